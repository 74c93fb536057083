"""The prompt cache against full prefill on tiny random models; chat pieces; decoding helpers."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from agent.adapters import attention
from agent.adapters.base import ImageInput
from agent.adapters.loading import load_adapter
from agent.engine import reuse
from agent.engine.answer import answer
from agent.engine.chat import ByteTokenizer, ImagePiece, Message, TextPiece, render
from agent.engine.generation import Sampler, SamplingParams, TextStream, decode
from agent.engine.prompt import PromptKeys, Record
from agent.engine.prompt_cache import Prompt, PromptCache, PromptCacheConfig, build_prompt
from agent.engine.reuse import Finder, follow_runs, run_starts, run_tokens
from cache.cdc import CDCConfig
from cache.planner import Plan, PlannedChunk, PlannerConfig
from cache.store import Entry, StoreConfig, TieredStore

DOC = " ".join(f"line {i} says {i * i}." for i in range(60))
CONFIG = PromptCacheConfig(planner=PlannerConfig(cdc=CDCConfig(min_size=8, avg_size=32, max_size=128)))


@pytest.fixture(scope="module")
def llama() -> Any:
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    return adapter


@pytest.fixture(scope="module")
def qwen_vl() -> Any:
    adapter = load_adapter("tiny:qwen2.5-vl")
    adapter.tokenizer = ByteTokenizer()
    return adapter


def make_cache(adapter: Any) -> PromptCache:
    return PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)), CONFIG)


def prompt_of(pc: PromptCache, messages: list[Message]) -> Prompt:
    return build_prompt(pc.adapter, render(pc.adapter.tokenizer, messages), pc.image_unit)


def full_prefill_logits(adapter: Any, prompt: Prompt) -> torch.Tensor:
    cache, pos, logits = adapter.empty_cache(), 0, None
    for inp in prompt.inputs_between(0, len(prompt.units)):
        out = adapter.prefill(inp, cache, pos)
        pos, logits = pos + out.kv.extent, out.logits[-1]
    assert logits is not None
    return logits


def chat(first: str, question: str = "What?") -> list[Message]:
    return [Message("system", (f"{first}\n{DOC}",)), Message("user", (question,))]


def greedy(pc: PromptCache, prepared: Any, n: int = 12) -> list[int]:
    params = SamplingParams(max_tokens=n)
    out = decode(pc.adapter, prepared.logits, prepared.cache, prepared.position, params, threading.Event())
    return out.tokens


def layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_exact_prefix_reuse_is_bit_identical_to_a_full_prefill(llama: Any) -> None:
    pc = make_cache(llama)
    prompt = prompt_of(pc, chat("Today"))
    cold = pc.prepare(prompt)
    pc.commit(cold)
    assert cold.usage.cached_tokens == 0
    assert cold.usage.prefilled_tokens == prompt.n_tokens
    warm = pc.prepare(prompt, mode="exact")
    # reused to the token before the last (each prompt's last token is prefilled for its logits)
    assert warm.usage.prefix_tokens == prompt.n_tokens - 1
    assert warm.usage.prefilled_tokens == prompt.n_tokens - warm.usage.prefix_tokens
    fresh = pc.prepare(prompt, "a fresh salt")  # nothing to reuse: the full prefill
    assert fresh.usage.cached_tokens == 0
    assert torch.equal(warm.logits, fresh.logits)
    for (k1, v1), (k2, v2) in zip(layer_kv(warm.cache), layer_kv(fresh.cache), strict=True):
        assert torch.equal(k1, k2)
        assert torch.equal(v1, v2)
    assert greedy(pc, warm) == greedy(pc, fresh)
    # the segmented prefill is the model's own one-pass prefill to float rounding
    torch.testing.assert_close(fresh.logits, full_prefill_logits(llama, prompt), atol=1e-4, rtol=1e-4)


def test_an_appended_conversation_reuses_exactly_in_every_mode(llama: Any) -> None:
    pc = make_cache(llama)
    first = [Message("system", (DOC,)), Message("user", ("What does line 3 say?",))]
    pc.commit(pc.prepare(prompt_of(pc, first)))
    turn = [*first, Message("assistant", ("It says 9.",)), Message("user", ("And line 4?",))]
    prompt = prompt_of(pc, turn)
    reference = pc.prepare(prompt, "reference")
    for mode in ("exact", "repair", "fast"):
        warm = pc.prepare(prompt, mode=mode)
        assert warm.usage.mode == mode
        assert warm.usage.prefix_tokens > 0.8 * prompt.n_tokens
        if mode != "fast":  # no template fragment is reused blind at a moved position
            assert warm.usage.relocated_tokens == 0
            assert torch.equal(warm.logits, reference.logits)


def test_the_exact_prefix_is_found_by_its_keys_without_the_indexes(llama: Any) -> None:
    pc = make_cache(llama)
    prompt = prompt_of(pc, chat("Restart"))
    pc.commit(pc.prepare(prompt))
    later = PromptCache(llama, pc.store, CONFIG)  # a restarted server, or a replica, on the same store
    warm = later.prepare(prompt, mode="exact")
    # whole segments by their keys, then the last one to the token by the pointer left after them
    assert warm.usage.prefix_tokens == prompt.n_tokens - 1
    assert torch.equal(warm.logits, later.prepare(prompt, "reference").logits)
    assert later.prepare(prompt, "another tenant").usage.cached_tokens == 0


def test_another_process_finds_the_exact_prefix_to_the_token_by_its_pointer(llama: Any) -> None:
    """Two prompts that part inside a segment: a process that never saw the first (no radix tree)
    reuses it to where they part, by the pointer the first left after the content before the
    segment; a pointer whose tokens or row do not check out is a miss, and the prefix ends at the
    last whole segment. Every answer is the full prefill's."""
    from agent.engine.reuse import after_key

    pc = make_cache(llama)
    first = prompt_of(pc, chat("Pointer", "What is the first entry? " + "Say it. " * 20))
    pc.commit(pc.prepare(first))
    second = prompt_of(pc, chat("Pointer", "What is the first entry? " + "Tell me. " * 20))
    parted = int(np.flatnonzero(first.units[: second.n_tokens] != second.units[: first.n_tokens])[0])
    block = CONFIG.block_tokens
    assert parted % block  # inside a segment

    def served() -> int:
        later = PromptCache(llama, pc.store, CONFIG)  # a replica, or the server restarted
        warm = later.prepare(second, mode="exact")
        assert torch.equal(warm.logits, later.prepare(second, "reference").logits)
        return warm.usage.prefix_tokens

    assert served() == parted
    ctx = PromptKeys(first, pc.planner("").namespace, first.cuts(block))
    key = after_key(ctx, parted // block * block)
    good = pc.store.get(key)
    assert good is not None
    ((row_key, row_ids),) = good.meta["rows"]
    ids = list(row_ids)
    ids[1] += 1  # tokens the row does not hold
    pc.store.put(key, Entry({}, {"rows": [[row_key, ids]]}))
    assert served() == parted // block * block
    pc.store.put(key, Entry({}, {"rows": [["gone/exact", list(row_ids)]]}))  # another row
    assert served() == parted // block * block
    for damaged in (
        {"ids": "many"},
        {"rows": [[row_key, 5]]},
        {"rows": [[row_key, [2**70]]]},
        {"rows": [row_key, list(row_ids)]},
    ):
        pc.store.put(key, Entry({}, damaged))  # not a pointer: a miss, and a commit writes a good one
        assert served() == parted // block * block
        again = PromptCache(llama, pc.store, CONFIG)
        again.commit(again.prepare(first, "another tenant"))
    pc.store.put(key, good)
    pc.store.delete(row_key)  # the row itself evicted
    assert served() == parted // block * block
    # the process that saw the first prompt: its radix tree knew more than the store now holds
    assert pc.prepare(second, mode="exact").usage.lost_entries == 1


def test_an_exact_hit_on_disk_needs_the_numerics_it_was_computed_under(
    llama: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    """Three processes on one disk store directory: the first commits a prompt under two threads'
    numerics; one under other numerics (a thread count of 1) finds none of its KV, neither as an
    exact prefix nor by content, while one under the first's numerics reuses its exact prefix."""
    from cache.numerics import numerics

    def process(threads: int) -> PromptCache:
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        store = TieredStore.from_config(
            StoreConfig(host_bytes=64 << 20, disk_bytes=64 << 20, disk_path=tmp_path, write_through=True)
        )
        pc = PromptCache(llama, store, CONFIG)
        assert pc.namespace("").numerics == numerics(llama.device, attention.numerics_name(llama.attention))
        assert attention.LAYOUT in pc.namespace("").numerics  # how the prefill blocks were run
        assert f"threads={threads}," in pc.namespace("").numerics
        return pc

    first = process(2)
    prompt = prompt_of(first, chat("Numerics"))
    first.commit(first.prepare(prompt))
    first.store.close()  # every entry on disk
    other = process(1).prepare(prompt, mode="repair")
    assert other.usage.cached_tokens == 0
    assert other.usage.prefilled_tokens == prompt.n_tokens
    same = process(2).prepare(prompt, mode="exact")
    assert same.usage.prefix_tokens == prompt.n_tokens - 1  # by keys and pointers on disk


def test_moved_content_is_found_by_its_alias_without_the_indexes(llama: Any) -> None:
    pc = make_cache(llama)
    pc.commit(pc.prepare(prompt_of(pc, chat("Now: 1"))))
    later = PromptCache(llama, pc.store, CONFIG)  # another replica on the same store
    moved = prompt_of(later, chat("Now: a much longer first line, which shifts all that follows"))
    warm = later.prepare(moved, mode="fast")
    assert warm.usage.relocated_tokens > 0.5 * len(DOC)
    assert later.prepare(moved, mode="exact").usage.relocated_tokens == 0
    assert PromptCache(llama, pc.store, CONFIG).prepare(moved, "other", mode="fast").usage.cached_tokens == 0


def test_prefix_hits_never_come_from_an_approximate_record(llama: Any) -> None:
    pc = make_cache(llama)
    pc.commit(pc.prepare(prompt_of(pc, chat("Now: 1"))))
    moved = prompt_of(pc, chat("Now: a much longer first line, which shifts all that follows"))
    fast = pc.prepare(moved, mode="fast")
    assert fast.usage.relocated_tokens > 0
    pc.commit(fast)  # its KV after the moved chunks is approximate: not in the radix tree
    again = pc.prepare(moved, mode="exact")
    assert again.usage.relocated_tokens == 0
    assert torch.equal(again.logits, pc.prepare(moved, "reference").logits)


def test_moved_content_is_relocated(llama: Any) -> None:
    pc = make_cache(llama)
    pc.commit(pc.prepare(prompt_of(pc, chat("Now: 1"))))
    moved = prompt_of(pc, chat("Now: a much longer first line, which shifts all that follows"))
    warm = pc.prepare(moved, mode="fast")
    u = warm.usage
    assert u.relocated_tokens > 0.8 * len(DOC)
    assert u.rotated_tokens == u.relocated_tokens
    assert u.prefix_tokens + u.relocated_tokens + u.prefilled_tokens == moved.n_tokens
    # blind reuse changes the logits a little, not wholesale
    reference = full_prefill_logits(llama, moved)
    assert float((warm.logits - reference).abs().max()) < 0.1 * float(reference.abs().max())


def test_repair_recomputes_small_pieces_and_repairs_large_ones(llama: Any) -> None:
    # no cap: a random model's repairs leave more than the guard's cap would let it decode on
    pc = PromptCache(llama, make_cache(llama).store, dataclasses.replace(CONFIG, repair_margin_cap=0.0))
    pc.commit(pc.prepare(prompt_of(pc, chat("Now: 1"))))
    moved = prompt_of(pc, chat("Now: a much longer first line, which shifts all that follows"))
    reference = pc.prepare(moved, "reference").logits
    fast, repair = pc.prepare(moved, mode="fast"), pc.prepare(moved, mode="repair")
    assert 0 < repair.usage.relocated_tokens <= fast.usage.relocated_tokens
    ratio = pc.config.repair_ratio
    assert 0 < repair.usage.repaired_tokens <= round(ratio * repair.usage.relocated_tokens) + 1
    err_fast = float((fast.logits - reference).abs().max())
    err_repair = float((repair.logits - reference).abs().max())
    assert err_repair < err_fast


def test_a_conversation_after_a_changed_header_reuses_its_last_turn_whole(llama: Any) -> None:
    """A system header that changes each request (a clock) moves all that follows; the turn that
    ended the last prompt, cut in template fragments and a question each too short to reuse
    alone and in a last chunk cut where that prompt ended, is reused whole: the chunks lay end
    to end there and still do."""
    pc = PromptCache(llama, make_cache(llama).store, dataclasses.replace(CONFIG, repair_margin_cap=0.0))
    turn = [Message("user", ("What does line 3 say?",))]
    first = prompt_of(pc, [Message("system", (f"Time 1.\n{DOC}",)), *turn])
    pc.commit(pc.prepare(first))
    later = [Message("system", (f"Time 12:00:01.\n{DOC}",)), *turn]
    later += [Message("assistant", ("It says 9.",)), Message("user", ("And line 4?",))]
    prompt = prompt_of(pc, later)
    shift = len("Time 12:00:01.") - len("Time 1.")  # one unit per byte
    tail = range(first.n_tokens - 40 + shift, first.n_tokens + shift)  # the question and its template
    for mode in ("repair", "fast"):
        warm = pc.prepare(prompt, mode=mode)
        reused = {u for row, kv in warm.rows if kv is None for u in range(row.start, row.end)}
        assert set(tail) <= reused, mode
        assert warm.usage.relocated_tokens > len(DOC)


def test_a_prompt_whose_kv_the_store_refused_does_not_take_over_the_index(
    llama: Any, monkeypatch: Any
) -> None:
    """The index points a chunk at the prompt seen last, unless the store refused some of that
    prompt's KV: then the chunk stays where its KV is, runs are not followed into that prompt,
    and the chunk is still reused."""
    pc = PromptCache(llama, make_cache(llama).store, dataclasses.replace(CONFIG, repair_margin_cap=0.0))
    turn = [Message("user", ("What does line 3 say?",))]
    pc.commit(pc.prepare(prompt_of(pc, [Message("system", (f"Time 1.\n{DOC}",)), *turn])))
    later = prompt_of(pc, [Message("system", (f"Time 12:00:01.\n{DOC}",)), *turn])
    with monkeypatch.context() as m:
        m.setattr("cache.records.put_kv", lambda *args: False)
        refused = pc.prepare(later, mode="exact")  # all of it prefilled: its own KV throughout
        pc.commit(refused)
    again = pc.prepare(later)  # lost: only the chunk new in the refused prompt (its header)
    assert again.usage.lost_entries <= 1
    assert again.usage.relocated_tokens > len(DOC)


def test_runs_are_followed_in_the_prompt_they_came_from(llama: Any) -> None:
    """After a hit from a record, a chunk holding the same units right after it there is taken
    from there (found elsewhere or missed); a miss alike for only its first units is split there;
    other chunks, and those after an exact prefix, are left as they are. Run sizes sum only what
    lies end to end in one record."""
    pc = make_cache(llama)
    prompt = prompt_of(pc, chat("Now"))
    units = prompt.units
    ctx = PromptKeys(prompt, pc.namespace(""))
    rec = Record((), prompt.tok_off, prompt.pos_off, 0, np.concatenate([[7, 7], units[:40]]))
    other = Record((), prompt.tok_off, prompt.pos_off, 0, units.copy())

    def chunk(a: int, b: int, status: str, src: int | None = None, payload: Any = None) -> PlannedChunk:
        return PlannedChunk(a, b, ctx.content_key(a, b), status, src, payload)  # type: ignore[arg-type]

    planned = [
        chunk(0, 10, "relocated-hit", 2, rec),  # rec holds units[:40] at 2..42
        chunk(10, 14, "relocated-hit", 10, other),  # the same units found elsewhere
        chunk(14, 20, "miss"),
        chunk(20, 50, "miss"),  # rec ends 20 units in
        chunk(50, 60, "miss"),
    ]
    out = follow_runs(prompt, ctx, planned)
    assert [(c.start, c.end, c.status, c.source_start) for c in out] == [
        (0, 10, "relocated-hit", 2),
        (10, 14, "relocated-hit", 12),
        (14, 20, "relocated-hit", 16),
        (20, 40, "relocated-hit", 22),
        (40, 50, "miss", None),
        (50, 60, "miss", None),
    ]
    assert all(c.payload is rec for c in out[:4])
    assert out[3].key == ctx.content_key(20, 40)
    assert out[4].key == ctx.content_key(40, 50)
    runs = run_tokens(prompt, out, 0)
    assert runs[:4] == [int(prompt.tok_off[40] - prompt.tok_off[0])] * 4
    assert runs[4:] == [10, 10]
    # other units right after the run, or a prefix before it: nothing changes
    moved = Record((), prompt.tok_off, prompt.pos_off, 0, np.concatenate([[7, 7], units[:10], [3] * 30]))
    kept = [chunk(0, 10, "relocated-hit", 2, moved), chunk(10, 14, "relocated-hit", 10, other)]
    assert follow_runs(prompt, ctx, kept) == kept
    assert run_tokens(prompt, kept, 0) == [10, 4]
    after_prefix = [chunk(0, 10, "prefix-hit"), chunk(10, 14, "miss")]
    assert follow_runs(prompt, ctx, after_prefix) == after_prefix


def test_a_run_is_reused_only_where_what_is_left_of_it_is_large_enough(llama: Any, monkeypatch: Any) -> None:
    """A run's chunks are fetched and checked one by one: where one is gone, what is left of the
    run is reused only if it still holds min_reuse_tokens (fast mode reuses any of it)."""
    pc = make_cache(llama)
    prompt = prompt_of(pc, chat("Now"))
    ctx = PromptKeys(prompt, pc.namespace(""), prompt.cuts(pc.config.block_tokens))
    rec = Record((), prompt.tok_off, prompt.pos_off, 0, np.concatenate([[7, 7], prompt.units[:60]]))
    planned = tuple(
        PlannedChunk(a, b, ctx.content_key(a, b), "relocated-hit", a + 2, rec)  # type: ignore[arg-type]
        for a, b in ((0, 20), (20, 40))
    )
    plan = Plan(planned, 0, prompt.n_tokens, ())
    gone: set[int] = set()

    def fetch(self: Finder, r: Record, a: int, b: int, shift: int) -> Any:
        return None if a in gone else (["kv"], ())

    monkeypatch.setattr(Finder, "fetch", fetch)
    monkeypatch.setattr(reuse, "fits", lambda *args: True)
    finder = Finder(pc.store, min_reuse_tokens=32)

    def reused(mode: str) -> list[tuple[int, int]]:
        steps, _ = finder.steps(prompt, plan, ctx, mode)
        return [(st.start, st.end) for st in steps if st.parts]

    assert reused("repair") == [(0, 20), (20, 40)]  # 40 tokens in one run
    gone.add(2)  # the first chunk's entry is gone: 20 tokens are left of the run
    assert reused("repair") == []
    assert reused("fast") == [(20, 40)]
    gone.clear()
    gone.add(22)
    assert reused("repair") == []


def test_a_chunk_holding_an_image_is_a_run_of_its_own(qwen_vl: Any) -> None:
    """Repair does not measure images, so text next to a reused image is not reused on its
    account: runs stop at a chunk that holds an image."""
    pc = make_cache(qwen_vl)
    prompt = prompt_of(pc, [Message("user", ("Look at", Image.new("RGB", (56, 56)), "and say what it is."))])
    img = next(p for p, inp in enumerate(prompt.inputs) if isinstance(inp, ImageInput))
    a, b = int(prompt.piece_unit[img]), int(prompt.piece_unit[img + 1])
    assert prompt.has_image(a, b)
    assert not prompt.has_image(0, a)
    assert not prompt.has_image(b, len(prompt.units))
    ctx = PromptKeys(prompt, pc.namespace(""))
    rec = Record((), prompt.tok_off, prompt.pos_off, 0, prompt.units.copy())
    cuts = [0, a - 2, a, b, b + 3, len(prompt.units)]
    chunks = [
        PlannedChunk(s, e, ctx.content_key(s, e), "relocated-hit", s, rec)  # type: ignore[arg-type]
        for s, e in itertools.pairwise(cuts)
    ]
    assert run_starts(prompt, chunks) == [0, 0, 2, 3, 3]
    sizes = run_tokens(prompt, chunks, 0)
    assert sizes[2] == int(prompt.tok_off[b] - prompt.tok_off[a])
    assert sizes[3] == int(prompt.tok_off[-2] - prompt.tok_off[b])  # the last unit is never reused


def test_after_reused_content_the_rest_runs_in_one_pass(llama: Any, monkeypatch: Any) -> None:
    """What follows content reused at a moved place is prefilled in one pass; so is an exact
    prefill (its segments joined: the blocked attention writes the KV of one pass), unless the
    model's KV depends on how its prefill was cut, when each segment is a pass."""
    pc = make_cache(llama)
    pc.commit(pc.prepare(prompt_of(pc, chat("Now: 1"))))
    question = " ".join(f"And what of item {i}?" for i in range(40))  # several blocks long
    moved = prompt_of(pc, chat("Now: a much longer first line, which shifts all that follows", question))
    passes: list[int] = []
    prefill = llama.prefill

    def counted(chunk: Any, *args: Any, **kwargs: Any) -> Any:
        passes.append(chunk.n_tokens)
        return prefill(chunk, *args, **kwargs)

    monkeypatch.setattr(llama, "prefill", counted)
    fast = pc.prepare(moved, mode="fast")
    assert fast.usage.relocated_tokens > 0
    assert max(passes) > pc.config.block_tokens  # the question after the reused document: one pass
    passes.clear()
    exact = pc.prepare(moved, mode="exact")
    # only the template's first tokens are reused exactly (to the token): the rest in one pass
    assert exact.usage.prefix_tokens < pc.config.block_tokens
    assert passes == [moved.n_tokens - exact.usage.prefix_tokens]
    passes.clear()
    monkeypatch.setattr(type(llama), "cut_invariant", property(lambda self: False))
    segmented = make_cache(llama)  # a model whose KV depends on the cut keeps its segments
    # (this one's does not: its segments give the joined pass's logits)
    assert torch.equal(segmented.prepare(moved, mode="exact").logits, exact.logits)
    assert max(passes) <= pc.config.block_tokens
    monkeypatch.undo()
    reference = full_prefill_logits(llama, moved)
    torch.testing.assert_close(exact.logits, reference, atol=1e-4, rtol=1e-4)
    assert float((fast.logits - reference).abs().max()) < 0.1 * float(reference.abs().max())


def test_lost_store_entries_are_prefilled_again(llama: Any) -> None:
    pc = make_cache(llama)
    prompt = prompt_of(pc, chat("Again"))
    pc.commit(pc.prepare(prompt))
    for key in pc.store.keys(""):
        pc.store.delete(key)
    warm = pc.prepare(prompt)
    assert warm.usage.lost_entries > 0
    assert warm.usage.cached_tokens == 0
    torch.testing.assert_close(warm.logits, full_prefill_logits(llama, prompt), atol=1e-4, rtol=1e-4)
    pc.commit(warm)
    assert pc.prepare(prompt).usage.prefix_tokens == prompt.n_tokens - 1


def test_an_unknown_reuse_mode_is_refused(llama: Any) -> None:
    pc = make_cache(llama)
    with pytest.raises(ValueError, match="reuse mode"):
        pc.prepare(prompt_of(pc, chat("x")), mode="bold")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reuse mode"):
        PromptCacheConfig(mode="bold")  # type: ignore[arg-type]


def test_tenants_never_share(llama: Any) -> None:
    pc = make_cache(llama)
    prompt = prompt_of(pc, chat("Shared"))
    pc.commit(pc.prepare(prompt, "tenant-a"))
    keys_a = set(pc.store.keys())
    other = pc.prepare(prompt, "tenant-b")
    assert other.usage.cached_tokens == 0
    pc.commit(other)
    assert not keys_a & (set(pc.store.keys()) - keys_a)
    assert len(pc.store.keys()) == 2 * len(keys_a)


def test_images_are_atomic_units_found_by_content(qwen_vl: Any) -> None:
    pc = make_cache(qwen_vl)
    rng = np.random.default_rng(0)
    a, b = (Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(2))
    first = prompt_of(pc, [Message("user", ("look", a, "now"))])
    assert first.n_images == 1
    image = next(i for i in first.inputs if isinstance(i, ImageInput))
    assert first.n_tokens == len(first.units) + image.n_tokens - 1
    pc.commit(pc.prepare(first))
    calls = qwen_vl.vision_encoder_calls
    later = prompt_of(pc, [Message("system", ("a new system prompt",)), Message("user", ("look", a, "now"))])
    moved = pc.prepare(later, mode="fast")
    assert qwen_vl.vision_encoder_calls == calls  # relocated, not re-encoded
    assert moved.usage.relocated_tokens >= image.n_tokens
    pc.prepare(later, mode="exact")  # recomputed from the cached features
    assert qwen_vl.vision_encoder_calls == calls
    other = pc.prepare(prompt_of(pc, [Message("user", ("look", b, "now"))]))
    assert qwen_vl.vision_encoder_calls == calls + 1  # same size, other pixels: a miss
    assert other.usage.cached_tokens < first.n_tokens - image.n_tokens


def test_text_beside_a_reused_image_is_repaired(qwen_vl: Any) -> None:
    """A document next to an image, found by content after a longer system prompt: repair
    recomputes its most deviating text tokens (the image keeps its reused KV, read with its
    features and M-RoPE positions, no encoder call), measures what it left, and a greedy answer
    under the guard is the full prefill's (a random model deviates far: never given up here, for
    the cap or for the cost)."""
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    pc = PromptCache(
        qwen_vl, store, dataclasses.replace(CONFIG, repair_margin_cap=0.0, repair_must_pay=False)
    )
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    user = Message("user", ("look at this", image, DOC))
    pc.commit(pc.prepare(prompt_of(pc, [Message("system", ("brief",)), user])))
    later = prompt_of(pc, [Message("system", ("a much longer system prompt than before, " * 3,)), user])
    calls = qwen_vl.vision_encoder_calls
    repaired = pc.prepare(later, mode="repair")
    u = repaired.usage
    assert u.served == "moved"
    assert u.relocated_tokens > 100
    assert u.repaired_tokens > 0  # an image beside the text no longer turns repair off
    assert 0 < u.repair_residual != pc.config.repair_residual_unit  # measured, not assumed
    assert qwen_vl.vision_encoder_calls == calls
    reference = greedy(pc, pc.prepare(later, "reference"))
    out = answer(pc, later, "", "repair", SamplingParams(max_tokens=12))
    assert out.decoded.tokens == reference


def test_render_pieces_follow_the_template() -> None:
    pieces = render(
        ByteTokenizer(), [Message("system", ("sys",)), Message("user", ("hi", Image.new("RGB", (8, 8))))]
    )
    kinds = [(type(p).__name__, getattr(p, "template", None)) for p in pieces]
    assert kinds == [
        ("TextPiece", True),
        ("TextPiece", False),
        ("TextPiece", True),
        ("TextPiece", False),
        ("ImagePiece", None),
        ("TextPiece", True),
    ]
    text = "".join(ByteTokenizer().decode(list(p.ids)) for p in pieces if isinstance(p, TextPiece))
    assert text == "system\nsys\nuser\nhi\nassistant\n"  # markers are special ids, not text
    assert isinstance(pieces[4], ImagePiece)


def test_render_with_smollm2_template() -> None:
    from agent.adapters.loading import ModelNotFoundError, resolve

    try:
        path = resolve(None)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    messages = [Message("user", ("Hello there",))]
    ids = [i for p in render(tok, messages) if isinstance(p, TextPiece) for i in p.ids]
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(ids) == expected  # default system prompt included by the template


def test_text_stream_holds_back_stop_prefixes() -> None:
    tok = ByteTokenizer()
    stream = TextStream(tok, ["END"])
    out = "".join(stream.push(t) for t in tok.encode("abcEN"))
    assert out == "abc"  # "EN" might become "END"
    out += "".join(stream.push(t) for t in tok.encode("Dzz"))
    assert stream.stopped
    assert out == "abc"
    assert stream.text == "abc"


def test_sampler_is_seeded() -> None:
    logits = torch.randn(512)
    draws = [[Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for _ in range(3)] for s in (1, 1, 2)]
    assert draws[0] == draws[1]
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(logits.argmax())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=3.0)


def test_decode_stops_when_cancelled(llama: Any) -> None:
    pc = make_cache(llama)
    prep = pc.prepare(prompt_of(pc, chat("x")))
    cancel = threading.Event()
    cancel.set()
    out = decode(llama, prep.logits, prep.cache, prep.position, SamplingParams(max_tokens=50), cancel)
    assert out.finish_reason in ("cancelled", "stop")
    assert len(out.tokens) <= 1


def test_an_unknown_rotation_kernel_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="rope_kernel"):
        PromptCacheConfig(rope_kernel="fastest")


def test_a_long_conversation_stays_bit_identical_turn_after_turn(llama: Any) -> None:
    """Each turn's exact prefix includes segments prefilled on top of earlier reuse, and the
    tokens a shorter prompt computed in its partial last segment, to where the prompts part (the
    prefill runs every attention block whole, so they have this prompt's bits)."""
    pc = make_cache(llama)
    messages = [Message("system", (f"Sys\n{DOC}",))]
    before = np.zeros(0, np.int64)  # the last prompt's units
    for turn in range(4):
        messages = [*messages, Message("user", (f"question {turn} " + "word " * 40,))]
        prompt = prompt_of(pc, messages)
        warm, fresh = pc.prepare(prompt, mode="exact"), pc.prepare(prompt, f"reference {turn}", mode="exact")
        m = min(len(before), prompt.n_tokens)
        parted = np.flatnonzero(before[:m] != prompt.units[:m])
        assert warm.usage.prefix_tokens == (int(parted[0]) if parted.size else m)  # all seen before
        assert torch.equal(warm.logits, fresh.logits)
        for (k1, v1), (k2, v2) in zip(layer_kv(warm.cache), layer_kv(fresh.cache), strict=True):
            assert torch.equal(k1, k2)
            assert torch.equal(v1, v2)
        pc.commit(warm)
        before = prompt.units
        messages = [*messages, Message("assistant", (f"answer {turn} " + "ok " * 30,))]
