"""The CLI under faults and bad input, as an operator meets them (issue 17, item 5).

Whatever the environment or the policy file, every command ends with an exit code
from :class:`sandlock.errors.ExitCode` (or the command's own) and at most a
``sandlock:`` line: never a Python traceback, never a read without bound, never a
wait on a FIFO. Each case runs the real CLI in its own process, as a user would.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IS_ROOT, POLICIES, write_policy

from sandlock.errors import ExitCode
from sandlock.policy.readfile import MAX_BYTES

PYTHON = [sys.executable, "-m", "sandlock"]


def memory_cap() -> None:
    """A soft address-space limit, so that a reader without bound (a regression) fails
    fast with MemoryError instead of filling the machine's memory."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, hard))


def cli(*args: str, cwd: str | None = None, close: str = "",
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own; ``close`` names the standard streams a shell
    would have closed (``>&-``, ``2>&-``) before starting it."""
    redirections = " ".join({"stdout": ">&-", "stderr": "2>&-", "stdin": "<&-"}[name]
                            for name in close.split()) if close else ""
    return subprocess.run(["sh", "-c", f'exec "$@" {redirections}', "sh", *PYTHON, *args],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          preexec_fn=memory_cap)


def assert_clean(result: subprocess.CompletedProcess[str], *codes: int) -> None:
    assert result.returncode in codes, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


@pytest.fixture
def shell_policy(tmp_path: Path) -> list[str]:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return ["--policy", str(POLICIES / "shell.toml"), "--var", f"workspace={workspace}"]


# ----------------------------------------------------------------------------
# Standard streams closed by the caller


@pytest.mark.parametrize("close", ["stdout", "stderr", "stdin", "stdout stderr"])
def test_run_with_a_closed_stream_gives_the_commands_code(shell_policy: list[str], close: str
                                                          ) -> None:
    result = cli("run", *shell_policy, "--", "sh", "-c", "exit 3", close=close)
    assert_clean(result, 3)


@pytest.mark.parametrize("close", ["stdout", "stderr"])
def test_run_failure_with_a_closed_stream_exits_125(close: str) -> None:
    result = cli("run", "--policy", "/nonexistent/policy.toml", "--", "true", close=close)
    assert_clean(result, ExitCode.LAUNCHER)


def test_closed_stdout_is_not_reused_for_sandlock_files(shell_policy: list[str]) -> None:
    """A closed descriptor 1 must not become one of sandlock's own files, handed to
    the tool as its standard output."""
    result = cli("run", *shell_policy, "--", "sh", "-c",
                 'exec 3>&1 || exit 9; readlink /proc/self/fd/3 >&2; exit 0', close="stdout")
    assert_clean(result, 0)
    assert result.stderr.splitlines()[-1] == "/dev/null", result.stderr


@pytest.mark.parametrize("close", ["stdout", "stderr", "stdout stderr"])
@pytest.mark.parametrize("command", ["explain", "check", "validate", "policies", "probe"])
def test_other_commands_with_a_closed_stream(tmp_path: Path, command: str, close: str) -> None:
    args = {
        "explain": ["explain", "--policy", str(POLICIES / "read_file.toml"), "--var",
                    f"workspace={tmp_path}"],
        "check": ["check"],
        "validate": ["validate", str(POLICIES / "shell.toml")],
        "policies": ["policies"],
        "probe": ["probe", "--policy", str(POLICIES / "read_file.toml"), "--var",
                  f"workspace={tmp_path}"],
    }[command]
    result = cli(*args, close=close)
    # Output that cannot be written is not a traceback: 0 (nothing was lost that the
    # caller asked to see) or 125 with a reason on stderr when stderr is still open.
    assert_clean(result, 0, ExitCode.LAUNCHER)


@pytest.mark.parametrize("command", ["explain", "check", "validate", "policies"])
def test_output_to_a_full_device(tmp_path: Path, command: str) -> None:
    args = {
        "explain": ["explain", "--policy", str(POLICIES / "read_file.toml"), "--var",
                    f"workspace={tmp_path}"],
        "check": ["check"],
        "validate": ["validate", str(POLICIES / "shell.toml")],
        "policies": ["policies"],
    }[command]
    with open("/dev/full", "w") as full:
        result = subprocess.run([*PYTHON, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                                timeout=60)
    assert result.returncode == ExitCode.LAUNCHER, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    assert result.stderr.startswith("sandlock: "), result.stderr
    assert "No space left on device" in result.stderr


# ----------------------------------------------------------------------------
# The working directory was deleted


@pytest.fixture
def gone(tmp_path: Path) -> str:
    """A working directory that no longer exists (the shell's cwd was removed)."""
    path = tmp_path / "gone"
    path.mkdir()
    return str(path)


@pytest.mark.parametrize("command", ["run", "explain", "validate", "policies", "probe",
                                     "run-registry"])
def test_deleted_working_directory(tmp_path: Path, gone: str, command: str) -> None:
    registry = tmp_path / "registry"
    registry.mkdir()
    (registry / "cat.toml").write_text((POLICIES / "read_file.toml").read_text())
    read_file = ["--policy", str(POLICIES / "read_file.toml"), "--var", f"workspace={tmp_path}"]
    args = {
        "run": ["run", *read_file, "--", "true"],
        "run-registry": ["run", "--tool", "cat", "--policies", str(registry), "--var",
                         f"workspace={tmp_path}", "--", "true"],
        "explain": ["explain", *read_file],
        "validate": ["validate", str(POLICIES / "shell.toml")],
        "policies": ["policies"],
        "probe": ["probe", *read_file],
    }[command]
    quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in [*PYTHON, *args])
    result = subprocess.run(["sh", "-c", f'cd "$1" && rmdir "$1" && exec {quoted}', "sh", gone],
                            capture_output=True, text=True, timeout=60)
    assert_clean(result, ExitCode.LAUNCHER)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sandlock: ") and "working directory no longer exists" in lines[0]


def test_check_works_in_a_deleted_directory(gone: str) -> None:
    result = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", gone,
                             *PYTHON, "check", "--json"], capture_output=True, text=True,
                            timeout=60)
    assert_clean(result, 0)


# ----------------------------------------------------------------------------
# What sits where a policy file is expected: every reader is bounded and never waits


GOOD = 'version = 1\nextends = ["base"]\n'
KINDS = ["fifo", "dev-zero", "directory", "too-large", "symlink-loop", "unreadable"]


def make(kind: str, directory: Path, name: str) -> Path:
    """A ``kind`` of non-policy at ``directory/name``."""
    path = directory / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "too-large":
        path.write_text(GOOD + "#" * (2 * MAX_BYTES) + "\n")
    elif kind == "symlink-loop":
        path.symlink_to(path.name)
    elif kind == "unreadable":
        path.write_text(GOOD)
        path.chmod(0)
    return path


READERS = ["run", "explain", "validate", "probe", "run-registry-dir", "explain-registry-dir",
           "run-registry-file", "extends", "registry-extends"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_policy_readers_are_bounded(tmp_path: Path, reader: str, kind: str) -> None:
    if kind == "unreadable" and IS_ROOT:
        pytest.skip("root reads a file of mode 000")
    work = tmp_path / "work"
    work.mkdir()
    registry = tmp_path / "registry"
    registry.mkdir()
    var = ["--var", f"workspace={work}"]
    if reader in ("run", "explain", "validate", "probe"):
        bad = make(kind, tmp_path, "policy.toml")
        args = {"run": ["run", "--policy", str(bad), *var, "--", "true"],
                "explain": ["explain", "--policy", str(bad), *var],
                "validate": ["validate", str(bad)],
                "probe": ["probe", "--policy", str(bad), *var]}[reader]
    elif reader in ("run-registry-dir", "explain-registry-dir"):
        bad = make(kind, registry, "tool.toml")
        write_policy(registry, GOOD, "other.toml")
        verb = reader.split("-")[0]
        args = [verb, "--tool", "tool", "--policies", str(registry), *var]
        args += ["--", "true"] if verb == "run" else []
    elif reader == "run-registry-file":
        bad = make(kind, tmp_path, "tools.toml")
        args = ["run", "--tool", "tool", "--policies", str(bad), *var, "--", "true"]
    elif reader == "extends":
        bad = make(kind, tmp_path, "base.toml")
        policy = write_policy(tmp_path, 'version = 1\nextends = ["./base.toml"]\n', "top.toml")
        args = ["explain", "--policy", str(policy), *var]
    else:
        bad = make(kind, tmp_path, "base.toml")
        write_policy(registry, 'version = 1\nextends = ["../base.toml"]\n', "tool.toml")
        args = ["run", "--tool", "tool", "--policies", str(registry), *var, "--", "true"]
    result = cli(*args)
    # click refuses a directory or an unreadable file given to a file option itself
    # (a usage error, exit 2).
    codes = (2, ExitCode.LAUNCHER) if kind in ("directory", "unreadable") else (ExitCode.LAUNCHER,)
    assert_clean(result, *codes)
    if result.returncode == ExitCode.LAUNCHER:
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("sandlock: "), result.stderr
        assert bad.name in result.stderr or str(bad.parent) in result.stderr, result.stderr


# ----------------------------------------------------------------------------
# Policies that would exhaust the parser


def test_deeply_nested_toml_through_the_cli(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, "version = 1\nx = " + "[" * 1000 + "]" * 1000 + "\n")
    result = cli("validate", str(policy))
    assert_clean(result, ExitCode.LAUNCHER)
    assert f"{policy}:2: " in result.stderr and "nested" in result.stderr, result.stderr


def test_long_extends_chain_through_the_cli(tmp_path: Path) -> None:
    for index in range(1000):
        write_policy(tmp_path, f'version = 1\nextends = ["./p{index + 1}.toml"]\n', f"p{index}.toml")
    write_policy(tmp_path, "version = 1\n", "p1000.toml")
    result = cli("run", "--policy", str(tmp_path / "p0.toml"), "--", "true")
    assert_clean(result, ExitCode.LAUNCHER)
    assert "extends" in result.stderr and "32" in result.stderr, result.stderr


def test_huge_memory_through_the_cli(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, 'version = 1\n[limits]\nmemory = "' + "9" * 400 + '"\n')
    result = cli("run", "--policy", str(policy), "--", "true")
    assert_clean(result, ExitCode.LAUNCHER)
    assert f"{policy}:3: limits.memory: " in result.stderr and "at most" in result.stderr


def test_run_in_process_leaves_no_descriptor_behind(tmp_path: Path) -> None:
    """`execute` is called in-process too (the click `run`, tests, embedders): the
    compiled-policy cache's directory must not stay open after each call."""
    import contextlib
    import io

    from sandlock.cli import launch

    workspace = tmp_path / "ws"
    workspace.mkdir()
    args = ["--policy", str(POLICIES / "shell.toml"), "--var", f"workspace={workspace}", "--",
            "true"]
    with contextlib.redirect_stderr(io.StringIO()):
        assert launch.main_run(args) == 0  # the first run may fill the cache
        before = sorted(os.listdir("/proc/self/fd"))
        for _ in range(5):
            assert launch.main_run(args) == 0
    assert sorted(os.listdir("/proc/self/fd")) == before


# ----------------------------------------------------------------------------
# Limits nothing can start under, and a caller short of descriptors or processes


TOO_SMALL = [("memory", '"1"'), ("memory", '"4KiB"'), ("memory", '"512KiB"'),
             ("memory", '"7MiB"'), ("open_files", "1"), ("open_files", "3")]


@pytest.mark.parametrize(("key", "value"), TOO_SMALL)
def test_a_limit_nothing_can_start_under_is_refused_alike(tmp_path: Path, key: str,
                                                          value: str) -> None:
    """`run` used to exit 139 (memory "1"), 127 (512KiB) or run a tool that could not
    load, while `validate` said ok: run, validate and the API give one message."""
    import sandlock

    policy = write_policy(tmp_path, f'version = 1\nextends = ["base"]\n[limits]\n{key} = {value}\n')
    run = cli("run", "--policy", str(policy), "--", "true")
    check = cli("validate", str(policy))
    assert_clean(run, ExitCode.LAUNCHER)
    assert_clean(check, ExitCode.LAUNCHER)
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith(f"sandlock: {policy}:4: limits.{key}: "), run.stderr
    assert ("8MiB" if key == "memory" else "fewer than 4") in message, message
    assert check.stderr.strip().splitlines()[-1] == message
    with pytest.raises(sandlock.PolicyError) as caught:
        sandlock.Sandbox(str(policy))
    assert f"sandlock: {caught.value}" == message


def test_the_smallest_limits_taken_still_start_a_program(tmp_path: Path) -> None:
    """Positive control: at the minimums a program starts and exits 0."""
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n[filesystem]\n'
                                    'exec = ["/usr/bin"]\n[limits]\nmemory = "8MiB"\nopen_files = 4\n')
    assert_clean(cli("run", "--policy", str(policy), "--", "/bin/true"), 0)


def test_a_policy_object_below_the_minimum_is_refused_by_the_compiler() -> None:
    """A Policy built without the loader meets the same check when compiled."""
    import dataclasses

    import sandlock
    from sandlock.compile import compiler
    from sandlock.policy.model import policy_from_dict

    policy = policy_from_dict({"extends": ["base"]})
    small = dataclasses.replace(policy, limits=dataclasses.replace(policy.limits, memory=4096))
    with pytest.raises(sandlock.PolicyError, match="limits.memory: .*8MiB"):
        compiler.compile_policy(small)


def _with_rlimit(which: int, value: int) -> None:
    memory_cap()
    resource.setrlimit(which, (value, resource.getrlimit(which)[1]))


@pytest.mark.parametrize("nofile", [6, 7])
def test_a_caller_short_of_descriptors_is_told_so(tmp_path: Path, nofile: int) -> None:
    """RLIMIT_NOFILE too low used to read "libseccomp is not available"."""
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n')
    result = subprocess.run([*PYTHON, "run", "--policy", str(policy), "--", "true"],
                            capture_output=True, text=True, timeout=60, cwd="/",
                            env={**os.environ, "SANDLOCK_NO_CACHE": "1"},
                            preexec_fn=lambda: _with_rlimit(resource.RLIMIT_NOFILE, nofile))
    assert_clean(result, ExitCode.LAUNCHER)
    assert "libseccomp" not in result.stderr, result.stderr
    assert "RLIMIT_NOFILE (ulimit -n) is" in result.stderr, result.stderr


@pytest.mark.skipif(IS_ROOT, reason="RLIMIT_NPROC does not bind root (CAP_SYS_RESOURCE)")
def test_a_caller_at_its_process_limit_is_told_so(tmp_path: Path) -> None:
    """RLIMIT_NPROC reached used to read "libseccomp is not available"."""
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n')
    result = subprocess.run([*PYTHON, "run", "--policy", str(policy), "--", "true"],
                            capture_output=True, text=True, timeout=60, cwd="/",
                            env={**os.environ, "SANDLOCK_NO_CACHE": "1"},
                            preexec_fn=lambda: _with_rlimit(resource.RLIMIT_NPROC, 1))
    assert_clean(result, ExitCode.LAUNCHER)
    assert "libseccomp" not in result.stderr, result.stderr
    assert "RLIMIT_NPROC (ulimit -u) is 1" in result.stderr, result.stderr
