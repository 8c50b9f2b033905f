"""What the CLI prints for people (`sandlock.cli.show`): a name holding markup, escape
sequences or control bytes is shown escaped, on a terminal and off it; and the
per-call `sandlock run` path imports none of the printing (nor click).

A learned draft names the tool's own files, and `explain` shows the paths of a
policy: a file name with ``\\x1b[2J`` would clear the reader's screen, one with ``\\r``
would overwrite the start of its line with what follows."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from sandlock.cli import show
from sandlock.trace.emit import toml_string

#: Rich-style markup (nothing here interprets it), a screen clear, a carriage return,
#: a bell, an OSC 8 hyperlink.
HOSTILE = "a[red]x[/red]\x1b[2J\r\x07[link=file:x]y[/link]\x1b]8;;file:/e\x07z"
SHOWN = "a[red]x[/red]\\x1b[2J\\r\\x07[link=file:x]y[/link]\\x1b]8;;file:/e\\x07z"

#: Runs the CLI; with ``off`` as its first argument, with the escaping switched off.
CLI = """\
import sys
if sys.argv[1] == "off":
    from sandlock.cli import show
    show.printable = lambda text, **_: text
from sandlock.cli.main import cli
cli(sys.argv[2:], prog_name="sandlock")
"""


def _explain(policy: Path, guard: str, tty: bool) -> str:
    """`sandlock explain` of ``policy``'s stdout, through a pty when ``tty``."""
    argv = [sys.executable, "-c", CLI, guard, "explain", "--policy", str(policy)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "TERM": "xterm"}
    if not tty:
        done = subprocess.run(argv, capture_output=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.decode()
    master, slave = os.openpty()
    proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.communicate(timeout=60)[1] == b"" and proc.returncode == 0
    return out.decode().replace("\r\n", "\n")  # the terminal's own line ends (onlcr)


@pytest.fixture
def hostile_policy(tmp_path: Path) -> tuple[Path, str]:
    """A policy in, and granting, a directory whose name is :data:`HOSTILE`; (policy, the
    directory above)."""
    target = tmp_path / HOSTILE
    target.mkdir(parents=True)
    policy = target / "p.toml"
    policy.write_text(f"version = 1\n[filesystem]\nread = [{toml_string(str(target))}]\n")
    return policy, str(tmp_path)


@pytest.mark.parametrize("tty", [False, True], ids=["pipe", "terminal"])
def test_explain_shows_a_hostile_path_escaped(hostile_policy: tuple[Path, str], tty: bool) -> None:
    policy, base = hostile_policy
    out = _explain(policy, "on", tty)
    assert f"\npolicy: {base}/{SHOWN}/p.toml\n" in "\n" + out, out  # a line
    assert f"  {base}/{SHOWN}  " in out and f"\t{base}/{SHOWN}\t" not in out if tty else \
        f"\t{base}/{SHOWN}\t" in out  # a cell
    for raw in ("\x1b", "\r", "\x07"):
        assert raw not in out, repr(raw)


@pytest.mark.parametrize("tty", [False, True], ids=["pipe", "terminal"])
def test_explain_without_the_escaping_would_write_the_bytes(hostile_policy: tuple[Path, str],
                                                           tty: bool) -> None:
    """Positive control: the same run with :func:`show.printable` switched off puts the
    escape sequence on the reader's terminal."""
    policy, base = hostile_policy
    out = _explain(policy, "off", tty)
    assert "\x1b[2J" in out and "\x1b]8;;file:/e\x07" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_table_aligns_columns_and_escapes_each_cell() -> None:
    out = _Terminal()
    show.table("t\x1b[2J", ["name", "what"], [["\u6f22\u5b57", "x\ty"], ["tab\there", "\r"]], out)
    lines = out.getvalue().splitlines()
    assert lines == ["t\\x1b[2J", "name       what", "---------  ----",
                     "\u6f22\u5b57       x\\ty", "tab\\there  \\r"]
    piped = io.StringIO()
    show.table("t", ["name", "what"], [["a\tb", "c\nd"]], piped)
    assert piped.getvalue() == "# t\na\\tb\tc\\nd\n"


def test_run_imports_no_click_and_no_printing(tmp_path: Path) -> None:
    """`sandlock run`'s per-call path (``-X importtime`` lists every module imported);
    `explain`, the positive control, imports them."""
    policy = tmp_path / "p.toml"
    policy.write_text('version = 1\nextends = ["base"]\n[filesystem]\nexec = ["/usr/bin/true"]\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def imported(*args: str) -> set[str]:
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "sandlock", *args],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}

    ran = imported("run", "--policy", str(policy), "--", "/usr/bin/true")
    explained = imported("explain", "--policy", str(policy))
    printing = {"click", "rich", "sandlock.cli.main", "sandlock.cli.show"}
    assert "sandlock.cli.run" in ran and not ran & printing, sorted(ran & printing)
    assert {"click", "sandlock.cli.show"} <= explained
    assert not any(name == "rich" or name.startswith("rich.") for name in ran | explained)
