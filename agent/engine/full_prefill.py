"""The fastest full prefill the engine runs: a prompt answered with nothing cached, in one pass.

The whole prompt goes through the model in one forward pass per run between image edges (a
text-only prompt: one pass; a model that is not ``cut_invariant``: one pass per prompt cache
segment) into a fresh arena cache sized for the answer; the head runs on the last token only and
no KV is taken out; then it is decoded as a chat completion decodes. It is what reuse is timed
against, and what ``exact`` reuse must equal bit for bit: the attention's fixed blocks
(``agent/adapters/attention.py``) make the prompt cache's prefill, which places what it reuses
and prefills the rest in bounded passes, write the KV this one pass writes.

Not here: the prompt cache's own full prefill (``prompt_cache.py``, ``exact`` mode with nothing
stored), which also takes each segment's KV out to store it; this path looks nothing up and
stores nothing.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from agent.adapters.attention import BLOCK
from agent.adapters.base import ModelAdapter
from agent.engine.generation import Decoded, SamplingParams, decode
from agent.engine.prompt import Prompt, between
from cache.arena import KVArena


class FullPrefill(NamedTuple):
    decoded: Decoded
    logits: torch.Tensor  # the prompt's last logits, [vocab]


def full_prefill(
    adapter: ModelAdapter, prompt: Prompt, params: SamplingParams, cancel: threading.Event | None = None
) -> FullPrefill:
    """``prompt`` prefilled in one forward pass into a fresh cache, then decoded under ``params``."""
    d = adapter.arena_dims
    arena = KVArena(d.n_layers, d.k, d.v, prompt.n_tokens + params.max_tokens, d.dtype, d.device)
    cache = adapter.new_cache(arena)
    # passes begin and end at each image's edges, as the prompt cache's do; a model whose KV
    # depends on how its prefill was cut runs the prompt cache's segments
    cuts = prompt.cuts(BLOCK if not adapter.cut_invariant else None)
    for a, b in between(cuts, 0, len(prompt.units)):
        (inp,) = prompt.inputs_between(a, b)
        logits = adapter.next_logits(inp, cache, int(prompt.pos_off[a]))
    decoded = decode(adapter, logits, cache, int(prompt.pos_off[-1]), params, cancel or threading.Event())
    return FullPrefill(decoded, logits)
