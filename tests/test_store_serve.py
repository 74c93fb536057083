"""`kamera serve` processes over one store directory: restarts, kill -9, swapped records, two servers.

Real server processes (tiny random model, this checkout on PYTHONPATH) and a real directory. The
reference answer of every prompt is the same request with a fresh ``cache_salt``, which shares no
entry with anything: a full prefill. Each test prints its numbers (run with ``-s`` to see them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from agent.server.background import free_port
from tests.test_store_faults import assert_directory_sound, rotate_records

ROOT = Path(__file__).resolve().parents[1]
DISK_BYTES = 256 << 20
DOCS = [" ".join(f"Ledger {d} line {i}: {(i * (d + 3)) % 17} sails." for i in range(30)) for d in range(6)]
PROMPTS = [
    [{"role": "system", "content": doc}, {"role": "user", "content": f"What is line {q}?"}]
    for doc in DOCS
    for q in (1, 2)
]

pytestmark = pytest.mark.slow


class Answer(NamedTuple):
    text: str
    prompt_tokens: int
    cached_tokens: int


class Server:
    """One `kamera serve` process on `disk`; stop it cleanly (SIGTERM) or kill it (SIGKILL)."""

    def __init__(self, disk: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "from agent.cli import main; raise SystemExit(main())", "serve"]
        cmd += ["--model", "tiny:llama-gqa", "--port", str(self.port), "--threads", "1"]
        cmd += ["--disk-path", str(disk), "--disk-bytes", str(DISK_BYTES), "--log-level", "warning", *extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kamera serve exited: {self.proc.stdout.read() if self.proc.stdout else ''}"
                )
            try:
                if self.client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kamera serve did not start")
            time.sleep(0.2)

    def ask(self, messages: list[dict[str, Any]], salt: str | None = None) -> Answer:
        body: dict[str, Any] = {"messages": messages, "max_tokens": 8, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = self.client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        out = r.json()
        u = out["usage"]
        return Answer(
            out["choices"][0]["message"]["content"],
            u["prompt_tokens"],
            u["prompt_tokens_details"]["cached_tokens"],
        )

    def metric(self, name: str, labels: str = "") -> float:
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith((name + labels + " ", name + "_total" + labels + " ")):
                return float(line.split()[-1])
        return 0.0

    def wait_written(self) -> None:
        """Until the background writer's queue is empty."""
        deadline = time.monotonic() + 60
        while self.metric("kamera_store_write_queue") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.client.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)
        self.client.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.kill()


def share(answers: list[Answer]) -> float:
    return sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers)


def references(server: Server) -> list[str]:
    return [server.ask(p, salt=f"fresh-{i}-{time.time_ns()}").text for i, p in enumerate(PROMPTS)]


def test_restart_after_clean_stop_and_kill(tmp_path: Path, servers: list[Server]) -> None:
    a = Server(tmp_path)
    servers.append(a)
    first = [a.ask(p) for p in PROMPTS]
    warm = [a.ask(p) for p in PROMPTS]  # what the running server reuses
    reference = references(a)
    a.stop()
    assert_directory_sound(tmp_path, DISK_BYTES)
    b = Server(tmp_path)
    servers.append(b)
    after_stop = [b.ask(p) for p in PROMPTS]
    new = [[m, {"role": "user", "content": "And the last line?"}] for m, _ in PROMPTS[::2]]
    new_first = [b.ask(p) for p in new]
    b.wait_written()
    b.kill()
    c = Server(tmp_path)
    servers.append(c)
    after_kill = [c.ask(p) for p in new]
    new_warm = [c.ask(p) for p in new]
    c.stop()
    assert_directory_sound(tmp_path, DISK_BYTES)
    kept_stop = share(after_stop) / share(warm)
    kept_kill = share(after_kill) / share(new_warm)
    print(
        f"\nrestart reuse: warm {share(warm):.3f}, after clean stop {share(after_stop):.3f} "
        f"({kept_stop:.1%} kept); new prompts warm {share(new_warm):.3f}, after kill -9 "
        f"{share(after_kill):.3f} ({kept_kill:.1%} kept)"
    )
    assert [x.text for x in first] == [x.text for x in warm] == [x.text for x in after_stop] == reference
    assert [x.text for x in after_kill] == [x.text for x in new_first]
    assert kept_stop >= 0.9
    assert kept_kill >= 0.9


def test_swapped_records_over_http(tmp_path: Path, servers: list[Server]) -> None:
    a = Server(tmp_path)
    servers.append(a)
    for p in PROMPTS:
        a.ask(p)
    a.stop()
    moved = rotate_records(tmp_path)
    b = Server(tmp_path)
    servers.append(b)
    answers = [b.ask(p).text for p in PROMPTS]
    refused = b.metric("kamera_store_misfiled", '{tier="disk"}')
    reference = references(b)
    print(
        f"\nswap: {moved} records moved, {refused:.0f} refused, {sum(map(str.__eq__, answers, reference))}/"
        f"{len(answers)} answers equal a full prefill's"
    )
    assert moved >= 2
    assert refused >= 2
    assert answers == reference
    b.stop()


def run_pair(pair: list[Server], order: list[list[dict[str, Any]]]) -> list[Answer]:
    out = []
    for i, p in enumerate(order):
        server = pair[(i + i // len(DOCS)) % 2]  # each document's second question goes to the other
        out.append(server.ask(p))
        server.wait_written()
    return out


def test_two_servers_on_one_directory(tmp_path: Path, servers: list[Server]) -> None:
    """Each document's questions are split between two servers: sharing one directory must beat
    two isolated ones and come near one server that saw everything."""
    order = [p for q in (1, 2) for p in PROMPTS if p[1]["content"].endswith(f"{q}?")]
    one = Server(tmp_path / "one")
    servers.append(one)
    alone = [one.ask(p) for p in order]
    one.stop()
    isolated = [Server(tmp_path / "a"), Server(tmp_path / "b")]
    servers.extend(isolated)
    apart = run_pair(isolated, order)
    for s in isolated:
        s.stop()
    pair = [Server(tmp_path / "shared"), Server(tmp_path / "shared")]
    servers.extend(pair)
    shared = run_pair(pair, order)
    reference = references(pair[0])
    for s in pair:
        s.stop()
    assert_directory_sound(tmp_path / "shared", DISK_BYTES)
    print(
        f"\nreuse: one server {share(alone):.3f}, two isolated {share(apart):.3f}, "
        f"two on one directory {share(shared):.3f}"
    )
    ref_by_prompt = {json.dumps(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    assert [a.text for a in shared] == [ref_by_prompt[json.dumps(p)] for p in order]
    assert share(shared) > share(apart)
    assert share(shared) >= 0.9 * share(alone)
