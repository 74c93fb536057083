"""Answering a prompt through the prompt cache: prepare, decode, commit. One path, run by the
server (``runtime.py``), the consistency benchmark and the demo alike.

In ``repair`` mode a prompt that reuses content at moved positions or after other antecedents is
decoded under a guard (``generation.Guard``): repaired KV is close to a full prefill's, not equal,
so the first greedy step whose best two logits lie closer than ``repair_margin`` moves decoding
onto the prompt prepared in ``exact`` mode (its exact prefix still reused bit for bit, the rest
prefilled), where the tokens so far are replayed and checked. What is committed is then that
exact KV, not the repaired one. A prompt whose every step is a clear call keeps the repaired
KV's speed; one with a close call pays an exact prefill of its reused part, once. A prompt whose
reused pieces are still far from the new context after repair (the deviation its selection left,
``PromptUsage.repair_residual``, above ``repair_max_residual``: pieces that bind to new or
reordered neighbours) is answered on the exact KV from its first token: a guard on margins alone
cannot catch an error that large.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from agent.grammar import Constraint
from agent.server.generation import Decoded, SamplingParams, TextCallback, decode
from agent.server.prompt import Prompt
from agent.server.prompt_cache import Prepared, PromptCache, PromptUsage, ReuseMode


class Answer(NamedTuple):
    decoded: Decoded
    usage: PromptUsage
    logits: torch.Tensor  # the prompt's last logits as first decoded (repaired KV, if any)


class _ToExact:
    """The guard of one repaired prompt: builds its exact cache when first asked. A prompt still
    far from its context after repair (``repair_max_residual``) gets an infinite margin: its first
    step already moves to the exact KV."""

    def __init__(self, pc: PromptCache, prompt: Prompt, tenant_salt: str, risky: bool) -> None:
        self.pc, self.prompt, self.tenant_salt = pc, prompt, tenant_salt
        self.margin = float("inf") if risky else pc.config.repair_margin
        self.prepared: Prepared | None = None

    def exact(self) -> tuple[Any, torch.Tensor, int]:
        self.prepared = self.pc.prepare(self.prompt, self.tenant_salt, "exact")
        return self.prepared.cache, self.prepared.logits, self.prepared.position


def answer(
    pc: PromptCache,
    prompt: Prompt,
    tenant_salt: str,
    mode: ReuseMode | None,
    params: SamplingParams,
    cancel: threading.Event | None = None,
    on_text: TextCallback | None = None,
    constraint: Constraint | None = None,
    on_start: Callable[[], None] | None = None,
) -> Answer:
    """``prompt`` answered in ``mode`` (None: the cache's default); its new KV committed."""
    prepared = pc.prepare(prompt, tenant_salt, mode)
    if on_start is not None:
        on_start()
    usage = prepared.usage
    guard = None
    risky = usage.repair_residual > pc.config.repair_max_residual
    if usage.mode == "repair" and usage.relocated_tokens and (pc.config.repair_margin > 0 or risky):
        guard = _ToExact(pc, prompt, tenant_salt, risky)
    final = prepared
    try:
        decoded = decode(
            pc.adapter,
            prepared.logits,
            prepared.cache,
            prepared.position,
            params,
            cancel or threading.Event(),
            on_text,
            constraint,
            guard,
        )
    finally:
        prepared.cache = None  # the request's own cache is not kept
        if guard is not None and guard.prepared is not None:
            final = guard.prepared
            final.cache = None
        pc.commit(final)
    if final is not prepared:
        usage = usage._replace(fallback_tokens=final.usage.prefilled_tokens)
    return Answer(decoded, usage, prepared.logits)
