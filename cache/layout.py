"""A chunk's KV in the pre-RoPE frame, the same shape for every attention family.

Every family splits into a *positional part* that RoPE rotates and a *position-free part*:

==========  =====================================  ==========================================
family      ``k`` (rotated when placed)            ``v`` (reused byte for byte)
==========  =====================================  ==========================================
``gqa``     keys ``[L, H_kv, T, D_k]``             values ``[L, H_kv, T, D_v]``
            (MHA is ``H_kv = H``; partial rotary
            models rotate only ``rotary_dim``)
``mla``     decoupled ``k_rope [L, 1, T, d_rope]``  normalised latent ``c_KV [L, 1, T, r]``
==========  =====================================  ==========================================

MLA stores the latent, never the per-head K/V that ``kv_b_proj`` expands from it.

``positions`` are the chunk's own positions counted from 0: ``[T]``, or ``[3, T]`` for M-RoPE,
where an image spans a grid and the text after it resumes at ``max(position) + 1``. So a
chunk's ``extent`` (how far it moves the next chunk's start) is not always ``n_tokens``.

``placed_at``: ``None`` for keys in the pre-RoPE frame; a start ``s`` for keys kept exactly as the
model rotated them with the chunk at ``s`` (post-RoPE, attention scaling included). Such a chunk
is still movable anywhere, by ``R(start - s)`` (:func:`cache.rope.relocate`), and placing it back
at ``s`` copies its keys bit for bit: un-rotating and rotating again would round, and an exact
prefix must reproduce a full prefill's cache exactly.

Not here: how a model produces or consumes these tensors (``agent/adapters``), patches
(``cache/patch.py``) or storage (``cache/store``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from cache.rope import RopeSpec, relocate, rotate

Family = Literal["gqa", "mla"]


@dataclass(frozen=True)
class ChunkKV:
    """One chunk's canonical (or conditioned) KV, position-free. See the module docstring."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    extent: int
    family: Family = "gqa"
    placed_at: int | None = None  # None: k pre-RoPE; s: k post-RoPE as placed at start s

    def __post_init__(self) -> None:
        if self.family not in ("gqa", "mla"):
            raise ValueError(f"family must be 'gqa' or 'mla', got {self.family!r}")
        if self.k.dim() != 4 or self.v.dim() != 4:
            raise ValueError(
                f"k and v must be [L, H, T, D], got {tuple(self.k.shape)} and {tuple(self.v.shape)}"
            )
        if self.k.shape[:1] != self.v.shape[:1] or self.k.shape[2] != self.v.shape[2]:
            raise ValueError(
                f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} disagree on layers or tokens"
            )
        if self.family == "mla" and (self.k.shape[1] != 1 or self.v.shape[1] != 1):
            raise ValueError("an MLA chunk holds one shared k_rope and one latent per token")
        n = self.k.shape[2]
        if self.positions.dtype != torch.int64 or self.positions.shape[-1] != n:
            raise ValueError(
                f"positions must be int64 [T] or [3, T] with T={n}, got "
                f"{self.positions.dtype} {tuple(self.positions.shape)}"
            )
        if self.positions.dim() not in (1, 2) or (self.positions.dim() == 2 and self.positions.shape[0] != 3):
            raise ValueError(f"positions must be [T] or [3, T], got {tuple(self.positions.shape)}")
        if n and int(self.positions.min()) < 0:
            raise ValueError("chunk positions count from 0")
        if self.extent < (int(self.positions.max()) + 1 if n else 0):
            raise ValueError(f"extent {self.extent} is smaller than the chunk's largest position + 1")
        if self.placed_at is not None and self.placed_at < 0:
            raise ValueError(f"placed_at must be a start >= 0, got {self.placed_at}")

    @property
    def n_tokens(self) -> int:
        return int(self.k.shape[2])

    @property
    def n_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def placed_positions(self, start: int) -> torch.Tensor:
        """Absolute positions when the chunk starts at ``start`` (``[T]`` or ``[3, T]``)."""
        return self.positions + start

    def place(self, start: int, spec: RopeSpec, kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE ``(k, v)`` for the chunk at ``start``: k rotated (or, for a chunk already
        placed there, shared as it is), v shared, not copied."""
        if self.placed_at is None:
            return rotate(self.k, self.placed_positions(start), spec, kernel), self.v
        if start == self.placed_at:
            return self.k, self.v
        return relocate(self.k, start - self.placed_at, spec, kernel), self.v

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ChunkKV:
        return ChunkKV(
            k=self.k.to(device=device, dtype=dtype),
            v=self.v.to(device=device, dtype=dtype),
            positions=self.positions.to(device=device),
            extent=self.extent,
            family=self.family,
            placed_at=self.placed_at,
        )

    def sliced(self, t0: int, t1: int, p0: int, extent: int) -> ChunkKV:
        """Tokens ``[t0, t1)``, positions counted from ``p0`` (their own start): a view, no copy."""
        if t0 == 0 and t1 == self.n_tokens and p0 == 0:
            return self
        return ChunkKV(
            self.k[:, :, t0:t1],
            self.v[:, :, t0:t1],
            self.positions[..., t0:t1] - p0,
            extent,
            self.family,
            None if self.placed_at is None else self.placed_at + p0,
        )


def text_positions(n_tokens: int) -> torch.Tensor:
    """``[0, 1, ..., n-1]`` as int64: the positions of a plain text chunk."""
    return torch.arange(n_tokens, dtype=torch.int64)
