"""The adapter contract: the only place that knows how a transformers model holds its KV.

An adapter turns chunk inputs (text token ids, an image) into :class:`cache.layout.ChunkKV` in
the pre-RoPE frame, assembles placed chunks into the model's own cache object, and runs the
model for new tokens on such a cache with explicit positions. Everything above it (context
manager, planner, agent loop) speaks only ``ChunkKV``, positions and token ids.

Not here: which chunks to reuse or where to place them (``agent/context.py``), storage, patches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from cache.arena import KVArena
from cache.layout import ChunkKV, Family
from cache.rope import RopeSpec
from cache.window import ArenaDims


@dataclass(frozen=True)
class TextInput:
    """A text chunk: token ids ``[T]`` (int64)."""

    ids: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.ids.dtype != torch.int64:
            raise ValueError(f"text ids must be int64 [T], got {self.ids.dtype} {tuple(self.ids.shape)}")

    @property
    def n_tokens(self) -> int:
        return int(self.ids.numel())


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: the processor's ``pixel_values`` and ``image_grid_thw`` row.

    ``content_key`` identifies the pixels (see ``cache/keys.py``); the vision encoder runs once per
    key. ``ids`` are the chunk's tokens (vision start, one pad per merged patch, vision end).
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    ids: torch.Tensor
    content_key: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.numel())


ChunkInput = TextInput | ImageInput


class Prefill(NamedTuple):
    """What :meth:`ModelAdapter.prefill` returns.

    logits: ``[T, vocab]`` float32 for the new tokens; kv: the new tokens' KV, pre-RoPE, with
    positions relative to their own start; cache: the model cache now holding context + new.
    """

    logits: torch.Tensor
    kv: ChunkKV
    cache: Any


class Generation(NamedTuple):
    tokens: list[int]
    first_token_s: float
    total_s: float


class TokenConstraint(Protocol):
    """What decoding under a grammar needs (``agent.grammar.Constraint`` is one)."""

    def allowed(self, vocab: int) -> torch.Tensor:
        """bool ``[vocab]``: the tokens allowed next."""
        ...

    def advance(self, token: int) -> None:
        """Take the chosen token (one that was allowed)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but an end token may follow."""
        ...


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    family: Family
    n_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    fingerprint: str


class ModelAdapter(ABC):
    """Contract between the runtime and one loaded model.

    All tensors returned are on the model's device. Positions are absolute sequence positions;
    for M-RoPE models a ``[3, T]`` tensor, for others ``[T]``.
    """

    info: ModelInfo
    spec: RopeSpec
    tokenizer: Any
    # attention depends only on relative positions (static RoPE frequencies), so a whole window
    # may be shifted; False for RoPE whose frequencies follow the sequence's length
    shift_invariant: bool = True

    @property
    def family(self) -> Family:
        return self.info.family

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def arena_dims(self) -> ArenaDims:
        """The shapes of this model's KV in a window's arena (ChunkKV layout)."""
        i = self.info
        return ArenaDims(i.n_layers, (i.kv_heads, i.head_dim), (i.kv_heads, i.head_dim), i.dtype, self.device)

    @abstractmethod
    def chunk_positions(self, chunk: ChunkInput) -> tuple[torch.Tensor, int]:
        """The chunk's positions relative to its start and its extent."""

    @abstractmethod
    def empty_cache(self) -> Any:
        """A model cache holding nothing."""

    @abstractmethod
    def assemble(self, placed: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """A model cache holding, in order, each chunk's post-RoPE ``(k, v)`` (ChunkKV layout).

        The result owns its tensors: running the model on it never modifies the inputs.
        """

    @abstractmethod
    def cache_from(self, k: torch.Tensor, v: torch.Tensor) -> Any:
        """A model cache over whole-window buffers ``k [L, H, T, D]`` (post-RoPE) and ``v``."""

    @abstractmethod
    def cache_on(self, arena: KVArena) -> Any:
        """A model cache over ``arena``'s used tokens; new tokens are written into its spare room."""

    @abstractmethod
    def prefill(
        self, chunk: ChunkInput, cache: Any, start: int, placed: bool = False, last_only: bool = False
    ) -> Prefill:
        """Run ``chunk`` at ``start`` attending to everything in ``cache`` (which grows).

        ``last_only``: logits ``[1, vocab]`` of the last token only (the head is not run on the rest).

        ``placed``: return the keys exactly as the model rotated them (``ChunkKV.placed_at =
        start``) instead of un-rotated to the pre-RoPE frame, so placing them back at ``start``
        reproduces this cache bit for bit."""

    def prefill_many(self, chunks: Sequence[ChunkInput], cache: Any, start: int) -> list[ChunkKV]:
        """Prefill ``chunks`` one after another from ``start`` (``cache`` grows by all of them);
        each one's KV, pre-RoPE, relative to its own start. Adapters may do it in one pass."""
        out = []
        for chunk in chunks:
            kv = self.prefill(chunk, cache, start).kv
            start += kv.extent
            out.append(kv)
        return out

    @abstractmethod
    def next_logits(self, chunk: ChunkInput, cache: Any, start: int) -> torch.Tensor:
        """Like :meth:`prefill` (``cache`` grows by the chunk) but only the logits ``[vocab]``
        after its last token: no logits for the other tokens, no KV extracted."""

    @abstractmethod
    def kv_tail(self, cache: Any, chunk: ChunkInput, start: int) -> ChunkKV:
        """The KV of ``chunk``, already the last tokens of ``cache`` at ``start``, pre-RoPE."""

    @abstractmethod
    def cache_length(self, cache: Any) -> int:
        """Tokens held by a model cache."""

    @abstractmethod
    def chunk_key(self, chunk: ChunkInput, tenant_salt: str = "") -> str:
        """Content key (hex) of a chunk under this model's namespace and a tenant's salt."""

    def encode(self, chunk: ChunkInput) -> ChunkKV:
        """Canonical KV: the chunk on its own, ``KV(B|∅)``."""
        return self.prefill(chunk, self.empty_cache(), 0).kv

    def text(self, ids: Sequence[int] | torch.Tensor) -> TextInput:
        return TextInput(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))

    @abstractmethod
    def decode_step(self, token: int, cache: Any, position: int) -> torch.Tensor:
        """Logits ``[vocab]`` of the token after ``token`` placed at ``position``."""

    @property
    @abstractmethod
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a generation."""

    def generate(
        self,
        prompt: ChunkInput,
        cache: Any,
        start: int,
        max_new_tokens: int,
        first_logits: torch.Tensor | None = None,
        constraint: TokenConstraint | None = None,
    ) -> Generation:
        """Greedy decoding after ``prompt`` placed at ``start`` on ``cache`` (which grows).

        Returns the generated token ids (end token excluded) and timings; the time to first
        token covers the prompt's prefill and the first argmax. Under a ``constraint`` the
        argmax is over the tokens it allows, and decoding stops once it is finished.
        """
        import time

        def pick(logits: torch.Tensor) -> int:
            if constraint is None:
                return int(logits.argmax())
            allowed = constraint.allowed(logits.shape[-1]).to(logits.device)
            if not bool(allowed.any()):
                raise ValueError("the grammar allows no token of this model's vocabulary")
            return int(logits.masked_fill(~allowed, float("-inf")).argmax())

        t0 = time.perf_counter()
        if first_logits is None:
            first_logits = self.next_logits(prompt, cache, start)
        _, extent = self.chunk_positions(prompt)
        pos = start + extent
        token = pick(first_logits)
        first = time.perf_counter() - t0
        tokens: list[int] = []
        while token not in self.eos_ids and len(tokens) < max_new_tokens:
            tokens.append(token)
            if constraint is not None:
                constraint.advance(token)
                if constraint.finished:
                    break
            if len(tokens) == max_new_tokens:
                break
            token = pick(self.decode_step(token, cache, pos))
            pos += 1
        return Generation(tokens, first, time.perf_counter() - t0)
