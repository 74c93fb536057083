"""The scheduler under concurrent requests: jobs decode as one batch, prefills interleave pass by
pass, and every answer is the one the request gets alone, bit for bit (tokens and logprobs), in
exact mode equal to an independent full prefill's."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import pytest

from agent.engine.chat import Message
from agent.engine.generation import SamplingParams
from agent.engine.prompt_cache import PromptCacheConfig
from agent.engine.runtime import ChatOutcome, Runtime, RuntimeConfig
from cache.store import StoreConfig
from tests._util import full_prefill, greedy

QUESTIONS = [
    "Which planet is known as the red planet?",
    "Name three primary colours.",
    "Write a haiku about rain on a tin roof.",
    "What is the capital of Japan? Answer with the city only.",
    "Count from one to ten in words, separated by commas.",
    "Explain in one sentence why the sky looks blue during the day.",
    "List two animals that live in the ocean.",
    "Say hello in French, Spanish and German.",
]


@pytest.fixture(scope="module")
def runtime(smollm2: Any) -> Runtime:
    # 16-token segments: these short prompts' exact prefixes are reused on a second run
    config = RuntimeConfig(
        store=StoreConfig(host_bytes=256 << 20), prompt_cache=PromptCacheConfig(block_tokens=16)
    )
    rt = Runtime(smollm2, config)
    yield rt
    rt.worker.shutdown()


def _pieces(rt: Runtime, text: str) -> Any:
    return rt.render([Message("user", (text,))])


def _run_all(
    rt: Runtime, jobs: list[tuple[str, int]], salt: str, order: list[str] | None = None
) -> list[ChatOutcome]:
    """Every (question, max_tokens) as its own job, all submitted at once; greedy with logprobs."""

    async def main() -> list[ChatOutcome]:
        tasks = []
        for text, max_tokens in jobs:
            params = SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=2)
            cancel = threading.Event()

            def started(text: str = text) -> None:
                if order is not None:
                    order.append("start:" + text[:12])

            fn = functools.partial(rt.chat, _pieces(rt, text), params, salt, cancel, started, None, "exact")
            tasks.append(asyncio.ensure_future(rt.worker.run(fn, cancel)))
        return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def _same(a: ChatOutcome, b: ChatOutcome) -> bool:
    return a.decoded.tokens == b.decoded.tokens and a.decoded.logprobs == b.decoded.logprobs


def test_requests_batched_together_answer_as_alone(runtime: Runtime) -> None:
    """Eight requests of different lengths at once: each one's tokens and logprobs equal, bit for
    bit, what it gives alone; the decode steps were shared; exact answers equal a full prefill's."""
    jobs = [(q, 6 + 3 * i) for i, q in enumerate(QUESTIONS)]
    alone = [_run_all(runtime, [job], salt=f"alone-{i}")[0] for i, job in enumerate(jobs)]
    steps, rows = runtime.worker.steps, runtime.worker.rows
    together = _run_all(runtime, jobs, salt="together")
    shared = runtime.worker.rows - rows
    assert shared > runtime.worker.steps - steps, "no decode step served two requests"
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert _same(a, b), f"request {i} answered differently in a batch"
    # hot cache (the prefixes stored by the runs above) and batched: still the same
    again = _run_all(runtime, jobs, salt="together")
    assert all(_same(a, b) for a, b in zip(alone, again, strict=True))
    assert any(o.usage.prefix_tokens for o in again)
    # exact mode is a full prefill, computed here straight through the model
    for (text, max_tokens), out in zip(jobs, together, strict=True):
        ids = [i for p in _pieces(runtime, text) for i in p.ids]
        cache, logits, pos = full_prefill(runtime.adapter, ids, runtime.prompt_cache.config.block_tokens)
        tokens, _ = greedy(runtime.adapter, logits, cache, pos, max_tokens)
        assert out.decoded.tokens == tokens


def test_a_long_prefill_does_not_hold_a_short_request_back(runtime: Runtime) -> None:
    """A prompt of many segments and a short one submitted just after it: the short one starts
    decoding before the long one finishes its prefill (its passes interleave with the long one's)."""
    long_text = " ".join(f"Item {i}: the {i % 7}th shelf holds {i * 3} jars of honey." for i in range(120))
    order: list[str] = []
    _run_all(runtime, [(long_text + "\nHow many jars on shelf 3?", 2), ("Say yes.", 2)], "interleave", order)
    assert order.index("start:Say yes.") < order.index("start:" + long_text[:12]), order


def test_prompts_that_arrive_together_finish_their_prefill_one_after_another(runtime: Runtime) -> None:
    """Two prompts of the same length submitted at once: the first one's passes run first (the
    fewest tokens left), so it starts decoding after its own passes alone; taking passes in turns
    would have it wait for nearly all of both."""
    text = " ".join(f"Note {i}: the {i % 5}th crate holds {i * 7} pears." for i in range(14))
    passes_at_start: dict[str, int] = {}
    done = threading.Event()

    async def main() -> None:
        tasks = []
        for name in ("first", "second"):
            cancel = threading.Event()

            def started(name: str = name) -> None:
                passes_at_start[name] = runtime.worker._passes

            params = SamplingParams(max_tokens=2)
            pieces = _pieces(runtime, f"{text}\nWhich crate holds the most pears? ({name})")
            salt = f"together-{name}"
            fn = functools.partial(runtime.chat, pieces, params, salt, cancel, started, None, "exact")
            tasks.append(asyncio.ensure_future(runtime.worker.run(fn, cancel)))
        await asyncio.gather(*tasks)
        done.set()

    before = runtime.worker._passes
    asyncio.run(main())
    assert done.is_set()
    first, second = passes_at_start["first"] - before, passes_at_start["second"] - before
    assert second >= 8, f"the prompts are too short to tell the orders apart ({second} passes)"
    assert first <= second // 2 + 1, f"the first prompt waited for the second's passes: {first} of {second}"


def test_a_step_that_fails_for_one_request_fails_that_request_only(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched decode step that raises because of one row (here: after every row's KV was
    written, as a failure half way through would leave it): that request gets the error, the
    others are stepped again alone from their caches as they were and answer as they do alone."""
    good = [(QUESTIONS[i], 48) for i in (2, 4, 5)]
    alone = [_run_all(runtime, [job], salt=f"fail-alone-{i}")[0] for i, job in enumerate(good)]
    poison = " ".join(f"Row {i} of the ledger is blank." for i in range(60))  # a prompt past 300 tokens
    step = runtime.adapter.decode_rows
    shared: list[int] = []  # sizes of the failed steps

    def failing(tokens: Any, caches: Any, positions: Any) -> Any:
        out = step(tokens, caches, positions)
        if any(p >= 300 for p in positions):
            shared.append(len(tokens))
            raise RuntimeError("a row the model cannot step")
        return out

    monkeypatch.setattr(runtime.adapter, "decode_rows", failing)

    async def main() -> list[Any]:
        tasks = []
        for i, (text, max_tokens) in enumerate([*good, (poison, 5)]):
            cancel = threading.Event()
            params = SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=2)
            fn = functools.partial(
                runtime.chat, _pieces(runtime, text), params, f"fail-{i}", cancel, None, None, "exact"
            )
            tasks.append(asyncio.ensure_future(runtime.worker.run(fn, cancel)))
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    *answers, failed = asyncio.run(main())
    assert max(shared) > 1, "the failing request never shared a step"
    assert isinstance(failed, RuntimeError)
    assert "cannot step" in str(failed)
    for a, b in zip(alone, answers, strict=True):
        assert not isinstance(b, BaseException), b
        assert _same(a, b)
