"""What the store holds: an entry of named tensors plus small JSON metadata, and its errors.

An entry is addressed by a string key made elsewhere (a hex content hash). Sub-records of a chunk
(its conditioned KV, a patch fitted for one context) are entries of their own under a composed
key, see `record_key`, so every tier handles one kind of thing and evicts each record on its own
merits.

An entry certifies itself: `key` is the store key it was filed under (the store stamps it on
put) and `tokens` a fingerprint of the token ids its tensors were computed for (the caller's,
opaque here). `certify` checks both against a lookup; every tier's hits go through it, and the
byte codec (`codec`) carries both inside the entry's own bytes, so an entry found under the wrong
key, by a bug, a swapped index record or a shared tier, is refused instead of served.

This module does not hash content (the caller makes keys and fingerprints) or move tensors
between tiers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

MAX_KEY_LENGTH = 512
_RESERVED_TENSOR_NAME = "__metadata__"  # the safetensors header uses it


@dataclass(frozen=True)
class Entry:
    """Named tensors and JSON-able metadata stored under one key.

    tensors: e.g. {"k": [L, H_kv, T, D_k], "v": [L, H_kv, T, D_v], "positions": [T] int64}; any
        dtype safetensors can write (float32, bfloat16, float16, int64, int8, ...).
    meta: small JSON-able values (n_tokens, extent, family, ...).
    key: the store key it is filed under; None until a store stamps it (`sealed`).
    tokens: fingerprint of the token ids the tensors belong to (hex), None when the caller gave none.

    Raises ValueError on construction when a name is empty or reserved, a value is not a tensor,
    or `meta` does not survive a JSON round trip unchanged.
    """

    tensors: Mapping[str, Tensor]
    meta: Mapping[str, Any] = field(default_factory=dict)
    key: str | None = None
    tokens: str | None = None

    def __post_init__(self) -> None:
        for name, value in self.tensors.items():
            if not isinstance(name, str) or not name or name == _RESERVED_TENSOR_NAME:
                raise ValueError(f"invalid tensor name {name!r}")
            if not isinstance(value, Tensor):
                raise ValueError(f"tensor {name!r} is a {type(value).__name__}, not a torch.Tensor")
        try:
            encoded = json.dumps(dict(self.meta), sort_keys=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"entry meta is not JSON-able: {err}") from err
        if json.loads(encoded) != dict(self.meta):
            raise ValueError("entry meta changes in a JSON round trip (tuples, non-str keys?)")
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what the memory budgets count)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device: torch.device, *, copy: bool = False) -> Entry:
        """The same entry with contiguous tensors on `device`; `copy` forces fresh storage."""
        moved = {
            name: t.detach().to(device, copy=copy, memory_format=torch.contiguous_format).contiguous()
            for name, t in self.tensors.items()
        }
        return Entry(moved, self.meta, self.key, self.tokens)

    def sealed(self, key: str) -> Entry:
        """This entry filed under `key`; ValueError if it already names another key."""
        if self.key is not None and self.key != key:
            raise ValueError(f"entry of key {self.key!r} cannot be filed under {key!r}")
        return self if self.key == key else Entry(self.tensors, self.meta, key, self.tokens)

    def meta_json(self) -> str:
        """`meta` as canonical JSON (sorted keys)."""
        return json.dumps(dict(self.meta), sort_keys=True)


def certify(entry: Entry, key: str, tokens: str | None = None) -> Entry:
    """`entry` if it names `key` (and `tokens`, when given); MisfiledEntryError otherwise.

    A caller that gives `tokens` refuses an entry that certifies none.
    """
    if entry.key != key:
        raise MisfiledEntryError(f"looked up as {key!r}, the entry is {entry.key!r}")
    if tokens is not None and entry.tokens != tokens:
        raise MisfiledEntryError(f"{key!r}: the entry holds tokens {entry.tokens}, the lookup wants {tokens}")
    return entry


def validate_key(key: str) -> str:
    """Return `key` if it is a usable store key, else raise ValueError."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"store key must be a non-empty str of at most {MAX_KEY_LENGTH} chars: {key!r}")
    if any(ch in key for ch in "\x00\n\r"):
        raise ValueError(f"store key contains a control character: {key!r}")
    return key


def record_key(chunk_key: str, kind: str, context_key: str | None = None) -> str:
    """Key of a sub-record of a chunk: "<chunk>/<kind>" or "<chunk>/<kind>/<context>".

    kind names what the record is ("conditioned", "patch", "orbit", ...); context_key is the key of
    the context it was computed for. Neither `kind` nor `context_key` may contain "/".
    """
    parts = [kind] if context_key is None else [kind, context_key]
    for part in parts:
        if not part or "/" in part:
            raise ValueError(f"record key part must be non-empty and free of '/': {part!r}")
    return validate_key("/".join([chunk_key, *parts]))


class EntryTooLargeError(ValueError):
    """An entry does not fit the byte budget of any tier; nothing was stored."""

    def __init__(self, key: str, nbytes: int, budgets: Mapping[str, int]) -> None:
        shown = ", ".join(f"{name}={budget}" for name, budget in budgets.items())
        super().__init__(f"entry {key!r} needs {nbytes} bytes, more than any tier's budget ({shown})")
        self.key = key
        self.nbytes = nbytes


class MisfiledEntryError(ValueError):
    """An entry found under one key certifies another key or other tokens: it must not be served."""


class TierFullError(RuntimeError):
    """A tier cannot make room: what it holds beyond the budget is pinned. Nothing was changed."""
