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
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import POLICIES, eventually, in_thread, parent, require_abi, require_native

import sandlock
from sandlock.exec import native as nativeexec
from sandlock.linux import process


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


def no_pids_cgroup() -> bool:
    """Whether this caller has no pids cgroup to create (then `processes` is RLIMIT_NPROC)."""
    from sandlock.linux import cgroups

    return cgroups.find()[0] is None


def daemon_script(mark: str) -> str:
    """A tool that leaves a setsid'd daemon (its own session, re-parented on its
    parent's death), then waits itself: two processes carrying ``mark``."""
    return f"setsid -f sleep {mark}; exec sleep {mark}"


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
        if os.getuid() != 0 and no_pids_cgroup():
            # RLIMIT_NPROC stands in, and counts every task of this user (a long test run
            # has many): leave the tools their 64 beyond what this user runs already.
            processes += process.user_tasks(os.getuid())
        policy["limits"] = {"processes": processes}
    with sandlock.Sandbox(policy, vars={"workspace": str(tmp_path)}, timeout=3,
                          best_effort=True) as box:
        calls = [in_thread(lambda: box.run(["/bin/sh", "-c", daemon_script(marker)]))
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


def test_a_call_whose_supervisor_is_killed_is_reported_killed(tmp_path: Path, marker: str,
                                                             native: None) -> None:
    """kill -9 of the supervisor of a running call: the command had started, so the call
    is reported killed (SIGKILL), not "not started"; its daemon does not survive."""
    with sandlock.Sandbox("shell", vars={"workspace": str(tmp_path)}, timeout=30) as box:
        thread, outcome = in_thread(lambda: box.run(["/bin/sh", "-c", daemon_script(marker)]))
        assert eventually(lambda: len(marked(marker)) == 2, 30), marked(marker)
        supervisors = {parent(pid) for pid in marked(marker)}
        assert len(supervisors) == 1, supervisors  # the subreaper of the call's tree
        os.kill(supervisors.pop(), signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive()
    result = outcome.get("value")
    assert isinstance(result, sandlock.Result), outcome
    assert result.outcome is sandlock.Outcome.SIGNALLED and result.signal == signal.SIGKILL, result
    assert eventually(lambda: not marked(marker), 15), f"survivors: {marked(marker)}"


def _kill_idle_supervisor(server: nativeexec.Server) -> None:
    """SIGKILL the server's only child once no call runs: its idle supervisor.

    Until the server has read the note of the supervisor that served the last call, that
    supervisor may be its only child, exiting: a pid that is gone by the kill is looked
    for again."""
    found: list[int] = []

    def one() -> bool:
        found[:] = server.children()
        return len(found) == 1
    for _ in range(20):
        assert eventually(one, 10), found
        try:
            os.kill(found[0], signal.SIGKILL)
            return
        except ProcessLookupError:
            continue
    raise AssertionError(f"no idle supervisor stayed to be killed: {found}")


def test_a_killed_idle_supervisor_fails_no_call(tmp_path: Path, native: None) -> None:
    """The idle supervisor (forked ahead of the next request) is killed, and a call is
    submitted at once: a request it never took is sent again; the call succeeds."""
    with sandlock.Sandbox("shell", vars={"workspace": str(tmp_path)}) as box:
        assert box.run(["/bin/true"]).ok
        failed = []
        for _ in range(60):
            _kill_idle_supervisor(nativeexec.get())
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


def _run_tool(tmp_path: Path, script: str, scope: bool = True) -> subprocess.CompletedProcess[str]:
    """``script`` under the shell profile; ``scope=False``: a policy that gives up the
    signal scope (no Landlock scope, no signal gate: the tool may signal the user's
    processes), accepted with --best-effort."""
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    policy, extra = POLICIES / "shell.toml", []
    if not scope:
        policy = tmp_path / "unscoped.toml"
        policy.write_text(f'version = 1\nextends = ["{POLICIES / "shell.toml"}"]\n'
                          "[scope]\nsignals = false\n")
        extra = ["--best-effort"]
    return subprocess.run(
        [sys.executable, "-m", "sandlock", "run", *extra, "--policy", str(policy),
         "--var", f"workspace={workspace}", "--timeout", "20", "--", "/bin/sh", "-c", script],
        capture_output=True, text=True, timeout=60)


def test_the_tool_cannot_kill_or_stop_its_watchdog(tmp_path: Path, marker: str) -> None:
    """The watchdog (the tool's parent) is outside the tool's sandbox: the signal scope
    (Landlock at ABI 6, the signal gate below) refuses the tool's SIGKILL and SIGSTOP to
    it (EPERM)."""
    result = _run_tool(tmp_path, 'kill -STOP $PPID; echo "stop=$?"; kill -9 $PPID; echo "kill=$?"')
    assert result.returncode == 0, result.stderr
    assert "stop=1" in result.stdout and "kill=1" in result.stdout, result.stdout


def test_without_the_signal_scope_a_killed_watchdog_still_leaves_no_tool_process(
        tmp_path: Path, marker: str) -> None:
    """Positive control of the test above, and what holds without the signal scope: the
    tool kills its watchdog (it can), yet its daemon does not survive the run: the tool
    dies with its parent (PR_SET_PDEATHSIG) and the launcher, the subreaper above, reaps
    the rest."""
    script = f"setsid -f sleep {marker}; kill -9 $PPID; exec sleep {marker}"
    result = _run_tool(tmp_path, script, scope=False)
    # 137, not 124 after the timeout: the watchdog died, and the tool with it
    assert result.returncode == 128 + signal.SIGKILL, (result.returncode, result.stderr)
    assert eventually(lambda: not marked(marker), 15), f"survivors: {marked(marker)}"


AGENT = """
import sys, sandlock
with sandlock.Sandbox("shell", vars={"workspace": sys.argv[1]}, timeout=60) as box:
    box.run(["/bin/sh", "-c", sys.argv[2]])
"""


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "fork-server"])
def test_killing_the_agent_leaves_no_tool_process(tmp_path: Path, marker: str,
                                                  native: str) -> None:
    """kill -9 of the agent (the API's caller) in the middle of a run."""
    if native == "1":
        require_native()
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path), daemon_script(marker)],
                             env={**os.environ, "SANDLOCK_NATIVE": native},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert eventually(lambda: len(marked(marker)) == 2 or agent.poll() is not None, 30)
        assert agent.poll() is None, agent.communicate()
        agent.kill()
        agent.wait(30)
        assert eventually(lambda: not marked(marker), 15), f"survivors: {marked(marker)}"
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(30)
        assert agent.stderr is not None
        agent.stderr.close()


def test_a_request_is_taken_only_when_a_supervisor_says_so() -> None:
    """What ``spawn`` reads from a call's socket before it returns: ``T`` (consumed) or a
    refusal (left for the caller) mean taken; an end without either means the request
    was lost unread, and is sent again."""
    import socket

    for said, taken, left in ((b"T", True, b""), (b"F 125 SetupError\nno", True, b"F 125"),
                              (b"", False, b"")):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, theirs:
            if said:
                theirs.send(said)
            theirs.close()
            assert nativeexec._taken(ours, 5) is taken, said
            assert ours.recv(5, socket.MSG_DONTWAIT) == left
