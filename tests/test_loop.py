"""The agent loop's reuse modes on a tiny random model: ``exact`` answers on a fresh prefill of
the window, ``repair`` falls back to it on a close call, ``fast`` never does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _util import greedy, max_rel

from agent.adapters.loading import load_adapter
from agent.context import WindowConfig
from agent.engine.chat import ByteTokenizer, ChatML
from agent.engine.close_calls import CloseCalls
from agent.loop import Agent, TextObservation
from agent.modes import REPAIR_DEPTH_UNIT, REPAIR_MARGIN, REPAIR_RESIDUAL_UNIT, guard_margin

SYSTEM = "You answer from notes."
NOTES = [TextObservation(" ".join(f"note {i}.{j} is {i * j}" for j in range(12))) for i in range(6)]
BUDGET, MAX_NEW_TOKENS = 900, 12


@pytest.fixture(scope="module")
def llama() -> Any:
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    return adapter


def run(adapter: Any, reuse: str, margin: float = 1.0) -> tuple[Agent, list[str]]:
    """Six steps over a window too small for all the notes: early ones slide out."""
    window = WindowConfig(budget_tokens=BUDGET, reuse=reuse, repair_margin=margin)
    agent = Agent(adapter, SYSTEM, window=window, max_new_tokens=MAX_NEW_TOKENS, finalize=False)
    outputs = [agent.step([note], f"What is note {i}.3?").output for i, note in enumerate(NOTES)]
    return agent, outputs


def fresh_answer(adapter: Any, window: list[list[int]], question: list[int]) -> tuple[list[int], list[Any]]:
    """The step answered on a prefill of ``window`` from nothing, straight through the adapter: its
    chunks one after another on an empty cache from position 0 (the passes the loop's re-prefill
    of its window runs, ``ContextManager.fresh_cache``), then the instruction, then greedy
    decoding. The tokens and the logits each was chosen from."""
    with torch.inference_mode():
        cache, start = adapter.empty_cache(), 0
        for chunk in window:
            start += adapter.prefill(adapter.text(chunk), cache, start).kv.extent
        first = adapter.next_logits(adapter.text(question), cache, start)
        return greedy(adapter, first, cache, start + len(question), MAX_NEW_TOKENS)


@pytest.mark.parametrize(
    ("reuse", "margin"),
    [("exact", 0.5), ("repair", 1e9)],  # repair at that margin: every step on moved KV is a close call
)
def test_each_step_answers_as_a_fresh_prefill_of_its_window(
    llama: Any, monkeypatch: pytest.MonkeyPatch, reuse: str, margin: float
) -> None:
    """The window is followed here on its own (the system prompt pinned, then each note and each
    turn of instruction, answer and turn end; the oldest after the prompt leave while the window
    is over budget) and every step is answered again on a prefill of it from nothing. Once a slide
    has moved the chunks the step answers on, exact mode re-prefills the window and repair falls
    back to that re-prefill: the logits the first token is chosen from are the reference's bit for
    bit, and every token the same (the window's chunks, the turns among them, are compared by
    content key)."""
    chat = ChatML()

    def ids(text: str) -> list[int]:
        return list(llama.tokenizer(text, add_special_tokens=False)["input_ids"])

    real_next, real_ask = llama.next_logits, llama.prefill_and_ask
    chosen_from: list[Any] = []  # the logits of each prompt the step ran, last: the one it answered on

    def next_logits(chunk: Any, cache: Any, start: int) -> Any:
        chosen_from.append(real_next(chunk, cache, start))
        return chosen_from[-1]

    def prefill_and_ask(chunks: Any, prompt: Any, cache: Any, start: int) -> Any:
        kvs, logits = real_ask(chunks, prompt, cache, start)
        chosen_from.append(logits)
        return kvs, logits

    agent = Agent(
        llama,
        SYSTEM,
        window=WindowConfig(budget_tokens=BUDGET, reuse=reuse, repair_margin=margin),
        max_new_tokens=MAX_NEW_TOKENS,
        finalize=False,
    )
    monkeypatch.setattr(llama, "next_logits", next_logits)
    monkeypatch.setattr(llama, "prefill_and_ask", prefill_and_ask)
    window = [ids(chat.system(SYSTEM))]
    moved = [False]  # per chunk of ``window``: it survived a slide (its KV moved)

    def add(chunk: list[int]) -> None:
        window.append(chunk)
        moved.append(False)
        while sum(map(len, window)) > BUDGET:
            del window[1], moved[1]
            moved[1:] = [True] * (len(moved) - 1)

    answered_fresh = 0
    for i, note in enumerate(NOTES):
        question = f"What is note {i}.3?"
        add(ids(chat.user_text(note.text)))
        instruction = ids(chat.instruction(question))
        tokens, steps = fresh_answer(llama, window, instruction)
        chosen_from.clear()
        result = agent.step([note], question)
        assert result.output == llama.tokenizer.decode(tokens), f"step {i}"
        err = max_rel(chosen_from[-1], steps[0])
        if any(moved):
            answered_fresh += 1
            same = torch.equal(chosen_from[-1], steps[0])
            assert same, f"step {i}: first logits {err:.1e} off a fresh prefill's"
        else:
            # an unmoved window answers on the KV it holds, which is not a re-prefill's to the last
            # bit (the system prompt was encoded alone and rotated onto the window), only close to
            # it; each turn's answer is prefilled again after decoding (``Agent._record_turn``)
            assert err < 1e-5, f"step {i}: first logits {err:.1e} off a fresh prefill's"
        add(instruction + tokens + ids(chat.end_of_turn()))
        want = [llama.chunk_key(llama.text(chunk)) for chunk in window]
        assert [v.chunk_id for v in agent.context.view()] == want, f"step {i}"
    assert 0 < answered_fresh < len(NOTES)  # both kinds of step were checked
    assert agent.context.counters.fresh_prefills == answered_fresh


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


def steps(adapter: Any, **window: Any) -> list[Any]:
    """The reports of :func:`run`'s six steps under a window configured by ``window``."""
    config = WindowConfig(budget_tokens=BUDGET, **window)
    agent = Agent(adapter, SYSTEM, window=config, max_new_tokens=MAX_NEW_TOKENS, finalize=False)
    return [agent.step([note], f"What is note {i}.3?") for i, note in enumerate(NOTES)]


def test_repair_s_guard_margin_follows_the_residual_the_window_left(llama: Any) -> None:
    """Chat completions' repair on a window: a step on an exact window needs none; once a slide
    moved the window, the moved chunks' most deviating tokens are recomputed, and the guard's margin
    is the configured one scaled by the square root of the residual left over its unit times the
    depth measured over its unit (no cap
    here, and no test of what the repair would pay: nothing is given up). The answers are exact
    mode's."""
    exact = [r.output for r in steps(llama, reuse="exact")]
    results = steps(llama, reuse="repair", repair_margin_cap=0.0, repair_must_pay=False)
    assert [r.output for r in results] == exact
    kinds = [r.report.served for r in results]
    assert kinds[0] == "prefix", kinds
    assert set(kinds) - {"prefix"} <= {"moved", "fallback"}, kinds
    assert set(kinds) - {"prefix"}, kinds
    for r in results:
        rep = r.report
        if rep.served == "prefix":
            assert rep.repair_residual is None
            assert rep.guard_margin is None
            assert rep.tokens_repaired == 0
            continue
        assert rep.repair_residual is not None
        assert rep.repair_residual > 0
        assert rep.tokens_repaired > 0
        assert rep.repair_depth is not None
        assert rep.repair_depth > 0
        want = guard_margin(
            REPAIR_MARGIN, rep.repair_residual, REPAIR_RESIDUAL_UNIT, rep.repair_depth, REPAIR_DEPTH_UNIT
        )
        assert rep.guard_margin == pytest.approx(want)
        if rep.served == "moved":
            assert rep.tokens_reused > 0
            assert rep.escalated_at is None
        else:  # answered on a fresh prefill: nothing of the window counts as reused
            assert rep.tokens_reused == 0


def test_more_recompute_leaves_less_residual(llama: Any) -> None:
    """The share recomputed grows towards repair_max_ratio while the residual is above the unit:
    a larger share leaves a smaller residual on the same moved windows."""
    nothing = {"repair_margin_cap": 0.0, "repair_must_pay": False}  # nothing given up
    few = steps(llama, reuse="repair", **nothing)
    many = steps(llama, reuse="repair", repair_max_ratio=0.6, **nothing)
    pairs = [(a.report, b.report) for a, b in zip(few, many, strict=True) if a.report.served != "prefix"]
    assert pairs
    for a, b in pairs:
        assert b.tokens_repaired > a.tokens_repaired
        assert b.repair_residual < a.repair_residual  # type: ignore[operator]


def test_a_residual_beyond_the_cap_answers_on_a_fresh_prefill_from_the_start(llama: Any) -> None:
    """With a cap no moved window can meet, every moved step is given up before decoding: the
    answers are exact mode's, no guard watches, and nothing of the window counts as reused; with
    a margin every step fails and no cap, each moved step falls back at its first token."""
    exact = [r.output for r in steps(llama, reuse="exact")]
    given_up = steps(llama, reuse="repair", repair_margin_cap=1e-9)
    assert [r.output for r in given_up] == exact
    moved = [r.report for r in given_up if r.report.served != "prefix"]
    assert moved
    assert all(rep.served == "given_up" for rep in moved)
    assert all(rep.guard_margin is None and rep.tokens_reused == 0 for rep in moved)
    close = steps(llama, reuse="repair", repair_margin=1e9, repair_margin_cap=0.0, repair_must_pay=False)
    assert [r.output for r in close] == exact
    moved = [r.report for r in close if r.report.served != "prefix"]
    assert moved
    assert all(rep.served == "fallback" and rep.escalated_at == 0 for rep in moved)
    assert all(rep.tokens_reused == 0 for rep in moved)


def test_a_window_repair_that_would_not_pay_is_answered_on_a_fresh_prefill(llama: Any) -> None:
    """Chat completions' test on a session's window: where every recent answer (shared with
    whatever else answers on the model) met a call closer than the guard's margin, a moved window
    is given up before its new tokens are prefilled on it; the answers are exact mode's. With the
    test off the same steps fall back; with recent answers all clear (and a guard that never
    calls) they stay on the window. Each step adds its answer's gaps to what is shared."""
    exact = [r.output for r in steps(llama, reuse="exact")]

    def with_history(gap: float, **window: Any) -> list[Any]:
        calls = CloseCalls()
        for _ in range(200):
            calls.add([gap] * MAX_NEW_TOKENS)
        config = WindowConfig(budget_tokens=BUDGET, reuse="repair", repair_margin_cap=0.0, **window)
        agent = Agent(
            llama, SYSTEM, window=config, max_new_tokens=MAX_NEW_TOKENS, finalize=False, close_calls=calls
        )
        out = [agent.step([note], f"What is note {i}.3?") for i, note in enumerate(NOTES)]
        assert len(calls) == min(200 + len(NOTES), 256)
        return out

    close = {"repair_margin": 1e9}
    for results, served in (
        (with_history(0.0, **close), {"given_up"}),
        (with_history(0.0, repair_must_pay=False, **close), {"fallback"}),
    ):
        assert [r.output for r in results] == exact
        assert {r.report.served for r in results} - {"prefix"} == served
    # a guard that never calls a step close: the window's repaired KV answers (not exact's words)
    kept = with_history(1e3, repair_margin=1e-9, repair_residual_unit=0.0)
    assert {r.report.served for r in kept} - {"prefix"} == {"moved"}


def test_a_kept_turn_holds_a_prefill_s_kv_not_the_decode_steps(
    llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer goes into the cache by decode steps, whose numbers are not a prefill's (one row,
    attention over the whole cache; a GGUF model's steps on int8 activations). Before the window
    keeps the turn, a cut-invariant model prefills the answer again (``Agent._record_turn``), so
    the turn's KV is, bit for bit, what a prefill of the turn after its context writes. Inverse:
    a model taken as not cut-invariant keeps the decode steps' KV, which this check tells apart."""

    def turn_vs_prefill(cut_invariant: bool) -> bool:
        seen: list[bool] = []
        real_tail = llama.kv_tail

        def kv_tail(cache: Any, chunk: Any, start: int) -> Any:
            kv = real_tail(cache, chunk, start)
            if chunk.n_tokens > 1:  # the last one taken is the turn's: instruction, answer, turn end
                ctx = llama.cache_length(cache) - chunk.n_tokens
                kv_layers = [llama.layer_kv(cache, i) for i in range(llama.info.n_layers)]
                k = torch.stack([lk[:, :ctx] for lk, _ in kv_layers]).clone()
                v = torch.stack([lv[:, :ctx] for _, lv in kv_layers]).clone()
                ref = llama.new_cache([(k, v)])
                with torch.inference_mode():
                    llama.prefill(chunk, ref, start, last_only=True)
                want = real_tail(ref, chunk, start)
                seen.append(torch.equal(kv.k, want.k) and torch.equal(kv.v, want.v))
            return kv

        with monkeypatch.context() as m:
            m.setattr(llama, "kv_tail", kv_tail)
            m.setattr(type(llama), "cut_invariant", property(lambda self: cut_invariant))
            agent = Agent(
                llama, SYSTEM, window=WindowConfig(budget_tokens=BUDGET), max_new_tokens=8, finalize=False
            )
            result = agent.step([NOTES[0]], "What is note 0.3?")
        assert seen, "the turn was not kept"
        assert result.output
        return seen[-1]

    assert turn_vs_prefill(True)
    assert not turn_vs_prefill(False)
