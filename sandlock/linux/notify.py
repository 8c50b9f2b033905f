"""A seccomp user-notification listener served by a thread of this process.

The base of the host allowlist's connect gate (:mod:`sandlock.net.connect`) and of the
recorder of `sandlock trace` (:mod:`sandlock.trace.record`): the forked child installs
a notifying filter and sends its listener back over a socketpair (:meth:`install`,
after the policy's own filter, just before execve); the parent's thread receives each
notification and hands it to :meth:`Listener._notified`, which must answer it
(:meth:`Listener._respond`). When the thread ends, the listener is closed, so a
pending or later notified call fails (ENOSYS) instead of waiting for an answer nobody
will send. https://man7.org/linux/man-pages/man2/seccomp_unotify.2.html
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import threading
from typing import TYPE_CHECKING, Optional

from . import kernel
from .kernel import NOTIF_ID_VALID, NOTIF_RECV, NOTIF_SEND, NOTIF_SIZE, RESP_FORMAT

if TYPE_CHECKING:
    from typing import Protocol

    class Signals(Protocol):
        """What a listener needs of the signal gate's handler it carries
        (:class:`sandlock.linux.signalgate.Signals`, which imports this module)."""

        prefix: bytes
        numbers: dict[int, str]

        def notified(self, listener: Listener, ident: int, tid: int, nr: int,
                     args: tuple[int, ...]) -> None: ...


#: Yama's ptrace restriction (Documentation/admin-guide/LSM/Yama.rst): 0 classic, 1 only
#: an ancestor (Ubuntu's default), 2 only with CAP_SYS_PTRACE, 3 never. Opening
#: /proc/TID/mem, as every gate does to read a notified call's arguments, is a ptrace
#: attach under it.
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
CAP_SYS_PTRACE = 19


def memory_unreadable(ancestor: bool, scope_file: str = YAMA_SCOPE,
                      status_file: str = "/proc/self/status") -> Optional[str]:
    """None when a gate in this process can read its tool's memory, else why not.
    ``ancestor``: the gate's process is an ancestor of every process of the tool.
    ``status_file``: where this process's capabilities are read (``CapEff``)."""
    try:
        with open(scope_file, "rb") as handle:
            scope = int(handle.read().strip() or b"0")
    except (OSError, ValueError):
        return None  # no Yama: the classic rules (same user, not dumpable-protected)
    if scope <= 0 or scope == 1 and ancestor:
        return None
    if scope >= 3:
        return (f"cannot read the tool's memory: Yama's ptrace_scope is {scope} ({scope_file}: "
                "no process may, whatever its privileges)")
    try:
        with open(status_file, "rb") as handle:
            effective = next(int(line.split()[1], 16) for line in handle
                             if line.startswith(b"CapEff:"))
    except (OSError, StopIteration, ValueError):
        effective = 0
    if effective >> CAP_SYS_PTRACE & 1:
        return None
    who = "an ancestor of the tool" if scope == 1 else "a process with CAP_SYS_PTRACE"
    return (f"cannot read the tool's memory: Yama's ptrace_scope is {scope} ({scope_file}), "
            f"which allows that only to {who}")


def gate_unsupported() -> Optional[str]:
    """None when this kernel can run a gate that makes the tool's sockets
    (:mod:`sandlock.net.connect`: user notification, ADDFD with SEND), else why not,
    naming the kernel it needs. ``sandlock check`` and the gate both ask here."""
    from .syscalls import AUDIT_ARCH, MACHINE

    if MACHINE not in AUDIT_ARCH:
        return f"not supported on {MACHINE}"
    if not kernel.seccomp_action_available(kernel.SECCOMP_RET_USER_NOTIF):
        return "needs seccomp user notification (Linux 5.9+)"
    missing = kernel.addfd_send_unsupported()
    if missing:
        return f"needs Linux {kernel.ADDFD_SEND_KERNEL}+: {missing}"
    return memory_unreadable(ancestor=True)  # every gate is its tool's ancestor


class Listener:
    """Subclasses define :meth:`_notified` and :attr:`name` (of the thread)."""

    name = "sandlock-notify"
    #: The signal gate's handler when this listener also carries it (:meth:`gate_signals`).
    signals: Optional[Signals] = None
    #: The listener whose descriptor receives this one's calls (:meth:`carry`), else None.
    carrier: Optional[Listener] = None
    #: The filter placed before another listener's program when it carries this one
    #: (:meth:`carry`): this listener's calls return here, every other call falls through.
    prefix = b""

    def __init__(self, bpf: bytes) -> None:
        self.notify_bpf = bpf
        self._prog, self._keep = kernel.make_fprog(bpf)
        self._parent_end, self._child_end = socket.socketpair()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread: Optional[threading.Thread] = None
        self.listener = -1
        self._riders: list[Listener] = []

    def gate_signals(self, signals: Signals) -> None:
        """Also answer the signal gate's calls (:mod:`sandlock.linux.signalgate`): its
        filter goes first in this listener's program. One listener for both, because
        the kernel gives a process only one (has_duplicate_listener() in
        kernel/seccomp.c refuses a second with EBUSY). Before fork only."""
        self.signals = signals
        self.notify_bpf = signals.prefix + self.notify_bpf
        self._prog, self._keep = kernel.make_fprog(self.notify_bpf)

    def carry(self, rider: Listener) -> None:
        """Also receive ``rider``'s calls: its :attr:`prefix` goes first in this listener's
        program, each call it :meth:`claims` is handed to its :meth:`_notified`, and it
        answers on this listener's descriptor (the kernel gives a process one listener,
        see :meth:`gate_signals`). ``rider`` then installs nothing and runs no thread of
        its own. Before fork only."""
        if not rider.prefix or rider.carrier is not None:
            raise ValueError(f"{rider.name} cannot ride on another listener")
        rider.carrier = self
        self._riders.append(rider)
        self.notify_bpf = rider.prefix + self.notify_bpf
        self._prog, self._keep = kernel.make_fprog(self.notify_bpf)

    def claims(self, nr: int, args: tuple[int, ...]) -> bool:
        """Whether a call is one of this listener's when another carries it: exactly the
        calls its :attr:`prefix` notifies."""
        return False

    @property
    def child_end(self) -> int:
        """The socket on which the child sends its listener (:meth:`install`)."""
        return self._child_end.fileno()

    # -- in the forked child, after the policy's filter, just before execve
    def install(self) -> None:
        if self.carrier is None:  # else the carrier's program holds this one's prefix
            kernel.install_listener(self._prog, self._child_end.fileno())

    # -- in the parent
    def start(self) -> None:
        self._child_end.close()
        if self.carrier is not None:
            return  # the carrier's thread receives this one's calls
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def run(self, until: int) -> None:
        """What :meth:`start`'s thread does, in the calling thread instead (one thread
        less to start per call): returns when ``until`` is readable or hung up, or the
        tool's tree is gone. :meth:`stop` still closes the descriptors."""
        if self.carrier is not None:
            raise ValueError(f"{self.name} rides on another listener: it serves nothing itself")
        self._child_end.close()
        self._loop(until)

    def stop(self) -> None:
        """End the thread and close every descriptor (once the tool's tree is gone)."""
        if self._stop_w < 0:
            return
        os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        own = self.listener if self.carrier is None else -1  # a carrier closes its own
        for fd in (self._stop_r, self._stop_w, own):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = self.listener = -1
        self._parent_end.close()
        self._child_end.close()

    def _loop(self, until: int = -1) -> None:
        try:
            self._serve(until)
        finally:
            for rider in self._riders:
                rider.listener = -1
            if self.listener >= 0:
                os.close(self.listener)
                self.listener = -1

    def _serve(self, until: int = -1) -> None:
        poller = select.poll()
        poller.register(self._stop_r, select.POLLIN)
        ends = {self._stop_r}
        if until >= 0:
            poller.register(until, select.POLLIN)
            ends.add(until)
        poller.register(self._parent_end.fileno(), select.POLLIN)
        if any(fd in ends for fd, _ in poller.poll()):
            return
        _, fds, _, _ = socket.recv_fds(self._parent_end, 1, 1)
        if not fds:
            return  # the child failed before installing the filter
        self.listener = fds[0]
        for rider in self._riders:
            rider.listener = self.listener
        poller.unregister(self._parent_end.fileno())
        poller.register(self.listener, select.POLLIN)
        while True:
            for fd, events in poller.poll():
                if fd in ends:
                    return
                if events & select.POLLIN:
                    self._receive()
                elif events & (select.POLLHUP | select.POLLERR):
                    return  # every process under the filter is gone

    def _receive(self) -> None:
        buf = bytearray(NOTIF_SIZE)
        try:
            fcntl.ioctl(self.listener, NOTIF_RECV, buf, True)
        except OSError:
            return  # the caller died or was interrupted before it was read
        # struct seccomp_notif: id, pid, flags, then seccomp_data: nr, arch, ip, args[6]
        ident, tid = struct.unpack_from("=QI", buf, 0)
        nr, = struct.unpack_from("=i", buf, 16)
        args = struct.unpack_from("=6Q", buf, 32)
        if self.signals is not None and nr in self.signals.numbers:
            self.signals.notified(self, ident, tid, nr, args)
            return
        self._dispatch(ident, tid, nr, args)

    def _dispatch(self, ident: int, tid: int, nr: int, args: tuple[int, ...]) -> None:
        """A call to the rider that :meth:`claims` it, else to this listener."""
        for rider in self._riders:
            if rider.claims(nr, args):
                rider._notified(ident, tid, nr, args)
                return
        self._notified(ident, tid, nr, args)

    def _notified(self, ident: int, tid: int, nr: int, args: tuple[int, ...]) -> None:
        """One notified call; must end with :meth:`_respond`. Runs in the thread."""
        raise NotImplementedError

    def _respond(self, ident: int, error: int = 0, flags: int = 0) -> None:
        try:
            fcntl.ioctl(self.listener, NOTIF_SEND, struct.pack(RESP_FORMAT, ident, 0, error, flags))
        except OSError:
            pass  # the caller is gone

    def _valid(self, ident: int) -> bool:
        """The notified call is still waiting (checked after reading its memory)."""
        try:
            fcntl.ioctl(self.listener, NOTIF_ID_VALID, struct.pack("=Q", ident))
            return True
        except OSError:
            return False
