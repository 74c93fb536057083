"""The tiered store: device -> host -> disk (-> Redis), with demotion on eviction and promotion on hit.

Memory tiers (device, host) are exclusive: a key lives in at most one of them. The disk tier is
inclusive: a disk hit is copied up and the file stays, and with `write_through` every put also
lands on disk, which is how processes sharing the directory see each other's entries.

    put:  the entry goes to the fastest tier whose budget can hold it; what that tier evicts is
          demoted to the next tier, and so on; disk evictions are final.
    get:  tiers are asked fastest first; a hit below the top is promoted to the fastest tier that
          can take it (moved from host, copied from disk).
    pin:  a pinned key is never evicted nor demoted, in any tier, until unpinned.

    shared: an optional Redis tier (``redis_tier``) below the local ones, for many replicas. It is
          read only by `prefetch`, one round trip for all the keys a request needs, whose hits
          land in the local tiers as promotions (`get` never waits on the network); every
          accepted put is queued for it in the background.

One re-entrant lock serialises every local call, disk I/O included; the network round trip of
`prefetch` runs outside it. This module does not hash content or verify token ids on a hit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from .disk import DiskTier
from .entry import Entry, EntryTooLargeError, TierFullError, validate_key
from .memory import MemoryTier
from .policies import DEFAULT_POLICY, available_policies
from .redis_tier import RedisConfig, RedisHealth, RedisTier
from .stats import StoreStats
from .tier import Arrival, Tier


@dataclass(frozen=True)
class StoreConfig:
    """Budgets and choices of a store built by `TieredStore.from_config`.

    device: torch device of the device tier; None picks "cuda" when available. Without CUDA (or
        with a CPU device) there is no device tier and `device_bytes` is ignored: the tensors in
        use are host memory, already counted by `host_bytes`.
    disk_path: folder of the disk tier (shared by every process pointing at it); None: no disk tier.
    policy: eviction policy name for every tier, see `available_policies()`.
    write_through: also write every put to disk (needed for other processes to see it).
    durable: fsync every disk write.
    redis: the shared tier below the local ones (see `RedisConfig`); None: no shared tier.
    """

    host_bytes: int
    device_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | Path | None = None
    device: str | None = None
    policy: str = DEFAULT_POLICY
    write_through: bool = False
    durable: bool = True
    redis: RedisConfig | None = None

    def __post_init__(self) -> None:
        for name in ("host_bytes", "device_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.policy not in available_policies():
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose from {available_policies()}")
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError("disk_path and a positive disk_bytes go together")
        if self.write_through and self.disk_path is None:
            raise ValueError("write_through needs a disk tier")


class PutResult(NamedTuple):
    """Where a put landed: the fastest tier now holding the entry, and its tensor bytes."""

    tier: str
    nbytes: int


class TieredStore:
    """Content-addressed entries over memory tiers (fastest first) and an optional disk tier.

    Raises ValueError if tier names repeat or there is no tier at all.
    """

    def __init__(
        self,
        memory: Sequence[MemoryTier],
        disk: DiskTier | None = None,
        *,
        write_through: bool = False,
        shared: RedisTier | None = None,
    ) -> None:
        self._memory = tuple(memory)
        self._disk = disk
        self.shared = shared
        names = [t.name for t in self.tiers]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a store needs at least one tier, uniquely named; got {names}")
        if write_through and disk is None:
            raise ValueError("write_through needs a disk tier")
        self._write_through = write_through
        self._pins: dict[str, int] = {}
        for tier in self.tiers:
            tier.pinned = self._pins
        self._lock = threading.RLock()
        self._hits = self._misses = self._puts = self._refused = 0

    @classmethod
    def from_config(cls, config: StoreConfig) -> TieredStore:
        """Build the tiers `config` describes (see `StoreConfig` for the device rule)."""
        device = config.device or ("cuda" if torch.cuda.is_available() else None)
        memory = []
        if device is not None and torch.device(device).type != "cpu" and config.device_bytes > 0:
            memory.append(MemoryTier("device", device, config.device_bytes, config.policy))
        if config.host_bytes > 0:
            memory.append(MemoryTier("host", "cpu", config.host_bytes, config.policy))
        disk = None
        if config.disk_path is not None:
            disk = DiskTier(config.disk_path, config.disk_bytes, config.policy, durable=config.durable)
        shared = RedisTier.from_config(config.redis) if config.redis is not None else None
        return cls(memory, disk, write_through=config.write_through, shared=shared)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Every tier, fastest first."""
        return (*self._memory, *([self._disk] if self._disk is not None else []))

    def put(self, key: str, entry: Entry) -> PutResult:
        """Store a copy of `entry` under `key`, replacing any previous entry of that key.

        Raises EntryTooLargeError when no tier's budget can hold it, TierFullError when every
        tier that could is held by pinned entries; the store is unchanged in both cases.
        """
        validate_key(key)
        with self._lock:
            nbytes = entry.nbytes
            if not any(t.fits(nbytes) for t in self.tiers):
                self._refused += 1
                raise EntryTooLargeError(key, nbytes, {t.name: t.budget_bytes for t in self.tiers})
            target = next((t for t in self._memory if t.fits(nbytes) and t.can_admit(key, nbytes)), None)
            if target is None and self._disk is None:
                raise TierFullError(f"entry {key!r}: every memory tier that fits it is pinned full")
            owned = entry.to(target.device if target is not None else torch.device("cpu"), copy=True)
            landed = None
            if self._disk is not None and (self._write_through or target is None):
                try:
                    self._disk.insert(key, owned, "put")
                except EntryTooLargeError:  # the file header tipped it over the disk budget
                    self._refused += 1
                    raise
                landed = self._disk.name
            for tier in self._memory:
                tier.remove(key)
            landed = self._place(0, len(self._memory), key, owned, "put") or landed
            self._puts += 1
            if self.shared is not None:
                self.shared.submit(key, owned)  # store tensors are read-only: the writer may encode later
            return PutResult(str(landed), nbytes)

    def prefetch(self, keys: Sequence[str]) -> frozenset[str]:
        """Bring `keys` that no local tier holds in from the shared tier, in one round trip.

        Hits are placed in the fastest memory tier that admits them, as promotions (one that none
        admits is dropped); returns the keys placed. Without one, or when it is unreachable,
        returns an empty set: the caller prefills what is missing.
        """
        if self.shared is None:
            return frozenset()
        with self._lock:
            wanted = [k for k in dict.fromkeys(keys) if not any(k in t for t in self.tiers)]
        found = self.shared.fetch_many(wanted)  # outside the lock: the network may be slow
        placed = []
        with self._lock:
            for key, entry in found.items():
                if any(key in t for t in self.tiers):  # put meanwhile: keep the local one
                    continue
                if self._place(0, len(self._memory), key, entry, "promotion") is not None:
                    placed.append(key)
        return frozenset(placed)

    def shared_health(self) -> RedisHealth | None:
        """The shared tier's state (breaker, queue, last error); None without one."""
        return self.shared.health() if self.shared is not None else None

    def close(self) -> None:
        """Write what is queued for the shared tier and stop its writer (local tiers need nothing)."""
        if self.shared is not None:
            self.shared.close()

    def get(self, key: str) -> Entry | None:
        """The entry under `key`, promoted to the fastest tier that takes it; None on a miss.

        Returned tensors share storage with the store: treat them as read-only.
        """
        with self._lock:
            return self._get(key)

    def pin(self, key: str) -> Entry | None:
        """`get`, and keep the entry from eviction until as many `unpin` calls; None on a miss."""
        with self._lock:
            entry = self._get(key)
            if entry is not None:
                self._pins[key] = self._pins.get(key, 0) + 1
            return entry

    def unpin(self, key: str) -> None:
        """Undo one `pin`; KeyError if `key` is not pinned."""
        with self._lock:
            count = self._pins.get(key, 0)
            if count == 0:
                raise KeyError(f"{key!r} is not pinned")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    @contextlib.contextmanager
    def pinned(self, key: str) -> Iterator[Entry | None]:
        """Pin `key` for the block; yields the entry, or None on a miss (then nothing is pinned)."""
        entry = self.pin(key)
        try:
            yield entry
        finally:
            if entry is not None:
                self.unpin(key)

    def delete(self, key: str) -> bool:
        """Remove `key` from every tier; whether any held it. ValueError if it is pinned."""
        with self._lock:
            if key in self._pins:
                raise ValueError(f"{key!r} is pinned; unpin it before deleting")
            removed = [tier.remove(key) for tier in self.tiers]  # every tier, no short cut
            return any(removed)

    def __contains__(self, key: object) -> bool:
        """Whether some tier holds `key`, counting nothing (the disk as this process last read it)."""
        with self._lock:
            return any(key in tier for tier in self.tiers)

    def keys(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with `prefix` held by any tier (e.g. a chunk's sub-records)."""
        with self._lock:
            return sorted({k for tier in self.tiers for k in tier if k.startswith(prefix)})

    def flush(self) -> int:
        """Write every memory entry missing from disk to disk; how many were written."""
        with self._lock:
            if self._disk is None:
                return 0
            written = 0
            for tier in self._memory:
                for key in tier:
                    entry = tier.peek(key)
                    if entry is not None and key not in self._disk:
                        self._disk.insert(key, entry, "put")
                        written += 1
            return written

    def stats(self) -> StoreStats:
        """A frozen snapshot of every counter."""
        with self._lock:
            tiers = tuple(t.stats() for t in self.tiers)
            if self.shared is not None:
                tiers = (*tiers, self.shared.stats())
            return StoreStats(tiers, self._hits, self._misses, self._puts, self._refused)

    def _get(self, key: str) -> Entry | None:
        for i, tier in enumerate(self._memory):
            entry = tier.get(key)
            if entry is not None:
                self._hits += 1
                return self._promote(i, key, entry)
        if self._disk is not None:
            entry = self._disk.get(key)
            if entry is not None:
                self._hits += 1
                landed = self._place(0, len(self._memory), key, entry, "promotion")
                held = self._memory_tier(landed).peek(key) if landed is not None else None
                return held if held is not None else entry
        self._misses += 1
        return None

    def _promote(self, index: int, key: str, entry: Entry) -> Entry:
        """Move a hit in memory tier `index` up to the fastest tier that admits it."""
        nbytes = entry.nbytes
        if not any(t.fits(nbytes) and t.can_admit(key, nbytes) for t in self._memory[:index]):
            return entry
        self._memory[index].remove(key)
        landed = self._place(0, index, key, entry, "promotion")
        held = self._memory_tier(landed).peek(key) if landed is not None else None
        if held is None:
            raise RuntimeError(f"promotion of {key!r} lost the entry")
        return held

    def _place(self, start: int, stop: int, key: str, entry: Entry, arrived: Arrival) -> str | None:
        """Insert into the first memory tier in [start, stop) that admits it, demoting its victims."""
        nbytes = entry.nbytes
        for i in range(start, stop):
            tier = self._memory[i]
            if tier.fits(nbytes) and tier.can_admit(key, nbytes):
                for victim_key, victim in tier.insert(key, entry, arrived):
                    self._demote(i + 1, victim_key, victim)
                return tier.name
        return None

    def _demote(self, start: int, key: str, entry: Entry) -> None:
        """Push an evicted entry to the next tier down that takes it; past the disk it is gone."""
        if self._place(start, len(self._memory), key, entry, "demotion") is not None:
            return
        if self._disk is not None and key not in self._disk:
            with contextlib.suppress(EntryTooLargeError, TierFullError):
                self._disk.insert(key, entry, "demotion")

    def _memory_tier(self, name: str) -> MemoryTier:
        return next(t for t in self._memory if t.name == name)
