"""Where the CLI prints for people: lines and tables, every character escaped.

What `check`, `explain`, `policies` and `probe` show holds text sandlock does not
choose: paths from a policy (a draft from `learn` names the tool's own files), a
probe's stderr, a kernel's release string. Every line and every cell goes through
:func:`sandlock.trace.emit.printable`, so a name holding an escape sequence, a
carriage return or a bell is seen as ``\\x1b``, ``\\r``, ``\\x07``; nothing here
interprets markup (``[red]`` is shown as typed).

A table is aligned columns on a terminal and tab-separated lines otherwise (``# title``
first), so that a program can cut it; ``--json`` is the format for programs.
"""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Sequence
from typing import TextIO

from ..trace.emit import printable


class Lines:
    """Escaped lines on stdout (or stderr)."""

    def __init__(self, stderr: bool = False) -> None:
        self.stream: TextIO = sys.stderr if stderr else sys.stdout

    def print(self, text: str = "") -> None:
        """``text`` as one line: a newline in it is escaped, as any control character."""
        self.stream.write(printable(text) + "\n")


def width(text: str) -> int:
    """Terminal columns of printable ``text``: wide East Asian characters take two,
    combining marks none."""
    return sum(0 if unicodedata.combining(c) else
               2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
          stream: TextIO | None = None) -> None:
    """Aligned columns on a terminal, tab-separated lines otherwise; every cell escaped
    (a tab in a cell is ``\\t``, so the columns stay the columns)."""
    out = stream or sys.stdout
    cells = [[printable(cell) for cell in row] for row in rows]
    if not out.isatty():
        out.write("".join(f"{line}\n" for line in
                          [f"# {printable(title)}", *("\t".join(row) for row in cells)]))
        return
    head = [printable(column) for column in columns]
    widths = [max([width(row[i]) for row in [head, *cells] if i < len(row)])
              for i in range(len(head))]

    def line(row: Sequence[str]) -> str:
        padded = [cell + " " * (widths[i] - width(cell)) for i, cell in enumerate(row)]
        return "  ".join(padded).rstrip()

    rule = ["-" * w for w in widths]
    out.write("".join(f"{text}\n" for text in
                      [printable(title), line(head), line(rule), *map(line, cells)]))
    out.flush()
