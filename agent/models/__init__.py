"""Models shipped inside the package.

``WORLD_VL_DIR`` is a small Qwen2.5-VL checkpoint trained on the synthetic video world
(``demos/world.py``, ``bench/train_world_model.py``); it loads with ``AutoProcessor`` and
``Qwen2_5_VLForConditionalGeneration.from_pretrained`` like a downloaded Qwen2.5-VL.
"""

from __future__ import annotations

from pathlib import Path

WORLD_VL_DIR: Path = Path(__file__).resolve().parent / "world_vl"

__all__ = ["WORLD_VL_DIR"]
