"""Output policies: how a model's text becomes what the agent does. Chosen by name.

``text``: the answer itself, stripped. ``action``: one web action in a small grammar, one per
reply (the first line that parses wins)::

    click(x, y)        type("text")       press("Enter")     scroll(dx, dy)
    goto("https://...")  back()           done("answer")

Coordinates are integers in screenshot pixels. Strings are double-quoted with JSON escapes. An
unparseable reply becomes :class:`Unparsed` (with the reason), never an exception.

A policy may also give a grammar (Lark, for ``agent.grammar``) that its replies are decoded
under: :meth:`ActionPolicy.grammar` is the action grammar, so a model decoded under it always
writes one parseable action. Its strings are printable ASCII without quotes or backslashes and
at most ``max_tokens - 8`` characters, integers at most four digits without leading zeros: every
action it allows fits in ``max_tokens`` tokens (a token is at least one character), so the budget
never cuts one short.
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

    def grammar(self, max_tokens: int) -> str | None:
        """The Lark grammar replies are decoded under, or None for free text."""
        ...


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
MIN_ACTION_TOKENS = 20  # the longest action without strings: click(-9999, -9999)
_INT = "/-?(0|[1-9][0-9]{0,3})/"
_STRING = '/"[ !#-\\[\\]-~]{0,%d}"/'  # printable ASCII but '"' and '\\'


def action_grammar(max_tokens: int) -> str:
    """Lark for exactly one action of :data:`VERBS` that fits in ``max_tokens`` tokens."""
    if max_tokens < MIN_ACTION_TOKENS:
        raise ValueError(f"an action needs up to {MIN_ACTION_TOKENS} tokens, max_tokens is {max_tokens}")
    arg = {int: "int", str: "str"}
    rules = [f"start: {' | '.join(VERBS)}"]
    for verb, types in VERBS.items():
        args = ' ", " '.join(arg[t] for t in types)
        rules.append(f'{verb}: "{verb}(" {args} ")"' if args else f'{verb}: "{verb}()"')
    rules += [f"int: {_INT}", f"str: {_STRING % (max_tokens - 8)}"]
    return "\n".join(rules) + "\n"


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

    def grammar(self, max_tokens: int) -> None:
        return None


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

    def grammar(self, max_tokens: int) -> str:
        return action_grammar(max_tokens)


POLICIES: dict[str, Callable[[], Policy]] = {"text": lambda: TextPolicy(), "action": lambda: ActionPolicy()}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()
