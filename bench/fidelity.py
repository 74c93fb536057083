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
- ``patch-r<m>`` (oracle): canonical + the rank-m patch of Δ = KV(B|context) − canonical,
  fitted in this very context from its full prefill (the recall case: the best a stored patch
  for these antecedents can do; an upper bound, not a deployable method).
- ``patch-budget-<pct>`` (oracle): the budget strategy with ``pct`` % of the chunk's KV bytes;
  ``patch-budget-r<m>`` (oracle): the budget strategy given exactly the bytes of ``patch-r<m>``.
- ``cacheblend-<pct>``: blind, then the ``pct`` % of chunk tokens whose values deviate most at
  layer 1 recomputed through all layers (``agent/recompute.py``).
- ``epic-<k>``: blind, then the first k tokens of every chunk but the first recomputed.
- ``oracle-select-<pct>`` (oracle): blind, then the ``pct`` % of chunk tokens whose KV, summed
  over every layer, lies furthest from this very prompt's full prefill recomputed the same way:
  a bound on what choosing which tokens to recompute can buy (``--oracle-select``, off by default).
- ``orbit-r<m>``: canonical + a rank-m orbit patch per chunk (``cache/orbit.py``), fitted on
  the chunk's Δ under ``--orbit`` other orders of the same chunks, each prefilled in full
  (drawn with a fixed seed, never the served order): what a server that has seen the set in
  other orders could store. Deployable; its cost is those prefills, paid once per set.
  ``orbit-r<m>+cacheblend-<pct>`` (and ``+guard``): CacheBlend's recompute and the guard on top.
- ``cacheblend-<pct>+guard``: ``kamera serve``'s ``repair`` method through its own code
  (``agent/recompute.py``, ``generation.decode`` and its guard), on this bench's placement of the
  chunks rather than the prompt cache's: the same recompute, then greedy decoding under the
  repair guard (``--guard-margin``, the server's default): at the first step whose best two
  logits lie closer than the margin, decoding moves to the context's exact KV (a fresh prefill of
  every chunk after the first), whose cost joins the row's ``recompute`` (``fallback``: the share
  of items that took it). The margin scales with the deviation the recompute left
  (``--residual-unit``), and beyond ``--guard-cap`` the repair is given up for exact KV at once
  (its recompute not counted), as the server does.

Canonical KV (``--canonical``): ``alone`` encodes a chunk on its own at position 0;
``after-prefix`` encodes it right after the pinned prefix (the attention sink), then removes
its rotation. Both are stored in the pre-RoPE frame.

Metrics per method: next-token KL(reference || method) over the tail and the teacher-forced
answer (the reference's greedy answer), pooled over items (median, mean); top-1 agreement
there; greedy answers equal to the reference's; exact match and token F1 against gold answers
(SQuAD normalisation); per-layer relative error of the chunks' K and V; patch bytes over the
chunk's KV bytes (both counted at the patch storage dtype, float16); time to fit and apply a
chunk's patch against the chunk's in-context prefill. For each ``cacheblend-*`` row, what the
guard's margin must cover and what might predict it: the largest |gap error| over the answer's
steps, the layer-1 residual, the logit shift the recompute made over the tail, and a deep probe
(every eighth token left, recomputed through every layer), per item and as rank correlations and
spreads (``bench/fidelity_report.py``, ``predictor_fields``).

The report keeps the deployable methods (``prefix``, ``blind``, ``cacheblend-*``, ``epic-*``)
apart from the oracles: each method's JSON has ``"oracle": true|false``, the report lists both
(``deployable``, ``oracle``) and prints them in separate tables (``bench/methods.py``).

Not here: storing patches (``cache/store``), fitting orbit patches (``cache/orbit.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from agent.adapters.base import ModelAdapter
from agent.tables import make_console
from bench.answers import Codec
from bench.fidelity_data import load_items
from bench.fidelity_item import CANONICAL_MODES, FidelityConfig, ItemResult, evaluate_item
from bench.fidelity_report import build_report, plot, print_table
from tools.data import find_data_folder


def default_data() -> str | None:
    """``multihop_qa`` in the resolved data folder (``tools.data``), None without one."""
    root = find_data_folder().path
    return str(root / "multihop_qa") if root is not None else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def load_model(name: str | None) -> ModelAdapter:
    """``tiny:<family>`` for a random-weight model (with the byte tokenizer, which the guarded
    rows' decoding needs), otherwise :func:`load_adapter`'s names."""
    from agent.adapters.loading import load_adapter
    from agent.byte_tokenizer import ByteTokenizer

    if name and name.startswith("tiny:"):
        return load_adapter(name, tokenizer=ByteTokenizer())
    return load_adapter(name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kamera bench fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data",
        default=None,
        help="JSONL file, a multi-hop QA JSON list, or a folder of them "
        "(default: multihop_qa in the data folder: $KAMERA_DATA, else ../shared/data)",
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
    parser.add_argument(
        "--oracle-select",
        default="",
        help="oracle recompute ratios, %% of chunk tokens: those furthest from the full prefill's KV",
    )
    parser.add_argument(
        "--orbit",
        type=int,
        default=0,
        help="orbit-r<m> rows: patches fitted on this many other orders of the chunks, each "
        "prefilled in full (0: none)",
    )
    parser.add_argument(
        "--guard-margin",
        type=float,
        default=FidelityConfig.guard_margin,
        help="repair guard margin of the cacheblend-<pct>+guard rows (0: leave them out)",
    )
    parser.add_argument(
        "--residual-unit",
        type=float,
        default=FidelityConfig.residual_unit,
        help="the deviation left by repair at which the guard's margin is as set (0: always as set)",
    )
    parser.add_argument(
        "--guard-cap",
        type=float,
        default=FidelityConfig.guard_cap,
        help="a larger margin gives the repair up for exact KV at once, as the server does (0: never)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=2,
        help="items, in the data's order (default 2: every method on an item takes minutes on two cores, "
        "so all 175 dev items take hours; 0: all)",
    )
    parser.add_argument("--max-chunks", type=int, default=4, help="chunks per item (0: all)")
    parser.add_argument("--max-chunk-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plots", default=None, help="folder for the PNG plots")
    args = parser.parse_args(argv)

    from rich.progress import Progress

    console = make_console()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = FidelityConfig(
        ranks=tuple(int(r) for r in _floats(args.ranks)),
        budgets=_floats(args.budgets),
        matched_budgets=not args.no_matched_budgets,
        budget_weighting=args.budget_weighting,
        cacheblend=_floats(args.cacheblend),
        epic=tuple(int(k) for k in _floats(args.epic)),
        oracle_select=_floats(args.oracle_select),
        guard_margin=args.guard_margin,
        residual_unit=args.residual_unit,
        guard_cap=args.guard_cap,
        orbit_orderings=args.orbit,
        canonical=CANONICAL_MODES if args.canonical == "both" else (args.canonical,),
        max_chunk_tokens=args.max_chunk_tokens or None,
        max_new_tokens=args.max_new_tokens,
    )
    if args.data is None:
        args.data = default_data()
        if args.data is None:
            raise SystemExit(find_data_folder().describe())
    items = load_items(args.data, args.split, args.max_chunks or None, args.limit or None)
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
    for name, m in canonical[config.canonical[0]]["methods"].items():
        if m.get("spearman_sqrt_residual") is not None:
            console.print(
                f"{name}: logit gap error against sqrt(residual): rank correlation "
                f"{m['spearman_sqrt_residual']:.2f}, spread {_fmt(m['spread_sqrt_residual'])}; "
                f"against the repair's shift: {m['spearman_repair_shift']:.2f}, "
                f"spread {_fmt(m['spread_repair_shift'])}"
                + (
                    f"; against sqrt(probe deviation): {m['spearman_sqrt_probe']:.2f}, "
                    f"spread {_fmt(m['spread_sqrt_probe'])}"
                    if m.get("spearman_sqrt_probe") is not None
                    else ""
                )
            )
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
