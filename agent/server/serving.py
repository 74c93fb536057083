"""``kamera serve``'s uvicorn: a deadline on request headers, and SIGTERM that drains before it stops.

uvicorn has no header read timeout: a connection that sends half a request line stays open.
``header_deadline_protocol(s)`` is uvicorn's h11 protocol with a timer armed when a connection
opens and again after each response, and disarmed when a request's headers are complete; when it
fires first, the connection is closed. (Body deadlines are ``limits.BodyLimitMiddleware``'s.)

uvicorn's own SIGTERM stops listening at once, so new clients get connection refused.
``DrainingServer`` instead, on the first SIGTERM: marks the runtime draining (new requests get 503
with ``Retry-After``, ``/health`` turns 503) while still accepting connections, waits until the
admitted jobs are done or ``drain_s`` has passed, and only then lets uvicorn close the listener
and finish. A second SIGTERM, or SIGINT, stops at once as uvicorn does.

Not here: the app (``app.py``), the drain's bookkeeping (``Runtime.drain``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agent.engine.runtime import Runtime


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request headers take over ``timeout_s``."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return HeaderDeadlineProtocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM drains ``runtime`` (503s) before the listener closes."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_deadline is None:
            self.runtime.draining = True
            self.drain_deadline = time.monotonic() + self.runtime.limits.drain_s
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and (
            self.runtime.worker.pending == 0 or time.monotonic() >= self.drain_deadline
        ):
            self.should_exit = True
        return await super().on_tick(counter)


def serve(app: Any, runtime: Runtime, host: str, port: int) -> None:
    """Serve ``app`` in the foreground until SIGTERM (drained) or SIGINT."""
    limits = runtime.limits
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=header_deadline_protocol(limits.header_timeout_s),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(limits.drain_s)),
    )
    DrainingServer(config, runtime).run()
