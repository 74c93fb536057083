from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.cdc import CDCConfig, chunk_bounds
from cache.index import ContentIndex, RadixKey, RadixTree, Segment, fingerprint
from cache.keys import ContentKey, Namespace, token_key
from cache.planner import Plan, PlannedChunk, Planner, PlannerConfig

NS = Namespace("m", "bf16")


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_radix_match_and_segments() -> None:
    t = RadixTree()
    assert t.insert(RadixKey([1, 2, 3, 4]), "A") == (0, 4)
    assert t.insert(RadixKey([1, 2, 9]), "B") == (2, 1)  # splits the edge after [1, 2]
    assert t.total_tokens == 5
    m = t.match_prefix(RadixKey([1, 2, 3, 7]))
    assert m.matched_len == 3
    assert m.segments == (Segment("A", 0, 2), Segment("A", 2, 1))
    assert m.payload == "A"
    m = t.match_prefix(RadixKey([1, 2, 9, 9]))
    assert (m.matched_len, m.segments) == (3, (Segment("A", 0, 2), Segment("B", 2, 1)))
    assert m.node is not None
    assert m.node.depth == 3
    assert t.match_prefix(RadixKey([5])) == (0, None, ())
    # A namespace is its own tree.
    assert t.match_prefix(RadixKey([1, 2, 3], extra_key=b"tenant-b")).matched_len == 0


def test_radix_payloads_below_a_match_are_the_sequences_that_go_on_past_it() -> None:
    """Where a match ends, the stored sequences holding it: the one that made the edge, then
    those under it, nearest first, the last used first among siblings; each once."""
    t = RadixTree()
    t.insert(RadixKey([1, 2, 3]), "A")
    t.insert(RadixKey([1, 2, 3, 4, 5]), "B")  # goes on past A
    t.insert(RadixKey([1, 2, 3, 4, 6, 7]), "C")  # splits B's edge after [4]
    t.insert(RadixKey([1, 2, 3, 8]), "D")
    t.match_prefix(RadixKey([1, 2, 3, 8]))  # D used last
    m = t.match_prefix(RadixKey([1, 2, 9]))  # ends inside A's edge
    assert m.matched_len == 2
    assert t.payloads_below(m.node) == ("A", "D", "B", "C")
    assert t.payloads_below(m.node, limit=2) == ("A", "D")
    m = t.match_prefix(RadixKey([1, 2, 3, 4, 9]))  # ends at the node B's edge was split at
    assert t.payloads_below(m.node) == ("B", "C")
    assert t.payloads_below(t.match_prefix(RadixKey([5])).node) == ()


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=8),
    query=st.lists(st.integers(0, 3), max_size=12),
)
def test_radix_match_is_longest_common_prefix(seqs: list[list[int]], query: list[int]) -> None:
    t = RadixTree()
    for i, s in enumerate(seqs):
        t.insert(RadixKey(s), i)
    m = t.match_prefix(RadixKey(query))
    assert m.matched_len == max((lcp(s, query) for s in seqs), default=0)
    # Segments cover the match, and each names a sequence that really holds those tokens there.
    assert sum(seg.length for seg in m.segments) == m.matched_len
    pos = 0
    for seg in m.segments:
        assert isinstance(seg.payload, int)
        src = seqs[seg.payload]
        assert src[seg.offset : seg.offset + seg.length] == query[pos : pos + seg.length]
        assert seg.offset == pos
        pos += seg.length
    assert t.total_tokens == len({tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)})


def test_radix_lru_evicts_least_recent_leaves_first() -> None:
    t = RadixTree("lru")
    t.insert(RadixKey([1, 2, 3]), "a")
    t.insert(RadixKey([1, 2, 4, 5]), "b")
    t.insert(RadixKey([7, 8]), "c")
    t.match_prefix(RadixKey([1, 2, 3]))  # "a" most recent now; "b" and "c" older
    r = t.evict(2)
    assert r.evicted_tokens == 2
    assert r.segments == (Segment("b", 2, 2),)
    r = t.evict(1)
    assert r.segments == (Segment("c", 0, 2),)
    assert t.match_prefix(RadixKey([1, 2, 3])).matched_len == 3
    r = t.evict(10)  # leaf [3] then its parent [1, 2], which became a leaf
    assert r.evicted_tokens == 3
    assert t.total_tokens == 0
    with pytest.raises(KeyError, match="eviction policy"):
        RadixTree("random")


def test_radix_lfu_keeps_frequent_leaves() -> None:
    t = RadixTree("lfu")
    t.insert(RadixKey([1]), "a")
    t.insert(RadixKey([2]), "b")
    for _ in range(3):
        t.match_prefix(RadixKey([1]))
    t.match_prefix(RadixKey([2]))  # most recent, but less frequent
    assert t.evict(1).segments == (Segment("b", 0, 1),)


@pytest.mark.parametrize("verify", ["tokens", "fingerprint"])
def test_content_index_verifies_hits_and_refuses_forged_keys(verify: str) -> None:
    idx = ContentIndex(verify)  # type: ignore[arg-type]
    k = token_key(NS, [1, 2, 3])
    assert idx.insert(k, [1, 2, 3], "h1", source_start=10).status == "miss"
    hit = idx.lookup(k, np.array([1, 2, 3]))
    assert hit.status == "hit"
    assert hit.entry is not None
    assert (hit.entry.payload, hit.entry.source_start, hit.entry.n_tokens) == ("h1", 10, 3)
    # A forged collision: the same key presented with other tokens.
    assert idx.lookup(k, [1, 2, 4]) == ("collision", None)
    assert idx.insert(k, [9, 9], "evil").status == "collision"
    assert idx.insert(k, [1, 2, 3], "h2").entry.payload == "h1"  # type: ignore[union-attr]
    assert idx.lookup(token_key(NS, [5]), [5]).status == "miss"
    s = idx.stats
    assert (s.hits, s.misses, s.collisions, s.inserts) == (1, 1, 2, 1)
    assert len(idx.lookup(k, [1, 2, 3]).entry.check) == (24 if verify == "tokens" else 16)  # type: ignore[union-attr]


@pytest.mark.parametrize("verify", ["tokens", "fingerprint"])
def test_content_index_batch_calls_equal_one_at_a_time(verify: str) -> None:
    rng = np.random.default_rng(5)
    tok = rng.integers(0, 1000, 60)
    b = [0, 7, 9, 20, 33, 34, 60]
    sp = list(pairwise(b))
    keys = [token_key(NS, tok[s:e]) for s, e in sp]
    one, many = ContentIndex(verify), ContentIndex(verify)  # type: ignore[arg-type]
    s, e = sp[2]
    for idx in (one, many):  # a forged entry: keys[2] holding other tokens
        idx.insert(keys[2], tok[s:e] + 1, "evil")
    first = [one.insert(k, tok[s:e], "p", s) for k, (s, e) in zip(keys[:3], sp[:3], strict=True)]
    assert many.insert_many(keys[:3], tok, sp[:3], "p") == first
    want = [one.lookup(k, tok[s:e]) for k, (s, e) in zip(keys, sp, strict=True)]
    assert many.lookup_many(keys, tok, sp) == want
    assert [r.status for r in want] == ["hit", "hit", "collision", "miss", "miss", "miss"]
    assert one.stats == many.stats
    assert list(one._entries) == list(many._entries)  # same LRU order


def test_a_refreshing_insert_points_an_entry_at_the_latest_payload() -> None:
    """Without refresh the first payload stays; with it, the same tokens point where they were
    seen last (and that entry is the most recently used); other tokens are still refused."""
    tok = np.arange(40)
    key = token_key(NS, tok[10:20])
    idx = ContentIndex()
    idx.insert(key, tok[10:20], "first", 10)
    idx.insert(token_key(NS, tok[:5]), tok[:5], "x", 0)
    assert idx.insert_many([key], tok, [(10, 20)], "second")[0].entry.payload == "first"
    shifted = np.concatenate([[99] * 5, tok])  # the same ten tokens, five later
    got = idx.insert_many([key], shifted, [(15, 25)], "third", refresh=True)[0]
    assert got.status == "hit"
    assert (got.entry.payload, got.entry.source_start) == ("third", 15)
    assert idx.lookup(key, tok[10:20]).entry.payload == "third"
    assert list(idx._entries)[-1] == key.digest
    assert idx.insert_many([key], tok + 1, [(10, 20)], "evil", refresh=True)[0].status == "collision"
    assert idx.lookup(key, tok[10:20]).entry.payload == "third"


def test_content_index_lru_bound() -> None:
    idx = ContentIndex(max_entries=2)
    ks = [token_key(NS, [i]) for i in range(3)]
    idx.insert(ks[0], [0], "a")
    idx.insert(ks[1], [1], "b")
    idx.lookup(ks[0], [0])
    idx.insert(ks[2], [2], "c")
    assert ks[1] not in idx
    assert ks[0] in idx
    assert idx.stats.evictions == 1
    assert len(idx) == 2
    assert fingerprint([1, 2]) != fingerprint([2, 1])
    with pytest.raises(ValueError, match="max_entries"):
        ContentIndex(max_entries=0)


CFG = PlannerConfig(cdc=CDCConfig(min_size=8, avg_size=32, max_size=128))


def messages(rng: np.random.Generator, lengths: list[int]) -> list[np.ndarray]:
    return [rng.integers(0, 30_000, n) for n in lengths]


def join(msgs: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    starts = np.cumsum([0, *[len(m) for m in msgs[:-1]]]).tolist()
    return np.concatenate(msgs), starts


def reference_plan(pl: Planner, tok: np.ndarray, starts: list[int]) -> Plan:
    """The planner's contract, chunk by chunk: one key and one lookup per chunk."""
    match = pl.radix.match_prefix(RadixKey(tok, NS.encoded))
    p = match.matched_len
    out = []
    for s, e in pairwise(chunk_bounds(tok, pl.config.cdc, starts).tolist()):
        if e <= p:
            out.append(PlannedChunk(s, e, token_key(NS, tok[s:e]), "prefix-hit", s, None))
            continue
        if s < p:
            whole = pl.index.lookup(token_key(NS, tok[s:e]), tok[s:e]).entry
            out.append(PlannedChunk(s, p, token_key(NS, tok[s:p]), "prefix-hit", s, None))
            if whole is not None:
                src = whole.source_start + p - s
                out.append(PlannedChunk(p, e, token_key(NS, tok[p:e]), "relocated-hit", src, whole.payload))
                continue
            s = p
        entry = pl.index.lookup(token_key(NS, tok[s:e]), tok[s:e]).entry
        if entry is None:
            out.append(PlannedChunk(s, e, token_key(NS, tok[s:e]), "miss", None, None))
        else:
            key = token_key(NS, tok[s:e])
            out.append(PlannedChunk(s, e, key, "relocated-hit", entry.source_start, entry.payload))
    return Plan(tuple(out), p, len(tok), match.segments, pl.radix.payloads_below(match.node) if p else ())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n_requests=st.integers(1, 6))
def test_planner_equals_the_chunk_by_chunk_reference(seed: int, n_requests: int) -> None:
    """Requests that drop, rewrite and add messages, planned and committed in turn. Messages
    share a 3-token header, so after a drop the exact prefix runs into the next message and
    ends inside a chunk stored whole before."""
    rng = np.random.default_rng(seed)
    header = rng.integers(0, 30_000, 3)

    def message(n: int) -> np.ndarray:
        return np.concatenate([header, rng.integers(0, 30_000, n)])

    msgs = [message(int(n)) for n in rng.integers(1, 120, 6)]
    fast, ref = Planner(NS, CFG), Planner(NS, CFG)
    for i in range(n_requests):
        if rng.random() < 0.4 and len(msgs) > 2:
            del msgs[int(rng.integers(1, len(msgs) - 1))]
        if rng.random() < 0.5:  # rewrite a stretch: the exact prefix may end inside a chunk
            m = msgs[int(rng.integers(0, len(msgs)))]
            j = int(rng.integers(0, len(m)))
            m[j : j + int(rng.integers(1, 20))] = rng.integers(0, 30_000)
        msgs.append(message(int(rng.integers(1, 90))))
        tok, starts = join(msgs)
        got, want = fast.plan(tok, starts), reference_plan(ref, tok, starts)
        assert got == want
        assert fast.commit(got, tok, f"r{i}") == ref.commit(want, tok, f"r{i}")
        assert fast.index.stats == ref.index.stats


def test_planner_first_request_misses_then_replay_is_prefix_hit() -> None:
    rng = np.random.default_rng(0)
    tok, starts = join(messages(rng, [300, 120, 80]))
    pl = Planner(NS, CFG)
    plan = pl.plan(tok, starts)
    assert plan.tokens_by_status() == {"prefix-hit": 0, "relocated-hit": 0, "miss": 500}
    bounds = chunk_bounds(tok, CFG.cdc, starts).tolist()
    assert [(c.start, c.end) for c in plan.chunks] == list(pairwise(bounds))
    assert all(c.key == token_key(NS, tok[c.start : c.end]) for c in plan.chunks)
    res = pl.commit(plan, tok, "req0")
    assert (res.new_prefix_tokens, res.new_chunks, res.collisions) == (500, len(plan.chunks), 0)
    again = pl.plan(tok, starts)
    assert again.tokens_by_status() == {"prefix-hit": 500, "relocated-hit": 0, "miss": 0}
    assert again.prefix == (Segment("req0", 0, 500),)


def test_planner_changed_system_prompt_recovers_later_messages_by_content() -> None:
    rng = np.random.default_rng(1)
    sys_a, sys_b = rng.integers(0, 30_000, 200), rng.integers(0, 30_000, 207)
    rest = messages(rng, [150, 90, 400])
    pl = Planner(NS, CFG)
    tok_a, st_a = join([sys_a, *rest])
    pl.commit(pl.plan(tok_a, st_a), tok_a, "A")
    new_msg = rng.integers(0, 30_000, 60)
    tok_b, st_b = join([sys_b, *rest, new_msg])
    plan = pl.plan(tok_b, st_b)
    by = plan.tokens_by_status()
    assert plan.prefix_len == 0
    assert by == {"prefix-hit": 0, "relocated-hit": 640, "miss": 207 + 60}
    for c in plan.chunks:
        if c.status == "relocated-hit":
            assert c.source_start is not None
            assert c.payload == "A"
            assert c.delta == 7  # the new system prompt is 7 tokens longer
            assert (tok_a[c.source_start : c.source_start + c.n_tokens] == tok_b[c.start : c.end]).all()


def test_planner_truncated_history_is_relocated_and_straddling_chunk_is_split() -> None:
    rng = np.random.default_rng(2)
    sys, m1, m2, m3 = messages(rng, [100, 130, 170, 90])
    pl = Planner(NS, CFG)
    tok_a, st_a = join([sys, m1, m2, m3])
    pl.commit(pl.plan(tok_a, st_a), tok_a, "A")
    # Window: drop m1; m2, m3 reappear 130 tokens earlier.
    tok_b, st_b = join([sys, m2, m3])
    plan = pl.plan(tok_b, st_b)
    assert plan.prefix_len == 100 + lcp(m1.tolist(), m2.tolist())
    assert plan.tokens_by_status() == {"prefix-hit": plan.prefix_len, "relocated-hit": 260, "miss": 0}
    assert {c.delta for c in plan.chunks if c.status == "relocated-hit"} == {-130}
    # A prompt that diverges inside a chunk: the chunk is cut at the end of the exact prefix.
    tok_c = tok_a.copy()
    tok_c[150] += 1
    plan_c = pl.plan(tok_c, st_a)
    assert plan_c.prefix_len == 150
    assert any(c.end == 150 and c.status == "prefix-hit" for c in plan_c.chunks)
    assert any(c.start == 150 and c.status == "miss" for c in plan_c.chunks)


def test_planner_isolates_tenants_and_refuses_collisions() -> None:
    rng = np.random.default_rng(3)
    tok, starts = join(messages(rng, [64, 64]))
    shared_radix, shared_index = RadixTree(), ContentIndex()
    a = Planner(Namespace("m", "bf16", tenant_salt="a"), CFG, shared_radix, shared_index)
    b = Planner(Namespace("m", "bf16", tenant_salt="b"), CFG, shared_radix, shared_index)
    a.commit(a.plan(tok, starts), tok, "A")
    assert b.plan(tok, starts).tokens_by_status()["miss"] == 128
    # Forge: register other tokens under the key b will compute for its first chunk.
    plan_b = b.plan(tok, starts)
    first = plan_b.chunks[0]
    shared_index.insert(first.key, np.zeros(first.n_tokens, dtype=np.int64), "forged")
    assert b.plan(tok[: first.end], [0]).chunks[0].status == "miss"
    assert shared_index.stats.collisions == 1
    res = b.commit(plan_b, tok, "B")
    assert res.collisions == 1
    assert res.new_chunks == len(plan_b.chunks) - 1
    with pytest.raises(ValueError, match="plan covers"):
        b.commit(plan_b, tok[:10], "B")
    assert isinstance(first.key, ContentKey)


def test_planner_straddling_chunk_tail_is_found_inside_the_stored_chunk() -> None:
    rng = np.random.default_rng(4)
    sys, m1, m2 = messages(rng, [100, 130, 170])
    m2[:5] = m1[:5]  # a shared message header: the exact prefix runs 5 tokens into m2
    pl = Planner(NS, CFG)
    tok_a, st_a = join([sys, m1, m2])
    pl.commit(pl.plan(tok_a, st_a), tok_a, "A")
    tok_b, st_b = join([sys, m2])
    plan = pl.plan(tok_b, st_b)
    assert plan.prefix_len == 105
    assert plan.tokens_by_status() == {"prefix-hit": 105, "relocated-hit": 170 - 5, "miss": 0}
    tail = next(c for c in plan.chunks if c.start == 105)
    assert tail.status == "relocated-hit"
    assert tail.source_start == 230 + 5
    assert tail.delta == -130
    assert tail.key == token_key(NS, tok_b[105 : tail.end])
