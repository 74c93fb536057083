"""A throwaway ``redis-server`` on a loopback port, for the replica benchmark and tests.

``with RedisServer() as url:`` starts Debian's ``redis-server`` on a free port in a temporary
folder with persistence off (``--save '' --appendonly no``), waits until it answers PING, and
stops it on exit. ``kill`` and ``start`` stop and restart it on the same port (a Redis that
goes away mid-run). Not for production: no password, no memory bound unless given.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServerMissingError(RuntimeError):
    """There is no ``redis-server`` on PATH."""


class RedisServer:
    """One ``redis-server`` process; ``extra`` are more ``--option value`` arguments."""

    def __init__(self, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerMissingError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.extra = extra
        self._dir = tempfile.TemporaryDirectory(prefix="kamera-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir.name]
        args += ["--save", "", "--appendonly", "no", *self.extra]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._pings():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)
        return self.url

    def kill(self) -> None:
        """Stop it at once (SIGKILL): what it held is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def _pings(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
        self._dir.cleanup()
