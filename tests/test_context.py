"""The context manager under random sequences of append, slide, reorder and recall.

A slow reference window is kept beside it: every chunk occurrence remembers the KV it had when it
was prefilled (computed by the reference on its own cache, rotated in float64). With full-rank
patches a recalled chunk must come back with exactly that KV, survivors must only have rotated,
and the assembled cache must equal the reference chunk by chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from agent.adapters.base import ModelAdapter, TextInput
from agent.adapters.loading import load_adapter
from agent.adapters.vision import VisionAdapter, encoder_calls
from agent.context import ContextManager, RecallError, Source, WindowConfig
from cache.arena import StaleCacheError
from cache.patch import PatchConfig
from cache.rank import rank_strategy
from cache.rope import unrotate
from cache.store import StoreConfig, TieredStore
from tests.test_rope import reference_rotate

BUDGET = 64
FULL_RANK = PatchConfig(rank=rank_strategy("fixed", rank=64), storage="float32", solver="exact")


@pytest.fixture(scope="module")
def adapter() -> ModelAdapter:
    return load_adapter("tiny:llama-gqa")


def pool(n: int = 6) -> list[TextInput]:
    g = torch.Generator().manual_seed(7)
    return [
        TextInput(torch.randint(2, 500, (int(torch.randint(4, 14, (1,), generator=g)),), generator=g))
        for _ in range(n)
    ]


@dataclass
class RefChunk:
    chunk_id: str
    k: torch.Tensor  # pre-RoPE conditioned KV from when it was prefilled
    v: torch.Tensor


class Reference:
    """The window as plain lists; KV placed with the float64 reference rotation."""

    def __init__(self, adapter: ModelAdapter, prefix: TextInput) -> None:
        self.adapter = adapter
        kv = adapter.encode(prefix)
        self.window = [RefChunk("prefix", kv.k, kv.v)]
        self.evicted: dict[str, RefChunk] = {}

    def placed(self, offset: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out, start = [], offset
        for c in self.window:
            n = c.k.shape[2]
            out.append(
                (reference_rotate(c.k, torch.arange(start, start + n), self.adapter.spec).float(), c.v)
            )
            start += n
        return out

    def append(self, chunk_id: str, chunk: TextInput) -> None:
        cache = self.adapter.new_cache(self.placed())
        start = sum(c.k.shape[2] for c in self.window)  # the reference window sits at position 0
        kv = self.adapter.prefill(chunk, cache, start).kv
        self.window.append(RefChunk(chunk_id, kv.k, kv.v))


def check(cm: ContextManager, ref: Reference, adapter: ModelAdapter) -> None:
    view = cm.view()
    # positions contiguous from the pinned prefix, budget held
    assert view[0].source == Source.PREFIX
    assert view[0].start == 0
    for a, b in itertools.pairwise(view):
        assert b.start == a.start + a.extent
    assert cm.tokens <= BUDGET
    assert [v.chunk_id for v in view[1:]] == [c.chunk_id for c in ref.window[1:]]
    # the assembled cache equals the reference, chunk by chunk, at the window's offset
    offset = cm.offset
    assert 0 <= offset <= BUDGET
    placed = ref.placed(offset)
    assert len(placed) == len(view)
    for i, (k_ref, v_ref) in enumerate(placed):
        k, v = cm.placed_kv(i)
        torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=2e-5)
    # the live cache holds the window's tokens and nothing else
    cache = cm.cache()
    assert adapter.cache_length(cache) == cm.tokens
    # and the model reads the same next token from it as from the reference at offset 0
    probe = TextInput(torch.tensor([11, 12, 13]))
    got = adapter.next_logits(probe, cache, cm.next_start)
    want = adapter.next_logits(probe, adapter.new_cache(ref.placed(0)), cm.tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cm.invalidate()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 5)),
        st.tuples(st.just("slide"), st.integers(1, 2)),
        st.tuples(st.just("reorder"), st.randoms(use_true_random=False)),
        st.tuples(st.just("recall"), st.integers(0, 10), st.integers(1, 6)),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_window_operations_keep_every_invariant(adapter: ModelAdapter, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    chunks = pool()
    prefix = TextInput(torch.arange(2, 8))
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET, patch=FULL_RANK), prefix)
    ref = Reference(adapter, prefix)
    appended: set[str] = set()
    for op in ops:
        if op[0] == "append":
            chunk = chunks[op[1]]
            cid = adapter.chunk_key(chunk)
            # the reference slides exactly as the window must: oldest first, until it fits
            while sum(c.k.shape[2] for c in ref.window) + chunk.n_tokens > BUDGET:
                gone = ref.window.pop(1)
                ref.evicted[gone.chunk_id] = gone
            cm.append(chunk)
            ref.append(cid, chunk)
            appended.add(cid)
        elif op[0] == "slide":
            n = min(op[1], len(ref.window) - 1)
            for cid in cm.slide(n):
                gone = ref.window.pop(1)
                assert gone.chunk_id == cid
                ref.evicted[cid] = gone
        elif op[0] == "reorder":
            order = [v.chunk_id for v in cm.view()[1:]]
            op[1].shuffle(order)
            if len(set(order)) == len(order):  # duplicates reorder ambiguously in the reference
                cm.reorder(order)
                by_id = {c.chunk_id: c for c in ref.window[1:]}
                ref.window[1:] = [by_id[cid] for cid in order]
        else:
            evicted = [e for e in cm.evicted if e not in {v.chunk_id for v in cm.view()}]
            if not evicted:
                continue
            cid = evicted[op[1] % len(evicted)]
            at = min(op[2], len(ref.window))
            came_back = ref.evicted.pop(cid)
            cm.recall(cid, at)
            ref.window.insert(at, came_back)
            while sum(c.k.shape[2] for c in ref.window) > BUDGET:
                victim = next(i for i, c in enumerate(ref.window[1:], 1) if c is not came_back)
                gone = ref.window.pop(victim)
                ref.evicted[gone.chunk_id] = gone
        check(cm, ref, adapter)
        # nothing lost: every chunk ever appended is in the window or recallable
        assert appended <= {v.chunk_id for v in cm.view()} | set(cm.evicted)


def test_recall_of_an_unknown_chunk_is_refused(adapter: ModelAdapter) -> None:
    store = TieredStore.from_config(StoreConfig(host_bytes=1 << 20))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET), TextInput(torch.arange(2, 8)))
    with pytest.raises(RecallError):
        cm.recall("0" * 64)
    with pytest.raises(ValueError, match="permutation"):
        cm.reorder(["nope"])
    with pytest.raises(ValueError, match="cannot fit"):
        cm.append(TextInput(torch.arange(2, 2 + BUDGET)))
    assert cm.tokens == 6  # the window is unchanged after every refusal


def test_recall_after_store_eviction_recomputes_and_says_so(adapter: ModelAdapter) -> None:
    store = TieredStore.from_config(StoreConfig(host_bytes=1))  # holds nothing
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET), TextInput(torch.arange(2, 8)))
    a = pool()[0]
    cm.append(a)
    cid = cm.slide(1)[0]
    view = cm.recall(cid)
    assert view.source == Source.CANONICAL  # no patch survived in the store: blind reuse, reported
    assert cm.counters.recompute_on_miss == 1


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_vision_encoder_runs_once_per_distinct_image_over_a_long_session(name: str) -> None:
    adapter = load_adapter(f"tiny:{name}")
    assert isinstance(adapter, VisionAdapter)
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=80), TextInput(torch.arange(2, 6)))
    colours = ["red", "green", "blue", "yellow", "purple"]
    images = [adapter.image(Image.new("RGB", (56, 56), c)) for c in colours]
    seen = []
    for step in range(14):
        cm.append(images[(step * 3) % 5])  # repeats, and the window slides as it fills
        seen.append(images[(step * 3) % 5].content_key)
        cm.finalize()
        if step % 4 == 3 and cm.evicted:
            cm.recall(cm.evicted[0], at=1)
    order = [v.chunk_id for v in cm.view()[1:]]
    cm.reorder(order[::-1])
    cm.cache()
    assert adapter.vision_encoder_calls == len(set(seen)) == 5


def test_conditioned_keep_recalls_the_exact_kv_without_extra_passes(adapter: ModelAdapter) -> None:
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    config = WindowConfig(budget_tokens=BUDGET, keep="conditioned")
    cm = ContextManager(adapter, store, config, TextInput(torch.arange(2, 8)))
    a, b = pool()[:2]
    cm.append(a)
    cm.append(b)
    k_b, offset_b = cm.placed_kv(2)[0], cm.offset
    cid_a = cm.view()[1].chunk_id
    cm.slide(2)
    cm.recall(cid_a)
    cm.recall(cm.evicted[0])  # b comes back after a: both at their first starts again
    assert [v.source for v in cm.view()[1:]] == [Source.CONDITIONED, Source.CONDITIONED]
    assert cm.counters.canonical_encodes == 0
    k_after, offset_after = cm.placed_kv(2)[0], cm.offset
    positions = torch.arange(6 + a.n_tokens, 6 + a.n_tokens + b.n_tokens)
    torch.testing.assert_close(
        unrotate(k_after, positions + offset_after, adapter.spec),
        unrotate(k_b, positions + offset_b, adapter.spec),
        rtol=1e-5,
        atol=1e-6,
    )


def test_window_moves_touch_only_what_moved(adapter: ModelAdapter) -> None:
    """A slide rotates the prefix, not the survivors (the window shifts as a whole); a recall at
    the front writes the recalled chunk and moves the prefix back; the arena holds no holes."""
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    prefix = TextInput(torch.arange(2, 8))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET, patch=FULL_RANK), prefix)
    chunks = pool()[:4]
    for chunk in chunks:
        cm.append(chunk)
    cm.cache()
    assert cm.offset == 0
    rotated, rebuilds = cm.counters.tokens_rotated, cm.counters.rebuilds
    gone = cm.slide(1)[0]
    cache = cm.cache()
    assert cm.offset == chunks[0].n_tokens
    assert cm.counters.tokens_rotated - rotated == prefix.n_tokens
    assert adapter.cache_length(cache) == cm.tokens
    rotated = cm.counters.tokens_rotated
    cm.recall(gone, at=1)
    cache = cm.cache()
    assert cm.offset == 0
    assert cm.counters.tokens_rotated - rotated == prefix.n_tokens + chunks[0].n_tokens
    assert adapter.cache_length(cache) == cm.tokens
    assert cm.counters.rebuilds == rebuilds  # all of it in place
    # a reorder that keeps the first two chunks in place rotates only the two that moved
    rotated = cm.counters.tokens_rotated
    ids = [v.chunk_id for v in cm.view()[1:]]
    cm.reorder([*ids[:2], ids[3], ids[2]])
    cm.cache()
    assert cm.counters.tokens_rotated - rotated == chunks[2].n_tokens + chunks[3].n_tokens


def test_a_cache_from_before_a_window_change_refuses_to_write(adapter: ModelAdapter) -> None:
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET), TextInput(torch.arange(2, 8)))
    for chunk in pool()[:3]:
        cm.append(chunk)
    old, start = cm.cache(), cm.next_start
    probe = TextInput(torch.tensor([11, 12]))
    adapter.next_logits(probe, old, start)  # the question's tokens go into spare room
    assert adapter.cache_length(old) == cm.tokens + 2
    cm.invalidate()
    fresh = cm.cache()
    assert adapter.cache_length(fresh) == cm.tokens  # the question is gone, nothing moved
    with pytest.raises(StaleCacheError):
        adapter.next_logits(probe, old, start)
    cm.slide(1)
    with pytest.raises(StaleCacheError):
        adapter.next_logits(probe, fresh, start)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2.5-vl", "qwen3-vl", "deepseek-mla"])
def test_append_many_equals_appending_one_by_one(name: str) -> None:
    """Several chunks in one forward pass (split where the budget requires, sliding as needed):
    the same window, the same KV, the same answer as appending them one at a time."""
    adapter = load_adapter(f"tiny:{name}")
    prefix = TextInput(torch.arange(2, 8))
    if isinstance(adapter, VisionAdapter):
        colours = ["red", "green", "blue", "red", "purple"]
        chunks = [adapter.image(Image.new("RGB", (56, 56), c)) for c in colours]
    else:
        chunks = pool()[:5]
    budget = sum(c.n_tokens for c in chunks[1:]) + prefix.n_tokens  # the first one has to slide out
    windows = []
    for batched in (False, True):
        store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
        cm = ContextManager(adapter, store, WindowConfig(budget_tokens=budget), prefix)
        calls = encoder_calls(adapter)
        if isinstance(adapter, VisionAdapter):
            adapter.clear_vision_cache()
        if batched:
            ids = cm.append_many(chunks, [{"i": i} for i in range(len(chunks))])
            assert ids == [adapter.chunk_key(c) for c in chunks]  # the evicted first one included
        else:
            for i, chunk in enumerate(chunks):
                cm.append(chunk, {"i": i})
        if isinstance(adapter, VisionAdapter):  # four distinct images, each encoded once
            assert encoder_calls(adapter) - calls == 4
        view = cm.view()
        assert [v.meta["i"] for v in view[1:]] == [1, 2, 3, 4]
        kvs = [cm.placed_kv(i) for i in range(len(view))]
        probe = TextInput(torch.tensor([11, 12, 13]))
        logits = adapter.next_logits(probe, cm.cache(), cm.next_start)
        windows.append((kvs, logits, cm.offset))
    (kv_a, logits_a, offset_a), (kv_b, logits_b, offset_b) = windows
    for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True):
        torch.testing.assert_close(ka, kb, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(va, vb, rtol=1e-4, atol=1e-5)
    assert offset_a == offset_b
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2.5-vl", "qwen3-vl", "deepseek-mla"])
def test_append_and_ask_is_append_many_then_the_prompt(name: str) -> None:
    """The new chunks and a prompt in one forward pass: the same window and chunk ids, the prompt's
    logits, and a live cache that holds the prompt after the window (decoding goes on there), as
    appending then running the prompt gives; with a window too small for one pass, the same."""
    adapter = load_adapter(f"tiny:{name}")
    prefix = TextInput(torch.arange(2, 8))
    if isinstance(adapter, VisionAdapter):
        chunks = [adapter.image(Image.new("RGB", (56, 56), c)) for c in ("red", "green", "blue")]
    else:
        chunks = pool()[:3]
    prompt, token = TextInput(torch.tensor([11, 12, 13])), 14
    for budget in (4096, prefix.n_tokens + chunks[0].n_tokens + chunks[1].n_tokens):
        got = []
        for merged in (False, True):
            store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
            cm = ContextManager(adapter, store, WindowConfig(budget_tokens=budget), prefix)
            metas = [{"i": i} for i in range(len(chunks))]
            if merged:
                ids, logits = cm.append_and_ask(chunks, metas, prompt)
            else:
                ids = cm.append_many(chunks, metas)
                logits = adapter.next_logits(prompt, cm.cache(), cm.next_start)
            cache, start = cm.cache(), cm.next_start
            assert adapter.cache_length(cache) == cm.tokens + prompt.n_tokens
            after = adapter.decode_step(token, cache, start + prompt.n_tokens)
            got.append((ids, [v.meta for v in cm.view()[1:]], logits, after))
        (ids_a, metas_a, logits_a, after_a), (ids_b, metas_b, logits_b, after_b) = got
        assert (ids_a, metas_a) == (ids_b, metas_b)
        torch.testing.assert_close(logits_b, logits_a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(after_b, after_a, rtol=1e-4, atol=1e-4)


def test_adopting_kv_that_is_not_the_live_cache_s_next_tokens_rewrites_it(adapter: ModelAdapter) -> None:
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET), TextInput(torch.arange(2, 8)))
    a, b, c = pool()[:3]
    cm.append(a)
    cache, start = cm.cache(), cm.next_start
    kv_b = adapter.prefill(b, cache, start).kv  # b then c prefilled; only c is adopted
    kv_c = adapter.prefill(c, cache, start + kv_b.extent).kv
    cm.adopt(c, kv_c, cache)
    k, v = cm.placed_kv(2)
    torch.testing.assert_close(v, kv_c.v)
    torch.testing.assert_close(k, kv_c.place(cm.view()[2].start + cm.offset, adapter.spec)[0])
    assert adapter.cache_length(cm.cache()) == cm.tokens


def test_an_unknown_rotation_kernel_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="rope_kernel"):
        WindowConfig(rope_kernel="fastest")
    assert WindowConfig().rope_kernel == "auto"


def test_context_keys_hash_each_chunk_id_once(adapter: ModelAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recording a chunk and asking which chunks are exact hash only the ids new to the window:
    hashing every prefix again was quadratic (n(n+1)/2 ids for each of exact_run and n adopts)."""
    import cache.keys as keys

    frame, hashed = keys._frame, []

    def counted(tag: bytes, payload: bytes) -> bytes:
        if tag == b"b" and len(payload) == 64:  # a chunk id going into a context key
            hashed.append(payload)
        return frame(tag, payload)

    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    cm = ContextManager(
        adapter, store, WindowConfig(budget_tokens=4096, keep="conditioned"), TextInput(torch.arange(2, 8))
    )
    chunks = [TextInput(torch.tensor([i + 2, i + 3])) for i in range(32)]
    monkeypatch.setattr(keys, "_frame", counted)
    ids = cm.append_many(chunks)
    assert cm.exact_run(ids) == 32
    assert cm.exact
    assert len(hashed) == 33  # the prefix and each chunk, once
    cm.cut(16, store=False)
    cm.append(chunks[0])
    assert cm.exact_run(ids[:16]) == 16
    assert len(hashed) == 34  # the cut window's keys were kept: one new id


def test_a_cut_leaves_the_kept_chunks_where_they_are(adapter: ModelAdapter) -> None:
    """Cutting the window back (as a question whose window shares a leading run with the last one
    does) rewrites nothing: the kept chunks' keys stay as placed, the cut tail is given up."""
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    cm = ContextManager(
        adapter, store, WindowConfig(budget_tokens=4096, keep="conditioned"), TextInput(torch.arange(2, 8))
    )
    ids = cm.append_many(pool(6))
    cm.cache()
    rotated, rebuilds = cm.counters.tokens_rotated, cm.counters.rebuilds
    assert cm.cut(3, store=False) == ids[:2:-1]
    cm.cache()
    assert (cm.counters.tokens_rotated, cm.counters.rebuilds) == (rotated, rebuilds)
    assert cm.exact_run(ids) == 3


def test_exact_run_counts_only_kv_computed_after_the_chunks_in_front_of_it(adapter: ModelAdapter) -> None:
    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    cm = ContextManager(
        adapter, store, WindowConfig(budget_tokens=BUDGET, keep="conditioned"), TextInput(torch.arange(2, 8))
    )
    a, b, c = pool()[:3]
    ids = cm.append_many([a, b, c])
    assert cm.exact_run(ids) == 3
    assert cm.exact_run(ids[:2]) == 2
    assert cm.exact_run([ids[0], ids[2], ids[1]]) == 1  # c was computed after b, not after a
    assert cm.exact_run(ids[::-1]) == 0
    cm.reorder([ids[1], ids[0], ids[2]])  # b and a moved: other chunks in front of them
    assert cm.exact_run([ids[1], ids[0], ids[2]]) == 0
    cm.reorder(ids)  # back where they were computed: exact again, only rotated
    assert cm.exact_run(ids) == 3
    assert cm.cut(1) == [ids[2], ids[1]]  # newest first; a stays where it is
    assert [v.chunk_id for v in cm.view()[1:]] == [ids[0]]
    assert cm.exact_run(ids) == 1
    cm.recall(ids[1])  # its stored conditioned KV, computed after a: exact in that place
    assert cm.exact_run(ids) == 2
    cm.slide(1)  # a gone: b's KV was computed after a, which is no longer in front of it
    assert cm.exact_run(ids[1:]) == 0
    with pytest.raises(ValueError, match="keep"):
        cm.cut(5)
    assert cm.cut(0, store=False) == [ids[1]]  # dropped: nothing stored, nothing to recall
    assert ids[1] not in cm.evicted
    with pytest.raises(RecallError):
        cm.recall(ids[1])


def _placed_in_order(adapter: ModelAdapter, cm: ContextManager) -> tuple[object, torch.Tensor, torch.Tensor]:
    """The window's placed KV laid out in window order on a cache of its own, with every chunk's
    input embeddings and positions after the prefix (the window as a sequence)."""
    kvs = [cm.placed_kv(i) for i in range(len(cm.view()))]
    k, v = torch.cat([kv[0] for kv in kvs], dim=2), torch.cat([kv[1] for kv in kvs], dim=2)
    views = cm.view()
    hidden = torch.cat([adapter.embed(s.input) for s in cm._slots[1:]])
    positions = torch.cat([torch.arange(view.n_tokens) + view.start + cm.offset for view in views[1:]])
    return adapter.new_cache([(k, v)]), hidden, positions


def test_residual_reads_the_window_in_its_order_not_the_arena_s(adapter: ModelAdapter) -> None:
    """After a reorder the arena holds chunks out of window order (values stay where they were):
    the residual measured on the window equals the one measured on the same KV laid out in window
    order, and leaves the window's KV bit for bit as it was; read in arena order it differs."""
    from agent.recompute import measure_residual

    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    prefix = TextInput(torch.arange(2, 8))
    cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET), prefix)
    for chunk in pool()[:4]:
        cm.append(chunk)
    assert cm.residual() == 0.0  # exact: nothing to measure
    ids = [v.chunk_id for v in cm.view()[1:]]
    cm.reorder([ids[2], ids[0], ids[1], ids[3]])
    before = [cm.placed_kv(i) for i in range(len(cm.view()))]
    got = cm.residual()
    after = [cm.placed_kv(i) for i in range(len(cm.view()))]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[1], b[1])
    seq_cache, hidden, positions = _placed_in_order(adapter, cm)
    n_prefix = prefix.n_tokens
    rows = torch.arange(n_prefix, n_prefix + hidden.shape[0])
    want = measure_residual(adapter, seq_cache, hidden, rows, positions)
    assert got is not None
    assert got > 0
    assert got == pytest.approx(want, rel=1e-4)
    # the arena's rows in arena order: the window's chunks read as if they came in that order
    arena_rows = torch.cat([torch.arange(i, i + n) for s in cm._slots[1:] for i, n in s.segs])
    sort = torch.argsort(arena_rows)
    wrong = measure_residual(adapter, cm.cache(), hidden[sort], arena_rows[sort], positions[sort])
    assert abs(wrong - want) > 1e-3 * want


def test_a_repaired_chunk_never_counts_as_exact_again(adapter: ModelAdapter) -> None:
    """Moved back where it was computed, a chunk's KV is exact again (its context key matches);
    once tokens of it were recomputed in the window, it is not: its KV there is no longer what
    the store holds."""
    from agent.recompute import DeviationSelection

    def window() -> tuple[ContextManager, list[str]]:
        store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
        cm = ContextManager(adapter, store, WindowConfig(budget_tokens=BUDGET), TextInput(torch.arange(2, 8)))
        for chunk in pool()[:4]:
            cm.append(chunk)
        ids = [v.chunk_id for v in cm.view()[1:]]
        cm.reorder([ids[1], ids[0], ids[2], ids[3]])
        return cm, ids

    cm, ids = window()
    assert cm.exact_run(ids) == 0
    cm.reorder(ids)
    assert cm.exact_run(ids) == len(ids)  # moved back: exact again
    cm, ids = window()
    done = cm.repair(lambda c: DeviationSelection(0.5, c))
    assert done is not None
    assert done.tokens > 0
    assert cm.counters.tokens_repaired == done.tokens
    cm.reorder(ids)
    assert cm.exact_run(ids) == 0
