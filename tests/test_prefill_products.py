"""Prefill products in bfloat16 (``DecoderAdapter.use_prefill_products``): the product's rows do
not depend on the other rows, so a prefill cut anywhere still writes one pass's KV and exact reuse
still equals the full prefill bit for bit under those numerics; decode steps keep their float32
products; the products are part of every cache key's numerics; bad settings are refused."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from agent.adapters.base import ModelAdapter
from agent.adapters.decoder import PREFILL_WEIGHT, DecoderAdapter
from agent.adapters.loading import load_adapter
from agent.engine.chat import ByteTokenizer
from agent.engine.full_prefill import full_prefill
from agent.engine.generation import SamplingParams, decode
from agent.engine.prompt_cache import PromptCache
from agent.engine.runtime import RuntimeConfig
from cache.numerics import bf16_kernels
from cache.store import StoreConfig, TieredStore
from tests.test_cut_invariance import prefill_cut, same_kv, text_prompt, token_cut_cases


def narrow(family: str = "llama-gqa") -> ModelAdapter:
    return load_adapter(f"tiny:{family}", prefill_products="bfloat16")


@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (96, 200)])
def test_a_bfloat16_products_row_does_not_depend_on_the_other_rows(shape: tuple[int, int]) -> None:
    """What the guarantee rests on: each row of ``x @ w.T`` is the same in a product of any rows,
    at any place (1 to 40 rows, longer ones, offsets)."""
    k, n = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(300, k, generator=gen).bfloat16()
    whole = x @ w.T
    for m in [*range(1, 41), 64, 127, 128, 129, 255, 299]:
        assert torch.equal(x[:m] @ w.T, whole[:m]), m
    for start in (1, 3, 17, 100, 131):
        assert torch.equal(x[start : start + 150] @ w.T, whole[start : start + 150]), start


@pytest.mark.parametrize("family", ["llama-gqa", "neox-partial"])
def test_a_prefill_cut_at_any_tokens_writes_one_pass_in_bfloat16_products(family: str) -> None:
    adapter = narrow(family)
    assert adapter.prefill_products == "bfloat16"
    assert adapter.cut_invariant
    for ids, cuts in token_cut_cases(11, 4):
        whole_logits, whole = prefill_cut(adapter, ids, [])
        cut_logits, cut = prefill_cut(adapter, ids, cuts)
        assert torch.equal(whole_logits, cut_logits), (len(ids), cuts)
        assert same_kv(whole, cut, len(ids)), (len(ids), cuts)


def test_the_products_are_live_in_prefill_and_not_in_decode() -> None:
    """Same weights: the bfloat16 prefill differs from the float32 one (a little), while a decode
    step on the same cache gives the float32 step's logits bit for bit."""
    wide, thin = load_adapter("tiny:llama-gqa"), narrow()
    ids = [random.Random(3).randrange(500) for _ in range(150)]
    wide_logits, wide_kv = prefill_cut(wide, ids, [])
    thin_logits, _ = prefill_cut(thin, ids, [])
    assert not torch.equal(wide_logits, thin_logits)
    assert torch.allclose(wide_logits, thin_logits, atol=0.5, rtol=0.05)
    again_kv = prefill_cut(wide, ids, [])[1]
    cache_a, cache_b = wide.new_cache(wide_kv), thin.new_cache(again_kv)
    step_a = wide.decode_rows([7], [cache_a], [len(ids)])
    step_b = thin.decode_rows([7], [cache_b], [len(ids)])
    assert torch.equal(step_a, step_b)
    # the reference forward and a repair's recompute run the prefill's products too
    ref_wide = wide.reference_logits([wide.text(ids)], last_only=True)
    ref_thin = thin.reference_logits([thin.text(ids)], last_only=True)
    assert not torch.equal(ref_wide, ref_thin)


def test_exact_reuse_equals_the_full_prefill_bit_for_bit_in_bfloat16_products() -> None:
    adapter = narrow()
    adapter.tokenizer = ByteTokenizer()
    pc = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)))
    rng = random.Random(9)
    shared = [rng.randrange(500) for _ in range(430)]
    pc.commit(pc.prepare(text_prompt(pc, shared + [rng.randrange(500) for _ in range(70)]), mode="exact"))
    prompt = text_prompt(pc, shared + [rng.randrange(500) for _ in range(150)])
    warm = pc.prepare(prompt, mode="exact")
    assert warm.usage.prefix_tokens == 430
    one = full_prefill(adapter, prompt, SamplingParams(max_tokens=6))
    assert torch.equal(warm.logits, one.logits)
    mine = decode(
        adapter,
        warm.logits,
        warm.cache,
        int(prompt.pos_off[-1]),
        SamplingParams(max_tokens=6),
        threading.Event(),
    )
    assert mine.tokens == one.decoded.tokens


def test_the_products_are_part_of_the_numerics() -> None:
    wide, thin = load_adapter("tiny:llama-gqa"), narrow()
    assert wide.info.fingerprint == thin.info.fingerprint  # the same weights
    assert "products=" not in wide.namespace().numerics  # float32 keys as they were
    # the products, and what picks a bfloat16 GEMM's kernel on this CPU
    assert thin.namespace().numerics == wide.namespace().numerics + ",products=bfloat16," + bf16_kernels()
    assert bf16_kernels().startswith("bf16=")
    ids = wide.text(list(range(40)))
    assert wide.chunk_key(ids) != thin.chunk_key(ids)
    thin.use_prefill_products("float32")
    assert thin.namespace() == wide.namespace()
    assert torch.equal(prefill_cut(thin, list(range(40)), [])[0], prefill_cut(wide, list(range(40)), [])[0])


def test_bad_products_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill products must be one of"):
        load_adapter("tiny:llama-gqa", prefill_products="int8")
    with pytest.raises(ValueError, match="text decoders"):
        load_adapter("tiny:qwen2.5-vl", prefill_products="bfloat16")
    with pytest.raises(ValueError, match="need float32 weights"):
        load_adapter("tiny:llama-gqa", dtype=torch.bfloat16, prefill_products="bfloat16")
    with pytest.raises(ValueError, match="prefill products must be"):
        RuntimeConfig(prefill_products="float16")
    with pytest.raises(ValueError, match="need float32 weights"):
        RuntimeConfig(dtype="bfloat16", prefill_products="bfloat16")
    assert isinstance(narrow(), DecoderAdapter)


def test_the_head_keeps_float32_products() -> None:
    """The logits an answer is chosen from are not rounded to bfloat16: only the decoder's
    linears carry a bfloat16 weight."""
    thin = narrow()
    assert isinstance(thin, DecoderAdapter)
    assert getattr(thin.lm_head, PREFILL_WEIGHT, None) is None
    carried = [m for m in thin.base.modules() if getattr(m, PREFILL_WEIGHT, None) is not None]
    assert carried
    assert all(getattr(m, PREFILL_WEIGHT).dtype == torch.bfloat16 for m in carried)
    ids = [random.Random(4).randrange(500) for _ in range(60)]
    logits, _ = prefill_cut(thin, ids, [])
    assert not torch.equal(logits, logits.bfloat16().float())  # finer than bfloat16's grid


def test_a_prompt_cache_keys_kv_by_the_products_it_was_computed_under() -> None:
    """Products switched on a live prompt cache: what was stored before is not an exact hit
    after, and what is stored after carries the new numerics."""
    adapter = load_adapter("tiny:llama-gqa")
    adapter.tokenizer = ByteTokenizer()
    pc = PromptCache(adapter, TieredStore.from_config(StoreConfig(host_bytes=64 << 20)))
    rng = random.Random(2)
    ids = [rng.randrange(500) for _ in range(300)]
    pc.commit(pc.prepare(text_prompt(pc, ids), mode="exact"))
    assert pc.prepare(text_prompt(pc, ids), mode="exact").usage.prefix_tokens == 299
    adapter.use_prefill_products("bfloat16")
    cold = pc.prepare(text_prompt(pc, ids), mode="exact")
    assert cold.usage.prefix_tokens == 0  # float32 KV is not exact under bfloat16 products
    assert pc.planner("").namespace == adapter.namespace("")
    pc.commit(cold)
    warm = pc.prepare(text_prompt(pc, ids), mode="exact")
    assert warm.usage.prefix_tokens == 299
    assert torch.equal(
        warm.logits, full_prefill(adapter, text_prompt(pc, ids), SamplingParams(max_tokens=1)).logits
    )


def test_kamera_serve_refuses_products_its_model_cannot_take(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.server import cli

    assert cli.main(["--model", "tiny:qwen2.5-vl", "--prefill-products", "bfloat16"]) == 2
    assert "for text decoders" in capsys.readouterr().out
    assert cli.main(["--dtype", "bfloat16", "--prefill-products", "bfloat16"]) == 2
    assert "need float32 weights" in capsys.readouterr().out
