"""Orbit patches: one conditioning patch per chunk that serves every order of a reorderable set.

A chunk's Δ depends on which chunks precede it. When a set of chunks may be shown in any order,
we measure each chunk's Δ under a few sampled orderings and fit one patch to all of them:

- ``mean``: the rank-m factorisation of the mean Δ. Over the sampled orderings it is the
  optimal single rank-m patch for the summed squared residual, since
  ``Σ_i ||Δ_i - P||² = n ||mean(Δ) - P||² + const``.
- ``stacked``: the feature basis from the orderings' stacked Δs (the leading eigenvectors of
  ``mean_i Δ_iᵀ Δ_i``), then ``U = mean(Δ) V``. Slightly worse on the fitted orderings, it
  keeps directions every ordering shares, which can serve unseen orderings better.

:func:`holdout` says how well a patch fitted on some orderings serves the others.

Not here: running a model under an ordering (``agent/``), the single-context fit
(``cache/patch.py``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

import torch

from cache.patch import FitResult, Patch, PatchConfig, fit_groups, groups, residual_energy

OrbitMethod = Literal["mean", "stacked"]


class Delta(NamedTuple):
    """One chunk's Δ under one ordering: k ``[L, H_k, T, D_k]``, v ``[L, H_v, T, D_v]``."""

    k: torch.Tensor
    v: torch.Tensor


class HoldoutReport(NamedTuple):
    """Relative residual energy ``||Δ - U Vᵀ||² / ||Δ||²`` (all layers, keys and values).

    fitted: per fitting ordering ``[n_fit]``; held_out: per held-out ordering ``[n_held]``.
    """

    fitted: torch.Tensor
    held_out: torch.Tensor

    @property
    def held_out_mean(self) -> float:
        return float(self.held_out.mean())

    @property
    def held_out_worst(self) -> float:
        return float(self.held_out.max())


def sample_orderings(n: int, count: int, seed: int = 0) -> Iterator[tuple[int, ...]]:
    """Distinct orderings of ``range(n)``: all ``n!`` (lexicographic) when ``n! <= count``,
    otherwise ``count`` distinct ones drawn with ``seed``."""
    if n < 0 or count < 0:
        raise ValueError(f"n and count must be >= 0, got {n}, {count}")
    if math.factorial(n) <= count:
        yield from itertools.permutations(range(n))
        return
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    order = list(range(n))
    while len(seen) < count:
        rng.shuffle(order)
        perm = tuple(order)
        if perm not in seen:
            seen.add(perm)
            yield perm


def fit_orbit(deltas: Sequence[Delta], config: PatchConfig, method: OrbitMethod = "mean") -> FitResult:
    """One patch for a chunk from its Δs under several orderings (same shapes throughout).

    ``FitResult.energy`` and ``.residual`` refer to the mean Δ.
    """
    if not deltas:
        raise ValueError("fit_orbit needs at least one Δ")
    if method not in ("mean", "stacked"):
        raise ValueError(f"method must be 'mean' or 'stacked', got {method!r}")
    mean_k = torch.stack([d.k.to(torch.float32) for d in deltas]).mean(dim=0)
    mean_v = torch.stack([d.v.to(torch.float32) for d in deltas]).mean(dim=0)
    targets = groups(mean_k, mean_v, config.arrangement)
    grams = None
    if method == "stacked":
        grams = [torch.zeros(t.shape[0], t.shape[2], t.shape[2]) for t in targets]
        for d in deltas:
            for g, x in enumerate(groups(d.k, d.v, config.arrangement)):
                grams[g] += x.transpose(1, 2) @ x / len(deltas)
    return fit_groups(targets, grams, mean_k, mean_v, config)


def fit_orbit_patches(
    deltas_per_chunk: Sequence[Sequence[Delta]], config: PatchConfig, method: OrbitMethod = "mean"
) -> list[Patch]:
    """One orbit patch per chunk of a reorderable set."""
    return [fit_orbit(deltas, config, method).patch for deltas in deltas_per_chunk]


def relative_residual(patch: Patch, deltas: Sequence[Delta]) -> torch.Tensor:
    """``||Δ_i - U Vᵀ||² / ||Δ_i||²`` for each Δ, float64 ``[len(deltas)]``."""
    out = []
    for d in deltas:
        energy = d.k.to(torch.float64).square().sum() + d.v.to(torch.float64).square().sum()
        out.append(residual_energy(patch, d.k, d.v).sum() / energy.clamp_min(torch.finfo(torch.float64).tiny))
    return torch.stack(out)


def holdout(
    deltas: Sequence[Delta], n_fit: int, config: PatchConfig, method: OrbitMethod = "mean"
) -> HoldoutReport:
    """Fit on ``deltas[:n_fit]``, report the relative residual there and on ``deltas[n_fit:]``."""
    if not 0 < n_fit < len(deltas):
        raise ValueError(f"n_fit must leave orderings on both sides, got {n_fit} of {len(deltas)}")
    patch = fit_orbit(deltas[:n_fit], config, method).patch
    return HoldoutReport(relative_residual(patch, deltas[:n_fit]), relative_residual(patch, deltas[n_fit:]))
