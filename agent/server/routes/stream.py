"""A streamed chat completion: server-sent events as OpenAI sends them.

The job runs on the model thread and hands its text to the event loop through a queue; the first
event decides the answer's form: a job that fails before its first token answers a plain 4xx
(or 5xx), one that started streams ``chat.completion.chunk`` events (the role, then content
deltas, or tool-call deltas as OpenAI streams them: the call's id and name with empty arguments,
then the arguments), a final chunk with the finish reason, the usage chunk when
``stream_options.include_usage`` asks for it, and ``data: [DONE]``. An error after the first
token is an ``event: error`` before ``[DONE]``. A client that goes away cancels the job.

Not here: the checks before the queue (``routes/chat.py``), the job and answer shapes
(``routes/completion.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import suppress
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from agent.engine.generation import TokenLogprob
from agent.engine.runtime import ChatOutcome
from agent.engine.tools import CallStream, ToolCall
from agent.server import schemas as S
from agent.server.errors import INTERNAL, ApiError, api_error
from agent.server.routes.completion import Completion, prepare, record, usage
from agent.server.state import ServerState
from agent.server.structured import logprob_content

Event = tuple[str, str, list[TokenLogprob]]  # a streaming job's (kind, text, logprobs of the text)
log = logging.getLogger("kamera.server")
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def stream_chat(state: ServerState, request: Request, tenant: str, c: Completion) -> Response:
    """Admit the request, start its job, and answer a stream once it produced its first event."""
    state.admit(tenant)
    handed = False
    try:
        pieces = await prepare(state, c)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        cancel = threading.Event()

        def emit(kind: str, text: str = "", lps: list[TokenLogprob] | None = None) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, text, lps or []))

        job = c.job(
            state, pieces, cancel, on_start=lambda: emit("start"), on_text=lambda t, lps: emit("text", t, lps)
        )
        task = asyncio.ensure_future(state.runtime.worker.run(job, cancel, tenant))
        task.add_done_callback(lambda _: state.runtime.worker.leave(tenant))
        task.add_done_callback(lambda _: events.put_nowait(("done", "", [])))
        handed = True
        kind, _, _ = await next_event(state, request, events, cancel)
        if kind == "done":  # failed before the first token: a plain error response
            try:
                task.result()
            except Exception as exc:
                raise state.refuse(exc) from None
    finally:
        if not handed:
            state.runtime.worker.leave(tenant)
    sse = Writer(state, c)
    return StreamingResponse(
        sse.events(request, events, task, cancel), media_type="text/event-stream", headers=HEADERS
    )


async def next_event(
    state: ServerState, request: Request, events: asyncio.Queue[Event], cancel: threading.Event
) -> Event:
    """The next event of a streaming job; checks the client between events."""
    while True:
        with suppress(TimeoutError):
            event = await asyncio.wait_for(events.get(), timeout=0.25)
            if event[0] == "text" and not cancel.is_set() and await request.is_disconnected():
                state.cancelled(cancel)
            return event
        if not cancel.is_set() and await request.is_disconnected():
            state.cancelled(cancel)


class Writer:
    """The SSE lines of one streamed completion."""

    def __init__(self, state: ServerState, c: Completion) -> None:
        self.state, self.c = state, c
        self.calls = CallStream(c.plan.tool_names) if c.plan.parse_calls else None
        self.pending: list[TokenLogprob] = []  # logprobs of text the call parser still holds

    def data(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        c = self.c
        body = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model}
        return f"data: {json.dumps({**body, 'choices': choices, **extra})}\n\n"

    def chunk(
        self, delta: dict[str, Any], finish: str | None = None, lps: list[TokenLogprob] | None = None
    ) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if self.c.params.logprobs:
            content = logprob_content(self.state.runtime.adapter.tokenizer, lps or [])
            choice["logprobs"] = {"content": [x.model_dump() for x in content]} if content else None
        return self.data([choice])

    def deltas(self, items: Iterable[str | ToolCall]) -> list[str]:
        """SSE chunks of parsed output: content, or a tool call as OpenAI streams one (its id,
        name and empty arguments, then the arguments)."""
        out = []
        for item in items:
            lps = self.pending[:]
            self.pending.clear()
            if isinstance(item, str):
                out.append(self.chunk({"content": item}, lps=lps))
                continue
            index = len(self.calls.calls) - 1 if self.calls is not None else 0
            head = {"index": index, "id": item.id, "type": "function"}
            fn = {"name": item.name, "arguments": ""}
            out.append(self.chunk({"tool_calls": [{**head, "function": fn}]}, lps=lps))
            out.append(
                self.chunk({"tool_calls": [{"index": index, "function": {"arguments": item.arguments}}]})
            )
        return out

    def text(self, text: str, lps: list[TokenLogprob]) -> list[str]:
        if self.calls is None:
            return [self.chunk({"content": text}, lps=lps)] if text or lps else []
        self.pending.extend(lps)
        return self.deltas(self.calls.push(text))

    def end(self, outcome: ChatOutcome, report: S.CacheReport) -> list[str]:
        """The lines after the last token: what the call parser held, the finish, usage (with the
        ``kamera`` report beside it, as a whole answer has it), [DONE]."""
        out = []
        if self.calls is not None:
            out += self.deltas(self.calls.close())
            if self.pending:
                out.append(self.chunk({}, lps=self.pending))
        finish = "length" if outcome.decoded.finish_reason == "length" else "stop"
        if self.calls is not None and self.calls.calls:
            finish = "tool_calls"
        out.append(self.chunk({}, finish))
        options = self.c.body.stream_options
        if options is not None and options.include_usage:
            out.append(self.data([], usage=usage(outcome).model_dump(), kamera=report.model_dump()))
        return [*out, "data: [DONE]\n\n"]

    async def events(
        self,
        request: Request,
        events: asyncio.Queue[Event],
        task: asyncio.Future[tuple[float, ChatOutcome]],
        cancel: threading.Event,
    ) -> AsyncIterator[str]:
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            while True:
                kind, text, lps = await next_event(self.state, request, events, cancel)
                if kind == "text":
                    for line in self.text(text, lps):
                        yield line
                    continue
                if kind != "done":
                    continue
                try:
                    started, outcome = task.result()
                except Exception as exc:
                    err = api_error(exc) or ApiError(500, *INTERNAL)
                    if err.status >= 500:
                        log.exception("stream failed", exc_info=exc)
                    yield err.sse()
                    yield "data: [DONE]\n\n"
                    return
                report = record(self.state, outcome, self.c.arrival, started)
                for line in self.end(outcome, report):
                    yield line
                return
        finally:  # the client went away (or the response was cut): stop the job
            if not task.done() and not cancel.is_set():
                self.state.cancelled(cancel)
