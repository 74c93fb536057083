"""Decode-step linear layers that read a GGUF model's quantised blocks instead of its float32 weights.

A model converted from a GGUF file (the embedded SmolLM2, ``loading.py``) holds float32 weights
that are exactly the dequantised Q4_1 / Q8_0 blocks of the file. A decode step reads every weight
once for a few rows, so reading the blocks (``cache/qmatmul.py``: 20 bytes per 32 Q4_1 weights
against 128) is several times faster, and gives the same products up to the order of float32
sums. Every tensor's blocks are checked once at load to dequantise bit for bit to the float32
weight the model holds (rows mapped through llama.cpp's permutation of attn_q / attn_k where the
conversion undid it); a tensor that does not match stays on its float32 weight, logged.

The blocks are copied once from the GGUF file into ``gguf-blocks.safetensors`` beside the
converted checkpoint (reading a GGUF's metadata takes seconds; this file loads at once), rows in
the file's order, and checked again at every load.

Linears that read the same input run as one product: q, k and v; gate and up.

Where the CPU has AVX-512 VNNI the products take the activations quantised to int8 in blocks of
32 and sum them with the blocks' integer codes (``cache/qdot.py``), as llama.cpp's CPU products
do: at a few rows these are bound by float32 multiply-adds, and the integer products do four per
lane and instruction. ``KAMERA_DECODE_PRODUCTS=float32`` keeps the float32 block products
(``INT8_PRODUCTS``). Either way a row's numbers do not depend on the other rows of the step.

Not here: prefill (float32 products in torch: many rows, bound by compute), the kernels
(``cache/qmatmul.py``, ``cache/qdot.py``), which sequences share a step (``batched.py``).
``KAMERA_QUANT_DECODE=0`` turns this off.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cache import qdot, qmatmul
from cache.qmatmul import BLOCK, BLOCK_BYTES, QWeight

log = logging.getLogger(__name__)

ENV = "KAMERA_QUANT_DECODE"
PRODUCTS_ENV = "KAMERA_DECODE_PRODUCTS"
DECODE_PRODUCTS = ("int8", "float32")  # activations quantised to int8 where the CPU has VNNI, or not
BLOCKS_FILE = "gguf-blocks.safetensors"
HEAD_TENSORS = ("output.weight", "token_embd.weight")  # an untied head, else the tied embedding


def enabled() -> bool:
    """Whether decode steps may use the blocks (``KAMERA_QUANT_DECODE=0`` says no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _products_from_env() -> str:
    value = os.environ.get(PRODUCTS_ENV, "int8").strip().lower()
    if value not in DECODE_PRODUCTS:
        raise ValueError(f"{PRODUCTS_ENV} must be one of {', '.join(DECODE_PRODUCTS)}, got {value!r}")
    return value


# Whether decode products quantise their activations to int8 (``KAMERA_DECODE_PRODUCTS``); read at
# every call, so a benchmark can run both in one process. Only where the integer kernel runs its
# vector loop: its plain loop is slower than the float32 block products.
INT8_PRODUCTS = _products_from_env() == "int8"


def int8_products() -> bool:
    """Whether a decode step's block products run on int8 activations here and now."""
    return INT8_PRODUCTS and qdot.vectorised()


class SharedInput:
    """Linears that read one input ``[rows, k]``: those with checked blocks as one quantised
    product (row-independent), the others through their own float32 module."""

    def __init__(self, modules: Sequence[nn.Linear], blocks: Sequence[QWeight | None]) -> None:
        kept = [b for b in blocks if b is not None]
        self.weight = _stack(kept) if kept else None
        self._packed: qdot.QPacked | None = None  # the weight for the integer kernel, made once
        self.parts: list[tuple[nn.Linear, int, int, bool]] = []  # module, out slice, on the kernel
        at = 0
        for module, b in zip(modules, blocks, strict=True):
            if b is None:
                self.parts.append((module, 0, 0, False))
            else:
                self.parts.append((module, at, at + b.n_out, True))
                at += b.n_out
        self.complete = len(kept) == len(modules)

    def packed(self) -> qdot.QPacked | None:
        if self._packed is None and self.weight is not None:
            self._packed = qdot.pack(self.weight)
        return self._packed

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.weight is None:
            y = None
        elif int8_products():
            y = qdot.matmul(x, self.packed())
        else:
            y = qmatmul.matmul(x, self.weight)
        out = []
        for module, lo, hi, quant in self.parts:
            if not quant or y is None:
                out.append(module(x))
                continue
            part = y[:, lo:hi]
            out.append(part if module.bias is None else part + module.bias)
        return out


def _stack(weights: Sequence[QWeight]) -> QWeight:
    if len({(w.kind, w.k) for w in weights}) != 1:
        raise ValueError("stacked weights need one block type and one input size")
    blocks = weights[0].blocks if len(weights) == 1 else torch.cat([w.blocks for w in weights])
    return QWeight(blocks.contiguous(), weights[0].kind, sum(w.n_out for w in weights), weights[0].k)


@dataclass(frozen=True)
class QuantLayer:
    qkv: SharedInput
    o: SharedInput
    gate_up: SharedInput
    down: SharedInput


@dataclass(frozen=True)
class QuantDecode:
    """Every decoder layer's linears and the LM head of one model, for ``batched.decode_rows``."""

    layers: tuple[QuantLayer, ...]
    head: SharedInput

    @property
    def row_invariant(self) -> bool:
        """Every product of a step runs on the kernel: a row's numbers do not depend on the
        number of rows, so steps need no padding rows."""
        each = (p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return self.head.complete and all(p.complete for p in each)

    def qkv(self, i: int, x: torch.Tensor) -> list[torch.Tensor]:
        return self.layers[i].qkv(x)

    def o(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[i].o(x)[0]

    def mlp(self, i: int, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.layers[i].gate_up(x)
        return self.layers[i].down(mlp.act_fn(gate) * up)[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)[0]

    def pack(self) -> None:
        """Every product's weight packed for the integer kernel (``cache/qdot.py``)."""
        for layer in self.layers:
            for shared in (layer.qkv, layer.o, layer.gate_up, layer.down):
                shared.packed()
        self.head.packed()


def read_gguf_blocks(gguf: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The Q4_1 / Q8_0 tensors of a GGUF file as uint8 ``[rows, row bytes]`` by tensor name, and
    their block type ids (as strings, the safetensors metadata format)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    tensors, kinds = {}, {}
    for t in reader.tensors:
        kind = int(t.tensor_type)
        if kind in BLOCK_BYTES:
            tensors[t.name] = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
            kinds[t.name] = str(kind)
    return tensors, kinds


def load_blocks(folder: Path, gguf: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The blocks from ``folder/BLOCKS_FILE``, written there from ``gguf`` first if missing
    (atomically: another process reads a whole file or none)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / BLOCKS_FILE
    if not path.is_file():
        tensors, kinds = read_gguf_blocks(gguf)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=".blocks-", suffix=".safetensors", dir=folder)
            os.close(fd)
            save_file(tensors, tmp, metadata=kinds)
            os.chmod(tmp, 0o644)  # readable like the checkpoint beside it
            os.replace(tmp, path)
        except OSError as exc:  # a read-only folder: read the GGUF file again next time
            log.warning("could not keep the GGUF blocks in %s: %s", path, exc)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        return tensors, kinds
    with safe_open(str(path), framework="pt") as f:
        kinds = dict(f.metadata() or {})
        names = list(f.keys())
        return {name: f.get_tensor(name) for name in names}, kinds


def dequantize(blocks: torch.Tensor, kind: int, k: int) -> torch.Tensor:
    """Float32 weights ``[rows, k]`` of uint8 blocks ``[rows, k // 32 * bytes]``, as gguf-py."""
    b = blocks.view(blocks.shape[0], k // BLOCK, BLOCK_BYTES[kind])
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if kind == qmatmul.Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
        return (d * q + m).view(blocks.shape[0], k)
    return (b[..., 2:].contiguous().view(torch.int8).float() * d).view(blocks.shape[0], k)


def llama_row_order(n_out: int, n_head: int) -> torch.Tensor:
    """Which GGUF row holds each HF row of attn_q / attn_k: llama.cpp's converter permutes rows
    within each head for its rotation layout, and transformers reverses it on load (its
    ``_reverse_permute_weights``), applied here to row indices."""
    half = n_out // n_head // 2
    return torch.arange(n_out).view(n_head, half, 2).transpose(1, 2).reshape(n_out)


def match(
    module: nn.Linear, name: str, blocks: dict[str, torch.Tensor], kinds: dict[str, str], heads: int = 0
) -> QWeight | None:
    """The blocks of tensor ``name`` ordered as ``module.weight``'s rows, when they dequantise to
    it bit for bit (as stored, or through llama.cpp's row permutation for ``heads`` heads when
    given); else None, logged."""
    weight = module.weight.detach()
    n_out, k = weight.shape
    found, kind = blocks.get(name), kinds.get(name, "")
    why = "no Q4_1 / Q8_0 tensor of that name in the GGUF file"
    if found is not None and kind.isdigit() and int(kind) in BLOCK_BYTES:
        kind_id = int(kind)
        if weight.dtype != torch.float32 or k % BLOCK:
            why = f"weights {weight.dtype} {tuple(weight.shape)} are not float32 in whole blocks"
        elif tuple(found.shape) != (n_out, k // BLOCK * BLOCK_BYTES[kind_id]) or found.dtype != torch.uint8:
            why = f"blocks {tuple(found.shape)} do not fit weights {tuple(weight.shape)}"
        else:
            orders = [None] if heads <= 0 or n_out % (2 * heads) else [None, llama_row_order(n_out, heads)]
            for order in orders:
                rows = found if order is None else found[order]
                if torch.equal(dequantize(rows, kind_id, k), weight):
                    return QWeight(rows.contiguous(), kind_id, n_out, k)
            why = "its blocks do not dequantise to the model's weights"
    log.warning("decode keeps float32 weights for %s: %s", name, why)
    return None


def build(model: Any, blocks: dict[str, torch.Tensor], kinds: dict[str, str]) -> QuantDecode:
    """The quantised decode linears of a Llama-shaped transformers model from GGUF blocks by
    tensor name (``blk.{i}.attn_q.weight``...); every tensor checked, see :func:`match`."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    layers = []
    for i, layer in enumerate(model.get_decoder().layers[: cfg.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp

        def ours(module: nn.Linear, tensor: str, n_head: int = 0, i: int = i) -> QWeight | None:
            return match(module, f"blk.{i}.{tensor}.weight", blocks, kinds, n_head)

        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up = (mlp.gate_proj, mlp.up_proj)
        layers.append(
            QuantLayer(
                qkv=SharedInput(
                    qkv,
                    [ours(qkv[0], "attn_q", heads), ours(qkv[1], "attn_k", kv_heads), ours(qkv[2], "attn_v")],
                ),
                o=SharedInput([attn.o_proj], [ours(attn.o_proj, "attn_output")]),
                gate_up=SharedInput(gate_up, [ours(gate_up[0], "ffn_gate"), ours(gate_up[1], "ffn_up")]),
                down=SharedInput([mlp.down_proj], [ours(mlp.down_proj, "ffn_down")]),
            )
        )
    head = model.get_output_embeddings()
    name = next((n for n in HEAD_TENSORS if n in blocks), HEAD_TENSORS[0])
    quant = QuantDecode(tuple(layers), SharedInput([head], [match(head, name, blocks, kinds)]))
    if int8_products():
        quant.pack()  # at load, not in a request's first step
    return quant


def attach(model: Any, folder: Path, gguf: Path) -> QuantDecode | None:
    """The quantised decode linears of ``model`` (converted from ``gguf`` into ``folder``), or
    None when turned off, when the kernel cannot be built here, or for a model whose layers
    ``batched.decode_rows`` does not run (all logged)."""
    from agent.adapters import batched

    if not enabled():
        return None
    if not batched.supports(model) or qmatmul.library() is None:
        return None
    try:
        blocks, kinds = load_blocks(folder, gguf)
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("decode keeps float32 weights: reading the blocks of %s failed: %r", gguf, exc)
        return None
    return build(model, blocks, kinds)
