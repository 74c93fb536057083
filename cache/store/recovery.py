"""Recovery of a disk tier directory: make the index and the files agree, within the budget.

`scan` holds the directory's lock and looks at every file under `entries/`:

- an index record whose file is gone or of another size is dropped; with `verify_indexed` every
  indexed file is also decoded, and one that is damaged is dropped with its file, one that
  certifies another key is dropped from that key and treated as an orphan (below);
- an entry file no record names (a writer died before publishing, the index was lost or
  corrupted) is re-indexed under the key its own bytes certify, unless that key already has a
  file or the bytes do not decode (damaged, an older format), in which case it is removed;
- a temporary file whose writer is dead (its pid is in the name), or older than `temp_grace_s`
  (a pid reused since), is removed; a live writer's is left;
- then, with a `budget`, the least recently used entries (file mtimes, which every process's
  hits touch) are evicted until the rest fit.

Other processes may be writing while a scan runs: their entry files are written and renamed
into place, and their losing copies removed, without the lock, so a file listed at the start of
the scan may be renamed or gone a moment later. Such a file is skipped (its writer publishes or
removes it), never an error: every process opening a shared directory runs a scan.

With `repair=False` nothing changes and the report says what would. Used on opening a
`DiskTier`, and offline by `kamera store check|gc`. This module does not know the tier's
counters or the store above it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .codec import CorruptEntryError, decode_entry
from .diskio import ENTRY_SUFFIX, TEMP_SUFFIX, DiskRecord, load_index, locked, write_index, writer_alive
from .entry import MisfiledEntryError
from .policies import DEFAULT_POLICY, make_policy


@dataclass
class Report:
    """What a scan found (and, when repairing, did). `problems` is one line per finding."""

    entries: int = 0  # indexed after the scan
    bytes: int = 0  # their file bytes
    reindexed: int = 0  # orphans indexed under the key they certify
    removed: int = 0  # files removed: damaged, older format, duplicate, stale temporary
    dropped_records: int = 0  # records naming a missing, resized, damaged or misfiled file
    evicted: int = 0  # entries removed to bring the directory within the budget
    misfiled: int = 0  # records whose file certifies another key
    index_problem: str | None = None  # why the index was unreadable, if it was
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Whether the directory needed nothing."""
        return not self.problems


def eviction_order(files: Path, records: dict[str, DiskRecord]) -> list[str]:
    """Keys of `records`, least recently used first (by file mtime; a missing file first)."""

    def last_use(key: str) -> int:
        try:
            return os.stat(files / records[key].file).st_mtime_ns
        except FileNotFoundError:
            return -1

    return sorted(records, key=last_use)


def scan(
    root: str | Path,
    *,
    budget: int | None = None,
    repair: bool = True,
    verify_indexed: bool = False,
    temp_grace_s: float = 60.0,
    policy: str = DEFAULT_POLICY,
    durable: bool = True,
) -> Report:
    """Check (and with `repair`, fix) the directory of a disk tier; see the module docstring."""
    root = Path(root)
    files, index_path = root / "entries", root / "index.json"
    report = Report()
    if not files.is_dir():
        return report
    with locked(root / "index.lock"):
        records, report.index_problem = load_index(index_path)
        if report.index_problem:
            report.problems.append(f"index.json: {report.index_problem}; its files are orphans now")
        changed = bool(report.index_problem) and repair
        names = {p.name: p for p in files.iterdir()}
        for key, rec in list(records.items()):
            path = names.get(rec.file)
            st = _stat(path) if path is not None else None
            problem = None
            if path is None or st is None:
                problem = "file missing"
            elif st.st_size != rec.size:
                problem = f"file has {st.st_size} bytes, record says {rec.size}"
            elif verify_indexed:
                try:
                    decode_entry(path.read_bytes(), key)
                except MisfiledEntryError as err:
                    problem = f"misfiled: {err}"
                    report.misfiled += 1
                except CorruptEntryError as err:
                    problem = f"damaged: {err}"
                    _remove(path, repair, report)
                    names.pop(rec.file)
            if problem is not None:
                report.problems.append(f"record {key!r} -> {rec.file}: {problem}; dropped")
                report.dropped_records += 1
                del records[key]
                changed = repair
        named = {rec.file for rec in records.values()}
        cutoff = time.time() - temp_grace_s
        for name, path in sorted(names.items()):
            if name in named:
                continue
            if name.endswith(TEMP_SUFFIX):
                if _stale_temp(path, cutoff):
                    report.problems.append(f"{name}: temporary file of a dead writer; removed")
                    _remove(path, repair, report)
                continue
            if not name.endswith(ENTRY_SUFFIX):
                report.problems.append(f"{name}: not an entry file; left alone")
                continue
            try:
                with open(path, "rb") as f:
                    data, st = f.read(), os.fstat(f.fileno())
            except FileNotFoundError:
                continue  # removed by its writer since the listing (a copy that lost to another)
            try:
                entry = decode_entry(data, None)
            except CorruptEntryError as err:
                report.problems.append(f"{name}: unindexed and unreadable ({err}); removed")
                _remove(path, repair, report)
                continue
            key = str(entry.key)  # decoded entries are always sealed
            if key in records:
                report.problems.append(f"{name}: unindexed copy of {key!r}, which has a file; removed")
                _remove(path, repair, report)
                continue
            records[key] = DiskRecord(name, st.st_size, entry.nbytes, st.st_mtime)
            report.problems.append(f"{name}: unindexed; re-indexed as {key!r}")
            report.reindexed += 1
            changed = repair
        for path in root.glob(f".index.json.*{TEMP_SUFFIX}"):  # a dead writer's index
            if _stale_temp(path, cutoff):
                report.problems.append(f"{path.name}: temporary index of a dead writer; removed")
                _remove(path, repair, report)
        held = sum(r.size for r in records.values())
        if budget is not None and held > budget:
            report.problems.append(f"{held} bytes indexed, over the budget of {budget}; evicting")
            order = make_policy(policy)
            for key in eviction_order(files, records):
                order.admit(key, records[key].size)
            while held > budget:
                victim = order.victim(keep=())
                if victim is None:
                    break
                order.forget(victim)
                rec = records.pop(victim)
                held -= rec.size
                _remove(files / rec.file, repair, report, count=False)
                report.evicted += 1
                changed = repair
        if changed:
            write_index(index_path, records, durable=durable)
        report.entries, report.bytes = len(records), held
    return report


def _stat(path: Path) -> os.stat_result | None:
    """`path`'s status, None if it is gone (renamed or removed by a writer since it was listed)."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _stale_temp(path: Path, cutoff: float) -> bool:
    """Whether temporary file `path` is a dead writer's, or older than `cutoff` (a pid reused
    since); False once it is gone (its live writer renamed it into place meanwhile)."""
    if not writer_alive(path.name):
        return True
    st = _stat(path)
    return st is not None and st.st_mtime < cutoff


def _remove(path: Path, repair: bool, report: Report, *, count: bool = True) -> None:
    if repair:
        path.unlink(missing_ok=True)
    report.removed += int(count)
