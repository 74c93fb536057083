"""Small random-weight models of real transformers classes, one per attention family.

They exercise the exact code paths of the full-size architectures (the same modules, caches and
rotary embeddings) at a size that runs in milliseconds on a CPU. Used by tests and benchmarks;
their outputs mean nothing. Load one with ``load_adapter("tiny:<family>")`` (``loading.py``);
``BUILDERS`` names the families.

Not here: anything with real weights (``loading.py``), Qwen3-VL's config (``qwen3_vl.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agent.adapters.base import ModelAdapter

VOCAB = 512


def _llama(**kw: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=kw.pop("kv_heads", 2),
        head_dim=16,
        max_position_embeddings=65536,
        eos_token_id=1,
        bos_token_id=0,
        **kw,
    )
    return LlamaForCausalLM(cfg)


def _neox() -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=65536,
        eos_token_id=1,
        bos_token_id=0,
    )
    return GPTNeoXForCausalLM(cfg)


def _deepseek(yarn: bool) -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        }
    cfg = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=192,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=4096 if yarn else 65536,
        rope_parameters=rope,
        eos_token_id=1,
        bos_token_id=0,
    )
    return DeepseekV2ForCausalLM(cfg)


def qwen2_5_vl_config(**text: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    text_config = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 65536,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
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
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=VOCAB - 3,
        video_token_id=VOCAB - 4,
        vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1,
    )


def _decoder(model: Any, name: str) -> ModelAdapter:
    from agent.adapters.decoder import DecoderAdapter

    return DecoderAdapter(model, tokenizer=None, name=name)


def _qwen2_5_vl(dtype: torch.dtype) -> ModelAdapter:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from agent.adapters.qwen_vl import QwenVLAdapter, tiny_processor

    model: Any = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config())
    model = model.to(dtype).eval()
    return QwenVLAdapter(model, tiny_processor(), name="tiny-qwen2.5-vl")


def _qwen3_vl(dtype: torch.dtype) -> ModelAdapter:
    from agent.adapters.qwen3_vl import tiny_qwen3_vl

    return tiny_qwen3_vl(dtype)


def _text(build: Callable[[], Any], name: str) -> Callable[[torch.dtype], ModelAdapter]:
    return lambda dtype: _decoder(build().to(dtype).eval(), f"tiny-{name}")


BUILDERS: dict[str, Callable[[torch.dtype], ModelAdapter]] = {
    "llama-gqa": _text(lambda: _llama(kv_heads=2), "llama-gqa"),
    "llama-mha": _text(lambda: _llama(kv_heads=6), "llama-mha"),
    "neox-partial": _text(_neox, "neox-partial"),
    "deepseek-mla": _text(lambda: _deepseek(yarn=False), "deepseek-mla"),
    "deepseek-mla-yarn": _text(lambda: _deepseek(yarn=True), "deepseek-mla-yarn"),
    "qwen2.5-vl": _qwen2_5_vl,
    "qwen3-vl": _qwen3_vl,
}
VISION_FAMILIES = frozenset({"qwen2.5-vl", "qwen3-vl"})
DEFAULT_FAMILY = "qwen2.5-vl"  # what plain "tiny" names: the family that takes text and images


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelAdapter:
    """A random-weight model of ``family`` (seeded) wrapped in its adapter."""
    if family not in BUILDERS:
        raise ValueError(f"unknown tiny model {family!r}; choose from {sorted(BUILDERS)}")
    torch.manual_seed(seed)
    return BUILDERS[family](dtype)
