"""The native quantised product: ``cache/qmatmul_native.c``, built once per machine, called by ctypes.

A decode step multiplies a few rows of activations by every weight matrix once: it is bound by
reading the weights. Read as float32 they are eight times the bytes of the GGUF blocks they were
dequantised from (Q4_1: 20 bytes per 32 weights), so the C loop reads the blocks, dequantises
them in registers to exactly the float32 values the model holds and multiplies them with the
float32 activations. A row's result does not depend on the other rows of the call (see the C
file). It is built and loaded like the rotation kernel (``cache/native.py``): on first use with
the machine's C compiler into ``$KAMERA_CACHE_DIR/kernels``, named by a hash of the source and
the compiler, written atomically; large products are split by output features over ``torch``'s
thread count (ctypes releases the GIL for the call).

Without a compiler (or on a build error) :func:`library` returns ``None`` once with a warning in
the log, and callers keep their float32 weights.

Not here: reading GGUF files or matching blocks to a model's weights
(``agent/adapters/qlinear.py``); CUDA tensors, autograd.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Lock
from typing import Any, NamedTuple

import numpy as np
import torch

from cache.native import NativeKernelError, compile_shared

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul_native.c")
BLOCK = 32  # weights per GGUF block
# GGML type ids and bytes per block of the types the kernel reads
Q4_1, Q8_0 = 3, 8
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
# Below this many weights times rows a product runs on the calling thread only: handing half of
# it to a pool thread costs tens of microseconds, more than it saves on a decode step's smaller
# products (measured with bench/decode.py; at one row only the LM head is split).
PARALLEL_MIN_WORK = 1 << 22
# The widest vector loops the kernel may use: 0 the best this CPU has, 1 none with AVX-512,
# 2 the plain loop only (for checking every path on one machine).
VECTOR_LIMIT = 0

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# w, kind, n_out, k, x, x row stride, rows, y, y row stride, the cap on vector loops
_ARGTYPES: list[Any] = [_PTR, _INT, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT]


class QWeight(NamedTuple):
    """A weight matrix ``[n_out, k]`` as rows of GGUF blocks: ``blocks`` uint8
    ``[n_out, k // 32 * BLOCK_BYTES[kind]]``, contiguous."""

    blocks: torch.Tensor
    kind: int
    n_out: int
    k: int


def build(folder: Path | None = None) -> Path:
    """The kernel's shared object for this machine (``cache.native.compile_shared``); no
    contracted multiply-adds, so each block dequantises with one rounding as the loader's does."""
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-shared", "-fPIC"]
    return compile_shared(SOURCE, "qmatmul", flags, folder)


class _Loaded:
    def __init__(self) -> None:
        self.lock = Lock()
        self.tried = False
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.pool_size = 0


_STATE = _Loaded()


def _after_fork_in_child() -> None:
    # a forked child has none of the parent's pool threads: start afresh (see cache/native.py)
    _STATE.lock = Lock()
    _STATE.pool, _STATE.pool_size = None, 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; ``None`` (logged once) where it cannot be."""
    with _STATE.lock:
        if not _STATE.tried:
            _STATE.tried = True
            try:
                lib = _load()
                lib.kamera_qmatmul_f32.argtypes = _ARGTYPES
                lib.kamera_qmatmul_f32.restype = ctypes.c_int
                _STATE.lib = lib
            except (NativeKernelError, OSError) as exc:
                _STATE.error = str(exc)
                log.warning("native quantised matmul unavailable, decoding with float32 weights: %s", exc)
        return _STATE.lib


def _load() -> ctypes.CDLL:
    path = build()
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # not a loadable object (damaged on disk): build again, once
        return ctypes.CDLL(str(build()))


def require() -> ctypes.CDLL:
    """The loaded kernel, or :class:`NativeKernelError` saying why there is none."""
    lib = library()
    if lib is None:
        raise NativeKernelError(f"the native quantised matmul is unavailable: {_STATE.error}")
    return lib


def _pool(threads: int) -> ThreadPoolExecutor:
    with _STATE.lock:
        if _STATE.pool is None or _STATE.pool_size != threads:
            if _STATE.pool is not None:
                _STATE.pool.shutdown(wait=False)
            _STATE.pool = ThreadPoolExecutor(threads, thread_name_prefix="kamera-qmatmul")
            _STATE.pool_size = threads
        return _STATE.pool


def dequantize(w: QWeight) -> torch.Tensor:
    """The float32 weights ``[n_out, k]`` the blocks hold, as gguf-py computes them (the
    reference the kernel's products are checked against)."""
    b = w.blocks.numpy().reshape(w.n_out, w.k // BLOCK, BLOCK_BYTES[w.kind])
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    if w.kind == Q4_1:
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
        out = d * q + m
    elif w.kind == Q8_0:
        out = b[..., 2:].view(np.int8).astype(np.float32) * d
    else:
        raise ValueError(f"unsupported block type {w.kind}")
    return torch.from_numpy(np.ascontiguousarray(out.reshape(w.n_out, w.k)))


def matmul(x: torch.Tensor, w: QWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[rows, k]`` float32 (unit feature stride) and W in GGUF blocks:
    ``[rows, n_out]`` float32, into ``out`` when given (any row stride, unit feature stride).

    Each output row depends on its input row only, bit for bit. Raises
    :class:`NativeKernelError` when the kernel is unavailable, ValueError on wrong shapes.
    """
    lib = require()
    if x.dim() != 2 or x.shape[1] != w.k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be CPU float32 [rows, {w.k}], got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, w.n_out, dtype=torch.float32)
    elif out.shape != (rows, w.n_out) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{rows}, {w.n_out}] with a unit feature stride")
    row_bytes = w.blocks.shape[1]
    wp, xp, yp = w.blocks.data_ptr(), x.data_ptr(), out.data_ptr()
    xs, ys = x.stride(0), out.stride(0)

    def part(lo: int, hi: int) -> None:
        code = lib.kamera_qmatmul_f32(
            wp + lo * row_bytes, w.kind, hi - lo, w.k, xp, xs, rows, yp + lo * 4, ys, VECTOR_LIMIT
        )
        if code != 0:
            raise NativeKernelError(f"kamera_qmatmul_f32 failed with {code}")

    split_run(part, w.n_out, 4, w.n_out * w.k * max(rows, 1) >= PARALLEL_MIN_WORK)
    return out


def split_run(part: Callable[[int, int], None], n: int, unit: int, parallel: bool) -> None:
    """``part(lo, hi)`` over ``range(n)``: at once where not ``parallel`` or with one thread, else
    in whole ``unit``s split over torch's threads, the calling thread taking the first part and the
    shared pool the rest (the native products' one pool, started afresh in a forked child)."""
    threads = torch.get_num_threads()
    if not parallel or threads < 2 or n <= unit:
        part(0, n)
        return
    step = -(-n // (unit * threads)) * unit
    bounds = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
    waits = [_pool(threads - 1).submit(part, lo, hi) for lo, hi in bounds[1:]]
    part(*bounds[0])
    for wait in waits:
        wait.result()
