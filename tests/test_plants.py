"""What a tool must not leave behind or run: privilege plants, code from memory, and
its hands on the user's terminal. Real attacks on the real kernel, through every
executor: the CLI (Python launcher), ``Sandbox.run`` (the native helper when built)
and ``Sandbox.call`` (a spare of the fork server). Root and ordinary user alike.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import resource
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any, Callable

import plant_attacks
import pytest
from conftest import PYTHON, require_abi, require_tool, run_confined, write_policy

import sandlock

TESTS = Path(__file__).resolve().parent
ATTACKS = TESTS / "plant_attacks.py"
x86_64_only = pytest.mark.skipif(os.uname().machine != "x86_64",
                                 reason="the memfd program is an x86_64 ELF")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "the sandbox")


def policy_for(_: Path, workspace: Path, extra: str = "") -> dict[str, Any]:
    syscalls = {"allow": [extra]} if extra else {}
    return {"extends": ["python"],
            "filesystem": {"read": [str(TESTS), "/proc"], "write": [str(workspace)]},
            "syscalls": syscalls}


def toml_for(tmp_path: Path, workspace: Path, extra: str = "") -> Path:
    allow = f'\n[syscalls]\nallow = ["{extra}"]\n' if extra else ""
    return write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{TESTS}", "/proc"]
        write = ["{workspace}"]
        """ + allow)


def via_cli(tmp_path: Path, workspace: Path, args: list[str], extra: str = "") -> Any:
    done = run_confined(toml_for(tmp_path, workspace, extra), [PYTHON, str(ATTACKS), *args])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def via_run(tmp_path: Path, workspace: Path, args: list[str], extra: str = "") -> Any:
    with sandlock.Sandbox(policy_for(tmp_path, workspace, extra)) as box:
        done = box.run([PYTHON, str(ATTACKS), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def via_call(tmp_path: Path, workspace: Path, args: list[str], extra: str = "") -> Any:
    with sandlock.Sandbox(policy_for(tmp_path, workspace, extra)) as box:
        if args[0] == "plant":
            return {"attacks": box.call(plant_attacks.plant, args[1]),
                    "controls": box.call(plant_attacks.controls, args[1]),
                    "planted": box.call(plant_attacks.planted, args[1])}
        return box.call(plant_attacks.memfd_exec, int(args[1]))


ROUTES: dict[str, Callable[..., Any]] = {"cli": via_cli, "run": via_run, "call": via_call}


# ---------------------------------------------------------------------------
# Privilege plants (issue 11 item 5)


def test_the_attacks_work_without_a_sandbox(workspace: Path) -> None:
    """The control: unconfined, every route plants (so a refusal below means the filter)."""
    done = subprocess.run([PYTHON, str(ATTACKS), "plant", str(workspace)], capture_output=True,
                          text=True, check=True)
    result = json.loads(done.stdout)
    routes = {k: v for k, v in result["attacks"].items() if not k.startswith("setxattr")}
    assert set(routes.values()) <= {"done", "ENOSYS"}, routes  # ENOSYS: kernel without it
    assert routes["os.chmod"] == routes["open(O_CREAT)"] == routes["mknod(S_IFREG)"] == "done"
    assert len(result["planted"]) >= 8


@pytest.mark.parametrize("route", ROUTES)
def test_no_set_id_file_and_no_file_capability(route: str, tmp_path: Path,
                                               workspace: Path) -> None:
    result = ROUTES[route](tmp_path, workspace, ["plant", str(workspace)])
    attacks = result["attacks"]
    refused = {name: code for name, code in attacks.items() if code != "done"}
    assert refused == attacks, f"let through: {set(attacks) - set(refused)}"
    assert attacks["openat2(2)"] == "ENOSYS"  # libc falls back to openat
    assert attacks["setxattr(security.capability)"] == "EPERM"  # no CAP_SETFCAP
    assert set(attacks.values()) <= {"EPERM", "ENOSYS"}, attacks
    assert result["controls"] == {"os.chmod 0755": "done", "open 0644": "done",
                                  "sticky dir": "done"}
    assert result["planted"] == []
    assert plant_attacks.planted(str(workspace)) == []  # seen from outside too


def test_the_chmod_command_cannot_set_the_bit(tmp_path: Path, workspace: Path) -> None:
    target = workspace / "tool"
    target.write_text("#!/bin/sh\n")
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["base"]
        [filesystem]
        write = ["{workspace}"]
        exec = ["/usr/bin/chmod"]
        """)
    for mode in ("4755", "u+s", "g+s", "6755"):
        done = run_confined(policy, ["/usr/bin/chmod", mode, str(target)])
        assert done.returncode == 1, (mode, done.stderr)
        assert "Operation not permitted" in done.stderr
        assert not target.stat().st_mode & 0o6000
    assert run_confined(policy, ["/usr/bin/chmod", "755", str(target)]).returncode == 0
    assert target.stat().st_mode & 0o7777 == 0o755


def test_setfattr_cannot_set_a_file_capability(tmp_path: Path, workspace: Path) -> None:
    setfattr = require_tool("setfattr")
    target = workspace / "tool"
    target.write_text("x")
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["base"]
        [filesystem]
        write = ["{workspace}"]
        exec = ["{setfattr}"]
        """)
    value = "0x" + plant_attacks.CAPABILITY.hex()
    done = run_confined(policy, [setfattr, "-n", "security.capability", "-v", value, str(target)])
    assert done.returncode == 1 and "Operation not permitted" in done.stderr, done.stderr
    assert plant_attacks.planted(str(workspace)) == []
    # the same command sets an ordinary attribute (the refusal is the capability's)
    done = run_confined(policy, [setfattr, "-n", "user.note", "-v", "1", str(target)])
    assert done.returncode in (0, 1), done.stderr  # 1: a filesystem without user xattrs


# ---------------------------------------------------------------------------
# Code from memory (issue 12 item 2)

MFD_NOEXEC_SEAL = 0x0008


@x86_64_only
def test_memfd_exec_works_without_a_sandbox() -> None:
    assert plant_attacks.memfd_exec(0) == {"memfd_create": "done", "fexecve": "done",
                                           "execve /proc/self/fd": "done", "fchmod +x": "done"}


@x86_64_only
@pytest.mark.parametrize("route", ROUTES)
def test_memfd_exec_is_refused_by_default(route: str, tmp_path: Path, workspace: Path) -> None:
    for flags in (0, os.MFD_CLOEXEC, 0x10):  # 0x10: MFD_EXEC
        result = ROUTES[route](tmp_path, workspace, ["memfd", str(flags)])
        assert result == {"memfd_create": "ENOSYS", "fexecve": "ENOSYS",
                          "execve /proc/self/fd": "ENOSYS"}, flags


@x86_64_only
@pytest.mark.parametrize("route", ROUTES)
def test_a_sealed_memfd_is_allowed_and_cannot_run(route: str, tmp_path: Path,
                                                  workspace: Path) -> None:
    result = ROUTES[route](tmp_path, workspace, ["memfd", str(MFD_NOEXEC_SEAL)])
    if result["memfd_create"] == "EINVAL":
        pytest.skip("MFD_NOEXEC_SEAL needs Linux 6.3")
    assert result == {"memfd_create": "done", "fexecve": "EACCES",
                      "execve /proc/self/fd": "EACCES", "fchmod +x": "EPERM"}


@x86_64_only
@pytest.mark.parametrize("route", ROUTES)
def test_memfd_exec_is_an_opt_in(route: str, tmp_path: Path, workspace: Path) -> None:
    result = ROUTES[route](tmp_path, workspace, ["memfd", "0"], extra="memfd_create")
    assert result == {"memfd_create": "done", "fexecve": "done", "execve /proc/self/fd": "done",
                      "fchmod +x": "done"}


@pytest.mark.parametrize("code", [
    "import ctypes, multiprocessing",
    # a ctypes callback: libffi's closure trampolines (it tries a memfd first)
    "import ctypes; f = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda x: x + 1);"
    " assert f(41) == 42",
    "import multiprocessing.shared_memory as s; m = s.SharedMemory(create=True, size=10);"
    " m.close(); m.unlink()",
])
def test_python_still_works(code: str, tmp_path: Path, workspace: Path) -> None:
    policy = write_policy(tmp_path, """\
        version = 1
        extends = ["python"]
        [filesystem]
        write = ["/dev/shm"]
        """)
    done = run_confined(policy, [PYTHON, "-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


# ---------------------------------------------------------------------------
# Terminal ioctls (issue 12 item 3)

N_TTY, N_NULL = 0, 27
#: On the terminal the tool has on stderr: the caller's through the probe's own launcher
#: path, a pty of its own (relayed to the caller's) through `sandlock run` and the API.
TERMINAL = """\
import errno, fcntl, json, struct, termios
def attempt(request, arg=0):
    try:
        fcntl.ioctl(2, request, arg)
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return "done"
attrs = termios.tcgetattr(2)
attrs[3] &= ~termios.ECHO
print(json.dumps({
    "TIOCSETD N_NULL": attempt(termios.TIOCSETD, struct.pack("i", 27)),
    "TIOCSTI": attempt(termios.TIOCSTI, b"#"),
    "TIOCLINUX": attempt(termios.TIOCLINUX, b"\\x02"),
    "TIOCCONS": attempt(termios.TIOCCONS),
    "TIOCSCTTY steal": attempt(termios.TIOCSCTTY, 1),
    "TIOCVHANGUP": attempt(0x5437),
    "TCSETS echo off": attempt(termios.TCSETS, struct.pack("IIII", *attrs[:4]) + bytes(64)),
    "TIOCSWINSZ": attempt(termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0)),
    "TCFLSH": attempt(termios.TCFLSH, termios.TCIFLUSH),
    "TIOCGETD": attempt(termios.TIOCGETD, b"    "),
}))
"""


def line_discipline(fd: int) -> int:
    value: int = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCGETD, b"\0" * 4))[0]
    return value


EXPECTED_TTY = {"TIOCSETD N_NULL": "EPERM", "TIOCSTI": "EPERM", "TIOCLINUX": "EPERM",
                "TIOCCONS": "EPERM", "TIOCSCTTY steal": "EPERM", "TIOCVHANGUP": "EPERM",
                "TCSETS echo off": "done", "TIOCSWINSZ": "done", "TCFLSH": "done",
                "TIOCGETD": "done"}


def test_terminal_ioctls_on_an_inherited_pty(tmp_path: Path) -> None:
    # the control: unconfined, TIOCSETD switches the discipline (and is switched back)
    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSETD, struct.pack("i", N_NULL))
        assert line_discipline(slave) == N_NULL
        fcntl.ioctl(slave, termios.TIOCSETD, struct.pack("i", N_TTY))
        policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n')
        done = subprocess.run([sys.executable, "-m", "sandlock", "run", "--policy", str(policy),
                               "--", PYTHON, "-c", TERMINAL], stdin=slave, stdout=subprocess.PIPE,
                              stderr=slave, text=True, timeout=60)
        assert done.returncode == 0, done.stdout
        assert json.loads(done.stdout) == EXPECTED_TTY
        assert line_discipline(slave) == N_TTY
    finally:
        os.close(master)
        os.close(slave)


def test_terminal_ioctls_through_the_api() -> None:
    master, slave = pty.openpty()
    try:
        with sandlock.Sandbox({"extends": ["python"]}) as box:
            done = box.run([PYTHON, "-c", TERMINAL], stdin=slave, stdout=sandlock.PIPE,
                           stderr=slave, text=True)
        assert done.returncode == 0, done.stdout
        assert json.loads(done.stdout) == EXPECTED_TTY
        assert line_discipline(slave) == N_TTY
    finally:
        os.close(master)
        os.close(slave)


# ---------------------------------------------------------------------------
# A file-size limit while the filter is built (issue 17 item 3)


@pytest.mark.parametrize("fsize", ["1", "1024"])
def test_a_file_size_limit_does_not_break_this_or_the_next_run(fsize: str, tmp_path: Path) -> None:
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n'
                                    '[filesystem]\nexec = ["/usr/bin/true"]\n')
    env = {k: v for k, v in os.environ.items() if k != "SANDLOCK_NO_CACHE"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    limited = subprocess.run(["prlimit", f"--fsize={fsize}", sys.executable, "-m", "sandlock",
                              "run", "--policy", str(policy), "--", "/usr/bin/true"],
                             capture_output=True, text=True, env=env, timeout=60)
    # the filter is exported through a pipe, which RLIMIT_FSIZE does not cut: it works
    assert limited.returncode == 0, limited.stderr
    for _ in range(2):
        after = run_confined(policy, ["/usr/bin/true"], env=env)
        assert after.returncode == 0, after.stderr


def test_the_api_builds_filters_under_a_file_size_limit(tmp_path: Path) -> None:
    """In-process: the filter is compiled after RLIMIT_FSIZE is lowered to one byte."""
    script = ("import resource, signal, sandlock; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))\n"
              "box = sandlock.Sandbox({'extends': ['base'], 'filesystem': "
              "{'exec': ['/usr/bin/true']}, 'syscalls': {'deny': ['sync']}})\n"
              "print(box.run(['/usr/bin/true']).returncode)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "0", done.stderr
    assert resource.getrlimit(resource.RLIMIT_FSIZE)  # the test process was not touched


# ---------------------------------------------------------------------------
# The keyring is never a tool's


@pytest.mark.parametrize("name", ["keyctl", "add_key", "request_key"])
def test_a_policy_cannot_allow_the_keyring(name: str, tmp_path: Path) -> None:
    policy = write_policy(tmp_path, f'version = 1\n[syscalls]\nallow = ["{name}"]\n')
    done = run_confined(policy, ["/usr/bin/true"])
    assert done.returncode == 125
    assert f"syscalls.allow: {name!r} cannot be allowed: the key management syscalls" in done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(sandlock.PolicyError, match="cannot be allowed"):
        sandlock.Sandbox({"syscalls": {"allow": [name]}})
