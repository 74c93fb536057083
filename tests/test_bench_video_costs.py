"""kamera bench video-costs: the cost model's arithmetic, the published widths and their cut, and
one end-to-end run on tiny widths (scaled to a deeper pretend model) and on a missing world VLM."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agent.adapters.qwen_vl_widths import (
    LLM,
    QWEN2_5_VL_3B,
    QWEN2_5_VL_7B,
    VISION_FULL,
    VISION_WINDOW,
    VLWidths,
    config,
)
from bench import video_costs
from bench.video_costs_model import PassModel, interpolate, modelled_ttft, scale_to_depth, slope

# the repository's tiny Qwen2.5-VL widths, standing for a model of 4 vision blocks and 6 layers
TINY = VLWidths(
    name="tiny",
    hidden=64,
    intermediate=128,
    heads=4,
    kv_heads=2,
    layers=6,
    vocab=512,
    tie_embeddings=False,
    mrope_section=(2, 3, 3),
    rope_theta=1e6,
    vision_depth=4,
    vision_hidden=32,
    vision_intermediate=64,
    vision_heads=2,
    patch_size=14,
    spatial_merge=2,
    temporal_patch=2,
    window_size=56,
    fullatt_blocks=(1, 3),
    min_pixels=56 * 56,
    max_pixels=224 * 224,
)


def test_scale_to_depth_counts_each_kind_of_block_at_its_real_number() -> None:
    block_s = {LLM: 4.0, VISION_WINDOW: 1.0, VISION_FULL: 2.0}
    measured = {LLM: 2, VISION_WINDOW: 1, VISION_FULL: 1}
    real = {LLM: 6, VISION_WINDOW: 3, VISION_FULL: 2}
    # the rest (10 - 7) plus 6 layers at 2 s, 3 window blocks at 1 s, 2 full blocks at 2 s
    assert scale_to_depth(10.0, block_s, measured, real) == pytest.approx(3 + 12 + 3 + 4)
    assert scale_to_depth(10.0, block_s, measured, measured) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="vision_full"):
        scale_to_depth(10.0, block_s, {**measured, VISION_FULL: 0}, real)


def test_interpolation_slope_and_the_pass_model() -> None:
    points = {0: 1.0, 16: 3.0, 64: 4.0}
    assert interpolate(points, 8) == pytest.approx(2.0)
    assert interpolate(points, 40) == pytest.approx(3.5)
    assert interpolate(points, 128) == pytest.approx(5.33333333)  # the last segment extended
    assert slope({0: 1.0, 10: 2.0, 20: 3.0}) == pytest.approx(0.1)
    model = PassModel.fit(5.0, 17, {0: 1.0, 16: 1.16})
    assert model.per_pair_s == pytest.approx(0.01)
    assert model.seconds(17) == pytest.approx(5.0)  # fitted to the measured pass
    assert PassModel.fit(5.0, 10, {0: 1.0, 16: 0.9}).per_pair_s == 0.0  # noise: no negative cost


def test_modelled_ttft_reuses_the_window_or_reencodes_it() -> None:
    passes = PassModel(per_frame_s=0.5, per_pair_s=0.01)
    t = modelled_ttft(2.0, 1.5, {0: 1.0, 16: 1.16}, passes, 0.3, window=16)
    assert t.reuse_s == pytest.approx(2.0 + 1.16 + 0.3)
    assert t.reencode_s == pytest.approx(17 * 1.5 + 17 * 0.5 + 0.01 * 17 * 16 / 2 + 0.3)
    assert t.speedup == pytest.approx(t.reencode_s / t.reuse_s)


def test_published_widths_make_the_published_parameter_counts() -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    for widths, total in ((QWEN2_5_VL_3B, 3.75e9), (QWEN2_5_VL_7B, 8.29e9)):
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(config(widths))
        vision = sum(p.numel() for p in model.model.visual.parameters())
        assert vision == pytest.approx(675e6, rel=0.01)  # the vision tower, about 675M either way
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(total, rel=0.01)


def test_a_cut_keeps_one_block_of_each_attention_kind() -> None:
    assert QWEN2_5_VL_7B.depths == {VISION_WINDOW: 28, VISION_FULL: 4, LLM: 28}
    cut = QWEN2_5_VL_7B.cut(2, 2)
    assert cut.depths == {VISION_WINDOW: 1, VISION_FULL: 1, LLM: 2}
    assert (cut.hidden, cut.vision_hidden, cut.fullatt_blocks) == (3584, 1280, (1,))
    with pytest.raises(ValueError, match="at least 2 vision blocks"):
        QWEN2_5_VL_7B.cut(1, 2)
    with pytest.raises(ValueError, match="mrope_section"):
        replace(TINY, mrope_section=(4, 4, 4))


def test_tiny_run_scales_to_the_real_depth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(video_costs.PUBLISHED, "tiny", TINY)
    out = tmp_path / "costs.json"
    args = ["--models", "tiny", "--sizes", "56,448", "--window", "2", "--windows", "2,4"]
    args += ["--repeats", "1", "--min-seconds", "0", "--question-tokens", "4", "--out", str(out)]
    assert video_costs.main(args) == 0
    report = json.loads(out.read_text())
    (row,) = report["models"]
    assert row["measured_depth"] == {VISION_WINDOW: 1, VISION_FULL: 1, LLM: 2}
    assert row["real_depth"] == {VISION_WINDOW: 2, VISION_FULL: 2, LLM: 6}
    assert row["scaled"] is True
    frame, too_big = row["frames"]
    assert "skipped" in too_big  # 448 x 448 is over the tiny processor's 224 x 224
    assert (frame["tokens_per_frame"], frame["chunk_tokens"]) == (4, 6)
    for unit in ("encode", "prefill", "decode"):
        # one run each: the blocks' time counted at the real depth, more than as run
        assert frame[f"{unit}_s"] > frame["measured"][f"{unit}_s"] > 0
        assert 0 < frame["ratio"][unit] < math.inf
    assert frame["ratio"]["decode"] == 1.0
    assert set(frame["prefill_s_by_context"]) == {"0", "2", "4"}
    assert frame["ttft"]["modelled"] is True
    assert [t["window"] for t in frame["ttft"]["rows"]] == [2, 4]
    assert all(t["reencode_s"] > 0 and t["reuse_s"] > 0 for t in frame["ttft"]["rows"])
    assert frame["one_pass"]["frames"] == 3


def test_missing_world_weights_skip_the_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video_costs, "WORLD_VL_DIR", tmp_path)
    out = tmp_path / "costs.json"
    assert video_costs.main(["--models", "world", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["models"]
    assert row["model"] == "world-vl"
    assert "holds no weights" in row["skipped"]
