"""The fork server, as the caller sees it: a small, fresh process from which every
confined child of the Python API is forked.

Three modules, one per process: this one runs in the caller (the agent); the fork
server and its supervisors run :mod:`sandlock.exec.server`; the confined child of a
Python call runs :mod:`sandlock.exec.callee`. The design, for all three:

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
import socket
import sys

from .. import PACKAGE_DIR
from .wire import FORKSERVER_INLINE_LIMIT as INLINE_LIMIT
from .wire import KINDS, SPARE_NAME

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Sequence


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
        boot = ("import sys; sys.path.insert(0, sys.argv[1]); from sandlock.exec.server "
                "import serve; serve(*map(int, sys.argv[2:]))")
        try:
            # Popen execs (vfork + exec on Linux): the server never holds the caller's memory.
            # Its own process group: a terminal's job signals (Ctrl-C, Ctrl-Z, or a tool
            # that made the caller's terminal send them) are the caller's, never stop it.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", boot, root, *map(str, theirs)],
                pass_fds=theirs, env={}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, close_fds=True, process_group=0)
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


def children_of(pid: int) -> list[int]:
    """The children of process ``pid`` (linux.process.children), [] if it is gone."""
    from ..linux.process import children

    return sorted(children(pid))
