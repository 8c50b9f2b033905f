"""The fork server process and the supervisors it forks (design: :mod:`.forkserver`).

Runs only in the fork server, which the caller execs as ``python -I -S -c "... from
sandlock.exec.server import serve ..."``, and in the supervisors forked from it: never
in the agent's process, never in a confined one (that is :mod:`sandlock.exec.callee`).
Requests are :mod:`marshal` dictionaries written by the trusted caller; the command's
confinement steps in them are checked (:func:`_steps`) before anything is forked.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import socket
import struct
import sys

from ..linux.process import FORWARDED_SIGNALS, children
from .wire import FORKSERVER_INLINE_LIMIT, KINDS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Sequence

#: Idle supervisors kept ready per kind. Two lets a call start while the replacement
#: for the previous one is still being forked.
POOL = 2
#: Calls a supervisor serves before it exits (bounds heap growth).
MAX_USES = 1000
#: Supervisor -> fork server notes: event byte and pid, one atomic pipe write each.
NOTE = struct.Struct("=ci")
_RECV_SIZE = FORKSERVER_INLINE_LIMIT + 1024
_MAX_FDS = 8

def serve(exec_fd: int, call_fd: int) -> None:
    """Main loop of the fork server process (never returns)."""
    # What a confined Python call needs right after fork, so it reads no more files.
    import fcntl  # noqa: F401 - an import in a forked child costs ~0.2 ms
    import operator  # noqa: F401
    import pickle  # noqa: F401
    import traceback  # noqa: F401

    from ..linux import kernel
    from . import launcher  # noqa: F401 - loaded once, shared by every child

    kernel.set_child_subreaper()
    os.chdir("/")  # every request names its working directory; do not pin the caller's
    ctrls = {"exec": socket.socket(fileno=exec_fd), "call": socket.socket(fileno=call_fd)}
    for sock in ctrls.values():
        sock.set_inheritable(False)
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    notes_r, notes_w = os.pipe2(os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's business
    supervisors: dict[int, str] = {}  # pid -> kind
    idle: set[int] = set()
    me = os.getpid()

    def fork_supervisor(kind: str) -> None:
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, notes_r):
                    os.close(fd)
                for other, sock in ctrls.items():
                    if other != kind:
                        sock.close()
                kernel.set_pdeathsig(signal.SIGKILL)
                if os.getppid() != me:
                    os._exit(0)
                kernel.set_child_subreaper()
                _supervise(ctrls[kind], notes_w, kind, me)
            finally:
                os._exit(0)
        supervisors[pid] = kind
        idle.add(pid)

    def fill() -> None:
        for kind in KINDS:
            for _ in range(POOL - sum(supervisors[pid] == kind for pid in idle)):
                fork_supervisor(kind)

    import gc

    gc.collect()
    gc.freeze()  # keep the collector from touching (and copying) the shared heap
    fill()
    from .spec import VERSION

    ctrls["exec"].send(b"R %d %d" % (me, VERSION))
    poller = select.poll()
    for sock in ctrls.values():
        poller.register(sock.fileno(), 0)  # only POLLHUP: requests are for the supervisors
    poller.register(notes_r, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, _events in poller.poll():
            if fd == notes_r:
                # Records of NOTE.size bytes (atomic pipe writes): "t" a supervisor took
                # a request, "i" it is idle again.
                data = os.read(notes_r, NOTE.size * 64)
                for event, pid in NOTE.iter_unpack(data):
                    (idle.add if event == b"i" else idle.discard)(pid)
                fill()
            elif fd == wake_r:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
                _reap(supervisors, me)
                idle.intersection_update(supervisors)
                fill()
            else:
                _shutdown(supervisors)


def _reap(supervisors: dict[int, str], me: int) -> None:
    """Collect exited supervisors; kill any other child (orphans of a dead supervisor)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        supervisors.pop(pid, None)
    for pid in children(me):
        if pid not in supervisors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _shutdown(supervisors: dict[int, str]) -> None:
    """The caller is gone: kill every process of every call, then exit."""
    from ..linux.process import reap_descendants

    del supervisors  # every child goes, supervisors included
    reap_descendants()
    from ..linux import cgroups

    base = cgroups.find()[0]
    if base is not None:
        cgroups.sweep(base)  # the groups of spares killed with their supervisors
    os._exit(0)


# ----------------------------------------------------------------------------
# Supervisor side (one call)


def _receive(ctrl: socket.socket, leaving: Callable[[], None] = lambda: None
             ) -> tuple[dict[str, Any], list[int]]:
    """Block until a request arrives; exit quietly when the caller has gone (after
    ``leaving()``)."""
    import array

    def _exit(code: int) -> None:
        leaving()
        os._exit(code)

    fds = array.array("i")
    try:
        data, ancillary, flags, _ = ctrl.recvmsg(_RECV_SIZE, socket.CMSG_SPACE(_MAX_FDS * 4),
                                                 socket.MSG_CMSG_CLOEXEC)
    except OSError:
        _exit(0)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % 4])
    if not data:
        _exit(0)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        _exit(1)  # cannot happen with our own client; the caller sees EOF
    request = marshal.loads(data)
    if request.get("memfd"):
        memfd = fds.pop()
        with os.fdopen(memfd, "rb") as handle:
            handle.seek(0)  # the caller's writes moved the shared file offset
            request = marshal.loads(handle.read())
    return request, list(fds)


def _supervise(ctrl: socket.socket, notes_w: int, kind: str, server: int) -> None:
    """Serve requests of one kind, one at a time, up to MAX_USES (bounds heap growth).

    One at a time: the supervisor is the subreaper of exactly one call's tree. Never
    both kinds: a command's request (argv, environment) is in this process's memory,
    harmless to a command child whose ``execve`` replaces that memory, but a Python
    call's child keeps running in a copy of it. So call supervisors see no data of
    any call at all: the environment, arguments and function of a call travel in a
    memfd that only the confined child reads.

    After each Python call, a call supervisor prepares a :class:`_Spare` for the
    same policy, so that the next call of that ``Sandbox`` does not wait for a
    fork and confinement.

    An idle supervisor dies with the fork server (PDEATHSIG). A busy one does not:
    its call goes on under its deadline, and at its end the supervisor, the
    subreaper of the call's tree, kills that tree (daemons included) and reports
    what happened, then exits when the fork server is gone (``server``, its pid).
    Killed with the fork server instead, it would leave the call's daemons to init
    and the caller without a report.
    """
    from ..compile import compiler
    from ..linux import kernel

    spare: Optional[_Spare] = None
    #: the policy spares get, its token, and whether its calls are mediated ([network] allow)
    prepared: Optional[tuple[compiler.Compiled, bytes, bool]] = None
    def leaving() -> None:  # its pids cgroup too ([limits] processes)
        if spare is not None:
            spare.discard()

    for use in range(1, MAX_USES + 1):
        request, fds = _receive(ctrl, leaving)
        kernel.set_pdeathsig(0)  # from here on, this call outlives the fork server
        token = request.get("policy") if request["kind"] == kind == "call" else None
        taken = None
        if spare is not None:  # first of all: the call's function may start right away
            if spare.token == token:
                taken = spare.take_if_ready(request, fds)
            else:
                spare.discard()
            if taken is None:
                spare = None
        if prepared is not None and prepared[1] != token:
            prepared[0].close()
            prepared = None
        if token is not None and prepared is None:
            # Its own copy of the ruleset fd: the request's is closed after the call.
            ruleset_fd = os.dup(fds[4]) if request["ruleset"] else -1
            prepared = (_compiled(request, ruleset_fd), token, request.get("mediate") is not None)
        # Nothing of this call survives into the next: the child's end (launcher's
        # Child._reap) kills and reaps every process re-parented to this supervisor.
        _serve_one(request, fds, notes_w, kind, spare, taken)
        spare = None
        kernel.set_pdeathsig(signal.SIGKILL)
        if os.getppid() != server:  # the fork server died during the call: no more calls
            break
        if use < MAX_USES:
            if prepared is not None:
                try:
                    spare = _Spare(*prepared[:2], mediated=prepared[2])
                except OSError:
                    spare = None  # fork failed (RLIMIT_NPROC, memory): the next call forks
            _note(notes_w, b"i")


def _compiled(request: dict[str, Any], ruleset_fd: int) -> Any:
    """The caller's compiled policy, as its request carries it: the ruleset fd, BPF,
    rlimits, and where each run's pids cgroup is made (the caller's decision, the one
    its warnings describe: never looked up again here)."""
    from ..compile import compiler
    from ..linux import cgroups

    wire = request["cgroup"]
    base = None if wire is None else cgroups.Base(*wire)
    return compiler.Compiled(None, 0, (), ruleset_fd,
                             request["bpf"], tuple(request["rlimits"]), base,
                             signal_gate=request.get("signals") is True)


def _steps(request: dict[str, Any], compiled: Any, cmd: Any, notify: bool) -> Any:
    """The command's confinement steps, as its request carries them (spec.encode),
    checked: this interpreter implements each, and the list is exactly the one
    :func:`spec.child_steps` makes of the request's own fields (its ruleset, rlimits,
    pids cgroup, working directory, supervisors): a request that names fewer steps
    than it calls for is refused, never run with them."""
    from ..errors import SetupError
    from . import engine, spec

    try:
        if request.get("version") != spec.VERSION:
            raise ValueError(f"a request of another wire version ({request.get('version')!r})")
        steps = spec.decode(request["steps"])
        spec.check(steps, engine.IMPLEMENTS, "the fork server")
        if any(s[0] == spec.NOTIFY for s in steps) != notify:
            raise ValueError("the notify step and the request's supervisors disagree")
        in_group = compiled.run_group_limit() is not None
        if steps != spec.child_steps(compiled, cmd, in_group=in_group, notify=notify):
            raise ValueError("not the steps this request calls for: "
                             + ", ".join(spec.encode(steps)))
    except (KeyError, TypeError, ValueError) as exc:
        raise SetupError(f"malformed request: {exc}") from None
    return steps


def _note(notes_w: int, event: bytes) -> None:
    try:
        os.write(notes_w, NOTE.pack(event, os.getpid()))
    except OSError:
        pass  # the fork server is gone (EPIPE): this supervisor ends its call, then exits


class _Spare:
    """A confined process made ahead of a Python call, for one policy (``token``).

    It is forked and confines itself (the same :func:`launcher._child` steps) before
    any call's data exists, then waits on its own socket for the call's descriptors
    (stdio, the request memfd, the result pipe) and working directory. Used once:
    a call gets a fresh process, never one that ran code before. The supervisor
    that forks it has only seen requests without call data (see :func:`_supervise`),
    so it starts with no call's secrets, like a child forked at the call.
    """

    def __init__(self, compiled: Any, token: bytes, ahead: bool = True,
                 mediated: bool = False) -> None:
        """``ahead``: made before its call (not at it), so it also rehearses one.
        ``mediated``: its call comes with the host allowlist's filter ([network] allow),
        whose listener, the mediator's, then carries the signal gate (Landlock ABI < 6):
        the spare gets no gate's listener of its own (a process gets one listener), and
        runs nothing of the call before that filter is installed (:meth:`take`)."""
        from . import launcher
        from .callee import _spare_body

        self.token = token
        #: The signal gate is the mediator's (checked against the call in :meth:`take`).
        self.carried = mediated and compiled.signal_gate
        self.gated = compiled.signal_gate
        #: The spare's setup channel: the call's descriptors go down it, and a setup
        #: failure comes back on it. The spare closes its end before the function runs,
        #: so nothing the function writes can read as a setup report (issue 12).
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        #: Read end of the call's "result written" pipe (see :func:`_watch`), from take().
        self.done = -1
        handoff = theirs.fileno()
        cmd = launcher.Command(sys.executable, (sys.executable,), (), None)
        try:
            from ..linux.signalgate import Signals

            self.starting: Any = launcher.Starting(compiled, cmd, stdio=(-1, -1, -1),
                                                   body=lambda: _spare_body(handoff, ahead),
                                                   signals=Signals() if self.carried else None)
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()

    def take(self, request: dict[str, Any], fds: Sequence[int]) -> Any:
        """Hand the call (``request`` and its ``fds``, see :func:`_serve_one`) to the
        spare: its stdio, data memfd and result pipe, its working directory, and under
        ``[network] allow`` the notifying filter and the socket for its listener.
        Return its :class:`launcher.Child`.

        Raises what :meth:`launcher.Starting.confirm` raises if it could not confine
        itself, OSError if it died since.
        """
        import array

        from ..errors import SetupError

        if self.carried != (self.gated and request.get("mediate") is not None):
            self.discard()
            raise SetupError("malformed request: the call's mediation and its spare's signal "
                             "gate disagree")
        if self.carried:
            try:
                _mediator_carries(request)
            except SetupError:
                self.discard()
                raise
        child = self.starting.confirm()
        mediate = _mediate_fd(request, fds)
        try:
            self.done, done_w = os.pipe2(os.O_CLOEXEC)
        except OSError:
            child.kill_tree()
            raise
        passed = array.array("i", [*fds[1:4], fds[-2], fds[-1], done_w]
                             + [mediate] * (mediate >= 0))
        try:
            from . import spec

            # The spare's last steps, in the step language (spec.call_steps), and the
            # notifying filter its notify step installs.
            last = spec.encode(spec.call_steps(request["cwd"], request.get("mediate") is not None))
            self.sock.sendmsg([marshal.dumps((last, request.get("mediate")))],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, passed)])
        except OSError:
            child.kill_tree()
            raise
        finally:
            os.close(done_w)
        return child

    def close(self) -> None:
        """Close the supervisor's ends of the spare's channels."""
        self.sock.close()
        if self.done >= 0:
            os.close(self.done)
            self.done = -1

    def take_if_ready(self, request: dict[str, Any], fds: Sequence[int]) -> Any:
        """:meth:`take`, or None if this spare is not usable (a new one is made; if its
        policy cannot be applied, that one reports why)."""
        from ..errors import SandlockError

        try:
            return self.take(request, fds)
        except (SandlockError, OSError):
            self.close()
            return None

    def discard(self) -> None:
        """Not used (another policy's call came): kill it, whatever stage it is at."""
        try:
            os.kill(self.starting.pid, signal.SIGKILL)
            os.waitpid(self.starting.pid, 0)
        except OSError:
            pass  # gone already
        if self.starting.errr >= 0:
            os.close(self.starting.errr)
        self.starting.discard_group()
        if self.starting.gate is not None:  # its signal gate (Landlock ABI < 6)
            self.starting.gate.stop()
            self.starting.gate = None
        self.close()


def _serve_one(request: dict[str, Any], fds: list[int], notes_w: int, kind: str,
               spare: Optional[_Spare] = None, taken: Any = None) -> None:
    """Run one request confined, report, kill its tree; close every fd it brought.

    ``taken`` is the child of ``spare`` that already has this (Python) call.
    """
    from ..errors import ExitCode, SandlockError
    from . import launcher
    from .wire import setup_failure

    call = socket.socket(fileno=fds[0])
    noted = False
    try:
        stdin, stdout, stderr = fds[1:4]
        cmd = launcher.Command(request["exe"], tuple(request["argv"]), tuple(request["env"]),
                               request["cwd"])
        if request["kind"] == "call" and kind != "call":
            raise SandlockError("a Python call reached a command supervisor")
        child = taken
        failure = ""
        recorder = None
        if child is None:
            spare = None
            compiled = _compiled(request, fds[4] if request["ruleset"] else -1)
            try:
                if request["kind"] == "call":  # no spare ready: one made now, for this call
                    spare = _Spare(compiled, request.get("policy") or b"", ahead=False,
                                   mediated=request.get("mediate") is not None)
                    child = spare.take(request, fds)
                else:
                    recorder = _recorder(request)
                    hook = _listener_hook(request, fds)
                    if recorder is not None:  # recorder first: the mediation filter
                        hook = _hooks(recorder.in_child, hook)  # refuses new listeners
                    # the signal gate (Landlock ABI < 6): on the recorder's listener if
                    # any, else the mediator's under [network] allow, else Starting gives
                    # the child one of its own
                    signals = launcher.carry_signals(compiled.signal_gate, recorder)
                    if signals is None and compiled.signal_gate and hook is not None:
                        signals = _mediator_carries(request)
                    steps = _steps(request, compiled, cmd,
                                   hook is not None or compiled.signal_gate)
                    starting = launcher.Starting(compiled, cmd, stdio=(stdin, stdout, stderr),
                                                 hook=hook, steps=steps, signals=signals)
                    if recorder is not None:
                        recorder.start()  # before confirm(): the child's execve is notified
                    child = starting.confirm()
            except SandlockError as exc:
                failure = f"F {int(exc.exit_code)} {type(exc).__name__}\n{exc}"
            except OSError as exc:  # fork failed (EAGAIN: RLIMIT_NPROC, memory)
                failure = f"F 125 SetupError\ncannot fork the confined process: {exc}"
        # Only now (the child has exec'd) may the fork server fork a replacement: that
        # fork does not compete for a CPU with this call's start; the pool has a spare.
        _note(notes_w, b"t")
        noted = True
        for fd in fds[1:]:
            os.close(fd)  # the child has them; keeping them would delay the caller's EOF
        fds = fds[:1]
        if failure:
            _send_denials(call, request, recorder)
            _send(call, failure)
            return
        assert child is not None
        if request.get("report_start"):
            _send(call, f"S {child.pid}")
        report = _watch(child, call, request["timeout"], spare)
        if child.pidfd >= 0 and recorder is not None:
            child._reap()  # the tree is gone before what it did is judged
        _send_denials(call, request, recorder)
        if report not in (b"", b".") and child.returncode == ExitCode.LAUNCHER:
            error = setup_failure(cmd, report)
            _send(call, f"F {int(error.exit_code)} {type(error).__name__}\n{error}")
        else:
            _send(call, f"E {child.returncode} {child.signal or 0} {int(child.timed_out)} "
                        f"{child.pid}")
        if child.pidfd >= 0:
            child._reap()  # ended early (see _watch): reap it, and anything it left
    finally:
        if recorder is not None:
            recorder.__exit__()  # stops it unless _send_denials did
        if spare is not None:
            spare.close()
        if not noted:
            _note(notes_w, b"t")
        for fd in fds[1:]:
            os.close(fd)
        call.close()


def _mediate_fd(request: dict[str, Any], fds: Sequence[int]) -> int:
    """The socket for the listener of a call under ``[network] allow`` (after the
    ruleset fd, before a Python call's memfd and result pipe), or -1."""
    return fds[4 + bool(request["ruleset"])] if request.get("mediate") else -1


def _mediator_carries(request: dict[str, Any]) -> Any:
    """The signal gate's handler, when the mediator of a call under ``[network] allow``
    carries it (:func:`sandlock.net.mediator.serve`; checked by
    :func:`sandlock.linux.signalgate.carried`)."""
    from ..linux.signalgate import carried

    return carried(request["mediate"])


def _listener_hook(request: dict[str, Any], fds: Sequence[int]) -> Any:
    """For launcher._child: install the notifying filter of ``[network] allow`` and
    send its listener to the caller's connect gate (sandlock.net.connect)."""
    fd = _mediate_fd(request, fds)
    if fd < 0:
        return None
    from ..linux import kernel

    prog, keep = kernel.make_fprog(request["mediate"])

    def hook() -> None:
        assert keep is not None  # the BPF buffer lives as long as the hook
        kernel.install_listener(prog, fd)

    return hook


def _recorder(request: dict[str, Any]) -> Any:
    """The :class:`sandlock.trace.record.Recorder` of a command call with ``trace`` (the API's
    ``run(..., trace=True)``), else None: no notifying filter, no thread."""
    if not request.get("trace"):
        return None
    from ..trace.record import Recorder

    return Recorder(network_mediated=bool(request.get("mediate")))


def _hooks(*hooks: Any) -> Any:
    def hook() -> None:
        for each in hooks:
            if each is not None:
                each()

    return hook


def _send_denials(call: socket.socket, request: dict[str, Any], recorder: Any) -> None:
    """``D`` messages, each a JSON list of refused accesses, judged here (the recorded
    paths come from the tool's memory: they are never parsed in the caller's process),
    before the call's ``E``/``F``; as many as the list needs."""
    if recorder is None:
        return
    from ..trace.record import Judge

    recorder.stop()
    abi, rules, ports = request["trace"]
    for batch in Judge(abi, [tuple(r) for r in rules], dict(ports)).batches(recorder.events):
        _send(call, "D " + batch)


def _send(call: socket.socket, text: str) -> None:
    try:
        call.send(text.encode(errors="replace"))
    except OSError:
        pass  # the caller has gone; the tree is (or will be) killed anyway


def _watch(child: Any, call: socket.socket, timeout: Optional[float],
           spare: Optional[_Spare] = None) -> bytes:
    """Wait for the command; obey the caller's kill/signal requests and the deadline.

    ``spare`` is the :class:`_Spare` of a Python call; two channels lead from it:

    * its setup socket, which the confined process closes before the function runs:
      a message there is its report that it could not start the call (returned; it
      exits by itself with ExitCode.LAUNCHER); EOF, that setup is over. Only what
      arrived there can ever become a setup failure;
    * its done pipe, held by the function's process: ``.`` there means the result is
      written and the process is about to ``_exit(0)``: then, if it is the call's only
      process, it is killed and the call reported ended (``returncode`` 0) without
      waiting for its teardown (see :func:`_ended_alone`). Anything else written there
      is the function's own doing and means nothing: the wait goes on.
    """
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()
    poller.register(child.pidfd, select.POLLIN)
    poller.register(call.fileno(), select.POLLIN)
    setup = done = -1
    if spare is not None:
        setup, done = spare.sock.fileno(), spare.done
        poller.register(setup, select.POLLIN)
        poller.register(done, select.POLLIN)
    report: Optional[bytes] = None
    while child.returncode is None:
        wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        events = poller.poll(wait)
        if not events and deadline is not None and time.monotonic() >= deadline:
            child.timed_out = True
            child.kill_tree()
        for fd, _ in events:
            if fd == call.fileno():
                try:
                    message = call.recv(64)
                except OSError:
                    message = b""
                if not message or message == b"K":
                    poller.unregister(fd)
                    child.kill_tree()
                elif message.startswith(b"s "):
                    try:
                        child.send_signal(int(message[2:]))
                    except (ValueError, OSError):
                        pass  # not a signal number: nothing to send
            elif fd == setup and spare is not None:
                poller.unregister(fd)
                report = _recv_report(spare.sock)
            elif fd == done:
                try:
                    said = os.read(done, 2)
                except OSError:
                    said = b""
                if said != b".":
                    poller.unregister(fd)  # EOF, or the function's own scribbling
                elif report == b"" and _ended_alone(child):  # set up, and alone
                    child.returncode = 0
                    return b""
            elif child.returncode is None:
                child._reap()  # also kills and reaps whatever the command left behind
                break
    if spare is not None and report is None:  # it exited before its report was read here
        report = _recv_report(spare.sock)
    return report or b""


def _recv_report(sock: socket.socket) -> bytes:
    """A spare's setup report, b"" at EOF (set up) or when nothing is there."""
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT)
    except OSError:
        return b""


def _ended_alone(child: Any) -> bool:
    """Kill ``child``; True if it was the only process of its call.

    After ``kill`` returns, the child can no longer fork (a fork racing with the
    signal fails: copy_process checks for pending fatal signals, under the lock
    that sending takes, before it links the new task), so what is read next is
    final. Its threads' children are read first, this (single-threaded)
    supervisor's last: a process re-parented meanwhile, by a dying thread of the
    child, is then seen here; a thread gone before its file is read counts as
    "not alone". A zombie stays listed until reaped. Either way the caller is told
    only when nothing of the call can run any more.
    """
    from ..linux.process import children

    me = os.getpid()
    try:
        os.kill(child.pid, signal.SIGKILL)
        if children(child.pid, strict=True):
            return False
        return children(me, strict=True) == {child.pid}
    except OSError:
        return False

