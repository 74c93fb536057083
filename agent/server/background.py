"""Serve an app with uvicorn on a background thread: for tests, demos and notebooks.

``with BackgroundServer(app) as url:`` binds a free loopback port (or the one given), waits
until uvicorn has started (lifespan included), yields the base URL, and on exit asks uvicorn to
stop and joins the thread, so the app's shutdown (draining) runs before the block ends.

Not here: signal handling (``kamera serve`` runs uvicorn in the foreground for that).
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from starlette.types import ASGIApp


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class BackgroundServer:
    def __init__(
        self, app: ASGIApp, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 60
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_config=None, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kamera-uvicorn", daemon=True)
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout_s)
