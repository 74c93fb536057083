"""The native decode attention (``cache/attend.py``): what SDPA computes, one fixed order on every
path, a row's result independent of the others in the call, and its arena writes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cache import attend

pytestmark = pytest.mark.skipif(attend.library() is None, reason="no C compiler for the native kernel")


def _cache(heads: int, tokens: int, d: int, room: int = 0, seed: int = 0) -> torch.Tensor:
    """``[1, heads, tokens, d]`` keys or values, a view into a buffer with ``room`` spare tokens
    (as an arena holds them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, tokens + room, d, generator=g)[:, :, :tokens]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    heads, d = q.shape
    kv = k.shape[1]
    query = q.double().view(1, kv, heads // kv, d)
    return F.scaled_dot_product_attention(query, k.double(), v.double(), scale=scale).reshape(-1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 3, 24), (2, 1, 8)]
)
def test_attention_is_sdpas_to_float_rounding(heads: int, kv_heads: int, d: int) -> None:
    lengths = [1, 2, 15, 16, 17, 100, 301]
    q = torch.randn(len(lengths), heads, d, generator=torch.Generator().manual_seed(1))
    keys = [_cache(kv_heads, t, d, room=5, seed=2 * i) for i, t in enumerate(lengths)]
    values = [_cache(kv_heads, t, d, room=3, seed=2 * i + 1) for i, t in enumerate(lengths)]
    scale = d**-0.5
    out = attend.attend_rows(q, keys, values, scale)
    for r in range(len(lengths)):
        ref = _reference(q[r], keys[r], values[r], scale)
        assert float((out[r].double() - ref).abs().max()) < 2e-6, f"row {r} of {lengths[r]} tokens"


def test_large_scores_keep_their_weights() -> None:
    """Scores far apart (a softmax with weights below e^-87 taken as 0) still match SDPA."""
    q = torch.full((1, 2, 16), 4.0)
    k = _cache(1, 40, 16, seed=3) * 6
    v = _cache(1, 40, 16, seed=4)
    out = attend.attend_rows(q, [k], [v], 1.0)
    assert torch.isfinite(out).all()
    assert float((out[0].double() - _reference(q[0], k, v, 1.0)).abs().max()) < 1e-5


def test_the_vector_and_plain_loops_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("this CPU runs the plain loop only")
    rng = random.Random(5)
    for heads, kv_heads, d in [(9, 3, 64), (3, 3, 40), (8, 2, 128)]:
        lengths = [rng.randint(1, 260) for _ in range(6)]
        q = torch.randn(len(lengths), heads, d)
        keys = [_cache(kv_heads, t, d, seed=rng.randrange(1 << 30)) for t in lengths]
        values = [_cache(kv_heads, t, d, seed=rng.randrange(1 << 30)) for t in lengths]
        wide = attend.attend_rows(q, keys, values, 0.125)
        monkeypatch.setattr(attend, "VECTOR_LIMIT", 2)
        plain = attend.attend_rows(q, keys, values, 0.125)
        monkeypatch.setattr(attend, "VECTOR_LIMIT", 0)
        assert torch.equal(wide, plain)


def test_a_row_is_the_same_alone_and_among_others() -> None:
    rng = random.Random(11)
    heads, kv_heads, d = 9, 3, 64
    q = torch.randn(1, heads, d)
    k, v = _cache(kv_heads, 77, d, seed=1), _cache(kv_heads, 77, d, seed=2)
    alone = attend.attend_rows(q, [k], [v], 0.125)[0]
    for others in (1, 5, 31):
        lengths = [rng.randint(1, 400) for _ in range(others)]
        at = rng.randint(0, others)
        ks = [_cache(kv_heads, t, d, seed=rng.randrange(1 << 30)) for t in lengths]
        vs = [_cache(kv_heads, t, d, seed=rng.randrange(1 << 30)) for t in lengths]
        ks.insert(at, k)
        vs.insert(at, v)
        qs = torch.randn(others + 1, heads, d)
        qs[at] = q[0]
        assert torch.equal(attend.attend_rows(qs, ks, vs, 0.125)[at], alone)


def test_the_new_token_is_written_then_read() -> None:
    """``attend_slots`` with new keys and values writes them at each row's last slot and attends
    over them: the same bits as attending over caches that already hold them."""
    heads, kv_heads, d, room = 6, 2, 32, 4
    lengths = [3, 50]
    buffers = [torch.randn(2, kv_heads, t + room, d) for t in lengths]  # keys, values with spare room
    new_k, new_v = torch.randn(len(lengths), kv_heads, d), torch.randn(len(lengths), kv_heads, d)
    q = torch.randn(len(lengths), heads, d)
    table = np.array(
        [
            [b[0].data_ptr() for b in buffers],
            [b[1].data_ptr() for b in buffers],
            [b.stride(1) for b in buffers],
            [b.stride(1) for b in buffers],
            [t + 1 for t in lengths],
        ],
        dtype=np.int64,
    )
    before = [b.clone() for b in buffers]
    out = attend.attend_slots(q, table, kv_heads, 0.2, new=(new_k, new_v))
    for r, (b, t) in enumerate(zip(buffers, lengths, strict=True)):
        assert torch.equal(b[0, :, t], new_k[r])
        assert torch.equal(b[1, :, t], new_v[r])
        assert torch.equal(b[:, :, :t], before[r][:, :, :t])
        assert torch.equal(b[:, :, t + 1 :], before[r][:, :, t + 1 :])
    views = attend.attend_rows(
        q,
        [b[0, None, :, : t + 1] for b, t in zip(buffers, lengths, strict=True)],
        [b[1, None, :, : t + 1] for b, t in zip(buffers, lengths, strict=True)],
        0.2,
    )
    assert torch.equal(out, views)


def test_caches_laid_out_otherwise_are_read_the_same() -> None:
    """Keys whose tokens do not lie D floats apart (a transposed copy) give the same bits."""
    q = torch.randn(1, 4, 16)
    k, v = _cache(2, 9, 16, seed=1), _cache(2, 9, 16, seed=2)
    odd_k = k.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, tokens 1 float apart
    assert odd_k.stride(-1) != 1
    assert torch.equal(attend.attend_rows(q, [odd_k], [v], 0.5), attend.attend_rows(q, [k], [v], 0.5))


def test_what_it_cannot_take_is_refused() -> None:
    q = torch.randn(2, 4, 16)
    k, v = _cache(2, 5, 16), _cache(2, 5, 16)
    with pytest.raises(ValueError, match="2 queries, 1 key"):
        attend.attend_rows(q, [k], [v, v], 1.0)
    with pytest.raises(ValueError, match="row 1"):
        attend.attend_rows(q, [k, _cache(2, 6, 16)], [v, v], 1.0)
    with pytest.raises(ValueError, match="float32"):
        attend.attend_rows(q, [k, k.double()], [v, v], 1.0)
    with pytest.raises(ValueError, match="row 1"):
        attend.attend_rows(q, [k, k.transpose(2, 3)], [v, v.transpose(2, 3)], 1.0)
    with pytest.raises(ValueError, match="do not group"):
        attend.attend_rows(torch.randn(2, 3, 16), [k, k], [v, v], 1.0)
    table = np.zeros((5, 1), dtype=np.int64)  # zero tokens: refused before any address is read
    with pytest.raises(ValueError, match="refused"):
        attend.attend_slots(torch.randn(1, 4, 16), table, 2, 1.0)
