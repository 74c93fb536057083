"""The tables of ``kamera bench video-costs``: per-frame costs and their ratio, the modelled
first tokens, and one forward pass over many frames beside its modelled sum.

Not here: the measurements (``video_costs.py``); the JSON report holds every figure.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from agent.tables import make_console, print_table


def _ms(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}"


def _depth(row: dict[str, Any]) -> str:
    real, measured = row["real_depth"], row["measured_depth"]
    vision = real["vision_window"] + real["vision_full"]
    cut = measured["vision_window"] + measured["vision_full"]
    text = f"{vision} + {real['llm']}"
    return f"{text} (scaled from {cut} + {measured['llm']})" if row["scaled"] else text


def _frames(report: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [
        (row, f)
        for row in report["models"]
        if "skipped" not in row
        for f in row["frames"]
        if "skipped" not in f
    ]


def print_tables(report: dict[str, Any]) -> None:
    console = make_console()
    w = report["window"]
    threads = report["torch_threads"]
    costs = Table(
        title=f"One frame: encode, prefill after {w} frames, one decode step (ms; float32 CPU, "
        f"{threads} thread{'s' * (threads != 1)}; depth: vision blocks + LLM layers)"
    )
    for header in ("model", "frame", "tokens", "encode", "prefill", "decode", "enc : pf : dec", "depth"):
        costs.add_column(header)
    for row, f in _frames(report):
        r = f["ratio"]
        costs.add_row(
            row["model"],
            "x".join(map(str, f["size"])),
            str(f["tokens_per_frame"]),
            _ms(f["encode_s"]),
            _ms(f["prefill_s"]),
            _ms(f["decode_s"]),
            f"{r['encode']:.2f} : {r['prefill']:.2f} : 1",
            _depth(row),
        )
    print_table(console, costs)

    ttft = Table(title="Time to first token over W frames + 1 new frame (modelled, ms)")
    for header in ("model", "frame", "W", "KV reused", "re-encoding", "speedup"):
        ttft.add_column(header)
    for row, f in _frames(report):
        for t in f["ttft"]["rows"]:
            ttft.add_row(
                row["model"],
                "x".join(map(str, f["size"])),
                str(t["window"]),
                _ms(t["reuse_s"]),
                _ms(t["reencode_s"]),
                f"{t['speedup']:.1f}x",
            )
    print_table(console, ttft)

    check = Table(title=f"Prefill of {w + 1} frames: one forward pass against single-frame passes (ms)")
    for header in ("model", "frame", "frames", "one pass", "single-frame passes"):
        check.add_column(header)
    for row, f in _frames(report):
        p = f["one_pass"]
        check.add_row(
            row["model"],
            "x".join(map(str, f["size"])),
            str(p["frames"]),
            _ms(p["measured_s"]),
            _ms(p["single_frame_sum_s"]),
        )
    print_table(console, check)
    for row in report["models"]:
        if "skipped" in row:
            console.print(f"{row['model']}: skipped, {row['skipped']}", markup=False)
