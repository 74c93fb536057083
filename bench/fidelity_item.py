"""One fidelity item: its prompt, the reference full prefill, and every method's context scored
against it (see ``fidelity.py`` for the methods and metrics).

Not here: pooling items, tables, plots (``fidelity_report.py``); the CLI (``fidelity.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from agent.adapters.base import ModelAdapter
from agent.engine.generation import SamplingParams, decode
from agent.engine.prompt_cache import PromptCacheConfig
from agent.modes import guard_margin
from agent.recompute import DeviationSelection, FixedSelection, selective_recompute
from bench.answers import Codec, exact_match, token_f1
from bench.consistency import gap_error
from bench.fidelity_data import QAItem
from bench.methods import (
    KV_STORAGE_BYTES,
    FullPrefill,
    Placed,
    concat_kv,
    delta,
    full_prefill,
    kl_rows,
    orbit_patch_and_place,
    patch_and_place,
    place,
    recompute_selections,
)
from cache.layout import ChunkKV
from cache.orbit import Delta, sample_orderings
from cache.patch import PatchConfig
from cache.rank import rank_strategy

SYSTEM = "Answer the question from the passages. Reply with the answer only, in a few words."


CANONICAL_MODES = ("after-prefix", "alone")


@dataclass(frozen=True)
class FidelityConfig:
    """What to compare. Percentages are of the chunk's KV bytes / of the chunk tokens."""

    ranks: tuple[int, ...] = (8, 16, 32)
    budgets: tuple[float, ...] = (6.0, 12.0)
    matched_budgets: bool = True
    budget_weighting: str = "relative"
    cacheblend: tuple[float, ...] = (15.0,)
    epic: tuple[int, ...] = (16,)
    oracle_select: tuple[float, ...] = ()
    canonical: tuple[str, ...] = CANONICAL_MODES
    max_chunk_tokens: int | None = 256
    max_new_tokens: int = 16
    system: str = SYSTEM
    guard_margin: float = PromptCacheConfig.repair_margin  # 0 leaves out the guarded rows
    residual_unit: float = PromptCacheConfig.repair_residual_unit  # the margin scales with residual / unit
    guard_cap: float = PromptCacheConfig.repair_margin_cap  # a larger margin: repair given up (0: never)
    orbit_orderings: int = 0  # other orders of the chunks an orbit patch is fitted on (0: no orbit rows)

    def __post_init__(self) -> None:
        bad = [m for m in self.canonical if m not in CANONICAL_MODES]
        if bad or not self.canonical:
            raise ValueError(f"canonical modes must be among {CANONICAL_MODES}, got {self.canonical}")
        if any(r <= 0 for r in self.ranks) or any(b <= 0 for b in self.budgets):
            raise ValueError("ranks and budgets must be positive")
        if any(not 0 < p <= 100 for p in (*self.cacheblend, *self.oracle_select)) or any(
            k <= 0 for k in self.epic
        ):
            raise ValueError("cacheblend and oracle-select ratios lie in (0, 100] and epic k is positive")
        if not 0 <= self.guard_margin < float("inf"):
            raise ValueError(f"guard_margin must be a finite number >= 0, got {self.guard_margin}")
        if not 0 <= self.residual_unit < float("inf"):
            raise ValueError(f"residual_unit must be a finite number >= 0, got {self.residual_unit}")
        if self.orbit_orderings < 0:
            raise ValueError(f"orbit_orderings must be >= 0, got {self.orbit_orderings}")


class Prompt(NamedTuple):
    prefix: torch.Tensor  # int64 [P]
    chunks: list[torch.Tensor]  # int64 [T_i] each
    tail: torch.Tensor  # int64 [Q]

    @property
    def starts(self) -> list[int]:
        out, pos = [], int(self.prefix.numel())
        for c in self.chunks:
            out.append(pos)
            pos += int(c.numel())
        return out

    @property
    def context(self) -> torch.Tensor:
        return torch.cat([self.prefix, *self.chunks])


def build_prompt(codec: Codec, item: QAItem, config: FidelityConfig) -> Prompt:
    """SmolLM2's chat format (ChatML); each chunk tokenised on its own and truncated."""
    prefix = f"<|im_start|>system\n{config.system}<|im_end|>\n<|im_start|>user\n"
    chunks = []
    for text in item.chunks:
        ids = codec.encode(text.strip() + "\n\n")[: config.max_chunk_tokens]
        if ids:
            chunks.append(torch.tensor(ids, dtype=torch.int64))
    tail = f"Question: {item.question}\nAnswer:<|im_end|>\n<|im_start|>assistant\n"
    as_ids = lambda s: torch.tensor(codec.encode(s), dtype=torch.int64)  # noqa: E731
    return Prompt(as_ids(prefix), chunks, as_ids(tail))


@dataclass
class MethodRecord:
    """One method's numbers on one item (per-position lists pooled later)."""

    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    answer: str = ""
    agree: float = 0.0
    em: float | None = None
    f1: float | None = None
    k_err: list[float] = field(default_factory=list)
    v_err: list[float] = field(default_factory=list)
    bytes_ratio: float = 0.0
    recompute: float = 0.0
    fit_ms: float = 0.0
    apply_ms: float = 0.0
    oracle: bool = False  # built from the served context's own full prefill (bench/methods.py)
    fallback: float = 0.0  # 1 when a guarded answer moved to exact KV (its cost is in recompute)
    residual: float | None = None  # CacheBlend: the deviation its selection left (agent/recompute.py)
    # CacheBlend: the largest |gap error| over the answer's steps (repaired against the reference:
    # what the guard's margin must cover) and the largest logit change the recompute made over the
    # tail (repaired against blind: known to a server before it decodes), see predictor_fields
    gap_error: float | None = None
    repair_shift: float | None = None
    # CacheBlend: every PROBE_EVERY-th token it left, recomputed on the repaired context through
    # every layer: their KV's relative deviation over all layers (a signal past layer 1; costs
    # that share of tokens more)
    probe_deviation: float | None = None


class ItemResult(NamedTuple):
    reference_answer: str
    reference_em: float | None
    reference_f1: float | None
    prefill_ms: float  # mean in-context prefill of one chunk
    chunk_tokens: list[int]
    methods: dict[str, dict[str, MethodRecord]]  # canonical mode -> name -> record
    deficit: dict[str, list[float]]  # canonical mode -> mean ||Δ||² per layer over chunks


def run_tail(
    adapter: ModelAdapter, k: torch.Tensor, v: torch.Tensor, prompt: Prompt, forced: list[int], max_new: int
) -> tuple[torch.Tensor, list[int]]:
    """On the context KV ``[L, H, N, D]``: logits ``[Q + A, vocab]`` of the tail and the
    teacher-forced answer ``forced`` (A tokens), and the greedy answer (at most ``max_new``)."""
    n, q = k.shape[2], int(prompt.tail.numel())
    cache = adapter.new_cache([(k, v)])
    logits = adapter.prefill(adapter.text(prompt.tail), cache, n).logits
    parts = [logits]
    if forced:
        parts.append(adapter.prefill(adapter.text(forced), cache, n + q).logits)
        cache.crop(-len(forced))  # drop the forced answer again (transformers 5: negative = remove)
    greedy = adapter.generate(adapter.text(prompt.tail), cache, n, max_new, first_logits=logits[-1])
    return torch.cat(parts), greedy.tokens


class _ExactTail:
    """The repair guard's way to exact KV (``agent.engine.generation.Guard``): the context as a
    full prefill computes it, then the tail; taken only at a close call, and paid for then."""

    def __init__(
        self, adapter: ModelAdapter, k: torch.Tensor, v: torch.Tensor, tail: torch.Tensor, margin: float
    ):
        self.adapter, self.k, self.v, self.tail, self.margin = adapter, k, v, tail, margin

    def exact(self) -> tuple[Any, torch.Tensor, int]:
        n = self.k.shape[2]
        cache = self.adapter.new_cache([(self.k, self.v)])
        logits = self.adapter.next_logits(self.adapter.text(self.tail), cache, n)
        return cache, logits, n + int(self.tail.numel())


def guarded_answer(
    adapter: ModelAdapter,
    kv: tuple[torch.Tensor, torch.Tensor],
    exact: tuple[torch.Tensor, torch.Tensor],
    prompt: Prompt,
    margin: float,
    max_new: int,
) -> tuple[list[int], bool]:
    """Greedy answer on repaired context KV ``kv`` under the server's guard (``generation.decode``):
    at the first step whose best two logits lie within ``margin`` decoding moves to ``exact``, the
    context's KV as a fresh prefill computes it. Returns the tokens and whether it moved."""
    n, q = kv[0].shape[2], int(prompt.tail.numel())
    cache = adapter.new_cache([kv])
    logits = adapter.next_logits(adapter.text(prompt.tail), cache, n)
    guard = _ExactTail(adapter, *exact, prompt.tail, margin)
    out = decode(
        adapter, logits, cache, n + q, SamplingParams(max_tokens=max_new), threading.Event(), guard=guard
    )
    return out.tokens, out.escalated_at is not None


def _kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[list[float], list[float]]:
    top1 = (ref.argmax(-1) == got.argmax(-1)).double()
    return kl_rows(ref, got).tolist(), top1.tolist()


def _rel_err(k: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """``||x - ref|| / ||ref||`` per layer of ``[L, H, N, D]``."""
    num = (k.double() - ref.double()).square().sum(dim=(1, 2, 3)).sqrt()
    return (num / ref.double().square().sum(dim=(1, 2, 3)).sqrt().clamp_min(1e-30)).tolist()


def _canonicals(
    adapter: ModelAdapter, prompt: Prompt, prefix_cache_kv: tuple[torch.Tensor, torch.Tensor], mode: str
) -> list[ChunkKV]:
    if mode == "alone":
        return [adapter.encode(adapter.text(c)) for c in prompt.chunks]
    p = int(prompt.prefix.numel())
    out = []
    for c in prompt.chunks:
        kv = adapter.prefill(adapter.text(c), adapter.new_cache([prefix_cache_kv]), p).kv
        out.append(kv)
    return out


def _patch_configs(
    config: FidelityConfig, delta: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, PatchConfig]:
    n_layers, _, n_tokens, _ = delta[0].shape
    width = delta[0].shape[1] * delta[0].shape[3] + delta[1].shape[1] * delta[1].shape[3]
    kv_bytes = (delta[0].numel() + delta[1].numel()) * KV_STORAGE_BYTES
    out = {f"patch-r{m}": PatchConfig(rank=rank_strategy("fixed", rank=m)) for m in config.ranks}
    for pct in config.budgets:
        nbytes = int(pct / 100 * kv_bytes)
        out[f"patch-budget-{pct:g}"] = PatchConfig(
            rank=rank_strategy("budget", nbytes=nbytes, weighting=config.budget_weighting)
        )
    if config.matched_budgets:
        for m in config.ranks:
            nbytes = n_layers * min(m, n_tokens, width) * (n_tokens + width) * KV_STORAGE_BYTES
            out[f"patch-budget-r{m}"] = PatchConfig(
                rank=rank_strategy("budget", nbytes=nbytes, weighting=config.budget_weighting)
            )
    return out


def other_orderings(n: int, count: int) -> list[tuple[int, ...]]:
    """Up to ``count`` orders of ``n`` chunks, never the served one (``0 .. n-1``): what an orbit
    patch for the served order may be fitted on. Drawn with a fixed seed, the same for every item
    of a size, so the orders do not depend on the item's content."""
    served = tuple(range(n))
    drawn = [o for o in sample_orderings(n, count + 1, seed=n) if o != served]
    return drawn[:count]


def kv_in_other_orders(
    adapter: ModelAdapter, prompt: Prompt, orders: Sequence[tuple[int, ...]]
) -> list[list[ChunkKV]]:
    """Each chunk's KV (pre-RoPE) in the full prefill of each of ``orders``: ``[order][chunk]``,
    chunks by their index in the served prompt. One full prefill per order: what the server
    would have computed when the set was shown in those orders."""
    out = []
    for order in orders:
        fp = full_prefill(
            adapter, adapter.text(prompt.prefix), [adapter.text(prompt.chunks[i]) for i in order]
        )
        out.append([fp.conditioned[order.index(i)] for i in range(len(order))])
    return out


PROBE_EVERY = 8


def probe_deviation(
    adapter: ModelAdapter, ids: torch.Tensor, positions: torch.Tensor, out: Any, candidates: torch.Tensor
) -> float:
    """Every :data:`PROBE_EVERY`-th candidate token the recompute ``out`` left, recomputed on its
    repaired KV through every layer: ``||KV_fresh - KV_kept||² / ||KV_kept||²`` over those tokens,
    keys and values, all layers."""
    left = candidates[~torch.isin(candidates, out.selected)][::PROBE_EVERY]
    if left.numel() == 0:
        return 0.0
    fresh = selective_recompute(adapter, ids, positions, out.k, out.v, FixedSelection(left))
    num = (fresh.k[:, :, left] - out.k[:, :, left]).double().square().sum()
    num += (fresh.v[:, :, left] - out.v[:, :, left]).double().square().sum()
    den = out.k[:, :, left].double().square().sum() + out.v[:, :, left].double().square().sum()
    return float(num / den.clamp_min(1e-30))


def reference_pass(adapter: ModelAdapter, prompt: Prompt) -> FullPrefill:
    """The full prefill: the pinned prefix, then each chunk in order on the same cache."""
    return full_prefill(adapter, adapter.text(prompt.prefix), [adapter.text(c) for c in prompt.chunks])


def evaluate_item(adapter: ModelAdapter, codec: Codec, item: QAItem, config: FidelityConfig) -> ItemResult:
    """Every method on one item, for each canonical mode."""
    prompt = build_prompt(codec, item, config)
    n_layers, p = adapter.info.n_layers, int(prompt.prefix.numel())
    starts, lengths = prompt.starts, [int(c.numel()) for c in prompt.chunks]

    ref = reference_pass(adapter, prompt)
    k_ref, v_ref = ref.k, ref.v
    prefix_kv = (k_ref[:, :, :p].clone(), v_ref[:, :, :p].clone())
    _, ref_answer = run_tail(adapter, k_ref, v_ref, prompt, [], config.max_new_tokens)
    ref_logits, _ = run_tail(adapter, k_ref, v_ref, prompt, ref_answer, 0)
    ref_text = codec.decode(ref_answer).strip()
    golds = item.answers

    def judge(greedy: list[int], rec: MethodRecord) -> MethodRecord:
        rec.answer = codec.decode(greedy).strip()
        rec.agree = float(rec.answer == ref_text)
        if golds:
            rec.em, rec.f1 = exact_match(rec.answer, golds), token_f1(rec.answer, golds)
        return rec

    def score(k: torch.Tensor, v: torch.Tensor, rec: MethodRecord) -> MethodRecord:
        logits, greedy = run_tail(adapter, k, v, prompt, ref_answer, config.max_new_tokens)
        rec.kl, rec.top1 = _kl_top1(ref_logits, logits)
        judge(greedy, rec)
        rec.k_err, rec.v_err = _rel_err(k[:, :, p:], k_ref[:, :, p:]), _rel_err(v[:, :, p:], v_ref[:, :, p:])
        return rec

    later = sum(lengths[1:]) / max(1, sum(lengths))
    methods: dict[str, dict[str, MethodRecord]] = {}
    deficit: dict[str, list[float]] = {}
    ids, positions = prompt.context, torch.arange(p + sum(lengths))
    candidates = torch.arange(p, p + sum(lengths))
    # the orders an orbit patch is fitted on, prefilled once for every canonical mode
    orders = other_orderings(len(prompt.chunks), config.orbit_orderings)
    orbit_kv = kv_in_other_orders(adapter, prompt, orders) if orders else []
    for mode in config.canonical:
        canon = _canonicals(adapter, prompt, prefix_kv, mode)
        recs: dict[str, MethodRecord] = {}
        recs["prefix"] = score(k_ref, v_ref, MethodRecord(recompute=later))
        placed = [place(c, start, adapter.spec) for start, c in zip(starts, canon, strict=True)]
        k_blind, v_blind = concat_kv(prefix_kv, [pl.kv for pl in placed])
        apply_ms = 1e3 * sum(pl.place_s for pl in placed) / len(placed)
        recs["blind"] = score(k_blind, v_blind, MethodRecord(apply_ms=apply_ms))

        # the recall case: each chunk's Δ from its KV in this very prompt's full prefill (an oracle)
        deltas = [delta(cd, c) for cd, c in zip(ref.conditioned, canon, strict=True)]
        energy = torch.zeros(n_layers, dtype=torch.float64)
        per_method: dict[str, list[Placed]] = {}
        for i, (dk, dv) in enumerate(deltas):
            energy += dk.double().square().sum(dim=(1, 2, 3)) + dv.double().square().sum(dim=(1, 2, 3))
            for name, pc in _patch_configs(config, (dk, dv)).items():
                per_method.setdefault(name, []).append(
                    patch_and_place(canon[i], (dk, dv), starts[i], adapter.spec, pc)
                )
        deficit[mode] = (energy / len(deltas)).tolist()
        kv_bytes = sum((c.k.numel() + c.v.numel()) * KV_STORAGE_BYTES for c in canon)
        for name, rows in per_method.items():
            k, v = concat_kv(prefix_kv, [r.kv for r in rows])
            rec = MethodRecord(
                bytes_ratio=sum(r.patch_bytes for r in rows) / kv_bytes,
                fit_ms=1e3 * sum(r.fit_s for r in rows) / len(rows),
                apply_ms=1e3 * sum(r.place_s for r in rows) / len(rows),
                oracle=True,
            )
            recs[name] = score(k, v, rec)

        selections = recompute_selections(config.cacheblend, config.epic, candidates, starts, lengths)
        # the oracle selection: the tokens whose KV, over every layer, lies furthest from this very
        # prompt's full prefill (a bound on what choosing tokens can buy; no server knows it)
        if config.oracle_select:
            off = (k_blind - k_ref).double().square().sum(dim=(0, 1, 3))
            off = (off + (v_blind - v_ref).double().square().sum(dim=(0, 1, 3)))[candidates]
            for pct in config.oracle_select:
                n_sel = max(1, round(pct / 100 * candidates.numel()))
                chosen = candidates[torch.topk(off, n_sel).indices]
                selections[f"oracle-select-{pct:g}"] = FixedSelection(chosen)

        def recompute_rows(
            recs: dict[str, MethodRecord],
            name: str,
            k0: torch.Tensor,
            v0: torch.Tensor,
            sel: Any,
            bytes_ratio: float = 0.0,
        ) -> None:
            """``sel``'s tokens recomputed on the placed ``(k0, v0)``; for a deviation selection, the
            server's guard on top (``name+guard``). ``bytes_ratio``: what was stored to build k0."""
            t0 = time.perf_counter()
            out = selective_recompute(adapter, ids, positions, k0, v0, sel)
            elapsed = time.perf_counter() - t0
            rec = MethodRecord(
                recompute=int(out.selected.numel()) / max(1, sum(lengths)),
                bytes_ratio=bytes_ratio,
                apply_ms=1e3 * elapsed / len(lengths),
                residual=out.residual if isinstance(sel, DeviationSelection) else None,
                oracle=name.startswith("oracle-"),
            )
            recs[name] = score(out.k, out.v, rec)
            if isinstance(sel, DeviationSelection):
                q = int(prompt.tail.numel())
                before, _ = run_tail(adapter, k0, v0, prompt, ref_answer, 0)
                after, _ = run_tail(adapter, out.k, out.v, prompt, ref_answer, 0)
                steps = zip(ref_logits[q - 1 :], after[q - 1 :], strict=True)
                rec.gap_error = max(abs(gap_error(r, c)) for r, c in steps)
                rec.repair_shift = float((after[:q] - before[:q]).abs().amax())
                rec.probe_deviation = probe_deviation(adapter, ids, positions, out, candidates)
            if isinstance(sel, DeviationSelection) and config.guard_margin > 0:
                # kamera serve's repair method, its code on this placement: the recompute, the guard (its
                # margin scaled with the deviation left); a fallback costs the exact prefill of
                # everything after the exact prefix. A margin beyond the cap: the server gives the
                # repair up once its layer-1 pass measured it (a pass no cacheblend row counts) and
                # answers on exact KV, the selected tokens not recomputed
                server = PromptCacheConfig(
                    repair_margin=config.guard_margin,
                    repair_residual_unit=config.residual_unit,
                    repair_margin_cap=config.guard_cap,
                )
                margin = guard_margin(config.guard_margin, out.residual, config.residual_unit)
                given_up = out.residual > server.give_up_residual
                tokens, moved = guarded_answer(
                    adapter,
                    (out.k, out.v),
                    (k_ref, v_ref),
                    prompt,
                    float("inf") if given_up else margin,
                    config.max_new_tokens,
                )
                spent = 0.0 if given_up else rec.recompute
                guarded = replace(rec, recompute=spent + (later if moved else 0.0), fallback=float(moved))
                recs[f"{name}+guard"] = judge(tokens, guarded)

        for name, sel in selections.items():
            recompute_rows(recs, name, k_blind, v_blind, sel)

        # orbit patches: each chunk's Δ under other orders of the set (each prefilled in full, never
        # the served order), one patch per chunk fitted to all of them; deployable. A single chunk
        # has no other order: its rows are blind reuse
        for m in config.ranks if config.orbit_orderings else ():
            pc = PatchConfig(rank=rank_strategy("fixed", rank=m))
            rows = [
                orbit_patch_and_place(
                    c, [Delta(*delta(o[i], c)) for o in orbit_kv], starts[i], adapter.spec, pc
                )
                for i, c in enumerate(canon if orbit_kv else ())
            ]
            k_orb, v_orb = concat_kv(prefix_kv, [r.kv for r in rows]) if rows else (k_blind, v_blind)
            bytes_ratio = sum(r.patch_bytes for r in rows) / kv_bytes
            name = f"orbit-r{m}"
            recs[name] = score(
                k_orb,
                v_orb,
                MethodRecord(
                    bytes_ratio=bytes_ratio,
                    fit_ms=1e3 * sum(r.fit_s for r in rows) / len(canon),
                    apply_ms=1e3 * sum(r.place_s for r in rows) / len(canon),
                ),
            )
            for sel_name, sel in selections.items():
                if isinstance(sel, DeviationSelection):
                    recompute_rows(recs, f"{name}+{sel_name}", k_orb, v_orb, sel, bytes_ratio)
        methods[mode] = recs
    return ItemResult(
        ref_text,
        exact_match(ref_text, golds) if golds else None,
        token_f1(ref_text, golds) if golds else None,
        1e3 * sum(ref.prefill_s) / len(ref.prefill_s),
        lengths,
        methods,
        deficit,
    )
