"""Live agent sessions: bounded in number (overall and per tenant), expired when idle, each owned
by one tenant; a tenant at its quota gets 429 while the others can still open sessions.

A session wraps one :class:`agent.loop.Agent` (its window on the shared store). Its lock is
held while a step runs or its window is read, so a view never sees a half-done step. A session
with a step in flight is never expired.

Not here: running steps (``runtime.py``) or HTTP (``app.py``).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.loop import Agent


class SessionLimitError(RuntimeError):
    """Every session slot (or the tenant's share of them) is taken."""


class SessionNotFoundError(KeyError):
    """No such session for this tenant (never created, deleted, or expired)."""


@dataclass(eq=False)
class Session:
    id: str
    tenant: str
    agent: Agent
    budget_tokens: int
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    busy: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionManager:
    """Sessions by id, at most ``per_tenant`` a tenant. Thread-safe; ``clock`` is injectable for tests."""

    def __init__(
        self,
        max_sessions: int,
        idle_s: float,
        per_tenant: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions, self.idle_s, self.clock = max_sessions, idle_s, clock
        self.per_tenant = min(max_sessions, per_tenant or max_sessions)
        self._sessions: dict[str, Session] = {}
        self._reserved: Counter[str] = Counter()
        self._held: Counter[str] = Counter()  # per tenant, live and reserved
        self._lock = threading.Lock()
        self.expired_total = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def reserve(self, tenant: str = "") -> None:
        """Hold a slot for a session being built; SessionLimitError when none is free."""
        self.sweep()
        retry = f"delete one or retry after idle ones expire ({self.idle_s:g} s)"
        with self._lock:
            if len(self._sessions) + self._reserved.total() >= self.max_sessions:
                raise SessionLimitError(
                    f"the server holds its maximum of {self.max_sessions} sessions; {retry}"
                )
            if self._held[tenant] >= self.per_tenant:
                raise SessionLimitError(f"this tenant holds its share of {self.per_tenant} sessions; {retry}")
            self._reserved[tenant] += 1
            self._held[tenant] += 1

    def release(self, tenant: str = "") -> None:
        with self._lock:
            self._reserved[tenant] -= 1
            self._drop(tenant)

    def _drop(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]

    def add(self, tenant: str, agent: Agent, budget_tokens: int) -> Session:
        """Insert a session built on a slot the tenant reserved (the reservation is consumed)."""
        session = Session(secrets.token_urlsafe(16), tenant, agent, budget_tokens, last_used=self.clock())
        with self._lock:
            self._reserved[tenant] -= 1
            self._sessions[session.id] = session
        return session

    def acquire(self, session_id: str, tenant: str) -> Session:
        """The session, marked busy (never expired) until :meth:`done`."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.tenant != tenant:
                raise SessionNotFoundError(session_id)
            session.busy += 1
            session.last_used = self.clock()
            return session

    def done(self, session: Session) -> None:
        with self._lock:
            session.busy -= 1
            session.last_used = self.clock()

    def delete(self, session_id: str, tenant: str) -> None:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.tenant != tenant:
                raise SessionNotFoundError(session_id)
            del self._sessions[session_id]
            self._drop(tenant)

    def sweep(self) -> int:
        """Drop sessions idle longer than ``idle_s``; how many went."""
        now = self.clock()
        with self._lock:
            gone = [
                sid for sid, s in self._sessions.items() if not s.busy and now - s.last_used > self.idle_s
            ]
            for sid in gone:
                self._drop(self._sessions.pop(sid).tenant)
            self.expired_total += len(gone)
        return len(gone)

    def clear(self) -> None:
        with self._lock:
            for session in self._sessions.values():
                self._drop(session.tenant)
            self._sessions.clear()
