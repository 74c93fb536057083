"""Requests to token ids with their structure: the chunk bounds the planner must keep.

:class:`MessageTokenizer` tokenizes each part of each message on its own (with a plain encoder,
or :func:`word_encode`, the tokenizer-free stand-in); :class:`TemplateTokenizer` renders the
request through a real tokenizer's chat template. Both give :class:`Tokenized`: the ids, where
each message starts, and every forced boundary (message starts, body starts and ends, the
structural points of tool calls).

Not here: the planner (``cache/planner.py``), the replay (``traces_replay.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

from bench.traces_data import Message
from cache.keys import digest_key


class Tokenized(NamedTuple):
    """A rendered request and its structure, as the planner's forced chunk bounds.

    ``boundaries`` holds every message start and, inside each message, the start and end of
    its body and the structural points of its tool calls (:func:`body_cuts`), so the role
    header, the end-of-turn marker and the JSON around a call's arguments are chunks of their
    own: a body the context manager replaces (a masked observation) or a message that arrives
    new leaves the chunks around it intact, and no chunk mixes template text with new text.
    """

    ids: np.ndarray  # [T] int64
    message_starts: tuple[int, ...]  # token offset where each message starts
    boundaries: tuple[int, ...]  # sorted forced chunk bounds: message starts and parts


Tokenizer = Callable[[Sequence[Message]], Tokenized]


TOOL_CALLS_OPEN = "\n<tool_call>"


MESSAGE_END = "<|im_end|>\n"


# The free-form fields of a tool call: their values change from call to call, the JSON around
# them repeats. json.dumps escapes every quote inside a string, so this never matches inside one.
_CALL_FIELD = re.compile(r'"(?:arguments|id)": "((?:[^"\\]|\\.)*)"')


def message_body(m: Message) -> str:
    """The text a message shows the model: its content, then its tool calls as JSON."""
    body = "" if m.get("content") is None else str(m["content"])
    if m.get("tool_calls"):
        body += TOOL_CALLS_OPEN + json.dumps(m["tool_calls"], sort_keys=True, default=str) + "</tool_call>"
    return body


def body_cuts(body: str) -> list[int]:
    """Character offsets in ``(0, len(body))`` where a body's structure changes, sorted: the start
    of its tool-call section and the start and end of each call's ``arguments`` and ``id``."""
    at = body.find(TOOL_CALLS_OPEN)
    if at < 0:
        return []
    cuts = {at, *(x for f in _CALL_FIELD.finditer(body, at) for x in f.span(1))}
    return sorted(c for c in cuts if 0 < c < len(body))


def message_header(m: Message) -> str:
    """ChatML header of one message: the start marker and the role line."""
    return f"<|im_start|>{m.get('role', 'user')}\n"


def message_parts(m: Message) -> list[str]:
    """One message's ChatML text cut at its structure: header, body pieces (see
    :func:`body_cuts`), end marker. Empty pieces are kept out."""
    body = message_body(m)
    cuts = [0, *body_cuts(body), len(body)]
    pieces = [body[a:b] for a, b in pairwise(cuts)]
    return [message_header(m), *(p for p in pieces if p), MESSAGE_END]


def render_message(m: Message) -> str:
    """ChatML-style text of one message, tool calls included."""
    return message_header(m) + message_body(m) + MESSAGE_END


class MessageTokenizer:
    """Tokenizes each part of each message (:func:`message_parts`) on its own (cached), so
    messages and their structural parts start and end on token bounds."""

    def __init__(self, encode: Callable[[str], Sequence[int]]) -> None:
        self.encode = encode
        self._cache: dict[str, np.ndarray] = {}

    def _ids(self, text: str) -> np.ndarray:
        if text not in self._cache:
            self._cache[text] = np.asarray(self.encode(text), dtype=np.int64)
        return self._cache[text]

    def __call__(self, messages: Sequence[Message]) -> Tokenized:
        ids: list[np.ndarray] = []
        starts, bounds, at = [], set(), 0
        for m in messages:
            starts.append(at)
            for part in message_parts(m):
                bounds.add(at)
                ids.append(self._ids(part))
                at += len(ids[-1])
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return Tokenized(flat, tuple(starts), tuple(sorted(bounds)))


_WORD = re.compile(r"\w+|[^\w\s]|\s+")


def word_encode(text: str, vocab: int = 50_000) -> list[int]:
    """Tokenizer-free stand-in: words, punctuation and whitespace runs hashed into ``vocab`` ids."""
    return [_word_id(w, vocab) for w in _WORD.findall(text)]


@lru_cache(maxsize=1 << 18)
def _word_id(word: str, vocab: int) -> int:
    return int.from_bytes(digest_key("word", [word.encode()]).digest[:4], "big") % vocab


class TemplateTokenizer:
    """A request rendered by the tokenizer's chat template, generation prompt included.

    The rendered text is cut before every ``marker`` (ChatML's ``<|im_start|>``) and each piece
    is tokenized on its own (cached), so messages start on token bounds. With the marker a
    special token, the pieces' ids concatenate to the ids of the whole text. Inside a piece,
    the body starts after the header line (marker and role) and ends at ``end_marker``; these
    and the body's tool-call structure (:func:`body_cuts`) are reported as
    boundaries, before the token holding each (the ids are never changed to make one). Message
    bodies are :func:`message_body` (tool calls as JSON), since the template
    shows only ``content``. Needs a fast tokenizer (character offsets).
    """

    def __init__(self, tokenizer: Any, marker: str = "<|im_start|>", end_marker: str = "<|im_end|>") -> None:
        self.tokenizer = tokenizer
        self.end_marker = end_marker
        self._split = re.compile(f"(?={re.escape(marker)})")
        self._cache: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        msgs = [{"role": str(m.get("role", "user")), "content": message_body(m)} for m in messages]
        text: str = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return text

    def _piece(self, piece: str) -> tuple[np.ndarray, tuple[int, ...]]:
        """Ids of one message piece [P] and the token offsets where its body starts and ends."""
        if piece not in self._cache:
            enc = self.tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
            start = piece.find("\n") + 1
            end = piece.rfind(self.end_marker) if self.end_marker in piece else len(piece)
            chars = [start, end, *(start + c for c in body_cuts(piece[start:end]))]
            # a point inside a token cuts before that token
            token_starts = [a for a, _ in enc["offset_mapping"]]
            inside = np.searchsorted(token_starts, [c for c in chars if c < len(piece)], side="right") - 1
            cuts = tuple(sorted({int(i) for i in inside if i > 0}))
            self._cache[piece] = (np.asarray(enc["input_ids"], dtype=np.int64), cuts)
        return self._cache[piece]

    def __call__(self, messages: Sequence[dict[str, Any]]) -> Tokenized:
        parts = [self._piece(p) for p in self._split.split(self.render(messages)) if p]
        starts = np.cumsum([0, *[len(ids) for ids, _ in parts[:-1]]]).tolist() if parts else []
        bounds = [b for s, (_, cuts) in zip(starts, parts, strict=True) for b in (s, *(s + c for c in cuts))]
        ids = np.concatenate([ids for ids, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        return Tokenized(ids, tuple(starts), tuple(bounds))


def load_tokenizer(kind: str) -> tuple[Tokenizer, Any]:
    """``word``: the tokenizer-free stand-in; ``model``: SmolLM2's tokenizer and template only;
    ``adapter``: the same through the loaded model (returned second, else None)."""
    if kind == "word":
        return MessageTokenizer(word_encode), None
    if kind == "model":
        from agent.adapters.loading import embedded_text_model_dir
        from agent.adapters.tokenizer import checkpoint_tokenizer

        return TemplateTokenizer(checkpoint_tokenizer(embedded_text_model_dir())), None
    if kind == "adapter":
        from agent.adapters.loading import load_adapter

        adapter = load_adapter()
        return TemplateTokenizer(adapter.tokenizer), adapter
    raise ValueError(f"tokenizer must be word, model or adapter, got {kind!r}")
