"""kamera bench video-multihop on the tiny random-weight Qwen2.5-VL and the world's frames."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.adapters.base import ImageInput
from agent.recompute import FixedSelection, selective_recompute
from bench.answers import Codec
from bench.video_multihop import load_model, main
from bench.video_multihop_eval import fresh_adapter
from bench.video_multihop_layout import (
    PREFIX,
    TAIL,
    Encoders,
    Piece,
    build_case,
    pairs,
    shuffled_order,
    text_encoder,
)
from bench.video_multihop_methods import Store, content_id, context_pass, placement
from tools.world.render import make_split


@pytest.fixture(scope="module")
def adapter() -> Any:
    return load_model("tiny")


@pytest.fixture(scope="module")
def enc(adapter: Any) -> Encoders:
    from bench.video_multihop_eval import frame_encoder

    return Encoders(text_encoder(Codec(adapter.tokenizer)), frame_encoder(adapter))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("vm") / "report.json"
    argv = ["--model", "tiny", "--limit", "2", "--ranks", "2,1000", "--threads", "1", "--json", str(path)]
    assert main(argv) == 0
    out: dict[str, Any] = json.loads(Path(path).read_text())
    return out


def test_cli_writes_the_json_keys(report: dict[str, Any]) -> None:
    names = {"reprefill", "blind", "patch-r2", "patch-r1000", "stored-r1000", "cacheblend-15", "epic-1"}
    assert set(report["methods"]) == names
    assert set(report["scenarios"]) == {"slide", "recall", "reorder"}
    for m in report["methods"].values():
        for key in ("acc_single", "acc_multi", "ttft_ms", "encoder_calls"):
            assert m[key] is not None
        assert m["n_single"] == 3 * 8  # 4 single per episode, 3 scenarios
        assert m["n_multi"] > 0
    assert report["random_weights"] is True
    assert report["methods"]["reprefill"]["agree_multi"] == 1.0
    # patches fitted to the served prompt's own full prefill are oracles, reported apart
    assert report["oracle"] == ["patch-r2", "patch-r1000"]
    assert set(report["deployable"]) == names - {"patch-r2", "patch-r1000"}
    assert all(m["oracle"] == (n in report["oracle"]) for n, m in report["methods"].items())


def test_full_rank_patch_reproduces_reprefill_answers(report: dict[str, Any]) -> None:
    for s in report["scenarios"].values():
        m = s["methods"]["patch-r1000"]
        assert m["agree_single"] == 1.0
        assert m["agree_multi"] == 1.0
        assert m["kl_first"] < 1e-6
        assert m["patch_bytes_ratio"] > 1.0  # a full-rank patch of a chunk this short outweighs its KV


def test_encoder_runs_once_per_distinct_frame_for_reuse(report: dict[str, Any]) -> None:
    episodes = make_split("test", 2)
    questions = sum(len(ep.questions) for ep in episodes)
    for scenario, s in report["scenarios"].items():
        frames = s["distinct_frames"]
        assert frames == (24 if scenario == "recall" else 12)  # recall also shows a val episode
        for name, m in s["methods"].items():
            if name == "reprefill":  # every frame of every question's prompt, from scratch
                per_prompt = frames // 2
                assert m["encoder_calls"] == per_prompt * questions
            else:
                assert m["encoder_calls"] == frames


def test_reprefill_equals_a_direct_hf_forward(adapter: Any, enc: Encoders) -> None:
    episode = make_split("test", 1)[0]
    pieces = pairs(episode, enc)
    prefix = enc.text(PREFIX)
    tail = enc.text(TAIL.format(question=episode.questions[-1].text))
    ref = context_pass(adapter, prefix, pieces)
    end = placement(adapter, prefix, pieces).end
    got = adapter.prefill(tail, adapter.new_cache([(ref.k, ref.v)]), end).logits

    chunks = [prefix, *[p.chunk for p in pieces], tail]
    images = [c for c in chunks if isinstance(c, ImageInput)]
    ids = torch.cat([c.ids for c in chunks])[None]
    types = (ids == adapter.image_token_id).int()
    grid = torch.tensor([c.grid_thw for c in images])
    hf_positions, _ = adapter.model.model.get_rope_index(ids, types, image_grid_thw=grid)
    ours = placement(adapter, prefix, [*pieces, Piece("tail", tail)]).positions
    assert torch.equal(ours, hf_positions[:, 0])
    with torch.inference_mode():
        out = adapter.model(
            input_ids=ids,
            pixel_values=torch.cat([c.pixel_values for c in images]),
            image_grid_thw=grid,
            mm_token_type_ids=types,
        )
    want = out.logits[0, -tail.n_tokens :].float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_recompute_of_every_token_is_the_full_prefill(adapter: Any, enc: Encoders) -> None:
    """CacheBlend/EPIC on an M-RoPE context: recomputing all tokens of a blind context from its
    input embeddings gives the reference KV (image tokens take their vision features, 3-D
    positions)."""
    episode = make_split("test", 1)[0]
    case = build_case("reorder", episode, make_split("val", 1)[0], enc)
    prefix = enc.text(PREFIX)
    reuse = fresh_adapter(adapter, 64)
    store = Store(reuse)
    ref = context_pass(adapter, prefix, case.target)
    place = placement(adapter, prefix, case.target)
    parts = [
        store.get(p.chunk).place(s, adapter.spec) for p, s in zip(case.target, place.starts, strict=True)
    ]
    k = torch.cat([ref.k[:, :, : place.n_prefix], *[kk for kk, _ in parts]], 2)
    v = torch.cat([ref.v[:, :, : place.n_prefix], *[vv for _, vv in parts]], 2)
    assert (k - ref.k).abs().max() > 1e-3  # blind differs
    embeds = store.embeds([prefix, *[p.chunk for p in case.target]])
    n = int(k.shape[2])
    rec = selective_recompute(reuse, embeds, place.positions, k, v, FixedSelection(torch.arange(n)))
    torch.testing.assert_close(rec.k, ref.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rec.v, ref.v, rtol=1e-4, atol=1e-4)


def test_reorder_keeps_each_label_with_its_frame(adapter: Any, enc: Encoders) -> None:
    episode = make_split("test", 1)[0]
    case = build_case("reorder", episode, make_split("val", 1)[0], enc)
    names = [p.name.split("/")[-1] for p in case.target]
    order = shuffled_order(episode)
    assert order != sorted(order)
    assert names == [x for k in order for x in (f"label {k}", f"frame {k}")]
    frames = {content_id(p.chunk) for p in case.target if isinstance(p.chunk, ImageInput)}
    assert len(frames) == len(episode.frames)
