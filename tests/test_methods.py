"""The benchmarks' shared method builders, against slow obvious references on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch

from agent.adapters.base import ModelAdapter
from agent.adapters.loading import load_adapter
from agent.recompute import DeviationSelection, FixedSelection
from bench.methods import (
    PrefixCache,
    concat_kv,
    delta,
    full_prefill,
    kl_divergence,
    kl_rows,
    layers_kv,
    patch_and_place,
    place,
    recompute_selections,
    reprefill,
    split_oracles,
)
from cache.patch import PatchConfig
from cache.rank import rank_strategy
from cache.rope import rotate


@pytest.fixture(scope="module")
def llama() -> ModelAdapter:
    return load_adapter("tiny:llama-gqa")


def test_kl_matches_the_definition() -> None:
    g = torch.Generator().manual_seed(0)
    ref, got = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    for row in range(3):
        p, q = ref[row].double().softmax(-1).tolist(), got[row].double().softmax(-1).tolist()
        want = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
        assert abs(float(kl_rows(ref, got)[row]) - want) < 1e-12
    assert kl_divergence(ref[0], ref[0]) == 0.0


def test_full_prefill_is_one_forward_over_the_whole_context(llama: ModelAdapter) -> None:
    prefix = llama.text(torch.arange(2, 9))
    chunks = [llama.text(torch.arange(20 + 9 * i, 29 + 9 * i)) for i in range(3)]
    ref = full_prefill(llama, prefix, chunks)
    direct = llama.prefill(
        llama.text(torch.arange(2, 9).tolist() + list(range(20, 47))), llama.empty_cache(), 0
    )
    k, v = layers_kv(direct.cache, llama.info.n_layers)
    torch.testing.assert_close(ref.k, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.v, v, atol=1e-5, rtol=1e-5)
    assert [c.k.shape[2] for c in ref.conditioned] == [9, 9, 9]
    assert len(ref.prefill_s) == 3
    assert ref.seconds >= sum(ref.prefill_s)


def test_blind_rotates_and_a_full_rank_patch_restores_the_conditioned_kv(llama: ModelAdapter) -> None:
    prefix = llama.text(torch.arange(2, 9))
    chunk = llama.text(torch.arange(30, 42))
    ref = full_prefill(llama, prefix, [chunk])
    canon, start = llama.encode(chunk), prefix.n_tokens
    blind = place(canon, start, llama.spec)
    torch.testing.assert_close(blind.kv[0], rotate(canon.k, canon.placed_positions(start), llama.spec))
    assert blind.kv[1] is canon.v
    assert blind.patch_bytes == 0
    full_rank = PatchConfig(rank=rank_strategy("fixed", rank=1000), storage="float32")
    patched = patch_and_place(canon, delta(ref.conditioned[0], canon), start, llama.spec, full_rank)
    torch.testing.assert_close(patched.kv[0], ref.k[:, :, start:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(patched.kv[1], ref.v[:, :, start:], atol=1e-4, rtol=1e-4)
    assert patched.patch_bytes > 0
    k, v = concat_kv((ref.k[:, :, :start], ref.v[:, :, :start]), [patched.kv])
    torch.testing.assert_close(k, ref.k, atol=1e-4, rtol=1e-4)
    assert v.shape == ref.v.shape


def test_recompute_selections_name_and_pick_their_tokens() -> None:
    candidates = torch.arange(4, 20)
    out = recompute_selections((15.0, 50.0), (2,), candidates, [4, 10, 15], [6, 5, 5])
    assert list(out) == ["cacheblend-15", "cacheblend-50", "epic-2"]
    blend = out["cacheblend-50"]
    assert isinstance(blend, DeviationSelection)
    assert blend.count == 8
    epic = out["epic-2"]
    assert isinstance(epic, FixedSelection)
    assert epic.indices.tolist() == [10, 11, 15, 16]  # every chunk but the first


def test_oracles_are_listed_apart() -> None:
    methods = {"blind": {"oracle": False}, "patch-r8": {"oracle": True}, "epic-1": {}}
    assert split_oracles(methods) == (["blind", "epic-1"], ["patch-r8"])


def test_prefix_cache_reuses_the_longest_unchanged_leading_run() -> None:
    adapter = load_adapter("tiny:llama-gqa")
    prefix, q = adapter.text(torch.arange(2, 8)), adapter.text(torch.arange(40, 44))
    chunks = [adapter.text(torch.arange(100 + 10 * i, 108 + 10 * i)) for i in range(4)]
    ids = [f"c{i}" for i in range(4)]
    pc = PrefixCache(adapter)
    tok, _, n = pc.run(prefix, ids[:3], chunks[:3], q)
    assert n == prefix.n_tokens + 24  # nothing cached yet
    assert tok == reprefill(adapter, prefix, chunks[:3], q)[0]
    tok, _, n = pc.run(prefix, ids[:3], chunks[:3], q)
    assert n == 0  # the same window again: only the question runs
    assert tok == reprefill(adapter, prefix, chunks[:3], q)[0]
    tok, _, n = pc.run(prefix, ids[1:], chunks[1:], q)
    assert n == 24  # the first chunk left: everything after the pinned prefix again
    assert tok == reprefill(adapter, prefix, chunks[1:], q)[0]
    tok, _, n = pc.run(prefix, [ids[1], ids[2], ids[0]], [chunks[1], chunks[2], chunks[0]], q)
    assert n == 8  # two leading chunks as in the last window
    assert tok == reprefill(adapter, prefix, [chunks[1], chunks[2], chunks[0]], q)[0]
