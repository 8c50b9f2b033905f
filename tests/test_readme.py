"""The README's examples run as written, so the documentation cannot drift.

A fenced block preceded by ``<!-- readme-test: sh|toml|python -->`` is extracted
and run in a fresh temporary directory: a shell block with ``sh -e`` (the
``sandlock`` command on PATH), a TOML block is validated and explained as a
policy, a Python block is run by this interpreter. Each must exit 0.

The README is for users; design notes, benchmarks and history live in docs/. Every
relative link between them must reach a file and a heading that exist, the test
command must be the one CI runs, and no page names the package's module files
(the layout is documented in one place, docs/architecture.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require_abi, require_tool

MARKED = re.compile(r"<!-- readme-test: (sh|toml|python) -->\n```(\w+)\n(.*?)\n```\n", re.S)
BLOCKS = [(kind, lang, body) for kind, lang, body in MARKED.findall((REPO / "README.md").read_text())]
BIN = str(Path(sys.executable).parent)
ENV = {"PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
       "HOME": os.environ.get("HOME", "/")}


DOCS = [REPO / "README.md", *(REPO / "docs" / name for name in ("design.md", "benchmarks.md", "history.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_COMMAND = "python -m pytest -q -p no:cacheprovider tests"
#: The README's one command for the whole suite: it installs what the tests need, then
#: runs TEST_COMMAND.
TEST_SCRIPT = "scripts/test.sh"
#: Commands of the examples that a machine may lack (scripts/system-packages.txt).
OPTIONAL_TOOLS = ("git",)


@pytest.fixture
def _landlock() -> None:
    require_abi(4, "the README's examples (files and TCP ports)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_examples_are_marked() -> None:
    kinds = [kind for kind, _, _ in BLOCKS]
    assert kinds.count("sh") >= 2 and "toml" in kinds and "python" in kinds
    assert all(kind == lang for kind, lang, _ in BLOCKS)


@pytest.mark.usefixtures("_landlock")
@pytest.mark.parametrize("kind,body", [(k, b) for k, _, b in BLOCKS],
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BLOCKS)])
def test_readme_block_runs(kind: str, body: str, tmp_path: Path) -> None:
    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)

    for tool in OPTIONAL_TOOLS:
        if re.search(rf"(^|[\s;&|(]){tool}\s", body, re.M):
            require_tool(tool)
    if kind == "sh":
        results = [run(["sh", "-e", "-c", body])]
    elif kind == "toml":
        (tmp_path / "policy.toml").write_text(body + "\n")
        results = [run([f"{BIN}/sandlock", "validate", "policy.toml"]),
                   run([f"{BIN}/sandlock", "explain", "--policy", "policy.toml",
                        "--var", f"workspace={tmp_path}"])]
    else:
        (tmp_path / "example.py").write_text(body + "\n")
        results = [run([sys.executable, "example.py"])]
    for result in results:
        assert result.returncode == 0, f"{result.args}\n{result.stdout}\n{result.stderr}"


def test_the_readme_has_the_user_sections() -> None:
    # Messages of the probe and comments in the code name some of these headings.
    headings = {m.strip() for m in re.findall(r"^## (.+)$", (REPO / "README.md").read_text(), re.M)}
    for heading in ("Install and run", "Run the tests", "A policy", "Python API", "Commands",
                    "Host allowlists", "Troubleshooting: my tool got Permission denied",
                    "Exit codes", "Kernel requirements",
                    "Threat model: what one tool can do to later runs",
                    "What sandlock does not protect against"):
        assert heading in headings, heading


def test_the_moved_parts_are_linked_from_the_readme() -> None:
    links = set(LINK.findall((REPO / "README.md").read_text()))
    for page in ("docs/design.md", "docs/benchmarks.md", "docs/history.md"):
        assert (REPO / page).is_file() and page in links, page
    assert "python -m benchmarks" in (REPO / "docs" / "benchmarks.md").read_text()


def test_the_test_command_is_the_one_ci_runs() -> None:
    assert f"\n{TEST_SCRIPT}\n" in (REPO / "README.md").read_text()
    assert f"\n{TEST_COMMAND} \"$@\"\n" in (REPO / TEST_SCRIPT).read_text()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in (line.strip() for line in ci)


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        dest = (page.parent / name).resolve() if name else page
        assert dest.exists(), f"{page.name}: {target}"
        if anchor:
            assert anchor in anchors(dest), f"{page.name}: {target}"


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_no_module_file_is_named(page: Path) -> None:
    assert not re.findall(r"sandlock/[\w/]*\.(?:py|c)\b", page.read_text())


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_every_code_fence_is_closed(page: Path) -> None:
    """An unclosed fence renders the rest of the page as code (it once hid the threat
    model): fences pair up, and no block holds a second-level heading."""
    fences = [i for i, line in enumerate(page.read_text().splitlines(), 1) if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: the fence at line {fences[-1]} is never closed"
    lines = page.read_text().splitlines()
    for start, end in zip(fences[::2], fences[1::2]):
        inside = [line for line in lines[start:end - 1] if line.startswith("## ")]
        assert not inside, f"{page.name}: the block at line {start} swallows {inside[0]!r}"
