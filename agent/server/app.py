"""The HTTP app: ``create_app(runtime)`` builds a FastAPI app around a runtime it is given.

Routes: ``POST /v1/chat/completions`` (OpenAI-compatible, SSE streaming), ``GET /v1/models``,
``POST/GET/DELETE /v1/sessions[/{id}]`` and ``POST /v1/sessions/{id}/steps`` (agent sessions),
``GET /health``, ``GET /metrics``. Every error is a JSON ``{"error": {...}}`` with a 4xx for
anything the client can fix; model work runs on the runtime's single model thread, media
decoding on the thread pool, the event loop only waits.

Not here: the model, the cache or the limits themselves (``runtime.py``, ``prompt_cache.py``,
``limits.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict, is_dataclass
from typing import Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.adapters.loading import WORLD_VL
from agent.context import RecallError
from agent.grammar import GrammarError
from agent.loop import FramesObservation, ImageObservation, Observation, StepResult, TextObservation
from agent.policies import MIN_ACTION_TOKENS
from agent.server import schemas as S
from agent.server.auth import OPEN_PATHS, AuthMiddleware
from agent.server.chat import Message as ChatMsg
from agent.server.chat import Piece, TemplateError, takes_tools
from agent.server.generation import SamplingParams, TokenLogprob
from agent.server.limits import BodyLimitMiddleware
from agent.server.media import BadMediaError, MediaLimitError, load_image_url, load_video_url
from agent.server.metrics import Metrics
from agent.server.prompt_cache import NoImagesError
from agent.server.runtime import ChatOutcome, PromptTooLongError, Runtime
from agent.server.scheduler import CancelledJobError, DrainingError, QueueFullError
from agent.server.sessions import Session, SessionLimitError, SessionNotFoundError
from agent.server.strict import describe, strict_route
from agent.server.structured import OutputPlan, call_out, logprob_content, output_plan
from agent.server.tools import CallStream, ToolCall, ToolError, split_calls

T = TypeVar("T")
Event = tuple[str, str, list[TokenLogprob]]  # a streaming job's (kind, text, logprobs of the text)
log = logging.getLogger("kamera.server")
PREPARE_ERRORS = (MediaLimitError, BadMediaError, PromptTooLongError, TemplateError)
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": S.ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}


class ApiError(Exception):
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
        self.status, self.message, self.code, self.kind, self.retry_after, self.param = (
            status,
            message,
            code,
            kind,
            retry_after,
            param,
        )
        self.param = param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}}
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(body, status_code=self.status, headers=headers)


def api_error(exc: BaseException) -> ApiError | None:
    """The client-facing error of an exception raised by a job, or None for a server fault."""
    table: list[tuple[type[BaseException], int, str, str]] = [
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
    for cls, status, code, kind in table:
        if isinstance(exc, cls):
            message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
            if isinstance(exc, SessionNotFoundError):
                message = f"no session {message!r} (never created, deleted, or expired)"
            retry = 1 if status in (429, 503) else 0
            return ApiError(status, message, code, kind, retry)
    return None


class AccessMiddleware:
    """Counts and logs every request (route template, status, duration) with a request id."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 500
        request_id = uuid.uuid4().hex[:16]

        async def send_wrapped(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapped)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, scope["method"], str(status)).inc()
            log.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": path,
                    "status": status,
                    "duration_ms": round(1000 * (time.perf_counter() - t0), 2),
                },
            )


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__.lower(), **asdict(value)}
    return value


def create_app(runtime: Runtime) -> FastAPI:
    limits = runtime.limits
    metrics = Metrics(runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            runtime.worker.admit()
            try:
                await runtime.worker.run(runtime.warmup, threading.Event())
            finally:
                runtime.worker.leave()
        except Exception:
            log.exception("warm-up failed; /health reports 503")
        sweeper = asyncio.create_task(_sweep())
        log.info("ready", extra={"model": runtime.config.name})
        try:
            yield
        finally:
            sweeper.cancel()
            finished = await asyncio.to_thread(runtime.drain, limits.drain_s)
            log.info("stopped", extra={"drained": finished})

    async def _sweep() -> None:
        while True:
            await asyncio.sleep(min(30.0, limits.session_idle_s / 2))
            runtime.sessions.sweep()

    app = FastAPI(title="Kamera", version="0.1.0", lifespan=lifespan)
    app.router.route_class = strict_route(runtime.config.lenient_fields)
    app.state.runtime = runtime
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    app.add_middleware(
        AuthMiddleware,
        tenants=runtime.tenants,
        open_paths=OPEN_PATHS | ({"/metrics"} if runtime.config.public_metrics else set()),
        on_reject=metrics.rejected.labels("unauthorized").inc,
    )
    app.add_middleware(AccessMiddleware, metrics=metrics)

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
        return ApiError(500, "internal error", "internal_error", "server_error").response()

    def tenant_of(request: Request) -> str:
        """The tenant AuthMiddleware found for the request's key."""
        tenant: str = request.state.tenant
        return tenant

    def refuse(exc: BaseException) -> ApiError:
        err = api_error(exc)
        if err is None:
            raise exc
        if err.status in (429, 503):
            metrics.rejected.labels(err.code).inc()
        return err

    async def admitted(tenant: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` holding a place in the model queue (429 when there is none for the tenant)."""
        if runtime.draining:
            raise refuse(DrainingError("the server is shutting down"))
        try:
            runtime.worker.admit(tenant)
        except (QueueFullError, DrainingError) as exc:
            raise refuse(exc) from None
        try:
            return await work()
        finally:
            runtime.worker.leave(tenant)

    async def watched(request: Request, fn: Callable[[], T], cancel: threading.Event) -> T:
        """Run ``fn`` on the model thread; a client that disconnects sets ``cancel``."""
        task = asyncio.ensure_future(runtime.worker.run(fn, cancel, request.state.tenant))
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and not cancel.is_set() and await request.is_disconnected():
                cancel.set()
                metrics.cancelled.inc()
        try:
            return task.result()
        except Exception as exc:
            raise refuse(exc) from None

    # --- chat completions -------------------------------------------------------------------

    def no_images_message() -> str:
        return (
            f"model {runtime.config.name} takes no image or video input; to send images, serve a "
            f"Qwen2.5-VL model: kamera serve --model {WORLD_VL} (the embedded one) or --model "
            "<a Qwen2.5-VL checkpoint folder>"
        )

    def check_media(body: S.ChatCompletionRequest) -> None:
        if len(body.messages) > limits.max_messages:
            raise ApiError(
                400,
                f"{len(body.messages)} messages exceed max_messages={limits.max_messages}",
                "too_many_messages",
                param="messages",
            )
        parts = [p for m in body.messages if isinstance(m.content, list) for p in m.content]
        images = sum(isinstance(p, S.ImagePart) for p in parts)
        videos = sum(isinstance(p, S.VideoPart) for p in parts)
        if images > limits.max_images:
            raise ApiError(
                413,
                f"{images} images exceed max_images={limits.max_images}",
                "too_many_images",
                param="messages",
            )
        if videos > limits.max_videos:
            raise ApiError(
                413,
                f"{videos} videos exceed max_videos={limits.max_videos}",
                "too_many_videos",
                param="messages",
            )
        if (images or videos) and not runtime.takes_images:
            raise ApiError(400, no_images_message(), "images_unsupported", param="messages")

    def to_messages(body: S.ChatCompletionRequest) -> list[ChatMsg]:
        """Decode media (on the thread pool): the request's messages with images in place."""
        out, frames_left = [], limits.max_frames
        native_tools = takes_tools(runtime.adapter.tokenizer)
        for m in body.messages:
            role = "system" if m.role == "developer" else m.role
            if m.role == "tool" and not native_tools:
                text = (
                    m.content
                    if isinstance(m.content, str)
                    else "".join(p.text for p in m.content or () if isinstance(p, S.TextPart))
                )
                out.append(ChatMsg("user", (f"<tool_response>\n{text}\n</tool_response>",)))
                continue
            if m.tool_calls:
                calls = [ToolCall(c.id, c.function.name, c.function.arguments).text() for c in m.tool_calls]
                text = m.content if isinstance(m.content, str) else ""
                out.append(ChatMsg(role, tuple(p for p in (text, *calls) if p)))
                continue
            if m.content is None or isinstance(m.content, str):
                out.append(ChatMsg(role, (m.content or "",)))
                continue
            parts: list[Any] = []
            for p in m.content:
                if isinstance(p, S.TextPart):
                    parts.append(p.text)
                elif isinstance(p, S.ImagePart):
                    parts.append(load_image_url(p.image_url.url, runtime.config.media, limits))
                else:
                    frames = load_video_url(p.video_url.url, runtime.config.media, limits, frames_left)
                    frames_left -= len(frames)
                    parts.extend(frames)
            out.append(ChatMsg(role, tuple(parts)))
        return out

    def prompt_pieces(body: S.ChatCompletionRequest, plan: OutputPlan) -> list[Piece]:
        """Media decoded and text tokenized (on the thread pool, not the model thread), the
        plan's tool definitions rendered into the prompt."""
        return runtime.render(to_messages(body), plan.definitions)

    def check_length(body: S.ChatCompletionRequest) -> None:
        """Refuse a prompt whose text is certainly too long, before it takes a queue place."""
        texts: list[str] = []
        for m in body.messages:
            if isinstance(m.content, str):
                texts.append(m.content)
            elif m.content:
                texts.extend(p.text for p in m.content if isinstance(p, S.TextPart))
        try:
            runtime.check_length(texts, limits.max_prompt_tokens)
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), "context_length_exceeded", param="messages") from None

    def sampling(body: S.ChatCompletionRequest) -> SamplingParams:
        max_tokens = body.max_completion_tokens or body.max_tokens or limits.default_max_tokens
        if max_tokens > limits.max_tokens:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} exceeds the server's {limits.max_tokens}",
                "max_tokens",
                param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise ApiError(400, "stop takes at most 4 non-empty strings", "bad_stop", param="stop")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "invalid_request", param="top_logprobs")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed or 0,
            stop=tuple(stop),
            logprobs=bool(body.logprobs),
            top_logprobs=body.top_logprobs or 0,
        )

    async def plan_of(body: S.ChatCompletionRequest) -> OutputPlan:
        """Tools, grammar and call parsing of a request; a 400 naming the field if they do not
        hold together or the grammar does not compile."""
        try:
            plan = output_plan(body)
        except ToolError as exc:
            raise ApiError(400, str(exc), "invalid_tools", param=exc.param) from None
        if plan.grammar is not None:
            try:
                await run_in_threadpool(runtime.grammar.check, plan.grammar)
            except GrammarError as exc:
                param = "response_format" if body.response_format is not None else "tools"
                raise ApiError(
                    400, f"cannot decode under this schema: {exc}", "invalid_schema", param=param
                ) from None
        return plan

    def choice_logprobs(params: SamplingParams, lps: list[TokenLogprob]) -> S.ChoiceLogprobs | None:
        if not params.logprobs:
            return None
        return S.ChoiceLogprobs(content=logprob_content(runtime.adapter.tokenizer, lps))

    def message_of(plan: OutputPlan, text: str) -> tuple[S.AssistantMessage, bool]:
        """The assistant message of generated ``text``, and whether it holds tool calls."""
        if not plan.parse_calls:
            return S.AssistantMessage(content=text), False
        content, calls = split_calls(text, plan.tool_names)
        if not calls:
            return S.AssistantMessage(content=text), False
        return S.AssistantMessage(content=content or None, tool_calls=[call_out(c) for c in calls]), True

    def record_chat(outcome: ChatOutcome, arrival: float, started: float) -> S.CacheReport:
        u = outcome.usage
        metrics.prompt_tokens.inc(u.prompt_tokens)
        metrics.completion_tokens.inc(len(outcome.decoded.tokens))
        metrics.reused_tokens.labels("prefix").inc(u.prefix_tokens)
        metrics.reused_tokens.labels("content").inc(u.relocated_tokens)
        metrics.reuse.labels(u.mode, "exact").inc(u.prefix_tokens)
        metrics.reuse.labels(u.mode, "repaired").inc(u.repaired_tokens)
        metrics.reuse.labels(u.mode, "reused").inc(u.relocated_tokens - u.repaired_tokens)
        metrics.reuse.labels(u.mode, "recomputed").inc(u.prefilled_tokens)
        metrics.prefilled_tokens.inc(u.prefilled_tokens)
        metrics.rotated_tokens.labels("chat").inc(u.rotated_tokens)
        metrics.lost_entries.inc(u.lost_entries)
        metrics.tier_tokens.labels("redis").inc(u.shared_tokens)
        metrics.queue_wait.observe(started - arrival)
        metrics.ttft.labels("chat").observe(started - arrival + outcome.ttft_s)
        return S.CacheReport(
            reuse_mode=u.mode,
            prefix_tokens=u.prefix_tokens,
            relocated_tokens=u.relocated_tokens,
            repaired_tokens=u.repaired_tokens,
            prefilled_tokens=u.prefilled_tokens,
            rotated_tokens=u.rotated_tokens,
            lost_entries=u.lost_entries,
            vision_encoder_calls=u.vision_encoder_calls,
            shared_tokens=u.shared_tokens,
            queue_ms=round(1000 * (started - arrival), 3),
            ttft_ms=round(1000 * outcome.ttft_s, 3),
            total_ms=round(1000 * outcome.total_s, 3),
        )

    def usage(outcome: ChatOutcome) -> S.Usage:
        u, n = outcome.usage, len(outcome.decoded.tokens)
        return S.Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=n,
            total_tokens=u.prompt_tokens + n,
            prompt_tokens_details=S.PromptTokensDetails(cached_tokens=u.cached_tokens),
        )

    @app.post("/v1/chat/completions", response_model=S.ChatCompletion, responses=ERRORS)
    async def chat_completions(
        body: S.ChatCompletionRequest, request: Request, tenant: str = Depends(tenant_of)
    ) -> Any:
        arrival = time.perf_counter()
        check_media(body)
        check_length(body)
        params = sampling(body)
        plan = await plan_of(body)
        salt = runtime.tenant_salt(tenant, body.cache_salt)
        cid, created, name = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), runtime.config.name
        if body.stream:
            return await stream_chat(request, body, params, plan, salt, cid, created, name, arrival)

        async def work() -> S.ChatCompletion:
            try:
                pieces = await run_in_threadpool(prompt_pieces, body, plan)
            except PREPARE_ERRORS as exc:
                raise refuse(exc) from None
            cancel = threading.Event()

            def job() -> tuple[float, ChatOutcome]:
                started = time.perf_counter()
                return started, runtime.chat(
                    pieces, params, salt, cancel, mode=body.kamera_reuse, grammar=plan.grammar
                )

            started, outcome = await watched(request, job, cancel)
            report = record_chat(outcome, arrival, started)
            message, called = message_of(plan, outcome.decoded.text)
            finish: Literal["stop", "length", "tool_calls"] = (
                "tool_calls" if called else "length" if outcome.decoded.finish_reason == "length" else "stop"
            )
            return S.ChatCompletion(
                id=cid,
                created=created,
                model=name,
                choices=[
                    S.Choice(
                        index=0,
                        message=message,
                        logprobs=choice_logprobs(params, outcome.decoded.logprobs),
                        finish_reason=finish,
                    )
                ],
                usage=usage(outcome),
                kamera=report,
            )

        return await admitted(tenant, work)

    async def stream_chat(
        request: Request,
        body: S.ChatCompletionRequest,
        params: SamplingParams,
        plan: OutputPlan,
        salt: str,
        cid: str,
        created: int,
        name: str,
        arrival: float,
    ) -> Response:
        tenant: str = request.state.tenant
        if runtime.draining:
            raise refuse(DrainingError("the server is shutting down"))
        try:
            runtime.worker.admit(tenant)
        except (QueueFullError, DrainingError) as exc:
            raise refuse(exc) from None
        handed = False
        try:
            try:
                pieces = await run_in_threadpool(prompt_pieces, body, plan)
            except PREPARE_ERRORS as exc:
                raise refuse(exc) from None
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[Event] = asyncio.Queue()
            cancel = threading.Event()

            def emit(kind: str, text: str = "", lps: list[TokenLogprob] | None = None) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (kind, text, lps or []))

            def job() -> tuple[float, ChatOutcome]:
                started = time.perf_counter()
                return started, runtime.chat(
                    pieces,
                    params,
                    salt,
                    cancel,
                    on_start=lambda: emit("start"),
                    on_text=lambda t, lps: emit("text", t, lps),
                    mode=body.kamera_reuse,
                    grammar=plan.grammar,
                )

            task = asyncio.ensure_future(runtime.worker.run(job, cancel, tenant))
            task.add_done_callback(lambda _: runtime.worker.leave(tenant))
            task.add_done_callback(lambda _: events.put_nowait(("done", "", [])))
            handed = True
            kind, _, _ = await _next_event(request, events, cancel)
            if kind == "done":  # failed before the first token: a plain error response
                try:
                    task.result()
                except Exception as exc:
                    raise refuse(exc) from None
        finally:
            if not handed:
                runtime.worker.leave(tenant)

        def chunk(
            delta: dict[str, Any], finish: str | None = None, lps: list[TokenLogprob] | None = None
        ) -> str:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if params.logprobs:
                content = logprob_content(runtime.adapter.tokenizer, lps or [])
                choice["logprobs"] = {"content": [c.model_dump() for c in content]} if content else None
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": [choice],
            }
            return f"data: {json.dumps(data)}\n\n"

        calls = CallStream(plan.tool_names) if plan.parse_calls else None
        pending: list[TokenLogprob] = []  # logprobs of text the call parser still holds

        def deltas(items: Any) -> list[str]:
            """SSE chunks of parsed output: content, or a tool call as OpenAI streams one (its id,
            name and empty arguments, then the arguments)."""
            out = []
            for item in items:
                lps = pending[:]
                pending.clear()
                if isinstance(item, str):
                    out.append(chunk({"content": item}, lps=lps))
                    continue
                index = len(calls.calls) - 1 if calls is not None else 0
                head = {"index": index, "id": item.id, "type": "function"}
                fn = {"name": item.name, "arguments": ""}
                out.append(chunk({"tool_calls": [{**head, "function": fn}]}, lps=lps))
                out.append(
                    chunk({"tool_calls": [{"index": index, "function": {"arguments": item.arguments}}]})
                )
            return out

        async def sse() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    kind, text, lps = await _next_event(request, events, cancel)
                    if kind == "text":
                        if calls is None:
                            if text or lps:
                                yield chunk({"content": text}, lps=lps)
                            continue
                        pending.extend(lps)
                        for line in deltas(calls.push(text)):
                            yield line
                        continue
                    if kind != "done":
                        continue
                    try:
                        started, outcome = task.result()
                    except Exception as exc:
                        err = api_error(exc) or ApiError(
                            500, "internal error", "internal_error", "server_error"
                        )
                        if err.status >= 500:
                            log.exception("stream failed", exc_info=exc)
                        payload = {"error": {"message": err.message, "type": err.kind, "code": err.code}}
                        yield f"event: error\ndata: {json.dumps(payload)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    record_chat(outcome, arrival, started)
                    if calls is not None:
                        for line in deltas(calls.close()):
                            yield line
                        if pending:
                            yield chunk({}, lps=pending)
                    finish = "length" if outcome.decoded.finish_reason == "length" else "stop"
                    if calls is not None and calls.calls:
                        finish = "tool_calls"
                    yield chunk({}, finish)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        data = {
                            "id": cid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": name,
                            "choices": [],
                            "usage": usage(outcome).model_dump(),
                        }
                        yield f"data: {json.dumps(data)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            finally:  # the client went away (or the response was cut): stop the job
                if not task.done() and not cancel.is_set():
                    cancel.set()
                    metrics.cancelled.inc()

        return StreamingResponse(
            sse(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _next_event(request: Request, events: asyncio.Queue[Event], cancel: threading.Event) -> Event:
        """The next event of a streaming job; checks the client between events."""
        while True:
            with suppress(TimeoutError):
                event = await asyncio.wait_for(events.get(), timeout=0.25)
                if event[0] == "text" and not cancel.is_set() and await request.is_disconnected():
                    cancel.set()
                    metrics.cancelled.inc()
                return event
            if not cancel.is_set() and await request.is_disconnected():
                cancel.set()
                metrics.cancelled.inc()

    @app.get("/v1/models", response_model=S.ModelList, responses=ERRORS)
    async def models(tenant: str = Depends(tenant_of)) -> S.ModelList:
        return S.ModelList(data=[S.ModelCard(id=runtime.config.name, created=int(runtime.started))])

    # --- agent sessions ---------------------------------------------------------------------

    def window(session: Session) -> S.WindowOut:
        with session.lock:
            cm = session.agent.context
            return S.WindowOut(
                id=session.id,
                created=session.created,
                steps=session.steps,
                budget_tokens=session.budget_tokens,
                tokens=cm.tokens,
                chunks=[
                    S.ChunkOut(
                        chunk_id=v.chunk_id,
                        kind=v.kind,
                        n_tokens=v.n_tokens,
                        extent=v.extent,
                        start=v.start,
                        source=str(v.source),
                        meta=v.meta,
                    )
                    for v in cm.view()
                ],
                evicted=list(cm.evicted),
                counters={k: float(v) for k, v in asdict(cm.counters).items()},
            )

    @app.post("/v1/sessions", response_model=S.WindowOut, status_code=201, responses=ERRORS)
    async def create_session(
        body: S.SessionCreate, request: Request, tenant: str = Depends(tenant_of)
    ) -> Any:
        if body.budget_tokens > limits.max_session_tokens:
            raise ApiError(
                400,
                f"budget_tokens exceeds max_session_tokens={limits.max_session_tokens}",
                "budget_too_large",
                param="budget_tokens",
            )
        if body.max_tokens > limits.max_tokens:
            raise ApiError(
                400, f"max_tokens exceeds the server's {limits.max_tokens}", "max_tokens", param="max_tokens"
            )
        if body.policy == "action" and body.max_tokens < MIN_ACTION_TOKENS:
            raise ApiError(
                400,
                f"an action session needs max_tokens >= {MIN_ACTION_TOKENS} (its replies are decoded "
                "under the action grammar)",
                "max_tokens",
                param="max_tokens",
            )
        try:
            runtime.sessions.reserve(tenant)
        except SessionLimitError as exc:
            raise refuse(exc) from None
        salt = runtime.tenant_salt(tenant, body.cache_salt)
        try:

            def job() -> Any:
                return runtime.new_agent(
                    body.system_prompt, body.budget_tokens, body.policy, body.max_tokens, salt
                )

            agent = await admitted(tenant, lambda: watched(request, job, threading.Event()))
        except BaseException:
            runtime.sessions.release(tenant)
            raise
        session = runtime.sessions.add(tenant, agent, body.budget_tokens)
        return await run_in_threadpool(window, session)

    def observations(body: S.StepRequest) -> list[Observation]:
        out: list[Observation] = []
        for o in body.observations:
            if isinstance(o, S.TextObs):
                out.append(TextObservation(o.text))
            elif isinstance(o, S.ImageObs):
                out.append(
                    ImageObservation(load_image_url(o.image_url, runtime.config.media, limits), o.label)
                )
            else:
                frames = [load_image_url(u, runtime.config.media, limits) for u in o.frames]
                stamps = o.timestamps if o.timestamps is not None else [float(i) for i in range(len(frames))]
                out.append(FramesObservation(frames, stamps))
        return out

    def check_step(body: S.StepRequest) -> None:
        if len(body.observations) > limits.max_observations:
            raise ApiError(
                413,
                f"{len(body.observations)} observations exceed {limits.max_observations}",
                "too_many_observations",
                param="observations",
            )
        images = sum(isinstance(o, S.ImageObs) for o in body.observations)
        frames = sum(len(o.frames) for o in body.observations if isinstance(o, S.FramesObs))
        if images > limits.max_images:
            raise ApiError(
                413,
                f"{images} images exceed max_images={limits.max_images}",
                "too_many_images",
                param="observations",
            )
        if frames > limits.max_frames:
            raise ApiError(
                413,
                f"{frames} frames exceed max_frames={limits.max_frames}",
                "too_many_frames",
                param="observations",
            )
        if (images or frames) and not runtime.takes_images:
            raise ApiError(400, no_images_message(), "images_unsupported", param="observations")
        for i, o in enumerate(body.observations):
            if isinstance(o, S.FramesObs) and o.timestamps is not None and len(o.timestamps) != len(o.frames):
                raise ApiError(
                    400,
                    "frames and timestamps differ in length",
                    "bad_frames",
                    param=f"observations[{i}].timestamps",
                )
        if body.max_tokens is not None and body.max_tokens > limits.max_tokens:
            raise ApiError(
                400, f"max_tokens exceeds the server's {limits.max_tokens}", "max_tokens", param="max_tokens"
            )

    def check_step_length(body: S.StepRequest, budget: int) -> None:
        """Refuse text no window of ``budget`` tokens can hold, from its length (before tokenizing)."""
        texts = [
            (f"observations[{i}].text", o.text)
            for i, o in enumerate(body.observations)
            if isinstance(o, S.TextObs)
        ]
        for param, text in [*texts, ("instruction", body.instruction)]:
            try:
                runtime.check_length([text], budget, param)
            except PromptTooLongError as exc:
                raise ApiError(
                    400, f"{exc} (the session's budget_tokens)", "context_length_exceeded", param=param
                ) from None

    def step_response(result: StepResult, queue_ms: float) -> S.StepResponse:
        report = asdict(result.report)
        report["evicted"] = list(report["evicted"])
        r = result.report
        metrics.session_steps.inc()
        metrics.session_tokens.labels("reused").inc(r.tokens_reused)
        metrics.session_tokens.labels("prefilled").inc(r.tokens_prefilled)
        metrics.rotated_tokens.labels("session").inc(r.tokens_rotated)
        metrics.ttft.labels("session").observe((queue_ms + r.ttft_ms) / 1000)
        return S.StepResponse(
            output=result.output,
            parsed=_jsonable(result.parsed),
            chunk_ids=list(result.chunk_ids),
            report=S.StepReportOut(**report),
            queue_ms=round(queue_ms, 3),
        )

    @app.post("/v1/sessions/{session_id}/steps", response_model=S.StepResponse, responses=ERRORS)
    async def step(
        session_id: str, body: S.StepRequest, request: Request, tenant: str = Depends(tenant_of)
    ) -> Any:
        arrival = time.perf_counter()
        check_step(body)
        try:
            session = runtime.sessions.acquire(session_id, tenant)
        except SessionNotFoundError as exc:
            raise refuse(exc) from None
        try:
            check_step_length(body, session.budget_tokens)
            ops: list[tuple[str, Any]] = []
            for op in body.operations:
                if isinstance(op, S.SlideOp):
                    ops.append(("slide", op.n))
                elif isinstance(op, S.ReorderOp):
                    ops.append(("reorder", op.order))
                else:
                    ops.append(("recall", (op.chunk_id, op.at)))

            async def work() -> S.StepResponse:
                try:
                    obs = await run_in_threadpool(observations, body)
                except (MediaLimitError, BadMediaError) as exc:
                    raise refuse(exc) from None

                def job() -> tuple[float, StepResult]:
                    started = time.perf_counter()
                    return started, runtime.step(session, ops, obs, body.instruction, body.max_tokens)

                started, result = await watched(request, job, threading.Event())
                return step_response(result, 1000 * (started - arrival))

            return await admitted(tenant, work)
        finally:
            runtime.sessions.done(session)

    @app.get("/v1/sessions/{session_id}", response_model=S.WindowOut, responses=ERRORS)
    async def get_session(session_id: str, tenant: str = Depends(tenant_of)) -> Any:
        try:
            session = runtime.sessions.acquire(session_id, tenant)
        except SessionNotFoundError as exc:
            raise refuse(exc) from None
        try:
            return await run_in_threadpool(window, session)
        finally:
            runtime.sessions.done(session)

    @app.delete("/v1/sessions/{session_id}", status_code=204, responses=ERRORS)
    async def delete_session(session_id: str, tenant: str = Depends(tenant_of)) -> Response:
        try:
            runtime.sessions.delete(session_id, tenant)
        except SessionNotFoundError as exc:
            raise refuse(exc) from None
        return Response(status_code=204)

    # --- operations ---------------------------------------------------------------------------

    @app.get("/health", responses={503: {"model": S.ErrorResponse}})
    async def health() -> JSONResponse:
        ok, reason = runtime.health()
        body = {
            "status": "ok" if ok else "unavailable",
            "reason": reason,
            "model": runtime.config.name,
            "sessions": len(runtime.sessions),
            "queue": runtime.worker.pending,
        }
        shared = runtime.store.shared_health()
        if shared is not None:  # a Redis that is away costs hits, not health: never a 503 for it
            body["redis"] = shared._asdict()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
