"""``kamera bench prefill-tax``: what an exact, storable prefill costs against the fastest pass.

A prompt whose KV is to be reused exactly must be prefilled so that any later prompt sharing a
prefix gets the same bits; that used to mean 128-token passes, each of which reads every weight
again. With the blocked attention (``agent/adapters/attention.py``) the prompt cache joins its
segments into one pass (or passes of ``prefill_pass_tokens`` under the server's scheduler) and
its KV is still the one-pass KV. For each prompt length, timed in one process, interleaved, the
best of ``--repeats``:

- ``one_pass``: the engine's full prefill (``agent/engine/full_prefill.py``): one forward pass
  over the prompt into a fresh cache, the head on the last token only, with the engine's
  attention (blocked);
- ``one_pass_cut_short``: the same pass with the blocks run only where the pass computes them
  (the last one cut short at the prompt's end): what running every block whole costs, the price
  of exact reuse to the token (``attention.WHOLE_BLOCKS``);
- ``one_pass_sdpa``: the same pass with SDPA's own kernel (not cut invariant): the fastest pass
  this CPU runs, whatever the cache needs;
- ``cache_exact``: the prompt cache's ``exact`` prefill with nothing to reuse (a fresh tenant
  salt each time), each segment's KV taken out for the store, then its commit (``commit_s``);
- ``cache_exact_server``: the same under the server's bound on passes (a stand-in scheduler with
  ``pass_tokens`` = ``--pass-tokens``), as ``kamera serve`` runs it;
- ``segmented_sdpa``: the way before: SDPA in 128-token passes;
- ``one_pass_bf16``, ``cache_exact_server_bf16``: ``one_pass`` and ``cache_exact_server`` with the
  prefill's products in bfloat16 (``kamera serve --prefill-products bfloat16``; text decoders
  only, else left out): ``bf16_speedup`` is ``one_pass`` over ``one_pass_bf16``, ``bf16_tax``
  the exact, storable prefill over the one pass in those numerics.

Ratios are over the fastest one-pass time (``fastest``: the smaller of ``one_pass`` and
``one_pass_sdpa``); ``exact_equal`` says whether the prompt cache's logits equal ``one_pass``'s
bit for bit. JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from agent.adapters import attention, batched
from agent.adapters.decoder import DecoderAdapter
from agent.adapters.loading import load_adapter
from agent.adapters.vision import VisionAdapter
from agent.engine.chat import TextPiece
from agent.engine.prompt_cache import PromptCache, PromptCacheConfig, build_prompt
from cache.arena import KVArena
from cache.store import StoreConfig, TieredStore

WAYS = (
    "one_pass",
    "one_pass_cut_short",
    "one_pass_sdpa",
    "cache_exact",
    "cache_exact_server",
    "segmented_sdpa",
    "one_pass_bf16",
    "cache_exact_server_bf16",
)
NARROW = "_bf16"  # ways run with the prefill's products in bfloat16


class _Bounded:
    """A stand-in scheduler: prefill passes of at most ``pass_tokens``; nothing else waits."""

    def __init__(self, pass_tokens: int) -> None:
        self.bound = pass_tokens
        self.passes = 0

    def decode(self, adapter: Any, token: int, cache: Any, position: int) -> torch.Tensor:
        return adapter.decode_rows([token], [cache], [position])[0]

    def pause(self) -> None:
        pass

    def pass_tokens(self, before: int) -> int:
        return self.bound

    def prefill_left(self, before: int, after: int) -> None:
        self.passes += 1


def _pass(adapter: Any, ids: list[int], cut: int | None = None) -> torch.Tensor:
    d = adapter.arena_dims
    cache = adapter.new_cache(KVArena(d.n_layers, d.k, d.v, len(ids) + 1, d.dtype, d.device))
    edges = [0, *range(cut, len(ids), cut), len(ids)] if cut else [0, len(ids)]
    logits = torch.empty(0)
    for a, b in itertools.pairwise(edges):
        logits = adapter.next_logits(adapter.text(ids[a:b]), cache, a)
    return logits


def measure(adapter: Any, n: int, repeats: int, pass_tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed + n)
    ids = [rng.randrange(adapter.vocab_size) for _ in range(n)]
    store = TieredStore.from_config(StoreConfig(host_bytes=2 << 30))
    pc = PromptCache(adapter, store, PromptCacheConfig(mode="exact"))
    prompt = build_prompt(adapter, [TextPiece(tuple(ids), False)], pc.image_unit)
    blocked = adapter.attention
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    commit: list[float] = []
    logits: dict[str, torch.Tensor] = {}
    passes = 0
    salt = 0

    def cached(stepper: _Bounded | None) -> torch.Tensor:
        nonlocal salt
        salt += 1
        batched.bind(stepper)
        try:
            prepared = pc.prepare(prompt, f"prefill-tax-{salt}")
        finally:
            batched.bind(None)
        assert prepared.usage.cached_tokens == 0
        t = time.perf_counter()
        pc.commit(prepared)
        commit.append(time.perf_counter() - t)
        return prepared.logits

    def server() -> torch.Tensor:
        nonlocal passes
        stepper = _Bounded(pass_tokens)
        out = cached(stepper)
        passes = stepper.passes
        return out

    def sdpa(cut: int | None) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            adapter.model.set_attn_implementation("sdpa")
            try:
                return _pass(adapter, ids, cut)
            finally:
                adapter.model.set_attn_implementation(blocked)

        return go

    def cut_short() -> torch.Tensor:
        attention.WHOLE_BLOCKS = False
        try:
            return _pass(adapter, ids)
        finally:
            attention.WHOLE_BLOCKS = True

    ways: dict[str, Callable[[], torch.Tensor]] = {
        "one_pass": lambda: _pass(adapter, ids),
        "one_pass_cut_short": cut_short,
        "one_pass_sdpa": sdpa(None),
        "cache_exact": lambda: cached(None),
        "cache_exact_server": server,
        "segmented_sdpa": sdpa(attention.BLOCK),
        "one_pass_bf16": lambda: _pass(adapter, ids),
        "cache_exact_server_bf16": server,
    }
    narrow = isinstance(adapter, DecoderAdapter) and not isinstance(adapter, VisionAdapter)
    if not narrow:
        ways = {w: fn for w, fn in ways.items() if not w.endswith(NARROW)}
    for _ in range(repeats):
        for name, fn in ways.items():
            if name.endswith(NARROW):
                adapter.use_prefill_products("bfloat16")
            try:
                t = time.perf_counter()
                logits[name] = fn()
                times[name].append(time.perf_counter() - t)
            finally:
                if name.endswith(NARROW):
                    adapter.use_prefill_products("float32")
    best = {w: min(v) for w, v in times.items() if v}
    fastest = min(best["one_pass"], best["one_pass_sdpa"])
    out = {
        "tokens": n,
        "seconds": {w: round(v, 6) for w, v in best.items()},
        "ms_per_token": {w: round(1000 * v / n, 3) for w, v in best.items()},
        "over_fastest": {w: round(v / fastest, 3) for w, v in best.items()},
        "commit_s": round(min(commit), 4),
        "server_passes": passes,
        "exact_equal": {
            w: bool(torch.equal(logits[w], logits["one_pass"])) for w in ("cache_exact", "cache_exact_server")
        },
    }
    if narrow:
        out["exact_equal"]["cache_exact_server_bf16"] = bool(
            torch.equal(logits["cache_exact_server_bf16"], logits["one_pass_bf16"])
        )
        out["bf16_speedup"] = round(best["one_pass"] / best["one_pass_bf16"], 3)
        out["bf16_tax"] = round(best["cache_exact_server_bf16"] / best["one_pass_bf16"], 3)
        out["bf16_top1_equal"] = bool(logits["one_pass_bf16"].argmax() == logits["one_pass"].argmax())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kamera bench prefill-tax", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096", help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pass-tokens", type=int, default=512, help="the server's prefill_pass_tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if not lengths or min(lengths) < 1 or args.repeats < 1 or args.pass_tokens < 1:
        ap.error("lengths, repeats and pass tokens must be positive")
    adapter = load_adapter(args.model)
    if not adapter.cut_invariant:
        print(
            f"note: {adapter.info.name} is not cut invariant: its prefill keeps its segments", file=sys.stderr
        )
    rows = []
    print(f"{'tokens':>6}  " + "  ".join(f"{w:>18}" for w in WAYS) + "  equal")
    for n in lengths:
        r = measure(adapter, n, args.repeats, args.pass_tokens, args.seed)
        rows.append(r)
        cells = "  ".join(
            f"{r['seconds'][w]:8.3f}s {r['over_fastest'][w]:6.3f}x" if w in r["seconds"] else f"{'-':>18}"
            for w in WAYS
        )
        print(f"{n:>6}  {cells}  {all(r['exact_equal'].values())}", flush=True)
    out = {
        "model": adapter.info.name,
        "attention": adapter.attention,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "pass_tokens": args.pass_tokens,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0
