"""Batched decoding: one step for many sequences, each on its own cache, and a sequence's numbers
independent of what it was batched with.

In the style of vLLM's determinism tests: a needle prompt decoded alone and among 1 to 32 other
sequences of other lengths gives the same tokens and the same logits, bit for bit; each check has
an inverse test that shows it catches a batch-dependent path.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from agent.adapters import batched, qlinear
from agent.adapters.loading import load_adapter
from cache.arena import KVArena
from cache.window import Placement, Window
from tests._util import full_prefill

NEEDLE = "Question: which planet is known as the red planet? Answer in one word.\nAnswer:"
STEPS = 6


def _filler(adapter: Any, rng: random.Random) -> list[int]:
    words = ["river", "stone", "quiet", "number", "window", "seven", "under", "light", "paper", "green"]
    text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
    return adapter.tokenizer(text, add_special_tokens=False)["input_ids"]


def _decode_together(
    adapter: Any,
    prompts: Sequence[list[int]],
    steps: int = STEPS,
    arena: bool = False,
    room: int | None = None,
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy decoding of every prompt, all of them in each step's one batched pass: per prompt,
    the tokens and the logits of every step."""
    states = []
    for ids in prompts:
        cache, logits, pos = full_prefill(adapter, ids)
        if arena:  # the same KV in a window's arena, as the prompt cache hands it over
            window = Window(adapter.spec, dims=adapter.arena_dims)
            kv = adapter.kv_tail(cache, adapter.text(ids), 0)
            cache = adapter.new_cache(
                window.sync([Placement(kv, start=0)], len(ids) + (steps if room is None else room))
            )
        states.append([cache, pos, [int(logits.argmax())], [logits]])
    for _ in range(steps):
        rows = adapter.decode_rows([s[2][-1] for s in states], [s[0] for s in states], [s[1] for s in states])
        for s, row in zip(states, rows, strict=True):
            s[1] += 1
            s[2].append(int(row.argmax()))
            s[3].append(row)
    return [(s[2], s[3]) for s in states]


def _same(a: tuple[list[int], list[torch.Tensor]], b: tuple[list[int], list[torch.Tensor]]) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.fixture(scope="module")
def needle(smollm2: Any) -> list[int]:
    return smollm2.tokenizer(NEEDLE, add_special_tokens=False)["input_ids"]


def test_a_batched_step_is_the_models_own_step(smollm2: Any, needle: list[int], monkeypatch: Any) -> None:
    """The lean batched step computes what the model's own forward computes (to float rounding),
    and the same greedy tokens, with the block products on float32 activations (int8 ones are
    checked against their own reference in tests/test_qdot.py); its cache ends as long."""
    monkeypatch.setattr(qlinear, "INT8_PRODUCTS", False)
    assert batched.supports(smollm2.model)
    ours = _decode_together(smollm2, [needle])[0]
    cache, logits, pos = full_prefill(smollm2, needle)
    token, tokens = int(logits.argmax()), [int(logits.argmax())]
    for _ in range(STEPS):
        with torch.inference_mode():
            row = smollm2._decode_one(token, cache, pos)
        pos += 1
        token = int(row.argmax())
        tokens.append(token)
        assert float((row - ours[1][len(tokens) - 1]).abs().max()) < 1e-3
    assert tokens == ours[0]


@pytest.mark.parametrize("float32", [False, True], ids=["gguf-blocks", "float32"])
@pytest.mark.parametrize("arena", [False, True], ids=["dynamic-cache", "arena"])
def test_a_needle_decodes_the_same_alone_and_in_any_batch(
    smollm2: Any, needle: list[int], arena: bool, float32: bool, monkeypatch: Any
) -> None:
    """Tokens and logits bit for bit the same alone and among 1 to 32 others of other lengths,
    with the products on the GGUF blocks (unpadded) or on the float32 weights (padded)."""
    if float32:
        monkeypatch.setattr(smollm2, "linears", None)
    alone = _decode_together(smollm2, [needle], arena=arena)[0]
    rng = random.Random(7)
    for others in (1, 6, 32) if not arena else (6,):
        prompts = [_filler(smollm2, rng) for _ in range(others)]
        at = others if others % 2 == 0 else rng.randint(0, others)  # last: a leftover row unpadded
        prompts.insert(at, needle)
        together = _decode_together(smollm2, prompts, arena=arena)
        assert _same(together[at], alone), f"the needle changed among {others} others"
        # every other sequence is batch-invariant too: each gives what it gives alone
        if others <= 6:
            for i, ids in enumerate(prompts):
                assert _same(together[i], _decode_together(smollm2, [ids], arena=arena)[0])


def test_unpadded_rows_would_depend_on_the_batch(smollm2: Any, needle: list[int], monkeypatch: Any) -> None:
    """The inverse test of the padding: without it, float32 matrix products on this CPU compute
    leftover rows with another kernel and the needle's logits change with the batch."""
    x = torch.randn(8, 576)
    w = torch.randn(1536, 576)
    if all(torch.equal(F.linear(x[:n], w)[n - 1], F.linear(x, w)[n - 1]) for n in (1, 2, 3, 5, 6, 7)):
        pytest.skip("this CPU's matrix products do not depend on the row count")
    monkeypatch.setattr(smollm2, "linears", None)  # the float32 products the padding is for
    monkeypatch.setattr(batched, "ROW_BLOCK", 1)
    alone = _decode_together(smollm2, [needle])[0]
    rng = random.Random(7)
    together = _decode_together(smollm2, [needle, _filler(smollm2, rng)])[0]
    assert not _same(together, alone)


def test_a_row_mixing_step_is_caught(smollm2: Any, needle: list[int], monkeypatch: Any) -> None:
    """The inverse test of the check itself: a step whose numbers depend on the batch size (here
    the head's sum split in two when more than four rows run) fails the comparison."""
    monkeypatch.setattr(smollm2, "linears", None)  # the head through the model's own module
    head = smollm2.model.get_output_embeddings()

    class SplitHead(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            if h.shape[0] <= batched.ROW_BLOCK:
                return head(h)
            half = h.shape[-1] // 2
            return F.linear(h[:, :half], head.weight[:, :half]) + F.linear(h[:, half:], head.weight[:, half:])

    alone = _decode_together(smollm2, [needle])[0]
    monkeypatch.setattr(smollm2.model, "get_output_embeddings", lambda: SplitHead())
    rng = random.Random(7)
    prompts = [needle, *(_filler(smollm2, rng) for _ in range(7))]
    together = _decode_together(smollm2, prompts)[0]
    assert not _same(together, alone)


def test_models_without_a_lean_step_decode_row_by_row() -> None:
    """A model the batched step does not cover (partial rotary, MLA) decodes each row through its
    own forward: the same as decoding it alone."""
    for family in ("neox-partial", "deepseek-mla"):
        adapter = load_adapter(f"tiny:{family}")
        assert not batched.supports(adapter.model)
        prompts = [[5, 9, 11, 3], [7, 7, 2]]
        together = _decode_together(adapter, prompts, steps=3)
        for i, ids in enumerate(prompts):
            assert _same(together[i], _decode_together(adapter, [ids], steps=3)[0])


def test_the_batched_step_refuses_what_it_cannot_run(smollm2: Any, needle: list[int]) -> None:
    cache, _, pos = full_prefill(smollm2, needle)
    with pytest.raises(ValueError, match="tokens"):
        batched.decode_rows(smollm2.model, [1, 2], [cache], [pos])
    with pytest.raises(ValueError, match="1 to"):
        batched.decode_rows(smollm2.model, [], [], [])


def test_native_attention_is_sdpas_step(smollm2: Any, needle: list[int], monkeypatch: Any) -> None:
    """The step's attention in one native call (cache/attend.py) gives the tokens of one SDPA
    call per row, to float rounding in the logits (float32 activations into the products: int8
    ones would turn a rounding difference into a whole step of the quantised input)."""
    if not batched.attend.vectorised():
        pytest.skip("the native attention kernel does not run on this CPU's decode steps")
    monkeypatch.setattr(qlinear, "INT8_PRODUCTS", False)
    native = _decode_together(smollm2, [needle], steps=12)[0]
    monkeypatch.setattr(batched, "NATIVE_ATTENTION", False)
    sdpa = _decode_together(smollm2, [needle], steps=12)[0]
    assert native[0] == sdpa[0]
    assert max(float((a - b).abs().max()) for a, b in zip(native[1], sdpa[1], strict=True)) < 1e-3


def test_arena_rows_write_in_place_with_the_same_numbers(
    smollm2: Any, needle: list[int], monkeypatch: Any
) -> None:
    """Rows on whole arenas take the step's new token written by the kernel (no per-row cache
    update); their numbers are those of the same rows updated one by one, bit for bit."""
    if not batched.attend.vectorised():
        pytest.skip("the native attention kernel does not run on this CPU's decode steps")
    rng = random.Random(3)
    prompts = [needle, _filler(smollm2, rng), _filler(smollm2, rng)]
    in_place = _decode_together(smollm2, prompts, arena=True)
    grown = _decode_on_tight_arenas(smollm2, prompts)
    monkeypatch.setattr(batched._ArenaRows, "of", classmethod(lambda cls, per_layer: None))
    updated = _decode_together(smollm2, prompts, arena=True)
    for a, b in zip(in_place, updated, strict=True):
        assert _same(a, b)
    assert _decode_on_tight_arenas(smollm2, prompts) == grown


def _decode_on_tight_arenas(adapter: Any, prompts: Sequence[list[int]]) -> list[list[int]]:
    """Greedy tokens of every prompt prefilled into an arena with room for one more token, so
    that it grows during the steps (checked); then the arenas' KV, which must hold every token."""
    d = adapter.arena_dims
    states = []
    for ids in prompts:
        arena = KVArena(d.n_layers, d.k, d.v, len(ids) + 1, d.dtype, d.device)
        cache = adapter.new_cache(arena)
        out = adapter.prefill(adapter.text(ids), cache, 0, placed=True, last_only=True)
        states.append([cache, len(ids), [int(out.logits[-1].argmax())], arena])
    for _ in range(STEPS):
        rows = adapter.decode_rows([s[2][-1] for s in states], [s[0] for s in states], [s[1] for s in states])
        for s, row in zip(states, rows, strict=True):
            s[1] += 1
            s[2].append(int(row.argmax()))
    for s, ids in zip(states, prompts, strict=True):
        assert s[3].grows > 0
        assert s[3].lengths == [len(ids) + STEPS] * d.n_layers
        assert s[0].layers[0].keys.shape[2] == len(ids) + STEPS
    return [s[2] for s in states]


def test_a_batch_dependent_attention_is_caught(smollm2: Any, needle: list[int], monkeypatch: Any) -> None:
    """The inverse test for attention: a kernel whose scale drifts by one part in 10^6 when more
    than four rows share the call fails the needle's comparison."""
    if not batched.attend.vectorised():
        pytest.skip("the native attention kernel does not run on this CPU's decode steps")
    alone = _decode_together(smollm2, [needle])[0]
    real = batched.attend.attend_slots

    def drifting(
        q: torch.Tensor, table: Any, kv_heads: int, scale: float, *args: Any, **kw: Any
    ) -> torch.Tensor:
        return real(q, table, kv_heads, scale * (1 + 1e-6 * (q.shape[0] > 4)), *args, **kw)

    monkeypatch.setattr(batched.attend, "attend_slots", drifting)
    rng = random.Random(7)
    together = _decode_together(smollm2, [needle, *(_filler(smollm2, rng) for _ in range(7))], arena=True)[0]
    assert _decode_together(smollm2, [needle], arena=True)[0][0] == alone[0]
    assert not _same(together, alone)


def test_without_the_vector_loop_the_step_keeps_sdpa(
    smollm2: Any, needle: list[int], monkeypatch: Any
) -> None:
    """On a CPU where the attention kernel would run only its plain loop, the step takes one
    SDPA call per row: the numbers of the switch turned off, bit for bit."""
    monkeypatch.setattr(batched.attend, "vectorised", lambda: False)
    without = _decode_together(smollm2, [needle], arena=True)[0]
    monkeypatch.setattr(batched, "NATIVE_ATTENTION", False)
    assert _same(_decode_together(smollm2, [needle], arena=True)[0], without)
