"""``kamera bench replicas``: agent traffic spread round-robin over replicas, with and without a
shared Redis tier.

Replay: every request of the agent traces (tau-bench airline, SWE-agent, mini-swe-agent; dev half
by default) in session order, request j sent to replica ``j % R`` as a stateless round-robin
balancer would, for R in 1, 2, 4. Each replica has its own planner (radix tree and content index)
and its own local store; with the shared tier they also share one real ``redis-server`` through
the product's ``RedisTier``. A replica does what ``PromptCache`` does: plan, reuse what its
indexes find, look up its misses locally and then in Redis (one MGET per request), and store
every planned chunk it did not hold, locally and through Redis's background writer (drained
after each request, so the replay is deterministic). Entries are real codec bytes of a
synthetic KV of ``--kv-bytes-per-token`` (the traffic is measured, not the model).

Figures per configuration: the cached share of prompt tokens (and the part that came from
Redis), Redis bytes read and written per reused token (measured, and projected to SmolLM2's
bf16 layout), and requests per second (the replay itself, and a fleet model: R replicas in
parallel, each also spending the measured prefill time on what it prefilled). Beside them, the
break-even chunk size: the time to fetch (MGET, decode, verify) a chunk of n tokens at SmolLM2's
layout from Redis against the time to prefill n tokens on this machine.

Not here: a model on the request path (see ``tests/test_replicas.py`` for real servers), local
eviction (stores are unbounded, as in ``bench traces``), network latency beyond loopback.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from agent.tables import make_console, print_table
from bench.redis_server import RedisServer, RedisServerMissingError
from bench.traces import DEFAULT_CDC, SETS, parse_cdc, parse_sessions
from bench.traces_data import Session, load_sessions
from bench.traces_replay import NAMESPACE
from bench.traces_tokens import Tokenizer, load_tokenizer
from cache.planner import Planner, PlannerConfig
from cache.store import Entry, RedisConfig, RedisTier, record_key
from cache.store.redis_tier import connect

SMOLLM2_BF16_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
BREAK_EVEN_SIZES = (4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_SEED = 0


class Counts(NamedTuple):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    shared_tokens: int  # of the cached, found in Redis
    bytes_read: int
    bytes_written: int
    entries_read: int
    prefilled_tokens: int


class Replica:
    """One replica's planner and local store (key -> n_tokens), and its view of the shared tier."""

    def __init__(self, config: PlannerConfig, shared: RedisTier | None, kv_bytes_per_token: int) -> None:
        self.planner = Planner(NAMESPACE, config)
        self.local: dict[str, int] = {}
        self.shared = shared
        self.kv_bytes = kv_bytes_per_token
        self.busy_s = 0.0
        self.prefilled = 0

    def serve(self, ids: np.ndarray, boundaries: Sequence[int], payload: str) -> tuple[int, int]:
        """Plan, reuse, store; (cached tokens, of those from Redis)."""
        t0 = time.perf_counter()
        plan = self.planner.plan(ids, boundaries)
        keys = [record_key(c.key.hex, "conditioned") for c in plan.chunks]
        missing = [
            k for c, k in zip(plan.chunks, keys, strict=True) if c.status == "miss" and k not in self.local
        ]
        found = self.shared.fetch_many(missing) if self.shared is not None else {}
        cached = shared = 0
        reused = False
        for c, key in zip(plan.chunks, keys, strict=True):
            reused = c.status != "miss" or key in self.local or key in found
            cached += c.n_tokens if reused else 0
            shared += c.n_tokens if key in found else 0
        cached -= int(reused)  # the prompt's last token is always prefilled
        self.planner.commit(plan, ids, payload)
        for c, key in zip(plan.chunks, keys, strict=True):
            if key in self.local:
                continue
            self.local[key] = c.n_tokens
            if self.shared is not None and key not in found:
                kv = torch.zeros(c.n_tokens * self.kv_bytes, dtype=torch.uint8)
                self.shared.submit(key, Entry({"kv": kv}, {"n_tokens": c.n_tokens}, tokens=key))
        if self.shared is not None:
            self.shared.flush()
        self.busy_s += time.perf_counter() - t0
        self.prefilled += len(ids) - cached
        return cached, shared


def replay(
    requests: Sequence[tuple[np.ndarray, tuple[int, ...]]],
    n_replicas: int,
    config: PlannerConfig,
    redis_url: str | None,
    kv_bytes_per_token: int,
) -> tuple[Counts, list[Replica], float]:
    """Every request round-robin over ``n_replicas``; the counts, the replicas and the wall time."""
    tiers: list[RedisTier] = []
    if redis_url is not None:
        connect(RedisConfig(redis_url)).flushdb()
        tiers = [
            RedisTier.from_config(
                RedisConfig(redis_url, ttl_s=0, timeout_s=5, connect_timeout_s=5, queue_entries=4096)
            )
            for _ in range(n_replicas)
        ]
    replicas = [Replica(config, tiers[i] if tiers else None, kv_bytes_per_token) for i in range(n_replicas)]
    cached = shared = tokens = 0
    t0 = time.perf_counter()
    for j, (ids, bounds) in enumerate(requests):
        c, s = replicas[j % n_replicas].serve(ids, bounds, f"r{j}")
        cached, shared, tokens = cached + c, shared + s, tokens + len(ids)
    wall = time.perf_counter() - t0
    stats = [t.stats() for t in tiers]
    for t in tiers:
        t.close()
    counts = Counts(
        len(requests),
        tokens,
        cached,
        shared,
        sum(s.bytes_read for s in stats),
        sum(s.bytes_written for s in stats),
        sum(s.hits for s in stats),
        sum(r.prefilled for r in replicas),
    )
    return counts, replicas, wall


def fields(
    counts: Counts, replicas: list[Replica], wall: float, kv_bytes: int, prefill_s_per_token: float
) -> dict[str, Any]:
    reused = max(counts.cached_tokens, 1)
    overhead = (counts.bytes_read - counts.shared_tokens * kv_bytes) / max(counts.entries_read, 1)
    projected = counts.shared_tokens * SMOLLM2_BF16_BYTES_PER_TOKEN + counts.entries_read * overhead
    fleet_s = max(r.busy_s + r.prefilled * prefill_s_per_token for r in replicas)
    return {
        "requests": counts.requests,
        "prompt_tokens": counts.prompt_tokens,
        "cached_share": counts.cached_tokens / max(counts.prompt_tokens, 1),
        "shared_share": counts.shared_tokens / max(counts.prompt_tokens, 1),
        "redis_bytes_read": counts.bytes_read,
        "redis_bytes_written": counts.bytes_written,
        "redis_read_bytes_per_reused_token": counts.bytes_read / reused,
        "redis_moved_bytes_per_reused_token": (counts.bytes_read + counts.bytes_written) / reused,
        "redis_entry_overhead_bytes": overhead if counts.entries_read else None,
        "smollm2_read_bytes_per_reused_token": projected / reused,
        "replay_requests_per_s": counts.requests / wall,
        "fleet_requests_per_s": counts.requests / fleet_s,
    }


# --- break-even chunk size ----------------------------------------------------------------------


def fetch_times(
    redis_url: str, sizes: Sequence[int], repeats: int = 5, seed: int = DEFAULT_SEED
) -> dict[int, float]:
    """Seconds to fetch, decode and verify one chunk of n tokens at SmolLM2's bf16 layout (best
    of); the chunks' values are drawn from ``seed``."""
    tier = RedisTier.from_config(RedisConfig(redis_url, timeout_s=5, connect_timeout_s=5))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in sizes:
        key = f"breakeven/{n}"
        kv = torch.randn(2, 30, 3, n, 64, generator=g).to(torch.bfloat16)
        tier.submit(key, Entry({"k": kv[0], "v": kv[1]}, {"n_tokens": n}))
        tier.flush()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = tier.fetch_many([key])
            best = min(best, time.perf_counter() - t0)
            if key not in got:
                raise RuntimeError(f"the break-even entry of {n} tokens did not come back")
        out[n] = best
    tier.close()
    return out


def prefill_times(sizes: Sequence[int], repeats: int = 3) -> dict[int, float] | None:
    """Seconds to prefill n tokens from empty on SmolLM2, one thread (best of), None without its
    weights."""
    from agent.adapters.loading import ModelNotFoundError, load_adapter

    try:
        adapter = load_adapter()
    except ModelNotFoundError:
        return None
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as one replica's share of a busy machine; steadier timings
    try:
        with torch.inference_mode():
            adapter.prefill(adapter.text(list(range(100, 132))), adapter.empty_cache(), 0)  # warm-up
            for n in sizes:
                out[n] = _best_prefill(adapter, n, repeats)
    finally:
        torch.set_num_threads(threads)
    return out


def _best_prefill(adapter: Any, n: int, repeats: int) -> float:
    chunk = adapter.text(list(range(100, 100 + n)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        adapter.prefill(chunk, adapter.empty_cache(), 0)
        best = min(best, time.perf_counter() - t0)
    return best


def break_even(fetch: dict[int, float], prefill: dict[int, float]) -> dict[str, Any]:
    """Lines through both timings and where they cross; the smallest measured n where fetching wins."""
    n = np.array(sorted(fetch), dtype=np.float64)
    fb, fa = np.polyfit(n, [fetch[int(x)] for x in n], 1)
    pb, pa = np.polyfit(n, [prefill[int(x)] for x in n], 1)
    crossing = (fa - pa) / (pb - fb) if pb > fb else float("inf")
    wins = [int(x) for x in n if fetch[int(x)] < prefill[int(x)]]
    return {
        "fetch_s": {int(k): v for k, v in fetch.items()},
        "prefill_s": {int(k): v for k, v in prefill.items()},
        "fetch_s_per_token": fb,
        "fetch_latency_s": fa,
        "prefill_s_per_token": pb,
        "prefill_fixed_s": pa,
        "break_even_tokens": max(crossing, 0.0),
        "smallest_measured_size_where_fetch_wins": min(wins) if wins else None,
    }


# --- CLI ----------------------------------------------------------------------------------------


def load_requests(
    args: argparse.Namespace, tokenize: Tokenizer
) -> tuple[list[tuple[np.ndarray, tuple[int, ...]]], dict[str, int]]:
    limits = parse_sessions(args.sessions)
    sessions: list[Session] = []
    per_set = {}
    for name in args.sets.split(","):
        if name not in SETS:
            raise KeyError(f"unknown trace set {name!r}; known: {sorted(SETS)}")
        loaded = load_sessions(SETS[name], args.split)[: limits.get(name, limits.get("*", 0)) or None]
        per_set[name] = len(loaded)
        sessions += loaded
    out = []
    for s in sessions:
        for request in s.requests:
            tok = tokenize(request)
            out.append((tok.ids, tok.boundaries))
    return out, per_set


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kamera bench replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    ap.add_argument("--sets", default="tau,swe,mini")
    ap.add_argument("--sessions", default="0", help="at most N sessions per set, or set=N,... (0: all)")
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--cdc", default=DEFAULT_CDC, help="min,avg,max,window in tokens")
    ap.add_argument("--tokenizer", default="model", choices=["model", "word"])
    ap.add_argument("--kv-bytes-per-token", type=int, default=16, help="synthetic entry size per token")
    ap.add_argument(
        "--redis-url", default=None, help="a running Redis (flushed!); default: start redis-server"
    )
    ap.add_argument("--no-break-even", action="store_true")
    ap.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="draws the break-even chunks' synthetic KV values"
    )
    args = ap.parse_args(argv)
    console = make_console(stderr=True)
    tokenize, _ = load_tokenizer(args.tokenizer)
    requests, per_set = load_requests(args, tokenize)
    console.log(f"{len(requests)} requests, {sum(len(r[0]) for r in requests)} prompt tokens")
    config = PlannerConfig("gear", parse_cdc(args.cdc))
    server, redis_note = None, None
    if args.redis_url is None:
        try:
            server = RedisServer()
        except RedisServerMissingError as e:  # the isolated rows need no Redis
            redis_note = f"shared rows and break-even left out: {e}, and no --redis-url"
            console.log(redis_note)
    url = server.start() if server is not None else args.redis_url
    try:
        timing: dict[str, Any] = {}
        prefill_s_per_token = 0.0
        if not args.no_break_even and url is not None:
            prefill = prefill_times(BREAK_EVEN_SIZES)
            if prefill is not None:
                timing = break_even(fetch_times(url, BREAK_EVEN_SIZES, seed=args.seed), prefill)
                prefill_s_per_token = timing["prefill_s_per_token"]
        rows: dict[str, Any] = {}
        for r in (int(x) for x in args.replicas.split(",")):
            for shared in (False, True) if url is not None else (False,):
                counts, replicas, wall = replay(
                    requests, r, config, url if shared else None, args.kv_bytes_per_token
                )
                name = f"{r}x {'shared' if shared else 'isolated'}"
                rows[name] = {
                    "replicas": r,
                    "shared": shared,
                    **fields(counts, replicas, wall, args.kv_bytes_per_token, prefill_s_per_token),
                }
                console.log(f"{name}: cached {rows[name]['cached_share']:.3f} in {wall:.1f}s")
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    one = next((v["cached_share"] for v in rows.values() if v["replicas"] == 1 and not v["shared"]), None)
    for v in rows.values():
        v["of_one_replica"] = v["cached_share"] / one if one else None
    result = {
        "config": {
            "split": args.split,
            "sets": per_set,
            "cdc": args.cdc,
            "tokenizer": args.tokenizer,
            "kv_bytes_per_token": args.kv_bytes_per_token,
            "smollm2_bf16_bytes_per_token": SMOLLM2_BF16_BYTES_PER_TOKEN,
            "clock": "wall time, this machine",
            "seed": args.seed,
            **({"redis": redis_note} if redis_note else {}),
        },
        "rows": rows,
        "break_even": timing,
    }
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=float))
    print_tables(make_console(), result)
    return 0


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_tables(console: Console, result: dict[str, Any]) -> None:
    table = Table(title=f"Replicas on agent traces ({result['config']['split']} half), round-robin")
    cols = (
        ("config", None),
        ("cached", ".3f"),
        ("of 1 replica", ".3f"),
        ("from Redis", ".3f"),
        ("Redis B read / reused tok", ".1f"),
        ("B moved / reused tok", ".1f"),
        ("SmolLM2 B read / reused tok", ".0f"),
        ("replay req/s", ".1f"),
        ("fleet req/s", ".2f"),
    )
    keys = (
        None,
        "cached_share",
        "of_one_replica",
        "shared_share",
        "redis_read_bytes_per_reused_token",
        "redis_moved_bytes_per_reused_token",
        "smollm2_read_bytes_per_reused_token",
        "replay_requests_per_s",
        "fleet_requests_per_s",
    )
    for name, _ in cols:
        table.add_column(name, justify="right")
    for name, row in result["rows"].items():
        table.add_row(
            name, *(_f(row[k], spec or "") for k, (_, spec) in zip(keys[1:], cols[1:], strict=True))
        )
    print_table(console, table)
    be = result["break_even"]
    if be:
        t = Table(title="Fetch one chunk from Redis (SmolLM2 bf16 layout) against prefilling it")
        for col in ("tokens", "fetch ms", "prefill ms"):
            t.add_column(col, justify="right")
        for n in sorted(be["fetch_s"], key=int):
            t.add_row(str(n), f"{1e3 * be['fetch_s'][n]:.2f}", f"{1e3 * be['prefill_s'][n]:.2f}")
        print_table(console, t)
        console.print(
            f"break-even chunk size: {be['break_even_tokens']:.1f} tokens (fit); smallest measured size "
            f"where fetching wins: {be['smallest_measured_size_where_fetch_wins']}"
        )
