"""The model thread: one job at a time, admission bounded overall and per tenant, tenants in turn.

A request first takes a place (:meth:`ModelWorker.admit`): at most ``capacity`` places are held
(the running job and those waiting), at most ``tenant_capacity`` by one tenant, so a tenant that
fills its share gets 429 while the others still get places. Jobs wait in one queue per tenant,
and the model thread takes the next job from the tenants in rotation: with two tenants waiting,
each gets every other turn however many jobs the first one queued. Jobs carry a cancel event,
checked before they start.

Not here: what a job does (``runtime.py``); a job is never preempted once it runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The model's queue (or the tenant's share of it) is full."""


class DrainingError(RuntimeError):
    """The server is shutting down and takes no new work."""


class CancelledJobError(RuntimeError):
    """The client went away before the job started."""


class _Job(NamedTuple):
    fn: Callable[[], Any]
    cancel: threading.Event
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting request was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ModelWorker:
    """One thread for the model; ``queue_size`` waiting jobs, ``tenant_capacity`` places a tenant."""

    def __init__(self, queue_size: int, tenant_capacity: int | None = None) -> None:
        self.capacity = queue_size + 1  # the running job and those waiting
        self.tenant_capacity = min(self.capacity, tenant_capacity or self.capacity)
        self._cond = threading.Condition()
        self._held: Counter[str] = Counter()
        self._waiting: dict[str, deque[_Job]] = {}  # insertion order is the rotation
        self.pending = 0
        self.closed = False
        self._thread = threading.Thread(target=self._serve, name="kamera-model", daemon=True)
        self._thread.start()

    def admit(self, tenant: str = "") -> None:
        """Take a place in the queue; QueueFullError when there is none. Pair with :meth:`leave`."""
        with self._cond:
            if self.closed:
                raise DrainingError("the server is shutting down")
            if self.pending >= self.capacity:
                raise QueueFullError(f"the model queue is full ({self.capacity - 1} waiting); retry shortly")
            if self._held[tenant] >= self.tenant_capacity:
                raise QueueFullError(
                    f"this tenant holds its share of {self.tenant_capacity} model queue places; retry shortly"
                )
            self.pending += 1
            self._held[tenant] += 1

    def leave(self, tenant: str = "") -> None:
        with self._cond:
            self.pending -= 1
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]

    def held(self, tenant: str = "") -> int:
        with self._cond:
            return self._held[tenant]

    async def run(self, fn: Callable[[], T], cancel: threading.Event, tenant: str = "") -> T:
        """Run ``fn`` on the model thread (after an :meth:`admit`); skipped if cancelled first."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cond:
            if self.closed:
                raise DrainingError("the server is shutting down")
            self._waiting.setdefault(tenant, deque()).append(_Job(fn, cancel, loop, future))
            self._cond.notify()
        return await future

    def _next(self) -> _Job | None:
        with self._cond:
            while not self._waiting and not self.closed:
                self._cond.wait()
            if not self._waiting:
                return None
            tenant = next(iter(self._waiting))
            queue = self._waiting.pop(tenant)
            job = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # to the back of the rotation
            return job

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            result: Any = None
            error: BaseException | None = None
            if self.closed:
                error = DrainingError("the server is shutting down")
            elif job.cancel.is_set():
                error = CancelledJobError("the client went away before the job started")
            else:
                try:
                    result = job.fn()
                except BaseException as exc:  # handed to the request that asked
                    error = exc
            with suppress(RuntimeError):  # the event loop is gone: nobody waits
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)

    def shutdown(self) -> None:
        """Refuse new work; waiting jobs fail with DrainingError; returns once the thread is done."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._thread.join()
