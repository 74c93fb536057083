"""``kamera bench video-costs``: what one video frame costs a real-size Qwen2.5-VL, and what
reusing frames' KV saves a streaming agent's first token.

Measured per model and square frame size, float32 on the CPU at the torch threads set
(``torch_threads`` in the report): the median of at least ``--repeats`` runs (more while they sum
to under ``--min-seconds``) after a warm-up run,

- ``encode``: the vision encoder on one frame (the feature cache emptied first), and
  ``encode_in_batch``: per frame, ``--window`` + 1 frames encoded in one batch;
- ``prefill``: the LLM on one frame's chunk (its merged patches between the vision start and end
  tokens) after C frames already in the cache, through the ingest path (``prefill_many``), for C
  in 0, ``--window`` and each of ``--windows``;
- ``decode``: one decode step after ``--window`` frames;
- ``question``: a ``--question-tokens`` question after W + 1 frames (``next_logits``, what an
  answer's first token runs), for each W of ``--windows``;
- ``one_pass``: ``--window`` + 1 frames prefilled in one forward pass on an empty cache.

The frames already in the cache are random KV of the shape the model writes (attention costs the
same whatever the values), so no measurement pays for filling it.

Qwen2.5-VL-3B and 7B are random-weight models of the published widths
(``agent/adapters/qwen_vl_widths.py``) cut to ``--vision-blocks`` vision blocks and ``--layers``
LLM layers. Forward hooks time every block; a run's time is scaled to the real depth as the rest
of the run (embeddings, patch embedding, merger, final norm, head) plus each kind of block's
mean time times its real count (window- and full-attention vision blocks apart). The world VLM
(``tools/world/world_vl``) runs at its own depth: ``scaled`` is false there, and the row is
skipped with a message when its weights are absent.

Modelled (``"modelled": true`` in the report; ``video_costs_model.py``), from the scaled units:
the time to the first token of a question over W frames and one new frame, with the W frames'
KV reused (the new frame encoded and prefilled, then the question) against re-encoding (all
W + 1 frames encoded in a batch and prefilled in one pass, then the question).

    kamera bench video-costs --out docs/video_costs.json

Not here: real weights of the 3B and 7B, GPUs, bfloat16.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from agent.adapters.base import ImageInput
from agent.adapters.loading import WORLD_VL, load_adapter
from agent.adapters.qwen_vl import QwenVLAdapter
from agent.adapters.qwen_vl_widths import PUBLISHED, block_groups, build
from bench.block_timer import Timer, Unit
from bench.video_costs_model import PassModel, interpolate, modelled_ttft
from bench.video_costs_report import print_tables
from tools.world import WORLD_VL_DIR

WORLD = "world"


def noise_frame(side: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def context_cache(adapter: QwenVLAdapter, frame: ImageInput, frames: int) -> tuple[Any, int, int]:
    """A model cache holding ``frames`` frames' worth of random KV: the cache, its token count,
    and the position after it."""
    info = adapter.info
    tokens = frames * frame.n_tokens
    if tokens == 0:
        return adapter.empty_cache(), 0, 0
    k = torch.randn(info.n_layers, info.kv_heads, tokens, info.head_dim, dtype=info.dtype)  # [L, H, T, D]
    _, extent = adapter.chunk_positions(frame)
    return adapter.new_cache([(k, torch.randn_like(k))]), tokens, frames * extent


def measure_frame(
    adapter: QwenVLAdapter, timer: Timer, side: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Every unit (module doc) for ``side`` x ``side`` frames, and the modelled first tokens."""
    frames = [adapter.image(noise_frame(side, seed)) for seed in range(args.window + 1)]
    frame = frames[0]
    t, h, w = frame.grid_thw

    def encode(images: list[ImageInput]) -> None:
        adapter.clear_vision_cache()  # the encoder runs on every image
        adapter.encode_images(images)

    enc = timer.unit(lambda: encode([frame]))
    batch = timer.unit(lambda: encode(frames), warmup=0, repeats=1)
    calls = adapter.vision_encoder_calls  # the LLM timings below must not run the encoder

    def on_context(n: int, step: Callable[[Any, int], object]) -> Unit:
        cache, tokens, start = context_cache(adapter, frame, n)

        def drop() -> None:
            cache.crop(tokens - adapter.cache_length(cache))  # transformers 5: negative = remove

        return timer.unit(lambda: step(cache, start), drop)

    contexts = sorted({0, args.window, *args.windows})
    prefill = {c: on_context(c, lambda cache, at: adapter.prefill_many([frame], cache, at)) for c in contexts}
    decode = on_context(args.window, lambda cache, at: adapter.decode_step(0, cache, at))
    # ids below the vision tokens: any text ids cost the same
    question = adapter.text(torch.randint(0, adapter.image_token_id - 2, (args.question_tokens,)))
    asked = {
        w: on_context(w + 1, lambda cache, at: adapter.next_logits(question, cache, at)) for w in args.windows
    }
    one_pass = timer.unit(lambda: adapter.prefill_many(frames, adapter.empty_cache(), 0), warmup=0, repeats=1)
    if adapter.vision_encoder_calls != calls:
        raise RuntimeError("the vision encoder ran during an LLM timing")

    prefill_at = {c: u.scaled_s for c, u in prefill.items()}
    in_batch = batch.scaled_s / len(frames)
    passes = PassModel.fit(one_pass.scaled_s, len(frames), prefill_at)
    ttfts = [
        modelled_ttft(enc.scaled_s, in_batch, prefill_at, passes, asked[w].scaled_s, w) for w in args.windows
    ]
    units = {"encode": enc, "prefill": prefill[args.window], "decode": decode}
    d = decode.scaled_s
    return {
        "size": [side, side],
        "patches": t * h * w,
        "tokens_per_frame": t * h * w // adapter.merge**2,
        "chunk_tokens": frame.n_tokens,
        "context_frames": args.window,
        **{f"{name}_s": u.scaled_s for name, u in units.items()},
        "ratio": {name: u.scaled_s / d for name, u in units.items()},
        "measured": {f"{name}_s": u.measured_s for name, u in units.items()},
        "encode_in_batch_s": in_batch,
        "prefill_s_by_context": {str(c): u.scaled_s for c, u in prefill.items()},
        "question_s_by_window": {str(w): u.scaled_s for w, u in asked.items()},
        "one_pass": {
            "frames": len(frames),
            "measured_s": one_pass.scaled_s,
            "single_frame_sum_s": sum(interpolate(prefill_at, i) for i in range(len(frames))),
        },
        "ttft": {
            "modelled": True,
            "per_frame_in_pass_s": passes.per_frame_s,
            "per_frame_pair_s": passes.per_pair_s,
            "rows": [{**m._asdict(), "speedup": m.speedup} for m in ttfts],
        },
    }


def measure_model(
    adapter: QwenVLAdapter, name: str, source: str, real: Mapping[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    timer = Timer(adapter, real, args.repeats, args.min_seconds)
    lo, hi = adapter.pixel_bounds()
    row: dict[str, Any] = {
        "model": name,
        "source": source,
        "measured_depth": timer.measured,
        "real_depth": timer.real,
        "scaled": timer.measured != timer.real,
        "frames": [],
    }
    try:
        for side in args.sizes:
            if not lo <= side * side <= hi:
                row["frames"].append(
                    {"size": [side, side], "skipped": f"its processor keeps {lo} to {hi} pixels"}
                )
                continue
            print(f"{name}: {side}x{side} frames", file=sys.stderr)
            row["frames"].append(measure_frame(adapter, timer, side, args))
    finally:
        timer.clock.close()
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for key in args.models:
        if key == WORLD:
            if not any(WORLD_VL_DIR.glob("*.safetensors")):
                message = f"{WORLD_VL_DIR} holds no weights (kamera train-demo-model makes them)"
                print(f"world-vl skipped: {message}", file=sys.stderr)
                rows.append({"model": "world-vl", "skipped": message})
                continue
            world: Any = load_adapter(WORLD_VL)
            depths = {kind: len(blocks) for kind, blocks in block_groups(world).items()}
            rows.append(
                measure_model(world, "world-vl", "the trained world VLM, tools/world/world_vl", depths, args)
            )
            continue
        widths = PUBLISHED[key]
        print(f"{widths.name}: building the random-weight cut model", file=sys.stderr)
        adapter = build(widths.cut(args.vision_blocks, args.layers))
        source = f"random weights at {widths.name}'s published widths"
        rows.append(measure_model(adapter, widths.name, source, widths.depths, args))
        del adapter
        gc.collect()
    return {
        "benchmark": "video-costs",
        "command": "kamera bench video-costs " + " ".join(args.argv),
        "device": "cpu",
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "min_seconds": args.min_seconds,
        "window": args.window,
        "windows": list(args.windows),
        "question_tokens": args.question_tokens,
        "models": rows,
    }


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kamera bench video-costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", "--json", dest="out", default=None, help="write the JSON report here")
    parser.add_argument("--models", default=f"3b,7b,{WORLD}", help=f"of {', '.join([*PUBLISHED, WORLD])}")
    parser.add_argument("--sizes", type=_ints, default=(56, 448), help="square frame sides in pixels")
    parser.add_argument("--window", type=int, default=16, help="frames in the cache for the ratio")
    parser.add_argument("--windows", type=_ints, default=(16, 32, 64), help="windows of the modelled TTFT")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per unit, at least")
    parser.add_argument(
        "--min-seconds", type=float, default=1.0, help="a unit repeats until its runs sum to this"
    )
    parser.add_argument("--vision-blocks", type=int, default=2, help="vision blocks kept of the real depth")
    parser.add_argument("--layers", type=int, default=2, help="LLM layers kept of the real depth")
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in (*PUBLISHED, WORLD)]
    if unknown or min(args.window, args.repeats, args.question_tokens) <= 0:
        parser.error(
            f"unknown models {unknown}" if unknown else "--window, --repeats, --question-tokens must be > 0"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    print_tables(report)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
