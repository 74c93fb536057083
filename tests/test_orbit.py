"""cache/orbit.py: orderings sampler, orbit fits against single-ordering fits, held-out report."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from cache.orbit import Delta, fit_orbit, fit_orbit_patches, holdout, relative_residual, sample_orderings
from cache.patch import PatchConfig, fit_delta, residual_energy
from cache.rank import FixedRank
from tests.test_patch import synthetic_delta


def test_sampler_is_exhaustive_when_small_and_distinct_and_seeded_otherwise():
    assert sorted(sample_orderings(3, 6)) == sorted(itertools.permutations(range(3)))
    assert len(list(sample_orderings(3, 100))) == math.factorial(3)
    drawn = list(sample_orderings(6, 50, seed=3))
    assert len(drawn) == 50
    assert len(set(drawn)) == 50
    assert all(sorted(p) == list(range(6)) for p in drawn)
    assert drawn == list(sample_orderings(6, 50, seed=3))
    assert drawn != list(sample_orderings(6, 50, seed=4))
    assert list(sample_orderings(1, 5)) == [(0,)]


def orbit_deltas(n: int, noise: float, seed: int = 0) -> list[Delta]:
    """Δs of one chunk under n orderings: a shared part plus an order-specific low-rank part."""
    shared_k, shared_v = synthetic_delta(n_layers=3, n_tokens=64, seed=seed)
    out = []
    for i in range(n):
        ok, ov = synthetic_delta(n_layers=3, n_tokens=64, seed=seed + 100 + i)
        out.append(Delta(shared_k + noise * ok, shared_v + noise * ov))
    return out


@pytest.mark.parametrize("method", ["mean", "stacked"])
@pytest.mark.parametrize("arrangement", ["joint", "split"])
def test_orbit_of_one_ordering_is_that_orderings_patch(method, arrangement):
    (d,) = orbit_deltas(1, 0.0)
    config = PatchConfig(rank=FixedRank(5), arrangement=arrangement, storage="float32", solver="exact")
    orbit = fit_orbit([d], config, method).patch
    single = fit_delta(d.k, d.v, config).patch
    assert orbit.ranks == single.ranks
    for a, b in zip(orbit.dense(), single.dense(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mean_fit_is_optimal_over_the_fitted_orderings():
    deltas = orbit_deltas(4, 0.5)
    config = PatchConfig(rank=FixedRank(4), storage="float32", solver="exact")
    mean = fit_orbit(deltas, config, "mean").patch
    stacked = fit_orbit(deltas, config, "stacked").patch

    def summed(patch):
        return sum(float(residual_energy(patch, d.k, d.v).sum()) for d in deltas)

    assert summed(mean) <= summed(stacked) * (1 + 1e-6)
    # and the reported residual of the mean fit is the mean Δ's tail energy
    fit = fit_orbit(deltas, config, "mean")
    mk = torch.stack([d.k for d in deltas]).mean(0)
    mv = torch.stack([d.v for d in deltas]).mean(0)
    torch.testing.assert_close(
        fit.residual.sum(), residual_energy(fit.patch, mk, mv).sum(), rtol=1e-4, atol=1e-6
    )


def test_holdout_reports_relative_residuals():
    deltas = orbit_deltas(6, 0.1)
    config = PatchConfig(rank=FixedRank(8), storage="float16")
    report = holdout(deltas, 4, config)
    assert report.fitted.shape == (4,)
    assert report.held_out.shape == (2,)
    assert 0.0 <= report.held_out_mean <= report.held_out_worst < 0.1
    patch = fit_orbit(deltas[:4], config).patch
    torch.testing.assert_close(report.held_out, relative_residual(patch, deltas[4:]))
    # an order-specific part as large as the shared one is served much worse
    assert holdout(orbit_deltas(6, 1.0), 4, config).held_out_mean > 2 * report.held_out_mean
    with pytest.raises(ValueError, match="n_fit"):
        holdout(deltas, 6, config)


def test_fit_orbit_patches_one_per_chunk():
    chunks = [orbit_deltas(3, 0.2, seed=s) for s in (0, 1)]
    patches = fit_orbit_patches(chunks, PatchConfig(rank=FixedRank(3)))
    assert len(patches) == 2
    assert all(p.ranks == (3, 3, 3) for p in patches)
