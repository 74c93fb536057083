"""The HTTP server: an OpenAI-compatible chat endpoint and agent sessions over HTTP, health and
Prometheus metrics, around an engine runtime (``agent/engine/``) it is given.

Layout: ``app`` (the FastAPI factory ``create_app(runtime)`` and its middleware), ``state``
(what the routes share: runtime, metrics, admission), ``routes/`` (``chat`` and ``stream`` with
``completion``, ``sessions``, ``ops``), ``errors`` (exceptions to HTTP answers, one table),
``content`` (content parts, decoded the same way for chat and sessions), ``structured`` (tools,
grammars and logprobs between the request schemas and the engine), ``limits`` (the body gate),
``schemas`` and ``strict`` (strict bodies, OpenAI error bodies), ``auth``, ``metrics``,
``serving`` (uvicorn with a header deadline and a draining SIGTERM), ``background`` (an app on a
thread, for tests), ``logs``, ``cli`` (``kamera serve``).

Not here: anything that answers a request (``agent/engine/``).
"""
