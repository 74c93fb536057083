"""A prefill cut at block edges writes the KV of one pass, bit for bit: the attention kernel's
fixed blocks (``agent/adapters/attention.py``), then the prompt cache's exact reuse against the
engine's one-pass full prefill, under a scheduler's bound on passes and with images."""

from __future__ import annotations

import itertools
import random
import threading
from typing import Any

import pytest
import torch
from PIL import Image

from agent.adapters import attention, batched
from agent.adapters.base import ModelAdapter
from agent.adapters.loading import load_adapter
from agent.engine.chat import ByteTokenizer, ImagePiece, TextPiece
from agent.engine.full_prefill import full_prefill
from agent.engine.generation import SamplingParams
from agent.engine.prompt_cache import Prompt, PromptCache, build_prompt
from cache.arena import KVArena
from cache.store import StoreConfig, TieredStore

BLOCK = attention.BLOCK


def prefill_cut(adapter: ModelAdapter, ids: list[int], cuts: list[int]) -> tuple[torch.Tensor, KVArena]:
    """``ids`` prefilled in passes that end at ``cuts``: the last logits and the arena."""
    d = adapter.arena_dims
    arena = KVArena(d.n_layers, d.k, d.v, len(ids) + 4, d.dtype, d.device)
    cache = adapter.new_cache(arena)
    edges = [0, *cuts, len(ids)]
    logits = torch.empty(0)
    for a, b in itertools.pairwise(edges):
        logits = adapter.prefill(adapter.text(ids[a:b]), cache, a, placed=True, last_only=True).logits[-1]
    return logits, arena


def same_kv(a: KVArena, b: KVArena, n: int) -> bool:
    return all(
        torch.equal(x[..., :n, :], y[..., :n, :])
        for layer in range(a.n_layers)
        for x, y in zip(a.views(layer), b.views(layer), strict=True)
    )


def cut_cases(seed: int, n_cases: int, lengths: tuple[int, int]) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n_cases):
        n = rng.randint(*lengths)
        edges = list(range(BLOCK, n, BLOCK))
        cuts = sorted(rng.sample(edges, rng.randint(1, len(edges))))
        cases.append(([rng.randrange(500) for _ in range(n)], cuts))
    return cases


@pytest.mark.parametrize("family", ["llama-gqa", "llama-mha", "neox-partial", "qwen2.5-vl", "qwen3-vl"])
def test_a_prefill_cut_at_block_edges_writes_the_kv_and_logits_of_one_pass(family: str) -> None:
    adapter = load_adapter(f"tiny:{family}")
    assert adapter.attention == attention.NAME
    assert adapter.cut_invariant
    for ids, cuts in cut_cases(7, 6, (BLOCK + 3, 5 * BLOCK + 60)):
        whole_logits, whole = prefill_cut(adapter, ids, [])
        cut_logits, cut = prefill_cut(adapter, ids, cuts)
        assert torch.equal(whole_logits, cut_logits), (len(ids), cuts)
        assert same_kv(whole, cut, len(ids)), (len(ids), cuts)


def token_cut_cases(seed: int, n_cases: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n_cases):
        n = rng.randint(BLOCK + 3, 3 * BLOCK + 60)
        cases.append(
            ([rng.randrange(500) for _ in range(n)], sorted(rng.sample(range(1, n), rng.randint(1, 5))))
        )
    return cases


@pytest.mark.parametrize("family", ["llama-gqa", "llama-mha", "neox-partial", "qwen2.5-vl", "qwen3-vl"])
def test_a_prefill_cut_at_any_tokens_writes_the_kv_and_logits_of_one_pass(family: str) -> None:
    """Every block runs whole, BLOCK rows over the keys to its end, whatever the pass computes of
    it: passes that begin and end inside blocks write one pass's bits."""
    adapter = load_adapter(f"tiny:{family}")
    for ids, cuts in token_cut_cases(7, 6):
        whole_logits, whole = prefill_cut(adapter, ids, [])
        cut_logits, cut = prefill_cut(adapter, ids, cuts)
        assert torch.equal(whole_logits, cut_logits), (len(ids), cuts)
        assert same_kv(whole, cut, len(ids)), (len(ids), cuts)


def test_the_check_catches_blocks_run_only_where_the_pass_computes_them(monkeypatch: Any) -> None:
    """Inverse: blocks run on the pass's own rows and keys only (cut short where a pass begins
    or the prompt ends) give other bits."""
    adapter = load_adapter("tiny:llama-gqa")
    monkeypatch.setattr(attention, "WHOLE_BLOCKS", False)
    differs = 0
    for ids, cuts in token_cut_cases(7, 6):
        whole_logits, whole = prefill_cut(adapter, ids, [])
        cut_logits, cut = prefill_cut(adapter, ids, cuts)
        differs += not (torch.equal(whole_logits, cut_logits) and same_kv(whole, cut, len(ids)))
    assert differs > 0


def test_a_prefix_computed_in_another_prompts_pass_continues_as_one_pass() -> None:
    """The KV of a prefix taken from a longer prompt's pass, then the rest in one pass: the new
    prompt's one-pass KV and logits (what an exact hit is)."""
    adapter = load_adapter("tiny:llama-gqa")
    rng = random.Random(3)
    for _ in range(4):
        shared = [rng.randrange(500) for _ in range(rng.randint(BLOCK + 1, 4 * BLOCK))]
        first = shared + [rng.randrange(500) for _ in range(rng.randint(1, 300))]
        second = shared + [rng.randrange(500) for _ in range(rng.randint(1, 300))]
        _, earlier = prefill_cut(adapter, first, [])
        whole_logits, whole = prefill_cut(adapter, second, [])
        keep = len(shared) // BLOCK * BLOCK
        logits, arena = place_then_prefill(adapter, earlier, second, keep)
        assert torch.equal(logits, whole_logits)
        assert same_kv(arena, whole, len(second))


def place_then_prefill(
    adapter: ModelAdapter, earlier: KVArena, ids: list[int], keep: int
) -> tuple[torch.Tensor, KVArena]:
    """The first ``keep`` tokens' KV taken from ``earlier`` (another prompt's pass), the rest of
    ``ids`` prefilled after them in one pass: the last logits and the arena."""
    d = adapter.arena_dims
    arena = KVArena(d.n_layers, d.k, d.v, len(ids) + 4, d.dtype, d.device)
    for layer in range(d.n_layers):
        k, v = earlier.views(layer)
        arena.append(layer, k[0, :, :keep], v[0, :, :keep], arena.generation)
    rest = adapter.prefill(adapter.text(ids[keep:]), adapter.new_cache(arena), keep, last_only=True)
    return rest.logits[-1], arena


def token_cuts(adapter: ModelAdapter) -> list[tuple[int, bool]]:
    """For a prefix kept to every 7th token of a block, taken from another prompt's pass,
    whether the rest prefilled after it gives the one pass's logits and KV."""
    rng = random.Random(3)
    first = [rng.randrange(500) for _ in range(2 * BLOCK + 40)]
    _, earlier = prefill_cut(adapter, first, [])
    out = []
    for keep in range(BLOCK + 1, 2 * BLOCK, 7):
        second = first[:keep] + [rng.randrange(500) for _ in range(2 * BLOCK + 10 - keep)]
        whole_logits, whole = prefill_cut(adapter, second, [])
        logits, arena = place_then_prefill(adapter, earlier, second, keep)
        out.append((keep, torch.equal(logits, whole_logits) and same_kv(arena, whole, len(second))))
    return out


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2.5-vl"])
def test_a_prefix_placed_to_the_token_continues_as_one_pass(family: str) -> None:
    """A prefix cut inside a block, its KV from another prompt's pass, then the rest in a pass
    that begins inside the block: the one pass's KV and logits."""
    adapter = load_adapter(f"tiny:{family}")
    assert all(same for _, same in token_cuts(adapter))


def test_the_check_catches_a_pass_that_runs_its_first_block_cut_short(monkeypatch: Any) -> None:
    """Inverse: a pass beginning inside a block that runs only its own rows there (other shapes
    than the one pass's block) gives other bits for some cuts."""
    adapter = load_adapter("tiny:llama-gqa")
    monkeypatch.setattr(attention, "WHOLE_BLOCKS", False)
    assert not all(same for _, same in token_cuts(adapter))


def test_the_check_catches_a_kernel_whose_result_depends_on_the_cut() -> None:
    """Inverse: SDPA's own CPU kernel (key blocks sized by the pass) fails the same comparison."""
    adapter = load_adapter("tiny:llama-gqa")
    adapter.model.set_attn_implementation("sdpa")
    try:
        differs = 0
        for ids, cuts in cut_cases(11, 6, (4 * BLOCK + 1, 9 * BLOCK)):
            whole_logits, whole = prefill_cut(adapter, ids, [])
            cut_logits, cut = prefill_cut(adapter, ids, cuts)
            differs += not (torch.equal(whole_logits, cut_logits) and same_kv(whole, cut, len(ids)))
        assert differs > 0
    finally:
        adapter.model.set_attn_implementation(attention.NAME)


class _Bounded:
    """A stand-in scheduler: passes of at most ``pass_tokens``; steps run at once."""

    def __init__(self, pass_tokens: int) -> None:
        self.bound = pass_tokens
        self.passes: list[tuple[int, int]] = []

    def decode(self, adapter: Any, token: int, cache: Any, position: int) -> torch.Tensor:
        return adapter.decode_rows([token], [cache], [position])[0]

    def pause(self) -> None:
        pass

    def pass_tokens(self, before: int) -> int:
        return self.bound

    def prefill_left(self, before: int, after: int) -> None:
        self.passes.append((before, after))


def text_prompt(pc: PromptCache, ids: list[int]) -> Prompt:
    return build_prompt(pc.adapter, [TextPiece(tuple(ids), False)], pc.image_unit)


@pytest.mark.parametrize("bound", [None, BLOCK, 3 * BLOCK])
def test_exact_reuse_equals_the_one_pass_full_prefill_bit_for_bit(bound: int | None) -> None:
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    pc = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)))
    rng = random.Random(5)
    shared = [rng.randrange(500) for _ in range(700)]
    pc.commit(pc.prepare(text_prompt(pc, shared + [rng.randrange(500) for _ in range(90)]), mode="exact"))
    prompt = text_prompt(pc, shared + [rng.randrange(500) for _ in range(260)])
    stepper = _Bounded(bound) if bound is not None else None
    batched.bind(stepper)
    try:
        warm = pc.prepare(prompt, mode="exact")
    finally:
        batched.bind(None)
    assert warm.usage.prefix_tokens == 700  # the exact prefix ends at the token
    assert warm.usage.prefilled_tokens == prompt.n_tokens - warm.usage.prefix_tokens
    if stepper is not None:
        before = [b - a for b, a in stepper.passes]
        assert all(n <= bound for n in before)
        assert len(before) == -(-warm.usage.prefilled_tokens // bound)
    one = full_prefill(adapter, prompt, SamplingParams(max_tokens=6))
    assert torch.equal(warm.logits, one.logits)
    reused = warm.cache.layers
    d = adapter.arena_dims
    arena = KVArena(d.n_layers, d.k, d.v, prompt.n_tokens, d.dtype, d.device)
    cache = adapter.new_cache(arena)
    adapter.next_logits(adapter.text(prompt.units.tolist()), cache, 0)
    for layer, mine in zip(cache.layers, reused, strict=True):
        assert torch.equal(layer.keys[..., : prompt.n_tokens, :], mine.keys[..., : prompt.n_tokens, :])
        assert torch.equal(layer.values[..., : prompt.n_tokens, :], mine.values[..., : prompt.n_tokens, :])
    # the segments stored from grouped passes are the grain of the next exact hit
    pc.commit(warm)
    again = pc.prepare(prompt, "", mode="exact")
    assert again.usage.prefix_tokens == prompt.n_tokens - 1  # to the token; the last one is prefilled
    assert torch.equal(again.logits, one.logits)


def test_the_exact_prefix_ends_at_the_token_wherever_the_prompts_part() -> None:
    """Exact reuse to the token: whether the earlier prompt or this one ends inside the block the
    match ends in, or the earlier prompt's pass stopped there (its exact part ended before moved
    KV), the prefix ends where the prompts part, and the answer is the one-pass full prefill's."""
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    rng = random.Random(6)
    shared = [rng.randrange(500) for _ in range(700)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(500) for _ in range(n)]

    def served(pc: PromptCache, second: list[int]) -> int:
        prompt = text_prompt(pc, second)
        warm = pc.prepare(prompt, mode="exact")
        assert torch.equal(warm.logits, full_prefill(adapter, prompt, SamplingParams(max_tokens=2)).logits)
        return warm.usage.prefix_tokens

    def after(first: list[int]) -> PromptCache:
        pc = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)))
        pc.commit(pc.prepare(text_prompt(pc, first), mode="exact"))
        return pc

    assert served(after(shared + tail(100)), shared + tail(200)) == 700  # both go on past the block
    assert served(after(shared + tail(20)), shared + tail(200)) == 700  # the earlier one ends inside it
    assert served(after(shared + tail(100)), shared + tail(30)) == 700  # this one ends inside it
    assert served(after(shared), shared + tail(200)) == 700  # the earlier prompt is the prefix, whole
    # the earlier prompt's exact part stops at 720, where content it had seen before follows
    # (reused at a moved place): its pass over [640, 720) ended inside the block
    moved = tail(300)
    pc = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)))

    def pieces(*parts: list[int]) -> Prompt:  # piece edges are chunk edges: the moved text is a chunk
        return build_prompt(adapter, [TextPiece(tuple(x), False) for x in parts], pc.image_unit)

    pc.commit(pc.prepare(pieces(moved, tail(5)), mode="exact"))
    first = pc.prepare(pieces(shared + tail(20), moved, tail(5)), mode="fast")
    assert first.usage.relocated_tokens > 0
    assert first.exact_units == 720
    pc.commit(first)
    assert served(pc, shared + tail(200)) == 700


def test_the_longer_of_the_radix_match_and_the_pointer_is_taken() -> None:
    """A replica whose own radix tree knows a short match (another conversation that shares the
    first tokens) still reuses as far as the pointer the first replica left reaches."""
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    rng = random.Random(8)
    head = [rng.randrange(500) for _ in range(100)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(500) for _ in range(n)]

    store = TieredStore.from_config(StoreConfig(host_bytes=64 << 20))
    a, b = PromptCache(adapter, store), PromptCache(adapter, store)
    a.commit(a.prepare(text_prompt(a, head + tail(200)), mode="exact"))
    b.commit(b.prepare(text_prompt(b, head[:10] + tail(300)), mode="exact"))  # b's tree: 10 tokens
    prompt = text_prompt(b, head + tail(200))
    warm = b.prepare(prompt, mode="exact")
    assert warm.usage.prefix_tokens == 100
    assert torch.equal(warm.logits, full_prefill(adapter, prompt, SamplingParams(max_tokens=2)).logits)


def test_exact_reuse_after_an_image_equals_the_full_prefill() -> None:
    adapter = load_adapter("tiny:qwen2.5-vl")
    adapter.tokenizer = ByteTokenizer()
    pc = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)))
    rng = random.Random(9)
    image = Image.new("RGB", (56, 56), (200, 30, 90))
    head = tuple(rng.randrange(500) for _ in range(150))
    tail = tuple(rng.randrange(500) for _ in range(300))

    def prompt(extra: int) -> Prompt:
        pieces = [TextPiece(head, False), ImagePiece(image), TextPiece(tail + tuple(range(1, extra)), False)]
        return build_prompt(adapter, pieces, pc.image_unit)

    pc.commit(pc.prepare(prompt(20), mode="exact"))
    second = prompt(200)
    warm = pc.prepare(second, mode="exact")
    assert warm.usage.prefix_tokens > len(head)  # past the image
    one = full_prefill(adapter, second, SamplingParams(max_tokens=4))
    assert torch.equal(warm.logits, one.logits)


def test_a_mixture_of_experts_keeps_its_segments_and_its_exact_reuse() -> None:
    """Routed experts run each expert's product on the tokens routed to it, so a token's sums
    depend on its pass: such a model is not cut invariant, its prefill runs segment by segment,
    and exact reuse still equals its full prefill bit for bit."""
    adapter = load_adapter("tiny:deepseek-mla")
    adapter.tokenizer = ByteTokenizer()
    assert not adapter.cut_invariant
    pc = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)))
    rng = random.Random(4)
    shared = [rng.randrange(500) for _ in range(300)]
    pc.commit(pc.prepare(text_prompt(pc, [*shared, 1, 2, 3]), mode="exact"))
    prompt = text_prompt(pc, shared + [rng.randrange(500) for _ in range(140)])
    stepper = _Bounded(4 * BLOCK)
    batched.bind(stepper)
    try:
        warm = pc.prepare(prompt, mode="exact")
    finally:
        batched.bind(None)
    assert warm.usage.prefix_tokens == 256
    assert all(b - a <= BLOCK for b, a in stepper.passes)
    assert torch.equal(warm.logits, full_prefill(adapter, prompt, SamplingParams(max_tokens=2)).logits)


def test_a_pass_takes_fewer_tokens_while_other_jobs_run() -> None:
    """A job alone may prefill ``pass_tokens`` at once; while another job runs (the other's turns
    come between passes), 256 tokens near the start of its prompt and one segment deeper; alone
    again, the whole bound."""
    import asyncio
    import time

    from agent.engine.scheduler import ModelWorker

    worker = ModelWorker(queue_size=4, pass_tokens=512)
    seen: dict[str, list[int | None]] = {"a": [], "b": []}

    def job(name: str, passes: int, left: int) -> None:
        for i in range(passes):
            batched.prefill_left(left - i, left - i - 1)  # b, nearly done, takes the turns first
            seen[name].append(batched.pass_tokens(128 * i))
            batched.pause()
            time.sleep(0.004)

    async def main() -> None:
        worker.admit()
        first = asyncio.ensure_future(worker.run(lambda: job("a", 150, 10_000), threading.Event()))
        await asyncio.sleep(0.06)
        worker.admit()
        await worker.run(lambda: job("b", 3, 10), threading.Event())
        worker.leave()
        await first
        worker.leave()

    asyncio.run(main())
    worker.shutdown()
    a = seen["a"]
    assert a[0] == 512
    assert seen["b"] == [256, 256, 256]
    assert 128 in a
    assert a[-1] == 512


def test_a_newcomer_runs_its_pass_next_and_the_first_job_still_gets_its_turn() -> None:
    """A long prefill runs alone; short ones arrive one at a time: each runs its first pass next,
    before another pass of the long one (a rotation counted in all passes would put one of the
    long one's passes first for one arrival in four). Then five short ones arrive together: the
    long one gets a pass after at most ``AGING`` passes in a row to them."""
    import asyncio
    import time

    from agent.engine.scheduler import AGING, ModelWorker

    worker = ModelWorker(queue_size=16, pass_tokens=512)
    events: list[str] = []
    long_done = threading.Event()

    def job(name: str, passes: int, left: int) -> None:
        events.append("arrive " + name)
        for i in range(passes):
            if name == "long" and long_done.is_set():
                return
            batched.prefill_left(left - i, left - i - 1)
            batched.pause()
            events.append("pass " + name)
            time.sleep(0.003)

    async def main() -> None:
        worker.admit()
        first = asyncio.ensure_future(worker.run(lambda: job("long", 100_000, 100_000), threading.Event()))
        await asyncio.sleep(0.05)
        for i in range(8):  # one at a time
            worker.admit()
            await worker.run(lambda i=i: job(f"alone{i}", 2, 10), threading.Event())
            worker.leave()
            await asyncio.sleep(0.01 * (i % 3))
        together = []
        for i in range(5):
            worker.admit()
            together.append(worker.run(lambda i=i: job(f"together{i}", 3, 10 + i), threading.Event()))
        await asyncio.gather(*together)
        for _ in together:
            worker.leave()
        long_done.set()
        await first
        worker.leave()

    asyncio.run(main())
    worker.shutdown()
    for i in range(8):
        at = events.index(f"arrive alone{i}")
        assert events[at + 1] == f"pass alone{i}", events[at - 2 : at + 3]
    start = events.index("arrive together0")
    end = max(i for i, e in enumerate(events) if e.startswith("pass together"))
    run = 0
    for e in events[start:end]:
        if e.startswith("pass "):
            run = 0 if e == "pass long" else run + 1
            assert run <= AGING, events[start:end]
    assert "pass long" in events[start:end]


def test_a_pass_bound_below_one_is_refused() -> None:
    from agent.engine.scheduler import ModelWorker

    with pytest.raises(ValueError, match="pass_tokens"):
        ModelWorker(4, pass_tokens=0)
