"""Decode attention for many sequences in one native call: ``cache/attend_native.c``.

A decode step attends one new query token per sequence over that sequence's own cache. Run as
one ``scaled_dot_product_attention`` per sequence and layer, a step of 32 sequences over 30
layers is 960 calls whose fixed costs outweigh their arithmetic (a few thousand multiply-adds
each). The C loop runs every sequence and head of a layer in one call, reading each sequence's
keys and values where its cache keeps them (an arena with room to spare or a tensor sized to its
tokens), in one fixed order of operations (see the C file), so a row's result depends on its
query and its own cache only: bit for bit the same alone or among any others, whatever their
number and lengths. The AVX-512 loop and the plain one give the same bits.

Built like the rotation and product kernels (``cache.native.compile_shared``) and loaded by
``cache.native.Kernel`` (which those two do not use yet: they keep their own loaders); where it
cannot be,
:func:`library` returns ``None``, and where the CPU has no AVX-512 (:func:`vectorised`),
``agent/adapters/batched.py`` keeps one SDPA call per row.

Not here: which rows share a step (``agent/engine/scheduler.py``), writing new tokens into caches
(``agent/adapters/cache_layers.py``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache.native import Kernel

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# n, heads, kv_heads, d, scale, q, keys, values, k head strides, v head strides, lengths, the new
# keys and values (or NULL), out, limit
_ARGTYPES: list[Any] = [
    _I64,
    _I64,
    _I64,
    _I64,
    _F32,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    _INT,
]
# The widest vector loop the kernel may use: 0 AVX-512 where the CPU has it, 2 the plain loop.
VECTOR_LIMIT = 0

KERNEL = Kernel(
    Path(__file__).with_name("attend_native.c"),
    "attend",
    # no contracted multiply-adds: every fused one is written out, the same on every path
    ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"],
    {"kamera_attend_rows": (_ARGTYPES, ctypes.c_int), "kamera_attend_vectorised": ([], ctypes.c_int)},
    "decoding with one attention call per sequence",
)


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; ``None`` (logged once) where it cannot be."""
    return KERNEL.library()


def vectorised() -> bool:
    """Whether the kernel runs its AVX-512 loop on this CPU. Elsewhere it runs the plain loop
    (the same bits, its fused multiply-adds through libm, many times slower than SDPA), so callers
    that only want speed keep SDPA there."""
    lib = KERNEL.library()
    return lib is not None and bool(lib.kamera_attend_vectorised())


def _laid_out(t: torch.Tensor, name: str) -> torch.Tensor:
    """A cache tensor ``[1?, H, T, D]`` as ``[H, T, D]`` float32 whose tokens lie D floats apart
    (a copy only where they do not)."""
    if t.dim() == 4:
        if t.shape[0] != 1:
            raise ValueError(f"{name}: one sequence per cache, got a batch of {t.shape[0]}")
        t = t[0]
    if t.dim() != 3 or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be CPU float32 [H, T, D], got {t.dtype} {tuple(t.shape)}")
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
        t = t.contiguous()
    return t


def attend_rows(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [n, heads, d]`` (row r: one query token of sequence r) over each row's
    own ``keys[r]``, ``values[r]`` (``[1?, kv_heads, T_r, d]``; query heads of one KV head are
    neighbours, as in grouped-query attention): ``[n, heads * d]`` float32, into ``out`` when
    given (contiguous). Every cached token is visible to the query (a decode step's causal
    mask). Raises ValueError on shapes it cannot take and ``NativeKernelError`` without the
    kernel."""
    n, heads, d = q.shape
    if len(keys) != n or len(values) != n:
        raise ValueError(f"{n} queries, {len(keys)} key and {len(values)} value caches")
    if q.dtype != torch.float32 or q.device.type != "cpu":
        raise ValueError(f"q must be CPU float32, got {q.dtype} on {q.device}")
    q = q.contiguous()
    table = np.empty((5, n), dtype=np.int64)  # key, value addresses; their head strides; lengths
    held = []  # the tensors the addresses point into, alive until the call returns
    kv_heads = 0
    for r in range(n):
        k, v = _laid_out(keys[r], "keys"), _laid_out(values[r], "values")
        held += [k, v]
        if k.shape != v.shape or k.shape[-1] != d or k.shape[1] < 1:
            raise ValueError(
                f"row {r}: keys {tuple(keys[r].shape)} and values {tuple(values[r].shape)} for d={d}"
            )
        if kv_heads and k.shape[0] != kv_heads:
            raise ValueError(f"row {r} has {k.shape[0]} KV heads, row 0 {kv_heads}")
        kv_heads = k.shape[0]
        table[:, r] = (k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k.shape[1])
    if n and heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    out = attend_slots(q, table, kv_heads, scale, out)
    del held
    return out


def attend_slots(
    q: torch.Tensor,
    table: np.ndarray,
    kv_heads: int,
    scale: float,
    out: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`attend_rows` over caches given by address: ``table`` int64 ``[5, n]`` holds each
    row's first key and first value address (float32, tokens ``d`` floats apart), the floats from
    one KV head to the next for keys and for values, and the row's tokens. With ``new`` (keys and
    values ``[n, kv_heads, d]``), each row's new token is first written at its last slot
    (``tokens - 1``): the caller has made room there and counts it. The caller answers for the
    addresses (live float32 memory of at least that size)."""
    lib = KERNEL.require()
    n, heads, d = q.shape
    q = q.contiguous()
    if table.shape != (5, n) or table.dtype != np.int64:
        raise ValueError(f"table must be int64 [5, {n}], got {table.dtype} {table.shape}")
    if out is None:
        out = torch.empty(n, heads * d, dtype=torch.float32)
    elif out.shape != (n, heads * d) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{n}, {heads * d}]")
    if n == 0:
        return out
    nk = nv = None
    if new is not None:
        nk, nv = (t.contiguous() for t in new)
        if nk.shape != (n, kv_heads, d) or nv.shape != (n, kv_heads, d) or nk.dtype != torch.float32:
            raise ValueError(f"new keys and values must be float32 [{n}, {kv_heads}, {d}]")
    table = np.ascontiguousarray(table)
    rows = [table[i].ctypes.data for i in range(5)]
    code = lib.kamera_attend_rows(
        n,
        heads,
        kv_heads,
        d,
        scale,
        q.data_ptr(),
        *rows,
        None if nk is None else nk.data_ptr(),
        None if nv is None else nv.data_ptr(),
        out.data_ptr(),
        VECTOR_LIMIT,
    )
    if code == -1:
        raise MemoryError("kamera_attend_rows could not allocate its scores")
    if code != 0:
        raise ValueError(f"kamera_attend_rows refused its sizes ({code})")
    return out
