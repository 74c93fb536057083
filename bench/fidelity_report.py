"""The fidelity report: items pooled per method, the JSON, the tables and the plots.

Oracle methods (a patch fitted in the very context being served) are marked ``"oracle": true``,
listed apart from the deployable ones and printed in their own table (``bench/methods.py``).

Not here: running items (``fidelity_item.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from agent.tables import print_table as draw
from bench.fidelity_item import FidelityConfig, ItemResult, MethodRecord
from bench.methods import split_oracles


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
            "fallback_share": _mean([rec.fallback for rec in recs]),
            "residual_mean": _mean([rec.residual for rec in recs if rec.residual is not None]),
            "residual_max": max((rec.residual for rec in recs if rec.residual is not None), default=None),
            "fit_ms": _mean([rec.fit_ms for rec in recs]),
            "apply_ms": apply_ms,
            "apply_vs_prefill": apply_ms / prefill_ms if prefill_ms else None,
            "positions": int(kl.numel()),
            "oracle": recs[0].oracle,
            # per item, in order: what the guard's settings are chosen from (on the dev half)
            "per_item": [
                {
                    "agree": rec.agree,
                    "residual": rec.residual,
                    "fallback": rec.fallback,
                    "gap_error": rec.gap_error,
                    "repair_shift": rec.repair_shift,
                    "probe_deviation": rec.probe_deviation,
                }
                for rec in recs
            ],
            **predictor_fields(recs),
        }
    return out


def _ranks(xs: Sequence[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64).argsort().argsort().double()


def _spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 3:
        return None
    a, b = _ranks(xs), _ranks(ys)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))


def predictor_fields(recs: Sequence[MethodRecord]) -> dict[str, Any]:
    """How well what a server can measure before decoding predicts the logit error the guard must
    cover (``gap_error``), for a repaired row's items: the layer-1 residual in the form the guard
    uses (``sqrt(residual)``), ``repair_shift`` (how far the recompute moved the tail's logits) and
    ``sqrt_probe`` (the deviation of a sample of the tokens repair left, at every layer).
    ``spearman_*``: rank correlation with the error; ``spread_*``: the largest error per unit of
    the predictor over the smallest (items with an error above 1e-3); a guard margin
    ``c * predictor`` that covers the worst item is that many times wider than the best needs."""
    rows = [r for r in recs if r.gap_error is not None and r.residual is not None and r.repair_shift]
    if not rows:
        return {}
    err = [r.gap_error for r in rows]
    pred = {
        "sqrt_residual": [math.sqrt(r.residual) for r in rows],
        "repair_shift": [r.repair_shift for r in rows],
    }
    if all(r.probe_deviation is not None for r in rows):
        pred["sqrt_probe"] = [math.sqrt(r.probe_deviation or 0.0) for r in rows]
    out: dict[str, Any] = {}
    for name, p in pred.items():
        ratios = [e / x for e, x in zip(err, p, strict=True) if e > 1e-3 and x > 0]
        out[f"spearman_{name}"] = _spearman(p, err)
        out[f"spread_{name}"] = max(ratios) / min(ratios) if ratios else None
        out[f"scale_{name}"] = max(ratios) if ratios else None
    return out


def _order(name: str) -> tuple[int, float, str]:
    """Table order: exact, blind, patches by bytes, recompute baselines."""
    rank = {"prefix": 0, "blind": 1}.get(name.split("-")[0], 2)
    if name.startswith(("cacheblend", "epic", "oracle-select")):
        rank = 3
    return rank, 0.0, name


def print_table(console: Any, mode: str, methods: dict[str, dict[str, Any]], items: int) -> None:
    """Two tables: the deployable methods, then the oracles (fitted to or chosen from the served
    prompt's own full prefill)."""
    deployable, oracles = split_oracles(methods)
    title = f"fidelity against full re-prefill: canonical {mode}, {items} items"
    _table(console, f"{title}: deployable methods", {n: methods[n] for n in deployable})
    if oracles:
        oracle_title = (
            f"{title}: oracles (fitted to or chosen from the served prompt's own full prefill, "
            "an upper bound)"
        )
        _table(console, oracle_title, {n: methods[n] for n in oracles})


def _table(console: Any, title: str, methods: dict[str, dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title=title)
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
        "fallback %",
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
            f(100 * m["fallback_share"], ".0f") if name.endswith("+guard") else "-",
            f(m["fit_ms"], ".1f"),
            f(m["apply_ms"], ".1f"),
            f(m["apply_vs_prefill"], ".3f"),
        )
    draw(console, t)


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
            if n == "blind" or n.startswith(("cacheblend", "epic", "prefix", "oracle-select")):
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
    deployable, oracles = split_oracles(canonical[primary]["methods"])
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
        "deployable": deployable,
        "oracle": oracles,
        "canonical": canonical,
        "threads": torch.get_num_threads(),
    }
