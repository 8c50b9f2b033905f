"""The one list of system packages (scripts/system-packages.txt) and what reads it: the
shell reader of install.sh, test.sh and .ci/run, and the tests' require_tool gate."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, SYSTEM_PACKAGES, _find_tool, package_of, require_tool

USES = {"install", "test", "ci"}
READER = REPO / "scripts" / "system-packages.sh"


def rows() -> list[list[str]]:
    return [line.split() for line in SYSTEM_PACKAGES.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_each_row_names_a_package_its_uses_what_it_provides_and_why() -> None:
    for row in rows():
        assert len(row) >= 4, row
        assert set(row[1].split(",")) <= USES, row
    provided = [row[2] for row in rows() if row[2] != "-"]
    assert len(provided) == len(set(provided)), "two packages provide one tool"


@pytest.mark.parametrize("use", sorted(USES))
def test_the_shell_reader_lists_what_the_list_says(use: str) -> None:
    listed = subprocess.run(["sh", str(READER), "list", use], capture_output=True, text=True,
                            check=True).stdout.split()
    assert listed == [row[0] for row in rows() if use in row[1].split(",")]


def test_every_tool_the_tests_require_is_in_the_list() -> None:
    for path in sorted((REPO / "tests").glob("*.py")):
        if path.name == "test_install.py":  # its own calls test the gate
            continue
        for tool in re.findall(r'require_tool\("([^"]+)"\)', path.read_text()):
            assert package_of(tool), (path.name, tool)


def test_the_scripts_install_from_the_list_alone() -> None:
    """No second list of packages: what apt-get installs comes from the reader."""
    for name in (".ci/run", "scripts/install.sh", "scripts/test.sh"):
        text = (REPO / name).read_text()
        assert "scripts/system-packages.sh ensure" in text, name
        assert "apt-get install" not in text, name


def gate(tool: str) -> str:
    """What require_tool did, caught here (a skip must not skip this test)."""
    try:
        return f"found {require_tool(tool)}"
    except pytest.skip.Exception as exc:
        return f"skip: {exc}"
    except pytest.fail.Exception as exc:
        return f"fail: {exc}"


def test_a_missing_tool_skips_naming_its_package(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.delenv("SANDLOCK_EXPECT_TOOLS", raising=False)
    _find_tool.cache_clear()
    try:
        assert gate("python3").startswith("found /")  # the control: a tool that is here
        monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no git
        _find_tool.cache_clear()
        assert gate("git") == ("skip: git is not installed (Debian/Ubuntu package git; "
                               "scripts/test.sh installs it)")
        monkeypatch.setenv("SANDLOCK_EXPECT_TOOLS", "1")
        assert gate("git").startswith("fail: git is not installed"), gate("git")
        assert gate("git").endswith("but SANDLOCK_EXPECT_TOOLS=1")
        with pytest.raises(LookupError, match="no package"):
            require_tool("no-such-tool")
    finally:
        _find_tool.cache_clear()
