"""The store under faults: misfiled, damaged, orphaned, killed mid-write, shared by two writers.

Each fault is done to a real store directory the way a bug, a crash or a hostile user would,
then the store is opened as a restarted process would open it. The store must serve no entry
but the one it was asked for (counted when it refuses one), keep its disk within the budget, and
the prompt cache over it must answer as a full prefill does.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.adapters.loading import load_adapter
from agent.engine.chat import ByteTokenizer, Message
from agent.engine.prompt_cache import PromptCache
from cache.store import (
    DiskTier,
    Entry,
    MemoryTier,
    TieredStore,
    decode_entry,
    encode_entry,
    recovery,
    scan,
)
from tests.test_prompt_cache import CONFIG, full_prefill_logits, prompt_of

ROOT = Path(__file__).resolve().parents[1]


def entry(i: int, n: int = 16) -> Entry:
    g = torch.Generator().manual_seed(i)
    return Entry(
        {"k": torch.randn(2, 2, n, 8, generator=g), "v": torch.randn(2, 2, n, 8, generator=g)}, {"i": i}
    )


FILE_BYTES = len(encode_entry(entry(0).sealed("w0")))  # every entry of this bench is this size


def disk_store(root: Path, budget: int = 10**7, **kw: Any) -> TieredStore:
    return TieredStore([], DiskTier(root, budget, durable=False, **kw))


def index_of(root: Path) -> dict[str, Any]:
    return json.loads((root / "index.json").read_text())


def write_index(root: Path, index: dict[str, Any]) -> None:
    (root / "index.json").write_text(json.dumps(index))


def assert_directory_sound(root: Path, budget: int) -> None:
    """Every file indexed and certifying its key, nothing else there, within the budget."""
    records = index_of(root)["entries"]
    files = {p.name: p for p in (root / "entries").iterdir()}
    assert set(files) == {r["file"] for r in records.values()}, "unindexed or missing files"
    assert sum(r["size"] for r in records.values()) <= budget
    assert sum(p.stat().st_size for p in files.values()) <= budget
    for key, rec in records.items():
        assert decode_entry(files[rec["file"]].read_bytes(), key).key == key


# -- misfiled entries: every way a record or a file can end up under the wrong key ----------------


def rotate_records(root: Path) -> int:
    """Each record moves to the next key of the same file size (valid JSON, files intact)."""
    index = index_of(root)
    records = index["entries"]
    by_size: dict[int, list[str]] = {}
    for key, rec in records.items():
        by_size.setdefault(rec["size"], []).append(key)
    moved = 0
    for keys in by_size.values():
        if len(keys) > 1:
            recs = [records[k] for k in keys]
            for k, rec in zip(keys, recs[1:] + recs[:1], strict=True):
                records[k] = rec
            moved += len(keys)
    write_index(root, index)
    return moved


def rotate_files(root: Path) -> int:
    """The bytes of equal-size entry files move round (the index untouched)."""
    records = index_of(root)["entries"]
    by_size: dict[int, list[Path]] = {}
    for rec in records.values():
        by_size.setdefault(rec["size"], []).append(root / "entries" / rec["file"])
    moved = 0
    for paths in by_size.values():
        if len(paths) > 1:
            data = [p.read_bytes() for p in paths]
            for p, d in zip(paths, data[1:] + data[:1], strict=True):
                p.write_bytes(d)
            moved += len(paths)
    return moved


def copy_under_other_keys(root: Path) -> int:
    """Every key's record points at a copy of the first entry's file (sizes made consistent)."""
    index = index_of(root)
    records = index["entries"]
    first, *others = sorted(records)
    src = root / "entries" / records[first]["file"]
    for i, key in enumerate(others):
        name = f"copy{i:04d}.safetensors"
        shutil.copy(src, root / "entries" / name)
        (root / "entries" / records[key]["file"]).unlink()
        records[key] = dict(records[first], file=name)
    write_index(root, index)
    return len(others)


MISFILE: dict[str, Callable[[Path], int]] = {
    "records": rotate_records,
    "files": rotate_files,
    "copies": copy_under_other_keys,
}


@pytest.mark.parametrize("fault", list(MISFILE))
def test_misfiled_entries_are_refused_and_counted(tmp_path: Path, fault: str) -> None:
    store = disk_store(tmp_path)
    for i in range(6):
        store.put(f"k{i}", entry(i))
    moved = MISFILE[fault](tmp_path)
    assert moved >= 5
    reader = disk_store(tmp_path)
    served = {k: reader.get(k) for k in (f"k{i}" for i in range(6))}
    for key, got in served.items():
        if got is not None:  # only an entry that certifies its own key
            assert got.key == key
            torch.testing.assert_close(got.tensors["k"], entry(int(key[1:])).tensors["k"], rtol=0, atol=0)
    disk = reader.stats().tier("disk")
    assert disk.misfiled == sum(v is None for v in served.values()) >= moved
    assert disk.hits + disk.misses == 6


def test_gc_refiles_swapped_records(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    for i in range(4):
        store.put(f"k{i}", entry(i))
    rotate_records(tmp_path)
    report = scan(tmp_path, verify_indexed=True, repair=True)
    assert (report.misfiled, report.reindexed, report.entries) == (4, 4, 4)
    reader = disk_store(tmp_path)
    for i in range(4):
        got = reader.get(f"k{i}")
        assert got is not None
        assert torch.equal(got.tensors["k"], entry(i).tensors["k"])
    assert scan(tmp_path, verify_indexed=True, repair=False).clean


def test_wrong_tokens_and_memory_misfiles_are_refused(tmp_path: Path) -> None:
    host = MemoryTier("host", "cpu", 10**6)
    store = TieredStore([host], DiskTier(tmp_path, 10**6, durable=False), write_through=True)
    store.put("a", Entry(entry(1).tensors, {}, tokens="fp-a"))
    assert store.get("a", tokens="fp-b") is None  # the lookup wants other tokens
    assert store.get("a") is None  # dropped from every tier, not only refused once
    s = store.stats()
    assert (s.tier("host").misfiled, s.tier("disk").misfiled) == (1, 1)  # the disk copy too
    store.put("b", Entry(entry(2).tensors, {}, tokens="fp-b"))
    host.insert("c", entry(2).sealed("b"), "put")  # a bug files b's entry under c
    assert store.get("c") is None
    assert store.stats().tier("host").misfiled == 2
    with pytest.raises(ValueError, match="cannot be filed"):
        store.put("d", entry(2).sealed("b"))


# -- damage, orphans, lost indexes: recovery cleans, the budget holds ------------------------------


def test_corrupt_and_truncated_files(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    for i in range(4):
        store.put(f"k{i}", entry(i))
    files = {k: tmp_path / "entries" / r["file"] for k, r in index_of(tmp_path)["entries"].items()}
    data = bytearray(files["k0"].read_bytes())
    data[-7] ^= 0x40
    files["k0"].write_bytes(bytes(data))  # same size: found when read
    files["k1"].write_bytes(files["k1"].read_bytes()[:-50])  # resized: found on opening
    reader = disk_store(tmp_path)
    assert reader.get("k0") is None
    assert reader.get("k1") is None
    assert reader.stats().tier("disk").corrupt_dropped == 1
    assert reader.tiers[0].recovery is not None
    assert reader.tiers[0].recovery.dropped_records == 1
    for i in (2, 3):
        got = reader.get(f"k{i}")
        assert got is not None
        assert torch.equal(got.tensors["v"], entry(i).tensors["v"])
    assert_directory_sound(tmp_path, 10**7)


@pytest.mark.parametrize("index_fault", ["garbage", "truncated", "deleted", "old-format"])
def test_lost_index_reindexes_within_the_budget(tmp_path: Path, index_fault: str) -> None:
    store = disk_store(tmp_path)
    for i in range(10):
        store.put(f"k{i}", entry(i))
    size = index_of(tmp_path)["entries"]["k0"]["size"]
    index = tmp_path / "index.json"
    if index_fault == "garbage":
        index.write_text("{not json")
    elif index_fault == "truncated":
        index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    elif index_fault == "deleted":
        index.unlink()
    else:
        index.write_text(json.dumps({"format": 1, "checksum": "blake3", "entries": {}}))
    (tmp_path / "entries" / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    budget = 6 * size
    reader = disk_store(tmp_path, budget)
    report = reader.tiers[0].recovery
    assert report is not None
    assert report.reindexed == 10
    assert report.evicted == 4
    assert report.removed == 1  # the junk file
    assert_directory_sound(tmp_path, budget)
    hits = [k for k in (f"k{i}" for i in range(10)) if reader.get(k) is not None]
    assert len(hits) == 6
    for key in hits:
        got = reader.get(key)
        assert got is not None
        assert torch.equal(got.tensors["k"], entry(int(key[1:])).tensors["k"])


def test_repeated_index_loss_never_grows_the_directory(tmp_path: Path) -> None:
    budget = 8 * FILE_BYTES
    for round_ in range(5):
        store = disk_store(tmp_path, budget)
        for i in range(6):
            store.put(f"w{round_ * 6 + i}", entry(round_ * 6 + i))
        assert_directory_sound(tmp_path, budget)
        (tmp_path / "index.json").write_text("lost")
    disk_store(tmp_path, budget)
    assert_directory_sound(tmp_path, budget)


def test_dead_writers_temporary_files_are_removed(tmp_path: Path) -> None:
    disk_store(tmp_path).put("a", entry(1))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    stale = tmp_path / "entries" / f".x.safetensors.{pid}.abc.tmp"
    live = tmp_path / "entries" / f".y.safetensors.{os.getpid()}.abc.tmp"
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    disk_store(tmp_path)
    assert not stale.exists()
    assert live.exists()  # a live writer's work in progress
    live.unlink()
    assert_directory_sound(tmp_path, 10**7)


@pytest.mark.parametrize("meanwhile", ["renamed", "removed"])
def test_files_a_live_writer_moves_during_the_scan_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """Between the scan's listing and its look at a file, another process's writer renames its
    temporary file into place, or removes a copy of its that lost to another: opening goes on."""
    disk_store(tmp_path).put("a", entry(1))
    files = tmp_path / "entries"
    staged = files / "b.safetensors"
    live = files / f".{staged.name}.{os.getpid()}.abc.tmp"  # listed first: its name starts with "."
    live.write_bytes(encode_entry(entry(2).sealed("b")))
    loser = files / "c.safetensors"
    loser.write_bytes(encode_entry(entry(1).sealed("a")))
    writer_alive = recovery.writer_alive

    def writer_moves(name: str) -> bool:  # the scan asks about `live` after listing every file
        if meanwhile == "renamed":
            os.replace(live, staged)
        else:
            loser.unlink()
        return writer_alive(name)

    monkeypatch.setattr(recovery, "writer_alive", writer_moves)
    opened = disk_store(tmp_path)
    report = opened.tiers[0].recovery
    assert report is not None
    assert (report.entries, report.reindexed, report.removed) == (1, 0, 1 if meanwhile == "renamed" else 0)
    assert opened.get("a") is not None
    monkeypatch.undo()
    if meanwhile == "renamed":  # the loser is removed as a copy; the renamed file is the writer's to publish
        assert staged.exists()
        assert not loser.exists()
        assert disk_store(tmp_path).get("b") is not None  # or the next scan re-indexes it
    else:
        assert live.exists()  # a live writer's work in progress
        live.unlink()
    assert_directory_sound(tmp_path, 10**7)


def test_a_scan_beside_a_writing_thread_never_fails(tmp_path: Path) -> None:
    """Scans (every process opening the directory runs one) while a writer stages, publishes and
    removes the copies that lose: each one returns, and leaves the directory sound."""
    tier = DiskTier(tmp_path, 10**8, durable=False)
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(10**6):
                if stop.is_set():
                    return
                copies = [tier.stage(f"k{i}", entry(i, n=4)) for _ in range(2)]  # one of them loses
                tier.commit_new(copies, "put")
        except BaseException as err:
            errors.append(err)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(150):
            scan(tmp_path, budget=10**8, durable=False)
    finally:
        stop.set()
        writer.join()
    assert not errors
    scan(tmp_path, budget=10**8, durable=False)
    assert_directory_sound(tmp_path, 10**8)


# -- processes: kill -9 during writes, two writers on one directory -------------------------------


def _writer(root: str, seed: int, budget: int, n: int) -> None:
    torch.set_num_threads(1)
    store = TieredStore([], DiskTier(root, budget, durable=True))
    for i in range(n):
        store.put(f"w{(seed + i) % 40}", entry((seed + i) % 40))


def test_kill_during_writes_leaves_a_sound_directory(tmp_path: Path) -> None:
    budget = 12 * FILE_BYTES
    ctx = mp.get_context("fork")
    rng = random.Random(0)
    for round_ in range(4):
        proc = ctx.Process(target=_writer, args=(str(tmp_path), 7 * round_, budget, 10**6))
        proc.start()
        time.sleep(0.3 + rng.random() * 0.4)
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join()
        reader = disk_store(tmp_path, budget)  # recovery: the killed writer is dead
        assert_directory_sound(tmp_path, budget)
        for key in list(reader.tiers[0]):
            got = reader.get(key)
            assert got is not None
            assert torch.equal(got.tensors["k"], entry(int(key[1:])).tensors["k"])


def test_two_writers_one_directory_small_budget(tmp_path: Path) -> None:
    budget = 10 * FILE_BYTES
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), seed, budget, 60)) for seed in (0, 5)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert_directory_sound(tmp_path, budget)
    reader = disk_store(tmp_path, budget)
    assert reader.tiers[0].recovery is not None
    assert reader.tiers[0].recovery.clean
    for key in list(reader.tiers[0]):
        got = reader.get(key)
        assert got is not None
        assert torch.equal(got.tensors["k"], entry(int(key[1:])).tensors["k"])


# -- the prompt cache over a faulted store answers as a full prefill ------------------------------

# One system prompt, four questions: reuse is of the exact prefix (and of the template's tail
# after a one-token change), so a prompt cache over a sound store answers as a full prefill.
LEDGER = " ".join(f"Ledger line {i}: {i * 7 % 13} barrels." for i in range(40))
PROMPTS = [[Message("system", (LEDGER,)), Message("user", (f"Question {q}?",))] for q in range(4)]


@pytest.fixture(scope="module")
def llama() -> Any:
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    return adapter


def serving_store(root: Path) -> TieredStore:
    host = MemoryTier("host", "cpu", 64 << 20)
    return TieredStore([host], DiskTier(root, 1 << 30, durable=False), write_through=True, write_queue=64)


def run_prompts(adapter: Any, store: TieredStore) -> list[tuple[float, torch.Tensor]]:
    """(cached share, first-token logits) of each prompt, through a fresh prompt cache."""
    pc = PromptCache(adapter, store, CONFIG)
    out = []
    for messages in PROMPTS:
        prepared = pc.prepare(prompt_of(pc, messages))
        out.append((prepared.usage.cached_tokens / prepared.usage.prompt_tokens, prepared.logits))
        pc.commit(prepared)
    return out


def test_restart_reuses_what_it_cached(llama: Any, tmp_path: Path) -> None:
    first = serving_store(tmp_path)
    run_prompts(llama, first)
    warm = run_prompts(llama, first)  # the same process again: what it had cached
    first.close()
    restarted = run_prompts(llama, serving_store(tmp_path))
    kept = sum(s for s, _ in restarted) / sum(s for s, _ in warm)
    assert kept >= 0.9, f"a restart reused {kept:.0%} of what the running process reused"


@pytest.mark.parametrize("fault", list(MISFILE))
def test_prompt_cache_over_misfiled_store_answers_as_full_prefill(
    llama: Any, tmp_path: Path, fault: str
) -> None:
    first = serving_store(tmp_path)
    run_prompts(llama, first)
    first.close()
    assert MISFILE[fault](tmp_path) >= 2
    store = serving_store(tmp_path)
    pc = PromptCache(llama, store, CONFIG)
    for messages in PROMPTS:
        prompt = prompt_of(pc, messages)
        prepared = pc.prepare(prompt)
        reference = full_prefill_logits(llama, prompt)
        torch.testing.assert_close(prepared.logits, reference, atol=1e-4, rtol=1e-4)
        pc.commit(prepared)
    assert store.stats().tier("disk").misfiled >= 2
