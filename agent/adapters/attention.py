"""Prefill attention whose result does not depend on how the prompt was cut, and grouped-query
attention without copying the cache.

**Cut invariance.** A prompt prefilled in one pass and the same prompt prefilled in several passes
(a cached prefix placed, the rest computed after it) must give the same KV bit for bit, or an exact
cache hit is not exact. SDPA's CPU kernel over a whole pass does not: it tiles the queries and the
keys by sizes chosen from how many the pass holds (keys: all of them below 512, else 512 at a time)
and takes each query's softmax tile by tile, so a row's sums depend on where the pass began and
ended. :func:`blocked_forward` cuts the pass's queries into fixed blocks of ``BLOCK`` rows, aligned
to multiples of ``BLOCK`` in the sequence (and to the pass's own start), and runs SDPA once per
block, over exactly the keys up to the block's end. A row's block, and so every shape, tile and sum
it goes through, is the same whether the pass that computed it began at 0 or at any multiple of
``BLOCK`` up to the row's own block, and whether the prompt goes on after it or not. A pass that
begins inside a block (after a prefix placed to the token) runs that block whole, the rows before
its start as stand-ins whose results are dropped, so its rows too go through their one-pass shapes.
With the row-wise layers (norms, projections, MLP: products whose rows do not mix, on at least 12
rows, see ``decoder.PASS_MIN_ROWS``), a prefill cut at multiples of ``BLOCK`` tokens therefore
writes the KV and logits of one pass (``tests/test_cut_invariance.py``). What it costs against SDPA
over the whole pass: ``kamera bench prefill-tax`` (``docs/prefill_tax.md``).

Decode steps (one query row), masks given as additive numbers (selective recompute), sliding
windows, soft caps, attention sinks and non-causal layers (vision towers) go to SDPA whole.

**Grouped heads.** transformers' ``sdpa`` attention uses SDPA's native grouped-query path only
when there is no attention mask; with one (a few new tokens over a cached window always have one)
it repeats every cached key and value head ``groups`` times first: a copy of the whole window per
layer per forward pass. On CPU, SDPA takes the mask and the grouped heads together (same result,
checked in ``tests/test_adapters.py``), so both paths here pass ``enable_gqa`` whenever a layer
has grouped heads.

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
PAD_PARTIAL_BLOCKS = True  # run a block that a pass begins inside whole (False only to show why)


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
    b, heads, q_len, _ = query.shape
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
    out = query.new_empty(b, q_len, heads, v_dim)
    start = offset
    while start < k_len:
        end = min((start // BLOCK + 1) * BLOCK, k_len)
        n, r0 = end - start, start - offset
        # a pass that begins inside a block (after a prefix placed to the token) runs the block
        # whole: the rows before its start are stand-ins, so the block's shapes, tiles and sums
        # are those of a pass that began at the block's edge (a row's result does not depend on
        # the values of the other rows, only on the shapes; the stand-ins are dropped)
        lead = start % BLOCK if PAD_PARTIAL_BLOCKS else 0
        rows = query[:, :, r0 : r0 + n]
        if attention_mask is not None:
            allowed = attention_mask[:, :, r0 : r0 + n, :end]
        else:  # row i of the block (sequence index start + i) sees the keys up to its own
            allowed = torch.ones(n, end, dtype=torch.bool, device=query.device).tril_(start)
        if lead:
            rows = torch.cat([rows.new_zeros(b, heads, lead, rows.shape[-1]), rows], dim=2)
            stand_in = torch.ones(lead, end, dtype=torch.bool, device=query.device).tril_(start - lead)
            if allowed.dim() == 4:
                stand_in = stand_in.expand(*allowed.shape[:2], lead, end)
            allowed = torch.cat([stand_in, allowed], dim=-2)
        # one SDPA call per block: its shapes, and so its tiles and sums, are the block's own
        o = torch.nn.functional.scaled_dot_product_attention(
            rows,
            key[:, :, :end],
            value[:, :, :end],
            attn_mask=allowed,
            scale=scaling,
            enable_gqa=groups > 1,
        )
        out[:, r0 : r0 + n] = o[:, :, lead:].transpose(1, 2)
        start = end
    return out, None


AttentionInterface.register(NAME, blocked_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
