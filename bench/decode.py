"""Decode speed of the embedded model, its linear layers on the GGUF blocks against float32.

One process, one loaded model: each round runs every batch size once with the products on the
GGUF blocks (``agent/adapters/qlinear.py``) and once on the float32 weights, in alternating
order, so that a slow spell on a shared machine falls on both. A batch of N rows is N sequences
after short prompts (each prefilled through the adapter, float32 in both cases), then ``--steps``
greedy decode steps through ``adapter.decode_rows``; the first two steps are left out. Reported
per batch size and path: the median over rounds of the mean step time, and tokens per second
(rows / step time). The single stream is the 1-row batch.

    kamera bench decode --rows 1,8,32 --rounds 3 --steps 24 --json decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from agent.adapters.loading import load_adapter

PROMPT = "Question: which planet is known as the red planet? Answer in one short sentence. Note {i}.\nAnswer:"
WARMUP = 2


def _batch(adapter: Any, rows: int) -> tuple[list[int], list[Any], list[int]]:
    tokens, caches, positions = [], [], []
    for i in range(rows):
        ids = adapter.tokenizer(PROMPT.format(i=i), add_special_tokens=False)["input_ids"]
        cache = adapter.empty_cache()
        out = adapter.prefill(adapter.text(ids), cache, 0, placed=True, last_only=True)
        tokens.append(int(out.logits[-1].argmax()))
        caches.append(cache)
        positions.append(len(ids))
    return tokens, caches, positions


def step_seconds(adapter: Any, rows: int, steps: int) -> float:
    """Mean seconds per decode step of ``rows`` sequences (after ``WARMUP`` steps)."""
    tokens, caches, positions = _batch(adapter, rows)
    start = 0.0
    for s in range(WARMUP + steps):
        if s == WARMUP:
            start = time.perf_counter()
        logits = adapter.decode_rows(tokens, caches, positions)
        tokens = [int(t) for t in logits.argmax(dim=-1)]
        positions = [p + 1 for p in positions]
    return (time.perf_counter() - start) / steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kamera bench decode", description=__doc__)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--rows", default="1,8,32", help="batch sizes (sequences per step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter: Any = load_adapter()
    quant = adapter.linears
    if quant is None:
        print(
            "the GGUF block products are unavailable here (see the log): nothing to compare", file=sys.stderr
        )
        return 1
    sizes = [int(r) for r in args.rows.split(",")]
    paths = {"gguf-blocks": quant, "float32": None}
    times: dict[str, dict[int, list[float]]] = {p: {n: [] for n in sizes} for p in paths}
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for n in sizes:
            for p in order:
                adapter.linears = paths[p]
                times[p][n].append(step_seconds(adapter, n, args.steps))
    adapter.linears = quant
    results: dict[str, dict[str, dict[str, Any]]] = {
        p: {
            str(n): {
                "step_ms": round(1e3 * statistics.median(ts), 2),
                "tokens_per_s": round(n / statistics.median(ts), 1),
                "step_ms_runs": [round(1e3 * t, 2) for t in ts],
            }
            for n, ts in by_rows.items()
        }
        for p, by_rows in times.items()
    }
    report = {
        "model": adapter.info.name,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps": args.steps,
        "results": results,
    }
    print(
        f"{'rows':>5} {'blocks ms':>10} {'blocks tok/s':>13} {'f32 ms':>8} {'f32 tok/s':>10} {'speedup':>8}"
    )
    for n in sizes:
        q, f = results["gguf-blocks"][str(n)], results["float32"][str(n)]
        speedup = f["step_ms"] / q["step_ms"]
        print(
            f"{n:>5} {q['step_ms']:>10} {q['tokens_per_s']:>13} {f['step_ms']:>8} {f['tokens_per_s']:>10} "
            f"{speedup:>7.2f}x"
        )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
