"""Content-addressed prompt reuse across chat requests, in one of three reuse modes.

A request's prompt (``chat.render``) becomes *planning units*: one per text token and one per
image, so an image is atomic. An image's unit id is interned from its content key: ids above the
vocabulary, handed out once and never reused (when they run out the indexes start afresh), so
two different images never share an id. Store keys never use those ids: they hash an image by
its content key (``cache.keys.span_key``), so they mean the same thing in every process.

The planner (``cache/planner.py``) cuts the units at piece boundaries and by content-defined
chunking, matches the exact prefix in its radix tree, then looks up each later chunk by content.

**Exact means exact.** Every prefill runs in *segments* cut at fixed points of the prompt:
multiples of ``block_tokens`` tokens and the edges of every image (:meth:`Prompt.cuts`), so the
same prompt is always computed by the same forward passes, whatever was reused. Conditioned KV
is stored as the model rotated it (``ChunkKV.placed_at``), never un-rotated and rotated back. An
exact-prefix hit is cut back to the last segment edge, placed bit for bit, and the rest is
prefilled segment by segment: the model cache, the logits and the greedy tokens are those of a
full prefill (which is this same code with nothing reused). Only KV that is exact in that sense
enters the radix tree, so a prefix hit is never KV computed after approximate reuse.

Modes (``ReuseMode``, per request, a server default):

- ``exact``: only the exact prefix is reused; the answer is the full prefill's, bit for bit.
- ``repair``: the exact prefix, then chunks found by content at moved positions or after other
  antecedents, reused where the piece is large enough to keep its meaning (``min_reuse_tokens``)
  and repaired by recomputing, through every layer, the share of its tokens whose layer-1 KV
  deviates most from what this context gives them (``repair_ratio``; CacheBlend's signal,
  computed against the new context, never from this prompt's full prefill). Smaller pieces,
  template fragments among them, are recomputed: their KV is mostly conditioning.
- ``fast``: every content hit reused blind (relocated by rotation only).

Stored: each prefill segment's KV under a key of its content *and its whole context*
(``record_key(chain_key(context, span), "exact" | "approx")``), so an entry is the KV of those
tokens after exactly those antecedents, computed exactly or not. A prompt is committed as a
:class:`Record` whose table maps unit spans to (store key, token and position offset in the
entry): reused spans point at the entries they came from, nothing is stored twice. Content keys
carry the tenant's salt (``Namespace.tenant_salt``): tenants never share an entry, a radix root
or an index key. A reused span whose entry was evicted becomes a miss and is prefilled again.

Not here: sampling (``generation.py``), threads (``runtime.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter, TextInput
from agent.adapters.vision import VisionAdapter, encoder_calls
from agent.server.chat import ImagePiece, Piece, TextPiece
from cache.index import ContentIndex, RadixTree
from cache.keys import ContentKey, Namespace, chain_key, span_key, token_bytes
from cache.layout import ChunkKV, place_window
from cache.planner import Plan, Planner, PlannerConfig
from cache.rope import KERNELS
from cache.store import Entry, EntryTooLargeError, TieredStore, TierFullError, record_key

ReuseMode = Literal["exact", "repair", "fast"]
REUSE_MODES: tuple[ReuseMode, ...] = get_args(ReuseMode)


class NoImagesError(ValueError):
    """The model takes no image input."""


@dataclass(frozen=True)
class Prompt:
    """A prompt as planning units. ``tok_off``/``pos_off`` [U + 1]: tokens and positions before
    each unit (an image's extent is not its token count under M-RoPE)."""

    units: np.ndarray  # [U] int64
    inputs: tuple[ChunkInput, ...]  # one per piece
    piece_unit: np.ndarray  # [P + 1] unit offset of each piece
    tok_off: np.ndarray  # [U + 1]
    pos_off: np.ndarray  # [U + 1]

    @property
    def n_tokens(self) -> int:
        return int(self.tok_off[-1])

    @property
    def n_images(self) -> int:
        return sum(isinstance(i, ImageInput) for i in self.inputs)

    def cuts(self, block_tokens: int) -> np.ndarray:
        """Unit offsets where prefill segments may start and end, sorted: 0, the end, every unit
        that starts on a multiple of ``block_tokens`` tokens, and both edges of every image."""
        starts = self.tok_off[:-1]
        edges = [0, len(self.units), *np.flatnonzero(starts % block_tokens == 0).tolist()]
        for p, inp in enumerate(self.inputs):
            if isinstance(inp, ImageInput):
                edges += [int(self.piece_unit[p]), int(self.piece_unit[p + 1])]
        return np.unique(np.asarray(edges, dtype=np.int64))

    def key_parts(self, a: int, b: int) -> list[np.ndarray | str]:
        """Units [a, b) as ``span_key`` parts: text token ids, images by content key."""
        out: list[np.ndarray | str] = []
        for p, inp in enumerate(self.inputs):
            s, e = int(self.piece_unit[p]), int(self.piece_unit[p + 1])
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                out.append(inp.content_key if isinstance(inp, ImageInput) else self.units[lo:hi])
        return out

    def inputs_between(self, a: int, b: int) -> list[ChunkInput]:
        """Model inputs covering units [a, b): text of adjacent pieces merged, images whole."""
        out: list[ChunkInput] = []
        text: list[torch.Tensor] = []
        for p, inp in enumerate(self.inputs):
            s, e = int(self.piece_unit[p]), int(self.piece_unit[p + 1])
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            if isinstance(inp, ImageInput):
                if text:
                    out.append(_text_input(text))
                    text = []
                out.append(inp)
            else:
                text.append(inp.ids[lo - s : hi - s])
        if text:
            out.append(_text_input(text))
        return out


def _text_input(parts: list[torch.Tensor]) -> ChunkInput:
    return TextInput(torch.cat(parts) if len(parts) > 1 else parts[0])


def build_prompt(adapter: ModelAdapter, pieces: Sequence[Piece], image_unit: Callable[[str], int]) -> Prompt:
    """Pieces to model inputs (images preprocessed, not encoded) and planning units."""
    inputs: list[ChunkInput] = []
    units: list[int] = []
    n_tok: list[int] = []
    ext: list[int] = []
    piece_unit = [0]
    for piece in pieces:
        if isinstance(piece, TextPiece):
            inputs.append(adapter.text(list(piece.ids)))
            units.extend(piece.ids)
            n_tok.extend([1] * len(piece.ids))
            ext.extend([1] * len(piece.ids))
        elif isinstance(piece, ImagePiece):
            if not isinstance(adapter, VisionAdapter):
                raise NoImagesError(f"model {adapter.info.name} takes no image or video input")
            inp = adapter.image(piece.image)
            inputs.append(inp)
            units.append(image_unit(inp.content_key))
            n_tok.append(inp.n_tokens)
            ext.append(adapter.chunk_positions(inp)[1])
        piece_unit.append(len(units))
    return Prompt(
        units=np.asarray(units, dtype=np.int64),
        inputs=tuple(inputs),
        piece_unit=np.asarray(piece_unit, dtype=np.int64),
        tok_off=np.concatenate([[0], np.cumsum(n_tok, dtype=np.int64)]),
        pos_off=np.concatenate([[0], np.cumsum(ext, dtype=np.int64)]),
    )


def concat_kv(parts: Sequence[ChunkKV]) -> ChunkKV:
    """Chunks laid end to end, each starting where the previous one's extent ends. Keys of one
    frame only: all pre-RoPE, or all placed contiguously (the result is placed at the first's)."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [p.extent for p in parts])
    first = parts[0].placed_at
    for p, o in zip(parts, offsets, strict=False):
        if (p.placed_at is None) != (first is None) or (first is not None and p.placed_at != first + int(o)):
            raise ValueError("concat_kv takes chunks of one frame, laid end to end")
    return ChunkKV(
        torch.cat([p.k for p in parts], dim=2),
        torch.cat([p.v for p in parts], dim=2),
        torch.cat([p.positions + int(o) for p, o in zip(parts, offsets, strict=False)], dim=-1),
        int(offsets[-1]),
        parts[0].family,
        first,
    )


class TableRow(NamedTuple):
    """Units [start, end) of a record are the entry at ``key``'s tokens from ``token``, whose
    positions there count from ``position``; ``tokens``: what the whole entry certifies (the
    fingerprint of the units it was computed for, :meth:`_Context.fingerprint`)."""

    start: int
    end: int
    key: str
    token: int
    position: int
    tokens: str


@dataclass(eq=False)
class Record:
    """A committed prompt: where the KV of each unit span lives, its unit offsets, and how many
    leading units hold KV exactly as a full prefill computes it."""

    table: tuple[TableRow, ...]
    tok_off: np.ndarray
    pos_off: np.ndarray
    exact_units: int


@dataclass(frozen=True)
class PromptCacheConfig:
    """planner: chunking and verification. max_radix_tokens / max_index_entries bound the two
    indexes (their payloads are small records; the KV itself is in the store's budget).
    rope_kernel: rotation kernel (``cache.rope.KERNELS``). max_tenants: planners kept.
    mode: the default reuse mode (module docstring). block_tokens: prefill segment size, the
    granularity of exact reuse. min_reuse_tokens: ``repair`` recomputes content hits shorter
    than this. repair_ratio: share of a repaired piece's tokens recomputed."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    max_radix_tokens: int = 1 << 20
    max_index_entries: int = 1 << 16
    rope_kernel: str = "auto"
    max_tenants: int = 1024
    mode: ReuseMode = "repair"
    block_tokens: int = 128
    min_reuse_tokens: int = 32
    repair_ratio: float = 0.15

    def __post_init__(self) -> None:
        if min(self.max_radix_tokens, self.max_index_entries, self.max_tenants, self.block_tokens) < 1:
            raise ValueError("prompt cache bounds must be positive")
        if self.rope_kernel not in KERNELS:
            raise ValueError(f"unknown rope_kernel {self.rope_kernel!r}; choose from {sorted(KERNELS)}")
        check_mode(self.mode)
        if self.min_reuse_tokens < 1:
            raise ValueError(f"min_reuse_tokens must be at least 1, got {self.min_reuse_tokens}")
        if not 0.0 <= self.repair_ratio <= 1.0:
            raise ValueError(f"repair_ratio must lie in [0, 1], got {self.repair_ratio}")


def check_mode(mode: str) -> ReuseMode:
    if mode not in REUSE_MODES:
        raise ValueError(f"unknown reuse mode {mode!r}; choose from {', '.join(REUSE_MODES)}")
    return mode  # type: ignore[return-value]


class PromptUsage(NamedTuple):
    prompt_tokens: int
    prefix_tokens: int  # reused exactly: the exact prefix, placed bit for bit
    relocated_tokens: int  # reused by content (moved, or after other antecedents)
    prefilled_tokens: int
    rotated_tokens: int  # reused tokens whose position changed (δ != 0)
    lost_entries: int  # planned reuse whose store entry was gone (prefilled instead)
    vision_encoder_calls: int
    mode: ReuseMode = "exact"
    repaired_tokens: int = 0  # of relocated_tokens, recomputed through every layer by repair
    shared_tokens: int = 0  # of the reused tokens, those whose KV came from the shared tier (Redis)

    @property
    def cached_tokens(self) -> int:
        return self.prefix_tokens + self.relocated_tokens


class _Step(NamedTuple):
    start: int
    end: int
    kv: ChunkKV | None  # reused KV (placed or pre-RoPE); None for a miss
    refs: tuple[TableRow, ...]  # where the reused KV lives, in this prompt's units
    delta: int
    exact: bool  # the exact prefix


@dataclass
class Prepared:
    """A prefilled prompt: generate from ``logits`` at ``position`` on ``cache``, then commit."""

    cache: Any
    logits: torch.Tensor
    position: int
    usage: PromptUsage
    prompt: Prompt
    plan: Plan
    planner: Planner
    rows: list[tuple[TableRow, ChunkKV | None]]  # the record's table; KV for the rows to store
    exact_units: int
    stored: bool = False


class PromptCache:
    """Plans, assembles and commits prompts of one model on a shared store. One caller at a time."""

    def __init__(
        self, adapter: ModelAdapter, store: TieredStore, config: PromptCacheConfig | None = None
    ) -> None:
        self.adapter, self.store = adapter, store
        self.config = config or PromptCacheConfig()
        self.radix = RadixTree(self.config.planner.eviction)
        self.index = ContentIndex(self.config.planner.verify, self.config.max_index_entries)
        self._planners: OrderedDict[str, Planner] = OrderedDict()
        self._image_base = 1 << max(16, adapter.vocab_size.bit_length())
        self._image_ids: dict[str, int] = {}

    def image_unit(self, content_key: str) -> int:
        """The planning id of an image: one per distinct content key, never reused."""
        unit = self._image_ids.get(content_key)
        if unit is None:
            if len(self._image_ids) >= self._image_base:  # ids used up: forget every index entry
                self.reset()
            unit = self._image_base + len(self._image_ids)
            self._image_ids[content_key] = unit
        return unit

    def reset(self) -> None:
        """Empty the indexes (store entries stay until evicted, unreachable)."""
        self.radix = RadixTree(self.config.planner.eviction)
        self.index = ContentIndex(self.config.planner.verify, self.config.max_index_entries)
        self._planners.clear()
        self._image_ids.clear()

    def namespace(self, tenant_salt: str) -> Namespace:
        info = self.adapter.info
        return Namespace(
            model=info.fingerprint, dtype=str(info.dtype).removeprefix("torch."), tenant_salt=tenant_salt
        )

    def planner(self, tenant_salt: str) -> Planner:
        planner = self._planners.get(tenant_salt)
        if planner is None:
            planner = Planner(self.namespace(tenant_salt), self.config.planner, self.radix, self.index)
            self._planners[tenant_salt] = planner
            if len(self._planners) > self.config.max_tenants:
                self._planners.popitem(last=False)
        self._planners.move_to_end(tenant_salt)
        return planner

    # --- prepare: plan, fetch, place, prefill the rest segment by segment -----------------

    def prepare(self, prompt: Prompt, tenant_salt: str = "", mode: ReuseMode | None = None) -> Prepared:
        """The prompt's model cache and first logits, reusing what ``mode`` allows."""
        if len(prompt.units) == 0:
            raise ValueError("empty prompt")
        mode = check_mode(mode or self.config.mode)
        planner = self.planner(tenant_salt)
        encoder_before = encoder_calls(self.adapter)
        plan = planner.plan(prompt.units, prompt.piece_unit.tolist())
        cuts = prompt.cuts(self.config.block_tokens)
        ctx = _Context(prompt, planner.namespace, cuts)
        fetched = self._prefetch(prompt, plan, ctx, mode)
        steps, lost = self._steps(prompt, plan, ctx, mode)
        counts = dict.fromkeys(("prefix", "relocated", "prefilled", "rotated", "repaired", "shared"), 0)
        pending: list[tuple[ChunkKV, int]] = []  # reused chunks not yet in the model cache
        repair: list[tuple[int, int]] = []  # reused unit spans to repair
        rows: list[tuple[TableRow, ChunkKV | None]] = []
        cache: Any = None
        logits: torch.Tensor | None = None
        exact_units = 0
        for step in steps:
            n_tok = int(prompt.tok_off[step.end] - prompt.tok_off[step.start])
            if step.kv is not None:
                pending.append((step.kv, int(prompt.pos_off[step.start])))
                rows.extend((r, None) for r in step.refs)
                counts["prefix" if step.exact else "relocated"] += n_tok
                if fetched:
                    counts["shared"] += sum(
                        int(prompt.tok_off[r.end] - prompt.tok_off[r.start])
                        for r in step.refs
                        if r.key in fetched
                    )
                counts["rotated"] += n_tok if step.delta else 0
                exact_units = step.end if step.exact else exact_units
                if not step.exact and mode == "repair":
                    repair.append((step.start, step.end))
                continue
            cache = self._with(cache, pending)
            pending = []
            if repair:
                counts["repaired"] += self._repair(prompt, cache, repair)
                repair = []
            exact = exact_units == step.start
            for a, b in ctx.segments(step.start, step.end):
                (inp,) = prompt.inputs_between(a, b)
                last = b == len(prompt.units)
                out = self.adapter.prefill(inp, cache, int(prompt.pos_off[a]), placed=True, last_only=last)
                row = TableRow(a, b, ctx.store_key(a, b, exact), 0, 0, ctx.fingerprint(a, b))
                rows.append((row, out.kv))
                counts["prefilled"] += out.kv.n_tokens
                if last:
                    logits = out.logits[-1]
            exact_units = step.end if exact else exact_units
        if logits is None or cache is None:  # _steps always leaves the last unit a miss
            raise RuntimeError("the prompt's last token was not prefilled")
        usage = PromptUsage(
            prompt_tokens=prompt.n_tokens,
            prefix_tokens=counts["prefix"],
            relocated_tokens=counts["relocated"],
            prefilled_tokens=counts["prefilled"],
            rotated_tokens=counts["rotated"],
            lost_entries=lost,
            vision_encoder_calls=encoder_calls(self.adapter) - encoder_before,
            mode=mode,
            repaired_tokens=counts["repaired"],
            shared_tokens=counts["shared"],
        )
        return Prepared(
            cache, logits, int(prompt.pos_off[-1]), usage, prompt, plan, planner, rows, exact_units
        )

    def _with(self, cache: Any, pending: list[tuple[ChunkKV, int]]) -> Any:
        """``cache`` (None: a new one) with the ``pending`` reused chunks appended, placed."""
        if not pending:
            return cache if cache is not None else self.adapter.empty_cache()
        k, v = place_window(pending, self.adapter.spec, self.config.rope_kernel)
        if cache is None:
            return self.adapter.new_cache([(k, v)])
        self.adapter.append_placed(cache, k, v)
        return cache

    def _repair(self, prompt: Prompt, cache: Any, spans: list[tuple[int, int]]) -> int:
        """Recompute, through every layer, the most deviating tokens of the reused ``spans``
        (CacheBlend's layer-1 signal against this context); the cache's KV is replaced in place.
        Returns the tokens recomputed; 0 where the adapter cannot (images, MLA)."""
        from agent.recompute import DeviationSelection, recompute_into

        ratio = self.config.repair_ratio
        if ratio <= 0 or not self.adapter.supports_recompute:
            return 0
        if any(isinstance(i, ImageInput) for a, b in spans for i in prompt.inputs_between(a, b)):
            return 0
        n = self.adapter.cache_length(cache)
        ids = _ids_upto(prompt, n)
        candidates = torch.cat(
            [torch.arange(int(prompt.tok_off[a]), int(prompt.tok_off[b])) for a, b in spans]
        )
        positions = torch.arange(n, dtype=torch.int64)
        return recompute_into(self.adapter, cache, ids, positions, DeviationSelection(ratio, candidates))

    def _steps(self, prompt: Prompt, plan: Plan, ctx: _Context, mode: ReuseMode) -> tuple[list[_Step], int]:
        """The plan as steps, reused KV fetched: the exact prefix cut back to a segment edge
        (and carried on by the keys of the segments after it, which the store may hold from
        before a restart or from another process), then what ``mode`` reuses by content;
        misses merged; the last unit always a miss."""
        n_units, cuts = len(prompt.units), ctx.cuts
        segments = [(at, seg) for at, seg in _offsets(plan.prefix) if isinstance(seg.payload, Record)]
        limit = min(plan.prefix_len, n_units - 1)
        kv, refs, got = self._fetch_prefix(segments, 0, limit)
        edge = _cut_back(cuts, got)
        lost = int(got < limit and _cut_back(cuts, limit) > edge)
        parts = [kv.sliced(0, int(prompt.tok_off[edge]), 0, int(prompt.pos_off[edge]))] if edge and kv else []
        rows = list(_clip(refs, edge)) if parts else []
        edge = edge if parts else 0
        for a, b in ctx.segments(edge, n_units - 1):
            if b != _cut_back(cuts, b):  # the segment ending before the last unit is not whole
                break
            key = ctx.store_key(a, b, exact=True)
            tokens = ctx.fingerprint(a, b)
            found = self._entry_kv(key, tokens) if key in self.store else None
            if found is None or found.placed_at != int(prompt.pos_off[a]) or not _fits(prompt, a, b, found):
                break
            parts.append(found)
            rows.append(TableRow(a, b, key, 0, 0, tokens))
            edge = b
        steps: list[_Step] = []
        if edge > 0:
            steps.append(_Step(0, edge, concat_kv(parts), tuple(rows), 0, True))
        for c in plan.chunks:
            s, e = max(c.start, edge), min(c.end, n_units)
            if s >= e:
                continue
            if e == n_units:
                e -= 1
            big = prompt.tok_off[e] - prompt.tok_off[s] >= self.config.min_reuse_tokens
            if mode == "exact" or e <= s or not (mode == "fast" or big) or c.status == "prefix-hit":
                steps.append(_Step(s, c.end, None, (), 0, False))
                continue
            reused, delta = None, 0
            if c.status == "relocated-hit" and isinstance(c.payload, Record) and c.source_start is not None:
                src = c.source_start + s - c.start
                reused = self._fetch(c.payload, src, src + e - s, s - src, int(prompt.pos_off[s]))
                delta = c.start - c.source_start
                lost += int(reused is None)
            elif s == c.start:  # not in the indexes: the store may hold it from another process
                alias = self._alias(ctx, c.start, c.end)
                if alias is not None:
                    reused = self._fetch(alias, 0, e - s, s, int(prompt.pos_off[s]))
            if reused is not None and not _fits(prompt, s, e, reused[0]):
                reused = None
            if reused is None:
                steps.append(_Step(s, c.end, None, (), 0, False))
                continue
            steps.append(_Step(s, e, reused[0], reused[1], delta, False))
            if e < c.end:
                steps.append(_Step(e, c.end, None, (), 0, False))
        return _merge_misses(steps), lost

    def _fetch_prefix(
        self, segments: list[tuple[int, Any]], a: int, b: int
    ) -> tuple[ChunkKV | None, list[TableRow], int]:
        """KV of units [a, b) from the radix segments, as far as the store still has it."""
        parts: list[ChunkKV] = []
        refs: list[TableRow] = []
        got = a
        for at, seg in segments:
            lo, hi = max(a, at), min(b, at + seg.length)
            if lo >= hi:
                continue
            if lo != got:
                break
            rec = seg.payload
            src = seg.offset + lo - at
            part = self._fetch(rec, src, seg.offset + hi - at, at - seg.offset, int(rec.pos_off[src]), True)
            if part is None:
                break
            parts.append(part[0])
            refs.extend(part[1])
            got = lo + _units_of(part[1])
            if got < hi:
                break
        return (concat_kv(parts) if parts else None), refs, got

    def _fetch(
        self, rec: Record, a: int, b: int, shift: int, at: int, partial: bool = False
    ) -> tuple[ChunkKV, tuple[TableRow, ...]] | None:
        """KV of units [a, b) of ``rec``, placed to start at position ``at``, and its rows moved
        by ``shift`` units; None if any entry is gone (``partial``: what is there from ``a`` on,
        None if nothing)."""
        parts: list[ChunkKV] = []
        refs: list[TableRow] = []
        for row in rec.table:
            if row.end <= a or row.start >= b:
                continue
            lo, hi = max(a, row.start), min(b, row.end)
            kv = self._entry_kv(row.key, row.tokens)
            t0 = row.token + int(rec.tok_off[lo] - rec.tok_off[row.start])
            t1 = t0 + int(rec.tok_off[hi] - rec.tok_off[lo])
            if kv is None or t1 > kv.n_tokens or (parts and lo != refs[-1].end - shift):
                if partial and parts:
                    break
                return None
            p0 = row.position + int(rec.pos_off[lo] - rec.pos_off[row.start])
            parts.append(kv.sliced(t0, t1, p0, int(rec.pos_off[hi] - rec.pos_off[lo])))
            refs.append(TableRow(lo + shift, hi + shift, row.key, t0, p0, row.tokens))
        if not parts or (not partial and refs[-1].end - shift != b) or refs[0].start - shift != a:
            return None
        return self._join(parts, at), tuple(refs)

    def _join(self, parts: list[ChunkKV], at: int) -> ChunkKV:
        """Parts laid end to end as one chunk placed at ``at``: each part already placed there is
        kept bit for bit, others are moved straight from their own frame (one rotation each)."""
        from cache.rope import relocate, rotate

        spec, kernel = self.adapter.spec, self.config.rope_kernel
        out, offset = [], 0
        for kv in parts:
            target = at + offset
            if kv.placed_at is None:
                k = rotate(kv.k, kv.placed_positions(target), spec, kernel)
            elif kv.placed_at != target:
                k = relocate(kv.k, target - kv.placed_at, spec, kernel)
            else:
                k = kv.k
            out.append(ChunkKV(k, kv.v, kv.positions, kv.extent, kv.family, target))
            offset += kv.extent
        return concat_kv(out)

    def _prefetch(self, prompt: Prompt, plan: Plan, ctx: _Context, mode: ReuseMode) -> frozenset[str]:
        """Two round trips to the store's shared tier (Redis), for what this prompt may reuse and
        no local tier holds: the keys of its exact prefix's segments and of the rows its radix
        and content hits point at, the aliases of its misses, then the rows those aliases point
        at. Returns the keys brought in (another replica's work)."""
        if getattr(self.store, "shared", None) is None:
            return frozenset()
        n_units = len(prompt.units)
        keys = [
            ctx.store_key(a, b, exact=True)
            for a, b in ctx.segments(0, n_units - 1)
            if b == _cut_back(ctx.cuts, b)
        ]
        for _, seg in _offsets(plan.prefix):
            if isinstance(seg.payload, Record):
                keys += [
                    r.key
                    for r in seg.payload.table
                    if r.end > seg.offset and r.start < seg.offset + seg.length
                ]
        aliases = []
        for c in plan.chunks:
            if mode == "exact":
                break
            if c.status == "relocated-hit" and isinstance(c.payload, Record) and c.source_start is not None:
                lo, hi = c.source_start, c.source_start + c.n_tokens
                keys += [r.key for r in c.payload.table if r.end > lo and r.start < hi]
            elif c.status == "miss":
                aliases.append(record_key(ctx.content_key(c.start, c.end).hex, "alias"))
        fetched = set(self.store.prefetch([*keys, *aliases]))
        rows = []
        for key in aliases:
            entry = self.store.get(key) if key in fetched else None
            if entry is not None:
                rows += [str(r[2]) for r in entry.meta.get("rows", ()) if isinstance(r, list) and len(r) > 2]
        if rows:
            fetched |= self.store.prefetch(rows)
        return frozenset(fetched)

    def _alias(self, ctx: _Context, a: int, b: int) -> Record | None:
        """The stored alias of units [a, b) by their content alone: where some prompt, in this
        process or another, keeps their KV (computed after its own antecedents)."""
        entry = self.store.get(record_key(ctx.content_key(a, b).hex, "alias"), ctx.fingerprint(a, b))
        if entry is None:
            return None
        meta = entry.meta
        try:
            table = tuple(
                TableRow(int(r[0]), int(r[1]), str(r[2]), int(r[3]), int(r[4]), str(r[5]))
                for r in meta["rows"]
            )
            tok, pos = np.asarray(meta["tok_off"], np.int64), np.asarray(meta["pos_off"], np.int64)
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        if len(tok) != b - a + 1 or len(pos) != b - a + 1:
            return None
        return Record(table, tok, pos, 0)

    def _entry_kv(self, key: str, tokens: str) -> ChunkKV | None:
        """The KV filed under ``key``, if the store has it and it certifies ``tokens``."""
        entry = self.store.get(key, tokens)
        if entry is None:
            return None
        t, meta = entry.tensors, entry.meta
        at = meta.get("placed_at")
        return ChunkKV(
            t["k"],
            t["v"],
            t["positions"],
            int(meta["extent"]),
            meta["family"],
            None if at is None else int(at),
        )

    # --- commit: store new segments, index the prompt -----------------------------------

    def commit(self, prepared: Prepared) -> int:
        """Store the KV of every new segment and index the prompt; entries written."""
        if prepared.stored:
            return 0
        prepared.stored = True
        written = 0
        for row, kv in prepared.rows:
            if kv is None or row.key in self.store:
                continue
            entry = Entry(
                {"k": kv.k, "v": kv.v, "positions": kv.positions},
                {
                    "n_tokens": kv.n_tokens,
                    "extent": kv.extent,
                    "family": kv.family,
                    "placed_at": kv.placed_at,
                },
                tokens=row.tokens,
            )
            with contextlib.suppress(EntryTooLargeError, TierFullError):
                self.store.put(row.key, entry)
                written += 1
        prompt = prepared.prompt
        record = Record(
            tuple(row for row, _ in prepared.rows), prompt.tok_off, prompt.pos_off, prepared.exact_units
        )
        written += self._write_aliases(prepared, record)
        prepared.planner.commit(prepared.plan, prompt.units, record, prefix_len=prepared.exact_units)
        excess = self.radix.total_tokens - self.config.max_radix_tokens
        if excess > 0:
            self.radix.evict(excess)
        prepared.rows = []  # the tensors now live in the store (or were refused)
        return written

    def _write_aliases(self, prepared: Prepared, record: Record) -> int:
        """An alias entry per chunk large enough to be reused by content (no tensors: the rows
        of ``record`` that hold it), so another process finds it by its content key."""
        ctx = _Context(prepared.prompt, prepared.planner.namespace, np.zeros(1, np.int64))
        written = 0
        for c in prepared.plan.chunks:
            a, b = c.start, c.end
            if (
                c.status == "relocated-hit"
                or record.tok_off[b] - record.tok_off[a] < self.config.min_reuse_tokens
            ):
                continue
            key = record_key(ctx.content_key(a, b).hex, "alias")
            if key in self.store:
                continue
            rows = [
                [
                    max(r.start, a) - a,
                    min(r.end, b) - a,
                    r.key,
                    r.token + int(record.tok_off[max(r.start, a)] - record.tok_off[r.start]),
                    r.position + int(record.pos_off[max(r.start, a)] - record.pos_off[r.start]),
                    r.tokens,
                ]
                for r in record.table
                if r.end > a and r.start < b
            ]
            meta = {
                "rows": rows,
                "tok_off": (record.tok_off[a : b + 1] - record.tok_off[a]).tolist(),
                "pos_off": (record.pos_off[a : b + 1] - record.pos_off[a]).tolist(),
            }
            with contextlib.suppress(EntryTooLargeError, TierFullError):
                self.store.put(key, Entry({}, meta, tokens=ctx.fingerprint(a, b)))
                written += 1
        return written


class _Context:
    """Segments and context-chained store keys of one prompt."""

    def __init__(self, prompt: Prompt, namespace: Namespace, cuts: np.ndarray) -> None:
        self.prompt, self.namespace, self.cuts = prompt, namespace, cuts
        self._chain: dict[int, ContentKey | None] = {0: None}

    def segments(self, a: int, b: int) -> list[tuple[int, int]]:
        inner = self.cuts[(self.cuts > a) & (self.cuts < b)].tolist()
        edges = [a, *inner, b]
        return list(itertools.pairwise(edges))

    def _span(self, a: int, b: int) -> ContentKey:
        return span_key(self.namespace, self.prompt.key_parts(a, b))

    def fingerprint(self, a: int, b: int) -> str:
        """What an entry of units [a, b) certifies: their token ids and images' content keys."""
        h = hashlib.blake2b(digest_size=16, person=b"kamera-entry")
        for part in self.prompt.key_parts(a, b):
            h.update(b"i" + part.encode() if isinstance(part, str) else b"t" + token_bytes(part))
        return h.hexdigest()

    def content_key(self, a: int, b: int) -> ContentKey:
        """Key of units [a, b) by their content alone (images by content key)."""
        return self._span(a, b)

    def context(self, a: int) -> ContentKey | None:
        """Key of units [0, a): chained over the segment edges, so it depends on content only."""
        c = int(self.cuts[np.searchsorted(self.cuts, a, side="right") - 1])
        if c not in self._chain:
            i = int(np.searchsorted(self.cuts, c))
            known = max(j for j in range(i + 1) if int(self.cuts[j]) in self._chain)
            for j in range(known, i):
                lo, hi = int(self.cuts[j]), int(self.cuts[j + 1])
                self._chain[hi] = chain_key(self._chain[lo], self._span(lo, hi))
        base = self._chain[c]
        return base if c == a else chain_key(base, self._span(c, a))

    def store_key(self, a: int, b: int, exact: bool) -> str:
        key = chain_key(self.context(a), self._span(a, b))
        return record_key(key.hex, "exact" if exact else "approx")


def _offsets(segments: Sequence[Any]) -> list[tuple[int, Any]]:
    out, at = [], 0
    for seg in segments:
        out.append((at, seg))
        at += seg.length
    return out


def _units_of(rows: Sequence[TableRow]) -> int:
    return sum(r.end - r.start for r in rows)


def _clip(rows: Sequence[TableRow], end: int) -> tuple[TableRow, ...]:
    return tuple(r if r.end <= end else r._replace(end=end) for r in rows if r.start < end)


def _cut_back(cuts: np.ndarray, at: int) -> int:
    return int(cuts[np.searchsorted(cuts, at, side="right") - 1])


def _fits(prompt: Prompt, s: int, e: int, kv: ChunkKV) -> bool:
    return bool(
        kv.n_tokens == prompt.tok_off[e] - prompt.tok_off[s]
        and kv.extent == prompt.pos_off[e] - prompt.pos_off[s]
    )


def _merge_misses(steps: list[_Step]) -> list[_Step]:
    out: list[_Step] = []
    for st in steps:
        if st.kv is None and out and out[-1].kv is None and out[-1].end == st.start:
            out[-1] = out[-1]._replace(end=st.end)
        else:
            out.append(st)
    return out


def _ids_upto(prompt: Prompt, n_tokens: int) -> torch.Tensor:
    parts = [inp.ids for inp in prompt.inputs]
    return torch.cat(parts)[:n_tokens] if parts else torch.zeros(0, dtype=torch.int64)


def elapsed_ms(t0: float) -> float:
    return 1000 * (time.perf_counter() - t0)
