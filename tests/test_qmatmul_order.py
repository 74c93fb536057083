"""cache/qmatmul_native.c sums in its documented order: every output of every loop (few rows with
blocks dequantised in registers, one or two rows of W at a time; many rows over a dequantised
buffer), on every vector path this CPU has, threaded or not, equals bit for bit a plain reference
of that order, for 1 to 40 rows."""

from __future__ import annotations

import platform
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from cache import qmatmul
from cache.qmatmul import Q4_1, Q8_0
from tests.test_qlinear import random_weight

pytestmark = pytest.mark.skipif(qmatmul.library() is None, reason="no C compiler on this machine")

MAX_ROWS = 40
# (n_out, k): odd n_out leaves a last row of W alone and a partial buffer of rows; 25 blocks of k
# make eight rows of x too long for the kernel's L1 budget, so it pairs rows of W
SHAPES = [(13, 96), (11, 800)]


def _cpu_flags() -> set[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def vector_path(limit: int) -> str:
    """The loop the kernel takes here under ``VECTOR_LIMIT = limit``: avx512, avx2 or plain."""
    flags = _cpu_flags()
    avx2 = limit < 2 and {"avx2", "fma", "f16c"} <= flags
    if avx2 and limit < 1 and "avx512f" in flags:
        return "avx512"
    return "avx2" if avx2 else "plain"


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once, as a fused multiply-add: the product is exact in
    float64, the sum rounded to float64 with its error kept (TwoSum), and a float64 sum that
    lies exactly halfway between two float32 values moved one float64 step towards the error,
    so that rounding it to float32 gives the rounding of the exact value."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    back = s - p
    err = (p - (s - back)) + (c64 - back)
    halfway = (s.view(np.uint64) & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)
    fix = halfway & (err != 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def reference(x: np.ndarray, w: np.ndarray, path: str) -> np.ndarray:
    """``x @ w.T`` ([rows, k] by [n_out, k], float32) summed in the kernel's order on ``path``."""
    prod = x[:, None, :], w[None, :, :]  # [rows, 1, k], [1, n_out, k]
    if path == "plain":  # eight lanes, lane l takes k = 8 i + l, each product rounded, then added
        a = np.zeros((x.shape[0], w.shape[0], 8), np.float32)
        for c in range(0, x.shape[1], 8):
            a = a + prod[0][..., c : c + 8] * prod[1][..., c : c + 8]
        low = (a[..., 0] + a[..., 4]) + (a[..., 1] + a[..., 5])
        return low + ((a[..., 2] + a[..., 6]) + (a[..., 3] + a[..., 7]))
    lanes = 16 if path == "avx512" else 8
    # the runs of lanes of a block that each accumulator takes, in order
    runs = [[0], [1]] if lanes == 16 else [[0, 2], [1, 3]]
    acc = [np.zeros((x.shape[0], w.shape[0], lanes), np.float32) for _ in runs]
    for c in range(0, x.shape[1], 32):
        for i, taken in enumerate(runs):
            for run in taken:
                at = slice(c + run * lanes, c + (run + 1) * lanes)
                acc[i] = fma32(prod[0][..., at], prod[1][..., at], acc[i])
    s = acc[0] + acc[1]
    while s.shape[-1] > 1:  # lane l plus lane l + half, halving
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    return s[..., 0]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("limit", [0, 1, 2])
@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_output_is_summed_in_the_documented_order(
    shape: tuple[int, int], kind: int, limit: int, parallel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qmatmul, "VECTOR_LIMIT", limit)
    monkeypatch.setattr(qmatmul, "PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    n_out, k = shape
    w = random_weight(kind, n_out, k, seed=kind + k)
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(k))
    want = torch.from_numpy(reference(x.numpy(), qmatmul.dequantize(w).numpy(), vector_path(limit)))
    for rows in range(1, MAX_ROWS + 1):
        got = qmatmul.matmul(x[:rows], w)
        wrong = (got != want[:rows]).sum().item()
        assert wrong == 0, f"{rows} rows: {wrong} of {got.numel()} outputs differ from the documented order"


def round32(v: Fraction) -> np.float32:
    """The float32 nearest to v, ties to even."""
    near = np.float32(float(v))
    cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(cands, key=lambda f: (abs(Fraction(float(f)) - v), int(f.view(np.uint32)) % 2))


def test_the_fused_reference_rounds_once() -> None:
    """fma32 against exact arithmetic: random values, and sums whose float64 rounding lands
    halfway between two float32 values (where rounding twice would be wrong)."""
    gen = np.random.default_rng(0)
    a = gen.standard_normal(300).astype(np.float32)
    b = gen.standard_normal(300).astype(np.float32)
    c = gen.standard_normal(300).astype(np.float32)
    # (1 + 2^-18) * 2^-24 (1 - 2^-18) + (1 + 2^-23) is just below a float32 halfway point
    scale = np.float32(2.0) ** gen.integers(-20, 20, 40).astype(np.float32)
    sign = np.where(gen.random(40) < 0.5, np.float32(-1), np.float32(1))
    a = np.concatenate([a, np.full(40, 1 + 2**-18, np.float32) * sign])
    b = np.concatenate([b, np.full(40, 2**-24 * (1 - 2**-18), np.float32) * scale])
    c = np.concatenate([c, np.full(40, 1 + 2**-23, np.float32) * scale * sign])
    got = fma32(a, b, c)
    for ai, bi, ci, gi in zip(a, b, c, got, strict=True):
        exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
        assert gi == round32(exact), (ai, bi, ci)
    assert got[-1] != np.float32(np.float64(a[-1]) * np.float64(b[-1]) + np.float64(c[-1]))  # twice: wrong
