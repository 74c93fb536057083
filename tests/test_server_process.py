"""A real ``kamera serve`` process: header and body read deadlines, and the SIGTERM drain.

The server is started from this tree (``PYTHONPATH``) with the tiny random model and one-second
deadlines, so slow clients must be cut within a few seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from agent.server.background import free_port

ROOT = Path(__file__).resolve().parents[1]
CONNECTIONS = 1000


def start(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-c", "from agent.cli import main; main()", "serve", "--model", "tiny:llama-gqa"]
    cmd += ["--port", str(port), "--threads", "1", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kamera serve did not start")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, str]]:
    proc, url = start("--header-timeout-s", "1", "--body-timeout-s", "1")
    yield int(url.rsplit(":", 1)[1]), url
    proc.kill()
    proc.wait()


def _closed(sock: socket.socket, wait_s: float) -> bytes | None:
    """What the server sent before closing, or None if the socket is still open after ``wait_s``."""
    sock.settimeout(wait_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def test_partial_headers_are_cut_after_the_deadline(server: tuple[int, str]) -> None:
    port, url = server
    socks = []
    for _ in range(CONNECTIONS):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
        socks.append(s)
    time.sleep(1.5)
    t0 = time.monotonic()
    still_open = sum(_closed(s, max(0.05, 3 - (time.monotonic() - t0))) is None for s in socks)
    for s in socks:
        s.close()
    assert still_open == 0
    assert httpx.get(url + "/health").status_code == 200


def test_trickled_body_gets_408_and_is_closed(server: tuple[int, str]) -> None:
    port, _ = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"messages"'
        )
        for _ in range(3):
            time.sleep(0.4)
            s.sendall(b" ")
        reply = _closed(s, 5)
    assert reply is not None, "still open"
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_sigterm_drains_with_503_while_running_requests_finish() -> None:
    proc, url = start("--drain-s", "60", "--max-tokens", "2048")
    streaming = threading.Event()

    def long_stream() -> tuple[int, list[str]]:
        body = {
            "messages": [{"role": "user", "content": "forever"}],
            "max_tokens": 2000,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                streaming.set()
                lines.append(line)
            return r.status_code, lines

    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(long_stream)
            assert streaming.wait(60)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            r = httpx.post(
                url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            )
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"]
            assert httpx.get(url + "/health").status_code == 503
            status, lines = running.result()
        assert status == 200
        assert [line for line in lines if line][-1] == "data: [DONE]"
        assert not any("event: error" in line for line in lines)
        assert proc.wait(30) is not None
    finally:
        proc.kill()
        proc.wait()
