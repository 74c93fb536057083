"""The vision-language model the video and web demos run, and the error both commands report.

``load_vl_adapter``: a Qwen2.5-VL checkpoint folder, by default the embedded world model
(``tools/world/world_vl``), or ``tiny`` (random weights with the byte tokenizer, for tests).

Not here: any prompt layout (``video_session.py``, ``web_agent.py``).
"""

from __future__ import annotations

from pathlib import Path

from agent.adapters.base import ModelAdapter, TextInput
from agent.adapters.loading import ModelNotFoundError, UnsupportedModelError, load_adapter
from agent.adapters.vision import VisionAdapter
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
    spec = model if model == TINY else str(default_model_dir() if model is None else model)
    adapter = load_adapter(spec, tokenizer=ByteTokenizer())
    if not isinstance(adapter, VisionAdapter):
        raise UnsupportedModelError(f"{adapter.info.name} ({adapter.info.architecture}) takes no images")
    return adapter


def fresh_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """The same weights behind a new adapter: an empty vision feature cache, its own counters."""
    if not isinstance(adapter, VisionAdapter):
        raise TypeError(f"no fresh copy for {type(adapter).__name__}")
    return adapter.fresh()


def encode_text(adapter: ModelAdapter, text: str) -> TextInput:
    return adapter.text(adapter.tokenizer(text, add_special_tokens=False)["input_ids"])
