"""``GET /v1/models``, ``GET /health`` and ``GET /metrics``.

``/health`` is 200 while the model is up and 503 after a failed warm-up or while draining; it
shows no paths, and a shared tier (Redis) that is away shows in it without making it 503. It
names the numerics this process computes KV under (``cache.numerics``): replicas sharing a store
reuse each other's exact KV only where theirs are the same.
``/metrics`` is Prometheus text, from the app's own registry.

Not here: who may call them (``auth.py``: ``/health`` is always open, ``/metrics`` unless keys
are set and metrics are not public).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from agent.server import schemas as S
from agent.server.errors import ERRORS
from agent.server.state import ServerState, tenant_of


def router(state: ServerState) -> APIRouter:
    api = APIRouter(route_class=state.route_class)
    runtime = state.runtime

    @api.get("/v1/models", response_model=S.ModelList, responses=ERRORS)
    async def models(tenant: str = Depends(tenant_of)) -> S.ModelList:
        return S.ModelList(data=[S.ModelCard(id=runtime.config.name, created=int(runtime.started))])

    @api.get("/health", responses={503: {"model": S.ErrorResponse}})
    async def health() -> JSONResponse:
        ok, reason = runtime.health()
        body: dict[str, Any] = {
            "status": "ok" if ok else "unavailable",
            "reason": reason,
            "model": runtime.config.name,
            "numerics": runtime.adapter.namespace().numerics,  # what exact hits must share (cache.numerics)
            "sessions": len(runtime.sessions),
            "queue": runtime.worker.pending,
        }
        shared = runtime.store.shared_health()
        if shared is not None:  # a Redis that is away costs hits, not health: never a 503 for it
            body["redis"] = shared._asdict()
        return JSONResponse(body, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return api
