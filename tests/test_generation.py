"""Incremental detokenisation (``TextStream``) against decoding every token again at each push."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.byte_tokenizer import ByteTokenizer
from agent.engine.generation import TextStream

PIECES = ["hello", " world", "é", "日本", "🙂", " .", ",", "\n", "  ", "END", "<|im_end|>"]
STOPS: list[tuple[str, ...]] = [(), ("END",), (" .", "日"), ("\n\n",)]


class FullDecodeStream:
    """The slow, obvious stream: every push decodes all the tokens so far."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.emitted, self.text, self.stopped = 0, "", False

    def push(self, token: int) -> str:
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for s in self.stop if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._take(len(self.text))
        safe = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):
            safe = min(safe, len(self.text) - 1)
        return self._take(safe)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out


def streamed(stream: Any, tokens: Sequence[int]) -> tuple[list[str], str, bool]:
    out = []
    for t in tokens:
        out.append(stream.push(t))
        if stream.stopped:
            break
    out.append(stream.flush())
    return out, stream.text, stream.stopped


def assert_same_as_full_decode(tokenizer: Any, tokens: Sequence[int], stop: tuple[str, ...]) -> None:
    want = streamed(FullDecodeStream(tokenizer, stop), tokens)
    assert streamed(TextStream(tokenizer, stop), tokens) == want
    if not want[2]:
        assert want[1] == tokenizer.decode(list(tokens), skip_special_tokens=True)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=30),
    cut=st.integers(0, 3),
    stop=st.sampled_from(STOPS),
)
def test_byte_stream_emits_what_a_full_decode_at_every_token_emits(
    pieces: list[str], cut: int, stop: tuple[str, ...]
) -> None:
    tok = ByteTokenizer()
    tokens = tok.encode("".join(pieces))
    assert_same_as_full_decode(tok, tokens[: len(tokens) - cut], stop)  # may end inside a character


def test_bpe_stream_emits_what_a_full_decode_at_every_token_emits() -> None:
    """SmolLM2's byte-level BPE: tokens that hold part of a character, or several."""
    from agent.adapters.loading import SMOLLM2, cache_dir

    folder = cache_dir() / "models" / SMOLLM2
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"no SmolLM2 tokenizer at {folder}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    for trial in range(120):
        if trial % 2:  # arbitrary ids: byte fragments, special tokens
            tokens = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        else:
            text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
            tokens = tok(text, add_special_tokens=False)["input_ids"]
        assert_same_as_full_decode(tok, tokens, rng.choice(STOPS))


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.decoded = 0  # token ids handed to decode, over all calls

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def test_a_push_decodes_the_new_tokens_not_the_whole_answer() -> None:
    tok = CountingTokenizer()
    tokens = tok.encode("é日🙂 and some words " * 20)  # 500 tokens, characters of 1 to 4
    stream = TextStream(tok, ["STOP"])
    for t in tokens:
        stream.push(t)
    # every push decoding all tokens so far would hand decode 500 * 501 / 2 ids
    assert tok.decoded <= 5 * len(tokens)
    stream.flush()
    assert stream.text == tok.decode(tokens)
