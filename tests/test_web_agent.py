from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("playwright")

from demos.web_agent import main
from tools.browser import serve_directory

CHROMIUM = os.environ.get("KAMERA_CHROMIUM", "/usr/bin/chromium")
SITE = Path(__file__).resolve().parents[1] / "demos" / "sample_site"
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"no Chromium at {CHROMIUM}")

# Coordinates of the sample site in a 640x400 viewport (see demos/sample_site/style.css).
SCRIPT = [
    "click(235, 30)",  # Products
    "click(390, 30)",  # Contact
    "click(160, 240)",  # the name field
    'type("Ada")',
    'press("Enter")',  # submits to thanks.html?name=Ada
    "click(80, 30)",  # Home: the first screenshot again, slid out by then: recalled
    "click(160, 350)",  # the link to example.com: refused
    "<b>I would rather wander</b>",  # not an action: reported and asked again
    'goto("https://example.com/")',  # refused
    'done("toured the shop")',
]


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_directory(SITE) as server:
        yield server.url


def _run(site: str, out: Path, *extra: str) -> tuple[int, dict]:
    summary = out.with_suffix(".json")
    code = main(
        ["--start-url", site + "index.html", "--task", "tour the shop", "--viewport", "640x400",
         "--out", str(out), "--json", str(summary), "--threads", "1", *extra]
    )  # fmt: skip
    return code, json.loads(summary.read_text()) if summary.exists() else {}


@needs_chromium
def test_scripted_tour_with_model(site: str, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    code, summary = _run(
        site, tmp_path / "run", "--policy", str(script), "--model", "tiny", "--keep", "2",
        "--max-new-tokens", "20", "--retries", "1",
    )  # fmt: skip
    assert code == 0
    # the model's own answer on every screenshot of the tour, decoded under the action grammar
    assert summary["model_parse_errors"] == 0
    assert summary["finished"] is True
    assert summary["run_dir"] == str(tmp_path / "run")
    steps = summary["steps"]
    assert all(set(s) >= {"action", "url", "ttft_ms"} for s in steps)
    assert all(s["ttft_ms"] > 0 for s in steps)
    assert [s["action"] for s in steps][-1] == 'done("toured the shop")'
    assert any("thanks.html?name=Ada" in s["url"] for s in steps)

    # one encoder run per distinct screenshot, over the whole run
    assert summary["vision_encoder_calls"] == summary["distinct_screenshots"] < len(steps)
    records = json.loads((tmp_path / "run" / "steps.json").read_text())
    assert "recalled" in [r["source"] for r in records]
    assert all(r["cache"]["screenshots_in_window"] <= 2 for r in records)

    # navigation off the allowlist: refused, reported, and the run went on
    assert "https://example.com/" in summary["refused"]
    refused = [r for r in records if r.get("refused")]
    assert len(refused) == 2
    assert all(r["url_after"].startswith(site) for r in refused)

    # the unparseable answer: reported, then the next answer was taken
    bad = next(r for r in records if r["parse_errors"])
    assert bad["action"] == 'goto("https://example.com/")'

    shots = sorted((tmp_path / "run" / "screenshots").glob("*.png"))
    assert len(shots) == len(steps)
    for shot in shots:
        pixels = np.asarray(Image.open(shot).convert("RGB"))
        assert pixels.shape == (400, 640, 3)
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 8  # not blank

    page = (tmp_path / "run" / "report.html").read_text()
    assert "screenshots/step_000.png" in page
    assert "&lt;b&gt;I would rather wander&lt;/b&gt;" in page
    assert "<b>I would rather" not in page
    assert (tmp_path / "run" / "actions.txt").read_text().splitlines()[0] == "click(235, 30)"


@needs_chromium
def test_model_answers_under_the_grammar_always_parse(site: str, tmp_path: Path) -> None:
    code, summary = _run(
        site, tmp_path / "run", "--model", "tiny", "--retries", "0", "--max-steps", "3",
        "--max-new-tokens", "20",
    )  # fmt: skip
    records = json.loads((tmp_path / "run" / "steps.json").read_text())
    assert summary["model_parse_errors"] == 0
    assert all(r["parse_errors"] == [] and r["action"] for r in records)
    assert code == (0 if summary["finished"] else 1)


@needs_chromium
def test_unparseable_model_answers_end_the_run(site: str, tmp_path: Path) -> None:
    code, summary = _run(
        site, tmp_path / "run", "--model", "tiny", "--retries", "1", "--max-steps", "3",
        "--max-new-tokens", "4", "--no-grammar",
    )  # fmt: skip
    assert code == 1
    assert summary["finished"] is False
    assert "no parseable action after 2 answers" in summary["reason"]
    records = json.loads((tmp_path / "run" / "steps.json").read_text())
    assert len(records) == 1
    assert len(records[0]["outputs"]) == len(records[0]["parse_errors"]) == 2
    assert (tmp_path / "run" / "report.html").is_file()


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--task", "t", "--out", str(tmp_path / "run")]
    assert main(["--start-url", "http://127.0.0.1:9/", *base, "--no-model"]) == 2  # no script
    assert main(["--start-url", "file:///etc/passwd", *base, "--model", "tiny"]) == 2
    bad = tmp_path / "script.json"
    bad.write_text('{"not": "a list"}')
    assert main(["--start-url", "http://127.0.0.1:9/", *base, "--policy", str(bad), "--no-model"]) == 2
    short = ["--start-url", "http://127.0.0.1:9/", *base, "--model", "tiny", "--max-new-tokens", "8"]
    assert main(short) == 2  # an action under the grammar may need 20 tokens
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("kamera web-agent: error:") == 4
