"""``kamera bench consistency``: does reuse change the answer? Agent traffic replayed through
the prompt cache that ``kamera serve`` runs, per context policy and reuse mode.

Each request of a session (real agent trajectories, ``bench/traces_data.py``: tau-bench airline
by default, dev half) is rewritten by a context policy (append, masked observations, a window
of turns, a system prompt whose clock changes, reranked observations), rendered with the
model's chat template (``agent.engine.chat.render``), prepared by :class:`PromptCache` in one
reuse mode after the session's earlier requests were committed in that same mode, and decoded
greedily (``agent.engine.generation.decode``): exactly what a chat completion does. The
reference is the same request through the same code with nothing to reuse (a cache that never
commits: a full prefill). Per policy and mode:

- ``greedy_agreement``: requests whose generated tokens equal the full prefill's (over the
  requests that reused anything, and over all);
- ``first_token_agreement``; ``kl_mean`` / ``kl_max``: KL(full || cached) of the first token;
- ``shares`` of prompt tokens: ``exact`` (the exact prefix, bit for bit), ``content`` (reused by
  content at a moved position or after other antecedents), ``repair_recomputed`` (of those, the
  tokens repair ran through every layer again), ``cached`` (exact + content), ``recomputed``,
  ``seen_before`` (prompt tokens outside the messages new to the session, none on its first
  request: the most any cache could reuse where new content comes as whole messages; a message
  changed in part, as the clock's system prompt, counts as new, though content reuse takes most
  of it);
- ``ttft_ratio``: full prefill's time to first token over the cached one's, per request with
  hits, measured side by side (median and mean), in the same process and thread count;
  ``e2e_ratio_median``: the same for the end-to-end time (from the call until the answer is
  returned: its last token and the commit a whole completion waits for);
- ``one_pass_ttft_ratio_median`` / ``one_pass_e2e_ratio_median``: the same two ratios with the
  fastest full prefill the engine can run as the reference (:func:`one_pass`: the whole prompt in
  one forward pass into a fresh cache, nothing looked up or stored, then the same greedy decode).
  The full prefill above runs in the prompt cache's 128-token segments, so that its KV can be
  stored exactly, and costs more per token; ``one_pass_mismatches`` counts the requests whose
  one-pass tokens differ from the segmented reference's (its last bits differ);
- ``per_request``: each request's ``served`` (see ``PromptUsage.served``) beside its latencies,
  cached, segmented and one-pass, in replay order, with how it was served (tokens from the exact
  prefix, moved, recomputed by repair, prefilled, prefilled again by an exact pass; the residual
  repair measured) and the smallest gap between the best two logits along the full prefill's
  answer (how close its closest call was);
- ``fallbacks``: requests whose guarded decoding on repaired KV met a close call and moved to
  exact KV (``agent/engine/answer.py``), and the tokens prefilled again for it;
- ``guard_curve`` (with ``--repair-margin 0``: the guard off, decoding stays on repaired KV):
  for each margin, the agreement the guard would give and the share of requests that would fall
  back, read from the margins between the best two logits along each answer. It is how the
  default margin is chosen, on the dev half.

Every mode replays its own history: what a mode stores depends on what it reused. Nothing
here knows the reference when a request is prepared: the figures are the product's.

``--peer llama-server`` replays the same requests, as the same token ids, through llama.cpp's
server on the same GGUF (``bench/peer_llama.py``): its cached answers against its own full
prefill, its cached share and TTFT ratio, as rows beside Kamera's.

Not here: hit rates without a model (``kamera bench traces --tokenizer-only``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from agent.engine.answer import answer
from agent.engine.chat import Message, render
from agent.engine.full_prefill import full_prefill
from agent.engine.generation import Decoded, SamplingParams
from agent.engine.prompt import Prompt
from agent.engine.prompt_cache import SERVED, PromptCache, PromptCacheConfig, build_prompt
from agent.modes import REPAIR_MARGIN, REUSE_MODES, ReuseMode, guard_margin
from agent.tables import make_console
from agent.tables import print_table as draw
from bench.agreement import answer_fields, ttft_fields
from bench.traces_data import load_sessions
from bench.traces_policies import DEFAULT_SEED, get_policy
from bench.traces_tokens import message_body
from cache.numerics import PREFILL_PRODUCTS
from cache.store import StoreConfig, TieredStore

DEFAULT_POLICIES = ("append", "mask-observations-2", "window-3", "dynamic-system", "rerank")
ROLES = ("system", "user", "assistant")


class Outcome(NamedTuple):
    tokens: list[int]
    logits: torch.Tensor  # first token's, [vocab]
    ttft_s: float
    total_s: float  # from the call until the answer is returned (its last token, its commit)
    usage: Any  # PromptUsage; None for the one-pass full prefill, which uses no prompt cache
    margins: list[float]  # per generated token: the gap between its best two logits


class Refs(NamedTuple):
    """A request's two full prefills: the prompt cache's segmented exact path with nothing to
    reuse (the reference answers are checked against), and the one-pass one (:func:`one_pass`)."""

    segmented: Outcome
    one_pass: Outcome
    float32_tokens: list[int] | None = None  # under narrower products: float32 products' answer


class Row(NamedTuple):
    session: str
    step: int
    prompt_tokens: int
    cached: Outcome
    reference: Outcome
    seen_tokens: int = 0  # prompt tokens outside messages new to the session (0 on its first request)
    one_pass: Outcome | None = None  # the one-pass full prefill (None: not run)
    float32_tokens: list[int] | None = None  # Refs.float32_tokens


def seen_tokens(tokenizer: Any, prompt_tokens: int, messages: Sequence[Message], seen: set[Any]) -> int:
    """The prompt tokens of this request outside the messages whose text no earlier request of the
    session held (template tokens included; none on the session's first request): the most any
    cache could reuse where new content comes as whole messages (a message changed in part counts
    as new). ``seen`` takes this request's messages."""
    texts = [(m.role, "".join(p for p in m.parts if isinstance(p, str))) for m in messages]
    first = not seen
    new = sum(
        len(tokenizer(t, add_special_tokens=False)["input_ids"]) for r, t in texts if (r, t) not in seen
    )
    seen.update(texts)
    return 0 if first else max(0, prompt_tokens - new)


def to_messages(request: Sequence[dict[str, Any]]) -> list[Message]:
    """Trace messages as chat messages: tool results shown as user turns (the template has no
    tool role), tool calls as JSON after the content (``message_body``)."""
    return [Message(m.get("role") if m.get("role") in ROLES else "user", (message_body(m),)) for m in request]


def run(pc: PromptCache, prompt: Any, salt: str, mode: ReuseMode, params: SamplingParams) -> Outcome:
    t0 = time.perf_counter()
    out = answer(pc, prompt, salt, mode, params)
    total = time.perf_counter() - t0
    ttft = out.decoded.first_token_at - t0
    return Outcome(out.decoded.tokens, out.logits, ttft, total, out.usage, _margins(out.decoded))


def one_pass(adapter: Any, prompt: Prompt, params: SamplingParams) -> Outcome:
    """The fastest full prefill the engine runs (``agent.engine.full_prefill``: the whole prompt
    in one forward pass into a fresh cache, then decoded greedily as a chat completion decodes),
    timed. No prompt cache: nothing is looked up or stored."""
    t0 = time.perf_counter()
    out = full_prefill(adapter, prompt, params)
    total = time.perf_counter() - t0
    d = out.decoded
    return Outcome(d.tokens, out.logits, d.first_token_at - t0, total, None, _margins(d))


def float32_answer(adapter: Any, prompt: Prompt, params: SamplingParams) -> list[int] | None:
    """Under prefill products narrower than float32, the one-pass full prefill's answer with
    float32 products (untimed): what the narrower products change in the model's own answer.
    None under float32 products."""
    products = adapter.prefill_products
    if products == "float32":
        return None
    adapter.use_prefill_products("float32")
    try:
        return list(full_prefill(adapter, prompt, params).decoded.tokens)
    finally:
        adapter.use_prefill_products(products)


def _margins(decoded: Decoded) -> list[float]:
    return [lp.top[0][1] - lp.top[1][1] for lp in decoded.logprobs if len(lp.top) > 1]


def kl(reference: torch.Tensor, cached: torch.Tensor) -> float:
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(cached.double(), -1)
    return float((p.exp() * (p - q)).sum())


def summarize(rows: Sequence[Row], config: PromptCacheConfig | None = None) -> dict[str, Any]:
    hit = [r for r in rows if r.cached.usage.cached_tokens > 0]
    total = sum(r.prompt_tokens for r in rows) or 1
    u = [r.cached.usage for r in rows]
    exact = sum(x.prefix_tokens for x in u)
    repaired = sum(x.repaired_tokens for x in u)
    content = sum(x.relocated_tokens for x in u)
    kls = [kl(r.reference.logits, r.cached.logits) for r in rows]
    return {
        **answer_fields(rows, hit),
        "kl_mean": round(statistics.fmean(kls), 6) if kls else None,
        "kl_max": round(max(kls), 6) if kls else None,
        "shares": {
            "exact": round(exact / total, 4),
            "content": round(content / total, 4),
            "repair_recomputed": round(repaired / total, 4),
            "cached": round((exact + content) / total, 4),
            "recomputed": round(sum(x.prefilled_tokens for x in u) / total, 4),
            # a ceiling where new content comes as whole messages (see seen_tokens)
            "seen_before": round(sum(r.seen_tokens for r in rows) / total, 4),
        },
        **ttft_fields(hit),
        **latency_fields(rows, hit),
        "lost_entries": sum(x.lost_entries for x in u),
        "fallbacks": {
            "requests": sum(x.fallback_tokens > 0 for x in u),
            "tokens": sum(x.fallback_tokens for x in u),
        },
        # what the guard's margin scales with; per request with content hits (or a repair given
        # up for them), in replay order
        "repair_residuals": [x.repair_residual for x in u if _moved(x) or x.repair_residual],
        # how each request was answered: on exact KV only, on moved KV, on exact KV after a close
        # call (fallback) or for a repair given up; in replay order, and counted
        "served": {k: sum(x.served == k for x in u) for k in SERVED},
        "served_per_request": [x.served for x in u],
        **logit_error_fields(rows, config),
        **float32_fields(rows),
    }


def float32_fields(rows: Sequence[Row]) -> dict[str, Any]:
    """Under narrower prefill products: how many full prefills' answers equal the float32
    products' (``float32_agreement``; a property of the numerics, not of reuse)."""
    checked = [r for r in rows if r.float32_tokens is not None]
    if not checked:
        return {}
    same = sum(list(r.reference.tokens) == r.float32_tokens for r in checked)
    return {"float32_checked": len(checked), "float32_agreement": round(same / len(checked), 4)}


def _median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def latency_fields(rows: Sequence[Row], hit: Sequence[Row]) -> dict[str, Any]:
    """End-to-end and one-pass ratios, medians over the requests with hits (as the TTFT ratio):
    ``e2e_ratio_median`` (segmented full prefill over cached), ``one_pass_ttft_ratio_median`` and
    ``one_pass_e2e_ratio_median`` (one-pass full prefill over cached); ``one_pass_mismatches``:
    requests whose one-pass greedy tokens differ from the segmented reference's; ``per_request``:
    each request's ``served`` beside its latencies (seconds), in replay order."""
    checked = [(r.one_pass, r.reference) for r in rows if r.one_pass is not None]
    timed = [(r.one_pass, r.cached) for r in hit if r.one_pass is not None and r.cached.ttft_s > 0]
    return {
        "e2e_ratio_median": _median(
            [r.reference.total_s / r.cached.total_s for r in hit if r.cached.total_s > 0]
        ),
        "one_pass_ttft_ratio_median": _median([one.ttft_s / cached.ttft_s for one, cached in timed]),
        "one_pass_e2e_ratio_median": _median([one.total_s / cached.total_s for one, cached in timed]),
        "one_pass_checked": len(checked),
        "one_pass_mismatches": sum(one.tokens != ref.tokens for one, ref in checked),
        "per_request": [_request_fields(r) for r in rows],
    }


def _request_fields(r: Row) -> dict[str, Any]:
    def ms(x: float) -> float:
        return round(x, 4)

    u = r.cached.usage
    out = {
        "session": r.session,
        "step": r.step,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached.usage.cached_tokens,
        "served": r.cached.usage.served,
        # how: the exact prefix, content placed (kept or, after a close call, abandoned), the
        # tokens repair recomputed, prefilled, and prefilled again by an exact pass
        "prefix_tokens": u.prefix_tokens,
        "moved_tokens": u.relocated_tokens or u.abandoned_tokens,
        "repaired_tokens": u.repaired_tokens,
        "prefilled_tokens": u.prefilled_tokens,
        "fallback_tokens": u.fallback_tokens,
        "repair_residual": u.repair_residual,
        "repair_depth": None if u.repair_depth is None else round(u.repair_depth, 4),
        # the smallest gap between the best two logits along the full prefill's answer
        "reference_min_margin": round(min(r.reference.margins), 4) if r.reference.margins else None,
        # the full prefill's answer, to set beside another run's (other numerics, another model)
        "reference_tokens": list(r.reference.tokens),
        **({"float32_tokens": r.float32_tokens} if r.float32_tokens is not None else {}),
        "ttft_s": ms(r.cached.ttft_s),
        "total_s": ms(r.cached.total_s),
        "segmented_ttft_s": ms(r.reference.ttft_s),
        "segmented_total_s": ms(r.reference.total_s),
    }
    if r.one_pass is not None:
        out |= {"one_pass_ttft_s": ms(r.one_pass.ttft_s), "one_pass_total_s": ms(r.one_pass.total_s)}
    return out


def _moved(usage: Any) -> bool:
    """Whether the request was first prepared on moved KV (kept, or abandoned for exact KV)."""
    return bool(usage.relocated_tokens or usage.abandoned_tokens)


def gap_error(reference: torch.Tensor, cached: torch.Tensor) -> float:
    """How much the cached logits moved the gap between the reference's best two tokens (what
    flips a greedy choice; positive: the gap widened)."""
    best = torch.topk(reference.double(), 2).indices
    err = cached.double() - reference.double()
    return float(err[best[0]] - err[best[1]])


def logit_error_fields(rows: Sequence[Row], config: PromptCacheConfig | None = None) -> dict[str, Any]:
    """First-token logit errors of the requests whose decoding the guard watches (content reuse in
    repair mode), beside the residual repair left: ``gap_errors`` (see :func:`gap_error`) and
    ``margin_scale`` = the largest ``|gap error| / sqrt(residual)``, the scale a guard margin
    ``c * sqrt(residual)`` needs to cover every one of them (``answer.guard_margin``). Read with
    ``--repair-margin 0``, where nothing falls back and every cached logit is repaired KV's."""
    watched = [r for r in rows if _moved(r.cached.usage) and r.cached.usage.repair_residual > 0]
    gaps = [gap_error(r.reference.logits, r.cached.logits) for r in watched]
    usage = [r.cached.usage for r in watched]
    scales = [abs(g) / math.sqrt(u.repair_residual) for g, u in zip(gaps, usage, strict=True)]
    # the same against the residual scaled by how the recomputed rows' deviation grew with depth
    # (``Repaired.depth``): a predictor is better where the scales it needs spread less
    deep = [
        abs(g) / math.sqrt(u.repair_residual * u.repair_depth)
        for g, u in zip(gaps, usage, strict=True)
        if u.repair_depth is not None
    ]

    def spread(xs: list[float]) -> list[float] | None:
        xs = [x for x in xs if x > 0]
        return [round(min(xs), 3), round(max(xs), 3)] if xs else None

    out: dict[str, Any] = {}
    if config is not None:
        # the largest depth unit under which every measured request's margin (the residual's,
        # scaled by sqrt(depth / unit)) would still be twice its |gap error|: what
        # repair_depth_unit may be set to on this traffic (None: no request bounds it); under the
        # margin set, or the default where the guard was off for the calibration
        margin = config.repair_margin or REPAIR_MARGIN
        bounds = []
        for g, u in zip(gaps, usage, strict=True):
            whole = guard_margin(margin, u.repair_residual, config.repair_residual_unit)
            if g != 0 and u.repair_depth is not None:
                bounds.append(u.repair_depth * (whole / (2 * abs(g))) ** 2)
        out["depth_unit_max"] = round(min(bounds), 3) if bounds else None
    return {
        **out,
        "gap_errors": [round(g, 5) for g in gaps],
        "repair_depths": [None if u.repair_depth is None else round(u.repair_depth, 4) for u in usage],
        "margin_scale": round(max(scales), 2) if scales else None,
        "margin_scale_depth": round(max(deep), 2) if deep else None,
        "scale_spread": {"residual": spread(scales), "residual_x_depth": spread(deep)},
    }


GUARD_MARGINS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


def needed_margin(r: Row) -> float:
    """The margin a guard needed to keep this unguarded answer equal to the full prefill's: 0 where
    it is equal; else just above the smallest gap between the answer's best two logits at or
    before its first token that differs (the guard must meet a close call there to fall back in
    time). What a margin must cover, read over the whole answer, not the first token alone."""
    a, b = r.cached.tokens, r.reference.tokens
    differ = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if differ is None and len(a) != len(b):
        differ = min(len(a), len(b))
    if differ is None:
        return 0.0
    gaps = r.cached.margins[: differ + 1]
    return float(min(gaps)) if gaps else float("inf")


def needed_fields(rows: Sequence[Row]) -> dict[str, Any]:
    """Per request decoded on repaired KV (content reuse in repair mode) with the guard off: the
    margin it needed (:func:`needed_margin`) beside its residual and depth, in replay order, and
    the largest need per sqrt(residual) and per sqrt(residual x depth): the scales a margin rule
    must reach to keep every answer."""
    watched = [r for r in rows if _moved(r.cached.usage) and r.cached.usage.repair_residual > 0]
    needs = [needed_margin(r) for r in watched]

    def scale(depth: bool) -> float | None:
        xs = []
        for need, r in zip(needs, watched, strict=True):
            u = r.cached.usage
            if 0 < need < math.inf and (not depth or u.repair_depth is not None):
                xs.append(need / math.sqrt(u.repair_residual * (u.repair_depth if depth else 1.0)))
        return round(max(xs), 2) if xs else None

    return {
        # None: no step to meet a close call at (an empty answer where the full prefill's was not)
        "needed_margins": [round(x, 5) if math.isfinite(x) else None for x in needs],
        "needed_scale": scale(False),
        "needed_scale_depth": scale(True),
    }


def guard_curve(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """For each margin: the share of requests with hits whose answer a guard at that margin would
    keep equal to the full prefill's (it falls back at or before the first token that differs),
    and the share it would send to exact KV. From unguarded runs (``--repair-margin 0``)."""
    hit = [r for r in rows if r.cached.usage.cached_tokens > 0]
    out = []
    for margin in GUARD_MARGINS:
        same = falls = 0
        for r in hit:
            a, b = r.cached.tokens, r.reference.tokens
            differ = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if differ is None and len(a) != len(b):
                differ = min(len(a), len(b))
            close = None
            if _moved(r.cached.usage):  # only repaired KV is guarded
                close = next((i for i, m in enumerate(r.cached.margins) if m < margin), None)
            falls += close is not None
            same += differ is None or (close is not None and close <= differ)
        n = len(hit) or 1
        out.append({"margin": margin, "agreement": round(same / n, 4), "fallback_share": round(falls / n, 4)})
    return out


def replay(
    adapter: Any,
    sessions: Sequence[Any],
    policy_name: str,
    modes: Sequence[ReuseMode],
    config: PromptCacheConfig,
    params: SamplingParams,
    max_requests: int,
    max_prompt_tokens: int,
    store_bytes: int,
    log: Any = print,
    peer: Any = None,
    seed: int = DEFAULT_SEED,
    concurrency: int = 1,
) -> tuple[dict[str, list[Row]], list[Any]]:
    """Every session's requests through each mode's prompt cache, beside two full prefills of each
    (segmented and one-pass, :class:`Refs`). ``concurrency`` above 1: the sessions of a mode run
    that many at once through the server's scheduler (their decode steps batched, their prefills
    interleaved), each session's requests still one after another; the full prefills run first,
    one at a time."""
    policy = get_policy(policy_name, seed)
    caches = {
        m: PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=store_bytes)), config)
        for m in modes
    }
    reference = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=1 << 20)), config)
    rows: dict[str, list[Row]] = {m: [] for m in modes}
    peer_rows: list[Any] = []
    work: list[tuple[Any, int, Any, Any, int, Refs | None]] = []  # session step pieces prompt seen refs
    for s in sessions:
        seen: set[tuple[str, str]] = set()
        for step, request in enumerate(s.requests[:max_requests]):
            messages = to_messages(policy(request, step))
            pieces = render(adapter.tokenizer, messages)
            prompt = build_prompt(adapter, pieces, reference.image_unit)
            if prompt.n_tokens > max_prompt_tokens:
                continue
            n_seen = seen_tokens(adapter.tokenizer, prompt.n_tokens, messages, seen)
            ref = None
            if modes:
                segmented = run(reference, prompt, f"{s.id}/{step}", "exact", params)
                ref = Refs(
                    segmented, one_pass(adapter, prompt, params), float32_answer(adapter, prompt, params)
                )
                reference.reset()  # never reused: every reference is a full prefill
            work.append((s, step, pieces, prompt, n_seen, ref))
            if concurrency > 1:
                continue
            if ref is not None:  # there are modes to replay
                for m in modes:
                    pc = caches[m]
                    cached = run(pc, build_prompt(adapter, pieces, pc.image_unit), s.id, m, params)
                    _keep(rows[m], policy_name, m, s, step, prompt, cached, ref, n_seen, log)
            if peer is not None:
                got = peer.request(s.id, step, prompt.units.tolist(), params.max_tokens)
                peer_rows.append(got)
                same = got.cached.tokens == got.reference.tokens
                log(
                    f"{policy_name:>20} {'llama':>6} {s.id} step {step:>2} {prompt.n_tokens:>5} tok "
                    f"cached {got.cached.cached_tokens:>5} same {same!s:>5} "
                    f"ttft {got.reference.ttft_s / max(got.cached.ttft_s, 1e-9):5.2f}x"
                )
    if concurrency > 1:
        if peer is not None:
            raise ValueError("--peer replays one request at a time: leave --concurrency at 1")
        for m in modes:
            _replay_at_once(adapter, caches[m], m, work, concurrency, params, rows[m], policy_name, log)
    return rows, peer_rows


def _keep(
    rows: list[Row], policy: str, mode: str, s: Any, step: int, prompt: Any, cached: Outcome, ref: Refs,
    n_seen: int, log: Any,
) -> None:  # fmt: skip
    rows.append(
        Row(s.id, step, prompt.n_tokens, cached, ref.segmented, n_seen, ref.one_pass, ref.float32_tokens)
    )
    log(
        f"{policy:>20} {mode:>6} {s.id} step {step:>2} {prompt.n_tokens:>5} tok "
        f"cached {cached.usage.cached_tokens:>5} {cached.usage.served:>8} "
        f"same {cached.tokens == ref.segmented.tokens!s:>5} "
        f"ttft {ref.segmented.ttft_s / max(cached.ttft_s, 1e-9):5.2f}x "
        f"1-pass ttft {ref.one_pass.ttft_s / max(cached.ttft_s, 1e-9):5.2f}x "
        f"e2e {ref.one_pass.total_s / max(cached.total_s, 1e-9):5.2f}x"
        f" residual {cached.usage.repair_residual:.1e}"
        f" depth {'-' if cached.usage.repair_depth is None else f'{cached.usage.repair_depth:.3g}'}"
        f" repaired {cached.usage.repaired_tokens}/{cached.usage.relocated_tokens}"
    )


def _replay_at_once(
    adapter: Any,
    pc: PromptCache,
    mode: ReuseMode,
    work: Sequence[tuple[Any, int, Any, Any, int, Any]],
    concurrency: int,
    params: SamplingParams,
    rows: list[Row],
    policy: str,
    log: Any,
) -> None:
    """One mode's sessions, ``concurrency`` at a time, as jobs of the server's scheduler."""
    import asyncio
    import functools
    import threading

    from agent.engine.scheduler import ModelWorker

    by_session: dict[str, list[tuple[Any, int, Any, Any, int, Any]]] = {}
    for item in work:
        by_session.setdefault(item[0].id, []).append(item)
    worker = ModelWorker(queue_size=len(by_session), max_running=concurrency)
    done: dict[tuple[str, int], Outcome] = {}

    async def session(items: Sequence[tuple[Any, int, Any, Any, int, Any]]) -> None:
        for s, step, pieces, _, _, _ in items:
            job = functools.partial(run, pc, build_prompt(adapter, pieces, pc.image_unit), s.id, mode, params)
            done[s.id, step] = await worker.run(job, threading.Event())

    async def everyone() -> None:
        await asyncio.gather(*(session(items) for items in by_session.values()))

    try:
        asyncio.run(everyone())
    finally:
        worker.shutdown()
    for s, step, _, prompt, n_seen, ref in work:  # rows in the order of the one-at-a-time replay
        _keep(rows, policy, mode, s, step, prompt, done[s.id, step], ref, n_seen, log)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kamera bench consistency", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--source", default="tau_bench", help="tau_bench, swe_agent, mini_swe_agent or a .jsonl")
    p.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    p.add_argument(
        "--sessions",
        type=int,
        default=2,
        help="sessions replayed (default 2 with --requests 4, about ten minutes on two cores; the "
        "runs in docs/consistency.md that name neither used 4 sessions of 8 requests)",
    )
    p.add_argument("--requests", type=int, default=4, help="requests replayed per session (default 4)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--modes", default=",".join(REUSE_MODES))
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=3000)
    p.add_argument("--block-tokens", type=int, default=PromptCacheConfig.block_tokens)
    p.add_argument("--min-reuse-tokens", type=int, default=PromptCacheConfig.min_reuse_tokens)
    p.add_argument("--repair-ratio", type=float, default=PromptCacheConfig.repair_ratio)
    p.add_argument(
        "--repair-max-ratio",
        type=float,
        default=PromptCacheConfig.repair_max_ratio,
        help="a repair leaving more than the residual unit recomputes more, up to this share",
    )
    p.add_argument(
        "--repair-margin",
        type=float,
        default=PromptCacheConfig.repair_margin,
        help="guard margin on repaired KV (0: no guard, and the guard_curve is reported)",
    )
    p.add_argument(
        "--repair-residual-unit",
        type=float,
        default=PromptCacheConfig.repair_residual_unit,
        help="the deviation left by repair at which the guard's margin is as set (0: always as set)",
    )
    p.add_argument(
        "--repair-margin-cap",
        type=float,
        default=PromptCacheConfig.repair_margin_cap,
        help="a repair calling for a larger margin is given up, the prompt prefilled exact (0: never)",
    )
    p.add_argument(
        "--repair-depth-unit",
        type=float,
        default=PromptCacheConfig.repair_depth_unit,
        help="the depth (how the recomputed tokens' deviation grew past the selection layer) at "
        "which the margin is the residual's; it scales with sqrt(depth / unit) (0: the residual alone)",
    )
    p.add_argument(
        "--repair-must-pay",
        action=argparse.BooleanOptionalAction,
        default=PromptCacheConfig.repair_must_pay,
        help="a repair expected to cost more than the exact prefill (its chance of a close call read "
        "from the mode's earlier answers) is given up (default on)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--prefill-products",
        default="float32",
        choices=PREFILL_PRODUCTS,
        help="the dtype prefill passes multiply in (kamera serve --prefill-products); every "
        "full prefill and cached request runs under it",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="sessions replayed at once through the server's scheduler, decoded as one batch "
        "(default 1: one request at a time); time to first token is then taken under that load",
    )
    p.add_argument("--store-bytes", type=int, default=4 << 30)
    p.add_argument("--peer", choices=["llama-server"], default=None, help="replay through a peer as well")
    p.add_argument("--peer-cache-reuse", type=int, default=256, help="llama-server's --cache-reuse N")
    p.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary (default: built)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="draws the rerank policy's permutations")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from agent.adapters.loading import load_adapter

    if args.concurrency < 1 or (args.concurrency > 1 and args.peer):
        raise SystemExit("--concurrency must be at least 1, and 1 with --peer")

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "none"]
    for m in modes:
        if m not in REUSE_MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(REUSE_MODES)}")
    try:
        sessions = load_sessions(args.source, args.split)[: args.sessions]
    except FileNotFoundError as e:
        raise SystemExit(f"kamera bench consistency: {e}") from None
    if not sessions:
        raise SystemExit(f"no sessions in {args.source} ({args.split}): is ../shared/data there?")
    adapter = load_adapter(args.model, prefill_products=args.prefill_products)
    config = PromptCacheConfig(
        block_tokens=args.block_tokens,
        min_reuse_tokens=args.min_reuse_tokens,
        repair_ratio=args.repair_ratio,
        repair_max_ratio=args.repair_max_ratio,
        repair_margin=args.repair_margin,
        repair_residual_unit=args.repair_residual_unit,
        repair_margin_cap=args.repair_margin_cap,
        repair_depth_unit=args.repair_depth_unit,
        repair_must_pay=args.repair_must_pay,
    )
    params = SamplingParams(max_tokens=args.max_tokens, logprobs=True, top_logprobs=2)
    report: dict[str, Any] = {
        "model": adapter.info.name,
        "source": args.source,
        "split": args.split,
        "sessions": [s.id for s in sessions],
        "requests_per_session": args.requests,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "prefill_products": adapter.prefill_products,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "config": {
            "block_tokens": config.block_tokens,
            "min_reuse_tokens": config.min_reuse_tokens,
            "repair_ratio": config.repair_ratio,
            "repair_max_ratio": config.repair_max_ratio,
            "repair_margin": config.repair_margin,
            "repair_residual_unit": config.repair_residual_unit,
            "repair_margin_cap": config.repair_margin_cap,
            "repair_depth_unit": config.repair_depth_unit,
            "repair_must_pay": config.repair_must_pay,
        },
        "policies": {},
    }
    peer = start_peer(args, adapter, report)
    t0 = time.perf_counter()
    try:
        run_policies(args, adapter, sessions, modes, config, params, peer, report)
    finally:
        if peer is not None:
            peer.close()
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def start_peer(args: argparse.Namespace, adapter: Any, report: dict[str, Any]) -> Any:
    """The llama.cpp pair when ``--peer`` asks for it; a message and None when it can't be had."""
    if args.peer is None:
        return None
    from agent.adapters.loading import SMOLLM2, smollm2_gguf_path
    from bench.peer_llama import Peer, PeerUnavailableError, llama_server_binary

    model = args.model or SMOLLM2
    gguf = Path(model) if str(model).endswith(".gguf") else None
    if model in (SMOLLM2, "smollm2"):
        gguf = smollm2_gguf_path()
    try:
        if gguf is None:
            raise PeerUnavailableError(f"--peer llama-server needs a GGUF model, not {model}")
        binary = args.llama_server or llama_server_binary()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise PeerUnavailableError(f"{binary} is not an executable file")
        log = Path(args.json or "consistency").with_suffix(".llama-server.log")
        peer = Peer(binary, gguf, args.peer_cache_reuse, torch.get_num_threads(), 8192, log)
    except PeerUnavailableError as e:
        print(f"peer llama-server skipped: {e}")
        report["peer"] = {"name": "llama-server", "skipped": str(e)}
        return None
    report["peer"] = {"name": "llama-server", "binary": str(binary), "gguf": gguf.name,
                      "cache_reuse": args.peer_cache_reuse, "threads": torch.get_num_threads()}  # fmt: skip
    return peer


def run_policies(
    args: argparse.Namespace,
    adapter: Any,
    sessions: Sequence[Any],
    modes: Sequence[ReuseMode],
    config: PromptCacheConfig,
    params: SamplingParams,
    peer: Any,
    report: dict[str, Any],
) -> None:
    from bench.peer_llama import summarize_peer

    with torch.inference_mode():
        for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
            rows, peer_rows = replay(
                adapter,
                sessions,
                name,
                modes,
                config,
                params,
                args.requests,
                args.max_prompt_tokens,
                args.store_bytes,
                peer=peer,
                seed=args.seed,
                concurrency=args.concurrency,
            )
            report["policies"][name] = {m: summarize(r, config) for m, r in rows.items()}
            if config.repair_margin == 0 and "repair" in rows:
                report["policies"][name]["repair"]["guard_curve"] = guard_curve(rows["repair"])
                report["policies"][name]["repair"] |= needed_fields(rows["repair"])
            if peer is not None:
                report["policies"][name]["llama-server"] = summarize_peer(peer_rows)


def print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"consistency with a full prefill ({report['source']}, {report['split']})")
    for col in (
        "policy",
        "mode",
        "req (hits)",
        "greedy=",
        "first=",
        "KL mean",
        "cached",
        "exact",
        "content",
        "repair",
        "seen before",
        "TTFT x",
        "1-pass TTFT x",
        "1-pass e2e x",
    ):
        t.add_column(col, justify="right")
    for policy, by_mode in report["policies"].items():
        for mode, r in by_mode.items():
            sh = r["shares"]
            t.add_row(
                policy,
                mode,
                f"{r['requests']} ({r['requests_with_hits']})",
                str(r["greedy_agreement_with_hits"]),
                str(r["first_token_agreement"]),
                str(r["kl_mean"]),
                str(sh["cached"]),
                str(sh["exact"]),  # None on the peer's rows: llama.cpp does not tell the two apart
                str(sh["content"]),
                str(sh["repair_recomputed"]),
                str(sh.get("seen_before")),  # not on the peer's rows
                str(r["ttft_ratio_median"]),
                str(r.get("one_pass_ttft_ratio_median")),  # not on the peer's rows
                str(r.get("one_pass_e2e_ratio_median")),
            )
    draw(make_console(), t)
