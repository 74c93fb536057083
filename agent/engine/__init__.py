"""The engine: a request's whole life, from arrival to its last token.

Prompt planning and reuse (``prompt.py``, ``reuse.py``, ``prompt_cache.py``), the answer path
with its guard (``answer.py``), decoding, sampling, grammars and stop strings
(``generation.py``), chat templates and tool calls (``chat.py``, ``tools.py``), media
(``media.py``), the limits a request is held to (``limits.py``), the scheduler that batches
decode steps and interleaves prefills (``scheduler.py``), live agent sessions
(``sessions.py``), and the runtime that owns one model, one store and all of these
(``runtime.py``).

Everything that answers requests calls this package: the HTTP server (``agent/server/``, which
adds routes, schemas, auth, the body gate and metrics), the agent loop, video QA, the web agent,
demos and benchmarks. Nothing here imports the HTTP server.
"""
