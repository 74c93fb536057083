"""The interface every tier of the store implements.

A tier holds entries up to a byte budget and counts its own traffic. It is not thread-safe and
knows nothing of the other tiers: moving entries between tiers (demotion, promotion) is the
store's job, which tells the tier why an entry arrives so the right counter moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterator
from typing import Literal

from .entry import Entry
from .stats import TierCounters, TierStats

Arrival = Literal["put", "promotion", "demotion"]


class Tier(ABC):
    """A byte-budgeted set of entries with counters.

    name: "device", "host", "disk" (or any label, unique within a store).
    budget_bytes: the most the tier holds; an entry bigger than it is refused.
    pinned: keys eviction must skip; the store points it at its live pin set.
    """

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"tier {name!r}: budget_bytes must be >= 0, got {budget_bytes}")
        self.name = name
        self.budget_bytes = budget_bytes
        self.counters = TierCounters()
        self.pinned: Container[str] = frozenset()

    @property
    @abstractmethod
    def bytes_in_use(self) -> int:
        """Bytes held now."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the tier holds `key` (counts nothing, changes no recency)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[str]:
        """The keys held now (a snapshot), in no particular order."""

    @abstractmethod
    def get(self, key: str) -> Entry | None:
        """The entry, counting a hit (and its bytes read), or None counting a miss."""

    @abstractmethod
    def insert(self, key: str, entry: Entry, arrived: Arrival) -> list[tuple[str, Entry]]:
        """Store `entry` under `key`, replacing any previous one, evicting others to make room.

        Returns the evicted (key, entry) pairs, oldest victim first, for the store to demote; a
        tier with nowhere below it returns [] and drops its victims for good.
        Raises EntryTooLargeError if the entry exceeds the budget, TierFullError if the room it
        needs is held by pinned entries; in both cases the tier is unchanged.
        """

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Take `key` out without counting an eviction; whether it was here."""

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` bytes is within the budget at all."""
        return nbytes <= self.budget_bytes

    def stats(self) -> TierStats:
        """A frozen snapshot of this tier's counters."""
        return TierStats.of(self.name, self.budget_bytes, self.bytes_in_use, len(self), self.counters)

    def _count_arrival(self, arrived: Arrival, nbytes: int) -> None:
        self.counters.bytes_written += nbytes
        if arrived == "promotion":
            self.counters.promotions += 1
        elif arrived == "demotion":
            self.counters.demotions += 1
