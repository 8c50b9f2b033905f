"""The README's examples run as written, so the documentation cannot drift.

A fenced block preceded by ``<!-- readme-test: sh|toml|python -->`` is extracted
and run in a fresh temporary directory: a shell block with ``sh -e`` (the
``sandlock`` command on PATH), a TOML block is validated and explained as a
policy, a Python block is run by this interpreter. Each must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require_abi

MARKED = re.compile(r"<!-- readme-test: (sh|toml|python) -->\n```(\w+)\n(.*?)\n```\n", re.S)
BLOCKS = [(kind, lang, body) for kind, lang, body in MARKED.findall((REPO / "README.md").read_text())]
BIN = str(Path(sys.executable).parent)
ENV = {"PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
       "HOME": os.environ.get("HOME", "/")}


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(4, "the README's examples (files and TCP ports)")


def test_the_examples_are_marked() -> None:
    kinds = [kind for kind, _, _ in BLOCKS]
    assert kinds.count("sh") >= 2 and "toml" in kinds and "python" in kinds
    assert all(kind == lang for kind, lang, _ in BLOCKS)


@pytest.mark.parametrize("kind,body", [(k, b) for k, _, b in BLOCKS],
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BLOCKS)])
def test_readme_block_runs(kind: str, body: str, tmp_path: Path) -> None:
    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)

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
