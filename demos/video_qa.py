"""``kamera video-qa``: answer questions over a long video whose frames slide through the window.

The video plays once, front to back. Each sampled frame is preprocessed, run through the vision
encoder once (the adapter caches features by content) and appended to the window as its own
chunk, with its timestamp; the context manager slides the oldest frames out when the token
budget is reached (survivors rotate, evicted frames go to the store with their canonical KV and
patch). A question asked at a time (``--at``) or at the end picks the frames it needs with a
retrieval strategy (``demos/retrieval.py``) and brings back the evicted ones with
``ContextManager.recall``: no vision encoder, no prefill of the frame. Only the question and the
answer are prefilled.

Two baselines are measured in the same run: ``reprefill_ttft_ms``, a full prefill of the first
question's window (vision features cached, so the LLM prefill alone), and with ``--compare``
``reencode_total_s``, every question answered from scratch on its window (vision encoder
included, on an adapter with an empty feature cache).

Not here: audio, seeking (the stream is decoded front to back), several videos in one window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter, TextInput
from agent.adapters.loading import ModelNotFoundError, UnsupportedModelError, load_adapter
from agent.adapters.qwen_vl import QwenVLAdapter
from agent.adapters.vision import VisionAdapter, encoder_calls
from agent.context import ContextManager, WindowConfig
from agent.loop import Agent, ChatML
from agent.models import WORLD_VL_DIR
from demos.retrieval import RETRIEVALS, FrameRecord, make_retrieval

SYSTEM_PROMPT = "You are a helpful assistant."
TINY = "tiny"
# FFmpeg renders any text file as ANSI-art video through its tty demuxer; that is not a video.
TEXT_FORMATS = frozenset({"tty"})


class UsageError(ValueError):
    """A command-line value that cannot work (bad time, budget too small for one frame)."""


# --------------------------------------------------------------------------- models


class ByteTokenizer:
    """UTF-8 bytes as token ids, for the random-weight test model (which ships no tokenizer).

    Ids: 0 ``<|endoftext|>``, 1 ``<|im_end|>`` (the tiny model's end token), 2 ``<|im_start|>``,
    3..258 the bytes. The tiny model's vision ids (508..511) are never produced from text.
    """

    SPECIAL: ClassVar[dict[str, int]] = {"<|endoftext|>": 0, "<|im_end|>": 1, "<|im_start|>": 2}
    _SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL) + ")")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        ids: list[int] = []
        for part in self._SPLIT.split(text):
            ids += [self.SPECIAL[part]] if part in self.SPECIAL else [3 + b for b in part.encode()]
        return {"input_ids": ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


def default_model_dir() -> Path:
    """``agent/models/world_vl`` when it holds weights; otherwise a clear error."""
    if any(WORLD_VL_DIR.glob("*.safetensors")) and (WORLD_VL_DIR / "config.json").is_file():
        return WORLD_VL_DIR
    raise ModelNotFoundError(
        f"no --model given and {WORLD_VL_DIR} holds no weights yet (train it with "
        "'kamera train-demo-model'); pass --model PATH to a Qwen2.5-VL checkpoint folder, "
        f"or --model {TINY} for a random-weight test model"
    )


def load_vl_adapter(model: str | None) -> ModelAdapter:
    """A vision-language adapter: a checkpoint folder, the default world model, or ``tiny``."""
    spec = model if model == TINY else str(default_model_dir() if model is None else model)
    adapter = load_adapter(spec, tokenizer=ByteTokenizer())
    if not isinstance(adapter, VisionAdapter):
        raise UnsupportedModelError(f"{adapter.info.name} ({adapter.info.architecture}) takes no images")
    return adapter


def fresh_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """The same weights behind a new adapter: an empty vision feature cache, its own counters."""
    if not isinstance(adapter, VisionAdapter):
        raise TypeError(f"no fresh copy for {type(adapter).__name__}")
    return adapter.fresh()


def encode_text(adapter: ModelAdapter, text: str) -> TextInput:
    return adapter.text(adapter.tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- questions


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


@dataclass
class Asked:
    index: int
    question: str
    at: float | None  # None: after the last frame
    expected: str | None = None  # the right answer, when the questions file gives it
    answer: str = ""
    ttft_ms: float = 0.0
    answer_ms: float = 0.0
    asked_at: float = 0.0
    frame_times: list[float] = field(default_factory=list)
    recalled_times: list[float] = field(default_factory=list)
    window_ids: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the session


class LabelledFrames(ChatML):
    """The embedded world model's layout: one user turn holds the frames, each after ``frame k``
    (k: its place among the question's frames, in time order), then the question.

    ``system`` opens that user turn after the system message; ``instruction`` continues it with
    the question and opens the assistant's turn.
    """

    def system(self, text: str) -> str:
        return f"<|im_start|>system\n{text}<|im_end|>\n<|im_start|>user\n"

    def instruction(self, text: str) -> str:
        return f"{text}<|im_end|>\n<|im_start|>assistant\n"


LAYOUTS = ("auto", "chat", "labelled")


class VideoSession:
    """One video played through one agent window; frames in, questions answered on demand."""

    def __init__(self, adapter: ModelAdapter, args: argparse.Namespace) -> None:
        self.adapter = adapter
        self.args = args
        self.labelled = layout_of(args) == "labelled"
        self.chat = LabelledFrames() if self.labelled else ChatML()
        self.agent = Agent(
            adapter,
            args.system,
            WindowConfig(budget_tokens=args.budget, keep=args.keep),
            policy="text",
            chat=self.chat,
            max_new_tokens=args.max_new_tokens,
            finalize=False,  # canonical KV and patches are fitted when a chunk slides out, not per answer
        )
        self.retrieval = make_retrieval(args.retrieval)
        self.frames: list[FrameRecord] = []
        self.inputs: dict[str, ChunkInput] = {}  # frames and labels by chunk id
        self.reprefill: dict[str, Any] | None = None
        self.pending: list[tuple[ImageInput, float]] = []
        self.prefix_tokens = self.cm.view()[0].n_tokens  # the pinned system prompt
        self.preprocess_s = 0.0  # the image processor's time on every frame

    @property
    def cm(self) -> ContextManager:
        return self.agent.context

    def add_frame(self, image: Any, t: float) -> None:
        """Queue a decoded frame; every ``--ingest-batch`` frames go into the window together
        (one vision encoder batch, one forward pass), and before a question."""
        t0 = time.perf_counter()
        chunk = self.adapter.image(image)  # type: ignore[attr-defined]
        self.preprocess_s += time.perf_counter() - t0
        if chunk.n_tokens + self.prefix_tokens > self.args.budget:
            raise UsageError(
                f"a frame is {chunk.n_tokens} tokens: --budget {self.args.budget} cannot hold one "
                "frame after the system prompt"
            )
        self.pending.append((chunk, t))
        if len(self.pending) >= self.args.ingest_batch:
            self.flush()

    def flush(self) -> None:
        """Put the queued frames into the window."""
        while self.pending:
            room = self.args.budget - self.prefix_tokens
            batch, tokens = [], 0
            while self.pending and tokens + self.pending[0][0].n_tokens <= room:
                tokens += self.pending[0][0].n_tokens
                batch.append(self.pending.pop(0))
            self._make_room(tokens)
            ids = self.cm.append_many([c for c, _ in batch], [{"kind": "frame", "t": t} for _, t in batch])
            for cid, (chunk, t) in zip(ids, batch, strict=True):
                self.inputs[cid] = chunk
                embedding = None
                if self.retrieval.name == "similarity":  # a hit in the feature cache: no encoder run
                    embedding = self.adapter.image_features(chunk).float().mean(0)  # type: ignore[attr-defined]
                self.frames.append(FrameRecord(cid, t, chunk.n_tokens, embedding))

    def _make_room(self, n_tokens: int) -> None:
        """Slide out at least ``--evict-batch`` chunks once the window is full: survivors are
        rotated and the live cache rebuilt once per batch rather than once per frame."""
        excess = self.cm.tokens + n_tokens - self.args.budget
        if excess <= 0:
            return
        view = self.cm.view()[1:]
        count, freed = 0, 0
        while freed < excess:
            freed += view[count].n_tokens
            count += 1
        self.cm.slide(max(count, min(self.args.evict_batch, len(view))))

    def question_embedding(self, question: str) -> torch.Tensor | None:
        if self.retrieval.name != "similarity":
            return None
        ids = encode_text(self.adapter, question).ids.to(self.adapter.device)
        with torch.inference_mode():
            emb = self.adapter.embed_ids(ids)
        return emb.float().mean(0).cpu()

    def answer(self, q: Asked, now: float) -> None:
        self.flush()  # frames already decoded are part of what the question may look at
        t0 = time.perf_counter()
        latest: dict[str, FrameRecord] = {f.chunk_id: f for f in self.frames}  # one per content
        candidates = sorted(latest.values(), key=lambda f: f.t)
        room = self.args.budget - self.prefix_tokens - self._prompt(q.question).n_tokens
        k, used = 0, 0
        for f in sorted(candidates, key=lambda f: f.n_tokens):  # how many frames fit at most
            cost = f.n_tokens + (self._label(k + 1).n_tokens if self.labelled else 0)
            if k >= self.args.frames_per_question or used + cost > room:
                break
            k, used = k + 1, used + cost
        picked = self.retrieval.select(candidates, k, self.question_embedding(q.question))
        chosen = [candidates[i] for i in picked]
        q.recalled_times = self._bring_in(chosen)
        if self.labelled:
            self._relabel(chosen)
        window = self.cm.view()[1:]
        q.frame_times = [float(v.meta["t"]) for v in window if v.kind == "frame"]
        q.window_ids = [v.chunk_id for v in window if v.kind in ("frame", "label")]
        prepare_ms = 1000 * (time.perf_counter() - t0)
        result = self.agent.step([], q.question)
        q.answer = result.output.strip()
        q.ttft_ms = prepare_ms + result.report.ttft_ms
        q.answer_ms = prepare_ms + result.report.total_ms
        q.asked_at = now
        q.report = result.as_dict()["report"]
        if self.reprefill is None:
            self.reprefill = self._measure_reprefill(q)

    def _bring_in(self, chosen: Sequence[FrameRecord]) -> list[float]:
        """Make the chosen frames present: evict unchosen chunks (oldest first) to make room, then
        recall each evicted chosen frame at its place in time. Returns the recalled timestamps."""
        ids = {f.chunk_id for f in chosen}
        present = {v.chunk_id for v in self.cm.view()}
        missing = [f for f in chosen if f.chunk_id not in present]
        need = sum(f.n_tokens for f in missing)
        while self.cm.tokens + need > self.args.budget:
            victim = next((i for i, v in enumerate(self.cm.view()) if i and v.chunk_id not in ids), None)
            if victim is None:
                break
            self.cm.slide_at(victim)
        for f in missing:
            view = self.cm.view()
            at = 1 + max(
                (i for i, v in enumerate(view) if i and v.kind == "frame" and float(v.meta["t"]) <= f.t),
                default=0,
            )
            self.cm.recall(f.chunk_id, at=at)
        return [f.t for f in missing]

    def _label(self, k: int) -> TextInput:
        return encode_text(self.adapter, f"frame {k}")

    def _relabel(self, chosen: Sequence[FrameRecord]) -> None:
        """Leave only the chosen frames in the window, each after its ``frame k`` label.

        Earlier turns and labels slide out; the labels go in as one batch after the frames and
        are then moved in front of theirs by rotation (their KV is conditioned on the frames
        before them, not on the frames' new order: the approximation the cache makes)."""
        ids = {f.chunk_id for f in chosen}
        view = self.cm.view()
        for i in range(len(view) - 1, 0, -1):
            if view[i].kind != "frame" or view[i].chunk_id not in ids:
                self.cm.slide_at(i)
        frames = [v.chunk_id for v in self.cm.view()[1:]]
        labels = [self._label(k) for k in range(1, len(frames) + 1)]
        label_ids = self.cm.append_many(labels, [{"kind": "label"} for _ in labels])
        for cid, label in zip(label_ids, labels, strict=True):
            self.inputs[cid] = label
        self.cm.reorder([c for pair in zip(label_ids, frames, strict=True) for c in pair])

    def _prefix(self) -> TextInput:
        return encode_text(self.adapter, self.chat.system(self.args.system))

    def _measure_reprefill(self, q: Asked) -> dict[str, Any]:
        """Full prefill of the same window (frames' features cached) and the question's first token."""
        chunks: list[ChunkInput] = [self._prefix(), *(self.inputs[c] for c in q.window_ids)]
        ms, answer = full_answer(self.adapter, chunks, self._prompt(q.question), self.args.max_new_tokens)
        return {"ttft_ms": ms, "answer": answer, "same_answer": answer.strip() == q.answer}

    def _prompt(self, question: str) -> TextInput:
        return encode_text(self.adapter, self.chat.instruction(question))

    def reencode(self, asked: Sequence[Asked]) -> dict[str, Any]:
        """Each question answered from scratch on its window, vision encoder included."""
        t0 = time.perf_counter()
        answers, calls = [], 0
        for q in asked:
            fresh = fresh_adapter(self.adapter)  # from scratch: no features kept between questions
            chunks: list[ChunkInput] = [self._prefix(), *(self.inputs[c] for c in q.window_ids)]
            _, answer = full_answer(fresh, chunks, self._prompt(q.question), self.args.max_new_tokens)
            answers.append(answer.strip())
            calls += encoder_calls(fresh)
        return {
            "reencode_total_s": time.perf_counter() - t0,
            "reencode_vision_encoder_calls": calls,
            "reencode_answers": answers,
            "reencode_same_answers": sum(a == q.answer for a, q in zip(answers, asked, strict=True)),
            "reencode_correct": sum(
                a == q.expected for a, q in zip(answers, asked, strict=True) if q.expected is not None
            ),
        }


def full_answer(
    adapter: ModelAdapter, chunks: Sequence[ChunkInput], prompt: TextInput, max_new_tokens: int
) -> tuple[float, str]:
    """Prefill ``chunks`` then ``prompt`` on an empty cache and decode greedily.

    Returns the time to first token in milliseconds and the answer text.
    """
    t0 = time.perf_counter()
    cache = adapter.empty_cache()
    adapter.prefill_many(chunks, cache, 0)  # one forward pass; the images in one encoder batch
    start = sum(adapter.chunk_positions(chunk)[1] for chunk in chunks)
    gen = adapter.generate(prompt, cache, start, max_new_tokens)
    ttft_ms = 1000 * (time.perf_counter() - t0) - 1000 * (gen.total_s - gen.first_token_s)
    return ttft_ms, adapter.tokenizer.decode(gen.tokens, skip_special_tokens=True)


# --------------------------------------------------------------------------- the command


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
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tools.video import NotAVideoError, SamplingConfig, iter_frames, plan_sampling, probe_video

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
    plan = plan_sampling(info, sampling)

    t0 = time.perf_counter()
    session = VideoSession(adapter, args)
    pending = sorted(asked, key=lambda q: math.inf if q.at is None else q.at)
    measured = 0.0  # time spent on the re-prefill baseline, kept out of total_s
    n_sampled, last_t = 0, 0.0
    decode_s = 0.0  # decoding, sampling and preprocessing the frames: the baseline reads them too
    console = Console(stderr=True)
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
        "budget_tokens": args.budget,
        "duration_s": info.duration_s,
        "sample_fps": plan.sample_fps,
        "frame_size": [plan.height, plan.width],
        "frames_sampled": n_sampled,
        "distinct_frames": len({f.chunk_id for f in session.frames}),
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
        report.update(session.reencode(asked))
        report["speedup_total"] = report["reencode_total_s"] / total_s
        report["speedup_answers"] = report["reencode_total_s"] / max(report["answer_total_s"], 1e-9)
        report.update(question_rate(report, len(asked)))
    return report


def layout_of(args: argparse.Namespace) -> str:
    """The prompt layout ``--layout`` asks for (``auto``: labelled on the embedded world model)."""
    if args.layout != "auto":
        return str(args.layout)
    is_world = args.model is None or Path(args.model).resolve() == Path(WORLD_VL_DIR).resolve()
    return "labelled" if is_world else "chat"


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
    out: dict[str, Any] = {
        "reencode_with_decode_s": d + report["reencode_total_s"],
        "speedup_total_with_decode": (d + report["reencode_total_s"]) / max(report["total_s"], 1e-9),
        "answer_s_per_question": a,
        "reencode_s_per_question": r,
    }
    out["break_even_questions"] = math.ceil(ingest / (r - a)) if r > a else None
    out["questions_for_5x"] = math.ceil((4 * d + 5 * ingest) / (r - 5 * a)) if r > 5 * a else None
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


def print_report(report: dict[str, Any]) -> None:
    for q in report["questions"]:
        times = spans(q["frame_times"])
        print(f"[{clock(q['asked_at_s'])}] Q: {q['question']}")
        expected = q.get("expected")
        mark = ""
        if expected is not None:
            mark = "  (right)" if q["answer"] == expected else f"  (expected {expected!r})"
        print(f"  A: {q['answer']!r}{mark}")
        print(f"  frames at {times}; ttft {q['ttft_ms']:.0f} ms")
    line = (
        f"{report['frames_sampled']} frames sampled ({report['distinct_frames']} distinct), "
        f"{report['vision_encoder_calls']} vision encoder calls, {report['tokens_reused']} tokens reused, "
        f"total {report['total_s']:.1f} s"
    )
    if report.get("reprefill_ttft_ms") is not None:
        line += f"; re-prefill ttft {report['reprefill_ttft_ms']:.0f} ms"
    if "reencode_total_s" in report:
        line += f"; re-encoding every question {report['reencode_total_s']:.1f} s"
    print(line)
    if report.get("with_expected"):
        line = f"{report['correct']} of {report['with_expected']} answers right"
        if "reencode_correct" in report:
            line += f" (re-encoding every window: {report['reencode_correct']})"
        print(line)


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
