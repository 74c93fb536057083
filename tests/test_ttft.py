"""``kamera bench ttft`` end to end on the random-weight Qwen2.5-VL: the JSON the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ttft import main


def test_ttft_bench_writes_every_step_and_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    args = ["--models", "qwen2.5-vl", "--vl-sizes", "400", "--image-side", "112", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert [s["op"] for s in steps] == ["append", "slide", "reorder", "recall", "append"]
    for s in steps:
        assert set(s["ttft_ms"]) == {"reprefill", "prefix", "kamera"}
        assert all(v > 0 for v in s["ttft_ms"].values())
        assert s["window_tokens"] <= 400
    summary = report["summary"]
    assert summary["ratio_reprefill_over_kamera"] > 0
    assert summary["ratio_prefix_over_kamera"] > 0
    calls = summary["vision_encoder_calls"]
    # Kamera encodes only the two appended images; the baselines re-encode every window image
    assert calls["kamera"] == 2
    assert calls["reprefill"] > calls["kamera"]
    # over the whole session (the first fill included) one encoder run per distinct image
    assert summary["kamera_session_encoder_calls"] == summary["unique_images"] > calls["kamera"]
    # the recalled chunk comes back from the store, not from a forward pass
    assert "canonical+patch" in steps[3]["sources"]
    # a reorder re-rotates the moved chunks' keys; the copy floor is timed for as many tokens
    assert steps[2]["tokens_rotated"] > 0
    assert steps[2]["copy_floor_ms"] > 0
    for s in steps:
        assert (s["copy_floor_ms"] > 0) == (s["tokens_rotated"] > 0)


def test_bad_sizes_and_models_are_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (
        ["--sizes", "0"],
        ["--sizes", "2k"],
        ["--models", "gpt"],
        ["--models", "smollm2", "--sizes", ""],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2
    assert "window sizes must be positive" in capsys.readouterr().err
