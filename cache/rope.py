"""Rotary position embeddings as pure functions: rotate, un-rotate and relocate.

RoPE rotates each frequency pair of a key by the angle ``position * inv_freq[j]``. Rotations
compose, ``R(p + d) = R(d) R(p)``, so a key rotated for position ``p`` moves to ``p + d`` by one
more rotation, and a key with its rotation removed (the *pre-RoPE frame*) carries no position.

Conventions (read from transformers' own code, see docs/DESIGN.md section 3.6):

- ``pairing="half"``: frequency ``j`` pairs dims ``(j, j + rotary_dim/2)`` (HF ``rotate_half``,
  Llama, Qwen, GPT-NeoX, Phi). ``pairing="interleaved"``: it pairs ``(2j, 2j + 1)`` (DeepSeek's
  complex multiplication over adjacent pairs).
- The rotation is counter-clockwise: ``(a, b) -> (a cos t - b sin t, b cos t + a sin t)``.
- Dims past ``rotary_dim`` (partial rotary) pass through untouched.
- ``attention_scaling`` (YaRN's mscale) multiplies cos and sin; :func:`unrotate` divides it out,
  :func:`relocate` never applies it (moving a rotated key keeps its magnitude).
- M-RoPE: positions are ``[3, T]`` (temporal, height, width); each frequency reads one axis.
  Contiguous sections (Qwen2-VL, Qwen2.5-VL) give the first ``mrope_section[0]`` frequencies to
  the temporal axis, the next ``mrope_section[1]`` to height, and so on; interleaved sections
  (Qwen3-VL) cycle t, h, w over the frequencies up to ``3 * mrope_section[i]``.

Angles are computed in float64 (positions can be large), the rotation in float32, and the
result is cast back to the input dtype.

Not here: anything about models or caches; the inverse frequencies of a checkpoint come from
the builders below or from the model itself (see ``agent/adapters``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from threading import Lock
from typing import Literal

import torch

from cache import native

Pairing = Literal["half", "interleaved"]


@dataclass(frozen=True)
class RopeSpec:
    """What a model's rotary embedding does to one head's features.

    ``inv_freq`` holds the ``rotary_dim // 2`` inverse frequencies exactly as the model uses them
    (float32 values for HF models, kept as Python floats so the spec is hashable).
    """

    inv_freq: tuple[float, ...]
    pairing: Pairing = "half"
    attention_scaling: float = 1.0
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    _axes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.inv_freq:
            raise ValueError("RopeSpec needs at least one inverse frequency")
        if self.pairing not in ("half", "interleaved"):
            raise ValueError(f"pairing must be 'half' or 'interleaved', got {self.pairing!r}")
        if not (self.attention_scaling > 0 and math.isfinite(self.attention_scaling)):
            raise ValueError(f"attention_scaling must be positive, got {self.attention_scaling}")
        object.__setattr__(self, "inv_freq", tuple(float(f) for f in self.inv_freq))
        if self.mrope_section is not None:
            sec = tuple(int(s) for s in self.mrope_section)
            object.__setattr__(self, "mrope_section", sec)
            if len(sec) != 3 or min(sec) < 0:
                raise ValueError(f"mrope_section must be three non-negative counts, got {sec}")
            if sum(sec) != len(self.inv_freq):
                raise ValueError(
                    f"mrope_section {sec} sums to {sum(sec)}, expected {len(self.inv_freq)} frequencies"
                )
        object.__setattr__(self, "_axes", _frequency_axes(self))

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @property
    def n_axes(self) -> int:
        """1 for plain RoPE, 3 for M-RoPE (positions ``[3, T]``)."""
        return 1 if self.mrope_section is None else 3

    @property
    def frequency_axes(self) -> tuple[int, ...]:
        """For each frequency, which position axis drives it (all 0 for 1-D RoPE)."""
        return self._axes


def _frequency_axes(spec: RopeSpec) -> tuple[int, ...]:
    n = len(spec.inv_freq)
    sec = spec.mrope_section
    if sec is None:
        return (0,) * n
    if not spec.mrope_interleaved:
        return tuple(axis for axis, count in enumerate(sec) for _ in range(count))
    axes = [0] * n
    for axis in (1, 2):
        for j in range(axis, min(3 * sec[axis], n), 3):
            axes[j] = axis
    return tuple(axes)


# --- inverse frequencies, computed the way transformers computes them (float32) -------------


def default_inv_freq(dim: int, base: float) -> tuple[float, ...]:
    """``1 / base^(2j/dim)`` for ``j < dim/2``, in float32 as HF computes it."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary dim must be positive and even, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return tuple((1.0 / (base**exponents)).tolist())


def linear_inv_freq(dim: int, base: float, factor: float) -> tuple[float, ...]:
    """Linear position interpolation: every frequency divided by ``factor``."""
    inv = torch.tensor(default_inv_freq(dim, base), dtype=torch.float32) / factor
    return tuple(inv.tolist())


def llama3_inv_freq(
    dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> tuple[float, ...]:
    """Llama-3 scaling: long wavelengths divided by ``factor``, a smooth blend in between."""
    inv = torch.tensor(default_inv_freq(dim, base), dtype=torch.float32)
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return tuple(torch.where(medium, smoothed, scaled).tolist())


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
    truncate: bool = True,
) -> tuple[tuple[float, ...], float]:
    """YaRN as DeepSeek uses it: (inverse frequencies, magnitude folded into cos/sin)."""
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    inv = interpolation * (1 - keep) + extrapolation * keep
    return tuple(inv.tolist()), float(attention_factor)


# --- rotation ---------------------------------------------------------------------------


def angles(positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotation angle of every (token, frequency): float64 ``[T, rotary_dim // 2]``.

    ``positions`` is ``[T]`` for 1-D RoPE or ``[3, T]`` for M-RoPE (a ``[T]`` tensor given to an
    M-RoPE spec means text: all three axes equal).
    """
    pos = positions.to(torch.float64)
    inv = torch.tensor(spec.inv_freq, dtype=torch.float64, device=positions.device)
    if spec.n_axes == 1:
        if pos.dim() != 1:
            raise ValueError(f"1-D RoPE takes positions [T], got shape {tuple(positions.shape)}")
        return pos[:, None] * inv
    if pos.dim() == 1:
        pos = pos.expand(3, -1)
    if pos.dim() != 2 or pos.shape[0] != 3:
        raise ValueError(f"M-RoPE takes positions [3, T], got shape {tuple(positions.shape)}")
    axes = torch.tensor(spec.frequency_axes, device=positions.device)
    return pos[axes].transpose(0, 1) * inv  # [T, F]


_TABLE_CACHE: OrderedDict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_TABLE_LOCK = Lock()
_TABLE_CACHE_SIZE = 512
# Positions below a bound read one float32 table per (spec, device), grown by doubling: a
# window's positions stay under about twice its budget, so its rotations gather rows instead of
# evaluating cos and sin again. The bound keeps each table under this many bytes (cos and sin).
POSITION_TABLE_BYTES = 64 << 20
_POSITION_TABLES: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _position_table(spec: RopeSpec, device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin of ``p * inv_freq`` for every position ``p < n`` or more: ``[N, F]`` float32.

    None when ``n`` is past what :data:`POSITION_TABLE_BYTES` allows.
    """
    f = spec.rotary_dim // 2
    limit = POSITION_TABLE_BYTES // (8 * f)
    if n > limit:
        return None
    key = (spec, device)
    with _TABLE_LOCK:
        table = _POSITION_TABLES.get(key)
        if table is not None and table[0].shape[0] >= n:
            return table
        size = min(limit, max(n, 4096, 2 * (0 if table is None else table[0].shape[0])))
        a = torch.arange(size, dtype=torch.float64, device=device)[:, None] * torch.tensor(
            spec.inv_freq, dtype=torch.float64, device=device
        )
        table = (a.cos().to(torch.float32), a.sin().to(torch.float32))
        _POSITION_TABLES[key] = table
        return table


def cos_sin(positions: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` of :func:`angles`, ``[T, rotary_dim // 2]``.

    Non-negative integer positions under a bound are gathered from one table per spec (the same
    float64 angles, computed once); others are computed and memoised by the positions' bytes,
    so a chunk placed at the same start again reuses its table.
    """
    if not positions.is_floating_point() and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        table = _position_table(spec, positions.device, hi + 1) if lo >= 0 else None
        if table is not None:
            cos_t, sin_t = table
            if spec.n_axes == 1 or positions.dim() == 1:
                if positions.dim() != 1:
                    raise ValueError(f"1-D RoPE takes positions [T], got shape {tuple(positions.shape)}")
                return cos_t[positions], sin_t[positions]
            if positions.dim() != 2 or positions.shape[0] != 3:
                raise ValueError(f"M-RoPE takes positions [3, T], got shape {tuple(positions.shape)}")
            axes = torch.tensor(spec.frequency_axes, device=positions.device)
            index = positions[axes].transpose(0, 1)  # [T, F]: the position each frequency reads
            return cos_t.gather(0, index), sin_t.gather(0, index)
    key = (spec, positions.device, tuple(positions.shape), positions.cpu().numpy().tobytes())
    with _TABLE_LOCK:
        hit = _TABLE_CACHE.get(key)
        if hit is not None:
            _TABLE_CACHE.move_to_end(key)
            return hit
    a = angles(positions, spec)
    table = (a.cos().to(torch.float32), a.sin().to(torch.float32))
    with _TABLE_LOCK:
        _TABLE_CACHE[key] = table
        if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    return table


def _pair_views(x: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members of every frequency pair, as views ``[..., rotary_dim // 2]``."""
    rd = spec.rotary_dim
    if spec.pairing == "half":
        return x[..., : rd // 2], x[..., rd // 2 : rd]
    return x[..., 0:rd:2], x[..., 1:rd:2]


def _rotate_eager(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Four in-place passes over halves: no temporaries beyond the output."""
    out = torch.empty_like(x) if out is None else out
    a, b = _pair_views(x, spec)
    oa, ob = _pair_views(out, spec)
    torch.mul(a, cos, out=oa)
    oa.addcmul_(b, sin, value=-1.0)
    torch.mul(b, cos, out=ob)
    ob.addcmul_(a, sin)
    if spec.rotary_dim < x.shape[-1]:
        out[..., spec.rotary_dim :] = x[..., spec.rotary_dim :]
    return out


def _rotate_math(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, interleaved: bool
) -> torch.Tensor:
    """The same rotation written as one expression, for a compiler to fuse into a single pass."""
    h = rd // 2
    if interleaved:
        pairs = x[..., :rd].unflatten(-1, (h, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = x[..., :h], x[..., h:rd]
        rot = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((rot, x[..., rd:]), dim=-1) if rd < x.shape[-1] else rot


_COMPILED: list[Callable[..., torch.Tensor]] = []


def _rotate_compiled(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One fused read-rotate-write pass (Inductor). The first call per process compiles."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_rotate_math, dynamic=True))
    # contiguous inputs keep one compiled graph for every chunk (strides are guarded on)
    result = _COMPILED[0](
        x.contiguous(), cos.contiguous(), sin.contiguous(), spec.rotary_dim, spec.pairing == "interleaved"
    )
    return result if out is None else out.copy_(result)


def _rotate_native(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One read-rotate-write pass in C (``cache/native.py``); CPU float32 only."""
    if not native.supports(x, cos, out):
        raise ValueError(
            "the native kernel takes CPU float32 tensors outside autograd; use 'auto' or 'eager'"
        )
    return native.rotate(x, cos, sin, spec.rotary_dim, spec.pairing == "interleaved", out)


def _native_applies(x: torch.Tensor, cos: torch.Tensor, out: torch.Tensor | None) -> bool:
    return native.supports(x, cos, out) and native.library() is not None


def _rotate_auto(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The native pass where it applies and is built on this machine, the eager ops elsewhere."""
    if _native_applies(x, cos, out):
        return native.rotate(x, cos, sin, spec.rotary_dim, spec.pairing == "interleaved", out)
    return _rotate_eager(x, cos, sin, spec, out)


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RopeSpec, "torch.Tensor | None"], torch.Tensor]
KERNELS: dict[str, Kernel] = {
    "auto": _rotate_auto,
    "eager": _rotate_eager,
    "native": _rotate_native,
    "compiled": _rotate_compiled,
}


def apply_rotation(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    spec: RopeSpec,
    kernel: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a, b) -> (a cos - b sin, b cos + a sin)`` on every pair; the kernel behind the rest.

    x: ``[..., T, D]`` with ``D >= rotary_dim``; cos, sin: float32, broadcastable to
    ``[..., T, rotary_dim // 2]``. ``kernel`` names an entry of :data:`KERNELS`: ``native`` (one
    read-rotate-write pass in C, built once per machine; CPU float32 outside autograd),
    ``eager`` (plain torch ops, anywhere), ``auto`` (native where it applies and could be built,
    eager elsewhere) or ``compiled`` (Inductor, compiled on first use). Returns a new tensor of
    x's dtype, or writes into ``out`` (any strides, x's shape, not overlapping x) and returns
    it; x is not modified.
    """
    if x.shape[-1] < spec.rotary_dim:
        raise ValueError(f"feature dim {x.shape[-1]} is smaller than rotary_dim {spec.rotary_dim}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown rotation kernel {kernel!r}; choose from {sorted(KERNELS)}")
    if out is not None and out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, x has {tuple(x.shape)}")
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    if out is not None and out.dtype == torch.float32:
        return KERNELS[kernel](xf, cos, sin, spec, out)
    result = KERNELS[kernel](xf, cos, sin, spec, None)
    if out is not None:
        return out.copy_(result)
    return result if result.dtype == x.dtype else result.to(x.dtype)


def _check_tokens(x: torch.Tensor, positions: torch.Tensor) -> None:
    if x.dim() < 2 or x.shape[-2] != positions.shape[-1]:
        raise ValueError(
            f"x [..., T, D] has T={x.shape[-2] if x.dim() >= 2 else None}, positions have "
            f"{positions.shape[-1]} tokens"
        )


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    kernel: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply RoPE: pre-RoPE ``x [..., T, D]`` to the frame of ``positions`` (``[T]`` or ``[3, T]``).

    ``out``: write the result there (e.g. a chunk's slice of a window buffer) instead of a new tensor.
    """
    cos, sin = _placed_tables(x, positions, spec)
    return apply_rotation(x, cos, sin, spec, kernel, out)


def _placed_tables(
    x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_tokens(x, positions)
    cos, sin = cos_sin(positions.to(x.device), spec)
    if spec.attention_scaling != 1.0:
        cos, sin = cos * spec.attention_scaling, sin * spec.attention_scaling
    return cos, sin


def rotate_many(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], spec: RopeSpec, kernel: str = "auto"
) -> None:
    """:func:`rotate` of every ``(x, positions, out)``, writing into each ``out``.

    With the native kernel, all of them go to the threads in one hand-off (re-assembling a window
    rotates many chunks at once); otherwise one :func:`rotate` after another.
    """
    tables = [_placed_tables(x, positions, spec) for x, positions, _ in items]
    pairs = list(zip(items, tables, strict=True))
    takes = native.supports if kernel == "native" else _native_applies  # native: missing build raises
    if kernel in ("auto", "native") and pairs and all(takes(x, cos, out) for (x, _, out), (cos, _) in pairs):
        batch = [(x, cos, sin, out) for (x, _, out), (cos, sin) in pairs]
        native.rotate_many(batch, spec.rotary_dim, spec.pairing == "interleaved")
        return
    for (x, _, out), (cos, sin) in pairs:
        apply_rotation(x, cos, sin, spec, kernel, out)


def unrotate(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Remove RoPE: the exact inverse of :func:`rotate` (scaling divided out)."""
    _check_tokens(x, positions)
    cos, sin = cos_sin(positions.to(x.device), spec)
    inv = 1.0 / spec.attention_scaling
    return apply_rotation(x, cos * inv, sin * -inv, spec)


def relocate(
    x: torch.Tensor, delta: int, spec: RopeSpec, kernel: str = "auto", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Move rotated keys ``[..., T, D]`` by ``delta`` positions (all M-RoPE axes alike).

    One angle per frequency for every token: ``R(p + delta) = R(delta) R(p)``; a magnitude the
    keys already carry (``attention_scaling``) is not applied again. ``out`` as in :func:`rotate`.
    """
    a = torch.tensor(spec.inv_freq, dtype=torch.float64, device=x.device) * float(delta)
    n = x.shape[-2]
    cos = a.cos().to(torch.float32).expand(n, -1).contiguous()  # [T, rotary_dim // 2]
    sin = a.sin().to(torch.float32).expand(n, -1).contiguous()
    return apply_rotation(x, cos, sin, spec, kernel, out)
