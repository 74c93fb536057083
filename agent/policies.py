"""Output policies: how a model's text becomes what the agent does. Chosen by name.

``text``: the answer itself, stripped. ``action``: one web action in a small grammar, one per
reply (the first line that parses wins)::

    click(x, y)        type("text")       press("Enter")     scroll(dx, dy)
    goto("https://...")  back()           done("answer")

Coordinates are integers in screenshot pixels. Strings are double-quoted with JSON escapes. An
unparseable reply becomes :class:`Unparsed` (with the reason), never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    def parse(self, output: str) -> Any: ...


@dataclass(frozen=True)
class Action:
    """One browser action: ``kind`` is a grammar verb, ``args`` its arguments in order."""

    kind: str
    args: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(json.dumps(a) for a in self.args)})"


@dataclass(frozen=True)
class Unparsed:
    output: str
    reason: str


VERBS: dict[str, tuple[type, ...]] = {
    "click": (int, int),
    "type": (str,),
    "press": (str,),
    "scroll": (int, int),
    "goto": (str,),
    "back": (),
    "done": (str,),
}
_CALL = re.compile(r"\b(" + "|".join(VERBS) + r")\s*\((.*)\)\s*$")


def parse_action(line: str) -> Action:
    """Parse one action line; ``ValueError`` says what is wrong."""
    m = _CALL.search(line.strip())
    if m is None:
        raise ValueError(f"no action of {sorted(VERBS)} in {line.strip()[:80]!r}")
    verb, body = m.group(1), m.group(2).strip()
    try:
        args = json.loads(f"[{body}]") if body else []
    except json.JSONDecodeError as e:
        raise ValueError(f"bad arguments for {verb}: {body[:60]!r} ({e.msg})") from None
    want = VERBS[verb]
    if len(args) != len(want) or not all(
        isinstance(a, t) and not (t is int and isinstance(a, bool)) for a, t in zip(args, want, strict=False)
    ):
        names = ", ".join(t.__name__ for t in want)
        raise ValueError(f"{verb} takes ({names}), got {body[:60]!r}")
    return Action(verb, tuple(args))


@dataclass(frozen=True)
class TextPolicy:
    name: str = "text"

    def parse(self, output: str) -> str:
        return output.strip()


@dataclass(frozen=True)
class ActionPolicy:
    name: str = "action"

    def parse(self, output: str) -> Action | Unparsed:
        reasons = []
        for line in output.strip().splitlines() or [""]:
            try:
                return parse_action(line)
            except ValueError as e:
                reasons.append(str(e))
        return Unparsed(output, reasons[0] if reasons else "empty output")


POLICIES: dict[str, Callable[[], Policy]] = {"text": lambda: TextPolicy(), "action": lambda: ActionPolicy()}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()
