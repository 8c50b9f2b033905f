"""Fork, confine, exec, wait: the only module that starts processes.

The parent prepares everything (:func:`compile_policy`: ruleset fd, compiled BPF,
rlimits; :func:`prepare_command`: executable path, argv, environment). The child
after fork makes a handful of syscalls, in this order:

    setsid -> PDEATHSIG (+ parent check) -> default signals -> stdio -> chdir
    -> rlimits -> close-on-exec for fds >= 3 -> no_new_privs
    -> landlock_restrict_self -> seccomp -> execve

A failure before exec travels to the parent over a close-on-exec pipe, so the
parent can tell "could not start" (125/126/127) from "ran and failed".
"""

from __future__ import annotations

import errno
import os
import resource
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Mapping, Optional, Sequence

from . import kernel, ruleset, seccomp
from .errors import ExecError, ExitCode, KernelSupportError, SandlockError, SetupError
from .policy import Compat, EnvSpec, Limits, Policy

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@dataclass
class Compiled:
    """A policy made ready for the kernel; reusable for any number of launches.

    The ruleset fd may be shared by many children: landlock_restrict_self only
    reads it. Close it with :meth:`close` when done.
    """

    policy: Policy
    abi: int
    gaps: tuple[ruleset.Gap, ...]
    ruleset_fd: int
    bpf: bytes
    rlimits: tuple[tuple[int, int], ...]
    _fprog: object = field(repr=False, default=None)
    _keep: object = field(repr=False, default=None)

    def __post_init__(self) -> None:
        self._fprog, self._keep = kernel.make_fprog(self.bpf)

    @property
    def warnings(self) -> list[str]:
        """One line per protection not enforced (only non-empty in best-effort mode)."""
        return [str(gap) for gap in self.gaps]

    def close(self) -> None:
        if self.ruleset_fd >= 0:
            os.close(self.ruleset_fd)
            self.ruleset_fd = -1

    def __enter__(self) -> "Compiled":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rlimits_for(limits: Limits) -> tuple[tuple[int, int], ...]:
    """(resource, value) pairs; core dumps are always off."""
    pairs = [(resource.RLIMIT_CORE, 0)]
    for value, res in ((limits.cpu, resource.RLIMIT_CPU), (limits.memory, resource.RLIMIT_AS),
                       (limits.processes, resource.RLIMIT_NPROC),
                       (limits.open_files, resource.RLIMIT_NOFILE),
                       (limits.file_size, resource.RLIMIT_FSIZE)):
        if value is not None:
            pairs.append((res, value))
    return tuple(pairs)


def strict_failure(policy: Policy, abi: int, gaps: Sequence[ruleset.Gap]) -> KernelSupportError:
    lines = "\n".join(f"  - {gap}" for gap in gaps)
    return KernelSupportError(
        f"this kernel (Landlock ABI {abi}) cannot enforce what {policy.source} relies on:\n{lines}\n"
        "Refusing to run. Use a newer kernel, remove the grant that needs it, or accept the gap "
        "with --best-effort (or compat = \"best-effort\" in the policy)."
    )


def compile_policy(policy: Policy) -> Compiled:
    """Check kernel support, build the Landlock ruleset and the seccomp BPF."""
    why = kernel.seccomp_supported()
    if why:
        raise KernelSupportError(f"seccomp filters are unavailable: {why}")
    abi = ruleset.detect_abi()
    plan = ruleset.plan(policy, abi)
    if plan.gaps and policy.compat is Compat.STRICT:
        raise strict_failure(policy, abi, plan.gaps)
    if policy.syscalls.allow or policy.syscalls.deny:
        seccomp.check_names(policy)
    bpf = seccomp.bpf_for(seccomp.plan(policy))
    fd = ruleset.build(plan)
    return Compiled(policy, abi, plan.gaps, fd, bpf, rlimits_for(policy.limits))


# ----------------------------------------------------------------------------
# The command


def build_env(spec: EnvSpec, caller: Mapping[str, str]) -> dict[str, str]:
    """Only the names ``pass`` matches, then ``set``: nothing else of the caller's."""
    env = {k: v for k, v in caller.items() if any(fnmatchcase(k, p) for p in spec.passed)}
    env.update(spec.set)
    return env


def resolve_command(name: str, path: Optional[str]) -> str:
    """Find ``name`` on the caller's PATH as env(1) does; raise ExecError 127/126."""
    if not name:
        raise ExecError("empty command", ExitCode.NOT_FOUND)
    if "/" in name:
        candidates = [name]
    else:
        candidates = [os.path.join(d or ".", name) for d in (path or os.defpath).split(":")]
    seen_non_executable = None
    for candidate in candidates:
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            seen_non_executable = candidate
        elif "/" in name and os.path.isdir(candidate):
            raise ExecError(f"{name}: is a directory", ExitCode.NOT_EXECUTABLE)
    if seen_non_executable:
        raise ExecError(f"{seen_non_executable}: permission denied", ExitCode.NOT_EXECUTABLE)
    raise ExecError(f"{name}: command not found", ExitCode.NOT_FOUND)


@dataclass(frozen=True)
class Command:
    executable: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: Optional[str] = None


def prepare_command(policy: Policy, argv: Sequence[str], *, caller_env: Optional[Mapping[str, str]] = None,
                    cwd: Optional[str] = None) -> Command:
    caller = os.environ if caller_env is None else caller_env
    if not argv:
        raise ExecError("no command given", ExitCode.NOT_FOUND)
    exe = resolve_command(argv[0], caller.get("PATH"))
    env = build_env(policy.env, caller)
    return Command(exe, tuple(argv), tuple(env.items()), cwd)


# ----------------------------------------------------------------------------
# Fork and the child


def _child(compiled: Compiled, cmd: Command, errw: int, parent: int,
           stdio: tuple[int, int, int], env: dict[bytes, bytes], argv: list[bytes]) -> None:
    stage = "setup"
    try:
        os.setsid()
        kernel.set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(ExitCode.LAUNCHER)
        for signum in (signal.SIGPIPE, signal.SIGXFSZ, *FORWARDED_SIGNALS):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        for target, source in enumerate(stdio):
            if source >= 0 and source != target:
                os.dup2(source, target)
        if cmd.cwd is not None:
            stage = "chdir"
            os.chdir(cmd.cwd)
        stage = "rlimit"
        for res, value in compiled.rlimits:
            resource.setrlimit(res, (value, value))
        stage = "setup"
        kernel.cloexec_from(3)
        kernel.no_new_privs()
        if compiled.ruleset_fd >= 0:
            stage = "landlock"
            kernel.restrict_self(compiled.ruleset_fd)
        stage = "seccomp"
        kernel.load_seccomp(compiled._fprog)  # type: ignore[arg-type]
        stage = "exec"
        os.execve(cmd.executable, argv, env)
    except OSError as exc:
        message = f"{stage}\0{exc.errno or 0}\0{exc.strerror or exc}"
    except BaseException as exc:  # noqa: BLE001 - must never return into the caller's code
        message = f"setup\0{0}\0{stage}: {type(exc).__name__}: {exc}"
    try:
        os.write(errw, message.encode(errors="replace"))
    finally:
        os._exit(ExitCode.LAUNCHER)


def _setup_failure(cmd: Command, report: bytes) -> SandlockError:
    stage, code, text = (report.decode(errors="replace").split("\0", 2) + ["", ""])[:3]
    err = int(code or 0)
    if stage == "exec":
        if err in (errno.ENOENT, errno.ENOTDIR):
            return ExecError(f"{cmd.executable}: command not found", ExitCode.NOT_FOUND)
        if err in (errno.EACCES, errno.EPERM):
            return ExecError(f"{cmd.executable}: permission denied (the policy does not grant exec "
                             "on it, or on its interpreter or loader)", ExitCode.NOT_EXECUTABLE)
        return ExecError(f"{cmd.executable}: cannot execute: {text}", ExitCode.NOT_EXECUTABLE)
    if stage == "chdir":
        return SetupError(f"cannot change directory to {cmd.cwd!r}: {text}")
    return SetupError(f"sandbox setup failed at {stage}: {text}")


class Child:
    """A confined process started by :func:`spawn`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.returncode: Optional[int] = None
        self.timed_out = False
        self.signal: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the command, kill its whole tree on timeout, return the exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.pidfd], [], [], remaining)
            if ready:
                self._reap()
            elif deadline is not None and time.monotonic() >= deadline:
                self.timed_out = True
                self.kill_tree()
        return self.returncode

    def _reap(self) -> None:
        _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            self.signal = -code
            code = ExitCode.SIGNAL_BASE + self.signal
        self.returncode = ExitCode.TIMEOUT if self.timed_out else code
        os.close(self.pidfd)
        self.pidfd = -1
        reap_descendants()

    def send_signal(self, signum: int) -> None:
        """Signal the command's process group (it is the leader of its own session)."""
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill_tree(self) -> None:
        self.send_signal(signal.SIGKILL)
        if self.returncode is None:
            self._reap()


def reap_descendants() -> None:
    """Kill and reap whatever the command left behind.

    The launcher is a child subreaper, so daemons that double-forked or called
    setsid are re-parented to it: kill every child (each kill re-parents that
    child's own children to us) until none is left.
    """
    children_file = f"/proc/self/task/{threading.get_native_id()}/children"
    while True:
        try:
            with open(children_file) as handle:
                pids = [int(p) for p in handle.read().split()]
        except OSError:
            pids = []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def spawn(compiled: Compiled, cmd: Command, *, stdin: int = -1, stdout: int = -1,
          stderr: int = -1) -> Child:
    """Fork a confined child running ``cmd``. Raises on any failure before exec."""
    env = {k.encode(): v.encode() for k, v in cmd.env}
    argv = [a.encode() for a in cmd.argv]
    errr, errw = os.pipe2(os.O_CLOEXEC)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which never returns
        os.close(errr)
        _child(compiled, cmd, errw, parent, (stdin, stdout, stderr), env, argv)
    os.close(errw)
    try:
        report = b""
        while chunk := os.read(errr, 4096):
            report += chunk
    finally:
        os.close(errr)
    if report:
        os.waitpid(pid, 0)
        raise _setup_failure(cmd, report)
    return Child(pid)


def run(compiled: Compiled, cmd: Command, *, timeout: Optional[float] = None,
        forward_signals: bool = True) -> Child:
    """Run ``cmd`` confined, as the launcher process: subreaper, signal forwarding, timeout.

    Returns the finished :class:`Child`; its ``returncode`` follows :class:`ExitCode`.
    """
    kernel.set_child_subreaper()
    child = spawn(compiled, cmd)
    previous = {}
    if forward_signals and threading.current_thread() is threading.main_thread():
        for signum in FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, lambda n, _f: child.send_signal(n))
    try:
        limit = timeout if timeout is not None else compiled.policy.limits.timeout
        child.wait(limit)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if child.returncode is None:
            child.kill_tree()
    return child
