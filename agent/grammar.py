"""Constrained decoding: a grammar becomes a mask over the vocabulary, applied before sampling.

The engine is llguidance (chosen over xgrammar for its mask time, see docs/server.md):
grammars are Lark text in which a JSON schema can stand for a rule (``%json{...}``), so a
tool call's wrapper and its arguments' schema are one grammar.
:class:`GrammarEngine` holds the tokenizer's token table (built once per model, about 0.4 s for
SmolLM2's 49,152 tokens); :meth:`GrammarEngine.constraint` compiles one request's grammar into a
:class:`Constraint`, the per-request matcher the decoder asks for a mask and feeds each token.

JSON is generated in one layout (``", "`` and ``": "``, no newlines): a small model given free
whitespace can spend its whole budget on it.

Not here: which grammar a request gets (``server/structured.py``, ``policies.py``) or how the
mask meets the logits (``server/generation.py``, ``ModelAdapter.generate``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from agent.adapters.base import ModelAdapter
from agent.adapters.tokenizer import is_fast_tokenizer

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or a JSON schema the engine cannot compile (the message says why)."""


def lark_string(text: str) -> str:
    """A Lark string literal matching ``text`` exactly."""
    return json.dumps(text, ensure_ascii=False)


def schema_rule(schema: dict[str, Any], lenient: bool = False) -> str:
    """A Lark rule body for JSON valid under ``schema``, in the fixed layout. ``lenient``
    ignores keywords the engine does not know instead of refusing them."""
    schema = copy.deepcopy(schema)
    schema["x-guidance"] = {**JSON_LAYOUT, **({"lenient": True} if lenient else {})}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def json_schema_grammar(schema: dict[str, Any], strict: bool) -> str:
    """JSON valid under ``schema``; with ``strict`` an unsupported keyword is a GrammarError."""
    return f"start: {schema_rule(schema, lenient=not strict)}\n"


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A packed int32 bitmask ``[ceil(V / 32)]`` (bit ``i % 32`` of word ``i // 32`` is token i)
    as a bool tensor ``[vocab]``; tokens past the mask's end are not allowed."""
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    flat = bits.reshape(-1).bool()
    if flat.numel() >= vocab:
        return flat[:vocab]
    return torch.cat([flat, torch.zeros(vocab - flat.numel(), dtype=torch.bool)])


class Constraint:
    """One generation under a grammar. ``allowed`` is the mask for the next token; ``advance``
    takes the chosen token (which must be allowed); ``finished`` once the grammar is complete
    and allows nothing more but an end token."""

    def __init__(self, matcher: llguidance.LLMatcher, table_size: int) -> None:
        self._matcher = matcher
        self._mask = llguidance.torch.allocate_token_bitmask(1, table_size)

    def allowed(self, vocab: int) -> torch.Tensor:
        """bool ``[vocab]``: the tokens that keep the output inside the grammar (ids the
        tokenizer does not have, e.g. the padding of a model's vocabulary, are never allowed)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._mask)
        return unpack_bitmask(self._mask[0], vocab)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} is outside the grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


class GrammarEngine:
    """The token table of one tokenizer, shared by every request's :class:`Constraint`."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], vocab: int) -> None:
        """GrammarError if llguidance cannot read the tokenizer (e.g. a word-level one)."""
        eos = sorted(eos_ids)
        self.vocab = vocab
        try:
            if is_fast_tokenizer(tokenizer):
                self._tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
            else:
                table = llguidance.TokenizerWrapper(_ByteTable(tokenizer, eos[0]))
                self._tok = llguidance.LLTokenizer(table, n_vocab=vocab, eos_token=eos)
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"no grammar support for this model's tokenizer: {e}") from None

    @classmethod
    def for_adapter(cls, adapter: ModelAdapter) -> GrammarEngine:
        """The engine of a model adapter's tokenizer, end tokens and vocabulary (its embedding
        rows, which may pad the tokenizer's)."""
        return cls(adapter.tokenizer, adapter.eos_ids, adapter.vocab_size)

    def constraint(self, grammar: str) -> Constraint:
        """Compile ``grammar`` (Lark, see :func:`json_schema_grammar`); GrammarError if it fails."""
        matcher = llguidance.LLMatcher(self._tok, llguidance.LLMatcher.grammar_from_lark(grammar))
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return Constraint(matcher, self._tok.vocab_size)

    def check(self, grammar: str) -> None:
        """Raise GrammarError if ``grammar`` does not compile (cheap: no mask is computed)."""
        problem = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_lark(grammar), self._tok
        )
        if problem:
            raise GrammarError(_first_line(problem))


class _ByteTable:
    """llguidance's view of a byte tokenizer (the tiny models' ``ByteTokenizer`` classes): UTF-8
    bytes as consecutive ids from an offset, named specials (``specials`` or ``SPECIAL``) below or
    above them, everything else unused. Any other kind of tokenizer is a GrammarError."""

    def __init__(self, tokenizer: Any, eos: int) -> None:
        self._tokenizer = tokenizer
        offset = self(b"A")[0] - ord("A")
        if self("\u00ff")[:2] != [offset + 0xC3, offset + 0xBF]:
            raise GrammarError(f"no grammar support for the tokenizer {type(tokenizer).__name__}")
        named = getattr(tokenizer, "specials", None) or getattr(tokenizer, "SPECIAL", {})
        specials: dict[int, str] = {i: s for s, i in named.items()}
        n = 1 + max([*specials, offset + 255])
        self.tokens: Sequence[bytes] = [
            specials[i].encode()
            if i in specials
            else bytes([i - offset])
            if offset <= i < offset + 256
            else f"<unused {i}>".encode()
            for i in range(n)
        ]
        self.special_token_ids = [i for i in range(n) if not offset <= i < offset + 256]
        self.eos_token_id = eos
        self.bos_token_id = None

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return [int(i) for i in self._tokenizer(text, add_special_tokens=False)["input_ids"]]


def _first_line(message: str) -> str:
    """llguidance's errors go on to quote the whole grammar; the first line says what is wrong."""
    return message.strip().splitlines()[0] if message.strip() else "the grammar does not compile"
