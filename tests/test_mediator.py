"""The API's host-allowlist mediation runs outside the agent's process (issue 12 item 6).

A tool under ``[network] allow`` talks to a proxy and a connect gate; their
parsing faces the tool. They run in a mediator process started for the call (a
clean exec, empty environment), so a tool flooding the proxy uses up the
mediator's descriptors, never the agent's, and at most MAX_CLIENTS of them.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import helper_tools
import pytest
from conftest import PYTHON, REPO, require_abi, require_native

import sandlock
from sandlock.net import listener

TESTS = str(REPO / "tests")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(4, "host allowlists (Landlock TCP rules)")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_tool_flooding_the_proxy_cannot_exhaust_the_agents_descriptors(tmp_path: Path) -> None:
    ready, release = tmp_path / "ready", tmp_path / "release"
    policy = {"extends": ["python"], "filesystem": {"read": [TESTS], "write": [str(tmp_path)]},
              "network": {"allow": ["example.test:443"]}}
    with sandlock.Sandbox(policy, timeout=120) as box:
        release.touch()
        box.call(helper_tools.flood_proxy, 0, str(ready), str(release))  # warm: spares, servers
        ready.unlink()
        release.unlink()
        before = _fds()
        outcome: dict[str, Any] = {}

        def flood() -> None:
            try:
                outcome["opened"] = box.call(helper_tools.flood_proxy, 2000, str(ready),
                                             str(release))
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome["error"] = exc

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        end = time.monotonic() + 120
        while not ready.exists() and thread.is_alive() and time.monotonic() < end:
            time.sleep(0.05)
        assert ready.exists(), outcome
        during = _fds()
        failures = 0
        opened = []
        for _ in range(200):  # the agent's own work goes on
            try:
                opened.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                failures += 1
        for fd in opened:
            os.close(fd)
        release.touch()
        thread.join(120)
        assert not thread.is_alive()
    assert failures == 0
    # The call's own pipes and sockets, not one per tool connection.
    assert during - before < 32, (before, during)
    assert outcome.get("opened") == 2000, outcome


def test_the_proxy_holds_at_most_the_cap_of_connections_with_a_report(tmp_path: Path) -> None:
    policy = {"extends": ["python"], "network": {"allow": ["example.test:443"]}}
    script = (f"import socket,os,urllib.parse as u,resource,time\n"
              f"s,h=resource.getrlimit(resource.RLIMIT_NOFILE);resource.setrlimit(resource.RLIMIT_NOFILE,(h,h))\n"
              f"p=u.urlsplit(os.environ['HTTP_PROXY'])\n"
              f"k=[socket.create_connection((p.hostname,p.port))"
              f" for _ in range({listener.MAX_CLIENTS + 50})]\n"
              f"time.sleep(1)\n")
    with sandlock.Sandbox({**policy, "extends": ["python"]}) as box:
        result = box.run(["/usr/bin/python3", "-I", "-S", "-c", script], capture_output=True)
    assert result.returncode == 0, result
    assert any(f"{listener.MAX_CLIENTS} are open (the limit per server)" in line
               for line in result.network_events), result.network_events


# ----------------------------------------------------------------------------
# One warm mediator per Sandbox, a proxy and a connect gate per call in it

#: give PATH: make a TCP socket (through the call's gate), hand it over a Unix socket at
#: PATH, wait until the taker is done. take PATH PORT: receive it and connect it to
#: 127.0.0.1:PORT (a port the policy grants); print 0 or the errno's name. both: the
#: two in one call (a forked child gives).
HAND_OVER = """
import array, errno, os, socket, sys, time
def give(path):
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(1)
    os.rename(path + ".tmp", path)
    peer, _ = server.accept()
    peer.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [tcp.fileno()]))])
    peer.recv(1)
def take(path, port):
    while not os.path.exists(path):
        time.sleep(0.01)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(path)
    _, fds, _, _ = socket.recv_fds(peer, 1, 1)
    tcp = socket.socket(fileno=fds[0])
    try:
        tcp.connect(("127.0.0.1", port))
        print(0)
    except OSError as exc:
        print(errno.errorcode.get(exc.errno, exc.errno))
    peer.send(b"x")
if sys.argv[1] == "give":
    give(sys.argv[2])
elif sys.argv[1] == "take":
    take(sys.argv[2], int(sys.argv[3]))
elif os.fork() == 0:
    give(sys.argv[2])
    os._exit(0)
else:
    take(sys.argv[2], int(sys.argv[3]))
    os.wait()
"""


def _hand_over_box(tmp_path: Path) -> tuple[Any, int, Any]:
    import socket

    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    # the hand-over's unix socket needs no abstract-unix scope: accepted, so that the test
    # runs below Landlock ABI 6 too (SANDLOCK_ABI=5), where strict mode refuses that gap
    policy = {"extends": ["python"], "filesystem": {"write": [str(tmp_path)]},
              "network": {"allow": ["example.test:443"], "connect": [port], "unix": True},
              "accept": ["abstract-unix"]}
    return sandlock.Sandbox(policy, timeout=60), port, listening


def test_a_socket_one_calls_gate_made_is_refused_to_another_call(tmp_path: Path) -> None:
    """Calls of one Sandbox share its mediator process, never a gate: a TCP socket made
    through call A's gate, handed to call B's tool, cannot connect (B's gate did not
    make it: EACCES, with a report), though A's gate would have let it."""
    box, port, listening = _hand_over_box(tmp_path)
    path = str(tmp_path / "hand")
    with box, listening:
        giver = box.popen([PYTHON, "-c", HAND_OVER, "give", path])
        taker = box.run([PYTHON, "-c", HAND_OVER, "take", path, str(port)],
                        capture_output=True, text=True)
        assert giver.wait() == 0
    assert taker.returncode == 0, taker.stderr
    assert taker.stdout.strip() == "EACCES"
    assert any("sandlock did not make" in line for line in taker.network_events), taker


def test_a_socket_handed_over_within_one_call_connects(tmp_path: Path) -> None:
    """Positive control: the same hand-over between two processes of one call (one gate
    made and holds the socket) connects, so the refusal above is the gates' separation."""
    box, port, listening = _hand_over_box(tmp_path)
    with box, listening:
        both = box.run([PYTHON, "-c", HAND_OVER, "both", str(tmp_path / "hand"), str(port)],
                       capture_output=True, text=True)
    assert both.returncode == 0, both.stderr
    assert both.stdout.strip() == "0", both


def test_the_mediator_ends_with_its_sandbox_and_never_restarts(tmp_path: Path) -> None:
    """One mediator process for a Sandbox's calls; close() ends it, and a call after
    close() is refused without starting another."""
    from conftest import eventually

    box = sandlock.Sandbox({"extends": ["python"], "network": {"allow": ["example.test:443"]}})
    pids = set()
    for _ in range(3):
        assert box.run([PYTHON, "-c", "pass"]).returncode == 0
        pids.add(box._mediator._proc.pid)
    assert len(pids) == 1  # the same process served the three calls
    process = box._mediator._proc
    assert process.poll() is None  # warm between calls
    box.close()
    assert eventually(lambda: process.poll() is not None)
    with pytest.raises(sandlock.SandlockError, match="closed"):
        box.run([PYTHON, "-c", "pass"])
    with pytest.raises(OSError, match="closed"):  # a call that passed the Sandbox's check
        box._mediator.open_call(False)
    assert box._mediator._proc is None


def test_the_next_calls_gate_asked_ahead_survives_a_dead_mediator(tmp_path: Path) -> None:
    """Each call asks the mediator for the next call's proxy and gate while it runs (they
    are ready when that call comes). A mediator killed between calls takes the prepared
    one with it: the next call gets a new mediator, still gated (a direct connection is
    refused), and the one prepared ahead is a different gate from the call's own."""
    box = sandlock.Sandbox({"extends": ["python"], "network": {"allow": ["example.test:443"]}})
    direct = ("import errno, socket\ns = socket.socket()\ntry:\n"
              "    s.connect(('127.0.0.1', 9))\nexcept OSError as e:\n"
              "    print(errno.errorcode[e.errno])\n")
    with box:
        first = box.run([PYTHON, "-c", direct], capture_output=True, text=True)
        assert first.stdout.strip() == "EACCES", first
        ahead = box._ahead.get("mediation")
        assert ahead is not None and ahead[0] == os.getpid()
        killed = box._mediator._proc
        killed.kill()
        killed.wait()
        again = box.run([PYTHON, "-c", direct], capture_output=True, text=True)
        assert again.stdout.strip() == "EACCES", again
        assert any("refused direct connection to 127.0.0.1" in line
                   for line in again.network_events), again
        assert box._mediator._proc.pid != killed.pid
        following = box._ahead.get("mediation")
        assert following is not None and following[1] is not ahead[1]


GRANDCHILD = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")


def _ancestors(pid: int) -> list[int]:
    """Pids above ``pid``, read from /proc/PID/status, up to init."""
    out = []
    while pid > 1:
        with open(f"/proc/{pid}/status") as handle:
            pid = next(int(line.split()[1]) for line in handle if line.startswith("PPid:"))
        out.append(pid)
    return out


@pytest.mark.parametrize("abi, native", [("7", "1"), ("5", "1"), ("7", "0")],
                         ids=["native", "native, signal gate", "fork server"])
def test_the_mediator_is_an_ancestor_of_every_tool_process(
        monkeypatch: pytest.MonkeyPatch, abi: str, native: str) -> None:
    """The connect gate (and, below Landlock ABI 6, the signal gate it carries) reads
    the tool's memory through /proc/TID/mem: under Yama's ptrace_scope = 1 (Ubuntu's
    default) only an ancestor may. The mediator starts the sandlock-exec server that
    runs its Sandbox's mediated commands, so it is an ancestor of the tool and of the
    tool's children. Control: through the fork server (SANDLOCK_NATIVE=0) it is not,
    which is why that path is refused where Yama restricts ptrace (see
    test_a_gate_that_cannot_read_the_tool_says_why)."""
    monkeypatch.setenv("SANDLOCK_ABI", abi)
    monkeypatch.setenv("SANDLOCK_NATIVE", native)
    from sandlock.linux import notify

    if native == "1":
        require_native()
    if native == "0" and notify.memory_unreadable(ancestor=False):
        pytest.skip("Yama restricts ptrace here: the fork server's mediated calls are refused")
    box = sandlock.Sandbox({"extends": ["python"], "network": {"allow": ["example.test:443"]}})
    with box, box.popen([PYTHON, "-c", GRANDCHILD], stdout=sandlock.PIPE) as process:
        assert process.stdout is not None
        grandchild = int(process.stdout.readline())
        try:
            mediator = box._mediator._proc.pid
            assert (mediator in _ancestors(grandchild)) == (native == "1")
            assert (mediator in _ancestors(process.pid)) == (native == "1")
        finally:
            process.kill()


@pytest.mark.any_user
def test_a_gate_that_cannot_read_the_tool_says_why(tmp_path: Path) -> None:
    """Yama's ptrace_scope decides who may read a tool's memory: 0 anyone of the user, 1
    an ancestor, 2 only with CAP_SYS_PTRACE, 3 no one; a gate that could not is refused
    with the reason (never a gate that silently denies every connect). The scope and
    the capabilities are read from files this test writes (the kernel here has no
    Yama; the ancestry itself is proven on the kernel above)."""
    from sandlock.linux import notify

    scope, status = tmp_path / "ptrace_scope", tmp_path / "status"
    assert notify.memory_unreadable(False, str(tmp_path / "absent")) is None  # no Yama
    ptrace = f"{1 << notify.CAP_SYS_PTRACE:016x}"
    for value, ancestor, caps, readable in (
            ("0", False, "0" * 16, True), ("1", True, "0" * 16, True),
            ("1", False, "0" * 16, False), ("1", False, ptrace, True),
            ("2", True, "0" * 16, False), ("2", False, ptrace, True),
            ("3", True, ptrace, False)):
        scope.write_text(value + "\n")
        status.write_text(f"Name:\tx\nCapEff:\t{caps}\n")
        why = notify.memory_unreadable(ancestor, str(scope), str(status))
        assert (why is None) == readable, (value, ancestor, caps, why)
        if why is not None:
            assert f"ptrace_scope is {value}" in why and "memory" in why


EXIT_UNCLOSED = """
import sys
sys.path.insert(0, sys.argv[1])
import sandlock
box = sandlock.Sandbox({"extends": ["python"], "network": {"allow": ["example.test:443"]}})
assert box.run([sys.argv[2], "-c", "pass"]).returncode == 0
traced = sandlock.Sandbox({"extends": ["python"]})
assert traced.run([sys.argv[2], "-c", "pass"], trace=True).returncode == 0
print("done", flush=True)
"""


def test_a_caller_that_never_closes_its_sandbox_still_exits() -> None:
    """A Sandbox left open ends with the interpreter (its __del__ closes it): its warm
    processes get EOF. Closing them used to start a reaper thread, which never starts
    while the interpreter finalizes: the caller hung at exit."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EXIT_UNCLOSED, str(REPO), PYTHON],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "done\n"), done.stderr[-2000:]


SUBREAPER_CALLER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import sandlock
from sandlock.linux import kernel
kernel.set_child_subreaper()  # as a caller that also runs `sandlock run`'s launcher in process
for _ in range(3):
    with sandlock.Sandbox({"extends": ["python"], "network": {"allow": ["example.test:443"]}}) as box:
        assert box.run([sys.argv[2], "-c", "pass"]).returncode == 0
    with sandlock.Sandbox({"extends": ["python"]}) as traced:
        assert traced.run([sys.argv[2], "-c", "pass"], trace=True).returncode == 0
    # this process's own sandlock-exec server, stopped: its idle supervisor is reaped by
    # it, never left to this process (the mediator's and recorder's are theirs to reap)
    with sandlock.Sandbox({"extends": ["python"]}) as plain:
        assert plain.run([sys.argv[2], "-c", "pass"]).returncode == 0
    from sandlock.exec import native
    server = native.get()
    deadline = time.monotonic() + 10  # the call's supervisor ends: its idle one is left
    while len(server.children()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    sandlock.shutdown()
def zombies():
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            out.append(pid)
    return out
# A child that ends is a zombie until its reaper thread runs: only one still there after
# half a second counts.
deadline = time.monotonic() + 20
found = zombies()
while time.monotonic() < deadline:
    time.sleep(0.5)
    found = [pid for pid in zombies() if pid in found]
    if not found:
        break
for pid in found:
    os.waitpid(int(pid), os.WNOHANG)
print(len(found))
"""


SUBREAPER_BUSY = SUBREAPER_CALLER.split("for _ in range(3):")[0] + """
from sandlock.exec import native
with sandlock.Sandbox({"extends": ["python"]}) as box:
    process = box.popen([sys.argv[2], "-c", "import time; time.sleep(0.5)"])
    native.shutdown()  # its own server stopped while a call runs (the call goes on)
    assert process.wait() == 0
""" + "def zombies():" + SUBREAPER_CALLER.split("def zombies():")[1]


def test_a_server_stopped_during_a_call_leaves_no_zombie_to_a_subreaper_caller() -> None:
    """A caller that is a subreaper stops its own sandlock-exec server while a call runs:
    the call's supervisor, ending after the server, was re-parented to the caller and
    stayed a zombie there. The server waits for it (a second at most) and reaps it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SUBREAPER_BUSY, str(REPO), PYTHON],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0", done.stdout


def test_warm_processes_leave_no_zombie_to_a_subreaper_caller() -> None:
    """A Sandbox's mediator and recorder each start a sandlock-exec server; at close they
    reap it before they exit. Left to outlive them, it was re-parented to the nearest
    subreaper, a caller that also runs the launcher in process (pytest here), where it
    stayed a zombie: each counts against RLIMIT_NPROC, and a user's CI suite ran out of
    processes."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SUBREAPER_CALLER, str(REPO), PYTHON],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0", done.stdout
