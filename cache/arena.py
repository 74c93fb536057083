"""A window's KV in place: two preallocated buffers that the model's cache appends into.

A :class:`KVArena` holds ``k [L, H, capacity, D_k]`` and ``v [L, H_v, capacity, D_v]`` in the
ChunkKV layout (post-RoPE keys) and, per layer, how many tokens are in use. The model's cache
(see ``agent/adapters/decoder.py``) is a set of views of the first ``lengths[layer]`` tokens:
new tokens are written into the spare capacity instead of concatenated onto a copy of the whole
window, so a forward pass of a few tokens over a long window copies nothing but those tokens.

The arena does not know about chunks or positions: the tokens of a window may lie in any
physical order, since attention over a cache (every cached token visible to every new query)
does not depend on where a key sits in memory, only on the position its rotation encodes. The
context manager (``agent/context.py``) decides where each chunk lives and keeps the bookkeeping.

Caches made over an arena carry its ``generation``: :meth:`KVArena.reset` starts a new one, and
a cache of an older generation refuses to write (it would overwrite tokens that moved there).
"""

from __future__ import annotations

import torch


class StaleCacheError(RuntimeError):
    """A model cache made over an arena was used after the window it showed changed."""


class KVArena:
    """Keys and values of one window, with room to grow; ``lengths[l]`` tokens in use per layer."""

    def __init__(
        self,
        n_layers: int,
        k_dims: tuple[int, int],
        v_dims: tuple[int, int],
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if n_layers < 1 or capacity < 1:
            raise ValueError(f"an arena needs at least one layer and one token, got {n_layers}, {capacity}")
        self.k = torch.empty((n_layers, k_dims[0], capacity, k_dims[1]), dtype=dtype, device=device)
        self.v = torch.empty((n_layers, v_dims[0], capacity, v_dims[1]), dtype=dtype, device=device)
        self.lengths = [0] * n_layers
        self.generation = 0
        self.grows = 0

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    @property
    def n_layers(self) -> int:
        return int(self.k.shape[0])

    def reserve(self, tokens: int) -> None:
        """Make room for at least ``tokens`` tokens per layer (doubling; the used part is copied)."""
        if tokens <= self.capacity:
            return
        capacity = max(tokens, 2 * self.capacity)
        used = max(self.lengths)
        k = self.k.new_empty((*self.k.shape[:2], capacity, self.k.shape[3]))
        v = self.v.new_empty((*self.v.shape[:2], capacity, self.v.shape[3]))
        k[:, :, :used] = self.k[:, :, :used]
        v[:, :, :used] = self.v[:, :, :used]
        self.k, self.v = k, v
        self.grows += 1

    def reset(self, length: int) -> None:
        """Every layer back to ``length`` tokens in use; caches made before refuse to write."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside 0..{self.capacity}")
        self.lengths = [length] * self.n_layers
        self.generation += 1

    def retire(self) -> None:
        """Caches made so far refuse to write from now on (the window they show changed)."""
        self.generation += 1

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, generation: int) -> None:
        """Write new tokens ``k [H, T, D_k]``, ``v [H_v, T, D_v]`` after ``layer``'s used ones."""
        if generation != self.generation:
            raise StaleCacheError(
                "this model cache no longer shows the window (it changed since the cache was made): "
                "take a new one from the context manager"
            )
        n, t = self.lengths[layer], k.shape[-2]
        self.reserve(n + t)
        self.k[layer, :, n : n + t] = k
        self.v[layer, :, n : n + t] = v
        self.lengths[layer] = n + t

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The used tokens of ``layer``: ``k [1, H, n, D_k]``, ``v [1, H_v, n, D_v]`` (views)."""
        n = self.lengths[layer]
        return self.k[layer, None, :, :n], self.v[layer, None, :, :n]

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy ``n`` tokens of every layer from ``src`` to ``dst`` (ranges must not overlap)."""
        if src < dst + n and dst < src + n:
            raise ValueError(f"overlapping move {src} -> {dst} of {n} tokens")
        self.k[:, :, dst : dst + n] = self.k[:, :, src : src + n]
        self.v[:, :, dst : dst + n] = self.v[:, :, src : src + n]
