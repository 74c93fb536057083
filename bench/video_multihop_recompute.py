"""CacheBlend and EPIC on a Qwen2.5-VL context: ``agent/recompute.py`` run through an M-RoPE view.

``selective_recompute`` was written for text decoders: it embeds token ids, builds its causal
mask by comparing 1-D positions, and asks the rotary module for 1-D positions. A Qwen2.5-VL
context breaks all three: image tokens enter as vision features, not as the embedding of
``<|image_pad|>``; positions are 3-D (temporal, height, width), and inside an image or after it
they do not grow with the sequence index, so they cannot order the mask. :class:`MRopeView`
hands ``selective_recompute`` the *sequence index* in place of both the token id and the
position: the index orders the causal mask (which is what the model's own forward does), the
view's embedding looks the index up in the context's input embeddings, and its rotary module
looks it up in the 3-D positions. The decoder layers are the model's own.

Not here: choosing tokens (``agent/recompute.py``), where the reused KV comes from.
"""

from __future__ import annotations

from typing import Any

import torch

from agent.recompute import Recomputed, Selection, selective_recompute


class _Lookup(torch.nn.Module):
    """An embedding whose "token ids" are sequence indices into precomputed input embeddings."""

    def __init__(self, embeds: torch.Tensor) -> None:
        super().__init__()
        self.embeds = embeds  # [N, hidden]

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.embeds[index]


class _Rotary(torch.nn.Module):
    """The model's M-RoPE module, addressed by sequence index: ``[1, rows]`` to ``[3, 1, rows]``."""

    def __init__(self, rotary: torch.nn.Module, positions: torch.Tensor) -> None:
        super().__init__()
        self.rotary, self.positions = rotary, positions  # positions: [3, N]

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        return self.rotary(hidden, position_ids=self.positions[:, position_ids[0]][:, None])


class _Model:
    def __init__(self, embeds: torch.Tensor) -> None:
        self._embed = _Lookup(embeds)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._embed


class _Base:
    def __init__(self, layers: Any, rotary: torch.nn.Module) -> None:
        self.layers, self.rotary_emb = layers, rotary


class MRopeView:
    """What ``selective_recompute`` reads of an adapter, for one Qwen2.5-VL context.

    adapter: a :class:`~agent.adapters.qwen_vl.QwenVLAdapter`; embeds: the context's input
    embeddings ``[N, hidden]`` (vision features at image tokens); positions: int64 ``[3, N]``.
    """

    family = "gqa"

    def __init__(self, adapter: Any, embeds: torch.Tensor, positions: torch.Tensor) -> None:
        self.info = adapter.info
        self.device = adapter.device
        self.model = _Model(embeds.to(self.device))
        self.base = _Base(adapter.base.layers, _Rotary(adapter.base.rotary_emb, positions.to(self.device)))


def recompute_mrope(
    adapter: Any,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
) -> Recomputed:
    """``selective_recompute`` on a Qwen2.5-VL context.

    embeds: ``[N, hidden]``; positions: int64 ``[3, N]``; k, v: reused post-RoPE
    ``[L, H_kv, N, D]`` (not modified). ``selection`` indexes tokens by their sequence index.
    """
    n = int(embeds.shape[0])
    if positions.shape != (3, n):
        raise ValueError(f"positions must be [3, {n}], got {tuple(positions.shape)}")
    index = torch.arange(n, dtype=torch.int64)
    return selective_recompute(MRopeView(adapter, embeds, positions), index, index, k, v, selection)
