"""An entry as bytes that certify themselves: the format every byte tier (disk, Redis) stores.

The bytes are a plain safetensors file. Its header metadata holds, besides the tensors' own
table:

    kamera.format   "2"
    kamera.key      the store key the entry was filed under
    kamera.tokens   the token fingerprint the entry was made for ("" when none)
    kamera.meta     the entry's meta as canonical JSON
    kamera.digest   BLAKE3 over the four fields above and every tensor's name, dtype, shape and
                    bytes (sorted by name)

`decode_entry(data, key)` recomputes the digest (so damage anywhere is caught, header or data)
and checks the key, so bytes need nothing outside themselves to be trusted: an index record, a
Redis key or a file name only says where to look. Nothing here unpickles: safetensors only.

This module does not read or write files, and does not check tokens (the store does that with
the lookup's fingerprint, see `entry.certify`).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import blake3
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .entry import Entry, certify

FORMAT = "2"
_FIELDS = ("kamera.format", "kamera.key", "kamera.tokens", "kamera.meta", "kamera.digest")


class CorruptEntryError(ValueError):
    """Bytes that do not parse, or whose digest does not match their content."""


def _digest(key: str, tokens: str, meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = blake3.blake3()
    for text in (FORMAT, key, tokens, meta_json):
        raw = text.encode()
        h.update(struct.pack("<Q", len(raw)) + raw)
    for name in sorted(tensors):
        t = tensors[name]
        head = json.dumps([name, str(t.dtype), list(t.shape)]).encode()
        h.update(struct.pack("<Q", len(head)) + head)
        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def encode_entry(entry: Entry) -> bytes:
    """The self-certifying bytes of a sealed entry; ValueError if it names no key."""
    if entry.key is None:
        raise ValueError("only an entry sealed with its key can be encoded")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in entry.tensors.items()}
    tokens, meta_json = entry.tokens or "", entry.meta_json()
    metadata = {
        "kamera.format": FORMAT,
        "kamera.key": entry.key,
        "kamera.tokens": tokens,
        "kamera.meta": meta_json,
        "kamera.digest": _digest(entry.key, tokens, meta_json, tensors),
    }
    return st_save(tensors, metadata=metadata)


def decode_entry(data: bytes, key: str | None) -> Entry:
    """The entry in `data`, checked whole; filed under `key` unless `key` is None (an audit).

    Raises CorruptEntryError when the bytes do not parse or their digest differs (an older
    format included), MisfiledEntryError when they are intact but certify another key.
    """
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        header: dict[str, Any] = json.loads(data[8 : 8 + header_len])
        fields = header.get("__metadata__") or {}
        if fields.get("kamera.format") != FORMAT or not all(isinstance(fields.get(f), str) for f in _FIELDS):
            raise CorruptEntryError("not a self-certifying entry (format 2)")
        tensors = st_load(data)
        stored_key, tokens, meta_json = fields["kamera.key"], fields["kamera.tokens"], fields["kamera.meta"]
        if _digest(stored_key, tokens, meta_json, tensors) != fields["kamera.digest"]:
            raise CorruptEntryError(f"entry {stored_key!r}: digest mismatch")
        entry = Entry(tensors, json.loads(meta_json), stored_key, tokens or None)
    except CorruptEntryError:
        raise
    except (SafetensorError, ValueError, KeyError, AttributeError, TypeError, struct.error) as err:
        raise CorruptEntryError(str(err)) from err
    return entry if key is None else certify(entry, key)
