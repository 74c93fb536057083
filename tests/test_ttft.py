"""``kamera bench ttft`` end to end on the random-weight Qwen2.5-VL: the JSON the issue names."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert summary["unique_images"] >= calls["kamera"]
    # the recalled chunk comes back from the store, not from a forward pass
    assert "canonical+patch" in steps[3]["sources"]
