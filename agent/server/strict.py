"""Strict request bodies: the JSON parser the routes use, and validation errors as OpenAI errors.

``parse_json`` is ``json.loads`` that also refuses what Python's parser lets through but JSON
(RFC 8259) or the model cannot take: ``NaN`` / ``Infinity``, duplicate keys, and strings holding a
lone UTF-16 surrogate (``"\\ud800"``, which no UTF-8 text can encode). ``strict_route(lenient)``
is the route class that parses bodies with it and sets ``schemas.LENIENT_FIELDS`` for the
request's validation. ``describe`` turns pydantic's errors into a message and the ``param`` of an
OpenAI error body.

Not here: what a field may hold (``schemas.py``), size limits (``limits.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple

from fastapi import Request, Response
from fastapi.routing import APIRoute

from agent.server.schemas import LENIENT_FIELDS


def _refuse(message: str) -> json.JSONDecodeError:
    return json.JSONDecodeError(message, "", 0)


def _check_text(text: str, key: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _refuse(f"{key!r} holds a lone surrogate: not valid Unicode") from None


def _check_value(value: Any, key: str) -> None:
    # Objects inside were checked by their own hook; lists are walked for strings and lists.
    if isinstance(value, str):
        _check_text(value, key)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, str | list):
                _check_value(item, key)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        dup = Counter(k for k, _ in pairs).most_common(1)[0][0]
        raise _refuse(f"duplicate key {dup!r}")
    for key, value in pairs:
        _check_text(key, key)
        _check_value(value, key)
    return out


def _constant(name: str) -> Any:
    raise _refuse(f"{name} is not a JSON number")


def parse_json(body: bytes) -> Any:
    """The JSON value of ``body``; ``json.JSONDecodeError`` for anything RFC 8259 refuses."""
    value = json.loads(body, object_pairs_hook=_object, parse_constant=_constant)
    _check_value(value, "body")
    return value


class StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


def strict_route(lenient_fields: bool) -> type[APIRoute]:
    """A route class whose bodies are parsed by :func:`parse_json`, unknown fields refused or dropped."""

    class StrictRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def strict_handler(request: Request) -> Response:
                token = LENIENT_FIELDS.set(lenient_fields)
                try:
                    return await handler(StrictRequest(request.scope, request.receive))
                finally:
                    LENIENT_FIELDS.reset(token)

            return strict_handler

    return StrictRoute


class Problem(NamedTuple):
    message: str
    param: str | None


def _param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` as ``messages[0].content``; union branch names dropped."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in str(part) and part not in ("str", "int", "float", "bool", "none"):
            out += f".{part}" if out else str(part)
    return out or None


def describe(errors: Sequence[dict[str, Any]]) -> Problem:
    """An OpenAI-style message and ``param`` for pydantic's (or the JSON parser's) errors."""
    lines: list[str] = []
    first: str | None = None
    for e in errors:
        loc = e.get("loc", ())
        param = _param(loc) if e.get("type") != "json_invalid" else None
        if e.get("type") == "extra_forbidden":
            line = (
                f"Unrecognized request argument supplied: {param}"
                if len(loc) == 2
                else f"{param}: unrecognized field"
            )
        elif e.get("type") == "json_invalid":
            line = f"the body is not valid JSON: {e.get('ctx', {}).get('error', 'parse error')}"
        else:
            line = f"{param or 'body'}: {e.get('msg', 'invalid')}"
        if line not in lines:
            lines.append(line)
        first = first or param
        if len(lines) == 5:
            break
    return Problem("; ".join(lines) or "invalid request", first)
