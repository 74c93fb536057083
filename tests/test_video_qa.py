from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("av")

from demos.retrieval import FrameRecord, make_retrieval
from demos.video_qa import clock, main, parse_time, schedule
from tools.video import counter_frames, write_video


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 s of distinct counter frames at 4 fps; sampled at 2 fps that is 20 frames."""
    path = tmp_path_factory.mktemp("video") / "counter.mp4"
    write_video(path, counter_frames(40, 160, 120), fps=4)
    return path


def _frames(n: int) -> list[FrameRecord]:
    return [FrameRecord(f"id{i}", float(i), 10, torch.eye(n)[i]) for i in range(n)]


def test_retrieval_strategies() -> None:
    frames = _frames(10)
    assert make_retrieval("recent").select(frames, 3, None) == [7, 8, 9]
    assert make_retrieval("even").select(frames, 4, None) == [0, 3, 6, 9]
    assert make_retrieval("even").select(frames, 20, None) == list(range(10))
    question = torch.eye(10)[2] + 0.5 * torch.eye(10)[7]
    assert make_retrieval("similarity").select(frames, 2, question) == [2, 7]
    with pytest.raises(ValueError, match="choose from"):
        make_retrieval("nearest")


def test_times_and_schedule() -> None:
    assert parse_time("00:01:30") == parse_time("1:30") == parse_time("90") == 90.0
    assert clock(90) == "01:30"
    assert clock(2.5) == "00:02.5"
    for bad in ("soon", "1:-2", "1:2:3:4"):
        with pytest.raises(ValueError, match="not a time"):
            parse_time(bad)

    class Args:
        question = ("a", "b")
        at = ("0:05",)

    asked = schedule(Args())  # type: ignore[arg-type]
    assert [q.at for q in asked] == [5.0, None]


def test_pixel_bounds_of_the_model() -> None:
    from demos.vl_model import load_vl_adapter

    adapter = load_vl_adapter("tiny")
    assert adapter.pixel_bounds() == (56 * 56, 224 * 224)  # type: ignore[attr-defined]


@pytest.mark.parametrize("ingest", ["1", "16"])  # frames one by one, or queued and put in together
def test_video_qa_end_to_end(video: Path, tmp_path: Path, ingest: str) -> None:
    out = tmp_path / "report.json"
    code = main(
        [str(video), "--model", "tiny", "--fps", "2", "--budget", "400", "--frames-per-question", "4",
         "--ingest", "eager", "--ingest-batch", ingest,
         "-q", "What is shown?", "--at", "00:03", "-q", "What changed?", "--compare",
         "--max-new-tokens", "4", "--json", str(out), "--quiet", "--threads", "1"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    for key in ("frames_sampled", "distinct_frames", "vision_encoder_calls", "tokens_reused", "questions",
                "reprefill_ttft_ms", "total_s", "reencode_total_s"):  # fmt: skip
        assert key in report, key
    assert report["frames_sampled"] == 20
    assert report["distinct_frames"] == 20
    # 160x120 frames kept within the tiny model's pixel bounds, not raised to a video's 100k minimum
    h, w = report["frame_size"]
    assert 56 * 56 <= h * w <= 224 * 224
    assert h % 28 == 0
    assert w % 28 == 0
    assert report["vision_encoder_calls"] == report["distinct_frames"]
    assert report["window"]["chunks_evicted"] > 0  # the window slid
    assert report["tokens_reused"] > 0
    first, last = report["questions"]
    assert set(first) >= {"question", "answer", "ttft_ms", "frame_times"}
    assert max(first["frame_times"]) <= 3.0  # asked at 00:03: nothing later was seen yet
    assert last["asked_at_s"] == max(last["frame_times"]) > 9
    assert min(last["frame_times"]) == 0.0  # "even" brought the first frame back by recall
    assert last["recalled_times"]
    # recalled from the store as their conditioned KV: no re-encode, no extra forward pass per frame
    assert report["window"]["recompute_on_miss"] == 0
    assert report["window"]["canonical_encodes"] == 0
    assert report["reprefill_ttft_ms"] > 0
    assert report["reencode_total_s"] > 0
    # the baseline starts from scratch for every question: one encoder run per frame of each window
    assert report["reencode_vision_encoder_calls"] == len(first["frame_times"]) + len(last["frame_times"])


def test_lazy_ingest_encodes_only_what_questions_pick(video: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = main(
        [str(video), "--model", "tiny", "--fps", "2", "--budget", "400", "--frames-per-question", "3",
         "--retrieval", "recent", "-q", "What is shown?", "--at", "00:03", "-q", "What now?", "--at", "00:03",
         "-q", "What changed?", "--compare", "--max-new-tokens", "4", "--json", str(out), "--quiet",
         "--threads", "1"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["ingest"] == "lazy"
    assert report["frames_sampled"] == report["distinct_frames"] == 20
    first, second, last = report["questions"]
    assert first["frame_times"] == second["frame_times"] == [2.0, 2.5, 3.0]  # the last three by 00:03
    assert len(last["frame_times"]) == 3
    assert min(last["frame_times"]) > 8
    # only the frames questions picked ran through the vision encoder, each once
    assert report["vision_encoder_calls"] == 6
    assert report["frames_preprocessed"] == 7  # and the first frame, to learn a frame's token count
    assert report["reencode_vision_encoder_calls"] == 9
    # re-encoding decoded the stream again and answered each question as it came
    assert report["reencode_decode_s"] > 0
    assert report["reencode_total_s"] < report["reencode_with_decode_s"]
    # the second question found its three frames as a fresh prefill has them; the third none
    assert [q["exact_chunks"] for q in report["questions"]] == [0, 3, 0]
    # no question's turn stays in the window; the last question cut the three frames before it
    assert report["window"]["chunks_evicted"] == 3
    assert report["reencode_same_answers"] == 3


def test_similarity_retrieval_runs(video: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = main(
        [str(video), "--model", "tiny", "--nframes", "8", "--budget", "300", "--retrieval", "similarity",
         "--frames-per-question", "2", "-q", "Which frame?", "--max-new-tokens", "2", "--json", str(out),
         "--quiet", "--threads", "1"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["vision_encoder_calls"] == report["distinct_frames"] == 8
    assert len(report["questions"][0]["frame_times"]) >= 2


def test_similarity_retrieval_lazy_scores_every_frame_once(video: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = main(
        [str(video), "--model", "tiny", "--nframes", "8", "--budget", "300", "--retrieval", "similarity",
         "--frames-per-question", "2", "-q", "Which frame?", "-q", "And now?", "--max-new-tokens", "2",
         "--json", str(out), "--quiet", "--threads", "1", "--ingest", "lazy"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    # scoring needs every frame's features: one encoder run each, none again for the prefill
    assert report["vision_encoder_calls"] == report["distinct_frames"] == 8


@pytest.mark.parametrize("kind", ["garbage", "text", "image", "missing", "truncated"])
def test_bad_inputs_exit_2_without_traceback(
    kind: str, video: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{kind}.mp4"
    if kind == "garbage":
        path.write_bytes(bytes(range(256)) * 64)
    elif kind == "text":
        path = tmp_path / "notes.txt"
        path.write_text("not a video\n" * 100)
    elif kind == "image":
        from PIL import Image

        path = tmp_path / "still.png"
        Image.new("RGB", (64, 48), (200, 30, 30)).save(path)
    elif kind == "truncated":
        path.write_bytes(video.read_bytes()[: video.stat().st_size // 3])
    code = main([str(path), "--model", "tiny", "-q", "what?", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kamera video-qa: error:")
    assert "Traceback" not in err


def test_bad_options_exit_2(video: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(video), "-q", "a", "--at", "later", "--model", "tiny"]) == 2
    assert main([str(video), "-q", "a", "--at", "1", "--at", "2", "--model", "tiny"]) == 2
    assert main([str(video), "--model", "tiny"]) == 2  # no question
    assert "Traceback" not in capsys.readouterr().err


def test_missing_default_model_is_a_clear_error(video: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.world import WORLD_VL_DIR

    if any(WORLD_VL_DIR.glob("*.safetensors")):
        pytest.skip("the world_vl checkpoint is present")
    assert main([str(video), "-q", "what?", "--quiet", "--nframes", "2"]) == 2
    assert "--model" in capsys.readouterr().err


def test_labelled_layout_answers_world_questions_from_a_file(tmp_path: Path) -> None:
    from tools.world.render import main as world_video

    path = tmp_path / "world.mp4"
    assert world_video([str(path), "--episodes", "2", "--per-episode", "2"]) == 0
    questions = json.loads(path.with_suffix(".json").read_text())
    assert [q["at"] for q in questions] == [5.5, 5.5, 11.5, 11.5]
    out = tmp_path / "report.json"
    code = main(
        [str(path), "--model", "tiny", "--layout", "labelled", "--fps", "1", "--budget", "400",
         "--retrieval", "recent", "--frames-per-question", "6", "--questions", str(path.with_suffix(".json")),
         "--max-new-tokens", "2", "--json", str(out), "--quiet", "--threads", "1", "--compare"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["with_expected"] == 4
    assert 0 <= report["correct"] <= 4
    assert 0 <= report["reencode_correct"] <= 4
    # each question looks at its own episode's six frames, in time order
    first, second = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]
    assert [q["frame_times"] for q in report["questions"]] == [first, first, second, second]
    assert [q["expected"] for q in report["questions"]] == [q["answer"] for q in questions]
    assert report["vision_encoder_calls"] == report["distinct_frames"] == 12
    # repair on the labelled layout: each window as a fresh prefill has it, so the answers are
    # re-encoding's; an episode's second question reuses its first one's labels and frames, the next
    # episode's first question the "frame 1" label in front of the window
    assert report["reencode_same_answers"] == 4
    assert [q["exact_chunks"] for q in report["questions"]] == [0, 12, 1, 12]


def test_each_question_is_tokenized_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The question's prompt is tokenized once: its length sizes the window, the step prefills it,
    and the first question's re-prefill measurement reuses it."""
    from agent.byte_tokenizer import ByteTokenizer
    from tools.world.render import main as world_video

    path = tmp_path / "world.mp4"
    assert world_video([str(path), "--episodes", "2", "--per-episode", "2"]) == 0
    questions = [q["question"] for q in json.loads(path.with_suffix(".json").read_text())]
    texts: list[str] = []
    call = ByteTokenizer.__call__

    def counted(self: ByteTokenizer, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        texts.append(text)
        return call(self, text, add_special_tokens)

    monkeypatch.setattr(ByteTokenizer, "__call__", counted)
    code = main(
        [str(path), "--model", "tiny", "--layout", "labelled", "--fps", "1", "--budget", "400",
         "--retrieval", "recent", "--frames-per-question", "6", "--questions", str(path.with_suffix(".json")),
         "--max-new-tokens", "2", "--quiet", "--threads", "1"]
    )  # fmt: skip
    assert code == 0
    assert len([t for t in texts if any(q in t for q in questions)]) == len(questions)


def test_reencoding_prefills_frames_and_question_in_one_pass() -> None:
    """The baseline's pass structure is the session's: the window and the question in one forward
    pass (then decoding), not the window and then the question."""
    from PIL import Image

    from agent.adapters.base import TextInput
    from demos.video_session import full_answer
    from demos.vl_model import encode_text, load_vl_adapter
    from tools.video import counter_frames

    adapter = load_vl_adapter("tiny")
    frames = [adapter.image(Image.fromarray(a)) for a in counter_frames(2, 56, 56)]  # type: ignore[attr-defined]
    chunks = [encode_text(adapter, "frames:"), *frames]
    calls: list[str] = []
    for name in ("prefill", "prefill_many", "prefill_and_ask", "next_logits"):
        method = getattr(adapter, name)
        setattr(adapter, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    ttft_ms, answer = full_answer(adapter, chunks, TextInput(torch.tensor([70, 71, 72])), 3)
    assert calls == ["prefill_and_ask"]
    assert ttft_ms > 0
    assert isinstance(answer, str)


@pytest.mark.parametrize("ingest", ["lazy", "eager"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_labelled_layout_reuse_modes(tmp_path: Path, ingest: str, mode: str) -> None:
    from tools.world.render import main as world_video

    path = tmp_path / "world.mp4"
    assert world_video([str(path), "--episodes", "2", "--per-episode", "1"]) == 0
    out = tmp_path / "report.json"
    code = main(
        [str(path), "--model", "tiny", "--layout", "labelled", "--fps", "1", "--budget", "400",
         "--retrieval", "recent", "--frames-per-question", "6", "--questions", str(path.with_suffix(".json")),
         "--max-new-tokens", "2", "--json", str(out), "--quiet", "--threads", "1", "--compare",
         "--ingest", ingest, "--reuse-mode", mode]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["vision_encoder_calls"] == report["distinct_frames"] == 12
    if mode == "exact" or ingest == "lazy":  # windows built as a fresh prefill has them
        assert report["reencode_same_answers"] == 2
        assert [q["exact_chunks"] for q in report["questions"]] == [0, 1]  # "frame 1" stays
    else:  # frames reused where the stream put them, labels moved in front of them by rotation
        assert report["window"]["tokens_rotated"] > 0
        assert all(q["exact_chunks"] == 0 for q in report["questions"])


BAD_QUESTION_FILES = ["not json", '{"question": "a"}', '[{"at": 3}]', '[{"question": "a", "at": "x"}]']


@pytest.mark.parametrize("content", BAD_QUESTION_FILES)
def test_bad_questions_file_exits_2(
    content: str, video: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "q.json"
    bad.write_text(content)
    assert main([str(video), "--model", "tiny", "--questions", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--questions" in err
    assert "Traceback" not in err
