"""One confinement engine: every executor takes the same steps, and proves it.

The child's steps come from one function (sandlock.exec.spec.child_steps) and are taken
by two interpreters: Python's (the CLI's launcher, the fork server) and sandlock-exec's
(C). The probe's 124 escape attempts, run through each executor on the real kernel,
must give the same rows; a step dropped on one path shows up as a different row.
"""

from __future__ import annotations

import os
import socket
import stat
import types
from pathlib import Path

import pytest
from conftest import REPO, require_abi, require_native

import sandlock
from sandlock.errors import SetupError
from sandlock.exec import engine, forkserver, native, spec
from sandlock.policy.model import Policy, load_policy
from sandlock.probe.harness import EXECUTORS, probe_policy

LIMITS = """\
version = 1
extends = ["base"]

[filesystem]
read = ["${workspace}"]
write = ["${workspace}/out"]
exec = ["/usr/bin/true"]

[limits]
cpu = 20
open_files = 64
file_size = 1048576
processes = 40
timeout = 60
"""


@pytest.fixture(autouse=True)
def _requirements() -> None:
    require_abi(1, "the probe")
    require_native()


def policy_named(name: str, workspace: Path) -> Policy:
    if name == "limits":
        (workspace / "out").mkdir(exist_ok=True)
        path = workspace.parent / "limits.toml"
        path.write_text(LIMITS)
    else:
        path = REPO / "policies" / f"{name}.toml"
    return load_policy(str(path), variables={"workspace": str(workspace)})


def rows(policy: Policy, executor: str) -> list[tuple[str, str]]:
    report = probe_policy(policy, executor=executor)
    return [(result.id, result.outcome) for result in report.results]


@pytest.mark.parametrize("name", ["shell", "read_file", "limits"])
def test_the_probe_gives_the_same_rows_through_every_executor(name: str, workspace: Path) -> None:
    policy = policy_named(name, workspace)
    through = {executor: rows(policy, executor) for executor in EXECUTORS}
    launcher_rows = through["launcher"]
    assert len(launcher_rows) > 100
    assert sum(outcome == "blocked" for _, outcome in launcher_rows) > 80
    for executor in EXECUTORS[1:]:
        differ = [(a, b) for a, b in zip(launcher_rows, through[executor]) if a != b]
        assert not differ and len(through[executor]) == len(launcher_rows), (executor, differ)


def test_a_step_dropped_on_one_executor_changes_the_rows(workspace: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: sandlock-exec given a list without the rlimit steps
    lets the payload open more files than the policy's limit, and the rows say so."""
    policy = policy_named("limits", workspace)
    before = dict(rows(policy, "native"))
    assert before["limits.open_files"] == "blocked"

    def without_rlimits(*args: object, **kwargs: object) -> tuple[spec.Step, ...]:
        steps = spec.child_steps(*args, **kwargs)  # type: ignore[arg-type]
        return tuple(s for s in steps if s[0] != spec.RLIMIT)

    monkeypatch.setattr(native, "spec", types.SimpleNamespace(
        child_steps=without_rlimits, check=spec.check))
    after = dict(rows(policy, "native"))
    assert after["limits.open_files"] == "allowed"
    assert dict(rows(policy, "launcher"))["limits.open_files"] == "blocked"


def test_each_executor_declares_what_it_implements() -> None:
    assert engine.IMPLEMENTS == spec.ORDER
    helper = native.implements()  # the helper's own first message
    assert helper == set(spec.ORDER)
    source = (REPO / "sandlock" / "exec" / "helper" / "sandlock_exec.c").read_text()
    assert f"#define WIRE_VERSION {spec.VERSION} " in source


@pytest.mark.parametrize("steps, why", [
    ([("session",), ("caps",), ("cloexec",), ("nnp",), ("seccomp",), ("exec",), ("bogus",)],
     "does not implement"),
    ([("caps",), ("cloexec",), ("nnp",), ("exec",)], "without the 'seccomp' step"),
    ([("seccomp",), ("caps",), ("cloexec",), ("nnp",), ("exec",)], "out of order"),
])
def test_a_list_not_made_by_child_steps_is_refused(steps: list[spec.Step], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        spec.check(steps, [*spec.ORDER, "bogus"] if why != "does not implement" else spec.ORDER,
                   "this executor")


def test_the_wire_form_round_trips() -> None:
    steps = (("cgroup",), ("session",), ("chdir", "/a:b=c"), ("rlimit", 7, 64), ("caps",),
             ("seccomp",), ("exec",))
    assert spec.decode(spec.encode(steps)) == steps
    with pytest.raises(ValueError, match="unknown confinement step"):
        spec.decode(["setuid=0"])


def fake_helper(tmp_path: Path, body: str) -> str:
    path = tmp_path / "sandlock-exec"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


@pytest.mark.parametrize("body, said", [
    ("printf 'V 1 session caps cloexec nnp seccomp exec' >&3\nexec sleep 30\n", "V 1"),
    ("exec sleep 30\n", "nothing"),
    ("exit 0\n", "nothing"),
])
def test_a_helper_of_another_version_is_an_error_not_a_fallback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workspace: Path, body: str, said: str
) -> None:
    native.shutdown()
    monkeypatch.setattr(native, "HELPER", fake_helper(tmp_path, body))
    monkeypatch.setattr(native, "HELLO_TIMEOUT", 1.0)
    monkeypatch.setenv("SANDLOCK_NATIVE", "1")
    box = sandlock.Sandbox(str(REPO / "policies" / "shell.toml"), vars={"workspace": str(workspace)})
    try:
        with pytest.raises(SetupError, match="another version of sandlock's wire") as raised:
            box.run(["/usr/bin/true"])
        assert said in str(raised.value) and "stale build" in str(raised.value)
    finally:
        box.close()
        native.shutdown()


def forkserver_request(**changes: object) -> bytes:
    """Submit one command request to the fork server, ``changes`` applied; its answer."""
    box = sandlock.Sandbox(str(REPO / "policies" / "read_file.toml"),
                           vars={"workspace": str(REPO)})
    compiled = box._compiled
    request = {
        "version": spec.VERSION, "kind": "exec", "exe": "/usr/bin/cat", "argv": ["cat", "/dev/null"],
        "env": [], "cwd": "/", "bpf": compiled.bpf, "rlimits": list(compiled.rlimits),
        "ruleset": compiled.ruleset_fd >= 0, "cgroup": None, "timeout": 10.0,
    }
    from sandlock.exec.launcher import Command

    made = spec.encode(spec.child_steps(compiled, Command("/usr/bin/cat", ("cat",), (), "/"),
                                        in_group=False))
    request["steps"] = made
    for dropped in ("landlock", "session", "rlimit"):  # a forged list, shorter than made
        if changes.get("steps") == f"without {dropped}":
            changes["steps"] = [text for text in made if not text.startswith(dropped)]
    request.update(changes)
    with open(os.devnull, "rb") as null:
        fds = [null.fileno()] * 3 + [compiled.ruleset_fd]
        sock = forkserver.submit(request, fds)
    with sock:
        sock.settimeout(30)
        answer = sock.recv(4096)
    box.close()
    return answer


@pytest.mark.parametrize("changes, why", [
    ({"version": spec.VERSION - 1}, "another wire version"),
    ({"steps": ["session", "caps", "cloexec", "nnp", "seccomp", "exec", "setuid=0"]},
     "unknown confinement step"),
    ({"steps": ["session", "cloexec", "nnp", "landlock", "seccomp", "exec"]}, "without the 'caps'"),
    ({"steps": ["session", "caps", "cloexec", "nnp", "landlock", "seccomp", "notify", "exec"]},
     "notify step and the request's supervisors disagree"),
    # Well-formed lists that are not what this request's own fields call for: a forged
    # request must not run the command with fewer steps (no Landlock, no rlimits, no session).
    ({"steps": "without landlock"}, "not the steps this request calls for"),
    ({"steps": "without session"}, "not the steps this request calls for"),
    ({"steps": "without rlimit"}, "not the steps this request calls for"),
])
def test_the_fork_server_refuses_a_request_it_cannot_take_whole(changes: dict[str, object],
                                                                why: str) -> None:
    answer = forkserver_request(**changes)
    assert answer.startswith(b"F 125 SetupError\nmalformed request: "), answer
    assert why.encode() in answer


def test_the_fork_server_runs_a_well_formed_request() -> None:
    answer = forkserver_request()
    assert answer.startswith(b"E 0 0 0 "), answer


def test_socket_is_seqpacket_for_the_hello() -> None:
    """The hello and each request are one message each: the helper's socket keeps
    message boundaries, so a short read can never split a version."""
    server = native.get()
    assert server._sock.type == socket.SOCK_SEQPACKET


def test_the_cli_probes_through_each_executor(workspace: Path) -> None:
    """`sandlock probe --executor X` (the same rows) and an executor it does not know."""
    import json
    import subprocess
    import sys

    def probe(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sandlock", "probe", "--policy",
                               str(REPO / "policies" / "read_file.toml"), "--var",
                               f"workspace={workspace}", "--json", *extra],
                              capture_output=True, text=True, timeout=300, cwd=workspace)

    reports = {}
    for executor in EXECUTORS:
        done = probe("--executor", executor)
        assert done.returncode == 0, done.stderr
        reports[executor] = [(r["id"], r["outcome"]) for r in json.loads(done.stdout)["results"]]
    assert reports["forkserver"] == reports["launcher"] == reports["native"]
    unknown = probe("--executor", "docker")
    assert unknown.returncode != 0 and "docker" in unknown.stderr


STATE = r'''
for k in CapInh CapPrm CapEff CapBnd CapAmb NoNewPrivs Seccomp Seccomp_filters SigBlk SigIgn; do
  grep "^$k:" /proc/self/status
done
awk '{print "pgrp==pid", ($5==$1)?"yes":"no"; print "sid==pid", ($6==$1)?"yes":"no"}' /proc/$$/stat
grep -v "^Limit" /proc/self/limits | sed 's/  */ /g'
echo "fds: $(ls /proc/$$/fd | tr '\n' ' ')"
echo "cwd: $(pwd)"
'''

STATE_POLICY = """\
version = 1
extends = ["base"]
[filesystem]
read = ["/proc", "${workspace}"]
exec = ["/usr/bin", "/bin"]
[limits]
processes = 64
open_files = 77
file_size = "16MiB"
memory = "1GiB"
"""


def test_every_executor_leaves_the_tool_in_the_same_state(workspace: Path) -> None:
    """What the probe cannot see: capabilities (root's are dropped), no_new_privs, the
    filters, blocked and ignored signals, session, limits, open descriptors and working
    directory of the tool, read by the tool itself, must be the same through each
    executor (a step missing from one shows up here)."""
    import subprocess
    import sys

    policy = workspace.parent / "state.toml"
    policy.write_text(STATE_POLICY)
    argv = ["/bin/sh", "-c", STATE]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    seen = {"launcher": subprocess.run(
        [sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--var",
         f"workspace={workspace}", "--", *argv], capture_output=True, text=True, env=env,
        cwd=workspace, timeout=60).stdout}
    for executor in ("forkserver", "native"):
        with sandlock.Sandbox(str(policy), vars={"workspace": str(workspace)}) as box:
            box._native = executor == "native"
            seen[executor] = box.run(argv, capture_output=True, text=True, cwd=str(workspace),
                                     timeout=60).stdout
    assert "NoNewPrivs:\t1" in seen["launcher"] and "sid==pid yes" in seen["launcher"]
    assert "CapEff:\t0000000000000000" in seen["launcher"]
    assert seen["forkserver"] == seen["launcher"]
    assert seen["native"] == seen["launcher"]
