"""cache/rank.py: each strategy against brute force, and budget against fixed rank at equal bytes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.patch import PatchConfig, fit_delta, residual_energy
from cache.rank import BlockSpectrum, BudgetRank, EnergyRank, FixedRank, rank_strategy
from tests.test_patch import synthetic_delta


def spectrum(values: list[float], cost: int) -> BlockSpectrum:
    e = torch.tensor(sorted(values, reverse=True), dtype=torch.float64)
    return BlockSpectrum(e, float(e.sum()), cost)


def test_registry_builds_by_name():
    assert rank_strategy("fixed", rank=4) == FixedRank(4)
    assert rank_strategy("energy", fraction=0.5) == EnergyRank(0.5)
    assert rank_strategy("budget", nbytes=100) == BudgetRank(100)
    with pytest.raises(ValueError, match="unknown rank strategy"):
        rank_strategy("magic")
    with pytest.raises(ValueError, match="fraction"):
        EnergyRank(1.5)


def test_fixed_caps_at_block_size():
    blocks = [spectrum([3.0, 2.0], 10), spectrum([5.0, 1.0, 1.0, 1.0], 10)]
    assert FixedRank(3).select(blocks) == (2, 3)


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=8), st.floats(0.0, 1.0))
@settings(max_examples=100, deadline=None)
def test_energy_rank_is_the_smallest_reaching_the_fraction(values, fraction):
    block = spectrum(values, 1)
    (r,) = EnergyRank(fraction).select([block])
    kept = [float(block.energies[:m].sum()) for m in range(len(values) + 1)]
    need = fraction * block.total * (1 - 1e-9)
    smallest = next((m for m in range(len(values) + 1) if kept[m] >= need), len(values))
    assert r == max(smallest, 0) or (block.total == 0 and r == 0)


@given(
    st.lists(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=4), min_size=1, max_size=4),
    st.lists(st.integers(1, 9), min_size=4, max_size=4),
    st.integers(0, 40),
)
@settings(max_examples=150, deadline=None)
def test_budget_never_exceeds_and_matches_brute_force_when_costs_are_equal(values, costs, budget):
    blocks = [spectrum(v, costs[i]) for i, v in enumerate(values)]
    for weighting in ("absolute", "relative"):
        ranks = BudgetRank(budget, weighting).select(blocks)
        assert sum(r * b.bytes_per_rank for r, b in zip(ranks, blocks, strict=True)) <= budget
        assert all(0 <= r <= len(b.energies) for r, b in zip(ranks, blocks, strict=True))
    equal = [spectrum(v, 3) for v in values]
    for weighting in ("absolute", "relative"):

        def worth(b: BlockSpectrum, r: int, weighting: str = weighting) -> float:
            kept = float(b.energies[:r].sum())
            return kept / b.total if weighting == "relative" and b.total > 0 else kept

        got = BudgetRank(budget, weighting).select(equal)
        best = max(
            sum(worth(b, r) for r, b in zip(rs, equal, strict=True))
            for rs in itertools.product(*[range(len(b.energies) + 1) for b in equal])
            if 3 * sum(rs) <= budget
        )
        kept = sum(worth(b, r) for r, b in zip(got, equal, strict=True))
        assert kept == pytest.approx(best, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("arrangement", ["joint", "split"])
@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_budget_beats_fixed_at_equal_bytes_when_energy_grows_with_depth(arrangement, storage):
    dk, dv = synthetic_delta(n_layers=8, n_tokens=128)
    # make depth matter more: the last layers dominate
    scale = torch.linspace(0.2, 3.0, 8).view(8, 1, 1, 1)
    dk, dv = dk * scale, dv * scale
    fixed = fit_delta(dk, dv, PatchConfig(rank=FixedRank(4), arrangement=arrangement, storage=storage))
    by_energy = BudgetRank(fixed.patch.nbytes, weighting="absolute")
    budget = fit_delta(dk, dv, PatchConfig(rank=by_energy, arrangement=arrangement, storage=storage))
    assert budget.patch.nbytes <= fixed.patch.nbytes
    r_fixed = float(residual_energy(fixed.patch, dk, dv).sum())
    r_budget = float(residual_energy(budget.patch, dk, dv).sum())
    assert r_budget < 0.9 * r_fixed
    ranks = budget.patch.ranks
    assert sum(ranks[len(ranks) // 2 :]) > sum(ranks[: len(ranks) // 2])  # deep layers got more


def test_relative_weighting_shares_the_budget_by_each_block_s_own_deficit() -> None:
    big = BlockSpectrum(torch.tensor([100.0, 90.0, 80.0, 70.0], dtype=torch.float64), 400.0, 10)
    small = BlockSpectrum(torch.tensor([1.0, 0.2, 0.1, 0.05], dtype=torch.float64), 1.4, 10)
    assert BudgetRank(40, weighting="absolute").select([big, small]) == (4, 0)  # the big block takes all
    # relative: small's first triplet is 71 % of its deficit, worth more than big's 4th (17.5 %)
    ranks = BudgetRank(40).select([big, small])  # relative is the default
    assert ranks == (3, 1)
    with pytest.raises(ValueError, match="weighting"):
        BudgetRank(10, weighting="loud")
