"""Tool registries: a directory of NAME.toml, or one file of [tools.NAME] tables."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import POLICIES, require_abi, write_policy
from conftest import sandlock as cli

import sandlock

TOOLS_FILE = """\
[tools.cat]
extends = ["base"]
[tools.cat.filesystem]
read = ["${workspace}"]
exec = ["/usr/bin/cat"]

[tools.echo]
extends = ["base", "extra.toml"]
"""


def test_directory_registry_runs_each_tool_under_its_own_policy(workspace: Path,
                                                                 outside: Path) -> None:
    require_abi(1, "filesystem confinement")
    with sandlock.Registry(POLICIES) as registry:
        assert "read_file" in registry and "shell" in registry.names
        variables = {"workspace": str(workspace)}
        inside = registry.run("read_file", ["cat", str(workspace / "notes.md")], vars=variables,
                              capture_output=True, text=True)
        assert inside.stdout == "hello from the workspace\n"
        denied = registry.run("read_file", ["cat", str(outside / "secret.txt")], vars=variables,
                              capture_output=True, text=True)
        assert denied.returncode == 1 and "top secret" not in denied.stdout
        assert registry.sandbox("read_file", variables) is registry.sandbox("read_file", variables)
        other = {"workspace": str(outside)}
        assert registry.sandbox("read_file", other) is not registry.sandbox("read_file", variables)


def test_tools_file_registry(tmp_path: Path, workspace: Path) -> None:
    require_abi(1, "filesystem confinement")
    write_policy(tmp_path, 'version = 1\n[filesystem]\nexec = ["/usr/bin/echo"]\n', "extra.toml")
    tools = write_policy(tmp_path, TOOLS_FILE, "tools.toml")
    registry = sandlock.Registry(tools)
    assert registry.names == ["cat", "echo"]
    echoed = registry.run("echo", ["echo", "hi"], capture_output=True)
    assert echoed.stdout == b"hi\n"  # extends resolved relative to tools.toml
    cat = registry.run("cat", ["cat", str(workspace / "notes.md")],
                       vars={"workspace": str(workspace)}, capture_output=True)
    assert cat.returncode == 0
    assert registry.run("echo", ["cat", str(workspace / "notes.md")]).returncode == 126
    with pytest.raises(sandlock.PolicyError, match=r"tools\.cat\]: filesystem\.read\[0\]: "
                                                   r"undefined variable \$\{workspace\}"):
        registry.policy("cat")
    registry.close()


def test_registry_errors(tmp_path: Path) -> None:
    tools = write_policy(tmp_path, TOOLS_FILE, "tools.toml")
    with pytest.raises(sandlock.PolicyError, match=r"unknown tool 'nope' \(known: cat, echo\)"):
        sandlock.Registry(tools).policy("nope")
    bad = write_policy(tmp_path, "[tools.x]\nextends = [\n", "bad.toml")
    with pytest.raises(sandlock.PolicyError, match="bad.toml:.*TOML syntax error"):
        sandlock.Registry(bad)
    stray = write_policy(tmp_path, "version = 1\n", "stray.toml")
    with pytest.raises(sandlock.PolicyError, match="only \\[tools.NAME\\] tables"):
        sandlock.Registry(stray)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(sandlock.PolicyError, match="no tools found"):
        sandlock.Registry(empty)
    with pytest.raises(sandlock.PolicyError, match="no such policy directory or file"):
        sandlock.Registry(tmp_path / "missing")


def test_cli_runs_a_tool_of_a_registry(tmp_path: Path, workspace: Path) -> None:
    require_abi(1, "filesystem confinement")
    tools = write_policy(tmp_path, 'version = 1\n[filesystem]\nexec = ["/usr/bin/echo"]\n',
                         "extra.toml").parent / "tools.toml"
    tools.write_text(textwrap.dedent(TOOLS_FILE))
    done = cli("run", "--tool", "cat", "--policies", str(tools), "--var",
               f"workspace={workspace}", "--", "cat", str(workspace / "notes.md"))
    assert (done.returncode, done.stdout) == (0, "hello from the workspace\n")
    unknown = cli("run", "--tool", "nope", "--policies", str(tools), "--", "true")
    assert unknown.returncode == 125 and "unknown tool 'nope'" in unknown.stderr
