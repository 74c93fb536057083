"""``kamera bench consistency`` on a tiny random model: the replay through the server's prompt
cache, the summary's shares (the seen-before ceiling among them), exact mode's agreement, and
the latencies against both full prefills (segmented and one-pass)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from agent.adapters.loading import load_adapter
from agent.byte_tokenizer import ByteTokenizer
from agent.engine.chat import Message
from agent.engine.generation import SamplingParams
from agent.engine.prompt_cache import PromptCacheConfig
from bench.consistency import Outcome, Row, gap_error, one_pass, replay, seen_tokens, summarize
from bench.traces_data import Session

DOC = " ".join(f"fact {i} is {i * 7}." for i in range(40))


@pytest.fixture(scope="module")
def llama() -> Any:
    return load_adapter("tiny:llama-gqa", tokenizer=ByteTokenizer())


def _session() -> Session:
    system = {"role": "system", "content": f"You help.\n{DOC}"}
    turns: list[dict[str, Any]] = [system, {"role": "user", "content": "What is fact 3?"}]
    requests = []
    for i in range(3):
        requests.append(list(turns))
        turns += [
            {"role": "assistant", "content": f"Fact {i} answer."},
            {"role": "tool", "content": f"tool output {i}: " + DOC[: 60 * (i + 1)]},
        ]
    return Session("s", tuple(requests))


def _replay(
    llama: Any,
    policy: str,
    modes: list[Any],
    config: PromptCacheConfig,
    sessions: int = 1,
    at_once: int = 1,
) -> dict[str, Any]:
    """The session's three requests replayed under ``policy``, 4 greedy tokens each."""
    rows, _ = replay(
        llama,
        [Session(f"s{i}", _session().requests) for i in range(sessions)],
        policy,
        modes,
        config,
        SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2),
        max_requests=3,
        max_prompt_tokens=10_000,
        store_bytes=64 << 20,
        log=lambda *_: None,
        concurrency=at_once,
    )
    return rows


def test_sessions_replayed_at_once_answer_as_one_at_a_time(llama: Any) -> None:
    """Three sessions at once through the scheduler (decode steps batched): every request's
    tokens, logits and reuse are what the one-at-a-time replay gives, in every mode."""
    config = PromptCacheConfig(block_tokens=64, min_reuse_tokens=16)
    modes = ["exact", "repair", "fast"]
    alone = _replay(llama, "window-1", modes, config, sessions=3)
    together = _replay(llama, "window-1", modes, config, sessions=3, at_once=3)
    for m in modes:
        assert len(alone[m]) == len(together[m]) == 9
        for a, b in zip(alone[m], together[m], strict=True):
            assert (a.session, a.step) == (b.session, b.step)
            assert a.cached.tokens == b.cached.tokens
            assert a.cached.margins == b.cached.margins  # every decode step's logits, as logprobs
            assert torch.equal(a.cached.logits, b.cached.logits)
            assert a.cached.usage.cached_tokens == b.cached.usage.cached_tokens
        assert [r.cached.usage.served for r in alone[m]] == [r.cached.usage.served for r in together[m]]
        moved = [r.cached.usage.relocated_tokens + r.cached.usage.abandoned_tokens for r in together[m]]
        assert any(moved) == (m != "exact")
        assert summarize(alone[m])["greedy_agreement"] == summarize(together[m])["greedy_agreement"]


def test_seen_tokens_are_the_prompt_outside_new_messages() -> None:
    tok, seen = ByteTokenizer(), set()
    first = [Message("system", ("abc",)), Message("user", ("hello",))]
    assert seen_tokens(tok, 30, first, seen) == 0  # the session's first request: nothing before it
    again = [*first, Message("user", ("new",))]
    assert seen_tokens(tok, 40, again, seen) == 40 - len("new")
    assert seen_tokens(tok, 40, [Message("assistant", ("abc",))], seen) == 40 - len("abc")  # another role


def test_replay_exact_mode_keeps_every_answer(llama: Any) -> None:
    rows = _replay(llama, "append", ["exact", "repair"], PromptCacheConfig(block_tokens=64))
    exact = summarize(rows["exact"])
    assert exact["requests"] == 3
    assert exact["requests_with_hits"] == 2
    assert exact["greedy_agreement"] == 1.0
    assert exact["kl_max"] == 0.0
    shares = exact["shares"]
    assert 0 < shares["exact"] <= shares["seen_before"] < 1
    assert shares["content"] == 0.0
    assert summarize(rows["repair"])["repair_residuals"] == []  # append: nothing moved


def test_margin_scale_covers_the_gap_errors_of_rows_whose_answer_is_known() -> None:
    """First-token logits made by hand beside a full prefill's, with the residual repair left and
    every figure worked out here: the gap errors of the requests decoded on repaired KV, the
    scale a guard margin ``c * sqrt(residual)`` needs, and what the guard then does with each."""
    import threading

    from agent.engine.generation import decode
    from agent.engine.prompt_cache import PromptUsage
    from agent.modes import guard_margin

    def row(
        ref: list[float],
        cached: list[float],
        relocated: int,
        residual: float,
        fallback: int = 0,
        depth: float | None = None,
    ) -> Row:
        usage = PromptUsage(
            100, 0, relocated, 100 - relocated, relocated, 0, 0, "repair",
            repair_residual=residual, fallback_tokens=fallback, repair_depth=depth,
        )  # fmt: skip
        reference = Outcome([int(torch.tensor(ref).argmax())], torch.tensor(ref), 1.0, 1.0, usage, [])
        return Row("s", 0, 100, Outcome([], torch.tensor(cached), 1.0, 1.0, usage, []), reference)

    flip = row([2.0, 1.9, 0.0, -1.0], [1.0, 2.4, 0.0, -1.0], 40, 0.09, depth=4.0)  # best two moved -1.0, +0.5
    clear = row([0.0, 4.0, 1.0, 0.0], [0.0, 4.2, 1.4, 0.0], 40, 0.04, depth=1.0)  # +0.2, +0.4
    wider = row([1.0, 0.0, 3.0, 2.0], [1.0, 0.0, 3.3, 1.9], 40, 0.01)  # +0.3, -0.1
    rows = [
        flip,
        row([2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0], 0, 0.0),  # the exact prefix alone
        clear,
        row([2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0], 0, 0.5, fallback=100),  # a repair given up
        row([2.0, 1.0, 0.0, -1.0], [0.0, 9.0, 0.0, 0.0], 40, 0.0),  # moved blind: nothing measured
        wider,
    ]
    assert gap_error(torch.tensor([3.0, 1.0, 0.0]), torch.tensor([3.5, 2.0, 9.0])) == pytest.approx(-0.5)
    report = summarize(rows)
    # per sqrt(residual): 1.5 / 0.3, 0.2 / 0.2, 0.4 / 0.1; the rows not decoded on repaired KV
    # (the given-up repair answered on exact KV) or not measured have no part in it
    assert report["gap_errors"] == pytest.approx([-1.5, -0.2, 0.4])
    assert report["margin_scale"] == pytest.approx(5.0)
    # with the depths measured (none for ``wider``): per sqrt(residual x depth) 1.5 / 0.6 and
    # 0.2 / 0.2; and under a margin of 0.5 at a residual of 0.01 (1.5 for the flip, 1.0 for the
    # clear call), the depth unit that keeps each margin twice its error: 4 x (1.5 / 3.0)^2 and
    # 1 x (1.0 / 0.4)^2, the smaller bounding it
    assert report["margin_scale_depth"] == pytest.approx(2.5)
    assert report["scale_spread"] == {"residual": [1.0, 5.0], "residual_x_depth": [1.0, 2.5]}
    assert report["repair_depths"] == [4.0, 1.0, None]
    assert "depth_unit_max" not in report
    config = PromptCacheConfig(repair_margin=0.5, repair_residual_unit=0.01)
    assert summarize(rows, config)["depth_unit_max"] == pytest.approx(1.0)

    class Stub:  # what decode needs of an adapter for one greedy token
        tokenizer, eos_ids = ByteTokenizer(), frozenset()

    class ToReference:  # the guard's way to exact KV: the full prefill's logits
        def __init__(self, r: Row, margin: float) -> None:
            self.r, self.margin, self.taken = r, margin, False

        def exact(self) -> tuple[Any, torch.Tensor, int]:
            self.taken = True
            return None, self.r.reference.logits, 0

    def guarded(r: Row, scale: float) -> tuple[int, bool]:
        unit = 1e-2  # margin c at residual unit: c * sqrt(residual / unit) = scale * sqrt(residual)
        guard = ToReference(r, guard_margin(scale * math.sqrt(unit), r.cached.usage.repair_residual, unit))
        params = SamplingParams(max_tokens=1)
        out = decode(Stub(), r.cached.logits, None, 0, params, threading.Event(), guard=guard)  # type: ignore[arg-type]
        return out.tokens[0], guard.taken

    # at the scale measured, the flipped first token (cached gap 1.4 under a margin of 1.5) goes to
    # exact KV and answers the full prefill's token; the clear calls keep repaired KV, and their
    # token is the full prefill's already
    assert int(flip.cached.logits.argmax()) != flip.reference.tokens[0]
    assert guarded(flip, 5.0) == (flip.reference.tokens[0], True)
    assert guarded(clear, 5.0) == (clear.reference.tokens[0], False)  # gap 2.8, margin 1.0
    assert guarded(wider, 5.0) == (wider.reference.tokens[0], False)  # gap 1.4, margin 0.5
    # a tenth short of it, the flip gets through (margin 1.35 over a gap of 1.4)
    assert guarded(flip, 4.5) == (int(flip.cached.logits.argmax()), False)


def test_gap_errors_are_read_against_an_independent_full_prefill(llama: Any) -> None:
    """Replayed with the guard off, the window policy moves the reused turns: the bench's
    reference for every request is the prompt prefilled from nothing straight through the model
    (in the prompt cache's segments, bit for bit), the requests decoded on repaired KV answer from
    other logits than it, and their gap errors are read against it."""
    from _util import full_prefill

    from agent.engine.chat import render
    from bench.consistency import to_messages
    from bench.traces_policies import get_policy

    config = PromptCacheConfig(block_tokens=64, min_reuse_tokens=8, repair_margin=0.0)
    rows = _replay(llama, "window-1", ["repair"], config)["repair"]
    policy = get_policy("window-1")
    watched = []
    for step, (r, request) in enumerate(zip(rows, _session().requests, strict=True)):
        pieces = render(llama.tokenizer, to_messages(policy(request, step)))
        ids = [t for p in pieces for t in p.ids]
        _, logits, _ = full_prefill(llama, ids, config.block_tokens)
        assert r.prompt_tokens == len(ids)
        same = torch.equal(r.reference.logits, logits)
        assert same, f"request {step}: the bench's reference is no full prefill"
        if r.cached.usage.relocated_tokens:
            assert r.cached.usage.repair_residual > 0
            assert r.cached.usage.repaired_tokens > 0
            assert not torch.equal(r.cached.logits, logits)  # repaired KV: close, not equal
            watched.append(gap_error(logits, r.cached.logits))
    assert len(watched) == 2, "the window moved nothing: nothing to read"
    report = summarize(rows)
    assert report["gap_errors"] == pytest.approx(watched, abs=1e-5)
    assert report["margin_scale"] > 0
    assert summarize(rows[:1])["margin_scale"] is None  # the first request moved nothing


class _Counted:
    """Calls of an adapter's forward entry points, counted on the instance, with each one's tokens."""

    NAMES = ("prefill", "prefill_many", "prefill_and_ask", "next_logits")

    def __init__(self, adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, list[int]] = {n: [] for n in self.NAMES}
        for name in self.NAMES:
            real = getattr(adapter, name)

            def counted(chunk: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                n = chunk.n_tokens if hasattr(chunk, "n_tokens") else sum(c.n_tokens for c in chunk)
                self.calls[_name].append(n)
                return _real(chunk, *args, **kwargs)

            monkeypatch.setattr(adapter, name, counted)


def _prompt(llama: Any, step: int) -> Any:
    from agent.engine.chat import render
    from agent.engine.prompt_cache import build_prompt
    from bench.consistency import to_messages

    pieces = render(llama.tokenizer, to_messages(_session().requests[step]))
    return build_prompt(llama, pieces, lambda key: 0)


def test_one_pass_prefills_the_whole_prompt_in_one_forward_pass(llama: Any, monkeypatch: Any) -> None:
    """The one-pass reference runs the prompt through the model once (no segments, no KV taken
    out), then decodes greedily as a completion does: its tokens and logits are those of the
    segmented full prefill up to the last bits of a differently shaped pass."""
    from _util import full_prefill, greedy, max_rel

    prompt = _prompt(llama, 2)
    assert prompt.n_tokens > 3 * 64  # the segmented path would take four passes at 64
    params = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2)
    counted = _Counted(llama, monkeypatch)
    with torch.inference_mode():
        out = one_pass(llama, prompt, params)
    assert counted.calls["next_logits"] == [prompt.n_tokens]
    assert counted.calls["prefill"] == counted.calls["prefill_many"] == counted.calls["prefill_and_ask"] == []
    assert out.usage is None
    assert 0 < out.ttft_s <= out.total_s
    assert len(out.margins) == len(out.tokens)
    monkeypatch.undo()
    cache, logits, position = full_prefill(llama, prompt.units.tolist(), 64)
    tokens, _ = greedy(llama, logits, cache, position, params.max_tokens)
    assert max_rel(out.logits, logits) < 1e-4
    assert out.tokens == tokens


def test_replay_times_every_request_against_both_full_prefills(llama: Any, monkeypatch: Any) -> None:
    """Each request is run once more as a one-pass full prefill, beside the segmented reference;
    rows carry both end to end, and the summary reads its ratios, mismatches and per-request
    latencies from them."""
    counted = _Counted(llama, monkeypatch)
    rows = _replay(llama, "append", ["exact", "repair"], PromptCacheConfig(block_tokens=64))
    # one forward pass of the whole prompt per request, shared by both modes' rows
    assert counted.calls["next_logits"] == [r.prompt_tokens for r in rows["exact"]]
    for mode in ("exact", "repair"):
        report = summarize(rows[mode])
        for r in rows[mode]:
            assert r.one_pass is not None
            for o in (r.cached, r.reference, r.one_pass):
                assert 0 < o.ttft_s <= o.total_s
        assert report["one_pass_checked"] == 3
        assert report["one_pass_mismatches"] == sum(
            r.one_pass.tokens != r.reference.tokens for r in rows[mode]
        )
        assert [p["served"] for p in report["per_request"]] == report["served_per_request"]
        for p, r in zip(report["per_request"], rows[mode], strict=True):
            assert (p["session"], p["step"], p["prompt_tokens"]) == (r.session, r.step, r.prompt_tokens)
            assert p["one_pass_total_s"] == round(r.one_pass.total_s, 4)
            assert p["segmented_ttft_s"] == round(r.reference.ttft_s, 4)
        for key in ("e2e_ratio_median", "one_pass_ttft_ratio_median", "one_pass_e2e_ratio_median"):
            assert report[key] > 0


def test_latency_ratios_are_medians_over_requests_with_hits() -> None:
    """Ratios worked out by hand: full prefill (segmented or one-pass) over cached, TTFT and end
    to end, medians over the requests that reused anything; a one-pass answer that differs from
    the segmented one is counted, not hidden."""
    from agent.engine.prompt_cache import PromptUsage

    def outcome(tokens: list[int], ttft: float, total: float, usage: Any = None) -> Outcome:
        return Outcome(tokens, torch.zeros(4), ttft, total, usage, [])

    Times = tuple[float, float]  # ttft, total

    def row(cached_tokens: int, cached: Times, ref: Times, one: Times, one_tokens: list[int]) -> Row:
        usage = PromptUsage(100, cached_tokens, 0, 100 - cached_tokens, 0, 0, 0, "exact")
        return Row(
            "s", 0, 100, outcome([1, 2], *cached, usage), outcome([1, 2], *ref), 0, outcome(one_tokens, *one)
        )

    rows = [
        row(0, (1.0, 2.0), (1.0, 2.0), (0.5, 1.5), [1, 2]),  # no hit: in no ratio, still checked
        row(80, (0.1, 1.0), (0.8, 1.6), (0.4, 1.2), [1, 2]),  # 8, 1.6; one-pass 4, 1.2
        row(80, (0.2, 1.0), (1.0, 2.0), (0.6, 1.5), [1, 3]),  # 5, 2.0; one-pass 3, 1.5
        row(80, (0.5, 2.0), (1.0, 2.0), (1.0, 1.0), [1, 2]),  # 2, 1.0; one-pass 2, 0.5
    ]
    report = summarize(rows)
    assert report["ttft_ratio_median"] == pytest.approx(5.0)
    assert report["e2e_ratio_median"] == pytest.approx(1.6)
    assert report["one_pass_ttft_ratio_median"] == pytest.approx(3.0)
    assert report["one_pass_e2e_ratio_median"] == pytest.approx(1.2)
    assert (report["one_pass_checked"], report["one_pass_mismatches"]) == (4, 1)
    assert [p["total_s"] for p in report["per_request"]] == [2.0, 1.0, 1.0, 2.0]


def test_replay_in_bfloat16_products_keeps_every_answer_and_sets_them_beside_float32s() -> None:
    narrow = load_adapter("tiny:llama-gqa", tokenizer=ByteTokenizer(), prefill_products="bfloat16")
    rows = _replay(narrow, "append", ["exact"], PromptCacheConfig(block_tokens=64))["exact"]
    assert narrow.prefill_products == "bfloat16"  # the float32 answers were taken and the products put back
    summary = summarize(rows)
    assert summary["greedy_agreement"] == 1.0  # exact reuse, exact under these numerics too
    assert summary["float32_checked"] == 3
    for row, fields in zip(rows, summary["per_request"], strict=True):
        assert fields["reference_tokens"] == list(row.reference.tokens)
        assert fields["float32_tokens"] == row.float32_tokens
        assert len(row.float32_tokens or []) == 4
    wide = load_adapter("tiny:llama-gqa", tokenizer=ByteTokenizer())  # the same weights
    wide_rows = _replay(wide, "append", ["exact"], PromptCacheConfig(block_tokens=64))["exact"]
    # the float32 answers are the float32 engine's own
    assert [f["float32_tokens"] for f in summary["per_request"]] == [
        list(r.reference.tokens) for r in wide_rows
    ]
    assert (
        summary["float32_agreement"]
        == sum(f["float32_tokens"] == f["reference_tokens"] for f in summary["per_request"]) / 3
    )


def test_float32_products_report_no_float32_answers(llama: Any) -> None:
    rows = _replay(llama, "append", ["exact"], PromptCacheConfig(block_tokens=64))["exact"]
    summary = summarize(rows)
    assert "float32_agreement" not in summary
    assert all("float32_tokens" not in f for f in summary["per_request"])


def test_the_margin_an_unguarded_answer_needed_is_read_over_its_whole_answer() -> None:
    """An answer equal to the full prefill's needed no margin; one that parts from it at step k
    needed a margin above the smallest gap of its steps up to k, wherever that lies (a first token
    with a clear call does not make a later close one safe); the scales are the largest need per
    sqrt(residual) and per sqrt(residual x depth)."""
    from agent.engine.prompt_cache import PromptUsage
    from bench.consistency import needed_fields, needed_margin

    def row(cached: list[int], gaps: list[float], ref: list[int], residual: float, depth: float) -> Row:
        usage = PromptUsage(
            100, 0, 40, 60, 40, 0, 0, "repair", repair_residual=residual, repair_depth=depth
        )  # fmt: skip
        logits = torch.zeros(4)
        return Row(
            "s", 0, 100,
            Outcome(cached, logits, 1.0, 1.0, usage, gaps),
            Outcome(ref, logits, 1.0, 1.0, usage, [1.0] * len(ref)),
        )  # fmt: skip

    same = row([1, 2, 3], [2.0, 0.01, 3.0], [1, 2, 3], 1e-6, 4.0)
    late = row([1, 2, 3], [2.0, 0.3, 0.2], [1, 2, 0], 1e-6, 4.0)  # parts at step 2: min(2, .3, .2)
    early = row([1, 2, 3], [0.5, 0.1, 0.01], [1, 0, 3], 4e-6, 1.0)  # parts at step 1: min(.5, .1)
    short = row([1, 2], [0.7, 0.4], [1, 2, 3], 1e-6, 1.0)  # stopped early: parts at step 2
    assert needed_margin(same) == 0.0
    assert needed_margin(late) == pytest.approx(0.2)
    assert needed_margin(early) == pytest.approx(0.1)
    assert needed_margin(short) == pytest.approx(0.4)
    got = needed_fields([same, late, early, short])
    assert got["needed_margins"] == pytest.approx([0.0, 0.2, 0.1, 0.4])
    # per sqrt(residual): 0.2 / 1e-3, 0.1 / 2e-3, 0.4 / 1e-3; per sqrt(residual x depth): 0.2 / 2e-3
    assert got["needed_scale"] == pytest.approx(400.0)
    assert got["needed_scale_depth"] == pytest.approx(400.0)
    assert needed_fields([same])["needed_scale"] is None
    empty = row([], [], [1, 2], 1e-6, 1.0)  # no step at which a guard could have met a close call
    assert needed_margin(empty) == math.inf
    assert needed_fields([empty, late]) == {
        "needed_margins": [None, pytest.approx(0.2)],
        "needed_scale": pytest.approx(200.0),
        "needed_scale_depth": pytest.approx(100.0),
    }
