"""``kamera bench prefill-tax`` on a tiny model: every way runs, the prompt cache's exact prefill
equals the one-pass full prefill bit for bit, and the server's bound shows in its passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import prefill_tax


def seconds_of(row: dict, way: str) -> float:
    return float(row["seconds"][way])


def test_the_prefill_tax_benchmark_reports_every_way(tmp_path: Path) -> None:
    out = tmp_path / "tax.json"
    code = prefill_tax.main(
        [
            "--model",
            "tiny:llama-gqa",
            "--lengths",
            "130,300",
            "--repeats",
            "1",
            "--pass-tokens",
            "128",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["rows"]] == [130, 300]
    for row in report["rows"]:
        assert set(row["seconds"]) == set(prefill_tax.WAYS)
        assert all(v > 0 for v in row["seconds"].values())
        assert row["exact_equal"] == {
            "cache_exact": True,
            "cache_exact_server": True,
            "cache_exact_server_bf16": True,  # exact in bfloat16 products too
        }
        # rounded to three decimals (and the seconds to six), whatever the ratio's size
        assert row["bf16_speedup"] == pytest.approx(
            seconds_of(row, "one_pass") / seconds_of(row, "one_pass_bf16"), rel=5e-3, abs=1e-3
        )
        assert row["server_passes"] == -(-row["tokens"] // 128)
        # every ratio is that way's seconds over the faster of the two one-pass ways
        seconds = row["seconds"]
        fastest = min(seconds["one_pass"], seconds["one_pass_sdpa"])
        for way, ratio in row["over_fastest"].items():
            assert ratio == pytest.approx(seconds[way] / fastest, rel=5e-3, abs=1e-3), way


def test_a_vision_model_leaves_the_bfloat16_ways_out(tmp_path: Path) -> None:
    out = tmp_path / "tax.json"
    args = ["--model", "tiny:qwen2.5-vl", "--lengths", "140", "--repeats", "1", "--json", str(out)]
    assert prefill_tax.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["seconds"]) == {w for w in prefill_tax.WAYS if not w.endswith(prefill_tax.NARROW)}
    assert "bf16_speedup" not in row
