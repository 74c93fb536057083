"""Tables that read where they land: a terminal of any width, or a piped log.

On a terminal a table is drawn at the terminal's width, with rich's boxes and colours. Piped to a
file it is drawn in plain text (no colour codes, Markdown-style rules) at ``PLAIN_WIDTH``
columns. Either way, a table whose columns cannot all keep their content on one line at that
width (each column wants its longest cell, text columns at most ``WRAP_AT`` characters) is
folded: one block per row, the first column as the block's heading and every other cell as a
``header: value`` line, so nothing is cut to a word per cell.

Not here: what a table holds (each command builds its own ``rich.table.Table``) or JSON output,
which always holds every figure.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

PLAIN_WIDTH = 100  # a piped log is read in an editor or a CI page: wide, never endless
WRAP_AT = 32  # a cell longer than this may wrap inside its column; shorter ones should not
GAP = 3  # rich's padding and rule between two columns


def make_console(stderr: bool = False, file: TextIO | None = None, plain_width: int = PLAIN_WIDTH) -> Console:
    """A console for a terminal (its own width, colours) or a plain one for a pipe or file,
    ``plain_width`` columns wide."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    if stream.isatty():
        return Console(file=stream)
    return Console(
        file=stream, width=plain_width, color_system=None, no_color=True, highlight=False, emoji=False
    )


def _plain(cell: object) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def wanted_width(table: Table) -> int:
    """Columns each at their longest cell or header (capped at ``WRAP_AT``), with the gaps."""
    total = 0
    for column in table.columns:
        cells = [_plain(column.header), *(_plain(c) for c in column.cells)]
        longest = max((len(line) for c in cells for line in c.splitlines() or [""]), default=0)
        total += min(longest, WRAP_AT) + GAP
    return total + 1


def fold(table: Table) -> list[str]:
    """The table as blocks of ``header: value`` lines, one block per row."""
    headers = [_plain(c.header) for c in table.columns]
    columns = [[_plain(cell) for cell in c.cells] for c in table.columns]
    n_rows = max((len(c) for c in columns), default=0)
    label = max((len(h) for h in headers[1:]), default=0)
    lines = [_plain(table.title)] if table.title else []
    for r in range(n_rows):
        lines.append(f"- {headers[0]}: {columns[0][r]}" if headers else "-")
        lines += [f"    {headers[i].ljust(label)}  {columns[i][r]}" for i in range(1, len(headers))]
    if table.caption:
        lines.append(_plain(table.caption))
    return lines


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` as it fits ``console``: drawn when its columns fit, folded otherwise."""
    if wanted_width(table) > console.width:
        for line in fold(table):
            console.print(line, markup=False, highlight=False, soft_wrap=False)
        return
    if console.no_color:
        table.box = box.MARKDOWN
    console.print(table)
