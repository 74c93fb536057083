"""The body-size gate that runs before anything else, and a route's tighter bound on its body.

The body's size is checked from Content-Length and again while the body streams in
(``BodyLimitMiddleware``, before any JSON parsing; a route may have a tighter :class:`BodyBound`
of its own). The limits on what a request may ask after that (messages, images, videos, prompt
tokens, queueing) are the engine's: ``agent/engine/limits.py``.

Not here: authentication (``auth.py``), queueing (``agent/engine/scheduler.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _error_body(message: str, code: str, param: str | None = None) -> bytes:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code, "param": param}}
    return json.dumps(body).encode()


@dataclass(frozen=True)
class BodyBound:
    """One route's tighter cap on its body, and the error its excess gets: ``status``, OpenAI
    ``code`` and ``param``, and ``why`` the cap is what it is (ends the message)."""

    max_bytes: int
    status: int
    code: str
    param: str | None
    why: str

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError("a body bound must be positive")


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413 before the app reads a byte of them, and bodies
    that take longer than ``timeout_s`` to arrive with 408 (and the connection closed).

    A declared Content-Length over the cap is refused at once; otherwise the body is read up to
    the cap (a chunked or lying client is cut off as soon as it passes it) and replayed to the app.
    The deadline is for the whole body, so a client trickling a byte a second is cut all the same.
    ``routes`` maps a path to a tighter :class:`BodyBound`, checked the same way (after the
    server's cap, which answers a body over both).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float = 60.0,
        routes: Mapping[str, BodyBound] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.routes = dict(routes or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        bound = self.routes.get(scope["path"])
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _reply(send, 400, "Content-Length is not a number", "bad_content_length")
                return
            if size > self.max_bytes:
                await _reply(
                    send, 413, f"request body of {size} bytes exceeds {self.max_bytes}", "body_too_large"
                )
                return
            if bound is not None and size > bound.max_bytes:
                await _over(send, bound, f"request body of {size} bytes exceeds {bound.max_bytes}")
                return
        chunks: list[bytes] = []
        total = 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await _reply(
                    send,
                    408,
                    f"request body not received within {self.timeout_s:g} s",
                    "body_timeout",
                    close=True,
                )
                return
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await _reply(send, 413, f"request body exceeds {self.max_bytes} bytes", "body_too_large")
                return
            if bound is not None and total > bound.max_bytes:
                await _over(send, bound, f"request body exceeds {bound.max_bytes} bytes")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _over(send: Send, bound: BodyBound, what: str) -> None:
    await _reply(send, bound.status, f"{what}: {bound.why}", bound.code, param=bound.param)


async def _reply(
    send: Send, status: int, message: str, code: str, close: bool = False, param: str | None = None
) -> None:
    body = _error_body(message, code, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
