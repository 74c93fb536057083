"""``kamera bench video-stream``: an agent watching a long video through a sliding window, asked
every few seconds, now and then about something that left the window minutes earlier; its
answers and times against re-encoding each question's window.

The stream is world episodes back to back at 1 fps (``tools/world/render.py``, written as a video
and decoded once, as ``kamera world-video`` does), ingested eagerly: every frame enters the
window as it arrives (vision encoder once per distinct frame, prefill in context), the oldest
slide out to the store. Questions come every ``--every`` seconds (``video_stream_plan.py``):
recent ones about the last episode seen, look-back ones about an episode minutes old. Each is
answered by the session (:class:`~demos.video_session.VideoSession`: no encoder call for a frame
seen before; evicted frames recalled from the store, or prefilled again from cached features
where the reuse mode needs KV a fresh prefill computes) and by re-encoding its window
(``video_stream_run.py``); the answers are compared token for token and with the renderer's.

Models: ``world`` (the trained world model, ``tools/world/world_vl``, in its labelled layout, a
prompt of ``--prompt-frames`` frames ending on the question's episode), ``world-long`` (the same
trained further on prompts of up to 48 frames, ``tools/world/world_vl_long``), ``3b`` / ``7b``
(random-weight Qwen2.5-VL at the published widths cut to ``--vision-blocks`` and ``--layers``,
timed per block and scaled to the real depth; a prompt over the whole window, one token decoded,
its answers meaningless, so only times and encoder calls count), ``tiny`` (for tests).

    kamera bench video-stream --model world --split test --json stream_world.json
    kamera bench video-stream --model 3b --frame-size 224 --episodes 20 --json stream_3b.json

Not here: GPUs, real weights of the 3B and 7B, audio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agent.adapters.loading import WORLD_VL, WORLD_VL_LONG, load_adapter
from agent.adapters.qwen_vl_widths import PUBLISHED, block_groups, build
from agent.byte_tokenizer import ByteTokenizer
from bench.block_timer import BlockClock, Timer
from bench.video_costs import context_cache
from bench.video_stream_plan import Schedule, StreamQuestion, plan
from bench.video_stream_report import print_run, print_summary, summarize
from bench.video_stream_run import Meter, play, session_args
from demos.video_session import SYSTEM_PROMPT, VideoSession
from demos.vl_model import load_vl_adapter
from tools.world import WORLD_VL_DIR, WORLD_VL_LONG_DIR
from tools.world.render import WorldConfig, make_split, write_video

# the trained world models, in their labelled layout: the shipped one and the one trained on long windows
WORLD_MODELS = {
    "world": (WORLD_VL, WORLD_VL_DIR, "kamera train-demo-model"),
    "world-long": (
        WORLD_VL_LONG,
        WORLD_VL_LONG_DIR,
        'the two runs of kamera train-demo-model in docs/world_model.md, "Long windows",',
    ),
}
MODELS = (*WORLD_MODELS, "tiny", *PUBLISHED)


class ShowIds(ByteTokenizer):
    """The byte tokenizer, writing every id outside the bytes as ``<id>``: a random-weight model's
    answers compared as text are then compared token for token."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(bytes([i - 4]).decode("latin-1") if 4 <= i < 260 else f"<{i}>" for i in ids)


def load(args: argparse.Namespace) -> tuple[Any, dict[str, int], dict[str, int]]:
    """The adapter, its measured block counts and the real depth they stand for."""
    if args.model in WORLD_MODELS:
        name, folder, how = WORLD_MODELS[args.model]
        if not any(folder.glob("*.safetensors")):
            raise SystemExit(f"{folder} holds no weights ({how} makes them)")
        adapter: Any = load_adapter(name)
        real = None
    elif args.model == "tiny":
        adapter, real = load_vl_adapter("tiny"), None
        adapter.tokenizer = ShowIds()
    else:
        widths = PUBLISHED[args.model]
        adapter, real = build(widths.cut(args.vision_blocks, args.layers)), widths.depths
        adapter.tokenizer = ShowIds()
    measured = {kind: len(blocks) for kind, blocks in block_groups(adapter).items()}
    return adapter, measured, dict(real or measured)


def stream(args: argparse.Namespace, adapter: Any, folder: Path) -> tuple[list[tuple[Any, float]], list[Any]]:
    """The episodes written as a video and decoded at 1 fps within the model's pixel bounds."""
    from tools.video import SamplingConfig, iter_frames

    size = 56 if args.model in WORLD_MODELS else args.frame_size
    episodes = make_split(args.split, args.episodes, WorldConfig(size=size), start=args.start)
    path = write_video(episodes, folder / "stream.mp4", fps=1)
    lo, hi = adapter.pixel_bounds()
    frames = [
        (f.to_pil(), f.timestamp)
        for f in iter_frames(path, SamplingConfig(fps=1, min_pixels=lo, max_pixels=hi))
    ]
    return frames, episodes


def held_frames(args: argparse.Namespace, questions: Sequence[StreamQuestion], labelled: bool) -> int:
    """The most frames the window holds: ``--window``; twice that on a re-anchored window, and a
    look-back's episode after it in the chat layout."""
    if args.window_policy == "slide":
        return int(args.window)
    episode = 0 if labelled else max((int(q.frames[1] - q.frames[0]) + 1 for q in questions), default=0)
    return 2 * args.window + episode


def budget_for(
    adapter: Any, frame: Any, questions: Sequence[StreamQuestion], args: argparse.Namespace, labelled: bool
) -> int:
    """Tokens for the system prompt, ``--window`` frames (twice that on a re-anchored window, and
    a look-back's episode after it in the chat layout; with their labels in the labelled layout),
    the longest question and its answer."""
    from agent.engine.chat import ChatML
    from demos.video_session import LabelledFrames

    chat = LabelledFrames() if labelled else ChatML()
    tok = adapter.tokenizer

    def n(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    frames = max(held_frames(args, questions, labelled), args.prompt_frames if labelled else 0)
    labels = sum(n(f"frame {k}") for k in range(1, frames + 1)) if labelled else 0
    question = max(n(chat.instruction(q.text)) for q in questions)
    return (
        n(chat.system(SYSTEM_PROMPT))
        + frames * adapter.image(frame).n_tokens
        + labels
        + question
        + args.max_new_tokens
    )


def decode_step_s(adapter: Any, frame: Any, window: int, real: dict[str, int]) -> float:
    """One decode step after ``window`` frames of KV (``video-costs``' unit), at the real depth."""
    timer = Timer(adapter, real, repeats=5)
    try:
        cache, tokens, start = context_cache(adapter, frame, window)

        def drop() -> None:
            cache.crop(tokens - adapter.cache_length(cache))

        return timer.unit(lambda: adapter.decode_step(0, cache, start), drop).scaled_s
    finally:
        timer.clock.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter, measured, real = load(args)
    labelled = args.model in WORLD_MODELS
    schedule = Schedule(args.every, args.lookback_every, args.back, args.back_cycles, args.prompt_frames)
    with tempfile.TemporaryDirectory() as tmp:
        frames, episodes = stream(args, adapter, Path(tmp))
    questions = plan(episodes, schedule)
    budget = budget_for(adapter, frames[0][0], questions, args, labelled)
    anchor = args.window if args.window_policy == "anchor" else None
    held = held_frames(args, questions, labelled)
    runs = []
    for mode in args.reuse_modes:
        clock = BlockClock(block_groups(adapter))
        try:
            meter = Meter(clock, measured, real)
            session = VideoSession(
                adapter.fresh(),  # each run encodes its own stream: no features carried over
                session_args(
                    budget=budget,
                    reuse_mode=mode,
                    layout="labelled" if labelled else "chat",
                    frames_per_question=args.prompt_frames if labelled else held,
                    max_new_tokens=args.max_new_tokens,
                ),
                anchor=anchor,
            )
            print(
                f"{args.model} / {mode} / {args.window_policy}: {len(frames)} frames, "
                f"{len(questions)} questions",
                file=sys.stderr,
            )
            rows = play(session, frames, questions, meter, args.window)
            runs.append(summarize(session, meter, rows, mode, args))
            runs[-1]["reanchors"] = session.reanchors
            print_run(runs[-1], file=sys.stderr)
        finally:
            clock.close()
    decode_s = decode_step_s(adapter, adapter.image(frames[0][0]), args.window, real)
    for r in runs:  # per frame at ingest, against one decode step after the window
        r["decode_step_s"] = decode_s
        r["proportions"] = {
            "encode": r["encode_s_per_frame"] / decode_s,
            "prefill": r["prefill_s_per_frame"] / decode_s,
            "decode": 1.0,
        }
    return {
        "benchmark": "video-stream",
        "command": "kamera bench video-stream " + " ".join(args.argv),
        "model": args.model,
        "model_name": adapter.info.name,
        "measured_depth": measured,
        "real_depth": real,
        "scaled": measured != real,
        "split": args.split,
        "episodes": args.episodes,
        "frames": len(frames),
        "frame_size": list(frames[0][0].size),
        "window_frames": args.window,
        "window_policy": args.window_policy,
        "budget_tokens": budget,
        "prompt_frames": args.prompt_frames if labelled else held,  # chat: the window, at most
        "every_s": args.every,
        "lookback_every": args.lookback_every,
        "torch_threads": torch.get_num_threads(),
        "runs": runs,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kamera bench video-stream", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="world")
    p.add_argument("--split", choices=("train", "val", "test"), default="test")
    p.add_argument("--episodes", type=int, default=100, help="6-frame episodes back to back (100: 10 min)")
    p.add_argument("--start", type=int, default=0, help="first episode index in the split")
    p.add_argument("--window", type=int, default=32, help="frames the window holds (32)")
    p.add_argument(
        "--window-policy",
        choices=("anchor", "slide"),
        default="anchor",
        help="anchor: the window grows from --window to twice that, then its newest --window frames "
        "are prefilled again once; slide: the oldest frames slide out, 8 at a time (anchor)",
    )
    p.add_argument("--every", type=int, default=6, help="seconds between questions (6)")
    p.add_argument("--lookback-every", type=int, default=4, help="every n-th question looks back (4)")
    p.add_argument("--back", type=int, default=60, help="a look-back reaches this far back, s (60)")
    p.add_argument("--back-cycles", type=int, default=5, help="look-backs reach 1..n times --back (5)")
    p.add_argument("--prompt-frames", type=int, default=6, help="world model: frames a prompt holds (6)")
    p.add_argument("--reuse-modes", default="exact,repair", help="runs, one per reuse mode (exact,repair)")
    p.add_argument("--frame-size", type=int, default=224, help="random-weight models: frame side, px (224)")
    p.add_argument("--vision-blocks", type=int, default=2, help="3b/7b: vision blocks kept (2)")
    p.add_argument("--layers", type=int, default=2, help="3b/7b: LLM layers kept (2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="world 8; others 1 (one token timed)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    args.reuse_modes = [m for m in args.reuse_modes.split(",") if m]
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.model in WORLD_MODELS else 1
    bad = [m for m in args.reuse_modes if m not in ("exact", "repair", "fast")]
    if bad or min(args.episodes, args.window, args.every, args.prompt_frames, args.max_new_tokens) <= 0:
        parser.error(f"unknown reuse modes {bad}" if bad else "sizes and counts must be > 0")
    report = run(args)
    print_summary(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
