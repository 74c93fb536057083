"""Relocation is exact through every adapter: a chunk encoded alone at 0 and rotated to s equals
the chunk prefilled alone at s, and a query on the relocated cache sees what it would see on the
direct prefill."""

from __future__ import annotations

import pytest
import torch
from _util import max_rel
from PIL import Image, ImageDraw

from agent.adapters import attention
from agent.adapters.base import ModelAdapter
from agent.adapters.loading import ModelNotFoundError, UnsupportedModelError, load_adapter
from agent.adapters.tiny import BUILDERS, VISION_FAMILIES
from agent.adapters.vision import VisionAdapter, encoder_calls
from cache.arena import KVArena
from cache.keys import image_key

TEXT_FAMILIES = [n for n in BUILDERS if n not in VISION_FAMILIES]


def picture(seed: int, size: tuple[int, int] = (112, 84)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    img = Image.new("RGB", size, tuple(int(c) for c in torch.randint(0, 255, (3,), generator=g)))
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x, y = (int(v) for v in torch.randint(0, min(size), (2,), generator=g))
        draw.ellipse(
            (x, y, x + 20, y + 15), fill=tuple(int(c) for c in torch.randint(0, 255, (3,), generator=g))
        )
    return img


def check_relocation(adapter: ModelAdapter, chunk, start: int, key_tol: float = 1e-5) -> None:  # type: ignore[no-untyped-def]
    canonical = adapter.encode(chunk)
    direct = adapter.prefill(chunk, adapter.empty_cache(), start).kv
    k_moved, v_moved = canonical.place(start, adapter.spec)
    k_direct, v_direct = direct.place(start, adapter.spec)
    assert max_rel(k_moved, k_direct) <= key_tol, max_rel(k_moved, k_direct)
    assert max_rel(v_moved, v_direct) <= key_tol
    assert v_moved is canonical.v  # the position-free part is reused byte for byte, never copied
    query = adapter.text(torch.arange(5, 12))
    moved = adapter.new_cache([(k_moved, v_moved)])
    on_moved = adapter.prefill(query, moved, start + canonical.extent).logits
    cache = adapter.empty_cache()
    adapter.prefill(chunk, cache, start)
    on_direct = adapter.prefill(query, cache, start + canonical.extent).logits
    assert float((on_moved - on_direct).abs().max()) < 1e-4


@pytest.mark.parametrize("name", TEXT_FAMILIES)
@pytest.mark.parametrize("start", [1, 37, 150])
def test_text_chunk_relocation_is_exact(name: str, start: int) -> None:
    adapter = load_adapter(f"tiny:{name}")
    check_relocation(
        adapter,
        adapter.text(torch.randint(2, 500, (24,), generator=torch.Generator().manual_seed(start))),
        start,
    )


def test_mla_stores_the_latent_not_expanded_kv() -> None:
    adapter = load_adapter("tiny:deepseek-mla")
    kv = adapter.encode(adapter.text(torch.arange(2, 30)))
    cfg = adapter.model.config  # type: ignore[attr-defined]
    assert kv.family == "mla"
    assert kv.k.shape == (cfg.num_hidden_layers, 1, 28, cfg.qk_rope_head_dim)
    assert kv.v.shape == (cfg.num_hidden_layers, 1, 28, cfg.kv_lora_rank)
    expanded = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert kv.nbytes / 28 < expanded * 4 * cfg.num_hidden_layers


def test_yarn_scaling_is_divided_out() -> None:
    adapter = load_adapter("tiny:deepseek-mla-yarn")
    assert adapter.spec.attention_scaling != 1.0
    check_relocation(adapter, adapter.text(torch.arange(3, 40)), 61)


def vision(name: str) -> VisionAdapter:
    adapter = load_adapter(f"tiny:{name}")
    assert isinstance(adapter, VisionAdapter)
    return adapter


@pytest.mark.parametrize("name", sorted(VISION_FAMILIES))
@pytest.mark.parametrize("start", [23, 301])
def test_image_chunk_relocation_is_exact_under_mrope(name: str, start: int) -> None:
    """An image chunk's KV, encoded alone at 0 and re-rotated on all three M-RoPE axes, equals
    the image prefilled at ``start`` (Qwen3-VL: interleaved sections, DeepStack inside the
    forward)."""
    adapter = vision(name)
    chunk = adapter.image(picture(1))
    positions, extent = adapter.chunk_positions(chunk)
    assert positions.shape == (3, chunk.n_tokens)
    assert extent < chunk.n_tokens  # a grid's extent is its longer side, not its token count
    check_relocation(adapter, chunk, start)


def test_qwen3_vl_rope_spec_is_the_interleaved_layout() -> None:
    adapter = vision("qwen3-vl")
    assert adapter.spec.mrope_interleaved
    assert adapter.spec.mrope_section == (2, 3, 3)
    # frequency j reads h when j % 3 == 1, w when j % 3 == 2 (up to 3 * section), t otherwise
    assert adapter.spec.frequency_axes == (0, 1, 2, 0, 1, 2, 0, 1)
    assert not vision("qwen2.5-vl").spec.mrope_interleaved


@pytest.mark.parametrize("name", sorted(VISION_FAMILIES))
def test_qwen_vl_positions_and_logits_match_the_full_forward(name: str) -> None:
    """Chunk-by-chunk prefill (text, image, text) equals HF's own forward on the whole prompt."""
    adapter = vision(name)
    image = adapter.image(picture(2))
    before, after = adapter.text(torch.arange(10, 17)), adapter.text(torch.arange(30, 36))
    ids = torch.cat([before.ids, image.ids, after.ids])[None]
    types = (ids == adapter.image_token_id).int()
    grid = torch.tensor([image.grid_thw])
    model = adapter.model  # type: ignore[attr-defined]
    ref_pos, _ = model.model.get_rope_index(ids, types, image_grid_thw=grid)
    ours = []
    start = 0
    for chunk in (before, image, after):
        rel, extent = adapter.chunk_positions(chunk)
        ours.append(rel + start)
        start += extent
    assert torch.equal(torch.cat(ours, dim=1), ref_pos[:, 0])
    with torch.inference_mode():
        ref = model(
            input_ids=ids, pixel_values=image.pixel_values, image_grid_thw=grid, mm_token_type_ids=types
        ).logits[0]
    torch.testing.assert_close(adapter.reference_logits([before, image, after]), ref)

    def chunked() -> torch.Tensor:
        cache, start, logits = adapter.empty_cache(), 0, []
        for chunk in (before, image, after):
            logits.append(adapter.prefill(chunk, cache, start).logits)
            start += adapter.chunk_positions(chunk)[1]
        return torch.cat(logits)

    assert float((chunked() - ref).abs().max()) < 1e-4
    if name == "qwen3-vl":  # DeepStack enters inside the adapter's forward, and it matters
        feats = adapter.vision_features(image)
        assert len(feats.deepstack) == 2
        assert all(d.shape == feats.embeds.shape for d in feats.deepstack)
        adapter._forward_kwargs = lambda chunks: {}  # type: ignore[method-assign]
        assert float((chunked() - ref).abs().max()) > 1e-3


@pytest.mark.parametrize("name", sorted(VISION_FAMILIES))
def test_vision_encoder_runs_once_per_image(name: str) -> None:
    adapter = vision(name)
    a, b = adapter.image(picture(3)), adapter.image(picture(4))
    again = adapter.image(picture(3))
    assert again.content_key == a.content_key != b.content_key
    for chunk in (a, b, again, a):
        adapter.encode(chunk)
    assert adapter.vision_encoder_calls == encoder_calls(adapter) == 2
    cache = adapter.empty_cache()
    adapter.prefill_many([adapter.text(torch.arange(3, 9)), b, a], cache, 0)  # both cached
    assert adapter.vision_encoder_calls == 2
    fresh = adapter.fresh()
    assert fresh.vision_encoder_calls == 0
    assert adapter.vision_encoder_calls == 2
    fresh.encode(a)
    assert fresh.vision_encoder_calls == 1
    adapter.clear_vision_cache()
    adapter.encode(a)
    assert adapter.vision_encoder_calls == 3
    assert encoder_calls(load_adapter("tiny:llama-gqa")) == 0


def test_an_image_chunk_key_is_remembered_by_content_and_salt() -> None:
    adapter = vision("qwen2.5-vl")
    a, b = adapter.image(picture(3)), adapter.image(picture(4))
    expect = image_key(
        adapter.namespace("t"), a.pixel_values, "RGB", {"grid_thw": a.grid_thw, "image_key": a.content_key}
    )
    assert adapter.chunk_key(a, "t") == str(expect)
    assert adapter.chunk_key(adapter.image(picture(3)), "t") == str(expect)  # the same pixels again
    assert adapter.chunk_key(a, "u") != str(expect)  # another tenant's salt, another key
    assert adapter.chunk_key(a) != adapter.chunk_key(b)
    assert adapter.chunk_key(a, "t") == str(expect)


def test_text_model_refuses_images_and_unknown_models(tmp_path) -> None:  # type: ignore[no-untyped-def]
    adapter = load_adapter("tiny:llama-gqa")
    vl = vision("qwen2.5-vl")
    assert not isinstance(adapter, VisionAdapter)
    with pytest.raises(TypeError, match="text-only"):
        adapter.encode(vl.image(picture(5)))
    with pytest.raises(ModelNotFoundError):
        load_adapter(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UnsupportedModelError, match="bert"):
        load_adapter(str(tmp_path))


def test_smollm2_relocation_and_greedy_answer(smollm2: ModelAdapter) -> None:
    tok = smollm2.tokenizer
    text = smollm2.text(tok("The Eiffel Tower is in Paris, the capital of France.")["input_ids"])
    check_relocation(smollm2, text, 100, key_tol=1e-5)
    question = smollm2.text(tok(" The Eiffel Tower is located in the city of")["input_ids"])
    kv = smollm2.encode(text)
    cache = smollm2.new_cache([kv.place(0, smollm2.spec)])
    out = smollm2.generate(question, cache, kv.extent, max_new_tokens=3)
    assert "Paris" in tok.decode(out.tokens)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_cache_over_an_arena_runs_like_a_dynamic_cache(name: str) -> None:
    """New tokens go into the arena's spare room (growing it when full); logits, the grown
    cache's keys and values, and next_logits all equal the plain cache path."""
    adapter = load_adapter(f"tiny:{name}")
    context = adapter.text(torch.arange(3, 40))
    kv = adapter.encode(context)
    k, v = kv.place(0, adapter.spec)
    arena = KVArena(k.shape[0], (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), capacity=40)
    arena.k[:, :, : k.shape[2]], arena.v[:, :, : v.shape[2]] = k, v
    arena.reset(k.shape[2])
    on_arena, plain = adapter.new_cache(arena), adapter.new_cache([(k, v)])
    query = adapter.text(torch.arange(5, 12))  # 37 + 7 > 40: the arena grows once
    got = adapter.prefill(query, on_arena, kv.extent)
    want = adapter.prefill(query, plain, kv.extent)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.kv.k, want.kv.k, rtol=1e-5, atol=1e-6)
    assert arena.grows == 1
    assert adapter.cache_length(on_arena) == adapter.cache_length(plain) == 44
    for a, b in zip(on_arena.layers, plain.layers, strict=False):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    last = adapter.text(torch.tensor([7, 8]))
    torch.testing.assert_close(
        adapter.next_logits(last, on_arena, 44),
        adapter.prefill(last, plain, 44).logits[-1],
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2.5-vl"])
def test_grouped_query_attention_without_copies_matches_sdpa(name: str) -> None:
    """The adapter switches CPU models to ``kamera_blocked``; new tokens over a cache (a mask,
    grouped heads, passes that cross a block edge) give transformers' own ``sdpa`` results, and so
    does a decode step."""
    adapter = load_adapter(f"tiny:{name}")
    assert adapter.model.config._attn_implementation == attention.NAME
    context, query = adapter.text(torch.arange(3, 200) % 90), adapter.text(torch.arange(5, 80))
    out = {}
    for impl in ("sdpa", attention.NAME):
        adapter.model.set_attn_implementation(impl)
        cache = adapter.empty_cache()
        first = adapter.prefill(context, cache, 0).logits
        second = adapter.prefill(query, cache, 197).logits
        step = adapter.prefill(adapter.text([7]), cache, 272).logits
        out[impl] = torch.cat([first, second, step])
    torch.testing.assert_close(out[attention.NAME], out["sdpa"], rtol=1e-5, atol=1e-5)


def test_load_adapter_names_the_tiny_models() -> None:
    plain = load_adapter("tiny")
    assert isinstance(plain, VisionAdapter)
    assert plain.info.name == "tiny-qwen2.5-vl"
    assert plain.tokenizer is None
    marker = object()
    text = load_adapter("tiny:llama-gqa", tokenizer=marker)
    assert text.tokenizer is marker
    assert text.info.fingerprint == load_adapter("tiny:llama-gqa").info.fingerprint  # seeded weights
    assert load_adapter("tiny:llama-gqa") is not text  # a new model each call
    with pytest.raises(ValueError, match="unknown tiny model"):
        load_adapter("tiny:bert")


def test_new_cache_takes_one_pair_over_and_joins_several() -> None:
    adapter = load_adapter("tiny:llama-gqa")
    k, v = adapter.encode(adapter.text(torch.arange(3, 20))).place(0, adapter.spec)
    one = adapter.new_cache([(k, v)])
    assert adapter.layer_kv(one, 0)[0].data_ptr() == k[0].data_ptr()  # no copy
    two = adapter.new_cache([(k[:, :, :5], v[:, :, :5]), (k[:, :, 5:], v[:, :, 5:])])
    assert adapter.cache_length(two) == adapter.cache_length(one) == 17
    assert torch.equal(adapter.layer_kv(two, 2)[0], k[2])
    with pytest.raises(ValueError, match="layers"):
        adapter.new_cache([(k[:2], v[:2])])
