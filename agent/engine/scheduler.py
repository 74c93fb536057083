"""The model's scheduler: admission bounded overall and per tenant, tenants in turn, and
continuous batching of the jobs that run.

A request first takes a place (:meth:`ModelWorker.admit`): at most ``capacity`` places are held
(running jobs and those waiting), at most ``tenant_capacity`` by one tenant, so a tenant that
fills its share gets 429 while the others still get places. Jobs wait in one queue per tenant and
start in rotation over the tenants (with two tenants waiting, each gets every other start however
many jobs the first one queued), up to ``max_running`` at once. Jobs carry a cancel event,
checked before they start.

**Continuous batching.** Each running job is a thread that runs only while the scheduler hands
it the turn, so the model, the prompt cache and the store see one job at a time, as if there were
one thread. A job gives the turn back at its model steps (``agent/adapters/batched.py``): when it
wants the next token's logits (it joins the next batched decode step) and after each prefill pass
(a pause). One iteration of the scheduler:

1. start waiting jobs while fewer than ``max_running`` run (each runs to its first step: up to
   its first prefill pass, which then waits its turn in 3, or its first decode step);
2. run one decode step for every job that asked for one, as one batched forward pass (each job
   keeps its own cache), and let each job take its logits on to its next step (a step that
   raises is run again row by row from the caches as they were, so only the rows that fail on
   their own get the error);
3. let paused jobs run their next prefill passes, until the iteration has spent
   ``prefill_budget_s`` on them (at least one pass) or a job arrives that can start (it is
   started at once and takes its turn): first the job with the fewest prompt tokens left to
   prefill (``batched.prefill_left``; earlier starts first among equals), and the job that
   started first once ``AGING`` passes in a row went to others while it waited, so a long
   prompt keeps moving however many short ones arrive (and a short one that arrives while the
   long one runs alone is not made to wait for an extra pass of it).

A prefill pass takes at most ``pass_tokens`` prompt tokens while its job has the model to
itself, and while other jobs run or wait ``SHARED_PASS_TOKENS``, or ``DEEP_PASS_TOKENS`` (one
segment) where it starts ``DEEP_PASS_AT`` tokens into its prompt or later
(``batched.pass_tokens``, asked as each pass begins; whole segments, so the KV is that of one
pass, see ``agent/adapters/attention.py``): fewer passes read the weights fewer times, shorter
ones let others in sooner. A pass's time grows with the context before it (its attention), so a
pass deep in a long prompt is the longest wait a newcomer and the running streams can meet: one
segment 3,700 tokens in took 0.68 s on two cores with the embedded model, 256 tokens there
1.18 s, against 0.24 s and 0.50 s at the start (``docs/load.md``), and a short prompt still
runs in one pass. A long prompt therefore advances in bounded passes while the streams already
running get a token every iteration, and short prompts that arrive meanwhile finish their
prefill first, one after another rather than all together (their first tokens come as early as
the model allows). A job's tokens do not depend on what it was batched with (``batched.py``).

Not here: what a job does (``runtime.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any, NamedTuple, TypeVar

import torch

from agent.adapters import batched

T = TypeVar("T")

MAX_RUNNING = 32  # jobs that run (and decode together) at once; the rest wait their turn
PREFILL_BUDGET_S = 0.25  # prefill time an iteration may spend between two decode steps
AGING = 4  # after this many passes in a row to others, the job that started first gets one
PASS_TOKENS = 512  # prompt tokens a prefill pass may take: others wait at most one such pass
SHARED_PASS_TOKENS = 256  # and while other jobs run or wait, at most this
DEEP_PASS_AT = 512  # and for a pass that starts this many prompt tokens in or later,
DEEP_PASS_TOKENS = 128  # at most this (one segment of the prompt cache's default)


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


class _Runner(batched.Stepper):
    """One running job: its thread, and where it stands (``state``) when it gave the turn back:
    ``decode`` (waits for a batched step's logits), ``pause`` (between passes) or ``done``."""

    def __init__(
        self, job: _Job, back: threading.Event, order: int, pass_tokens: Callable[[int], int | None]
    ) -> None:
        self.job = job
        self._pass_tokens = pass_tokens
        self.order = order  # when it started: earlier first among equals
        self.left = 0  # prompt tokens still to prefill, as the job last said
        self.queued = False  # whether it has paused before its first prefill pass
        self.state = "new"
        self.result: Any = None
        self.error: BaseException | None = None
        self.request: tuple[Any, int, Any, int] | None = None  # adapter, token, cache, position
        self.logits: torch.Tensor | None = None
        self.step_error: BaseException | None = None
        self._go = threading.Event()
        self._back = back
        self.thread = threading.Thread(target=self._body, name="kamera-job", daemon=True)

    # --- the job's side (its own thread) ---------------------------------------------------

    def _body(self) -> None:
        self._go.wait()
        self._go.clear()
        batched.bind(self)
        try:
            self.result = self.job.fn()
        except BaseException as exc:  # handed to the request that asked
            self.error = exc
        finally:
            batched.bind(None)
            self.state = "done"
            self._back.set()

    def _yield(self, state: str) -> None:
        self.state = state
        self._back.set()
        self._go.wait()
        self._go.clear()

    def decode(self, adapter: Any, token: int, cache: Any, position: int) -> torch.Tensor:
        self.request, self.logits, self.step_error = (adapter, token, cache, position), None, None
        self._yield("decode")
        if self.step_error is not None:
            raise self.step_error
        assert self.logits is not None
        logits, self.logits, self.request = self.logits, None, None
        return logits

    def pause(self) -> None:
        self._yield("pause")

    def pass_tokens(self, before: int) -> int | None:
        return self._pass_tokens(before)

    def prefill_left(self, before: int, after: int) -> None:
        if not self.queued:  # a job's first pass waits its turn like any other
            self.queued = True
            self.left = max(0, int(before))
            self._yield("pause")
        self.left = max(0, int(after))

    # --- the scheduler's side --------------------------------------------------------------

    def resume(self) -> None:
        """Hand this job the turn; returns when it gives it back (a step, a pause, its end)."""
        self._back.clear()
        if self.state == "new":
            self.thread.start()
        self._go.set()
        self._back.wait()


class ModelWorker:
    """The model's scheduler: ``queue_size`` waiting jobs, ``tenant_capacity`` places a tenant,
    ``max_running`` jobs running (and decoding together) at once, prefill passes of at most
    ``pass_tokens`` prompt tokens."""

    def __init__(
        self,
        queue_size: int,
        tenant_capacity: int | None = None,
        max_running: int = MAX_RUNNING,
        prefill_budget_s: float = PREFILL_BUDGET_S,
        pass_tokens: int | None = PASS_TOKENS,
    ) -> None:
        if not 1 <= max_running <= batched.MAX_ROWS:
            raise ValueError(f"max_running must be in 1..{batched.MAX_ROWS}, got {max_running}")
        if not prefill_budget_s >= 0:
            raise ValueError(f"prefill_budget_s must be >= 0, got {prefill_budget_s}")
        if pass_tokens is not None and pass_tokens < 1:
            raise ValueError(f"pass_tokens must be >= 1 (or None: no bound), got {pass_tokens}")
        self.prefill_budget_s = prefill_budget_s
        self.pass_tokens = pass_tokens
        self.capacity = queue_size + 1  # a running job and those waiting
        self.tenant_capacity = min(self.capacity, tenant_capacity or self.capacity)
        self.max_running = max_running
        self._cond = threading.Condition()
        self._held: Counter[str] = Counter()
        self._waiting: dict[str, deque[_Job]] = {}  # insertion order is the rotation
        self._running: list[_Runner] = []  # touched by the scheduler thread only
        self._passes = 0  # prefill passes handed out
        self._skipped = 0  # passes in a row to other jobs while the one that started first waited
        self._order = itertools.count()
        self._back = threading.Event()
        self.pending = 0
        self.closed = False
        self.steps = 0  # batched decode steps run
        self.rows = 0  # sequences they decoded, all together
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
        """Run ``fn`` as a scheduled job (after an :meth:`admit`); skipped if cancelled first."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cond:
            if self.closed:
                raise DrainingError("the server is shutting down")
            self._waiting.setdefault(tenant, deque()).append(_Job(fn, cancel, loop, future))
            self._cond.notify()
        return await future

    def _next(self) -> _Job | None:
        """The next job to start (tenants in rotation); waits while nothing runs or waits."""
        with self._cond:
            while not self._waiting and not self._running and not self.closed:
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
        while True:
            while len(self._running) < self.max_running and (job := self._next()) is not None:
                self._start(job)
            if not self._running:
                with self._cond:
                    if self.closed and not self._waiting:
                        return
                continue
            self._decode_step()
            self._prefill_passes()
            self._reap()

    def _prefill_passes(self) -> None:
        """Paused jobs' next passes, nearly done prompts first, until the budget is spent."""
        t0 = time.perf_counter()
        while paused := [r for r in self._running if r.state == "pause"]:
            self._passes += 1
            oldest = min(paused, key=lambda r: r.order)
            aged = self._skipped >= AGING
            runner = oldest if aged else min(paused, key=lambda r: (r.left, r.order))
            self._skipped = 0 if runner is oldest else self._skipped + 1
            runner.resume()
            if time.perf_counter() - t0 >= self.prefill_budget_s:
                return
            if self._waiting and len(self._running) < self.max_running:
                return  # a job arrived: started now, it takes its turn among these

    def _start(self, job: _Job) -> None:
        error: BaseException | None = None
        if self.closed:
            error = DrainingError("the server is shutting down")
        elif job.cancel.is_set():
            error = CancelledJobError("the client went away before the job started")
        if error is not None:
            with suppress(RuntimeError):  # the event loop is gone: nobody waits
                job.loop.call_soon_threadsafe(_settle, job.future, None, error)
            return
        runner = _Runner(job, self._back, next(self._order), self._pass_bound)
        self._running.append(runner)
        runner.resume()  # to its first step
        self._reap()

    def _pass_bound(self, before: int) -> int | None:
        """Prompt tokens the next prefill pass may take, ``before`` tokens into its prompt:
        ``pass_tokens`` while its job has the model to itself; while other jobs run or wait,
        whose turns come between passes, ``SHARED_PASS_TOKENS``, or ``DEEP_PASS_TOKENS`` from
        ``DEEP_PASS_AT`` on (never more than ``pass_tokens``). Read by the job's thread while the
        scheduler waits on it."""
        if self.pass_tokens is None:
            return None
        running = len(self._running)  # finished jobs leave at the end of the iteration
        alone = sum(r.state != "done" for r in self._running) <= 1 and self.pending <= running
        if alone:
            return self.pass_tokens
        return min(DEEP_PASS_TOKENS if before >= DEEP_PASS_AT else SHARED_PASS_TOKENS, self.pass_tokens)

    def _decode_step(self) -> None:
        """One batched decode step for every job waiting on one, then each job on to its next."""
        waiting = [r for r in self._running if r.state == "decode"]
        if not waiting:
            return
        by_adapter: dict[int, list[_Runner]] = {}
        for r in waiting:
            assert r.request is not None
            by_adapter.setdefault(id(r.request[0]), []).append(r)
        for group in by_adapter.values():
            marks = [batched.lengths(r.request[2]) for r in group]  # type: ignore[index]
            try:
                self._step(group)
            except Exception as exc:
                if any(m is None for m in marks):  # caches that cannot be rewound: all fail
                    for r in group:
                        r.step_error = exc
                else:  # one row's failure is its own: back to where they were, then alone
                    for r, m in zip(group, marks, strict=True):
                        batched.rewind(r.request[2], m)  # type: ignore[index, arg-type]
                    for r in group:
                        try:
                            self._step([r])
                        except Exception as alone:  # raised in the job's own thread
                            r.step_error = alone
            self.steps += 1
            self.rows += len(group)
        for r in waiting:
            r.resume()

    @staticmethod
    def _step(group: list[_Runner]) -> None:
        """One batched decode step of ``group`` (one adapter); each runner gets its row's logits.
        A row's logits do not depend on the rows beside it (``batched.py``), so a row stepped
        alone after a failed batch gets what the batch would have given it."""
        adapter = group[0].request[0]  # type: ignore[index]
        with torch.inference_mode():
            logits = adapter.decode_rows(
                [r.request[1] for r in group],  # type: ignore[index]
                [r.request[2] for r in group],  # type: ignore[index]
                [r.request[3] for r in group],  # type: ignore[index]
            )
        for r, row in zip(group, logits, strict=True):
            r.logits = row

    def _reap(self) -> None:
        for r in [r for r in self._running if r.state == "done"]:
            self._running.remove(r)
            r.thread.join()
            with suppress(RuntimeError):  # the event loop is gone: nobody waits
                r.job.loop.call_soon_threadsafe(_settle, r.job.future, r.result, r.error)

    def shutdown(self) -> None:
        """Refuse new work; waiting jobs fail with DrainingError, running ones finish; returns
        once the scheduler is done."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._thread.join()
