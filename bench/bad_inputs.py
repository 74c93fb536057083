"""Each bad input of issue 17 against a real ``kamera serve``: status, milliseconds, server RSS.

    python -m bench.bad_inputs [--model MODEL] [--repeat 5]

Starts ``kamera serve`` from this tree with one API key, warms it with one good request, then sends
each bad input ``--repeat`` times and prints a Markdown table: the status and error code, the
median client-side milliseconds (the upload of the body included), and the server's resident memory
(VmRSS) before the first send and half a second after the last answer. The 30 MiB message is
sent twice: with its Content-Length, and chunked (no length: the server sees only the bytes read
so far).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tools.serve import free_port

ROOT = Path(__file__).resolve().parents[1]
KEY = {"Authorization": "Bearer bench-key", "content-type": "application/json"}
HI = [{"role": "user", "content": "hi"}]
SETTLE_S = 0.5  # RSS "after" is read this long after the last answer
PNG = (  # a 1x1 PNG
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
    "AAAABJRU5ErkJggg=="
)


CHUNKED = "(chunked)"  # a case whose name ends so is sent without a Content-Length


def cases() -> list[tuple[str, str, str, bytes, dict[str, str]]]:
    chat = "/v1/chat/completions"

    def body(obj: object) -> bytes:
        return json.dumps(obj).encode()

    frames = '{"type": "frames", "frames": ["data:,"], "timestamps": [%s]}'
    big = body({"messages": [{"role": "user", "content": "a " * (15 << 20)}]})
    step = '{"observations": [' + frames + '], "instruction": "go"}'
    return [
        (
            "lone surrogate in a message",
            "POST",
            chat,
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            KEY,
        ),
        ("30 MiB text message", "POST", chat, big, KEY),
        (f"30 MiB text message {CHUNKED}", "POST", chat, big, KEY),
        (
            "10 MiB text message",
            "POST",
            chat,
            body({"messages": [{"role": "user", "content": "a " * (5 << 20)}]}),
            KEY,
        ),
        ("max_tokens: true", "POST", chat, body({"messages": HI, "max_tokens": True}), KEY),
        ('max_tokens: "3"', "POST", chat, body({"messages": HI, "max_tokens": "3"}), KEY),
        ('stream: "yes"', "POST", chat, body({"messages": HI, "stream": "yes"}), KEY),
        ("unknown top-level field", "POST", chat, body({"messages": HI, "foo": 1}), KEY),
        (
            "image to the text-only model",
            "POST",
            chat,
            body(
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}
                    ]
                }
            ),
            KEY,
        ),
        ("frame timestamp NaN", "POST", "/v1/sessions/x/steps", (step % "NaN").encode(), KEY),
        ("frame timestamp Infinity", "POST", "/v1/sessions/x/steps", (step % "Infinity").encode(), KEY),
        ("/metrics without a key", "GET", "/metrics", b"", {}),
        ("/openapi.json without a key", "GET", "/openapi.json", b"", {}),
    ]


def pieces(data: bytes, size: int = 1 << 16) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "from agent.cli import main; main()",
        "serve",
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KAMERA_API_KEYS": "bench-key:bench"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, headers=KEY)
            print("| bad input | status | code | median ms | server RSS before / after (MiB) |")
            print("|---|---|---|---|---|")
            for name, method, path, data, headers in cases():
                before = rss_mb(proc.pid)
                times, statuses, codes = [], set(), set()
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    content = pieces(data) if name.endswith(CHUNKED) else data or None
                    r = client.request(method, path, content=content, headers=headers)
                    times.append(1000 * (time.perf_counter() - t0))
                    statuses.add(r.status_code)
                    codes.add(r.json()["error"]["code"])
                time.sleep(SETTLE_S)
                after = rss_mb(proc.pid)
                status = "/".join(str(s) for s in sorted(statuses))
                median, code = statistics.median(times), "/".join(sorted(codes))
                print(f"| {name} | {status} | {code} | {median:.1f} | {before:.0f} / {after:.0f} |")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
