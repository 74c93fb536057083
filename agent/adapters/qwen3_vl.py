"""Adapter for Qwen3-VL: interleaved M-RoPE and DeepStack features, through the Qwen2.5-VL contract.

What differs from Qwen2.5-VL (``qwen_vl.py``), read from transformers' ``modeling_qwen3_vl``:

- **Interleaved M-RoPE.** The text rotary module recomposes its frequencies so that frequency
  ``j`` reads the height axis when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, the width
  axis when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, and the temporal axis otherwise
  (``RopeSpec(mrope_interleaved=True)``); pairing stays split-half. Positions are laid out as
  in Qwen2.5-VL (vision start at 0, patches at ``1 + (t, h, w)``, end at ``1 + max(H', W')``),
  so a chunk's extent and its relocation by δ on all three axes are the same.
- **DeepStack.** Besides the merged-patch embeddings that replace the image's pad tokens, the
  vision encoder returns one feature map per ``deepstack_visual_indexes`` entry; the text model
  adds map ``i`` to the hidden states of the image's pad tokens after decoder layer ``i``. The
  adapter keeps those maps in the feature cache with the embeddings and passes them (with the
  pad-token mask) to every forward it runs, so an image chunk's KV equals a full prefill's and
  the encoder still runs once per image.
- Patches are 16 pixels (32 per merged token), and the processor normalises to mean 0.5.

Selective recompute (:meth:`run_layers`) is refused: DeepStack features would have to enter
the image rows between layers, and the rows' embeddings alone do not carry them.

Not here: video inputs (Qwen3-VL's timestamped video frames); each frame is an image chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agent.adapters.base import ChunkInput, ImageInput, LayerRun, ModelCache
from agent.adapters.decoder import rope_spec_from_module
from agent.adapters.qwen_vl import QwenVLAdapter
from agent.adapters.vision import VisionFeatures
from cache.rope import RopeSpec

VOCAB = 512


class Qwen3VLAdapter(QwenVLAdapter):
    """Qwen3-VL (``Qwen3VLForConditionalGeneration``): text and image chunks."""

    def _rope_spec(self, text_config: Any) -> RopeSpec:
        rope = text_config.rope_parameters
        return rope_spec_from_module(
            self.model.model.language_model.rotary_emb,
            "qwen3_vl",
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
            mrope_interleaved=True,  # its rotary module always interleaves
        )

    def _run_encoder(self, images: Sequence[ImageInput]) -> list[VisionFeatures]:
        pixels = torch.cat([c.pixel_values for c in images]).to(self.device)
        grid = torch.tensor([c.grid_thw for c in images], device=self.device)
        out = self.vlm.get_image_features(pixels, grid)
        # pooler_output: one [N_i, hidden] per image; deepstack_features: per layer, one per image
        per_layer = out.deepstack_features or []
        return [
            VisionFeatures(embeds, tuple(layer[i] for layer in per_layer))
            for i, embeds in enumerate(out.pooler_output)
        ]

    def _forward_kwargs(self, chunks: Sequence[ChunkInput]) -> dict[str, Any]:
        """``visual_pos_masks [1, T]`` (the pad tokens of every image among ``chunks``, which
        run as one sequence) and ``deepstack_visual_embeds``: per DeepStack layer, the images'
        maps in order, ``[n_pads, hidden]``."""
        images = [c for c in chunks if isinstance(c, ImageInput)]
        if not images:
            return {}
        feats = [self.vision_features(c) for c in images]
        mask = torch.cat([c.ids for c in chunks]).to(self.device) == self.image_token_id
        depth = len(feats[0].deepstack)
        stacks = [torch.cat([f.deepstack[i] for f in feats]) for i in range(depth)]
        return {"visual_pos_masks": mask[None], "deepstack_visual_embeds": stacks}

    def run_layers(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        cache: ModelCache,
        layers: range,
        order: torch.Tensor | None = None,
    ) -> LayerRun:
        raise TypeError("Qwen3-VL: selective recompute cannot carry DeepStack features into image rows")


def tiny_processor() -> Any:
    """The Qwen2-VL image processor with Qwen3-VL's settings (16-pixel patches, merge 2, mean and
    std 0.5), sized for small test images (64 to 256 pixels a side)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=64 * 64,
        max_pixels=256 * 256,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def qwen3_vl_config(**text: Any) -> Any:
    """A small random-weight Qwen3-VL: 3 decoder layers (GQA 4/2 heads, head_dim 16), interleaved
    M-RoPE over 8 frequencies, a 2-block vision encoder whose both blocks feed DeepStack (so
    its maps enter after decoder layers 0 and 1)."""
    from transformers import Qwen3VLConfig

    text_config = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        "eos_token_id": 1,
        "bos_token_id": 0,
        **text,
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": [0, 1],
    }
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=VOCAB - 3,
        video_token_id=VOCAB - 4,
        vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1,
    )


def tiny_qwen3_vl(dtype: torch.dtype = torch.float32) -> Qwen3VLAdapter:
    """A random-weight Qwen3-VL (the caller seeds torch) wrapped in its adapter."""
    from transformers import Qwen3VLForConditionalGeneration

    model: Any = Qwen3VLForConditionalGeneration(qwen3_vl_config())
    model = model.to(dtype).eval()
    return Qwen3VLAdapter(model, tiny_processor(), name="tiny-qwen3-vl")
