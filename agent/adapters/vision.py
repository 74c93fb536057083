"""The contract of a model that takes images: preprocessing, an encoder run once per image.

A :class:`VisionAdapter` is a :class:`~agent.adapters.base.ModelAdapter` that also turns a PIL
image into an :class:`~agent.adapters.base.ImageInput` chunk and keeps a feature cache keyed by
the chunk's content key, so the vision encoder runs once per distinct image however often the
image is prefilled, moved or recalled; ``vision_encoder_calls`` counts the images it encoded.
Callers test ``isinstance(adapter, VisionAdapter)`` (or read :func:`encoder_calls`).

Not here: how a model encodes (``_run_encoder`` of each adapter), video inputs.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Self

import torch
from PIL import Image

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter

Content = Sequence[str | Image.Image]


class VisionFeatures(NamedTuple):
    """One image's encoder output: ``embeds [N, hidden]``, one row per merged patch, which
    replace its pad tokens' input embeddings; ``deepstack``: per early decoder layer, ``[N,
    hidden]`` features added to the image rows' hidden states after that layer (Qwen3-VL's
    DeepStack; empty for models without)."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


class VisionAdapter(ModelAdapter):
    """A model adapter that takes image chunks, with a bounded LRU cache of their features."""

    image_token_id: int

    def __init__(self, vision_cache_size: int = 4096) -> None:
        if vision_cache_size < 0:
            raise ValueError(f"vision_cache_size must be >= 0, got {vision_cache_size}")
        self._features: OrderedDict[str, VisionFeatures] = OrderedDict()
        self._features_max = vision_cache_size
        self.vision_encoder_calls = 0

    # --- what each model says ---------------------------------------------------------------

    @abstractmethod
    def image(self, image: Image.Image) -> ImageInput:
        """Preprocess one image with the model's processor; its content key covers the pixels
        and every preprocessing setting."""

    @abstractmethod
    def pixel_bounds(self) -> tuple[int, int]:
        """The fewest and most pixels the processor keeps an image at (it resizes into this range)."""

    @abstractmethod
    def processor_ids(self, content: Content) -> torch.Tensor | None:
        """Token ids ``[T]`` of one user turn of ``content`` (text and images, in order) with the
        generation prompt, as the model's own processor and chat template lay it out; None when
        the processor has no chat template."""

    @abstractmethod
    def _run_encoder(self, images: Sequence[ImageInput]) -> list[VisionFeatures]:
        """Run the vision encoder once over ``images`` (one batch; it keeps images apart)."""

    # --- the feature cache ------------------------------------------------------------------

    def fresh(self, vision_cache_size: int | None = None) -> Self:
        """Another adapter on the same weights, with an empty feature cache of its own (of
        ``vision_cache_size`` entries, by default this one's; 0 keeps nothing past the batch
        being prefilled) and its own counter."""
        other = copy.copy(self)
        size = self._features_max if vision_cache_size is None else vision_cache_size
        VisionAdapter.__init__(other, size)
        return other

    def clear_vision_cache(self) -> None:
        """Forget every cached image feature (the next prefill of each image runs the encoder)."""
        self._features.clear()

    def encode_images(self, chunks: Sequence[ChunkInput]) -> int:
        """Run the vision encoder once over every image among ``chunks`` whose features are not
        cached (in one batch when there are several, which then stay cached until they are
        prefilled whatever the cache's size); returns how many it encoded."""
        todo: dict[str, ImageInput] = {}
        for c in chunks:
            if isinstance(c, ImageInput) and c.content_key not in self._features:
                todo.setdefault(c.content_key, c)
        if len(todo) <= 1:
            for c in todo.values():
                self.vision_features(c)
            return len(todo)
        with torch.inference_mode():
            feats = self._run_encoder(list(todo.values()))
        for key, f in zip(todo, feats, strict=True):
            self.vision_encoder_calls += 1
            self._features[key] = f
        while len(self._features) > max(self._features_max, len(todo)):
            self._features.popitem(last=False)
        return len(todo)

    def vision_features(self, chunk: ImageInput) -> VisionFeatures:
        """The image's features; the encoder runs only on a cache miss."""
        hit = self._features.get(chunk.content_key)
        if hit is not None:
            self._features.move_to_end(chunk.content_key)
            return hit
        with torch.inference_mode():
            (feats,) = self._run_encoder([chunk])
        self.vision_encoder_calls += 1
        self._features[chunk.content_key] = feats
        if len(self._features) > self._features_max:
            self._features.popitem(last=False)
        return feats

    def image_features(self, chunk: ImageInput) -> torch.Tensor:
        """Merged-patch embeddings ``[N, hidden]`` (:attr:`VisionFeatures.embeds`)."""
        return self.vision_features(chunk).embeds


def encoder_calls(adapter: ModelAdapter) -> int:
    """Images the adapter's vision encoder has encoded so far (0 for a text-only model)."""
    return adapter.vision_encoder_calls if isinstance(adapter, VisionAdapter) else 0
