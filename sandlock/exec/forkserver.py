"""The fork server: a small, fresh process from which every confined child is forked.

Why not fork the caller? An agent holds API keys, conversation history and gigabytes
of model state in memory. A child forked from it starts as a copy of all of that
(a confined Python function could simply read it), and forking a large process is
slow (page tables are copied: ~30 us per MiB on the reference machine). So the
library execs a fresh interpreter once (``sys.executable -I -S``: no site, no
PYTHON* variables, an empty environment) and forks from it.

Process tree (``exec``/``call``: one SOCK_SEQPACKET socketpair per kind of request)::

    caller ──exec──┐
           ──call──┴─> fork server (single-threaded, child subreaper, ~5 MiB anonymous)
                        ├─ idle supervisors, per kind: blocked in recvmsg on their
                        │  socket; the kernel hands each request to exactly one
                        │  └─ a call supervisor's spare: confined, waiting for a call
                        └─ busy supervisor (one call at a time, child subreaper)
                            └─ confined command or function ── its own children ...

* A request goes from the caller straight to an idle supervisor: the fork server
  is not on the call path; it forks replacements to keep POOL idle per kind.
  So a call costs one fork of a small process, never a fork of the caller.
* stdio travels as file descriptors (SCM_RIGHTS), so captured output flows from
  the command to the caller through pipes that neither server process reads.
* A supervisor handles one call at a time and is the subreaper of that call, so at
  the end it kills that call's whole tree (daemons and ``setsid`` escapees
  included) and nothing else: concurrent calls cannot touch each other.
* Supervisors are reused (up to MAX_USES calls), each for one kind of request. A
  command's request passes through its supervisor's memory, harmless because the
  child's ``execve`` replaces that memory. A Python call's child keeps running in
  a copy of its supervisor's memory, so a call's environment, function and
  arguments travel in a memfd that only the confined child reads: no call's data
  is ever in memory a later call is forked from.
* A Python call runs in a *spare*: a process forked from its supervisor and
  confined by the call's policy before the call arrives (after the supervisor's
  previous call of the same ``Sandbox``, or at the call), which then receives the
  call's descriptors. A spare serves one call and is never reused; it is made
  from a supervisor that never held any call's data, so it starts exactly as a
  process forked at the call would. When the function's result is written and it
  is the call's only process, the call is reported ended once it is killed,
  without waiting for its teardown (:func:`_ended_alone`).
* If a supervisor dies, its orphans are re-parented to the fork server, which kills
  every child that is not a supervisor. If the caller goes away (its sockets reach
  EOF), the fork server kills everything and exits.

Wire format: requests are :mod:`marshal` dictionaries (only the trusted caller
writes them); supervisor -> caller messages are short ASCII lines on the per-call
socket: ``S pid`` started, ``F exit_code class\\nmessage`` failed before exec,
``E returncode signal timed_out pid`` ended (``S`` only when asked: ``popen``).
The caller sends ``K`` (kill the tree) or ``s N`` (signal N); closing its end
kills the tree.
"""

from __future__ import annotations

import _thread
import atexit
import marshal
import os
import select
import signal
import socket
import struct
import sys

from .. import PACKAGE_DIR

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Sequence

#: Kinds of request, each with its own socket and pool of idle supervisors.
KINDS = ("exec", "call")
#: Idle supervisors kept ready per kind. Two lets a call start while the replacement
#: for the previous one is still being forked.
POOL = 2
#: Calls a supervisor serves before it exits (bounds heap growth).
MAX_USES = 1000
#: Supervisor -> fork server notes: event byte and pid, one atomic pipe write each.
NOTE = struct.Struct("=ci")
#: Requests larger than this travel in a memfd (a SEQPACKET message must fit the
#: socket buffer in one piece).
INLINE_LIMIT = 32 * 1024
_RECV_SIZE = INLINE_LIMIT + 1024
_MAX_FDS = 8
#: What a :class:`_Spare` is called (``/proc/PID/comm``) until a call takes it; then
#: it is called CALL_NAME.
SPARE_NAME = b"sandlock-spare"
CALL_NAME = b"sandlock-call"


# ----------------------------------------------------------------------------
# Caller side


class ForkServer:
    """The caller's handle on one fork server process (see :func:`get`)."""

    def __init__(self) -> None:
        import subprocess

        # One socket per kind of request, each with its own supervisors (see the module
        # docstring: a Python call's child must not be forked from a command's supervisor).
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in KINDS]
        theirs = [pair[1].fileno() for pair in pairs]
        root = os.path.dirname(PACKAGE_DIR)
        boot = ("import sys; sys.path.insert(0, sys.argv[1]); from sandlock.exec.forkserver "
                "import serve; serve(*map(int, sys.argv[2:]))")
        try:
            # Popen execs (vfork + exec on Linux): the server never holds the caller's memory.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", boot, root, *map(str, theirs)],
                pass_fds=theirs, env={}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            for pair in pairs:
                pair[1].close()
        self._socks = {kind: pair[0] for kind, pair in zip(KINDS, pairs)}
        self.owner = os.getpid()
        self.credentials = credentials()
        self.broken = False  #: set when a submit finds the server gone: get() restarts it
        hello = self._socks["exec"].recv(64)
        if not hello.startswith(b"R "):
            self._proc.wait()
            from ..errors import SetupError

            raise SetupError(f"the sandlock fork server did not start ({sys.executable}, "
                             f"exit status {self._proc.returncode})")
        pid, _, version = hello[2:].partition(b" ")
        self.pid = int(pid)
        try:  # the same files, unless the installation changed under this process
            from .wire import check_hello

            check_hello("the sandlock fork server", b"V " + version)
        except BaseException:
            self.close()
            raise

    def submit(self, request: dict[str, Any], fds: Sequence[int]) -> socket.socket:
        """Hand one call to an idle supervisor; return the caller's end of its socket."""
        import array

        if self.owner == os.getpid() and self._proc.poll() is not None:
            # Dead: its busy supervisors still hold the request sockets until their
            # calls end, but none of them will take another request.
            self.broken = True
            raise _Gone(f"exit status {self._proc.returncode}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        memfd = -1
        try:
            blob = marshal.dumps(request)
            if len(blob) > INLINE_LIMIT:
                memfd = os.memfd_create("sandlock-request", os.MFD_CLOEXEC)
                os.write(memfd, blob)  # memfd writes are not short below 2 GiB
                blob = marshal.dumps({"memfd": True})
            sent = [theirs.fileno(), *fds] + ([memfd] if memfd >= 0 else [])
            try:
                self._socks[request["kind"]].sendmsg(
                    [blob], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sent))])
            except OSError as exc:
                ours.close()
                self.broken = True
                raise _Gone(str(exc)) from None
        finally:
            theirs.close()
            if memfd >= 0:
                os.close(memfd)
        return ours

    def alive(self) -> bool:
        return self._proc.poll() is None

    def children(self) -> list[int]:
        """Pids of the fork server's children (idle and busy supervisors, strays)."""
        return children_of(self.pid)

    def spares(self) -> list[int]:
        """Pids of the confined processes prepared for a next call (see ``_Spare``)."""
        found = []
        for supervisor in self.children():
            for pid in children_of(supervisor):
                try:
                    with open(f"/proc/{pid}/comm", "rb") as handle:
                        if handle.read().strip() == SPARE_NAME:
                            found.append(pid)
                except OSError:
                    pass  # gone meanwhile
        return found

    def close(self) -> None:
        """Stop the server: it kills every call still running, then exits."""
        if self._socks["exec"].fileno() >= 0:
            for sock in self._socks.values():
                sock.close()
            if self.owner == os.getpid():
                self._proc.wait()


class _Gone(Exception):
    """The request was not delivered (the server died): safe to send again."""


def submit(request: dict[str, Any], fds: Sequence[int]) -> socket.socket:
    """Submit to the process-wide fork server; restart it once if it has died."""
    try:
        return get().submit(request, fds)
    except _Gone:
        pass
    try:
        return get().submit(request, fds)
    except _Gone as exc:
        from ..errors import SetupError

        raise SetupError(f"the sandlock fork server is gone: {exc}") from None


class ProcessWide:
    """The one helper process of a kind (this fork server, :mod:`sandlock.exec.native`'s
    server) per caller process: started on first use, under a lock; replaced when
    :func:`usable` says no; forgotten in a forked copy of the caller.

    A replaced handle is not closed (other threads may still be inside its submit;
    its sockets close when the last of them drops it): ``retire`` gets it, under the
    lock. ``forget`` gets the parent's handle in a forked child.
    """

    def __init__(self, start: Callable[[], Any], retire: Callable[[Any], None],
                 forget: Callable[[Any], None]) -> None:
        self._start, self._retire, self._forget = start, retire, forget
        self._current: Any = None
        self._lock = _thread.allocate_lock()
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def get(self) -> Any:
        current = self._current
        if usable(current):
            return current
        with self._lock:
            if not usable(self._current):
                if self._current is not None:
                    self._retire(self._current)
                self._current = self._start()
            return self._current

    def detach(self) -> Any:
        """The current handle (or None), which the next get() will not return."""
        with self._lock:
            current, self._current = self._current, None
        return current

    def _after_fork_in_child(self) -> None:
        if self._current is not None:
            self._forget(self._current)
        self._current = None
        self._lock = _thread.allocate_lock()


def usable(server: Any) -> bool:
    """Whether a process-wide server handle may serve this caller: started by this
    process (not inherited across a fork), with its current credentials, and not
    found dead."""
    return (server is not None and server.owner == os.getpid() and not server.broken
            and server.credentials == credentials())


def credentials() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The caller's real, effective and saved uids and gids. A server started before
    the caller changed them (dropped privileges) is replaced: tools get its current
    ones (under no_new_privs, an exec'd command's effective uid is its real one)."""
    return os.getresuid(), os.getresgid()


def _close_sockets(server: ForkServer) -> None:
    for sock in server._socks.values():
        sock.close()


_servers = ProcessWide(ForkServer, retire=lambda server: None, forget=_close_sockets)


def get() -> ForkServer:
    """The process-wide fork server, started on first use (thread-safe)."""
    server: ForkServer = _servers.get()
    return server


def shutdown() -> None:
    """Stop the fork server now (it restarts on the next call)."""
    server = _servers.detach()
    if server is not None:
        server.close()


atexit.register(shutdown)


# ----------------------------------------------------------------------------
# Fork server side


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
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
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
    for pid in children_of(me):
        if pid not in supervisors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def children_of(pid: int) -> list[int]:
    """The children of process ``pid`` (linux.process.children), [] if it is gone."""
    from ..linux.process import children

    return sorted(children(pid))


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
    from ..linux import kernel
    from . import launcher

    spare: Optional[_Spare] = None
    prepared: Optional[tuple[launcher.Compiled, bytes]] = None  # the policy spares get
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
            prepared = (_compiled(request, ruleset_fd), token)
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
                    spare = _Spare(*prepared)
                except OSError:
                    spare = None  # fork failed (RLIMIT_NPROC, memory): the next call forks
            _note(notes_w, b"i")


def _compiled(request: dict[str, Any], ruleset_fd: int) -> Any:
    """The caller's compiled policy, as its request carries it: the ruleset fd, BPF,
    rlimits, and where each run's pids cgroup is made (the caller's decision, the one
    its warnings describe: never looked up again here)."""
    from ..linux import cgroups
    from . import launcher

    wire = request["cgroup"]
    base = None if wire is None else cgroups.Base(*wire)
    return launcher.Compiled(None, 0, (), ruleset_fd,  # type: ignore[arg-type]
                             request["bpf"], tuple(request["rlimits"]), base)


def _steps(request: dict[str, Any], notify: bool) -> Any:
    """The command's confinement steps, as its request carries them (spec.encode),
    checked: this interpreter implements each, and the list agrees with the request."""
    from ..errors import SetupError
    from . import engine, spec

    try:
        if request.get("version") != spec.VERSION:
            raise ValueError(f"a request of another wire version ({request.get('version')!r})")
        steps = spec.decode(request["steps"])
        spec.check(steps, engine.IMPLEMENTS, "the fork server")
        if any(s[0] == spec.NOTIFY for s in steps) != notify:
            raise ValueError("the notify step and the request's supervisors disagree")
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

    def __init__(self, compiled: Any, token: bytes, ahead: bool = True) -> None:
        """``ahead``: made before its call (not at it), so it also rehearses one."""
        from . import launcher

        self.token = token
        #: The spare's setup channel: the call's descriptors go down it, and a setup
        #: failure comes back on it. The spare closes its end before the function runs,
        #: so nothing the function writes can read as a setup report (issue 12).
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        #: Read end of the call's "result written" pipe (see :func:`_watch`), from take().
        self.done = -1
        handoff = theirs.fileno()
        cmd = launcher.Command(sys.executable, (sys.executable,), (), None)
        try:
            self.starting: Any = launcher.Starting(compiled, cmd, stdio=(-1, -1, -1),
                                                   body=lambda: _spare_body(handoff, ahead))
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
            self.sock.sendmsg([marshal.dumps((request["cwd"], request.get("mediate")))],
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
                    spare = _Spare(compiled, request.get("policy") or b"", ahead=False)
                    child = spare.take(request, fds)
                else:
                    recorder = _recorder(request)
                    hook = _listener_hook(request, fds)
                    if recorder is not None:  # recorder first: the mediation filter
                        hook = _hooks(recorder.in_child, hook)  # refuses new listeners
                    steps = _steps(request, hook is not None)
                    starting = launcher.Starting(compiled, cmd, stdio=(stdin, stdout, stderr),
                                                 hook=hook, steps=steps)
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


def _listener_hook(request: dict[str, Any], fds: Sequence[int]) -> Any:
    """For launcher._child: install the notifying filter of ``[network] allow`` and
    send its listener to the caller's connect supervisor (sandlock.net.connect)."""
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


#: The largest ``D`` message (the caller reads at most 64 KiB at once).
_DENIALS_LIMIT = 60000


def _send_denials(call: socket.socket, request: dict[str, Any], recorder: Any) -> None:
    """``D`` messages, each a JSON list of refused accesses, judged here (the recorded
    paths come from the tool's memory: they are never parsed in the caller's process),
    before the call's ``E``/``F``; as many as the list needs (a path is at most 4 KiB)."""
    if recorder is None:
        return
    import json

    from ..trace.record import Judge

    recorder.stop()
    abi, rules, ports = request["trace"]
    judge = Judge(abi, [tuple(r) for r in rules], dict(ports))
    batch: list[str] = []
    size = 0
    for denial in judge.denials(recorder.events):
        item = json.dumps(denial.as_dict())
        if batch and size + len(item) > _DENIALS_LIMIT:
            _send(call, "D [" + ",".join(batch) + "]")
            batch, size = [], 0
        batch.append(item)
        size += len(item) + 1
    if batch:
        _send(call, "D [" + ",".join(batch) + "]")


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


# ----------------------------------------------------------------------------
# The confined child of a Python call (runs after Landlock and seccomp)


def _spare_body(handoff: int, rehearse: bool) -> None:
    """A :class:`_Spare`, confined: wait for a call's descriptors, then run it."""
    import array
    import operator
    import pickle

    from ..linux import kernel

    os.dup2(handoff, 3)
    os.closerange(4, 2**31 - 1)  # the ruleset fd and the supervisor's own descriptors
    kernel.set_name(SPARE_NAME)
    if rehearse:
        # A call on dummy data while no call waits: the pages it touches are copied
        # (copy-on-write) now rather than on the call's time (~0.3 ms less per call).
        _outcome(marshal.loads(marshal.dumps({
            "env": [], "main": None, "sys_path": list(sys.path),
            "payload": pickle.dumps((operator.add, (1, 2), {}))})))
    from ..errors import ExitCode

    fds = array.array("i")
    sock = socket.socket(fileno=3)
    try:
        data, ancillary, flags, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(7 * fds.itemsize))
    except OSError:
        os._exit(0)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(fds) not in (6, 7) or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        os._exit(0)  # the supervisor went away (EOF), or a cut message: nothing to run
    cwd, notify_bpf = marshal.loads(data)
    kernel.set_name(CALL_NAME)
    for target in range(3):
        os.dup2(fds[target], target)
    from . import engine, spec

    def notify() -> None:  # [network] allow: connect(2) goes to the caller's mediator
        prog, _keep = kernel.make_fprog(notify_bpf)
        kernel.install_listener(prog, fds[6])
        os.close(fds[6])

    try:  # the spare's last steps, now that the call is known (spec.call_steps)
        engine.apply(spec.call_steps(cwd, notify_bpf is not None), engine.Context(notify=notify))
    except engine.StepFailed as failed:  # reported as the launcher's child reports it
        exc = failed.error
        sock.send(f"{failed.stage}\0{exc.errno or 0}\0{exc.strerror}".encode(errors="replace"))
        os._exit(ExitCode.LAUNCHER)
    # The setup channel closes before any of the caller's code runs: what the function
    # writes can never read as a setup report. The done pipe tells the supervisor that
    # the result is written; nothing else said there counts (see _watch).
    sock.close()
    _call_body(fds[3], fds[4], done_fd=fds[5])


def _call_body(data_fd: int, result_fd: int, done_fd: int) -> None:
    """Run the caller's function inside the sandbox and write its outcome to the caller.

    Before any of the caller's code is loaded, every descriptor but stdio and the
    result pipe is closed (the ruleset fd above all: rules added to it would widen
    the sandbox of later calls), and the environment becomes exactly the policy's.
    """

    size, data = os.fstat(data_fd).st_size, b""
    while len(data) < size:  # pread: the caller's writes moved the shared offset
        data += os.pread(data_fd, size - len(data), len(data)) or b"\0"
    request = marshal.loads(data)
    import fcntl

    # result -> 3, done -> 4, then nothing else: lifted first, so that neither
    # dup2 overwrites the other's source.
    lifted = [fcntl.fcntl(fd, fcntl.F_DUPFD, 5) for fd in (result_fd, done_fd)]
    for target, fd in enumerate(lifted, 3):
        os.dup2(fd, target)
    os.closerange(5, 2**31 - 1)
    data = _outcome(request)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(3, view):]
        os.close(3)  # EOF for the caller now, not after this process's teardown
        os.write(4, b".")  # to the supervisor: the call has ended (see _watch)
    finally:
        os._exit(0)


def _outcome(request: dict[str, Any]) -> bytes:
    """Set up the environment and ``sys`` as the request says, run its function and
    return the pickled record of how it ended."""
    import pickle

    os.environ.clear()
    os.environ.update(dict(request["env"]))
    sys.dont_write_bytecode = True
    sys.argv = [sys.executable]
    record: tuple[Any, ...]
    try:
        sys.path[:] = request["sys_path"]
        if request["main"]:
            _load_main(request["main"])
        try:
            func, args, kwargs = pickle.loads(request["payload"])
        except Exception as exc:
            raise ImportError(
                f"the sandbox could not load the function or its arguments ({type(exc).__name__}:"
                f" {exc}): the policy must grant read on the directories their modules are "
                "imported from (their sys.path entries), not only on the files") from exc
        value = func(*args, **kwargs)
        try:
            record = ("ok", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException as exc:  # noqa: BLE001
            what = f"{type(value).__module__}.{type(value).__qualname__}"
            record = ("unpicklable", what, f"{type(exc).__name__}: {exc}")
    except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the caller
        record = _raised(exc)
    # Only str and bytes at this level: the caller can always read the envelope, and
    # decides separately (and restrictively) whether to rebuild the objects inside.
    return pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)


def _raised(exc: BaseException) -> tuple[Any, ...]:
    import pickle
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    exc.__traceback__ = None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        blob: Optional[bytes] = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 - the text still reaches the caller
        blob = None
    return ("raise", kind, str(exc), text, blob)


def _load_main(path: str) -> None:
    """Make ``__main__`` functions importable: load the caller's script under another
    name (its ``if __name__ == "__main__":`` block does not run), as multiprocessing does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("__sandlock_main__", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the caller's main script {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["__sandlock_main__"] = sys.modules["__main__"] = module
    spec.loader.exec_module(module)
