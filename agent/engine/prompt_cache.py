"""Content-addressed prompt reuse across chat requests, in one of three reuse modes.

A request's prompt becomes *planning units* (``prompt.py``): one per text token and one per
image, so an image is atomic. An image's unit id is interned from its content key: ids above the
vocabulary, handed out once and never reused (when they run out the indexes start afresh), so
two different images never share an id. Store keys never use those ids: they hash an image by
its content key (``cache.keys.span_key``), so they mean the same thing in every process.

The planner (``cache/planner.py``) cuts the units at piece boundaries and by content-defined
chunking, matches the exact prefix in its radix tree, then looks up each later chunk by content.

**Exact means exact.** A prompt's exact part is stored in *segments* cut at fixed points of the
prompt: multiples of ``block_tokens`` tokens and the edges of every image (:meth:`Prompt.cuts`).
The segments run in as few forward passes as the scheduler's bound and the images allow
(:func:`~agent.engine.prompt.passes`); the prefill attention runs every block of the sequence whole
however a pass cuts it (``agent/adapters/attention.py``), so a prompt's first tokens have the KV of
any prompt that begins with them, whatever was reused and however the passes fell (a model that is
not ``cut_invariant`` runs one pass per segment instead, and reuses whole segments only). What
follows content reused at a moved place or after other antecedents is not exact whatever its
passes, and is prefilled in one. Conditioned KV is stored as the model rotated it
(``ChunkKV.placed_at``), never un-rotated and rotated back. An exact-prefix hit goes on to the
token where the prompts part (``reuse.Finder``: whole segments by their keys, then the leading rows
of an earlier prompt's segment, found in the radix tree or by the pointer a commit leaves after
each exact row, :meth:`PromptCache._write_pointers`), is placed bit for bit, and the rest is
prefilled: the model cache, the logits and the greedy tokens are those of the engine's one-pass
full prefill (``full_prefill.py``). Only KV that is exact in that sense enters the radix tree, so a
prefix hit is never KV computed after approximate reuse.

Modes (``agent/modes.py``, per request, a server default), as this cache runs them:

- ``exact``: only the exact prefix is reused; the answer is the full prefill's, bit for bit.
- ``repair``: the exact prefix, then chunks found by content at moved positions or after other
  antecedents, reused where the piece is large enough to keep its meaning (``min_reuse_tokens``;
  chunks that lay end to end in one earlier prompt and still do count as one piece) and
  repaired by recomputing, through every layer, the share of its tokens whose layer-1 KV
  deviates most from what this context gives them (``repair_ratio``, growing to
  ``repair_max_ratio`` while what it leaves calls for a wider guard margin than
  ``repair_margin``; CacheBlend's signal, computed against the new context, never from this
  prompt's full prefill). Smaller pieces, template fragments among them, are recomputed: their
  KV is mostly conditioning.
- ``fast``: every content hit reused blind (relocated by rotation only).

Stored: each prefill segment's KV under a key of its content *and its whole context*
(``record_key(chain_key(context, span), "exact" | "approx")``), so an entry is the KV of those
tokens after exactly those antecedents, computed exactly or not. A prompt is committed as a
:class:`Record` whose table maps unit spans to (store key, token and position offset in the
entry): reused spans point at the entries they came from, nothing is stored twice. Content keys
carry the tenant's salt (``Namespace.tenant_salt``): tenants never share an entry, a radix root
or an index key. A reused span whose entry was evicted becomes a miss and is prefilled again.

Reused KV and new KV meet in one :class:`~cache.window.Window`, the same the context manager
places its chunks through: reused parts are written into its arena once (copied bit for bit
where they were stored at the same position, moved by ``R(δ)`` elsewhere) and the model writes
the prefilled segments straight after them, so nothing placed is copied again when a miss
follows a hit.

Not here: prompts, segments and keys (``prompt.py``), sampling (``generation.py``), threads
(``runtime.py``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import torch

from agent.adapters import attention, batched
from agent.adapters.base import ImageInput, ModelAdapter
from agent.adapters.vision import VisionAdapter, encoder_calls
from agent.engine.close_calls import CloseCalls
from agent.engine.prompt import (
    NoImagesError,
    Prompt,
    PromptKeys,
    Record,
    TableRow,
    build_prompt,
    cut_back,
    fits,
    ids_upto,
    passes,
    split_pass,
)
from agent.engine.reuse import Finder, after_key, pointer_meta, pointer_rows, read_pointer
from agent.modes import (
    DEFAULT_MODE,
    REPAIR_DEPTH_UNIT,
    REPAIR_MARGIN,
    REPAIR_MARGIN_CAP,
    REPAIR_MAX_RATIO,
    REPAIR_RATIO,
    REPAIR_RESIDUAL_UNIT,
    ReuseMode,
    check_mode,
    depth_unit_for,
    give_up_residual,
    guard_margin,
)
from agent.recompute import DeviationSelection, Repaired, recompute_into
from cache import records
from cache.index import ContentIndex, RadixTree
from cache.keys import Namespace
from cache.layout import ChunkKV
from cache.planner import Plan, Planner, PlannerConfig
from cache.rope import KERNELS
from cache.store import Entry, TieredStore, record_key
from cache.window import Placement, Window

__all__ = [
    "NoImagesError",
    "Prepared",
    "Prompt",
    "PromptCache",
    "PromptCacheConfig",
    "PromptUsage",
    "build_prompt",
]


@dataclass(frozen=True)
class PromptCacheConfig:
    """planner: chunking and verification. max_radix_tokens / max_index_entries bound the two
    indexes (their payloads are small records; the KV itself is in the store's budget).
    rope_kernel: rotation kernel (``cache.rope.KERNELS``). max_tenants: planners kept.
    mode: the default reuse mode (module docstring). block_tokens: prefill segment size, the
    granularity of exact reuse. min_reuse_tokens: ``repair`` recomputes content hits shorter
    than this (a run of hits laid end to end as in the prompt they came from counts whole).
    repair_ratio: share of a repaired piece's tokens recomputed at least; repair_max_ratio: at
    most, the share growing, most deviating first, until the residual left is at most
    repair_residual_unit (where the guard's margin is repair_margin). repair_margin: a
    greedy step on repaired KV whose best two logits lie closer than this moves decoding to the
    exact KV (``answer.py``; 0: never), at a residual (``PromptUsage.repair_residual``, the
    deviation a repair left) of repair_residual_unit; the margin scales with the square root of
    residual / unit, so pieces that bind to new or reordered neighbours need clearer calls to keep
    their repaired KV and pieces barely touched keep theirs (unit 0: the margin as set, always).
    A piece whose repair could not measure (no recompute ran) reports the unit.
    repair_margin_cap: a repair whose residual calls for a larger margin is given up once its
    selection layer has measured it, before any token runs on through the later layers, and the
    prompt is prepared exact at once (0: never given up); a repair whose margin exceeds it once
    its depth is measured is given up then. repair_depth_unit: the depth
    (``PromptUsage.repair_depth``: how the recomputed tokens' deviation grew past the selection
    layer) at which the margin is as the residual sets it; it scales with sqrt(depth / unit)
    (``agent.modes.guard_margin``; 0: the residual alone). repair_must_pay: a repair is also given
    up there when going on is expected to cost more than the exact prefill: the tokens it
    recomputes and those still to prefill on moved KV, plus, with the chance of a close call at its
    guard's margin (read from the cache's recent answers, ``close_calls.py``), that prefill and the
    steps it replays; and not tried at all where even the smallest residual measured lately would
    not pay."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    max_radix_tokens: int = 1 << 20
    max_index_entries: int = 1 << 16
    rope_kernel: str = "auto"
    max_tenants: int = 1024
    mode: ReuseMode = DEFAULT_MODE
    block_tokens: int = 128
    min_reuse_tokens: int = 32
    repair_ratio: float = REPAIR_RATIO
    repair_margin: float = REPAIR_MARGIN
    repair_residual_unit: float = REPAIR_RESIDUAL_UNIT
    repair_margin_cap: float = REPAIR_MARGIN_CAP
    repair_depth_unit: float = REPAIR_DEPTH_UNIT
    repair_max_ratio: float = REPAIR_MAX_RATIO
    repair_must_pay: bool = True

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
        if not 0.0 <= self.repair_margin < float("inf"):
            raise ValueError(f"repair_margin must be a finite number >= 0, got {self.repair_margin}")
        if not 0.0 <= self.repair_residual_unit < float("inf"):
            raise ValueError(
                f"repair_residual_unit must be a finite number >= 0, got {self.repair_residual_unit}"
            )
        if not 0.0 <= self.repair_margin_cap < float("inf"):
            raise ValueError(f"repair_margin_cap must be a finite number >= 0, got {self.repair_margin_cap}")
        if not 0.0 <= self.repair_depth_unit < float("inf"):
            raise ValueError(f"repair_depth_unit must be a finite number >= 0, got {self.repair_depth_unit}")
        if not 0.0 <= self.repair_max_ratio <= 1.0:
            raise ValueError(f"repair_max_ratio must lie in [0, 1], got {self.repair_max_ratio}")

    @property
    def give_up_residual(self) -> float:
        """The residual beyond which the guard's margin would exceed ``repair_margin_cap``."""
        return give_up_residual(self.repair_margin, self.repair_residual_unit, self.repair_margin_cap)


Served = Literal["prefix", "moved", "fallback", "given_up"]
SERVED: tuple[Served, ...] = get_args(Served)


class PromptUsage(NamedTuple):
    """What a prompt reused and recomputed, counting only the KV its answer was computed from
    (after a fallback: the exact pass's). Tokens."""

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
    # prefilled again when a too-close call moved decoding to exact KV, or for a repair given up
    # before decoding: what the exact pass prefilled (the segments the repair attempt had already
    # prefilled exactly are placed, not prefilled again, and count in prefilled_tokens only)
    fallback_tokens: int = 0
    # the deviation from this context that repair measured and left unrecomputed, the largest
    # over its runs (``agent.recompute.Repaired.residual``): what the guard's margin scales with
    repair_residual: float = 0.0
    # how much further the recomputed tokens' deviation went in the later layers than at the
    # selection layer (``agent.recompute.Repaired.depth``), the largest over repair's runs; None
    # where not measured. With the residual, what the guard's margin scales with
    repair_depth: float | None = None
    # how the answer was served (``SERVED``): on exact KV only, on moved KV, on exact KV after a
    # close call moved decoding there, or on exact KV because the repair was given up
    served: Served = "prefix"
    # moved KV that was found and then not answered from (a fallback, a repair given up, or one
    # not tried because it could not pay): counted nowhere else, since the answer did not rest on it
    abandoned_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose cached KV the answer was computed from."""
        return self.prefix_tokens + self.relocated_tokens


def own_exact_prefill(usage: PromptUsage, cached_prefix: int) -> PromptUsage:
    """The usage of an exact pass that followed a repair attempt of the same request: of its
    exact prefix, only ``cached_prefix`` tokens came from earlier prompts; the rest the attempt
    prefilled exactly (and stored), which the answer rests on as prefilled tokens.
    ``fallback_tokens``: what the exact pass prefilled again."""
    own = max(0, usage.prefix_tokens - cached_prefix)
    return usage._replace(
        prefix_tokens=usage.prefix_tokens - own,
        prefilled_tokens=usage.prefilled_tokens + own,
        fallback_tokens=usage.prefilled_tokens,
    )


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
    # the shared tier's copies of the pointer entries this prompt read (``reuse.Finder.pointers``)
    pointers: dict[str, Entry] = field(default_factory=dict)


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
        # prefill passes may join segments where that leaves the KV as one pass writes it
        self._join = adapter.cut_invariant and self.config.block_tokens % attention.BLOCK == 0
        self._image_ids: dict[str, int] = {}
        # the close calls of this cache's recent answers (``answer.py`` adds them): what a repair risks
        self.close_calls = CloseCalls()

    @property
    def depth_unit(self) -> float:
        """The guard's depth unit for this model (``agent.modes.depth_unit_for``: 0 where its
        decode steps take int8 activations)."""
        return depth_unit_for(self.config.repair_depth_unit, self.adapter.quantised_decode)

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
        """The adapter's namespace (weights, dtype, numerics) under a tenant's salt."""
        return self.adapter.namespace(tenant_salt)

    def planner(self, tenant_salt: str) -> Planner:
        planner = self._planners.get(tenant_salt)
        namespace = self.namespace(tenant_salt)
        if planner is None or planner.namespace != namespace:  # numerics changed: threads, products
            planner = Planner(namespace, self.config.planner, self.radix, self.index)
            self._planners[tenant_salt] = planner
            if len(self._planners) > self.config.max_tenants:
                self._planners.popitem(last=False)
        self._planners.move_to_end(tenant_salt)
        return planner

    # --- prepare: plan, fetch, place, prefill the rest segment by segment -----------------

    def prepare(
        self, prompt: Prompt, tenant_salt: str = "", mode: ReuseMode | None = None, steps: int | None = None
    ) -> Prepared:
        """The prompt's model cache and first logits, reusing what ``mode`` allows. ``steps``: the
        most tokens the answer may run to (what a repair's chance of a close call is read over;
        None: as long as recent answers ran)."""
        if len(prompt.units) == 0:
            raise ValueError("empty prompt")
        mode = check_mode(mode or self.config.mode)
        t0 = time.perf_counter()
        planner = self.planner(tenant_salt)
        encoder_before = encoder_calls(self.adapter)
        plan = planner.plan(prompt.units, prompt.piece_unit.tolist())
        keys = PromptKeys(prompt, planner.namespace, prompt.cuts(self.config.block_tokens))
        finder = Finder(self.store, self.config.min_reuse_tokens, to_the_token=self._join)
        chunks = finder.chunks(prompt, plan, keys, mode)
        fetched = finder.prefetch(prompt, plan, keys, mode, chunks)
        plan_steps, lost = finder.steps(prompt, plan, keys, mode, chunks)
        counts = dict.fromkeys(("prefix", "relocated", "prefilled", "rotated", "repaired", "shared"), 0)
        window = Window(self.adapter.spec, self.config.rope_kernel, dims=self.adapter.arena_dims)
        placed: list[Placement] = []  # the window, in order: reused parts and prefilled segments
        repair: list[tuple[int, int]] = []  # reused unit spans to repair
        rows: list[tuple[TableRow, ChunkKV | None]] = []
        exact_rows: list[tuple[TableRow, ChunkKV]] = []  # prefilled exactly by this attempt
        cache: Any = None
        logits: torch.Tensor | None = None
        exact_units = 0
        residual = 0.0
        depth: float | None = None
        given_up: float | None = None
        exact_cost, misses_left, moved = _costs(prompt, plan_steps)
        if mode == "repair" and not self._worth_trying(plan_steps, misses_left, exact_cost, steps):
            return self._exact_instead(
                prompt, tenant_salt, 0.0, encoder_before, moved, prompt.n_tokens - exact_cost
            )
        for i, step in enumerate(plan_steps):
            n_tok = int(prompt.tok_off[step.end] - prompt.tok_off[step.start])
            if step.parts:
                at = int(prompt.pos_off[step.start])
                for kv in step.parts:
                    placed.append(Placement(kv, start=at))
                    at += kv.extent
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
            cache = self.adapter.new_cache(window.sync(placed, prompt.n_tokens))
            if repair:
                # what giving up costs: the exact pass places what this attempt prefilled exactly
                held = sum(kv.n_tokens for _, kv in exact_rows)
                done = self._repair(
                    prompt, cache, repair, self._pays(misses_left[i], exact_cost - held, steps)
                )
                if done.given_up or done.residual > self.config.give_up_residual or self._beyond_cap(done):
                    given_up = done.residual
                    break
                counts["repaired"] += done.tokens
                residual = max(residual, done.residual)
                if done.depth is not None:
                    depth = done.depth if depth is None else max(depth, done.depth)
                repair = []
            exact = exact_units == step.start
            # rows are stored segment by segment (the grain of the stores' keys); the segments run
            # in as few forward passes as a scheduler's bound and the images allow: the attention
            # runs its blocks whole, so a pass cut anywhere writes the KV of one pass
            # (``agent/adapters/attention.py``), and fewer passes read the weights fewer times
            segments = keys.segments(step.start, step.end)
            for group in passes(prompt, segments, batched.pass_tokens, self._join):
                a, b = group[0][0], group[-1][1]
                (inp,) = prompt.inputs_between(a, b)
                at = int(prompt.pos_off[a])
                left = prompt.n_tokens - int(prompt.tok_off[a])
                batched.prefill_left(left, left - inp.n_tokens)
                # the head runs on the last token only: only the prompt's last logits are read
                out = self.adapter.prefill(inp, cache, at, placed=True, last_only=True)
                item = Placement(out.kv, start=at)
                if not window.adopt(item):
                    raise RuntimeError("the model did not write its new tokens into the window")
                placed.append(item)
                for sa, sb, kv in split_pass(prompt, group, out.kv):
                    row = TableRow(sa, sb, keys.store_key(sa, sb, exact), 0, 0, keys.fingerprint(sa, sb))
                    rows.append((row, kv))
                    if exact:
                        exact_rows.append((row, kv))
                counts["prefilled"] += out.kv.n_tokens
                if b == len(prompt.units):
                    logits = out.logits[-1]
            exact_units = step.end if exact else exact_units
        if mode == "repair" and (given_up is not None or counts["relocated"]):
            # an exact pass may follow (a repair given up, a close call): what this attempt
            # prefilled exactly is stored now, so that pass places it instead of prefilling it again
            self._hold(exact_rows)
        if given_up is not None:  # the abandoned attempt's KV let go before the exact one is built
            cache = window = placed = rows = exact_rows = None  # type: ignore[assignment]
            return self._exact_instead(
                prompt, tenant_salt, given_up, encoder_before, counts["relocated"], counts["prefix"]
            )
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
            repair_residual=residual,
            repair_depth=depth,
            served="moved" if counts["relocated"] else "prefix",
        )
        position = int(prompt.pos_off[-1])
        # a prefill's own time: nothing placed by content, nothing repaired, no frame encoded
        if not counts["relocated"] and encoder_calls(self.adapter) == encoder_before:
            self.close_calls.observe_prefill(counts["prefilled"], time.perf_counter() - t0)
        return Prepared(
            cache, logits, position, usage, prompt, plan, planner, rows, exact_units, pointers=finder.pointers
        )

    def _worth_trying(
        self, plan_steps: Sequence[Any], misses_left: list[int], exact: int, steps: int | None
    ) -> bool:
        """Whether to try a repair of the prompt's moved steps: whether it could pay at all, at the
        smallest residual recent repairs measured with nothing recomputed
        (``CloseCalls.worth_trying``). True where there is nothing to repair or the check is off."""
        first = next((i for i, s in enumerate(plan_steps) if s.parts and not s.exact), None)
        if first is None:
            return True
        # the misses before the first moved step are prefilled exactly either way (an exact pass
        # after a repair places them): neither side of the test pays for them
        before = misses_left[0] - misses_left[first]
        pays = self._pays(misses_left[first], exact - before, steps)
        return pays is None or self.close_calls.worth_trying(pays)

    def _pays(self, remaining: int, exact: int, steps: int | None) -> Callable[[float, int], bool] | None:
        """Whether a repair that would leave a residual and recompute some tokens, with
        ``remaining`` tokens still to prefill, is expected to cost less than the ``exact``
        prefill (``close_calls.repair_pays``; ``steps``: the answer's most steps). None (always)
        where the guard never falls back or the check is off."""
        cfg = self.config
        if not cfg.repair_must_pay or cfg.repair_margin <= 0:
            return None
        return self.close_calls.repair_test(
            cfg.repair_margin, cfg.repair_residual_unit, remaining, exact, steps, self.depth_unit
        )

    def _beyond_cap(self, done: Repaired) -> bool:
        """Whether the guard's margin, with the depth the repair measured, exceeds the cap (the
        residual alone was tested at the selection layer, before the depth was known)."""
        cfg = self.config
        if cfg.repair_margin_cap <= 0 or cfg.repair_margin <= 0 or done.depth is None:
            return False
        margin = guard_margin(
            cfg.repair_margin, done.residual, cfg.repair_residual_unit, done.depth, self.depth_unit
        )
        return margin > cfg.repair_margin_cap

    def _hold(self, rows: list[tuple[TableRow, ChunkKV]]) -> None:
        """Store exactly prefilled segments before the prompt is committed (the commit then finds
        them there and writes nothing twice)."""
        for row, kv in rows:
            if row.key not in self.store:
                records.put_kv(self.store, row.key, kv, row.tokens)

    def _exact_instead(
        self,
        prompt: Prompt,
        tenant_salt: str,
        residual: float,
        encoder_before: int,
        abandoned: int,
        cached_prefix: int,
    ) -> Prepared:
        """A repair given up (its residual beyond ``give_up_residual``): the prompt prepared exact,
        its usage in repair mode with the exact prefill counted as a fallback, the ``abandoned``
        moved tokens, and the vision encoder runs of both attempts. The exact pass places what the
        attempt prefilled exactly (:meth:`_hold`); that is counted as prefilled, not as cached:
        only the attempt's own exact prefix (``cached_prefix`` tokens) came from earlier prompts."""
        prepared = self.prepare(prompt, tenant_salt, "exact")
        prepared.usage = own_exact_prefill(prepared.usage, cached_prefix)._replace(
            mode="repair",
            served="given_up",
            abandoned_tokens=abandoned,
            repair_residual=residual,
            vision_encoder_calls=encoder_calls(self.adapter) - encoder_before,
        )
        return prepared

    def _repair(
        self,
        prompt: Prompt,
        cache: Any,
        spans: list[tuple[int, int]],
        pays: Callable[[float, int], bool] | None = None,
    ) -> Repaired:
        """Recompute, through every layer, the most deviating text tokens of the reused ``spans``
        (CacheBlend's layer-1 signal against this context); the cache's KV is replaced in place.
        An image inside or before the spans keeps its reused KV and is read as the model reads it
        (its vision features at its tokens, its M-RoPE positions), so the text next to it is
        repaired all the same. Returns the tokens recomputed and the deviation left; where
        nothing can be recomputed (no ratio, MLA, no text among the spans) nothing is measured
        either, and the residual reported is the unit (the guard's margin as set). ``pays``: asked
        with the residual the choice would leave (the unit, unmeasured) and the tokens it would
        recompute; False gives the repair up before anything runs past the selection layer."""
        ratio = self.config.repair_ratio
        unit = self.config.repair_residual_unit
        adapter = self.adapter

        def unmeasured() -> Repaired:
            return Repaired(0, unit, pays is not None and not pays(unit, 0))

        if ratio <= 0:
            return unmeasured()
        n = adapter.cache_length(cache)
        upto = int(np.searchsorted(prompt.tok_off, n))  # the units the cache holds
        if int(prompt.tok_off[upto]) != n:
            return unmeasured()
        candidates = torch.cat([prompt.text_rows(a, b) for a, b in spans])
        if candidates.numel() == 0:
            return unmeasured()
        inputs: torch.Tensor
        if not prompt.has_image(0, upto):
            if not adapter.supports_recompute:
                return unmeasured()
            inputs, positions = ids_upto(prompt, n), torch.arange(n, dtype=torch.int64)
        else:
            if not isinstance(adapter, VisionAdapter) or adapter.family != "gqa":
                return unmeasured()
            embeds, where, u = [], [], 0
            for inp in prompt.inputs_between(0, upto):
                rel, _ = adapter.chunk_positions(inp)
                embeds.append(adapter.embed(inp))
                where.append(rel + int(prompt.pos_off[u]))
                u += 1 if isinstance(inp, ImageInput) else inp.n_tokens
            inputs, positions = torch.cat(embeds), torch.cat(where, dim=-1)
        selection = DeviationSelection(
            ratio,
            candidates,
            max_residual=self.config.give_up_residual,
            max_ratio=max(ratio, self.config.repair_max_ratio),
            target_residual=self.config.repair_residual_unit,
            pays=pays,
        )
        done = recompute_into(adapter, cache, inputs, positions, selection)
        self.close_calls.add_residual(done.residual)
        self.close_calls.add_depth(done.depth, self.depth_unit)
        return done

    # --- commit: store new segments, index the prompt -----------------------------------

    def commit(self, prepared: Prepared) -> int:
        """Store the KV of every new segment and index the prompt; entries written."""
        if prepared.stored:
            return 0
        prepared.stored = True
        written, refused_at = 0, None  # the first unit whose KV the store refused
        for row, kv in prepared.rows:
            if kv is None or row.key in self.store:
                continue
            ok = records.put_kv(self.store, row.key, kv, row.tokens)
            written += ok
            if not ok and refused_at is None:
                refused_at = row.start
        prompt = prepared.prompt
        record = Record(
            tuple(row for row, _ in prepared.rows),
            prompt.tok_off,
            prompt.pos_off,
            prepared.exact_units,
            prompt.units if refused_at is None else None,  # runs are followed only where all is kept
        )
        written += self._write_aliases(prepared, record)
        whole = self._whole_segments(prepared) if refused_at is None else []
        written += len(whole)
        written += self._write_pointers(prepared, whole)
        # the index points each chunk at this prompt, where it sits beside its neighbours now,
        # unless the store refused some of its KV: then chunks already indexed keep their place,
        # and the radix tree learns the exact prefix only as far as the store holds it
        prefix_len = prepared.exact_units if refused_at is None else min(prepared.exact_units, refused_at)
        prepared.planner.commit(
            prepared.plan, prompt.units, record, prefix_len=prefix_len, refresh=refused_at is None
        )
        excess = self.radix.total_tokens - self.config.max_radix_tokens
        if excess > 0:
            self.radix.evict(excess)
        prepared.rows = []  # the tensors now live in the store (or were refused)
        return written

    def _whole_segments(self, prepared: Prepared) -> list[tuple[TableRow, ChunkKV]]:
        """Each segment of the exact prefix that this prompt finished (its first units reused to
        the token from an earlier prompt, the rest prefilled now), stored whole under its own
        key: the exact KV of units it holds, laid end to end, as a full prefill computes them.
        Another process walking the exact prefix segment by segment then finds it by its key
        wherever its own reuse ended, not only at the unit where this prompt's did. Returns the
        rows stored, with their KV."""
        if not self._join:
            return []
        prompt = prepared.prompt
        ctx = PromptKeys(prompt, prepared.planner.namespace, prompt.cuts(self.config.block_tokens))
        out = []
        for s, e in ctx.segments(0, prepared.exact_units):
            if cut_back(ctx.cuts, e) != e or prompt.has_image(s, e):
                continue
            covering = [(row, kv) for row, kv in prepared.rows if row.start < e and row.end > s]
            if len(covering) < 2 or all(kv is None for _, kv in covering):
                continue  # stored whole by its own key already, or nothing in it made now
            key = ctx.store_key(s, e, exact=True)
            if key in self.store:
                continue
            parts = []
            for row, kv in covering:
                if row.start < s or row.end > e:
                    break
                if kv is None:  # reused: the rows it came from, as placed then
                    held = records.load_kv(self.store, row.key, row.tokens)
                    n = int(prompt.tok_off[row.end] - prompt.tok_off[row.start])
                    if held is None or row.token + n > held.n_tokens:
                        break
                    extent = int(prompt.pos_off[row.end] - prompt.pos_off[row.start])
                    kv = held.sliced(row.token, row.token + n, row.position, extent)
                if kv.placed_at != int(prompt.pos_off[row.start]):
                    break
                parts.append(kv)
            else:
                joined = ChunkKV(
                    torch.cat([p.k.to(parts[0].k.device) for p in parts], dim=2),
                    torch.cat([p.v.to(parts[0].v.device) for p in parts], dim=2),
                    torch.cat(
                        [p.positions.cpu() + (p.placed_at - parts[0].placed_at) for p in parts], dim=-1
                    ).to(parts[0].positions.device),
                    int(prompt.pos_off[e] - prompt.pos_off[s]),
                    parts[0].family,
                    parts[0].placed_at,
                )
                if not fits(prompt, s, e, [joined]):
                    continue
                tokens = ctx.fingerprint(s, e)
                if records.put_kv(self.store, key, joined, tokens):
                    out.append((TableRow(s, e, key, 0, 0, tokens), joined))
        return out

    def _write_pointers(self, prepared: Prepared, whole: list[tuple[TableRow, ChunkKV]]) -> int:
        """For each exact row of text stored now, a pointer after the content before it
        (``reuse.after_key``): where a prompt that parts from this one inside the row finds its
        leading tokens, in this process or another, after a restart too. The row goes first in
        the pointer's list, beside the rows this process's copy and the shared tier's copy (as
        this prompt read it) listed that it does not supersede; written where it was not
        listed first already, so a pointer a replica's write missed (the shared tier away, or
        restarted empty) is written again with the next row it gains. ``whole``: segments
        stored whole now (:meth:`_whole_segments`)."""
        if not self._join:
            return 0
        prompt = prepared.prompt
        ctx = PromptKeys(prompt, prepared.planner.namespace, prompt.cuts(self.config.block_tokens))
        written = 0
        for row, kv in [*whole, *prepared.rows]:
            if kv is None or row.end > prepared.exact_units or prompt.has_image(row.start, row.end):
                continue
            if row.key not in self.store:  # refused
                continue
            key = after_key(ctx, row.start)
            local, shared = self.store.get(key), prepared.pointers.get(key)
            ids = prompt.units[row.start : row.end].astype(np.int64)
            copies = (local, shared) if getattr(self.store, "shared", None) is not None else (local,)
            listed = [read_pointer(e.meta) if e is not None else [] for e in copies]
            if all(rows and rows[0][0] == row.key for rows in listed):
                continue  # first in both already
            meta = pointer_meta((row.key, ids), pointer_rows(local, shared))
            written += records.put(self.store, key, Entry({}, meta))
        return written

    def _write_aliases(self, prepared: Prepared, record: Record) -> int:
        """An alias entry per chunk large enough to be reused by content (no tensors: the rows
        of ``record`` that hold it), so another process finds it by its content key."""
        ctx = PromptKeys(prepared.prompt, prepared.planner.namespace)
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
            written += records.put(self.store, key, Entry({}, meta, tokens=ctx.fingerprint(a, b)))
        return written


def _costs(prompt: Prompt, steps: Sequence[Any]) -> tuple[int, list[int], int]:
    """What an exact prefill of the prompt costs (its tokens after the leading exact steps); per
    step, the tokens the steps from there on prefill (their misses); and the tokens reused by
    content (moved)."""
    sizes = [int(prompt.tok_off[s.end] - prompt.tok_off[s.start]) for s in steps]
    moved = sum(n for s, n in zip(steps, sizes, strict=True) if s.parts and not s.exact)
    lead = 0
    for s, n in zip(steps, sizes, strict=True):
        if not (s.parts and s.exact):
            break
        lead += n
    left, misses = [0] * (len(steps) + 1), 0
    for i in range(len(steps) - 1, -1, -1):
        misses += 0 if steps[i].parts else sizes[i]
        left[i] = misses
    return prompt.n_tokens - lead, left, moved
