"""The context manager: an ordered window of chunks under a token budget, on a position-free store.

The window starts with a pinned prefix (the system prompt, also the attention sink: never
evicted). The operations and what they cost (DESIGN.md section 3):

- ``append``: the chunk is prefilled in context, attending to the window; its conditioned KV
  is exact. Its canonical KV (the chunk alone) and its patch are fitted later, by
  :meth:`ContextManager.finalize`, off the path to the next token.
- ``slide``: the oldest chunks leave for the store; survivors keep their conditioned KV and
  only rotate. Automatic when an append or a recall would exceed the budget.
- ``reorder``: chunks move by rotation. A chunk with an orbit patch for the window's set is
  rebuilt as canonical + orbit patch; otherwise it keeps the KV it has and moves.
- ``recall``: an evicted chunk comes back as canonical + the patch fitted for its original
  antecedents, rotated to where it is inserted (forward-lossless, not retroactive).

None of these runs the vision encoder or a forward pass over content already seen, except a
recall whose store entry was evicted, which re-encodes the chunk alone and says so.

The window keeps a live model cache: appends extend it, and any operation that moves a chunk
invalidates it, so the next :meth:`cache` call reassembles from each chunk's pre-RoPE KV (a
chunk whose start did not change reuses its rotated keys).

Not here: turning observations into chunks and generating answers (``agent/loop.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter, Prefill
from cache.layout import ChunkKV
from cache.orbit import Delta, fit_orbit, sample_orderings
from cache.patch import Patch, PatchConfig, apply_patch, fit_patch
from cache.rank import rank_strategy
from cache.rope import rotate
from cache.store import Entry, EntryTooLargeError, TieredStore, TierFullError, record_key


class Source(StrEnum):
    """Where a window chunk's KV came from."""

    PREFIX = "prefix"  # the pinned prefix, prefilled once at position 0
    PREFILLED = "prefilled"  # prefilled in this window: exact conditioned KV
    ROTATED = "rotated"  # a survivor of a slide or reorder: its conditioned KV, moved
    PATCHED = "canonical+patch"  # recalled: canonical + the patch for its original antecedents
    ORBIT = "canonical+orbit"  # reordered: canonical + the orbit patch of the window's set
    CANONICAL = "canonical"  # no patch found: canonical KV alone (blind reuse)
    CONDITIONED = "conditioned"  # recalled: its stored conditioned KV (exact for its old antecedents)


@dataclass(frozen=True)
class WindowConfig:
    """budget_tokens: most tokens the window holds, prefix included. patch: how patches are fitted
    and stored. rope_kernel: rotation kernel name (``cache.rope.KERNELS``). orbit_orderings:
    orderings sampled per orbit fit. keep: what an evicted chunk leaves in the store:
    ``canonical+patch`` (its canonical KV, shared by every context it appears in, plus a small
    patch for its antecedents; one extra forward pass of the chunk alone) or ``conditioned``
    (its KV as computed in the window: exact on recall, no extra pass, but one full entry per
    context; for streams such as video where content rarely repeats in another context)."""

    budget_tokens: int = 4096
    patch: PatchConfig = field(default_factory=lambda: PatchConfig(rank=rank_strategy("fixed", rank=16)))
    rope_kernel: str = "eager"
    orbit_orderings: int = 4
    tenant_salt: str = ""
    keep: str = "canonical+patch"

    def __post_init__(self) -> None:
        if self.keep not in ("canonical+patch", "conditioned"):
            raise ValueError(f"keep must be 'canonical+patch' or 'conditioned', got {self.keep!r}")
        if self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be positive, got {self.budget_tokens}")
        if self.orbit_orderings < 1:
            raise ValueError("orbit_orderings must be at least 1")


@dataclass(frozen=True)
class ChunkView:
    """One chunk of the window as a user sees it."""

    chunk_id: str
    kind: str
    n_tokens: int
    extent: int
    start: int
    source: Source
    meta: dict[str, Any]


@dataclass
class Counters:
    """What the window did, cumulatively. ``tokens_reused``: window tokens that a step's new
    tokens attended to without recomputing them (kept by whoever runs the steps)."""

    tokens_prefilled: int = 0
    tokens_reused: int = 0
    tokens_rotated: int = 0
    patches_applied: int = 0
    patches_fitted: int = 0
    canonical_encodes: int = 0
    recompute_on_miss: int = 0
    assemblies: int = 0
    slides: int = 0
    chunks_evicted: int = 0
    fit_ms: float = 0.0
    assemble_ms: float = 0.0


@dataclass(frozen=True)
class _Evicted:
    """What an evicted chunk leaves behind: enough to find (or, on a store miss, rebuild) its KV."""

    chunk_id: str
    input: ChunkInput
    context_key: str
    meta: dict[str, Any]


@dataclass
class _Slot:
    chunk_id: str
    input: ChunkInput
    kv: ChunkKV  # pre-RoPE KV this window uses for the chunk
    source: Source
    context_key: str  # the antecedents it was prefilled after (its patch's key)
    meta: dict[str, Any]
    start: int = 0
    placed_start: int | None = None  # where its keys were last rotated to
    finalized: bool = False


class RecallError(KeyError):
    """The chunk was never in this window, or is in it now."""


def context_key(chunk_ids: Iterable[str]) -> str:
    h = hashlib.blake2b(b"kamera.context.v1", digest_size=20)
    for cid in chunk_ids:
        h.update(cid.encode() + b"\x00")
    return h.hexdigest()


def set_key(chunk_ids: Iterable[str]) -> str:
    return "set-" + context_key(sorted(chunk_ids))


class ContextManager:
    """An ordered window of chunks over one adapter and one store. Not thread-safe: one owner.

    Every operation runs under ``torch.inference_mode``: all KV it makes is an inference tensor,
    so a compiled rotation kernel sees one kind of input and never recompiles for another.
    """

    def __init__(
        self, adapter: ModelAdapter, store: TieredStore, config: WindowConfig, prefix: ChunkInput
    ) -> None:
        self.adapter, self.store, self.config = adapter, store, config
        self.counters = Counters()
        self._evicted: dict[str, _Evicted] = {}
        cache = adapter.empty_cache()
        out = adapter.prefill(prefix, cache, 0)
        self.counters.tokens_prefilled += prefix.n_tokens
        pid = adapter.chunk_key(prefix, config.tenant_salt)
        self._slots = [
            _Slot(pid, prefix, out.kv, Source.PREFIX, context_key([]), {"kind": "prefix"}, 0, 0, True)
        ]
        if self.tokens > config.budget_tokens:
            raise ValueError(
                f"the prefix alone ({self.tokens} tokens) exceeds the budget {config.budget_tokens}"
            )
        self._cache: Any = cache
        self._restart()

    # --- views --------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return sum(s.kv.n_tokens for s in self._slots)

    @property
    def next_start(self) -> int:
        last = self._slots[-1]
        return last.start + last.kv.extent

    def view(self) -> tuple[ChunkView, ...]:
        return tuple(
            ChunkView(s.chunk_id, _kind(s), s.kv.n_tokens, s.kv.extent, s.start, s.source, dict(s.meta))
            for s in self._slots
        )

    @property
    def evicted(self) -> tuple[str, ...]:
        return tuple(self._evicted)

    # --- operations ---------------------------------------------------------------------

    @torch.inference_mode()
    def append(self, chunk: ChunkInput, meta: dict[str, Any] | None = None) -> Prefill:
        """Prefill ``chunk`` at the end of the window (sliding first if it would not fit)."""
        if chunk.n_tokens + self._slots[0].kv.n_tokens > self.config.budget_tokens:
            raise ValueError(
                f"a {chunk.n_tokens}-token chunk cannot fit a {self.config.budget_tokens}-token window"
            )
        self._make_room(chunk.n_tokens)
        cache = self.cache()
        start = self.next_start
        out = self.adapter.prefill(chunk, cache, start)
        self.counters.tokens_prefilled += chunk.n_tokens
        self.adopt(chunk, out.kv, cache, meta)
        return out

    @torch.inference_mode()
    def adopt(self, chunk: ChunkInput, kv: ChunkKV, cache: Any, meta: dict[str, Any] | None = None) -> None:
        """Record a chunk already prefilled into the live ``cache`` at :attr:`next_start`.

        If it does not fit, the oldest chunks slide out first and the live cache is rebuilt
        on next use; a chunk larger than the whole budget is refused with ``ValueError``.
        """
        if kv.n_tokens + self._slots[0].kv.n_tokens > self.config.budget_tokens:
            self._cache = None
            raise ValueError(
                f"a {kv.n_tokens}-token chunk cannot fit a {self.config.budget_tokens}-token window"
            )
        ctx = context_key(s.chunk_id for s in self._slots)
        if self.tokens + kv.n_tokens > self.config.budget_tokens:
            self._make_room(kv.n_tokens)
            ctx, cache = context_key(s.chunk_id for s in self._slots), None
        slot = _Slot(
            self.adapter.chunk_key(chunk, self.config.tenant_salt),
            chunk,
            kv,
            Source.PREFILLED,
            ctx,
            dict(meta or {}),
        )
        slot.start = self.next_start
        if cache is None:  # moved by the slide: it now starts elsewhere than where it was computed
            slot.source = Source.ROTATED
        else:
            slot.placed_start = slot.start
        self._slots.append(slot)
        self._cache = cache

    def slide(self, n_chunks: int = 1) -> list[str]:
        """Evict the ``n_chunks`` oldest chunks after the prefix; survivors rotate back."""
        if n_chunks < 0 or n_chunks > len(self._slots) - 1:
            raise ValueError(f"can slide 0..{len(self._slots) - 1} chunks, not {n_chunks}")
        gone = self._slots[1 : 1 + n_chunks]
        for slot in gone:
            self._finalize_slot(slot)
            self._evicted[slot.chunk_id] = _Evicted(slot.chunk_id, slot.input, slot.context_key, slot.meta)
        del self._slots[1 : 1 + n_chunks]
        for slot in self._slots[1:]:
            if slot.source == Source.PREFILLED:
                slot.source = Source.ROTATED
        if gone:
            self.counters.slides += 1
            self.counters.chunks_evicted += len(gone)
            self._restart()
        return [s.chunk_id for s in gone]

    @torch.inference_mode()
    def reorder(self, order: Sequence[str]) -> None:
        """Put the chunks after the prefix in ``order`` (chunk ids, a permutation of the window's)."""
        current = [s.chunk_id for s in self._slots[1:]]
        if sorted(order) != sorted(current):
            raise ValueError("reorder needs a permutation of the chunks in the window")
        by_id: dict[str, list[_Slot]] = {}
        for s in self._slots[1:]:
            by_id.setdefault(s.chunk_id, []).append(s)
        skey = set_key(current)
        new = [self._slots[0]]
        for cid in order:
            slot = by_id[cid].pop(0)
            orbit = self._load_patch(cid, skey)
            if orbit is not None:
                canonical = self._canonical(slot.chunk_id, slot.input, recompute=True)
                k, v = apply_patch(canonical.k, canonical.v, orbit)
                slot.kv, slot.source = replace(canonical, k=k, v=v), Source.ORBIT
                self.counters.patches_applied += 1
            elif slot.source == Source.PREFILLED:
                slot.source = Source.ROTATED
            new.append(slot)
        self._slots = new
        self._restart()

    @torch.inference_mode()
    def recall(self, chunk_id: str, at: int | None = None) -> ChunkView:
        """Bring an evicted chunk back at window index ``at`` (default: the end)."""
        gone = self._evicted.get(chunk_id)
        if gone is None:
            raise RecallError(f"chunk {chunk_id[:12]} was never evicted from this window")
        index = len(self._slots) if at is None else at
        if not 1 <= index <= len(self._slots):
            raise ValueError(f"recall index must be in 1..{len(self._slots)} (0 is the pinned prefix)")
        stored = self._load_kv(record_key(chunk_id, "conditioned", gone.context_key))
        if stored is not None:
            slot = _Slot(
                chunk_id,
                gone.input,
                stored,
                Source.CONDITIONED,
                gone.context_key,
                dict(gone.meta),
                finalized=True,
            )
            return self._insert_recalled(slot, index)
        canonical = self._canonical(chunk_id, gone.input, recompute=True)
        patch = self._load_patch(chunk_id, gone.context_key)
        slot = _Slot(
            chunk_id,
            gone.input,
            canonical,
            Source.CANONICAL,
            gone.context_key,
            dict(gone.meta),
            finalized=True,
        )
        if patch is not None:
            k, v = apply_patch(canonical.k, canonical.v, patch)
            slot.kv, slot.source = replace(canonical, k=k, v=v), Source.PATCHED
            self.counters.patches_applied += 1
        return self._insert_recalled(slot, index)

    def _insert_recalled(self, slot: _Slot, index: int) -> ChunkView:
        del self._evicted[slot.chunk_id]
        self._slots.insert(index, slot)
        while self.tokens > self.config.budget_tokens:
            victim = next(i for i, s in enumerate(self._slots[1:], 1) if s is not slot)
            self.slide_at(victim)
        self._restart()
        return self.view()[self._slots.index(slot)]

    def slide_at(self, index: int) -> str:
        """Evict the chunk at window ``index`` (not the prefix)."""
        if not 1 <= index < len(self._slots):
            raise ValueError(f"index must be in 1..{len(self._slots) - 1}")
        self._slots.insert(1, self._slots.pop(index))
        return self.slide(1)[0]

    @torch.inference_mode()
    def prepare_orbit(self) -> int:
        """Fit an orbit patch for every chunk of the current set over sampled orderings.

        Runs ``orbit_orderings`` prefills of the whole set (off the path to the next token) so a
        later :meth:`reorder` of this set needs no forward pass. Returns the patches stored.
        """
        slots = self._slots[1:]
        if len(slots) < 2:
            return 0
        skey = set_key(s.chunk_id for s in slots)
        deltas: list[list[Delta]] = [[] for _ in slots]
        canon = [self._canonical(s.chunk_id, s.input, recompute=s.finalized) for s in slots]
        for ordering in sample_orderings(len(slots), self.config.orbit_orderings, seed=len(slots)):
            cache = self.adapter.assemble([self._slots[0].kv.place(0, self.adapter.spec)])
            start = self._slots[0].kv.extent
            for i in ordering:
                out = self.adapter.prefill(slots[i].input, cache, start)
                start += out.kv.extent
                deltas[i].append(Delta(out.kv.k - canon[i].k, out.kv.v - canon[i].v))
        t0 = time.perf_counter()
        for slot, ds in zip(slots, deltas, strict=True):
            self._put(
                record_key(slot.chunk_id, "orbit", skey),
                Entry(fit_orbit(ds, self.config.patch).patch.to_dict()),
            )
        self.counters.fit_ms += 1000 * (time.perf_counter() - t0)
        return len(slots)

    @torch.inference_mode()
    def finalize(self) -> int:
        """Encode the canonical KV and fit the patch of every chunk prefilled since the last call."""
        done = 0
        for slot in self._slots:
            if not slot.finalized:
                self._finalize_slot(slot)
                done += 1
        return done

    # --- assembly -----------------------------------------------------------------------

    @torch.inference_mode()
    def cache(self) -> Any:
        """The model cache holding the window, with every chunk rotated to its start.

        Each chunk's keys are rotated straight into its slice of one window buffer (one pass
        over the keys, one copy of the values); the model cache takes the buffers over.
        """
        if self._cache is not None:
            return self._cache
        t0 = time.perf_counter()
        first = self._slots[0].kv
        total = self.tokens
        k_buf = first.k.new_empty((first.k.shape[0], first.k.shape[1], total, first.k.shape[3]))
        v_buf = first.v.new_empty((first.v.shape[0], first.v.shape[1], total, first.v.shape[3]))
        offset = 0
        for slot in self._slots:
            n = slot.kv.n_tokens
            positions = slot.kv.placed_positions(slot.start)
            k_out = k_buf[:, :, offset : offset + n]
            rotate(slot.kv.k, positions, self.adapter.spec, self.config.rope_kernel, out=k_out)
            v_buf[:, :, offset : offset + n] = slot.kv.v
            if slot.placed_start != slot.start:
                self.counters.tokens_rotated += n
                slot.placed_start = slot.start
            offset += n
        self._cache = self.adapter.cache_from(k_buf, v_buf)
        self.counters.assemblies += 1
        self.counters.assemble_ms += 1000 * (time.perf_counter() - t0)
        return self._cache

    def invalidate(self) -> None:
        """Drop the live cache (e.g. after generating tokens that are not part of the window)."""
        self._cache = None

    # --- internals ----------------------------------------------------------------------

    def _restart(self) -> None:
        start = 0
        for slot in self._slots:
            slot.start = start
            start += slot.kv.extent
        self._cache = None

    def _make_room(self, n_tokens: int) -> None:
        excess = self.tokens + n_tokens - self.config.budget_tokens
        count, freed = 0, 0
        while freed < excess:
            count += 1
            freed += self._slots[count].kv.n_tokens
        if count:
            self.slide(count)

    def _canonical(self, chunk_id: str, chunk: ChunkInput, recompute: bool) -> ChunkKV:
        """The chunk's canonical KV from the store, or encoded alone (and stored) on a miss.

        ``recompute``: a miss means the store lost an entry it had (counted), not a first encode.
        """
        kv = self._load_kv(chunk_id)
        if kv is not None and kv.n_tokens == chunk.n_tokens:
            return kv
        self.counters.recompute_on_miss += int(recompute)
        kv = self.adapter.encode(chunk)
        self.counters.canonical_encodes += 1
        self._put_kv(chunk_id, kv)
        return kv

    def _load_kv(self, key: str) -> ChunkKV | None:
        entry = self.store.get(key)
        if entry is None:
            return None
        t = entry.tensors
        return ChunkKV(t["k"], t["v"], t["positions"], int(entry.meta["extent"]), entry.meta["family"])

    def _put_kv(self, key: str, kv: ChunkKV) -> None:
        meta = {"n_tokens": kv.n_tokens, "extent": kv.extent, "family": kv.family}
        self._put(key, Entry({"k": kv.k, "v": kv.v, "positions": kv.positions}, meta))

    def _finalize_slot(self, slot: _Slot) -> None:
        if slot.finalized:
            return
        if self.config.keep == "conditioned" and slot.source in (Source.PREFILLED, Source.ROTATED):
            self._put_kv(record_key(slot.chunk_id, "conditioned", slot.context_key), slot.kv)
            slot.finalized = True
            return
        canonical = self._canonical(slot.chunk_id, slot.input, recompute=False)
        if slot.source in (Source.PREFILLED, Source.ROTATED):  # unfinalized: conditioned KV
            t0 = time.perf_counter()
            fit = fit_patch(canonical.k, canonical.v, slot.kv.k, slot.kv.v, self.config.patch)
            self.counters.fit_ms += 1000 * (time.perf_counter() - t0)
            self.counters.patches_fitted += 1
            self._put(record_key(slot.chunk_id, "patch", slot.context_key), Entry(fit.patch.to_dict()))
        slot.finalized = True

    def _load_patch(self, chunk_id: str, ctx: str) -> Patch | None:
        kind = "orbit" if ctx.startswith("set-") else "patch"
        entry = self.store.get(record_key(chunk_id, kind, ctx))
        return None if entry is None else Patch.from_dict(dict(entry.tensors))

    def _put(self, key: str, entry: Entry) -> None:
        # too big for every tier, or every tier pinned full: a later miss re-encodes it
        with contextlib.suppress(EntryTooLargeError, TierFullError):
            self.store.put(key, entry)


def _kind(slot: _Slot) -> str:
    if slot.source == Source.PREFIX:
        return "prefix"
    return str(slot.meta.get("kind", "image" if isinstance(slot.input, ImageInput) else "text"))
