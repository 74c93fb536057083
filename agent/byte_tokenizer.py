"""A tokenizer for models that ship none (the tiny random-weight models): UTF-8 bytes plus ChatML.

Ids: 0 bos, 1 ``<|im_end|>`` (the tiny models' end token), 2 ``<|im_start|>``, 3 unused, and
4..259 the bytes 0..255. The tiny models' vocabulary is 512, so ids 260 and up (the tiny
Qwen2.5-VL's vision tokens among them) are never produced from text.

It has the parts of a Hugging Face tokenizer that the runtime calls: ``tok(text)["input_ids"]``,
``encode``, ``decode`` (bytes outside 4..259 are dropped), ``get_vocab`` (what the grammar
engine builds its token table from) and ``chat_template`` (None: callers fall back to ChatML).

Not here: any trained model's tokenizer (the world model ships its own word-level one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar


class ByteTokenizer:
    """UTF-8 bytes as token ids 4..259, plus ChatML's two markers; for the tiny random models."""

    chat_template = None
    specials: ClassVar[dict[str, int]] = {"<|im_start|>": 2, "<|im_end|>": 1}
    _split = re.compile("(<\\|im_start\\|>|<\\|im_end\\|>)")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.specials:
                ids.append(self.specials[part])
            else:
                ids.extend(b + 4 for b in part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - 4 for i in ids if 4 <= i < 260)
        return data.decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(b): b + 4 for b in range(256)}, **self.specials}
