"""A small synthetic video world with single-hop and multi-hop questions.

An episode is a short video (``n_frames`` frames of ``size`` x ``size`` pixels). Each frame shows
one to three objects on a 2 x 2 grid of slots; an object has a shape, a colour and a digit drawn on
it in seven-segment strokes. Between consecutive frames exactly one event happens: a new object
appears, an object moves to a free slot, or an object changes colour. Digits never change.

Questions come in two kinds:

- ``single``: answerable from one frame ("what colour is the star in frame 3 ?").
- ``multi``: binding across frames ("which shape moved last ?", "what colour was the square when
  the star appeared ?", "what digit is on the shape that moved last ?").

Answers are single words from a small vocabulary (:data:`ANSWER_WORDS`). Everything is seeded:
the same split and index give the same episode on every machine (no fonts, no global RNG).

What this module does *not* do: tokenise, run a model, or sample frames from arbitrary videos.
It renders the world and writes it to a video file; the training script and the demos consume it.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 40, 40),
    "green": (40, 190, 60),
    "blue": (70, 120, 255),
    "yellow": (240, 220, 40),
    "purple": (175, 80, 225),
}
DIGITS: tuple[str, ...] = ("1", "2", "3", "4", "5", "6")
SLOTS: tuple[str, ...] = ("top-left", "top-right", "bottom-left", "bottom-right")
COUNTS: tuple[str, ...] = ("one", "two", "three")
ANSWER_WORDS: tuple[str, ...] = (*SHAPES, *COLOURS, *DIGITS, *SLOTS, *COUNTS)

SINGLE_TEMPLATES: tuple[str, ...] = ("colour_at", "digit_at", "shape_at", "count_at")
MULTI_TEMPLATES: tuple[str, ...] = (
    "moved_last",
    "digit_moved_last",
    "colour_before_change",
    "where_before_move",
    "colour_when_appeared",
)

SPLIT_NAMES: tuple[str, ...] = ("train", "val", "test")
BACKGROUND = (36, 36, 40)
MAX_OBJECTS = 3

Kind = Literal["single", "multi"]


@dataclass(frozen=True)
class WorldConfig:
    """How episodes are drawn.

    ``size`` must be a multiple of 28 (patch 14 x spatial merge 2) so that a frame maps to whole
    merged vision tokens. The default 56 px gives a 2 x 2 grid of 4 tokens, one per slot, which
    keeps training on a CPU short; 112 px gives 16 tokens, 2 x 2 per slot.
    """

    n_frames: int = 6
    size: int = 56
    jitter: int = 1
    p_appear: float = 0.3
    p_move: float = 0.35
    p_recolour: float = 0.35

    def __post_init__(self) -> None:
        if self.n_frames < 2:
            raise ValueError(f"n_frames must be >= 2, got {self.n_frames}")
        if self.size < 56 or self.size % 28:
            raise ValueError(f"size must be a multiple of 28 and >= 56, got {self.size}")
        if not 0 <= self.jitter <= self.size // 16:
            raise ValueError(f"jitter must be in [0, size/16], got {self.jitter}")
        if min(self.p_appear, self.p_move, self.p_recolour) < 0 or (
            self.p_appear + self.p_move + self.p_recolour <= 0
        ):
            raise ValueError("event probabilities must be >= 0 with a positive sum")


@dataclass(frozen=True)
class ObjectState:
    """One object as shown in one frame."""

    shape: str
    colour: str
    digit: str
    slot: str


@dataclass(frozen=True)
class Event:
    """What changed between frame ``frame - 1`` and frame ``frame`` (1-based frame numbers)."""

    frame: int
    kind: Literal["appear", "move", "recolour"]
    shape: str
    before: str | None  # previous colour or slot; None for "appear"
    after: str  # new colour, new slot, or (for "appear") the slot it appeared in


@dataclass(frozen=True)
class Question:
    """A question with its one-word answer and the 1-based frames holding the evidence."""

    text: str
    answer: str
    kind: Kind
    frames_needed: tuple[int, ...]
    template: str


@dataclass
class Episode:
    """A rendered video and its questions; ``states[i]`` is what frame ``i + 1`` shows."""

    frames: list[Image.Image]
    questions: list[Question]
    states: list[tuple[ObjectState, ...]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    seed: str = ""


# --------------------------------------------------------------------------- simulation


def _simulate(cfg: WorldConfig, rng: random.Random) -> tuple[list[tuple[ObjectState, ...]], list[Event]]:
    shapes = list(SHAPES)
    rng.shuffle(shapes)
    digits = list(DIGITS)
    rng.shuffle(digits)
    n0 = rng.choice((1, 2))
    slots = rng.sample(SLOTS, n0)
    colours = rng.sample(list(COLOURS), n0)
    objs = {shapes[i]: ObjectState(shapes[i], colours[i], digits[i], slots[i]) for i in range(n0)}
    states = [tuple(objs.values())]
    events: list[Event] = []
    for frame in range(2, cfg.n_frames + 1):
        free_slots = [s for s in SLOTS if s not in {o.slot for o in objs.values()}]
        free_colours = [c for c in COLOURS if c not in {o.colour for o in objs.values()}]
        kinds = ["move", "recolour"]
        weights = [cfg.p_move, cfg.p_recolour]
        if len(objs) < MAX_OBJECTS:
            kinds.append("appear")
            weights.append(cfg.p_appear)
        kind = rng.choices(kinds, weights)[0]
        if kind == "appear":
            shape = shapes[len(objs)]
            new = ObjectState(shape, rng.choice(free_colours), digits[len(objs)], rng.choice(free_slots))
            objs[shape] = new
            events.append(Event(frame, "appear", shape, None, new.slot))
        else:
            shape = rng.choice(sorted(objs))
            old = objs[shape]
            if kind == "move":
                slot = rng.choice(free_slots)
                objs[shape] = ObjectState(shape, old.colour, old.digit, slot)
                events.append(Event(frame, "move", shape, old.slot, slot))
            else:
                colour = rng.choice(free_colours)
                objs[shape] = ObjectState(shape, colour, old.digit, old.slot)
                events.append(Event(frame, "recolour", shape, old.colour, colour))
        states.append(tuple(objs.values()))
    return states, events


# --------------------------------------------------------------------------- rendering


def _seven_segment(draw: ImageDraw.ImageDraw, digit: str, cx: float, cy: float, h: float) -> None:
    """Draw ``digit`` centred at (cx, cy), ``h`` pixels tall, in black strokes."""
    segs = {
        "1": "bc", "2": "abged", "3": "abgcd", "4": "fgbc", "5": "afgcd", "6": "afgedc",
        "7": "abc", "8": "abcdefg", "9": "abcdfg", "0": "abcdef",
    }  # fmt: skip
    w = h * 0.55
    x0, x1 = cx - w / 2, cx + w / 2
    y0, y1, y2 = cy - h / 2, cy, cy + h / 2
    lines = {
        "a": ((x0, y0), (x1, y0)),
        "b": ((x1, y0), (x1, y1)),
        "c": ((x1, y1), (x1, y2)),
        "d": ((x0, y2), (x1, y2)),
        "e": ((x0, y1), (x0, y2)),
        "f": ((x0, y0), (x0, y1)),
        "g": ((x0, y1), (x1, y1)),
    }
    width = max(2, round(h / 7))
    for s in segs[digit]:
        draw.line(lines[s], fill=(0, 0, 0), width=width)


def _draw_object(draw: ImageDraw.ImageDraw, obj: ObjectState, cx: float, cy: float, r: float) -> None:
    fill = COLOURS[obj.colour]
    digit_cy = cy
    if obj.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif obj.shape == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
        digit_cy = cy + r * 0.3
    else:  # star
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.5
            ang = -math.pi / 2 + i * math.pi / 5
            pts.append((cx + rad * math.cos(ang), cy + rad * math.sin(ang)))
        draw.polygon(pts, fill=fill)
        digit_cy = cy + r * 0.05
    _seven_segment(draw, obj.digit, cx, digit_cy, r * 0.7)


def render_frame(
    objects: tuple[ObjectState, ...], cfg: WorldConfig, rng: random.Random | None = None
) -> Image.Image:
    """Render one frame; ``rng`` adds a small per-object position jitter (none when omitted)."""
    img = Image.new("RGB", (cfg.size, cfg.size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    half = cfg.size / 2
    r = half * 0.42
    for obj in objects:
        col, row = SLOTS.index(obj.slot) % 2, SLOTS.index(obj.slot) // 2
        cx, cy = half * (col + 0.5), half * (row + 0.5)
        if rng is not None and cfg.jitter:
            cx += rng.randint(-cfg.jitter, cfg.jitter)
            cy += rng.randint(-cfg.jitter, cfg.jitter)
        _draw_object(draw, obj, cx, cy, r)
    return img


# --------------------------------------------------------------------------- questions


def _find(state: tuple[ObjectState, ...], shape: str) -> ObjectState | None:
    return next((o for o in state if o.shape == shape), None)


def _single_questions(states: list[tuple[ObjectState, ...]], rng: random.Random) -> list[Question]:
    out = []
    for template in SINGLE_TEMPLATES:
        k = rng.randint(1, len(states))
        state = states[k - 1]
        obj = rng.choice(state)
        if template == "colour_at":
            text, answer = f"what colour is the {obj.shape} in frame {k} ?", obj.colour
        elif template == "digit_at":
            text, answer = f"what digit is on the {obj.shape} in frame {k} ?", obj.digit
        elif template == "shape_at":
            text, answer = f"what shape is at the {obj.slot} in frame {k} ?", obj.shape
        else:
            text, answer = f"how many objects are in frame {k} ?", COUNTS[len(state) - 1]
        out.append(Question(text, answer, "single", (k,), template))
    return out


def _multi_questions(
    states: list[tuple[ObjectState, ...]], events: list[Event], rng: random.Random
) -> list[Question]:
    out = []
    moves = [e for e in events if e.kind == "move"]
    if moves:
        last = moves[-1]
        frames = (last.frame - 1, last.frame)
        out.append(Question("which shape moved last ?", last.shape, "multi", frames, "moved_last"))
        digit = _find(states[last.frame - 1], last.shape)
        if digit is not None:
            out.append(
                Question(
                    "what digit is on the shape that moved last ?",
                    digit.digit,
                    "multi",
                    frames,
                    "digit_moved_last",
                )
            )
    by_shape: dict[tuple[str, str], list[Event]] = {}
    for e in events:
        by_shape.setdefault((e.kind, e.shape), []).append(e)
    once = [evs[0] for (kind, _), evs in by_shape.items() if kind == "recolour" and len(evs) == 1]
    if once:
        e = rng.choice(once)
        out.append(
            Question(
                f"what colour was the {e.shape} before it changed colour ?",
                str(e.before),
                "multi",
                (e.frame - 1, e.frame),
                "colour_before_change",
            )
        )
    once = [evs[0] for (kind, _), evs in by_shape.items() if kind == "move" and len(evs) == 1]
    if once:
        e = rng.choice(once)
        out.append(
            Question(
                f"where was the {e.shape} before it moved ?",
                str(e.before),
                "multi",
                (e.frame - 1, e.frame),
                "where_before_move",
            )
        )
    pairs = [(e, o) for e in events if e.kind == "appear" for o in states[e.frame - 1] if o.shape != e.shape]
    if pairs:
        e, o = rng.choice(pairs)
        out.append(
            Question(
                f"what colour was the {o.shape} when the {e.shape} appeared ?",
                o.colour,
                "multi",
                (e.frame - 1, e.frame),
                "colour_when_appeared",
            )
        )
    return out


# --------------------------------------------------------------------------- public API


def episode_seed(split: str, index: int) -> str:
    """The seed string of episode ``index`` of ``split``; splits never share a seed."""
    if split not in SPLIT_NAMES:
        raise ValueError(f"split must be one of {SPLIT_NAMES}, got {split!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return f"kamera-world/{split}/{index}"


def make_episode(seed: str | int, cfg: WorldConfig | None = None) -> Episode:
    """Simulate, render and question one episode; the same seed always gives the same episode."""
    cfg = cfg or WorldConfig()
    rng = random.Random(f"{seed}")
    states, events = _simulate(cfg, rng)
    frames = [render_frame(state, cfg, rng) for state in states]
    questions = _single_questions(states, rng) + _multi_questions(states, events, rng)
    return Episode(frames=frames, questions=questions, states=states, events=events, seed=str(seed))


_FRAME_WORD = re.compile(r"\bframe (\d+)\b")


def renumber(text: str, offset: int) -> str:
    """``frame k`` as ``frame k + offset``: an episode's frame k is frame k + offset of a prompt
    holding ``offset`` frames before the episode."""
    return _FRAME_WORD.sub(lambda m: f"frame {int(m.group(1)) + offset}", text)


def after_frames(episode: Episode, before: Sequence[Episode], n: int) -> Episode:
    """``episode`` shown after the last ``n`` frames of ``before`` played back to back, as one
    longer prompt: what a video stream's window holds when a question about ``episode`` comes.

    The result's frames, states and events cover the whole prompt, numbered within it; its
    questions are ``episode``'s, their ``frame k`` renumbered (multi-hop questions still ask
    about ``episode``, the prompt's last frames). ``before`` must hold at least ``n`` frames.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    frames = [f for ep in before for f in ep.frames]
    states = [s for ep in before for s in ep.states]
    if n > len(frames):
        raise ValueError(f"{n} frames asked for, but the episodes before hold {len(frames)}")
    frames, states = frames[len(frames) - n :], states[len(states) - n :]
    questions = [
        replace(q, text=renumber(q.text, n), frames_needed=tuple(k + n for k in q.frames_needed))
        for q in episode.questions
    ]
    return Episode(
        frames=[*frames, *episode.frames],
        questions=questions,
        states=[*states, *episode.states],
        events=[replace(e, frame=e.frame + n) for e in episode.events],
        seed=f"{episode.seed}+{n}",
    )


def make_split(split: str, n: int, cfg: WorldConfig | None = None, start: int = 0) -> list[Episode]:
    """Episodes ``start .. start + n - 1`` of ``split`` (``train``, ``val`` or ``test``)."""
    return [make_episode(episode_seed(split, i), cfg) for i in range(start, start + n)]


def write_video(
    episodes: Episode | list[Episode], path: str | Path, fps: int = 1, codec: str = "mpeg4"
) -> Path:
    """Write the frames of one episode, or of several back to back, as a video file.

    Frame ``i`` (0-based, over the whole concatenation) is shown at ``i / fps`` seconds, so with
    the default 1 fps a frame's timestamp in seconds is its index. ``codec`` is any PyAV encoder
    that takes yuv420p (``mpeg4`` and ``libx264`` are built into the wheel).
    """
    import av  # optional dependency: kamera[video]

    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    eps = [episodes] if isinstance(episodes, Episode) else list(episodes)
    frames = [f for ep in eps for f in ep.frames]
    if not frames:
        raise ValueError("no frames to write")
    path = Path(path)
    width, height = frames[0].size
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        if not isinstance(stream, av.VideoStream):
            raise ValueError(f"{codec!r} is not a video encoder")
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        if codec == "mpeg4":
            stream.options = {"qscale": "2"}
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_image(img.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def questions_for_video(
    episodes: list[Episode], fps: int = 1, per_episode: int | None = None
) -> list[dict[str, object]]:
    """The questions of episodes written back to back by :func:`write_video`, each asked half a
    frame before the next episode starts (so its window ends on the episode's last frame):
    ``{"question", "at", "answer", "kind", "template", "episode"}``. ``per_episode`` keeps that
    many per episode, templates taken in turn across episodes."""
    out: list[dict[str, object]] = []
    for e, ep in enumerate(episodes):
        qs = list(ep.questions)
        if per_episode is not None:
            shift = (e * per_episode) % max(1, len(qs))
            qs = (qs[shift:] + qs[:shift])[:per_episode]
        at = ((e + 1) * len(ep.frames) - 0.5) / fps
        out += [
            {
                "question": q.text,
                "at": at,
                "answer": q.answer,
                "kind": q.kind,
                "template": q.template,
                "episode": e,
            }
            for q in qs
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    """``kamera world-video OUT``: a video of world episodes and its questions with their answers."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="kamera world-video", description=main.__doc__)
    p.add_argument("out", type=Path, help="the video file to write (.mp4)")
    p.add_argument("--episodes", type=int, default=3, help="episodes back to back (3)")
    p.add_argument("--split", choices=SPLIT_NAMES, default="test")
    p.add_argument("--start", type=int, default=0, help="first episode index in the split")
    p.add_argument("--fps", type=int, default=1)
    p.add_argument("--per-episode", type=int, default=None, help="questions kept per episode (all)")
    p.add_argument(
        "--questions", type=Path, default=None, help="where to write the questions (OUT with .json)"
    )
    a = p.parse_args(argv)
    if a.episodes < 1 or a.start < 0 or a.fps < 1 or (a.per_episode is not None and a.per_episode < 1):
        p.error("--episodes, --fps and --per-episode must be >= 1 and --start >= 0")
    episodes = make_split(a.split, a.episodes, start=a.start)
    write_video(episodes, a.out, fps=a.fps)
    questions = questions_for_video(episodes, a.fps, a.per_episode)
    qpath = a.questions or a.out.with_suffix(".json")
    qpath.write_text(json.dumps(questions, indent=1) + "\n")
    n_frames = sum(len(ep.frames) for ep in episodes)
    print(f"wrote {a.out} ({n_frames} frames, {n_frames / a.fps:.0f} s), {len(questions)} questions: {qpath}")
    return 0
