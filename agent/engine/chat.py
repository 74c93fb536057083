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


class ChatML:
    """``<|im_start|>role\\n...<|im_end|>`` (SmolLM2, Qwen) as an agent window lays it out: the
    system turn, one user turn per text observation, the instruction's user turn with the
    assistant's turn opened after it, and the end of the assistant's turn."""

    def system(self, text: str) -> str:
        return f"<|im_start|>system\n{text}<|im_end|>\n"

    def user_text(self, text: str) -> str:
        return f"<|im_start|>user\n{text}<|im_end|>\n"

    def instruction(self, text: str) -> str:
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

    def end_of_turn(self) -> str:
        return "<|im_end|>\n"


@dataclass(frozen=True)
class TemplateChat:
    """The same layout cut out of a model's own chat template: the text it writes around a
    system message, around a user message, to open the assistant's turn and to close it.

    Built by :func:`chat_format`, which renders a few conversations with sentinel contents and
    checks that the template writes each turn the same way wherever it sits (the window moves
    turns around, so a turn's text must not depend on its neighbours)."""

    system_open: str
    system_close: str
    user_open: str
    user_close: str
    assistant_open: str
    assistant_close: str

    def system(self, text: str) -> str:
        return f"{self.system_open}{text}{self.system_close}"

    def user_text(self, text: str) -> str:
        return f"{self.user_open}{text}{self.user_close}"

    def instruction(self, text: str) -> str:
        return f"{self.user_open}{text}{self.user_close}{self.assistant_open}"

    def end_of_turn(self) -> str:
        return self.assistant_close


def chat_format(tokenizer: Any) -> TemplateChat | ChatML:
    """How an agent window lays out turns for ``tokenizer``'s model: its chat template cut into
    turns (:class:`TemplateChat`), or ChatML for a tokenizer without a template.

    TemplateError when the template cannot be cut that way: it refuses a system message or two
    user turns in a row, or writes a turn differently by its place (a template that puts a date
    or the conversation's length into every turn, for example)."""
    if not getattr(tokenizer, "chat_template", None):
        return ChatML()

    def text(roles: Sequence[str], generation: bool) -> str:
        messages = [{"role": r, "content": f"{_OPEN}{i}{_CLOSE}"} for i, r in enumerate(roles)]
        try:
            return str(
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            )
        except Exception as exc:  # jinja raises its own exception types for template errors
            raise TemplateError(f"the chat template cannot lay out an agent window: {exc}") from exc

    def around(rendered: str, prefix: str, index: int) -> tuple[str, str]:
        """The text before and after content ``index``, ``rendered`` being ``prefix`` + one turn."""
        if not rendered.startswith(prefix):
            raise TemplateError("the chat template rewrites earlier turns as the conversation grows")
        turn = rendered[len(prefix) :]
        mark = f"{_OPEN}{index}{_CLOSE}"
        if turn.count(mark) != 1:
            raise TemplateError("the chat template does not write each message's content once, as given")
        before, after = turn.split(mark)
        return before, after

    system_only = text(["system"], False)
    system_open, system_close = around(system_only, "", 0)
    one_user = text(["system", "user"], False)
    user_open, user_close = around(one_user, system_only, 1)
    # a second user turn in a row is written like the first (a window holds many)
    if around(text(["system", "user", "user"], False), one_user, 2) != (user_open, user_close):
        raise TemplateError("the chat template writes a user turn differently by its place")
    assistant_open = text(["system", "user"], True)[len(one_user) :]
    replied = text(["system", "user", "assistant"], False)
    opened, assistant_close = around(replied, one_user, 2)
    if opened != assistant_open:
        raise TemplateError("the chat template opens the assistant's turn differently once it is written")
    if around(text(["system", "user", "assistant", "user"], False), replied, 3) != (user_open, user_close):
        raise TemplateError("the chat template writes a user turn differently after an answer")
    return TemplateChat(system_open, system_close, user_open, user_close, assistant_open, assistant_close)
