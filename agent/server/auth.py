"""API keys: every route but ``/health`` needs one when keys are set, docs and metrics included.

``AuthMiddleware`` runs before the body is read, so a request without a valid key costs no body
read; it puts the key's tenant in ``scope["state"]["tenant"]`` (``request.state.tenant``), where
the routes take it from. Without keys every request is the anonymous tenant ``""``. Keys are
compared in constant time.

Not here: what a tenant may use (``sessions.py``, ``scheduler.py``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})


def tenant_of_token(tenants: Mapping[str, str], authorization: str) -> str | None:
    """The tenant of an ``Authorization: Bearer <key>`` header, or None."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    found = None
    for key, tenant in tenants.items():  # every key compared: the time does not tell which matched
        if hmac.compare_digest(key.encode(), token.strip().encode()):
            found = tenant
    return found


class AuthMiddleware:
    """401 for a missing or unknown key on every path but ``open_paths`` (when keys are set)."""

    def __init__(
        self,
        app: ASGIApp,
        tenants: Mapping[str, str],
        open_paths: frozenset[str] = OPEN_PATHS,
        on_reject: Callable[[], None] = lambda: None,
    ) -> None:
        self.app, self.tenants, self.open_paths, self.on_reject = app, dict(tenants), open_paths, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if not self.tenants:
            state["tenant"] = ""
        elif scope["path"] not in self.open_paths:
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            tenant = tenant_of_token(self.tenants, header.decode("latin-1"))
            if tenant is None:
                self.on_reject()
                await _unauthorized(send)
                return
            state["tenant"] = tenant
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    body = json.dumps(
        {
            "error": {
                "message": "missing or invalid API key (Authorization: Bearer <key>)",
                "type": "authentication_error",
                "code": "invalid_api_key",
                "param": None,
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
