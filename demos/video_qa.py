"""``kamera video-qa``: answer questions over a long video whose frames slide through the window.

The video plays once, front to back, through one :class:`~demos.video_session.VideoSession`:
each sampled frame is preprocessed, run through the vision encoder once (the adapter caches
features by content) and appended to the window as its own chunk, with its timestamp; the
context manager slides the oldest frames out when the token budget is reached (survivors rotate,
evicted frames go to the store with their canonical KV and patch). A question asked at a time
(``--at``) or at the end picks the frames it needs with a retrieval strategy
(``demos/retrieval.py``) and brings back the evicted ones with ``ContextManager.recall``: no
vision encoder, no prefill of the frame. Only the question and the answer are prefilled. The
model is the embedded world model unless ``--model`` names another (``demos/vl_model.py``).

Two baselines are measured in the same run: ``reprefill_ttft_ms``, a full prefill of the first
question's window (vision features cached, so the LLM prefill alone), and with ``--compare``
``reencode_total_s``, every question answered from scratch on its window (vision encoder
included, on an adapter with an empty feature cache). Re-encoding is timed as a tool without the
cache runs it: a second pass decodes the stream again and answers each question when its time
comes, preprocessing the window's frames then (``reencode_with_decode_s``, the whole pass), so
that both ways meet the machine in the same state (the encoder's weights cold after decoding).

Not here: audio, seeking (the stream is decoded front to back), several videos in one window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agent.adapters.loading import ModelNotFoundError, UnsupportedModelError, frozen_heap
from agent.adapters.qwen_vl import QwenVLAdapter
from agent.modes import REUSE_MODES
from agent.tables import make_console
from demos.retrieval import RETRIEVALS
from demos.video_session import LAYOUTS, SYSTEM_PROMPT, Asked, VideoSession
from demos.vl_model import TINY, UsageError, load_vl_adapter
from tools.world import WORLD_VL_DIR

if TYPE_CHECKING:
    from tools.video import SamplingConfig, VideoInfo

# FFmpeg renders any text file as ANSI-art video through its tty demuxer; that is not a video.
TEXT_FORMATS = frozenset({"tty"})


def parse_time(text: str) -> float:
    """``HH:MM:SS``, ``MM:SS`` or seconds (fractions allowed) to seconds."""
    try:
        parts = [float(p) for p in text.strip().split(":")]
    except ValueError:
        raise UsageError(f"not a time: {text!r} (use HH:MM:SS, MM:SS or seconds)") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 or not math.isfinite(p) for p in parts):
        raise UsageError(f"not a time: {text!r} (use HH:MM:SS, MM:SS or seconds)")
    seconds = 0.0
    for p in parts:
        seconds = seconds * 60 + p
    return seconds


def clock(seconds: float) -> str:
    """``MM:SS`` (``HH:MM:SS`` past an hour), with tenths when the time is not whole."""
    whole, tenths = divmod(round(seconds * 10), 10)
    text = f"{whole // 3600:02d}:" if whole >= 3600 else ""
    text += f"{whole // 60 % 60:02d}:{whole % 60:02d}"
    return text + (f".{tenths}" if tenths else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kamera video-qa",
        description="Answer questions over a video whose frames slide through a token-budgeted window.",
    )
    p.add_argument("video", help="a video file (anything PyAV decodes)")
    p.add_argument("--question", "-q", action="append", help="a question (repeatable)")
    p.add_argument(
        "--questions",
        type=Path,
        help="a JSON list of {question, at, answer}: more questions, with the right answer when known "
        "(the report then marks each answer); 'kamera world-video' writes one",
    )
    p.add_argument(
        "--at",
        action="append",
        default=[],
        help="when to ask, one per question in order (HH:MM:SS, MM:SS or seconds); "
        "questions without one are asked at the end",
    )
    p.add_argument("--model", help=f"Qwen2.5-VL checkpoint folder, or '{TINY}' (default: {WORLD_VL_DIR})")
    p.add_argument("--budget", type=int, default=4096, help="window token budget (default 4096)")
    p.add_argument(
        "--keep",
        choices=["conditioned", "canonical+patch"],
        default="conditioned",
        help="what a frame that slides out leaves in the store: its conditioned KV (exact on recall, no "
        "extra forward pass; the default) or canonical KV plus a patch (one more pass per frame)",
    )
    p.add_argument(
        "--ingest",
        choices=["lazy", "eager"],
        default="lazy",
        help="lazy (default): frames are decoded and preprocessed as the video plays and enter the "
        "window (vision encoder, prefill) only when a question picks them, so a session never costs "
        "more than re-encoding its questions' windows; eager: every frame enters the window as it is "
        "decoded, so each answer only prefills its question",
    )
    p.add_argument(
        "--reuse-mode",
        choices=REUSE_MODES,
        default="repair",
        help="exact: a question's window is kept only where a fresh prefill would compute the same "
        "KV, the rest prefilled in context (vision features still reused); repair (default): frames "
        "moved and recalled by rotation in the chat layout, exact windows in the labelled layout, and "
        "a close greedy step answered on a fresh prefill; fast: moved and recalled blind",
    )
    p.add_argument("--retrieval", choices=sorted(RETRIEVALS), default="even", help="default: even")
    p.add_argument("--frames-per-question", type=int, default=8, help="frames a question looks at (8)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--evict-batch", type=int, default=8, help="chunks slid out at once when full (8)")
    p.add_argument(
        "--ingest-batch",
        type=int,
        default=16,
        help="frames encoded and prefilled together as the video plays (16; 1: one by one)",
    )
    p.add_argument("--system", default=SYSTEM_PROMPT, help="system prompt")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="auto",
        help="prompt layout: 'chat' (frames between the system turn and the question's user turn), "
        "'labelled' (the embedded world model's: frames inside the user turn, each after 'frame k'); "
        "auto: labelled for the embedded world model, chat otherwise",
    )
    sampling = p.add_mutually_exclusive_group()
    sampling.add_argument("--fps", type=float, help="frames sampled per second (qwen-vl-utils default 2)")
    sampling.add_argument("--nframes", type=int, help="frames sampled over the whole video")
    p.add_argument("--max-frames", type=int, help="cap on frames sampled with --fps")
    p.add_argument(
        "--max-pixels",
        type=int,
        help="cap on pixels per sampled frame (default: the model's image processor bounds)",
    )
    p.add_argument("--compare", action="store_true", help="also answer every question by re-encoding")
    p.add_argument("--json", type=Path, help="write a machine-readable report here")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def schedule(args: argparse.Namespace) -> list[Asked]:
    questions = list(args.question or [])
    if len(args.at) > len(questions):
        raise UsageError(f"{len(args.at)} --at for {len(questions)} --question")
    times: list[float | None] = [parse_time(a) for a in args.at]
    times += [None] * (len(questions) - len(times))
    asked = [Asked(i, q, t) for i, (q, t) in enumerate(zip(questions, times, strict=True))]
    if getattr(args, "questions", None) is not None:
        asked += read_questions(args.questions, start=len(asked))
    if not asked:
        raise UsageError("no question: give --question or --questions FILE")
    return asked


def read_questions(path: Path, start: int = 0) -> list[Asked]:
    """Questions from a JSON list of ``{"question": str, "at": time or null, "answer": str}``
    (``at`` and ``answer`` optional; ``at`` as for ``--at``)."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--questions {path}: {e}") from None
    if not isinstance(items, list):
        raise UsageError(f"--questions {path}: expected a JSON list of questions")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("question"), str):
            raise UsageError(f'--questions {path}: entry {i} has no "question" string')
        at = item.get("at")
        try:
            t = None if at is None else parse_time(str(at))
        except ValueError as e:
            raise UsageError(f"--questions {path}: entry {i}: {e}") from None
        expected = item.get("answer")
        out.append(Asked(start + i, item["question"], t, None if expected is None else str(expected)))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tools.video import NotAVideoError, SamplingConfig, plan_sampling, probe_video

    if (
        min(args.budget, args.frames_per_question, args.max_new_tokens, args.evict_batch, args.ingest_batch)
        <= 0
    ):
        raise UsageError(
            "--budget, --frames-per-question, --max-new-tokens, --evict-batch and --ingest-batch must be > 0"
        )
    asked = schedule(args)
    try:
        sampling = SamplingConfig(
            fps=args.fps, nframes=args.nframes, max_frames=args.max_frames, max_pixels=args.max_pixels
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    info = probe_video(args.video)
    if info.format_name in TEXT_FORMATS:
        raise NotAVideoError(f"{args.video}: a text file (FFmpeg's {info.format_name} demuxer), not a video")
    plan_sampling(info, sampling)  # a video too short for the sampling fails before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    adapter = load_vl_adapter(args.model)
    load_s = time.perf_counter() - t_load
    if args.max_pixels is None and isinstance(adapter, QwenVLAdapter):
        # frames sized within the model's own bounds: its processor would resize anything else again
        lo, hi = adapter.pixel_bounds()
        sampling = replace(sampling, min_pixels=lo, max_pixels=hi)
    with frozen_heap():  # the collector's full passes skip the model and libraries
        return _play(args, adapter, info, sampling, asked, load_s)


def _play(
    args: argparse.Namespace,
    adapter: Any,
    info: VideoInfo,
    sampling: SamplingConfig,
    asked: list[Asked],
    load_s: float,
) -> dict[str, Any]:
    """The session itself: the stream decoded once, questions answered as their time comes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tools.video import iter_frames, plan_sampling

    plan = plan_sampling(info, sampling)
    t0 = time.perf_counter()
    session = VideoSession(adapter, args)
    pending = sorted(asked, key=lambda q: math.inf if q.at is None else q.at)
    measured = 0.0  # time spent on the re-prefill baseline, kept out of total_s
    n_sampled, last_t = 0, 0.0
    decode_s = 0.0  # decoding, sampling and preprocessing the frames: the baseline reads them too
    console = make_console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=args.quiet) as progress:
        task = progress.add_task("decoding and encoding frames", total=len(plan.indices))
        frames = iter_frames(args.video, sampling)
        while True:
            t_decode = time.perf_counter()
            frame = next(frames, None)
            if frame is None:
                break
            image = frame.to_pil()
            decode_s += time.perf_counter() - t_decode
            while pending and pending[0].at is not None and pending[0].at < frame.timestamp:
                measured += _answer(session, pending.pop(0), last_t)
            session.add_frame(image, frame.timestamp)
            n_sampled, last_t = n_sampled + 1, frame.timestamp
            progress.advance(task)
        decode_s += session.preprocess_s
    session.flush()
    while pending:
        measured += _answer(session, pending.pop(0), last_t)
    total_s = time.perf_counter() - t0 - measured

    snap = session.agent.snapshot()
    report: dict[str, Any] = {
        "video": str(args.video),
        "model": adapter.info.name,
        "retrieval": args.retrieval,
        "ingest": args.ingest,
        "reuse_mode": args.reuse_mode,
        "budget_tokens": args.budget,
        "duration_s": info.duration_s,
        "sample_fps": plan.sample_fps,
        "frame_size": [plan.height, plan.width],
        "frames_sampled": n_sampled,
        "distinct_frames": len({f.chunk_id for f in session.frames}),
        # lazy: the first frame (its token count) and those questions picked; eager: every one
        "frames_preprocessed": len(session.prepared) if session.lazy else n_sampled,
        "vision_encoder_calls": snap["vision_encoder_calls"],
        "tokens_reused": snap["window"]["tokens_reused"],
        "questions": [
            {
                "question": q.question,
                "asked_at_s": q.asked_at,
                "answer": q.answer,
                "expected": q.expected,
                "ttft_ms": q.ttft_ms,
                "answer_ms": q.answer_ms,
                "frame_times": q.frame_times,
                "recalled_times": q.recalled_times,
                "exact_chunks": q.exact_chunks,
                "step": q.report,
            }
            for q in asked
        ],
        "correct": sum(q.answer == q.expected for q in asked if q.expected is not None),
        "with_expected": sum(q.expected is not None for q in asked),
        "reprefill_ttft_ms": (session.reprefill or {}).get("ttft_ms"),
        "reprefill_same_answer": (session.reprefill or {}).get("same_answer"),
        "total_s": total_s,
        "answer_total_s": sum(q.answer_ms for q in asked) / 1000,
        "decode_s": decode_s,
        "load_s": load_s,
        "window": snap["window"],
        "store": snap["store"],
    }
    report["ingest_s"] = total_s - decode_s - report["answer_total_s"]
    if args.compare:
        report.update(_reencode_pass(args, sampling, session, asked))
        report["speedup_total"] = report["reencode_total_s"] / total_s
        report["speedup_answers"] = report["reencode_total_s"] / max(report["answer_total_s"], 1e-9)
        report.update(question_rate(report, len(asked)))
    return report


def question_rate(report: dict[str, Any], n_questions: int) -> dict[str, Any]:
    """How the session compares with re-encoding as questions get more frequent.

    Both ways decode the same stream (``decode_s``). The session then pays ``ingest_s`` once
    (every distinct frame encoded and prefilled) and ``a`` per question; re-encoding pays ``r``
    per question (its window's frames encoded and prefilled again). From the measured ``a`` and
    ``r`` at this window size: ``break_even_questions``, the question count at which the session
    is the faster of the two, and ``questions_for_5x``, the count at which it is 5x faster, both
    with decoding counted on each side (None when per-question costs never get there).
    """
    d, ingest = report["decode_s"], max(report["ingest_s"], 0.0)
    a = report["answer_total_s"] / max(n_questions, 1)
    r = report["reencode_total_s"] / max(n_questions, 1)
    with_decode = report.get("reencode_with_decode_s", d + report["reencode_total_s"])
    out: dict[str, Any] = {
        "reencode_with_decode_s": with_decode,
        "speedup_total_with_decode": with_decode / max(report["total_s"], 1e-9),
        "answer_s_per_question": a,
        "reencode_s_per_question": r,
    }
    out["break_even_questions"] = math.ceil(ingest / (r - a)) if r > a else None
    out["questions_for_5x"] = math.ceil((4 * d + 5 * ingest) / (r - 5 * a)) if r > 5 * a else None
    return out


def _reencode_pass(
    args: argparse.Namespace, sampling: SamplingConfig, session: VideoSession, asked: list[Asked]
) -> dict[str, Any]:
    """Re-encoding, timed as a tool without the cache would run: the stream decoded again, and
    each question answered when its time comes, from scratch on the window the session gave it
    (its frames preprocessed then, the vision encoder run on each). Only the frames some window
    holds are kept, each until the last question that needs it."""
    from tools.video import iter_frames

    wanted: dict[float, int] = {}
    for q in asked:
        for t in q.frame_times:
            wanted[t] = wanted.get(t, 0) + 1
    images: dict[float, Any] = {}
    pending = sorted(asked, key=lambda q: math.inf if q.at is None else q.at)

    def answer(q: Asked) -> None:
        session.reencode_one(q, images)
        for t in q.frame_times:
            wanted[t] -= 1
            if not wanted[t]:
                images.pop(t, None)

    t0 = time.perf_counter()
    decode_s = 0.0
    frames = iter_frames(args.video, sampling)
    while True:
        t_decode = time.perf_counter()
        frame = next(frames, None)
        if frame is None:
            break
        image = frame.to_pil() if frame.timestamp in wanted else None
        decode_s += time.perf_counter() - t_decode
        while pending and pending[0].at is not None and pending[0].at < frame.timestamp:
            answer(pending.pop(0))
        if image is not None:
            images[frame.timestamp] = image
    while pending:
        answer(pending.pop(0))
    out = session.reencode(asked)
    out["reencode_with_decode_s"] = time.perf_counter() - t0
    out["reencode_decode_s"] = decode_s
    return out


def _answer(session: VideoSession, q: Asked, now: float) -> float:
    """Answer ``q``; returns the seconds spent on the re-prefill measurement (not on answering)."""
    had = session.reprefill is not None
    t0 = time.perf_counter()
    session.answer(q, now)
    if had or session.reprefill is None:
        return 0.0
    return (time.perf_counter() - t0) - q.answer_ms / 1000


def spans(times: Sequence[float]) -> str:
    """Timestamps for people: runs of three or more at the sampling step become ``a-b (n)``."""
    if not times:
        return "none"
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    step = min(gaps, default=0.0) * 1.5  # sampled timestamps jitter around the step
    runs: list[list[float]] = [[times[0]]]
    for t in times[1:]:
        if 0 < t - runs[-1][-1] <= step:
            runs[-1].append(t)
        else:
            runs.append([t])
    parts = []
    for run in runs:
        if len(run) >= 3:
            parts.append(f"{clock(run[0])}-{clock(run[-1])} ({len(run)})")
        else:
            parts += [clock(t) for t in run]
    return ", ".join(parts)


def print_report(report: dict[str, Any], width: int = 80) -> None:
    """The answers and the session's figures, wrapped to ``width`` columns (80: any terminal, any log)."""

    def say(text: str, indent: str = "") -> None:
        print(textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "  "))

    for q in report["questions"]:
        times = spans(q["frame_times"])
        say(f"[{clock(q['asked_at_s'])}] Q: {q['question']}")
        expected = q.get("expected")
        mark = ""
        if expected is not None:
            mark = "  (right)" if q["answer"] == expected else f"  (expected {expected!r})"
        say(f"A: {q['answer']!r}{mark}", "  ")
        say(f"frames at {times}; ttft {q['ttft_ms']:.0f} ms", "  ")
    line = (
        f"{report['frames_sampled']} frames sampled ({report['distinct_frames']} distinct), "
        f"{report['vision_encoder_calls']} vision encoder calls, {report['tokens_reused']} tokens reused, "
        f"total {report['total_s']:.1f} s"
    )
    if report.get("reprefill_ttft_ms") is not None:
        line += f"; re-prefill ttft {report['reprefill_ttft_ms']:.0f} ms"
    if "reencode_total_s" in report:
        line += f"; re-encoding every question {report['reencode_total_s']:.1f} s"
    say(line)
    if report.get("with_expected"):
        line = f"{report['correct']} of {report['with_expected']} answers right"
        if "reencode_correct" in report:
            line += f" (re-encoding every window: {report['reencode_correct']})"
        say(line)


def main(argv: Sequence[str] | None = None) -> int:
    from tools.video import VideoError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its message
        return int(e.code or 0)
    try:
        report = run(args)
    except (VideoError, UsageError, ModelNotFoundError, UnsupportedModelError) as e:
        print(f"kamera video-qa: error: {e}", file=sys.stderr)
        return 2
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
