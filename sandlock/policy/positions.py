"""Find the line of a key in TOML source text, for error messages.

TOML parsers return plain data without positions, so a validation error would
otherwise say only *what* is wrong. This scanner recovers *where*: the line of
``[table]`` + ``key =`` (or a dotted key), and for an array element the line on
which that element starts. It is best effort and never raises: an unknown
position simply yields ``None``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Union

Key = Sequence[Union[str, int]]

_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_ASSIGN = re.compile(r"^\s*([A-Za-z0-9_\-\.\"' ]+?)\s*=")


def _norm(dotted: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in dotted.split("."))


def _key_line(lines: list[str], names: list[str]) -> int | None:
    """0-based line of the header or assignment of the dotted key ``names``."""
    statements = _statement_lines(lines)
    wanted = ".".join(names)
    table = ""
    best: int | None = None
    for number, line in enumerate(lines):
        if number not in statements:
            continue  # inside a multi-line string or array: not a header or a key
        header = _HEADER.match(line)
        if header:
            table = _norm(header.group(1))
            if table == wanted:
                best = number
            continue
        assign = _ASSIGN.match(line)
        if not assign:
            continue
        full = _norm(table + "." + assign.group(1) if table else assign.group(1))
        if full == wanted or wanted.startswith(full + "."):
            return number
    return best


def find_line(text: str, key: Key) -> int | None:
    """1-based line of ``key`` (e.g. ``["filesystem", "read", 2]``) in ``text``."""
    names: list[str] = []
    for part in key:
        if not isinstance(part, str):
            break
        names.append(part)
    if not names:
        return None
    lines = text.splitlines()
    best = _key_line(lines, names)
    if best is None:
        return None
    if len(key) > len(names):
        index = key[len(names)]
        assert isinstance(index, int)
        starts = _element_starts(lines, best)
        return (starts[index] if index < len(starts) else best) + 1
    return best + 1


def find_element_lines(text: str, names: list[str]) -> list[int]:
    """1-based line of every element of the array at ``names``, in one pass.

    Used to label each of many path rules with its origin: calling
    :func:`find_line` per element would rescan the text for each one.
    """
    lines = text.splitlines()
    best = _key_line(lines, names)
    return [] if best is None else [n + 1 for n in _element_starts(lines, best)]


def _statement_lines(lines: list[str]) -> set[int]:
    """Lines that begin outside any string, array or inline table.

    Only such a line can hold a ``[table]`` header or a ``key =``; text inside a
    multi-line string (a ``description``) or array element must not be taken for one.
    """
    return _scan(lines)[0]


def find_deep_nesting(text: str, limit: int) -> int | None:
    """1-based line on which brackets and braces outside strings and comments first
    nest deeper than ``limit``; None if they never do.

    Checked before parsing: the TOML parser recurses once per level, so a value
    nested a thousand deep would exhaust Python's stack instead of being refused.
    """
    if text.count("[") + text.count("{") <= limit:
        return None  # the common case costs two counts
    return _scan(text.splitlines(), limit)[1]


def _scan(lines: list[str], limit: int | None = None) -> tuple[set[int], int | None]:
    """The 0-based statement lines, and the 1-based line on which nesting first
    exceeds ``limit`` (None if it never does, or no limit is given)."""
    out: set[int] = set()
    depth = 0
    quote = ""  # the opening quote (one or three characters) while inside a string
    for number, line in enumerate(lines):
        if quote in ('"', "'"):
            quote = ""  # a one-line string cannot span lines (the parser already said so)
        if not quote and depth <= 0:
            out.add(number)
        position = 0
        while position < len(line):
            char = line[position]
            if quote:
                if char == "\\" and quote[0] == '"':
                    position += 2
                    continue
                if line.startswith(quote, position):
                    position += len(quote)
                    quote = ""
                    continue
                position += 1
                continue
            if char == "#":
                break
            if char in "\"'":
                triple = char * 3
                quote = triple if line.startswith(triple, position) else char
                position += len(quote)
                continue
            if char in "[{":
                depth += 1
                if limit is not None and depth > limit:
                    return out, number + 1
            elif char in "]}":
                depth -= 1
            position += 1
    return out, None


def _element_starts(lines: list[str], start: int) -> list[int]:
    """Line on which each element of the array assigned at ``start`` begins."""
    depth = 0
    expect_new = False
    quote = ""
    starts: list[int] = []
    for number in range(start, len(lines)):
        line = lines[number]
        position = lines[start].find("=") + 1 if number == start else 0
        while position < len(line):
            char = line[position]
            position += 1
            if quote:
                if char == "\\" and quote == '"':
                    position += 1
                elif char == quote:
                    quote = ""
                continue
            if char == "#":
                break
            if char.isspace():
                continue
            if depth == 1 and expect_new and char not in ",]":
                starts.append(number)
                expect_new = False
            if char in "\"'":
                quote = char
            elif char in "[{":
                depth += 1
                expect_new = depth == 1
            elif char in "]}":
                depth -= 1
                if depth <= 0:
                    return starts
            elif char == "," and depth == 1:
                expect_new = True
    return starts
