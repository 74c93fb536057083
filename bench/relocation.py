"""``kamera bench relocation``: exactness per attention family and rotation throughput.

Exactness: for every family, a chunk encoded alone at 0 and rotated to start s is compared with
the same chunk prefilled alone at s (max relative error on keys), and a follow-up query's logits
on the relocated cache with those on the direct prefill (max absolute difference).

Throughput: rotating a chunk's positional part to a new start against a plain copy of the same
bytes, side by side in one run, at 256 to 16k tokens, on the SmolLM2 layout (30 layers, 3 KV
heads, 64 dims) and the DeepSeek-V2 MLA layout (60 layers, one 64-dim ``k_rope``; the 512-wide
latent is never touched). Every rotation kernel is measured (eager torch ops, the native C pass
where it builds, Inductor); the cos/sin table is memoised per placement as the runtime does.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.table import Table

from agent.adapters.base import ChunkInput, ModelAdapter
from agent.adapters.vision import VisionAdapter
from agent.tables import make_console, print_table
from cache import native
from cache.rope import RopeSpec, default_inv_freq, rotate

STARTS = (1, 100, 1000)
SIZES = (256, 1024, 4096, 16384)
BENCH_KERNELS = ("eager", "native", "compiled")
DEFAULT_SEED = 0
# DeepSeek-V2 (236B) attention dimensions, for the MLA byte count
DSV2 = {"layers": 60, "heads": 128, "qk_nope": 128, "qk_rope": 64, "v_head": 128, "kv_lora_rank": 512}


def family_exactness(adapter: ModelAdapter, chunk: ChunkInput) -> dict[str, Any]:
    """Worst errors over the starts in STARTS, and the key error at each start.

    The reference (the chunk prefilled at s) computes its own angles in float32, as transformers
    does: at s = 1000 that alone moves keys by about 1e-5 relative, so errors grow with s even
    though the rotation here is exact in float64.
    """
    canonical = adapter.encode(chunk)
    query = adapter.text(torch.arange(5, 13))
    by_start: dict[str, float] = {}
    worst_logits = 0.0
    for start in STARTS:
        direct = adapter.prefill(chunk, adapter.empty_cache(), start)
        k_moved, v = canonical.place(start, adapter.spec)
        k_direct, _ = direct.kv.place(start, adapter.spec)
        by_start[str(start)] = float(
            (k_moved.double() - k_direct.double()).abs().max() / k_direct.double().abs().max()
        )
        moved = adapter.prefill(query, adapter.new_cache([(k_moved, v)]), start + canonical.extent).logits
        ref = adapter.prefill(query, direct.cache, start + canonical.extent).logits
        worst_logits = max(worst_logits, float((moved - ref).abs().max()))
    return {
        "max_rel_err": max(by_start.values()),
        "max_rel_err_by_start": by_start,
        "logits_max_abs_diff": worst_logits,
        "n_tokens": canonical.n_tokens,
    }


def best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def throughput(
    layout: str, shape: tuple[int, ...], spec: RopeSpec, size: int, repeats: int, seed: int = DEFAULT_SEED
) -> dict[str, float]:
    """GB/s of a copy and of each rotation kernel, all into one preallocated buffer (as the
    runtime writes into its window), so page faults of fresh allocations count for none. The
    keys rotated are drawn from ``seed``."""
    x = torch.randn(*shape[:2], size, shape[-1], generator=torch.Generator().manual_seed(seed))
    dst = torch.empty_like(x)
    positions = torch.arange(size) + 4096
    gb = x.numel() * x.element_size() / 1e9
    out: dict[str, float] = {"bytes": x.numel() * x.element_size()}
    kernels = BENCH_KERNELS if native.library() is not None else ("eager", "compiled")
    for kernel in kernels:
        rotate(x, positions, spec, kernel, out=dst)  # warm: cos/sin table, compiles or builds once
    copy_s = best_of(lambda: dst.copy_(x), repeats)
    for kernel in kernels:
        s = best_of(lambda k=kernel: rotate(x, positions, spec, k, out=dst), repeats)  # type: ignore[misc]
        out[f"{kernel}_gbps"] = gb / s
    # side by side once more, so drift between the two measurements cannot favour either
    copy_s = min(copy_s, best_of(lambda: dst.copy_(x), repeats))
    out["copy_gbps"] = gb / copy_s
    out["relocate_gbps"] = max(out[f"{k}_gbps"] for k in kernels)
    out["ratio"] = out["relocate_gbps"] / out["copy_gbps"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kamera bench relocation", description=__doc__)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-real", action="store_true", help="leave out the real SmolLM2 weights")
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help="draws the tiny models' token ids and the rotated keys (the tiny weights are seeded apart)",
    )
    args = parser.parse_args(argv)
    console = make_console()
    from agent.adapters.loading import load_adapter
    from agent.adapters.tiny import BUILDERS

    families: dict[str, Any] = {}
    g = torch.Generator().manual_seed(args.seed)
    for name in BUILDERS:
        adapter = load_adapter(f"tiny:{name}")
        families[name] = family_exactness(adapter, adapter.text(torch.randint(2, 500, (48,), generator=g)))
        if isinstance(adapter, VisionAdapter):
            from PIL import Image

            img = Image.effect_mandelbrot((112, 84), (-2, -1.2, 1, 1.2), 60).convert("RGB")
            families[f"{name}-image"] = family_exactness(adapter, adapter.image(img))
    if not args.skip_real:
        from agent.adapters.loading import load_adapter

        smol = load_adapter()
        text = "The Rhine rises in the Swiss Alps and reaches the North Sea near Rotterdam. " * 4
        families["smollm2-135m (real weights)"] = family_exactness(
            smol, smol.text(smol.tokenizer(text)["input_ids"])
        )

    layouts = {
        "smollm2": ((30, 3, 0, 64), RopeSpec(default_inv_freq(64, 100000.0))),
        "deepseek-v2-mla": (
            (DSV2["layers"], 1, 0, DSV2["qk_rope"]),
            RopeSpec(default_inv_freq(64, 10000.0), pairing="interleaved"),
        ),
    }
    sizes = [int(s) for s in args.sizes.split(",")]
    tput: dict[str, Any] = {}
    for layout, (shape, spec) in layouts.items():
        for size in sizes:
            tput.setdefault(str(size), {})[layout] = throughput(
                layout, shape, spec, size, args.repeats, args.seed
            )
    # The keys at the top of each size: the SmolLM2 layout
    for size in tput.values():
        for key in ("relocate_gbps", "copy_gbps", "ratio"):
            size[key] = size["smollm2"][key]

    latent = DSV2["layers"] * (DSV2["kv_lora_rank"] + DSV2["qk_rope"]) * 2
    expanded = DSV2["layers"] * DSV2["heads"] * (DSV2["qk_nope"] + DSV2["qk_rope"] + DSV2["v_head"]) * 2
    report = {
        "families": families,
        "throughput": tput,
        "mla": {
            "latent_bytes_per_token": latent,
            "expanded_bytes_per_token": expanded,
            "dtype": "bfloat16",
            "ratio": expanded / latent,
        },
        "threads": torch.get_num_threads(),
        "seed": args.seed,
    }

    t = Table(title="relocation exactness (chunk at 0 rotated to s vs prefilled at s; s in 1, 100, 1000)")
    for col in ("family", "tokens", *(f"key rel err, s={s}" for s in STARTS), "logits max abs diff"):
        t.add_column(col, justify="right")
    for name, f in families.items():
        errs = [f"{f['max_rel_err_by_start'][str(s)]:.1e}" for s in STARTS]
        t.add_row(name, str(f["n_tokens"]), *errs, f"{f['logits_max_abs_diff']:.2e}")
    print_table(console, t)
    t = Table(title="rotation throughput vs a plain copy of the same bytes (GB/s)")
    for col in ("tokens", "layout", "copy", *BENCH_KERNELS, "best / copy"):
        t.add_column(col, justify="right")
    for size_name, per in tput.items():
        for layout in layouts:
            r = per[layout]
            t.add_row(
                size_name,
                layout,
                f"{r['copy_gbps']:.2f}",
                *(f"{r[f'{k}_gbps']:.2f}" if f"{k}_gbps" in r else "-" for k in BENCH_KERNELS),
                f"{r['ratio']:.2f}",
            )
    print_table(console, t)
    console.print(
        f"MLA bytes per token (bf16, DeepSeek-V2 dims): latent+k_rope {latent} vs expanded K/V "
        f"{expanded} ({expanded / latent:.0f}x)"
    )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)
        console.print(f"wrote {args.json_path}")
    return 0
