"""Random-weight Qwen2.5-VL models at the widths of the published checkpoints, cut to a few blocks.

A machine without a real checkpoint's weights can still time its vision tower and its LLM block
by block: every width here is the published ``config.json`` value, only the depth is cut, and the
weights are random (their values do not change the time of a dense float32 pass). The model is
the real transformers class, run through :class:`~agent.adapters.qwen_vl.QwenVLAdapter`.
:func:`block_groups` names the blocks whose time scales with depth, for any Qwen2.5-VL adapter
(so that a timing of a cut model can be scaled to the real depths).

Not here: real weights (``loading.py``), timing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from agent.adapters.qwen_vl import QwenVLAdapter

# the block kinds whose count a cut changes: vision blocks with window attention, vision blocks
# with full attention, LLM decoder layers
VISION_WINDOW, VISION_FULL, LLM = "vision_window", "vision_full", "llm"


@dataclass(frozen=True)
class VLWidths:
    """A Qwen2.5-VL's sizes, named after their ``config.json`` keys where they differ."""

    name: str
    hidden: int  # text hidden_size
    intermediate: int  # text intermediate_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    layers: int  # num_hidden_layers
    vocab: int  # vocab_size
    tie_embeddings: bool  # tie_word_embeddings
    mrope_section: tuple[int, int, int]  # rope_scaling.mrope_section
    rope_theta: float
    vision_depth: int  # vision_config.depth
    vision_hidden: int  # vision_config.hidden_size
    vision_intermediate: int  # vision_config.intermediate_size
    vision_heads: int  # vision_config.num_heads
    patch_size: int
    spatial_merge: int  # spatial_merge_size
    temporal_patch: int  # temporal_patch_size
    window_size: int  # pixels a side of a window-attention window
    fullatt_blocks: tuple[int, ...]  # fullatt_block_indexes
    min_pixels: int  # preprocessor_config.json
    max_pixels: int

    def __post_init__(self) -> None:
        sizes = (self.hidden, self.intermediate, self.heads, self.kv_heads, self.layers, self.vocab)
        vision = (self.vision_depth, self.vision_hidden, self.vision_intermediate, self.vision_heads)
        if min(*sizes, *vision, self.patch_size, self.spatial_merge, self.temporal_patch) <= 0:
            raise ValueError(f"{self.name}: every size must be positive")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: hidden must divide by heads and heads by kv_heads")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"{self.name}: mrope_section must sum to head_dim / 2 = {self.head_dim // 2}")
        if self.vision_hidden % self.vision_heads:
            raise ValueError(f"{self.name}: vision_hidden must divide by vision_heads")
        if any(not 0 <= i < self.vision_depth for i in self.fullatt_blocks):
            raise ValueError(f"{self.name}: fullatt_blocks must lie in [0, {self.vision_depth})")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"{self.name}: need 0 < min_pixels <= max_pixels")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def depths(self) -> dict[str, int]:
        """Blocks of each kind (:data:`VISION_WINDOW`, :data:`VISION_FULL`, :data:`LLM`)."""
        full = len(set(self.fullatt_blocks))
        return {VISION_WINDOW: self.vision_depth - full, VISION_FULL: full, LLM: self.layers}

    def cut(self, vision_blocks: int, layers: int) -> VLWidths:
        """The same widths with ``vision_blocks`` vision blocks and ``layers`` LLM layers, keeping
        one block of each attention kind the full depth has (full attention last)."""
        real = self.depths
        kinds = (real[VISION_WINDOW] > 0) + (real[VISION_FULL] > 0)
        if vision_blocks < kinds or layers < 1:
            raise ValueError(f"{self.name}: a cut keeps at least {kinds} vision blocks and 1 layer")
        if real[VISION_WINDOW] == 0:
            full: tuple[int, ...] = tuple(range(vision_blocks))
        else:
            full = (vision_blocks - 1,) if real[VISION_FULL] else ()
        return replace(self, vision_depth=vision_blocks, layers=layers, fullatt_blocks=full)


# Qwen/Qwen2.5-VL-3B-Instruct, config.json and preprocessor_config.json
QWEN2_5_VL_3B = VLWidths(
    name="qwen2.5-vl-3b",
    hidden=2048,
    intermediate=11008,
    heads=16,
    kv_heads=2,
    layers=36,
    vocab=151936,
    tie_embeddings=True,
    mrope_section=(16, 24, 24),
    rope_theta=1e6,
    vision_depth=32,
    vision_hidden=1280,
    vision_intermediate=3420,
    vision_heads=16,
    patch_size=14,
    spatial_merge=2,
    temporal_patch=2,
    window_size=112,
    fullatt_blocks=(7, 15, 23, 31),
    min_pixels=3136,
    max_pixels=12845056,
)

# Qwen/Qwen2.5-VL-7B-Instruct, config.json and preprocessor_config.json: the same vision tower
# (its merger projects to 3584), a wider and shallower LLM with untied embeddings
QWEN2_5_VL_7B = replace(
    QWEN2_5_VL_3B,
    name="qwen2.5-vl-7b",
    hidden=3584,
    intermediate=18944,
    heads=28,
    kv_heads=4,
    layers=28,
    vocab=152064,
    tie_embeddings=False,
)

PUBLISHED: dict[str, VLWidths] = {"3b": QWEN2_5_VL_3B, "7b": QWEN2_5_VL_7B}


def config(widths: VLWidths) -> Any:
    """The transformers ``Qwen2_5_VLConfig`` of ``widths``; the special token ids sit at the end
    of the vocabulary (their values do not matter to a random-weight model)."""
    from transformers import Qwen2_5_VLConfig

    v = widths.vocab
    text = {
        "vocab_size": v,
        "hidden_size": widths.hidden,
        "intermediate_size": widths.intermediate,
        "num_hidden_layers": widths.layers,
        "num_attention_heads": widths.heads,
        "num_key_value_heads": widths.kv_heads,
        "max_position_embeddings": 128000,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": widths.rope_theta,
            "mrope_section": list(widths.mrope_section),
        },
        "tie_word_embeddings": widths.tie_embeddings,
        "bos_token_id": v - 5,
        "eos_token_id": v - 5,
    }
    vision = {
        "depth": widths.vision_depth,
        "hidden_size": widths.vision_hidden,
        "intermediate_size": widths.vision_intermediate,
        "num_heads": widths.vision_heads,
        "out_hidden_size": widths.hidden,
        "patch_size": widths.patch_size,
        "spatial_merge_size": widths.spatial_merge,
        "temporal_patch_size": widths.temporal_patch,
        "window_size": widths.window_size,
        "fullatt_block_indexes": list(widths.fullatt_blocks),
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=v - 3,
        video_token_id=v - 4,
        vision_start_token_id=v - 2,
        vision_end_token_id=v - 1,
        tie_word_embeddings=widths.tie_embeddings,
    )


def build(widths: VLWidths, seed: int = 0) -> QwenVLAdapter:
    """A random-weight (seeded) float32 Qwen2.5-VL of ``widths`` on the CPU, in its adapter, with
    the real image processor at the checkpoint's pixel bounds."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config(widths)).eval()
    processor = Qwen2VLImageProcessor(
        min_pixels=widths.min_pixels,
        max_pixels=widths.max_pixels,
        patch_size=widths.patch_size,
        temporal_patch_size=widths.temporal_patch,
        merge_size=widths.spatial_merge,
    )
    return QwenVLAdapter(model, processor, name=f"random-{widths.name}")


def block_groups(adapter: QwenVLAdapter) -> dict[str, list[torch.nn.Module]]:
    """The blocks of each kind in a Qwen2.5-VL adapter's model (vision blocks split by their
    attention, as the model's ``fullatt_block_indexes`` says; the LLM's decoder layers)."""
    visual = adapter.vlm.visual
    full = set(adapter.model.config.vision_config.fullatt_block_indexes)
    blocks = list(visual.blocks)
    return {
        VISION_WINDOW: [b for i, b in enumerate(blocks) if i not in full],
        VISION_FULL: [b for i, b in enumerate(blocks) if i in full],
        LLM: list(adapter.base.layers),
    }
