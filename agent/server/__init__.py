"""The HTTP server: an OpenAI-compatible chat endpoint with a content-addressed prompt cache,
agent sessions over the context manager, health and Prometheus metrics.

Layout: ``runtime`` (model, store, worker thread, sessions, built once), ``app`` (the FastAPI
factory ``create_app(runtime)``), ``prompt_cache`` (plan, assemble, prefill misses, store),
``chat`` (chat template applied piecewise), ``generation`` (decoding, stop strings),
``media`` (request parts to images and frames under limits), ``sessions``, ``limits``,
``metrics``, ``schemas``, ``cli`` (``kamera serve``).
"""
