"""The Python API's native path (sandlock-exec, sandlock/exec/native.py) on the real kernel.

Each confinement check runs through both paths: ``native`` (posix_spawn of the C
helper) and ``forkserver`` (SANDLOCK_NATIVE=0), so the two cannot drift apart.
The helper is built at install time; without it these tests skip, unless
SANDLOCK_EXPECT_NATIVE=1 says it must be there (CI).
"""

from __future__ import annotations

import array
import json
import os
import resource
import secrets
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import PYTHON, REPO, alive, eventually, parent, proc_state, require_abi, require_native

import sandlock
from sandlock.api.sandbox import Outcome
from sandlock.exec import native as nativeexec
from sandlock.exec import spec
from sandlock.exec.forkserver import children_of
from sandlock.linux import process

TESTS = str(REPO / "tests")


@pytest.fixture(autouse=True)
def _requirements() -> None:
    require_abi(1, "the Python API")
    require_native()


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


# ----------------------------------------------------------------------------
# The native path is the one taken


def test_commands_run_under_the_native_helper(native: None, box: sandlock.Sandbox) -> None:
    """The command's parent is a sandlock-exec supervisor forked by this process's
    server, which is this process's child."""
    with box.popen(["/bin/sh", "-c", "read x"], stdin=sandlock.PIPE) as proc:
        supervisor = parent(proc.pid)
        assert os.readlink(f"/proc/{supervisor}/exe") == nativeexec.HELPER
        assert parent(supervisor) == nativeexec.get().pid
        assert nativeexec.get().pid in process.children()
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


@pytest.mark.parametrize("abi", ["0", "1"])
def test_the_supervisor_times_out_a_run_without_its_own_ruleset_or_gate(
        native: None, workspace: Path, monkeypatch: pytest.MonkeyPatch, abi: str) -> None:
    """The supervisor closes the descriptors it was given once the command runs, and
    only those: with no ruleset (SANDLOCK_ABI=0, best effort) its signalfd took the
    ruleset's number and was closed with them, so it spun on a dead descriptor and its
    timeout never fired (the caller's grace period ended the call, unreported: signal
    None). Control: with a ruleset (ABI 1) the same run reports the supervisor's kill."""
    monkeypatch.setenv("SANDLOCK_ABI", abi)
    policy = {"extends": ["base"], "filesystem": {"exec": ["/usr/bin/sleep"]}}
    with sandlock.Sandbox(policy, best_effort=True) as sandbox:
        assert (sandbox._compiled.ruleset_fd >= 0) == (abi != "0")
        result = sandbox.run(["/usr/bin/sleep", "30"], timeout=0.3)
    assert (result.returncode, result.outcome, result.signal) == (124, Outcome.TIMED_OUT, 9)


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
# The server: one per caller process, supervisors forked from it


def only_the_idle_supervisor() -> bool:
    """The server's one child is its idle supervisor: forked ahead, with no child."""
    idle = children_of(nativeexec.get().pid)
    return len(idle) == 1 and children_of(idle[0]) == []


def test_the_server_is_started_once_and_reused(native: None, box: sandlock.Sandbox) -> None:
    """Calls fork supervisors from one server: no new process of the caller's, no exec."""
    box.run(["/usr/bin/true"])
    server = nativeexec.get().pid
    children = process.children()
    assert server in children and os.readlink(f"/proc/{server}/exe") == nativeexec.HELPER
    supervisors = set()
    for _ in range(5):
        with box.popen(["/bin/sh", "-c", "read x"], stdin=sandlock.PIPE) as proc:
            supervisor = parent(proc.pid)
            assert parent(supervisor) == server
            supervisors.add(supervisor)
            proc.communicate(b"\n")
        assert box.run(["/usr/bin/true"]).returncode == 0
    assert len(supervisors) == 5  # one supervisor per call
    assert nativeexec.get().pid == server and process.children() == children


def test_a_killed_server_is_replaced_and_its_calls_go_on(native: None,
                                                         box: sandlock.Sandbox) -> None:
    proc = box.popen(["/bin/sh", "-c", "read x; exit 5"], stdin=sandlock.PIPE)
    old = nativeexec.get().pid
    assert eventually(lambda: len(children_of(old)) == 2)  # the call's supervisor, the next idle one
    idle = (set(children_of(old)) - {parent(proc.pid)}).pop()
    os.kill(old, signal.SIGKILL)
    # The idle supervisor dies with it (PR_SET_PDEATHSIG): nothing holds its socket any more.
    assert eventually(lambda: proc_state(old) in ("Z", "gone") and proc_state(idle) in ("Z", "gone"))
    with proc:
        assert proc.poll() is None  # the supervisor does not depend on the server
        proc.communicate(b"\n")
    assert proc.returncode == 5
    result = box.run(["/bin/sh", "-c", "echo again"], capture_output=True)
    assert (result.returncode, result.stdout) == (0, b"again\n")
    assert nativeexec.get().pid != old
    assert proc_state(old) == "gone"  # reaped by the restart


def test_a_forked_caller_gets_its_own_server(native: None, box: sandlock.Sandbox) -> None:
    box.run(["/usr/bin/true"])
    server = nativeexec.get().pid
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through the pipe; it never returns to pytest
        code = 1
        try:
            os.close(report_r)
            result = box.run(["/bin/sh", "-c", "echo child"], capture_output=True)
            own = nativeexec.get().pid
            ok = (result.stdout == b"child\n" and own != server and parent(own) == os.getpid())
            os.write(report_w, b"ok" if ok else repr((result, own, server)).encode())
            nativeexec.shutdown()
            code = 0
        finally:
            os._exit(code)
    os.close(report_w)
    with os.fdopen(report_r, "rb") as report:
        assert report.read() == b"ok"
    assert os.waitpid(pid, 0)[1] == 0
    result = box.run(["/bin/sh", "-c", "echo parent"], capture_output=True)
    assert result.stdout == b"parent\n" and nativeexec.get().pid == server


def test_a_server_that_cannot_fork_refuses_at_once(native: None, box: sandlock.Sandbox) -> None:
    """No idle supervisor (fork fails: RLIMIT_NPROC): the call fails with 125 instead of waiting."""
    if os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC does not apply to root (CAP_SYS_RESOURCE)")
    assert box.run(["/usr/bin/true"]).returncode == 0  # the server and its idle supervisor are up
    server = nativeexec.get().pid
    deadline = time.monotonic() + 10  # the next idle supervisor is forked as the last call runs
    while not nativeexec.get().children() and time.monotonic() < deadline:
        time.sleep(0.01)
    unlimited = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.prlimit(server, resource.RLIMIT_NPROC, (0, unlimited[1]))
    try:
        assert box.run(["/usr/bin/true"]).returncode == 0  # the idle supervisor forked before
        refused = box.run(["/usr/bin/true"])
        assert (refused.returncode, refused.outcome) == (125, Outcome.NOT_STARTED)
        assert "cannot fork a supervisor" in str(refused.error), refused.error
    finally:
        resource.prlimit(server, resource.RLIMIT_NPROC, unlimited)
    assert box.run(["/usr/bin/true"]).returncode == 0 and nativeexec.get().pid == server


def test_a_megabyte_of_argv_and_environment_round_trips(native: None,
                                                        box: sandlock.Sandbox) -> None:
    """Requests above INLINE_LIMIT travel in a memfd; every byte arrives."""
    env = {f"SANDLOCK_BIG_{i}": secrets.token_hex(32 * 1024) + "=\u00e9" for i in range(8)}
    args = [secrets.token_hex(32 * 1024) + " \u00e9" for _ in range(8)]
    assert sum(map(len, [*env.values(), *args])) > 1 << 20
    code = ("import json, os, sys; json.dump([sys.argv[1:], {k: v for k, v in os.environ.items()"
            " if k.startswith('SANDLOCK_BIG_')}], sys.stdout)")
    result = box.run([PYTHON, "-c", code, *args], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [args, env]


def test_a_nul_inside_an_argument_is_refused(native: None, box: sandlock.Sandbox) -> None:
    """A NUL would end the string early and shift the rest of the request."""
    with pytest.raises(ValueError, match="null byte"):
        box.run(["/bin/sh", "-c", "echo a\0b"])
    assert box.run(["/usr/bin/true"]).returncode == 0


def test_the_server_holds_none_of_the_callers_memory(native: None,
                                                     box: sandlock.Sandbox) -> None:
    """The server is an exec'd image: a secret in the caller's memory is not in its."""
    secret = ("SANDLOCKSERVER" + secrets.token_hex(16)).encode()
    held = bytearray(secret * 1000)  # noqa: F841 - in this process's memory
    box.run(["/usr/bin/true"])
    server = nativeexec.get().pid
    assert os.readlink(f"/proc/{server}/exe") == nativeexec.HELPER
    scanned = 0
    with open(f"/proc/{server}/maps") as maps, open(f"/proc/{server}/mem", "rb") as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("r") or line.rstrip().endswith("[vvar]"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            mem.seek(start)
            try:
                data = mem.read(end - start)
            except OSError:
                continue
            scanned += len(data)
            assert secret not in data
    assert 0 < scanned < 4 << 20  # a few pages, not a copy of this interpreter


def request(data: bytes, nfds: int = 4) -> bytes:
    """Send a raw request with a call socket (and nfds - 1 more fds); return the answer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, open(os.devnull, "rb") as null:
        ours.send(b"\0" * 8)  # as spawn() does: the BPF comes first, unread if refused
        try:
            nativeexec.get().submit(data, [theirs.fileno(), *[null.fileno()] * (nfds - 1)])
        finally:
            theirs.close()
        ours.settimeout(10)
        return ours.recv(4096)


#: The least a request's step list must hold (sandlock/exec/spec.py).
STEPS = ["session", "parent", "signals", "stdio", "caps", "cloexec", "nnp", "seccomp", "exec"]


def counts(args: list[str], env: list[str] = [], steps: list[str] = STEPS,  # noqa: B006
           version: int = spec.VERSION) -> bytes:
    strings = b"".join(s.encode() + b"\0" for s in [*steps, *args, *env])
    return struct.pack("=IIII", version, len(steps), len(args), len(env)) + strings


TRUE = ["--", "/bin/true", "true"]


@pytest.mark.parametrize("data, nfds, why", [
    (b"garbage", 4, "malformed request"),
    (struct.pack("=IIII", spec.VERSION, 1000, 0, 0) + b"x\0", 4, "malformed request"),
    (struct.pack("=IIII", spec.VERSION, 1, 0, 0) + b"no terminating NUL", 4, "malformed request"),
    (counts(TRUE) + b"trailing", 4, "malformed request"),
    (struct.pack("=IIII", 0, 0, 0, 0), 4, "reading the request's memfd"),
    (counts(TRUE), 2, "file descriptors"),
    (counts(TRUE, steps=[*STEPS[:7], "landlock", *STEPS[7:]]), 4, "file descriptors"),
    (counts(["-x", *TRUE]), 4, "bad arguments"),
    (counts(["--"]), 4, "no command"),
    (counts(TRUE), 1, "file descriptors"),
    # The step list: an old or future version, an unknown step, a missing or misplaced one.
    (counts(TRUE, version=1), 4, "another wire version"),
    (counts(TRUE, version=spec.VERSION + 1), 4, "another wire version"),
    (counts(TRUE, steps=[*STEPS[:-1], "trace", "exec"]), 4, "does not implement the confinement step"),
    (counts(TRUE, steps=[*STEPS[:-1], "notify", "exec"]), 4, "file descriptors"),
    (counts(TRUE, steps=[s for s in STEPS if s != "seccomp"]), 4, "without caps, cloexec, nnp, seccomp"),
    (counts(TRUE, steps=[s for s in STEPS if s != "exec"]), 4, "without caps, cloexec, nnp, seccomp"),
    (counts(TRUE, steps=["exec", *STEPS[:-1]]), 4, "out of order"),
    (counts(TRUE, steps=["cgroup", *STEPS]), 4, "cgroup step and -p go together"),
    (counts(TRUE, steps=[*STEPS[:4], "chdir", *STEPS[4:]]), 4, "chdir without a directory"),
    (counts(TRUE, steps=[*STEPS[:4], "rlimit=7", *STEPS[4:]]), 4, "bad rlimit step"),
    (counts(TRUE, steps=[*STEPS[:-1], "exec=/bin/sh"]), 4, "takes no argument has one"),
])
def test_a_malformed_request_is_refused_and_the_server_survives(
        native: None, box: sandlock.Sandbox, data: bytes, nfds: int, why: str) -> None:
    box.run(["/usr/bin/true"])
    server = nativeexec.get().pid
    answer = request(data, nfds)
    assert answer.startswith(b"F 125 SetupError\nsandlock-exec: ") and why.encode() in answer
    assert nativeexec.get().pid == server and proc_state(server) not in ("Z", "gone")
    assert box.run(["/usr/bin/true"]).returncode == 0


def test_an_oversized_or_fdless_request_does_not_hurt_the_server(native: None,
                                                                 box: sandlock.Sandbox) -> None:
    box.run(["/usr/bin/true"])
    server = nativeexec.get()
    server._sock.send(b"no call socket to answer on")  # dropped
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        ours.send(b"\0" * 8)
        server._sock.sendmsg([b"x" * (65 * 1024)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                     array.array("i", [theirs.fileno()]))])
        theirs.close()
        ours.settimeout(10)
        assert ours.recv(4096).startswith(b"F 125 SetupError\nsandlock-exec: request too large")
    assert box.run(["/usr/bin/true"]).returncode == 0 and nativeexec.get() is server


# ----------------------------------------------------------------------------
# Hygiene under load (native path)


def test_a_thousand_calls_from_eight_threads_leak_nothing(native: None,
                                                          box: sandlock.Sandbox) -> None:
    box.run(["/usr/bin/true"])
    fds_before = sorted(os.listdir("/proc/self/fd"))
    children_before = process.children()
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
                    result = box.run(["/usr/bin/true"])
                    assert result.returncode == 0, (result.outcome, str(result.error))
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                failures.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [], "\n".join(failures[:3])
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert process.children() == children_before  # no new server or zombie
    assert len(daemons) == 100 and not any(alive(pid) for pid in daemons)
    # Supervisors exit after their report: the server is left with its idle supervisor only.
    assert eventually(only_the_idle_supervisor), nativeexec.get().children()


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
