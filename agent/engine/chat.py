"""Chat messages to prompt pieces with the model's chat template, applied piecewise.

The template is rendered once with every content part replaced by a sentinel; the text between
sentinels is the template's own text (role headers, turn ends, a default system prompt, the
generation prompt). Each piece is then tokenized on its own, so a message's text tokenizes the
same wherever it sits in the conversation, and every message and image starts a piece: the
planner gets those offsets as structural boundaries.

A tokenizer without a chat template gets ChatML (``<|im_start|>role\\n ... <|im_end|>\\n``),
what SmolLM2 and Qwen use. The tiny random models have no tokenizer; ``ByteTokenizer``
(``agent/byte_tokenizer.py``, imported here for the server's modules) gives them one.

Tool definitions are prompt content too: a template that renders ``tools`` gets them and its
output is cut around each definition's JSON; any other template gets the fallback tool block of
``tools.py`` in the system turn, one part per definition. Either way each definition is its own
piece, reused by content when the tool list changes.

Not here: decoding images (``media.py``) or planning reuse (``prompt_cache.py``). Content is
inserted raw where the template had the sentinel: a template that transforms content (strips
it, for example) sees the sentinel, not the text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image

from agent.byte_tokenizer import ByteTokenizer as ByteTokenizer  # the server's modules import it from here
from agent.engine.tools import prompt_parts_of

_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


@dataclass(frozen=True)
class Message:
    """One chat message: a role and its parts in order (text, or an image to become a chunk)."""

    role: str
    parts: tuple[str | Image.Image, ...]


@dataclass(frozen=True)
class TextPiece:
    ids: tuple[int, ...]
    template: bool  # text of the template itself rather than of a message


@dataclass(frozen=True)
class ImagePiece:
    image: Image.Image


Piece = TextPiece | ImagePiece


class TemplateError(ValueError):
    """The chat template refused the messages (e.g. roles out of the order it accepts)."""


def tokenize(tokenizer: Any, text: str) -> tuple[int, ...]:
    if not text:
        return ()
    return tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])


def takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list itself."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()) -> list[Piece]:
    """The prompt of ``messages`` followed by the generation prompt, as pieces in order.
    ``tools``: OpenAI function definitions (``{"type": "function", "function": {...}}``)."""
    native = bool(tools) and takes_tools(tokenizer)
    if tools and not native:
        messages = _with_tool_block(messages, tools)
    parts: list[str | Image.Image] = []
    rendered_msgs = []
    for m in messages:
        marks = []
        for p in m.parts:
            marks.append(f"{_OPEN}{len(parts)}{_CLOSE}")
            parts.append(p)
        rendered_msgs.append({"role": m.role, "content": "".join(marks)})
    text = _apply_template(tokenizer, rendered_msgs, list(tools) if native else None)
    cuts = _tool_spans(text, tools) if native else []
    pieces: list[Piece] = []
    pos, expected = 0, 0
    for match in _SENTINEL.finditer(text):
        index = int(match.group(1))
        if index != expected:
            raise TemplateError("the chat template reordered or dropped message content")
        expected += 1
        _add_template(pieces, tokenizer, text, pos, match.start(), cuts)
        part = parts[index]
        if isinstance(part, str):
            _add_text(pieces, tokenizer, part, template=False)
        else:
            pieces.append(ImagePiece(part))
        pos = match.end()
    if expected != len(parts):
        raise TemplateError("the chat template dropped message content")
    _add_template(pieces, tokenizer, text, pos, len(text), cuts)
    return pieces


def _with_tool_block(messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[Message]:
    """The fallback tool block at the end of the system turn (a new one if there is none)."""
    block = prompt_parts_of(tools)
    if messages and messages[0].role == "system":
        first = messages[0]
        lead = ("\n\n",) if any(isinstance(p, str) and p for p in first.parts) else ()
        return [replace(first, parts=(*first.parts, *lead, *block)), *messages[1:]]
    return [Message("system", tuple(block)), *messages]


def _tool_spans(text: str, tools: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """Where the template wrote each definition (as ``tojson`` writes it, whole or its
    ``function``), in order; a definition written some other way is not cut out."""
    spans = []
    for tool in tools:
        for obj in (tool, tool.get("function")):
            found = [text.find(json.dumps(obj, ensure_ascii=a)) for a in (False, True)]
            at = max(found)
            if at >= 0:
                n = len(json.dumps(obj, ensure_ascii=found.index(at) == 1))
                spans.append((at, at + n))
                break
    return sorted(spans)


def _add_template(
    pieces: list[Piece], tokenizer: Any, text: str, a: int, b: int, cuts: Sequence[tuple[int, int]]
) -> None:
    """Template text ``text[a:b]``, with each tool definition inside it a piece of its own."""
    for s, e in cuts:
        if a <= s and e <= b:
            _add_text(pieces, tokenizer, text[a:s], template=True)
            _add_text(pieces, tokenizer, text[s:e], template=False)
            a = e
    _add_text(pieces, tokenizer, text[a:b], template=True)


def _add_text(pieces: list[Piece], tokenizer: Any, text: str, template: bool) -> None:
    ids = tokenize(tokenizer, text)
    if ids:
        pieces.append(TextPiece(ids, template))


def _apply_template(
    tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None
) -> str:
    if getattr(tokenizer, "chat_template", None):
        try:
            out = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja raises its own exception types for template errors
            raise TemplateError(f"the chat template refused the messages: {exc}") from exc
        return str(out)
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"
