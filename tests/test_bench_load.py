"""``kamera bench load``: its figures from known results, and one real run against a
``kamera serve`` process (a tiny random-weight model; llama.cpp left out)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench import load


def _result(sent: float, ttft: float, latency: float, out: int, queue: float | None = 0.0) -> load.Result:
    return load.Result(sent, ttft, latency, out, 100, 0, queue, "prefilled 100")


def test_summary_counts_what_was_measured() -> None:
    results = [_result(0.0, 0.1 * i, 1.0 + i, 10 * i) for i in range(1, 6)]
    results.append(load.Result(0.0, 0.0, 0.5, 0, 0, 0, None, "", "HTTP 429"))
    s = load.summarize(results, wall_s=5.0)
    assert s["requests"] == 6
    assert s["errors"] == 1
    assert s["output_tokens"] == 150
    assert s["tokens_per_s"] == 30.0
    assert s["ttft_p50_s"] == 0.30000000000000004
    assert s["ttft_p95_s"] == 0.5
    assert s["latency_p95_s"] == 6.0
    assert len(s["rows"]) == 6
    assert s["rows"][-1]["error"] == "HTTP 429"


def test_checks_are_ratios_of_the_rows() -> None:
    short = {
        "kamera": {"1": {"tokens_per_s": 10.0}, "8": {"tokens_per_s": 40.0, "ttft_p50_s": 1.5}},
        "llama.cpp": {"1": {"tokens_per_s": 50.0}, "8": {"tokens_per_s": 60.0}},
    }
    got = load.checks({"scenarios": {"short": short}})
    assert got["kamera"]["gain_8"] == 4.0
    assert got["kamera"]["gain_32"] is None
    assert got["kamera"]["one_stream_over_llama"] == 0.2
    assert got["llama.cpp"]["gain_8"] == 1.2
    assert got["llama.cpp"]["one_stream_over_llama"] is None


def test_the_same_seed_sends_the_same_traffic() -> None:
    a = load.traffic("shared", 3, 2, random.Random("0-shared-3"))
    b = load.traffic("shared", 3, 2, random.Random("0-shared-3"))
    assert a == b
    systems = {r.messages[0]["content"] for client in a for r in client}
    assert len(systems) == 1  # every request shares the system prompt
    assert len({r.messages[1]["content"] for client in a for r in client}) == 6


def test_a_run_against_a_real_server(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    code = load.main(
        ["--no-peer", "--scenarios", "short", "--clients", "1,2", "--requests", "1",
         "--kamera-args", "--model tiny:llama-gqa", "--log", str(tmp_path / "serve.log"), "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    got = json.loads(out.read_text())
    rows = got["scenarios"]["short"]["kamera"]
    assert set(rows) == {"1", "2"}
    for clients, s in rows.items():
        assert s["errors"] == 0
        assert s["requests"] == int(clients)
        assert s["output_tokens"] > 0
        assert s["tokens_per_s"] > 0
        assert all(r["served"] and r["queue_s"] is not None for r in s["rows"])
    assert got["checks"]["kamera"]["one_client_tokens_per_s"] == rows["1"]["tokens_per_s"]
