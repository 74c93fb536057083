"""The context manager: an ordered window of chunks under a token budget, on a position-free store.

The window starts with a pinned prefix (the system prompt, also the attention sink: never
evicted). The operations and what they cost (docs/DESIGN.md section 5.1):

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

Not here: turning observations into chunks and generating answers (``agent/loop.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter, Prefill
from agent.context_types import (
    ChunkView,
    ContextKeys,
    Counters,
    Ensured,
    Evicted,
    RecallError,
    Slot,
    Source,
    WindowConfig,
    context_key,
    exact_run,
    set_key,
    slot_kind,
)
from agent.keep import Keeper
from agent.recompute import DeviationSelection, Repaired, measure_residual, recompute_into
from cache.layout import ChunkKV
from cache.patch import apply_patch
from cache.store import TieredStore
from cache.window import Window


class _Rows(NamedTuple):
    """The window's inexact chunks as :func:`agent.recompute.recompute_into` reads them."""

    cache: Any
    candidates: torch.Tensor  # sorted cache rows of the chunks
    inputs: torch.Tensor  # [N, hidden]: input embeddings at the candidates' rows
    positions: torch.Tensor  # [N] ([3, N] under M-RoPE): positions at the candidates' rows
    order: torch.Tensor  # [N]: the sequence index of every cache row
    slots: list[Slot]


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
        self._keep = Keeper(adapter, store, config, self.counters)
        self._evicted: dict[str, Evicted] = {}
        self._contexts = ContextKeys()
        prefix_kv = adapter.encode(prefix)
        self.counters.tokens_prefilled += prefix.n_tokens
        pid = adapter.chunk_key(prefix, config.tenant_salt)
        self._slots = [
            Slot(
                kv=prefix_kv,
                chunk_id=pid,
                input=prefix,
                source=Source.PREFIX,
                context_key=context_key([]),
                meta={"kind": "prefix"},
                finalized=True,
            )
        ]
        if self.tokens > config.budget_tokens:
            raise ValueError(
                f"the prefix alone ({self.tokens} tokens) exceeds the budget {config.budget_tokens}"
            )
        self._cache: Any = None
        self._window = Window(adapter.spec, config.rope_kernel, config.headroom_tokens, self._shift_limit())
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
        return self._window.offset + self._end

    @property
    def _end(self) -> int:
        last = self._slots[-1]
        return last.start + last.kv.extent

    def view(self) -> tuple[ChunkView, ...]:
        return tuple(
            ChunkView(s.chunk_id, slot_kind(s), s.kv.n_tokens, s.kv.extent, s.start, s.source, dict(s.meta))
            for s in self._slots
        )

    @property
    def evicted(self) -> tuple[str, ...]:
        return tuple(self._evicted)

    def exact_run(self, chunk_ids: Sequence[str]) -> int:
        """How many chunks after the prefix hold ``chunk_ids`` as a fresh prefill computes them."""
        return exact_run(self._slots, chunk_ids, self._context_keys())

    @property
    def exact(self) -> bool:
        """Every chunk as prefilled here after the chunks now before it, never moved or restored."""
        ids = [s.chunk_id for s in self._slots[1:] if s.source == Source.PREFILLED]
        return len(ids) == len(self._slots) - 1 and self.exact_run(ids) == len(ids)

    def make_room(self, n_tokens: int) -> list[str]:
        """Slide the oldest chunks out until ``n_tokens`` more fit the budget (what appending them
        does first); the ids evicted."""
        before = set(self._evicted)
        self._make_room(n_tokens)
        return [cid for cid in self._evicted if cid not in before]

    def residual(self, layer: int = 1, skip_last: int = 0) -> float | None:
        """How far the window's KV is from what a fresh prefill of the window computes: every
        chunk after the exact leading run (moved, patched, repaired, or computed after other
        chunks) read by the model in the window as it stands, and the deviation of its KV at
        ``layer`` over the energy of its fresh values (CacheBlend's signal, the one chat
        completions' repair measures: ``agent.recompute.measure_residual``). ``skip_last``: the
        newest chunks not measured (just prefilled on this window: their KV is what this window
        computes). 0 where nothing is left to measure; None where the model cannot run on rows
        (MLA, DeepStack vision rows). The window and its live cache are left bit for bit as they
        were; vision features come from the adapter's cache."""
        rows = self._inexact_rows(skip_last)
        if rows is None or layer >= self.adapter.info.n_layers:
            return None
        if rows.candidates.numel() == 0:
            return 0.0
        at = rows.candidates
        hidden = rows.inputs[at.to(rows.inputs.device)]
        try:
            with torch.inference_mode():
                return measure_residual(
                    self.adapter, rows.cache, hidden, at, rows.positions[..., at], layer, order=rows.order
                )
        except TypeError:  # DeepStack vision rows
            return None

    def repair(self, selection: Callable[[torch.Tensor], DeviationSelection]) -> Repaired | None:
        """CacheBlend on the window, as chat completions repair a prompt: the tokens of every
        chunk after the exact leading run are candidates, ``selection(candidates)`` chooses the
        most deviating at its layer and recomputes them through every layer, in the live cache
        (the others keep their KV). The deviation left is returned (``Repaired``); None where
        nothing was measured: every chunk in the exact run, or a model that cannot run on rows. The
        candidates' chunks are marked repaired: their KV in the window is no longer bit for bit
        what they were stored with, so they never count as exact again (``exact_run``); what the
        store keeps of them is unchanged."""
        rows = self._inexact_rows(0)
        if rows is None or rows.candidates.numel() == 0:
            return None
        sel = selection(rows.candidates)
        try:
            with torch.inference_mode():
                done = recompute_into(
                    self.adapter, rows.cache, rows.inputs, rows.positions, sel, order=rows.order
                )
        except TypeError:  # DeepStack vision rows: raised before anything is written
            return None
        for slot in rows.slots:  # their rows ran at least the layers before the selection's
            slot.repaired = True
        self.counters.tokens_repaired += done.tokens
        return done

    def _inexact_rows(self, skip_last: int) -> _Rows | None:
        """The live cache and, for the chunks after the exact leading run (less the newest
        ``skip_last``), their cache rows, their inputs and positions; None where the model cannot
        run on rows."""
        adapter = self.adapter
        if adapter.family != "gqa":
            return None
        slots = self._slots
        inexact = slots[1 + self.exact_run([s.chunk_id for s in slots[1:]]) : len(slots) - skip_last]
        cache = self.cache()
        n = adapter.cache_length(cache)
        empty = torch.zeros(0, dtype=torch.int64)
        if not inexact:
            return _Rows(cache, empty, empty, empty, empty, [])
        offset = self._window.offset
        order = torch.full((n,), n, dtype=torch.int64)  # rows no chunk holds: seen by none
        seq = 0
        for slot in slots:
            for index, count in slot.segs:
                order[index : index + count] = torch.arange(seq, seq + count)
                seq += count
        rows, hidden, where = [], [], []
        for slot in inexact:
            rows.append(torch.cat([torch.arange(index, index + count) for index, count in slot.segs]))
            hidden.append(adapter.embed(slot.input))
            rel, _ = adapter.chunk_positions(slot.input)
            where.append(rel + slot.start + offset)
        at = torch.cat(rows)
        first = torch.cat(hidden)
        inputs = first.new_zeros((n, first.shape[-1]))
        inputs[at.to(inputs.device)] = first
        rel = torch.cat(where, dim=-1)
        positions = rel.new_zeros((*rel.shape[:-1], n))
        positions[..., at] = rel
        return _Rows(cache, at.sort().values, inputs, positions, order, list(inexact))

    def cut(self, keep: int, store: bool = True) -> list[str]:
        """Evict all after the first ``keep`` (newest first; ``store=False``: unstored, no recall)."""
        if not 0 <= keep < len(self._slots):
            raise ValueError(f"can keep 0..{len(self._slots) - 1} chunks, not {keep}")
        if store:
            return [self.slide_at(i) for i in range(len(self._slots) - 1, keep, -1)]
        gone, self._slots = self._slots[keep + 1 :][::-1], self._slots[: keep + 1]
        self.counters.chunks_evicted += len(gone)
        self.counters.slides += bool(gone)
        if gone:
            self._restart()
        return [s.chunk_id for s in gone]

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

    def append_many(
        self, chunks: Sequence[ChunkInput], metas: Sequence[dict[str, Any] | None] | None = None
    ) -> list[str]:
        """Prefill several chunks at the end of the window, as many per forward pass as the
        budget allows (sliding first to make room); each one's KV is exact in context, as if
        appended one by one. Returns their chunk ids, in order."""
        return self._append(chunks, metas, None)[0]

    def append_and_ask(
        self, chunks: Sequence[ChunkInput], metas: Sequence[dict[str, Any] | None], prompt: ChunkInput
    ) -> tuple[list[str], torch.Tensor]:
        """:meth:`append_many`, with ``prompt`` run after the new chunks in their last forward
        pass: their ids and the prompt's last logits. The prompt's KV follows the window in the
        live cache, not a chunk of it (as ``adapter.next_logits`` leaves it)."""
        ids, logits = self._append(chunks, metas, prompt)
        if logits is None:  # the prompt did not run, or the live cache it ran on was dropped
            logits = self.adapter.next_logits(prompt, self.cache(), self.next_start)
        return ids, logits

    @torch.inference_mode()
    def _append(
        self,
        chunks: Sequence[ChunkInput],
        metas: Sequence[dict[str, Any] | None] | None,
        prompt: ChunkInput | None,
    ) -> tuple[list[str], torch.Tensor | None]:
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
        cache, logits = None, None
        i = 0
        while i < len(chunks):
            j, tokens = i, 0
            while j < len(chunks) and tokens + chunks[j].n_tokens <= room:
                tokens += chunks[j].n_tokens
                j += 1
            group = chunks[i:j]
            self._make_room(tokens)
            cache = self.cache()
            if prompt is not None and j == len(chunks):
                kvs, logits = self.adapter.prefill_and_ask(group, prompt, cache, self.next_start)
            else:
                kvs = self.adapter.prefill_many(group, cache, self.next_start)
            self.counters.tokens_prefilled += tokens
            out += [
                self.adopt(chunk, kv, cache, meta)
                for chunk, kv, meta in zip(group, kvs, metas[i:j], strict=True)
            ]
            i = j
        return out, logits if cache is not None and self._cache is cache else None

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
        ctx = self._context_keys()[-1]
        slot = Slot(
            kv=kv,
            chunk_id=self.adapter.chunk_key(chunk, self.config.tenant_salt),
            input=chunk,
            source=Source.PREFILLED,
            context_key=ctx,
            meta=dict(meta or {}),
        )
        slot.start = self._end
        # the model wrote its tokens into the live cache's arena: they stay there
        if cache is None or cache is not self._cache or not self._window.adopt(slot):
            self._cache = cache = None
        self._slots.append(slot)
        if self.tokens > self.config.budget_tokens:
            self._slots.pop()
            self._make_room(kv.n_tokens)
            slot.context_key = self._context_keys()[-1]
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
            self._evicted[slot.chunk_id] = Evicted(slot.chunk_id, slot.input, slot.context_key, slot.meta)
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
        by_id: dict[str, list[Slot]] = {}
        for s in self._slots[1:]:
            by_id.setdefault(s.chunk_id, []).append(s)
        skey = set_key(current)
        new = [self._slots[0]]
        for cid in order:
            slot = by_id[cid].pop(0)
            orbit = self._keep.patch(cid, skey)
            if orbit is not None:
                canonical = self._keep.canonical(slot.chunk_id, slot.input, recompute=True)
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
        stored = self._keep.conditioned(chunk_id, gone.input, gone.context_key)
        if stored is not None:
            slot = Slot(
                kv=stored,
                chunk_id=chunk_id,
                input=gone.input,
                source=Source.CONDITIONED,
                context_key=gone.context_key,
                meta=dict(gone.meta),
                finalized=True,
            )
            return self._insert_recalled(slot, index)
        canonical = self._keep.canonical(chunk_id, gone.input, recompute=True)
        patch = self._keep.patch(chunk_id, gone.context_key)
        slot = Slot(
            kv=canonical,
            chunk_id=chunk_id,
            input=gone.input,
            source=Source.CANONICAL,
            context_key=gone.context_key,
            meta=dict(gone.meta),
            finalized=True,
        )
        if patch is not None:
            k, v = apply_patch(canonical.k, canonical.v, patch)
            slot.kv, slot.source = replace(canonical, k=k, v=v), Source.PATCHED
            self.counters.patches_applied += 1
        return self._insert_recalled(slot, index)

    def _insert_recalled(self, slot: Slot, index: int) -> ChunkView:
        del self._evicted[slot.chunk_id]
        self._slots.insert(index, slot)
        while self.tokens > self.config.budget_tokens:
            victim = next(i for i, s in enumerate(self._slots[1:], 1) if s is not slot)
            self.slide_at(victim)
        self._restart()
        return self.view()[self._slots.index(slot)]

    @torch.inference_mode()
    def ensure(self, chunk: ChunkInput, meta: dict[str, Any] | None = None) -> Ensured:
        """Make ``chunk`` the newest chunk of its kind (``meta["kind"]``, else image or text) in
        the window, with the least work, and say how: ``present`` (it already is), ``moved`` (it
        was behind newer ones of its kind: it leaves and is recalled at the end, with its KV for
        the antecedents it was first seen after), ``recalled`` (it was evicted: back at the end,
        no forward pass) or ``appended`` (never seen: prefilled at the end)."""
        cid = self.adapter.chunk_key(chunk, self.config.tenant_salt)
        kind = str((meta or {}).get("kind", "image" if isinstance(chunk, ImageInput) else "text"))
        same = [i for i, v in enumerate(self.view()) if i and v.kind == kind]
        mine = [i for i in same if self._slots[i].chunk_id == cid]
        if mine and mine[-1] == same[-1]:
            return Ensured(cid, "present")
        if cid in self._evicted:
            self.recall(cid)
            return Ensured(cid, "recalled")
        if mine:
            self.slide_at(mine[-1])
            self.recall(cid)
            return Ensured(cid, "moved")
        self.append(chunk, meta)
        return Ensured(cid, "appended")

    def slide_at(self, index: int) -> str:
        """Evict the chunk at window ``index`` (not the prefix)."""
        if not 1 <= index < len(self._slots):
            raise ValueError(f"index must be in 1..{len(self._slots) - 1}")
        self._slots.insert(1, self._slots.pop(index))
        return self.slide(1)[0]

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

        The window lives in one :class:`~cache.window.Window` kept between calls and brought up
        to date with the least work (a chunk whose place did not change is not touched; one that
        moved has its keys rotated again; a new one fills the room evicted chunks left). The
        whole window may sit at a position ``offset`` (:attr:`offset`): attention depends only on
        relative positions, so after a slide moving the few prefix tokens is cheaper than moving
        every survivor. The model's new tokens are written into the arena's spare room; a cache
        returned earlier refuses to be used once the window changed
        (:class:`~cache.arena.StaleCacheError`).
        """
        if self._cache is not None:
            return self._cache
        t0 = time.perf_counter()
        window = self._window
        rotated, rebuilds = window.tokens_rotated, window.rebuilds
        arena = window.sync(self._slots, self.config.budget_tokens)
        self.counters.tokens_rotated += window.tokens_rotated - rotated
        self.counters.rebuilds += window.rebuilds - rebuilds
        self._cache = self.adapter.new_cache(arena)
        self.counters.assemblies += 1
        self.counters.assemble_ms += 1000 * (time.perf_counter() - t0)
        return self._cache

    @torch.inference_mode()
    def fresh_cache(self) -> tuple[Any, int]:
        """A model cache of the window prefilled afresh from position 0, nothing reused but what
        the adapter keeps by content (vision features); the window is not touched. Returns it and
        the next token's position."""
        return self._keep.fresh_prefill([s.input for s in self._slots])

    def invalidate(self) -> None:
        """Drop the live cache (e.g. after generating tokens that are not part of the window):
        the next :meth:`cache` shows the window alone again, without moving anything."""
        self._cache = None

    @property
    def offset(self) -> int:
        """The window's position shift in the live cache: chunk ``i`` of :meth:`view` carries
        positions from ``view()[i].start + offset`` (see :meth:`cache`, made if needed)."""
        self.cache()
        return self._window.offset

    def placed_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window chunk ``index``'s keys and values as the live cache holds them (copies,
        ``[L, H, T, D]``; keys rotated to ``view()[index].start + offset``)."""
        self.cache()
        return self._window.placed_kv(self._slots[index])

    def _shift_limit(self) -> int:
        if not self.adapter.shift_invariant:
            return 0
        return self.config.budget_tokens if self.config.max_offset is None else self.config.max_offset

    # --- internals ----------------------------------------------------------------------

    def _context_keys(self) -> list[str]:
        """The context key of each prefix of the window (the empty one first)."""
        return self._contexts.prefixes([s.chunk_id for s in self._slots])

    def _restart(self) -> None:
        """Logical starts from 0 in window order; the live cache is remade on next use (and a
        cache taken before refuses to run: it shows a window that no longer is)."""
        self._window.retire()
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

    def _finalize_slot(self, slot: Slot) -> None:
        if slot.finalized:
            return
        if slot.source in (Source.PREFILLED, Source.ROTATED):  # unfinalized: conditioned KV
            self._keep.finalize(slot.chunk_id, slot.input, slot.kv, slot.context_key)
        else:
            self._keep.canonical(slot.chunk_id, slot.input, recompute=False)
        slot.finalized = True
