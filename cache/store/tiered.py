"""The tiered store: device -> host -> disk (-> Redis), with demotion on eviction and promotion on hit.

Memory tiers (device, host) are exclusive: a key lives in at most one of them. The disk tier is
inclusive: a disk hit is copied up and the file stays, and with `write_through` every put also
lands on disk, which is how processes sharing the directory see each other's entries and how a
restarted process finds them. With a `write_queue`, those disk writes (and demotions to disk) go
through a bounded queue to one background thread, never on the caller's path; a full queue
drops the write (counted), and `flush`/`close` drain it and write what memory still holds.

    put:  the entry goes to the fastest tier whose budget can hold it; what that tier evicts is
          demoted to the next tier, and so on; disk evictions are final.
    get:  tiers are asked fastest first; a hit below the top is promoted to the fastest tier that
          can take it (moved from host, copied from disk).
    pin:  a pinned key is never evicted nor demoted, in any tier, until unpinned.
    shared: an optional Redis tier (``redis_tier``) below the local ones, for many replicas. It
          is read only by `prefetch`, one round trip for all the keys a request needs, whose hits
          land in the memory tiers as promotions (`get` never waits on the network) and are
          certified like any hit when read; every accepted put is queued for it in the
          background.

Every entry is sealed with its key on put, and every hit, from any tier, is certified against the
key it was looked up by and the caller's token fingerprint (`entry.certify`): an entry that names
another key or other tokens is dropped from its tier, counted in `misfiled`, and the lookup goes
on to the next tier as if it had missed.

One re-entrant lock serialises every call and the index updates of background writes; the file
writes and the network round trip of `prefetch` happen outside it. This module does not hash
content.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence

import torch

from .config import PutResult, StoreConfig
from .disk import DiskTier
from .entry import Entry, EntryTooLargeError, MisfiledEntryError, TierFullError, certify, validate_key
from .memory import MemoryTier
from .redis_tier import RedisHealth, RedisTier
from .stats import StoreStats
from .tier import Arrival, Tier


class TieredStore:
    """Content-addressed entries over memory tiers (fastest first) and an optional disk tier.

    write_queue: see `StoreConfig`; 0 (the default here) writes to disk in the calling thread.
    Raises ValueError if tier names repeat or there is no tier at all.
    """

    def __init__(
        self,
        memory: Sequence[MemoryTier],
        disk: DiskTier | None = None,
        *,
        write_through: bool = False,
        shared: RedisTier | None = None,
        write_queue: int = 0,
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
        self._writes_queued = self._writes_dropped = 0
        self._writer = _Writer(self, write_queue) if disk is not None and write_queue > 0 else None

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
        return cls(
            memory,
            disk,
            write_through=config.write_through,
            write_queue=config.write_queue,
            shared=shared,
        )

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Every tier, fastest first."""
        return (*self._memory, *([self._disk] if self._disk is not None else []))

    def put(self, key: str, entry: Entry) -> PutResult:
        """Store a copy of `entry` under `key`, replacing any previous entry of that key.

        Raises EntryTooLargeError when no tier's budget can hold it, TierFullError when every
        tier that could is held by pinned entries; the store is unchanged in both cases.
        ValueError if `entry` is sealed with another key (an entry is filed under its own key only).
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
            device = target.device if target is not None else torch.device("cpu")
            owned = entry.to(device, copy=True).sealed(key)
            landed = None
            later = target is not None and self._writer is not None
            if self._disk is not None and (target is None or (self._write_through and not later)):
                try:
                    self._disk.insert(key, owned, "put")
                except EntryTooLargeError:  # the file header tipped it over the disk budget
                    self._refused += 1
                    raise
                landed = self._disk.name
            for tier in self._memory:
                tier.remove(key)
            landed = self._place(0, len(self._memory), key, owned, "put") or landed
            if self._write_through and later:
                self._write_later(key, owned)
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
        return self.prefetch_fresh(keys, ())[0]

    def fetch_shared(self, keys: Sequence[str]) -> dict[str, Entry]:
        """The shared tier's own entries of `keys`, in one round trip, whether or not a local tier
        holds them too, and placed nowhere: for entries that replicas rewrite (a pointer's list
        of rows), whose local copy may be older than the one another replica wrote since. {}
        without a shared tier or when it is unreachable."""
        return self.prefetch_fresh((), keys)[1]

    def prefetch_fresh(
        self, keys: Sequence[str], fresh: Sequence[str]
    ) -> tuple[frozenset[str], dict[str, Entry]]:
        """`prefetch(keys)` and `fetch_shared(fresh)` in one round trip: the keys placed, and the
        shared tier's own entries of `fresh`."""
        if self.shared is None:
            return frozenset(), {}
        fresh = list(dict.fromkeys(fresh))
        with self._lock:
            wanted = [k for k in dict.fromkeys(keys) if not any(k in t for t in self.tiers)]
        asked = list(dict.fromkeys([*wanted, *fresh]))
        found = self.shared.fetch_many(asked) if asked else {}  # outside the lock: the network may be slow
        placed = []
        with self._lock:
            for key in wanted:
                entry = found.get(key)
                if entry is None or any(key in t for t in self.tiers):  # put meanwhile: keep the local one
                    continue
                if self._place(0, len(self._memory), key, entry, "promotion") is not None:
                    placed.append(key)
        return frozenset(placed), {k: found[k] for k in fresh if k in found}

    def shared_health(self) -> RedisHealth | None:
        """The shared tier's state (breaker, queue, last error); None without one."""
        return self.shared.health() if self.shared is not None else None

    def get(self, key: str, tokens: str | None = None) -> Entry | None:
        """The entry under `key`, promoted to the fastest tier that takes it; None on a miss.

        tokens: the fingerprint the entry must certify (see `entry.certify`); None checks the key
        only. Returned tensors share storage with the store: treat them as read-only.
        """
        with self._lock:
            return self._get(key, tokens)

    def pin(self, key: str, tokens: str | None = None) -> Entry | None:
        """`get`, and keep the entry from eviction until as many `unpin` calls; None on a miss."""
        with self._lock:
            entry = self._get(key, tokens)
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
    def pinned(self, key: str, tokens: str | None = None) -> Iterator[Entry | None]:
        """Pin `key` for the block; yields the entry, or None on a miss (then nothing is pinned)."""
        entry = self.pin(key, tokens)
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
        """Wait for the background writes, then write every memory entry missing from disk to disk;
        how many this call wrote itself."""
        if self._writer is not None:
            self._writer.drain()
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

    def close(self) -> int:
        """`flush`, then stop the background writer (later writes happen in the caller); how many
        entries the flush wrote. Call on a clean stop so a restart finds what memory held."""
        written = self.flush()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self.shared is not None:
            self.shared.close()  # what is queued for the shared tier is written first
        return written

    def stats(self) -> StoreStats:
        """A frozen snapshot of every counter."""
        with self._lock:
            tiers = tuple(t.stats() for t in self.tiers)
            if self.shared is not None:
                tiers = (*tiers, self.shared.stats())
            pending = self._writer.pending if self._writer is not None else 0
            return StoreStats(
                tiers,
                self._hits,
                self._misses,
                self._puts,
                self._refused,
                self._writes_queued,
                self._writes_dropped,
                pending,
            )

    def _certified(self, tier: Tier, key: str, entry: Entry, tokens: str | None) -> Entry | None:
        """`entry` if it certifies `key` and `tokens`; else dropped from `tier`, counted, None."""
        try:
            return certify(entry, key, tokens)
        except MisfiledEntryError:
            tier.counters.hits -= 1  # the tier counted a hit; it was a refusal
            tier.counters.misses += 1
            tier.counters.misfiled += 1
            tier.remove(key)
            return None

    def _get(self, key: str, tokens: str | None) -> Entry | None:
        for i, tier in enumerate(self._memory):
            entry = tier.get(key)
            if entry is not None and self._certified(tier, key, entry, tokens) is not None:
                self._hits += 1
                return self._promote(i, key, entry)
        if self._disk is not None:
            entry = self._disk.get(key)
            if entry is not None and self._certified(self._disk, key, entry, tokens) is not None:
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
            if self._writer is not None:
                self._write_later(key, entry)
                return
            with contextlib.suppress(EntryTooLargeError, TierFullError):
                self._disk.insert(key, entry, "demotion")

    def _write_later(self, key: str, entry: Entry) -> None:
        """Hand a disk write to the background writer; a full queue drops it (counted)."""
        if self._writer is not None and self._writer.offer(key, entry):
            self._writes_queued += 1
        else:
            self._writes_dropped += 1

    def _write_behind(self, batch: list[tuple[str, Entry]]) -> None:
        """Background writes: the files outside the lock, one index update under it (writer thread)."""
        disk = self._disk
        if disk is None:
            return
        with self._lock:
            todo = [(key, entry) for key, entry in batch if key not in disk]
        staged = []
        for key, entry in todo:
            try:
                staged.append(disk.stage(key, entry))
            except (EntryTooLargeError, OSError):
                with self._lock:
                    self._writes_dropped += 1
        if not staged:
            return
        with self._lock:
            try:
                self._writes_dropped += len(staged) - disk.commit_new(staged, "put")
            except OSError:
                self._writes_dropped += len(staged)

    def _memory_tier(self, name: str) -> MemoryTier:
        return next(t for t in self._memory if t.name == name)


_BATCH = 64  # queued writes published in one index update


class _Writer:
    """One daemon thread writing queued entries to the store's disk tier, at most `size` waiting."""

    def __init__(self, store: TieredStore, size: int) -> None:
        self._store = store
        self._queue: queue.Queue[tuple[str, Entry] | None] = queue.Queue(maxsize=size)
        self._thread = threading.Thread(target=self._run, name="kamera-store-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Writes accepted and not yet done: waiting, or being written now (a reader that waits
        for 0 knows every accepted entry is on disk, or was refused)."""
        return self._queue.unfinished_tasks

    def offer(self, key: str, entry: Entry) -> bool:
        """Queue a write; False (nothing queued) when the queue is full."""
        try:
            self._queue.put_nowait((key, entry))
        except queue.Full:
            return False
        return True

    def drain(self) -> None:
        """Wait until every queued write is done."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH and batch[-1] is not None:  # what waits now: one index update
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._store._write_behind([item for item in batch if item is not None])
            finally:
                for _ in batch:
                    self._queue.task_done()
            if batch[-1] is None:
                return
