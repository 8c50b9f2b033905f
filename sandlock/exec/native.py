"""The native fast path of the Python API: a ``sandlock-exec`` server per caller process.

The fork server (:mod:`sandlock.exec.forkserver`) pays a Python ``fork()`` (~1 ms of
copy-on-write faults) and runs the confinement steps in Python. ``sandlock-exec``
(``sandlock/exec/helper/sandlock_exec.c``, compiled at install time by ``setup.py``) does
the same job in C. The caller starts it once, on first use, with ``os.posix_spawn``
(vfork + exec, so none of the caller's memory is copied, whatever its size: no
secrets, no 2 GiB page-table copy), and sends it one request per call on a
SEQPACKET control socket: the per-call socket, stdio and the ruleset fd as
SCM_RIGHTS, the arguments and environment as data. Each call gets its own
supervisor, a fork of that small static C program (not an exec), made ahead of time:
an idle supervisor waits for the next request and the server forks the next one while the
call runs. The supervisor speaks the fork server's per-call wire format on that
call's socket. Used for ``run``/``popen``/``run_async`` of commands when the helper
exists and ``SANDLOCK_NATIVE`` is not ``"0"``; ``call()`` always uses the fork server
(the child runs Python, not ``execve``). Under ``[network] allow`` or with
``trace=True`` the command runs on a server that the Sandbox's mediator or recorder
process started (:class:`sandlock.net.mediator.WarmProcess`), whose child takes the
``notify`` step: it installs that process's filter and sends it the listener, and the
process, reading the tool's memory, is the tool's ancestor.

A call never depends on the server once forked: if the server dies, calls in flight
go on (their supervisors watch their own sockets) and the next call starts a new
server. A forked copy of the caller starts its own.
"""

from __future__ import annotations

import array
import atexit
import errno
import fcntl
import os
import signal
import socket

from ..linux.process import DEFAULTED_SIGNALS
from . import spec, wire
from .forkserver import ProcessWide, children_of, credentials

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional, Sequence

    from ..compile.compiler import Compiled
    from .spec import Command

#: Built by setup.py next to its source; absent only in an install made with
#: SANDLOCK_NO_NATIVE=1 (the API then starts commands through its fork server).
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helper", "sandlock-exec")
AVAILABLE = os.access(HELPER, os.X_OK)
#: Request data above this size travels in a memfd (the server reads messages of at
#: most 64 KiB: REQUEST_MAX in sandlock_exec.c; a SEQPACKET message must also fit the
#: socket's send buffer in one piece).
INLINE_LIMIT = 32 * 1024
#: How long a new server may take to say its version (it starts in about a millisecond).
HELLO_TIMEOUT = 10.0
#: sendmsg errors that mean the server is gone (the request was not delivered).
_GONE = (errno.EPIPE, errno.ECONNREFUSED, errno.ECONNRESET, errno.ENOTCONN)


def enabled() -> bool:
    """The helper exists and ``SANDLOCK_NATIVE`` does not turn it off (read per call)."""
    return AVAILABLE and os.environ.get("SANDLOCK_NATIVE") != "0"


def start_server() -> tuple[socket.socket, int]:
    """A new ``sandlock-exec`` server, a child of this process: (the control socket, its
    pid). Its first message (the hello) is left for :class:`Server` to read."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # posix_spawn's file actions run in order: lift the socket above 3 first if
        # it is one of the targets (a caller that closed its stdio).
        peer = theirs.fileno()
        if peer <= 3:  # close-on-exec: only the dup2 below reaches the server
            peer = fcntl.fcntl(peer, fcntl.F_DUPFD_CLOEXEC, 4)
        null = os.devnull
        actions = [(os.POSIX_SPAWN_DUP2, peer, 3),
                   *((os.POSIX_SPAWN_OPEN, fd, null, os.O_RDWR, 0) for fd in range(3))]
        try:
            # stdio on /dev/null: the caller's pipes must not stay open in the server.
            # Its own process group (the terminal's Ctrl-C is the caller's business),
            # no blocked signal, default dispositions (Python ignores SIGPIPE).
            pid = os.posix_spawn(HELPER, [HELPER], {}, file_actions=actions,
                                 setpgroup=0, setsigmask=(),
                                 setsigdef=DEFAULTED_SIGNALS)  # for every fork
        finally:
            if peer != theirs.fileno():
                os.close(peer)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours, pid


class Server:
    """The caller's handle on one ``sandlock-exec`` server: this process's own (see
    :func:`get`), or ``adopted``, one another process started (:func:`start_server`)
    and handed over, with its pid."""

    def __init__(self, adopted: Optional[tuple[socket.socket, int]] = None) -> None:
        ours, self.pid = start_server() if adopted is None else adopted
        self._sock = ours
        #: The process that may reap it (an adopted server is its starter's child).
        self.owner = os.getpid() if adopted is None else -1
        self.credentials = credentials()
        self.broken = False  #: set when a submit finds the server gone: get() restarts it
        try:
            #: The confinement steps this build of the helper implements (its first message).
            self.implements = wire.check_hello(HELPER, _hello(ours, HELLO_TIMEOUT))
        except BaseException:
            # A server that does not speak this wire may never exit at EOF either: it is
            # our unreaped child (its pid cannot be reused yet), so it is killed, not waited on.
            if self.owner == os.getpid():
                os.kill(self.pid, signal.SIGKILL)
            self.close()
            raise

    def submit(self, data: bytes, fds: Sequence[int]) -> None:
        """Send one request (see sandlock_exec.c's header); large data goes in a memfd.

        Raises :class:`_Gone` if the server is gone (nothing was delivered), OSError
        for other failures.
        """
        memfd = -1
        try:
            if len(data) > INLINE_LIMIT:
                memfd = os.memfd_create("sandlock-request", os.MFD_CLOEXEC)
                view = memoryview(data)
                while view:
                    view = view[os.write(memfd, view):]
                data, fds = wire.IN_MEMFD, [*fds, memfd]
            try:
                self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", fds))], socket.MSG_NOSIGNAL)
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
                self.broken = True
                raise _Gone(str(exc)) from None
        finally:
            if memfd >= 0:
                os.close(memfd)

    def children(self) -> list[int]:
        """Pids of the server's children: its idle supervisor (forked ahead for the
        next call), supervisors of running calls, strays about to be killed."""
        return children_of(self.pid)

    def close(self) -> None:
        """Stop the server (it exits at EOF; running calls go on) and reap it."""
        self._sock.close()
        self.reap()

    def reap(self) -> None:
        """Wait for the server to exit (it is this process's child)."""
        if self.owner == os.getpid():
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass  # reaped by someone's waitpid(-1), or SIGCHLD ignored


class _Gone(Exception):
    """The request was not delivered (the server died): safe to send again."""


def _retire(server: Server) -> None:
    if server.broken:
        server.reap()  # dead: reap it (its socket closes when the last user drops it)


_servers = ProcessWide(Server, retire=_retire, forget=lambda server: server._sock.close())


def get() -> Server:
    """The process-wide server, started on first use (thread-safe)."""
    server: Server = _servers.get()
    return server


def shutdown() -> None:
    """Stop the server now (it restarts on the next call; running calls go on)."""
    server = _servers.detach()
    if server is not None and server.owner == os.getpid():
        server.close()


atexit.register(shutdown)


def spawn(compiled: Compiled, cmd: Command, stdio: Sequence[int], timeout: Optional[float],
          report_start: bool, wait: Optional[float] = None,
          notify: Optional[tuple[int, bytes]] = None,
          server: Optional[Server] = None) -> socket.socket:
    """Start one call; return the caller's end of its socket (closing it kills the call).

    ``notify``: (socket, BPF) of a supervisor's notifying filter (the host allowlist's
    connect gate): the child installs it after the policy's filter and sends its
    listener on that socket (the ``notify`` step). ``server``: an adopted server (a
    mediator's, :class:`Server`) instead of this process's own.

    Returns once a supervisor has taken the request (it says ``T`` just before it forks
    the command): a request lost before that (its idle supervisor was killed) never ran
    and is submitted again, so such a kill never fails a call. ``wait`` bounds that
    wait (seconds; the call's deadline).

    Raises OSError if the server cannot be started or reached, ValueError for an
    argument or environment string that cannot be passed to execve (as posix_spawn).
    """
    limit = compiled.run_group_limit()
    group = limit is not None
    if cmd.cwd is None:  # the helper runs in /: the caller's directory, named now
        cmd = type(cmd)(cmd.executable, cmd.argv, cmd.env, os.getcwd())
    steps = spec.child_steps(compiled, cmd, in_group=group, notify=notify is not None)
    implemented = (server or get()).implements
    fds = [*stdio]
    if compiled.ruleset_fd >= 0:
        fds.append(compiled.ruleset_fd)
    filters = [compiled.bpf]
    if notify is not None:
        fds.append(notify[0])
        filters.append(notify[1])
    args = ["-s"] if report_start else []
    if timeout is not None:
        args += ["-t", repr(float(timeout))]
    if group:  # the supervisor makes the call's pids cgroup (sandlock/linux/cgroups.py)
        version, base, relative = compiled.cgroup.wire()  # type: ignore[union-attr]
        args += ["-p", str(limit), "-g", f"{version}:{base}", "-G", relative]
    args += ["--", cmd.executable, *cmd.argv]  # the path to exec, then argv (argv[0] too)
    data = _request(steps, implemented, tuple(args), cmd.env)
    for _ in range(SUBMIT_TRIES):
        ours = _submit_once(filters, data, fds, wait, server)
        if ours is not None:
            return ours
    raise OSError(errno.EPIPE, f"{SUBMIT_TRIES} requests to the sandlock-exec server were lost "
                  "before any supervisor took them (its processes are being killed)")


#: Requests made lately, by everything each is made of: an agent runs the same few
#: commands again and again, and their steps are checked and their strings encoded once.
_REQUESTS: "dict[tuple[Any, ...], bytes]" = {}
_REQUESTS_KEPT = 64


def _request(steps: tuple[spec.Step, ...], implemented: frozenset[str], args: tuple[str, ...],
             env: tuple[tuple[str, str], ...]) -> bytes:
    """The request of a call: its steps checked against what the helper implements
    (SetupError: never run without one), then encoded (ValueError: a string execve cannot
    carry)."""
    key = (steps, implemented, args, env)
    data = _REQUESTS.get(key)
    if data is None:
        try:
            spec.check(steps, implemented, HELPER)
        except ValueError as exc:  # a step this build does not take: never run without it
            from ..errors import SetupError

            raise SetupError(str(exc)) from None
        data = wire.native_request(steps, args, env)
        if len(_REQUESTS) >= _REQUESTS_KEPT:
            _REQUESTS.clear()
        _REQUESTS[key] = data
    return data


#: How often a request lost before a supervisor took it (the idle supervisor was killed)
#: is submitted again: the command never ran, so sending it again is safe.
SUBMIT_TRIES = 5


def _submit_once(filters: Sequence[bytes], data: bytes, fds: Sequence[int],
                 wait: Optional[float], server: Optional[Server] = None) -> Optional[socket.socket]:
    """Submit one request and wait until a supervisor has taken it (its ``T``, or a
    refusal); None if the call's socket ended first: the request was lost (the idle
    supervisor that received it, or the whole server, was killed) and nothing ran."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # The filters travel as the socket's first messages: no per-Sandbox state to keep.
        for bpf in filters:
            ours.send(bpf)
        try:
            (server or get()).submit(data, [theirs.fileno(), *fds])
        except _Gone as gone:
            if server is not None:  # adopted: its starter restarts it
                raise OSError(errno.EPIPE, f"the sandlock-exec server is gone: {gone}") from None
            try:
                get().submit(data, [theirs.fileno(), *fds])  # restarted once
            except _Gone as exc:
                raise OSError(errno.EPIPE, f"the sandlock-exec server is gone: {exc}") from None
        theirs.close()  # the supervisor's copy is the only one: its death is our EOF
        if _taken(ours, wait):
            return ours
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    ours.close()
    return None


def _taken(sock: socket.socket, wait: Optional[float]) -> bool:
    """Whether a supervisor took the request on ``sock``: it said ``T`` (consumed here)
    or refused it (an ``F``, left for the caller). A supervisor that stops answering
    (``wait`` seconds, the call's own deadline) counts as taken: the caller's deadline
    ends the call."""
    import select

    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(None if wait is None else int(wait * 1000) + 1):
        return True
    try:
        first = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    if first == b"T":
        sock.recv(16)
        return True
    return first != b""


def implements() -> frozenset[str]:
    """The confinement steps the running helper implements (starting it if need be)."""
    return get().implements


def _hello(sock: socket.socket, timeout: float) -> bytes:
    """The server's first message; b"" if it says nothing in time (an old build says
    nothing at all) or exits first."""
    import select

    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(int(timeout * 1000)):
        return b""
    try:
        return sock.recv(256, socket.MSG_DONTWAIT)
    except OSError:
        return b""
