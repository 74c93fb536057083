"""Tests for the ``kamera`` dispatcher: the command table comes from the package's entry points."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent import cli

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"bench", "demo", "serve", "store", "train-demo-model", "video-qa", "web-agent", "world-video"}


def test_pyproject_declares_every_command() -> None:
    table = cli.from_pyproject(ROOT / "pyproject.toml")
    assert set(table) == EXPECTED
    for command in table.values():  # each names a function that exists, found without importing it
        spec = importlib.util.find_spec(command.module)
        assert spec is not None, command
        assert spec.origin is not None, command
        tree = ast.parse(Path(spec.origin).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == command.function for n in tree.body), command


def test_every_command_has_a_help_line() -> None:
    text = cli.usage(cli.commands())
    for name, command in cli.commands().items():
        assert name in text
        assert cli.summary(command), name
    assert "answer questions over a long video whose frames slide through the window" in text


def test_installed_metadata_is_read_when_there_is_no_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [SimpleNamespace(name="video-qa", value="demos.video_qa:main")]
    monkeypatch.setattr(
        cli.importlib.metadata, "entry_points", lambda group: eps if group == cli.GROUP else []
    )
    monkeypatch.setattr(cli, "PYPROJECT", ROOT / "no-such-pyproject.toml")
    assert cli.commands() == {"video-qa": cli.Command("video-qa", "demos.video_qa", "main")}


def test_a_malformed_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="module:function"):
        cli.Command.parse("x", "demos.video_qa")


def test_dispatch_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--help"]) == 0
    assert "relocation" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli.main([]) == 0


def test_agent_names_no_demo_or_benchmark() -> None:
    """The runtime imports neither the products nor the benchmarks, also not by string or path."""
    pattern = re.compile(r"\b(demos|bench)[./]\w")
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in sorted((ROOT / "agent").rglob("*"))
        if path.suffix in (".py", ".md", ".json", ".jinja")
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_serve_defaults_are_the_prompt_caches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kamera serve`` spells its defaults out (its parser imports no torch); they are the
    prompt cache's own, and each ``KAMERA_*`` variable sets its flag."""
    from agent.engine.prompt_cache import PromptCacheConfig
    from agent.server import cli as serve_cli

    fields = (
        "mode",
        "repair_ratio",
        "repair_max_ratio",
        "repair_margin",
        "repair_residual_unit",
        "repair_margin_cap",
        "repair_must_pay",
    )
    got = serve_cli.build_config(serve_cli.parser().parse_args([])).prompt_cache
    assert {f: getattr(got, f) for f in fields} == {f: getattr(PromptCacheConfig(), f) for f in fields}
    monkeypatch.setenv("KAMERA_REPAIR_MAX_RATIO", "0.4")
    assert serve_cli.build_config(serve_cli.parser().parse_args([])).prompt_cache.repair_max_ratio == 0.4
    off = serve_cli.build_config(serve_cli.parser().parse_args(["--no-repair-must-pay"])).prompt_cache
    assert off.repair_must_pay is False
    monkeypatch.setenv("KAMERA_REPAIR_MUST_PAY", "off")
    assert serve_cli.build_config(serve_cli.parser().parse_args([])).prompt_cache.repair_must_pay is False
    on = serve_cli.build_config(serve_cli.parser().parse_args(["--repair-must-pay"])).prompt_cache
    assert on.repair_must_pay is True
    # a variable that is not a number is the flag's usage error, not a traceback
    monkeypatch.setenv("KAMERA_REPAIR_RATIO", "abc")
    with pytest.raises(SystemExit) as exc:
        serve_cli.parser().parse_args([])
    assert exc.value.code == 2
    assert "--repair-ratio: invalid float value: 'abc'" in capsys.readouterr().err
