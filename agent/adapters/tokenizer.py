"""A checkpoint's tokenizer, and whether a tokenizer is one of transformers' fast tokenizers.

Code outside ``agent/adapters`` (the grammar engine, the benchmarks) needs these two facts about
tokenizers; asking here keeps every import of transformers inside the adapters
(``docs/ARCHITECTURE.md``, who may import whom).

Not here: loading a model (``loading.py``), the byte tokenizer of the tiny models
(``agent/byte_tokenizer.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def checkpoint_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a local checkpoint folder, as transformers' ``AutoTokenizer`` loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def is_fast_tokenizer(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a transformers ``PreTrainedTokenizerFast`` (which llguidance reads
    directly)."""
    from transformers import PreTrainedTokenizerFast

    return isinstance(tokenizer, PreTrainedTokenizerFast)
