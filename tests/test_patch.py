"""cache/patch.py against dense references: exact SVD, a per-layer loop, rope.rotate."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load, save

from cache.patch import (
    Patch,
    PatchConfig,
    apply_and_place,
    apply_patch,
    bytes_per_rank,
    fit_delta,
    fit_patch,
    groups,
    quantize_int8,
    residual_energy,
)
from cache.rank import EnergyRank, FixedRank
from cache.rope import RopeSpec, default_inv_freq, rotate


def synthetic_delta(
    n_layers: int = 6, heads: int = 3, n_tokens: int = 96, dim: int = 16, hidden: int = 48, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Δ shaped like a real one: a low-rank hidden-state change projected to K and V, with a
    decaying spectrum, energy growing with depth and a little full-rank noise."""
    g = torch.Generator().manual_seed(seed)
    ks, vs = [], []
    for layer in range(n_layers):
        spectrum = torch.exp(-torch.arange(hidden, dtype=torch.float32) / 4.0) * (1.0 + layer)
        dh = torch.randn(n_tokens, hidden, generator=g) * spectrum
        wk = torch.randn(hidden, heads * dim, generator=g) / hidden**0.5
        wv = torch.randn(hidden, heads * dim, generator=g) / hidden**0.5
        k = dh @ wk + 0.01 * torch.randn(n_tokens, heads * dim, generator=g)
        v = dh @ wv + 0.01 * torch.randn(n_tokens, heads * dim, generator=g)
        ks.append(k.reshape(n_tokens, heads, dim).permute(1, 0, 2))
        vs.append(v.reshape(n_tokens, heads, dim).permute(1, 0, 2))
    return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()


def reference_delta(patch: Patch) -> tuple[torch.Tensor, torch.Tensor]:
    """Head by head, token by token: ``Δ[l, h, t, d] = Σ_j u[t, j] v[h * D + d, j]``."""
    hk, dk = patch.k_shape
    hv, dv = patch.v_shape
    out_k = torch.zeros(patch.n_layers, hk, patch.n_tokens, dk, dtype=torch.float64)
    out_v = torch.zeros(patch.n_layers, hv, patch.n_tokens, dv, dtype=torch.float64)
    for layer in range(patch.n_layers):
        (uk, vk), (uv, vv) = patch.layer(layer)
        for h in range(hk):
            out_k[layer, h] = uk.double() @ vk[h * dk : (h + 1) * dk].double().T
        for h in range(hv):
            out_v[layer, h] = uv.double() @ vv[h * dv : (h + 1) * dv].double().T
    return out_k, out_v


@pytest.mark.parametrize("arrangement", ["joint", "split"])
@pytest.mark.parametrize("solver", ["exact", "randomized"])
@pytest.mark.parametrize("n_tokens", [96, 20])  # F <= T (feature Gram) and F > T (token Gram)
def test_full_rank_patch_reconstructs_conditioned_kv(arrangement, solver, n_tokens):
    torch.manual_seed(0)
    canon_k, canon_v = torch.randn(4, 3, n_tokens, 16), torch.randn(4, 3, n_tokens, 16)
    cond_k, cond_v = canon_k + torch.randn_like(canon_k), canon_v + torch.randn_like(canon_v)
    config = PatchConfig(rank=FixedRank(1000), arrangement=arrangement, storage="float32", solver=solver)
    fit = fit_patch(canon_k, canon_v, cond_k, cond_v, config)
    k, v = apply_patch(canon_k, canon_v, fit.patch)
    torch.testing.assert_close(k, cond_k, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(v, cond_v, atol=2e-5, rtol=1e-5)
    assert float(fit.residual.max()) < 1e-6 * float(fit.energy.max())


@pytest.mark.parametrize("arrangement", ["joint", "split"])
@pytest.mark.parametrize("solver", ["exact", "randomized"])
def test_truncated_fit_is_the_optimal_rank_m_approximation(arrangement, solver):
    dk, dv = synthetic_delta()
    rank = 6
    fit = fit_delta(
        dk, dv, PatchConfig(rank=FixedRank(rank), arrangement=arrangement, storage="float32", solver=solver)
    )
    # Eckart-Young: the best rank-m residual is the energy of the tail singular values
    tails = []
    for layer in range(dk.shape[0]):
        for g in groups(dk, dv, arrangement):
            s = torch.linalg.svdvals(g[layer].double())
            tails.append(s[rank:].square().sum())
    tail = torch.stack(tails)
    torch.testing.assert_close(fit.residual, tail, rtol=1e-4, atol=1e-6 * float(fit.energy.max()))
    measured = residual_energy(fit.patch, dk, dv)
    per_layer_tail = tail.view(dk.shape[0], -1).sum(dim=1)
    torch.testing.assert_close(measured, per_layer_tail, rtol=1e-4, atol=1e-6 * float(fit.energy.max()))


def test_dense_patch_matches_head_by_head_reference():
    dk, dv = synthetic_delta(n_layers=2)
    patch = fit_delta(dk, dv, PatchConfig(rank=FixedRank(5), arrangement="split")).patch
    ref_k, ref_v = reference_delta(patch)
    got_k, got_v = patch.dense()
    torch.testing.assert_close(got_k.double(), ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v.double(), ref_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("arrangement", ["joint", "split"])
def test_nbytes_and_safetensors_round_trip(storage, arrangement):
    dk, dv = synthetic_delta(n_layers=3)
    fit = fit_delta(dk, dv, PatchConfig(rank=EnergyRank(0.9), arrangement=arrangement, storage=storage))
    patch = fit.patch
    widths = [dk.shape[1] * dk.shape[3] + dv.shape[1] * dv.shape[3]] if arrangement == "joint" else [48, 48]
    costs = [bytes_per_rank(dk.shape[2], widths[i % len(widths)], storage) for i in range(len(patch.blocks))]
    assert patch.nbytes == sum(r * c for r, c in zip(patch.ranks, costs, strict=True))
    assert [s.bytes_per_rank for s in fit.spectra] == costs
    back = Patch.from_dict(load(save(patch.to_dict())))
    assert back.ranks == patch.ranks
    assert back.arrangement == patch.arrangement
    for a, b in zip(back.dense(), patch.dense(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert io.BytesIO(save(patch.to_dict())).getbuffer().nbytes < patch.nbytes + 4096


def test_int8_error_is_within_half_a_step_per_element():
    dk, dv = synthetic_delta(n_layers=2)
    f32 = fit_delta(dk, dv, PatchConfig(rank=FixedRank(8), storage="float32")).patch
    i8 = fit_delta(dk, dv, PatchConfig(rank=FixedRank(8), storage="int8")).patch
    for layer in range(2):
        u, v = f32.blocks[layer].dense()
        qu, qv = i8.blocks[layer].dense()
        su, sv = i8.blocks[layer].u_scale, i8.blocks[layer].v_scale
        assert su is not None
        assert sv is not None
        assert bool(((qu - u).abs() <= su / 2 + 1e-7).all())
        assert bool(((qv - v).abs() <= sv / 2 + 1e-7).all())
        # elementwise bound on the product: |Δu| |v'|ᵀ + |u| |Δv|ᵀ
        bound = (su / 2).expand_as(u) @ qv.abs().T + u.abs() @ (sv / 2).expand_as(v).T
        assert bool(((qu @ qv.T - u @ v.T).abs() <= bound * (1 + 1e-4) + 1e-6).all())
        rel = (qu @ qv.T - u @ v.T).norm() / (u @ v.T).norm()
        assert float(rel) < 0.02


def test_quantize_int8_zero_column():
    q, s = quantize_int8(torch.zeros(5, 2))
    assert bool((q == 0).all())
    assert bool((s == 1).all())


def unfused_place(k, v, patch, positions, spec):
    ref_k, ref_v = reference_delta(patch)
    k_patched = (k.double() + ref_k).to(k.dtype)
    return rotate(k_patched, positions, spec), (v.double() + ref_v).to(v.dtype)


@pytest.mark.parametrize("arrangement", ["joint", "split"])
@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_apply_and_place_equals_add_then_rotate(arrangement, storage):
    torch.manual_seed(1)
    dk, dv = synthetic_delta(n_layers=3, n_tokens=40)
    canon_k, canon_v = torch.randn_like(dk), torch.randn_like(dv)
    patch = fit_delta(dk, dv, PatchConfig(rank=FixedRank(4), arrangement=arrangement, storage=storage)).patch
    spec = RopeSpec(default_inv_freq(16, 10000.0))
    positions = torch.arange(40, dtype=torch.int64) + 1234
    k, v = apply_and_place(canon_k, canon_v, patch, positions, spec)
    ref_k, ref_v = unfused_place(canon_k, canon_v, patch, positions, spec)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-5)


def test_apply_and_place_mla_mrope_and_half_precision():
    torch.manual_seed(2)
    n_tokens = 24
    canon_k = torch.randn(2, 1, n_tokens, 8)  # k_rope
    canon_v = torch.randn(2, 1, n_tokens, 32)  # latent
    dk, dv = 0.1 * torch.randn_like(canon_k), 0.1 * torch.randn_like(canon_v)
    patch = fit_delta(dk, dv, PatchConfig(rank=FixedRank(3), storage="bfloat16")).patch
    spec = RopeSpec(default_inv_freq(8, 10000.0), pairing="interleaved", mrope_section=(2, 1, 1))
    positions = torch.stack(
        [torch.arange(n_tokens) + 7, torch.arange(n_tokens) % 5, torch.arange(n_tokens) // 5]
    )
    k, v = apply_and_place(canon_k, canon_v, patch, positions, spec)
    ref_k, ref_v = unfused_place(canon_k, canon_v, patch, positions, spec)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-5)
    half_k, half_v = apply_and_place(canon_k.half(), canon_v.half(), patch, positions, spec)
    assert half_k.dtype == torch.float16
    assert half_v.dtype == torch.float16
    torch.testing.assert_close(half_k.float(), ref_k, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(half_v.float(), ref_v, atol=1e-2, rtol=1e-2)


def test_apply_and_place_without_patch_only_rotates():
    k, v = torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    spec = RopeSpec(default_inv_freq(8, 10000.0))
    positions = torch.arange(5, dtype=torch.int64)
    out_k, out_v = apply_and_place(k, v, None, positions, spec)
    torch.testing.assert_close(out_k, rotate(k, positions, spec))
    assert out_v is v


def test_rejects_mismatched_shapes():
    dk, dv = synthetic_delta(n_layers=2, n_tokens=10)
    patch = fit_delta(dk, dv, PatchConfig(rank=FixedRank(2))).patch
    with pytest.raises(ValueError, match="patch is for"):
        apply_patch(dk[:, :, :9], dv[:, :, :9], patch)
    with pytest.raises(ValueError, match="differ in shape"):
        fit_patch(dk, dv, dk[:1], dv, PatchConfig())
    with pytest.raises(ValueError, match="arrangement"):
        PatchConfig(arrangement="side")  # type: ignore[arg-type]
