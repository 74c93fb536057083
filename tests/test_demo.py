"""``kamera demo`` on the embedded SmolLM2: the reordered documents through the server's prompt
cache, where the modes that promise a full prefill's answer must give it."""

from __future__ import annotations

import pytest

from agent.adapters.base import ModelAdapter
from agent.server.prompt_cache import PromptCacheConfig
from demos.reorder import DOCUMENTS, QUESTION, main, run


def test_exact_and_repair_answer_as_a_full_prefill(smollm2: ModelAdapter) -> None:
    report = run(smollm2, QUESTION, [2, 0, 1], 12)
    rows = {r["mode"]: r for r in report["modes"]}
    reference = report["reference"]["tokens"]
    assert rows["exact"]["tokens"] == reference
    assert rows["repair"]["tokens"] == reference
    repair = rows["repair"]
    if repair["content_tokens"]:  # repaired: its recompute ran
        assert repair["repair_recomputed_tokens"] > 0
    else:  # given up: what repair measured called for too wide a margin
        assert repair["repair_residual"] > PromptCacheConfig().give_up_residual
        assert repair["exact_fallback_tokens"] == repair["prefilled_tokens"] > 0
    assert rows["fast"]["content_tokens"] > 0
    assert rows["fast"]["content_tokens"] >= repair["content_tokens"]
    assert rows["exact"]["content_tokens"] == 0
    prompt = report["reference"]["prompt_tokens"]
    for r in rows.values():
        assert r["prompt_tokens"] == prompt


@pytest.mark.parametrize("order", ["0,1", "0,1,1", "a,b,c"])
def test_a_bad_order_is_refused(order: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--order", order])
    assert e.value.code == 2
    assert f"permutation of 0..{len(DOCUMENTS) - 1}" in capsys.readouterr().err
