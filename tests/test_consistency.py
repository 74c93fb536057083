"""``kamera bench consistency`` on a tiny random model: the replay through the server's prompt
cache, the summary's shares (the seen-before ceiling among them) and exact mode's agreement."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from agent.adapters.loading import load_adapter
from agent.byte_tokenizer import ByteTokenizer
from agent.server.chat import Message
from agent.server.generation import SamplingParams
from agent.server.prompt_cache import PromptCacheConfig
from bench.consistency import gap_error, replay, seen_tokens, summarize
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


def _replay(llama: Any, policy: str, modes: list[Any], config: PromptCacheConfig) -> dict[str, Any]:
    """The session's three requests replayed under ``policy``, 4 greedy tokens each."""
    rows, _ = replay(
        llama,
        [_session()],
        policy,
        modes,
        config,
        SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2),
        max_requests=3,
        max_prompt_tokens=10_000,
        store_bytes=64 << 20,
        log=lambda *_: None,
    )
    return rows


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


def test_gap_error_and_margin_scale_read_what_repair_left(llama: Any) -> None:
    """The gap error is how far the cached logits moved the reference's best two apart; the
    margin scale is the largest |gap error| / sqrt(residual) over requests decoded on repaired KV
    (the window policy moves the reused turns), and covers each of them."""
    assert gap_error(torch.tensor([3.0, 1.0, 0.0]), torch.tensor([3.5, 2.0, 9.0])) == pytest.approx(-0.5)
    config = PromptCacheConfig(block_tokens=64, min_reuse_tokens=8, repair_margin=0.0)
    rows = _replay(llama, "window-1", ["repair"], config)
    report = summarize(rows["repair"])
    watched = [r for r in rows["repair"] if r.cached.usage.relocated_tokens]
    assert watched, "the window moved nothing: nothing to read"
    assert len(report["gap_errors"]) == len(watched)
    scale = report["margin_scale"]
    for r, g in zip(watched, report["gap_errors"], strict=True):
        assert g == pytest.approx(gap_error(r.reference.logits, r.cached.logits), abs=1e-5)
        assert abs(g) <= scale * math.sqrt(r.cached.usage.repair_residual) + 1e-4
    assert summarize(rows["repair"][:1])["margin_scale"] is None  # the first request moved nothing
