"""Bytes on disk for the disk tier: entry files, checksums, the JSON index and its lock.

An entry file is a plain safetensors file; the entry's meta rides in the safetensors header
metadata under "kamera.meta". Files are written to a temporary name, fsynced and renamed into
place, so a reader sees a whole file or none. Nothing here unpickles: safetensors only.

The index is {"format": 1, "checksum": "blake3", "entries": {key: record}}; it is rewritten whole
(atomically) under an exclusive advisory lock on a separate lock file, because `os.replace` gives
the index a new inode and a lock on the index itself would be lost with the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .entry import Entry

INDEX_FORMAT = 1
CHECKSUM = "blake3"
_META_FIELD = "kamera.meta"


class CorruptEntryError(ValueError):
    """An entry file does not match its index record or does not parse."""


@dataclass(frozen=True)
class DiskRecord:
    """What the index knows of one entry file."""

    file: str  # name inside the entries folder
    size: int  # file bytes (what the disk budget counts)
    nbytes: int  # tensor bytes
    checksum: str  # blake3 hex digest of the whole file
    written: float  # time.time() when written; orders a fresh process's policy


def checksum(data: bytes) -> str:
    """Hex blake3 digest of `data`."""
    return blake3.blake3(data).hexdigest()


def encode_entry(entry: Entry) -> bytes:
    """The safetensors bytes of `entry`, meta included."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in entry.tensors.items()}
    return st_save(tensors, metadata={_META_FIELD: entry.meta_json()})


def decode_entry(data: bytes, record: DiskRecord) -> Entry:
    """Parse file bytes after checking them against `record`; CorruptEntryError on any mismatch."""
    if len(data) != record.size:
        raise CorruptEntryError(f"{record.file}: {len(data)} bytes, index says {record.size}")
    if checksum(data) != record.checksum:
        raise CorruptEntryError(f"{record.file}: checksum mismatch")
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header.get("__metadata__", {}).get(_META_FIELD, "{}"))
        return Entry(st_load(data), meta)
    except (SafetensorError, ValueError, KeyError, AttributeError, struct.error) as err:
        raise CorruptEntryError(f"{record.file}: {err}") from err


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` through a temporary file and `os.replace`; fsync when `durable`."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
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
    """The records of the index file; {} if it is absent or unreadable.

    An unreadable index (edited by hand, foreign format) is treated as empty: its files become
    orphans for `DiskTier.sweep_orphans`, and nothing unverified is ever loaded.
    """
    try:
        raw = json.loads(index_path.read_bytes())
        if raw.get("format") != INDEX_FORMAT or raw.get("checksum") != CHECKSUM:
            return {}
        return {key: DiskRecord(**rec) for key, rec in raw["entries"].items()}
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}


def write_index(index_path: Path, records: dict[str, DiskRecord], *, durable: bool = True) -> None:
    """Replace the index file atomically with `records`."""
    body = {
        "format": INDEX_FORMAT,
        "checksum": CHECKSUM,
        "entries": {key: asdict(rec) for key, rec in records.items()},
    }
    atomic_write(index_path, json.dumps(body, sort_keys=True).encode(), durable=durable)
