"""Structured logs: one JSON object per line, with whatever ``extra`` fields a call passes.

``configure_logging`` is called by ``kamera serve``, never on import.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(
            {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("color_")}
        )
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to the process's standard error as it is when the record is emitted,
    not as it was when logging was configured (a stream replaced since, and maybe closed, is never
    written to)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def configure_logging(level: str = "info") -> None:
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter())
    for name in ("kamera", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # the app logs every request itself
