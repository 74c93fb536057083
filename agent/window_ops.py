"""Window operations as values: ``Slide(n) | Reorder(order) | Recall(chunk_id, at)``, and ``apply``.

A request (an HTTP session step, a demo's script) says what to do to a window as a list of these;
``apply(window, op)`` performs one on anything with the context manager's ``slide`` /
``reorder`` / ``recall`` methods. Each operation is validated when it is built, so a value that
exists is one the window can be asked to do (whether it succeeds, e.g. recalling an id that was
never evicted, is the window's answer).

Not here: what the operations do to KV (``agent/context.py``, docs/DESIGN.md section 5.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Window(Protocol):
    """The operations of :class:`agent.context.ContextManager` this module drives."""

    def slide(self, n_chunks: int = 1) -> Any: ...
    def reorder(self, order: Sequence[str]) -> Any: ...
    def recall(self, chunk_id: str, at: int | None = None) -> Any: ...


@dataclass(frozen=True)
class Slide:
    """Evict the ``n`` oldest chunks after the pinned prefix (0 does nothing)."""

    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise ValueError(f"slide takes a count of chunks >= 0, got {self.n!r}")


@dataclass(frozen=True)
class Reorder:
    """Put the window's chunks (pinned prefix excluded) in ``order``, given by chunk id."""

    order: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", tuple(self.order))
        if not all(isinstance(c, str) for c in self.order):
            raise ValueError("reorder takes chunk ids (strings)")


@dataclass(frozen=True)
class Recall:
    """Bring evicted chunk ``chunk_id`` back at window index ``at`` (None: at the end)."""

    chunk_id: str
    at: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_id, str) or not self.chunk_id:
            raise ValueError("recall takes a non-empty chunk id")
        if self.at is not None and (isinstance(self.at, bool) or not isinstance(self.at, int) or self.at < 1):
            raise ValueError(f"recall's index is at least 1 (the pinned prefix is 0), got {self.at!r}")


WindowOp = Slide | Reorder | Recall


def apply(window: Window, op: WindowOp) -> None:
    """Perform ``op`` on ``window``; TypeError for anything that is not a window operation."""
    match op:
        case Slide(n):
            window.slide(n)
        case Reorder(order):
            window.reorder(list(order))
        case Recall(chunk_id, at):
            window.recall(chunk_id, at)
        case _:
            raise TypeError(f"not a window operation: {op!r}")
