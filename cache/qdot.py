"""Integer decode products: GGUF blocks times activations quantised to int8 (``qdot_native.c``).

A decode step of a few rows is bound by the float32 multiply-adds of its products, not by the
weights it reads (``docs/decode.md``): every (row, weight) pair is one float32 lane. llama.cpp's
CPU products quantise each row of activations to int8 in blocks of 32 and take the blocks' dot
products with the weights' integer codes in int32, four byte products per 32-bit lane in one
instruction (AVX-512 VNNI), which is four times the work per instruction. This module does the
same for the kernel's two block types (Q4_1, Q8_0), with the weights packed once in groups of 16
output rows so that the int32 sums of 16 outputs land in one vector and the block's scales are
applied lane by lane (see the C file for the formula and the layout).

Every integer sum is exact and the float32 steps after it are one fixed sequence per output, so
a row's result is the same bits on every path (AVX-512 VNNI, plain C) and whatever else is in the
call. The numbers differ from the float32 products (``cache/qmatmul.py``) by the activations'
quantisation: about 0.4% of a row's largest value per block, as in llama.cpp.

Built and loaded by ``cache.native.Kernel``; where it cannot be, :func:`library` is ``None`` and
callers keep the float32 block products.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from cache.native import Kernel, NativeKernelError
from cache.qmatmul import BLOCK, BLOCK_BYTES, Q4_1, Q8_0, QWeight, split_run

GROUP = 16  # output rows per packed group: one float32 lane each
# Below this many weights times rows a product runs on the calling thread only. Handing part of
# a product to a pool thread cost about 100 microseconds on a two-core machine, more than the
# integer products of a decode step save by it except the LM head's from 8 rows and gate/up's at
# 32 (measured per product shape of the embedded model at 1, 8 and 32 rows, one thread against two).
PARALLEL_MIN_WORK = 1 << 25
# The widest vector loop the kernel may use: 0 AVX-512 VNNI where the CPU has it, 2 the plain loop.
VECTOR_LIMIT = 0

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
KERNEL = Kernel(
    Path(__file__).with_name("qdot_native.c"),
    "qdot",
    # no contracted multiply-adds: each block's float steps are rounded as written, on every path
    ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"],
    {
        # codes, scales, kind, n_out, k, x, x row stride, rows, y, y row stride, vector cap
        "kamera_qdot_f32": ([_PTR, _PTR, _INT, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], _INT),
        # x, x row stride, rows, k, q, dx, sx, qsum
        "kamera_qdot_quantise": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR], _INT),
        "kamera_qdot_vectorised": ([], _INT),
    },
    "decoding with float32 block products",
)


class QPacked(NamedTuple):
    """A weight matrix ``[n_out, k]`` packed for the integer kernel: ``codes`` uint8
    ``[groups, k // 32, 256 or 512]`` and ``scales`` float16 ``[groups, k // 32, 32 or 16]``
    (dw, then mw for Q4_1), ``groups = ceil(n_out / 16)``."""

    codes: torch.Tensor
    scales: torch.Tensor
    kind: int
    n_out: int
    k: int


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; ``None`` (logged once) where it cannot be."""
    return KERNEL.library()


def vectorised() -> bool:
    """Whether the kernel runs its AVX-512 VNNI loop here. Elsewhere its plain loop gives the
    same bits far more slowly than the float32 block products, so callers that want speed keep
    those."""
    lib = KERNEL.library()
    return lib is not None and bool(lib.kamera_qdot_vectorised())


def pack(w: QWeight) -> QPacked:
    """The blocks of ``w`` rearranged for the kernel (the layout in ``qdot_native.c``)."""
    if w.kind not in (Q4_1, Q8_0):
        raise ValueError(f"unsupported block type {w.kind}")
    nb = w.k // BLOCK
    groups = -(-w.n_out // GROUP)
    b = w.blocks.numpy().reshape(w.n_out, nb, BLOCK_BYTES[w.kind])
    pad = groups * GROUP - w.n_out
    if pad:
        b = np.concatenate([b, np.zeros((pad, nb, b.shape[2]), dtype=np.uint8)])
    b = b.reshape(groups, GROUP, nb, b.shape[2]).transpose(0, 2, 1, 3)  # [groups, nb, 16, bytes]
    if w.kind == Q4_1:
        qs = b[..., 4:]
        c = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # codes in order of k: [.., 16, 32]
        scales = np.concatenate([b[..., 0:2], b[..., 2:4]], axis=2)  # dw of 16 rows, then mw
        # run p, byte 4j + t: c[j, 4p + t] low, c[j, 4(p + 4) + t] high
        lo = c[..., :16].reshape(groups, nb, GROUP, 4, 4).transpose(0, 1, 3, 2, 4)
        hi = c[..., 16:].reshape(groups, nb, GROUP, 4, 4).transpose(0, 1, 3, 2, 4)
        codes = (lo | (hi << 4)).reshape(groups, nb, 256)
    else:
        c = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [.., 16, 32]
        scales = b[..., 0:2]
        codes = c.reshape(groups, nb, GROUP, 8, 4).transpose(0, 1, 3, 2, 4).reshape(groups, nb, 512)
    scales = np.ascontiguousarray(scales).view(np.float16).reshape(groups, nb, -1)
    return QPacked(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        w.kind,
        w.n_out,
        w.k,
    )


class Quantised(NamedTuple):
    """Rows of activations quantised for the kernel: int8 codes ``[rows, k]``, and per block of
    32 the scale ``dx``, ``sx = dx * sum(codes)`` and the sum of codes."""

    q: torch.Tensor
    dx: torch.Tensor
    sx: torch.Tensor
    qsum: torch.Tensor


def quantise(x: torch.Tensor) -> Quantised:
    """``x`` ``[rows, k]`` float32 quantised in blocks of 32 (``dx = max |x| / 127``)."""
    lib = KERNEL.require()
    if x.dim() != 2 or x.shape[1] % BLOCK or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(
            f"x must be CPU float32 [rows, k] with k a multiple of 32, got {x.dtype} {tuple(x.shape)}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    nb = k // BLOCK
    out = Quantised(
        torch.empty(rows, k, dtype=torch.int8),
        torch.empty(rows, nb, dtype=torch.float32),
        torch.empty(rows, nb, dtype=torch.float32),
        torch.empty(rows, nb, dtype=torch.int32),
    )
    code = lib.kamera_qdot_quantise(x.data_ptr(), x.stride(0), rows, k, *(t.data_ptr() for t in out))
    if code != 0:
        raise NativeKernelError(f"kamera_qdot_quantise failed with {code}")
    return out


def matmul(x: torch.Tensor, w: QPacked, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` with x's rows quantised to int8 as :func:`quantise` does (in the same call):
    x float32 ``[rows, k]`` (unit feature stride), ``[rows, n_out]`` float32 out, into ``out``
    when given (any row stride, unit feature stride).

    Each output row depends on its input row only, bit for bit. Raises
    :class:`NativeKernelError` when the kernel is unavailable, ValueError on wrong shapes.
    """
    lib = KERNEL.require()
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be CPU float32 [rows, {w.k}], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != w.k:
        raise ValueError(f"x has {x.shape[1]} features, the weight {w.k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, w.n_out, dtype=torch.float32)
    elif out.shape != (rows, w.n_out) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{rows}, {w.n_out}] with a unit feature stride")
    code_step, scale_step = w.codes.stride(0), w.scales.stride(0) * 2  # bytes per group
    cp, sp, xp, yp = w.codes.data_ptr(), w.scales.data_ptr(), x.data_ptr(), out.data_ptr()
    xs, ys = x.stride(0), out.stride(0)

    def part(lo: int, hi: int) -> None:  # outputs, lo a multiple of GROUP
        g0 = lo // GROUP
        code = lib.kamera_qdot_f32(
            cp + g0 * code_step,
            sp + g0 * scale_step,
            w.kind,
            hi - lo,
            w.k,
            xp,
            xs,
            rows,
            yp + lo * 4,
            ys,
            VECTOR_LIMIT,
        )
        if code != 0:
            raise NativeKernelError(f"kamera_qdot_f32 failed with {code}")

    split_run(part, w.n_out, GROUP, w.n_out * w.k * max(rows, 1) >= PARALLEL_MIN_WORK)
    return out


def reference(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """The kernel's result computed with NumPy from the unpacked blocks, step by step in the
    kernel's order (the check for every path)."""
    xq = quantise(x)
    rows, k = xq.q.shape
    nb = k // BLOCK
    b = w.blocks.numpy().reshape(w.n_out, nb, BLOCK_BYTES[w.kind])
    dw = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]  # [n_out, nb]
    if w.kind == Q4_1:
        qs = b[..., 4:]
        c = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
        mw = b[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    else:
        c = b[..., 2:].view(np.int8).astype(np.int64)
        mw = None
    q = xq.q.numpy().reshape(rows, nb, BLOCK).astype(np.int64)
    dx, sx = xq.dx.numpy(), xq.sx.numpy()
    isum = np.einsum("jbi,rbi->rjb", c, q).astype(np.float32)  # exact: |sum| < 2^24
    acc = np.zeros((rows, w.n_out), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for blk in range(nb):
            scale = (dw[None, :, blk] * dx[:, None, blk]).astype(np.float32)
            acc = (acc + (isum[:, :, blk] * scale).astype(np.float32)).astype(np.float32)
            if mw is not None:
                acc = (acc + (mw[None, :, blk] * sx[:, None, blk]).astype(np.float32)).astype(np.float32)
    return torch.from_numpy(acc)
