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
import time
from pathlib import Path
from typing import Any, Iterator

import helper_tools
import pytest
from conftest import REPO, in_thread, require_abi

import sandlock
from sandlock.errors import CallError, SetupError
from sandlock.exec import forkserver
from sandlock.exec import native as nativeexec

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


# ----------------------------------------------------------------------------
# A helper process dies while a tool's daemon holds the call's pipes (issue 17 item 2)


def _gone(pid: int, within: float = 30.0) -> bool:
    """Whether ``pid`` has exited (or is a zombie) within a bounded wait."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _wait_for(path: Path, within: float = 30.0) -> None:
    end = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("policy", [PY, {**PY, "limits": {"processes": 64}}],
                         ids=["no-cgroup", "processes"])
def test_call_ends_and_its_daemon_dies_when_the_fork_server_dies(
        tmp_path: Path, policy: dict[str, Any]) -> None:
    pidfile, ready = tmp_path / "daemon.pid", tmp_path / "ready"
    with sandlock.Sandbox({**policy, "filesystem": {"read": [TESTS], "write": [str(tmp_path)]}},
                          best_effort=True, timeout=5) as box:
        thread, outcome = in_thread(
            lambda: box.call(helper_tools.daemon_on_stdout, str(pidfile), str(ready)))
        _wait_for(ready)
        _wait_for(pidfile)
        daemon = int(pidfile.read_text())
        _kill(forkserver.get().pid)
        thread.join(60)  # timeout 5 s (below) plus a margin; never asserted on
        assert not thread.is_alive(), "the call outlived its timeout after the fork server died"
    error = outcome.get("error")
    assert isinstance(error, sandlock.SandlockError), outcome
    assert not isinstance(error, SetupError) or "were killed" not in str(error)
    assert _gone(daemon), "the tool's daemon survived its call"


def _run_daemon(box: sandlock.Sandbox, tmp_path: Path) -> sandlock.Result:
    """A command that leaves a setsid'd daemon holding its stdout, then hangs."""
    pidfile, ready = tmp_path / "daemon.pid", tmp_path / "ready"
    script = (f'(setsid sh -c "echo \\$\\$ > {pidfile}; exec sleep 120" &); '
              f'while [ ! -s {pidfile} ]; do sleep 0.01; done; touch {ready}; exec sleep 120')
    return box.run(["/bin/sh", "-c", script], capture_output=True)


@pytest.mark.parametrize("native", [False, True], ids=["fork-server", "native"])
def test_run_ends_and_its_daemon_dies_when_its_server_dies(
        tmp_path: Path, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not nativeexec.enabled():
        pytest.skip("the native helper is not built")
    monkeypatch.setenv("SANDLOCK_NATIVE", "1" if native else "0")
    with sandlock.Sandbox("shell", vars={"workspace": str(tmp_path)}, timeout=5) as box:
        thread, outcome = in_thread(lambda: _run_daemon(box, tmp_path))
        _wait_for(tmp_path / "ready")
        daemon = int((tmp_path / "daemon.pid").read_text())
        _kill(nativeexec.get().pid if native else forkserver.get().pid)
        thread.join(60)
        assert not thread.is_alive(), "the run outlived its timeout after its server died"
    result = outcome.get("value")
    assert isinstance(result, sandlock.Result), outcome
    assert result.outcome in (sandlock.Outcome.TIMED_OUT, sandlock.Outcome.NOT_STARTED), result
    if result.error is not None:
        assert "were killed" not in str(result.error)
    assert _gone(daemon), "the command's daemon survived its run"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_caller_keeps_its_own_deadline_when_the_supervisor_stops(
        tmp_path: Path, mode: str) -> None:
    """A supervisor that stops answering (SIGSTOP) cannot hold the caller past the call's
    timeout: the call ends as timed out, on the caller's own clock."""
    import asyncio

    pidfile = tmp_path / "pids"
    with sandlock.Sandbox({**PY, "filesystem": {"read": [TESTS], "write": [str(tmp_path)]}},
                          timeout=3) as box:
        def call() -> Any:
            if mode == "async":
                return asyncio.run(box.call_async(helper_tools.report_supervisor, str(pidfile)))
            return box.call(helper_tools.report_supervisor, str(pidfile))

        thread, outcome = in_thread(call)
        _wait_for(pidfile)
        supervisor, tool = map(int, pidfile.read_text().split())
        os.kill(supervisor, signal.SIGSTOP)
        try:
            thread.join(60)
            assert not thread.is_alive(), "the call waited on a stopped supervisor"
        finally:
            os.kill(supervisor, signal.SIGCONT)
    assert isinstance(outcome.get("error"), sandlock.TimeoutExpired), outcome
    assert _gone(tool), "the tool outlived its call once its supervisor ran again"
