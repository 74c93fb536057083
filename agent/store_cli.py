"""``kamera store check|gc PATH``: audit or repair a disk tier directory, offline.

``check`` decodes every entry file and reports what does not agree (records naming missing,
resized, damaged or misfiled files; unindexed files; dead writers' temporary files; bytes over
``--disk-bytes``) and changes nothing. ``gc`` repairs the same findings: it drops bad records,
re-indexes files that certify themselves, removes the rest, and evicts the least recently used
entries past ``--disk-bytes``. Both hold the directory's lock, so a server using it waits for them.

Exit status: 0 the directory is clean (``check``) or was repaired (``gc``); 1 ``check`` found
problems; 2 the path is not a store directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from cache.store import Report, scan


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kamera store", description="audit or repair a store directory")
    p.add_argument("action", choices=["check", "gc"], help="check: report only; gc: repair")
    p.add_argument("path", type=Path, help="the --disk-path of a kamera serve")
    p.add_argument("--disk-bytes", type=int, default=None, help="the budget to enforce (default: none)")
    p.add_argument(
        "--temp-grace-s",
        type=float,
        default=60.0,
        help="temporary files older than this are a dead writer's even if their pid is alive",
    )
    return p


def summary(report: Report) -> str:
    return (
        f"{report.entries} entries, {report.bytes} bytes; reindexed {report.reindexed}, "
        f"removed {report.removed} files, dropped {report.dropped_records} records "
        f"({report.misfiled} misfiled), evicted {report.evicted}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.path / "entries").is_dir():
        print(f"kamera store: {args.path} is not a store directory (no entries/ folder)")
        return 2
    repair = args.action == "gc"
    report = scan(
        args.path, budget=args.disk_bytes, repair=repair, verify_indexed=True, temp_grace_s=args.temp_grace_s
    )
    for line in report.problems:
        print(("fixed: " if repair else "found: ") + line)
    print(("after gc: " if repair else "") + summary(report))
    if report.clean:
        print("clean")
        return 0
    return 0 if repair else 1
