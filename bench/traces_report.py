"""The traces report: per-policy JSON records (rates, plan time, store bytes) and the tables.

Not here: the replay (``traces_replay.py``), consistency (``traces_consistency.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.tables import print_table as draw
from bench.traces_consistency import MODES, ORACLE_MODES
from bench.traces_replay import PolicyResult, RequestStat

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
    draw(console, table)
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
                    f"{mode} (oracle)" if mode in ORACLE_MODES else mode,
                    _fmt(m["greedy_match"], ".2f"),
                    _fmt(m["kl_median"], ".2e"),
                    _fmt(m["kl_max"], ".2e"),
                )
        draw(console, ct)
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
    draw(console, tt)
    ref = result["reference"]
    if ref:
        console.print(
            f"mini-swe-agent: provider prefix cache hit share {_fmt(ref['mini_swe_agent_cached_share'])}; "
            f"ours (append) prefix {_fmt(ref.get('ours_append_prefix_hit_rate'))}, "
            f"content {_fmt(ref.get('ours_append_content_hit_rate'))}"
        )
