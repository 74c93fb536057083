"""What a chat completion's whole and streamed answers share: the checked request
(:class:`Completion`), its prompt (media decoded, template rendered, text tokenized, on the thread
pool), its model-thread job, and the shapes of what comes back (message, logprobs, usage, the
``kamera`` cache report, counted in the metrics).

Not here: the checks and the route (``routes/chat.py``), the SSE stream (``routes/stream.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from agent.engine.chat import Message, Piece, takes_tools
from agent.engine.generation import SamplingParams, TextCallback, TokenLogprob
from agent.engine.media import VideoClip
from agent.engine.runtime import ChatOutcome
from agent.engine.tools import ToolCall, split_calls
from agent.server import schemas as S
from agent.server.content import load_part
from agent.server.errors import PREPARE_ERRORS
from agent.server.state import ServerState
from agent.server.structured import OutputPlan, call_out, logprob_content


@dataclass(frozen=True)
class Completion:
    """One checked chat request: what to generate and what its answer is called."""

    body: S.ChatCompletionRequest
    params: SamplingParams
    plan: OutputPlan
    salt: str  # the tenant's cache namespace
    id: str
    created: int
    model: str
    arrival: float  # perf_counter at arrival

    def job(
        self,
        state: ServerState,
        pieces: list[Piece],
        cancel: threading.Event,
        on_start: Callable[[], None] | None = None,
        on_text: TextCallback | None = None,
    ) -> Callable[[], tuple[float, ChatOutcome]]:
        """The model-thread job: it answers (its start time, the outcome)."""

        def run() -> tuple[float, ChatOutcome]:
            started = time.perf_counter()
            outcome = state.runtime.chat(
                pieces,
                self.params,
                self.salt,
                cancel,
                on_start=on_start,
                on_text=on_text,
                mode=self.body.kamera_reuse,
                grammar=self.plan.grammar,
            )
            return started, outcome

        return run


# --- the prompt, holding a queue place --------------------------------------------------


async def prepare(state: ServerState, c: Completion) -> list[Piece]:
    """Media decoded and text tokenized (on the thread pool, not the model thread), the plan's
    tool definitions rendered into the prompt."""

    def render() -> list[Piece]:
        return state.runtime.render(messages(state, c.body), c.plan.definitions)

    try:
        return await run_in_threadpool(render)
    except PREPARE_ERRORS as exc:
        raise state.refuse(exc) from None


def messages(state: ServerState, body: S.ChatCompletionRequest) -> list[Message]:
    """The request's messages with their media decoded in place (a video as its frames)."""
    out, frames_left = [], state.limits.max_frames
    native_tools = takes_tools(state.runtime.adapter.tokenizer)
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        if m.role == "tool" and not native_tools:
            text = (
                m.content
                if isinstance(m.content, str)
                else "".join(p.text for p in m.content or () if isinstance(p, S.TextPart))
            )
            out.append(Message("user", (f"<tool_response>\n{text}\n</tool_response>",)))
            continue
        if m.tool_calls:
            calls = [ToolCall(c.id, c.function.name, c.function.arguments).text() for c in m.tool_calls]
            text = m.content if isinstance(m.content, str) else ""
            out.append(Message(role, tuple(p for p in (text, *calls) if p)))
            continue
        if m.content is None or isinstance(m.content, str):
            out.append(Message(role, (m.content or "",)))
            continue
        parts: list[Any] = []
        for p in m.content:
            got = load_part(state, p, frames_left)
            if isinstance(got, VideoClip):
                frames_left -= len(got.frames)
                parts.extend(got.frames)
            else:
                parts.append(got)
        out.append(Message(role, tuple(parts)))
    return out


# --- the answer ---------------------------------------------------------------------------


def choice_logprobs(
    state: ServerState, params: SamplingParams, lps: list[TokenLogprob]
) -> S.ChoiceLogprobs | None:
    if not params.logprobs:
        return None
    return S.ChoiceLogprobs(content=logprob_content(state.runtime.adapter.tokenizer, lps))


def message_of(plan: OutputPlan, text: str) -> tuple[S.AssistantMessage, bool]:
    """The assistant message of generated ``text``, and whether it holds tool calls."""
    if not plan.parse_calls:
        return S.AssistantMessage(content=text), False
    content, calls = split_calls(text, plan.tool_names)
    if not calls:
        return S.AssistantMessage(content=text), False
    return S.AssistantMessage(content=content or None, tool_calls=[call_out(c) for c in calls]), True


def record(state: ServerState, outcome: ChatOutcome, arrival: float, started: float) -> S.CacheReport:
    """Count a finished request in the metrics; its ``kamera`` cache report."""
    u, metrics = outcome.usage, state.metrics
    metrics.prompt_tokens.inc(u.prompt_tokens)
    metrics.completion_tokens.inc(len(outcome.decoded.tokens))
    metrics.reused_tokens.labels("prefix").inc(u.prefix_tokens)
    metrics.reused_tokens.labels("content").inc(u.relocated_tokens)
    metrics.reused_tokens.labels("abandoned").inc(u.abandoned_tokens)
    metrics.served.labels(u.mode, u.served).inc()
    metrics.reuse.labels(u.mode, "exact").inc(u.prefix_tokens)
    metrics.reuse.labels(u.mode, "repaired").inc(u.repaired_tokens)
    metrics.reuse.labels(u.mode, "reused").inc(u.relocated_tokens - u.repaired_tokens)
    metrics.reuse.labels(u.mode, "recomputed").inc(u.prefilled_tokens)
    metrics.reuse.labels(u.mode, "fallback").inc(u.fallback_tokens)
    metrics.prefilled_tokens.inc(u.prefilled_tokens)
    metrics.rotated_tokens.labels("chat").inc(u.rotated_tokens)
    metrics.lost_entries.inc(u.lost_entries)
    metrics.tier_tokens.labels("redis").inc(u.shared_tokens)
    if u.mode == "repair" and u.repair_residual > 0:  # repaired, or given up on what it measured
        metrics.repair_residual.observe(u.repair_residual)
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
        fallback_tokens=u.fallback_tokens,
        served=u.served,
        abandoned_tokens=u.abandoned_tokens,
        repair_residual=u.repair_residual,
        repair_depth=u.repair_depth,
        escalated_at=outcome.decoded.escalated_at,
        diverged_tokens=outcome.decoded.diverged,
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
