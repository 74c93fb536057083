"""Guarded decoding on repaired KV: a close call moves decoding to exact KV, and the answer is a
full prefill's (tiny random model, greedy and sampled with a seed)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest

from agent.engine.answer import answer, guard_margin
from agent.engine.chat import Message
from agent.engine.close_calls import CloseCalls
from agent.engine.generation import SamplingParams, decode
from agent.engine.prompt_cache import PromptCache
from tests.test_prompt_cache import CONFIG, chat, llama, make_cache, prompt_of  # noqa: F401

PARAMS = SamplingParams(max_tokens=24)
FIRST = chat("Now: 1")
MOVED = chat("Now: a much longer first line, which shifts all that follows")


class Scripted:
    """A guard that lets the first ``quiet`` steps through and then calls every step too close."""

    def __init__(self, pc: PromptCache, prompt: Any, quiet: int) -> None:
        self.pc, self.prompt, self.quiet, self.steps, self.escalations = pc, prompt, quiet, 0, 0

    @property
    def margin(self) -> float:
        self.steps += 1
        return float("-inf") if self.steps <= self.quiet else float("inf")

    def exact(self) -> tuple[Any, Any, int]:
        self.escalations += 1
        ex = self.pc.prepare(self.prompt, "", "exact")
        return ex.cache, ex.logits, ex.position


def _greedy(pc: PromptCache, prepared: Any, **kw: Any) -> Any:
    cache, position = prepared.cache, prepared.position
    return decode(pc.adapter, prepared.logits, cache, position, PARAMS, threading.Event(), **kw)


def _setup(llama: Any) -> tuple[PromptCache, Any, list[int], list[int], int]:  # noqa: F811
    pc = make_cache(llama)
    pc.commit(pc.prepare(prompt_of(pc, FIRST)))
    moved = prompt_of(pc, MOVED)
    reference = _greedy(pc, pc.prepare(moved, "reference")).tokens
    blind = _greedy(pc, pc.prepare(moved, mode="fast")).tokens
    first_diff = next(i for i, (a, b) in enumerate(zip(blind, reference, strict=False)) if a != b)
    return pc, moved, reference, blind, first_diff


def test_a_close_call_after_a_divergence_rewinds_to_the_exact_answer(llama: Any) -> None:  # noqa: F811
    pc, moved, reference, _, d = _setup(llama)
    assert d + 2 < PARAMS.max_tokens  # blind reuse changed the answer early: there is something to mend
    guard = Scripted(pc, moved, quiet=d + 2)
    out = _greedy(pc, pc.prepare(moved, mode="fast"), guard=guard)
    assert guard.escalations == 1
    assert out.escalated_at == d + 2
    assert out.diverged == 0
    assert out.tokens == reference


def test_text_already_streamed_is_kept_and_what_differs_is_counted(llama: Any) -> None:  # noqa: F811
    pc, moved, _, blind, d = _setup(llama)
    sent: list[str] = []
    guard = Scripted(pc, moved, quiet=d + 2)
    out = _greedy(pc, pc.prepare(moved, mode="fast"), guard=guard, on_text=lambda t, _: sent.append(t))
    assert out.tokens[: d + 2] == blind[: d + 2]
    assert out.diverged == 2
    assert "".join(sent) == out.text


SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=11)


def _sampled(pc: PromptCache, prepared: Any, params: SamplingParams = SAMPLED, **kw: Any) -> Any:
    cache, position = prepared.cache, prepared.position
    return decode(pc.adapter, prepared.logits, cache, position, params, threading.Event(), **kw)


def test_sampled_decoding_under_a_guard_draws_what_exact_kv_draws_with_its_seed(llama: Any) -> None:  # noqa: F811
    """The guard watches sampled steps too (logits plus the step's noise): after a close call the
    tokens drawn on blind KV are replayed with the same noise on exact KV and rewound at the first
    that differs, so the answer is the exact path's draw for that seed."""
    pc = make_cache(llama)
    pc.commit(pc.prepare(prompt_of(pc, FIRST)))
    moved = prompt_of(pc, MOVED)
    reference = _sampled(pc, pc.prepare(moved, "reference")).tokens
    blind = _sampled(pc, pc.prepare(moved, mode="fast")).tokens
    assert _sampled(pc, pc.prepare(moved, "reference again")).tokens == reference  # seeded
    d = next(i for i, (a, b) in enumerate(zip(blind, reference, strict=False)) if a != b)
    assert d + 2 < SAMPLED.max_tokens
    guard = Scripted(pc, moved, quiet=d + 2)
    out = _sampled(pc, pc.prepare(moved, mode="fast"), guard=guard)
    assert (guard.escalations, out.escalated_at) == (1, d + 2)
    assert out.tokens == reference
    quiet = Scripted(pc, moved, quiet=10**6)  # every call clear: the blind draw stands
    assert _sampled(pc, pc.prepare(moved, mode="fast"), guard=quiet).tokens == blind
    assert quiet.escalations == 0


def test_no_sampled_step_under_a_nucleus_is_clear(llama: Any) -> None:  # noqa: F811
    """With top_p < 1 the nucleus moves with the logits: a guard moves to exact KV at once, and
    ``answer`` prepares such a request exact rather than repair it."""
    pc = make_cache(llama)
    pc.commit(pc.prepare(prompt_of(pc, FIRST)))
    moved = prompt_of(pc, MOVED)
    nucleus = dataclasses.replace(SAMPLED, top_p=0.9)
    reference = _sampled(pc, pc.prepare(moved, "reference"), nucleus).tokens
    guard = Scripted(pc, moved, quiet=10**6)
    out = _sampled(pc, pc.prepare(moved, mode="fast"), nucleus, guard=guard)
    assert (guard.escalations, out.escalated_at) == (1, 0)
    assert out.tokens == reference
    served = answer(pc, moved, "", "repair", nucleus)
    assert served.usage.mode == "exact"
    assert served.usage.relocated_tokens == 0
    assert served.decoded.tokens == reference


def _after_first(adapter: Any, **config: Any) -> tuple[PromptCache, Any]:
    """A prompt cache that has committed ``FIRST``, and ``MOVED`` as its prompt."""
    pc = PromptCache(adapter, make_cache(adapter).store, dataclasses.replace(CONFIG, **config))
    pc.commit(pc.prepare(prompt_of(pc, FIRST)))
    return pc, prompt_of(pc, MOVED)


def test_a_fallback_keeps_what_the_attempt_prefilled_exactly(llama: Any) -> None:  # noqa: F811
    """New text before the moved content is prefilled exactly by the repair attempt; the exact
    pass that follows (a repair given up, or a close call) places those segments instead of
    prefilling them again, and counts them as prefilled (this request computed them), not as
    cached."""
    doc = " ".join(f"entry {i} holds {i * 7}." for i in range(40))
    news = " ".join(f"news item {i} came at {i}:00." for i in range(30))
    first = [Message("system", ("You help.",)), Message("user", (doc, "Sum it up."))]
    then = [Message("system", ("You help.",)), Message("user", (news, doc, "Sum it up."))]
    for config, served in (
        (CONFIG, "given_up"),
        (dataclasses.replace(CONFIG, repair_margin=1e9, repair_margin_cap=0.0), "fallback"),
    ):
        pc = PromptCache(llama, make_cache(llama).store, config)
        pc.commit(pc.prepare(prompt_of(pc, first)))
        later = prompt_of(pc, then)
        reference = _greedy(pc, pc.prepare(later, "reference")).tokens
        out = answer(pc, later, "", "repair", PARAMS)
        u = out.usage
        assert u.served == served
        assert out.decoded.tokens == reference
        assert u.abandoned_tokens > 0
        assert u.prefix_tokens + u.prefilled_tokens == u.prompt_tokens
        kept = u.prefilled_tokens - u.fallback_tokens  # placed from the attempt, not prefilled again
        assert kept >= pc.config.block_tokens, (served, u)


def test_repair_answers_fall_back_to_exact_kv_and_commit_it(llama: Any) -> None:  # noqa: F811
    pc, moved = _after_first(llama, repair_margin=1e9, repair_margin_cap=0.0)
    reference = _greedy(pc, pc.prepare(moved, "reference")).tokens
    out = answer(pc, moved, "", "repair", PARAMS)
    assert out.decoded.escalated_at == 0
    assert out.decoded.tokens == reference
    # the answer rests on the exact pass: its usage, with the moved KV it gave up noted apart
    u = out.usage
    assert (u.served, u.relocated_tokens, u.repaired_tokens) == ("fallback", 0, 0)
    assert u.abandoned_tokens > 0
    assert u.cached_tokens == u.prefix_tokens
    assert u.fallback_tokens == u.prefilled_tokens == u.prompt_tokens - u.prefix_tokens
    again = pc.prepare(moved, "", "exact")  # what was committed is exact KV: its prefix is found
    assert again.usage.prefix_tokens > 0.9 * moved.n_tokens - pc.config.block_tokens


def test_without_a_margin_repair_keeps_its_kv(llama: Any) -> None:  # noqa: F811
    pc, moved = _after_first(llama, repair_margin=0.0)
    out = answer(pc, moved, "", "repair", PARAMS)
    assert out.usage.relocated_tokens > 0
    assert out.usage.served == "moved"
    assert out.usage.cached_tokens == out.usage.prefix_tokens + out.usage.relocated_tokens
    assert out.decoded.escalated_at is None
    assert (out.usage.fallback_tokens, out.usage.abandoned_tokens) == (0, 0)


def test_the_guard_margin_scales_with_the_deviation_repair_left(llama: Any) -> None:  # noqa: F811
    """At the unit the margin is as set; it scales with the square root of residual / unit, up
    and down. A repair that left more than a tiny unit allows is answered on exact KV at a close
    call the margin as set would have let through; one that left less than a huge unit keeps its
    repaired KV at a call the margin as set would have sent to exact KV."""
    assert guard_margin(0.5, 1e-4, 1e-4) == 0.5
    assert guard_margin(0.5, 4e-4, 1e-4) == pytest.approx(1.0)
    assert guard_margin(0.5, 2.5e-5, 1e-4) == pytest.approx(0.25)
    assert guard_margin(0.5, 0.0, 1e-4) == 0.0
    assert guard_margin(0.5, 1.0, 0.0) == 0.5
    no_cap = {"repair_margin_cap": 0.0}
    pc, moved = _after_first(llama, repair_margin=1e-9, repair_residual_unit=1e-30, **no_cap)
    reference = _greedy(pc, pc.prepare(moved, "reference")).tokens
    out = answer(pc, moved, "", "repair", PARAMS)
    assert out.usage.repair_residual > 0.0
    assert out.usage.served == "fallback"
    assert out.decoded.escalated_at == 0
    assert out.usage.fallback_tokens > 0
    assert out.decoded.tokens == reference
    # the same prompt with the margin as set keeps its repaired KV
    fixed, moved = _after_first(llama, repair_margin=1e-9, repair_residual_unit=0.0, **no_cap)
    kept = answer(fixed, moved, "", "repair", PARAMS)
    assert kept.usage.repair_residual == out.usage.repair_residual
    assert kept.decoded.escalated_at is None
    assert kept.usage.served == "moved"
    assert kept.usage.repaired_tokens > 0
    assert answer(fixed, moved, "", "exact", PARAMS).usage.repair_residual == 0.0
    # a margin that would send every step to exact KV, scaled down by a residual far below its unit
    always, moved = _after_first(llama, repair_margin=1e9, repair_residual_unit=0.0, **no_cap)
    assert answer(always, moved, "", "repair", PARAMS).decoded.escalated_at == 0
    shrunk, moved = _after_first(llama, repair_margin=1e9, repair_residual_unit=1e30, **no_cap)
    assert answer(shrunk, moved, "", "repair", PARAMS).decoded.escalated_at is None


def test_the_margin_scales_with_the_depth_repair_measured(
    llama: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``repair_depth_unit``: a repair that measured its depth (``PromptUsage.repair_depth``) has
    its margin scaled by sqrt(depth / unit), down and up; unmeasured, or with the unit 0, the
    margin is the residual's alone. Through the answer path: a margin that sends the first step
    to exact KV on the residual alone keeps the repaired KV once a huge depth unit narrows it, and
    a tiny one widens it further."""
    assert guard_margin(0.5, 1e-4, 1e-4, 4.0, 16.0) == pytest.approx(0.25)
    assert guard_margin(0.5, 1e-4, 1e-4, 64.0, 16.0) == pytest.approx(1.0)
    assert guard_margin(0.5, 1e-4, 1e-4, None, 16.0) == 0.5
    assert guard_margin(0.5, 1e-4, 1e-4, 4.0, 0.0) == 0.5
    assert guard_margin(0.5, 1e-4, 1e-4, float("nan"), 16.0) == 0.5
    no_cap = {"repair_margin_cap": 0.0, "repair_residual_unit": 0.0, "repair_must_pay": False}
    for depth_unit, escalated in ((0.0, 0), (1e-30, 0), (1e30, None)):
        pc, moved = _after_first(llama, repair_margin=1e6, repair_depth_unit=depth_unit, **no_cap)
        out = answer(pc, moved, "", "repair", PARAMS)
        assert out.usage.repaired_tokens > 0 or out.usage.served == "fallback"
        assert out.usage.repair_depth is not None
        assert out.usage.repair_depth > 0
        assert out.decoded.escalated_at == escalated, depth_unit
    # a model whose decode steps take int8 activations keeps the residual's margin
    # (``agent.modes.depth_unit_for``): the huge depth unit no longer narrows it
    pc, moved = _after_first(llama, repair_margin=1e6, repair_depth_unit=1e30, **no_cap)
    monkeypatch.setattr(type(llama), "quantised_decode", property(lambda self: True))
    assert pc.depth_unit == 0.0
    assert answer(pc, moved, "", "repair", PARAMS).decoded.escalated_at == 0


def test_a_repair_too_far_to_use_is_given_up_and_answered_exact(llama: Any) -> None:  # noqa: F811
    """A residual calling for a margin beyond the cap: no recompute, no decoding on repaired KV;
    the prompt is prepared exact, its answer is the full prefill's, the exact prefill is counted
    as a fallback, and what is committed is exact KV."""
    pc, moved = _after_first(llama, repair_margin=0.5, repair_residual_unit=1e-30, repair_margin_cap=3.0)
    assert pc.config.give_up_residual == pytest.approx(36e-30)
    reference = _greedy(pc, pc.prepare(moved, "reference")).tokens
    out = answer(pc, moved, "", "repair", PARAMS)
    u = out.usage
    assert u.mode == "repair"
    assert u.repair_residual > pc.config.give_up_residual
    assert (u.relocated_tokens, u.repaired_tokens) == (0, 0)
    assert u.served == "given_up"
    assert u.abandoned_tokens > 0
    assert u.fallback_tokens == u.prefilled_tokens > 0
    assert out.decoded.escalated_at is None
    assert out.decoded.tokens == reference
    again = pc.prepare(moved, "", "exact")
    assert again.usage.prefix_tokens > 0.9 * moved.n_tokens - pc.config.block_tokens
    # without a cap the same repair is decoded (and guarded)
    uncapped, moved = _after_first(
        llama, repair_margin=0.5, repair_residual_unit=1e-30, repair_margin_cap=0.0
    )
    tried = answer(uncapped, moved, "", "repair", PARAMS).usage
    assert tried.served in ("moved", "fallback")
    assert tried.relocated_tokens + tried.abandoned_tokens > 0


def test_an_answer_records_how_close_each_of_its_calls_was(llama: Any) -> None:  # noqa: F811
    """Each chosen token's gap between its best two logits, what the next repair's risk is read
    from; a greedy gap is the gap of the token's logprobs (a shift of the logits)."""
    pc, moved = _after_first(llama)
    params = dataclasses.replace(PARAMS, logprobs=True, top_logprobs=2)
    out = answer(pc, moved, "", "exact", params)
    d = out.decoded
    assert len(pc.close_calls) == 1
    # one per chosen token, the end token's included when the answer ended on it
    assert len(d.gaps) == len(d.tokens) + (d.finish_reason == "stop") > 0
    for gap, lp in zip(d.gaps, d.logprobs, strict=False):
        assert gap == pytest.approx(lp.top[0][1] - lp.top[1][1], abs=1e-4)
    assert min(d.gaps) >= 0.0


def test_a_repair_that_would_not_pay_is_given_up_before_it_decodes(llama: Any) -> None:  # noqa: F811
    """Where every recent answer met a call closer than the guard's margin, going on would cost the
    tokens left plus, almost surely, the exact prefill: the repair is given up once measured and
    the prompt answered exact. With the check off the same request decodes on moved KV and falls
    back; with recent answers all clear it goes on."""
    close = [0.0] * 8
    pc, moved = _after_first(llama, repair_margin=1e9, repair_margin_cap=0.0)
    reference = _greedy(pc, pc.prepare(moved, "reference")).tokens
    # the prompt's last token is all that is left to prefill on moved KV: going on stops paying
    # once the chance of a close call passes 1 - 1 / (the exact prefill's tokens)
    pc.close_calls = CloseCalls(size=4 * moved.n_tokens)
    for _ in range(4 * moved.n_tokens):
        pc.close_calls.add(close)
    out = answer(pc, moved, "", "repair", PARAMS)
    assert out.usage.served == "given_up"
    assert out.decoded.escalated_at is None
    assert out.usage.abandoned_tokens > 0
    assert out.decoded.tokens == reference
    off, moved = _after_first(llama, repair_margin=1e9, repair_margin_cap=0.0, repair_must_pay=False)
    for _ in range(50):
        off.close_calls.add(close)
    fell = answer(off, moved, "", "repair", PARAMS)
    assert fell.usage.served == "fallback"
    assert fell.decoded.tokens == reference
    clear, moved = _after_first(llama, repair_margin=1e-9, repair_residual_unit=0.0, repair_margin_cap=0.0)
    for _ in range(50):
        clear.close_calls.add([5.0] * 8)
    kept = answer(clear, moved, "", "repair", PARAMS)
    assert kept.usage.served == "moved"
    assert kept.usage.relocated_tokens > 0


def test_a_repair_that_could_not_pay_even_at_the_best_recent_residual_is_not_tried(
    llama: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With recent repairs all measured and every recent answer close, even the smallest residual
    measured lately would not pay: nothing is placed or measured (no selection pass), the prompt
    is answered exact, its moved tokens reported abandoned and no residual reported."""
    import agent.engine.prompt_cache as prompt_cache

    pc, moved = _after_first(llama, repair_margin=1e9, repair_margin_cap=0.0)
    reference = _greedy(pc, pc.prepare(moved, "reference")).tokens
    pc.close_calls = CloseCalls(size=4 * moved.n_tokens)
    for _ in range(4 * moved.n_tokens):
        pc.close_calls.add([0.0] * 8)
    pc.close_calls.add_residual(1e-12)
    measured: list[Any] = []
    real = prompt_cache.recompute_into
    monkeypatch.setattr(prompt_cache, "recompute_into", lambda *a, **k: measured.append(1) or real(*a, **k))
    out = answer(pc, moved, "", "repair", PARAMS)
    assert measured == []
    u = out.usage
    assert (u.served, u.repair_residual, u.relocated_tokens) == ("given_up", 0.0, 0)
    assert u.abandoned_tokens > 0
    assert out.decoded.tokens == reference
    # with the check off the same request is tried and measured
    off, moved = _after_first(llama, repair_margin=1e9, repair_margin_cap=0.0, repair_must_pay=False)
    off.close_calls = pc.close_calls
    assert answer(off, moved, "", "repair", PARAMS).usage.served == "fallback"
    assert measured
