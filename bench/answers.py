"""Text to token ids and back, and answers scored against gold ones (SQuAD normalisation).

Not here: prompts (each benchmark lays out its own).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from agent.byte_tokenizer import ByteTokenizer


class Codec:
    """Text to ids and back: the model's tokenizer, or bytes (:class:`ByteTokenizer`) for the tiny
    random models, which ship none."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def normalize_answer(s: str) -> str:
    """SQuAD: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(pred: str, golds: Sequence[str]) -> float:
    return float(any(normalize_answer(pred) == normalize_answer(g) for g in golds))


def token_f1(pred: str, golds: Sequence[str]) -> float:
    best = 0.0
    p = normalize_answer(pred).split()
    for g in golds:
        t = normalize_answer(g).split()
        common = sum((Counter(p) & Counter(t)).values())
        if common:
            prec, rec = common / len(p), common / len(t)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best
