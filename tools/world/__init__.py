"""The synthetic video world and the small vision-language model trained on it, in one place.

- ``render.py``: episodes (objects on a 2 x 2 grid, one event per frame), their single- and
  multi-hop questions, and videos of them (``kamera world-video``);
- ``model.py``: the small Qwen2.5-VL, its word-level tokenizer, processor, prompts, evaluation;
- ``batches.py`` and ``train.py``: its training (``kamera train-demo-model``);
- ``world_vl/``: the trained checkpoint (:data:`WORLD_VL_DIR`), shipped as package data; it loads
  with ``AutoProcessor`` and ``Qwen2_5_VLForConditionalGeneration.from_pretrained`` like a
  downloaded Qwen2.5-VL (``kamera serve --model world-vl``, the default of ``kamera video-qa``);
- ``world_vl_long/``: that checkpoint trained further on prompts of up to 48 frames, a video
  stream's window (:data:`WORLD_VL_LONG_DIR`, ``--model world-vl-long``).

Importing this package loads nothing heavy: the modules above import torch and transformers
only when imported themselves.
"""

from __future__ import annotations

from pathlib import Path

WORLD_VL_DIR: Path = Path(__file__).resolve().parent / "world_vl"
WORLD_VL_LONG_DIR: Path = Path(__file__).resolve().parent / "world_vl_long"

__all__ = ["WORLD_VL_DIR", "WORLD_VL_LONG_DIR"]
