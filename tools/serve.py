"""A ``kamera serve`` process on a free loopback port, for demos, benchmarks and scripts that
talk to the server as a client does.

:class:`ServeProcess` starts ``kamera serve`` of this checkout (``python -m agent.cli serve``,
so it runs without the package installed), waits until ``GET /health`` answers and stops the
process on exit (SIGTERM, so it drains, then SIGKILL after ``stop_s``). Its standard error goes
to a log file, named in the error when the process dies at start. :func:`free_port` and
:func:`wait_healthy` are the same steps for any other server process (llama.cpp's, in the
benchmarks).

Not here: an in-process server for tests (``agent/server/background.py``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    proc: subprocess.Popen[bytes], port: int, name: str, log: Path, timeout_s: float = 600
) -> None:
    """Return once ``GET /health`` on ``port`` answers; RuntimeError if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} at start; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{name} was not healthy after {timeout_s:.0f} s; see {log}")


class ServeProcess:
    """``kamera serve <args>`` on a free port; ``url`` once healthy. A context manager."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        timeout_s: float = 600,
        stop_s: float = 30,
    ) -> None:
        self.port = free_port()
        self.stop_s = stop_s
        self.log = log or Path(tempfile.mkstemp(prefix="kamera-serve-", suffix=".log")[1])
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "agent.cli", "serve", "--port", str(self.port), *args]
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p)
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=full_env)
        try:
            wait_healthy(self.proc, self.port, "kamera serve", self.log, timeout_s)
        except BaseException:
            self.close()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
