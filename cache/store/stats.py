"""Counters of the store, per tier, and the frozen snapshots they are read as.

Each tier owns one mutable `TierCounters`; readers get `TierStats` / `StoreStats` snapshots, which
never change after they are taken. An exporter (Prometheus or a log line) needs only
`StatsSource.stats()` and `StoreStats.rows()`. This module does not export anything itself.

Counter meanings, per tier:
    hits, misses      lookups answered / not answered by this tier
    bytes_in_use      bytes held now (tensor bytes in memory, file bytes on disk)
    bytes_written     bytes stored into this tier (puts, promotions and demotions in)
    bytes_read        bytes served from this tier on hits
    evictions         entries this tier pushed out to make room
    promotions        entries that arrived here from a slower tier on a hit
    demotions         entries that arrived here from a faster tier's eviction
    corrupt_dropped   entries found corrupt, truncated or missing, dropped and reported as misses
    misfiled          entries intact but certifying another key or other tokens than the lookup's
                      (a swapped record, a copy under the wrong key): dropped, reported as misses

Store-wide: writes_queued / writes_dropped count background disk writes accepted / refused
because the queue was full; write_queue is how many are not yet done (waiting or being written).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Protocol


@dataclass
class TierCounters:
    """The live, mutable counters of one tier; only its tier and the store write them."""

    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    corrupt_dropped: int = 0
    misfiled: int = 0


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier's counters and occupancy."""

    tier: str
    budget_bytes: int
    bytes_in_use: int
    entries: int
    hits: int
    misses: int
    bytes_written: int
    bytes_read: int
    evictions: int
    promotions: int
    demotions: int
    corrupt_dropped: int
    misfiled: int

    @classmethod
    def of(cls, tier: str, budget_bytes: int, bytes_in_use: int, entries: int, c: TierCounters) -> TierStats:
        return cls(
            tier=tier, budget_bytes=budget_bytes, bytes_in_use=bytes_in_use, entries=entries, **asdict(c)
        )


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the whole store: per-tier stats, fastest tier first, plus store-level totals.

    hits / misses count `get` calls answered by some tier / by none; puts counts accepted puts;
    refused counts puts rejected because the entry fits no tier.
    """

    tiers: tuple[TierStats, ...]
    hits: int
    misses: int
    puts: int
    refused: int
    writes_queued: int = 0
    writes_dropped: int = 0
    write_queue: int = 0

    def tier(self, name: str) -> TierStats:
        """The stats of the tier called `name`; KeyError if the store has no such tier."""
        for t in self.tiers:
            if t.tier == name:
                return t
        raise KeyError(name)

    def rows(self) -> Iterator[tuple[str, str, int]]:
        """(tier, counter, value) for every numeric counter; tier "store" holds the totals."""
        for name in ("hits", "misses", "puts", "refused", "writes_queued", "writes_dropped", "write_queue"):
            yield "store", name, getattr(self, name)
        for t in self.tiers:
            for f in fields(t):
                if f.name != "tier":
                    yield t.tier, f.name, getattr(t, f.name)


class StatsSource(Protocol):
    """Anything an exporter can poll for a snapshot."""

    def stats(self) -> StoreStats: ...
