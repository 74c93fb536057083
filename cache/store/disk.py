"""The disk tier: one self-certifying file per entry plus a JSON index, shareable between processes.

Layout under `root`: `entries/<random>.safetensors` (immutable once renamed into place; a new
write of a key gets a new file), `index.json` (key -> file, size) and `index.lock`. Every change
to the index happens under an exclusive `flock` on `index.lock` and starts by re-reading the
index, so processes writing different entries lose nothing; files and the index are replaced
atomically, so readers never see half of one.

A read trusts a file for what its own bytes certify (`codec`): one that is damaged, truncated or
gone is dropped and counted in `corrupt_dropped`; one that is intact but certifies another key
(a swapped or copied record) is dropped and counted in `misfiled`; both are misses, and the caller
recomputes. Opening a directory recovers it (`recovery.scan`): files the index does not name are
re-indexed from their certificates or removed, and the budget is enforced, so crashes and lost
indexes leak no disk.

Shared use: the budget and the hits are shared by every process on the directory, and so is the
eviction order: a hit touches its file's mtime, and eviction (under the lock) feeds the tier's
policy the index's keys oldest use first, so no process evicts what another has just used. Pinned
keys of this process are never evicted by it. This module does not talk to a network tier or
compact files.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from .codec import CorruptEntryError, decode_entry, encode_entry
from .diskio import (
    ENTRY_SUFFIX,
    DiskRecord,
    IndexStamp,
    atomic_write,
    index_stamp,
    locked,
    read_index,
    write_index,
)
from .entry import Entry, EntryTooLargeError, MisfiledEntryError, TierFullError
from .policies import DEFAULT_POLICY, make_policy
from .recovery import Report, eviction_order, scan
from .tier import Arrival, Tier


class Staged(NamedTuple):
    """An entry file written but not yet in the index (see `DiskTier.stage`)."""

    key: str
    record: DiskRecord


class DiskTier(Tier):
    """Entries as files under `root`, within `budget_bytes` of file bytes.

    durable: fsync files and the folder on every write (off only for throwaway stores).
    recover: scan the directory on opening (see `recovery.scan`); `self.recovery` is its report.
    Raises OSError if `root` cannot be created, ValueError for an unknown policy.
    """

    def __init__(
        self,
        root: str | Path,
        budget_bytes: int,
        policy: str = DEFAULT_POLICY,
        *,
        name: str = "disk",
        durable: bool = True,
        recover: bool = True,
    ) -> None:
        super().__init__(name, budget_bytes)
        make_policy(policy)  # refuse an unknown name now, not at the first eviction
        self.root = Path(root)
        self._files = self.root / "entries"
        self._files.mkdir(parents=True, exist_ok=True)
        self._index_path = self.root / "index.json"
        self._lock_path = self.root / "index.lock"
        self._policy_name = policy
        self._durable = durable
        self._index: dict[str, DiskRecord] = {}
        self._stamp: IndexStamp | None = None
        self.recovery: Report | None = None
        if recover:
            self.recovery = scan(self.root, budget=budget_bytes, repair=True, policy=policy, durable=durable)
        self._refresh(force=True)

    @property
    def bytes_in_use(self) -> int:
        return sum(rec.size for rec in self._index.values())

    def __contains__(self, key: object) -> bool:
        if key not in self._index:
            self._refresh()  # another process may have written it
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[str]:
        self._refresh()
        return iter(list(self._index))

    def get(self, key: str) -> Entry | None:
        if key not in self._index:
            self._refresh()
        record = self._index.get(key)
        if record is None:
            self.counters.misses += 1
            return None
        path = self._files / record.file
        try:
            data = path.read_bytes()
            if len(data) != record.size:
                raise CorruptEntryError(f"{record.file}: {len(data)} bytes, index says {record.size}")
            entry = decode_entry(data, key)
        except MisfiledEntryError:
            if self._drop_if_current(key, record):
                self.counters.misfiled += 1
            self.counters.misses += 1
            return None
        except (FileNotFoundError, CorruptEntryError):
            if self._drop_if_current(key, record):
                self.counters.corrupt_dropped += 1
            self.counters.misses += 1
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # the shared recency eviction orders by
        self.counters.hits += 1
        self.counters.bytes_read += record.size
        return entry

    def insert(self, key: str, entry: Entry, arrived: Arrival) -> list[tuple[str, Entry]]:
        self.commit(self.stage(key, entry), arrived)
        return []

    def stage(self, key: str, entry: Entry) -> Staged:
        """Write `entry`'s file without touching the index or this tier's state (any thread).

        Follow with `commit` or `discard`. Raises EntryTooLargeError if it exceeds the budget,
        ValueError if the entry is sealed with another key.
        """
        data = encode_entry(entry.sealed(key))
        if not self.fits(len(data)):
            raise EntryTooLargeError(key, len(data), {self.name: self.budget_bytes})
        record = DiskRecord(f"{uuid.uuid4().hex}{ENTRY_SUFFIX}", len(data), entry.nbytes, time.time())
        atomic_write(self._files / record.file, data, durable=self._durable)
        return Staged(key, record)

    def commit(self, staged: Staged, arrived: Arrival) -> None:
        """Publish a staged file under its key, evicting to make room; TierFullError if pins forbid."""
        key, record = staged
        doomed: list[str] = []
        try:
            with locked(self._lock_path):
                self._refresh(force=True)
                self._make_room(key, record.size, doomed)
                previous = self._index.pop(key, None)
                if previous is not None and previous.file != record.file:  # recovery may have indexed ours
                    doomed.append(previous.file)
                self._index[key] = record
                self._publish()
        except BaseException:
            self.discard(staged)
            raise
        for name in doomed:  # after publishing: a reader of the old index gets a miss, not a half file
            (self._files / name).unlink(missing_ok=True)
        self._count_arrival(arrived, record.size)

    def discard(self, staged: Staged) -> None:
        """Delete a staged file that will not be committed."""
        (self._files / staged.record.file).unlink(missing_ok=True)

    def remove(self, key: str) -> bool:
        with locked(self._lock_path):
            self._refresh(force=True)
            record = self._index.pop(key, None)
            if record is None:
                return False
            self._publish()
        (self._files / record.file).unlink(missing_ok=True)
        return True

    def _make_room(self, key: str, size: int, doomed: list[str]) -> None:
        """Evict (under the lock) until `size` more bytes fit; TierFullError if pins forbid it."""
        others = {k: r for k, r in self._index.items() if k != key}
        pinned_bytes = sum(r.size for k, r in others.items() if k in self.pinned)
        if pinned_bytes + size > self.budget_bytes:
            raise TierFullError(f"tier {self.name!r}: pinned files leave no room for {size} bytes")
        held = sum(r.size for r in others.values())
        if held + size <= self.budget_bytes:
            return
        policy = make_policy(self._policy_name)
        for k in eviction_order(self._files, others):
            policy.admit(k, others[k].size)
        while held + size > self.budget_bytes:
            victim = policy.victim(keep=self.pinned)
            if victim is None:  # unreachable after the pinned-bytes check
                raise TierFullError(f"tier {self.name!r}: policy found no victim")
            record = self._index.pop(victim)
            policy.forget(victim)
            held -= record.size
            doomed.append(record.file)
            self.counters.evictions += 1

    def _drop_if_current(self, key: str, record: DiskRecord) -> bool:
        """Remove `key` if the index still names `record`'s file; whether it did."""
        with locked(self._lock_path):
            self._refresh(force=True)
            if self._index.get(key) != record:
                return False  # evicted or rewritten by another process meanwhile: a plain miss
            del self._index[key]
            self._publish()
        (self._files / record.file).unlink(missing_ok=True)
        return True

    def _refresh(self, force: bool = False) -> None:
        """Adopt the index on disk if it changed since last read (always when `force`)."""
        stamp = index_stamp(self._index_path)
        if not force and stamp == self._stamp:
            return
        self._index = read_index(self._index_path)
        self._stamp = stamp

    def _publish(self) -> None:
        """Write the in-memory index (call with the lock held, after a forced refresh)."""
        write_index(self._index_path, self._index, durable=self._durable)
        self._stamp = index_stamp(self._index_path)
