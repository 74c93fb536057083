"""Conditioning patches: a low-rank correction from a chunk's canonical KV to its conditioned KV.

For a chunk B the patch approximates, per layer and in the pre-RoPE frame,
``Δ = KV(B|ctx) - KV(B|∅)`` as a ``tokens x features`` matrix, heads flattened into features
(feature index ``h * D + d``, the layout of ``x.permute(1, 0, 2).reshape(T, H * D)`` for one
layer ``x [H, T, D]``). It keeps the leading singular triplets, ``Δ ≈ U Vᵀ`` with ``U [T, m]``
and ``V [F, m]``. One factor is orthonormal: ``V`` when ``F <= T`` (``U`` then carries the
singular values), ``U`` otherwise.

``arrangement="joint"`` (the default) fits one matrix per layer with keys and values side by
side (``F = H_k D_k + H_v D_v``): the tokens factor ``U``, the expensive one since ``T >> F``,
is shared by keys and values. At equal bytes it wins on real SmolLM2-135M Δs (3 MuSiQue dev
pairs, 256 + 256 tokens, fp16, 614 KB per chunk): relative residual energy 0.206 joint vs 0.225
split with the budget strategy, 0.257 vs 0.295 at fixed rank. ``"split"`` fits keys and
values apart (two blocks per layer, block ``2l`` keys, ``2l + 1`` values). Ranks are chosen
per block by a strategy from ``cache/rank.py``.

Fitting forms the smaller Gram matrix (``F x F`` when ``F <= T``) once per layer, batched over
layers, and takes its leading eigenvectors: exactly (``eigh``) or by randomized subspace
iteration when only a few ranks are wanted. Both give the optimal rank-m approximation
(Eckart-Young) up to rounding.

The same code serves MLA: ``k`` is the decoupled ``k_rope [L, 1, T, d]`` and ``v`` the latent
``[L, 1, T, r]``.

Reuse: ``K = R(s) (K_canon + (U Vᵀ)_K)``, ``V = V_canon + (U Vᵀ)_V`` (:func:`apply_and_place`).

Not here: choosing ranks (``cache/rank.py``), orbit patches over reorderings
(``cache/orbit.py``), storing patches (``cache/store``), producing KV from a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from cache.rank import BlockSpectrum, FixedRank, RankStrategy
from cache.rope import RopeSpec, rotate

Arrangement = Literal["joint", "split"]
Storage = Literal["float32", "float16", "bfloat16", "int8"]
Solver = Literal["auto", "exact", "randomized"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
_SCALE_BYTES = 4  # int8 factors keep one float32 scale per column
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class PatchConfig:
    """How to fit and store a patch.

    rank: strategy choosing each block's rank. arrangement: keys and values in one matrix per
    layer or apart. storage: dtype of the stored factors (int8 adds a float32 scale per
    column). solver: ``exact`` eigendecomposes the Gram matrix; ``randomized`` runs
    ``power_iters`` subspace iterations with ``oversample`` extra columns; ``auto`` picks
    randomized when the strategy's rank cap is small against the Gram size. max_rank: a cap on
    every block's rank.
    """

    rank: RankStrategy = field(default_factory=lambda: FixedRank(16))
    arrangement: Arrangement = "joint"
    storage: Storage = "float16"
    solver: Solver = "auto"
    max_rank: int | None = None
    oversample: int = 8
    power_iters: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrangement not in ("joint", "split"):
            raise ValueError(f"arrangement must be 'joint' or 'split', got {self.arrangement!r}")
        if self.storage not in _DTYPES:
            raise ValueError(f"storage must be one of {sorted(_DTYPES)}, got {self.storage!r}")
        if self.solver not in ("auto", "exact", "randomized"):
            raise ValueError(f"solver must be 'auto', 'exact' or 'randomized', got {self.solver!r}")
        if self.max_rank is not None and self.max_rank < 0:
            raise ValueError(f"max_rank must be >= 0, got {self.max_rank}")
        if self.oversample < 0 or self.power_iters < 0:
            raise ValueError("oversample and power_iters must be >= 0")


class Factors(NamedTuple):
    """One block's stored factors: ``u [T, m]``, ``v [F, m]``; scales ``[m]`` float32 for int8."""

    u: torch.Tensor
    v: torch.Tensor
    u_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return int(self.u.shape[1])

    @property
    def nbytes(self) -> int:
        ts = [self.u, self.v] + [s for s in (self.u_scale, self.v_scale) if s is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def dense(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(u [T, m], v [F, m])``, scales applied."""
        return _load(self.u, self.u_scale, device), _load(self.v, self.v_scale, device)


@dataclass(frozen=True)
class Patch:
    """A chunk's conditioning patch: per-block factors (ranks may differ between blocks).

    blocks: ``L`` blocks (joint, features ``[keys | values]``) or ``2L`` (split: block ``2l``
    the keys of layer l, ``2l + 1`` its values). k_shape / v_shape: ``(H, D)`` of keys / values.
    """

    blocks: tuple[Factors, ...]
    arrangement: Arrangement
    n_tokens: int
    k_shape: tuple[int, int]
    v_shape: tuple[int, int]

    def __post_init__(self) -> None:
        per_layer = 1 if self.arrangement == "joint" else 2
        if len(self.blocks) % per_layer:
            raise ValueError(f"a split patch holds 2 blocks per layer, got {len(self.blocks)}")
        fk, fv = self.k_shape[0] * self.k_shape[1], self.v_shape[0] * self.v_shape[1]
        widths = [fk + fv] if per_layer == 1 else [fk, fv]
        for i, b in enumerate(self.blocks):
            want = widths[i % per_layer]
            if b.u.shape[0] != self.n_tokens or b.v.shape[0] != want or b.u.shape[1] != b.v.shape[1]:
                raise ValueError(
                    f"block {i}: u {tuple(b.u.shape)}, v {tuple(b.v.shape)} do not fit "
                    f"T={self.n_tokens}, F={want}"
                )

    @property
    def n_layers(self) -> int:
        return len(self.blocks) // (1 if self.arrangement == "joint" else 2)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(b.rank for b in self.blocks)

    @property
    def nbytes(self) -> int:
        """Stored bytes of all factors and scales (the metadata of :meth:`to_dict` excluded)."""
        return sum(b.nbytes for b in self.blocks)

    def layer(
        self, layer: int, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """float32 ``((u_k [T, m], v_k [F_k, m]), (u_v [T, m'], v_v [F_v, m']))`` of one layer."""
        if self.arrangement == "joint":
            u, v = self.blocks[layer].dense(device)
            fk = self.k_shape[0] * self.k_shape[1]
            return (u, v[:fk]), (u, v[fk:])
        return self.blocks[2 * layer].dense(device), self.blocks[2 * layer + 1].dense(device)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The approximated ``(Δk [L, H_k, T, D_k], Δv [L, H_v, T, D_v])``, float32."""
        ks, vs = [], []
        for layer in range(self.n_layers):
            (uk, vk), (uv, vv) = self.layer(layer)
            ks.append(_from_matrix(uk @ vk.T, self.k_shape))
            vs.append(_from_matrix(uv @ vv.T, self.v_shape))
        return torch.stack(ks), torch.stack(vs)

    def to(self, device: torch.device | str) -> Patch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        blocks = tuple(
            Factors(b.u.to(device), b.v.to(device), move(b.u_scale), move(b.v_scale)) for b in self.blocks
        )
        return Patch(blocks, self.arrangement, self.n_tokens, self.k_shape, self.v_shape)

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors for safetensors (no pickle): ``meta``, ``ranks``, ``{i}.u``, ``{i}.v``
        and, for int8, ``{i}.u_scale``, ``{i}.v_scale``."""
        meta = [
            _FORMAT_VERSION,
            self.n_tokens,
            *self.k_shape,
            *self.v_shape,
            int(self.arrangement == "split"),
        ]
        out = {
            "meta": torch.tensor(meta, dtype=torch.int64),
            "ranks": torch.tensor(self.ranks, dtype=torch.int64),
        }
        for i, b in enumerate(self.blocks):
            out[f"{i}.u"], out[f"{i}.v"] = b.u.contiguous(), b.v.contiguous()
            if b.u_scale is not None and b.v_scale is not None:
                out[f"{i}.u_scale"], out[f"{i}.v_scale"] = b.u_scale, b.v_scale
        return out

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> Patch:
        meta = [int(x) for x in tensors["meta"].tolist()]
        if meta[0] != _FORMAT_VERSION:
            raise ValueError(f"patch format version {meta[0]} is not {_FORMAT_VERSION}")
        _, n_tokens, hk, dk, hv, dv, split = meta
        n_blocks = int(tensors["ranks"].numel())
        blocks = tuple(
            Factors(
                tensors[f"{i}.u"], tensors[f"{i}.v"], tensors.get(f"{i}.u_scale"), tensors.get(f"{i}.v_scale")
            )
            for i in range(n_blocks)
        )
        return cls(blocks, "split" if split else "joint", n_tokens, (hk, dk), (hv, dv))


class FitResult(NamedTuple):
    """patch; per block: total energy ``||Δ||²`` and the residual ``||Δ - U Vᵀ||²`` before
    storage rounding (float64 ``[n_blocks]``); spectra: the energies each strategy saw."""

    patch: Patch
    energy: torch.Tensor
    residual: torch.Tensor
    spectra: tuple[BlockSpectrum, ...]


class KV(NamedTuple):
    k: torch.Tensor
    v: torch.Tensor


# --- fitting ---------------------------------------------------------------------------


def fit_patch(
    canonical_k: torch.Tensor,
    canonical_v: torch.Tensor,
    conditioned_k: torch.Tensor,
    conditioned_v: torch.Tensor,
    config: PatchConfig,
) -> FitResult:
    """Fit the patch taking canonical ``(k, v)`` to conditioned ``(k, v)``, all pre-RoPE.

    k: ``[L, H_k, T, D_k]``; v: ``[L, H_v, T, D_v]`` (MLA: ``[L, 1, T, d]`` and ``[L, 1, T, r]``).
    """
    if canonical_k.shape != conditioned_k.shape or canonical_v.shape != conditioned_v.shape:
        raise ValueError("canonical and conditioned KV differ in shape")
    dk = conditioned_k.to(torch.float32) - canonical_k.to(torch.float32)
    dv = conditioned_v.to(torch.float32) - canonical_v.to(torch.float32)
    return fit_delta(dk, dv, config)


def fit_delta(delta_k: torch.Tensor, delta_v: torch.Tensor, config: PatchConfig) -> FitResult:
    """Fit ``Δk [L, H_k, T, D_k]``, ``Δv [L, H_v, T, D_v]`` by truncated SVD per block."""
    _check_kv(delta_k, delta_v)
    return fit_groups(groups(delta_k, delta_v, config.arrangement), None, delta_k, delta_v, config)


def fit_groups(
    targets: list[torch.Tensor],
    grams: list[torch.Tensor] | None,
    delta_k: torch.Tensor,
    delta_v: torch.Tensor,
    config: PatchConfig,
) -> FitResult:
    """The fit behind :func:`fit_delta`, also used by orbit patches.

    targets: the matrices to approximate, one ``[L, T, F]`` per group (joint: one group; split:
    keys then values). grams: if given, ``[L, F, F]`` per group whose leading eigenvectors give
    the feature basis ``V`` (then ``U = target V``); if None, the optimal basis of the target
    itself. delta_k / delta_v only give the shapes.
    """
    exact = _use_exact(targets, config)
    per_group = [
        _factorize(x, None if grams is None else grams[g], exact, config) for g, x in enumerate(targets)
    ]
    # block order: layer-major, group-minor (split: keys of layer l at 2l, values at 2l + 1)
    n_layers, n_tokens = targets[0].shape[0], targets[0].shape[1]
    spectra, us, vs, totals = [], [], [], []
    for layer in range(n_layers):
        for g, (energies, u, v, total) in enumerate(per_group):
            width = targets[g].shape[2]
            cost = bytes_per_rank(n_tokens, width, config.storage)
            spectra.append(BlockSpectrum(energies[layer], float(total[layer]), cost))
            us.append(u[layer])
            vs.append(v[layer])
            totals.append(total[layer])
    ranks = config.rank.select(spectra)
    if config.max_rank is not None:
        ranks = tuple(min(r, config.max_rank) for r in ranks)
    blocks = tuple(_store(us[i][:, :r], vs[i][:, :r], config.storage) for i, r in enumerate(ranks))
    energy = torch.stack(totals)
    kept = torch.stack([_energy(us[i][:, :r], vs[i][:, :r]) for i, r in enumerate(ranks)])
    patch = Patch(
        blocks,
        config.arrangement,
        n_tokens,
        (delta_k.shape[1], delta_k.shape[3]),
        (delta_v.shape[1], delta_v.shape[3]),
    )
    return FitResult(patch, energy, (energy - kept).clamp_min(0.0), tuple(spectra))


def bytes_per_rank(n_tokens: int, width: int, storage: Storage) -> int:
    """Stored bytes of one singular triplet of a ``[n_tokens, width]`` block."""
    scales = 2 * _SCALE_BYTES if storage == "int8" else 0
    return (n_tokens + width) * _DTYPES[storage].itemsize + scales


def _energy(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``||u vᵀ||²`` without forming it: ``sum((uᵀu) * (vᵀv))``, float64."""
    u, v = u.to(torch.float64), v.to(torch.float64)
    return ((u.T @ u) * (v.T @ v)).sum()


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, T, D]`` to float32 ``[L, T, H * D]`` (heads flattened into features)."""
    n_layers, heads, n_tokens, dim = x.shape
    return x.to(torch.float32).permute(0, 2, 1, 3).reshape(n_layers, n_tokens, heads * dim)


def _from_matrix(m: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``[T, H * D]`` back to ``[H, T, D]``."""
    return m.reshape(m.shape[0], shape[0], shape[1]).permute(1, 0, 2)


def groups(delta_k: torch.Tensor, delta_v: torch.Tensor, arrangement: Arrangement) -> list[torch.Tensor]:
    """The matrices a patch approximates, float32.

    joint: ``[[L, T, F_k + F_v]]``; split: ``[[L, T, F_k], [L, T, F_v]]``.
    """
    mk, mv = as_matrix(delta_k), as_matrix(delta_v)
    return [torch.cat([mk, mv], dim=2)] if arrangement == "joint" else [mk, mv]


def _check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    if k.dim() != 4 or v.dim() != 4 or k.shape[0] != v.shape[0] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must be [L, H, T, D] with equal L and T, got {tuple(k.shape)}, {tuple(v.shape)}"
        )


def _use_exact(targets: list[torch.Tensor], config: PatchConfig) -> bool:
    if config.solver != "auto":
        return config.solver == "exact"
    n_tokens = targets[0].shape[1]
    costs = [bytes_per_rank(n_tokens, x.shape[2], config.storage) for x in targets]
    caps = [c for c in (config.rank.rank_cap(costs), config.max_rank) if c is not None]
    if not caps:
        return True
    n = min(min(n_tokens, x.shape[2]) for x in targets)
    return 4 * (min(caps) + config.oversample) > n


def _factorize(
    x: torch.Tensor, gram: torch.Tensor | None, exact: bool, config: PatchConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Leading singular triplets of each ``x [B, T, F]``.

    Returns energies float64 ``[B, q]`` (descending), ``u [B, T, q]``, ``v [B, F, q]`` with
    ``u vᵀ`` the rank-q approximation, and totals float64 ``[B]`` (``||x||²``).
    """
    total = x.to(torch.float64).square().sum(dim=(1, 2))
    n_tokens, width = x.shape[1], x.shape[2]
    feature_side = gram is not None or width <= n_tokens
    if gram is None:
        gram = x.transpose(1, 2) @ x if feature_side else x @ x.transpose(1, 2)
    n = gram.shape[-1]
    cost = bytes_per_rank(n_tokens, width, config.storage)
    caps = [c for c in (config.rank.rank_cap([cost]), config.max_rank) if c is not None]
    n_keep = min([n, *caps])
    energies, basis = _top_eigh(gram, n_keep, exact, config)
    if feature_side:
        return energies, x @ basis, basis, total
    return energies, basis, x.transpose(1, 2) @ basis, total


def _top_eigh(
    gram: torch.Tensor, q: int, exact: bool, config: PatchConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leading ``q`` eigenpairs of symmetric PSD ``gram [B, n, n]``: float64 ``[B, q]``, ``[B, n, q]``."""
    n = gram.shape[-1]
    if exact or q + config.oversample >= n:
        evals, evecs = torch.linalg.eigh(gram)
    else:
        gen = torch.Generator(device=gram.device).manual_seed(config.seed)
        q_mat = torch.randn(gram.shape[0], n, q + config.oversample, generator=gen, device=gram.device)
        for _ in range(config.power_iters):
            q_mat = torch.linalg.qr(gram @ q_mat).Q
        small = q_mat.transpose(1, 2) @ gram @ q_mat
        evals, w = torch.linalg.eigh(0.5 * (small + small.transpose(1, 2)))
        evecs = q_mat @ w
    evals, evecs = evals.flip(-1)[:, :q], evecs.flip(-1)[:, :, :q]
    return evals.to(torch.float64).clamp_min(0.0), evecs


# --- storage ---------------------------------------------------------------------------


def _store(u: torch.Tensor, v: torch.Tensor, storage: Storage) -> Factors:
    if storage != "int8":
        return Factors(u.to(_DTYPES[storage]).contiguous(), v.to(_DTYPES[storage]).contiguous())
    qu, su = quantize_int8(u)
    qv, sv = quantize_int8(v)
    return Factors(qu, qv, su, sv)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-column int8: ``x [n, m]`` to ``(q int8 [n, m], scale float32 [m])``,
    ``x ≈ q * scale`` with ``|x - q * scale| <= scale / 2`` elementwise."""
    scale = (x.abs().amax(dim=0) / 127.0).to(torch.float32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def _load(x: torch.Tensor, scale: torch.Tensor | None, device: torch.device | None) -> torch.Tensor:
    x = x.to(device=device, dtype=torch.float32)
    return x if scale is None else x * scale.to(device=device, dtype=torch.float32)


# --- applying --------------------------------------------------------------------------


def apply_patch(k: torch.Tensor, v: torch.Tensor, patch: Patch) -> KV:
    """Pre-RoPE ``(k + Δk, v + Δv)``, new tensors of the inputs' shapes and dtypes."""
    _check_patch(k, v, patch)
    factors = [patch.layer(layer, k.device) for layer in range(patch.n_layers)]
    return KV(_add_low_rank(k, [f[0] for f in factors]), _add_low_rank(v, [f[1] for f in factors]))


def apply_and_place(
    chunk_k: torch.Tensor,
    chunk_v: torch.Tensor,
    patch: Patch | None,
    positions: torch.Tensor,
    spec: RopeSpec,
) -> KV:
    """Patch the chunk and place it: ``(rotate(k + Δk, positions), v + Δv)``.

    chunk_k ``[L, H_k, T, D_k]``, chunk_v ``[L, H_v, T, D_v]``, pre-RoPE; positions: absolute
    ``[T]`` (or ``[3, T]`` for M-RoPE) of the placed tokens. Keys come back post-RoPE. The low
    rank term is added by one ``baddbmm`` per layer straight into a fresh buffer (no copy of
    the chunk first), which the rotation then reads. ``patch=None`` places the chunk unpatched.
    """
    if patch is None:
        return KV(rotate(chunk_k, positions, spec), chunk_v)
    k, v = apply_patch(chunk_k, chunk_v, patch)
    return KV(rotate(k, positions, spec), v)


def _check_patch(k: torch.Tensor, v: torch.Tensor, patch: Patch) -> None:
    _check_kv(k, v)
    want_k = (patch.n_layers, patch.k_shape[0], patch.n_tokens, patch.k_shape[1])
    want_v = (patch.n_layers, patch.v_shape[0], patch.n_tokens, patch.v_shape[1])
    if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
        raise ValueError(f"patch is for k {want_k}, v {want_v}; got {tuple(k.shape)}, {tuple(v.shape)}")


def _add_low_rank(x: torch.Tensor, factors: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``x [L, H, T, D]`` plus ``u vᵀ`` per layer (``u [T, m]``, ``v [H * D, m]``)."""
    _, heads, n_tokens, dim = x.shape
    out = torch.empty_like(x)
    for layer, (u, v) in enumerate(factors):
        m = u.shape[1]
        if m == 0:
            out[layer].copy_(x[layer])
            continue
        # [H, T, m] @ [H, m, D] per head: the feature axis h * D + d splits into heads
        u_h, v_h = u.expand(heads, n_tokens, m), v.reshape(heads, dim, m).transpose(1, 2)
        if x.dtype == torch.float32:
            torch.baddbmm(x[layer], u_h, v_h, out=out[layer])
        else:
            out[layer] = torch.baddbmm(x[layer].to(torch.float32), u_h, v_h).to(x.dtype)
    return out


def residual_energy(patch: Patch, delta_k: torch.Tensor, delta_v: torch.Tensor) -> torch.Tensor:
    """``||Δ_l - (U Vᵀ)_l||²`` per layer over keys and values, float64 ``[L]``."""
    approx_k, approx_v = patch.dense()
    rk = (delta_k.to(torch.float64) - approx_k.to(torch.float64)).square().sum(dim=(1, 2, 3))
    rv = (delta_v.to(torch.float64) - approx_v.to(torch.float64)).square().sum(dim=(1, 2, 3))
    return rk + rv
