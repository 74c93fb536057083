"""Grouped-query attention without copying the cache: SDPA's ``enable_gqa`` on CPU.

transformers' ``sdpa`` attention uses SDPA's native grouped-query path only when there is no
attention mask; with one (a few new tokens over a cached window always have one) it repeats
every cached key and value head ``groups`` times first: a copy of the whole window per layer per
forward pass. On CPU, SDPA takes the mask and the grouped heads together (same result, checked in
``tests/test_adapters.py``), so this implementation passes ``enable_gqa`` whenever a layer has
grouped heads and leaves everything else to transformers' own function.

Registered as ``kamera_sdpa`` (attention and mask interfaces); :class:`DecoderAdapter` switches a
model on the CPU to it when the model uses ``sdpa``.

Not here: anything about which tokens attend where (the model's own mask).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "kamera_sdpa"


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    groups = int(getattr(module, "num_key_value_groups", 1))
    plain = (
        groups == 1
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
