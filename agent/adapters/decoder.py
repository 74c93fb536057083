"""Adapter for decoder-only transformers LMs: Llama/Qwen2 (GQA), MHA, partial rotary, MLA.

How each family's HF cache holds a layer (transformers 5.x, read from its code):

- Llama, Qwen2, Mistral, GPT-NeoX, Phi: ``keys`` post-RoPE ``[B, H_kv, T, D]`` (partial rotary
  models rotate the first ``rotary_dim`` dims), ``values`` ``[B, H_kv, T, D_v]``.
- DeepSeek-V2/V3 (MLA): the *key* slot holds the normalised latent ``[B, 1, T, kv_lora_rank]``
  and the *value* slot the rotated ``k_pe`` ``[B, 1, T, qk_rope_head_dim]``; per-head K/V are
  expanded by ``kv_b_proj`` inside attention. ChunkKV keeps ``k = k_pe`` and ``v = latent``.

Not here: vision inputs (``qwen_vl.py``), loading checkpoints (``loading.py``).
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from agent.adapters import attention, batched, qlinear
from agent.adapters.base import (
    ChunkInput,
    ImageInput,
    LayerRun,
    ModelAdapter,
    ModelCache,
    ModelInfo,
    Prefill,
    TextInput,
)
from agent.adapters.cache_layers import ArenaLayer, RowWriter, hf_layers
from agent.adapters.vision import VisionAdapter
from cache.arena import KVArena
from cache.keys import digest_key, image_key, token_key
from cache.layout import ChunkKV, Family
from cache.numerics import PREFILL_PRODUCTS
from cache.rope import RopeSpec, unrotate
from cache.window import ArenaDims

_IMAGE_KEYS_KEPT = 16384  # remembered image chunk keys (one short string each)
# A prefill pass's linear layers run on at least this many rows: a float32 GEMM computes the 1 to
# 3 rows left over at the end of a product of fewer than 12 rows with another kernel (see
# ``batched.py``), so a short pass would not write the KV a longer pass writes for those tokens
PASS_MIN_ROWS = 12
_pass = threading.local()
PREFILL_WEIGHT = "_kamera_prefill_weight"  # a linear's weight in the prefill products' dtype
INTERLEAVED_ARCHITECTURES = frozenset({"deepseek_v2", "deepseek_v3"})


def rope_spec_from_module(rotary_emb: torch.nn.Module, model_type: str, **mrope: Any) -> RopeSpec:
    """The spec of what the model's own rotary module applies: its inverse frequencies (already
    scaled: linear, Llama-3, YaRN) and the magnitude it folds into cos/sin."""
    inv = rotary_emb.inv_freq
    if not isinstance(inv, torch.Tensor):
        raise TypeError("the rotary embedding module has no inv_freq buffer")
    return RopeSpec(
        inv_freq=tuple(inv.float().cpu().tolist()),
        pairing="interleaved" if model_type in INTERLEAVED_ARCHITECTURES else "half",
        attention_scaling=float(getattr(rotary_emb, "attention_scaling", 1.0)),
        **mrope,
    )


def _floored_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[-2] if x.dim() > 1 else 0
    in_pass = getattr(_pass, "narrow", False)
    if 0 < rows < getattr(_pass, "min_rows", 0):
        pad = x.new_zeros(*x.shape[:-2], PASS_MIN_ROWS - rows, x.shape[-1])
        return _product(self, torch.cat([x, pad], dim=-2), in_pass)[..., :rows, :]
    return _product(self, x, in_pass)


def _product(linear: torch.nn.Linear, x: torch.Tensor, in_pass: bool) -> torch.Tensor:
    """``linear(x)``; in a prefill pass (or a repair's recompute, or the reference forward) of a
    model whose prefill products run in a narrower dtype (:meth:`DecoderAdapter.use_prefill_products`),
    ``x`` and the weight in that dtype, the product back in the activations' dtype, the bias
    added there."""
    narrow = getattr(linear, PREFILL_WEIGHT, None) if in_pass else None
    if narrow is None:
        return torch.nn.Linear.forward(linear, x)
    y = torch.nn.functional.linear(x.to(narrow.dtype), narrow).to(x.dtype)
    return y if linear.bias is None else y + linear.bias


def floor_rows(linear: torch.nn.Linear) -> None:
    """Make ``linear`` run a prefill pass's product on at least ``PASS_MIN_ROWS`` rows (zero rows
    added, their results dropped), so its rows come out as they would in a longer pass. Bound as
    the module's own method, so a copy of the model keeps it on the copy."""
    linear.forward = types.MethodType(_floored_forward, linear)  # type: ignore[method-assign]


def model_fingerprint(model: PreTrainedModel, name: str) -> str:
    """A stable id of the weights: config plus a sample of every parameter's values."""
    parts = [name.encode(), model.config.to_json_string(use_diff=False).encode()]
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            flat = p.detach().reshape(-1)
            parts.append(pname.encode())
            parts.append(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
    return digest_key("model", parts).hex


class DecoderAdapter(ModelAdapter):
    """Any decoder-only transformers causal LM whose cache is a list of (keys, values) layers."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: Any, name: str, linears: batched.Linears | None = None
    ) -> None:
        """``linears``: where batched decode steps run the linear layers (the model's own float32
        modules when None; ``qlinear.QuantDecode`` for a model converted from GGUF blocks)."""
        cfg = model.config.get_text_config()
        if getattr(model.config, "_attn_implementation", None) == "sdpa" and model.device.type == "cpu":
            model.set_attn_implementation(attention.NAME)  # cut-invariant prefill, grouped heads uncopied
        self.model = model.eval()
        self._lean = batched.supports(model)  # decode steps batched across sequences
        self.linears = linears
        self.tokenizer = tokenizer
        # image chunk keys by (content key, grid, pixel shape, tenant salt); see chunk_key
        self._image_keys: OrderedDict[tuple[Any, ...], str] = OrderedDict()
        self.base = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        for module in [*self.base.modules(), self.lm_head]:
            if type(module) is torch.nn.Linear:
                floor_rows(module)
        mla = getattr(cfg, "kv_lora_rank", None) is not None
        family: Family = "mla" if mla else "gqa"
        heads = cfg.num_attention_heads
        kv_heads = 1 if mla else (getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = (
            cfg.qk_rope_head_dim if mla else (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        )
        v_dims = (1, cfg.kv_lora_rank) if mla else (kv_heads, getattr(cfg, "v_head_dim", None) or head_dim)
        self._kv_dims = ((kv_heads, head_dim), v_dims)
        self.spec = self._rope_spec(cfg)
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        # frequencies that depend on the sequence's length make attention depend on absolute
        # positions: such a model's window cannot be shifted as a whole
        self.shift_invariant = rope_type not in ("dynamic", "longrope")
        self.info = ModelInfo(
            name=name,
            architecture=cfg.model_type,
            family=family,
            n_layers=cfg.num_hidden_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=next(model.parameters()).dtype,
            fingerprint=model_fingerprint(model, name),
        )
        eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        self._eos = frozenset(int(i) for i in ids if i is not None)

    def _rope_spec(self, text_config: Any) -> RopeSpec:
        return rope_spec_from_module(self.base.rotary_emb, text_config.model_type)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def arena_dims(self) -> ArenaDims:
        """The shapes of this model's KV in a window's arena (ChunkKV layout)."""
        return ArenaDims(self.info.n_layers, self._kv_dims[0], self._kv_dims[1], self.info.dtype, self.device)

    def chunk_positions(self, chunk: ChunkInput) -> tuple[torch.Tensor, int]:
        if isinstance(chunk, ImageInput):
            raise TypeError(f"{self.info.architecture} is a text-only model: it cannot take an image chunk")
        return torch.arange(chunk.n_tokens, dtype=torch.int64), chunk.n_tokens

    def empty_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _to_slots(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ChunkKV (k, v) of one layer -> the HF cache's (key slot, value slot)."""
        return (v, k) if self.family == "mla" else (k, v)

    def new_cache(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | KVArena) -> DynamicCache:
        if isinstance(kv, KVArena):
            return self._cache_on(kv)
        if not kv:
            return self.empty_cache()
        # k, v: [L, H, T_i, D] per chunk -> [L, H, sum T_i, D], one copy (none for one pair)
        ks = torch.cat([k for k, _ in kv], dim=2) if len(kv) > 1 else kv[0][0]
        vs = torch.cat([v for _, v in kv], dim=2) if len(kv) > 1 else kv[0][1]
        if ks.shape[0] != self.info.n_layers or vs.shape[0] != self.info.n_layers:
            raise ValueError(f"the KV has {ks.shape[0]} layers, the model {self.info.n_layers}")
        cache = self.empty_cache()
        for layer, (kl, vl) in enumerate(zip(ks, vs, strict=True)):
            key, value = self._to_slots(kl[None], vl[None])
            target = cache.layers[layer]
            target.lazy_initialization(key, value)  # type: ignore[union-attr]
            target.keys, target.values = key, value  # type: ignore[union-attr]
        return cache

    def _cache_on(self, arena: KVArena) -> DynamicCache:
        if arena.n_layers != self.info.n_layers:
            raise ValueError(f"the arena has {arena.n_layers} layers, the model {self.info.n_layers}")
        cache = self.empty_cache()
        swap = self.family == "mla"
        cache.layers[: self.info.n_layers] = [ArenaLayer(arena, i, swap) for i in range(self.info.n_layers)]
        return cache

    def append_placed(self, cache: ModelCache, k: torch.Tensor, v: torch.Tensor) -> None:
        for layer, (kl, vl) in enumerate(zip(k, v, strict=True)):
            key, value = self._to_slots(kl[None], vl[None])
            hf_layers(cache)[layer].update(key, value)

    def kv_tail(self, cache: ModelCache, chunk: ChunkInput, start: int) -> ChunkKV:
        """The KV of ``chunk``, the last tokens in ``cache``, placed at ``start`` (pre-RoPE)."""
        rel, extent = self.chunk_positions(chunk)
        return self._extract(cache, chunk.n_tokens, (rel + start).to(self.device), rel, extent)

    def cache_length(self, cache: ModelCache) -> int:
        return int(cache.get_seq_length())

    @property
    def attention(self) -> str:
        return str(getattr(self.model.config, "_attn_implementation", None) or "eager")

    @property
    def quantised_decode(self) -> bool:
        return self._lean and self.linears is not None and qlinear.int8_products()

    @property
    def cut_invariant(self) -> bool:
        """The blocked attention (``attention.py``), no routed experts and no sliding windows: a
        mixture of experts runs each expert's product on the tokens routed to it, so a token's
        sums depend on which other tokens share its pass; a layer with a sliding window goes to
        SDPA whole, whose tiles depend on the pass."""
        cfg = self.model.config.get_text_config()
        experts = any(
            getattr(cfg, name, None) for name in ("n_routed_experts", "num_experts", "num_local_experts")
        )
        windows = any(getattr(m, "sliding_window", None) for m in self.model.modules())
        return self.attention == attention.NAME and not experts and not windows

    def chunk_key(self, chunk: ChunkInput, tenant_salt: str = "") -> str:
        """Content key of a chunk under this model's namespace (and a tenant's salt).

        An image's key is remembered by its input's ``content_key`` (which covers its pixels and
        preprocessing, and which the vision feature cache is keyed by too), so an image placed
        again is not hashed again."""
        if isinstance(chunk, ImageInput):
            memo = self._image_keys
            at = (chunk.content_key, chunk.grid_thw, tuple(chunk.pixel_values.shape), tenant_salt)
            key = memo.get(at)
            if key is None:
                key = str(
                    image_key(
                        self.namespace(tenant_salt),
                        chunk.pixel_values,
                        "RGB",
                        {"grid_thw": chunk.grid_thw, "image_key": chunk.content_key},
                    )
                )
                memo[at] = key
                if len(memo) > _IMAGE_KEYS_KEPT:
                    memo.popitem(last=False)
            return key
        return str(token_key(self.namespace(tenant_salt), chunk.ids))

    def _extract(
        self,
        cache: ModelCache,
        n_new: int,
        positions: torch.Tensor,
        rel: torch.Tensor,
        extent: int,
        after: int = 0,
        placed_at: int | None = None,
    ) -> ChunkKV:
        """The KV of the ``n_new`` tokens that precede the cache's last ``after`` tokens; keys
        un-rotated, or kept as rotated when ``placed_at`` (their start) is given."""
        keys, values = [], []
        for layer in hf_layers(cache)[: self.info.n_layers]:
            end = layer.keys.shape[2] - after
            key, value = layer.keys[0, :, end - n_new : end], layer.values[0, :, end - n_new : end]
            k, v = self._to_slots(key, value)  # the swap is its own inverse
            keys.append(k)
            values.append(v)
        k_rot = torch.stack(keys)  # stack copies: the KV no longer aliases the cache
        return ChunkKV(
            k=k_rot if placed_at is not None else unrotate(k_rot, positions, self.spec),
            v=torch.stack(values),
            positions=rel,
            extent=extent,
            family=self.family,
            placed_at=placed_at,
        )

    def _position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Absolute positions ``[T]`` as the model's ``position_ids`` argument."""
        return positions.to(self.device)[None]

    @torch.inference_mode()
    def embed(self, chunk: ChunkInput) -> torch.Tensor:
        if not isinstance(chunk, TextInput):
            raise TypeError(f"{self.info.architecture} is a text-only model: it cannot take an image chunk")
        return self.model.get_input_embeddings()(chunk.ids.to(self.device))

    def use_prefill_products(self, products: str) -> None:
        """Run a prefill pass's linear layers in ``products`` ("float32" or "bfloat16"): the
        activations and a copy of each weight in that dtype, summed in float32 by the CPU's
        bfloat16 GEMM and rounded to bfloat16 on the way out (torch's CPU product returns its
        inputs' dtype), then widened back to float32. The LM head keeps float32 products, so the
        logits an answer is chosen from are not rounded to bfloat16's 8-bit mantissa. Prefill is
        bound by its multiply-adds, and this CPU's bfloat16 dot products run about twice as many
        a second; decode steps, bound by reading the weights, keep their products (float32 or the
        GGUF blocks). A bfloat16 GEMM's row does not depend on the other rows of the product
        (``tests/test_prefill_products.py``), so a prefill cut anywhere still writes one pass's
        KV and exact reuse still equals the full prefill, bit for bit, under these numerics; the
        answers are those of other numerics than float32's. KV and activations stay float32;
        the products (and the CPU's bfloat16 instructions, which pick the GEMM's kernel) are part
        of every cache key's numerics (``base.namespace``)."""
        if products not in PREFILL_PRODUCTS:
            raise ValueError(
                f"prefill products must be one of {', '.join(PREFILL_PRODUCTS)}, got {products!r}"
            )
        if products != "float32" and isinstance(self, VisionAdapter):
            raise ValueError(
                f"{products} prefill products are for text decoders, not {self.info.architecture}"
            )
        if products != "float32" and self.info.dtype != torch.float32:
            raise ValueError(f"{products} prefill products need float32 weights, not {self.info.dtype}")
        narrow = None if products == "float32" else getattr(torch, products)
        for module in self.base.modules():  # not the head: the logits stay float32 products
            if type(module) is torch.nn.Linear:
                weight = None if narrow is None else module.weight.detach().to(narrow)
                setattr(module, PREFILL_WEIGHT, weight)
        self.prefill_products = products

    def _forward_kwargs(self, chunks: Sequence[ChunkInput]) -> dict[str, Any]:
        """Extra arguments of the decoder's forward over ``chunks`` (Qwen3-VL: DeepStack)."""
        return {}

    def _run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: ModelCache,
        last_only: bool = False,
        chunks: Sequence[ChunkInput] = (),
        pause: bool = True,
        prefill: bool = True,
    ) -> torch.Tensor:
        """Logits ``[T, vocab]`` of ``embeds [1, T, hidden]`` run at ``positions`` on ``cache``;
        then, under a scheduler, a pause where other requests' steps may run (``pause``). A
        ``prefill`` pass runs its products on at least ``PASS_MIN_ROWS`` rows."""
        _pass.min_rows = PASS_MIN_ROWS if prefill else 0
        _pass.narrow = prefill
        attention.set_prefill(prefill)
        try:
            out = self.base(
                inputs_embeds=embeds,
                position_ids=self._position_ids(positions),
                cache=cache,
                use_cache=True,
                **self._forward_kwargs(chunks),
            )
            hidden = out.last_hidden_state[:, -1:] if last_only else out.last_hidden_state
            logits = self.lm_head(hidden)[0].float()
        finally:
            _pass.min_rows = 0
            _pass.narrow = False
            attention.set_prefill(False)
        if pause:
            batched.pause()
        return logits

    @torch.inference_mode()
    def next_logits(self, chunk: ChunkInput, cache: ModelCache, start: int) -> torch.Tensor:
        if chunk.n_tokens == 0:
            raise ValueError("cannot run an empty chunk")
        rel, _ = self.chunk_positions(chunk)
        positions = (rel + start).to(self.device)
        return self._run(self.embed(chunk)[None], positions, cache, last_only=True, chunks=[chunk])[-1]

    @torch.inference_mode()
    def prefill(
        self, chunk: ChunkInput, cache: ModelCache, start: int, placed: bool = False, last_only: bool = False
    ) -> Prefill:
        if chunk.n_tokens == 0:
            raise ValueError("cannot prefill an empty chunk")
        rel, extent = self.chunk_positions(chunk)
        positions = (rel + start).to(self.device)
        logits = self._run(self.embed(chunk)[None], positions, cache, last_only=last_only, chunks=[chunk])
        kv = self._extract(cache, chunk.n_tokens, positions, rel, extent, placed_at=start if placed else None)
        return Prefill(logits, kv, cache)

    def _prepare(self, chunks: Sequence[ChunkInput]) -> None:
        """Work a batch of chunks needs before its forward pass (vision encoders: see qwen_vl)."""

    @torch.inference_mode()
    def prefill_many(self, chunks: Sequence[ChunkInput], cache: ModelCache, start: int) -> list[ChunkKV]:
        """All ``chunks`` in one forward pass (logits of the last token only); each chunk's KV
        taken out of the grown cache and un-rotated with its own positions."""
        return self._prefill_many(chunks, None, cache, start)[0] if chunks else []

    @torch.inference_mode()
    def prefill_and_ask(
        self, chunks: Sequence[ChunkInput], prompt: ChunkInput, cache: ModelCache, start: int
    ) -> tuple[list[ChunkKV], torch.Tensor]:
        """The chunks and the prompt in one forward pass."""
        return self._prefill_many(chunks, prompt, cache, start)

    def _prefill_many(
        self, chunks: Sequence[ChunkInput], prompt: ChunkInput | None, cache: ModelCache, start: int
    ) -> tuple[list[ChunkKV], torch.Tensor]:
        """``chunks`` then ``prompt`` (if any) in one pass: the chunks' KV, the last logits."""
        run = [*chunks, prompt] if prompt is not None else list(chunks)
        if any(c.n_tokens == 0 for c in run):
            raise ValueError("cannot prefill an empty chunk")
        self._prepare(run)
        embeds, positions, placed = [], [], []
        at = start
        for chunk in run:
            rel, extent = self.chunk_positions(chunk)
            embeds.append(self.embed(chunk))
            positions.append(rel + at)
            placed.append((rel, extent, at))
            at += extent
        logits = self._run(
            torch.cat(embeds)[None],
            torch.cat(positions, dim=-1).to(self.device),
            cache,
            last_only=True,
            chunks=run,
        )
        out, after = [], sum(c.n_tokens for c in run)
        for chunk, (rel, extent, at) in zip(chunks, placed[: len(chunks)], strict=True):
            after -= chunk.n_tokens
            kv = self._extract(cache, chunk.n_tokens, (rel + at).to(self.device), rel, extent, after)
            out.append(kv)
        return out, logits[-1]

    @torch.inference_mode()
    def decode_step(self, token: int, cache: ModelCache, position: int) -> torch.Tensor:
        """One token's logits; handed to the thread's scheduler when it batches steps, else run
        alone through the same :meth:`decode_rows` (so the numbers do not depend on which)."""
        stepper = batched.current()
        if stepper is not None:
            return stepper.decode(self, token, cache, position)
        return self.decode_rows([token], [cache], [position])[0]

    @torch.inference_mode()
    def decode_rows(
        self, tokens: Sequence[int], caches: Sequence[ModelCache], positions: Sequence[int]
    ) -> torch.Tensor:
        """Logits ``[N, vocab]`` of one decode step for each of N sequences, each on its own
        cache: one batched pass where ``batched.decode_rows`` runs this model (its rows padded
        so that a row's numbers do not depend on the batch), else the model's forward per row."""
        if self._lean:
            return batched.decode_rows(self.model, tokens, caches, positions, self.linears)
        rows = zip(tokens, caches, positions, strict=True)
        return torch.stack([self._decode_one(t, c, p) for t, c, p in rows])

    def _decode_one(self, token: int, cache: ModelCache, position: int) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(torch.tensor([[token]], device=self.device))
        rel, _ = self.chunk_positions(TextInput(torch.tensor([token])))
        return self._run(embeds, rel.to(self.device) + position, cache, pause=False, prefill=False)[-1]

    @torch.inference_mode()
    def reference_logits(self, chunks: Sequence[ChunkInput], last_only: bool = False) -> torch.Tensor:
        if any(isinstance(c, ImageInput) for c in chunks):
            raise TypeError(f"{self.info.architecture} is a text-only model: it cannot take an image chunk")
        ids = torch.cat([c.ids for c in chunks])[None].to(self.device)
        _pass.narrow = True
        try:
            out = self.model(input_ids=ids, logits_to_keep=1 if last_only else 0)
        finally:
            _pass.narrow = False
        return out.logits[0].float()

    # --- selective recompute ------------------------------------------------------------------

    @property
    def supports_recompute(self) -> bool:
        """Text decoders with GQA/MHA layers (Llama, Qwen2, Qwen3, Mistral)."""
        return self.family == "gqa"

    def layer_kv(self, cache: ModelCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        target = hf_layers(cache)[layer]
        return self._to_slots(target.keys[0], target.values[0])  # the swap is its own inverse

    @torch.inference_mode()
    def run_layers(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        cache: ModelCache,
        layers: range,
        order: torch.Tensor | None = None,
    ) -> LayerRun:
        """The model's own decoder layers on the rows, with an additive mask over sequence
        indices and a stand-in cache (:class:`RowWriter`) that writes the rows' fresh K/V into
        the cache's layer tensors. Needs layers that take ``(hidden, attention_mask=,
        position_embeddings=, cache=)`` and call ``cache.update(k, v, layer_idx)`` with post-RoPE
        ``[1, H_kv, rows, D]`` keys (Llama, Qwen2, Qwen3, Mistral, Qwen2.5-VL's text model)."""
        if self.family != "gqa":
            raise TypeError(f"{self.info.architecture}: selective recompute runs on GQA/MHA decoders only")
        if len(layers) == 0:
            raise ValueError("no layers to run")
        rows = rows.to(self.device)
        x = hidden.to(self.device)[None]  # [1, R, hidden]
        n = self.cache_length(cache)
        # row r sees every token at a sequence index up to its own: [1, 1, R, N], built once
        seq = torch.arange(n, device=self.device) if order is None else order.to(self.device)
        allowed = seq[None, :] <= seq[rows][:, None]
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(x.dtype).min)
        pos = self._position_ids(positions)
        rotary = self.base.rotary_emb(x, position_ids=pos)
        writer = RowWriter(rows)
        _pass.narrow = True  # the products a prefill pass runs (use_prefill_products)
        try:
            for index in layers:
                writer.target = hf_layers(cache)[index]
                x = self.base.layers[index](
                    x,
                    attention_mask=mask[None, None],
                    position_ids=pos,
                    position_embeddings=rotary,
                    cache=writer,
                    use_cache=True,
                )
        finally:
            _pass.narrow = False
        batched.pause()
        return LayerRun(x[0], *writer.fresh)
