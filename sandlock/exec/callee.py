"""The confined child of a Python call: what runs inside the sandbox of ``call()``.

A spare (:class:`sandlock.exec.server._Spare`) is forked by a call's supervisor and
confined by the policy's steps before the call arrives; it then runs
:func:`_spare_body`: the call's last steps (:func:`sandlock.exec.spec.call_steps`),
then the caller's function. Nothing here runs outside a sandbox.
"""

from __future__ import annotations

import marshal
import os
import socket
import sys

from .wire import CALL_NAME, SPARE_NAME

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

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
    last, notify_bpf = marshal.loads(data)
    kernel.set_name(CALL_NAME)
    for target in range(3):
        os.dup2(fds[target], target)
    from . import engine, spec

    def notify() -> None:  # [network] allow: connect(2) goes to the caller's mediator
        prog, _keep = kernel.make_fprog(notify_bpf)
        kernel.install_listener(prog, fds[6])
        os.close(fds[6])

    try:  # the spare's last steps, now that the call is known (spec.call_steps)
        steps = spec.decode(last)
        if {s[0] for s in steps} - {spec.CHDIR, spec.NOTIFY} or (
                any(s[0] == spec.NOTIFY for s in steps) != (notify_bpf is not None)):
            raise engine.StepFailed("setup", OSError(0, f"not a call's last steps: {last!r}"))
        engine.apply(steps, engine.Context(notify=notify))
    except ValueError as unknown:  # spec.decode: a step this version does not know
        sock.send(f"setup\0{0}\0{unknown}".encode(errors="replace"))
        os._exit(ExitCode.LAUNCHER)
    except engine.StepFailed as failed:  # reported as the launcher's child reports it
        error = failed.error
        sock.send(f"{failed.stage}\0{error.errno or 0}\0{error.strerror}".encode(errors="replace"))
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
