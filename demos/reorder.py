"""``kamera demo``: text chunks encoded once, reordered by rotation alone, a question answered.

The pinned prefix (system prompt) is prefilled once at position 0. Each document chunk is
encoded on its own (its canonical, position-free KV). The chunks are then put in a different
order: every chunk's keys are rotated to its new start, nothing is re-encoded, and only the
question is prefilled. A full re-prefill of the same reordered prompt runs beside it, so the
answer and the time to first token can be compared.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from agent.adapters.loading import load_adapter

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
    console = Console()

    t0 = time.perf_counter()
    adapter = load_adapter(args.model)
    tok = adapter.tokenizer
    console.print(
        f"[bold]model[/] {adapter.info.name} ({adapter.info.architecture}, {adapter.info.family}, "
        f"{adapter.info.n_layers} layers) loaded in {time.perf_counter() - t0:.1f} s"
    )

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    head = ids(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    docs = [ids(d + "\n") for d in DOCUMENTS]
    question = ids(f"Question: {args.question}<|im_end|>\n<|im_start|>assistant\n")
    order = [int(i) for i in args.order.split(",")]
    if sorted(order) != list(range(len(docs))):
        parser.error(f"--order must be a permutation of 0..{len(docs) - 1}")

    # The prefix sits at position 0 for good: prefilled once, reused as-is.
    prefix_kv = adapter.encode(adapter.text(head))
    encoded, encode_ms = [], []
    original_start, start = [], prefix_kv.extent
    for d in docs:  # each document alone: its canonical KV, no position baked in
        t = time.perf_counter()
        encoded.append(adapter.encode(adapter.text(d)))
        encode_ms.append(1000 * (time.perf_counter() - t))
        original_start.append(start)
        start += encoded[-1].extent

    # Reorder: rotate every chunk to its new start; only the question is prefilled.
    t = time.perf_counter()
    placed = [prefix_kv.place(0, adapter.spec)]
    new_start, start = {}, prefix_kv.extent
    for i in order:
        placed.append(encoded[i].place(start, adapter.spec))
        new_start[i] = start
        start += encoded[i].extent
    cache = adapter.assemble(placed)
    assemble_ms = 1000 * (time.perf_counter() - t)
    reused = adapter.generate(adapter.text(question), cache, start, args.max_new_tokens)

    # The reference: the same reordered prompt prefilled from scratch.
    full = torch.cat([head, *(docs[i] for i in order), question])
    reference = adapter.generate(adapter.text(full), adapter.empty_cache(), 0, args.max_new_tokens)

    table = Table(title="chunks: encoded once, moved by rotation")
    for col in ("chunk", "tokens", "first start", "placed at", "rotated by", "recomputed"):
        table.add_column(col, justify="right")
    table.add_row("system prefix", str(prefix_kv.n_tokens), "0", "0", "0", "no (exact prefix)")
    for i in order:
        table.add_row(
            f"document {i + 1}",
            str(encoded[i].n_tokens),
            str(original_start[i]),
            str(new_start[i]),
            f"{new_start[i] - original_start[i]:+d}",
            "no",
        )
    table.add_row("question", str(len(question)), "-", str(start), "-", "yes (prefilled)")
    console.print(table)

    reused_tokens = prefix_kv.n_tokens + sum(e.n_tokens for e in encoded)
    answer_reused = tok.decode(reused.tokens, skip_special_tokens=True).strip()
    answer_full = tok.decode(reference.tokens, skip_special_tokens=True).strip()
    ttft_reused = 1000 * reused.first_token_s + assemble_ms
    ttft_full = 1000 * reference.first_token_s
    console.print(f"[bold]question[/] {args.question}")
    console.print(f"[bold]answer from relocated cache[/]  {answer_reused!r}")
    console.print(
        f"[bold]answer from full re-prefill[/]  {answer_full!r}  "
        f"({'same' if reused.tokens == reference.tokens else 'different'})"
    )
    console.print(
        f"reused {reused_tokens} tokens by rotation, prefilled {len(question)} question tokens; "
        f"time to first token {ttft_reused:.0f} ms (assembly {assemble_ms:.1f} ms) against "
        f"{ttft_full:.0f} ms for the re-prefill of {len(full)} tokens"
    )
    console.print(
        "[dim]Blind relocation drops what each document absorbed from those before it; "
        "conditioning patches restore it.[/]"
    )
    if args.json_path:
        report = {
            "model": adapter.info.name,
            "order": order,
            "tokens_reused": reused_tokens,
            "tokens_prefilled": len(question),
            "answer_relocated": answer_reused,
            "answer_reprefill": answer_full,
            "same_answer": reused.tokens == reference.tokens,
            "ttft_ms_relocated": ttft_reused,
            "ttft_ms_reprefill": ttft_full,
            "assemble_ms": assemble_ms,
            "encode_ms": encode_ms,
        }
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0
