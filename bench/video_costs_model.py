"""The cost model of ``kamera bench video-costs``: times measured on a cut model scaled to the real
depth, and per-unit times turned into a streaming agent's time to first token, with frames' KV
reused or with the frames encoded and prefilled again.

Pure functions of seconds; nothing here runs a model.

Not here: the measurements (``video_costs.py``), the tables (``video_costs_report.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


def scale_to_depth(
    total_s: float, block_s: Mapping[str, float], measured: Mapping[str, int], real: Mapping[str, int]
) -> float:
    """A run's seconds at the real depth: ``total_s`` less the time inside the blocks
    (``block_s``: seconds per kind, over ``measured[kind]`` blocks), plus each kind's mean block
    time times ``real[kind]``. Raises ValueError when a kind the real model has was not measured."""
    scaled = total_s - sum(block_s.values())
    for kind, count in real.items():
        if count == 0:
            continue
        if measured.get(kind, 0) <= 0:
            raise ValueError(f"no {kind} block was measured to stand for the real {count}")
        scaled += block_s.get(kind, 0.0) / measured[kind] * count
    return scaled


def interpolate(points: Mapping[int, float], x: float) -> float:
    """The piecewise-linear function through ``points`` at ``x`` (end segments extended)."""
    xs = sorted(points)
    if len(xs) < 2:
        raise ValueError("interpolation needs two points")
    i = next((j for j in range(1, len(xs)) if x <= xs[j]), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def slope(points: Mapping[int, float]) -> float:
    """Least-squares slope of ``points`` (y against x)."""
    if len(points) < 2:
        raise ValueError("a slope needs two points")
    n = len(points)
    mx = sum(points) / n
    my = sum(points.values()) / n
    return sum((x - mx) * (y - my) for x, y in points.items()) / sum((x - mx) ** 2 for x in points)


class PassModel(NamedTuple):
    """One forward pass over n frames on an empty cache: ``n * per_frame_s`` for everything a
    frame's tokens cost by themselves, plus ``per_pair_s`` for each (frame, earlier frame) pair
    its attention reads."""

    per_frame_s: float
    per_pair_s: float

    def seconds(self, frames: int) -> float:
        return frames * self.per_frame_s + self.per_pair_s * frames * (frames - 1) / 2

    @classmethod
    def fit(cls, pass_s: float, frames: int, prefill_at: Mapping[int, float]) -> PassModel:
        """From one measured pass over ``frames`` frames (``pass_s``) and a single frame's
        prefill by the frames already in the cache (``prefill_at``), whose slope is what one
        more frame of context costs (taken as 0 when noise makes it negative)."""
        per_pair = max(slope(prefill_at), 0.0)
        return cls((pass_s - per_pair * frames * (frames - 1) / 2) / frames, per_pair)


class Ttft(NamedTuple):
    """Modelled seconds to the first token of a question over ``window`` frames and a new one."""

    window: int
    reuse_s: float
    reencode_s: float

    @property
    def speedup(self) -> float:
        return self.reencode_s / self.reuse_s


def modelled_ttft(
    encode_s: float,
    encode_in_batch_s: float,
    prefill_at: Mapping[int, float],
    one_pass: PassModel,
    question_s: float,
    window: int,
) -> Ttft:
    """Reuse: the ``window`` frames' KV is in the cache; the new frame is encoded alone
    (``encode_s``) and prefilled after them (``prefill_at``, by frames in the cache), then the
    question (``question_s``, after ``window`` + 1 frames). Re-encoding: the ``window`` + 1
    frames encoded in one batch (``encode_in_batch_s`` each) and prefilled in one pass
    (``one_pass``), then the same question."""
    reuse = encode_s + interpolate(prefill_at, window) + question_s
    frames = window + 1
    return Ttft(window, reuse, frames * encode_in_batch_s + one_pass.seconds(frames) + question_s)
