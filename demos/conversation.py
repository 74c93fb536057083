"""``kamera demo``: an agent conversation whose window appends, slides and reorders, each model
call answered with reuse and by a full prefill, side by side.

The conversation (``demos/conversation_trace.py``) is an on-call agent's: a system prompt with
four tools, tool outputs, retrieved passages and user turns. Before each model call the context
manager changes the window: it appends (the prompt starts with the last one: an exact prefix),
drops the oldest tool output (everything after it moves), or re-ranks the retrieved passages
(they swap places). Each call's prompt is then answered twice, greedily:

- with reuse: ``agent.engine.answer.answer`` on one ``PromptCache`` that holds what the earlier
  calls stored, in the server's default reuse mode (``--reuse-mode``), exactly as ``kamera serve``
  answers a chat completion (the commit of the prompt's KV included in the end-to-end time);
- by a full prefill: ``agent.engine.full_prefill``, the fastest way the engine answers with
  nothing cached (the whole prompt in one forward pass into a fresh cache, nothing stored).

Per call: what changed, how the reused answer was served (``PromptUsage.served``), the prompt
tokens it took from the cache, time to first token and end to end for both, and whether the two
answers are the same tokens; then the totals. Both paths run once on a short prompt first, so
that neither pays for loading kernels. The first call has nothing to reuse: the prompt cache
prefills it in one pass too (its KV then taken out and stored), about the full prefill's time.

Not here: the conversation itself (``conversation_trace.py``); how reuse and the guard work
(``agent/engine/prompt_cache.py``, ``agent/engine/answer.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.table import Table

from agent.adapters.loading import load_adapter
from agent.engine.answer import answer
from agent.engine.chat import Message, render, takes_tools
from agent.engine.full_prefill import full_prefill
from agent.engine.generation import Decoded, SamplingParams
from agent.engine.prompt_cache import PromptCache, PromptCacheConfig, PromptUsage, build_prompt
from agent.modes import DEFAULT_MODE, MODE_HELP, REUSE_MODES, ReuseMode
from agent.tables import make_console, print_table
from cache.store import StoreConfig, TieredStore
from demos.conversation_trace import STEPS, TOOLS, Change, Entry, Step, apply, to_messages

WIDTH = 80  # a piped report fits an 80-column terminal
HOST_BYTES = 2 << 30  # the store's host budget, kamera serve's default


class Side(NamedTuple):
    """One way of answering a prompt: its greedy tokens and text, and how long it took."""

    tokens: list[int]
    text: str
    ttft_s: float  # from the call to the first token
    e2e_s: float  # from the call until the answer is returned (with reuse: its KV committed)


class Turn(NamedTuple):
    step: int  # 1-based
    change: Change
    note: str
    usage: PromptUsage  # the reused answer's
    reuse: Side
    full: Side

    @property
    def same(self) -> bool:
        return self.reuse.tokens == self.full.tokens


def _side(adapter: Any, decoded: Decoded, t0: float) -> Side:
    """``decoded`` as one way of answering, timed from ``t0`` (its call) to now."""
    e2e = time.perf_counter() - t0
    text = adapter.tokenizer.decode(decoded.tokens, skip_special_tokens=True)
    return Side(decoded.tokens, text, decoded.first_token_at - t0, e2e)


def _new_cache(adapter: Any, mode: ReuseMode) -> PromptCache:
    store = TieredStore.from_config(StoreConfig(host_bytes=HOST_BYTES))
    return PromptCache(adapter, store, PromptCacheConfig(mode=mode))


def run(
    adapter: Any,
    mode: ReuseMode = DEFAULT_MODE,
    max_new_tokens: int = 20,
    steps: Sequence[Step] = STEPS,
) -> list[Turn]:
    """Every step of ``steps`` applied to the window, its prompt answered with reuse (one prompt
    cache for the whole conversation, in ``mode``) and by a full prefill: one ``Turn`` each."""
    params = SamplingParams(max_tokens=max_new_tokens)
    native = takes_tools(adapter.tokenizer)

    def prompt_of(messages: Sequence[Message], pc: PromptCache) -> Any:
        return build_prompt(adapter, render(adapter.tokenizer, messages, TOOLS), pc.image_unit)

    turns: list[Turn] = []
    with torch.inference_mode():
        warm = _new_cache(adapter, mode)
        short = prompt_of([Message("user", ("Hello.",))], warm)
        answer(warm, short, "", mode, params)
        full_prefill(adapter, short, params)

        pc, window = _new_cache(adapter, mode), list[Entry]()
        for i, step in enumerate(steps, 1):
            window = apply(window, step)
            prompt = prompt_of(to_messages(window, native), pc)
            t0 = time.perf_counter()
            reused = answer(pc, prompt, "", mode, params)
            reuse = _side(adapter, reused.decoded, t0)
            t0 = time.perf_counter()
            full = _side(adapter, full_prefill(adapter, prompt, params).decoded, t0)
            turns.append(Turn(i, step.change, step.note, reused.usage, reuse, full))
    return turns


def totals(turns: Sequence[Turn]) -> dict[str, Any]:
    served: dict[str, int] = {}
    for t in turns:
        served[t.usage.served] = served.get(t.usage.served, 0) + 1
    out: dict[str, Any] = {
        "turns": len(turns),
        "answers_equal": sum(t.same for t in turns),
        "served": served,
        "prompt_tokens": sum(t.usage.prompt_tokens for t in turns),
        "cached_tokens": sum(t.usage.cached_tokens for t in turns),
    }
    for key in ("ttft_s", "e2e_s"):
        reuse = sum(getattr(t.reuse, key) for t in turns)
        full = sum(getattr(t.full, key) for t in turns)
        out[key] = {"reuse": round(reuse, 4), "full_prefill": round(full, 4), "saved": round(full - reuse, 4)}
    return out


def report(turns: Sequence[Turn], model: str, mode: ReuseMode, max_new_tokens: int) -> dict[str, Any]:
    """Every figure, for ``--json``."""

    def side(s: Side) -> dict[str, Any]:
        return {
            "ttft_s": round(s.ttft_s, 4),
            "e2e_s": round(s.e2e_s, 4),
            "answer": s.text,
            "tokens": s.tokens,
        }

    return {
        "model": model,
        "mode": mode,
        "max_new_tokens": max_new_tokens,
        "turns": [
            {
                "turn": t.step,
                "change": t.change,
                "note": t.note,
                "usage": t.usage._asdict(),
                "cached_tokens": t.usage.cached_tokens,
                "reuse": side(t.reuse),
                "full_prefill": side(t.full),
                "same_answer": t.same,
            }
            for t in turns
        ],
        "totals": totals(turns),
    }


def _ms(s: float) -> str:
    return f"{1000 * s:.0f}"


def table(turns: Sequence[Turn]) -> Table:
    t = Table(title="each model call answered with reuse and by a full prefill (times in ms)")
    t.add_column("turn")
    t.add_column("served")
    for header in ("cached/\nprompt", "TTFT\nreuse", "TTFT\nfull", "e2e\nreuse", "e2e\nfull"):
        t.add_column(header, justify="right")
    t.add_column("same")
    for r in turns:
        t.add_row(
            f"{r.step} {r.change}",
            r.usage.served,
            f"{r.usage.cached_tokens}/{r.usage.prompt_tokens}",
            _ms(r.reuse.ttft_s),
            _ms(r.full.ttft_s),
            _ms(r.reuse.e2e_s),
            _ms(r.full.e2e_s),
            "yes" if r.same else "no",
        )
    return t


def _clip(text: str, width: int) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 3] + "..."


def _saved(label: str, reuse: float, full: float) -> str:
    """One row of the totals: both times and what reuse saved (negative: what it lost)."""
    saved = full - reuse
    share = saved / full if full > 0 else 0.0
    return f"{label:<20}{reuse:>9.2f} s{full:>13.2f} s{saved:>9.2f} s ({share:.0%})"


def show(console: Console, turns: Sequence[Turn], mode: ReuseMode) -> None:
    """The per-call table, the answers and the totals, at the console's width."""
    print_table(console, table(turns))
    width = min(console.width, WIDTH)
    console.print("\nanswers with reuse (and the full prefill's, where it differs)", markup=False)
    for r in turns:
        console.print(
            f"{r.step:>2} {'same' if r.same else 'diff'} {_clip(r.reuse.text, width - 8)}", markup=False
        )
        if not r.same:
            console.print(f"   full {_clip(r.full.text, width - 8)}", markup=False)
    s = totals(turns)
    served = ", ".join(f"{n} {name}" for name, n in s["served"].items())
    share = s["cached_tokens"] / max(1, s["prompt_tokens"])
    lines = [
        f"answers equal:       {s['answers_equal']}/{s['turns']}",
        f"served:              {served}",
        f"cached:              {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens ({share:.0%})",
        "",
        f"{'':<20}{'with reuse':>11}{'full prefill':>15}{'saved':>11}",
        _saved("time to first token", s["ttft_s"]["reuse"], s["ttft_s"]["full_prefill"]),
        _saved("end to end", s["e2e_s"]["reuse"], s["e2e_s"]["full_prefill"]),
    ]
    console.print("\n" + "\n".join(lines), markup=False, highlight=False)
    console.print(
        f"\n[dim]reuse: the server's prompt cache in mode {mode} ({MODE_HELP[mode]}). served: prefix, "
        "on exact KV only (an exact prefix, the rest prefilled); moved, on KV moved by rotation and "
        "repaired; fallback, on exact KV after a call too close for moved KV; given_up, on exact KV, "
        "the repair given up before decoding. full: the whole prompt in one forward pass, nothing "
        "cached. same: the two answers are the same tokens. The first call finds nothing cached: "
        "the prompt cache prefills it in one pass too, and takes its KV out to store it.[/]"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """An agent conversation whose window appends, slides and reorders, answered with reuse and
    by a full prefill side by side: the answers and the time saved."""
    parser = argparse.ArgumentParser(prog="kamera demo", description=__doc__)
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument(
        "--reuse-mode", choices=REUSE_MODES, default=DEFAULT_MODE, help="the prompt cache's mode"
    )
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    console = make_console(plain_width=WIDTH)

    t0 = time.perf_counter()
    adapter = load_adapter(args.model)
    info = adapter.info
    console.print(
        f"[bold]model[/] {info.name} ({info.architecture}, {info.n_layers} layers) loaded in "
        f"{time.perf_counter() - t0:.1f} s; torch threads: {torch.get_num_threads()}"
    )
    console.print(
        f"An on-call agent's conversation, {len(STEPS)} model calls. Before each, the window "
        f"changes; then its prompt is answered twice, greedily ({args.max_new_tokens} tokens): "
        f"with reuse (the server's prompt cache, mode {args.reuse_mode}, holding what earlier "
        "calls stored) and by a full prefill (nothing cached).\n",
        markup=False,
    )
    for i, step in enumerate(STEPS, 1):
        console.print(f"{i:>2} {step.change:<10} {step.note}", markup=False)
    console.print()
    turns = run(adapter, args.reuse_mode, args.max_new_tokens)
    show(console, turns, args.reuse_mode)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report(turns, info.name, args.reuse_mode, args.max_new_tokens), f, indent=2)
    return 0
