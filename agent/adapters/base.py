"""The adapter contract: the only place that knows how a transformers model holds its KV.

An adapter turns chunk inputs (text token ids, an image) into :class:`cache.layout.ChunkKV` in
the pre-RoPE frame, builds the model's own cache over placed chunks (:meth:`ModelAdapter.new_cache`),
and runs the model for new tokens on such a cache with explicit positions. For selective
recompute it also embeds tokens and runs decoder layers on chosen rows of a cache
(:meth:`ModelAdapter.run_layers`), so nothing above it touches the model. A model that takes
images is a :class:`VisionAdapter`: image preprocessing, the vision encoder run once per
distinct image, and the feature cache that makes that so. Everything above (context manager,
planner, agent loop, server) speaks only ``ChunkKV``, positions, token ids and these types.

Not here: which chunks to reuse or where to place them (``agent/context.py``), storage, patches,
which tokens to recompute (``agent/recompute.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from agent.adapters import attention
from cache.arena import KVArena
from cache.keys import Namespace
from cache.layout import ChunkKV, Family
from cache.numerics import bf16_kernels, numerics
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


class ModelCache(Protocol):
    """A model's own cache of past tokens (transformers: a ``Cache``, per-layer keys and values).

    Opaque above the adapter: only the adapter that made it (:meth:`ModelAdapter.empty_cache`,
    :meth:`ModelAdapter.new_cache`) reads or writes it; callers hand it back and ask
    :meth:`ModelAdapter.cache_length`.
    """

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens; a negative one drops the last ``-max_length``."""
        ...


class Prefill(NamedTuple):
    """What :meth:`ModelAdapter.prefill` returns.

    logits: ``[T, vocab]`` float32 for the new tokens; kv: the new tokens' KV, pre-RoPE, with
    positions relative to their own start; cache: the model cache now holding context + new.
    """

    logits: torch.Tensor
    kv: ChunkKV
    cache: ModelCache


class LayerRun(NamedTuple):
    """What :meth:`ModelAdapter.run_layers` returns.

    hidden: ``[R, hidden]``, the rows' output of the last layer run; k, v: the rows' fresh KV at
    that layer in the ChunkKV layout, post-RoPE, ``[H_kv, R, D]``.
    """

    hidden: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


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
    for M-RoPE models a ``[3, T]`` tensor, for others ``[T]``. A model cache holds one sequence.
    """

    info: ModelInfo
    spec: RopeSpec
    tokenizer: Any
    # attention depends only on relative positions (static RoPE frequencies), so a whole window
    # may be shifted; False for RoPE whose frequencies follow the sequence's length
    shift_invariant: bool = True
    # the dtype a prefill pass multiplies its linear layers in ("float32": the weights' own; a
    # narrower one is part of the numerics, see DecoderAdapter.use_prefill_products)
    prefill_products: str = "float32"

    @property
    def family(self) -> Family:
        return self.info.family

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Rows of the input embedding (it may pad the tokenizer's vocabulary)."""

    @property
    def arena_dims(self) -> ArenaDims:
        """The shapes of this model's KV in a window's arena (ChunkKV layout)."""
        i = self.info
        return ArenaDims(i.n_layers, (i.kv_heads, i.head_dim), (i.kv_heads, i.head_dim), i.dtype, self.device)

    @abstractmethod
    def chunk_positions(self, chunk: ChunkInput) -> tuple[torch.Tensor, int]:
        """The chunk's positions relative to its start and its extent."""

    # --- model caches ---------------------------------------------------------------------

    @abstractmethod
    def empty_cache(self) -> ModelCache:
        """A model cache holding nothing."""

    @abstractmethod
    def new_cache(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | KVArena) -> ModelCache:
        """A model cache over placed KV, the only way to build one that holds tokens.

        ``kv``: post-RoPE ``(k, v)`` pairs in the ChunkKV layout (``k [L, H, T_i, D]``), held in
        order; one pair is taken over as it is (no copy), several are concatenated into new
        buffers. The model's forward never writes them (it appends to new per-layer tensors);
        :meth:`run_layers` does, in place: give it a cache over tensors you own. Or a
        :class:`KVArena`: the cache holds the arena's used tokens as views, and new tokens are
        written into its spare room (growing it when full), copying nothing else.

        Raises ValueError when the KV's layer count is not the model's.
        """

    @abstractmethod
    def append_placed(self, cache: ModelCache, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append post-RoPE ``k [L, H, T, D]`` and ``v`` (ChunkKV layout) after what ``cache``
        holds, as the model's own next forward would append its new tokens."""

    @abstractmethod
    def cache_length(self, cache: ModelCache) -> int:
        """Tokens held by a model cache."""

    # --- running the model ----------------------------------------------------------------

    @abstractmethod
    def prefill(
        self, chunk: ChunkInput, cache: ModelCache, start: int, placed: bool = False, last_only: bool = False
    ) -> Prefill:
        """Run ``chunk`` at ``start`` attending to everything in ``cache`` (which grows).

        ``last_only``: logits ``[1, vocab]`` of the last token only (the head is not run on the rest).

        ``placed``: return the keys exactly as the model rotated them (``ChunkKV.placed_at =
        start``) instead of un-rotated to the pre-RoPE frame, so placing them back at ``start``
        reproduces this cache bit for bit."""

    def prefill_many(self, chunks: Sequence[ChunkInput], cache: ModelCache, start: int) -> list[ChunkKV]:
        """Prefill ``chunks`` one after another from ``start`` (``cache`` grows by all of them);
        each one's KV, pre-RoPE, relative to its own start. Adapters may do it in one pass."""
        out = []
        for chunk in chunks:
            kv = self.prefill(chunk, cache, start, last_only=True).kv
            start += kv.extent
            out.append(kv)
        return out

    def prefill_and_ask(
        self, chunks: Sequence[ChunkInput], prompt: ChunkInput, cache: ModelCache, start: int
    ) -> tuple[list[ChunkKV], torch.Tensor]:
        """:meth:`prefill_many` of ``chunks`` from ``start``, then ``prompt`` after them as
        :meth:`next_logits` runs it: the chunks' KV and the prompt's last logits ``[vocab]``; the
        cache grows by both. Adapters may do it in one pass."""
        kvs = self.prefill_many(chunks, cache, start)
        return kvs, self.next_logits(prompt, cache, start + sum(kv.extent for kv in kvs))

    @abstractmethod
    def next_logits(self, chunk: ChunkInput, cache: ModelCache, start: int) -> torch.Tensor:
        """Like :meth:`prefill` (``cache`` grows by the chunk) but only the logits ``[vocab]``
        after its last token: no logits for the other tokens, no KV extracted."""

    @abstractmethod
    def kv_tail(self, cache: ModelCache, chunk: ChunkInput, start: int) -> ChunkKV:
        """The KV of ``chunk``, already the last tokens of ``cache`` at ``start``, pre-RoPE."""

    @abstractmethod
    def reference_logits(self, chunks: Sequence[ChunkInput], last_only: bool = False) -> torch.Tensor:
        """Logits ``[T, vocab]`` (``[1, vocab]`` with ``last_only``) of one plain forward of the
        model over ``chunks`` from position 0, positions and vision features computed the
        model's own way (images encoded afresh, the feature cache untouched): the reference a
        chunked prefill must equal."""

    @property
    @abstractmethod
    def attention(self) -> str:
        """The attention implementation the model runs (a part of its numerics)."""

    def namespace(self, tenant_salt: str = "") -> Namespace:
        """What must match, besides content, for KV cached under this model to be reused: its
        weights, the KV dtype, a tenant's salt, and the numerics this process computes KV under
        now (``cache.numerics``: the thread count is read at each call)."""
        computed = numerics(self.device, attention.numerics_name(self.attention))
        if self.prefill_products != "float32":
            computed += f",products={self.prefill_products},{bf16_kernels()}"
        return Namespace(
            model=self.info.fingerprint,
            dtype=str(self.info.dtype).removeprefix("torch."),
            tenant_salt=tenant_salt,
            numerics=computed,
        )

    @abstractmethod
    def chunk_key(self, chunk: ChunkInput, tenant_salt: str = "") -> str:
        """Content key (hex) of a chunk under this model's namespace and a tenant's salt."""

    def encode(self, chunk: ChunkInput) -> ChunkKV:
        """Canonical KV: the chunk on its own, ``KV(B|∅)``."""
        return self.prefill(chunk, self.empty_cache(), 0, last_only=True).kv

    def text(self, ids: Sequence[int] | torch.Tensor) -> TextInput:
        return TextInput(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))

    @abstractmethod
    def decode_step(self, token: int, cache: ModelCache, position: int) -> torch.Tensor:
        """Logits ``[vocab]`` of the token after ``token`` placed at ``position``."""

    def decode_rows(
        self, tokens: Sequence[int], caches: Sequence[ModelCache], positions: Sequence[int]
    ) -> torch.Tensor:
        """Logits ``[N, vocab]`` of one decode step for each of N sequences, each on its own
        cache; a model that batches them overrides this (one step after another here)."""
        return torch.stack(
            [self.decode_step(t, c, p) for t, c, p in zip(tokens, caches, positions, strict=True)]
        )

    @property
    @abstractmethod
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a generation."""

    # --- hooks for selective recompute (``agent/recompute.py``) ---------------------------

    @abstractmethod
    def embed(self, chunk: ChunkInput) -> torch.Tensor:
        """Input embeddings ``[T, hidden]`` of a chunk's tokens (an image's vision features at
        its pad tokens; the encoder runs only on a feature-cache miss)."""

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[T, hidden]`` of token ids ``[T]``, as text."""
        return self.embed(self.text(ids))

    @property
    def cut_invariant(self) -> bool:
        """Whether a prefill cut at multiples of ``agent.adapters.attention.BLOCK`` tokens writes
        the KV of one pass, bit for bit, so that prefill passes may join segments (else each
        segment is a pass of its own)."""
        return False

    @property
    def quantised_decode(self) -> bool:
        """Whether decode steps multiply activations quantised to int8 (a GGUF model's block
        products, ``agent/adapters/qlinear.py``). Their logits then move in the quantisation's
        steps, and how far repaired KV moves a later step's logits is not told by how far it
        moved the first token's (``agent.modes.depth_unit_for``). False unless an adapter says so."""
        return False

    @property
    def supports_recompute(self) -> bool:
        """Whether the server's repair may recompute token ids of this model's contexts
        (:meth:`run_layers` on text rows). False unless an adapter says so."""
        return False

    def layer_kv(self, cache: ModelCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer`` of ``cache`` as ``(k, v)`` views ``[H, N, D]`` in the ChunkKV layout
        (post-RoPE; MLA: ``k_rope`` and the latent): writing into them writes the cache."""
        raise TypeError(f"{self.info.architecture}: no per-layer access to its cache")

    def run_layers(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        cache: ModelCache,
        layers: range,
        order: torch.Tensor | None = None,
    ) -> LayerRun:
        """Run decoder ``layers`` (consecutive) on some rows of the sequence ``cache`` holds.

        hidden: ``[R, hidden]``, the rows' input to the first layer (from :meth:`embed`); rows:
        sorted int64 ``[R]`` indices into ``cache``; positions: the rows' absolute positions,
        ``[R]`` (``[3, R]`` under M-RoPE). Each row attends to every cached token at a sequence
        index up to its own, its own fresh KV included. ``order``: the sequence index of every
        cached token (int64 ``[N]``) where the cache does not hold the sequence in order (a
        window's arena); None: a token's index in the cache. Side effect: at every layer
        run, the rows' fresh KV replace theirs in ``cache``, in place; nothing else is written
        and the context is never copied. Raises TypeError where the model's layers cannot run
        this way (MLA, DeepStack vision rows).
        """
        raise TypeError(f"{self.info.architecture}: selective recompute runs on GQA/MHA decoders only")

    def generate(
        self,
        prompt: ChunkInput,
        cache: ModelCache,
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
