"""Faults and lies of sandlock's helper processes, as a call() tool or an operator
causes them: what the caller reports must be what happened, within the call's time.

- A call() tool holds descriptors that lead to its supervisor and to the caller
  (its result pipe): whatever it writes there, the caller never reports a setup
  failure for it (issue 12 item 4).
- The fork server or the native server dies while a call runs and the tool has a
  daemon holding its pipes: the call still ends, its tree dies (issue 17 item 2).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

import helper_tools
import pytest
from conftest import REPO, require_abi

import sandlock
from sandlock import forkserver, nativeexec
from sandlock.errors import CallError, SetupError

TESTS = str(REPO / "tests")
PY = {"extends": ["python"], "filesystem": {"read": [TESTS]}}


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "the Python API")


@pytest.fixture(scope="module")
def box() -> Iterator[sandlock.Sandbox]:
    with sandlock.Sandbox(PY) as sandbox:
        yield sandbox


# ----------------------------------------------------------------------------
# A forged setup report (issue 12 item 4)


def test_a_tool_cannot_forge_a_setup_failure(box: sandlock.Sandbox) -> None:
    """The tool writes a setup report on every descriptor and exits 125: the caller
    says the function exited with 125 before returning, not "setup failed"."""
    for _ in range(2):  # a spare prepared ahead, then one made at the call
        with pytest.raises(CallError) as caught:
            box.call(helper_tools.forge_setup_report)
        assert not isinstance(caught.value, SetupError)
        assert "forged" not in str(caught.value)
        assert ("malformed result" in str(caught.value)  # it wrote its result pipe too
                or "exited with code 125 before returning a result" in str(caught.value))


def test_a_tool_cannot_send_a_setup_error_as_its_result(box: sandlock.Sandbox) -> None:
    """A SetupError rebuilt from the result pipe is the tool's word: a CallError."""
    with pytest.raises(CallError) as caught:
        box.call(helper_tools.forge_setup_error)
    assert not isinstance(caught.value, SetupError)
    assert "SetupError" in str(caught.value)


def test_a_real_setup_failure_is_still_reported(box: sandlock.Sandbox,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The trusted channel still works: a working directory the confined process cannot
    enter is a SetupError (from the spare's setup, before the function runs)."""
    monkeypatch.setattr(os, "getcwd", lambda: "/nonexistent/sandlock-test")
    for _ in range(2):
        with pytest.raises(SetupError, match="cannot change directory"):
            box.call(helper_tools.forge_setup_report)
