"""Decode speed of the embedded model: the server's step against its linear layers in float32
and against one attention call per row.

One process, one loaded model: each round runs every batch size once on each path, in an order
that turns each round, so that a slow spell on a shared machine falls on all of them. The paths:
``gguf-blocks`` (as the server runs: products on the GGUF blocks, ``agent/adapters/qlinear.py``,
on int8 activations where the CPU has VNNI unless ``KAMERA_DECODE_PRODUCTS=float32``, and every
row's attention in one native call writing into the rows' arenas, ``cache/attend.py``),
``blocks-f32-products`` (the block products on float32 activations, ``cache/qmatmul.py``),
``blocks-sdpa`` (the server's products, one SDPA call and one cache update per row and layer)
and ``float32`` (products on the float32 weights, native attention). A batch of N
rows is N sequences after prompts of about ``--prompt-tokens`` tokens, each prefilled through the
adapter into an arena as the server's are, then ``--steps`` greedy decode steps through
``adapter.decode_rows``; the first two steps are left out. Reported per batch size and path: the
median over rounds of the mean step time, and tokens per second (rows / step time). The single
stream is the 1-row batch.

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

from agent.adapters import batched, qlinear
from agent.adapters.loading import load_adapter
from cache import attend, qdot
from cache.arena import KVArena

PROMPT = "Question: which planet is known as the red planet? Answer in one short sentence. Note {i}.\n"
WARMUP = 2


def _batch(adapter: Any, rows: int, steps: int, prompt_tokens: int) -> tuple[list[int], list[Any], list[int]]:
    tokens, caches, positions = [], [], []
    d = adapter.arena_dims
    for i in range(rows):
        ids: list[int] = []
        while len(ids) < prompt_tokens:
            ids += adapter.tokenizer(PROMPT.format(i=i + len(ids)), add_special_tokens=False)["input_ids"]
        ids = ids[:prompt_tokens]
        cache = adapter.new_cache(KVArena(d.n_layers, d.k, d.v, len(ids) + WARMUP + steps, d.dtype, d.device))
        out = adapter.prefill(adapter.text(ids), cache, 0, placed=True, last_only=True)
        tokens.append(int(out.logits[-1].argmax()))
        caches.append(cache)
        positions.append(len(ids))
    return tokens, caches, positions


def step_seconds(adapter: Any, rows: int, steps: int, prompt_tokens: int = 32) -> float:
    """Mean seconds per decode step of ``rows`` sequences (after ``WARMUP`` steps)."""
    tokens, caches, positions = _batch(adapter, rows, steps, prompt_tokens)
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
    parser.add_argument(
        "--prompt-tokens", type=int, default=32, help="tokens in each row's cache before decoding"
    )
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
    served = batched.NATIVE_ATTENTION  # as the server runs it (KAMERA_NATIVE_ATTENTION)
    int8 = qlinear.INT8_PRODUCTS  # as the server runs it (KAMERA_DECODE_PRODUCTS)
    # linears, native attention, int8 activations
    paths = {
        "gguf-blocks": (quant, served, int8),
        "blocks-f32-products": (quant, served, False),
        "blocks-sdpa": (quant, False, int8),
        "float32": (None, served, int8),
    }
    times: dict[str, dict[int, list[float]]] = {p: {n: [] for n in sizes} for p in paths}
    names = list(paths)
    try:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in sizes:
                for p in order:
                    adapter.linears, batched.NATIVE_ATTENTION, qlinear.INT8_PRODUCTS = paths[p]
                    times[p][n].append(step_seconds(adapter, n, args.steps, args.prompt_tokens))
    finally:
        adapter.linears, batched.NATIVE_ATTENTION, qlinear.INT8_PRODUCTS = quant, served, int8
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
    one = sizes[0]
    report = {
        "model": adapter.info.name,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps": args.steps,
        "prompt_tokens": args.prompt_tokens,
        "native_attention": served
        and attend.vectorised(),  # whether the server's step takes the native call here
        "int8_products": int8 and qdot.vectorised(),  # whether the server's products take int8 here
        "results": results,
        # tokens/s of N rows over those of the first batch size, per path (the batching gain a
        # step alone allows, before any prefill)
        "gain": {
            p: {
                str(n): round(results[p][str(n)]["tokens_per_s"] / results[p][str(one)]["tokens_per_s"], 2)
                for n in sizes
            }
            for p in paths
        },
    }
    print(f"{'rows':>5} " + " ".join(f"{p + ' ms':>16} {'tok/s':>7} {'gain':>6}" for p in paths))
    for n in sizes:
        cells = []
        for p in paths:
            row = results[p][str(n)]
            cells.append(f"{row['step_ms']:>16} {row['tokens_per_s']:>7} {report['gain'][p][str(n)]:>5}x")
        print(f"{n:>5} " + " ".join(cells))
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
