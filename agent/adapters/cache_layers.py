"""transformers cache layers the decoder adapter builds: one over a :class:`KVArena`, and a
stand-in that writes recomputed rows into a layer in place.

Both keep the transformers layout: keys and values ``[1, H, T, D]`` per layer (MLA swapped:
the key slot holds the latent, see ``decoder.py``).

Not here: building caches or running the model (``decoder.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from agent.adapters.base import ModelCache
from cache.arena import KVArena


class ArenaLayer(DynamicLayer):
    """One layer of a model cache whose tokens live in a :class:`KVArena`: the cached keys and
    values are views of the arena's used tokens, and new ones are written into its spare room.

    ``swap``: the model's key slot holds ChunkKV's ``v`` (MLA: the latent), its value slot ``k``.
    """

    def __init__(self, arena: KVArena, index: int, swap: bool) -> None:
        super().__init__()
        self.arena, self.index, self.swap = arena, index, swap
        self.generation = arena.generation
        self.device = arena.k.device
        self.is_initialized = True
        self._show()

    def _show(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.arena.views(self.index)
        self.keys, self.values = shown = (v, k) if self.swap else (k, v)
        return shown

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (value_states, key_states) if self.swap else (key_states, value_states)
        if k.shape[0] != 1:
            raise ValueError(f"a window cache holds one sequence, got a batch of {k.shape[0]}")
        self.arena.append(self.index, k[0], v[0], self.generation)
        return self._show()

    def refresh(self) -> None:
        """Show the arena's used tokens again (after tokens were written into it directly)."""
        self._show()

    def get_seq_length(self) -> int:
        return self.arena.lengths[self.index]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        n = self.arena.lengths[self.index]
        self.arena.lengths[self.index] = max(0, n + tokens_to_remove)
        self._show()


class RowWriter:
    """Stands in for the model cache inside one decoder layer of ``DecoderAdapter.run_layers``.

    ``update(k, v, layer)`` writes the rows' fresh post-RoPE K/V (``[1, H, R, D]``) into
    ``target``'s tensors at ``rows``, in place, and returns the whole layer, so the rows attend
    to the cached KV everywhere else; ``fresh`` keeps the last K/V it received (``[H, R, D]``).
    """

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.target: Any = None
        self.fresh: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.target.keys, self.target.values
        keys[0].index_copy_(1, self.rows, key_states[0].to(keys.dtype))
        values[0].index_copy_(1, self.rows, value_states[0].to(values.dtype))
        self.fresh = (key_states[0], value_states[0])
        return keys, values


def hf_layers(cache: ModelCache) -> list[Any]:
    """The per-layer (keys, values) holders of a transformers cache."""
    if not isinstance(cache, Cache):
        raise TypeError(f"not a model cache of this adapter: {type(cache).__name__}")
    return cache.layers


def whole_arena(layers: list[Any]) -> KVArena | None:
    """The arena behind ``layers`` when they are its layers 0..L-1 in order (keys in the key slot),
    of its current generation, each with the same tokens in use; else None. Such a cache can take
    a step's new tokens written straight into the arena (``agent/adapters/batched.py``)."""
    if not layers or not isinstance(layers[0], ArenaLayer):
        return None
    arena = layers[0].arena
    if len(layers) != arena.n_layers or len(set(arena.lengths)) != 1:
        return None
    for i, layer in enumerate(layers):
        if not isinstance(layer, ArenaLayer) or layer.arena is not arena or layer.index != i:
            return None
        if layer.swap or layer.generation != arena.generation:
            return None
    return arena
