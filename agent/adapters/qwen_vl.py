"""Adapter for Qwen2.5-VL: text and image chunks under M-RoPE, the vision encoder run once per image.

An image chunk is ``<|vision_start|>``, one ``<|image_pad|>`` per merged patch, ``<|vision_end|>``.
Its positions are 3-D (temporal, height, width) as ``get_rope_index`` lays them out: the start
token at 0, the patches at ``1 + (t, h, w)`` on the merged grid, the end token at
``1 + max(H', W')``; text after it resumes one further on, so the chunk's extent is
``2 + max(H', W')`` while it holds ``H' W' + 2`` tokens.

Positions are always passed explicitly: the model keeps ``rope_deltas`` as state between calls,
which misplaces tokens on a reused cache if left to itself.

Not here: video inputs as one multi-frame chunk (each frame is an image chunk of its own) and
Qwen3-VL (its deepstack features enter several decoder layers, which a chunk's KV alone does not
capture).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from agent.adapters.base import ChunkInput, ImageInput, TextInput
from agent.adapters.decoder import DecoderAdapter, rope_spec_from_module
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


class QwenVLAdapter(DecoderAdapter):
    """Qwen2.5-VL through the same chunk contract as the text models, plus image chunks."""

    def __init__(self, model: Any, processor: Any, name: str, vision_cache_size: int = 4096) -> None:
        self.processor = processor
        self.image_processor = getattr(processor, "image_processor", processor)
        tokenizer = getattr(processor, "tokenizer", None)
        super().__init__(model, tokenizer, name)
        self.vlm = model.model
        self.base = model.model.language_model
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.vision_start_id = int(cfg.vision_start_token_id)
        self.vision_end_id = int(cfg.vision_end_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self._features: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._features_max = vision_cache_size
        self.vision_encoder_calls = 0

    def _rope_spec(self, text_config: Any) -> RopeSpec:
        section = tuple(text_config.rope_parameters.get("mrope_section", (16, 24, 24)))
        return rope_spec_from_module(
            self.model.model.language_model.rotary_emb, "qwen2_5_vl", mrope_section=section
        )

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

    # --- vision encoder, once per distinct image ----------------------------------------------

    def clear_vision_cache(self) -> None:
        """Forget every cached image feature (the next prefill of each image runs the encoder)."""
        self._features.clear()

    def encode_images(self, chunks: Sequence[ChunkInput]) -> int:
        """Run the vision encoder once over every image among ``chunks`` whose features are not
        cached (one batch: the encoder keeps images apart); returns how many it encoded."""
        todo: dict[str, ImageInput] = {}
        for c in chunks:
            if isinstance(c, ImageInput) and c.content_key not in self._features:
                todo.setdefault(c.content_key, c)
        if len(todo) <= 1:
            for c in todo.values():
                self.image_features(c)
            return len(todo)
        pixels = torch.cat([c.pixel_values for c in todo.values()]).to(self.device)
        grid = torch.tensor([c.grid_thw for c in todo.values()], device=self.device)
        with torch.inference_mode():
            feats = self.vlm.get_image_features(pixels, grid).pooler_output
        for key, f in zip(todo, feats, strict=True):
            self.vision_encoder_calls += 1
            self._features[key] = f
        while len(self._features) > max(self._features_max, len(todo)):
            self._features.popitem(last=False)
        return len(todo)

    def _prepare(self, chunks: Sequence[ChunkInput]) -> None:
        self.encode_images(chunks)

    def image_features(self, chunk: ImageInput) -> torch.Tensor:
        """Merged-patch embeddings ``[N, hidden]``; the encoder runs only on a cache miss."""
        hit = self._features.get(chunk.content_key)
        if hit is not None:
            self._features.move_to_end(chunk.content_key)
            return hit
        grid = torch.tensor([chunk.grid_thw], device=self.device)
        with torch.inference_mode():
            out = self.vlm.get_image_features(chunk.pixel_values.to(self.device), grid)
        feats = out.pooler_output[0]
        self.vision_encoder_calls += 1
        self._features[chunk.content_key] = feats
        if len(self._features) > self._features_max:
            self._features.popitem(last=False)
        return feats

    def _embed(self, chunk: ChunkInput) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(chunk.ids.to(self.device)[None])
        if isinstance(chunk, ImageInput):
            feats = self.image_features(chunk).to(embeds.dtype)
            mask = chunk.ids.to(self.device) == self.image_token_id
            if int(mask.sum()) != feats.shape[0]:
                raise ValueError(f"image chunk has {int(mask.sum())} pads for {feats.shape[0]} features")
            embeds = embeds.clone()
            embeds[0, mask] = feats
        return embeds
