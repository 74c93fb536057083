"""Token-selective recompute on a reused cache: the CacheBlend and EPIC ways of repairing KV.

Both start from an assembled context whose KV was reused (each chunk's canonical KV rotated to
its place) and recompute *some tokens* through every layer, each attending to the reused KV of
the tokens that are not recomputed and to the fresh KV of those that are; the fresh K/V replace
the reused at every layer. They differ in which tokens:

- :class:`DeviationSelection` (CacheBlend): run every candidate token through the layers before
  ``layer`` (layer 1 by default: layer 0's KV depends on the token alone, so it is already exact),
  compute their K/V at ``layer``, and keep the ``ratio`` share whose K/V deviates most from the
  reused (squared L2 over heads and dims; ``"v"``, values only, as CacheBlend's code does, or
  ``"kv"``). From ``layer`` on only those tokens run.
- :class:`FixedSelection` (EPIC): a fixed set, e.g. the first k tokens of every chunk but the
  first.

With every token selected both give the full prefill (to float rounding).

The forward runs the model's own decoder layers one by one on just the selected rows, with an
explicit additive mask on absolute positions and a stand-in cache whose ``update`` scatters the
rows' fresh K/V into a copy of the reused layer. It needs a decoder whose layers take
``(hidden, attention_mask=, position_embeddings=, cache=)`` and call ``cache.update(k, v,
layer_idx)`` with post-RoPE ``[1, H_kv, rows, D]`` keys (Llama, Qwen2, Qwen3, Mistral): the GQA
family of :class:`agent.adapters.decoder.DecoderAdapter`.

Not here: where the reused KV comes from, patches (``cache/patch.py``), metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

Deviation = Literal["v", "kv"]


@dataclass(frozen=True)
class DeviationSelection:
    """CacheBlend: recompute the ``ratio`` share of ``candidates`` deviating most at ``layer``.

    candidates: token indices that may be chosen (the reused chunks; a pinned prefix whose KV
    is exact need not be). At least one token is chosen when ``ratio > 0``.
    """

    ratio: float
    candidates: torch.Tensor
    layer: int = 1
    deviation: Deviation = "v"

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must lie in [0, 1], got {self.ratio}")
        if self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")
        if self.deviation not in ("v", "kv"):
            raise ValueError(f"deviation must be 'v' or 'kv', got {self.deviation!r}")

    @property
    def count(self) -> int:
        n = int(self.candidates.numel())
        return min(n, max(1, round(self.ratio * n))) if self.ratio > 0 else 0


@dataclass(frozen=True)
class FixedSelection:
    """EPIC and friends: recompute exactly these token indices."""

    indices: torch.Tensor


Selection = DeviationSelection | FixedSelection


class Recomputed(NamedTuple):
    """k, v: post-RoPE ``[L, H_kv, N, D]`` with the selected tokens' KV recomputed;
    selected: sorted int64 indices of the tokens recomputed past the selection layer."""

    k: torch.Tensor
    v: torch.Tensor
    selected: torch.Tensor


def first_tokens(starts: Sequence[int], lengths: Sequence[int], k: int) -> torch.Tensor:
    """Indices of the first ``k`` tokens of each chunk (``starts`` are indices into the sequence)."""
    parts = [torch.arange(s, s + min(k, n)) for s, n in zip(starts, lengths, strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class _ScatterCache:
    """Stands in for an HF cache during a partial forward.

    ``update(k, v, layer)`` writes the running rows' fresh post-RoPE K/V (``[1, H, rows, D]``)
    into layer ``layer`` of the working K/V at ``rows`` and returns the whole layer, so the rows
    attend to reused KV everywhere else. ``fresh`` keeps the last K/V each layer received.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # [L, H, N, D], modified in place
        self.rows = torch.zeros(0, dtype=torch.int64)
        self.fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.fresh[layer_idx] = (key_states[0], value_states[0])
        self.k[layer_idx][:, self.rows] = key_states[0].to(self.k.dtype)
        self.v[layer_idx][:, self.rows] = value_states[0].to(self.v.dtype)
        return self.k[layer_idx][None], self.v[layer_idx][None]


def _mask(positions: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[1, 1, rows, N]``: row r sees every token at a position <= its own."""
    allowed = positions[None, :] <= positions[rows][:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def selective_recompute(
    adapter: Any,
    ids: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
) -> Recomputed:
    """Recompute the selected tokens of a reused context through every layer.

    adapter: a GQA :class:`~agent.adapters.decoder.DecoderAdapter`. ids: int64 ``[N]``, the
    context's tokens; positions: int64 ``[N]`` absolute positions; k, v: the reused post-RoPE KV
    ``[L, H_kv, N, D]`` (not modified). Returns new tensors.
    """
    if getattr(adapter, "family", None) != "gqa":
        raise TypeError("selective recompute runs on GQA/MHA decoders only")
    n = int(ids.numel())
    if k.shape[2] != n or v.shape[2] != n or positions.shape != ids.shape:
        raise ValueError(f"ids [{n}], positions {tuple(positions.shape)} and KV {tuple(k.shape)} disagree")
    device = adapter.device
    layers = adapter.base.layers[: adapter.info.n_layers]
    cache = _ScatterCache(k.clone().to(device), v.clone().to(device))
    positions = positions.to(device)
    if isinstance(selection, FixedSelection):
        rows, check = selection.indices.to(torch.int64).unique(sorted=True), None
    else:
        rows, check = selection.candidates.to(torch.int64).unique(sorted=True), selection.layer
    rows = rows.to(device)
    hidden = adapter.model.get_input_embeddings()(ids.to(device)[rows][None])
    dtype = hidden.dtype
    for index, layer in enumerate(layers):
        if index == check and isinstance(selection, DeviationSelection):
            rows, hidden = _select(adapter, layer, index, hidden, rows, positions, cache, selection)
        if rows.numel() == 0:
            break
        cache.rows = rows
        pos = positions[rows][None]
        hidden = layer(
            hidden,
            attention_mask=_mask(positions, rows, dtype).to(device),
            position_ids=pos,
            position_embeddings=adapter.base.rotary_emb(hidden, position_ids=pos),
            cache=cache,
            use_cache=True,
        )
    return Recomputed(cache.k, cache.v, rows.cpu())


def _select(
    adapter: Any,
    layer: torch.nn.Module,
    index: int,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    cache: _ScatterCache,
    selection: DeviationSelection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``layer`` on every row once to read their fresh K/V, keep the most deviating rows.

    The layer's working K/V is restored to the reused values for the rows not kept.
    """
    saved_k, saved_v = cache.k[index].clone(), cache.v[index].clone()
    cache.rows = rows
    pos = positions[rows][None]
    layer(
        hidden,
        attention_mask=_mask(positions, rows, hidden.dtype).to(hidden.device),
        position_ids=pos,
        position_embeddings=adapter.base.rotary_emb(hidden, position_ids=pos),
        cache=cache,
        use_cache=True,
    )
    fresh_k, fresh_v = cache.fresh[index]  # [H, rows, D]
    dev = (fresh_v - saved_v[:, rows]).square().sum(dim=(0, 2))
    if selection.deviation == "kv":
        dev = dev + (fresh_k - saved_k[:, rows]).square().sum(dim=(0, 2))
    keep = torch.topk(dev, selection.count).indices.sort().values
    cache.k[index], cache.v[index] = saved_k, saved_v
    return rows[keep], hidden[:, keep]
