"""Consistency on agent traces: a turn's cache built from the KV of earlier requests, each reuse
mode's greedy continuation and first-token distribution against a full prefill.

The last request of a turn is planned after committing the earlier ones (:func:`plan_pieces`):
prefix pieces and relocated pieces take the source request's pre-RoPE KV rotated to their new
start; misses are prefilled. Modes: ``blind`` (rotation only), ``first-k`` (the first k tokens
of each relocated piece prefilled in context) and ``patched``, which adds to each relocated
piece a patch fitted to its KV in this prompt's full prefill: an **oracle** (an upper bound of
what a stored patch for those antecedents gives), reported as such (:data:`ORACLE_MODES`).

Not here: the replay of whole sessions (``traces_replay.py``), the tables (``traces_report.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from bench.methods import kl_divergence
from bench.traces_data import Session
from bench.traces_policies import DEFAULT_SEED, get_policy
from bench.traces_replay import NAMESPACE
from bench.traces_tokens import Tokenized, Tokenizer
from cache.keys import digest_key
from cache.patch import PatchConfig, apply_patch, fit_patch
from cache.planner import Planner, PlannerConfig
from cache.rank import FixedRank
from cache.rope import rotate

Mode = Literal["blind", "patched", "first-k"]


MODES: tuple[Mode, ...] = ("blind", "patched", "first-k")
ORACLE_MODES: tuple[Mode, ...] = ("patched",)  # fitted to the served prompt's own full prefill


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
    seed: int = DEFAULT_SEED,
) -> list[tuple[str, str, str, list[Tokenized]]]:
    """``n`` distinct turns ``(set, policy, session id, truncated prompts 0..t)`` cycling over sets
    and the policies that move content; each turn relocates at least ``min_relocated`` tokens
    from at most ``max_sources`` earlier requests. A turn whose prompts equal one already taken
    (early in a session several policies render the same requests) is skipped, so no turn
    counts twice. Deterministic: sessions in order, steps from 2 up, the policies drawing from
    ``seed`` (:func:`get_policy`)."""
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
                    seed,
                )
                if found is None:
                    combos.remove(combo)
                    break
                digest = digest_key("turn", [p.ids.tobytes() for p in found[1]]).digest
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
    seed: int = DEFAULT_SEED,
) -> tuple[str, list[Tokenized]] | None:
    policy = get_policy(policy_name, seed)
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
                from agent.adapters.loading import load_adapter

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
