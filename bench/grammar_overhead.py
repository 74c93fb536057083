"""Per-token cost of a JSON-schema token mask on the CPU: llguidance against xgrammar.

The embedded model's tokenizer (SmolLM2, 49,152 tokens) and one tool-call style schema; a
document valid under the schema is tokenized and replayed token by token through each library's
matcher: compute the mask for the next token, check the document's token is allowed, consume it.
Reported: the time from a new schema to its first mask (compile included, nothing cached), the
mean / p50 / p99 mask time per token (what decoding pays on top of the forward pass), and the time
to turn the packed mask into a boolean over the vocabulary.

    python -m bench.grammar_overhead [--repeats 5] [--threads 1] [--seed 0]

Not here: the forward pass (the model is not run), or any GPU path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["city", "unit", "days", "hourly", "tags"],
    "additionalProperties": False,
}
DOCUMENT = {
    "city": "Lisbon, the old town by the river",
    "unit": "celsius",
    "days": 7,
    "hourly": False,
    "tags": ["travel", "weekend plans", "rain?"],
}


def percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def replay(
    tokens: list[int],
    fill: Callable[[], torch.Tensor],
    allowed: Callable[[torch.Tensor, int], bool],
    consume: Callable[[int], object],
) -> list[float]:
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        mask = fill()
        times.append(time.perf_counter() - t0)
        if not allowed(mask, t):
            raise RuntimeError(f"token {t} refused by the mask")
        consume(t)
    return times


def bit_allowed(mask: torch.Tensor, t: int) -> bool:
    return bool((int(mask[0, t // 32]) >> (t % 32)) & 1)


def run_llguidance(tok: Any, ids: list[int], repeats: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    tok_s = time.perf_counter() - t0
    times: list[float] = []
    first_mask_s = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()  # a fresh schema each time: nothing is cached across requests
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
        llguidance.torch.fill_next_token_bitmask(m, mask)  # the grammar is compiled lazily
        first_mask_s = time.perf_counter() - t0

        def fill(m: Any = m, mask: torch.Tensor = mask) -> torch.Tensor:
            llguidance.torch.fill_next_token_bitmask(m, mask)
            return mask

        times += replay(ids, fill, bit_allowed, m.consume_token)
    return {"tokenizer_s": tok_s, "first_mask_s": first_mask_s, **summary(times)}


def run_xgrammar(tok: Any, ids: list[int], repeats: int) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    times: list[float] = []
    first_mask_s = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        m.fill_next_token_bitmask(mask)
        first_mask_s = time.perf_counter() - t0

        def fill(m: Any = m, mask: torch.Tensor = mask) -> torch.Tensor:
            m.fill_next_token_bitmask(mask)
            return mask

        times += replay(ids, fill, bit_allowed, m.accept_token)
    return {"tokenizer_s": tok_s, "first_mask_s": first_mask_s, **summary(times)}


def summary(times: list[float]) -> dict[str, float]:
    ms = [1000 * t for t in times]
    return {
        "tokens": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
    }


def unpack_ms(vocab: int, repeats: int = 200, seed: int = 0) -> float:
    """Bitmask to a boolean over the vocabulary, as generation.py applies it (the mask's bits
    drawn from ``seed``)."""
    from agent.grammar import unpack_bitmask

    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(-(2**31), 2**31 - 1, ((vocab + 31) // 32,), dtype=torch.int32, generator=g)
    t0 = time.perf_counter()
    for _ in range(repeats):
        unpack_bitmask(mask, vocab)
    return 1000 * (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="draws the packed mask that is unpacked")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from agent.adapters.loading import resolve
    from agent.adapters.tokenizer import checkpoint_tokenizer

    tok = checkpoint_tokenizer(resolve(None))
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    print(f"vocabulary {len(tok)}, document {len(ids)} tokens, {args.repeats} replays")
    results = {
        "llguidance": run_llguidance(tok, ids, args.repeats),
        "xgrammar": run_xgrammar(tok, ids, args.repeats),
    }
    results["unpack_ms"] = {"mean_ms": unpack_ms(len(tok), seed=args.seed)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
