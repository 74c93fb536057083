"""The vision-language model the video and web demos run, and the error both commands report.

``load_vl_adapter``: a Qwen2.5-VL checkpoint folder, by default the embedded world model
(``tools/world/world_vl``), or ``tiny`` (random weights with the byte tokenizer, for tests).

Not here: any prompt layout (``video_session.py``, ``web_agent.py``).
"""

from __future__ import annotations

from pathlib import Path

from agent.adapters.base import ModelAdapter, TextInput
from agent.adapters.loading import ModelNotFoundError, UnsupportedModelError, load_adapter
from agent.adapters.qwen_vl import QwenVLAdapter
from agent.byte_tokenizer import ByteTokenizer
from tools.world import WORLD_VL_DIR

TINY = "tiny"


class UsageError(ValueError):
    """A command-line value that cannot work (bad time, budget too small for one frame)."""


def default_model_dir() -> Path:
    """``tools/world/world_vl`` when it holds weights; otherwise a clear error."""
    if any(WORLD_VL_DIR.glob("*.safetensors")) and (WORLD_VL_DIR / "config.json").is_file():
        return WORLD_VL_DIR
    raise ModelNotFoundError(
        f"no --model given and {WORLD_VL_DIR} holds no weights yet (train it with "
        "'kamera train-demo-model'); pass --model PATH to a Qwen2.5-VL checkpoint folder, "
        f"or --model {TINY} for a random-weight test model"
    )


def load_vl_adapter(model: str | None) -> ModelAdapter:
    """A vision-language adapter: a checkpoint folder, the default world model, or ``tiny``."""
    if model == TINY:
        from agent.adapters.tiny import tiny_adapter

        adapter = tiny_adapter("qwen2.5-vl")
        adapter.tokenizer = ByteTokenizer()
        return adapter
    adapter = load_adapter(str(default_model_dir() if model is None else model))
    if not hasattr(adapter, "image"):
        raise UnsupportedModelError(f"{adapter.info.name} ({adapter.info.architecture}) takes no images")
    return adapter


def fresh_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """The same weights behind a new adapter: an empty vision feature cache, its own counters."""

    if not isinstance(adapter, QwenVLAdapter):
        raise TypeError(f"no fresh copy for {type(adapter).__name__}")
    copy = QwenVLAdapter(adapter.model, adapter.processor, adapter.info.name)
    copy.tokenizer = adapter.tokenizer
    return copy


def encode_text(adapter: ModelAdapter, text: str) -> TextInput:
    return adapter.text(adapter.tokenizer(text, add_special_tokens=False)["input_ids"])
