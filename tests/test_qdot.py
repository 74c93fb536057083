"""cache/qdot.py: GGUF blocks times int8-quantised activations. Every path gives the bits of a
NumPy reference of the kernel's formula, a row's result is the same alone and among others, the
packed layout holds the blocks' codes, and the result stays within the quantisation's bound of the
float32 product."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cache import qdot, qmatmul
from cache.native import NativeKernelError
from cache.qmatmul import BLOCK, Q4_1, Q8_0, QWeight
from tests.test_qlinear import random_weight

pytestmark = pytest.mark.skipif(qdot.library() is None, reason="no C compiler on this machine")

KINDS = [Q4_1, Q8_0]


@pytest.fixture(params=[0, 2], ids=["best", "plain"])
def limit(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    if request.param == 0 and not qdot.vectorised():
        pytest.skip("no AVX-512 VNNI on this CPU: the plain loop is checked on its own")
    monkeypatch.setattr(qdot, "VECTOR_LIMIT", request.param)
    return request.param


SHAPES = [(1, 32, 1), (16, 64, 3), (37, 96, 13), (200, 576, 8), (48, 1536, 25)]  # n_out, k, rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n_out", "k", "rows"), SHAPES)
def test_every_path_gives_the_references_bits(kind: int, n_out: int, k: int, rows: int, limit: int) -> None:
    w = random_weight(kind, n_out, k, seed=n_out + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    got = qdot.matmul(x, qdot.pack(w))
    assert torch.equal(got, qdot.reference(x, w))


@pytest.mark.parametrize("kind", KINDS)
def test_within_the_quantisations_bound_of_the_float32_product(kind: int) -> None:
    """Each block of x is off by at most half a step (max |x| / 254) per value: the product is
    off by at most sum over blocks of that step times the block's sum of |w|."""
    w = random_weight(kind, 64, 576)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    W = qmatmul.dequantize(w).double()
    exact = x.double() @ W.T
    got = qdot.matmul(x, qdot.pack(w)).double()
    step = x.double().reshape(5, -1, BLOCK).abs().amax(-1) / 254  # [rows, blocks]
    bound = torch.einsum("rb,jb->rj", step, W.abs().reshape(64, -1, BLOCK).sum(-1))
    assert bool(((got - exact).abs() <= bound * 1.001 + 1e-5).all())
    assert float((got - exact).abs().max()) > 0  # quantised: not the float32 product


def _moves_with_its_batch(product, k: int) -> bool:
    """Whether a needle row's result changes with the rows around it (1 to 40 others of other
    scales, the needle anywhere)."""
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(4)
    needle = torch.randn(1, k, generator=gen)
    alone = product(needle)[0]
    for others in (1, 11, 12, 13, 40):  # around the kernel's tile of rows
        batch = torch.randn(others + 1, k, generator=gen) * rng.choice([0.01, 1.0, 100.0])
        at = rng.randint(0, others)
        batch[at] = needle[0]
        if not torch.equal(product(batch)[at], alone):
            return True
    return False


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_alone_and_among_others_anywhere(kind: int, limit: int) -> None:
    w = qdot.pack(random_weight(kind, 80, 192, seed=5))
    assert not _moves_with_its_batch(lambda x: qdot.matmul(x, w), 192)


def test_the_check_catches_a_batch_dependent_quantisation() -> None:
    """Inverse: quantising with one scale for the whole batch (a shortcut a batched kernel could
    take) changes a row's result with its neighbours, and the check above sees it."""
    W = qmatmul.dequantize(random_weight(Q4_1, 80, 192, seed=5))

    def shared_scale(x: torch.Tensor) -> torch.Tensor:
        d = x.abs().amax() / 127
        return (torch.round(x / d).clamp(-127, 127) * d) @ W.T

    assert _moves_with_its_batch(shared_scale, 192)


def test_the_quantised_rows() -> None:
    x = torch.randn(4, 128)
    xq = qdot.quantise(x)
    assert xq.q.dtype == torch.int8
    assert int(xq.q.abs().max()) <= 127
    assert torch.equal(xq.qsum, xq.q.reshape(4, -1, BLOCK).sum(-1, dtype=torch.int32))


def test_the_packed_layout_holds_the_codes() -> None:
    """Run p, byte 4j + t of a Q4_1 group holds codes 4p + t (low nibble) and 4(p + 4) + t (high)
    of output row j; Q8_0 holds code + 128."""
    for kind in KINDS:
        w = random_weight(kind, 20, 64, seed=kind)  # 20 rows: a second, partial group
        p = qdot.pack(w)
        assert p.codes.shape == (2, 2, 256 if kind == Q4_1 else 512)
        W = qmatmul.dequantize(w)
        blocks = w.blocks.numpy().reshape(20, 2, -1)
        j, b = 17, 1
        g, lane = divmod(j, qdot.GROUP)
        d = float(blocks[j, b, 0:2].view(np.float16)[0])
        assert float(p.scales[g, b, lane]) == d
        runs = p.codes[g, b].numpy().reshape(-1, 64)
        if kind == Q4_1:
            m = float(blocks[j, b, 2:4].view(np.float16)[0])
            assert float(p.scales[g, b, qdot.GROUP + lane]) == m
            for i in range(BLOCK):
                p_run, t = (i // 4) % 4, i % 4
                byte = int(runs[p_run, 4 * lane + t])
                c = byte & 0x0F if i < 16 else byte >> 4
                assert float(W[j, b * BLOCK + i]) == pytest.approx(d * c + m, abs=0, rel=1e-6)
        else:
            for i in range(BLOCK):
                c = int(runs[i // 4, 4 * lane + i % 4]) - 128
                assert float(W[j, b * BLOCK + i]) == pytest.approx(d * c, abs=0, rel=1e-6)
        pad = p.codes[1].reshape(-1, 64)[:, 4 * 4 :]  # rows 20..31 of the last group: code 0
        assert bool((pad == (0 if kind == Q4_1 else 128)).all())


def test_a_row_that_is_not_finite_gives_nan_and_leaves_the_others(limit: int) -> None:
    w = qdot.pack(random_weight(Q4_1, 16, 64))
    x = torch.randn(3, 64)
    clean = qdot.matmul(x, w)
    x[1, 40] = float("inf")
    got = qdot.matmul(x, w)
    assert bool(torch.isnan(got[1]).all())
    assert torch.equal(got[[0, 2]], clean[[0, 2]])


def test_a_zero_row_gives_zeros() -> None:
    w = random_weight(Q4_1, 16, 64)
    assert torch.equal(qdot.matmul(torch.zeros(2, 64), qdot.pack(w)), torch.zeros(2, 16))


def test_splits_over_threads_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    w = qdot.pack(random_weight(Q4_1, 1024, 576))
    x = torch.randn(9, 576)
    monkeypatch.setattr(qdot, "PARALLEL_MIN_WORK", 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        split = qdot.matmul(x, w)
        torch.set_num_threads(1)
        whole = qdot.matmul(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, whole)


def test_writes_into_a_strided_output() -> None:
    w = random_weight(Q8_0, 32, 64)
    x = torch.randn(3, 64)
    out = torch.zeros(3, 50)
    qdot.matmul(x, qdot.pack(w), out=out[:, 10:42])
    assert torch.equal(out[:, 10:42], qdot.reference(x, w))
    assert not out[:, :10].any()
    assert not out[:, 42:].any()


def test_wrong_shapes_and_types_are_refused() -> None:
    w = qdot.pack(random_weight(Q4_1, 16, 64))
    with pytest.raises(ValueError, match="features"):
        qdot.matmul(torch.randn(2, 96), w)
    with pytest.raises(ValueError, match="multiple of 32"):
        qdot.quantise(torch.randn(2, 40))
    with pytest.raises(ValueError, match="float32"):
        qdot.matmul(torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="float32"):
        qdot.matmul(torch.randn(64), w)
    with pytest.raises(ValueError, match="out must be"):
        qdot.matmul(torch.randn(2, 64), w, out=torch.empty(2, 15))
    with pytest.raises(ValueError, match="block type"):
        qdot.pack(QWeight(torch.zeros(1, 18, dtype=torch.uint8), 2, 1, 32))


def test_an_unbuilt_kernel_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qdot.KERNEL, "tried", True)
    monkeypatch.setattr(qdot.KERNEL, "lib", None)
    monkeypatch.setattr(qdot.KERNEL, "error", "no compiler")
    assert not qdot.vectorised()
    with pytest.raises(NativeKernelError, match="no compiler"):
        qdot.matmul(torch.randn(1, 64), qdot.pack(random_weight(Q4_1, 16, 64)))
