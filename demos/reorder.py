"""``kamera demo``: documents reused at new positions through the server's prompt cache, with
the answer of each reuse mode beside a full prefill's.

A first request asks about three documents in one order; its KV is stored. A second request
puts the same documents in another order. It is answered through the same prompt cache that
``kamera serve`` runs, once per reuse mode: ``fast`` moves every document's stored KV by
rotation alone (blind: what each absorbed from the documents before it stays wrong), ``repair``
moves them and recomputes the share of their tokens that deviates most in this context,
``exact`` reuses only the exact prefix (the system prompt) and prefills the rest. ``repair``
decodes under the server's guard: documents that bind to new neighbours stay far from their
context after repair, so a call too close for that moves decoding to exact KV (``fallback``
counts the tokens prefilled again), and a repair that would leave them too far off to decode on
at all (``residual``) is given up for an exact prefill once measured, before its recompute. A
full prefill of the reordered prompt is the reference: the table shows what each mode reused,
recomputed and answered, and whether the answer is the full prefill's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import torch
from rich.table import Table

from agent.adapters.loading import load_adapter
from agent.engine.answer import answer
from agent.engine.chat import Message, render
from agent.engine.generation import SamplingParams
from agent.engine.prompt_cache import PromptCache, PromptCacheConfig, build_prompt
from agent.tables import make_console, print_table
from cache.store import StoreConfig, TieredStore

SYSTEM = "You are a helpful assistant. Answer from the documents, in a few words."
DOCUMENTS = [
    "Document 1. The Rhine rises in the Swiss Alps, flows through Lake Constance and along the "
    "French-German border, and reaches the North Sea in the Netherlands near Rotterdam.",
    "Document 2. Marie Curie was born in Warsaw in 1867. She moved to Paris to study physics, and "
    "she was the first person to win Nobel Prizes in two different sciences.",
    "Document 3. The Great Barrier Reef lies off the coast of Queensland in Australia. It is the "
    "largest coral reef system on Earth and can be seen from space.",
]
QUESTION = "In which city was Marie Curie born?"


def run(adapter: Any, question: str, order: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    """The first request stored, then the documents in ``order`` answered in each reuse mode
    (each from the same stored first request) and by a full prefill: the report."""
    params = SamplingParams(max_tokens=max_new_tokens)

    def messages(docs: Sequence[str]) -> list[Message]:
        return [Message("system", (SYSTEM,)), Message("user", (*[d + "\n" for d in docs], question))]

    def ask(pc: PromptCache, docs: Sequence[str], mode: Any) -> dict[str, Any]:
        prompt = build_prompt(adapter, render(adapter.tokenizer, messages(docs)), pc.image_unit)
        t = time.perf_counter()
        answered = answer(pc, prompt, "", mode, params)
        out, u = answered.decoded, answered.usage
        return {
            "mode": mode,
            "answer": adapter.tokenizer.decode(out.tokens, skip_special_tokens=True).strip(),
            "tokens": out.tokens,
            "prompt_tokens": u.prompt_tokens,
            "exact_tokens": u.prefix_tokens,
            "content_tokens": u.relocated_tokens,
            "repair_recomputed_tokens": u.repaired_tokens,
            "repair_residual": u.repair_residual,
            "prefilled_tokens": u.prefilled_tokens,
            "rotated_tokens": u.rotated_tokens,
            "exact_fallback_tokens": u.fallback_tokens,
            "ttft_ms": 1000 * (out.first_token_at - t),
        }

    reordered = [DOCUMENTS[i] for i in order]
    rows = []
    with torch.inference_mode():
        full = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=1 << 20)))
        reference = ask(full, reordered, "exact")
        for mode in ("fast", "repair", "exact"):
            # each mode starts from the same stored first request, documents in their first order
            pc = PromptCache(
                adapter, TieredStore.from_config(StoreConfig(host_bytes=256 << 20)), PromptCacheConfig()
            )
            ask(pc, DOCUMENTS, "exact")
            rows.append(ask(pc, reordered, mode))
    return {"model": adapter.info.name, "order": list(order), "reference": reference, "modes": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kamera demo", description=__doc__)
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--order", default="2,0,1", help="new order of the three documents")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    console = make_console()
    try:
        order = [int(i) for i in args.order.split(",")]
    except ValueError:
        order = []
    if sorted(order) != list(range(len(DOCUMENTS))):
        parser.error(f"--order must be a permutation of 0..{len(DOCUMENTS) - 1}")

    t0 = time.perf_counter()
    adapter = load_adapter(args.model)
    console.print(
        f"[bold]model[/] {adapter.info.name} ({adapter.info.architecture}, {adapter.info.family}, "
        f"{adapter.info.n_layers} layers) loaded in {time.perf_counter() - t0:.1f} s"
    )
    report = run(adapter, args.question, order, args.max_new_tokens)
    reference, rows = report["reference"], report["modes"]

    table = Table(title=f"documents reordered to {args.order}: each reuse mode against a full prefill")
    for col in (
        "mode",
        "reused exactly",
        "reused by content",
        "repair recomputed",
        "prefilled",
        "residual",
        "fallback",
        "TTFT ms",
        "answer",
        "= full prefill",
    ):
        table.add_column(col, justify="right" if col not in ("answer", "mode") else "left")
    for r in rows:
        table.add_row(
            r["mode"],
            str(r["exact_tokens"]),
            str(r["content_tokens"]),
            str(r["repair_recomputed_tokens"]),
            str(r["prefilled_tokens"]),
            f"{r['repair_residual']:.1e}" if r["repair_residual"] else "-",
            str(r["exact_fallback_tokens"]),
            f"{r['ttft_ms']:.0f}",
            repr(r["answer"]),
            "yes" if r["tokens"] == reference["tokens"] else "no",
        )
    table.add_row(
        "full prefill",
        "0",
        "0",
        "0",
        str(reference["prefilled_tokens"]),
        "-",
        "0",
        f"{reference['ttft_ms']:.0f}",
        repr(reference["answer"]),
        "-",
    )
    console.print(f"[bold]question[/] {args.question}")
    print_table(console, table)
    console.print(
        "[dim]fast: stored KV moved by rotation alone; repair: moved, and the tokens whose layer-1 "
        "KV deviates most in this context recomputed through every layer, then decoded under a "
        "guard that moves to exact KV at a call too close for what the repair left (residual; "
        "fallback: the tokens prefilled again for it; a repair left too far off is given up for "
        "an exact prefill once measured); exact: only the exact prefix reused. The server's "
        "default is set by --reuse-mode.[/]"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0
