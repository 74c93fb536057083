"""Two `kamera serve` processes on one store directory reuse each other's entries, and answer as a
full prefill does (`bench/store_share.py`, on the tiny random model and made-up conversations).

Each turn of a conversation goes to the other server than its turn before (a stateless balancer),
so each turn's exact prefix was computed by the other process and can only be found through the
shared directory. The reference of every request is the same request under a fresh ``cache_salt``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.store_share import Conversation, Server, load_conversations, measure, parser

SYSTEM = " ".join(f"Rule {i}: a crate of kind {i % 5} ships on day {(i * 7) % 11}." for i in range(24))


def conversation(n: int, turns: int = 3) -> Conversation:
    doc = " ".join(f"Manifest {n} row {i}: {(i * (n + 2)) % 13} crates." for i in range(16))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{doc} Row 1?"}]
    requests = []
    for t in range(turns):
        requests.append([dict(m) for m in messages])
        messages += [
            {"role": "assistant", "content": f"Row {t + 1} holds {(t + 1) * (n + 2) % 13} crates."},
            {"role": "user", "content": f"And row {t + 2}?"},
        ]
    return Conversation(f"manifest-{n}", tuple(requests))


@pytest.mark.slow
def test_second_process_reuses_the_first_ones_entries(tmp_path: Path) -> None:
    conv = conversation(0)
    a = Server(tmp_path, model="tiny:llama-gqa", host_bytes=1 << 30, disk_bytes=256 << 20, mode="exact")
    b = Server(tmp_path, model="tiny:llama-gqa", host_bytes=1 << 30, disk_bytes=256 << 20, mode="exact")
    try:
        a.wait_ready()
        b.wait_ready()
        first = a.ask(conv.requests[0], 8)
        a.settle()
        hits_before = b.metrics().get('kamera_store_hits_total{tier="disk"}', 0)
        second = b.ask(conv.requests[1], 8)
        disk_hits = b.metrics().get('kamera_store_hits_total{tier="disk"}', 0) - hits_before
        full = [b.ask(r, 8, salt=f"full-prefill-{i}") for i, r in enumerate(conv.requests[:2])]
    finally:
        a.stop()
        b.stop()
    assert first.cached_tokens == 0
    assert second.cached_tokens >= 0.5 * second.prompt_tokens  # the first request's KV, from A
    assert disk_hits > 0
    assert [first.tokens, second.tokens] == [f.tokens for f in full]


@pytest.mark.slow
def test_shared_directory_keeps_one_process_reuse(tmp_path: Path) -> None:
    args = parser().parse_args(
        ["--model", "tiny:llama-gqa", "--route", "request", "--disk-bytes", str(256 << 20)]
    )
    rows = measure([conversation(n) for n in range(3)], args, tmp_path)
    one, shared, separate = rows["one"], rows["shared"], rows["separate"]
    print(
        f"\nreused: one {one['reused_share']:.3f}, shared {shared['reused_share']:.3f}, "
        f"separate {separate['reused_share']:.3f}; disk hits in shared {shared['disk_hits']}"
    )
    for row in rows.values():
        assert row["equal_to_full_prefill"] == row["requests"]
        assert row["directories_clean"], row["problems"]
        assert row["host_misfiled"] + row["disk_misfiled"] == 0
    assert shared["reused_share"] >= one["reused_share"]
    assert shared["reused_share"] > separate["reused_share"]
    assert shared["disk_hits"] > 0
    assert shared["lost_entries"] == 0


def test_conversations_of_the_trace_sets_load() -> None:
    try:
        convs = load_conversations("tau", "dev", 2, 2)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert [len(c.requests) for c in convs] == [2, 2]
    assert all(m["role"] in ("system", "user", "assistant") for c in convs for r in c.requests for m in r)
