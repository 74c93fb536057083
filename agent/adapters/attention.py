"""Prefill attention whose result does not depend on how the prompt was cut, and grouped-query
attention without copying the cache.

**Cut invariance.** A prompt prefilled in one pass and the same prompt prefilled in several
passes (a cached prefix placed, the rest computed after it) must give the same KV bit for bit, or
an exact cache hit is not exact. SDPA's CPU kernel does not: it splits the keys into blocks
whose size depends on how many keys the pass sees (all of them below 512, else 512 at a time) and
takes each query's softmax block by block, so a row's sums depend on where the pass began and
ended. :func:`blocked_forward` computes every query row in a fixed block of ``BLOCK`` rows,
aligned to multiples of ``BLOCK`` in the sequence (and to the pass's own start), against exactly
the keys up to that block's end: one matrix product for the scores, the softmax over whole rows,
one product with the values. A row's block, and so every shape and every sum it goes through,
is the same whether the pass that computed it began at 0 or at any multiple of ``BLOCK`` after
the row's own block began, and whether the prompt goes on after it or not. With the
row-wise layers (norms, projections, MLP: products whose rows do not mix), a prefill cut at
multiples of ``BLOCK`` tokens therefore writes the KV and logits of one pass
(``tests/test_cut_invariance.py``). It costs about what SDPA costs on prompts of a few thousand
tokens (``docs/consistency.md``).

Decode steps (one query row), masks given as additive numbers (selective recompute), sliding
windows, soft caps, attention sinks and non-causal layers (vision towers) go to SDPA as before.

**Grouped heads.** transformers' ``sdpa`` attention uses SDPA's native grouped-query path only
when there is no attention mask; with one (a few new tokens over a cached window always have one)
it repeats every cached key and value head ``groups`` times first: a copy of the whole window per
layer per forward pass. On CPU, SDPA takes the mask and the grouped heads together (same result, checked in
``tests/test_adapters.py``), so this implementation passes ``enable_gqa`` whenever a layer has
grouped heads and leaves everything else to transformers' own function.

Registered as ``kamera_blocked`` (attention and mask interfaces); :class:`DecoderAdapter` switches
a model on the CPU to it when the model uses ``sdpa``.

Not here: anything about which tokens attend where (the model's own mask).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "kamera_blocked"
BLOCK = 128  # query rows per block; a prefill may be cut at any multiple of it
_PLAIN_KWARGS = ("position_bias", "softcap", "sliding_window", "s_aux")


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


def blocked_forward(
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
    """Causal attention of the pass's queries (the last ``Q`` of the ``K`` keys) in blocks of
    ``BLOCK`` rows aligned to the sequence (module docstring); ``[B, Q, H, D_v]``."""
    b, heads, q_len, dim = query.shape
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (
        q_len == 1
        or not causal
        or dropout
        or query.device.type != "cpu"
        or (attention_mask is not None and attention_mask.dtype != torch.bool)
        or kwargs.get("output_attentions", False)
        or any(kwargs.get(name) is not None for name in _PLAIN_KWARGS)
    ):
        return gqa_sdpa_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    kv_heads, k_len, v_dim = key.shape[1], key.shape[2], value.shape[3]
    groups = heads // kv_heads
    offset = k_len - q_len  # the queries are the last q_len keys' tokens
    if offset < 0 or groups * kv_heads != heads:
        raise ValueError(f"attention of {q_len} queries over {k_len} keys, {heads} heads on {kv_heads}")
    scale = scaling if scaling is not None else dim**-0.5
    grouped = query.view(b, kv_heads, groups, q_len, dim)
    out = query.new_empty(b, q_len, kv_heads, groups, v_dim)
    start = offset
    while start < k_len:
        end = min((start // BLOCK + 1) * BLOCK, k_len)
        n, r0 = end - start, start - offset
        # the group's query heads as rows of one product against their shared key head
        # (scaled before the product: the scores, the largest tensor here, are written once less)
        q = grouped[:, :, :, r0 : r0 + n].reshape(b, kv_heads, groups * n, dim) * scale
        scores = torch.matmul(q, key[:, :, :end].transpose(-1, -2))
        rows = scores.view(b, kv_heads, groups, n, end)
        if attention_mask is not None:
            allowed = attention_mask[:, :, r0 : r0 + n, :end]
            rows.masked_fill_(~allowed[:, :, None], float("-inf"))
        else:
            later = torch.ones(n, n, dtype=torch.bool, device=query.device).triu_(1)
            rows[..., start:end].masked_fill_(later, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, value[:, :, :end])
        out[:, r0 : r0 + n] = o.view(b, kv_heads, groups, n, v_dim).permute(0, 3, 1, 2, 4)
        start = end
    return out.view(b, q_len, heads, v_dim), None


AttentionInterface.register(NAME, blocked_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
