"""Tests of cache/store: round trips, tiers, eviction, counters, corruption, processes."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from cache.store import (
    DiskTier,
    Entry,
    EntryTooLargeError,
    MemoryTier,
    StoreConfig,
    TieredStore,
    TierFullError,
    available_policies,
    encode_entry,
    make_policy,
    record_key,
)


def make_entry(seed: int, n_tokens: int = 4, dtype: torch.dtype = torch.float32) -> Entry:
    """A small canonical-KV-like entry, a pure function of its arguments."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, n_tokens, 8)  # [L, H_kv, T, D]
    if dtype.is_floating_point:
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
    else:
        info = torch.iinfo(dtype)
        k = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=g, dtype=dtype)
        v = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=g, dtype=dtype)
    positions = torch.arange(n_tokens, dtype=torch.int64)
    meta = {"token_ids": list(range(seed, seed + n_tokens)), "n_tokens": n_tokens, "extent": n_tokens}
    return Entry({"k": k, "v": v, "positions": positions}, meta)


def assert_same(a: Entry | None, b: Entry) -> None:
    assert a is not None
    assert dict(a.meta) == dict(b.meta)
    assert set(a.tensors) == set(b.tensors)
    for name, t in b.tensors.items():
        got = a.tensors[name]
        assert got.dtype == t.dtype
        assert got.shape == t.shape
        assert torch.equal(got.cpu().view(torch.uint8), t.cpu().contiguous().view(torch.uint8)), name


NBYTES = make_entry(0).nbytes  # 2*3*4*8*4*2 + 4*8 = 1568


def memory_store(*budgets: int, policy: str = "lru", disk: DiskTier | None = None, **kw: bool) -> TieredStore:
    """Memory tiers on the CPU named device, host, ... (CPU stands in for the GPU)."""
    names = ["device", "host", "spare"]
    tiers = [MemoryTier(names[i], "cpu", b, policy) for i, b in enumerate(budgets)]
    return TieredStore(tiers, disk, **kw)


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int8])
def test_round_trip_bit_exact_memory_and_disk(tmp_path: Path, dtype: torch.dtype) -> None:
    entry = make_entry(7, dtype=dtype)
    store = memory_store(10 * NBYTES, disk=DiskTier(tmp_path, 10**6, durable=False), write_through=True)
    store.put("a" * 64, entry)
    assert_same(store.get("a" * 64), entry)
    fresh = TieredStore([], DiskTier(tmp_path, 10**6))  # reads the file back
    assert_same(fresh.get("a" * 64), entry)


def test_put_copies_and_non_contiguous_inputs() -> None:
    base = torch.randn(4, 6)
    entry = Entry({"x": base.t()}, {"n": 1})  # non-contiguous view
    store = memory_store(10**6)
    store.put("k", entry)
    base.zero_()  # the caller's storage changes; the store's copy must not
    got = store.get("k")
    assert got is not None
    assert got.tensors["x"].is_contiguous()
    assert not torch.equal(got.tensors["x"], base.t())


def test_entry_files_are_plain_safetensors(tmp_path: Path) -> None:
    store = TieredStore([], DiskTier(tmp_path, 10**6, durable=False))
    store.put("key", make_entry(1))
    (path,) = (tmp_path / "entries").iterdir()
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == {"k", "v", "positions"}
        assert json.loads(f.metadata()["kamera.meta"])["n_tokens"] == 4


def test_no_pickle_in_the_store() -> None:
    import cache.store as package

    for path in Path(package.__file__).parent.glob("*.py"):
        assert not re.search(
            r"^\s*(import|from) (pickle|dill|marshal)|torch\.load\(|weights_only", path.read_text(), re.M
        ), path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_tier_demotes_to_host_and_promotes_back() -> None:
    store = TieredStore.from_config(StoreConfig(host_bytes=4 * NBYTES, device_bytes=2 * NBYTES))
    assert [t.name for t in store.tiers] == ["device", "host"]
    entries = {f"g{i}": make_entry(i, dtype=torch.bfloat16 if i % 2 else torch.float32) for i in range(4)}
    for key, entry in entries.items():
        store.put(key, entry)
    device, host = (t for t in store.tiers if isinstance(t, MemoryTier))

    def device_types(tier: MemoryTier) -> set[str]:
        return {t.device.type for k in tier if (e := tier.peek(k)) is not None for t in e.tensors.values()}

    assert device_types(device) == {"cuda"}
    assert device_types(host) == {"cpu"}
    got = store.get("g0")  # host hit: moved to the GPU
    assert got is not None
    assert got.tensors["k"].is_cuda
    assert_same(got, entries["g0"])
    assert store.stats().tier("device").promotions == 1
    assert device.bytes_in_use <= device.budget_bytes


# -- entries and config validation ---------------------------------------------------------------


def test_entry_validation_and_record_keys() -> None:
    with pytest.raises(ValueError, match="JSON"):
        Entry({"k": torch.zeros(1)}, {"bad": object()})
    with pytest.raises(ValueError, match="round trip"):
        Entry({"k": torch.zeros(1)}, {"ids": (1, 2)})
    with pytest.raises(ValueError, match="tensor name"):
        Entry({"__metadata__": torch.zeros(1)})
    assert record_key("abc", "patch", "ctx1") == "abc/patch/ctx1"
    assert record_key("abc", "conditioned") == "abc/conditioned"
    with pytest.raises(ValueError, match="free of '/'"):
        record_key("abc", "patch", "a/b")
    with pytest.raises(ValueError, match="non-empty"):
        memory_store(100).put("", make_entry(0))


def test_config_without_cuda_has_no_device_tier(tmp_path: Path) -> None:
    store = TieredStore.from_config(
        StoreConfig(host_bytes=1000, device_bytes=500, disk_bytes=10**6, disk_path=tmp_path, device="cpu")
    )
    assert [t.name for t in store.tiers] == ["host", "disk"]
    with pytest.raises(ValueError, match="policy"):
        StoreConfig(host_bytes=1, policy="nope")
    with pytest.raises(ValueError, match="disk_path"):
        StoreConfig(host_bytes=1, disk_bytes=10)
    with pytest.raises(ValueError, match=">= 0"):
        StoreConfig(host_bytes=-1)
    assert {"lru", "lfu", "largest"} <= set(available_policies())
    with pytest.raises(ValueError, match="choose from"):
        make_policy("mru")


# -- eviction order --------------------------------------------------------------------------------


def test_lru_order() -> None:
    store = memory_store(3 * NBYTES)
    for key in "abc":
        store.put(key, make_entry(ord(key)))
    store.get("a")  # b is now the least recently used
    store.put("d", make_entry(4))
    assert set(store.keys()) == {"a", "c", "d"}
    store.get("c")
    store.put("e", make_entry(5))  # a is now the oldest
    assert set(store.keys()) == {"c", "d", "e"}
    assert store.stats().tier("device").evictions == 2


def test_lfu_and_largest_policies() -> None:
    lfu = memory_store(3 * NBYTES, policy="lfu")
    for key in "abc":
        lfu.put(key, make_entry(ord(key)))
    for _ in range(3):
        lfu.get("a")
    lfu.get("b")
    lfu.put("d", make_entry(4))  # c has the fewest hits
    assert set(lfu.keys()) == {"a", "b", "d"}

    largest = memory_store(NBYTES * 3, policy="largest")
    largest.put("big", make_entry(1, n_tokens=8))  # about twice NBYTES
    largest.put("small", make_entry(2, n_tokens=2))
    largest.put("new", make_entry(3, n_tokens=4))
    assert set(largest.keys()) == {"small", "new"}


# -- tiers, demotion, promotion, counters ----------------------------------------------------------


def test_demotion_and_promotion_through_three_tiers(tmp_path: Path) -> None:
    store = memory_store(2 * NBYTES, 2 * NBYTES, disk=DiskTier(tmp_path, 100 * NBYTES, durable=False))
    entries = {f"e{i}": make_entry(i) for i in range(6)}
    for key, entry in entries.items():
        assert store.put(key, entry).tier == "device"
    device, host, disk = store.tiers
    assert set(device) == {"e4", "e5"}
    assert set(host) == {"e2", "e3"}
    assert set(disk) == {"e0", "e1"}
    s = store.stats()
    assert (s.tier("device").evictions, s.tier("host").demotions) == (4, 4)
    assert (s.tier("host").evictions, s.tier("disk").demotions) == (2, 2)
    assert s.tier("device").bytes_in_use == s.tier("host").bytes_in_use == 2 * NBYTES

    assert_same(store.get("e0"), entries["e0"])  # disk hit: copied up, file kept
    s = store.stats()
    assert s.tier("device").misses == 1
    assert s.tier("host").misses == 1
    assert s.tier("disk").hits == 1
    assert s.tier("device").promotions == 1
    assert "e0" in device
    assert "e0" in disk
    assert s.tier("disk").bytes_read > NBYTES

    assert_same(store.get("e2"), entries["e2"])  # host hit: moved up, not copied
    assert "e2" in device
    assert "e2" not in host
    assert store.stats().tier("device").promotions == 2

    # every entry still reachable exactly once across memory tiers
    for key, entry in entries.items():
        assert_same(store.get(key), entry)
        assert sum(key in t for t in (device, host)) == 1
    s = store.stats()
    assert s.hits == 8
    assert s.misses == 0
    assert s.puts == 6
    rows = {(tier, name): value for tier, name, value in s.rows()}
    assert rows[("store", "hits")] == 8
    assert rows[("disk", "demotions")] == s.tier("disk").demotions
    with pytest.raises(AttributeError):
        s.hits = 0  # type: ignore[misc]


def test_entry_too_big_for_device_lands_lower() -> None:
    store = memory_store(NBYTES, 4 * NBYTES)
    assert store.put("big", make_entry(1, n_tokens=8)).tier == "host"
    assert store.get("big") is not None
    assert "big" in store.tiers[1]


def test_oversized_entry_refused_store_unchanged(tmp_path: Path) -> None:
    store = memory_store(2 * NBYTES, disk=DiskTier(tmp_path, 3 * NBYTES, durable=False))
    store.put("a", make_entry(1))
    before = [(t.name, sorted(t), t.bytes_in_use) for t in store.tiers]
    with pytest.raises(EntryTooLargeError, match="more than any tier"):
        store.put("huge", make_entry(2, n_tokens=64))
    assert [(t.name, sorted(t), t.bytes_in_use) for t in store.tiers] == before
    assert store.stats().refused == 1
    assert store.stats().puts == 1


def test_full_budget_with_pins() -> None:
    store = memory_store(2 * NBYTES, 2 * NBYTES)
    store.put("a", make_entry(1))
    store.put("b", make_entry(2))
    with store.pinned("a") as a, store.pinned("b"):
        assert a is not None
        assert store.put("c", make_entry(3)).tier == "host"  # device is pinned full
        store.put("d", make_entry(4))
        store.put("e", make_entry(5))  # host evicts c for good (no disk)
        assert set(store.tiers[0]) == {"a", "b"}
        with pytest.raises(ValueError, match="pinned"):
            store.delete("a")
    store.put("f", make_entry(6))  # unpinned: device may evict again
    assert "f" in store.tiers[0]
    with pytest.raises(KeyError):
        store.unpin("a")

    only = memory_store(2 * NBYTES)
    only.put("x", make_entry(1))
    only.put("y", make_entry(2))
    only.pin("x")
    only.pin("y")
    with pytest.raises(TierFullError):
        only.put("z", make_entry(3))
    assert set(only.keys()) == {"x", "y"}


def test_delete_and_prefix_keys(tmp_path: Path) -> None:
    store = memory_store(10 * NBYTES, disk=DiskTier(tmp_path, 10**6, durable=False), write_through=True)
    store.put("chunk", make_entry(1))
    store.put(record_key("chunk", "patch", "c1"), make_entry(2))
    store.put(record_key("chunk", "patch", "c2"), make_entry(3))
    assert store.keys("chunk/patch/") == ["chunk/patch/c1", "chunk/patch/c2"]
    assert store.delete("chunk/patch/c1")
    assert not store.delete("chunk/patch/c1")
    assert "chunk/patch/c1" not in store
    assert len(list((tmp_path / "entries").iterdir())) == 2


# -- budgets under random traffic ------------------------------------------------------------------


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "pin", "unpin"]), st.integers(0, 11), st.integers(1, 12)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, policy=st.sampled_from(["lru", "lfu", "largest"]))
def test_budgets_hold_under_random_traffic(ops: list[tuple[str, int, int]], policy: str) -> None:
    store = memory_store(5 * NBYTES, 7 * NBYTES, policy=policy)
    device, host = (t for t in store.tiers if isinstance(t, MemoryTier))
    pins: dict[str, int] = {}
    for op, i, n_tokens in ops:
        key = f"k{i}"
        if op == "put":
            with contextlib.suppress(TierFullError, EntryTooLargeError):
                store.put(key, make_entry(i, n_tokens=n_tokens))
        elif op == "get":
            got = store.get(key)
            assert got is None or got.meta["token_ids"][0] == i
        elif op == "pin" and store.pin(key) is not None:
            pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key):
            store.unpin(key)
            pins[key] -= 1
        for tier in (device, host):
            assert tier.bytes_in_use <= tier.budget_bytes
            held = [e.nbytes for k in tier if (e := tier.peek(k)) is not None]
            assert len(held) == len(tier)
            assert tier.bytes_in_use == sum(held)
        assert not set(device) & set(host)
        assert all(k in device or k in host for k, c in pins.items() if c)
    s = store.stats()
    assert s.tier("device").evictions == s.tier("host").demotions


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 16), min_size=1, max_size=25))
def test_disk_budget_holds(sizes: list[int]) -> None:
    with tempfile.TemporaryDirectory() as root:
        budget = 6 * NBYTES
        store = TieredStore([], DiskTier(root, budget, durable=False))
        for i, n in enumerate(sizes):
            try:
                store.put(f"k{i}", make_entry(i, n_tokens=n))
            except EntryTooLargeError:
                assert make_entry(i, n_tokens=n).nbytes > budget - 1000
        disk = store.tiers[0]
        assert disk.bytes_in_use <= budget
        files = {p.name: p.stat().st_size for p in (Path(root) / "entries").iterdir()}
        assert sum(files.values()) == disk.bytes_in_use
        assert len(files) == len(disk)


# -- disk: persistence and damage ----------------------------------------------------------------


def test_disk_persists_across_instances(tmp_path: Path) -> None:
    entries = {f"p{i}": make_entry(i, dtype=torch.bfloat16) for i in range(6)}
    host_bytes = 4 * entries["p0"].nbytes
    first = TieredStore.from_config(
        StoreConfig(host_bytes=host_bytes, disk_bytes=10**6, disk_path=tmp_path, device="cpu", durable=False)
    )
    for key, entry in entries.items():
        first.put(key, entry)
    assert first.flush() == 4  # the four still only in host memory
    second = TieredStore([], DiskTier(tmp_path, 10**6))
    for key, entry in entries.items():
        assert_same(second.get(key), entry)
    assert second.stats().tier("disk").hits == 6


def _damage_store(tmp_path: Path) -> tuple[TieredStore, Path]:
    store = TieredStore([], DiskTier(tmp_path, 10**6, durable=False))
    store.put("victim", make_entry(1))
    store.put("bystander", make_entry(2))
    index = json.loads((tmp_path / "index.json").read_text())
    return store, tmp_path / "entries" / index["entries"]["victim"]["file"]


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the tensor data: the header still parses
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("damage", [flip_bytes, truncate, Path.unlink], ids=["flip", "truncate", "delete"])
def test_damaged_file_is_a_counted_miss(tmp_path: Path, damage: Callable[[Path], object]) -> None:
    store, path = _damage_store(tmp_path)
    damage(path)
    reader = TieredStore([], DiskTier(tmp_path, 10**6, recover=False))  # the read path; see test_store_faults
    assert reader.get("victim") is None
    s = reader.stats()
    assert s.tier("disk").corrupt_dropped == 1
    assert s.misses == 1
    assert s.tier("disk").hits == 0
    assert "victim" not in json.loads((tmp_path / "index.json").read_text())["entries"]
    assert not path.exists()
    assert_same(reader.get("bystander"), make_entry(2))
    assert store.get("victim") is None  # the writer's view catches up: a miss, not a second drop
    reader.put("victim", make_entry(1))  # recomputed and stored again
    assert_same(TieredStore([], DiskTier(tmp_path, 10**6)).get("victim"), make_entry(1))


def test_unreadable_index_is_rebuilt_from_the_files(tmp_path: Path) -> None:
    store = TieredStore([], DiskTier(tmp_path, 10**6, durable=False))
    store.put("a", make_entry(1))
    (tmp_path / "index.json").write_text("{not json")
    fresh = DiskTier(tmp_path, 10**6, durable=False)  # the file certifies its own key
    assert fresh.recovery is not None
    assert fresh.recovery.reindexed == 1
    assert list(fresh) == ["a"]
    assert_same(fresh.get("a"), make_entry(1))


def test_two_tiers_on_one_directory_share_index_and_budget(tmp_path: Path) -> None:
    budget = 5 * len(encode_entry(make_entry(0).sealed("k0"))) + 100
    a = DiskTier(tmp_path, budget, durable=False)
    b = DiskTier(tmp_path, budget, durable=False)
    for i in range(8):
        (a if i % 2 else b).insert(f"k{i}", make_entry(i), "put")
    assert sorted(a) == sorted(b) == [f"k{i}" for i in range(3, 8)]
    assert a.bytes_in_use == b.bytes_in_use <= budget
    assert len(list((tmp_path / "entries").iterdir())) == 5
    assert_same(b.get("k7"), make_entry(7))


# -- concurrency -----------------------------------------------------------------------------------


def test_threads_share_one_store() -> None:
    store = memory_store(6 * NBYTES, 10 * NBYTES)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(40):
                key = f"w{worker}-{i % 9}"
                store.put(key, make_entry(worker * 100 + i % 9))
                got = store.get(key)
                if got is not None:
                    assert got.meta["token_ids"][0] == worker * 100 + i % 9
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for tier in store.tiers:
        assert tier.bytes_in_use <= tier.budget_bytes


def _process_worker(root: str, worker: int, n: int, other: int, done: Queue[tuple[int, object, int]]) -> None:
    """Answer (worker, entries of the other worker read, corrupt files dropped), or on any error
    (worker, "error", traceback) so the test fails at once with it; SIGUSR1 dumps its stacks."""
    try:
        stacks = open(Path(root) / f"worker{worker}.stacks", "w")  # noqa: SIM115 - open until exit
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        done.put((worker, *_share_directory(root, worker, n, other)))
    except BaseException:
        done.put((worker, "error", traceback.format_exc()))
        raise


def _share_directory(root: str, worker: int, n: int, other: int) -> tuple[int, int]:
    torch.set_num_threads(1)
    store = TieredStore.from_config(
        StoreConfig(host_bytes=3 * NBYTES, disk_bytes=10**7, disk_path=root, device="cpu", write_through=True)
    )
    for i in range(n):
        store.put(f"p{worker}-{i}", make_entry(worker * 1000 + i, dtype=torch.bfloat16))
    store.flush()  # the puts were written in the background
    seen = 0
    deadline = time.monotonic() + 60
    while seen < n and time.monotonic() < deadline:  # read the other writer's entries as they land
        got = store.get(f"p{other}-{seen}")
        if got is None:
            time.sleep(0.01)
            continue
        assert_same(got, make_entry(other * 1000 + seen, dtype=torch.bfloat16))
        seen += 1
    store.close()
    return seen, store.stats().tier("disk").corrupt_dropped


def _answers(
    procs: list[BaseProcess], done: Queue[tuple[int, object, int]], root: Path, wait_s: float = 120
) -> list[tuple]:
    """Every worker's answer, sorted. Fails at once with a worker's traceback, or with its exit code
    when it died without answering; after `wait_s`, with the stacks of the workers still running."""
    answers: dict[int, tuple[int, object, int]] = {}
    deadline = time.monotonic() + wait_s
    while len(answers) < len(procs):
        try:
            got = done.get(timeout=0.5)
        except queue.Empty:
            gone = [w for w, p in enumerate(procs) if w not in answers and p.exitcode is not None]
            if gone:  # what a worker sent is in the pipe before it exits: one more look
                with contextlib.suppress(queue.Empty):
                    got = done.get(timeout=1)
                    answers[got[0]] = got
                    continue
                pytest.fail(f"worker {gone[0]} exited with code {procs[gone[0]].exitcode} and no answer")
            if time.monotonic() > deadline:
                running = [w for w in range(len(procs)) if w not in answers]
                for w in running:
                    os.kill(procs[w].pid or 0, signal.SIGUSR1)
                time.sleep(1)
                stacks = "\n".join((root / f"worker{w}.stacks").read_text() for w in running)
                pytest.fail(f"workers {running} gave no answer in {wait_s:.0f} s; their stacks:\n{stacks}")
            continue
        if got[1] == "error":
            pytest.fail(f"worker {got[0]} failed:\n{got[2]}")
        answers[got[0]] = got
    return sorted(answers.values())


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    n = 25
    procs = [ctx.Process(target=_process_worker, args=(str(tmp_path), w, n, 1 - w, done)) for w in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = _answers(procs, done, tmp_path)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert results == [(0, n, 0), (1, n, 0)]
    for w in (0, 1):
        (tmp_path / f"worker{w}.stacks").unlink()
    reader = TieredStore([], DiskTier(tmp_path, 10**7))
    assert len(reader.keys()) == 2 * n
    for w in (0, 1):
        for i in range(n):
            assert_same(reader.get(f"p{w}-{i}"), make_entry(w * 1000 + i, dtype=torch.bfloat16))
    assert len(list((tmp_path / "entries").iterdir())) == 2 * n  # no temp files, no orphans
