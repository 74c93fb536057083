"""Eviction policies: which entry a tier gives up first, chosen by name from a registry.

A policy only orders keys; it never touches tensors or budgets. The tier tells it about every
insert (`admit`), hit (`touch`) and removal (`forget`), and asks it for the next `victim` while it
is over budget, passing the keys that must stay (pinned entries).

Registered names: "lru" (least recently used, the default), "lfu" (least frequently used, ties
broken by recency), "largest" (biggest entry first, ties broken by recency). Add one with
`register_policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container

DEFAULT_POLICY = "lru"


class EvictionPolicy(ABC):
    """Orders the keys of one tier for eviction. Not thread-safe: the store holds its lock."""

    @abstractmethod
    def admit(self, key: str, nbytes: int) -> None:
        """`key` (`nbytes` bytes) was inserted; re-admitting a key resets its history."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """`key` was read. Unknown keys are ignored."""

    @abstractmethod
    def forget(self, key: str) -> None:
        """`key` left the tier. Unknown keys are ignored."""

    @abstractmethod
    def victim(self, keep: Container[str]) -> str | None:
        """The key to evict next, skipping those in `keep`; None when every key is kept."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest first

    def admit(self, key: str, nbytes: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def forget(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, keep: Container[str]) -> str | None:
        return next((key for key in self._order if key not in keep), None)


class _ScoredPolicy(EvictionPolicy):
    """Evicts the key with the smallest (score, last use); subclasses define the score."""

    def __init__(self) -> None:
        self._tick = 0
        self._uses: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._last: dict[str, int] = {}

    def _stamp(self, key: str) -> None:
        self._tick += 1
        self._last[key] = self._tick

    def admit(self, key: str, nbytes: int) -> None:
        self._uses[key] = 1
        self._sizes[key] = nbytes
        self._stamp(key)

    def touch(self, key: str) -> None:
        if key in self._uses:
            self._uses[key] += 1
            self._stamp(key)

    def forget(self, key: str) -> None:
        for table in (self._uses, self._sizes, self._last):
            table.pop(key, None)

    @abstractmethod
    def _score(self, key: str) -> int:
        """Lower is evicted first."""

    def victim(self, keep: Container[str]) -> str | None:
        candidates = [key for key in self._uses if key not in keep]
        if not candidates:
            return None
        return min(candidates, key=lambda k: (self._score(k), self._last[k]))


class LFUPolicy(_ScoredPolicy):
    """Fewest hits since insertion first; among equals, least recently used."""

    def _score(self, key: str) -> int:
        return self._uses[key]


class LargestFirstPolicy(_ScoredPolicy):
    """Biggest entry first (frees the budget with the fewest evictions); among equals, LRU."""

    def _score(self, key: str) -> int:
        return -self._sizes[key]


_REGISTRY: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "largest": LargestFirstPolicy,
}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make `factory` available as `name`; ValueError if the name is taken."""
    if name in _REGISTRY:
        raise ValueError(f"eviction policy {name!r} is already registered")
    _REGISTRY[name] = factory


def available_policies() -> tuple[str, ...]:
    """Registered policy names, sorted."""
    return tuple(sorted(_REGISTRY))


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy registered as `name`; ValueError naming the choices if there is none."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {available_policies()}") from None
    return factory()
