"""What the route modules share: the runtime, its limits, the app's metrics, and the three ways a
request waits for the model (admission, a job on the model thread, the client's disconnect).

``create_app`` builds one :class:`ServerState` and hands it to each route module's ``router``;
nothing here is global, so two apps in one process (the tests build several) share nothing.

Not here: the routes (``routes/``), the error table (``errors.py``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.routing import APIRoute

from agent.adapters.loading import WORLD_VL
from agent.engine.limits import ServerLimits
from agent.engine.runtime import Runtime
from agent.engine.scheduler import DrainingError, QueueFullError
from agent.server.errors import ApiError, api_error
from agent.server.metrics import Metrics
from agent.server.strict import strict_route

T = TypeVar("T")


def tenant_of(request: Request) -> str:
    """The tenant AuthMiddleware found for the request's key (a route dependency)."""
    tenant: str = request.state.tenant
    return tenant


@dataclass(frozen=True)
class ServerState:
    runtime: Runtime
    metrics: Metrics

    @property
    def limits(self) -> ServerLimits:
        return self.runtime.limits

    @property
    def route_class(self) -> type[APIRoute]:
        """Routes that parse bodies strictly (unknown fields refused unless the server is lenient)."""
        return strict_route(self.runtime.config.lenient_fields)

    def refuse(self, exc: BaseException) -> ApiError:
        """The ApiError of ``exc`` (counted when it is a 429 or 503); ``exc`` itself when it is a
        server fault."""
        err = api_error(exc)
        if err is None:
            raise exc
        if err.status in (429, 503):
            self.metrics.rejected.labels(err.code).inc()
        return err

    def admit(self, tenant: str) -> None:
        """A place in the model queue for ``tenant``, or the 429/503 of there being none."""
        if self.runtime.draining:
            raise self.refuse(DrainingError("the server is shutting down"))
        try:
            self.runtime.worker.admit(tenant)
        except (QueueFullError, DrainingError) as exc:
            raise self.refuse(exc) from None

    async def admitted(self, tenant: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` holding a place in the model queue (429 when there is none for the tenant)."""
        self.admit(tenant)
        try:
            return await work()
        finally:
            self.runtime.worker.leave(tenant)

    async def watched(self, request: Request, fn: Callable[[], T], cancel: threading.Event) -> T:
        """Run ``fn`` on the model thread; a client that disconnects sets ``cancel``."""
        task = asyncio.ensure_future(self.runtime.worker.run(fn, cancel, request.state.tenant))
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and not cancel.is_set() and await request.is_disconnected():
                self.cancelled(cancel)
        try:
            return task.result()
        except Exception as exc:
            raise self.refuse(exc) from None

    def cancelled(self, cancel: threading.Event) -> None:
        """The client went away: stop its job and count it."""
        cancel.set()
        self.metrics.cancelled.inc()

    def no_images(self, param: str) -> ApiError:
        """The 400 of media sent to a model that takes none, naming the model that does."""
        message = (
            f"model {self.runtime.config.name} takes no image or video input; to send images, serve "
            f"a Qwen2.5-VL model: kamera serve --model {WORLD_VL} (the embedded one) or --model "
            "<a Qwen2.5-VL checkpoint folder>"
        )
        return ApiError(400, message, "images_unsupported", param=param)
