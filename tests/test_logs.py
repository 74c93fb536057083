"""``kamera serve``'s logs: JSON lines on whatever standard error is when a record is written."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from agent.server.logs import configure_logging


@pytest.fixture
def restored() -> object:
    names = ("kamera", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = {
        n: (
            logging.getLogger(n).handlers[:],
            logging.getLogger(n).level,
            logging.getLogger(n).propagate,
            logging.getLogger(n).disabled,
        )
        for n in names
    }
    yield
    for n, (handlers, level, propagate, disabled) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers, logger.level, logger.propagate, logger.disabled = (
            handlers,
            level,
            propagate,
            disabled,
        )


def test_records_go_to_the_standard_error_of_the_moment(
    restored: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info")
    first.close()  # the stream logging was configured under is gone (a test's captured output, say)
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("kamera.test").info("request", extra={"route": "/v1/x", "status": 200})
    line = json.loads(later.getvalue())
    assert line["msg"] == "request"
    assert line["route"] == "/v1/x"
    assert line["status"] == 200
    assert line["level"] == "info"
