"""Tests of agent/tables: tables drawn where they fit, folded where they do not, plain when piped."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from agent.tables import PLAIN_WIDTH, fold, make_console, print_table, wanted_width


def wide_table(n_columns: int = 10) -> Table:
    t = Table(title="each reuse mode against a full prefill")
    for i in range(n_columns):
        t.add_column(f"column number {i}")
    t.add_row(*(f"value {i}" for i in range(n_columns)))
    t.add_row(*(f"other {i}" for i in range(n_columns)))
    return t


def narrow_table() -> Table:
    t = Table(title="small")
    t.add_column("mode")
    t.add_column("ms", justify="right")
    t.add_row("exact", "12")
    t.add_row("repair", "7")
    return t


def render(table: Table, width: int, tty: bool = False) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, no_color=not tty, force_terminal=tty)
    print_table(console, table)
    return out.getvalue()


def test_a_piped_console_is_plain_and_wide() -> None:
    console = make_console(file=io.StringIO())
    assert console.width == PLAIN_WIDTH
    assert console.no_color
    assert console.color_system is None


def test_a_table_that_fits_is_drawn_as_a_table() -> None:
    text = render(narrow_table(), 80)
    assert "| mode" in text  # plain rules, not box drawing, when piped
    assert "exact" in text
    assert "repair" in text
    assert "─" not in text


def test_a_wide_table_is_folded_with_every_cell_whole() -> None:
    table = wide_table()
    assert wanted_width(table) > 80
    text = render(table, 80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    for i in range(10):
        assert f"value {i}" in text
        assert f"other {i}" in text
    assert lines[0] == "each reuse mode against a full prefill"
    assert lines[1] == "- column number 0: value 0"
    assert lines[2].split() == ["column", "number", "1", "value", "1"]


def test_fold_lists_every_row_under_its_first_cell() -> None:
    lines = fold(narrow_table())
    assert lines == ["small", "- mode: exact", "    ms  12", "- mode: repair", "    ms  7"]


def test_a_wide_terminal_draws_what_a_narrow_one_folds() -> None:
    table = wide_table()
    assert "┃" in render(table, 220, tty=True) or "│" in render(table, 220, tty=True)
    assert render(table, 80, tty=True).startswith("each reuse mode")
