"""One pass of ``kamera bench video-stream``: the stream played through a
:class:`~demos.video_session.VideoSession` (eager ingest, a window of the last W frames), each
question answered there and again by re-encoding its window, side by side.

Every span of work is timed as run and, on a model cut in depth, scaled to the real depth from
the time its blocks took (``bench/block_timer.py``'s clock, ``scale_to_depth``): the session's
ingest (preprocessing, vision encoder, prefill, slides), each question (retrieval, recall or
re-prefill from cached features, the question's pass, decoding) and each re-encoding (the window's
frames preprocessed on an adapter with no cached features, the encoder run on each, one forward
pass over frames and question, the same greedy decoding: ``full_answer``).

Not here: the stream and its questions (``video_stream_plan.py``), the command and the summary
(``video_stream.py``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agent.adapters.base import ImageInput
from agent.adapters.vision import encoder_calls
from bench.block_timer import BlockClock
from bench.video_costs_model import scale_to_depth
from bench.video_stream_plan import StreamQuestion
from demos.video_session import Asked, VideoSession, full_answer
from demos.vl_model import encode_text, fresh_adapter

VISION_KINDS = ("vision_window", "vision_full")


@dataclass(frozen=True)
class TimeSpans:
    """Retrieval by time: the frames whose timestamp lies in one of ``spans`` (inclusive), at most
    the latest ``k`` of them; what a question that says when it is about picks."""

    spans: tuple[tuple[float, float], ...]
    name: str = "span"

    def select(self, frames: Sequence[Any], k: int, question: Any) -> list[int]:
        hits = [i for i, f in enumerate(frames) if any(a <= f.t <= b for a, b in self.spans)]
        return hits[max(0, len(hits) - k) :]


@dataclass
class Meter:
    """Seconds of work as run and at the real depth, per part (``ingest``, ``answer``, ``reencode``),
    with the scaled seconds the vision and LLM blocks took in each."""

    clock: BlockClock | None
    measured_depth: Mapping[str, int]
    real_depth: Mapping[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    scaled: dict[str, float] = field(default_factory=dict)
    blocks: dict[str, dict[str, float]] = field(default_factory=dict)

    def run(self, part: str, work: Callable[[], Any]) -> tuple[Any, float, float]:
        """Run ``work`` as part ``part``: its result, seconds as run, seconds at the real depth."""
        if self.clock is not None:
            self.clock.reset()
        t0 = time.perf_counter()
        out = work()
        total = time.perf_counter() - t0
        spent = dict(self.clock.seconds) if self.clock is not None else {}
        scaled = scale_to_depth(total, spent, self.measured_depth, self.real_depth) if spent else total
        self.seconds[part] = self.seconds.get(part, 0.0) + total
        self.scaled[part] = self.scaled.get(part, 0.0) + scaled
        blocks = self.blocks.setdefault(part, {"vision": 0.0, "llm": 0.0})
        for kind, s in spent.items():
            per_block = (
                s / self.measured_depth[kind] * self.real_depth[kind] if self.measured_depth[kind] else 0
            )
            blocks["vision" if kind in VISION_KINDS else "llm"] += per_block
        return out, total, scaled


def prompt_spans(
    q: StreamQuestion, window: int, labelled: bool, first: float | None = None
) -> tuple[tuple[float, float], ...]:
    """The frames a question's prompt holds. Labelled (the world model): the plan's frames, those
    its training layout reads. Chat: the whole window, the last ``window`` frames before the
    question, with a look-back's episode in place of the oldest of them; on a re-anchored window
    (``first``: the time of the oldest frame it holds) every frame it holds, and a look-back's
    episode besides."""
    if labelled:
        return (q.frames,)
    now = q.at - 0.5  # the last frame that has arrived
    if first is not None:
        return ((first, now),) if q.kind == "recent" else (q.frames, (first, now))
    if q.kind == "recent":
        return ((now - window + 1, now),)
    episode = q.frames[1] - q.frames[0] + 1
    return (q.frames, (now - window + episode + 1, now))


def reencode(session: VideoSession, asked: Asked, images: Mapping[float, Any]) -> tuple[float, str, int]:
    """``asked`` answered from scratch on the window the session gave it, as a tool without the
    cache would: the frames preprocessed and encoded on an adapter with no cached features, one
    forward pass over the system prompt, frames and question, greedy decoding. Returns the time to
    the first token (s), the answer and the encoder runs."""
    t0 = time.perf_counter()
    fresh = fresh_adapter(session.adapter)
    times = iter(asked.frame_times)
    chunks: list[Any] = [encode_text(fresh, session.chat.system(session.args.system))]
    for cid in asked.window_ids:
        chunk = session.inputs[cid]
        chunks.append(fresh.image(images[next(times)]) if isinstance(chunk, ImageInput) else chunk)  # type: ignore[attr-defined]
    prepared = time.perf_counter() - t0
    ttft_ms, answer = full_answer(
        fresh, chunks, session.agent.prompt(asked.question), session.args.max_new_tokens
    )
    return prepared + ttft_ms / 1000, answer.strip(), encoder_calls(fresh)


def play(
    session: VideoSession,
    frames: Sequence[tuple[Any, float]],
    questions: Sequence[StreamQuestion],
    meter: Meter,
    window: int,
) -> list[dict[str, Any]]:
    """The stream through ``session``, each question answered when its time comes and then
    re-encoded; one row per question."""
    images = {t: image for image, t in frames}
    labelled = session.labelled
    session.reprefill = {}  # video-qa's first-question re-prefill: not measured here
    pending = list(questions)
    rows: list[dict[str, Any]] = []
    adapter = session.adapter
    for image, t in [*frames, (None, float("inf"))]:
        while pending and pending[0].at < t:
            q = pending.pop(0)
            meter.run("ingest", session.flush)  # every frame that has arrived is in the window
            held = [float(v.meta["t"]) for v in session.cm.view() if v.kind == "frame"]
            first = min(held, default=None) if session.anchor is not None else None
            session.retrieval = TimeSpans(prompt_spans(q, window, labelled, first))
            asked = Asked(q.index, q.text, q.at, q.expected)
            calls = encoder_calls(adapter)
            _, run_s, scaled_s = meter.run("answer", partial(session.answer, asked, q.at))
            calls = encoder_calls(adapter) - calls
            # every block ran before the first token when one token is decoded; otherwise (the
            # world model, run at its own depth) nothing is scaled
            ttft = asked.ttft_ms / 1000 + (scaled_s - run_s)
            (base_ttft, base_answer, base_calls), base_run_s, base_scaled_s = meter.run(
                "reencode", partial(reencode, session, asked, images)
            )
            base_ttft += base_scaled_s - base_run_s
            rows.append(row(q, asked, ttft, run_s, base_ttft, base_answer, calls, base_calls))
        if image is not None:
            meter.run("ingest", partial(session.add_frame, image, t))
    return rows


def row(
    q: StreamQuestion,
    asked: Asked,
    ttft_s: float,
    run_s: float,
    base_ttft_s: float,
    base_answer: str,
    calls: int,
    base_calls: int,
) -> dict[str, Any]:
    step = asked.report
    frames = len(asked.frame_times)
    return {
        "index": q.index,
        "at_s": q.at,
        "kind": q.kind,
        "episode": q.episode,
        "template": q.template,
        "question": q.text,
        "frames": frames,
        "frame_span": [min(asked.frame_times, default=0.0), max(asked.frame_times, default=0.0)],
        "recalled": len(asked.recalled_times),
        "reused_chunks": asked.exact_chunks,
        "tokens_prefilled": step.get("tokens_prefilled"),
        "tokens_rotated": step.get("tokens_rotated"),
        "served": step.get("served"),
        "ttft_ms": 1000 * ttft_s,
        "ttft_ms_as_run": asked.ttft_ms,
        "answer_ms_as_run": 1000 * run_s,
        "baseline_ttft_ms": 1000 * base_ttft_s,
        "ttft_ratio": base_ttft_s / max(ttft_s, 1e-9),
        "answer": asked.answer,
        "baseline_answer": base_answer,
        "expected": q.expected,
        "same_as_baseline": asked.answer == base_answer,
        "right": asked.answer == q.expected,
        "baseline_right": base_answer == q.expected,
        "encoder_calls": calls,
        "baseline_encoder_calls": base_calls,
    }


def session_args(
    *, budget: int, reuse_mode: str, layout: str, frames_per_question: int, max_new_tokens: int
) -> argparse.Namespace:
    """What :class:`VideoSession` reads: eager ingest, retrieval set per question."""
    from demos.video_qa import build_parser

    args = build_parser().parse_args(["-"])
    args.budget, args.reuse_mode, args.layout = budget, reuse_mode, layout
    args.ingest, args.frames_per_question, args.max_new_tokens = "eager", frames_per_question, max_new_tokens
    args.retrieval = "recent"  # replaced by the question's time spans before each question
    return args
