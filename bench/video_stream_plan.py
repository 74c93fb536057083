"""The stream of ``kamera bench video-stream``: world episodes back to back at 1 fps, and the
questions asked of it every few seconds, with their right answers from the renderer.

A question is asked half a frame before second ``at`` (every ``every_s`` seconds), so it sees
the frames ``0 .. at - 1``. Most are *recent*: about the last episode whose frames have all
arrived (in the window). Every ``lookback_every``-th is a *look-back*: about an episode that
ended ``back_s`` seconds or more earlier (left the window long since); the distance cycles
through ``back_s``, ``2 back_s``, ... ``back_cycles back_s``, each cut to what the stream has
seen. A question's prompt holds ``prompt_frames`` frames ending on its episode's last frame (the
episode's own frames when it is the episode's length); its ``frame k`` words are renumbered to
count within that prompt.

Not here: running a model (``video_stream.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tools.world.render import Episode, renumber

Kind = Literal["recent", "look-back"]


@dataclass(frozen=True)
class StreamQuestion:
    """One question of the stream. ``frames``: the first and last timestamp (s) of the frames its
    prompt holds, inclusive; ``episode``: the index of the episode it is about."""

    index: int
    at: float
    text: str
    expected: str
    kind: Kind
    episode: int
    template: str
    frames: tuple[float, float]


@dataclass(frozen=True)
class Schedule:
    """When and what to ask. Seconds are frames at 1 fps."""

    every_s: int = 6
    lookback_every: int = 4
    back_s: int = 60
    back_cycles: int = 5
    prompt_frames: int = 6

    def __post_init__(self) -> None:
        if min(self.every_s, self.lookback_every, self.back_s, self.back_cycles, self.prompt_frames) <= 0:
            raise ValueError("every_s, lookback_every, back_s, back_cycles and prompt_frames must be > 0")


def plan(episodes: list[Episode], schedule: Schedule) -> list[StreamQuestion]:
    """The stream's questions in time order (module doc). Episodes must be of one length."""
    n = len(episodes[0].frames)
    if any(len(ep.frames) != n for ep in episodes):
        raise ValueError("every episode must have the same number of frames")
    total = n * len(episodes)
    out: list[StreamQuestion] = []
    lookbacks = 0
    for at in range(schedule.every_s, total + 1, schedule.every_s):
        recent = at // n - 1  # the last episode whose frames have all arrived
        if recent < 0:
            continue
        episode, kind = recent, "recent"
        if (len(out) + 1) % schedule.lookback_every == 0:
            back = schedule.back_s * (1 + lookbacks % schedule.back_cycles)
            target = (at - back) // n - 1  # the last episode that ended at least ``back`` s ago
            if target >= 0:
                episode, kind = target, "look-back"
                lookbacks += 1
        last = (episode + 1) * n - 1
        first = max(0, last - schedule.prompt_frames + 1)
        ep = episodes[episode]
        q = ep.questions[(at // schedule.every_s) % len(ep.questions)]  # templates taken in turn
        offset = last - n + 1 - first  # frames of the prompt before the episode's first
        out.append(
            StreamQuestion(
                index=len(out),
                at=at - 0.5,
                text=renumber(q.text, offset),
                expected=q.answer,
                kind=kind,  # type: ignore[arg-type]
                episode=episode,
                template=q.template,
                frames=(float(first), float(last)),
            )
        )
    return out
