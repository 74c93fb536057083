from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("av")

from bench.video_stream import ShowIds, main
from bench.video_stream_plan import Schedule, plan
from bench.video_stream_run import TimeSpans, prompt_spans
from demos.retrieval import FrameRecord
from tools.world import WORLD_VL_DIR
from tools.world.render import make_split, renumber


def test_plan_asks_recent_and_look_back_questions() -> None:
    episodes = make_split("val", 12)
    qs = plan(episodes, Schedule(every_s=6, lookback_every=3, back_s=24, back_cycles=2))
    assert [q.at for q in qs] == [6 * i - 0.5 for i in range(1, 13)]
    kinds = [q.kind for q in qs]
    assert kinds.count("look-back") >= 3
    for q in qs:
        ep = episodes[q.episode]
        last = 6 * q.episode + 5
        assert q.frames == (last - 5.0, float(last))
        assert q.frames[1] < q.at  # every frame it needs has arrived
        if q.kind == "recent":
            assert q.episode == int(q.at + 0.5) // 6 - 1
        else:  # left a 16-frame window long before
            assert q.at - q.frames[1] >= 24
        assert q.expected in {x.answer for x in ep.questions}
        assert q.text in {x.text for x in ep.questions}


def test_longer_prompts_renumber_the_episode_frames() -> None:
    assert renumber("what colour is the star in frame 3 ?", 10) == "what colour is the star in frame 13 ?"
    assert renumber("which shape moved last ?", 10) == "which shape moved last ?"
    qs = plan(make_split("val", 4), Schedule(prompt_frames=16))
    q = qs[-1]
    assert q.frames == (23.0 - 15, 23.0)
    assert plan(make_split("val", 4), Schedule(prompt_frames=16))[0].frames == (0.0, 5.0)  # clipped at 0


def test_time_spans_and_chat_prompts() -> None:
    frames = [FrameRecord(f"f{i}", float(i), 4) for i in range(40)]
    assert TimeSpans(((3.0, 5.0), (30.0, 39.0))).select(frames, 20, None) == [3, 4, 5, *range(30, 40)]
    assert TimeSpans(((0.0, 39.0),)).select(frames, 4, None) == [36, 37, 38, 39]
    q = plan(make_split("val", 10), Schedule(lookback_every=2, back_s=24))[5]
    assert q.kind == "look-back"
    spans = prompt_spans(q, 16, labelled=False)
    picked = TimeSpans(spans).select(frames, 16, None)
    assert len(picked) == 16
    assert {int(q.frames[0]), int(q.frames[1])} <= set(picked)
    assert max(picked) == int(q.at - 0.5)


def test_answers_are_compared_token_for_token() -> None:
    tok = ShowIds()
    assert tok.decode([300, 301]) != tok.decode([300, 302])  # the byte tokenizer drops both
    assert tok.decode(tok.encode("star")) == "star"


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "stream.json"
    assert main([*argv, "--split", "val", "--threads", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_tiny_stream(tmp_path: Path) -> None:
    report = _run(
        tmp_path,
        "--model",
        "tiny",
        "--episodes",
        "8",
        "--window",
        "8",
        "--lookback-every",
        "2",
        "--back",
        "18",
        "--frame-size",
        "112",
        "--reuse-modes",
        "exact,repair",
        "--window-policy",
        "slide",
    )
    assert report["frames"] == 48
    assert report["frame_size"] == [112, 112]
    for run in report["runs"]:
        rows = run["rows"]
        assert run["vision_encoder_calls"] == run["distinct_frames"] >= 46
        assert run["targets"]["encoder_calls_equal_distinct_frames"]
        look_back = [r for r in rows if r["kind"] == "look-back"]
        assert look_back
        assert all(r["encoder_calls"] == 0 for r in look_back)
        assert run["lookback_encoder_calls"] == 0
        for r in rows:  # re-encoding runs the encoder on every frame of the window it answers on
            assert r["baseline_encoder_calls"] == r["frames"] >= min(8, r["at_s"] + 0.5)
            assert r["frame_span"][1] == r["at_s"] - 0.5
        for key in ("ttft_ms", "baseline_ttft_ms", "answer", "expected", "same_as_baseline", "served"):
            assert all(key in r for r in rows)
        assert run["baseline_encoder_calls"] == sum(r["frames"] for r in rows)
        assert run["session_s"] > 0
        assert run["baseline_s"] > 0
    exact, repair = report["runs"]
    assert all(r["frames"] == min(8, r["at_s"] + 0.5) for r in exact["rows"])  # the question's frames only
    assert exact["same_as_baseline"] == exact["questions"]  # exact KV: re-encoding's answers
    assert all(r["served"] == "prefix" for r in exact["rows"])
    # repair brings a look-back's evicted frames back from the store
    assert all(r["recalled"] >= 6 for r in repair["rows"] if r["kind"] == "look-back")


def _session(anchor: int | None, window: int) -> tuple[Any, list[Any]]:
    """A tiny-model session of eager ingest and 20 distinct frames (each flushed as it comes)."""
    from PIL import Image

    from bench.video_stream_run import session_args
    from demos.video_session import VideoSession
    from demos.vl_model import load_vl_adapter

    adapter = load_vl_adapter("tiny")
    frames = [Image.new("RGB", (56, 56), (12 * i, 255 - 12 * i, 7 * i)) for i in range(20)]
    per_frame = adapter.image(frames[0]).n_tokens
    args = session_args(
        budget=60 + 2 * window * per_frame,
        reuse_mode="exact",
        layout="chat",
        frames_per_question=2 * window,
        max_new_tokens=1,
    )
    return VideoSession(adapter, args, anchor=anchor), frames


def test_a_re_anchored_window_is_exact_after_every_batch() -> None:
    from agent.adapters.vision import encoder_calls
    from agent.context_types import Source

    session, frames = _session(anchor=4, window=4)
    held = []
    for t, image in enumerate(frames):
        session.add_frame(image, float(t))
        session.flush()
        calls = encoder_calls(session.adapter)
        assert calls == t + 1  # the re-prefill of the survivors runs no encoder
        view = session.cm.view()[1:]
        held.append(len(view))
        assert session.cm.exact
        assert all(v.source == Source.PREFILLED for v in view)
        assert [v.meta["t"] for v in view] == [float(x) for x in range(t + 1 - len(view), t + 1)]
    assert max(held) == 8  # grows from 4 to 8 frames, never past
    assert min(held[4:]) >= 4
    assert session.reanchors == 3  # at the 9th, 14th and 19th frame: down to 4, up to 8
    assert len(session.cm.evicted) == 15  # the oldest went to the store, recallable


@pytest.mark.parametrize("mode", ["exact", "repair"])
def test_labelled_eager_ingest_encodes_and_prefills_nothing(mode: str) -> None:
    """On the labelled layout a question prefills its frames after their labels, so the stream's
    frames are encoded as they come and nothing of them is prefilled until a question asks;
    the answer is re-encoding's, and the question runs no encoder."""
    from PIL import Image

    from agent.adapters.vision import encoder_calls
    from bench.video_stream_run import session_args
    from demos.video_session import Asked, VideoSession
    from demos.vl_model import load_vl_adapter

    adapter = load_vl_adapter("tiny")
    frames = [Image.new("RGB", (56, 56), (20 * i, 200 - 15 * i, 9 * i)) for i in range(12)]
    per_frame = adapter.image(frames[0]).n_tokens
    args = session_args(
        budget=200 + 12 * per_frame,
        reuse_mode=mode,
        layout="labelled",
        frames_per_question=4,
        max_new_tokens=2,
    )
    session = VideoSession(adapter, args)
    prefilled = session.cm.counters.tokens_prefilled
    for t, image in enumerate(frames):
        session.add_frame(image, float(t))
    session.flush()
    assert encoder_calls(adapter) == 12
    assert len(session.cm.view()) == 1  # the system prompt alone
    assert session.cm.counters.tokens_prefilled == prefilled
    assert [f.t for f in session.frames] == [float(t) for t in range(12)]
    q = Asked(0, "What is shown?", None)
    session.answer(q, 12.0)
    assert encoder_calls(adapter) == 12  # the question's frames came from cached features
    assert q.frame_times == [8.0, 9.0, 10.0, 11.0]
    assert [v.kind for v in session.cm.view()[1:]] == ["label", "frame"] * 4
    session.reencode_one(q)
    assert q.reencoded is not None
    assert q.reencoded[1] == q.answer
    assert q.reencoded[2] == 4  # re-encoding runs the encoder on every frame it answers on


def test_a_sliding_window_stops_being_exact() -> None:
    session, frames = _session(anchor=None, window=4)
    exact = []
    for t, image in enumerate(frames):
        session.add_frame(image, float(t))
        session.flush()
        exact.append(session.cm.exact)
    assert exact[0]
    assert not exact[-1]
    assert session.reanchors == 0


def test_tiny_stream_re_anchored(tmp_path: Path) -> None:
    report = _run(
        tmp_path,
        "--model",
        "tiny",
        "--episodes",
        "8",
        "--window",
        "8",
        "--lookback-every",
        "2",
        "--back",
        "18",
        "--frame-size",
        "112",
        "--reuse-modes",
        "exact,repair",
        "--window-policy",
        "anchor",
    )
    assert report["window_policy"] == "anchor"
    for run in report["runs"]:
        rows = run["rows"]
        assert run["reanchors"] >= 2
        assert run["vision_encoder_calls"] == run["distinct_frames"] == 48
        assert run["lookback_encoder_calls"] == 0
        # every question on a window exact as it stands: only the question (and a look-back's six
        # frames, after the window) prefilled, and re-encoding's answer
        assert all(r["served"] == "prefix" for r in rows)
        assert run["same_as_baseline"] == run["questions"] == 8
        for r in rows:
            extra = 6 if r["kind"] == "look-back" else 0
            assert r["reused_chunks"] == r["frames"] - extra
            assert r["frames"] <= 2 * 8 + extra
            assert r["baseline_encoder_calls"] == r["frames"]
            assert r["recalled"] == 0
        look_back = [r for r in rows if r["kind"] == "look-back"]
        assert look_back
        assert all(r["tokens_prefilled"] > 6 * 16 for r in look_back)
        # the question alone (byte tokens, about 60), not the window's 8 to 16 frames of 18
        assert max(r["tokens_prefilled"] for r in rows if r["kind"] == "recent") < 100
    assert max(r["reused_chunks"] for r in report["runs"][0]["rows"]) > 8  # grew past W


NO_WORLD = not any(WORLD_VL_DIR.glob("*.safetensors"))


@pytest.mark.skipif(NO_WORLD, reason="the world model's weights are absent (kamera train-demo-model)")
def test_world_model_stream(tmp_path: Path) -> None:
    report = _run(
        tmp_path,
        "--model",
        "world",
        "--episodes",
        "12",
        "--window",
        "16",
        "--back",
        "24",
        "--reuse-modes",
        "exact",
    )
    (run,) = report["runs"]
    assert run["vision_encoder_calls"] == run["distinct_frames"]
    assert run["same_as_baseline"] == run["questions"] == 12
    assert run["right"] >= run["baseline_right"] - 1
    assert run["right"] >= 6  # the trained model reads its frames (chance is well under half)
    assert all(r["frames"] == 6 for r in run["rows"])
