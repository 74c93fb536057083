"""The HTTP app: ``create_app(runtime)`` builds a FastAPI app around a runtime it is given.

Routes: ``POST /v1/chat/completions`` (OpenAI-compatible, SSE streaming), ``GET /v1/models``,
``POST/GET/DELETE /v1/sessions[/{id}]`` and ``POST /v1/sessions/{id}/steps`` (agent sessions),
``GET /health``, ``GET /metrics``. Every error is a JSON ``{"error": {...}}`` with a 4xx for
anything the client can fix; model work runs on the runtime's single model thread, media
decoding on the thread pool, the event loop only waits.

Requests pass, outermost first: the access log and counters, the API key check, the body gate
(size and deadline, before any parsing), then the route. The app is the factory and that wiring;
the routes live in ``routes/`` and share one :class:`~agent.server.state.ServerState`.

Not here: the routes (``routes/``), the error table (``errors.py``), the model, the cache or the
limits themselves (``runtime.py``, ``prompt_cache.py``, ``limits.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.engine.runtime import Runtime
from agent.server import errors
from agent.server.auth import OPEN_PATHS, AuthMiddleware
from agent.server.limits import BodyBound, BodyLimitMiddleware
from agent.server.metrics import Metrics
from agent.server.routes import chat, ops, sessions
from agent.server.state import ServerState

log = logging.getLogger("kamera.server")


class AccessMiddleware:
    """Counts and logs every request (route template, status, duration) with a request id."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 500
        request_id = uuid.uuid4().hex[:16]

        async def send_wrapped(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapped)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, scope["method"], str(status)).inc()
            log.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": path,
                    "status": status,
                    "duration_ms": round(1000 * (time.perf_counter() - t0), 2),
                },
            )


def create_app(runtime: Runtime) -> FastAPI:
    limits = runtime.limits
    state = ServerState(runtime, Metrics(runtime))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            runtime.worker.admit()
            try:
                await runtime.worker.run(runtime.warmup, threading.Event())
            finally:
                runtime.worker.leave()
        except Exception:
            log.exception("warm-up failed; /health reports 503")
        sweeper = asyncio.create_task(_sweep(runtime))
        log.info("ready", extra={"model": runtime.config.name})
        try:
            yield
        finally:
            sweeper.cancel()
            finished = await asyncio.to_thread(runtime.drain, limits.drain_s)
            log.info("stopped", extra={"drained": finished})

    app = FastAPI(title="Kamera", version="0.1.0", lifespan=lifespan)
    app.state.runtime = runtime
    app.state.metrics = state.metrics
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=limits.max_body_bytes,
        timeout_s=limits.body_timeout_s,
        routes=body_bounds(runtime),
    )
    app.add_middleware(
        AuthMiddleware,
        tenants=runtime.tenants,
        open_paths=OPEN_PATHS | ({"/metrics"} if runtime.config.public_metrics else set()),
        on_reject=state.metrics.rejected.labels("unauthorized").inc,
    )
    app.add_middleware(AccessMiddleware, metrics=state.metrics)
    errors.install(app)
    for module in (chat, sessions, ops):
        app.include_router(module.router(state))
    return app


def body_bounds(runtime: Runtime) -> dict[str, BodyBound]:
    """The chat route's cap for a model that takes no images (``Runtime.chat_body_bytes``): a
    body past it cannot hold a prompt the server would serve, so it is refused unread, with the
    400 a prompt over ``max_prompt_tokens`` gets."""
    most = runtime.chat_body_bytes()
    if most is None or most >= runtime.limits.max_body_bytes:
        return {}
    why = (
        f"no prompt of max_prompt_tokens={runtime.limits.max_prompt_tokens} tokens takes that much JSON "
        f"(model {runtime.config.name} takes no images)"
    )
    return {chat.PATH: BodyBound(most, 400, "context_length_exceeded", "messages", why)}


async def _sweep(runtime: Runtime) -> None:
    """Expire idle sessions, every half idle period (at most every 30 s)."""
    while True:
        await asyncio.sleep(min(30.0, runtime.limits.session_idle_s / 2))
        runtime.sessions.sweep()
