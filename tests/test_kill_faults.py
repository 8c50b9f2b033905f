"""Killing sandlock's own processes never lets a tool's process tree outlive its limits.

An operator or a crash may SIGKILL the `sandlock run` launcher, the native helper
(sandlock-exec: its server, or its whole process group) or the caller. Whatever dies,
no process of the tool survives, a call whose command had started is reported as
started (never "not started"), and a request that no supervisor took is sent again.

Every tool process here carries a marker in its argv (a ``sleep`` of ``300.<digits>``
seconds); survivors are found by it in /proc and killed in a ``finally``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import POLICIES, eventually, require_abi, require_native

import sandlock
from sandlock.exec import native as nativeexec


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "confinement")


@pytest.fixture
def marker() -> Iterator[str]:
    """A ``sleep`` duration unique to this test; whatever carries it is killed at the end."""
    mark = f"300.{secrets.randbelow(10**9):09d}"
    try:
        yield mark
    finally:
        for pid in marked(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def marked(mark: str) -> list[int]:
    """Live (not zombie) processes whose argv contains ``mark``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
            with open(f"/proc/{name}/stat") as handle:
                state = handle.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if mark.encode() in argv and state != "Z":
            found.append(int(name))
    return found


def daemon_script(mark: str) -> str:
    """A tool that leaves a setsid'd daemon (its own session, re-parented on its
    parent's death), then waits itself: two processes carrying ``mark``."""
    return f"setsid -f sleep {mark}; exec sleep {mark}"


def _in_thread(target: Any) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


# ----------------------------------------------------------------------------
# The native helper (Sandbox.run)


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    require_native()
    monkeypatch.setenv("SANDLOCK_NATIVE", "1")
    yield
    nativeexec.shutdown()


@pytest.mark.parametrize("processes", [None, 64], ids=["no-cgroup", "processes"])
def test_killing_the_native_helpers_group_loses_no_call(
        tmp_path: Path, marker: str, native: None, processes: int | None) -> None:
    """kill -9 of sandlock-exec's process group while calls run: each call still ends
    (by its timeout, reported as such, never "not started") and no daemon survives."""
    policy: dict[str, Any] = {"extends": ["shell"]}
    if processes:
        policy["limits"] = {"processes": processes}
    with sandlock.Sandbox(policy, vars={"workspace": str(tmp_path)}, timeout=3,
                          best_effort=True) as box:
        calls = [_in_thread(lambda: box.run(["/bin/sh", "-c", daemon_script(marker)]))
                 for _ in range(3)]
        assert eventually(lambda: len(marked(marker)) == 6, 30), marked(marker)
        os.killpg(nativeexec.get().pid, signal.SIGKILL)
        for thread, _ in calls:
            thread.join(60)
            assert not thread.is_alive(), "a call outlived its timeout after its helper died"
    for _, outcome in calls:
        result = outcome.get("value")
        assert isinstance(result, sandlock.Result), outcome
        assert result.outcome is not sandlock.Outcome.NOT_STARTED, result
    assert eventually(lambda: not marked(marker), 15), f"survivors: {marked(marker)}"


def _idle_supervisor(server: nativeexec.Server) -> int:
    """The server's only child once no call runs: its idle supervisor."""
    found: list[int] = []

    def one() -> bool:
        found[:] = server.children()
        return len(found) == 1
    assert eventually(one, 10), found
    return found[0]


def test_a_killed_idle_supervisor_fails_no_call(tmp_path: Path, native: None) -> None:
    """The idle supervisor (forked ahead of the next request) is killed, and a call is
    submitted at once: a request it never took is sent again; the call succeeds."""
    with sandlock.Sandbox("shell", vars={"workspace": str(tmp_path)}) as box:
        assert box.run(["/bin/true"]).ok
        failed = []
        for _ in range(60):
            os.kill(_idle_supervisor(nativeexec.get()), signal.SIGKILL)
            result = box.run(["/bin/true"])
            if not result.ok:
                failed.append(result)
    assert not failed, f"{len(failed)} of 60 calls failed: {failed[0]}"


# ----------------------------------------------------------------------------
# The `sandlock run` launcher


NO_GROUP = """\
version = 1
extends = ["base"]
[filesystem]
write = ["${workspace}"]
exec = ["/usr/bin"]
[env]
pass = ["PATH"]
"""


@pytest.mark.parametrize("target", ["launcher", "group"])
@pytest.mark.parametrize("policy", ["no-cgroup", "processes"])
def test_killing_the_launcher_leaves_no_tool_process(
        tmp_path: Path, marker: str, target: str, policy: str) -> None:
    """kill -9 of `sandlock run` (its pid, or its whole process group) while the tool and
    a setsid'd daemon of it run: neither survives it."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    if policy == "processes":
        path = POLICIES / "shell.toml"  # [limits] processes: a pids cgroup where allowed
    else:
        path = tmp_path / "policy.toml"
        path.write_text(NO_GROUP)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "sandlock", "run", "--policy", str(path), "--var",
         f"workspace={workspace}", "--timeout", "60", "--", "/bin/sh", "-c",
         daemon_script(marker)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert eventually(lambda: len(marked(marker)) == 2 or launcher.poll() is not None, 30)
        assert launcher.poll() is None, launcher.communicate()
        if target == "group":
            os.killpg(launcher.pid, signal.SIGKILL)
        else:
            launcher.kill()
        launcher.wait(30)
        assert eventually(lambda: not marked(marker), 15), f"survivors: {marked(marker)}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(30)
        assert launcher.stderr is not None
        launcher.stderr.close()
