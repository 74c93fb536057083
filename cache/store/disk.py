"""The disk tier: one safetensors file per entry plus a JSON index, shareable between processes.

Layout under `root`: `entries/<random>.safetensors` (immutable once renamed into place; a new
write of a key gets a new file), `index.json` (key -> file, size, checksum) and `index.lock`.
Every change to the index happens under an exclusive `flock` on `index.lock` and starts by
re-reading the index, so processes writing different entries lose nothing; the index and entry
files are replaced atomically, so readers never see half of one. A file whose size or checksum
disagrees with the index, or that has vanished while the index still names it, is dropped from
the index, counted in `corrupt_dropped` and reported as a miss: the caller recomputes.

The budget is shared by every process using the directory. Each process orders eviction by the
reads it has seen itself (a fresh process starts from the write times); pinned keys of this
process are never evicted by it. This module does not talk to a network tier, compact files, or
verify that two writers of one key wrote the same bytes (the last writer wins).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from .diskio import (
    CorruptEntryError,
    DiskRecord,
    IndexStamp,
    atomic_write,
    checksum,
    decode_entry,
    encode_entry,
    index_stamp,
    locked,
    read_index,
    write_index,
)
from .entry import Entry, EntryTooLargeError, TierFullError
from .policies import DEFAULT_POLICY, make_policy
from .tier import Arrival, Tier


class DiskTier(Tier):
    """Entries as files under `root`, within `budget_bytes` of file bytes.

    durable: fsync files and the folder on every write (off only for throwaway stores).
    Raises OSError if `root` cannot be created.
    """

    def __init__(
        self,
        root: str | Path,
        budget_bytes: int,
        policy: str = DEFAULT_POLICY,
        *,
        name: str = "disk",
        durable: bool = True,
    ) -> None:
        super().__init__(name, budget_bytes)
        self.root = Path(root)
        self._files = self.root / "entries"
        self._files.mkdir(parents=True, exist_ok=True)
        self._index_path = self.root / "index.json"
        self._lock_path = self.root / "index.lock"
        self._policy = make_policy(policy)
        self._durable = durable
        self._index: dict[str, DiskRecord] = {}
        self._stamp: IndexStamp | None = None
        self._refresh()

    @property
    def bytes_in_use(self) -> int:
        return sum(rec.size for rec in self._index.values())

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[str]:
        self._refresh()
        return iter(list(self._index))

    def get(self, key: str) -> Entry | None:
        if key not in self._index:
            self._refresh()  # another process may have written it
        record = self._index.get(key)
        if record is None:
            self.counters.misses += 1
            return None
        try:
            entry = decode_entry((self._files / record.file).read_bytes(), record)
        except (FileNotFoundError, CorruptEntryError):
            if self._drop_if_current(key, record):
                self.counters.corrupt_dropped += 1
            self.counters.misses += 1
            return None
        self._policy.touch(key)
        self.counters.hits += 1
        self.counters.bytes_read += record.size
        return entry

    def insert(self, key: str, entry: Entry, arrived: Arrival) -> list[tuple[str, Entry]]:
        data = encode_entry(entry)
        if not self.fits(len(data)):
            raise EntryTooLargeError(key, len(data), {self.name: self.budget_bytes})
        name = f"{uuid.uuid4().hex}.safetensors"
        record = DiskRecord(name, len(data), entry.nbytes, checksum(data), time.time())
        atomic_write(self._files / record.file, data, durable=self._durable)
        doomed: list[str] = []
        try:
            with locked(self._lock_path):
                self._refresh(force=True)
                self._make_room(key, record.size, doomed)
                previous = self._index.pop(key, None)
                if previous is not None:
                    doomed.append(previous.file)
                self._index[key] = record
                self._policy.forget(key)
                self._policy.admit(key, record.size)
                self._publish()
        except BaseException:
            (self._files / record.file).unlink(missing_ok=True)
            raise
        for name in doomed:  # after publishing: a reader of the old index gets a miss, not a half file
            (self._files / name).unlink(missing_ok=True)
        self._count_arrival(arrived, record.size)
        return []

    def remove(self, key: str) -> bool:
        with locked(self._lock_path):
            self._refresh(force=True)
            record = self._index.pop(key, None)
            if record is None:
                return False
            self._policy.forget(key)
            self._publish()
        (self._files / record.file).unlink(missing_ok=True)
        return True

    def sweep_orphans(self, min_age_s: float = 3600.0) -> int:
        """Delete files no index record names, older than `min_age_s`; returns how many.

        Orphans come from a writer that died between writing its file and publishing it. The age
        threshold spares files that a live writer has not published yet.
        """
        cutoff = time.time() - min_age_s
        removed = 0
        with locked(self._lock_path):
            self._refresh(force=True)
            named = {rec.file for rec in self._index.values()}
            for path in self._files.iterdir():
                if path.name not in named and path.stat().st_mtime < cutoff:
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed

    def _make_room(self, key: str, size: int, doomed: list[str]) -> None:
        """Evict (under the lock) until `size` more bytes fit; TierFullError if pins forbid it."""
        others = {k: r for k, r in self._index.items() if k != key}
        pinned_bytes = sum(r.size for k, r in others.items() if k in self.pinned)
        if pinned_bytes + size > self.budget_bytes:
            raise TierFullError(f"tier {self.name!r}: pinned files leave no room for {size} bytes")
        held = sum(r.size for r in others.values())
        self._policy.forget(key)
        while held + size > self.budget_bytes:
            victim = self._policy.victim(keep=self.pinned)
            if victim is None or victim not in others:
                raise RuntimeError(f"tier {self.name!r}: eviction policy out of step with the index")
            record = self._index.pop(victim)
            del others[victim]
            self._policy.forget(victim)
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
            self._policy.forget(key)
            self._publish()
        (self._files / record.file).unlink(missing_ok=True)
        return True

    def _refresh(self, force: bool = False) -> None:
        """Adopt the index on disk if it changed since last read (always when `force`)."""
        stamp = index_stamp(self._index_path)
        if not force and stamp == self._stamp:
            return
        fresh = read_index(self._index_path)
        for key in self._index.keys() - fresh.keys():
            self._policy.forget(key)
        for key in sorted(fresh.keys() - self._index.keys(), key=lambda k: fresh[k].written):
            self._policy.admit(key, fresh[key].size)
        self._index = fresh
        self._stamp = stamp

    def _publish(self) -> None:
        """Write the in-memory index (call with the lock held, after a forced refresh)."""
        write_index(self._index_path, self._index, durable=self._durable)
        self._stamp = index_stamp(self._index_path)
