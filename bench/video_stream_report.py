"""The summary of a ``kamera bench video-stream`` run and its table: times to first token and the
whole session against re-encoding, encoder calls against distinct frames, right and equal answers,
how each question was served, and the targets, met or not.

Not here: running anything (``video_stream_run.py``).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

from agent.adapters.vision import encoder_calls
from bench.video_stream_run import Meter
from demos.video_session import VideoSession

TARGETS = {
    "ttft_10x": "median TTFT per question >= 10x better than re-encoding its window",
    "session_3x": "whole session (ingest included) >= 3x faster than re-encoding every question",
    "encoder_calls_equal_distinct_frames": "vision encoder calls == distinct frames",
    "right_within_1": "right answers >= re-encoding's minus 1",
    "equal_99": "answers equal to re-encoding's on >= 99% of questions, look-back included",
}


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linear between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    x = q * (len(ordered) - 1)
    i = int(x)
    j = min(i + 1, len(ordered) - 1)
    return ordered[i] + (ordered[j] - ordered[i]) * (x - i)


def _kinds(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kind in ("recent", "look-back"):
        mine = [r for r in rows if r["kind"] == kind]
        out[kind] = {
            "questions": len(mine),
            "right": sum(r["right"] for r in mine),
            "baseline_right": sum(r["baseline_right"] for r in mine),
            "same_as_baseline": sum(r["same_as_baseline"] for r in mine),
            "ttft_ratio_median": quantile([r["ttft_ratio"] for r in mine], 0.5),
            "encoder_calls": sum(r["encoder_calls"] for r in mine),
            "served": dict(Counter(r["served"] for r in mine)),
        }
    return out


def summarize(
    session: VideoSession, meter: Meter, rows: list[dict[str, Any]], mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One run's figures (times at the real depth where the model was cut) and its targets."""
    n = len(rows)
    ttft = [r["ttft_ms"] for r in rows]
    base = [r["baseline_ttft_ms"] for r in rows]
    ratios = [r["ttft_ratio"] for r in rows]
    session_s = meter.scaled.get("ingest", 0.0) + meter.scaled.get("answer", 0.0)
    baseline_s = meter.scaled.get("reencode", 0.0)
    distinct = len({f.chunk_id for f in session.frames})
    calls = encoder_calls(session.adapter)
    right, base_right = sum(r["right"] for r in rows), sum(r["baseline_right"] for r in rows)
    same = sum(r["same_as_baseline"] for r in rows)
    ingest_blocks = meter.blocks.get("ingest", {"vision": 0.0, "llm": 0.0})
    frames = max(len(session.frames), 1)
    summary: dict[str, Any] = {
        "reuse_mode": mode,
        "questions": n,
        "ttft_ms_median": quantile(ttft, 0.5),
        "ttft_ms_p90": quantile(ttft, 0.9),
        "baseline_ttft_ms_median": quantile(base, 0.5),
        "baseline_ttft_ms_p90": quantile(base, 0.9),
        "ttft_ratio_median": quantile(ratios, 0.5),
        "ttft_ratio_p10": quantile(ratios, 0.1),  # nine questions in ten gain at least this
        "ttft_ratio_of_p90": quantile(base, 0.9) / max(quantile(ttft, 0.9), 1e-9),
        "ttft_ratio_min": min(ratios, default=float("nan")),
        "questions_10x": sum(x >= 10 for x in ratios),
        "session_s": session_s,
        "ingest_s": meter.scaled.get("ingest", 0.0),
        "answer_s": meter.scaled.get("answer", 0.0),
        "baseline_s": baseline_s,
        "session_ratio": baseline_s / max(session_s, 1e-9),
        "as_run_s": dict(meter.seconds),
        "encode_s_per_frame": ingest_blocks["vision"] / frames,
        "prefill_s_per_frame": ingest_blocks["llm"] / frames,
        "vision_encoder_calls": calls,
        "distinct_frames": distinct,
        "lookback_encoder_calls": sum(r["encoder_calls"] for r in rows if r["kind"] == "look-back"),
        "baseline_encoder_calls": sum(r["baseline_encoder_calls"] for r in rows),
        "right": right,
        "baseline_right": base_right,
        "same_as_baseline": same,
        "served": dict(Counter(r["served"] for r in rows)),
        "frames_recalled": sum(r["recalled"] for r in rows),
        "by_kind": _kinds(rows),
        "rows": rows,
    }
    summary["targets"] = {
        "ttft_10x": summary["ttft_ratio_median"] >= 10,
        "session_3x": summary["session_ratio"] >= 3,
        "encoder_calls_equal_distinct_frames": calls == distinct,
        "right_within_1": right >= base_right - 1,
        "equal_99": same >= 0.99 * n,
    }
    return summary


def print_summary(report: dict[str, Any]) -> None:
    size = "x".join(map(str, report["frame_size"]))
    depth = "scaled to the real depth" if report["scaled"] else "as run"
    print(
        f"{report['model_name']}: {report['frames']} frames of {size}, "
        f"window {report['window_frames']} frames, {report['prompt_frames']} frames a prompt, "
        f"a question every {report['every_s']} s; times {depth}"
    )
    head = (
        "mode",
        "TTFT ms",
        "re-enc ms",
        "TTFT x med",
        "x p10",
        "session s",
        "re-enc s",
        "session x",
        "enc calls",
        "distinct",
        "right",
        "re-enc right",
        "equal",
        "served",
    )
    print(" | ".join(head))
    for r in report["runs"]:
        print_run(r)


def print_run(r: dict[str, Any], file: TextIO | None = None) -> None:
    """One run's row of the table and its targets."""
    served = ", ".join(f"{k} {v}" for k, v in sorted(r["served"].items()))
    cells = (
        r["reuse_mode"],
        f"{r['ttft_ms_median']:.1f}",
        f"{r['baseline_ttft_ms_median']:.1f}",
        f"{r['ttft_ratio_median']:.1f}",
        f"{r['ttft_ratio_p10']:.1f}",
        f"{r['session_s']:.1f}",
        f"{r['baseline_s']:.1f}",
        f"{r['session_ratio']:.2f}",
        str(r["vision_encoder_calls"]),
        str(r["distinct_frames"]),
        f"{r['right']}/{r['questions']}",
        str(r["baseline_right"]),
        f"{r['same_as_baseline']}/{r['questions']}",
        served,
    )
    print(" | ".join(cells), file=file)
    met = ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in r["targets"].items())
    print(f"  targets: {met}", file=file)
