"""Replay of agent sessions through the planner: what an exact-prefix cache, content addressing
and an n-gram oracle each reuse of every request.

Every request of a session is rewritten by a context policy, tokenized, planned against
session-local indexes and committed; :class:`NgramOracle` counts the tokens that lay in some
16-token window seen earlier in the session (what was reusable at all). ``python -m
bench.traces_replay`` prints the rates for one trace source with the word stand-in tokenizer.

Not here: loaders (``traces_data.py``), the benchmark's report (``traces.py``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from bench.traces_data import SOURCES, Session, load_sessions
from bench.traces_policies import DEFAULT_SEED, Policy, get_policy
from bench.traces_tokens import MessageTokenizer, Tokenizer, word_encode
from cache.cdc import CDCConfig, gear_values, window_hash
from cache.keys import Namespace
from cache.planner import Planner, PlannerConfig


class NgramOracle:
    """Which prompt tokens lie in some ``n``-token window seen earlier in the session."""

    def __init__(self, n: int = 16) -> None:
        if n < 1 or n & (n - 1):
            raise ValueError(f"n must be a power of two, got {n}")
        self.n = n
        self._seen = np.zeros(0, dtype=np.uint64)

    def _hashes(self, ids: np.ndarray) -> np.ndarray:
        """64-bit hash of the window ending at each position >= n - 1: [T] -> [T - n + 1]."""
        hi = window_hash(gear_values(ids, 101), self.n, 0x9E3779B1).astype(np.uint64)
        lo = window_hash(gear_values(ids, 202), self.n, 0x01000193).astype(np.uint64)
        return ((hi << np.uint64(32)) | lo)[self.n - 1 :]

    def covered(self, ids: np.ndarray) -> int:
        if len(ids) < self.n or not self._seen.size:
            return 0
        hit_end = np.flatnonzero(np.isin(self._hashes(ids), self._seen, assume_unique=False)) + self.n - 1
        delta = np.bincount(hit_end - self.n + 1, minlength=len(ids) + 1)[: len(ids) + 1]
        delta -= np.bincount(hit_end + 1, minlength=len(ids) + 1)[: len(ids) + 1]
        return int((np.cumsum(delta)[: len(ids)] > 0).sum())

    def add(self, ids: np.ndarray) -> None:
        if len(ids) >= self.n:
            self._seen = np.union1d(self._seen, self._hashes(ids))


class RequestStat(NamedTuple):
    n_tokens: int
    prefix: int  # tokens an exact-prefix cache reuses
    content: int  # tokens reused by prefix or content
    oracle: int  # tokens in a window seen earlier in the session
    plan_ms: float  # chunking + lookup
    stored: int = 0  # tokens of chunks this request added to the content store


class PolicyResult(NamedTuple):
    policy: str
    n_requests: int
    prompt_tokens: int
    prefix_hit_rate: float
    content_hit_rate: float
    oracle_hit_rate: float
    recovered_of_oracle: float  # (content - prefix) / (oracle - prefix); nan when nothing to recover
    p50_plan_ms: float
    store_tokens: int = 0  # tokens of the distinct chunks the content store holds, all sessions


NAMESPACE = Namespace(model="trace-replay", dtype="none")


def replay_session(
    session: Session, policy: Policy, tokenize: Tokenizer, config: PlannerConfig, oracle_n: int = 16
) -> list[RequestStat]:
    """Plan and commit every request of ``session`` in order against session-local caches."""
    planner, oracle = Planner(NAMESPACE, config), NgramOracle(oracle_n)
    stats = []
    for step, request in enumerate(session.requests):
        tok = tokenize(policy(request, step))
        t0 = time.process_time()  # CPU time: the machine may be shared
        plan = planner.plan(tok.ids, tok.boundaries)
        ms = (time.process_time() - t0) * 1e3
        by = plan.tokens_by_status()
        new = {
            c.key: c.n_tokens
            for c in plan.chunks
            if c.status != "relocated-hit" and c.key not in planner.index
        }
        stats.append(
            RequestStat(
                len(tok.ids),
                by["prefix-hit"],
                plan.reused_tokens,
                oracle.covered(tok.ids),
                ms,
                sum(new.values()),
            )
        )
        planner.commit(plan, tok.ids, f"{session.id}/{step}")
        oracle.add(tok.ids)
    return stats


def summarize(policy: str, stats: Iterable[RequestStat]) -> PolicyResult:
    s = list(stats)
    total = sum(r.n_tokens for r in s)
    prefix, content, oracle = (
        sum(getattr(r, f) for r in s) / max(total, 1) for f in ("prefix", "content", "oracle")
    )
    recovered = (content - prefix) / (oracle - prefix) if oracle > prefix else float("nan")
    p50 = float(np.median([r.plan_ms for r in s])) if s else float("nan")
    stored = sum(r.stored for r in s)
    return PolicyResult(policy, len(s), total, prefix, content, oracle, recovered, p50, stored)


def evaluate(
    sessions: Sequence[Session],
    policies: Sequence[str],
    tokenize: Tokenizer,
    config: PlannerConfig | None = None,
    seed: int = DEFAULT_SEED,
) -> list[PolicyResult]:
    """Token-weighted hit rates of every policy over all requests of all sessions (``seed``: the
    policies', see :func:`get_policy`)."""
    cfg = config or PlannerConfig()
    return [
        summarize(
            name, [r for s in sessions for r in replay_session(s, get_policy(name, seed), tokenize, cfg)]
        )
        for name in policies
    ]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Prefix vs content reuse on real agent traces")
    ap.add_argument("--source", default="tau_bench", help=f"{sorted(SOURCES)} or a .jsonl path")
    ap.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument(
        "--policies",
        default="append,window-6,dynamic-system,mask-observations-3,rerank",
        help="comma-separated",
    )
    ap.add_argument("--min-size", type=int, default=16)
    ap.add_argument("--avg-size", type=int, default=64)
    ap.add_argument("--max-size", type=int, default=256)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--normalization", type=int, default=1)
    ap.add_argument("--chunker", default="gear")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help="the rerank policy's permutations")
    args = ap.parse_args(argv)
    sessions = load_sessions(args.source, args.split)[: args.sessions]
    cfg = PlannerConfig(
        args.chunker, CDCConfig(args.min_size, args.avg_size, args.max_size, args.window, args.normalization)
    )
    print(
        f"{'policy':<22}{'req':>5}{'tokens':>10}{'prefix':>8}{'content':>8}{'oracle':>8}{'recov':>7}{'p50ms':>7}"
    )
    for r in evaluate(sessions, args.policies.split(","), MessageTokenizer(word_encode), cfg, args.seed):
        print(
            f"{r.policy:<22}{r.n_requests:>5}{r.prompt_tokens:>10}{r.prefix_hit_rate:>8.3f}"
            f"{r.content_hit_rate:>8.3f}{r.oracle_hit_rate:>8.3f}{r.recovered_of_oracle:>7.3f}{r.p50_plan_ms:>7.2f}"
        )


if __name__ == "__main__":
    main()
