"""Fork, confine, exec, wait: the only module that starts processes.

The parent prepares everything (:func:`sandlock.compile.compiler.compile_policy`:
ruleset fd, compiled BPF, rlimits; :func:`prepare_command`: executable path, argv,
environment). The child after fork takes the steps of :mod:`sandlock.exec.spec`
(:mod:`sandlock.exec.engine` interprets them), in this order:

    join the run's pids cgroup -> setsid -> PDEATHSIG (+ parent check)
    -> default signals -> stdio -> chdir -> rlimits -> drop capabilities
    -> close-on-exec for fds >= 3 -> no_new_privs -> landlock_restrict_self
    -> seccomp -> [notifying filters] -> execve

``[limits] processes`` is a pids cgroup of the run (:mod:`sandlock.linux.cgroups`) when
this caller can create one, else RLIMIT_NPROC (per user, and not binding root: a
reported gap, refused in strict mode for root).

A failure before exec travels to the parent over a close-on-exec pipe, so the
parent can tell "could not start" (125/126/127) from "ran and failed".

:func:`run` forks the tool from a watchdog (:func:`_watchdog`): the subreaper of the
tool's tree, in a process group of its own, which kills that tree when the launcher
dies, however it dies.
"""

from __future__ import annotations

import os
import select
import signal
import time

from ..errors import ExecError, ExitCode, SetupError
from ..linux import cgroups, kernel
from ..linux.process import (
    FORWARDED_SIGNALS,
    JOB_STOPS,
    children,
    is_terminal,
    reap_descendants,
    refuse_directories,
)
from . import engine, spec
from .spec import Command as Command  # data, defined with the steps; still importable here

# Start-up is paid on every `sandlock run`: nothing the cached run path skips
# (policy parsing, dataclasses, typing, fnmatch/re, threading) is imported here at
# module level. See docs/design.md "Start-up".
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Mapping, Optional, Sequence

    from ..compile.compiler import Compiled
    from ..linux.signalgate import SignalGate, Signals
    from ..net.connect import Mediation
    from ..trace.record import Recorder
    from ..undo.keep import Kept


#: The longest single wait for the tool, in milliseconds (a longer timeout waits again).
POLL_MAX_MS = 86_400_000
#: Bytes of the watchdog's lines about the kept paths (one or two per path) read at most.
MAX_KEPT_REPORT = 1 << 16
#: Seconds a launcher waits for its watchdog's report once the tool was killed, before
#: it kills the watchdog too (one the tool stopped, below Landlock ABI 6).
WATCHDOG_GRACE = 2.0
#: Off unless scripts/measure_fork_exec.py sets it: a pipe to which each child writes
#: three CLOCK_MONOTONIC nanosecond stamps (parent before fork, child after fork,
#: child just before execve), so the child's own path can be timed from outside.
TIMING_FD = -1
_fork_stamp = 0


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


def prepare_command(compiled: Compiled, argv: Sequence[str], *,
                    caller_env: Optional[Mapping[str, str]] = None,
                    cwd: Optional[str] = None) -> Command:
    """The command for ``argv``: found on the caller's PATH, with the environment the
    compiled policy gives the tool."""
    caller = os.environ if caller_env is None else caller_env
    if not argv:
        raise ExecError("no command given", ExitCode.NOT_FOUND)
    exe = resolve_command(argv[0], caller.get("PATH"))
    env = compiled.environment(caller)
    return Command(exe, tuple(argv), tuple(env.items()), cwd)


# ----------------------------------------------------------------------------
# Fork and the child


def _child(steps: tuple[spec.Step, ...], ctx: engine.Context, errw: int,
           body: Optional[Callable[[], None]] = None) -> None:
    """The forked child: take ``steps`` (:mod:`sandlock.exec.spec`), then exec, or run
    ``body`` (a Python call) when the list has no exec step. Never returns."""
    started = time.monotonic_ns() if TIMING_FD >= 0 else 0
    try:
        if TIMING_FD >= 0 and steps[-1][0] == spec.EXEC:
            engine.apply(steps[:-1], ctx)
            stamps = (_fork_stamp, started, time.monotonic_ns())
            os.write(TIMING_FD, b"".join(t.to_bytes(8, "little") for t in stamps))
            steps = steps[-1:]
        engine.apply(steps, ctx)
        if body is not None:  # a Python function instead of a program (sandlock.api call())
            os.close(errw)  # confined: the parent stops waiting for a setup failure
            errw = -1
            body()  # ends with os._exit; its own errors never come back here
        message = "setup\0" + "0\0" + "no exec step and no body"
    except engine.StepFailed as failed:
        exc = failed.error
        message = f"{failed.stage}\0{exc.errno or 0}\0{exc.strerror or exc}"
    except BaseException as exc:  # noqa: BLE001 - must never return into the caller's code
        message = f"setup\0{0}\0{type(exc).__name__}: {exc}"
    try:
        os.write(errw, message.encode(errors="replace"))
    finally:
        os._exit(ExitCode.LAUNCHER)


def _watchdog(steps: tuple[spec.Step, ...], ctx: engine.Context, errw: int,
              body: Optional[Callable[[], None]], report: int, launcher: int,
              group: Optional[cgroups.Group], kept: Sequence[Kept] = ()) -> None:
    """The forked watchdog between the launcher and the tool: never returns.

    It leads a process group of its own (a kill of the launcher's group does not reach
    it) and is the child subreaper of the tool's tree (the tool's daemons are
    re-parented to it, whoever dies above). It forks the tool (:func:`_child`), writes
    the tool's pid then its wait status to ``report``, and once the tool has exited or
    the launcher has died (its pidfd is readable, however it died: SIGKILL included)
    kills and reaps every process left (the run's pids cgroup at once where there is
    one), puts back each ``kept`` path the tool changed (:mod:`sandlock.undo.keep`),
    saying so after the status (on stderr when the launcher is gone), then exits. It
    runs no Python beyond this loop: every module it uses was imported by the launcher
    before the fork.
    """
    status = -1
    orphaned = False
    try:
        # Only what must precede the tool comes before the fork (the launcher waits for
        # the tool's exec): the subreaper, so that no orphan of the tool escapes.
        kernel.set_child_subreaper()
        ctx.parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the tool's process, which never returns
            os.close(report)
            _child(steps, ctx, errw, body)
        os.close(errw)
        errw = -1
        if ctx.terminal >= 0:  # the tool's; the pty hangs up once the tool's tree is gone
            os.close(ctx.terminal)
        os.setpgid(0, 0)
        watched = os.pidfd_open(launcher)
        # The launcher's signals (blocked by run() until its handlers exist) stay blocked
        # here: they are the tool's to receive, forwarded by the launcher.
        if os.getppid() != launcher:  # the launcher died before the pidfd: end the run
            raise ProcessLookupError("the launcher is gone")
        if group is not None and group.procs_fd >= 0:  # the tool's to join, not ours
            os.close(group.procs_fd)
            group.procs_fd = -1
        os.write(report, pid.to_bytes(4, "little", signed=True))
        tool = os.pidfd_open(pid)
        poller = select.poll()
        poller.register(watched, select.POLLIN)
        poller.register(tool, select.POLLIN)
        while status < 0:
            ready = {fd for fd, _ in poller.poll()}
            if tool in ready:
                status = os.waitpid(pid, 0)[1]
                os.write(report, status.to_bytes(4, "little", signed=True))
            elif watched in ready:
                orphaned = True  # the launcher is gone: the run is over, the group ours
                break
    except BaseException as exc:  # noqa: BLE001 - must never return into the caller's code
        orphaned = orphaned or isinstance(exc, ProcessLookupError)
        if errw >= 0:
            why = _fork_failure(exc) if isinstance(exc, OSError) else f"watchdog: {exc}"
            message = f"setup\0{getattr(exc, 'errno', 0) or 0}\0{why}"
            os.write(errw, message.encode(errors="replace"))
    finally:
        try:
            if group is not None:  # the whole tree at once, a fork bomb included, before
                # reaping (one by one, a bomb that forks at its cap would never be done)
                if orphaned:
                    group.close()  # and nobody else will remove the group
                else:
                    group.kill()  # the launcher removes it once told the status
            if _has_children():
                reap_descendants()
            if kept:
                _put_back(kept, 2 if orphaned else report)
        finally:
            os._exit(0 if status >= 0 else ExitCode.LAUNCHER)


def _put_back(kept: Sequence[Kept], out: int) -> None:
    """Put back each kept path the tool changed (its tree is gone); one line on ``out``
    for each, ``!`` first where it could not be."""
    from ..undo.keep import KeepError, in_order, put_back

    for each in in_order(kept):
        try:
            said, mark = put_back(each), " "
        except KeepError as exc:
            said, mark = str(exc), "!"
        if said is not None:
            line = f"sandlock: {said}" if out == 2 else mark + said
            os.write(out, line.encode(errors="backslashreplace") + b"\n")
    if out != 2:  # every kept path was seen to: the launcher need not look again
        os.write(out, KEPT_ALL_SEEN.encode() + b"\n")


#: The watchdog's last line once it has put back every kept path (Child.kept's last).
KEPT_ALL_SEEN = "="


def _drain(fd: int) -> None:
    """Read a non-blocking pipe empty."""
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass


def _fork_failure(exc: OSError) -> str:
    """What a failed fork means for the user: EAGAIN is their RLIMIT_NPROC."""
    import errno

    if exc.errno == errno.EAGAIN:
        from ..compile.compiler import process_shortage

        return process_shortage()
    return f"cannot fork: {exc.strerror or exc}"


def _has_children() -> bool:
    """Whether this process has a child, zombie or alive (one waitid, not a /proc read)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # None: none exited yet
    except ChildProcessError:
        return False
    return True


class Child:
    """A confined process started by :func:`spawn`."""

    def __init__(self, pid: int, spared: frozenset[int] = frozenset(),
                 group: Optional[cgroups.Group] = None,
                 watchdog: Optional[tuple[int, int]] = None) -> None:
        self.pid = pid
        self.spared = spared  #: the caller's own children, never killed when reaping
        self.group = group  #: the run's pids cgroup: killed and removed when reaped
        #: (pid, report fd) of the run's watchdog (:func:`_watchdog`), the tool's parent;
        #: None when the tool is this process's own child.
        self.watchdog = watchdog
        #: What the watchdog said of the kept paths it put back (``!`` first: could not).
        self.kept: list[str] = []
        self.pidfd = os.pidfd_open(pid) if watchdog is None else watchdog[1]
        self.returncode: Optional[int] = None
        self.timed_out = False
        self.signal: Optional[int] = None
        #: The signal gate's own listener (Landlock ABI < 6): stopped once the tree is gone.
        self.gate: Optional[SignalGate] = None
        #: Bytes of the tool's output the caller's terminal never took (exec/terminal.py).
        self.output_dropped = 0
        #: Where a forwarded signal's arrival is written (signal.set_wakeup_fd), watched with
        #: the tool: a signal caught just before the wait began would otherwise wait with it.
        self.wakeup = -1

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the command, kill its whole tree on timeout, return the exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            # poll, not select: a launcher started with many descriptors open gets a
            # pidfd above FD_SETSIZE (1024), which select cannot watch.
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            if self.wakeup >= 0:
                poller.register(self.wakeup, select.POLLIN)
            # At most a day per wait (poll takes an int of milliseconds): a longer limit is
            # waited for in several.
            ready = poller.poll(None if remaining is None else min(int(remaining * 1000) + 1,
                                                                    POLL_MAX_MS))
            if any(fd == self.wakeup for fd, _ in ready):
                _drain(self.wakeup)  # its handler ran (or runs at the next line): wait on
                continue
            if ready:
                self._reap()
            elif deadline is not None and time.monotonic() >= deadline:
                self.timed_out = True
                self.kill_tree()
        return self.returncode

    def _reap(self) -> None:
        if self.watchdog is None:
            _, status = os.waitpid(self.pid, 0)
        else:
            status = self._watchdog_status()
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            self.signal = -code
            code = ExitCode.SIGNAL_BASE + self.signal
        self.returncode = ExitCode.TIMEOUT if self.timed_out else code
        os.close(self.pidfd)
        self.pidfd = -1
        if self.group is not None:
            self.group.kill()  # the whole tree at once, a fork bomb included
        reap_descendants(self.spared)
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.gate is not None:
            self.gate.stop()
            self.gate = None

    def _watchdog_status(self) -> int:
        """The tool's wait status as its watchdog reports it, once the watchdog has
        killed what was left and exited. A watchdog that dies without reporting (killed)
        took the tool with it (PR_SET_PDEATHSIG): SIGKILL; its orphans came back to this
        process (a subreaper), which reaps them."""
        assert self.watchdog is not None
        pid, report = self.watchdog
        data = b""
        poller = select.poll()
        poller.register(report, select.POLLIN)
        while len(data) < 4:
            if not poller.poll(int(WATCHDOG_GRACE * 1000)):
                os.kill(pid, signal.SIGKILL)  # stopped: the tree is ours to end
                continue
            chunk = os.read(report, 4 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) == 4:  # then what it put back of the kept paths, until it exits
            # (however long it takes to end the tree: the wait below is as long)
            rest = b""
            while len(rest) < MAX_KEPT_REPORT:
                chunk = os.read(report, MAX_KEPT_REPORT - len(rest))
                if not chunk:
                    break
                rest += chunk
            self.kept = rest.decode(errors="backslashreplace").splitlines()
        os.waitpid(pid, 0)
        return int.from_bytes(data, "little", signed=True) if len(data) == 4 else int(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        """Signal the command's process group (it is the leader of its own session)."""
        if self.returncode is not None:
            return  # reaped: the group id may already belong to someone else
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill_tree(self) -> None:
        if self.group is not None and self.returncode is None:
            self.group.kill()
        self.send_signal(signal.SIGKILL)
        if self.returncode is None:
            self._reap()


def spawn(compiled: Compiled, cmd: Command, *, stdin: int = -1, stdout: int = -1,
          stderr: int = -1, hook: Optional[Callable[[], None]] = None,
          body: Optional[Callable[[], None]] = None, signals: Optional[Signals] = None) -> Child:
    """Fork a confined child running ``cmd``. Raises on any failure before exec.

    ``body``, if given, runs in the confined child instead of execve (it must end
    with ``os._exit``): the fork server's Python calls use the very same steps.
    """
    return Starting(compiled, cmd, stdio=(stdin, stdout, stderr), hook=hook, body=body,
                    signals=signals).confirm()


class Starting:
    """A child forked and confining itself: :meth:`confirm` waits until it has exec'd
    (or, with a ``body``, until it is confined) and raises its setup failure if any.
    Between the two the parent is free: the fork server prepares confined processes
    ahead of the calls that will use them."""

    def __init__(self, compiled: Compiled, cmd: Command, *, stdio: tuple[int, int, int],
                 hook: Optional[Callable[[], None]] = None,
                 body: Optional[Callable[[], None]] = None,
                 steps: Optional[tuple[spec.Step, ...]] = None,
                 signals: Optional[Signals] = None, watchdog: bool = False,
                 keep: Sequence[Kept] = (), terminal: int = -1) -> None:
        """``steps``: the child's steps as a request carried them (checked by the
        caller); by default :func:`spec.child_steps` for ``compiled`` and ``cmd``.
        ``signals``: the signal gate's handler when another listener of the run carries it
        (:func:`carry_signals`); else a policy that needs the gate gets its own here.
        ``watchdog``: fork the tool from a watchdog (:func:`_watchdog`) that kills its
        whole tree if this process dies; ``keep``: the paths it puts back once the tree
        is gone; ``terminal``: the pty the tool takes as its controlling terminal (its
        slave, among ``stdio``: :mod:`sandlock.exec.terminal`)."""
        # fsencode, not encode: argv and environment are bytes on Linux, and Python keeps
        # bytes that are not UTF-8 as surrogate escapes.
        env = {os.fsencode(k): os.fsencode(v) for k, v in cmd.env}
        argv = [os.fsencode(a) for a in cmd.argv]
        self.cmd = cmd
        self.ruleset_fd = compiled.ruleset_fd  # to say which file an exec refusal was about
        self.group: Optional[cgroups.Group] = None
        limit = compiled.run_group_limit()
        if limit is not None:
            assert compiled.cgroup is not None
            try:
                self.group = cgroups.Group(compiled.cgroup, limit)
            except cgroups.CgroupError as exc:
                raise SetupError(f"[limits] processes = {limit}: {exc.strerror}") from None
        try:
            self.errr, errw = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            self.discard_group()
            raise
        in_group = self.group is not None
        self.gate, hook = _own_gate(compiled, signals, body, hook)
        if self.gate is not None:
            signals = self.gate.signals
        if steps is None:
            steps = spec.child_steps(compiled, cmd, in_group=in_group, notify=hook is not None,
                                     exec_=body is None)
        elif any(s[0] == spec.CGROUP for s in steps) != in_group:
            self.discard_group()
            raise SetupError("malformed request: the cgroup step and the run's pids cgroup disagree")
        elif any(s[0] == spec.NOTIFY for s in steps) != (hook is not None):
            self.discard_group()
            raise SetupError("malformed request: the notify step and the run's listeners disagree")
        group_fd = -1 if self.group is None else self.group.procs_fd
        ctx = engine.Context(parent=os.getpid(), group_fd=group_fd,
                             stdio=stdio, terminal=terminal, ruleset_fd=compiled.ruleset_fd,
                             fprog=compiled._fprog,
                             notify=hook, executable=cmd.executable, argv=argv, env=env)
        # Before fork: an orphan of the tool can never be among them.
        self.spared = frozenset(children())
        if TIMING_FD >= 0:
            global _fork_stamp
            _fork_stamp = time.monotonic_ns()
        self.report = -1
        reportw = -1
        try:
            if watchdog:
                self.report, reportw = os.pipe2(os.O_CLOEXEC)
            launcher = os.getpid()
            self.pid = os.fork()
        except BaseException as exc:
            for fd in (self.errr, errw, self.report, reportw):
                if fd >= 0:
                    os.close(fd)
            self.discard_group()
            if isinstance(exc, OSError):
                raise SetupError(_fork_failure(exc)) from None
            raise
        if self.pid == 0:  # pragma: no cover - runs in the child, which never returns
            os.close(self.errr)
            if watchdog:
                os.close(self.report)
                _watchdog(steps, ctx, errw, body, reportw, launcher, self.group, keep)
            _child(steps, ctx, errw, body)
        os.close(errw)
        if reportw >= 0:
            os.close(reportw)
        if self.gate is not None:
            self.gate.start()
        if self.group is not None:  # the child holds its copy until exec (close-on-exec)
            os.close(self.group.procs_fd)
            self.group.procs_fd = -1

    def discard_group(self) -> None:
        """Kill what is in the run's pids cgroup and remove it (a child that never ran,
        or a spare thrown away)."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def confirm(self) -> Child:
        try:
            report = b""
            while chunk := os.read(self.errr, 4096):
                report += chunk
        finally:
            os.close(self.errr)
            self.errr = -1
        watchdog = None
        if self.report >= 0:  # the watchdog's first report: the tool's pid
            watchdog = (self.pid, self.report)
            tool = os.read(self.report, 4) if not report else b""
            if len(tool) < 4 and not report:
                report = b"setup\0" + b"0\0" + b"the watchdog of the run died"
        if report:
            os.waitpid(self.pid, 0)
            if self.report >= 0:
                os.close(self.report)
            self.discard_group()
            if self.gate is not None:
                self.gate.stop()
            from .wire import setup_failure

            raise setup_failure(self.cmd, report, self.ruleset_fd)
        pid = self.pid if watchdog is None else int.from_bytes(tool, "little", signed=True)
        child = Child(pid, self.spared, self.group, watchdog)
        child.gate, self.gate = self.gate, None  # the Child's now, as the group
        self.group = None  # the Child's now
        return child


def run(compiled: Compiled, cmd: Command, *, timeout: Optional[float] = None,
        forward_signals: bool = True, report: Optional[Callable[[str], None]] = None,
        _mediation: Optional[Mediation] = None, recorder: Optional[Recorder] = None,
        keep: Sequence[Kept] = ()) -> Child:
    """Run ``cmd`` confined, as the launcher process: subreaper (for the run only), signal
    forwarding, timeout; ``keep``: the paths its watchdog puts back (``Child.kept``).

    Returns the finished :class:`Child`; its ``returncode`` follows :class:`ExitCode`.
    ``report`` receives one line per network refusal (policies with ``[network] allow``),
    and one hint when the command exits non-zero. ``recorder`` (`sandlock trace`/`learn`
    only, :mod:`sandlock.trace.record`) loads its notifying filter in the child and is started
    before the child's execve, which it is notified of; the caller stops it.
    """
    was_subreaper = kernel.set_child_subreaper()
    # A caller that ignores SIGCHLD would have its children reaped by the kernel, and the
    # run's waits fail: the default for the run (the tool starts with it too).
    ignored = signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        if compiled.routes is not None:  # credential routes (issue 16), granted by compile_policy
            from ..net.routes import Routes, serving

            assert isinstance(compiled.routes, Routes)  # the API's remote ones never come here
            with serving(compiled.routes, cmd) as routed_cmd:  # serving for this run only
                return _mediated(compiled, routed_cmd, timeout, forward_signals, _mediation,
                                 recorder, report, keep)
        return _mediated(compiled, cmd, timeout, forward_signals, _mediation, recorder, report,
                         keep)
    finally:
        # The run's tree is reaped by now. A caller that stayed a subreaper would adopt
        # every orphan of its other children for good, as zombies it never waits for.
        if not was_subreaper:
            kernel.set_child_subreaper(False)
        if ignored:
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)


def _mediated(compiled: Compiled, cmd: Command, timeout: Optional[float], forward_signals: bool,
              _mediation: Optional[Mediation], recorder: Optional[Recorder],
              report: Optional[Callable[[str], None]], keep: Sequence[Kept] = ()) -> Child:
    """:func:`run`, through the host allowlist's proxy and connect gate when the policy has one."""
    if compiled.network is not None and _mediation is None:  # host allowlist (issue 7)
        from ..net.connect import Mediation

        # Mediation reads only ``.network`` of what it is given: the plan's
        # the credential route's connections are admitted for this run (routes.RouteServer)
        with Mediation(compiled, report, compiled.routes) as mediation:  # type: ignore[arg-type]
            return _run(compiled, mediation.command(cmd), timeout, forward_signals, mediation,
                        recorder, report, keep)
    return _run(compiled, cmd, timeout, forward_signals, _mediation, recorder, report, keep)


def _hint(compiled: Compiled, cmd: Command, child: Child, report: Callable[[str], None],
          mediation: Optional[Mediation] = None) -> None:
    """One line when the command failed: where to look for what the policy refused. The
    network hint only when the host allowlist refused a connection of this run."""
    if compiled.network is not None and (mediation is None or mediation.events):
        # A tool that resolves names itself gets no DNS here, which it reports as its
        # own error.
        report(f"hint: the command exited with {child.returncode}; this policy reaches the "
               "network only through sandlock's proxy (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY): a "
               "tool that ignores them cannot even resolve names; refusals are reported above")
        return
    if compiled.network is not None:  # nothing refused on the network: look elsewhere
        report(f"hint: {os.path.basename(cmd.argv[0])} exited with {child.returncode}; no "
               "connection was refused; `sandlock trace` with the same options lists the files, "
               "ports and sockets it refused")
        return
    report(f"hint: {os.path.basename(cmd.argv[0])} exited with {child.returncode}; "
           "`sandlock trace` with the same options lists what the policy refused it")


def _run(compiled: Compiled, cmd: Command, timeout: Optional[float], forward_signals: bool,
         _mediation: Optional[Mediation], recorder: Optional[Recorder],
         report: Optional[Callable[[str], None]] = None, keep: Sequence[Kept] = ()) -> Child:
    child = _run_child(compiled, cmd, timeout, forward_signals, _mediation, recorder, keep)
    if report is not None and recorder is None and child.returncode and child.signal is None \
            and not child.timed_out:
        _hint(compiled, cmd, child, report, _mediation)
    return child


def _run_child(compiled: Compiled, cmd: Command, timeout: Optional[float], forward_signals: bool,
               _mediation: Optional[Mediation], recorder: Optional[Recorder],
               keep: Sequence[Kept] = ()) -> Child:
    from ..compile.grants import refuse_foreign_directory  # the compile imported it

    refuse_directories((0, 1, 2))
    refuse_foreign_directory(cmd.cwd)
    if recorder is not None and _mediation is not None:
        # One listener per process: the connect gate rides on the recorder's (its filter,
        # the new-listener refusal included, goes first in the recorder's program).
        recorder.carry(_mediation.gate)
    hooks = [h.in_child for h in (recorder, _mediation) if h is not None]  # recorder first:
    # the mediation filter refuses new listeners
    # the signal gate (Landlock ABI < 6) rides on the recorder's or the connect gate's
    # listener; without either, Starting gives the child a listener of its own
    signals = carry_signals(compiled.signal_gate, recorder, _mediation)

    def hook() -> None:
        for each in hooks:
            each()
    # Hold the forwarded signals until the handlers that forward them exist: one that
    # arrived between fork and the handlers would kill or interrupt the launcher and
    # leave the tool running. The child unblocks them before exec.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS) if forward_signals else None
    previous = {}
    wakeup: Optional[tuple[int, int]] = None
    old_wakeup = -1
    # The caller's terminal is never the tool's: a pty of its own, relayed (exec/terminal.py).
    relay = None
    stdio, tty = (-1, -1, -1), -1
    if any(is_terminal(fd) for fd in (0, 1, 2)):  # else nothing imported: every run's path
        from .terminal import Relay

        relay = Relay((0, 1, 2), interactive=True)
        stdio, tty = relay.replace((0, 1, 2)), relay.slave
    try:
        try:
            starting = Starting(compiled, cmd, stdio=stdio, hook=hook if hooks else None,
                                signals=signals, watchdog=True, keep=keep, terminal=tty)
            if recorder is not None:
                recorder.start()  # before confirm(): the child's own execve is notified
            child = starting.confirm()
            if relay is not None:
                relay.start()
        except BaseException:
            if relay is not None:
                relay.close()
            raise
        if _mediation is not None:
            _mediation.start()  # threads only after fork
        if forward_signals:
            try:
                for signum in FORWARDED_SIGNALS:
                    previous[signum] = signal.signal(signum, lambda n, _f: child.send_signal(n))
                for signum in JOB_STOPS:  # stopped, the launcher would never time out
                    previous[signum] = signal.signal(signum, signal.SIG_IGN)
                if relay is not None:
                    resize = relay.resize
                    previous[signal.SIGWINCH] = signal.signal(signal.SIGWINCH,
                                                              lambda _n, _f: resize())
                wakeup = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    old_wakeup = signal.set_wakeup_fd(wakeup[1], warn_on_full_buffer=False)
                except BaseException:
                    for fd in wakeup:
                        os.close(fd)
                    raise
                child.wakeup = wakeup[0]
            except ValueError:  # not the main thread: only it may handle signals
                pass
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        limit = timeout if timeout is not None else compiled.timeout
        child.wait(limit)
    finally:
        if wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)
            for fd in wakeup:
                os.close(fd)
            child.wakeup = -1
        if child.returncode is None:
            child.kill_tree()
        if relay is not None:
            relay.close()  # the tool's last output, then the caller's terminal as it was
            child.output_dropped = relay.dropped
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return child


# -- the signal gate: the substitute for Landlock's signal scope below ABI 6 -------------


def carry_signals(needed: bool, *listeners: object) -> Optional[Signals]:
    """The signal gate's handler, put on the run's first other listener (a recorder, or
    the connect gate of a Mediation): a process may have only one listener. None when the
    run needs no gate or has no other listener (then :class:`Starting` makes the gate a
    listener of its own). Before fork. (Nothing is imported for a run that needs no gate:
    this is on every `sandlock run`'s path.)"""
    carriers = [getattr(each, "gate", each) for each in listeners if each is not None]
    if not needed or not carriers:
        return None
    from ..linux.notify import Listener
    from ..linux.signalgate import Signals

    signals = Signals()
    carrier = carriers[0]
    assert isinstance(carrier, Listener)
    carrier.gate_signals(signals)
    return signals


def _own_gate(compiled: Compiled, signals: Optional[Signals], body: object,
              hook: Optional[Callable[[], None]]
              ) -> tuple[Optional[SignalGate], Optional[Callable[[], None]]]:
    """A listener of its own for a command whose policy needs the gate and whose caller
    put it on no other listener (``signals`` None); ``hook`` then installs it as well.
    A Python call's spare (``body``) gets one too, in the supervisor that forks it."""
    if not compiled.signal_gate or signals is not None:
        return None, hook
    from ..linux.signalgate import SignalGate, Signals

    gate = SignalGate(Signals())
    if hook is None:
        return gate, gate.in_child
    first = hook

    def both() -> None:
        first()
        gate.in_child()

    return gate, both
