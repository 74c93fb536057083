"""``POST /v1/chat/completions``: OpenAI's chat completions, answered whole or streamed (SSE).

A request is checked in order of cost before it takes a place in the model queue: counts of
messages and media, the prompt's least token count from its text's length, sampling parameters,
then tools and ``response_format`` (the grammar compiled on the thread pool). Holding a place, its
media is decoded and its prompt rendered and tokenized on the thread pool, then the model thread
plans, prefills and decodes it. A streamed answer goes to ``routes/stream.py`` from there.

Not here: the SSE stream (``routes/stream.py``), what both answers share (``routes/completion.py``),
the prompt cache (``prompt_cache.py``), the chat template (``chat.py``), the error table
(``errors.py``).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from agent.engine.generation import SamplingParams
from agent.engine.runtime import PromptTooLongError
from agent.engine.tools import ToolError
from agent.grammar import GrammarError
from agent.server import schemas as S
from agent.server.content import check_media, count_media
from agent.server.errors import ERRORS, ApiError
from agent.server.routes.completion import Completion, choice_logprobs, message_of, prepare, record, usage
from agent.server.routes.stream import stream_chat
from agent.server.state import ServerState, tenant_of
from agent.server.structured import OutputPlan, output_plan

PATH = "/v1/chat/completions"
Finish = Literal["stop", "length", "tool_calls"]


def router(state: ServerState) -> APIRouter:
    api = APIRouter(route_class=state.route_class)

    @api.post(PATH, response_model=S.ChatCompletion, responses=ERRORS)
    async def chat_completions(
        body: S.ChatCompletionRequest, request: Request, tenant: str = Depends(tenant_of)
    ) -> Any:
        arrival = time.perf_counter()
        check_request(state, body)
        params = sampling(state, body)
        plan = await plan_of(state, body)
        completion = Completion(
            body,
            params,
            plan,
            state.runtime.tenant_salt(tenant, body.cache_salt),
            f"chatcmpl-{uuid.uuid4().hex[:24]}",
            int(time.time()),
            state.runtime.config.name,
            arrival,
        )
        if body.stream:
            return await stream_chat(state, request, tenant, completion)
        return await state.admitted(tenant, lambda: answer(state, request, completion))

    return api


async def answer(state: ServerState, request: Request, c: Completion) -> S.ChatCompletion:
    """The whole answer (the caller holds the request's queue place)."""
    pieces = await prepare(state, c)
    cancel = threading.Event()
    started, outcome = await state.watched(request, c.job(state, pieces, cancel), cancel)
    report = record(state, outcome, c.arrival, started)
    message, called = message_of(c.plan, outcome.decoded.text)
    finish: Finish = (
        "tool_calls" if called else "length" if outcome.decoded.finish_reason == "length" else "stop"
    )
    choice = S.Choice(
        index=0,
        message=message,
        logprobs=choice_logprobs(state, c.params, outcome.decoded.logprobs),
        finish_reason=finish,
    )
    return S.ChatCompletion(
        id=c.id, created=c.created, model=c.model, choices=[choice], usage=usage(outcome), kamera=report
    )


# --- checks, before a queue place is taken -------------------------------------------------


def check_request(state: ServerState, body: S.ChatCompletionRequest) -> None:
    """Counts of messages and media, then the prompt's text length (no decoding, no tokenizing)."""
    limits = state.limits
    if len(body.messages) > limits.max_messages:
        raise ApiError(
            400,
            f"{len(body.messages)} messages exceed max_messages={limits.max_messages}",
            "too_many_messages",
            param="messages",
        )
    parts = [p for m in body.messages if isinstance(m.content, list) for p in m.content]
    check_media(state, count_media(parts), "messages")
    texts: list[str] = []
    for m in body.messages:
        if isinstance(m.content, str):
            texts.append(m.content)
        elif m.content:
            texts.extend(p.text for p in m.content if isinstance(p, S.TextPart))
    try:
        state.runtime.check_length(texts, limits.max_prompt_tokens)
    except PromptTooLongError as exc:
        raise ApiError(400, str(exc), "context_length_exceeded", param="messages") from None


def sampling(state: ServerState, body: S.ChatCompletionRequest) -> SamplingParams:
    limits = state.limits
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


async def plan_of(state: ServerState, body: S.ChatCompletionRequest) -> OutputPlan:
    """Tools, grammar and call parsing of a request; a 400 naming the field if they do not
    hold together or the grammar does not compile."""
    try:
        plan = output_plan(body)
    except ToolError as exc:
        raise ApiError(400, str(exc), "invalid_tools", param=exc.param) from None
    if plan.grammar is not None:
        try:
            await run_in_threadpool(state.runtime.grammar.check, plan.grammar)
        except GrammarError as exc:
            param = "response_format" if body.response_format is not None else "tools"
            raise ApiError(
                400, f"cannot decode under this schema: {exc}", "invalid_schema", param=param
            ) from None
    return plan
