"""``kamera bench NAME``: benchmarks (relocation, fidelity, ttft, traces, consistency, replicas, ...).

Each benchmark is a module with ``main(argv) -> int``; JSON out with --json.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from tools.data import find_data_folder

BENCHMARKS: dict[str, tuple[str, str]] = {
    "relocation": ("bench.relocation", "exactness per family; rotation throughput against a copy"),
    "fidelity": ("bench.fidelity", "patches against blind reuse, CacheBlend and EPIC on multi-hop QA"),
    "ttft": ("bench.ttft", "time to first token of an agent session: re-prefill, prefix cache, Kamera"),
    "traces": ("bench.traces", "content-addressed reuse on real agent traces under context policies"),
    "video-multihop": ("bench.video_multihop", "single- and multi-hop accuracy on the video world"),
    "consistency": (
        "bench.consistency",
        "cached answers against a full prefill, per context policy and reuse mode",
    ),
    "replicas": ("bench.replicas", "agent traces round-robin over 1, 2, 4 replicas, with and without Redis"),
    "load": (
        "bench.load",
        "1, 8 and 32 streaming clients at once against kamera serve and llama.cpp's server",
    ),
    "decode": ("bench.decode", "decode tokens/s at 1, 8 and 32 rows: GGUF block products against float32"),
    "serve-ttft": ("bench.serve_ttft", "kamera serve's time to first token: cached prompt, full prefill"),
    "store-share": (
        "bench.store_share",
        "kamera serve processes on one store directory, against one process and separate directories",
    ),
    "prefill-tax": (
        "bench.prefill_tax",
        "an exact, storable prefill against the fastest one-pass prefill, per prompt length",
    ),
    "video-costs": (
        "bench.video_costs",
        "a frame's encode, prefill and decode at Qwen2.5-VL-3B/7B widths; modelled TTFT with KV reuse",
    ),
    "video-stream": (
        "bench.video_stream",
        "a sliding window over a 10-minute stream asked every few seconds, look-back included, "
        "against re-encoding each question's window",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in BENCHMARKS:
        width = max(map(len, BENCHMARKS))
        print("usage: kamera bench NAME [--json PATH] ...\n\nbenchmarks:")
        for name, (_, doc) in BENCHMARKS.items():
            print(f"  {name.ljust(width)}  {doc}")
        return 0 if not args or args[0] in ("-h", "--help") else 2
    print(find_data_folder().describe(), file=sys.stderr)
    code: int = importlib.import_module(BENCHMARKS[args[0]][0]).main(args[1:])
    return code
