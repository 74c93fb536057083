"""The ``kamera`` command: a dispatcher over the subcommands the package declares.

The command table is the ``kamera.commands`` entry-point group of ``pyproject.toml``: a name and
the ``module:function`` that runs it (``main(argv) -> int``). This module names no command, so
the runtime does not depend on the products built on it. A subcommand is imported only when it
runs; its help line is the first sentence of that function's docstring (else its module's),
read from the source without importing it, so ``kamera --help`` stays fast and a missing
optional extra (server, video, browser) only affects the command that needs it.

Where the table comes from: a source checkout (``pyproject.toml`` beside the package, as in an
editable install) reads it from that file, which is what the installed metadata was built from
and may be newer; an installed wheel reads the metadata.

Not here: any command's options (each parses its own ``argv``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import sys
import textwrap
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

GROUP = "kamera.commands"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


class Command(NamedTuple):
    """One subcommand: its name and the ``module:function`` that runs it."""

    name: str
    module: str
    function: str

    @classmethod
    def parse(cls, name: str, value: str) -> Command:
        module, sep, function = value.strip().partition(":")
        if not sep or not module or not function:
            raise ValueError(f"command {name!r}: {value!r} is not 'module:function'")
        return cls(name, module, function)


def from_pyproject(path: Path) -> dict[str, Command]:
    """The ``kamera.commands`` table of a ``pyproject.toml``; empty when it declares none."""
    project = tomllib.loads(path.read_text()).get("project", {})
    table: Mapping[str, str] = project.get("entry-points", {}).get(GROUP, {})
    return {name: Command.parse(name, value) for name, value in table.items()}


def from_metadata() -> dict[str, Command]:
    """The ``kamera.commands`` entry points of the installed distributions."""
    return {ep.name: Command.parse(ep.name, ep.value) for ep in importlib.metadata.entry_points(group=GROUP)}


def commands() -> dict[str, Command]:
    """Name -> command, sorted by name: from the checkout's ``pyproject.toml``, else installed."""
    found = from_pyproject(PYPROJECT) if PYPROJECT.is_file() else {}
    found = found or from_metadata()
    return dict(sorted(found.items()))


def summary(command: Command) -> str:
    """The first sentence of the function's docstring (else the module's), without importing
    it; a leading ``kamera NAME ...:`` is dropped. Empty when there is no docstring."""
    spec = importlib.util.find_spec(command.module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return ""
    tree = ast.parse(Path(spec.origin).read_text())
    function = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == command.function), None
    )
    doc = (ast.get_docstring(function) if function is not None else None) or ast.get_docstring(tree) or ""
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
    if text.startswith("kamera ") and ": " in text:
        text = text.split(": ", 1)[1]
    sentence = text.split(". ", 1)[0]
    return sentence.removesuffix(".")


def usage(table: Mapping[str, Command]) -> str:
    width = max(map(len, table), default=0)
    lines = ["usage: kamera COMMAND [ARGS...]", "", "commands:"]
    for name, command in table.items():
        wrapped = textwrap.wrap(summary(command), 96 - width) or [""]
        lines.append(f"  {name.ljust(width)}  {wrapped[0]}")
        lines += [f"  {'':{width}}  {more}" for more in wrapped[1:]]
    lines += ["", "Run 'kamera COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    table = commands()
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(table))
        return 0
    name, rest = args[0], args[1:]
    if name not in table:
        print(f"kamera: unknown command {name!r}\n\n{usage(table)}", file=sys.stderr)
        return 2
    command = table[name]
    code: int = getattr(importlib.import_module(command.module), command.function)(rest)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
