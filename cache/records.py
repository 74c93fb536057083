"""What a chunk leaves in the store, and how it comes back: one conversion, one check on a hit.

A chunk's KV is filed as an :class:`~cache.store.Entry` holding ``k``, ``v`` and ``positions``
with ``n_tokens``, ``extent``, ``family`` and ``placed_at`` (the position its keys were rotated
to; absent or None for pre-RoPE keys). The kinds of record a chunk has (``cache.store.record_key``):

- *canonical* (its content key alone): the chunk encoded on its own, ``KV(B|∅)``, pre-RoPE;
- *conditioned*: its KV as computed after particular antecedents (a context key, or a prompt's
  chained key for the prompt cache's ``exact`` / ``approx`` segments);
- *patch* / *orbit*: the low-rank correction for one context or one set (``cache.patch``).

Every read goes through :func:`load_kv` with the fingerprint of the tokens the caller expects
(``cache.keys.fingerprint``): the store drops an entry that certifies other tokens or another key
(a misfile, counted), and this module refuses one whose shape does not match the request. A
refusal is a miss, never a hit.
"""

from __future__ import annotations

import contextlib
from typing import Any

from cache.layout import ChunkKV
from cache.patch import Patch
from cache.store import Entry, EntryTooLargeError, TieredStore, TierFullError, record_key


def kv_entry(kv: ChunkKV, tokens: str | None = None) -> Entry:
    """``kv`` as a store entry certifying ``tokens`` (a :func:`cache.keys.fingerprint`)."""
    meta: dict[str, Any] = {"n_tokens": kv.n_tokens, "extent": kv.extent, "family": kv.family}
    if kv.placed_at is not None:
        meta["placed_at"] = kv.placed_at
    return Entry({"k": kv.k, "v": kv.v, "positions": kv.positions}, meta, tokens=tokens)


def entry_kv(entry: Entry) -> ChunkKV | None:
    """The KV an entry holds; None if it is not a KV entry or is inconsistent with itself."""
    t, meta = entry.tensors, entry.meta
    try:
        at = meta.get("placed_at")
        kv = ChunkKV(
            t["k"], t["v"], t["positions"], int(meta["extent"]), str(meta["family"]),
            None if at is None else int(at),
        )
    except (KeyError, TypeError, ValueError):
        return None
    if int(meta.get("n_tokens", kv.n_tokens)) != kv.n_tokens:
        return None
    return kv


def load_kv(
    store: TieredStore, key: str, tokens: str | None = None, n_tokens: int | None = None
) -> ChunkKV | None:
    """The KV filed under ``key`` if the store has it, it certifies ``tokens`` (None: the key
    only) and it holds ``n_tokens`` tokens (None: any)."""
    entry = store.get(key, tokens)
    if entry is None:
        return None
    kv = entry_kv(entry)
    if kv is None or (n_tokens is not None and kv.n_tokens != n_tokens):
        return None
    return kv


def put(store: TieredStore, key: str, entry: Entry) -> bool:
    """Store ``entry``; False when no tier takes it (too big for all, or all pinned full): a
    later miss recomputes it, nothing else is lost."""
    with contextlib.suppress(EntryTooLargeError, TierFullError):
        store.put(key, entry)
        return True
    return False


def put_kv(store: TieredStore, key: str, kv: ChunkKV, tokens: str | None = None) -> bool:
    return put(store, key, kv_entry(kv, tokens))


def patch_key(chunk_id: str, context: str) -> str:
    """The record of a chunk's patch for ``context`` (a set key, ``set-...``: an orbit patch)."""
    return record_key(chunk_id, "orbit" if context.startswith("set-") else "patch", context)


def load_patch(store: TieredStore, chunk_id: str, context: str) -> Patch | None:
    entry = store.get(patch_key(chunk_id, context))
    if entry is None:
        return None
    try:
        return Patch.from_dict(dict(entry.tensors))
    except (KeyError, TypeError, ValueError):
        return None


def put_patch(store: TieredStore, chunk_id: str, context: str, patch: Patch) -> bool:
    return put(store, patch_key(chunk_id, context), Entry(patch.to_dict()))
