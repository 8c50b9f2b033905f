"""The one way text a recorded tool controls leaves `trace` and `learn`.

File names, executable names and ``#!`` lines are the tool's: a name holding a
newline, a quote or an escape sequence must stay one name wherever it goes.

- :func:`printable`: terminal output and TOML comments; every character that is not
  printable (controls, escape sequences, bidirectional overrides, line separators,
  undecodable bytes) is written as a backslash escape.
- :func:`toml_string`: a TOML basic string (https://toml.io/en/v1.0.0#string) that
  the policy loader reads back as exactly ``text``; :class:`Unspellable` when no
  policy can name it (see :func:`policy_path`).
- :func:`toml_comment`: ``# `` and :func:`printable` text.
- :func:`toml_value`: a boolean, integer, string, array or inline table, every string
  in it through :func:`toml_string`.
- Command lines: :func:`command` (``shlex.join``), then :func:`printable`.
"""

from __future__ import annotations

import re
import shlex
from typing import Mapping, Sequence, Union

_SHORT = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


class Unspellable(ValueError):
    """A name no policy can hold (a policy names it, the loader reads something else)."""


def _escape(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` with every non-printable character escaped (a lone surrogate, from a
    name that is not UTF-8, included): one line, no terminal control. ``lines``: keep
    newlines (sandlock's own multi-line errors; a tool's name in them is escaped where
    it is written, as :func:`sandlock.trace.record.exec_refusals` does)."""
    return "".join(c if c.isprintable() or (lines and c == "\n") else _escape(c) for c in text)


def toml_string(text: str) -> str:
    """A TOML basic string holding exactly ``text`` (no raw control character in it)."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char in _SHORT:
            out.append(_SHORT[char])
        elif char.isprintable():
            out.append(char)
        elif 0xD800 <= ord(char) <= 0xDFFF:  # an undecodable byte (os.fsdecode)
            raise Unspellable(f"{printable(text)} is not UTF-8")
        else:
            code = ord(char)
            out.append(f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def policy_path(path: str, home: str = "") -> str:
    """The TOML string of a path a policy grants: :class:`Unspellable` when the policy
    loader would read another path from it (it expands ``${...}`` and a leading ``~``,
    :func:`sandlock.policy.model._expand`) or TOML cannot hold it. A path inside
    ``home`` (absolute, not ``/``) is written ``~/...``: the loader reads it as the
    running user's home."""
    if "${" in path or path.startswith("~") or not path.startswith("/"):
        raise Unspellable(f"{printable(path)} would be read as another path")
    if home.startswith("/") and home != "/" and path.startswith(home.rstrip("/") + "/"):
        return toml_string("~" + path[len(home.rstrip("/")):])
    return toml_string(path)


#: What :func:`toml_value` writes.
TomlValue = Union[bool, int, str, Sequence["TomlValue"], Mapping[str, "TomlValue"]]


def toml_value(value: TomlValue) -> str:
    """``value`` as TOML (https://toml.io/en/v1.0.0): arrays on one line, tables inline,
    a key bare only when TOML reads it as itself."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, Mapping):
        pairs = [f"{_key(key)} = {toml_value(item)}" for key, item in value.items()]
        return "{ " + ", ".join(pairs) + " }" if pairs else "{}"
    return "[" + ", ".join(toml_value(item) for item in value) + "]"


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else toml_string(name)


def toml_comment(text: str) -> str:
    """A TOML comment (to the end of its line) holding ``text``, escaped."""
    return "# " + printable(text)


def command(argv: Sequence[str]) -> str:
    """A command line a shell reads back as ``argv`` (shown with :func:`printable`)."""
    return shlex.join(argv)
