"""``kamera demo`` on the embedded SmolLM2: the reordered documents through the server's prompt
cache, where the modes that promise a full prefill's answer must give it."""

from __future__ import annotations

import pytest
from _util import full_prefill, greedy

from agent.adapters.base import ModelAdapter
from agent.engine.chat import Message, render
from agent.engine.prompt_cache import PromptCacheConfig
from demos.reorder import DOCUMENTS, QUESTION, SYSTEM, main, run

MAX_NEW_TOKENS = 12


def test_exact_and_repair_answer_as_a_full_prefill(smollm2: ModelAdapter) -> None:
    """The reordered prompt answered in each mode beside a full prefill computed here straight
    through the model. On these documents repair is given up, every time: what its layer-1 pass
    measured calls for a wider margin than the guard's cap, so the prompt is prepared exact; the
    row must say so (residual measured, nothing reused by content, the exact prefill counted as
    the fallback) and answer from exact KV."""
    order = [2, 0, 1]
    report = run(smollm2, QUESTION, order, MAX_NEW_TOKENS)
    docs = [DOCUMENTS[i] + "\n" for i in order]
    pieces = render(smollm2.tokenizer, [Message("system", (SYSTEM,)), Message("user", (*docs, QUESTION))])
    ids = [t for p in pieces for t in p.ids]
    cache, logits, position = full_prefill(smollm2, ids)
    want, _ = greedy(smollm2, logits, cache, position, MAX_NEW_TOKENS)
    rows = {r["mode"]: r for r in report["modes"]}
    assert report["reference"]["prompt_tokens"] == len(ids)
    assert report["reference"]["tokens"] == want
    for r in rows.values():
        assert r["prompt_tokens"] == len(ids)
    exact, repair, fast = rows["exact"], rows["repair"], rows["fast"]
    assert exact["tokens"] == want
    assert exact["content_tokens"] == 0
    assert exact["prefilled_tokens"] == len(ids) - exact["exact_tokens"]
    assert fast["content_tokens"] > 0
    assert fast["tokens"] != want  # what the demo shows: blind reuse changes this answer

    # given up: the repair measured too much, and the prompt was prepared exact instead, so the
    # answer came from exact KV (the full prefill's tokens, the same prefill as exact mode's)
    assert repair["repair_residual"] > PromptCacheConfig().give_up_residual
    assert repair["tokens"] == want
    assert repair["exact_tokens"] == exact["exact_tokens"]
    assert repair["prefilled_tokens"] == exact["prefilled_tokens"]
    assert repair["exact_fallback_tokens"] == repair["prefilled_tokens"] > 0
    # and it is not reported as a repair that was used: nothing reused by content, moved or
    # recomputed by it
    used = {k: repair[k] for k in ("content_tokens", "repair_recomputed_tokens", "rotated_tokens")}
    assert used == dict.fromkeys(used, 0), f"a given-up repair reported as used: {used}"


@pytest.mark.parametrize("order", ["0,1", "0,1,1", "a,b,c"])
def test_a_bad_order_is_refused(order: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--order", order])
    assert e.value.code == 2
    assert f"permutation of 0..{len(DOCUMENTS) - 1}" in capsys.readouterr().err
