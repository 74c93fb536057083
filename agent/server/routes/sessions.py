"""Agent sessions: ``POST /v1/sessions``, ``POST /v1/sessions/{id}/steps``, ``GET`` and ``DELETE
/v1/sessions/{id}``.

A session is one agent's window on the server's store (``sessions.py`` keeps them, per tenant).
A step's observations are chat's content parts (``text``, ``image_url``, ``video_url``, decoded
by the same code as chat's, ``content.py``) or the session forms (``image`` with a label,
``frames`` with timestamps); its window operations are parsed into typed values
(``agent/window_ops.py``) and applied in order before the step. Everything the client can get
wrong is checked before the step takes a place in the model queue: counts of observations,
images, videos and frames, and text no window of the session's budget could hold (from its
length, untokenized).

Not here: running a step (``runtime.py``, ``agent/loop.py``), the window (``agent/context.py``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, is_dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from agent.engine.media import BadMediaError, MediaLimitError, VideoClip, load_image_url
from agent.engine.runtime import PromptTooLongError
from agent.engine.sessions import Session, SessionLimitError, SessionNotFoundError
from agent.loop import Agent, FramesObservation, ImageObservation, Observation, StepResult, TextObservation
from agent.policies import MIN_ACTION_TOKENS
from agent.server import schemas as S
from agent.server.content import MediaCount, check_media, count_media, load_part
from agent.server.errors import ERRORS, ApiError
from agent.server.state import ServerState, tenant_of


def router(state: ServerState) -> APIRouter:
    api = APIRouter(route_class=state.route_class)
    runtime = state.runtime

    @api.post("/v1/sessions", response_model=S.WindowOut, status_code=201, responses=ERRORS)
    async def create_session(
        body: S.SessionCreate, request: Request, tenant: str = Depends(tenant_of)
    ) -> Any:
        check_create(state, body)
        try:
            runtime.sessions.reserve(tenant)
        except SessionLimitError as exc:
            raise state.refuse(exc) from None
        salt = runtime.tenant_salt(tenant, body.cache_salt)
        try:

            def job() -> Agent:
                return runtime.new_agent(
                    body.system_prompt,
                    body.budget_tokens,
                    body.policy,
                    body.max_tokens,
                    salt,
                    body.kamera_reuse,
                )

            agent = await state.admitted(tenant, lambda: state.watched(request, job, threading.Event()))
        except BaseException:
            runtime.sessions.release(tenant)
            raise
        session = runtime.sessions.add(tenant, agent, body.budget_tokens)
        return await run_in_threadpool(window, session)

    @api.post("/v1/sessions/{session_id}/steps", response_model=S.StepResponse, responses=ERRORS)
    async def step(
        session_id: str, body: S.StepRequest, request: Request, tenant: str = Depends(tenant_of)
    ) -> Any:
        arrival = time.perf_counter()
        check_step(state, body)
        session = acquire(state, session_id, tenant)
        try:
            check_step_length(state, body, session.budget_tokens)
            ops = [op.typed() for op in body.operations]

            async def work() -> S.StepResponse:
                try:
                    obs = await run_in_threadpool(observations, state, body)
                except (MediaLimitError, BadMediaError) as exc:
                    raise state.refuse(exc) from None

                cancel = threading.Event()

                def job() -> tuple[float, StepResult]:
                    started = time.perf_counter()
                    return started, runtime.step(session, ops, obs, body.instruction, body.max_tokens, cancel)

                started, result = await state.watched(request, job, cancel)
                return step_response(state, result, 1000 * (started - arrival))

            return await state.admitted(tenant, work)
        finally:
            runtime.sessions.done(session)

    @api.get("/v1/sessions/{session_id}", response_model=S.WindowOut, responses=ERRORS)
    async def get_session(session_id: str, tenant: str = Depends(tenant_of)) -> Any:
        session = acquire(state, session_id, tenant)
        try:
            return await run_in_threadpool(window, session)
        finally:
            runtime.sessions.done(session)

    @api.delete("/v1/sessions/{session_id}", status_code=204, responses=ERRORS)
    async def delete_session(session_id: str, tenant: str = Depends(tenant_of)) -> Response:
        try:
            runtime.sessions.delete(session_id, tenant)
        except SessionNotFoundError as exc:
            raise state.refuse(exc) from None
        return Response(status_code=204)

    return api


def acquire(state: ServerState, session_id: str, tenant: str) -> Session:
    try:
        return state.runtime.sessions.acquire(session_id, tenant)
    except SessionNotFoundError as exc:
        raise state.refuse(exc) from None


# --- checks, before a queue place is taken -------------------------------------------------


def max_tokens_error(state: ServerState) -> ApiError:
    cap = state.limits.max_tokens
    return ApiError(400, f"max_tokens exceeds the server's {cap}", "max_tokens", param="max_tokens")


def check_create(state: ServerState, body: S.SessionCreate) -> None:
    limits = state.limits
    if body.budget_tokens > limits.max_session_tokens:
        raise ApiError(
            400,
            f"budget_tokens exceeds max_session_tokens={limits.max_session_tokens}",
            "budget_too_large",
            param="budget_tokens",
        )
    if body.max_tokens > limits.max_tokens:
        raise max_tokens_error(state)
    if body.policy == "action" and body.max_tokens < MIN_ACTION_TOKENS:
        raise ApiError(
            400,
            f"an action session needs max_tokens >= {MIN_ACTION_TOKENS} (its replies are decoded "
            "under the action grammar)",
            "max_tokens",
            param="max_tokens",
        )


def check_step(state: ServerState, body: S.StepRequest) -> None:
    obs, limits = body.observations, state.limits
    if len(obs) > limits.max_observations:
        raise ApiError(
            413,
            f"{len(obs)} observations exceed {limits.max_observations}",
            "too_many_observations",
            param="observations",
        )
    parts = count_media(obs)
    count = MediaCount(parts.images + sum(isinstance(o, S.ImageObs) for o in obs), parts.videos)
    frames = sum(len(o.frames) for o in obs if isinstance(o, S.FramesObs))
    check_media(state, count, "observations", frames)
    for i, o in enumerate(obs):
        if isinstance(o, S.FramesObs) and o.timestamps is not None and len(o.timestamps) != len(o.frames):
            raise ApiError(
                400,
                "frames and timestamps differ in length",
                "bad_frames",
                param=f"observations[{i}].timestamps",
            )
    if body.max_tokens is not None and body.max_tokens > limits.max_tokens:
        raise max_tokens_error(state)


def check_step_length(state: ServerState, body: S.StepRequest, budget: int) -> None:
    """Refuse text no window of ``budget`` tokens can hold, from its length (before tokenizing)."""
    texts = [
        (f"observations[{i}].text", o.text)
        for i, o in enumerate(body.observations)
        if isinstance(o, S.TextPart)
    ]
    for param, text in [*texts, ("instruction", body.instruction)]:
        try:
            state.runtime.check_length([text], budget, param)
        except PromptTooLongError as exc:
            raise ApiError(
                400, f"{exc} (the session's budget_tokens)", "context_length_exceeded", param=param
            ) from None


# --- the step -----------------------------------------------------------------------------


def observations(state: ServerState, body: S.StepRequest) -> list[Observation]:
    """The step's observations with their media decoded (on the thread pool); content parts go
    through chat's decoder, a video becomes its frames with their timestamps."""
    out: list[Observation] = []
    media, limits = state.runtime.config.media, state.limits
    frames_left = limits.max_frames - sum(
        len(o.frames) for o in body.observations if isinstance(o, S.FramesObs)
    )
    for o in body.observations:
        if isinstance(o, S.ImageObs):
            out.append(ImageObservation(load_image_url(o.image_url, media, limits), o.label))
        elif isinstance(o, S.FramesObs):
            frames = [load_image_url(u, media, limits) for u in o.frames]
            stamps = o.timestamps if o.timestamps is not None else [float(i) for i in range(len(frames))]
            out.append(FramesObservation(frames, stamps))
        else:
            got = load_part(state, o, frames_left)
            if isinstance(got, VideoClip):
                frames_left -= len(got.frames)
                out.append(FramesObservation(got.frames, got.timestamps))
            elif isinstance(got, str):
                out.append(TextObservation(got))
            else:
                out.append(ImageObservation(got))
    return out


def step_response(state: ServerState, result: StepResult, queue_ms: float) -> S.StepResponse:
    report = asdict(result.report)
    report["evicted"] = list(report["evicted"])
    r, metrics = result.report, state.metrics
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


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__.lower(), **asdict(value)}
    return value
