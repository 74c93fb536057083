"""The native rotation kernel: ``cache/rope_native.c``, built once per machine, called by ctypes.

Re-rotating a window's keys is bound by memory traffic. Eager torch ops rotate in four passes
over halves of the keys (a product and a fused multiply-add into each half of the output); the
C loop reads each key once, rotates it and writes it once, which runs at the speed of a plain
copy. It is built on first use with the machine's C compiler into
``$KAMERA_CACHE_DIR/kernels`` (default ``~/.cache/kamera``; a file named by the hash of the
source and the compiler, written atomically, so processes sharing the folder never load half a
file) and the build is reused from then on. Large rotations are split over ``torch``'s thread
count: ctypes releases the GIL for the call, so the parts run in parallel.

Without a compiler (or on a build error) :func:`library` returns ``None`` once with a warning in
the log, and ``cache.rope``'s ``auto`` kernel uses the eager ops.

Not here: the rotation's contract and its reference (``cache/rope.py``); CUDA tensors, other
dtypes than float32 and anything needing autograd (the eager ops take those).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Lock
from typing import Any

import torch

from cache.keys import digest_key

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rope_native.c")
# Below this many output elements one call on the calling thread beats handing out parts.
PARALLEL_MIN_ELEMENTS = 1 << 22
# From this many output elements on (64 MiB), stores bypass the cache (see rope_native.c):
# output this large does not fit in a last-level cache anyway.
STREAM_MIN_ELEMENTS = 1 << 24

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# x, its 3 strides; out, its 3 strides; cos, sin, token stride; n0, n1, T, D, rotary_dim;
# interleaved pairing; streaming stores; the cap on vector loops
_ARGTYPES: list[Any] = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64]
_ARGTYPES += [_I64, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
# The widest vector loops the kernel may use: 0 the best this CPU has, 1 none with AVX-512,
# 2 the compiler-vectorised plain loop only (for checking every path on one machine).
VECTOR_LIMIT = 0


class NativeKernelError(RuntimeError):
    """The native kernel was asked for by name but could not be built or loaded here."""


def cache_dir() -> Path:
    """Where Kamera keeps files derived once per machine (converted models, built kernels)."""
    return Path(os.environ.get("KAMERA_CACHE_DIR", Path.home() / ".cache" / "kamera"))


def _compiler() -> list[str] | None:
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if not candidate:
            continue
        argv = shlex.split(str(candidate))
        if argv and shutil.which(argv[0]):
            return argv
    return None


def build(folder: Path | None = None) -> Path:
    """The rotation kernel's shared object for this machine (see :func:`compile_shared`)."""
    return compile_shared(SOURCE, "rope", ["-O3", "-std=c11", "-shared", "-fPIC"], folder)


def compile_shared(source: Path, name: str, flags: Sequence[str], folder: Path | None = None) -> Path:
    """``source`` compiled with ``flags`` into ``<folder or cache_dir()>/kernels/<name>-<hash>.so``,
    named by a hash of the source, the compiler, the flags and the machine; compiled now unless
    an identical build is there, written atomically (a temporary file, then a rename).

    Raises :class:`NativeKernelError` (with the compiler's message) when it cannot be built.
    """
    cc = _compiler()
    if cc is None:
        raise NativeKernelError("no C compiler found (set CC, or install gcc or clang)")
    parts = [source.read_bytes(), *(s.encode() for s in [*cc, *flags]), platform.machine().encode()]
    digest = digest_key("kernel", parts)
    folder = (folder or cache_dir()) / "kernels"
    target = folder / f"{name}-{digest.hex[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [*cc, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode != 0:
            raise NativeKernelError(f"{' '.join(cc)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelError(f"building {source.name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Kernel:
    """A C source built on first use (:func:`compile_shared`) and loaded by ctypes, once per
    process: :meth:`library` gives the loaded library, or ``None`` (logged once) where it cannot
    be built or loaded; :meth:`require` raises :class:`NativeKernelError` saying why instead.

    ``functions`` maps each exported function to its ``(argtypes, restype)``.
    """

    def __init__(
        self,
        source: Path,
        name: str,
        flags: Sequence[str],
        functions: dict[str, tuple[list[Any], Any]],
        fallback: str,
    ) -> None:
        self.source, self.name, self.flags, self.functions = source, name, list(flags), functions
        self.fallback = fallback  # what callers do without it, for the log
        self.lock = Lock()
        self.tried = False
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        self.lock = Lock()

    def build(self, folder: Path | None = None) -> Path:
        return compile_shared(self.source, self.name, self.flags, folder)

    def library(self) -> ctypes.CDLL | None:
        with self.lock:
            if not self.tried:
                self.tried = True
                try:
                    lib = self._load()
                    for fn, (argtypes, restype) in self.functions.items():
                        getattr(lib, fn).argtypes = argtypes
                        getattr(lib, fn).restype = restype
                    self.lib = lib
                except (NativeKernelError, OSError, AttributeError) as exc:
                    self.error = str(exc)
                    log.warning("native %s kernel unavailable, %s: %s", self.name, self.fallback, exc)
            return self.lib

    def _load(self) -> ctypes.CDLL:
        path = self.build()
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # not a loadable object (damaged on disk): build again, once
            return ctypes.CDLL(str(self.build()))

    def require(self) -> ctypes.CDLL:
        lib = self.library()
        if lib is None:
            raise NativeKernelError(f"the native {self.name} kernel is unavailable: {self.error}")
        return lib


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
    # a forked child has none of the parent's pool threads (and maybe a lock another thread
    # held): start both afresh, or the first parallel rotation would wait for threads forever
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
                lib.kamera_rotate_f32.argtypes = _ARGTYPES
                lib.kamera_rotate_f32.restype = None
                _STATE.lib = lib
            except (NativeKernelError, OSError) as exc:
                _STATE.error = str(exc)
                log.warning("native rotation kernel unavailable, using eager torch ops: %s", exc)
        return _STATE.lib


def _load() -> ctypes.CDLL:
    path = build()
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        # not a loadable object (damaged on disk): drop it and build again, once
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(build()))


def require() -> ctypes.CDLL:
    """The loaded kernel, or :class:`NativeKernelError` saying why there is none."""
    lib = library()
    if lib is None:
        raise NativeKernelError(f"the native rotation kernel is unavailable: {_STATE.error}")
    return lib


def _pool(threads: int) -> ThreadPoolExecutor:
    with _STATE.lock:
        if _STATE.pool is None or _STATE.pool_size != threads:
            if _STATE.pool is not None:
                _STATE.pool.shutdown(wait=False)
            _STATE.pool = ThreadPoolExecutor(threads, thread_name_prefix="kamera-rope")
            _STATE.pool_size = threads
        return _STATE.pool


def _as_4d(t: torch.Tensor) -> torch.Tensor | None:
    """``[..., T, D]`` as ``[n0, n1, T, D]`` without copying, or None when the leading dims can't merge."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        try:
            t = t.view(-1, *t.shape[-3:])
        except RuntimeError:
            return None
    return t


def _table(t: torch.Tensor, n_tokens: int, half: int) -> torch.Tensor | None:
    """cos or sin as a ``[T or 1, rd/2]`` contiguous float32 table, or None if it varies by more."""
    if t.shape[-1] != half or any(s != 1 for s in t.shape[:-2]):
        return None
    t = t.reshape(-1, half) if t.dim() >= 2 else t.reshape(1, half)
    if t.shape[0] not in (1, n_tokens):
        return None
    return t.to(torch.float32).contiguous()


def supports(x: torch.Tensor, cos: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether :func:`rotate` takes these tensors (CPU float32, no autograd, a known layout)."""
    tensors = [x, cos] if out is None else [x, cos, out]
    if any(t.device.type != "cpu" for t in tensors) or x.dtype != torch.float32:
        return False
    if out is not None and (out.dtype != torch.float32 or out.stride(-1) != 1 or _as_4d(out) is None):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad):
        return False
    return x.dim() >= 2 and _table(cos, x.shape[-2], cos.shape[-1]) is not None


class _Job:
    """One rotation, checked and laid out for the C call; :meth:`run` does a slice of it."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out: torch.Tensor,
        rotary_dim: int,
    ) -> None:
        # the C loop trusts every size and stride it is given: check them all here
        if x.dim() < 2 or out.shape != x.shape:
            raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} must be one [..., T, D] shape")
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > x.shape[-1]:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and within the feature dim {x.shape[-1]}")
        tensors = (x, cos, sin, out)
        if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
            raise ValueError("the native kernel takes CPU float32 tensors")
        if x.stride(-1) != 1 or out.stride(-1) != 1:
            raise ValueError("x and out need a unit feature stride")
        n_tokens, half = x.shape[-2], rotary_dim // 2
        c, s = _table(cos, n_tokens, half), _table(sin, n_tokens, half)
        x4, o4 = _as_4d(x), _as_4d(out)
        if c is None or s is None or x4 is None or o4 is None:
            raise ValueError(
                f"unsupported layout: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
            )
        self.lib, self.x4, self.o4, self.c, self.s = lib, x4, o4, c, s
        self.ts = half if c.shape[0] == n_tokens and n_tokens > 1 else 0
        self.sizes = (x4.shape[0], x4.shape[1], n_tokens)

    def parts(self, n: int) -> tuple[int, list[tuple[int, int]]]:
        """The first axis (of dim 0, dim 1, tokens) long enough for ``n`` parts, and its parts."""
        axis = next((a for a in range(3) if self.sizes[a] >= n), 2)
        size = self.sizes[axis]
        step = -(-size // n)
        return axis, [(lo, min(lo + step, size)) for lo in range(0, size, step)]

    def run(self, axis: int, lo: int, hi: int, rotary_dim: int, interleaved: bool, stream: bool) -> None:
        part = list(self.sizes)
        part[axis] = hi - lo
        x4, o4 = self.x4, self.o4
        xo, oo = lo * x4.stride(axis) * 4, lo * o4.stride(axis) * 4
        co = lo * self.ts * 4 if axis == 2 else 0
        self.lib.kamera_rotate_f32(
            x4.data_ptr() + xo, x4.stride(0), x4.stride(1), x4.stride(2),
            o4.data_ptr() + oo, o4.stride(0), o4.stride(1), o4.stride(2),
            self.c.data_ptr() + co, self.s.data_ptr() + co, self.ts,
            part[0], part[1], part[2], x4.shape[-1], rotary_dim, int(interleaved), int(stream), VECTOR_LIMIT,
        )  # fmt: skip


def rotate_many(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    rotary_dim: int,
    interleaved: bool,
) -> None:
    """Several ``(x, cos, sin, out)`` rotations (see :func:`rotate`) handed to the threads once.

    The rotations are cut into parts that the calling thread and torch's other threads take in
    turn, so a window re-assembled from many chunks pays for waking the threads once, not once
    per chunk.
    """
    lib = require()
    jobs = []
    for x, cos, sin, out in items:
        if x.stride(-1) != 1 or _as_4d(x) is None:
            x = x.contiguous()
        jobs.append(_Job(lib, x, cos, sin, out, rotary_dim))
    total = sum(job.o4.numel() for job in jobs)
    stream = total >= STREAM_MIN_ELEMENTS
    threads = torch.get_num_threads()
    if threads < 2 or total < PARALLEL_MIN_ELEMENTS:
        for job in jobs:
            job.run(0, 0, job.sizes[0], rotary_dim, interleaved, stream)
        return
    # about four parts per thread, taken in turn from one counter: a thread that starts late
    # (woken from sleep) takes fewer, instead of the others waiting for its fixed share
    per_job = -(-4 * threads // len(jobs))
    units = [(job, axis, lo, hi) for job in jobs for axis, parts in [job.parts(per_job)] for lo, hi in parts]
    counter = itertools.count()

    def work() -> None:
        while (i := next(counter)) < len(units):
            job, axis, lo, hi = units[i]
            job.run(axis, lo, hi, rotary_dim, interleaved, stream)

    waits = [_pool(threads - 1).submit(work) for _ in range(1, threads)]
    work()  # the calling thread works too
    for w in waits:
        w.result()


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cache.rope.apply_rotation`` for tensors :func:`supports` accepts, in one pass.

    x ``[..., T, D]`` float32; cos, sin ``[T, rotary_dim // 2]`` or ``[rotary_dim // 2]`` (one
    angle per frequency for every token); ``out``: x's shape, any strides with a unit feature
    stride, not overlapping x. Raises :class:`NativeKernelError` when the kernel is unavailable.
    """
    out = torch.empty(x.shape, dtype=torch.float32) if out is None else out
    rotate_many([(x, cos, sin, out)], rotary_dim, interleaved)
    return out
