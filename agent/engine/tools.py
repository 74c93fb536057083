"""Tool calling: tool definitions into the prompt, tool calls out of the model's text.

Format: the Hermes / Qwen one. Definitions sit in the system turn between ``<tools>`` tags, one
JSON object a line; the model answers a call as ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``; a tool's result comes back in a user turn between ``<tool_response>``
tags. A chat template that renders ``tools`` itself (Qwen2.5's does) gets them through the
template instead (``chat.render(tools=...)``); SmolLM2's does not, so the embedded model gets the
fallback text here, which is the same layout. Every definition is its own prompt piece, so the
prompt cache reuses an unchanged definition by content when the tool list changes between turns.

``tool_choice``: ``none`` leaves the tools out of the prompt and the text as it is; ``auto`` lets
the model choose and parses what it wrote; ``required`` and a named function decode under a
grammar (one call, arguments under the function's parameter schema).

Not here: HTTP (``app.py``), the grammar engine (``grammar.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from agent.grammar import lark_string, schema_rule

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_OUTRO = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """Tools, a tool choice or a tool-call history that does not hold together; ``param`` names
    the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool = False

    def definition(self) -> dict[str, Any]:
        """The definition as the model reads it (OpenAI's ``{"type": "function", ...}``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else EMPTY_PARAMETERS
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def text(self) -> str:
        """The call as the model writes it (for an assistant message in the history)."""
        body = json.dumps({"name": self.name, "arguments": json.loads(self.arguments)}, ensure_ascii=False)
        return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools: Sequence[Tool]) -> None:
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if not NAME.match(name):
            raise ToolError(f"tool name {name!r} must match {NAME.pattern}", f"tools[{i}].function.name")
        if names.index(name) != i:
            raise ToolError(f"tool name {name!r} is defined twice", f"tools[{i}].function.name")


def prompt_parts_of(definitions: Sequence[dict[str, Any]]) -> list[str]:
    """The fallback tool block as prompt parts: the intro, one definition each (JSON), the outro."""
    defs = [json.dumps(d, ensure_ascii=False) for d in definitions]
    return [_INTRO, *(d + "\n" for d in defs), _OUTRO]


def call_grammar(tools: Sequence[Tool]) -> str:
    """Lark: exactly one call of one of ``tools``, arguments under its parameter schema."""
    rules = []
    for i, t in enumerate(tools):
        head = lark_string(f'{{"name": {json.dumps(t.name)}, "arguments": ')
        params = t.parameters if t.parameters is not None else EMPTY_PARAMETERS
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: {schema_rule(params, lenient=not t.strict)}")
    start = (
        f"start: {lark_string(CALL_OPEN + chr(10))} ({' | '.join(f'call_{i}' for i in range(len(tools)))}) "
    )
    start += lark_string("\n" + CALL_CLOSE)
    return "\n".join([start, *rules]) + "\n"


def check_history(messages: Sequence[Any]) -> None:
    """Every tool message answers a call of the assistant turn just before it, each call is
    answered once before the conversation goes on. ``messages``: objects with ``role``,
    ``tool_calls`` (items with ``id``) and ``tool_call_id``."""
    open_ids: dict[str, int] = {}  # call id -> index of the assistant message that made it
    for i, m in enumerate(messages):
        if getattr(m, "tool_calls", None) and m.role != "assistant":
            raise ToolError(f"a {m.role} message cannot carry tool_calls", f"messages[{i}].tool_calls")
        if m.role == "tool":
            if not m.tool_call_id:
                raise ToolError("a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
            if m.tool_call_id not in open_ids:
                raise ToolError(
                    f"tool_call_id {m.tool_call_id!r} answers no open call of the assistant turn before it",
                    f"messages[{i}].tool_call_id",
                )
            del open_ids[m.tool_call_id]
            continue
        if open_ids:
            raise ToolError(
                f"tool calls {sorted(open_ids)} of messages[{next(iter(open_ids.values()))}] have no tool "
                "message answering them",
                f"messages[{i}]",
            )
        if m.role == "assistant" and m.tool_calls:
            for j, call in enumerate(m.tool_calls):
                if call.id in open_ids:
                    raise ToolError(
                        f"tool call id {call.id!r} is used twice", f"messages[{i}].tool_calls[{j}].id"
                    )
                try:
                    args = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    raise ToolError(
                        f"arguments are not JSON ({e.msg})",
                        f"messages[{i}].tool_calls[{j}].function.arguments",
                    ) from None
                if not isinstance(args, dict):
                    raise ToolError(
                        "arguments must be a JSON object", f"messages[{i}].tool_calls[{j}].function.arguments"
                    )
                open_ids[call.id] = i


def parse_call(body: str, names: Sequence[str]) -> ToolCall | None:
    """One ``{"name": ..., "arguments": {...}}`` body, or None if it is not a call of ``names``."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args = data.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), str(data["name"]), json.dumps(args, ensure_ascii=False))


class CallStream:
    """Splits generated text into content and tool calls as it arrives.

    ``push(text)`` and ``close()`` yield ``str`` (content safe to show) and :class:`ToolCall`
    (a complete call). Text that might be the start of ``<tool_call>`` is held back until it is
    not; a block that does not parse as a call of a known tool is given back as content.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.buffer = ""
        self.inside = False
        self.calls: list[ToolCall] = []
        self.content = ""

    def push(self, text: str) -> Iterator[str | ToolCall]:
        self.buffer += text
        while True:
            if not self.inside:
                at = self.buffer.find(CALL_OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buffer, CALL_OPEN)
                    yield from self._content(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return
                yield from self._content(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at:], True
            end = self.buffer.find(CALL_CLOSE)
            if end < 0:
                return
            block = self.buffer[: end + len(CALL_CLOSE)]
            self.buffer, self.inside = self.buffer[len(block) :], False
            yield from self._block(block)

    def close(self) -> Iterator[str | ToolCall]:
        """The held-back tail: an unclosed block still counts if its JSON is complete."""
        rest, self.buffer = self.buffer, ""
        if self.inside:
            self.inside = False
            yield from self._block(rest)
        else:
            yield from self._content(rest)

    def _block(self, block: str) -> Iterator[str | ToolCall]:
        body = block.removeprefix(CALL_OPEN).removesuffix(CALL_CLOSE).strip()
        call = parse_call(body, self.names)
        if call is None:
            yield from self._content(block)
        else:
            self.calls.append(call)
            yield call

    def _content(self, text: str) -> Iterator[str]:
        if text:
            self.content += text
            yield text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_calls(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """All of ``text`` at once: the content (outside the calls, stripped) and the calls."""
    stream = CallStream(names)
    for _ in stream.push(text):
        pass
    for _ in stream.close():
        pass
    return stream.content.strip(), stream.calls
