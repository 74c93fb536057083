"""Selective recompute (CacheBlend, EPIC) against a full prefill on tiny random models."""

from __future__ import annotations

import itertools

import pytest
import torch

from agent.adapters.base import ModelAdapter
from agent.adapters.loading import load_adapter
from agent.recompute import (
    DeviationSelection,
    FixedSelection,
    first_tokens,
    recompute_into,
    selective_recompute,
)
from cache.arena import KVArena
from tests._util import max_rel

PREFIX, CHUNK = 6, 14


@pytest.fixture(scope="module")
def llama() -> ModelAdapter:
    return load_adapter("tiny:llama-gqa")


def _setup(
    adapter: ModelAdapter,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N]; reference K, V from one prefill; blind K, V (prefix exact, chunks encoded alone)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 500, (PREFIX + 3 * CHUNK,), generator=g)
    ref = adapter.prefill(adapter.text(ids), adapter.empty_cache(), 0).cache
    k_ref = torch.stack([lay.keys[0] for lay in ref.layers])
    v_ref = torch.stack([lay.values[0] for lay in ref.layers])
    ks, vs = [k_ref[:, :, :PREFIX]], [v_ref[:, :, :PREFIX]]
    for start in range(PREFIX, ids.numel(), CHUNK):
        k, v = adapter.encode(adapter.text(ids[start : start + CHUNK])).place(start, adapter.spec)
        ks.append(k)
        vs.append(v)
    return ids, k_ref, v_ref, torch.cat(ks, 2), torch.cat(vs, 2)


def test_full_selection_equals_prefill(llama: ModelAdapter) -> None:
    ids, k_ref, v_ref, k, v = _setup(llama)
    positions = torch.arange(ids.numel())
    assert max_rel(k, k_ref) > 1e-2  # blind reuse is far off
    for sel in (
        FixedSelection(torch.arange(ids.numel())),
        DeviationSelection(1.0, torch.arange(ids.numel())),
    ):
        out = selective_recompute(llama, ids, positions, k, v, sel)
        assert max_rel(out.k, k_ref) < 1e-5
        assert max_rel(out.v, v_ref) < 1e-5


def test_cacheblend_all_chunk_tokens_equals_prefill(llama: ModelAdapter) -> None:
    ids, k_ref, v_ref, k, v = _setup(llama)
    sel = DeviationSelection(1.0, torch.arange(PREFIX, ids.numel()))
    out = selective_recompute(llama, ids, torch.arange(ids.numel()), k, v, sel)
    torch.testing.assert_close(out.k, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.v, v_ref, atol=1e-5, rtol=1e-5)
    assert out.selected.tolist() == list(range(PREFIX, ids.numel()))


def test_epic_whole_chunks_equals_prefill(llama: ModelAdapter) -> None:
    ids, k_ref, v_ref, k, v = _setup(llama)
    # the first chunk right after the prefix, encoded alone, differs; EPIC leaves it as reused
    k[:, :, PREFIX : PREFIX + CHUNK] = k_ref[:, :, PREFIX : PREFIX + CHUNK]
    v[:, :, PREFIX : PREFIX + CHUNK] = v_ref[:, :, PREFIX : PREFIX + CHUNK]
    starts = [PREFIX + CHUNK, PREFIX + 2 * CHUNK]
    picked = first_tokens(starts, [CHUNK, CHUNK], 100)
    out = selective_recompute(llama, ids, torch.arange(ids.numel()), k, v, FixedSelection(picked))
    torch.testing.assert_close(out.k, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.v, v_ref, atol=1e-5, rtol=1e-5)


def test_partial_selection_keeps_the_others(llama: ModelAdapter) -> None:
    ids, _, _, k, v = _setup(llama)
    sel = DeviationSelection(0.25, torch.arange(PREFIX, ids.numel()))
    out = selective_recompute(llama, ids, torch.arange(ids.numel()), k, v, sel)
    assert out.selected.numel() == sel.count == round(0.25 * 3 * CHUNK)
    assert int(out.selected.min()) >= PREFIX
    others = torch.ones(ids.numel(), dtype=torch.bool)
    others[out.selected] = False
    # from the selection layer on, tokens not chosen keep their reused KV exactly
    assert torch.equal(out.k[1:, :, others], k[1:, :, others])
    assert torch.equal(out.v[1:, :, others], v[1:, :, others])
    assert not torch.equal(out.v[1:, :, out.selected], v[1:, :, out.selected])


def test_first_tokens() -> None:
    assert first_tokens([3, 10], [5, 2], 3).tolist() == [3, 4, 5, 10, 11]
    assert first_tokens([], [], 3).numel() == 0


def test_rejects_bad_input(llama: ModelAdapter) -> None:
    with pytest.raises(ValueError, match="ratio"):
        DeviationSelection(1.5, torch.arange(3))
    ids, _, _, k, v = _setup(llama)
    with pytest.raises(ValueError, match="disagree"):
        selective_recompute(
            llama, ids[:-1], torch.arange(ids.numel() - 1), k, v, FixedSelection(torch.arange(2))
        )
    mla = load_adapter("tiny:deepseek-mla")
    with pytest.raises(TypeError, match="GQA"):
        selective_recompute(mla, ids, torch.arange(ids.numel()), k, v, FixedSelection(torch.arange(2)))


def test_the_residual_is_the_deviation_left_unrecomputed(llama: ModelAdapter) -> None:
    """The selection layer's value deviation left in the candidates not chosen, over their fresh
    values' energy: against a slow count of the same, falling as more is recomputed, 0 when all
    is, and 0 on KV that already is the context's (nothing deviates)."""
    ids, k_ref, v_ref, k, v = _setup(llama)
    positions, candidates = torch.arange(ids.numel()), torch.arange(PREFIX, ids.numel())
    # slow reference: layer 1 of every candidate run on the blind KV, deviation per row
    probe = llama.new_cache([(k.clone(), v.clone())])
    hidden = llama.run_layers(
        llama.embed_ids(ids[candidates]), candidates, positions[candidates], probe, range(1)
    )
    fresh = llama.run_layers(hidden.hidden, candidates, positions[candidates], probe, range(1, 2))
    dev = (fresh.v - v[1][:, candidates]).square().sum(dim=(0, 2))
    residuals = []
    for ratio in (0.1, 0.5, 1.0):
        sel = DeviationSelection(ratio, candidates)
        out = selective_recompute(llama, ids, positions, k, v, sel)
        left = dev.sort(descending=True).values[sel.count :].sum() / fresh.v.square().sum()
        assert out.residual == pytest.approx(float(left), rel=1e-4, abs=1e-12)
        residuals.append(out.residual)
    assert residuals[0] > residuals[1] > residuals[2] == 0.0
    exact = selective_recompute(llama, ids, positions, k_ref, v_ref, DeviationSelection(0.1, candidates))
    assert exact.residual < 1e-10
    assert selective_recompute(llama, ids, positions, k, v, FixedSelection(candidates)).residual == 0.0


def test_a_repair_that_would_leave_too_much_runs_nothing_past_its_selection_layer(
    llama: ModelAdapter,
) -> None:
    """Over ``max_residual`` the repair is given up: it reports the residual it measured and no
    token recomputed, and from the selection layer on the KV is the reused one, untouched."""
    ids, _, _, k, v = _setup(llama)
    positions, candidates = torch.arange(ids.numel()), torch.arange(PREFIX, ids.numel())
    measured = selective_recompute(llama, ids, positions, k, v, DeviationSelection(0.25, candidates))
    assert measured.residual > 0.0
    given_up = selective_recompute(
        llama, ids, positions, k, v, DeviationSelection(0.25, candidates, max_residual=measured.residual / 2)
    )
    assert given_up.selected.numel() == 0
    assert given_up.residual == measured.residual
    assert torch.equal(given_up.k[1:], k[1:])
    assert torch.equal(given_up.v[1:], v[1:])
    kept = selective_recompute(
        llama, ids, positions, k, v, DeviationSelection(0.25, candidates, max_residual=measured.residual)
    )
    assert torch.equal(kept.selected, measured.selected)  # at the limit it still runs
    with pytest.raises(ValueError, match="max_residual"):
        DeviationSelection(0.25, candidates, max_residual=float("nan"))


def test_a_selection_grows_until_what_it_leaves_meets_its_target(llama: ModelAdapter) -> None:
    """Past ``ratio``, most deviating first, the fewest tokens that leave at most
    ``target_residual``; all of ``max_ratio`` when none do; none beyond ``ratio`` when the floor
    already meets the target or no ``max_ratio`` is given. The same rows as a fixed selection of
    that size, and the same KV."""
    ids, _, _, k, v = _setup(llama)
    positions, candidates = torch.arange(ids.numel()), torch.arange(PREFIX, ids.numel())
    fixed = {
        n: selective_recompute(
            llama, ids, positions, k, v, DeviationSelection(n / candidates.numel(), candidates)
        )
        for n in range(1, candidates.numel() + 1)
    }
    left = [fixed[n].residual for n in sorted(fixed)]
    assert all(a >= b for a, b in itertools.pairwise(left))
    floor, most = 0.1, 0.75
    lo, hi = DeviationSelection(floor, candidates).count, DeviationSelection(most, candidates).count
    # a target met somewhere between the floor and the most: the first count meeting it
    want = next(n for n in range(lo, hi + 1) if fixed[n].residual <= fixed[lo + 3].residual)
    grown = selective_recompute(
        llama,
        ids,
        positions,
        k,
        v,
        DeviationSelection(floor, candidates, max_ratio=most, target_residual=fixed[lo + 3].residual),
    )
    assert grown.selected.numel() == want > lo
    assert torch.equal(grown.selected, fixed[want].selected)
    assert grown.residual == pytest.approx(fixed[want].residual, rel=1e-6)
    assert torch.equal(grown.k, fixed[want].k)
    assert torch.equal(grown.v, fixed[want].v)
    # unreachable within max_ratio: all of it; met at the floor or no max_ratio: the floor
    capped = DeviationSelection(floor, candidates, max_ratio=most, target_residual=0.0)
    assert selective_recompute(llama, ids, positions, k, v, capped).selected.numel() == hi
    met = DeviationSelection(floor, candidates, max_ratio=most, target_residual=1.0)
    assert selective_recompute(llama, ids, positions, k, v, met).selected.numel() == lo
    unset = DeviationSelection(floor, candidates, target_residual=0.0)
    assert selective_recompute(llama, ids, positions, k, v, unset).selected.numel() == lo
    with pytest.raises(ValueError, match="max_ratio"):
        DeviationSelection(0.5, candidates, max_ratio=0.25)
    with pytest.raises(ValueError, match="target_residual"):
        DeviationSelection(0.5, candidates, target_residual=-1.0)


def test_recompute_into_rewrites_the_cache_in_place(llama: ModelAdapter) -> None:
    """The model cache's own tensors take the recomputed rows (no copy of the context): the same
    result as on buffers, the same storage before and after, and the tokens not chosen untouched."""
    ids, _, _, k, v = _setup(llama)
    positions = torch.arange(ids.numel())
    sel = DeviationSelection(0.25, torch.arange(PREFIX, ids.numel()))
    want = selective_recompute(llama, ids, positions, k, v, sel)
    cache = llama.new_cache([(k.clone(), v.clone())])
    layers = range(llama.info.n_layers)
    before = [llama.layer_kv(cache, i)[0].data_ptr() for i in layers]
    done = recompute_into(llama, cache, ids, positions, sel)
    assert (done.tokens, done.residual) == (want.selected.numel(), want.residual)
    assert [llama.layer_kv(cache, i)[0].data_ptr() for i in layers] == before
    got_k = torch.stack([llama.layer_kv(cache, i)[0] for i in layers])
    got_v = torch.stack([llama.layer_kv(cache, i)[1] for i in layers])
    assert torch.equal(got_k, want.k)
    assert torch.equal(got_v, want.v)


def test_depth_is_how_the_recomputed_rows_deviation_grew_past_the_selection_layer(
    llama: ModelAdapter,
) -> None:
    """``Repaired.depth``: the recomputed rows' value deviation over their fresh values' energy,
    averaged over the layers after the selection layer, over the same at it; against a slow count
    of the same. None where nothing deviates (the context's own KV) or nothing is recomputed."""
    ids, k_ref, v_ref, k, v = _setup(llama)
    positions, candidates = torch.arange(ids.numel()), torch.arange(PREFIX, ids.numel())
    sel = DeviationSelection(0.25, candidates)
    want = selective_recompute(llama, ids, positions, k, v, sel)
    kept = want.selected
    probe = llama.new_cache([(k.clone(), v.clone())])
    hidden = llama.run_layers(
        llama.embed_ids(ids[candidates]), candidates, positions[candidates], probe, range(1)
    )
    fresh = llama.run_layers(hidden.hidden, candidates, positions[candidates], probe, range(1, 2))
    at = torch.isin(candidates, kept)

    def rel(new: torch.Tensor, old: torch.Tensor) -> float:
        return float((new.double() - old.double()).square().sum() / new.double().square().sum())

    at_check = rel(fresh.v[:, at], v[1][:, kept])
    later = [rel(want.v[i][:, kept], v[i][:, kept]) for i in range(2, llama.info.n_layers)]
    assert later
    assert at_check > 0
    done = recompute_into(llama, llama.new_cache([(k.clone(), v.clone())]), ids, positions, sel)
    assert done.tokens == kept.numel()
    assert done.depth == pytest.approx(sum(later) / len(later) / at_check, rel=1e-6)
    assert done.depth != 1.0
    exact = recompute_into(llama, llama.new_cache([(k_ref.clone(), v_ref.clone())]), ids, positions, sel)
    assert exact.depth is None
    none = recompute_into(
        llama, llama.new_cache([(k.clone(), v.clone())]), ids, positions, FixedSelection(candidates)
    )
    assert none.depth is None


def test_recompute_from_embeddings_equals_from_ids(llama: ModelAdapter) -> None:
    ids, _, _, k, v = _setup(llama)
    positions = torch.arange(ids.numel())
    sel = FixedSelection(first_tokens([PREFIX, PREFIX + CHUNK], [CHUNK, CHUNK], 4))
    by_ids = selective_recompute(llama, ids, positions, k, v, sel)
    by_embeds = selective_recompute(llama, llama.embed_ids(ids), positions, k, v, sel)
    assert torch.equal(by_ids.k, by_embeds.k)
    assert torch.equal(by_ids.selected, by_embeds.selected)


def test_models_whose_layers_cannot_run_on_rows_say_so() -> None:
    qwen3 = load_adapter("tiny:qwen3-vl")
    assert not qwen3.supports_recompute
    ids = torch.arange(3, 9)
    cache = qwen3.prefill(qwen3.text(ids), qwen3.empty_cache(), 0).cache
    with pytest.raises(TypeError, match="DeepStack"):
        recompute_into(qwen3, cache, ids, torch.arange(6).expand(3, -1), FixedSelection(torch.arange(2)))
    assert load_adapter("tiny:llama-gqa").supports_recompute
    assert not load_adapter("tiny:deepseek-mla").supports_recompute


def test_recompute_into_an_arena_cache_survives_the_next_forward(llama: ModelAdapter) -> None:
    """A window's cache shows its arena: the recomputed rows are written into the arena, so the
    next forward (which shows the arena's tokens again) still attends to them."""
    ids, _, _, k, v = _setup(llama)
    n = ids.numel()
    arena = KVArena(k.shape[0], (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), capacity=n + 8)
    arena.k[:, :, :n], arena.v[:, :, :n] = k, v
    arena.reset(n)
    cache = llama.new_cache(arena)
    sel = FixedSelection(torch.arange(PREFIX, n))
    recompute_into(llama, cache, ids, torch.arange(n), sel)
    want = selective_recompute(llama, ids, torch.arange(n), k, v, sel)
    assert torch.equal(arena.k[:, :, :n], want.k)
    probe = llama.text(torch.tensor([5, 6, 7]))
    got = llama.prefill(probe, cache, n).logits
    torch.testing.assert_close(got, llama.prefill(probe, llama.new_cache([(want.k, want.v)]), n).logits)
    assert torch.equal(llama.layer_kv(cache, 1)[0][:, :n], want.k[1])
