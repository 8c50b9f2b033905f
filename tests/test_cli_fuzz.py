"""Property test of the CLI's arguments (hypothesis): whatever a caller types, the
CLI answers with an exit code, never with a Python traceback.

Argument lists are built from the real option names of each command and from
values an operator or a script might pass by mistake: paths that exist or do not,
a FIFO, /dev/zero, a directory, a file too large, a symbolic link loop, broken and
hostile policies, huge and negative numbers, empty strings, unicode, NUL bytes.
`run` goes through its own parser (:func:`sandlock.cli.run.main_run`, what the
console script calls); the other commands through click, in-process.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from conftest import POLICIES
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sandlock.cli import launch
from sandlock.cli.main import cli
from sandlock.policy.readfile import MAX_BYTES

#: Codes a command may end with: sandlock's own, or those of the commands run below.
ALLOWED = {0, 1, 2, 3, 124, 125, 126, 127}
COMMANDS = ["explain", "check", "validate", "policies", "probe"]


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory of things to name on the command line; also the working directory."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "ws").mkdir()
    (root / "ws" / "notes.md").write_text("notes\n")
    os.mkfifo(root / "fifo.toml")
    (root / "zero.toml").symlink_to("/dev/zero")
    (root / "dir.toml").mkdir()
    (root / "large.toml").write_text("#" * (2 * MAX_BYTES))
    (root / "loop.toml").symlink_to("loop.toml")
    (root / "bad.toml").write_text("version = [\n")
    (root / "deep.toml").write_text("x = " + "[" * 500 + "]" * 500 + "\n")
    (root / "huge.toml").write_text('version = 1\n[limits]\nmemory = "' + "9" * 400 + '"\n')
    (root / "binary.toml").write_bytes(b"\xff\xfe\x00version = 1\n")
    (root / "extends-fifo.toml").write_text('version = 1\nextends = ["./fifo.toml"]\n')
    (root / "registry").mkdir()
    (root / "registry" / "cat.toml").write_text((POLICIES / "read_file.toml").read_text())
    (root / "tools.toml").write_text('[tools.cat]\nversion = 1\nextends = ["base"]\n')
    here = os.getcwd()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(here)


FILES = ["fifo.toml", "zero.toml", "dir.toml", "large.toml", "loop.toml", "bad.toml", "deep.toml",
         "huge.toml", "binary.toml", "extends-fifo.toml", "registry", "tools.toml", "ws",
         "missing.toml", "ws/notes.md"]
GOOD = [str(POLICIES / "read_file.toml"), str(POLICIES / "shell.toml"), "read_file", "base"]
JUNK = ["", "-", "--", "=", "-x", "é", "日本語.toml", "a\x00b", "\udcff", "9" * 400, "-1", "0",
        "1e999", "nan", "inf", "2" * 30 + "s", "/", "/dev/zero", "/dev/null", "/proc/self/mem",
        "~", "${workspace}", "x" * 5000]
VARS = ["workspace=ws", "workspace=", "=x", "x", "1x=y", "cwd=/", "workspace=a\x00b",
        "workspace=" + "x" * 5000, "é=1", "home=/nonexistent"]
TIMEOUTS = ["30s", "0", "-1", "1e9", "9" * 400, "nan", "soon", "", "0.001ms", "1000000h"]
#: What `run` starts when it gets that far (each returns one of ALLOWED).
ARGV = [["true"], ["false"], ["sh", "-c", "exit 3"], ["/nonexistent"], [""], ["a\x00b"],
        ["é"], ["cat", "notes.md"], ["/dev/zero"], ["ws"], ["--"], ["-h"]]


#: Values that get a command past its parser, per option: most examples use them, so
#: that the hostile values land deep in the command instead of in click's usage errors.
PLAUSIBLE = {"--policy": GOOD, "--tool": ["cat"], "--policies": ["registry", "tools.toml"],
             "--var": ["workspace=/tmp"], "--timeout": ["30s", "2"]}
#: Options that name the policy: one way is drawn first (a file, a registry's tool, or
#: whatever comes), so that most examples name exactly one policy.
SOURCES = [["--policy"], ["--policy"], ["--policy"], ["--tool", "--policies"], []]
#: A positional argument of the command, if it takes one.
POSITIONAL = {"validate": GOOD[:2] + FILES, "policies": ["base", "python", "read_file"]}

values = st.one_of(st.sampled_from(FILES), st.sampled_from(GOOD), st.sampled_from(JUNK),
                   st.text(max_size=8))
hostile = {"--var": st.sampled_from(VARS) | values, "--timeout": st.sampled_from(TIMEOUTS) | values}


@st.composite
def arguments(draw: Any, command: str) -> list[str]:
    """An argument list for ``command``: its real options, mostly with values that
    parse, some with hostile ones, in any order, now and then one it does not have."""
    options = [param for param in cli.commands[command].params if isinstance(param, click.Option)]
    source = draw(st.sampled_from(SOURCES))
    args: list[str] = []
    for param in draw(st.permutations(options)):
        name = param.opts[-1]
        if name in ("--policy", "--tool", "--policies") and source:
            if name not in source:
                continue
        elif param.name == "help" or name != "--var" and not draw(st.booleans()):
            continue
        if param.is_flag:
            args.append(name)
            continue
        for _ in range(draw(st.integers(1, 2)) if param.multiple else 1):
            if name in PLAUSIBLE and draw(st.integers(0, 3)):
                value = draw(st.sampled_from(PLAUSIBLE[name]))
            else:
                value = draw(hostile.get(name, values))
            args += [f"{name}={value}"] if draw(st.integers(0, 4)) == 0 else [name, value]
    if command in POSITIONAL and draw(st.booleans()):
        args.append(draw(st.sampled_from(POSITIONAL[command]) | values))
    if draw(st.integers(0, 9)) == 0:
        args.insert(draw(st.integers(0, len(args))), draw(st.sampled_from(["--nope", "-q", "--"])
                                                          | values))
    return args


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text
    assert "internal error" not in text, text


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_run_arguments(place: Path, data: st.DataObject) -> None:
    """`run`'s own parser and everything behind it: an exit code, nothing raised."""
    args = data.draw(arguments("run"))
    if data.draw(st.integers(0, 9)):
        args += ["--", *data.draw(st.sampled_from(ARGV))]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = launch.main_run(args)  # an exception escaping here fails the test
    no_traceback(err.getvalue())
    event(f"run: exit {code}")
    assert code is None or code in ALLOWED, (args, code, err.getvalue())
    assert code is None or code == 0 or code in (1, 3) or err.getvalue().startswith("sandlock: "), \
        (args, code, err.getvalue())


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_other_commands_arguments(place: Path, data: st.DataObject) -> None:
    """The click commands, in-process: SystemExit with a known code, nothing else."""
    command = data.draw(st.sampled_from(COMMANDS))
    args = data.draw(arguments(command))
    if command == "probe":
        # A probe that gets to run takes a second: give it only policies that stop it first.
        args = [a for a in args if a not in GOOD and not a.startswith("--policy=")]
        args += ["--policy", data.draw(st.sampled_from(FILES))]
    result = CliRunner().invoke(cli, [command, *args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # shows the traceback the user would have seen
    no_traceback(result.output)
    event(f"{command}: exit {result.exit_code}")
    assert result.exit_code in ALLOWED, (command, args, result.exit_code, result.output)
