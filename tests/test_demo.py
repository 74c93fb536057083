"""``kamera demo``: the agent conversation's window (append, slide, reorder), each model call
answered with reuse and by a full prefill, and a report that fits 80 columns when piped."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from agent.adapters.base import ModelAdapter
from agent.adapters.loading import load_adapter
from agent.byte_tokenizer import ByteTokenizer
from agent.engine.prompt_cache import SERVED
from demos import conversation
from demos.conversation import WIDTH, run
from demos.conversation_trace import PASSAGES, STEPS, Entry, Step, apply, to_messages

BOX_DRAWING = re.compile("[\u2500-\u257f]")


def _windows() -> list[list[Entry]]:
    out: list[list[Entry]] = []
    window: list[Entry] = []
    for step in STEPS:
        window = apply(window, step)
        out.append(window)
    return out


def test_the_conversation_appends_slides_and_reorders() -> None:
    """Each step's window is what its change says: an appended window starts with the whole
    previous one, a slid one has lost the oldest tool output and keeps the rest in order, a
    reordered one holds the same passages in another order."""
    assert [s.change for s in STEPS].count("slid") == 1
    assert [s.change for s in STEPS].count("reordered") == 1
    windows = _windows()
    for before, after, step in zip(windows[:-1], windows[1:], STEPS[1:], strict=True):
        if step.change == "appended":
            assert after[: len(before)] == before
        elif step.change == "slid":
            dropped = [e for e in before if e.name in step.drop]
            assert [e.role for e in dropped] == ["assistant", "tool"]
            assert dropped[1] == next(e for e in before if e.role == "tool")  # the oldest output
            kept = [e for e in before if e.name not in step.drop]
            assert after[: len(kept)] == kept
        else:
            assert step.change == "reordered"
            assert step.rerank is not None
            name = step.rerank[0]
            old = next(e for e in before if e.name == name)
            new = next(e for e in after if e.name == name)
            assert sorted(new.passages) == sorted(old.passages)
            assert new.passages != old.passages
            assert [e.name for e in after[: len(before)]] == [e.name for e in before]
        assert len([e for e in after if e.role == "tool"]) <= 3  # the window keeps three outputs


def test_tool_outputs_are_rendered_as_the_server_renders_them() -> None:
    window = _windows()[2]
    plain = to_messages(window, native_tools=False)
    assert plain[0].role == "system"
    outputs = [m for m in plain if str(m.parts[0]).startswith("<tool_response>\n")]
    assert len(outputs) == 2
    assert all(m.role == "user" for m in outputs)
    assert PASSAGES["pool"] in str(outputs[1].parts[0])
    assert [m.role for m in to_messages(window, native_tools=True)].count("tool") == 2
    calls = [m for m in plain if m.role == "assistant"]
    assert all(str(m.parts[-1]).startswith("<tool_call>\n") for m in calls)


def test_a_step_that_drops_what_the_window_lacks_is_refused() -> None:
    with pytest.raises(KeyError, match="does not hold"):
        apply([], Step("slid", "x", drop=("logs",)))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread, then the count as it was: on a busy CPU, two threads wait for each
    other at every small product of the prompt cache's segments."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def piped(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """``kamera demo`` on a tiny random model with the byte tokenizer, its stdout captured (not
    a terminal)."""
    path = tmp_path_factory.mktemp("demo") / "demo.json"
    tiny = load_adapter("tiny:llama-gqa", tokenizer=ByteTokenizer())
    out = io.StringIO()
    args = ["--max-new-tokens", "3", "--threads", "1", "--json", str(path)]
    with one_thread(), pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(conversation, "load_adapter", lambda model: tiny)
        assert conversation.main(args) == 0
    return out.getvalue(), json.loads(path.read_text())


def test_every_call_is_answered_both_ways_and_compared(piped: tuple[str, dict[str, Any]]) -> None:
    _, report = piped
    turns = report["turns"]
    assert [t["change"] for t in turns] == [s.change for s in STEPS]
    for t in turns:
        assert t["usage"]["served"] in SERVED
        assert t["same_answer"] == (t["reuse"]["tokens"] == t["full_prefill"]["tokens"])
        assert t["cached_tokens"] == t["usage"]["prefix_tokens"] + t["usage"]["relocated_tokens"]
        for side in ("reuse", "full_prefill"):
            assert 0 < t[side]["ttft_s"] <= t[side]["e2e_s"]
    assert turns[0]["cached_tokens"] == 0  # nothing stored before the first call
    for before, t in itertools.pairwise(turns):
        stored, prefix = before["usage"]["prompt_tokens"], t["usage"]["prefix_tokens"]
        if t["change"] == "appended":  # the previous prompt, up to its last segment's edge
            assert stored - 128 < prefix <= stored
        else:  # slid or reordered: the prompt differs from the previous one before its end
            assert prefix < stored
    totals = report["totals"]
    assert totals["answers_equal"] == sum(t["same_answer"] for t in turns)
    assert sum(totals["served"].values()) == len(turns)
    reuse = sum(t["reuse"]["e2e_s"] for t in turns)
    assert totals["e2e_s"]["reuse"] == pytest.approx(reuse, abs=1e-3)


def test_the_piped_report_fits_80_columns_in_plain_text(piped: tuple[str, dict[str, Any]]) -> None:
    text, report = piped
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert "\x1b" not in text
    assert not BOX_DRAWING.search(text)
    rows = [line for line in lines if re.match(r"\| \d \w+", line)]
    assert len(rows) == len(STEPS)
    for row, t in zip(rows, report["turns"], strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == f"{t['turn']} {t['change']}"
        assert cells[1] == t["usage"]["served"]
        assert cells[-1] == ("yes" if t["same_answer"] else "no")
    t = report["totals"]
    assert f"answers equal:       {t['answers_equal']}/{len(STEPS)}" in text


@pytest.mark.slow
def test_the_embedded_model_meets_moved_content_where_the_window_changed(smollm2: ModelAdapter) -> None:
    """The conversation on SmolLM2 (its chat template, its tokens): appended calls take the
    previous prompt as their exact prefix; the slid and the reordered call cannot, and the
    cache finds their moved content by content (answered from it, or placed and abandoned for
    exact KV); what each reused and prefilled adds up to its prompt."""
    with one_thread():
        turns = run(smollm2, max_new_tokens=4)
    assert [t.change for t in turns] == [s.change for s in STEPS]
    for t in turns:
        assert t.usage.served in SERVED
        assert t.usage.cached_tokens + t.usage.prefilled_tokens == t.usage.prompt_tokens
    for before, t in itertools.pairwise(turns):
        stored, u = before.usage.prompt_tokens, t.usage
        if t.change == "appended":
            assert stored - 128 < u.prefix_tokens <= stored
        else:
            assert u.prefix_tokens < stored
            assert u.relocated_tokens + u.abandoned_tokens > 0
