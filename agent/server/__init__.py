"""The HTTP server: an OpenAI-compatible chat endpoint with a content-addressed prompt cache,
agent sessions over the context manager, health and Prometheus metrics.

Layout: ``runtime`` (model, store, sessions, built once), ``scheduler`` (the model thread:
admission per tenant, tenants in turn), ``app`` (the FastAPI factory ``create_app(runtime)``),
``prompt_cache`` (plan, assemble, prefill misses, store), ``chat`` (chat template applied
piecewise), ``generation`` (decoding, stop strings), ``media`` (request parts to images and
frames under limits), ``sessions``, ``limits``, ``token_bound`` (a prompt's least token count
from its length), ``schemas`` and ``strict`` (strict bodies, OpenAI error bodies), ``auth``,
``metrics``, ``serving`` (uvicorn with a header deadline and a draining SIGTERM), ``cli``
(``kamera serve``).
"""
