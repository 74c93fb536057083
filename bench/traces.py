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
the cache for turn t is built from the KV of earlier requests (``traces_consistency.py``) and
the greedy continuation and first next-token distribution are compared with a full prefill; its
``patched`` mode is an oracle (its patch is fitted to this prompt's own full prefill).

Not here: the loaders (``traces_data.py``), policies (``traces_policies.py``), tokenizing
(``traces_tokens.py``), the replay loop (``traces_replay.py``), tables (``traces_report.py``);
eviction (every session's store is unbounded); timing of a real serving engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent.tables import make_console
from bench.traces_consistency import ORACLE_MODES, consistency, sample_turns
from bench.traces_data import Session, data_root, load_jsonl, load_sessions, mini_swe_agent_usage
from bench.traces_policies import DEFAULT_SEED, get_policy
from bench.traces_replay import RequestStat, replay_session, summarize
from bench.traces_report import BYTES_PER_TOKEN, TIMING_KEYS, policy_fields, print_tables, timing_fields
from bench.traces_tokens import Tokenizer, load_tokenizer
from cache.cdc import CDCConfig, chunk_bounds
from cache.planner import PlannerConfig
from tools.data import find_data_folder

SETS: dict[str, str] = {"tau": "tau_bench", "swe": "swe_agent", "mini": "mini_swe_agent"}


DEFAULT_POLICIES = "append,window-6,dynamic-system,mask-observations-3,rerank"


DEFAULT_CDC = "2,8,32,4"  # chosen on the dev half (docs/traces.md)


def parse_cdc(text: str) -> CDCConfig:
    """``min,avg,max,window`` -> CDCConfig."""
    parts = [int(x) for x in text.split(",")]
    if len(parts) != 4:
        raise ValueError(f"--cdc needs min,avg,max,window, got {text!r}")
    return CDCConfig(*parts)


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


def replay_sets(
    sets: dict[str, list[Session]],
    policies: Sequence[str],
    tokenize: Tokenizer,
    config: PlannerConfig,
    log: Callable[[str], None],
    seed: int = DEFAULT_SEED,
) -> dict[str, dict[str, list[RequestStat]]]:
    """Every session of every set under every policy (``seed``: the policies', see
    :func:`get_policy`): set -> policy -> request stats.

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
                policy = get_policy(name, seed)
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
        raise FileNotFoundError(find_data_folder().describe() + "; or pass --data")
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
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help="draws the rerank policy's permutations")
    args = ap.parse_args(argv)
    console = make_console(stderr=True)
    kind = "model" if args.tokenizer == "adapter" and args.tokenizer_only else args.tokenizer
    t0 = time.perf_counter()
    tokenize, adapter = load_tokenizer(kind)
    console.log(f"tokenizer {kind} ready in {time.perf_counter() - t0:.1f}s")
    cdc = parse_cdc(args.cdc)
    config = PlannerConfig(args.chunker, cdc)
    sets = load_sets(args)
    policies = args.policies.split(",")
    per_set = replay_sets(sets, policies, tokenize, config, console.log, args.seed)

    result: dict[str, Any] = {
        "config": {
            "split": args.split,
            "sets": {k: len(v) for k, v in sets.items()},
            "cdc": {"min": cdc.min_size, "avg": cdc.avg_size, "max": cdc.max_size, "window": cdc.window},
            "chunker": args.chunker,
            "tokenizer": kind,
            "bytes_per_token": BYTES_PER_TOKEN,
            "seed": args.seed,
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
            sets, policies, tokenize, config, args.consistency_turns, args.consistency_budget, seed=args.seed
        )
        result["consistency"] = consistency(
            models, turns, config, adapter, console.log, args.first_k, args.patch_rank
        )
        result["consistency"]["oracle_modes"] = list(ORACLE_MODES)
        result["consistency"]["note"] = (
            "patched: a patch fitted for the chunk's new antecedents from its KV in the full prefill "
            "(an upper bound of what a stored patch for those antecedents gives)"
        )

    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=float))
    print_tables(make_console(), result)
    return 0
