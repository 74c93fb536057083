"""``kamera bench decode``: every path measured at every batch size, gains against the first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.adapters import batched, qlinear
from bench import decode
from cache import qdot


def test_the_decode_bench_measures_every_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, int8 = batched.NATIVE_ATTENTION, qlinear.INT8_PRODUCTS
    out = tmp_path / "decode.json"
    assert (
        decode.main(
            ["--rows", "1,3", "--rounds", "1", "--steps", "2", "--prompt-tokens", "12", "--json", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"gguf-blocks", "blocks-f32-products", "blocks-sdpa", "float32"}
    for path, by_rows in report["results"].items():
        assert set(by_rows) == {"1", "3"}, path
        for rows, row in by_rows.items():
            assert row["step_ms"] > 0
            assert row["tokens_per_s"] == pytest.approx(int(rows) * 1e3 / row["step_ms"], rel=0.02)
        assert report["gain"][path]["1"] == 1.0
    assert report["prompt_tokens"] == 12
    assert batched.NATIVE_ATTENTION is before  # the switches are back as the server runs them
    assert qlinear.INT8_PRODUCTS is int8
    assert report["int8_products"] == (int8 and qdot.vectorised())
    assert "gguf-blocks ms" in capsys.readouterr().out
