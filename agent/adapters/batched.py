"""One decode step for many sequences at once, each on its own cache, whatever the batch.

Decode reads every weight once per step however many rows it serves, so N sequences decoded in
one pass cost little more than one. Each sequence keeps its own model cache (its own window,
length and positions): the row-wise parts of a layer (norms, projections, MLP, rotation) run on
all rows together, and attention runs per sequence over that sequence's cache only.

**Attention.** A float32 CPU step runs every row's attention of a layer in one native call
(``cache/attend.py``: each row over its own cache, in one fixed order of operations), instead of
one SDPA call per row and layer, whose fixed costs outweighed their arithmetic at 8 and more rows.
Where every row's cache is a whole arena (the server's caches), the kernel also writes the new
token's key and value into it, and each arena counts the token once after the step, instead of
one cache update per row and layer. ``KAMERA_NATIVE_ATTENTION=0``, a machine where the kernel
cannot be built, or a CPU without AVX-512 (where only the kernel's slow plain loop would run)
keeps the per-row SDPA calls (other float32 rounding, the same invariance).

**Batch invariance.** A row's result must not depend on what it was batched with. Row-wise
elementwise work and per-sequence attention never mix rows; matrix products do not mix them
either, but a BLAS picks its micro-kernel (and so the order of its sums) by the rows it is given:
on this project's CPUs a float32 GEMM computes a row one way when it runs in a block of four rows
and another way when it is one of 1 to 3 rows left over at the end of a product of fewer than 12
rows (``tests/test_batched.py`` measures it; bfloat16 products showed no such dependence). Every
step therefore runs a multiple of ``ROW_BLOCK`` rows, padded with a zero token at position 0
whose results are dropped, so a sequence decodes bit for bit the same alone or among up to
``MAX_ROWS - 1`` others, whatever its place in the batch. The padding rows go through the whole
pass (their products are part of the shape that fixes the sums) and are thrown away. Steps whose
every product runs on a row-independent kernel (``Linears.row_invariant``: the GGUF block
products of ``qlinear.py``) need no padding and run exactly their rows.

Supported: decoder layers of the Llama shape (``self_attn.{q,k,v,o}_proj``, optional per-head
``q_norm``/``k_norm``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) with full
attention and split-half rotary over the whole head (Llama, Mistral without a sliding window,
Qwen2, Qwen3). Others decode one sequence at a time through the model's own forward.

**Stepping.** Code that decodes (``DecoderAdapter.decode_step``) and code that prefills
(``DecoderAdapter._run``) ask :func:`current` whether their thread belongs to a scheduler that
batches steps (``agent/engine/scheduler.py``): a :class:`Stepper` bound with :func:`bind`. Then a
decode step is handed to it (and comes back with the logits of the batched pass it joined) and a
forward pass is followed by a pause, where the scheduler may run other work. Elsewhere (scripts,
tests, the CLI) steps run at once, through the same :func:`decode_rows`, so their numbers are the
ones a server gives.

Not here: which sequences share a step (``scheduler.py``), sampling (``generation.py``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from agent.adapters.cache_layers import hf_layers, whole_arena
from cache import attend
from cache.arena import KVArena

ROW_BLOCK = 4  # rows in whole blocks of four: no row is computed by a GEMM's leftover-row kernel
MAX_ROWS = 64  # checked invariant up to here (tests/test_batched.py)
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Attention of a float32 CPU step in one native call for all rows (cache/attend.py); off, where
# the kernel cannot be built or where it has no AVX-512 loop, one SDPA call per row and layer.
NATIVE_ATTENTION = os.environ.get("KAMERA_NATIVE_ATTENTION", "1") != "0"


class Stepper(Protocol):
    """Where a thread's model steps go when a scheduler batches them."""

    def decode(self, adapter: Any, token: int, cache: Any, position: int) -> torch.Tensor:
        """The logits of ``token`` at ``position`` on ``cache``, from a step shared with others."""

    def pause(self) -> None:
        """A point between forward passes where other work may run."""

    def prefill_left(self, before: int, after: int) -> None:
        """A prefill pass is about to run: ``before`` prompt tokens are left to prefill before
        the first token (this pass's included), ``after`` once it is done. A scheduler may run
        the passes of nearly done prompts first, and may pause here before the job's first pass."""

    def pass_tokens(self, before: int) -> int | None:
        """The most prompt tokens one prefill pass may take (None: no bound), so that other
        work waits at most one pass of that size; ``before``: the prompt's tokens ahead of the
        pass (its attention's reach, which a pass's time grows with)."""


_local = threading.local()


def bind(stepper: Stepper | None) -> None:
    """Hand this thread's model steps to ``stepper`` (None: run them at once)."""
    _local.stepper = stepper


def current() -> Stepper | None:
    return getattr(_local, "stepper", None)


def pause() -> None:
    """Let other work run here, when this thread's steps are scheduled (else nothing)."""
    stepper = current()
    if stepper is not None:
        stepper.pause()


def prefill_left(before: int, after: int) -> None:
    """Tell this thread's scheduler how many prompt tokens are left to prefill before and after
    the pass about to run (else nothing)."""
    stepper = current()
    if stepper is not None:
        stepper.prefill_left(before, after)


def pass_tokens(before: int) -> int | None:
    """The most prompt tokens one prefill pass of this thread may take, ``before`` tokens into
    its prompt: its scheduler's bound, or None (one pass for all) when steps run at once."""
    stepper = current()
    return None if stepper is None else stepper.pass_tokens(before)


def lengths(cache: Any) -> list[int] | None:
    """Tokens in each layer of a model cache (None: not a transformers cache), for :func:`rewind`."""
    try:
        return [layer.get_seq_length() for layer in hf_layers(cache)]
    except TypeError:
        return None


def rewind(cache: Any, marks: Sequence[int]) -> None:
    """Drop what a failed step appended to ``cache`` since :func:`lengths` gave ``marks``."""
    for layer, n in zip(hf_layers(cache), marks, strict=True):
        extra = layer.get_seq_length() - n
        if extra > 0:
            layer.crop(-extra)


class _ArenaRows:
    """A step's rows whose caches are whole arenas (``cache_layers.whole_arena``), one each: room
    for the new token is made once, every layer's new key and value are written by the attention
    kernel at the same slot, and the token is counted once the step has run every layer."""

    def __init__(self, arenas: list[KVArena], layers: list[list[Any]]) -> None:
        self.arenas, self.layers = arenas, layers
        for arena, rows in zip(arenas, layers, strict=True):
            grows = arena.grows
            arena.reserve(arena.lengths[0] + 1)  # may move the buffers: addresses are taken after
            if arena.grows != grows:
                for layer in rows:  # the views show the new buffers at once
                    layer.refresh()
        self.table = np.array(
            [
                [a.k.data_ptr() for a in arenas],
                [a.v.data_ptr() for a in arenas],
                [a.k.stride(1) for a in arenas],
                [a.v.stride(1) for a in arenas],
                [a.lengths[0] + 1 for a in arenas],
            ],
            dtype=np.int64,
        )
        self.layer_bytes = np.array(
            [
                [a.k.stride(0) * a.k.element_size() for a in arenas],
                [a.v.stride(0) * a.v.element_size() for a in arenas],
            ],
            dtype=np.int64,
        )

    @classmethod
    def of(cls, per_layer: list[list[Any]]) -> _ArenaRows | None:
        arenas = [whole_arena(layers) for layers in per_layer]
        if any(a is None or a.k.dtype != torch.float32 or a.k.stride(2) != a.k.shape[3] for a in arenas):
            return None
        if any(a.v.stride(2) != a.v.shape[3] or a.k.shape[3] != a.v.shape[3] for a in arenas):
            return None
        if len({id(a) for a in arenas}) != len(arenas):
            return None
        return cls(arenas, per_layer)  # type: ignore[arg-type]

    def layer(self, i: int) -> np.ndarray:
        table = self.table.copy()
        table[:2] += i * self.layer_bytes
        return table

    def count(self) -> None:
        for arena, layers in zip(self.arenas, self.layers, strict=True):
            arena.lengths = [arena.lengths[0] + 1] * arena.n_layers
            for layer in layers:
                layer.refresh()


def _attend_updated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layers: list[Any],
    scale: float,
    out: torch.Tensor,
    native: bool,
) -> None:
    """Each row's cache layer takes the row's new key and value (``update``), then the rows
    attend over their caches into ``out``: in one native call, or one SDPA call per row."""
    n, heads, d = len(layers), q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    cached = [layer.update(k[r][None, :, None], v[r][None, :, None]) for r, layer in enumerate(layers)]
    if native:  # every row's heads in one call, in one fixed order (cache/attend.py)
        attend.attend_rows(q[:n], [c[0] for c in cached], [c[1] for c in cached], scale, out[:n])
        return
    for r, (keys, values) in enumerate(cached):
        # query heads of one KV head are neighbours: [1, H_kv, group, D] against its cache
        query = q[r].view(1, kv_heads, heads // kv_heads, d)
        o = F.scaled_dot_product_attention(query, keys, values, scale=scale)
        out[r] = o.reshape(heads * d)


def supports(model: Any) -> bool:
    """Whether :func:`decode_rows` can run ``model`` (a transformers causal LM)."""
    cfg = model.config.get_text_config()
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    if cfg.model_type not in MODEL_TYPES or windowed:
        return False
    if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        return False
    base = model.get_decoder()
    needed = ("q_proj", "k_proj", "v_proj", "o_proj")
    return all(
        all(hasattr(layer.self_attn, n) for n in needed)
        and hasattr(layer, "input_layernorm")
        and hasattr(layer, "post_attention_layernorm")
        for layer in base.layers
    )


class Linears(Protocol):
    """Where a step's linear layers run: the model's own float32 modules (:class:`ModelLinears`)
    or another kernel for the same weights (``qlinear.QuantDecode``). x: ``[rows, features]``."""

    @property
    def row_invariant(self) -> bool:
        """Whether a row's products are the same whatever the number of rows (no padding needed)."""

    def qkv(self, i: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Layer i's query, key and value projections of x."""

    def o(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's attention output projection."""

    def mlp(self, i: int, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP (``mlp`` the model's module)."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head."""


class ModelLinears:
    """The model's own modules: float32 GEMMs, whose sums depend on the number of rows."""

    row_invariant = False

    def __init__(self, model: Any) -> None:
        self.layers = model.get_decoder().layers
        self.head = model.get_output_embeddings()

    def qkv(self, i: int, x: torch.Tensor) -> list[torch.Tensor]:
        attn = self.layers[i].self_attn
        return [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]

    def o(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[i].self_attn.o_proj(x)

    def mlp(self, i: int, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        return mlp(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


@torch.inference_mode()
def decode_rows(
    model: Any,
    tokens: Sequence[int],
    caches: Sequence[Any],
    positions: Sequence[int],
    linears: Linears | None = None,
) -> torch.Tensor:
    """Logits ``[N, vocab]`` (float32) of ``tokens[i]`` placed at ``positions[i]`` on
    ``caches[i]``; each cache grows by one token. ``linears``: where the linear layers run (the
    model's own modules when None). Rows are padded to a multiple of ``ROW_BLOCK`` unless every
    product is row-invariant."""
    n = len(tokens)
    if not n == len(caches) == len(positions):
        raise ValueError(f"{n} tokens, {len(caches)} caches and {len(positions)} positions")
    if not 1 <= n <= MAX_ROWS:
        raise ValueError(f"a step decodes 1 to {MAX_ROWS} sequences, got {n}")
    base = model.get_decoder()
    cfg = model.config.get_text_config()
    device = next(model.parameters()).device
    lin = ModelLinears(model) if linears is None else linears
    rows = n if lin.row_invariant else -(-n // ROW_BLOCK) * ROW_BLOCK
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    ids[:n] = torch.tensor(list(tokens), dtype=torch.long)
    pos = torch.zeros(rows, dtype=torch.long, device=device)
    pos[:n] = torch.tensor(list(positions), dtype=torch.long)
    h = model.get_input_embeddings()(ids)  # h: [rows, hidden]
    cos, sin = base.rotary_emb(h[None], pos[None])  # cos, sin: [1, rows, D]
    cos, sin = cos[0], sin[0]
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    per_layer = [hf_layers(c) for c in caches]
    native = NATIVE_ATTENTION and h.dtype == torch.float32 and device.type == "cpu" and attend.vectorised()
    direct = _ArenaRows.of(per_layer) if native else None
    for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
        attn = layer.self_attn
        d = attn.head_dim
        x = layer.input_layernorm(h)
        q, k, v = lin.qkv(i, x)
        q, k, v = q.view(rows, heads, d), k.view(rows, kv_heads, d), v.view(rows, kv_heads, d)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        q, k = rotate(q, k, cos, sin, unsqueeze_dim=1)  # split-half rotation, per row's position
        out = torch.zeros(rows, heads * d, dtype=h.dtype, device=device)
        if direct is not None:  # the kernel writes each row's new token into its arena, then attends
            attend.attend_slots(q[:n], direct.layer(i), kv_heads, attn.scaling, out[:n], (k[:n], v[:n]))
        else:
            _attend_updated(q, k, v, [layers[i] for layers in per_layer], attn.scaling, out, native)
        h = h + lin.o(i, out)
        h = h + lin.mlp(i, layer.mlp, layer.post_attention_layernorm(h))
    if direct is not None:
        direct.count()
    logits = lin.logits(base.norm(h))  # every row: the shape fixes the sums
    return logits[:n].float()
