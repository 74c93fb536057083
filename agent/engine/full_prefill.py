"""The fastest full prefill the engine runs: a prompt answered with nothing cached, in one pass.

The whole prompt goes through the model in one forward pass (its images in the same pass) into a
fresh arena cache sized for the answer; the head runs on the last token only and no KV is taken
out; then it is decoded as a chat completion decodes. It is what reuse is timed against.

Not here: the prompt cache's own full prefill (``prompt_cache.py``, ``exact`` mode with nothing
stored), which prefills in segments so that its KV can be stored exactly, and costs more per
token; this path looks nothing up and stores nothing.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from agent.adapters.base import ModelAdapter
from agent.engine.generation import Decoded, SamplingParams, decode
from agent.engine.prompt import Prompt
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
    *before, last = prompt.inputs_between(0, len(prompt.units))
    if before:
        _, logits = adapter.prefill_and_ask(before, last, cache, 0)
    else:
        logits = adapter.next_logits(last, cache, 0)
    decoded = decode(adapter, logits, cache, int(prompt.pos_off[-1]), params, cancel or threading.Event())
    return FullPrefill(decoded, logits)
