"""The agent loop's reuse modes on a tiny random model: ``exact`` answers on a fresh prefill of
the window, ``repair`` falls back to it on a close call, ``fast`` never does."""

from __future__ import annotations

from typing import Any

import pytest

from agent.adapters.loading import load_adapter
from agent.context import WindowConfig
from agent.loop import Agent, TextObservation
from agent.server.chat import ByteTokenizer

NOTES = [TextObservation(" ".join(f"note {i}.{j} is {i * j}" for j in range(12))) for i in range(6)]


@pytest.fixture(scope="module")
def llama() -> Any:
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    return adapter


def run(adapter: Any, reuse: str, margin: float = 1.0) -> tuple[Agent, list[str]]:
    """Six steps over a window too small for all the notes: early ones slide out."""
    window = WindowConfig(budget_tokens=900, reuse=reuse, repair_margin=margin)
    agent = Agent(adapter, "You answer from notes.", window=window, max_new_tokens=12, finalize=False)
    outputs = [agent.step([note], f"What is note {i}.3?").output for i, note in enumerate(NOTES)]
    return agent, outputs


def test_a_window_that_slid_answers_like_a_fresh_prefill_once_repair_falls_back(llama: Any) -> None:
    exact_agent, exact = run(llama, "exact")
    assert exact_agent.context.counters.slides > 0  # the window moved: reused KV is approximate
    # a fresh prefill for every step whose window moved; one still as appended needs none
    moved = exact_agent.context.counters.fresh_prefills
    assert 0 < moved < len(NOTES)
    always, guarded = run(llama, "repair", margin=1e9)  # every first step is a close call
    assert guarded == exact
    assert always.context.counters.fresh_prefills == moved


def test_fast_never_falls_back_and_repair_only_on_close_calls(llama: Any) -> None:
    fast_agent, _ = run(llama, "fast")
    assert fast_agent.context.counters.fresh_prefills == 0
    quiet, _ = run(llama, "repair", margin=1e-9)  # no call is that close
    assert quiet.context.counters.fresh_prefills == 0


def test_an_unknown_reuse_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="reuse"):
        WindowConfig(reuse="sometimes")


def test_a_step_that_keeps_no_turn_leaves_the_window_as_it_was(llama: Any) -> None:
    window = WindowConfig(budget_tokens=900, reuse="exact")
    agent = Agent(llama, "You answer from notes.", window=window, max_new_tokens=8, finalize=False)
    agent.step([NOTES[0]], "What is note 0.3?")  # a turn kept: the window is prefix, note, turn
    before = [(v.chunk_id, v.start) for v in agent.context.view()]
    first = agent.step([], "What is note 0.5?", keep_turn=False)
    assert [(v.chunk_id, v.start) for v in agent.context.view()] == before
    # the question and answer written after the window are gone from the live cache
    assert llama.cache_length(agent.context.cache()) == agent.context.tokens
    again = agent.step([], "What is note 0.5?", keep_turn=False)
    assert again.output == first.output
    # and the window still answers as a fresh prefill of it does
    fresh = Agent(llama, "You answer from notes.", window=window, max_new_tokens=8, finalize=False)
    fresh.step([NOTES[0]], "What is note 0.3?")
    assert fresh.step([], "What is note 0.5?").output == first.output
