"""The close calls of recent answers, and whether a repair is worth going on with."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.engine.close_calls import EXPLORE, CloseCalls, Risk, repair_pays


def test_with_nothing_seen_the_chance_is_one_half_and_a_zero_margin_is_never_met() -> None:
    calls = CloseCalls()
    assert calls.risk(0.5) == Risk(0.5, 0.0)
    assert calls.risk(0.0) == Risk(0.0, 0.0)
    calls.add([])  # an answer with no step is not counted
    assert len(calls) == 0


def test_the_chance_counts_answers_with_a_step_below_the_margin_within_the_steps() -> None:
    calls = CloseCalls()
    calls.add([3.0, 1.0, 2.0])
    assert calls.risk(2.0, steps=1) == Risk(pytest.approx(1 / 3), 0.0)  # only the first step: 3 >= 2
    assert calls.risk(2.0, steps=2) == Risk(pytest.approx(2 / 3), 1.0)  # one step decoded before it
    assert calls.risk(2.0) == Risk(pytest.approx(2 / 3), 1.0)
    assert calls.risk(1.0).chance == pytest.approx(1 / 3)  # below, not at
    calls.add([5.0])  # ended after one step: counted over its own length
    assert calls.risk(2.0, steps=10).chance == pytest.approx(2 / 4)
    calls.add([0.5, 0.1])  # met at its first step
    assert calls.risk(2.0).steps_before == pytest.approx(0.5)


def test_an_answer_cut_short_by_its_budget_says_nothing_of_the_steps_it_never_ran() -> None:
    calls = CloseCalls()
    calls.add([5.0, 5.0], ended=False)  # stopped at a 2-token budget, no close call
    calls.add([5.0, 0.5], ended=False)  # stopped at its budget, a close call within it
    assert calls.risk(1.0, steps=2).chance == pytest.approx(2 / 4)  # both ran the steps asked
    assert calls.risk(1.0, steps=8).chance == pytest.approx(2 / 3)  # the first is left out
    calls.add([5.0, 5.0], ended=True)  # ended by itself: no more steps to come
    assert calls.risk(1.0, steps=8).chance == pytest.approx(2 / 4)


def test_only_the_last_answers_are_kept() -> None:
    calls = CloseCalls(size=4)
    calls.add([0.0])
    for _ in range(3):
        calls.add([9.0])
    assert calls.risk(1.0).chance == pytest.approx(2 / 6)
    calls.add([9.0])  # the close one is forgotten
    assert len(calls) == 4
    assert calls.risk(1.0).chance == pytest.approx(1 / 6)


def test_a_nan_gap_is_not_kept_and_fails_nothing() -> None:
    calls = CloseCalls()
    assert calls.add([1.0, math.nan]) is False
    assert calls.add([]) is False
    assert len(calls) == 0
    assert calls.add([1.0]) is True
    with pytest.raises(ValueError, match="at least 1"):
        CloseCalls(size=0)


@given(st.lists(st.lists(st.floats(0, 20), min_size=1, max_size=12), max_size=20), st.floats(0.01, 20))
def test_the_chance_grows_with_the_margin_and_the_steps(answers: list[list[float]], margin: float) -> None:
    calls = CloseCalls()
    for a in answers:
        calls.add(a)
    chance = [
        calls.risk(margin, steps=1).chance,
        calls.risk(margin, steps=4).chance,
        calls.risk(margin).chance,
    ]
    assert 0.0 < chance[0] <= chance[1] <= chance[2] < 1.0
    assert chance[2] <= calls.risk(margin * 2).chance
    assert 0.0 <= calls.risk(margin).steps_before < 12


def test_a_decode_step_is_priced_in_prefilled_tokens_once_both_were_timed() -> None:
    calls = CloseCalls()
    assert calls.step_tokens() == 0.0
    calls.observe_prefill(1000, 2.0)
    assert calls.step_tokens() == 0.0
    calls.observe_decode(10, 0.1)
    assert calls.step_tokens() == pytest.approx(5.0)  # 10 ms a step, 2 ms a token
    calls.observe_prefill(8, 1.0)  # too few tokens to time
    calls.observe_decode(0, 1.0)
    assert calls.step_tokens() == pytest.approx(5.0)


def test_going_on_pays_while_its_work_and_the_risk_cost_less_than_the_exact_prefill() -> None:
    assert repair_pays(Risk(0.0, 0.0), 0.0, 0, 10, 100)
    assert repair_pays(Risk(0.4, 0.0), 0.0, 0, 50, 100)  # 50 + 40 < 100
    assert not repair_pays(Risk(0.5, 0.0), 0.0, 0, 50, 100)  # no gain, and the risk of paying twice
    assert not repair_pays(Risk(0.4, 0.0), 0.0, 15, 50, 100)  # the recompute tips it
    assert not repair_pays(Risk(0.4, 8.0), 5.0, 0, 50, 100)  # 50 + 0.4 * (100 + 40) = 106
    assert repair_pays(Risk(0.4, 8.0), 0.5, 0, 50, 100)
    assert not repair_pays(Risk(0.0, 0.0), 0.0, 0, 100, 100)  # nothing reused: nothing to gain


def test_a_repair_is_tested_at_the_margin_recent_depths_narrowed_theirs_to() -> None:
    """Depth is measured by the recompute, after the test: the test takes the median of what
    recent depths did to their margins (1.0 with none measured, or with the depth unit off)."""
    calls = CloseCalls()
    assert calls.depth_factor() == 1.0
    for depth in (1.0, None, 4.0, 100.0):  # None: not measured, not kept
        calls.add_depth(depth, 16.0)
    calls.add_depth(2.0, 0.0)  # the unit off: nothing kept
    assert calls.depth_factor() == pytest.approx(0.5)  # factors 0.25, 0.5, 1.0
    for _ in range(8):
        calls.add([5.0, 0.3, 5.0])  # every answer had a step 0.3 apart
    # a margin of 0.4 on the residual alone meets that step; narrowed by half it does not
    alone = calls.repair_test(0.4, 0.0, 50, 100, 3)
    narrowed = calls.repair_test(0.4, 0.0, 50, 100, 3, depth_unit=16.0)
    assert not alone(1.0, 0)
    assert narrowed(1.0, 0)


def test_the_smallest_recent_residual_is_what_a_repair_is_first_tested_at() -> None:
    calls = CloseCalls()
    assert calls.low_residual() is None
    for r in (3e-7, 8e-8, 2e-6, math.nan, -1.0, math.inf):  # not measured: not kept
        calls.add_residual(r)
    assert calls.low_residual() == 8e-8


def test_a_server_s_sessions_share_the_record_of_its_chat_completions(smollm2: Any) -> None:
    """One record per model: what chat completions' answers showed prices a session's repair,
    and the other way round; the server's setting of the test reaches the session's window."""
    from agent.engine.prompt_cache import PromptCacheConfig
    from agent.engine.runtime import Runtime, RuntimeConfig

    runtime = Runtime(smollm2, RuntimeConfig(prompt_cache=PromptCacheConfig(repair_must_pay=False)))
    agent = runtime.new_agent("You help.", 1024, "text", 8, "tenant")
    assert agent.close_calls is runtime.prompt_cache.close_calls
    assert agent.context.config.repair_must_pay is False


def test_a_repair_is_tried_unless_the_best_recent_residual_would_not_pay_and_now_and_then_even_so() -> None:
    calls = CloseCalls()
    refuse: list[float] = []

    def never(residual: float, recomputed: int) -> bool:
        refuse.append(residual)
        return False

    assert calls.worth_trying(never)  # nothing measured yet: tried
    assert refuse == []
    calls.add_residual(5e-7)
    calls.add_residual(2e-7)
    tried = [calls.worth_trying(never) for _ in range(2 * EXPLORE)]
    assert refuse == [2e-7] * (2 * EXPLORE)  # asked at the smallest, with nothing recomputed
    assert [i for i, t in enumerate(tried) if t] == [EXPLORE - 1, 2 * EXPLORE - 1]
    calls.worth_trying(never)
    calls.add_residual(3e-7)  # a measurement starts the count again
    assert not any(calls.worth_trying(never) for _ in range(EXPLORE - 1))
    assert calls.worth_trying(lambda residual, recomputed: True)
