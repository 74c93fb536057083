"""The Redis tier on fakeredis: round trips, verification, faults, the breaker, and two prompt
caches that share one Redis as two replicas would. The real server is in test_replicas.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from agent.engine import reuse
from agent.engine.chat import Message
from agent.engine.prompt import PromptKeys
from agent.engine.prompt_cache import PromptCache
from cache.store import Entry, MemoryTier, RedisConfig, RedisTier, TieredStore
from cache.store.breaker import CircuitBreaker
from cache.store.codec import decode_entry
from tests.test_prompt_cache import CONFIG, DOC, full_prefill_logits, llama, prompt_of  # noqa: F401

fakeredis = pytest.importorskip("fakeredis")
URL = "redis://127.0.0.1:6379/0"


def entry(seed: int, n: int = 4) -> Entry:
    g = torch.Generator().manual_seed(seed)
    return Entry({"k": torch.randn(2, 1, n, 8, generator=g)}, {"n_tokens": n})


class CountingClient:
    """A fakeredis client that counts the commands sent (a pipeline counts once)."""

    def __init__(self, server: Any) -> None:
        self.inner = fakeredis.FakeRedis(server=server)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if callable(attr):
            self.calls.append(name)
        return attr


class DownClient:
    """Every command fails as a Redis that is gone would."""

    def __getattr__(self, name: str) -> Any:
        import redis

        def fail(*args: Any, **kwargs: Any) -> Any:
            raise redis.ConnectionError("connection refused")

        return fail


def tier(client: Any, **kw: Any) -> RedisTier:
    return RedisTier(client, RedisConfig(URL, **kw))


def test_damaged_or_misfiled_values_are_refused() -> None:
    server = fakeredis.FakeServer()
    raw = fakeredis.FakeRedis(server=server)
    t = tier(fakeredis.FakeRedis(server=server))
    for key in ("a", "b", "c", "d"):
        t.submit(key, entry(ord(key)))
    t.flush()
    good = raw.get("kamera:a")
    flipped = bytearray(good)
    flipped[-3] ^= 0xFF
    raw.set("kamera:b", good)  # intact, but the entry of another key
    raw.set("kamera:c", bytes(flipped))
    raw.set("kamera:d", good[: len(good) // 2])  # half-written
    raw.set("kamera:e", b"\x80\x04pickle")
    found = t.fetch_many(["a", "b", "c", "d", "e"])
    assert sorted(found) == ["a"]
    torch.testing.assert_close(found["a"].tensors["k"], entry(ord("a")).tensors["k"], atol=0, rtol=0)
    s = t.stats()
    assert (s.hits, s.misfiled, s.corrupt_dropped) == (1, 1, 3)
    t.close()


def test_config_validation_and_redacted_url() -> None:
    with pytest.raises(ValueError, match="redis url"):
        RedisConfig("http://x")
    with pytest.raises(ValueError, match="timeouts"):
        RedisConfig(URL, timeout_s=0)
    assert RedisConfig("rediss://user:secret@h:6380/1").safe_url == "rediss://user:***@h:6380/1"


def test_fetch_is_one_round_trip_and_writes_are_background() -> None:
    server = fakeredis.FakeServer()
    client = CountingClient(server)
    t = tier(client, ttl_s=60)
    for i in range(5):
        assert t.submit(f"k{i}", entry(i))
    assert t.flush()
    assert client.inner.ttl("kamera:k0") > 0
    client.calls.clear()
    found = t.fetch_many([f"k{i}" for i in range(8)])
    assert sorted(found) == [f"k{i}" for i in range(5)]
    assert client.calls == ["mget"]
    s = t.stats()
    assert (s.hits, s.misses, s.corrupt_dropped) == (5, 3, 0)
    assert s.bytes_read > 0
    t.close()


def test_corrupt_entry_is_refused_and_deleted() -> None:
    server = fakeredis.FakeServer()
    raw = fakeredis.FakeRedis(server=server)
    t = tier(fakeredis.FakeRedis(server=server))
    t.submit("k", entry(1))
    t.flush()
    value = bytearray(raw.get("kamera:k"))
    value[-1] ^= 1
    raw.set("kamera:k", bytes(value))
    assert t.fetch_many(["k"]) == {}
    assert t.stats().corrupt_dropped == 1
    t.flush()
    assert raw.get("kamera:k") is None  # dropped, so no replica trips on it again
    t.close()


def test_oversized_entries_are_not_written() -> None:
    server = fakeredis.FakeServer()
    t = tier(fakeredis.FakeRedis(server=server), max_entry_bytes=64)
    t.submit("big", entry(2, n=64))
    t.flush()
    assert t.health().writes_refused == 1
    assert fakeredis.FakeRedis(server=server).dbsize() == 0
    t.close()


def test_redis_down_costs_hits_and_opens_the_breaker() -> None:
    t = tier(DownClient(), failures_to_open=2, retry_after_s=60)
    assert t.fetch_many(["a"]) == {}
    assert t.fetch_many(["a"]) == {}
    assert t.health().state == "open"
    assert t.fetch_many(["a", "b"]) == {}  # not even asked
    assert t.stats().misses == 4
    t.submit("a", entry(0))
    t.flush()
    assert t.health().writes_dropped == 1
    assert "connection refused" in (t.health().last_error or "")
    t.close()


def test_full_write_queue_drops_instead_of_waiting() -> None:
    t = tier(DownClient(), queue_entries=1, failures_to_open=1, retry_after_s=60)
    t.breaker.failure("down")
    results = [t.submit(f"k{i}", entry(i)) for i in range(50)]
    assert not all(results)  # some were dropped at once, none blocked
    t.close()


def test_breaker_retries_after_the_delay() -> None:
    now = [0.0]
    b = CircuitBreaker(failures_to_open=2, retry_after_s=5, clock=lambda: now[0])
    b.failure("x")
    assert b.state == "closed"
    assert b.allow()
    b.failure("x")
    assert b.state == "open"
    assert not b.allow()
    now[0] = 5.0
    assert b.allow()  # the one trial
    assert not b.allow()
    b.failure("still down")
    assert b.state == "open"
    assert b.opened_total == 2
    now[0] = 10.0
    assert b.allow()
    b.success()
    assert b.state == "closed"
    assert b.allow()


def test_store_prefetch_promotes_into_memory() -> None:
    server = fakeredis.FakeServer()

    def store() -> TieredStore:
        shared = tier(fakeredis.FakeRedis(server=server))
        return TieredStore([MemoryTier("host", "cpu", 1 << 20)], shared=shared)

    a, b = store(), store()
    a.put("x", entry(3))
    a.shared.flush()  # type: ignore[union-attr]
    assert b.get("x") is None  # get never waits on the network
    assert b.prefetch(["x", "y"]) == {"x"}
    got = b.get("x")
    assert got is not None
    torch.testing.assert_close(got.tensors["k"], entry(3).tensors["k"], atol=0, rtol=0)
    stats = b.stats()
    assert stats.tier("host").promotions == 1
    assert (stats.tier("redis").hits, stats.tier("redis").misses) == (1, 1)
    assert b.prefetch(["x"]) == frozenset()  # held locally now: not asked again
    a.close()
    b.close()


def replica(adapter: Any, server: Any, **kw: Any) -> PromptCache:
    shared = tier(fakeredis.FakeRedis(server=server), **kw)
    # no cap: a random model's repairs leave more than the guard's cap would let it decode on, and
    # what is checked here is where the reused KV came from
    config = dataclasses.replace(CONFIG, repair_margin_cap=0.0)
    return PromptCache(adapter, TieredStore([MemoryTier("host", "cpu", 64 << 20)], shared=shared), config)


def test_replica_reuses_what_another_prefilled(llama: Any) -> None:  # noqa: F811
    server = fakeredis.FakeServer()
    a, b = replica(llama, server), replica(llama, server)
    first = [Message("system", ("You are terse.",)), Message("user", (DOC, "Sum?"))]
    a.commit(a.prepare(prompt_of(a, first)))
    a.store.shared.flush()  # type: ignore[union-attr]
    moved = [Message("system", ("You are a careful assistant. Today is Monday.",)), *first[1:]]
    prompt = prompt_of(b, moved)
    warm = b.prepare(prompt)
    u = warm.usage
    assert u.shared_tokens >= 0.5 * prompt.n_tokens, u
    assert u.shared_tokens <= u.relocated_tokens + u.prefix_tokens
    assert u.prefilled_tokens + u.cached_tokens == prompt.n_tokens
    b.commit(warm)
    # another tenant computes other keys: nothing comes from the shared tier
    other = b.prepare(prompt_of(b, moved), tenant_salt="bob")
    assert other.usage.cached_tokens == 0
    assert other.usage.shared_tokens == 0
    # and the reused KV is the stored KV, rotated: logits stay close to a full prefill
    reference = full_prefill_logits(llama, prompt)
    assert torch.softmax(warm.logits, -1).sub(torch.softmax(reference, -1)).abs().max() < 0.05


def test_a_replica_reuses_to_the_token_what_another_prefilled(llama: Any) -> None:  # noqa: F811
    """Two replicas share only Redis: the second prompt parts from the first inside a segment,
    and the replica that never saw the first brings in its pointers and their rows in the
    prefetch, and reuses it exactly to where they part: the full prefill's logits."""
    server = fakeredis.FakeServer()
    a, b = replica(llama, server), replica(llama, server)
    first = prompt_of(
        a, [Message("system", ("You are terse.",)), Message("user", (DOC, "Sum it up in a line."))]
    )
    a.commit(a.prepare(first, mode="exact"))
    a.store.shared.flush()  # type: ignore[union-attr]
    second = prompt_of(
        b, [Message("system", ("You are terse.",)), Message("user", (DOC, "List three items."))]
    )
    parted = int(
        torch.nonzero(torch.as_tensor(first.units[: second.n_tokens] != second.units[: first.n_tokens]))[0]
    )
    assert parted % CONFIG.block_tokens
    warm = b.prepare(second, mode="exact")
    assert warm.usage.prefix_tokens == parted
    assert warm.usage.shared_tokens == 0 or warm.usage.shared_tokens <= parted
    assert torch.equal(warm.logits, b.prepare(second, "reference", mode="exact").logits)


def test_a_replica_follows_rows_stored_from_inside_a_segment(llama: Any) -> None:  # noqa: F811
    """The first replica reused a prompt to the token and stored the rest of that segment from
    where it began; the second, sharing only Redis, fetches that row when its walk reaches it
    and goes on through the whole segments after: exact to where its prompt parts."""
    import random

    from agent.engine.chat import TextPiece
    from agent.engine.prompt_cache import build_prompt

    rng = random.Random(12)
    server = fakeredis.FakeServer()
    a, b = replica(llama, server), replica(llama, server)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    def text(pc: PromptCache, tokens: list[int]) -> Any:
        return build_prompt(llama, [TextPiece(tuple(tokens), False)], pc.image_unit)

    head, rest = ids(52), ids(400)
    a.commit(a.prepare(text(a, head + ids(300)), mode="exact"))
    first = a.prepare(text(a, head + rest), mode="exact")
    assert first.usage.prefix_tokens == 52  # [52, 128) stored from where its pass began
    a.commit(first)
    a.store.shared.flush()  # type: ignore[union-attr]
    prompt = text(b, head + rest + ids(40))
    warm = b.prepare(prompt, mode="exact")
    assert warm.usage.prefix_tokens == len(head + rest)
    assert torch.equal(warm.logits, b.prepare(prompt, "reference", mode="exact").logits)


def back_empty(llama: Any) -> tuple[PromptCache, PromptCache, Any]:  # noqa: F811
    """Two replicas whose first prompts were prefilled while Redis was away (their writes lost,
    their rows and pointers held locally), then Redis back empty, as after a restart. A saw a
    prompt that shares the chat header with later ones; B one that shares more ("You are ")."""
    server = fakeredis.FakeServer()
    a, b = replica(llama, server), replica(llama, server)
    server.connected = False
    for pc, system in ((a, "Turn 0."), (b, "You are a careful assistant.")):
        pc.commit(
            pc.prepare(prompt_of(pc, [Message("system", (system,)), Message("user", ("Hi?",))]), mode="exact")
        )
        pc.store.shared.flush()  # type: ignore[union-attr]
    server.connected = True
    fakeredis.FakeRedis(server=server).flushall()
    for pc in (a, b):  # the breakers' probe found it back
        pc.store.shared.breaker.success()  # type: ignore[union-attr]
    return a, b, server


def test_a_replica_finds_a_segment_whole_where_its_own_reuse_ended_elsewhere(
    llama: Any,  # noqa: F811
) -> None:
    """A reused the first segment of its prompt to the token (its own earlier prompt, as far as
    the chat header) and prefilled the rest. B's walk stops elsewhere in that segment (its own
    earlier prompt shared more), where no row of A's begins: B finds the segment whole by its
    key, which A's commit stored, and goes on through A's whole prompt, exact."""
    a, b, _ = back_empty(llama)
    first = [Message("system", ("You are terse.",)), Message("user", (DOC, "Sum it up in a line."))]
    prompt = prompt_of(a, first)
    made = a.prepare(prompt, mode="exact")
    assert 0 < made.usage.prefix_tokens < CONFIG.block_tokens  # the header, from its own earlier prompt
    a.commit(made)
    a.store.shared.flush()  # type: ignore[union-attr]
    longer = prompt_of(b, [*first, Message("assistant", ("Done.",)), Message("user", ("More?",))])
    warm = b.prepare(longer, mode="exact")
    assert warm.usage.prefix_tokens == prompt.n_tokens, warm.usage
    assert warm.usage.shared_tokens > 0
    assert torch.equal(warm.logits, full_prefill_logits(llama, longer))


def test_a_replica_reads_the_shared_pointer_beside_its_own(llama: Any) -> None:  # noqa: F811
    """B's prompt parts from A's inside the first segment. B's own pointer after the empty
    context lists only its earlier prompt; the shared tier's, rewritten by A, lists A's row
    first: B reads both and reuses A's row to where the prompts part, exact. Of the rows the
    pointer lists, B brings in only that one: another prompt's row, which agrees with B's only as
    far as the chat header, stays in Redis."""
    a, b, server = back_empty(llama)
    doc = (DOC, "Sum it up in a line.")
    other = prompt_of(a, [Message("system", ("Other rules apply here.",)), Message("user", doc)])
    a.commit(a.prepare(other, mode="exact"))
    first = prompt_of(a, [Message("system", ("You are terse. Keep it short.",)), Message("user", doc)])
    a.commit(a.prepare(first, mode="exact"))
    a.store.shared.flush()  # type: ignore[union-attr]
    second = prompt_of(b, [Message("system", ("You are terse. Be kind.",)), Message("user", doc)])
    parted = int(np.flatnonzero(first.units[: second.n_tokens] != second.units[: first.n_tokens])[0])
    assert parted < CONFIG.block_tokens
    warm = b.prepare(second, mode="exact")
    assert warm.usage.prefix_tokens == parted, warm.usage
    assert torch.equal(warm.logits, full_prefill_logits(llama, second))
    # a pointer's list: the newest row first, each row once, the rows it supersedes left out
    key = reuse.after_key(PromptKeys(first, a.planner("").namespace, first.cuts(CONFIG.block_tokens)), 0)
    listed = reuse.read_pointer(
        decode_entry(fakeredis.FakeRedis(server=server).get("kamera:" + key), key).meta
    )
    assert len({k for k, _ in listed}) == len(listed) >= 2
    assert np.array_equal(listed[0][1], first.units[: CONFIG.block_tokens])
    ctx = PromptKeys(other, a.planner("").namespace, other.cuts(CONFIG.block_tokens))
    other_row = ctx.store_key(0, CONFIG.block_tokens, exact=True)
    assert other_row in {k for k, _ in listed}
    assert fakeredis.FakeRedis(server=server).exists("kamera:" + other_row)
    assert other_row not in b.store


def test_entry_of_other_tokens_is_refused_after_prefetch() -> None:
    """Two processes may give one image id to two images, so one key to two chunks: the token
    fingerprint each entry certifies keeps the other process's entry from being served."""
    server = fakeredis.FakeServer()
    a = TieredStore([MemoryTier("host", "cpu", 1 << 20)], shared=tier(fakeredis.FakeRedis(server=server)))
    b = TieredStore([MemoryTier("host", "cpu", 1 << 20)], shared=tier(fakeredis.FakeRedis(server=server)))
    a.put("x", Entry(entry(5).tensors, {"n_tokens": 4}, tokens="image-one"))
    a.close()
    assert b.prefetch(["x"]) == {"x"}
    assert b.get("x", "image-two") is None
    assert b.stats().tier("host").misfiled == 1
    b.close()
