"""Adapter for Qwen2.5-VL: text and image chunks under M-RoPE, the vision encoder run once per image.

An image chunk is ``<|vision_start|>``, one ``<|image_pad|>`` per merged patch, ``<|vision_end|>``.
Its positions are 3-D (temporal, height, width) as ``get_rope_index`` lays them out: the start
token at 0, the patches at ``1 + (t, h, w)`` on the merged grid, the end token at
``1 + max(H', W')``; text after it resumes one further on, so the chunk's extent is
``2 + max(H', W')`` while it holds ``H' W' + 2`` tokens.

Positions are always passed explicitly: the model keeps ``rope_deltas`` as state between calls,
which misplaces tokens on a reused cache if left to itself.

Not here: video inputs as one multi-frame chunk (each frame is an image chunk of its own),
Qwen3-VL's interleaved M-RoPE and DeepStack (``qwen3_vl.py``, built on this one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from agent.adapters.base import ChunkInput, ImageInput, TextInput
from agent.adapters.decoder import DecoderAdapter, rope_spec_from_module
from agent.adapters.vision import Content, VisionAdapter, VisionFeatures
from cache.keys import digest_key
from cache.rope import RopeSpec

PREPROCESS_KEYS = (
    "min_pixels",
    "max_pixels",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "image_mean",
    "image_std",
)


def tiny_processor() -> Any:
    """The real Qwen2-VL image processor, sized for small test images (56 to 224 pixels a side)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224)


class QwenVLAdapter(DecoderAdapter, VisionAdapter):
    """Qwen2.5-VL through the same chunk contract as the text models, plus image chunks."""

    def __init__(self, model: Any, processor: Any, name: str, vision_cache_size: int = 4096) -> None:
        self.processor = processor
        self.image_processor = getattr(processor, "image_processor", processor)
        tokenizer = getattr(processor, "tokenizer", None)
        DecoderAdapter.__init__(self, model, tokenizer, name)
        VisionAdapter.__init__(self, vision_cache_size)
        self.vlm = model.model
        self.base = model.model.language_model
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.vision_start_id = int(cfg.vision_start_token_id)
        self.vision_end_id = int(cfg.vision_end_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)

    def _rope_spec(self, text_config: Any) -> RopeSpec:
        section = tuple(text_config.rope_parameters.get("mrope_section", (16, 24, 24)))
        return rope_spec_from_module(
            self.model.model.language_model.rotary_emb, "qwen2_5_vl", mrope_section=section
        )

    @property
    def supports_recompute(self) -> bool:
        """False: the server's repair recomputes by token id, and image rows need their features
        (:meth:`run_layers` itself runs here, on :meth:`embed`'s embeddings)."""
        return False

    # --- inputs -----------------------------------------------------------------------------

    def image(self, image: Image.Image) -> ImageInput:
        """Preprocess one image with the real processor and key it by its pixels and settings."""
        out = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        pixels: torch.Tensor = out["pixel_values"]
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        n = grid[0] * grid[1] * grid[2] // self.merge**2
        ids = torch.tensor([self.vision_start_id] + [self.image_token_id] * n + [self.vision_end_id])
        settings = {k: getattr(self.image_processor, k, None) for k in PREPROCESS_KEYS}
        meta = repr(
            (self.info.fingerprint, grid, tuple(pixels.shape), str(pixels.dtype), sorted(settings.items()))
        ).encode()
        key = digest_key("image-input", [meta, pixels.contiguous().numpy().tobytes()]).hex
        return ImageInput(pixels, (grid[0], grid[1], grid[2]), ids, key, {"size": image.size})

    def pixel_bounds(self) -> tuple[int, int]:
        """The fewest and most pixels the image processor keeps an image at (it resizes into this
        range), read from its ``size`` (``shortest_edge`` / ``longest_edge``, pixel counts) or its
        ``min_pixels`` / ``max_pixels``."""
        ip = self.image_processor
        size = getattr(ip, "size", None)

        def read(*names: str) -> Any:
            for name in names:
                for source in (size, ip):
                    value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
                    if value is not None:
                        return value
            return None

        lo, hi = read("shortest_edge", "min_pixels"), read("longest_edge", "max_pixels")
        if lo is None or hi is None:
            raise ValueError(f"{type(ip).__name__} states no pixel bounds")
        return int(lo), int(hi)

    def chunk_positions(self, chunk: ChunkInput) -> tuple[torch.Tensor, int]:
        if isinstance(chunk, TextInput):
            return torch.arange(chunk.n_tokens, dtype=torch.int64).expand(3, -1).contiguous(), chunk.n_tokens
        t, h, w = chunk.grid_thw
        grid = self.vlm.get_vision_position_ids(1, torch.tensor([t, h, w]), 1, self.merge, 1)
        grid = grid.to(torch.int64).cpu()
        side = max(h, w) // self.merge
        end = torch.full((3, 1), 1 + side, dtype=torch.int64)
        positions = torch.cat([torch.zeros(3, 1, dtype=torch.int64), grid, end], dim=1)
        return positions, 2 + side

    def _position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.to(self.device)[:, None, :]  # [3, batch=1, T]

    def processor_ids(self, content: Content) -> torch.Tensor | None:
        if getattr(self.processor, "chat_template", None) is None or not hasattr(self.processor, "tokenizer"):
            return None
        parts = [{"type": "text", "text": c} if isinstance(c, str) else {"type": "image"} for c in content]
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
        )
        images = [c for c in content if not isinstance(c, str)]
        out = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids: torch.Tensor = out["input_ids"][0]
        return ids

    # --- vision encoder, once per distinct image (the cache: ``vision.py``) -------------------

    def _run_encoder(self, images: Sequence[ImageInput]) -> list[VisionFeatures]:
        pixels = torch.cat([c.pixel_values for c in images]).to(self.device)
        grid = torch.tensor([c.grid_thw for c in images], device=self.device)
        feats = self.vlm.get_image_features(pixels, grid).pooler_output
        return [VisionFeatures(f) for f in feats]

    def _prepare(self, chunks: Sequence[ChunkInput]) -> None:
        self.encode_images(chunks)

    @torch.inference_mode()
    def embed(self, chunk: ChunkInput) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(chunk.ids.to(self.device))
        if isinstance(chunk, ImageInput):
            feats = self.image_features(chunk).to(embeds.dtype)
            mask = chunk.ids.to(self.device) == self.image_token_id
            if int(mask.sum()) != feats.shape[0]:
                raise ValueError(f"image chunk has {int(mask.sum())} pads for {feats.shape[0]} features")
            embeds = embeds.clone()
            embeds[mask] = feats
        return embeds

    @torch.inference_mode()
    def reference_logits(self, chunks: Sequence[ChunkInput], last_only: bool = False) -> torch.Tensor:
        ids = torch.cat([c.ids for c in chunks])[None].to(self.device)
        images = [c for c in chunks if isinstance(c, ImageInput)]
        extra: dict[str, Any] = {}
        if images:
            extra = {
                "pixel_values": torch.cat([c.pixel_values for c in images]).to(self.device),
                "image_grid_thw": torch.tensor([c.grid_thw for c in images], device=self.device),
                "mm_token_type_ids": (ids == self.image_token_id).int(),
            }
        out = self.model(input_ids=ids, logits_to_keep=1 if last_only else 0, **extra)
        return out.logits[0].float()
