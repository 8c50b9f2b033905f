"""The Python API's native path (sandlock-exec, sandlock/nativeexec.py) on the real kernel.

Each confinement check runs through both paths: ``native`` (posix_spawn of the C
helper) and ``forkserver`` (SANDLOCK_NATIVE=0), so the two cannot drift apart.
The helper is built at install time; without it these tests skip, unless
SANDLOCK_EXPECT_NATIVE=1 says it must be there (CI).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import PYTHON, REPO, require_abi

import sandlock
from sandlock import launcher, nativeexec
from sandlock.api import Outcome

TESTS = str(REPO / "tests")


@pytest.fixture(autouse=True)
def _requirements() -> None:
    require_abi(1, "the Python API")
    if not nativeexec.AVAILABLE:
        message = f"{nativeexec.HELPER} is not built (no C compiler at install time?)"
        if os.environ.get("SANDLOCK_EXPECT_NATIVE") == "1":
            pytest.fail(f"{message}, but SANDLOCK_EXPECT_NATIVE=1")
        pytest.skip(message)


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOCK_NATIVE", "1")


@pytest.fixture(params=["native", "forkserver"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("SANDLOCK_NATIVE", "1" if request.param == "native" else "0")
    return str(request.param)


@pytest.fixture
def box(workspace: Path) -> Iterator[sandlock.Sandbox]:
    policy = {"extends": ["python"],
              "filesystem": {"read": [TESTS, "/proc"], "write": [str(workspace)],
                             "exec": ["/bin/sh", "/usr/bin/true", "/usr/bin/sleep"]}}
    with sandlock.Sandbox(policy) as sandbox:
        yield sandbox


def probe(box: sandlock.Sandbox, code: str, **options: Any) -> sandlock.Result:
    """Run ``code`` with the system python3, confined; it prints what happened."""
    return box.run([PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                   **options)


ERRNO = """
import errno, os, socket, sys
try:
    {body}
    print("OK")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


def attempt(box: sandlock.Sandbox, body: str) -> str:
    result = probe(box, ERRNO.format(body=body))
    assert result.returncode == 0, result
    return str(result.stdout).strip()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------
# The native path is the one taken


def test_commands_run_under_the_native_helper(native: None, box: sandlock.Sandbox) -> None:
    """The command's parent is a sandlock-exec that is this process's child."""
    with box.popen(["/bin/sh", "-c", "read x"], stdin=sandlock.PIPE) as proc:
        with open(f"/proc/{proc.pid}/stat") as handle:
            helper = int(handle.read().rsplit(")", 1)[1].split()[1])
        assert os.readlink(f"/proc/{helper}/exe") == nativeexec.HELPER
        assert helper in launcher.children()
        proc.communicate(b"\n")
    assert proc.returncode == 0


# ----------------------------------------------------------------------------
# Confinement, through both paths


def test_read_outside_is_denied(path: str, box: sandlock.Sandbox, outside: Path) -> None:
    assert attempt(box, f"open({str(outside / 'secret.txt')!r}).read()") == "EACCES"
    assert attempt(box, f"open({TESTS + '/conftest.py'!r}).read()") == "OK"


def test_exec_outside_is_refused_with_126(path: str, box: sandlock.Sandbox) -> None:
    result = box.run(["/usr/bin/id"], capture_output=True)
    assert (result.returncode, result.outcome) == (126, Outcome.NOT_STARTED)
    assert isinstance(result.error, sandlock.ExecError) and result.stdout == b""
    missing = box.run(["/no/such/binary"])
    assert (missing.returncode, missing.outcome) == (127, Outcome.NOT_STARTED)


def test_setup_failure_is_125(path: str, box: sandlock.Sandbox, tmp_path: Path) -> None:
    result = box.run(["/usr/bin/true"], cwd=str(tmp_path / "gone"))
    assert (result.returncode, result.outcome) == (125, Outcome.NOT_STARTED)
    assert isinstance(result.error, sandlock.SetupError) and "gone" in str(result.error)


@pytest.mark.parametrize("family", ["AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"])
def test_socket_families_are_denied(path: str, box: sandlock.Sandbox, family: str) -> None:
    kind = "SOCK_RAW" if family in ("AF_NETLINK", "AF_PACKET") else "SOCK_STREAM"
    assert attempt(box, f"socket.socket(socket.{family}, socket.{kind})") == "EPERM"


def test_signal_to_an_outside_process_is_denied(path: str, box: sandlock.Sandbox) -> None:
    require_abi(6, "signal scope")
    with subprocess.Popen(["sleep", "600"]) as bystander:
        try:
            assert attempt(box, f"os.kill({bystander.pid}, 15)") == "EPERM"
            assert attempt(box, f"os.kill({os.getpid()}, 15)") == "EPERM"  # the caller
            assert bystander.poll() is None
        finally:
            bystander.kill()


def test_environment_is_scrubbed(path: str, box: sandlock.Sandbox,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOCK_TEST_API_KEY", "sk-do-not-leak")
    result = probe(box, "import os; print(sorted(os.environ))", env={"GIVEN": "1"})
    assert "SANDLOCK_TEST_API_KEY" not in result.stdout and "'GIVEN'" in result.stdout


def test_inherited_fd_is_not_usable(path: str, box: sandlock.Sandbox, outside: Path) -> None:
    fd = os.open(outside / "secret.txt", os.O_RDONLY)
    os.set_inheritable(fd, True)  # a careless caller's fd, open on a denied file
    try:
        assert attempt(box, f"os.read({fd}, 100)") == "EBADF"
    finally:
        os.close(fd)


def test_callers_memory_is_out_of_reach(path: str, box: sandlock.Sandbox) -> None:
    """Neither the supervisor (the command's parent) nor the caller can be read."""
    secret = "SANDLOCKNATIVE" + secrets.token_hex(16)
    held = bytearray(secret.encode() * 1000)  # noqa: F841 - in this process's memory
    code = f"""
        import errno, os
        supervisor = os.getppid()
        with open(f"/proc/{{supervisor}}/stat") as handle:
            caller = int(handle.read().rsplit(")", 1)[1].split()[1])
        for pid in (supervisor, caller):
            for name in ("mem", "environ"):
                try:
                    with open(f"/proc/{{pid}}/{{name}}", "rb") as handle:
                        print(pid, name, {secret!r}.encode() in handle.read())
                except OSError as exc:
                    print(pid, name, errno.errorcode[exc.errno])
        """
    result = probe(box, code)
    assert result.returncode == 0, result
    lines = result.stdout.split("\n")[:-1]
    assert len(lines) == 4 and secret not in result.stdout
    assert all(line.split()[2] in ("EACCES", "EPERM") for line in lines), lines


def test_timeout_kills_a_setsid_grandchild(path: str, box: sandlock.Sandbox,
                                           workspace: Path) -> None:
    pidfile = workspace / "daemon.pid"
    result = box.run([PYTHON, "-c", f"import sys; sys.path.insert(0, {TESTS!r}); import api_tools;"
                      f" api_tools.sleep_with_daemon({str(pidfile)!r})"], timeout=0.5)
    assert (result.returncode, result.outcome, result.signal) == (124, Outcome.TIMED_OUT, 9)
    assert not alive(int(pidfile.read_text())), "the setsid'd grandchild survived"


def test_signals_and_kill_reach_the_tree(path: str, box: sandlock.Sandbox) -> None:
    proc = box.popen(["/bin/sh", "-c", "trap 'exit 7' USR1; while :; do sleep 0.05; done"])
    time.sleep(0.2)  # let the shell install its trap (not a timing assertion)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait() == 7
    daemonized = box.popen(["/bin/sh", "-c", "sleep 60 & exec sleep 60"])
    daemonized.kill()
    assert daemonized.wait() == 137 and daemonized.result is not None
    assert daemonized.result.outcome is Outcome.SIGNALLED


# ----------------------------------------------------------------------------
# Hygiene under load (native path)


def test_a_thousand_calls_from_eight_threads_leak_nothing(native: None,
                                                          box: sandlock.Sandbox) -> None:
    box.run(["/usr/bin/true"])
    fds_before = sorted(os.listdir("/proc/self/fd"))
    children_before = launcher.children()
    failures: list[str] = []
    daemons: list[int] = []
    counter = iter(range(1000))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            try:
                if index % 10 == 0:
                    result = box.run(["/bin/sh", "-c", "sleep 30 & echo $0 $!", str(index)],
                                     capture_output=True)  # leaves a daemon behind
                    echoed, daemon = result.stdout.split()
                    assert echoed == str(index).encode(), result
                    daemons.append(int(daemon))
                else:
                    assert box.run(["/usr/bin/true"]).returncode == 0
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                failures.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert launcher.children() == children_before  # no helper or zombie left
    assert len(daemons) == 100 and not any(alive(pid) for pid in daemons)


def test_a_process_outlives_the_thread_that_started_it(native: None,
                                                       box: sandlock.Sandbox) -> None:
    """PR_SET_PDEATHSIG would fire when the starting thread exits: the helper does not
    use it, so a popen'd command keeps running under another thread."""
    started: list[sandlock.Process] = []
    thread = threading.Thread(target=lambda: started.append(
        box.popen(["/bin/sh", "-c", "read x; exit 5"], stdin=sandlock.PIPE)))
    thread.start()
    thread.join()
    with started[0] as proc:
        assert proc.poll() is None
        proc.communicate(b"\n")
    assert proc.returncode == 5


def test_the_callers_death_kills_the_tree(native: None, workspace: Path) -> None:
    """SIGKILL of the caller: its end of the socket closes, the helper kills the tree."""
    pids = workspace / "pids"
    script = f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        import sandlock
        box = sandlock.Sandbox({{"extends": ["python"], "filesystem": {{"write": [{str(workspace)!r}],
                               "exec": ["/bin/sh", "/usr/bin/sleep", "/usr/bin/setsid"]}}}})
        proc = box.popen(["/bin/sh", "-c", "setsid sleep 60 & echo $$ $! > {pids}; exec sleep 60"])
        while not os.path.exists({str(pids)!r}) or not open({str(pids)!r}).read().strip():
            time.sleep(0.01)
        print("ready", flush=True)
        time.sleep(60)
        """
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None and caller.stdout.readline() == "ready\n"
        tool = [int(p) for p in pids.read_text().split()]
        assert all(alive(pid) for pid in tool)
    finally:
        caller.kill()
        caller.wait()

    def gone() -> bool:
        return not any(alive(pid) for pid in tool)

    end = time.monotonic() + 10
    while not gone() and time.monotonic() < end:
        time.sleep(0.01)
    assert gone(), "the tool outlived its caller"
