"""The import table of ``docs/ARCHITECTURE.md`` ("Who may import whom"), checked on the code.

Every ``import x`` and ``from x import y`` in every module under agent/, cache/, tools/, demos/
and bench/ is read with ``ast`` (at the top of the module and inside functions alike; relative
imports resolved against the module's package), and each one the table forbids fails the test,
named by file and line. ``from pkg import name`` counts as an import of ``pkg.name`` where that is
a module of ours.

Not here: circles between modules of one folder, and tests/ (which may import anything).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("agent", "cache", "tools", "demos", "bench")

# What each room may import of ours: the longest prefix that matches the imported module decides
# (True: allowed, False: forbidden); a module no prefix matches is forbidden.
MAY_IMPORT: dict[str, dict[str, bool]] = {
    "cache": {"cache": True},
    "tools": {"tools": True},
    "agent/adapters": {"agent.adapters": True, "cache": True, "tools.world": True},
    "agent/engine": {"agent": True, "agent.server": False, "cache": True, "tools": True},
    "agent/server": {"agent": True, "cache": True, "tools": True},
    "agent": {"agent": True, "agent.server": False, "cache": True},
    # products call the engine; the HTTP server is for clients, reached as a process
    "demos": {"demos": True, "agent": True, "agent.server": False, "cache": True, "tools": True},
    # measurements run the products as users run them (video QA's session, say)
    "bench": {
        "bench": True,
        "demos": True,
        "agent": True,
        "agent.server": False,
        "cache": True,
        "tools": True,
    },
}

# Outside libraries that only some folders may import.
ONLY_IN: dict[str, tuple[str, ...]] = {
    "transformers": ("agent/adapters/", "tools/world/"),
    "fastapi": ("agent/server/",),
    "starlette": ("agent/server/",),
    "uvicorn": ("agent/server/",),
}


class Import(NamedTuple):
    path: str  # relative to the root, with "/"
    line: int
    module: str  # absolute dotted name


def room(path: str) -> str:
    """The row of the table a module (``path`` relative to the root) falls under."""
    parts = path.split("/")
    if parts[0] == "agent" and len(parts) > 2 and parts[1] in ("adapters", "engine", "server"):
        return f"agent/{parts[1]}"
    return parts[0]


def _is_our_module(root: Path, dotted: str) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(root: Path, path: Path) -> Iterator[Import]:
    """Every import statement of the module at ``path``, anywhere in it, as absolute modules."""
    rel = path.relative_to(root).as_posix()
    package = rel.split("/")[:-1]  # a module's package; for __init__.py the package itself
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(rel, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    raise ValueError(f"{rel}:{node.lineno}: relative import beyond the top of the tree")
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                yield Import(rel, node.lineno, sub if _is_our_module(root, sub) else module)


def _decision(rules: dict[str, bool], module: str) -> bool:
    best, allowed = -1, False
    for prefix, ok in rules.items():
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
            best, allowed = len(prefix), ok
    return allowed


def violation(imp: Import) -> str | None:
    """Why ``imp`` breaks the table, or None."""
    top = imp.module.split(".")[0]
    where = room(imp.path)
    if top in FOLDERS:
        if _decision(MAY_IMPORT[where], imp.module):
            return None
        allowed = ", ".join(p for p, ok in MAY_IMPORT[where].items() if ok)
        return f"{imp.path}:{imp.line}: {where}/ imports {imp.module} (it may import {allowed})"
    if top in ONLY_IN and not imp.path.startswith(ONLY_IN[top]):
        return f"{imp.path}:{imp.line}: {where}/ imports {top} (only {', '.join(ONLY_IN[top])} may)"
    return None


def violations(root: Path) -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            found.extend(v for imp in imports(root, path) if (v := violation(imp)) is not None)
    return found


def test_every_import_follows_the_table() -> None:
    bad = violations(ROOT)
    assert not bad, "imports that break docs/ARCHITECTURE.md's table:\n" + "\n".join(bad)


def test_the_check_names_each_forbidden_import(tmp_path: Path) -> None:
    files = {
        "cache/__init__.py": "",
        "cache/store/__init__.py": "from .entry import Entry\n",
        "cache/store/entry.py": "def load():\n    from ..keys import key\n    from agent.context import x\n",
        "cache/keys.py": "",
        "agent/__init__.py": "",
        "agent/context.py": "from agent import server\n",
        "agent/server/__init__.py": "",
        "agent/engine/generation.py": "import fastapi\n",
        "agent/engine/runtime.py": "from agent.server.app import create_app\n",
        "agent/loop.py": "from agent.engine.generation import decode\n",
        "agent/grammar.py": "def f():\n    import transformers\n",
        "agent/adapters/__init__.py": "",
        "agent/adapters/decoder.py": "from transformers import DynamicCache\nfrom agent.loop import x\n",
        "bench/__init__.py": "",
        "bench/run.py": "from demos import video_qa\nimport uvicorn\nfrom agent.server import app\n",
        "demos/__init__.py": "",
        "demos/video_qa.py": "from bench import consistency\n",
        "tools/world/model.py": "import transformers\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = violations(tmp_path)
    assert sorted(b.split(" (")[0] for b in bad) == [
        "agent/adapters/decoder.py:2: agent/adapters/ imports agent.loop",
        "agent/context.py:1: agent/ imports agent.server",
        "agent/engine/generation.py:1: agent/engine/ imports fastapi",
        "agent/engine/runtime.py:1: agent/engine/ imports agent.server.app",
        "agent/grammar.py:2: agent/ imports transformers",
        "bench/run.py:2: bench/ imports uvicorn",
        "bench/run.py:3: bench/ imports agent.server",
        "cache/store/entry.py:3: cache/ imports agent.context",
        "demos/video_qa.py:1: demos/ imports bench",
    ]
