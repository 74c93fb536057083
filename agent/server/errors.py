"""Exceptions to HTTP answers, in one place: every error the app returns is an :class:`ApiError`.

``api_error(exc)`` maps what a job or a check raises (a full queue, a prompt too long, bad media,
...) to its status, OpenAI error ``code`` and ``type``; ``install(app)`` registers the handlers
that turn an ``ApiError``, a validation failure, an HTTP exception or a crash into the JSON
``{"error": {"message", "type", "code", "param"}}`` body (with ``Retry-After`` on 429 and 503,
``WWW-Authenticate`` on 401). ``ERRORS`` documents those answers in the OpenAPI schema.

Not here: the 401 of a missing key and the 408/413 of a body (``auth.py`` and ``limits.py``
answer those before the app runs, in the same body shape).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent.context import RecallError
from agent.engine.chat import TemplateError
from agent.engine.media import BadMediaError, MediaLimitError
from agent.engine.prompt_cache import NoImagesError
from agent.engine.runtime import PromptTooLongError
from agent.engine.scheduler import CancelledJobError, DrainingError, QueueFullError
from agent.engine.sessions import SessionLimitError, SessionNotFoundError
from agent.grammar import GrammarError
from agent.server import schemas as S
from agent.server.strict import describe

log = logging.getLogger("kamera.server")

# What preparing a prompt (decoding media, rendering, tokenizing) may raise for the client to fix.
PREPARE_ERRORS = (MediaLimitError, BadMediaError, PromptTooLongError, TemplateError)
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": S.ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}


class ApiError(Exception):
    """A client-facing error: status, message, OpenAI ``code`` and ``type``, the field it names."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        kind: str = "invalid_request_error",
        retry_after: int = 0,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind
        self.retry_after, self.param = retry_after, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}}
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(body, status_code=self.status, headers=headers)

    def sse(self) -> str:
        """The error as a server-sent event, for a stream that already started."""
        payload = {"error": {"message": self.message, "type": self.kind, "code": self.code}}
        return f"event: error\ndata: {json.dumps(payload)}\n\n"


INTERNAL = ("internal error", "internal_error", "server_error")

# (exception class, status, code, type), first match wins: subclasses before their bases.
_TABLE: list[tuple[type[BaseException], int, str, str]] = [
    (QueueFullError, 429, "queue_full", "rate_limit_error"),
    (SessionLimitError, 429, "session_limit", "rate_limit_error"),
    (DrainingError, 503, "shutting_down", "server_error"),
    (CancelledJobError, 499, "client_closed", "invalid_request_error"),
    (SessionNotFoundError, 404, "session_not_found", "not_found_error"),
    (RecallError, 400, "bad_recall", "invalid_request_error"),
    (PromptTooLongError, 400, "context_length_exceeded", "invalid_request_error"),
    (MediaLimitError, 413, "media_too_large", "invalid_request_error"),
    (BadMediaError, 400, "bad_media", "invalid_request_error"),
    (NoImagesError, 400, "images_unsupported", "invalid_request_error"),
    (TemplateError, 400, "bad_messages", "invalid_request_error"),
    (GrammarError, 400, "invalid_grammar", "invalid_request_error"),
    (ValueError, 400, "invalid_request", "invalid_request_error"),
]


def api_error(exc: BaseException) -> ApiError | None:
    """The client-facing error of an exception raised by a job, or None for a server fault."""
    for cls, status, code, kind in _TABLE:
        if isinstance(exc, cls):
            message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
            if isinstance(exc, SessionNotFoundError):
                message = f"no session {message!r} (never created, deleted, or expired)"
            retry = 1 if status in (429, 503) else 0
            return ApiError(status, message, code, kind, retry)
    return None


def install(app: FastAPI) -> None:
    """Register the handlers that give every error of ``app`` the OpenAI body."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problem = describe(exc.errors())
        return ApiError(400, problem.message, "invalid_request", param=problem.param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), "http_error").response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path})
        return ApiError(500, *INTERNAL).response()
