"""``kamera bench ttft``: time to first token of an agent session, three ways, side by side.

A session fills a window with chunks (text paragraphs on SmolLM2; images on the random-weight
Qwen2.5-VL), then runs steps that append, slide, reorder and recall, each followed by a question.
Every step is answered three ways in the same run:

- ``reprefill``: the whole window and the question prefilled from scratch (the vision encoder
  runs again for every image);
- ``prefix``: the longest run of leading chunks unchanged since an earlier step is reused as is
  (a radix cache over the earlier windows); everything after it is prefilled again (images in
  that part re-encoded);
- ``kamera``: the window operation on the context manager (rotation, patches, assembly) and
  the question's prefill only. Canonical encodes and patch fits run after the answer and are
  reported apart (``finalize_ms``), as they are off the path to the first token.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from agent.adapters.base import ChunkInput, ModelAdapter, TextInput
from agent.adapters.vision import encoder_calls
from agent.context import ContextManager, WindowConfig
from agent.tables import make_console, print_table
from bench.methods import PrefixCache, first_token, reprefill
from cache.rope import KERNELS
from cache.store import StoreConfig, TieredStore

OPS = ("append", "slide", "reorder", "recall", "append")
APPENDS = OPS.count("append")  # chunks a session needs beyond its first fill
DEFAULT_SEED = 0
# Text for the SmolLM2 session when the multi-hop QA data is absent; ``text_pool`` cycles over it,
# numbering each paragraph so that no two chunks cut from the cycle hold the same tokens.
FALLBACK_PARAGRAPHS = (
    "The Rhine rises in the Swiss Alps, flows through Lake Constance and along the French-German "
    "border, and reaches the North Sea in the Netherlands near Rotterdam.",
    "Marie Curie was born in Warsaw in 1867. She moved to Paris to study physics, and she was the "
    "first person to win Nobel Prizes in two different sciences.",
    "The Great Barrier Reef lies off the coast of Queensland in Australia. It is the largest coral "
    "reef system on Earth and can be seen from space.",
)


@dataclass
class Window:
    """The reference list of chunk inputs, mirrored from the context manager's view."""

    ids: list[str]
    inputs: dict[str, ChunkInput]

    def chunks(self) -> list[ChunkInput]:
        return [self.inputs[i] for i in self.ids]


def text_frame(adapter: Any) -> tuple[Any, Any]:
    """The text session's pinned system prefix and its question, as the adapter's chunks."""
    tok = adapter.tokenizer
    prefix = adapter.text(
        tok("<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n")["input_ids"]
    )
    question = adapter.text(
        tok("Question: which of these documents mentions a date?<|im_end|>\n<|im_start|>assistant\n")[
            "input_ids"
        ]
    )
    return prefix, question


def text_source(data: str | None) -> Path | None:
    """The multi-hop QA file the text chunks come from: ``data`` (which must exist), else the
    MuSiQue set in the shared data folder; None when that folder is absent (the chunks then come
    from :data:`FALLBACK_PARAGRAPHS`)."""
    from bench.traces_data import data_root

    if data:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"--data {data}: no such file")
        return path
    root = data_root()
    path = root / "multihop_qa" / "hipporag_musique_train_100.json" if root else None
    return path if path is not None and path.is_file() else None


def fallback_paragraphs() -> Iterator[str]:
    """:data:`FALLBACK_PARAGRAPHS` over and over, each time numbered anew: never periodic."""
    for k in itertools.count(1):
        for p in FALLBACK_PARAGRAPHS:
            yield f"({k}) {p}"


def text_pool(adapter: ModelAdapter, n: int, tokens: int, data: str | None) -> list[ChunkInput]:
    """``n`` distinct chunks of ``tokens`` tokens cut from real paragraphs, in the data's order:
    the multi-hop QA data's dev half (:func:`text_source`), continued when it runs out (and
    replaced when it is absent) by numbered :data:`FALLBACK_PARAGRAPHS`. A chunk whose tokens
    equal an earlier one's is left out, as the session would hold it once."""
    paragraphs: list[str] = []
    path = text_source(data)
    if path is not None:
        for item in json.loads(path.read_text())[::2]:  # dev half only
            paragraphs += [p["title"] + ". " + p["paragraph_text"] for p in item["paragraphs"]]
    out: list[ChunkInput] = []
    seen: set[tuple[int, ...]] = set()
    buf: list[int] = []
    for p in itertools.chain(paragraphs, fallback_paragraphs()):
        buf += adapter.tokenizer(p + "\n", add_special_tokens=False)["input_ids"]
        while len(buf) >= tokens and len(out) < n:
            ids, buf = tuple(buf[:tokens]), buf[tokens:]
            if ids not in seen:
                seen.add(ids)
                out.append(adapter.text(list(ids)))
        if len(out) == n:
            break
    return out


def image_pool(adapter: ModelAdapter, n: int, side: int, seed: int = DEFAULT_SEED) -> list[ChunkInput]:
    """``n`` synthetic images (colour blocks and their number), drawn from ``seed``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    out = []
    for i in range(n):
        img = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(img)
        for _ in range(8):
            x, y = rng.randrange(side), rng.randrange(side)
            draw.rectangle(
                (x, y, x + side // 5, y + side // 6), fill=tuple(rng.randrange(256) for _ in range(3))
            )
        draw.text((4, 4), str(i), fill=(0, 0, 0))
        out.append(adapter.image(img))  # type: ignore[attr-defined]
    return out


def plan_fill(
    chunks: Sequence[tuple[str, int]], prefix_tokens: int, question_tokens: int, budget: int
) -> tuple[list[str], list[str]]:
    """Split a pool's ``(chunk id, tokens)`` (distinct ids, in order) into the window's first fill
    (chunks taken in order while the prefix, the window and the question fit ``budget``) and the
    rest, which the session's appends draw from. A pool that leaves fewer than
    :data:`APPENDS` chunks after the fill is refused with ``ValueError``."""
    ids = [c for c, _ in chunks]
    if len(set(ids)) != len(ids):
        raise ValueError("the pool's chunk ids must be distinct")
    tokens, n_fill = prefix_tokens, 0
    for _, n in chunks:
        if tokens + n + question_tokens > budget:
            break
        tokens, n_fill = tokens + n, n_fill + 1
    fill, rest = ids[:n_fill], ids[n_fill:]
    if len(rest) < APPENDS:
        raise ValueError(
            f"a {budget}-token window takes {len(fill)} of the pool's {len(ids)} distinct chunks, "
            f"leaving {len(rest)} for the session's {APPENDS} appends: give a larger pool"
        )
    return fill, rest


def session_inputs(
    adapter: ModelAdapter, pool: Sequence[ChunkInput], prefix: ChunkInput, question: ChunkInput, budget: int
) -> tuple[dict[str, ChunkInput], list[str], list[str]]:
    """The pool by chunk id (a chunk equal to an earlier one kept once), the first fill's ids and
    the ids left for the appends (:func:`plan_fill`)."""
    inputs: dict[str, ChunkInput] = {}
    for c in pool:
        inputs.setdefault(adapter.chunk_key(c), c)
    fill, rest = plan_fill(
        [(k, c.n_tokens) for k, c in inputs.items()], prefix.n_tokens, question.n_tokens, budget
    )
    return inputs, fill, rest


def run_session(
    adapter: ModelAdapter,
    pool: list[ChunkInput],
    prefix: ChunkInput,
    question: TextInput,
    budget: int,
    rope_kernel: str,
    log: Callable[[str], None],
    seed: int = DEFAULT_SEED,
) -> dict[str, Any]:
    inputs, fill, rest = session_inputs(adapter, pool, prefix, question, budget)
    store = TieredStore.from_config(StoreConfig(host_bytes=8 << 30))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=budget, rope_kernel=rope_kernel), prefix)
    enc_fill = encoder_calls(adapter)
    for chunk_id in fill:
        cm.append(inputs[chunk_id])
    enc_fill = encoder_calls(adapter) - enc_fill
    cm.finalize()
    cm.invalidate()
    cm.cache()  # warm: the rotation kernel (compiled on first use) and the cos/sin tables
    prefix_cache = PrefixCache(adapter)
    prefix_cache.run(
        prefix, [v.chunk_id for v in cm.view()[1:]], [inputs[v.chunk_id] for v in cm.view()[1:]], question
    )
    steps = []
    calls = {"reprefill": 0, "prefix": 0, "kamera": 0}
    prefilled = {"reprefill": 0, "prefix": 0, "kamera": 0}
    unique_images: set[str] = {cm.view()[i].chunk_id for i in range(1, len(cm.view()))}
    for op in OPS:
        enc0 = encoder_calls(adapter)
        pre0 = cm.counters.tokens_prefilled
        rot0 = cm.counters.tokens_rotated
        t = time.perf_counter()
        if op == "append":
            new = rest.pop(0)
            cm.append(inputs[new], {"kind": "chunk"})
            unique_images.add(new)
        elif op == "slide":
            cm.slide(1)
        elif op == "reorder":
            ids = [v.chunk_id for v in cm.view()[1:]]
            random.Random(seed + 1).shuffle(ids)
            cm.reorder(ids)
        else:
            cm.recall(cm.evicted[0], at=1)
        while cm.tokens + question.n_tokens > budget:
            cm.slide(1)
        op_s = time.perf_counter() - t  # an append's prefill of its new chunk, or the window operation
        t = time.perf_counter()
        cache = cm.cache()
        assemble_s = time.perf_counter() - t
        tok_k, q_s = first_token(adapter, question, cache, cm.next_start)
        kamera_s = op_s + assemble_s + q_s
        own_prefill_s = q_s + (op_s if op == "append" else 0.0)
        overhead_s = assemble_s + (0.0 if op == "append" else op_s)
        rotated = cm.counters.tokens_rotated - rot0
        prefix_keys = cm.placed_kv(0)[0]  # the layout of the window's keys, for the copy floor
        cm.invalidate()  # the question is not part of the window
        calls["kamera"] += encoder_calls(adapter) - enc0
        prefilled["kamera"] += cm.counters.tokens_prefilled - pre0 + question.n_tokens
        t = time.perf_counter()
        cm.finalize()
        finalize_s = time.perf_counter() - t

        ids = [v.chunk_id for v in cm.view()[1:]]
        window = [inputs[i] for i in ids]
        enc0 = encoder_calls(adapter)
        tok_r, reprefill_s = reprefill(adapter, prefix, window, question)
        calls["reprefill"] += encoder_calls(adapter) - enc0
        prefilled["reprefill"] += cm.tokens + question.n_tokens
        enc0 = encoder_calls(adapter)
        tok_p, prefix_s, n_pre = prefix_cache.run(prefix, ids, window, question)
        calls["prefix"] += encoder_calls(adapter) - enc0
        prefilled["prefix"] += n_pre + question.n_tokens
        step = {
            "op": op,
            "window_tokens": cm.tokens,
            "ttft_ms": {
                "reprefill": 1000 * reprefill_s,
                "prefix": 1000 * prefix_s,
                "kamera": 1000 * kamera_s,
            },
            "kamera_overhead_ms": 1000 * overhead_s,
            "kamera_own_prefill_ms": 1000 * own_prefill_s,
            "finalize_ms": 1000 * finalize_s,
            "tokens_rotated": rotated,
            "copy_floor_ms": copy_floor_ms(prefix_keys, rotated, seed=seed),
            "first_token_same": {"prefix": tok_p == tok_r, "kamera": tok_k == tok_r},
            "sources": [str(v.source) for v in cm.view()],
        }
        steps.append(step)
        log(
            f"  {op:8s} window {cm.tokens:5d}  reprefill {1000 * reprefill_s:8.0f} ms"
            f"  prefix {1000 * prefix_s:8.0f} ms  kamera {1000 * kamera_s:7.0f} ms"
        )
    return {
        "steps": steps,
        "vision_encoder_calls": calls,
        # Kamera's encoder runs over the whole session, the window's first fill included: one
        # per distinct image is the target (the per-method counts above cover the steps only)
        "kamera_session_encoder_calls": enc_fill + calls["kamera"],
        "prefilled_tokens": prefilled,
        "unique_images": len(unique_images),
    }


def copy_floor_ms(like: torch.Tensor, n_tokens: int, repeats: int = 3, seed: int = DEFAULT_SEED) -> float:
    """Milliseconds to copy ``n_tokens`` tokens' keys of every layer once (``like``: a placed
    ``[layers, heads, T, dim]`` key tensor), best of ``repeats``: the memory traffic any
    re-rotation of those keys needs at least (read once, write once)."""
    if n_tokens == 0:
        return 0.0
    shape = (like.shape[0], like.shape[1], n_tokens, *like.shape[3:])
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(shape, generator=g).to(like.dtype)
    dst = torch.empty(shape, dtype=like.dtype)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 1000 * best


def summarise(steps: list[dict[str, Any]]) -> dict[str, float]:
    moves = [s for s in steps if s["op"] in ("slide", "reorder", "recall")] or steps
    total = {m: sum(s["ttft_ms"][m] for s in moves) for m in ("reprefill", "prefix", "kamera")}
    return {
        "ratio_reprefill_over_kamera": total["reprefill"] / total["kamera"],
        "ratio_prefix_over_kamera": total["prefix"] / total["kamera"],
        "kamera_overhead_over_own_prefill": sum(s["kamera_overhead_ms"] for s in steps)
        / sum(s["kamera_own_prefill_ms"] for s in steps),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kamera bench ttft", description=__doc__)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--sizes", default="1024,2048", help="window budgets in tokens (SmolLM2)")
    parser.add_argument("--vl-sizes", default="1024", help="window budgets for the Qwen2.5-VL image session")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--image-side", type=int, default=224)
    parser.add_argument("--rope-kernel", default="auto", choices=sorted(KERNELS))
    parser.add_argument("--models", default="smollm2,qwen2.5-vl")
    parser.add_argument("--data", default=None, help="multi-hop QA JSON for the text chunks")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help="draws the images and the reorder step's permutation (the same seed, the same inputs)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)

    def window_sizes(text: str, flag: str) -> list[int]:
        try:
            out = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            parser.error(f"{flag} takes comma-separated token counts, got {text!r}")
        if any(n <= 0 for n in out):
            parser.error(f"{flag}: window sizes must be positive, got {text!r}")
        return out

    sizes, vl_sizes = window_sizes(args.sizes, "--sizes"), window_sizes(args.vl_sizes, "--vl-sizes")
    console = make_console()
    report: dict[str, Any] = {"runs": [], "steps": [], "threads": torch.get_num_threads(), "seed": args.seed}
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - {"smollm2", "qwen2.5-vl"})
    if unknown:
        parser.error(f"unknown models {unknown}: choose from smollm2, qwen2.5-vl")
    if not (("smollm2" in models and sizes) or ("qwen2.5-vl" in models and vl_sizes)):
        parser.error("no session to run: give window sizes for at least one chosen model")
    if "smollm2" in models:
        from agent.adapters.loading import load_adapter

        smol = load_adapter()
        prefix, question = text_frame(smol)
        source = text_source(args.data)
        report["text_source"] = str(source) if source is not None else "fallback paragraphs"
        for size in sizes:
            n = size // args.chunk_tokens + 4
            pool = text_pool(smol, n, args.chunk_tokens, args.data)
            console.print(f"[bold]smollm2[/] window {size} tokens, {len(pool)} chunks of {args.chunk_tokens}")
            run = run_session(smol, pool, prefix, question, size, args.rope_kernel, console.print, args.seed)
            run.update({"model": "smollm2", "window": size, "summary": summarise(run["steps"])})
            report["runs"].append(run)
    if "qwen2.5-vl" in models:
        from agent.adapters.loading import load_adapter

        vl = load_adapter("tiny:qwen2.5-vl")
        prefix, question = vl.text(torch.arange(5, 25)), vl.text(torch.arange(40, 56))
        for size in vl_sizes:
            per_image = image_pool(vl, 1, args.image_side, args.seed)[0].n_tokens
            pool = image_pool(vl, size // per_image + 4, args.image_side, args.seed)
            console.print(f"[bold]qwen2.5-vl (random weights)[/] window {size} tokens, {len(pool)} images")
            run = run_session(vl, pool, prefix, question, size, args.rope_kernel, console.print, args.seed)
            run.update({"model": "qwen2.5-vl", "window": size, "summary": summarise(run["steps"])})
            report["runs"].append(run)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["peak_rss_bytes"] = peak
    first = report["runs"][0]
    report["steps"] = first["steps"]
    report["summary"] = {
        **first["summary"],
        "vision_encoder_calls": next(
            (r["vision_encoder_calls"] for r in report["runs"] if r["model"] != "smollm2"),
            first["vision_encoder_calls"],
        ),
        "unique_images": next((r["unique_images"] for r in report["runs"] if r["model"] != "smollm2"), 0),
        "kamera_session_encoder_calls": next(
            (r["kamera_session_encoder_calls"] for r in report["runs"] if r["model"] != "smollm2"), 0
        ),
    }
    for run in report["runs"]:
        t = Table(title=f"{run['model']}, window {run['window']} tokens: time to first token (ms)")
        for col in (
            "step",
            "op",
            "window",
            "reprefill",
            "prefix",
            "kamera",
            "kamera ops",
            "rotated",
            "copy floor",
            "reprefill/kamera",
            "same first token",
        ):
            t.add_column(col, justify="right")
        for i, s in enumerate(run["steps"]):
            ms = s["ttft_ms"]
            t.add_row(
                str(i),
                s["op"],
                str(s["window_tokens"]),
                f"{ms['reprefill']:.0f}",
                f"{ms['prefix']:.0f}",
                f"{ms['kamera']:.0f}",
                f"{s['kamera_overhead_ms']:.1f}",
                str(s["tokens_rotated"]),
                f"{s['copy_floor_ms']:.1f}",
                f"{ms['reprefill'] / ms['kamera']:.1f}",
                "yes" if s["first_token_same"]["kamera"] else "no",
            )
        print_table(console, t)
        console.print(
            f"  summary {json.dumps({k: round(v, 2) for k, v in run['summary'].items()})}; "
            f"vision encoder calls over the steps {run['vision_encoder_calls']}, Kamera's over the "
            f"session {run['kamera_session_encoder_calls']} for {run['unique_images']} distinct chunks; "
            f"prefilled tokens {run['prefilled_tokens']}"
        )
    console.print(f"peak RSS {peak / 2**30:.2f} GiB")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {args.json_path}")
    return 0
