"""What a window chunk leaves in the store and gets back (docs/DESIGN.md section 5.2).

A chunk prefilled in a window has its *conditioned* KV, exact for the antecedents it was
prefilled after. Off the path to the next token (:meth:`Keeper.finalize`) it leaves either

- its *canonical* KV (the chunk alone, ``KV(B|∅)``, shared by every context it appears in) plus
  a small *patch* for its antecedents (one extra forward pass of the chunk alone), or
- its conditioned KV itself (``keep="conditioned"``: exact on recall, no extra pass, one full
  entry per context; for streams such as video where content rarely repeats elsewhere);

and a set of chunks may get *orbit patches* (:meth:`Keeper.fit_orbits`), fitted over sampled
orderings, so a later reorder of that set needs no forward pass. Records are read and written
through ``cache.records``: a hit is certified against the chunk's tokens.

Not here: which chunk sits where (``agent/context.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter
from agent.context_types import Counters, WindowConfig, set_key
from cache import records
from cache.keys import fingerprint
from cache.layout import ChunkKV
from cache.orbit import Delta, fit_orbit, sample_orderings
from cache.patch import Patch, fit_patch
from cache.store import TieredStore, record_key


def chunk_tokens(chunk: ChunkInput) -> str:
    """What a chunk's records certify: its token ids, or an image's content key."""
    return fingerprint([chunk.content_key] if isinstance(chunk, ImageInput) else [chunk.ids])


class Keeper:
    """A window's records in the store: canonical KV, conditioned KV, patches, orbit patches."""

    def __init__(
        self, adapter: ModelAdapter, store: TieredStore, config: WindowConfig, counters: Counters
    ) -> None:
        self.adapter, self.store, self.config, self.counters = adapter, store, config, counters

    def fresh_prefill(self, chunks: Sequence[ChunkInput]) -> tuple[Any, int]:
        """``chunks`` prefilled one after another on an empty cache from position 0, as a
        re-prefill of the window does; returns the cache and the next token's position."""
        cache, start = self.adapter.empty_cache(), 0
        for chunk in chunks:
            start += self.adapter.prefill(chunk, cache, start, last_only=True).kv.extent
            self.counters.fresh_tokens += chunk.n_tokens
        self.counters.fresh_prefills += 1
        return cache, start

    def canonical(self, chunk_id: str, chunk: ChunkInput, recompute: bool) -> ChunkKV:
        """The chunk's canonical KV from the store, or encoded alone (and stored) on a miss.

        ``recompute``: a miss means the store lost an entry it had (counted), not a first encode.
        """
        tokens = chunk_tokens(chunk)
        kv = records.load_kv(self.store, chunk_id, tokens, chunk.n_tokens)
        if kv is not None:
            return kv
        self.counters.recompute_on_miss += int(recompute)
        kv = self.adapter.encode(chunk)
        self.counters.canonical_encodes += 1
        records.put_kv(self.store, chunk_id, kv, tokens)
        return kv

    def conditioned(self, chunk_id: str, chunk: ChunkInput, context: str) -> ChunkKV | None:
        """The chunk's KV as computed after the antecedents ``context`` names, if stored."""
        key = record_key(chunk_id, "conditioned", context)
        return records.load_kv(self.store, key, chunk_tokens(chunk), chunk.n_tokens)

    def patch(self, chunk_id: str, context: str) -> Patch | None:
        """The chunk's patch for ``context`` (a set key: its orbit patch), if stored."""
        return records.load_patch(self.store, chunk_id, context)

    def finalize(self, chunk_id: str, chunk: ChunkInput, kv: ChunkKV, context: str) -> None:
        """Leave what ``config.keep`` says for a chunk whose conditioned KV (after ``context``)
        is ``kv``."""
        if self.config.keep == "conditioned":
            records.put_kv(self.store, record_key(chunk_id, "conditioned", context), kv, chunk_tokens(chunk))
            return
        canonical = self.canonical(chunk_id, chunk, recompute=False)
        t0 = time.perf_counter()
        fit = fit_patch(canonical.k, canonical.v, kv.k, kv.v, self.config.patch)
        self.counters.fit_ms += 1000 * (time.perf_counter() - t0)
        self.counters.patches_fitted += 1
        records.put_patch(self.store, chunk_id, context, fit.patch)

    @torch.inference_mode()
    def fit_orbits(self, prefix: ChunkKV, chunks: Sequence[tuple[str, ChunkInput, bool]]) -> int:
        """Orbit patches for the set of ``(chunk id, input, finalized)`` after ``prefix``: the set
        prefilled in ``orbit_orderings`` sampled orderings, each chunk's deltas from its canonical
        KV fitted into one patch. Returns the patches stored."""
        if len(chunks) < 2:
            return 0
        skey = set_key(cid for cid, _, _ in chunks)
        deltas: list[list[Delta]] = [[] for _ in chunks]
        canon = [self.canonical(cid, inp, recompute=done) for cid, inp, done in chunks]
        for ordering in sample_orderings(len(chunks), self.config.orbit_orderings, seed=len(chunks)):
            cache = self.adapter.new_cache([prefix.place(0, self.adapter.spec)])
            start = prefix.extent
            for i in ordering:
                out = self.adapter.prefill(chunks[i][1], cache, start)
                start += out.kv.extent
                deltas[i].append(Delta(out.kv.k - canon[i].k, out.kv.v - canon[i].v))
        t0 = time.perf_counter()
        for (cid, _, _), ds in zip(chunks, deltas, strict=True):
            records.put_patch(self.store, cid, skey, fit_orbit(ds, self.config.patch).patch)
        self.counters.fit_ms += 1000 * (time.perf_counter() - t0)
        return len(chunks)
