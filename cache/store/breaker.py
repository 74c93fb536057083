"""A circuit breaker for a tier that may be down: after a few failures in a row, stop asking.

    closed     calls go through; `failures_to_open` consecutive failures open it
    open       calls are refused (`allow()` is False) until `retry_after_s` have passed
    half-open  after that, one call goes through as a trial: success closes, failure reopens

The clock is injectable for tests. Thread-safe: the request thread and a background writer share
one breaker. This module does not time calls out or retry them; the caller does the call and
reports how it went.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half-open"]


class CircuitBreaker:
    """Consecutive-failure breaker. Raises ValueError on a non-positive threshold or delay."""

    def __init__(
        self,
        failures_to_open: int = 3,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures_to_open < 1 or retry_after_s <= 0:
            raise ValueError("failures_to_open must be >= 1 and retry_after_s > 0")
        self.failures_to_open = failures_to_open
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._trial = False
        self.opened_total = 0  # times it went from closed (or half-open) to open
        self.last_error: str | None = None

    @property
    def state(self) -> State:
        with self._lock:
            return self._state()

    def _state(self) -> State:
        if self._opened_at is None:
            return "closed"
        if self._trial or self._clock() - self._opened_at >= self.retry_after_s:
            return "half-open"
        return "open"

    def allow(self) -> bool:
        """Whether a call may go out now; in half-open, only the first caller gets the trial."""
        with self._lock:
            state = self._state()
            if state == "closed":
                return True
            if state == "half-open" and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._trial = False
            self.last_error = None

    def failure(self, error: str) -> None:
        with self._lock:
            self.last_error = error
            self._failures += 1
            if self._trial or (self._opened_at is None and self._failures >= self.failures_to_open):
                self._opened_at = self._clock()
                self._trial = False
                self.opened_total += 1
