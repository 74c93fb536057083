"""The numerics KV is computed under: what, besides the weights and the tokens, decides its bits.

Exact reuse promises the bits a full prefill in this process would compute. Another process
with the same weights may compute other last bits: another torch release (other kernels), another
BLAS / LAPACK library, another CPU instruction set (ATen dispatches its kernels on it), another
thread count (how reductions are split), another device (and on a GPU, another card), another
attention implementation. :func:`numerics` names them in one short string that goes into every
content key's namespace (``cache.keys.Namespace.numerics``), so an entry written to a shared
disk or Redis store by a process under other numerics is never an exact hit here.

The parts fixed for the life of the process (torch's version and build, the CPU capability) are
read once; the thread count is read at each call, since a process may change it after loading a
model (``torch.set_num_threads``).

Not here: whether two numerics give the same bits. Any difference counts, so a store shared by
processes of different numerics holds one copy per numerics rather than a wrong hit.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

import torch

# the dtypes a prefill pass may multiply a text decoder's float32 weights in (float32 first: the
# default, named nowhere in a key); see agent.adapters.decoder.DecoderAdapter.use_prefill_products
PREFILL_PRODUCTS = ("float32", "bfloat16")


def _build_setting(config: str, name: str) -> str:
    """A ``NAME=value`` of torch's build settings (``torch.__config__.show()``), "none" if absent."""
    found = re.search(rf"\b{name}=([^,\s]*)", config)
    return found.group(1) if found and found.group(1) else "none"


@lru_cache(maxsize=1)
def process_numerics() -> str:
    """The parts of :func:`numerics` fixed for the process: torch's version, its BLAS and LAPACK
    libraries and the CPU capability its kernels dispatch on, e.g.
    ``torch=2.5.1,blas=mkl,lapack=mkl,cpu=AVX512``."""
    config = torch.__config__.show()
    return ",".join(
        (
            f"torch={torch.__version__}",
            f"blas={_build_setting(config, 'BLAS_INFO')}",
            f"lapack={_build_setting(config, 'LAPACK_INFO')}",
            f"cpu={torch.backends.cpu.get_cpu_capability()}",
        )
    )


def numerics(device: torch.device | str, attention: str) -> str:
    """The numerics of KV computed on ``device`` with the ``attention`` implementation by this
    process now: :func:`process_numerics`, the thread count, the device type (and a GPU's name),
    and the attention implementation, e.g.
    ``torch=2.5.1,blas=mkl,lapack=mkl,cpu=AVX512,threads=2,device=cpu,attention=sdpa``."""
    dev = torch.device(device)
    parts = [process_numerics(), f"threads={torch.get_num_threads()}", f"device={dev.type}"]
    if dev.type == "cuda":
        parts.append(f"gpu={torch.cuda.get_device_name(dev)}")
    parts.append(f"attention={attention}")
    return ",".join(parts)


@lru_cache(maxsize=1)
def bf16_kernels() -> str:
    """What picks a bfloat16 GEMM's kernel on this CPU, beyond :func:`process_numerics`'s
    capability (which reads AVX512 with or without bfloat16 instructions): the CPU's bfloat16
    instructions (``amx_bf16``, ``avx512_bf16`` or none, from ``/proc/cpuinfo``) and oneDNN's
    ``ONEDNN_MAX_CPU_ISA`` cap if set, e.g. ``bf16=avx512_bf16``."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    break
    except OSError:
        pass
    isa = next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), "none")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().lower()
    return f"bf16={isa}" + (f",onednn_isa={cap}" if cap else "")
