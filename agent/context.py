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
from cache.arena import KVArena
from cache.layout import ChunkKV
from cache.orbit import Delta, fit_orbit, sample_orderings
from cache.patch import Patch, PatchConfig, apply_patch, fit_patch
from cache.rank import rank_strategy
from cache.rope import KERNELS, rotate_many
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
    and stored. rope_kernel: rotation kernel name (``cache.rope.KERNELS``). headroom_tokens: spare
    room kept after the window in its buffer for a step's new tokens (it grows if a step needs
    more). max_offset: the largest position shift of the window in the live cache (default: the
    budget; 0 keeps the window at position 0, rotating survivors on every slide). orbit_orderings:
    orderings sampled per orbit fit. keep: what an evicted chunk leaves in the store:
    ``canonical+patch`` (its canonical KV, shared by every context it appears in, plus a small
    patch for its antecedents; one extra forward pass of the chunk alone) or ``conditioned``
    (its KV as computed in the window: exact on recall, no extra pass, but one full entry per
    context; for streams such as video where content rarely repeats in another context)."""

    budget_tokens: int = 4096
    patch: PatchConfig = field(default_factory=lambda: PatchConfig(rank=rank_strategy("fixed", rank=16)))
    rope_kernel: str = "auto"
    headroom_tokens: int = 256
    max_offset: int | None = None
    orbit_orderings: int = 4
    tenant_salt: str = ""
    keep: str = "canonical+patch"

    def __post_init__(self) -> None:
        if self.keep not in ("canonical+patch", "conditioned"):
            raise ValueError(f"keep must be 'canonical+patch' or 'conditioned', got {self.keep!r}")
        if self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be positive, got {self.budget_tokens}")
        if self.headroom_tokens < 0 or (self.max_offset is not None and self.max_offset < 0):
            raise ValueError("headroom_tokens and max_offset must not be negative")
        if self.orbit_orderings < 1:
            raise ValueError("orbit_orderings must be at least 1")
        if self.rope_kernel not in KERNELS:
            raise ValueError(f"unknown rope_kernel {self.rope_kernel!r}; choose from {sorted(KERNELS)}")


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
    rebuilds: int = 0
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


@dataclass(eq=False)  # a slot is itself: the same chunk may sit in the window twice
class _Slot:
    chunk_id: str
    input: ChunkInput
    kv: ChunkKV  # pre-RoPE KV this window uses for the chunk
    source: Source
    context_key: str  # the antecedents it was prefilled after (its patch's key)
    meta: dict[str, Any]
    start: int = 0
    placed_start: int | None = None  # the position its keys carry in the arena (None: not written)
    segs: list[tuple[int, int]] = field(default_factory=list)  # (arena index, tokens), in token order
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
        prefix_kv = adapter.encode(prefix)
        self.counters.tokens_prefilled += prefix.n_tokens
        pid = adapter.chunk_key(prefix, config.tenant_salt)
        self._slots = [
            _Slot(pid, prefix, prefix_kv, Source.PREFIX, context_key([]), {"kind": "prefix"}, finalized=True)
        ]
        if self.tokens > config.budget_tokens:
            raise ValueError(
                f"the prefix alone ({self.tokens} tokens) exceeds the budget {config.budget_tokens}"
            )
        self._cache: Any = None
        self._arena: KVArena | None = None
        self._holders: list[_Slot] = []  # slots whose tokens are in the arena
        self._used = 0  # arena tokens the window occupies
        self._base = 0  # the window's position shift in the arena
        self._restart()

    # --- views --------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return sum(s.kv.n_tokens for s in self._slots)

    @property
    def next_start(self) -> int:
        """The position the next token takes in the live cache (:meth:`cache`, made if needed):
        the window's end plus :attr:`offset`."""
        self.cache()
        return self._base + self._end

    @property
    def _end(self) -> int:
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
    def append_many(
        self, chunks: Sequence[ChunkInput], metas: Sequence[dict[str, Any] | None] | None = None
    ) -> list[str]:
        """Prefill several chunks at the end of the window, as many per forward pass as the
        budget allows (sliding first to make room); each one's KV is exact in context, as if
        appended one by one. Returns their chunk ids, in order."""
        metas = list(metas) if metas is not None else [None] * len(chunks)
        if len(metas) != len(chunks):
            raise ValueError(f"{len(chunks)} chunks but {len(metas)} metadata entries")
        room = self.config.budget_tokens - self._slots[0].kv.n_tokens
        for chunk in chunks:
            if chunk.n_tokens > room:
                raise ValueError(
                    f"a {chunk.n_tokens}-token chunk cannot fit a {self.config.budget_tokens}-token window"
                )
        out: list[str] = []
        i = 0
        while i < len(chunks):
            j, tokens = i, 0
            while j < len(chunks) and tokens + chunks[j].n_tokens <= room:
                tokens += chunks[j].n_tokens
                j += 1
            group = chunks[i:j]
            self._make_room(tokens)
            cache = self.cache()
            kvs = self.adapter.prefill_many(group, cache, self.next_start)
            self.counters.tokens_prefilled += tokens
            out += [
                self.adopt(chunk, kv, cache, meta)
                for chunk, kv, meta in zip(group, kvs, metas[i:j], strict=True)
            ]
            i = j
        return out

    @torch.inference_mode()
    def adopt(self, chunk: ChunkInput, kv: ChunkKV, cache: Any, meta: dict[str, Any] | None = None) -> str:
        """Record a chunk already prefilled into the live ``cache`` at :attr:`next_start`;
        returns its chunk id.

        If it does not fit, the oldest chunks slide out first and the live cache is rebuilt
        on next use; a chunk larger than the whole budget is refused with ``ValueError``.
        """
        if kv.n_tokens + self._slots[0].kv.n_tokens > self.config.budget_tokens:
            self._cache = None
            raise ValueError(
                f"a {kv.n_tokens}-token chunk cannot fit a {self.config.budget_tokens}-token window"
            )
        ctx = context_key(s.chunk_id for s in self._slots)
        slot = _Slot(
            self.adapter.chunk_key(chunk, self.config.tenant_salt),
            chunk,
            kv,
            Source.PREFILLED,
            ctx,
            dict(meta or {}),
        )
        slot.start = self._end
        if self._is_next_in_arena(cache, kv):  # they stay where the model wrote them
            slot.segs, slot.placed_start = [(self._used, kv.n_tokens)], self._base + slot.start
            self._used += kv.n_tokens
            self._holders.append(slot)
        else:
            self._cache = cache = None
        self._slots.append(slot)
        if self.tokens > self.config.budget_tokens:
            self._slots.pop()
            self._make_room(kv.n_tokens)
            slot.context_key = context_key(s.chunk_id for s in self._slots)
            slot.start, slot.source = self._end, Source.ROTATED  # moved by the slide
            self._slots.append(slot)
            cache = None
        self._cache = cache
        return slot.chunk_id

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
                slot.placed_start = None  # new KV: its keys and values are written again
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
            cache = self.adapter.new_cache([self._slots[0].kv.place(0, self.adapter.spec)])
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
        """The model cache holding the window, every chunk's keys rotated to its place.

        The window lives in one :class:`~cache.arena.KVArena` that is kept between calls and
        brought up to date with the least work: a chunk whose place did not change is not
        touched; one that moved has its keys rotated again from its pre-RoPE KV (its values
        stay where they are); a new one is written into the room left by evicted chunks (or
        after the last one), and the holes that remain are filled from the arena's physical end.
        Since every cached token is visible to every new query, the tokens' physical order does
        not matter, only their rotation. The whole window may sit at a position ``offset``
        (:attr:`offset`): attention depends only on relative positions, so shifting the window
        by a constant changes nothing, and after a slide moving the few prefix tokens is cheaper
        than moving every survivor. The model's new tokens are written into the arena's spare
        room; a cache returned earlier refuses to be used once the window changed
        (:class:`~cache.arena.StaleCacheError`).
        """
        if self._cache is not None:
            return self._cache
        t0 = time.perf_counter()
        if not self._sync():
            self._rebuild()
        assert self._arena is not None
        self._arena.reset(self._used)
        self._cache = self.adapter.new_cache(self._arena)
        self.counters.assemblies += 1
        self.counters.assemble_ms += 1000 * (time.perf_counter() - t0)
        return self._cache

    def invalidate(self) -> None:
        """Drop the live cache (e.g. after generating tokens that are not part of the window):
        the next :meth:`cache` shows the window alone again, without moving anything."""
        self._cache = None

    def _is_next_in_arena(self, cache: Any, kv: ChunkKV) -> bool:
        """Whether ``kv``'s tokens are the live cache's next ones after the window (the model
        wrote them there): their values, copied out unchanged, are checked at both ends."""
        arena, n, at = self._arena, kv.n_tokens, self._used
        if cache is None or cache is not self._cache or arena is None:
            return False
        if min(arena.lengths) < at + n:
            return False
        return all(
            torch.equal(arena.v[layer, :, at + t], kv.v[layer, :, t])
            for layer in (0, arena.n_layers - 1)
            for t in (0, n - 1)
        )

    @property
    def offset(self) -> int:
        """The window's position shift in the live cache: chunk ``i`` of :meth:`view` carries
        positions from ``view()[i].start + offset`` (see :meth:`cache`, made if needed)."""
        self.cache()
        return self._base

    def placed_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window chunk ``index``'s keys and values as the live cache holds them (copies,
        ``[L, H, T, D]``; keys rotated to ``view()[index].start + offset``)."""
        self.cache()
        slot = self._slots[index]
        assert self._arena is not None
        ks = [self._arena.k[:, :, p : p + n] for p, n in slot.segs]
        vs = [self._arena.v[:, :, p : p + n] for p, n in slot.segs]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def _shift_limit(self) -> int:
        if not self.adapter.shift_invariant:
            return 0
        return self.config.budget_tokens if self.config.max_offset is None else self.config.max_offset

    def _new_arena(self, tokens: int) -> KVArena:
        first = self._slots[0].kv
        return KVArena(
            first.k.shape[0],
            (first.k.shape[1], first.k.shape[3]),
            (first.v.shape[1], first.v.shape[3]),
            tokens + self.config.headroom_tokens,
            first.k.dtype,
            first.k.device,
        )

    def _rebuild(self) -> None:
        """Every chunk written afresh, in window order from physical 0, at offset 0."""
        total = self.tokens
        if self._arena is None or self._arena.capacity < total + self.config.headroom_tokens:
            self._arena = self._new_arena(max(total, self.config.budget_tokens))
        offset = 0
        for slot in self._slots:
            slot.segs, slot.placed_start = [(offset, slot.kv.n_tokens)], None
            offset += slot.kv.n_tokens
        self._holders, self._used, self._base = list(self._slots), offset, 0
        self.counters.rebuilds += 1
        self._write()

    def _sync(self) -> bool:
        """Bring the arena up to the window in place; False when a rebuild is the better way."""
        arena = self._arena
        if arena is None:
            return False
        live = {id(s) for s in self._slots}
        holes: list[tuple[int, int]] = []
        for slot in self._holders:
            if id(slot) not in live:
                holes += slot.segs
                slot.segs, slot.placed_start = [], None
        # the offset most tokens already sit at (within the allowed shift)
        votes: dict[int, int] = {}
        for slot in self._slots:
            if slot.segs and slot.placed_start is not None:
                b = slot.placed_start - slot.start
                votes[b] = votes.get(b, 0) + slot.kv.n_tokens
        limit = self._shift_limit()
        valid = {b: w for b, w in votes.items() if 0 <= b <= limit}
        base = max(valid, key=lambda b: (valid[b], -b)) if valid else 0
        # new chunks go into the holes first, then after the last used token
        holes = _merge(holes)
        used = self._used
        for slot in self._slots:
            if slot.segs:
                continue
            need, segs = slot.kv.n_tokens, []
            while need and holes:
                h, n = holes.pop(0)
                take = min(n, need)
                segs.append((h, take))
                need -= take
                if n > take:
                    holes.insert(0, (h + take, n - take))
            if need:
                segs.append((used, need))
                used += need
            slot.segs, slot.placed_start = segs, None
        arena.reserve(used + self.config.headroom_tokens)
        used = self._compact(holes, used)
        if sum(len(s.segs) for s in self._slots) > 2 * len(self._slots) + 16:
            return False  # too fragmented: one contiguous rewrite is cheaper from here on
        self._holders, self._used, self._base = list(self._slots), used, base
        self._write()
        return True

    def _compact(self, holes: list[tuple[int, int]], used: int) -> int:
        """Fill ``holes`` (sorted, disjoint, below ``used``) with tokens from the physical end."""
        assert self._arena is not None
        ends: dict[int, _Slot] = {p + n: s for s in self._slots for p, n in s.segs}
        while holes:
            h, n = holes[-1]
            if h + n >= used:  # a hole at the end: just give it up
                holes.pop()
                used = min(used, h)
                continue
            h, n = holes[0]
            owner = ends.pop(used)
            i = next(j for j, (p, m) in enumerate(owner.segs) if p + m == used)
            p, m = owner.segs[i]
            take = min(m, n)
            if owner.placed_start is not None:  # its data is valid: move it (else it is rewritten anyway)
                self._arena.move(used - take, h, take)
            owner.segs[i : i + 1] = [seg for seg in ((p, m - take), (h, take)) if seg[1]]
            if m > take:
                ends[used - take] = owner
            ends[h + take] = owner
            used -= take
            holes[0:1] = [(h + take, n - take)] if n > take else []
        return used

    def _write(self) -> None:
        """Rotate every chunk whose keys are not at its place (values too for new ones)."""
        assert self._arena is not None
        rotations = []
        for slot in self._slots:
            at = self._base + slot.start
            if slot.placed_start == at:
                continue
            positions = slot.kv.placed_positions(at)
            values = slot.placed_start is None
            t = 0
            for p, n in slot.segs:
                out = self._arena.k[:, :, p : p + n]
                rotations.append((slot.kv.k[:, :, t : t + n], positions[..., t : t + n], out))
                if values:
                    self._arena.v[:, :, p : p + n] = slot.kv.v[:, :, t : t + n]
                t += n
            slot.placed_start = at
            self.counters.tokens_rotated += slot.kv.n_tokens
        rotate_many(rotations, self.adapter.spec, self.config.rope_kernel)

    # --- internals ----------------------------------------------------------------------

    def _restart(self) -> None:
        """Logical starts from 0 in window order; the live cache is remade on next use (and a
        cache taken before refuses to run: it shows a window that no longer is)."""
        if self._arena is not None:
            self._arena.retire()
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


def _merge(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ``(start, length)`` ranges with touching ones joined."""
    out: list[tuple[int, int]] = []
    for p, n in sorted(segments):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((p, n))
    return out
