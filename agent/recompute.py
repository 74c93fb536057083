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

The forward runs through the adapter's hooks (:meth:`~agent.adapters.base.ModelAdapter.embed`,
:meth:`~agent.adapters.base.ModelAdapter.run_layers`, ``layer_kv``): the model's own decoder
layers on just the selected rows, each row attending by sequence index (as the model's own
forward does: under M-RoPE positions do not order tokens), the rows' fresh K/V written in place
into the cache's layers. :func:`recompute_into` repairs a model cache that way without copying
the context; :func:`selective_recompute` works on ``[L, H, N, D]`` buffers and returns new ones.
Inputs are token ids ``[N]``, or input embeddings ``[N, hidden]`` for a context with images
(``adapter.embed`` of each chunk: vision features at image tokens).

Not here: where the reused KV comes from, patches (``cache/patch.py``), metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from agent.adapters.base import ModelAdapter, ModelCache

Deviation = Literal["v", "kv"]


@dataclass(frozen=True)
class DeviationSelection:
    """CacheBlend: recompute the ``ratio`` share of ``candidates`` deviating most at ``layer``.

    candidates: token indices that may be chosen (the reused chunks; a pinned prefix whose KV
    is exact need not be). At least one token is chosen when ``ratio > 0``. max_ratio and
    target_residual: the choice grows past ``ratio``, most deviating first, until the deviation
    it leaves (:class:`Repaired`) is at most ``target_residual`` or it holds the ``max_ratio``
    share (default: ``ratio``, no growth): a piece barely touched by its new context pays the
    least, one bound to new neighbours pays more before anything is given up. max_residual: when
    the deviation the choice would leave exceeds it, nothing runs past the selection layer (the
    repair is given up: what it would leave is too far to use). pays: asked, once the choice is
    made, with the deviation it would leave and the tokens it keeps; False gives the repair up
    there as well (going on would cost more than it saves).
    """

    ratio: float
    candidates: torch.Tensor
    layer: int = 1
    deviation: Deviation = "v"
    max_residual: float = float("inf")
    max_ratio: float | None = None
    target_residual: float = 0.0
    pays: Callable[[float, int], bool] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must lie in [0, 1], got {self.ratio}")
        if self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")
        if self.deviation not in ("v", "kv"):
            raise ValueError(f"deviation must be 'v' or 'kv', got {self.deviation!r}")
        if not self.max_residual >= 0.0:
            raise ValueError(f"max_residual must be >= 0, got {self.max_residual}")
        if self.max_ratio is not None and not self.ratio <= self.max_ratio <= 1.0:
            raise ValueError(f"max_ratio must lie in [ratio, 1] = [{self.ratio}, 1], got {self.max_ratio}")
        if not self.target_residual >= 0.0:
            raise ValueError(f"target_residual must be >= 0, got {self.target_residual}")

    @property
    def count(self) -> int:
        """Tokens chosen at least (the ``ratio`` share)."""
        return self._share(self.ratio)

    @property
    def most(self) -> int:
        """Tokens chosen at most (the ``max_ratio`` share)."""
        return self._share(self.ratio if self.max_ratio is None else self.max_ratio)

    def _share(self, ratio: float) -> int:
        n = int(self.candidates.numel())
        return min(n, max(1, round(ratio * n))) if ratio > 0 else 0

    def choose(self, dev: torch.Tensor, energy: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The candidates kept (a bool mask over ``dev``, each candidate's deviation at the
        selection layer) and the residual they leave: the fewest from :attr:`count` up to
        :attr:`most`, most deviating first, that leave at most ``target_residual`` of
        ``energy`` (all :attr:`most` when none do)."""
        order = torch.argsort(dev.double(), descending=True)
        taken = torch.cumsum(dev.double()[order], 0)
        # left[k]: the deviation left when the k most deviating are kept, k = 0..n
        left = (taken[-1] - torch.cat([taken.new_zeros(1), taken])).clamp_min(0.0)
        left = left / float(energy.double().clamp_min(1e-30))
        lo, hi = self.count, self.most
        within = torch.nonzero(left[lo : hi + 1] <= self.target_residual)
        k = lo + int(within[0]) if within.numel() else hi
        keep = torch.zeros(dev.numel(), dtype=torch.bool)
        keep[order[:k].cpu()] = True
        return keep, float(left[k])


@dataclass(frozen=True)
class FixedSelection:
    """EPIC and friends: recompute exactly these token indices."""

    indices: torch.Tensor


Selection = DeviationSelection | FixedSelection


class Recomputed(NamedTuple):
    """k, v: post-RoPE ``[L, H_kv, N, D]`` with the selected tokens' KV recomputed;
    selected: sorted int64 indices of the tokens recomputed past the selection layer;
    residual: see :class:`Repaired`."""

    k: torch.Tensor
    v: torch.Tensor
    selected: torch.Tensor
    residual: float = 0.0


class Repaired(NamedTuple):
    """tokens: how many ran through every layer. residual: the deviation a
    :class:`DeviationSelection` measured at its layer and left in the candidates it did not
    recompute, over the energy of their fresh K/V there (squared L2, values or keys and values as
    it measures): how far from this context the reused KV still is (0 for a fixed selection).
    given_up: nothing ran past the selection layer, the choice refused (``max_residual``, ``pays``).
    depth: how the recomputed tokens' deviation grew past the selection layer: their values'
    squared deviation over their fresh values' energy, averaged over the later layers, divided by
    the same at the selection layer. The layer-1 residual counts what a
    change of context does to the first layers; a change that alters what the text means (turns
    removed, passages reordered) moves the later layers much further than one that alters a few
    tokens (a clock), and this ratio, read off the rows repair recomputed anyway, says which
    (None where not measured: nothing recomputed past the selection layer, or no deviation there)."""

    tokens: int
    residual: float
    given_up: bool = False
    depth: float | None = None


def first_tokens(starts: Sequence[int], lengths: Sequence[int], k: int) -> torch.Tensor:
    """Indices of the first ``k`` tokens of each chunk (``starts`` are indices into the sequence)."""
    parts = [torch.arange(s, s + min(k, n)) for s, n in zip(starts, lengths, strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def recompute_into(
    adapter: ModelAdapter,
    cache: ModelCache,
    inputs: torch.Tensor,
    positions: torch.Tensor,
    selection: Selection,
    order: torch.Tensor | None = None,
) -> Repaired:
    """Recompute the selected tokens of the context ``cache`` holds, in place.

    inputs: int64 token ids ``[N]`` or float input embeddings ``[N, hidden]`` of the context;
    positions: int64 absolute positions ``[N]`` (``[3, N]`` under M-RoPE). At every layer the
    recomputed tokens' KV in ``cache`` is replaced; from the selection layer on, the others'
    is left as it was (the selection layer restores the rows it tried but did not keep).
    Returns how many tokens ran through every layer and the deviation left (none ran past the
    selection layer when it exceeds the selection's ``max_residual``). ``order``: the sequence
    index of every cached token where the cache does not hold them in order (a window's arena;
    ``ModelAdapter.run_layers``). Raises TypeError for a model whose layers cannot run on rows
    (MLA), ValueError for inputs that disagree with the cache.
    """
    rows, residual, given_up, depth = _recompute(adapter, cache, inputs, positions, selection, order)
    return Repaired(int(rows.numel()), residual, given_up, depth)


@torch.inference_mode()
def selective_recompute(
    adapter: ModelAdapter,
    inputs: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
) -> Recomputed:
    """Recompute the selected tokens of a reused context through every layer.

    inputs: int64 token ids ``[N]`` or input embeddings ``[N, hidden]``; positions: int64
    ``[N]`` (``[3, N]`` under M-RoPE) absolute positions; k, v: the reused post-RoPE KV
    ``[L, H_kv, N, D]`` (not modified: the work runs on one copy of them). Returns new tensors.
    """
    _check_family(adapter)
    n = int(inputs.shape[0])
    if k.shape[2] != n or v.shape[2] != n:
        raise ValueError(f"inputs [{n}], positions {tuple(positions.shape)} and KV {tuple(k.shape)} disagree")
    device = adapter.device
    k, v = k.to(device, copy=True), v.to(device, copy=True)
    selected, residual, _, _ = _recompute(adapter, adapter.new_cache([(k, v)]), inputs, positions, selection)
    return Recomputed(k, v, selected, residual)


@torch.inference_mode()
def measure_residual(
    adapter: ModelAdapter,
    cache: ModelCache,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    layer: int = 1,
    deviation: Deviation = "v",
    order: torch.Tensor | None = None,
) -> float:
    """How far the KV ``cache`` holds at ``rows`` is from what its context computes there:
    CacheBlend's signal at ``layer`` (:class:`DeviationSelection`), the rows' squared deviation
    over the energy of their fresh K/V, measured and nothing kept. ``hidden``: the rows' input
    embeddings ``[R, hidden]``; positions: theirs (``[R]``, ``[3, R]`` under M-RoPE); rows:
    sorted int64 cache indices; ``order``: the sequence index of every cached token where the
    cache does not hold them in order (``ModelAdapter.run_layers``). The cache is left bit for
    bit as it was. Raises TypeError for a model whose layers cannot run on rows."""
    _check_family(adapter)
    if rows.numel() == 0:
        return 0.0
    device_rows = rows.to(adapter.device)
    saved = []
    for i in range(layer + 1):  # the layers the rows run through write their fresh KV
        k_layer, v_layer = adapter.layer_kv(cache, i)
        saved.append((k_layer[:, device_rows], v_layer[:, device_rows]))
    try:
        x = hidden.to(adapter.device)
        if layer > 0:
            x = adapter.run_layers(x, rows, positions, cache, range(layer), order=order).hidden
        fresh = adapter.run_layers(x, rows, positions, cache, range(layer, layer + 1), order=order)
    finally:
        for i, (k_rows, v_rows) in enumerate(saved):
            k_layer, v_layer = adapter.layer_kv(cache, i)
            k_layer.index_copy_(1, device_rows, k_rows)
            v_layer.index_copy_(1, device_rows, v_rows)
    reused_k, reused_v = saved[layer]
    dev = (fresh.v - reused_v).double().square().sum()
    energy = fresh.v.double().square().sum()
    if deviation == "kv":
        dev = dev + (fresh.k - reused_k).double().square().sum()
        energy = energy + fresh.k.double().square().sum()
    return float(dev / energy.clamp_min(1e-30))


def _check_family(adapter: ModelAdapter) -> None:
    if adapter.family != "gqa":
        raise TypeError("selective recompute runs on GQA/MHA decoders only")


@torch.inference_mode()
def _recompute(
    adapter: ModelAdapter,
    cache: ModelCache,
    inputs: torch.Tensor,
    positions: torch.Tensor,
    selection: Selection,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float, bool, float | None]:
    """The sorted indices of the tokens recomputed through every layer (on the CPU), the
    deviation left in the others, whether the choice was refused and how the recomputed rows'
    deviation grew past the selection layer (:class:`Repaired`)."""
    _check_family(adapter)
    n = adapter.cache_length(cache)
    if inputs.shape[0] != n or positions.shape[-1] != n or positions.dim() > 2:
        shapes = f"inputs {tuple(inputs.shape)}, positions {tuple(positions.shape)}"
        raise ValueError(f"{shapes} and a cache of {n} tokens disagree")
    n_layers = adapter.info.n_layers
    if isinstance(selection, FixedSelection):
        rows = selection.indices.to(torch.int64).unique(sorted=True)
        check = n_layers  # no selection layer: every row runs every layer
    else:
        rows, check = selection.candidates.to(torch.int64).unique(sorted=True), selection.layer
    if rows.numel() == 0:
        return rows, 0.0, False, None
    hidden = _embed_rows(adapter, inputs, rows)
    if check >= n_layers or not isinstance(selection, DeviationSelection):
        adapter.run_layers(hidden, rows, positions[..., rows], cache, range(n_layers), order=order)
        return rows, 0.0, False, None
    if check > 0:
        hidden = adapter.run_layers(
            hidden, rows, positions[..., rows], cache, range(check), order=order
        ).hidden
    # the selection layer: every candidate once, its fresh KV against the reused; the rows not
    # kept get their reused KV back, the kept ones run the layer again from its input (now
    # attending to the reused KV of the others) and on through the last
    k_layer, v_layer = adapter.layer_kv(cache, check)
    device_rows = rows.to(k_layer.device)
    saved_k, saved_v = k_layer[:, device_rows], v_layer[:, device_rows]  # [H, C, D] copies
    fresh = adapter.run_layers(
        hidden, rows, positions[..., rows], cache, range(check, check + 1), order=order
    )
    dev = (fresh.v - saved_v).square().sum(dim=(0, 2))
    energy = fresh.v.square().sum()
    if selection.deviation == "kv":
        dev = dev + (fresh.k - saved_k).square().sum(dim=(0, 2))
        energy = energy + fresh.k.square().sum()
    keep, residual = selection.choose(dev, energy)
    given_up = residual > selection.max_residual or (
        selection.pays is not None and not selection.pays(residual, int(keep.sum()))
    )
    if given_up:  # every row gets its reused KV back here
        keep[:] = False
    drop = (~keep).to(k_layer.device)
    k_layer.index_copy_(1, device_rows[drop], saved_k[:, drop])
    v_layer.index_copy_(1, device_rows[drop], saved_v[:, drop])
    kept = keep.to(fresh.v.device)
    at_check = _relative(fresh.v[:, kept], saved_v[:, kept])
    rows, hidden = rows[keep], hidden[keep.to(hidden.device)]
    depth: float | None = None
    if rows.numel():
        later = range(check + 1, n_layers)
        kept_rows = device_rows[keep.to(device_rows.device)]
        reused = [adapter.layer_kv(cache, i)[1][:, kept_rows] for i in later]  # copies
        adapter.run_layers(hidden, rows, positions[..., rows], cache, range(check, n_layers), order=order)
        if at_check > 0.0 and len(later):
            after = [
                _relative(adapter.layer_kv(cache, i)[1][:, kept_rows], old)
                for i, old in zip(later, reused, strict=True)
            ]
            depth = sum(after) / len(after) / at_check
    return rows, residual, given_up, depth


def _relative(fresh: torch.Tensor, reused: torch.Tensor) -> float:
    """Squared deviation of ``reused`` from ``fresh`` over ``fresh``'s energy (0 for no rows)."""
    energy = float(fresh.double().square().sum())
    return float((fresh.double() - reused.double()).square().sum()) / energy if energy > 0 else 0.0


def _embed_rows(adapter: ModelAdapter, inputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Input embeddings ``[R, hidden]`` of the rows: looked up for token ids, taken for embeddings."""
    if inputs.is_floating_point():
        return inputs[rows.to(inputs.device)].to(adapter.device)
    return adapter.embed_ids(inputs[rows])
