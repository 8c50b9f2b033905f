"""``Sandbox.run(..., trace=True)``: the API's `sandlock trace`, on the real kernel.

A traced call is confined exactly as a plain one (the recorder only records; Landlock
and seccomp decide), and its :class:`Result` lists what the policy refused, each with
the policy line that grants it. Without ``trace`` nothing is recorded and no
notifying filter is loaded (counted in the tool's own /proc/self/status).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import require_native, require_tool

from sandlock import Outcome, Sandbox
from sandlock.errors import KernelSupportError
from sandlock.trace import record as T

SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- planted"

pytestmark = pytest.mark.skipif(T.supported() is not None, reason=str(T.supported()))


@pytest.fixture(autouse=True, params=["native", "forkserver"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both paths of a traced command: the native one (a recorder process
    of the Sandbox records, its sandlock-exec server runs the command) and the fork
    server's (its supervisor records)."""
    if request.param == "native":
        require_native()
    monkeypatch.setenv("SANDLOCK_NATIVE", "1" if request.param == "native" else "0")
    return str(request.param)


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("api_trace")


@pytest.fixture
def tmp_path(_shared: Path, request: pytest.FixtureRequest) -> Path:
    """One directory per test inside one of this module: the session's base temporary
    directory, whose every entry `sandlock learn` (tests/test_trace.py) grants with a
    descriptor of its own, grows by one entry only."""
    name: str = request.node.name
    place = _shared / name[:60]
    place.mkdir()
    return place


def box(**filesystem: Any) -> Sandbox:
    return Sandbox({"version": 1, "extends": ["base"], "filesystem": filesystem,
                    "env": {"pass": ["PATH", "HOME"]}})


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A planted private key outside every grant."""
    path = tmp_path / "home" / ".ssh" / "id_rsa"
    path.parent.mkdir(parents=True)
    path.write_text(SECRET)
    return path


@pytest.fixture
def cat() -> Iterator[Sandbox]:
    with box(exec=["/usr/bin/cat"]) as sandbox:
        yield sandbox


def test_a_refused_read_names_the_path_and_the_grant(cat: Sandbox, secret: Path) -> None:
    result = cat.run(["cat", str(secret)], capture_output=True, text=True, trace=True)
    assert SECRET not in result.stdout + result.stderr  # still refused while traced
    assert "Permission denied" in result.stderr
    assert result.outcome is Outcome.EXITED and result.returncode == 1
    denial = next(d for d in result.denials if d.path == str(secret))
    assert (denial.right, denial.section, denial.grant) == (
        "read", "filesystem", f'read += "{secret}"')
    assert str(denial) == f'denied read {secret} -> [filesystem] read += "{secret}"'
    assert denial.as_dict() == {"right": "read", "path": str(secret), "section": "filesystem",
                                "grant": f'read += "{secret}"'}


def test_without_trace_nothing_is_recorded(cat: Sandbox, secret: Path) -> None:
    result = cat.run(["cat", str(secret)], capture_output=True, text=True)
    assert result.returncode == 1 and SECRET not in result.stdout
    assert result.denials == ()


def test_no_notifying_filter_without_trace(tmp_path: Path) -> None:
    """The cost of trace=False is zero: the tool carries no extra seccomp filter."""
    with box(exec=["/usr/bin/cat"], read=["/proc"]) as sandbox:
        def filters(trace: bool) -> int:
            out = sandbox.run(["cat", "/proc/self/status"], capture_output=True, text=True,
                              trace=trace).stdout
            line = next(x for x in out.splitlines() if x.startswith("Seccomp_filters:"))
            return int(line.split()[1])

        assert filters(True) == filters(False) + 1


def test_a_denial_does_not_change_the_exit_code(tmp_path: Path, secret: Path) -> None:
    with box(exec=["/usr/bin/cat", "/bin/sh", "/usr/bin/dash", "/usr/bin/bash"]) as sandbox:
        argv = ["/bin/sh", "-c", f'cat "{secret}" 2>/dev/null; exit 3']
        plain = sandbox.run(argv, capture_output=True)
        traced = sandbox.run(argv, capture_output=True, trace=True)
        assert plain.returncode == traced.returncode == 3
        assert any(d.path == str(secret) for d in traced.denials)
        fine = sandbox.run(["/bin/sh", "-c", f'cat "{secret}" 2>/dev/null; true'], trace=True)
        assert fine.returncode == 0 and fine.ok
        assert any(d.path == str(secret) for d in fine.denials)


def test_input_cwd_env_and_capture_behave_as_a_plain_run(tmp_path: Path) -> None:
    with box(exec=["/usr/bin/cat", "/bin/sh", "/usr/bin/dash", "/usr/bin/bash",
                   "/usr/bin/pwd", "/bin/pwd"], read=[str(tmp_path)]) as sandbox:
        for trace in (False, True):
            got = sandbox.run(["cat"], input="through stdin\n", capture_output=True, text=True,
                              trace=trace)
            assert (got.returncode, got.stdout) == (0, "through stdin\n")
            here = sandbox.run(["/bin/sh", "-c", 'pwd; echo "$GREETING" >&2'],
                               cwd=str(tmp_path), env={"GREETING": "hello"},
                               capture_output=True, text=True, trace=trace)
            assert (here.stdout, here.stderr) == (f"{tmp_path}\n", "hello\n")


def test_the_timeout_holds_while_traced() -> None:
    with box(exec=["/usr/bin/sleep"]) as sandbox:
        result = sandbox.run(["sleep", "60"], timeout=1, trace=True)
        assert result.outcome is Outcome.TIMED_OUT and result.returncode == 124


def test_an_exec_refused_for_its_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "tool.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    with box(exec=[str(script)]) as sandbox:
        result = sandbox.run([str(script)], capture_output=True, trace=True)
    assert result.outcome is Outcome.NOT_STARTED and result.returncode == 126
    shell = os.path.realpath("/bin/sh")
    denial = next(d for d in result.denials if d.path == shell)
    assert denial.right == "exec" and denial.detail == f"#! interpreter of {script}"
    assert denial.grant == f'exec += "{shell}"'
    assert not any(d.path == str(script) for d in result.denials)  # granted


def test_popen_and_run_async(cat: Sandbox, secret: Path) -> None:
    with cat.popen(["cat", str(secret)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                   trace=True) as process:
        out, _ = process.communicate()
    assert SECRET.encode() not in out and process.returncode == 1
    assert process.result is not None
    assert [d.path for d in process.result.denials] == [str(secret)]
    result = asyncio.run(cat.run_async(["cat", str(secret)], capture_output=True, trace=True))
    assert [d.path for d in result.denials] == [str(secret)]


def test_trace_must_be_a_bool(cat: Sandbox) -> None:
    with pytest.raises(TypeError, match="trace must be True or False"):
        cat.run(["cat", "/dev/null"], trace="yes")  # type: ignore[arg-type]


def test_git_log_names_its_missing_grant(tmp_path: Path, secret: Path) -> None:
    git = require_tool("git")
    home = secret.parent.parent
    repo = tmp_path / "repo"
    env = {**os.environ, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run([git, "init", "-q", str(repo)], check=True, env=env)
    subprocess.run([git, "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a", "commit",
                    "-q", "--allow-empty", "-m", "first"], check=True, env=env)
    (home / ".gitconfig").write_text("[core]\n\tpager = cat\n")
    with box(exec=[git]) as sandbox:
        result = sandbox.run(["git", "log"], cwd=str(repo), env={"HOME": str(home)},
                             capture_output=True, text=True, trace=True)
        plain = sandbox.run(["git", "log"], cwd=str(repo), env={"HOME": str(home)},
                            capture_output=True, text=True)
    assert result.returncode != 0 and result.returncode == plain.returncode
    refused = {d.path: d for d in result.denials}
    named = [p for p in ("/etc/gitconfig", str(home / ".gitconfig"), str(repo)) if p in refused]
    assert named, result.denials
    assert refused[named[0]].grant == f'read += "{named[0]}"'
    # with the named grants, git log works and the planted key stays out of reach
    granted = sorted({d.path for d in result.denials if d.section == "filesystem"
                      and d.right == "read" and not d.path.startswith(str(home / ".ssh"))})
    with box(exec=[git], read=[*granted, str(repo)]) as sandbox:
        fixed = sandbox.run(["git", "log", "--format=%s"], cwd=str(repo),
                            env={"HOME": str(home)}, capture_output=True, text=True, trace=True)
        stolen = sandbox.run(["git", "hash-object", str(secret)], cwd=str(repo),
                             env={"HOME": str(home)}, capture_output=True, text=True, trace=True)
    assert (fixed.returncode, fixed.stdout) == (0, "first\n"), (fixed.stderr, fixed.denials)
    assert stolen.returncode != 0 and SECRET not in stolen.stdout + stolen.stderr
    assert any(d.path == str(secret) for d in stolen.denials)


def test_every_denial_of_a_long_list_arrives(tmp_path: Path) -> None:
    """More refusals than one supervisor message holds: none is dropped."""
    many = tmp_path / ("d" * 200)
    many.mkdir()
    names = [f"{'f' * 150}{index:04d}" for index in range(1500)]
    for name in names:
        (many / name).write_text("x")
    with box(exec=["/usr/bin/cat"]) as sandbox:
        result = sandbox.run(["cat", *(str(many / n) for n in names)], stderr=subprocess.DEVNULL,
                             trace=True)
    assert result.returncode == 1
    assert sorted(d.path for d in result.denials) == [str(many / n) for n in names]


def test_trace_under_a_host_allowlist_is_refused_clearly() -> None:
    """The kernel gives a process's filters one notification listener (the host
    allowlist's): a traced call says so before anything starts."""
    with Sandbox({"version": 1, "extends": ["base"], "filesystem": {"exec": ["/usr/bin/cat"]},
                  "network": {"allow": ["example.com:443"]}}) as sandbox:
        with pytest.raises(KernelSupportError, match=r"trace=True: not available with \[network\] allow"):
            sandbox.run(["cat", "/dev/null"], trace=True)
        assert sandbox.run(["cat", "/dev/null"]).returncode == 0


GRANDCHILD = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")


@pytest.mark.parametrize("abi", ["7", "5"], ids=["scoped", "signal gate"])
def test_the_recorder_is_an_ancestor_of_every_tool_process(
        path: str, monkeypatch: pytest.MonkeyPatch, abi: str) -> None:
    """The recorder reads the tool's memory (/proc/TID/mem), which Yama's ptrace_scope =
    1 allows only to an ancestor: the fork server's supervisor is the tool's parent; on
    the native path the Sandbox's recorder process started the server the command runs
    on. Below Landlock ABI 6 the signal gate rides on the recorder's listener."""
    import sandlock
    from sandlock.api import sandbox as api_sandbox

    monkeypatch.setenv("SANDLOCK_ABI", abi)
    python = "/usr/bin/python3"
    with Sandbox({"extends": ["python"]}) as sandbox, sandbox.popen(
            [python, "-c", GRANDCHILD], stdout=sandlock.PIPE, trace=True) as process:
        assert process.stdout is not None
        grandchild = int(process.stdout.readline())
        try:
            chain = [grandchild]
            while chain[-1] > 1:
                with open(f"/proc/{chain[-1]}/status") as handle:
                    chain.append(next(int(line.split()[1]) for line in handle
                                      if line.startswith("PPid:")))
            if path == "native":
                assert sandbox._recorder._proc.pid in chain
            else:
                assert sandbox._recorder is None
            assert isinstance(process._call, api_sandbox._NativeCall) == (path == "native")
        finally:
            process.kill()
