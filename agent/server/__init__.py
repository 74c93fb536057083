"""The HTTP server: an OpenAI-compatible chat endpoint with a content-addressed prompt cache,
agent sessions over the context manager, health and Prometheus metrics.

Layout: ``runtime`` (model, store, sessions, built once), ``scheduler`` (the model thread:
admission per tenant, tenants in turn), ``app`` (the FastAPI factory ``create_app(runtime)``
and its middleware), ``state`` (what the routes share: runtime, metrics, admission),
``routes/`` (``chat`` and ``stream`` with ``completion``, ``sessions``, ``ops``), ``errors``
(exceptions to HTTP answers, one table), ``content`` (content parts, decoded the same way for
chat and sessions), ``prompt_cache`` (plan, assemble, prefill misses, store), ``chat`` (chat
template applied piecewise), ``generation`` (decoding, stop strings), ``media`` (request parts
to images and frames under limits), ``sessions``, ``limits`` (and the body gate),
``token_bound`` (a prompt's least token count from its length), ``schemas`` and ``strict``
(strict bodies, OpenAI error bodies), ``auth``, ``metrics``, ``serving`` (uvicorn with a header
deadline and a draining SIGTERM), ``cli`` (``kamera serve``).
"""
