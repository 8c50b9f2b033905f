"""docs/sandlock.1 names every subcommand, every option and every SANDLOCK_ variable
the package reads: a new one without a line in the man page fails here."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

from sandlock.cli.launch import OPTIONS as RUN_OPTIONS
from sandlock.cli.main import cli

pytestmark = pytest.mark.any_user

#: The man page as it reads (roff writes a hyphen-minus as ``\-``).
PAGE = (REPO / "docs" / "sandlock.1").read_text().replace("\\-", "-")


def _section(name: str) -> str:
    return PAGE.split(f"\n.SH {name}\n", 1)[1].split("\n.SH ", 1)[0]


def test_every_subcommand_and_option_is_in_the_synopsis() -> None:
    synopsis = _section("SYNOPSIS")
    named = set(re.findall(r"^\.B sandlock (\S+)$", synopsis, re.M))
    assert named == set(cli.commands)
    blocks = dict(re.findall(r"^\.B sandlock (\S+)\n(.*?)(?=^\.br$|\Z)", synopsis, re.M | re.S))
    for name, command in cli.commands.items():
        options = [o for p in command.params for o in p.opts if o.startswith("-")]
        if name == "run":  # `run`'s own parser (sandlock.cli.launch); click only lists it
            options = [option for option, _metavar, _text in RUN_OPTIONS]
        missing = [o for o in options if not re.search(rf"\\fB{re.escape(o)}\\fR", blocks[name])]
        assert not missing, f"sandlock {name}: {missing} not in the man page's SYNOPSIS"


def test_every_sandlock_variable_is_in_the_environment_section() -> None:
    sources = [p for p in (REPO / "sandlock").rglob("*") if p.suffix in (".py", ".c")]
    read = {name for path in sources
            for name in re.findall(r"SANDLOCK_[A-Z0-9_]*[A-Z0-9]", path.read_text())}
    # A C macro given at build time (``#ifdef``/``#ifndef`` NAME) is no variable users set.
    read -= {name for path in sources if path.suffix == ".c"
             for name in re.findall(r"^#\s*if(?:n)?def\s+(SANDLOCK_\w+)", path.read_text(), re.M)}
    assert {"SANDLOCK_ABI", "SANDLOCK_NO_CACHE"} <= read  # the search finds them
    documented = set(re.findall(r"^\.B[R]? (.*)$", _section("ENVIRONMENT"), re.M))
    names = {n for line in documented for n in re.findall(r"SANDLOCK_[A-Z0-9_]+", line)}
    assert read <= names, f"not in the man page's ENVIRONMENT: {sorted(read - names)}"
