"""``kamera bench fidelity``: conditioning patches against blind reuse, CacheBlend and EPIC.

Each item is a question over ordered text chunks, laid out in the model's chat format: the
pinned prefix (system turn and the user header), the chunks in order, then
``Question: ...\\nAnswer:``, the end of the user turn and the assistant header (the *tail*).
The reference is a full prefill of the prefix and the chunks. Every method keeps the pinned
prefix's exact KV and rebuilds the chunks' KV its own way, side by side on the same inputs:

- ``prefix``: exact-prefix reuse. The first chunk sits at its original place and is reused
  as-is; every later chunk is prefilled, so its KV is the reference's by construction. Its
  cost is the share of chunk tokens it prefills (``recompute``).
- ``blind``: each chunk's canonical KV rotated to its start.
- ``patch-r<m>``: canonical + the rank-m patch of Δ = KV(B|context) − canonical, fitted in this
  very context (the recall case: the best a stored patch for these antecedents can do).
- ``patch-budget-<pct>``: the budget strategy with ``pct`` % of the chunk's KV bytes;
  ``patch-budget-r<m>``: the budget strategy given exactly the bytes of ``patch-r<m>``.
- ``cacheblend-<pct>``: blind, then the ``pct`` % of chunk tokens whose values deviate most at
  layer 1 recomputed through all layers (``agent/recompute.py``).
- ``epic-<k>``: blind, then the first k tokens of every chunk but the first recomputed.

Canonical KV (``--canonical``): ``alone`` encodes a chunk on its own at position 0;
``after-prefix`` encodes it right after the pinned prefix (the attention sink), then removes
its rotation. Both are stored in the pre-RoPE frame.

Metrics per method: next-token KL(reference || method) over the tail and the teacher-forced
answer (the reference's greedy answer), pooled over items (median, mean); top-1 agreement
there; greedy answers equal to the reference's; exact match and token F1 against gold answers
(SQuAD normalisation); per-layer relative error of the chunks' K and V; patch bytes over the
chunk's KV bytes (both counted at the patch storage dtype, float16); time to fit and apply a
chunk's patch against the chunk's in-context prefill.

Not here: storing patches (``cache/store``), orbit patches over reorderings (``cache/orbit.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from agent.adapters.base import ModelAdapter
from agent.recompute import DeviationSelection, FixedSelection, first_tokens, selective_recompute
from bench.fidelity_data import QAItem, load_items
from cache.layout import ChunkKV
from cache.patch import PatchConfig, apply_and_place, fit_delta
from cache.rank import rank_strategy

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "multihop_qa"
SYSTEM = "Answer the question from the passages. Reply with the answer only, in a few words."
CANONICAL_MODES = ("after-prefix", "alone")
KV_STORAGE_BYTES = 2  # chunk KV and patches are both counted at float16


@dataclass(frozen=True)
class FidelityConfig:
    """What to compare. Percentages are of the chunk's KV bytes / of the chunk tokens."""

    ranks: tuple[int, ...] = (8, 16, 32)
    budgets: tuple[float, ...] = (6.0, 12.0)
    matched_budgets: bool = True
    budget_weighting: str = "relative"
    cacheblend: tuple[float, ...] = (15.0,)
    epic: tuple[int, ...] = (16,)
    canonical: tuple[str, ...] = CANONICAL_MODES
    max_chunk_tokens: int | None = 256
    max_new_tokens: int = 16
    system: str = SYSTEM

    def __post_init__(self) -> None:
        bad = [m for m in self.canonical if m not in CANONICAL_MODES]
        if bad or not self.canonical:
            raise ValueError(f"canonical modes must be among {CANONICAL_MODES}, got {self.canonical}")
        if any(r <= 0 for r in self.ranks) or any(b <= 0 for b in self.budgets):
            raise ValueError("ranks and budgets must be positive")
        if any(not 0 < p <= 100 for p in self.cacheblend) or any(k <= 0 for k in self.epic):
            raise ValueError("cacheblend ratios lie in (0, 100] and epic k is positive")


# --- text -------------------------------------------------------------------------------


class Codec:
    """Text to ids and back: the model's tokenizer, or bytes for the tiny random models."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [2 + b for b in text.encode()]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return bytes(max(0, i - 2) % 256 for i in ids).decode(errors="replace")
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


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


def normalize_answer(s: str) -> str:
    """SQuAD: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(pred: str, golds: Sequence[str]) -> float:
    return float(any(normalize_answer(pred) == normalize_answer(g) for g in golds))


def token_f1(pred: str, golds: Sequence[str]) -> float:
    best = 0.0
    p = normalize_answer(pred).split()
    for g in golds:
        t = normalize_answer(g).split()
        common = sum((Counter(p) & Counter(t)).values())
        if common:
            prec, rec = common / len(p), common / len(t)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


# --- one item ---------------------------------------------------------------------------


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


class ItemResult(NamedTuple):
    reference_answer: str
    reference_em: float | None
    reference_f1: float | None
    prefill_ms: float  # mean in-context prefill of one chunk
    chunk_tokens: list[int]
    methods: dict[str, dict[str, MethodRecord]]  # canonical mode -> name -> record
    deficit: dict[str, list[float]]  # canonical mode -> mean ||Δ||² per layer over chunks


def _layers_kv(cache: Any, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE ``[L, H, N, D]`` keys and values held by an HF cache."""
    layers = cache.layers[:n_layers]
    return torch.stack([lay.keys[0] for lay in layers]), torch.stack([lay.values[0] for lay in layers])


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


def _kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[list[float], list[float]]:
    lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    top1 = (ref.argmax(-1) == got.argmax(-1)).double()
    return kl.tolist(), top1.tolist()


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


class Reference(NamedTuple):
    """The full prefill: post-RoPE context KV ``[L, H, N, D]``, each chunk's conditioned KV
    (pre-RoPE) and its in-context prefill time in seconds."""

    k: torch.Tensor
    v: torch.Tensor
    conditioned: list[ChunkKV]
    prefill_s: list[float]


def reference_pass(adapter: ModelAdapter, prompt: Prompt) -> Reference:
    """Prefill the pinned prefix, then each chunk in order on the same cache."""
    cache = adapter.prefill(adapter.text(prompt.prefix), adapter.empty_cache(), 0).cache
    conditioned, prefill_s = [], []
    for start, chunk in zip(prompt.starts, prompt.chunks, strict=True):
        t0 = time.perf_counter()
        conditioned.append(adapter.prefill(adapter.text(chunk), cache, start).kv)
        prefill_s.append(time.perf_counter() - t0)
    k, v = _layers_kv(cache, adapter.info.n_layers)
    return Reference(k, v, conditioned, prefill_s)


def evaluate_item(adapter: ModelAdapter, codec: Codec, item: QAItem, config: FidelityConfig) -> ItemResult:
    """Every method on one item, for each canonical mode."""
    prompt = build_prompt(codec, item, config)
    n_layers, p = adapter.info.n_layers, int(prompt.prefix.numel())
    starts, lengths = prompt.starts, [int(c.numel()) for c in prompt.chunks]

    k_ref, v_ref, conditioned, prefill_s = reference_pass(adapter, prompt)
    prefix_kv = (k_ref[:, :, :p].clone(), v_ref[:, :, :p].clone())
    _, ref_answer = run_tail(adapter, k_ref, v_ref, prompt, [], config.max_new_tokens)
    ref_logits, _ = run_tail(adapter, k_ref, v_ref, prompt, ref_answer, 0)
    ref_text = codec.decode(ref_answer).strip()
    golds = item.answers

    def score(k: torch.Tensor, v: torch.Tensor, rec: MethodRecord) -> MethodRecord:
        logits, greedy = run_tail(adapter, k, v, prompt, ref_answer, config.max_new_tokens)
        rec.kl, rec.top1 = _kl_top1(ref_logits, logits)
        rec.answer = codec.decode(greedy).strip()
        rec.agree = float(rec.answer == ref_text)
        if golds:
            rec.em, rec.f1 = exact_match(rec.answer, golds), token_f1(rec.answer, golds)
        rec.k_err, rec.v_err = _rel_err(k[:, :, p:], k_ref[:, :, p:]), _rel_err(v[:, :, p:], v_ref[:, :, p:])
        return rec

    later = sum(lengths[1:]) / max(1, sum(lengths))
    methods: dict[str, dict[str, MethodRecord]] = {}
    deficit: dict[str, list[float]] = {}
    for mode in config.canonical:
        canon = _canonicals(adapter, prompt, prefix_kv, mode)
        recs: dict[str, MethodRecord] = {}
        recs["prefix"] = score(k_ref, v_ref, MethodRecord(recompute=later))
        placed, place_s = [], []
        for start, c in zip(starts, canon, strict=True):
            t0 = time.perf_counter()
            placed.append(apply_and_place(c.k, c.v, None, c.placed_positions(start), adapter.spec))
            place_s.append(time.perf_counter() - t0)
        k_blind = torch.cat([prefix_kv[0], *[kv.k for kv in placed]], dim=2)
        v_blind = torch.cat([prefix_kv[1], *[kv.v for kv in placed]], dim=2)
        recs["blind"] = score(k_blind, v_blind, MethodRecord(apply_ms=1e3 * sum(place_s) / len(place_s)))

        deltas = [(cd.k - c.k, cd.v - c.v) for cd, c in zip(conditioned, canon, strict=True)]
        energy = torch.zeros(n_layers, dtype=torch.float64)
        per_method: dict[str, list[tuple[Any, float, float, int]]] = {}
        for i, (dk, dv) in enumerate(deltas):
            energy += dk.double().square().sum(dim=(1, 2, 3)) + dv.double().square().sum(dim=(1, 2, 3))
            for name, pc in _patch_configs(config, (dk, dv)).items():
                t0 = time.perf_counter()
                fit = fit_delta(dk, dv, pc)
                fit_s = time.perf_counter() - t0
                c = canon[i]
                t0 = time.perf_counter()
                kv = apply_and_place(c.k, c.v, fit.patch, c.placed_positions(starts[i]), adapter.spec)
                apply_s = time.perf_counter() - t0
                per_method.setdefault(name, []).append((kv, fit_s, apply_s, fit.patch.nbytes))
        deficit[mode] = (energy / len(deltas)).tolist()
        kv_bytes = sum((c.k.numel() + c.v.numel()) * KV_STORAGE_BYTES for c in canon)
        for name, rows in per_method.items():
            k = torch.cat([prefix_kv[0], *[r[0].k for r in rows]], dim=2)
            v = torch.cat([prefix_kv[1], *[r[0].v for r in rows]], dim=2)
            rec = MethodRecord(
                bytes_ratio=sum(r[3] for r in rows) / kv_bytes,
                fit_ms=1e3 * sum(r[1] for r in rows) / len(rows),
                apply_ms=1e3 * sum(r[2] for r in rows) / len(rows),
            )
            recs[name] = score(k, v, rec)

        ids, positions = prompt.context, torch.arange(p + sum(lengths))
        candidates = torch.arange(p, p + sum(lengths))
        selections: dict[str, Any] = {
            f"cacheblend-{pct:g}": DeviationSelection(pct / 100, candidates) for pct in config.cacheblend
        }
        for k_first in config.epic:
            picked = first_tokens(starts[1:], lengths[1:], k_first)
            selections[f"epic-{k_first}"] = FixedSelection(picked)
        for name, sel in selections.items():
            t0 = time.perf_counter()
            out = selective_recompute(adapter, ids, positions, k_blind, v_blind, sel)
            elapsed = time.perf_counter() - t0
            rec = MethodRecord(
                recompute=int(out.selected.numel()) / max(1, sum(lengths)),
                apply_ms=1e3 * elapsed / len(lengths),
            )
            recs[name] = score(out.k, out.v, rec)
        methods[mode] = recs
    return ItemResult(
        ref_text,
        exact_match(ref_text, golds) if golds else None,
        token_f1(ref_text, golds) if golds else None,
        1e3 * sum(prefill_s) / len(prefill_s),
        lengths,
        methods,
        deficit,
    )


# --- aggregation, report ------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def aggregate(results: Sequence[ItemResult], mode: str) -> dict[str, dict[str, Any]]:
    """Per method: KL pooled over every scored position of every item; the rest item means."""
    prefill_ms = _mean([r.prefill_ms for r in results]) or 0.0
    out: dict[str, dict[str, Any]] = {}
    for name in results[0].methods[mode]:
        recs = [r.methods[mode][name] for r in results]
        kl = torch.tensor([x for rec in recs for x in rec.kl], dtype=torch.float64)
        k_err = torch.tensor([rec.k_err for rec in recs], dtype=torch.float64).mean(0)
        v_err = torch.tensor([rec.v_err for rec in recs], dtype=torch.float64).mean(0)
        apply_ms = _mean([rec.apply_ms for rec in recs]) or 0.0
        out[name] = {
            "kl_median": float(kl.median()),
            "kl_mean": float(kl.mean()),
            "kl_p90": float(kl.quantile(0.9)),
            "top1": float(torch.tensor([x for rec in recs for x in rec.top1]).mean()),
            "answer_agreement": _mean([rec.agree for rec in recs]),
            "em": _mean([rec.em for rec in recs if rec.em is not None]),
            "f1": _mean([rec.f1 for rec in recs if rec.f1 is not None]),
            "k_rel_err": float(k_err.mean()),
            "v_rel_err": float(v_err.mean()),
            "k_rel_err_by_layer": k_err.tolist(),
            "v_rel_err_by_layer": v_err.tolist(),
            "bytes_ratio": _mean([rec.bytes_ratio for rec in recs]),
            "recompute": _mean([rec.recompute for rec in recs]),
            "fit_ms": _mean([rec.fit_ms for rec in recs]),
            "apply_ms": apply_ms,
            "apply_vs_prefill": apply_ms / prefill_ms if prefill_ms else None,
            "positions": int(kl.numel()),
        }
    return out


def _order(name: str) -> tuple[int, float, str]:
    """Table order: exact, blind, patches by bytes, recompute baselines."""
    rank = {"prefix": 0, "blind": 1}.get(name.split("-")[0], 2)
    if name.startswith(("cacheblend", "epic")):
        rank = 3
    return rank, 0.0, name


def print_table(console: Any, mode: str, methods: dict[str, dict[str, Any]], items: int) -> None:
    from rich.table import Table

    t = Table(title=f"fidelity against full re-prefill: canonical {mode}, {items} items")
    cols = (
        "method",
        "KL median",
        "KL mean",
        "top-1",
        "answer =",
        "EM",
        "F1",
        "K err",
        "bytes %",
        "recompute %",
        "fit ms",
        "apply ms",
        "apply/prefill",
    )
    for col in cols:
        t.add_column(col, justify="right")

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for name in sorted(methods, key=_order):
        m = methods[name]
        t.add_row(
            name,
            f(m["kl_median"], ".2e"),
            f(m["kl_mean"], ".2e"),
            f(m["top1"], ".3f"),
            f(m["answer_agreement"], ".2f"),
            f(m["em"], ".2f"),
            f(m["f1"], ".2f"),
            f(m["k_rel_err"], ".3f"),
            f(100 * m["bytes_ratio"], ".1f"),
            f(100 * m["recompute"], ".0f"),
            f(m["fit_ms"], ".1f"),
            f(m["apply_ms"], ".1f"),
            f(m["apply_vs_prefill"], ".3f"),
        )
    console.print(t)


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """``fidelity_pareto.png`` (median KL against patch bytes) and ``fidelity_deficit.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    modes = list(report["canonical"])
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        methods = report["canonical"][mode]["methods"]
        fixed = sorted(
            (m["bytes_ratio"] * 100, m["kl_median"], n)
            for n, m in methods.items()
            if re.fullmatch(r"patch-r\d+", n)
        )
        budget = sorted(
            (m["bytes_ratio"] * 100, m["kl_median"], n)
            for n, m in methods.items()
            if n.startswith("patch-budget")
        )
        for pts, style, label in ((fixed, "o-", "patch, fixed rank"), (budget, "s--", "patch, budget")):
            if pts:
                ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], style, label=label)
                for x, y, n in pts:
                    ax.annotate(
                        n.removeprefix("patch-"),
                        (x, y),
                        fontsize=7,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
        for n, m in methods.items():
            if n == "blind" or n.startswith(("cacheblend", "epic", "prefix")):
                y = max(m["kl_median"], 1e-12)
                ax.plot([0.0], [y], "x" if n == "blind" else "^", label=n)
                note = n if n == "blind" else f"{n}: {100 * m['recompute']:.0f}% recomputed"
                ax.annotate(note, (0.0, y), fontsize=7, xytext=(4, -9), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("patch bytes, % of the chunk's KV (recompute methods at 0)")
        ax.set_ylabel("median next-token KL vs re-prefill")
        ax.set_title(f"canonical: {mode}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    pareto = out_dir / "fidelity_pareto.png"
    fig.savefig(pareto, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode in modes:
        energy = report["canonical"][mode]["deficit_energy_by_layer"]
        ax.plot(range(len(energy)), energy, "o-", ms=3, label=f"canonical {mode}")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean ||Δ||² per chunk (keys + values)")
    ax.set_title("conditioning deficit by layer")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    deficit = out_dir / "fidelity_deficit.png"
    fig.savefig(deficit, dpi=120)
    plt.close(fig)
    return [pareto, deficit]


def build_report(
    results: Sequence[ItemResult], config: FidelityConfig, meta: dict[str, Any]
) -> dict[str, Any]:
    """The JSON report of the items done so far; ``meta`` (command, model, data...) goes first."""
    ref_em = [r.reference_em for r in results if r.reference_em is not None]
    ref_f1 = [r.reference_f1 for r in results if r.reference_f1 is not None]
    canonical: dict[str, dict[str, Any]] = {
        mode: {
            "methods": aggregate(results, mode),
            "deficit_energy_by_layer": torch.tensor([r.deficit[mode] for r in results]).mean(0).tolist(),
        }
        for mode in config.canonical
    }
    primary = config.canonical[0]
    return {
        **meta,
        "items": len(results),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
        "chunks_per_item": _mean([len(r.chunk_tokens) for r in results]),
        "chunk_tokens_mean": _mean([t for r in results for t in r.chunk_tokens]),
        "prefill_ms_per_chunk": _mean([r.prefill_ms for r in results]),
        "reference": {"em": _mean(ref_em), "f1": _mean(ref_f1)},
        "canonical_primary": primary,
        "methods": canonical[primary]["methods"],
        "canonical": canonical,
        "threads": torch.get_num_threads(),
    }


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def load_model(name: str | None) -> ModelAdapter:
    """``tiny:<family>`` for a random-weight model, otherwise :func:`load_adapter`'s names."""
    from agent.adapters.loading import load_adapter

    return load_adapter(name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kamera bench fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data", default=str(DEFAULT_DATA), help="JSONL file, a multi-hop QA JSON list, or a folder of them"
    )
    parser.add_argument("--split", choices=("dev", "test", "all"), default="dev")
    parser.add_argument(
        "--model", default=None, help="checkpoint folder, .gguf, embedded name or tiny:<family>"
    )
    parser.add_argument("--canonical", choices=("alone", "after-prefix", "both"), default="both")
    parser.add_argument("--ranks", default="8,16,32")
    parser.add_argument("--budgets", default="6,12", help="patch byte budgets, %% of the chunk's KV bytes")
    parser.add_argument(
        "--no-matched-budgets",
        action="store_true",
        help="leave out patch-budget-r<m> (the budget strategy at patch-r<m>'s bytes)",
    )
    parser.add_argument(
        "--budget-weighting",
        choices=("absolute", "relative"),
        default="relative",
        help="how the budget strategy weighs a layer's singular values (see cache/rank.py)",
    )
    parser.add_argument("--cacheblend", default="15", help="recompute ratios, %% of chunk tokens")
    parser.add_argument("--epic", default="16", help="first-k token counts")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-chunks", type=int, default=4, help="chunks per item (0: all)")
    parser.add_argument("--max-chunk-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plots", default=None, help="folder for the PNG plots")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import Progress

    console = Console() if sys.stdout.isatty() else Console(width=170)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = FidelityConfig(
        ranks=tuple(int(r) for r in _floats(args.ranks)),
        budgets=_floats(args.budgets),
        matched_budgets=not args.no_matched_budgets,
        budget_weighting=args.budget_weighting,
        cacheblend=_floats(args.cacheblend),
        epic=tuple(int(k) for k in _floats(args.epic)),
        canonical=CANONICAL_MODES if args.canonical == "both" else (args.canonical,),
        max_chunk_tokens=args.max_chunk_tokens or None,
        max_new_tokens=args.max_new_tokens,
    )
    items = load_items(args.data, args.split, args.max_chunks or None, args.limit)
    if not items:
        console.print(f"no items in {args.data} ({args.split})")
        return 1
    adapter = load_model(args.model)
    codec = Codec(adapter.tokenizer)
    results: list[ItemResult] = []
    meta = {
        "command": "kamera bench fidelity " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": adapter.info.name,
        "data": str(args.data),
        "split": args.split,
    }
    t0 = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("items", total=len(items))
        for item in items:
            results.append(evaluate_item(adapter, codec, item, config))
            progress.advance(task)
            if args.json_path:  # the items so far, so that a stopped run still leaves numbers
                Path(args.json_path).write_text(json.dumps(build_report(results, config, meta), indent=2))
    report = build_report(results, config, meta)
    report["wall_s"] = time.perf_counter() - t0
    canonical = report["canonical"]
    for mode in config.canonical:
        print_table(console, mode, canonical[mode]["methods"], len(results))
    console.print(
        f"reference: EM {report['reference']['em']}, F1 {report['reference']['f1']}; "
        f"{report['chunks_per_item']:.1f} chunks of {report['chunk_tokens_mean']:.0f} tokens on average; "
        f"in-context prefill {report['prefill_ms_per_chunk']:.0f} ms per chunk"
    )
    if args.plots:
        for path in plot(report, Path(args.plots)):
            console.print(f"wrote {path}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json_path}")
    return 0
