"""Process hygiene, exit codes, the syscall deny list and resource limits, on the real kernel.

Probes run through `sandlock run`. A process is "alive" when /proc shows it in a
state other than zombie: an orphan re-parented to an init that does not reap is
dead for our purpose.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import POLICIES, PYTHON, REPO, alive, python_probe, require_abi, run_confined, write_policy

from sandlock.compile.seccomp import NEVER_ALLOW

SIGSYS_EXIT = 128 + signal.SIGSYS


def wait_gone(pid: int, within: float = 20.0) -> bool:
    """Wait (not a timing assertion: a generous bound) until ``pid`` is no longer alive."""
    deadline = time.monotonic() + within
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Pids a test must see dead; killed afterwards so a failing test leaks nothing."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "filesystem confinement")


WRITE_WS = 'write = ["${workspace}"]'
WRITE_POLICY = f'version = 1\nextends = ["python"]\n[filesystem]\n{WRITE_WS}\n'

#: A daemon the way shells make them: fork, setsid, fork again; the grandchild
#: writes its pid and sleeps. The first process then does what ``THEN`` says.
DAEMON = """\
import os, sys, time
pidfile = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(pidfile + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.rename(pidfile + ".tmp", pidfile)
        time.sleep(600)
    os._exit(0)
os.wait()
while not os.path.exists(pidfile):
    time.sleep(0.01)
{then}
"""


def run_daemon(tmp_path: Path, workspace: Path, then: str, extra: tuple[str, ...] = ()
               ) -> tuple[subprocess.CompletedProcess[str], int]:
    policy = write_policy(tmp_path, WRITE_POLICY)
    pidfile = workspace / "daemon.pid"
    result = run_confined(policy, [PYTHON, "-c", DAEMON.format(then=then), str(pidfile)],
                          variables={"workspace": str(workspace)}, extra=extra)
    return result, int(pidfile.read_text())


def test_timeout_kills_a_setsid_double_forked_grandchild(tmp_path: Path, workspace: Path,
                                                         leftovers: list[int]) -> None:
    result, daemon = run_daemon(tmp_path, workspace, "time.sleep(600)", ("--timeout", "2s"))
    leftovers.append(daemon)
    assert result.returncode == 124
    assert "timeout" in result.stderr
    assert not alive(daemon)


def test_nothing_is_left_running_after_a_normal_exit(tmp_path: Path, workspace: Path,
                                                     leftovers: list[int]) -> None:
    result, daemon = run_daemon(tmp_path, workspace, "sys.exit(0)")
    leftovers.append(daemon)
    assert result.returncode == 0, result.stderr
    assert not alive(daemon)


# ----------------------------------------------------------------------------
# The launcher's own fate: signals and death

READY = "import os, signal, time; print(os.getpid(), flush=True); time.sleep(600)"


def start_launcher(tmp_path: Path, code: str = READY) -> tuple[subprocess.Popen[str], int]:
    """Start `sandlock run` on a probe that prints its pid when ready; return both."""
    policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n')
    proc = subprocess.Popen([sys.executable, "-m", "sandlock", "run", "--policy", str(policy),
                             "--", PYTHON, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.stderr.read() if proc.stderr else ""
    return proc, int(line)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_to_the_launcher_are_forwarded(tmp_path: Path, leftovers: list[int],
                                               signum: int) -> None:
    proc, tool = start_launcher(tmp_path)
    leftovers.append(tool)
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 128 + signum
    assert not alive(tool)


def test_signal_forwarded_even_if_the_tool_handles_it(tmp_path: Path, leftovers: list[int]) -> None:
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
            "print(os.getpid(), flush=True)\ntime.sleep(600)\n")
    proc, tool = start_launcher(tmp_path, code)
    leftovers.append(tool)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42


def test_forwarded_signal_also_ends_the_tools_daemons(tmp_path: Path, workspace: Path,
                                                     leftovers: list[int]) -> None:
    policy = write_policy(tmp_path, WRITE_POLICY)
    pidfile = workspace / "daemon.pid"
    code = DAEMON.format(then="print(os.getpid(), flush=True)\ntime.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-m", "sandlock", "run", "--policy", str(policy),
                             "--var", f"workspace={workspace}", "--", PYTHON, "-c", code,
                             str(pidfile)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    leftovers.append(int(proc.stdout.readline()))
    daemon = int(pidfile.read_text())
    leftovers.append(daemon)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not alive(daemon)


def test_tool_runs_in_its_own_session(tmp_path: Path) -> None:
    code = "import os; print(os.getsid(0) == os.getpid() == os.getpgrp(), os.getsid(0) != %d)"
    result = python_probe(tmp_path, code % os.getsid(0))
    assert result.stdout.split() == ["True", "True"], result.stderr


def test_tool_dies_when_the_launcher_is_killed(tmp_path: Path, leftovers: list[int]) -> None:
    proc, tool = start_launcher(tmp_path)
    leftovers.append(tool)
    proc.kill()
    proc.wait(timeout=30)
    assert wait_gone(tool), "the tool outlived its launcher (PDEATHSIG)"


# ----------------------------------------------------------------------------
# Exit codes


def test_exit_code_is_the_commands_own(tmp_path: Path) -> None:
    assert python_probe(tmp_path, "raise SystemExit(3)").returncode == 3
    assert python_probe(tmp_path, "pass").returncode == 0


def test_exit_code_128_plus_signal(tmp_path: Path) -> None:
    result = python_probe(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGUSR1)")
    assert result.returncode == 128 + signal.SIGUSR1


def test_exit_code_124_on_timeout_from_the_policy(tmp_path: Path) -> None:
    result = python_probe(tmp_path, "import time; time.sleep(600)",
                          extra_toml='\n[limits]\ntimeout = "1s"\n')
    assert result.returncode == 124
    assert "timeout" in result.stderr


def test_exit_code_125_for_a_bad_policy(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, 'version = 1\n[filesystem]\nread = "/tmp"\n')
    result = run_confined(policy, ["true"])
    assert result.returncode == 125
    assert f"{policy}:3: filesystem.read: expected an array" in result.stderr


def test_exit_code_125_when_strict_and_the_kernel_lacks_a_protection(tmp_path: Path,
                                                                     workspace: Path) -> None:
    require_abi(4, "pretending an older kernel")
    marker = workspace / "ran"
    policy = write_policy(tmp_path, WRITE_POLICY + "[network]\nconnect = [443]\n")
    env = {**os.environ, "SANDLOCK_ABI": "3"}
    argv = [PYTHON, "-c", f"open({str(marker)!r}, 'w')"]
    result = run_confined(policy, argv, variables={"workspace": str(workspace)}, env=env)
    assert result.returncode == 125
    assert "Landlock ABI 3" in result.stderr and "TCP port restriction" in result.stderr
    assert not marker.exists()
    # best-effort runs it, and says what is not enforced
    result = run_confined(policy, argv, variables={"workspace": str(workspace)}, env=env,
                          extra=["--best-effort"])
    assert result.returncode == 0, result.stderr
    assert "NOT enforced" in result.stderr and "TCP port restriction" in result.stderr
    assert marker.exists()


def test_exit_code_126_for_a_file_that_is_not_executable(tmp_path: Path, workspace: Path) -> None:
    script = workspace / "script.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)
    result = run_confined(POLICIES / "read_file.toml", [str(script)],
                          variables={"workspace": str(workspace)})
    assert result.returncode == 126
    assert "permission denied" in result.stderr and result.stdout == ""


def test_exit_code_126_for_a_directory(workspace: Path) -> None:
    result = run_confined(POLICIES / "read_file.toml", [str(workspace)],
                          variables={"workspace": str(workspace)})
    assert result.returncode == 126
    assert "is a directory" in result.stderr


def test_exit_code_126_when_the_policy_denies_exec(workspace: Path) -> None:
    # Executable on disk, but the policy grants no exec on the workspace.
    tool = workspace / "tool"
    tool.write_bytes(Path("/usr/bin/true").read_bytes())
    tool.chmod(0o755)
    result = run_confined(POLICIES / "read_file.toml", [str(tool)],
                          variables={"workspace": str(workspace)})
    assert result.returncode == 126
    assert "does not grant exec" in result.stderr


def test_exit_code_127_for_a_missing_command(workspace: Path) -> None:
    result = run_confined(POLICIES / "read_file.toml", ["no-such-command-sandlock"],
                          variables={"workspace": str(workspace)})
    assert result.returncode == 127
    assert "no-such-command-sandlock: command not found" in result.stderr
    result = run_confined(POLICIES / "read_file.toml", [str(workspace / "missing")],
                          variables={"workspace": str(workspace)})
    assert result.returncode == 127


# ----------------------------------------------------------------------------
# The syscall deny list (seccomp)

SYSCALL_PROBE = """\
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(number, *args):
    result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])
    if result == 0 and {fork_guard}:
        os._exit(0)  # a raw clone that succeeded: this is the child
    return "OK" if result >= 0 else errno.errorcode[ctypes.get_errno()]
print(call({number}, {args}))
"""

#: name -> (x86_64 number, arguments). Without the filter each call succeeds or fails
#: with something other than EPERM, for root and for an ordinary user alike.
SYSCALLS = {
    "ptrace": (101, (0, 0, 0, 0)),  # PTRACE_TRACEME
    "unshare": (272, (0x10000000,)),  # CLONE_NEWUSER
    "mount": (165, (0, 0, 0, 0, 0)),
    "io_uring_setup": (425, (1, 0)),
    "bpf": (321, (0, 0, 0)),
    "perf_event_open": (298, (0, 0, -1, -1, 0)),
    "keyctl": (250, (0, -3, 0)),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "userfaultfd": (323, (1,)),  # UFFD_USER_MODE_ONLY
    "clone": (56, (0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)),  # with CLONE_NEWUSER
}


def syscall_code(name: str) -> str:
    number, args = SYSCALLS[name]
    return SYSCALL_PROBE.format(number=number, args=", ".join(map(str, args)),
                                fork_guard=name == "clone")


def syscall_result(tmp_path: Path, name: str, extra_toml: str = "") -> str:
    result = python_probe(tmp_path, syscall_code(name), extra_toml=extra_toml)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture(autouse=True)
def _x86_64_numbers(request: pytest.FixtureRequest) -> None:
    if "syscall" in request.node.name and os.uname().machine != "x86_64":
        pytest.skip("syscall numbers in these probes are x86_64's")


@pytest.mark.parametrize("name", SYSCALLS)
def test_dangerous_syscall_denied(tmp_path: Path, name: str) -> None:
    assert syscall_result(tmp_path, name) == "EPERM"


@pytest.mark.parametrize("name", [n for n in SYSCALLS if n not in NEVER_ALLOW])
def test_dangerous_syscall_control_with_allow(tmp_path: Path, name: str) -> None:
    """The same probe with the syscall allowed: what the kernel says without the filter.
    (The keyring calls can never be allowed: tests/test_plants.py.)"""
    outcome = syscall_result(tmp_path, name, extra_toml=f'\n[syscalls]\nallow = ["{name}"]\n')
    if outcome == "EPERM":
        unconfined = subprocess.run([PYTHON, "-c", syscall_code(name)], capture_output=True,
                                    text=True, timeout=60).stdout.strip()
        if unconfined == "EPERM":  # e.g. user namespaces in a chroot, or sysctls that refuse them
            pytest.skip(f"{name} answers EPERM here unconfined too: the control shows nothing")
    assert outcome != "EPERM"


def test_syscall_clone3_answers_enosys(tmp_path: Path) -> None:
    code = SYSCALL_PROBE.format(number=435, args="0, 0", fork_guard=False)
    assert python_probe(tmp_path, code).stdout.strip() == "ENOSYS"


def test_syscall_with_the_x32_bit_kills_the_process(tmp_path: Path) -> None:
    code = SYSCALL_PROBE.format(number=0x40000000 | 39, args="", fork_guard=False)  # x32 getpid
    result = python_probe(tmp_path, code)
    assert result.returncode == SIGSYS_EXIT and result.stdout == ""


I386_GETPID = """\
import ctypes, mmap
code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (i386 getpid); int 0x80; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print("i386 getpid returned", function(), flush=True)
"""


def test_syscall_through_the_i386_abi_kills_the_process(tmp_path: Path) -> None:
    result = python_probe(tmp_path, I386_GETPID)
    assert result.returncode == SIGSYS_EXIT, result.stdout + result.stderr
    assert "returned" not in result.stdout


TIOCSTI_PROBE = """\
import ctypes, errno, fcntl, termios
fcntl.ioctl(2, termios.TIOCSCTTY, 0)  # our tty: only the filter can refuse TIOCSTI now
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
char = ctypes.c_char(b"x")
for request in (termios.TIOCSTI, 0xDEADBEEF00000000 | termios.TIOCSTI):
    result = libc.syscall(ctypes.c_long(16), ctypes.c_long(2), ctypes.c_ulong(request),
                          ctypes.byref(char))
    print("OK" if result == 0 else errno.errorcode[ctypes.get_errno()])
"""


def run_on_a_pty(tmp_path: Path, extra_toml: str = "") -> subprocess.CompletedProcess[str]:
    policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n' + extra_toml)
    primary, secondary = os.openpty()
    try:
        # On stderr: the tool gets a pty of its own there, its controlling terminal.
        return subprocess.run([sys.executable, "-m", "sandlock", "run", "--policy", str(policy),
                               "--", PYTHON, "-c", TIOCSTI_PROBE], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=secondary, text=True, timeout=60,
                              check=False)
    finally:
        os.close(primary)
        os.close(secondary)


def test_syscall_ioctl_tiocsti_denied_even_with_high_bits(tmp_path: Path) -> None:
    result = run_on_a_pty(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["EPERM", "EPERM"]


def test_syscall_ioctl_tiocsti_control_with_allow(tmp_path: Path) -> None:
    result = run_on_a_pty(tmp_path, '[syscalls]\nallow = ["ioctl"]\n')
    assert result.returncode == 0, result.stderr
    assert "EPERM" not in result.stdout.split()  # injected (or EIO where legacy TIOCSTI is off)


# ----------------------------------------------------------------------------
# Resource limits


def test_file_size_limit_python_gets_efbig(tmp_path: Path, workspace: Path) -> None:
    code = f"""\
        import errno
        try:
            open({str(workspace / 'big')!r}, 'wb').write(b'x' * 2_000_000)
        except OSError as exc:
            print(errno.errorcode[exc.errno])
        """
    result = python_probe(tmp_path, code, filesystem=WRITE_WS,
                          extra_toml='\n[limits]\nfile_size = "1MiB"\n',
                          variables={"workspace": str(workspace)})
    assert result.stdout.strip() == "EFBIG", result.stderr
    assert (workspace / "big").stat().st_size == 1024 * 1024


def test_file_size_limit_kills_with_sigxfsz(tmp_path: Path, workspace: Path) -> None:
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["{POLICIES / 'shell.toml'}"]
        [limits]
        file_size = "1MiB"
        """)
    shell = 'head -c 2000000 /dev/zero > "$1"'
    result = run_confined(policy, ["sh", "-c", shell, "sh", str(workspace / "big")],
                          variables={"workspace": str(workspace)})
    assert result.returncode == 128 + signal.SIGXFSZ
    assert (workspace / "big").stat().st_size == 1024 * 1024


def test_memory_limit_raises_memory_error(tmp_path: Path) -> None:
    code = """\
        try:
            block = bytearray(1024 ** 3)
        except MemoryError:
            print("MemoryError")
        """
    result = python_probe(tmp_path, code, extra_toml='\n[limits]\nmemory = "256MiB"\n')
    assert result.stdout.strip() == "MemoryError", result.stderr


def test_cpu_limit_stops_a_busy_loop(tmp_path: Path) -> None:
    result = python_probe(tmp_path, "while True: pass", extra_toml='\n[limits]\ncpu = "1s"\n')
    assert result.returncode in (128 + signal.SIGXCPU, 128 + signal.SIGKILL)


def test_open_files_limit_gives_emfile(tmp_path: Path) -> None:
    code = """\
        import errno, os
        try:
            for _ in range(100):
                os.open("/dev/null", os.O_RDONLY)
        except OSError as exc:
            print(errno.errorcode[exc.errno])
        """
    result = python_probe(tmp_path, code, extra_toml="\n[limits]\nopen_files = 32\n")
    assert result.stdout.strip() == "EMFILE", result.stderr


def test_limit_above_the_callers_hard_limit_is_clamped(tmp_path: Path) -> None:
    """A policy cannot raise a limit; asking for more than the caller has keeps the caller's."""
    code = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[1])"
    hard = 64
    policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n'
                                    '[limits]\nopen_files = 4096\n')
    result = subprocess.run(
        ["prlimit", f"--nofile={hard}:{hard}", sys.executable, "-m", "sandlock", "run", "--policy",
         str(policy),
         "--", PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == hard



def test_waiting_in_process_spares_the_hosts_other_children(workspace: Path) -> None:
    """Used as a library, the launcher reaps what the tool left, not the host's own children."""
    from sandlock.compile import compiler
    from sandlock.exec import launcher
    from sandlock.policy.model import loads_policy

    host_child = subprocess.Popen(["sleep", "600"])
    try:
        policy = loads_policy('version = 1\nextends = ["base"]\n'
                              '[filesystem]\nexec = ["/usr/bin/true"]\n')
        with compiler.compile_policy(policy) as compiled:
            child = launcher.spawn(compiled, launcher.prepare_command(compiled, ["/usr/bin/true"]))
            assert child.wait() == 0
        assert host_child.poll() is None, "the launcher killed a child that was not the tool's"
    finally:
        host_child.kill()
        host_child.wait()


# ----------------------------------------------------------------------------
# Other processes of the same user: limits, scheduling, System V IPC

#: name -> (call on the outside process {pid}, the same call on the tool itself)
SELF_ONLY = {
    "prlimit64": ("resource.prlimit({pid}, resource.RLIMIT_CORE, (0, 0))",
                  "resource.prlimit(0, resource.RLIMIT_CORE, (0, 0))"),
    "setpriority": ("os.setpriority(os.PRIO_PROCESS, {pid}, 19)",
                    "os.setpriority(os.PRIO_PROCESS, 0, 19)"),
    "sched_setaffinity": ("os.sched_setaffinity({pid}, os.sched_getaffinity({pid}))",
                          "os.sched_setaffinity(0, os.sched_getaffinity(0))"),
    "sched_setscheduler": ("os.sched_setscheduler({pid}, os.SCHED_IDLE, os.sched_param(0))",
                           "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))"),
    "ioprio_set": ("syscall(251, 1, {pid}, 3 << 13)", "syscall(251, 1, 0, 3 << 13)"),
}

OUTCOME = """\
import ctypes, errno, os, resource
libc = ctypes.CDLL(None, use_errno=True)
def syscall(*args):
    if libc.syscall(*[ctypes.c_long(a) for a in args]) < 0:
        raise OSError(ctypes.get_errno(), "")
try:
    {call}
    print("OK")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of the same user. Without capabilities: as root the launcher drops the
    tool's, and the kernel refuses to renice a process holding more than the caller."""
    no_caps = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []
    proc = subprocess.Popen([*no_caps, "sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("name", SELF_ONLY)
def test_syscall_on_another_process_refused_on_itself_allowed(
        tmp_path: Path, bystander: subprocess.Popen[bytes], name: str) -> None:
    outside, itself = SELF_ONLY[name]
    code = OUTCOME.format(call=outside.format(pid=bystander.pid))
    assert python_probe(tmp_path, code).stdout.strip() == "EPERM"
    assert python_probe(tmp_path, OUTCOME.format(call=itself)).stdout.strip() == "OK"
    # control: allowed, the same call on the outside process goes through
    allowed = python_probe(tmp_path, code, extra_toml=f'\n[syscalls]\nallow = ["{name}"]\n')
    assert allowed.stdout.strip() == "OK", allowed.stderr


def test_syscall_setpriority_on_every_process_of_the_user_refused(tmp_path: Path) -> None:
    code = OUTCOME.format(call="os.setpriority(os.PRIO_USER, 0, 19)")
    assert python_probe(tmp_path, code).stdout.strip() == "EPERM"


SHMAT = """\
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
address = libc.shmat(int(sys.argv[1]), None, 0o10000)  # SHM_RDONLY
if address in (None, ctypes.c_void_p(-1).value):
    print(errno.errorcode[ctypes.get_errno()])
else:
    print(ctypes.string_at(address, 6).decode())
"""


def test_syscall_sysv_shared_memory_of_the_caller_is_unreachable(tmp_path: Path) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    segment = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    assert segment >= 0
    try:
        address = libc.shmat(segment, None, 0)
        ctypes.memmove(address, b"SECRET", 6)
        libc.shmdt(ctypes.c_void_p(address))
        policies = {"denied": 'version = 1\nextends = ["python"]\n',
                    "allowed": 'version = 1\nextends = ["python"]\n[syscalls]\nallow = ["shmat"]\n'}
        seen = {}
        for name, text in policies.items():
            policy = write_policy(tmp_path, text)
            seen[name] = run_confined(policy, [PYTHON, "-c", SHMAT, str(segment)]).stdout.strip()
    finally:
        libc.shmctl(segment, 0, None)  # IPC_RMID
    assert seen == {"denied": "EPERM", "allowed": "SECRET"}


#: A library caller: runs the launcher in process, then has a child of its own that leaves
#: an orphan. ``adopted`` if the orphan came back to the caller (its subreaper) to be waited
#: for; left a subreaper, a caller that never waits keeps each such orphan as a zombie.
LIBRARY_CALLER = """
import os, sys
sys.path.insert(0, sys.argv[1])
from sandlock.compile import compiler
from sandlock.exec import launcher
from sandlock.linux import kernel
from sandlock.policy.model import load_policy
if sys.argv[3] == "subreaper":  # the control: a caller that is one on its own
    kernel.set_child_subreaper()
with compiler.compile_policy(load_policy(sys.argv[2])) as compiled:
    child = launcher.run(compiled, launcher.prepare_command(compiled, ["/usr/bin/true"]),
                         forward_signals=False)
assert child.returncode == 0, child.returncode
parent = os.fork()
if parent == 0:
    if os.fork() == 0:
        os.read(os.open("/dev/null", os.O_RDONLY), 1)  # ends at once
        os._exit(0)
    os._exit(0)
os.waitpid(parent, 0)
try:
    os.waitpid(-1, 0)  # the orphan, if it came back here
    print("adopted")
except ChildProcessError:
    print("not adopted")
"""


@pytest.mark.any_user
@pytest.mark.parametrize("caller", ["plain", "subreaper"])
def test_the_launcher_gives_a_library_caller_its_subreaper_setting_back(tmp_path: Path,
                                                                         caller: str) -> None:
    """`launcher.run` makes its caller the tool tree's subreaper for the run only. Left one
    afterwards, a caller (pytest, a probe) adopted every orphan of its other children and
    never waited for them: zombies piled up until its user's RLIMIT_NPROC refused forks.
    The control: a caller that was a subreaper before stays one, and adopts."""
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n'
                          '[filesystem]\nexec = ["/usr/bin/true"]\n')
    done = subprocess.run([sys.executable, "-c", LIBRARY_CALLER, str(REPO), str(policy), caller],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("adopted" if caller == "subreaper" else "not adopted")
