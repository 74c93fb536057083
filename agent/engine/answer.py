"""Answering a prompt through the prompt cache: prepare, decode, commit. One path, run by the
server (``runtime.py``), the consistency benchmark and the demo alike.

In ``repair`` mode a prompt that reuses content at moved positions or after other antecedents is
decoded under a guard (``generation.Guard``): repaired KV is close to a full prefill's, not equal,
so the first greedy step whose best two logits lie closer than the guard's margin moves decoding
onto the prompt prepared in ``exact`` mode (its exact prefix still reused bit for bit, and the
segments the repaired attempt had prefilled exactly placed rather than prefilled again; the rest
prefilled), where the tokens so far are replayed and checked. What is committed is then that
exact KV, not the repaired one. A prompt whose every step is a clear call keeps the repaired
KV's speed; one with a close call pays an exact prefill of its reused part, once.

The margin follows how far the repaired pieces still are from the new context (the deviation
the repair left, ``PromptUsage.repair_residual``): ``repair_margin`` at a residual of
``repair_residual_unit``, scaled by the square root of the ratio, up and down
(:func:`guard_margin`). The scale is set on measured errors: the defaults cover twice the
largest first-token logit-gap error that ``kamera bench consistency --repair-margin 0`` measured
on the dev half, per unit of residual (``margin_scale``; ``docs/consistency.md``). A repair
whose residual calls for a margin beyond ``repair_margin_cap`` is not decoded at all: the prompt
cache gives it up once the selection layer has measured it, before any token runs on through the
later layers, and prepares the prompt exact (``prompt_cache.py``). It does the same with a repair
that would not pay: where the chance of a close call at its margin, read from the cache's recent
answers, makes going on cost more than the exact prefill (``close_calls.py``). Every answer
records how close its calls were, for the next.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from agent.engine.generation import Decoded, SamplingParams, TextCallback, decode
from agent.engine.prompt import Prompt
from agent.engine.prompt_cache import Prepared, PromptCache, PromptUsage, own_exact_prefill
from agent.grammar import Constraint
from agent.modes import ReuseMode, guard_margin


class Answer(NamedTuple):
    decoded: Decoded
    usage: PromptUsage
    logits: torch.Tensor  # the prompt's last logits as first decoded (repaired KV, if any)


class _ToExact:
    """The guard of one repaired prompt: builds its exact cache when first asked."""

    def __init__(self, pc: PromptCache, prompt: Prompt, tenant_salt: str, margin: float) -> None:
        self.pc, self.prompt, self.tenant_salt, self.margin = pc, prompt, tenant_salt, margin
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
    """``prompt`` answered in ``mode`` (None: the cache's default); its new KV committed. A
    sampled request with ``top_p`` < 1 is answered in ``exact`` for ``repair``: the guard cannot
    bound a nucleus that moves with the logits (``generation.py``)."""
    if params.temperature > 0.0 and params.top_p < 1.0 and (mode or pc.config.mode) == "repair":
        mode = "exact"
    prepared = pc.prepare(prompt, tenant_salt, mode, params.max_tokens)
    if on_start is not None:
        on_start()
    usage = prepared.usage
    guard = None
    cfg = pc.config
    if usage.mode == "repair" and usage.relocated_tokens and cfg.repair_margin > 0:
        margin = guard_margin(
            cfg.repair_margin,
            usage.repair_residual,
            cfg.repair_residual_unit,
            usage.repair_depth,
            pc.depth_unit,
        )
        guard = _ToExact(pc, prompt, tenant_salt, margin)
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
        decoded_at = time.perf_counter()
    finally:
        prepared.cache = None  # the request's own cache is not kept
        if guard is not None and guard.prepared is not None:
            final = guard.prepared
            final.cache = None
        pc.commit(final)
    if decoded.finish_reason != "cancelled":  # what the next repair risks (``close_calls.py``)
        pc.close_calls.add(decoded.gaps, ended=decoded.finish_reason == "stop")
        if decoded.escalated_at is None:
            pc.close_calls.observe_decode(len(decoded.gaps) - 1, decoded_at - decoded.first_token_at)
    if final is not prepared:  # the answer rests on the exact pass: its usage, the attempt noted
        usage = own_exact_prefill(final.usage, usage.prefix_tokens)._replace(
            mode=usage.mode,
            served="fallback",
            abandoned_tokens=usage.relocated_tokens,
            repair_residual=usage.repair_residual,
            repair_depth=usage.repair_depth,
            vision_encoder_calls=usage.vision_encoder_calls + final.usage.vision_encoder_calls,
            lost_entries=usage.lost_entries + final.usage.lost_entries,
        )
    return Answer(decoded, usage, prepared.logits)
