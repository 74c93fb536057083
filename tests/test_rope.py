"""cache/rope.py against a slow float64 reference and against transformers' own rotary code."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import rope
from cache.rope import (
    RopeSpec,
    angles,
    cos_sin,
    default_inv_freq,
    linear_inv_freq,
    llama3_inv_freq,
    relocate,
    rotate,
    unrotate,
    yarn_inv_freq,
)


def reference_rotate(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Pair by pair, in float64: the obvious definition."""
    out = x.to(torch.float64).clone()
    rd = spec.rotary_dim
    h = rd // 2
    pos = positions if positions.dim() == 2 else positions[None].expand(spec.n_axes, -1)
    for j in range(h):
        ia, ib = (j, j + h) if spec.pairing == "half" else (2 * j, 2 * j + 1)
        axis = spec.frequency_axes[j]
        theta = pos[axis].to(torch.float64) * spec.inv_freq[j]
        c, s = theta.cos() * spec.attention_scaling, theta.sin() * spec.attention_scaling
        a, b = x[..., ia].to(torch.float64), x[..., ib].to(torch.float64)
        out[..., ia] = a * c - b * s
        out[..., ib] = b * c + a * s
    return out


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


_YARN = yarn_inv_freq(64, 10000.0, 4.0, 512, mscale=1.0, mscale_all_dim=0.5)
SPECS = {
    "half": RopeSpec(default_inv_freq(64, 10000.0)),
    "interleaved": RopeSpec(default_inv_freq(64, 10000.0), pairing="interleaved"),
    "partial": RopeSpec(default_inv_freq(16, 10000.0)),
    "yarn": RopeSpec(_YARN[0], pairing="interleaved", attention_scaling=_YARN[1]),
    "mrope": RopeSpec(default_inv_freq(32, 1e6), mrope_section=(4, 6, 6)),
    "mrope-interleaved": RopeSpec(default_inv_freq(32, 1e6), mrope_section=(6, 5, 5), mrope_interleaved=True),
}


def _positions(spec: RopeSpec, n: int, start: int) -> torch.Tensor:
    if spec.n_axes == 1:
        return torch.arange(start, start + n)
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 40, (3, n), generator=g) + start


@pytest.mark.parametrize("name", list(SPECS))
def test_rotate_matches_reference(name: str) -> None:
    spec = SPECS[name]
    x = torch.randn(2, 3, 17, 64)
    pos = _positions(spec, 17, 5)
    got = rotate(x, pos, spec)
    ref = reference_rotate(x, pos, spec)
    assert max_rel(got, ref) < 1e-6, max_rel(got, ref)
    if spec.rotary_dim < 64:
        assert torch.equal(got[..., spec.rotary_dim :], x[..., spec.rotary_dim :])


@pytest.mark.parametrize("name", list(SPECS))
def test_unrotate_inverts_rotate(name: str) -> None:
    spec = SPECS[name]
    x = torch.randn(3, 2, 33, 64)
    pos = _positions(spec, 33, 1000)
    back = unrotate(rotate(x, pos, spec), pos, spec)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(start=st.integers(0, 100_000), delta=st.integers(-50_000, 50_000), name=st.sampled_from(list(SPECS)))
def test_relocate_composes(start: int, delta: int, name: str) -> None:
    spec = SPECS[name]
    if start + delta < 0:
        delta = -start
    x = torch.randn(1, 2, 9, 64)
    pos = _positions(spec, 9, start)
    moved = relocate(rotate(x, pos, spec), delta, spec)
    ref = reference_rotate(x, pos + delta, spec)
    assert max_rel(moved, ref) < 2e-6


def test_large_positions_use_float64_angles() -> None:
    spec = SPECS["half"]
    x = torch.randn(1, 1, 4, 64)
    pos = torch.arange(3_000_000, 3_000_004)
    assert max_rel(rotate(x, pos, spec), reference_rotate(x, pos, spec)) < 1e-6


def test_bfloat16_is_rotated_in_float32_and_cast_back() -> None:
    spec = SPECS["half"]
    x = torch.randn(2, 8, 64).to(torch.bfloat16)
    pos = torch.arange(100, 108)
    got = rotate(x, pos, spec)
    assert got.dtype == torch.bfloat16
    assert max_rel(got, reference_rotate(x, pos, spec)) < 1e-2


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="pairing"):
        RopeSpec((1.0,), pairing="diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mrope_section"):
        RopeSpec(default_inv_freq(32, 1e4), mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="positions"):
        rotate(torch.randn(1, 5, 64), torch.arange(4), SPECS["half"])
    with pytest.raises(ValueError, match=r"\[3, T\]"):
        rotate(torch.randn(1, 5, 64), torch.zeros(2, 5, dtype=torch.long), SPECS["mrope"])


# --- against transformers ----------------------------------------------------------------


def test_inverse_frequency_builders_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def hf(rope_parameters: dict[str, object], **kw: object) -> tuple[list[float], float]:
        cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope_parameters, **kw)
        inv, scaling = ROPE_INIT_FUNCTIONS[str(rope_parameters["rope_type"])](cfg, "cpu")
        return inv.tolist(), float(scaling)

    inv, _ = hf({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    assert list(linear_inv_freq(64, 10000.0, 4.0)) == inv
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    inv, _ = hf(params)
    assert list(llama3_inv_freq(64, 500000.0, 8.0, 1.0, 4.0, 8192)) == inv
    params = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    }
    inv, scaling = hf(params, max_position_embeddings=163840)
    ours, ours_scaling = yarn_inv_freq(64, 10000.0, 40.0, 4096, 32, 1, 0.707, 0.707)
    assert list(ours) == inv
    assert math.isclose(ours_scaling, scaling)


def test_split_half_matches_llama_apply_rotary() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    spec = SPECS["half"]
    k = torch.randn(1, 3, 12, 64)
    pos = torch.arange(40, 52)
    inv = torch.tensor(spec.inv_freq, dtype=torch.float32)
    freqs = pos[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    _, hf_k = apply_rotary_pos_emb(k, k, emb.cos()[None], emb.sin()[None])
    assert max_rel(rotate(k, pos, spec), hf_k) < 1e-5


def test_interleaved_matches_deepseek_apply_rotary() -> None:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    spec = SPECS["yarn"]
    k = torch.randn(1, 1, 12, 64)
    pos = torch.arange(7, 19)
    freqs = pos[:, None].float() * torch.tensor(spec.inv_freq, dtype=torch.float32)
    cis = torch.polar(torch.ones_like(freqs), freqs) * spec.attention_scaling
    _, hf_k = apply_rotary_emb(k, k, cis[None])
    assert max_rel(rotate(k, pos, spec), hf_k) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_matches_qwen_vl_recomposition(interleaved: bool) -> None:
    spec = SPECS["mrope-interleaved" if interleaved else "mrope"]
    pos = _positions(spec, 10, 3)
    inv = torch.tensor(spec.inv_freq, dtype=torch.float32)
    freq = pos[:, None, :, None].float() * inv  # [3, 1, T, F]
    if interleaved:
        thw = freq[0].clone()
        for dim, offset in ((1, 1), (2, 2)):
            idx = slice(offset, spec.mrope_section[dim] * 3, 3)  # type: ignore[index]
            thw[..., idx] = freq[dim, ..., idx]
        chosen = thw
    else:
        chosen = torch.cat(
            [m[i % 3] for i, m in enumerate(freq.split(list(spec.mrope_section), dim=-1))], dim=-1
        )  # type: ignore[arg-type]
    emb = torch.cat((chosen, chosen), dim=-1)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    k = torch.randn(1, 2, 10, 32)
    _, hf_k = apply_rotary_pos_emb(k, k, emb.cos(), emb.sin())
    assert max_rel(rotate(k, pos, spec), hf_k) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["half", "interleaved", "partial", "mrope"])
def test_compiled_kernel_matches_eager(name: str) -> None:
    spec = SPECS[name]
    x = torch.randn(2, 3, 40, 64)
    pos = _positions(spec, 40, 11)
    eager = rotate(x, pos, spec)
    compiled = rotate(x, pos, spec, kernel="compiled")
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="kernel"):
        rotate(torch.randn(1, 4, 64), torch.arange(4), SPECS["half"], kernel="fast")


@pytest.mark.parametrize("name", ["half", "partial", "mrope", "mrope-interleaved"])
def test_cos_sin_tables_equal_the_angles_they_stand_for(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SPECS[name]
    cases = [_positions(spec, 50, 3), _positions(spec, 7, 9000), torch.arange(-5, 5)]
    if spec.n_axes == 3:
        cases.append(torch.arange(20))  # text on an M-RoPE model: all axes alike
    monkeypatch.setattr(rope, "POSITION_TABLE_BYTES", 8 * spec.rotary_dim * 1000)  # 2000 positions
    for pos in cases:  # under the table bound, past it, and negative
        a = angles(pos, spec)
        cos, sin = cos_sin(pos, spec)
        torch.testing.assert_close(cos, a.cos().float(), rtol=0, atol=0)
        torch.testing.assert_close(sin, a.sin().float(), rtol=0, atol=0)
