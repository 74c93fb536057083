"""A lower bound on a text's token count from its length, so an oversized prompt is refused untokenized.

No token of a vocabulary decodes to more characters (or UTF-8 bytes) than its own string has:
byte-level BPE strings hold one character per byte, SentencePiece's ``▁`` is one space, byte
fallback ``<0x41>`` is one byte. So a text of ``c`` characters and ``b`` bytes has at least
``max(c / chars_per_token, b / bytes_per_token)`` tokens, where those are the longest vocabulary
string's length in characters and in bytes (special tokens included; a byte-level BPE string
has one character per byte). A normalizer may shrink a
text before tokenization (NFC composes at most 4 code points into one), so a tokenizer with one
gets that factor of slack. ``len`` is O(1); the byte count costs one encode, done only when the
character bound did not already decide.

The same bound read the other way bounds a prompt's JSON: a text of ``n`` tokens has at most
``n * bytes_per_token`` UTF-8 bytes, and JSON spends at most :data:`JSON_ESCAPE_BYTES` bytes on
each (a control byte is ``\\u001f``; a character of k bytes written as ``\\uXXXX`` escapes takes
at most 3k), so its JSON string takes at most ``n * json_bytes_per_token`` bytes.

Not here: the exact count (``runtime.py`` tokenizes off the model thread and counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NORMALIZER_SLACK = 4
JSON_ESCAPE_BYTES = 6  # the most bytes JSON writes for one UTF-8 byte of a string


@dataclass(frozen=True)
class TokenBound:
    """chars_per_token / bytes_per_token: the most characters / bytes one token stands for."""

    chars_per_token: int
    bytes_per_token: int

    def __post_init__(self) -> None:
        if self.chars_per_token < 1 or self.bytes_per_token < 1:
            raise ValueError("chars_per_token and bytes_per_token must be at least 1")

    @property
    def json_bytes_per_token(self) -> int:
        """The most bytes of a JSON string (escapes included) one token's text can take."""
        return JSON_ESCAPE_BYTES * self.bytes_per_token

    @classmethod
    def of(cls, tokenizer: Any) -> TokenBound | None:
        """The bound of a tokenizer with a ``get_vocab``; None when it has none (no shortcut)."""
        get_vocab = getattr(tokenizer, "get_vocab", None)
        if get_vocab is None:
            return None
        vocab = list(get_vocab())
        if not vocab:
            return None
        slack = NORMALIZER_SLACK if _normalizes(tokenizer) else 1
        chars = max(len(t) for t in vocab)
        nbytes = (
            chars if _byte_level(tokenizer) else max(len(t.encode("utf-8", "surrogatepass")) for t in vocab)
        )
        return cls(chars * slack, nbytes * slack)

    def min_tokens(self, texts: Sequence[str], over: int) -> int:
        """A lower bound on the tokens of ``texts`` tokenized one by one; exact enough to compare
        with ``over``: bytes are counted only while the characters alone stay at or under it."""
        chars = sum(len(t) for t in texts)
        bound = -(-chars // self.chars_per_token)
        if bound > over:
            return bound
        nbytes = sum(len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts)
        return max(bound, -(-nbytes // self.bytes_per_token))


def _byte_level(tokenizer: Any) -> bool:
    # A byte-level BPE vocabulary spells each byte as one character (space is "Ġ", two UTF-8 bytes).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _normalizes(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and backend.normalizer is not None
