"""Small helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error measure every exactness test reports."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@torch.inference_mode()
def full_prefill(adapter: Any, ids: Sequence[int], block_tokens: int = 128) -> tuple[Any, torch.Tensor, int]:
    """A text prompt prefilled from nothing, straight through the model adapter: segments cut at
    every multiple of ``block_tokens`` (the passes a full prefill of the prompt cache runs,
    ``docs/consistency.md``), each attending to a fresh cache holding the segments before it, the
    head run on the last token only. No store, no index, no window: the reference reused KV must
    equal bit for bit where a mode promises exactness. Returns the cache, the last logits and the
    next token's position."""
    if not ids:
        raise ValueError("empty prompt")
    cache, logits = adapter.empty_cache(), None
    for a in range(0, len(ids), block_tokens):
        b = min(a + block_tokens, len(ids))
        out = adapter.prefill(adapter.text(ids[a:b]), cache, a, placed=True, last_only=b == len(ids))
        logits = out.logits[-1]
    assert logits is not None
    return cache, logits, len(ids)


@torch.inference_mode()
def greedy(
    adapter: Any, logits: torch.Tensor, cache: Any, position: int, max_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding after a prompt whose last logits are ``logits`` (the next token at
    ``position`` on ``cache``, which grows), as a completion decodes: the tokens (the end token
    left out) and the logits each choice was made from (the end token's included)."""
    tokens: list[int] = []
    steps = [logits]
    while True:
        token = int(steps[-1].argmax())
        if token in adapter.eos_ids:
            return tokens, steps
        tokens.append(token)
        if len(tokens) == max_tokens:
            return tokens, steps
        steps.append(adapter.decode_step(token, cache, position))
        position += 1
