"""The table of scripts/mutation_check.py follows the code: every guard's snippet is
where the table says, exactly once, and its tests exist. (The mutation check itself,
which switches each guard off and runs its tests, runs as root in CI: .ci/run.)"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from mutation_guards import GUARDS, Guard  # noqa: E402


@pytest.mark.parametrize("guard", GUARDS, ids=[g.name for g in GUARDS])
def test_each_snippet_is_in_its_file_once(guard: Guard) -> None:
    text = (REPO / guard.file).read_text()
    assert text.count(guard.snippet) == 1, f"{guard.file}: update the entry {guard.name!r}"
    assert guard.replacement != guard.snippet and guard.tests


@pytest.mark.parametrize("guard", GUARDS, ids=[g.name for g in GUARDS])
def test_each_listed_test_exists(guard: Guard) -> None:
    for node in guard.tests:
        path, _, name = node.partition("::")
        tree = ast.parse((REPO / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name.split("[")[0] in names, node


def test_names_are_unique() -> None:
    assert len({g.name for g in GUARDS}) == len(GUARDS)
