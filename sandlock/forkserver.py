"""The fork server: a small, fresh process from which every confined child is forked.

Why not fork the caller? An agent holds API keys, conversation history and gigabytes
of model state in memory. A child forked from it starts as a copy of all of that
(a confined Python function could simply read it), and forking a large process is
slow (page tables are copied: ~30 us per MiB on the reference machine). So the
library execs a fresh interpreter once (``sys.executable -I -S``: no site, no
PYTHON* variables, an empty environment) and forks from it.

Process tree (one box per process; ``ctrl`` is one SOCK_SEQPACKET socketpair)::

    caller ──ctrl──> fork server (single-threaded, child subreaper, ~10 MiB)
                      ├─ idle supervisor ─┐ blocked in recvmsg(ctrl); the kernel hands
                      ├─ idle supervisor ─┘ each request to exactly one of them
                      └─ busy supervisor (one call, child subreaper)
                          └─ confined command or function ── its own children ...

* A request goes from the caller straight to an idle supervisor: the fork server
  is not on the call path; it only forks a replacement when told one was taken.
  So a call costs one fork of a small process, never a fork of the caller.
* stdio travels as file descriptors (SCM_RIGHTS), so captured output flows from
  the command to the caller through pipes that neither server process reads.
* A supervisor serves exactly one call and then exits: no data of one call is ever
  in memory of a process that forks another call's child. It is the subreaper of
  its call, so at the end it kills that call's whole tree (daemons and ``setsid``
  escapees included) and nothing else: concurrent calls cannot touch each other.
* If a supervisor dies, its orphans are re-parented to the fork server, which kills
  every child that is not a supervisor. If the caller goes away (ctrl reaches EOF),
  the fork server kills everything and exits.

Wire format: requests are :mod:`marshal` dictionaries (only the trusted caller
writes them); supervisor -> caller messages are short ASCII lines on the per-call
socket: ``S pid`` started, ``F exit_code class\\nmessage`` failed before exec,
``E returncode signal timed_out pid`` ended (``S`` only when asked: ``popen``). The caller sends ``K`` (kill the tree) or
``s N`` (signal N); closing its end kills the tree.
"""

from __future__ import annotations

import _thread
import atexit
import marshal
import os
import select
import signal
import socket
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional, Sequence

#: Idle supervisors kept ready. Two lets one call start while the replacement for
#: the previous one is still being forked.
POOL = 2
#: Requests larger than this travel in a memfd (a SEQPACKET message must fit the
#: socket buffer in one piece).
INLINE_LIMIT = 32 * 1024
_RECV_SIZE = INLINE_LIMIT + 1024
_MAX_FDS = 8


# ----------------------------------------------------------------------------
# Caller side


class ForkServer:
    """The caller's handle on one fork server process (see :func:`get`)."""

    def __init__(self) -> None:
        import subprocess

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        boot = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from sandlock.forkserver import serve; serve(int(sys.argv[2]))")
        try:
            # Popen execs (vfork + exec on Linux): the server never holds the caller's memory.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", boot, root, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env={}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self._sock = ours
        self.owner = os.getpid()
        hello = ours.recv(64)
        if not hello.startswith(b"R "):
            self._proc.wait()
            from .errors import SetupError

            raise SetupError(f"the sandlock fork server did not start ({sys.executable}, "
                             f"exit status {self._proc.returncode})")
        self.pid = int(hello[2:])

    def submit(self, request: dict[str, Any], fds: Sequence[int]) -> socket.socket:
        """Hand one call to an idle supervisor; return the caller's end of its socket."""
        import array

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
                self._sock.sendmsg([blob], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", sent))])
            except OSError as exc:
                ours.close()
                from .errors import SetupError

                raise SetupError(f"the sandlock fork server is gone: {exc}") from None
        finally:
            theirs.close()
            if memfd >= 0:
                os.close(memfd)
        return ours

    def alive(self) -> bool:
        return self._proc.poll() is None

    def children(self) -> list[int]:
        """Pids of the fork server's children (idle and busy supervisors, strays)."""
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as handle:
                return [int(p) for p in handle.read().split()]
        except OSError:
            return []

    def close(self) -> None:
        """Stop the server: it kills every call still running, then exits."""
        if self._sock.fileno() >= 0:
            self._sock.close()
            if self.owner == os.getpid():
                self._proc.wait()


_server: Optional[ForkServer] = None
_lock = _thread.allocate_lock()


def get() -> ForkServer:
    """The process-wide fork server, started on first use (thread-safe)."""
    global _server
    server = _server
    if server is not None and server.owner == os.getpid():
        return server
    with _lock:
        if _server is None or _server.owner != os.getpid() or not _server.alive():
            _server = ForkServer()
        return _server


def shutdown() -> None:
    """Stop the fork server now (it restarts on the next call)."""
    global _server
    server, _server = _server, None
    if server is not None:
        server.close()


def _after_fork_in_child() -> None:
    """A forked copy of the caller must not share the parent's fork server."""
    global _server, _lock
    if _server is not None:
        _server._sock.close()
    _server = None
    _lock = _thread.allocate_lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)


# ----------------------------------------------------------------------------
# Fork server side


def serve(ctrl_fd: int) -> None:
    """Main loop of the fork server process (never returns)."""
    from . import kernel, launcher  # noqa: F401 - loaded once, shared by every child

    # What a confined Python call needs right after fork, so it reads no more files.
    import pickle  # noqa: F401
    import traceback  # noqa: F401

    kernel.set_child_subreaper()
    ctrl = socket.socket(fileno=ctrl_fd)
    ctrl.set_inheritable(False)
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    taken_r, taken_w = os.pipe2(os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's business
    supervisors: set[int] = set()
    me = os.getpid()

    def fork_supervisor() -> None:
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, taken_r):
                    os.close(fd)
                kernel.set_pdeathsig(signal.SIGKILL)
                if os.getppid() != me:
                    os._exit(0)
                kernel.set_child_subreaper()
                _supervise(ctrl, taken_w)
            finally:
                os._exit(0)
        supervisors.add(pid)

    import gc

    gc.collect()
    gc.freeze()  # keep the collector from touching (and copying) the shared heap
    for _ in range(POOL):
        fork_supervisor()
    ctrl.send(b"R %d" % me)
    poller = select.poll()
    poller.register(ctrl_fd, 0)  # only POLLHUP: requests are for the supervisors
    poller.register(taken_r, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, events in poller.poll():
            if fd == ctrl_fd:
                _shutdown(supervisors)
            elif fd == taken_r:
                for _ in os.read(taken_r, 64):
                    fork_supervisor()
            else:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
                _reap(supervisors, me)


def _reap(supervisors: set[int], me: int) -> None:
    """Collect exited supervisors; kill any other child (orphans of a dead supervisor)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        supervisors.discard(pid)
    for pid in _children(me):
        if pid not in supervisors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


def _shutdown(supervisors: set[int]) -> None:
    """The caller is gone: kill every process of every call, then exit."""
    me = os.getpid()
    while True:
        pids = _children(me)
        if not pids:
            os._exit(0)
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


# ----------------------------------------------------------------------------
# Supervisor side (one call)


def _receive(ctrl: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Block until a request arrives; exit quietly when the caller has gone."""
    import array

    fds = array.array("i")
    try:
        data, ancillary, flags, _ = ctrl.recvmsg(_RECV_SIZE, socket.CMSG_SPACE(_MAX_FDS * 4),
                                                 socket.MSG_CMSG_CLOEXEC)
    except OSError:
        os._exit(0)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % 4])
    if not data:
        os._exit(0)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        os._exit(1)  # cannot happen with our own client; the caller sees EOF
    request = marshal.loads(data)
    if request.get("memfd"):
        memfd = fds.pop()
        with os.fdopen(memfd, "rb") as handle:
            request = marshal.loads(handle.read())
    return request, list(fds)


def _supervise(ctrl: socket.socket, taken_w: int) -> None:
    """Wait for one request, run it confined, report, kill the tree, exit."""
    from . import launcher
    from .errors import SandlockError

    request, fds = _receive(ctrl)
    ctrl.close()
    call = socket.socket(fileno=fds[0])
    stdin, stdout, stderr = fds[1:4]
    ruleset_fd = fds[4] if request["ruleset"] else -1
    result_fd = fds[-1] if request["kind"] == "call" else -1
    compiled = launcher.Compiled(None, 0, (), ruleset_fd, request["bpf"],  # type: ignore[arg-type]
                                 tuple(request["rlimits"]))
    cmd = launcher.Command(request["exe"], tuple(request["argv"]), tuple(request["env"]),
                           request["cwd"])
    body = None
    if result_fd >= 0:
        def body() -> None:
            _call_body(result_fd, request)
    failure = ""
    try:
        child = launcher.spawn(compiled, cmd, stdin=stdin, stdout=stdout, stderr=stderr,
                               body=body)
    except SandlockError as exc:
        failure = f"F {int(exc.exit_code)} {type(exc).__name__}\n{exc}"
    except OSError as exc:  # fork failed (EAGAIN: RLIMIT_NPROC, memory)
        failure = f"F 125 SetupError\ncannot fork the confined process: {exc}"
    # Only now (the child has exec'd) does the fork server fork a replacement, so that
    # fork does not compete for a CPU with this call's start; the pool has a spare.
    os.write(taken_w, b"x")
    os.close(taken_w)
    if failure:
        _send(call, failure)
        os._exit(0)
    for fd in fds[1:]:
        os.close(fd)  # the child has them; keeping them would delay the caller's EOF
    if request.get("report_start"):
        _send(call, f"S {child.pid}")
    _watch(child, call, request["timeout"])
    _send(call, f"E {child.returncode} {child.signal or 0} {int(child.timed_out)} {child.pid}")
    os._exit(0)


def _send(call: socket.socket, text: str) -> None:
    try:
        call.send(text.encode(errors="replace"))
    except OSError:
        pass  # the caller has gone; the tree is (or will be) killed anyway


def _watch(child: Any, call: socket.socket, timeout: Optional[float]) -> None:
    """Wait for the command; obey the caller's kill/signal requests and the deadline."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()
    poller.register(child.pidfd, select.POLLIN)
    poller.register(call.fileno(), select.POLLIN)
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
                    child.send_signal(int(message[2:]))
            elif child.returncode is None:
                child._reap()  # also kills and reaps whatever the command left behind
                break


# ----------------------------------------------------------------------------
# The confined child of a Python call (runs after Landlock and seccomp)


def _call_body(result_fd: int, request: dict[str, Any]) -> None:
    """Run the caller's function inside the sandbox and write its outcome to the caller.

    Before any of the caller's code is loaded, every descriptor but stdio and the
    result pipe is closed (the ruleset fd above all: rules added to it would widen
    the sandbox of later calls), and the environment becomes exactly the policy's.
    """
    import pickle

    os.dup2(result_fd, 3)
    os.closerange(4, 2**31 - 1)
    os.environ.clear()
    os.environ.update(dict(request["env"]))
    sys.dont_write_bytecode = True
    sys.argv = [request["exe"]]
    record: tuple[Any, ...]
    try:
        sys.path[:] = request["sys_path"]
        if request["main"]:
            _load_main(request["main"])
        func, args, kwargs = pickle.loads(request["payload"])
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
    data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(3, view):]
    finally:
        os._exit(0)


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
