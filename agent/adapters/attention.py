"""Prefill attention whose result does not depend on how the prompt was cut, and grouped-query
attention without copying the cache.

**Cut invariance.** A prompt prefilled in one pass and the same prompt prefilled in several passes
(a cached prefix placed, the rest computed after it) must give the same KV bit for bit, or an exact
cache hit is not exact. SDPA's CPU kernel over a whole pass does not: it tiles the queries and the
keys by sizes chosen from how many the pass holds (keys: all of them below 512, else 512 at a time)
and takes each query's softmax tile by tile, so a row's sums depend on where the pass began and
ended. :func:`blocked_forward` cuts the sequence into fixed blocks of ``BLOCK`` rows aligned to
multiples of ``BLOCK`` and runs SDPA once per block of the pass, always on the whole block:
``BLOCK`` query rows over the keys up to the block's end. Rows of the block the pass does not
compute (before its start, or after the prompt's last token) are stand-ins: zero queries, and zero
keys and values past the last token, which the causal mask hides from every real row; their
results are dropped. A row's result depends on the block's shapes and on the keys it sees, not on
the other rows' values nor on the keys masked from it (the masked scores are exactly zero weights),
so every row goes through the same shapes, tiles and sums in every pass and every prompt that
holds its tokens and those before it. With the row-wise layers (norms, projections, MLP: products
whose rows do not mix, on at least 12 rows, see ``decoder.PASS_MIN_ROWS``), a prefill cut at any
tokens therefore writes the KV and logits of one pass, and the KV of a prompt's first tokens is
the KV any longer prompt that begins with them computes (``tests/test_cut_invariance.py``): exact
reuse may end at any token. What it costs against SDPA over the whole pass: ``kamera bench
prefill-tax`` (``docs/prefill_tax.md``). ``LAYOUT`` names this way of running the blocks in the
numerics of every cache key (``ModelAdapter.namespace``), so KV run another way is never taken as
exact.

Decode steps (one query row outside a prefill pass, :func:`set_prefill`), masks given as additive
numbers (selective recompute), sliding windows, soft caps, attention sinks and non-causal layers
(vision towers) go to SDPA whole.

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

import threading
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "kamera_blocked"
BLOCK = 128  # query rows per block, aligned to multiples of it in the sequence
_PLAIN_KWARGS = ("position_bias", "softcap", "sliding_window", "s_aux")
WHOLE_BLOCKS = True  # every block runs whole, however a pass cuts it (False only to show why)
LAYOUT = f"blocks-of-{BLOCK}-whole"  # part of the numerics: how the blocks were run


_pass = threading.local()


def set_prefill(on: bool) -> None:
    """Whether this thread runs a prefill pass now: a pass of one token is then a block like any
    other (a decode step's one row goes to SDPA whole)."""
    _pass.prefill = on


def numerics_name(implementation: str) -> str:
    """An attention implementation as the numerics name it: this module's with its ``LAYOUT``."""
    return f"{implementation}/{LAYOUT}" if implementation == NAME else implementation


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
        (q_len == 1 and not getattr(_pass, "prefill", False))
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
        lo = start // BLOCK * BLOCK if WHOLE_BLOCKS else start
        end = min(start // BLOCK * BLOCK + BLOCK, k_len)
        n, r0 = end - start, start - offset
        # every block runs whole, BLOCK rows over the keys up to its end, wherever the pass began
        # or the prompt ends: rows before the pass's start and after the last key are stand-ins
        # (zero queries; zero keys and values that no real row sees), dropped after. A row's
        # result depends on the block's shapes and on the keys it sees, not on the other rows or
        # the keys masked from it, so it is the same in every pass and every prompt that holds
        # its tokens and those before it (module docstring)
        lead, trail = start - lo, (lo + BLOCK - end) if WHOLE_BLOCKS else 0
        rows = query[:, :, r0 : r0 + n]
        keys, values = key[:, :, :end], value[:, :, :end]
        if attention_mask is not None:
            allowed = attention_mask[:, :, r0 : r0 + n, :end]
        else:  # row i of the block (sequence index start + i) sees the keys up to its own
            allowed = torch.ones(n, end, dtype=torch.bool, device=query.device).tril_(start)
        if lead or trail:
            width = end + trail
            d_q = rows.shape[-1]
            stand_ins = rows.new_zeros(b, heads, lead, d_q), rows.new_zeros(b, heads, trail, d_q)
            rows = torch.cat([stand_ins[0], rows, stand_ins[1]], dim=2)
            if trail:
                keys = torch.cat([keys, keys.new_zeros(b, kv_heads, trail, keys.shape[-1])], dim=2)
                values = torch.cat([values, values.new_zeros(b, kv_heads, trail, v_dim)], dim=2)
            whole = torch.ones(lead + n + trail, width, dtype=torch.bool, device=query.device).tril_(lo)
            if allowed.dim() == 4:
                whole = whole.expand(*allowed.shape[:2], *whole.shape).clone()
            whole[..., lead : lead + n, :end] = allowed
            whole[..., lead : lead + n, end:] = False
            allowed = whole
        # one SDPA call per block: its shapes, and so its tiles and sums, are the block's own
        o = torch.nn.functional.scaled_dot_product_attention(
            rows, keys, values, attn_mask=allowed, scale=scaling, enable_gqa=groups > 1
        )
        out[:, r0 : r0 + n] = o[:, :, lead : lead + n].transpose(1, 2)
        start = end
    return out, None


AttentionInterface.register(NAME, blocked_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
