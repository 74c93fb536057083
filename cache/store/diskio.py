"""Bytes on disk for the disk tier: atomic file writes, the JSON index and its lock.

Entry files hold the self-certifying bytes of `codec`; they are written to a temporary name,
fsynced and renamed into place, so a reader sees a whole file or none. The index is
{"format": 2, "entries": {key: record}}; it is rewritten whole (atomically) under an exclusive
advisory lock on a separate lock file, because `os.replace` gives the index a new inode and a
lock on the index itself would be lost with the old one. The index only says where an entry's
file is and how big it is: a file is trusted for what its own bytes certify, never for where the
index filed it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

INDEX_FORMAT = 2
ENTRY_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class DiskRecord:
    """What the index knows of one entry file. ValueError on a malformed record."""

    file: str  # name inside the entries folder
    size: int  # file bytes (what the disk budget counts)
    nbytes: int  # tensor bytes
    written: float  # time.time() when written

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or "/" in self.file or not self.file.endswith(ENTRY_SUFFIX):
            raise ValueError(f"bad entry file name {self.file!r}")
        if not all(isinstance(n, int) and n >= 0 for n in (self.size, self.nbytes)):
            raise ValueError(f"bad sizes in the record of {self.file!r}")


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` through a temporary file and `os.replace`; fsync when `durable`.

    The temporary file, `.<name>.<pid>.<random>.tmp`, names its writer, so recovery can tell a
    dead writer's leftovers from a live one's work (`writer_alive`).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def writer_alive(temp_name: str) -> bool:
    """Whether the process that named temporary file `temp_name` may still be writing it."""
    try:
        pid = int(temp_name.split(".")[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive `fcntl.flock` on `lock_path` (created if absent) for the block."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


IndexStamp = tuple[int, int, int]  # (inode, mtime_ns, size) of index.json


def index_stamp(index_path: Path) -> IndexStamp | None:
    """Identity of the index file version on disk, None if there is none."""
    try:
        st = os.stat(index_path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def read_index(index_path: Path) -> dict[str, DiskRecord]:
    """The records of the index file; {} if it is absent or unreadable (see `load_index`)."""
    return load_index(index_path)[0]


def load_index(index_path: Path) -> tuple[dict[str, DiskRecord], str | None]:
    """The records of the index file and, if it was there but unreadable, why.

    An unreadable index (edited by hand, an older format) is treated as empty: its files become
    orphans, which recovery re-indexes from what they certify or removes.
    """
    try:
        raw = json.loads(index_path.read_bytes())
        if raw.get("format") != INDEX_FORMAT:
            return {}, f"index format {raw.get('format')!r}, not {INDEX_FORMAT}"
        return {str(key): DiskRecord(**rec) for key, rec in raw["entries"].items()}, None
    except FileNotFoundError:
        return {}, None
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        return {}, f"unreadable index: {type(err).__name__}: {err}"


def write_index(index_path: Path, records: dict[str, DiskRecord], *, durable: bool = True) -> None:
    """Replace the index file atomically with `records`."""
    body = {
        "format": INDEX_FORMAT,
        "entries": {key: asdict(rec) for key, rec in records.items()},
    }
    atomic_write(index_path, json.dumps(body, sort_keys=True).encode(), durable=durable)
