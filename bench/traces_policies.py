"""Context policies: how an agent's context manager rewrites each request of a session.

A policy maps ``(request, step)`` to the message list actually sent: ``append`` (everything),
``window-N`` (the system prompt and the last N turns), ``dynamic-system`` (a system header whose
clock changes every step), ``mask-observations-N`` (tool output older than N turns replaced by a
placeholder), ``rerank`` (the last tool output's passages in another order). Chosen by name from
:data:`POLICIES` with :func:`get_policy`, which hands its ``seed`` to the policies that draw
(``rerank``): the same seed, the same messages.

Not here: loading sessions (``traces_data.py``), tokenizing (``traces_tokens.py``), replaying
(``traces_replay.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from datetime import datetime, timedelta
from typing import Protocol

import numpy as np

from bench.traces_data import Message


def is_observation(m: Message) -> bool:
    return m.get("role") == "tool" or m.get("observation") is True or m.get("message_type") == "observation"


def turn_starts(messages: Sequence[Message]) -> list[int]:
    """Index where each turn starts: the first non-system message, then every assistant one.

    A turn is one model call and what came back from it (tool results, the user's reply).
    """
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    return [first, *(i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > first)]


class Policy(Protocol):
    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]: ...


@dataclass(frozen=True)
class Append:
    """The raw conversation."""

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        return list(messages)


@dataclass(frozen=True)
class Window:
    """System messages pinned, then only the last ``n`` turns."""

    n: int

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        starts = turn_starts(messages)
        keep_from = starts[max(0, len(starts) - self.n)] if starts else len(messages)
        pinned = [m for m in messages[: starts[0] if starts else len(messages)] if m.get("role") == "system"]
        return pinned + list(messages[keep_from:])


@dataclass(frozen=True)
class DynamicSystem:
    """A timestamp and step counter at the top of the system prompt, new on every request."""

    start: str = "2024-05-15T15:00:00"
    seconds_per_step: int = 37

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        now = datetime.fromisoformat(self.start) + timedelta(seconds=self.seconds_per_step * step)
        header = f"Current time: {now:%Y-%m-%d %H:%M:%S}. Step {step}.\n\n"
        out = list(messages)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": header + str(out[0].get("content") or "")}
        else:
            out.insert(0, {"role": "system", "content": header.rstrip()})
        return out


@dataclass(frozen=True)
class MaskObservations:
    """Observations older than the last ``n`` turns replaced by a one-line stub."""

    n: int

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        starts = turn_starts(messages)
        cutoff = starts[max(0, len(starts) - self.n)] if starts else 0
        out = []
        for i, m in enumerate(messages):
            if i < cutoff and is_observation(m):
                lines = str(m.get("content") or "").count("\n") + 1
                m = {**m, "content": f"[output omitted: {lines} lines]"}
            out.append(m)
        return out


@dataclass(frozen=True)
class Rerank:
    """Observations (tool output, retrieved text) shuffled among their slots, seeded per step."""

    seed: int = 0

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        out = list(messages)
        slots = [i for i, m in enumerate(out) if is_observation(m)]
        order = np.random.default_rng([self.seed, step]).permutation(len(slots))
        moved = [out[slots[j]] for j in order]
        for i, m in zip(slots, moved, strict=True):
            out[i] = m
        return out


POLICIES: dict[str, Callable[..., Policy]] = {
    "append": Append,
    "window": Window,
    "dynamic-system": DynamicSystem,
    "mask-observations": MaskObservations,
    "rerank": Rerank,
}


DEFAULT_SEED = 0


def get_policy(name: str, seed: int = DEFAULT_SEED) -> Policy:
    """A policy by name; a trailing ``-N`` is its integer parameter (``window-6``). ``seed`` goes
    to the policies that draw anything (``rerank``); the others ignore it."""
    m = re.fullmatch(r"(.+?)-(\d+)", name)
    base, arg = (m.group(1), int(m.group(2))) if m and m.group(1) in POLICIES else (name, None)
    if base not in POLICIES:
        raise KeyError(f"unknown policy {name!r}; known: {sorted(POLICIES)} (some take -N)")
    cls = POLICIES[base]
    draws = is_dataclass(cls) and "seed" in {f.name for f in fields(cls)}
    kw = {"seed": seed} if draws else {}
    return cls(**kw) if arg is None else cls(arg, **kw)
