"""``kamera bench traces``: content-addressed reuse on real agent traces under context policies.

Replay: every request of every session (tau-bench airline, SWE-agent, mini-swe-agent, or a
``--data`` JSONL) is rendered through the model's chat template (generation prompt included),
rewritten by a context policy, planned against session-local indexes and committed. Per policy
and trace set: the share of prompt tokens an exact-prefix cache reuses, the share content
addressing reuses, the share that lay in some 16-token window seen earlier in the session (the
oracle), the recovered share ``(content - prefix) / (oracle - prefix)``, the p50 time to chunk
and look up one request, and the bytes a content-addressed store holds for the distinct chunks
(SmolLM2's GQA layout, and DeepSeek-V2's MLA layout: latent plus ``k_rope``, against its
expanded per-head K/V). Beside it: the hit share the provider's own prefix cache reported on
the mini-swe-agent traffic.

Consistency: on a few sampled turns (prompts cut to a token budget, system prompt head kept),
the cache for turn t is built from the KV of earlier requests (see :func:`consistency_turn`) and
the greedy continuation and first next-token distribution are compared with a full prefill.

Not here: the loaders, policies and replay loop (``bench/traces_data.py``); eviction (every
session's store is unbounded); timing of a real serving engine.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench.traces_data import (
    NAMESPACE,
    MessageTokenizer,
    PolicyResult,
    RequestStat,
    Session,
    Tokenized,
    Tokenizer,
    body_cuts,
    data_root,
    get_policy,
    load_jsonl,
    load_sessions,
    message_body,
    mini_swe_agent_usage,
    replay_session,
    summarize,
    word_encode,
)
from cache.cdc import CDCConfig, chunk_bounds
from cache.patch import PatchConfig, apply_patch, fit_patch
from cache.planner import Planner, PlannerConfig
from cache.rank import FixedRank
from cache.rope import rotate

SETS: dict[str, str] = {"tau": "tau_bench", "swe": "swe_agent", "mini": "mini_swe_agent"}
DEFAULT_POLICIES = "append,window-6,dynamic-system,mask-observations-3,rerank"
DEFAULT_CDC = "2,8,32,4"  # chosen on the dev half (docs/traces.md)
Mode = Literal["blind", "patched", "first-k"]
MODES: tuple[Mode, ...] = ("blind", "patched", "first-k")

# KV bytes per token, bf16. SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, keys and values.
# DeepSeek-V2: 60 layers; an MLA entry holds the 512-wide latent and the 64-wide k_rope; the
# expanded cache would hold 128 heads x (128 + 64 key dims + 128 value dims).
BYTES_PER_TOKEN = {
    "gqa": 30 * 3 * 64 * 2 * 2,
    "mla": 60 * (512 + 64) * 2,
    "mla_expanded": 60 * 128 * (128 + 64 + 128) * 2,
}


TIMING_KEYS = (
    "lookup_ms_p50",
    "plan_ms_mean",
    "saved_tokens_mean",
    "saved_prefill_ms_mean",
    "plan_over_saved_prefill",
    "breakeven_prefill_tokens_per_s",
)


# --- tokenizing through the chat template -------------------------------------------------------


class TemplateTokenizer:
    """A request rendered by the tokenizer's chat template, generation prompt included.

    The rendered text is cut before every ``marker`` (ChatML's ``<|im_start|>``) and each piece
    is tokenized on its own (cached), so messages start on token bounds. With the marker a
    special token, the pieces' ids concatenate to the ids of the whole text. Inside a piece,
    the body starts after the header line (marker and role) and ends at ``end_marker``; these
    and the body's tool-call structure (:func:`bench.traces_data.body_cuts`) are reported as
    boundaries, before the token holding each (the ids are never changed to make one). Message
    bodies are :func:`bench.traces_data.message_body` (tool calls as JSON), since the template
    shows only ``content``. Needs a fast tokenizer (character offsets).
    """

    def __init__(self, tokenizer: Any, marker: str = "<|im_start|>", end_marker: str = "<|im_end|>") -> None:
        self.tokenizer = tokenizer
        self.end_marker = end_marker
        self._split = re.compile(f"(?={re.escape(marker)})")
        self._cache: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        msgs = [{"role": str(m.get("role", "user")), "content": message_body(m)} for m in messages]
        text: str = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return text

    def _piece(self, piece: str) -> tuple[np.ndarray, tuple[int, ...]]:
        """Ids of one message piece [P] and the token offsets where its body starts and ends."""
        if piece not in self._cache:
            enc = self.tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
            start = piece.find("\n") + 1
            end = piece.rfind(self.end_marker) if self.end_marker in piece else len(piece)
            chars = [start, end, *(start + c for c in body_cuts(piece[start:end]))]
            # a point inside a token cuts before that token
            token_starts = [a for a, _ in enc["offset_mapping"]]
            inside = np.searchsorted(token_starts, [c for c in chars if c < len(piece)], side="right") - 1
            cuts = tuple(sorted({int(i) for i in inside if i > 0}))
            self._cache[piece] = (np.asarray(enc["input_ids"], dtype=np.int64), cuts)
        return self._cache[piece]

    def __call__(self, messages: Sequence[dict[str, Any]]) -> Tokenized:
        parts = [self._piece(p) for p in self._split.split(self.render(messages)) if p]
        starts = np.cumsum([0, *[len(ids) for ids, _ in parts[:-1]]]).tolist() if parts else []
        bounds = [b for s, (_, cuts) in zip(starts, parts, strict=True) for b in (s, *(s + c for c in cuts))]
        ids = np.concatenate([ids for ids, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        return Tokenized(ids, tuple(starts), tuple(bounds))


def load_tokenizer(kind: str) -> tuple[Tokenizer, Any]:
    """``word``: the tokenizer-free stand-in; ``model``: SmolLM2's tokenizer and template only;
    ``adapter``: the same through the loaded model (returned second, else None)."""
    if kind == "word":
        return MessageTokenizer(word_encode), None
    if kind == "model":
        from transformers import AutoTokenizer

        from agent.adapters.loading import embedded_text_model_dir

        return TemplateTokenizer(AutoTokenizer.from_pretrained(embedded_text_model_dir())), None
    if kind == "adapter":
        from agent.adapters.loading import load_adapter

        adapter = load_adapter()
        return TemplateTokenizer(adapter.tokenizer), adapter
    raise ValueError(f"tokenizer must be word, model or adapter, got {kind!r}")


# --- replay -------------------------------------------------------------------------------------


def parse_cdc(text: str) -> CDCConfig:
    """``min,avg,max,window`` -> CDCConfig."""
    parts = [int(x) for x in text.split(",")]
    if len(parts) != 4:
        raise ValueError(f"--cdc needs min,avg,max,window, got {text!r}")
    return CDCConfig(*parts)


def policy_fields(r: PolicyResult) -> dict[str, float | int | None]:
    """The JSON record of one policy: rates, p50 plan time, store tokens and bytes."""
    out: dict[str, float | int | None] = {
        "n_requests": r.n_requests,
        "prompt_tokens": r.prompt_tokens,
        "prefix_hit_rate": r.prefix_hit_rate,
        "content_hit_rate": r.content_hit_rate,
        "oracle_hit_rate": r.oracle_hit_rate,
        "recovered_of_oracle": None if math.isnan(r.recovered_of_oracle) else r.recovered_of_oracle,
        "lookup_ms_p50": r.p50_plan_ms,
        "store_tokens": r.store_tokens,
        "store_bytes_gqa": r.store_tokens * BYTES_PER_TOKEN["gqa"],
        "store_bytes_mla": r.store_tokens * BYTES_PER_TOKEN["mla"],
        "store_bytes_mla_expanded": r.store_tokens * BYTES_PER_TOKEN["mla_expanded"],
    }
    return out


def plan_overhead(stats: Sequence[RequestStat], prefill_s_per_token: float) -> float:
    """Chunking + lookup time over the prefill time of the tokens content addressing recovers
    above the exact prefix (the prefill it saves beyond a prefix cache)."""
    saved = sum(r.content - r.prefix for r in stats) * prefill_s_per_token
    return sum(r.plan_ms for r in stats) / 1e3 / saved if saved > 0 else float("inf")


def timing_fields(stats: Sequence[RequestStat], prefill_s_per_token: float | None) -> dict[str, float | None]:
    """Plan cost per request beside the prefill it saves (tokens content addressing reuses
    above the exact prefix). ``breakeven_prefill_tokens_per_s``: the prefill rate up to which
    planning costs at most 1% of the prefill it saves (total saved tokens over 100 x total plan
    seconds); a faster prefill (a GPU) needs a cheaper plan."""
    plan_s = sum(r.plan_ms for r in stats) / 1e3
    saved = sum(r.content - r.prefix for r in stats)
    n = max(len(stats), 1)
    out: dict[str, float | None] = {
        "plan_ms_mean": plan_s * 1e3 / n,
        "saved_tokens_mean": saved / n,
        "breakeven_prefill_tokens_per_s": saved / (100 * plan_s) if plan_s > 0 else None,
    }
    if prefill_s_per_token is not None:
        out["saved_prefill_ms_mean"] = saved * prefill_s_per_token * 1e3 / n
        out["plan_over_saved_prefill"] = plan_overhead(stats, prefill_s_per_token)
    return out


def chunking_rate(
    sessions: Sequence[Session], tokenize: Tokenizer, cdc: CDCConfig, repeats: int = 5
) -> float:
    """Tokens per CPU second of content-defined chunking on the last request of every session
    (best of ``repeats`` each; CPU time, since the machine may be shared)."""
    toks = [tokenize(s.requests[-1]) for s in sessions if s.requests]
    total, seconds = 0, 0.0
    for t in toks:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            chunk_bounds(t.ids, cdc, t.boundaries)
            best = min(best, time.process_time() - t0)
        total, seconds = total + len(t.ids), seconds + best
    return total / seconds if seconds else float("nan")


# --- consistency --------------------------------------------------------------------------------


class Piece(NamedTuple):
    start: int  # span [start, end) of the new prompt
    end: int
    kind: Literal["prefix", "relocated", "miss"]
    source: int | None  # index of the earlier request holding the reused KV
    source_start: int | None


class TurnResult(NamedTuple):
    greedy_match: dict[str, bool]
    kl: dict[str, float]
    n_tokens: int
    reused: dict[str, int]  # tokens per piece kind
    latent_identical: bool | None  # MLA: relocated latents equal their source byte for byte
    krope_rotated: bool | None  # MLA: every moved k_rope equals its source rotated to the new start


def truncate(tok: Tokenized, budget: int) -> Tokenized:
    """At most ``budget`` tokens: the first message's head (up to half the budget) and the tail."""
    ids, n = tok.ids, len(tok.ids)
    if n <= budget:
        return tok
    first_end = tok.message_starts[1] if len(tok.message_starts) > 1 else n
    head = min(first_end, budget // 2)
    cut = n - (budget - head)

    def kept(offsets: Sequence[int]) -> tuple[int, ...]:  # the head's, then the tail's, moved
        return tuple(
            sorted(
                {0, head, *(b for b in offsets if b < head), *(b - cut + head for b in offsets if b > cut)}
            )
        )

    return Tokenized(np.concatenate([ids[:head], ids[cut:]]), kept(tok.message_starts), kept(tok.boundaries))


def plan_pieces(prompts: Sequence[Tokenized], config: PlannerConfig) -> tuple[list[Piece], set[int]]:
    """Pieces of the last prompt planned after committing the earlier ones (payload = index).

    The last token is always a miss, so the method ends on a prefill that yields its logits.
    Returns the pieces and the earlier requests whose KV they reuse.
    """
    planner = Planner(NAMESPACE, config)
    for i, t in enumerate(prompts[:-1]):
        planner.commit(planner.plan(t.ids, t.boundaries), t.ids, i)
    last = prompts[-1]
    plan = planner.plan(last.ids, last.boundaries)
    pieces: list[Piece] = []
    at = 0
    for seg in plan.prefix:
        pieces.append(Piece(at, at + seg.length, "prefix", int(seg.payload), seg.offset))  # type: ignore[call-overload]
        at += seg.length
    for c in plan.chunks:
        if c.end <= plan.prefix_len:
            continue
        if c.status == "miss":
            if pieces and pieces[-1].kind == "miss":
                pieces[-1] = pieces[-1]._replace(end=c.end)
            else:
                pieces.append(Piece(c.start, c.end, "miss", None, None))
        else:
            pieces.append(Piece(c.start, c.end, "relocated", int(c.payload), c.source_start))  # type: ignore[call-overload]
    n = len(last.ids)
    if pieces and pieces[-1].kind != "miss":
        p = pieces.pop()
        if p.end - p.start > 1:
            pieces.append(p._replace(end=n - 1))
        pieces.append(Piece(n - 1, n, "miss", None, None))
    return pieces, {p.source for p in pieces if p.source is not None}


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of two next-token distributions given as logits ``[V]``."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


def run_method(
    adapter: Any,
    ids: torch.Tensor,
    pieces: Sequence[Piece],
    sources: dict[int, Any],
    full_kv: Any,
    mode: Mode,
    first_k: int,
    patch_config: PatchConfig,
) -> tuple[torch.Tensor, Any, Piece]:
    """Build the cache piece by piece; returns the last logits ``[V]``, the cache and the last piece.

    Prefix pieces and relocated pieces take the source request's pre-RoPE KV rotated to their
    new start (a prefix piece does not move); ``patched`` adds to a relocated piece the patch
    fitted from the reused KV to ``full_kv`` (its KV in this prompt, computed by the full
    prefill); ``first-k`` prefills the first ``first_k`` tokens of a relocated piece in context.
    Misses are prefilled attending to everything placed before them.
    """
    spec = adapter.spec
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []
    cache, fresh, logits = None, False, None

    def prefill(s: int, e: int) -> None:
        nonlocal cache, fresh, logits
        if not fresh:
            cache = adapter.new_cache(placed)
        out = adapter.prefill(adapter.text(ids[s:e]), cache, s)
        placed.append(out.kv.place(s, spec))
        fresh, logits = True, out.logits[-1]

    for p in pieces:
        if p.kind == "miss":
            prefill(p.start, p.end)
            continue
        s = p.start
        if p.kind == "relocated" and mode == "first-k":
            s = min(p.end, p.start + first_k)
            prefill(p.start, s)
            if s == p.end:
                continue
        src = sources[p.source]  # type: ignore[index]
        a = p.source_start + (s - p.start)  # type: ignore[operator]
        k, v = src.k[:, :, a : a + p.end - s], src.v[:, :, a : a + p.end - s]
        if p.kind == "relocated" and mode == "patched":
            fit = fit_patch(k, v, full_kv.k[:, :, s : p.end], full_kv.v[:, :, s : p.end], patch_config)
            k, v = apply_patch(k, v, fit.patch)
        placed.append((rotate(k, torch.arange(s, p.end), spec), v))
        fresh = False
    if logits is None:
        raise ValueError("the last piece must be a miss")
    last = pieces[-1]
    return logits, cache, last


def mla_checks(
    adapter: Any, ids: torch.Tensor, pieces: Sequence[Piece], sources: dict[int, Any], cache: Any
) -> tuple[bool, bool]:
    """Whether the cache after a blind run holds every relocated latent byte for byte as its
    source, and every relocated ``k_rope`` equal to its source's rotated to the new start."""
    held = adapter.kv_tail(cache, adapter.text(ids), 0)  # pre-RoPE, the whole prompt
    latent_ok, rope_ok = True, True
    for p in pieces:
        if p.kind != "relocated":
            continue
        a, n = p.source_start, p.end - p.start
        src = sources[p.source]  # type: ignore[index]
        src_v, held_v = src.v[:, :, a : a + n], held.v[:, :, p.start : p.end]  # type: ignore[operator]
        latent_ok &= src_v.dtype == held_v.dtype and torch.equal(
            src_v.view(torch.uint8), held_v.view(torch.uint8)
        )
        src_k = rotate(src.k[:, :, a : a + n], torch.arange(p.start, p.end), adapter.spec)  # type: ignore[operator]
        held_k = rotate(held.k[:, :, p.start : p.end], torch.arange(p.start, p.end), adapter.spec)
        rope_ok &= bool(torch.allclose(src_k, held_k, rtol=1e-4, atol=1e-5))
    return latent_ok, rope_ok


def consistency_turn(
    adapter: Any,
    prompts: Sequence[Tokenized],
    config: PlannerConfig,
    vocab: int,
    max_new_tokens: int = 16,
    first_k: int = 16,
    patch_rank: int = 8,
) -> TurnResult:
    """Compare each reuse mode on the last of ``prompts`` with its full prefill.

    Earlier requests are full-prefilled (the KV as computed in their own context) only where
    the last prompt reuses them. Token ids are taken modulo ``vocab`` for the model.
    """
    pieces, used = plan_pieces(prompts, config)
    as_ids = [torch.as_tensor(t.ids % vocab, dtype=torch.int64) for t in prompts]
    sources = {i: adapter.prefill(adapter.text(as_ids[i]), adapter.empty_cache(), 0).kv for i in sorted(used)}
    ids = as_ids[-1]
    full = adapter.prefill(adapter.text(ids), adapter.empty_cache(), 0)
    ref = adapter.generate(adapter.text(ids), full.cache, 0, max_new_tokens, first_logits=full.logits[-1])
    patch_cfg = PatchConfig(rank=FixedRank(patch_rank), storage="float32")
    match: dict[str, bool] = {}
    kls: dict[str, float] = {}
    latent_ok = rope_ok = None
    for mode in MODES:
        logits, cache, last = run_method(adapter, ids, pieces, sources, full.kv, mode, first_k, patch_cfg)
        if mode == "blind" and adapter.family == "mla":
            latent_ok, rope_ok = mla_checks(adapter, ids, pieces, sources, cache)
        kls[mode] = kl_divergence(full.logits[-1], logits)
        gen = adapter.generate(
            adapter.text(ids[last.start : last.end]), cache, last.start, max_new_tokens, first_logits=logits
        )
        match[mode] = gen.tokens == ref.tokens
    reused = {k: sum(p.end - p.start for p in pieces if p.kind == k) for k in ("prefix", "relocated", "miss")}
    return TurnResult(match, kls, len(ids), reused, latent_ok, rope_ok)


def sample_turns(
    sets: dict[str, list[Session]],
    policies: Sequence[str],
    tokenize: Tokenizer,
    config: PlannerConfig,
    n: int,
    budget: int,
    min_relocated: int = 32,
    max_sources: int = 4,
) -> list[tuple[str, str, str, list[Tokenized]]]:
    """``n`` distinct turns ``(set, policy, session id, truncated prompts 0..t)`` cycling over sets
    and the policies that move content; each turn relocates at least ``min_relocated`` tokens
    from at most ``max_sources`` earlier requests. A turn whose prompts equal one already taken
    (early in a session several policies render the same requests) is skipped, so no turn
    counts twice. Deterministic: sessions in order, steps from 2 up."""
    moving = [p for p in policies if p != "append"] or list(policies)
    combos = [(s, p) for p in moving for s in sets]
    out: list[tuple[str, str, str, list[Tokenized]]] = []
    seen: set[bytes] = set()
    cursor = dict.fromkeys(combos, 0)
    while len(out) < n and combos:
        for combo in list(combos):
            if len(out) >= n:
                break
            while True:
                found = _next_turn(
                    sets[combo[0]],
                    combo[1],
                    tokenize,
                    config,
                    budget,
                    cursor,
                    combo,
                    min_relocated,
                    max_sources,
                )
                if found is None:
                    combos.remove(combo)
                    break
                digest = hashlib.blake2b(b"".join(p.ids.tobytes() + b"|" for p in found[1])).digest()
                if digest not in seen:
                    seen.add(digest)
                    out.append((combo[0], combo[1], *found))
                    break
    return out


def _next_turn(
    sessions: list[Session],
    policy_name: str,
    tokenize: Tokenizer,
    config: PlannerConfig,
    budget: int,
    cursor: dict[tuple[str, str], int],
    combo: tuple[str, str],
    min_relocated: int,
    max_sources: int,
) -> tuple[str, list[Tokenized]] | None:
    policy = get_policy(policy_name)
    while cursor[combo] < len(sessions):
        s = sessions[cursor[combo]]
        cursor[combo] += 1
        prompts = [truncate(tokenize(policy(r, i)), budget) for i, r in enumerate(s.requests[:8])]
        for t in range(2, len(prompts)):
            pieces, used = plan_pieces(prompts[: t + 1], config)
            moved = sum(p.end - p.start for p in pieces if p.kind == "relocated")
            if moved >= min_relocated and len(used) <= max_sources:
                return s.id, prompts[: t + 1]
    return None


def consistency(
    models: Sequence[str],
    turns: Sequence[tuple[str, str, str, list[Tokenized]]],
    config: PlannerConfig,
    smollm2: Any,
    log: Callable[[str], None],
    first_k: int = 16,
    patch_rank: int = 8,
) -> dict[str, Any]:
    """Per model: per mode greedy-match share and KL median/max, plus each turn's record."""
    from agent.adapters.loading import load_adapter

    out: dict[str, Any] = {}
    for name in models:
        if name == "smollm2":
            if smollm2 is None:
                smollm2 = load_adapter()
            adapter = smollm2
        else:
            adapter = load_adapter(f"tiny:{name}")
        vocab = adapter.vocab_size
        records = []
        for set_name, policy, sid, prompts in turns:
            t0 = time.perf_counter()
            r = consistency_turn(adapter, prompts, config, vocab, first_k=first_k, patch_rank=patch_rank)
            log(
                f"{name} {set_name}/{policy} {sid} t={len(prompts) - 1}: {r.reused} "
                f"KL {', '.join(f'{m} {r.kl[m]:.2e}' for m in MODES)} ({time.perf_counter() - t0:.1f}s)"
            )
            records.append(
                {"set": set_name, "policy": policy, "session": sid, "step": len(prompts) - 1, **r._asdict()}
            )
        model_out: dict[str, Any] = {
            mode: {
                "greedy_match": float(np.mean([r["greedy_match"][mode] for r in records]))
                if records
                else None,
                "kl_median": float(np.median([r["kl"][mode] for r in records])) if records else None,
                "kl_max": float(np.max([r["kl"][mode] for r in records])) if records else None,
            }
            for mode in MODES
        }
        model_out["turns"] = records
        model_out["family"] = adapter.family
        if adapter.family == "mla":
            model_out["mla_latent_identical"] = all(r["latent_identical"] for r in records)
            model_out["mla_krope_rotated"] = all(r["krope_rotated"] for r in records)
        out[name] = model_out
    return out


def prefill_rate(adapter: Any, ids: np.ndarray, n_tokens: int = 512, repeats: int = 2) -> float:
    """Tokens per CPU second of one SmolLM2 prefill of ``n_tokens`` real prompt tokens from empty,
    on one thread: the same clock and the same one core as the plan it is compared with."""
    chunk = adapter.text(torch.as_tensor(ids[:n_tokens], dtype=torch.int64))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            adapter.prefill(chunk, adapter.empty_cache(), 0)
            best = min(best, time.process_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return chunk.n_tokens / best


# --- CLI ----------------------------------------------------------------------------------------


def replay_sets(
    sets: dict[str, list[Session]],
    policies: Sequence[str],
    tokenize: Tokenizer,
    config: PlannerConfig,
    log: Callable[[str], None],
) -> dict[str, dict[str, list[RequestStat]]]:
    """Every session of every set under every policy: set -> policy -> request stats.

    What is loaded by now (torch, transformers, the traces: ~400k objects) outlives the replay;
    it is frozen meanwhile so that the full collections the growing indexes trigger do not
    rescan it, as a server does after start-up. Unfrozen, those pauses land in the timed plans
    (p50 unchanged, mean about doubled on mini-swe-agent).
    """
    gc.freeze()
    try:
        per_set: dict[str, dict[str, list[RequestStat]]] = {}
        for set_name, sessions in sets.items():
            per_set[set_name] = {}
            for name in policies:
                t0 = time.perf_counter()
                policy = get_policy(name)
                stats = [r for s in sessions for r in replay_session(s, policy, tokenize, config)]
                per_set[set_name][name] = stats
                log(f"{set_name} {name}: {len(stats)} requests, {time.perf_counter() - t0:.1f}s")
    finally:
        gc.unfreeze()
    return per_set


def load_sets(args: argparse.Namespace) -> dict[str, list[Session]]:
    if args.data:
        return {Path(args.data).stem: load_jsonl(Path(args.data))}
    if data_root() is None:
        raise FileNotFoundError("no data folder: set KAMERA_DATA, place it at ../shared/data, or pass --data")
    limits = parse_sessions(args.sessions)
    out = {}
    for name in args.sets.split(","):
        if name not in SETS:
            raise KeyError(f"unknown trace set {name!r}; known: {sorted(SETS)}")
        out[name] = load_sessions(SETS[name], args.split)[: limits.get(name, limits.get("*", 0)) or None]
    return out


def parse_sessions(text: str) -> dict[str, int]:
    """``4`` (every set) or ``mini=4,tau=10`` -> {set or "*": at most that many sessions; 0: all}."""
    if "=" not in text:
        return {"*": int(text)}
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kamera bench traces", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--data", default=None, help="a JSONL of sessions instead of the shared traces")
    ap.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    ap.add_argument("--sets", default="tau,swe,mini")
    ap.add_argument("--sessions", default="0", help="at most N sessions per set, or set=N,... (0: all)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--cdc", default=DEFAULT_CDC, help="min,avg,max,window in tokens")
    ap.add_argument("--chunker", default="gear")
    ap.add_argument("--tokenizer", default="adapter", choices=["adapter", "model", "word"])
    ap.add_argument("--tokenizer-only", action="store_true", help="load SmolLM2's tokenizer, not its weights")
    ap.add_argument("--consistency-turns", type=int, default=6)
    ap.add_argument("--consistency-models", default="smollm2,deepseek-mla")
    ap.add_argument("--consistency-budget", type=int, default=768)
    ap.add_argument("--first-k", type=int, default=16)
    ap.add_argument("--patch-rank", type=int, default=8)
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    kind = "model" if args.tokenizer == "adapter" and args.tokenizer_only else args.tokenizer
    t0 = time.perf_counter()
    tokenize, adapter = load_tokenizer(kind)
    console.log(f"tokenizer {kind} ready in {time.perf_counter() - t0:.1f}s")
    cdc = parse_cdc(args.cdc)
    config = PlannerConfig(args.chunker, cdc)
    sets = load_sets(args)
    policies = args.policies.split(",")
    per_set = replay_sets(sets, policies, tokenize, config, console.log)

    result: dict[str, Any] = {
        "config": {
            "split": args.split,
            "sets": {k: len(v) for k, v in sets.items()},
            "cdc": {"min": cdc.min_size, "avg": cdc.avg_size, "max": cdc.max_size, "window": cdc.window},
            "chunker": args.chunker,
            "tokenizer": kind,
            "bytes_per_token": BYTES_PER_TOKEN,
        }
    }
    all_sessions = [s for v in sets.values() for s in v]
    timing: dict[str, Any] = {
        "clock": "process CPU time, one thread",
        "chunking_tokens_per_s": chunking_rate(all_sessions, tokenize, cdc),
    }
    s_per_token = None
    if adapter is not None and all_sessions:
        rate = prefill_rate(adapter, tokenize(all_sessions[0].requests[-1]).ids)
        timing["prefill_tokens_per_s"], s_per_token = rate, 1.0 / rate

    def fields(name: str, stats: list[RequestStat]) -> dict[str, Any]:
        return {**policy_fields(summarize(name, stats)), **timing_fields(stats, s_per_token)}

    result["sets"] = {
        s: {"policies": {p: fields(p, st) for p, st in by.items()}} for s, by in per_set.items()
    }
    result["policies"] = {p: fields(p, [r for by in per_set.values() for r in by[p]]) for p in policies}
    timing["policies"] = {
        p: {k: v for k, v in r.items() if k in TIMING_KEYS} for p, r in result["policies"].items()
    }
    result["timing"] = timing

    ref: dict[str, Any] = {}
    root = data_root()
    if "mini" in sets and not args.data and root is not None:
        usage = mini_swe_agent_usage(root / "agent_traces" / "mini_swe_agent_deepseek", args.split)
        ref["mini_swe_agent_cached_share"] = sum(c for _, c in usage) / max(1, sum(p for p, _ in usage))
        ref["mini_swe_agent_prompt_tokens"] = sum(p for p, _ in usage)
        if "append" in per_set["mini"]:
            ours = result["sets"]["mini"]["policies"]["append"]
            ref["ours_append_prefix_hit_rate"] = ours["prefix_hit_rate"]
            ref["ours_append_content_hit_rate"] = ours["content_hit_rate"]
    result["reference"] = ref

    models = [m for m in args.consistency_models.split(",") if m]
    if args.consistency_turns > 0 and models:
        turns = sample_turns(
            sets, policies, tokenize, config, args.consistency_turns, args.consistency_budget
        )
        result["consistency"] = consistency(
            models, turns, config, adapter, console.log, args.first_k, args.patch_rank
        )
        result["consistency"]["note"] = (
            "patched: a patch fitted for the chunk's new antecedents from its KV in the full prefill "
            "(an upper bound of what a stored patch for those antecedents gives)"
        )

    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=float))
    print_tables(Console(width=150), result)
    return 0


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_tables(console: Console, result: dict[str, Any]) -> None:
    table = Table(
        title=f"Reuse on agent traces ({result['config']['split']} split, CDC {result['config']['cdc']})"
    )
    for col in (
        "set",
        "policy",
        "tokens",
        "prefix",
        "content",
        "oracle",
        "recovered",
        "p50 ms",
        "GQA GB",
        "MLA GB",
        "MLA exp. GB",
    ):
        table.add_column(col, justify="left" if col in ("set", "policy") else "right")
    rows = [(s, v["policies"]) for s, v in result["sets"].items()] + [("all", result["policies"])]
    for set_name, pols in rows:
        for p, r in pols.items():
            table.add_row(
                set_name,
                p,
                f"{r['prompt_tokens']:,}",
                _fmt(r["prefix_hit_rate"]),
                _fmt(r["content_hit_rate"]),
                _fmt(r["oracle_hit_rate"]),
                _fmt(r["recovered_of_oracle"]),
                _fmt(r["lookup_ms_p50"], ".2f"),
                _fmt(r["store_bytes_gqa"] / 1e9, ".2f"),
                _fmt(r["store_bytes_mla"] / 1e9, ".2f"),
                _fmt(r["store_bytes_mla_expanded"] / 1e9, ".1f"),
            )
    console.print(table)
    if "consistency" in result:
        ct = Table(title="Consistency with a full prefill (greedy 16 tokens, KL of the first token)")
        for col in ("model", "mode", "greedy match", "KL median", "KL max"):
            ct.add_column(col)
        for model, modes in result["consistency"].items():
            if not isinstance(modes, dict):
                continue
            for mode in MODES:
                m = modes[mode]
                ct.add_row(
                    model,
                    mode,
                    _fmt(m["greedy_match"], ".2f"),
                    _fmt(m["kl_median"], ".2e"),
                    _fmt(m["kl_max"], ".2e"),
                )
        console.print(ct)
    t = result["timing"]
    console.print(
        f"chunking {_fmt(t['chunking_tokens_per_s'] / 1e6, '.1f')}M tokens/s; "
        f"SmolLM2 prefill {_fmt(t.get('prefill_tokens_per_s'), ',.0f')} tokens/s ({t['clock']})"
    )
    tt = Table(title="Plan (chunking + keys + lookup) per request beside the prefill it saves")
    for col in (
        "policy",
        "plan ms p50",
        "plan ms mean",
        "saved tokens",
        "saved prefill ms",
        "plan / saved",
        "1% up to tok/s",
    ):
        tt.add_column(col, justify="left" if col == "policy" else "right")
    for p, r in t["policies"].items():
        tt.add_row(
            p,
            _fmt(r["lookup_ms_p50"], ".2f"),
            _fmt(r["plan_ms_mean"], ".2f"),
            _fmt(r["saved_tokens_mean"], ",.0f"),
            _fmt(r.get("saved_prefill_ms_mean"), ",.0f"),
            _fmt(r.get("plan_over_saved_prefill"), ".2e"),
            _fmt(r["breakeven_prefill_tokens_per_s"], ",.0f"),
        )
    console.print(tt)
    ref = result["reference"]
    if ref:
        console.print(
            f"mini-swe-agent: provider prefix cache hit share {_fmt(ref['mini_swe_agent_cached_share'])}; "
            f"ours (append) prefix {_fmt(ref.get('ours_append_prefix_hit_rate'))}, "
            f"content {_fmt(ref.get('ours_append_content_hit_rate'))}"
        )
