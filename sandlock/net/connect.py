"""Mediated network for one run: the proxy plus a seccomp gate for socket(2) and connect(2).

Only policies with ``[network] allow`` import this module (:func:`sandlock.exec.launcher.run`).

Why a gate as well as the proxy: Landlock's TCP rules name ports, not
addresses, so a Landlock grant of the proxy's port would also reach *any* host
on that port, and a hostile server can listen on every port. Instead the tool
gets no Landlock grant for the proxy at all, and its TCP sockets and every
``connect(2)`` stop in a seccomp user notification
(https://docs.kernel.org/userspace-api/seccomp_filter.html#userspace-notification):

1. ``socket(2)`` of an IPv4 or IPv6 stream socket: the gate creates the socket
   itself with the same arguments (registers: nothing to race), keeps its own
   reference, and installs the same open file in the tool with
   ``SECCOMP_IOCTL_NOTIF_ADDFD`` + ``SECCOMP_ADDFD_FLAG_SEND`` (Linux 5.14), which
   also answers the call with the new descriptor's number;
2. ``connect(2)``: the gate names the object behind the tool's descriptor by its
   inode (``stat`` of ``/proc/TID/fd/N``; a socket's inode number is unique while
   the socket lives, and the gate's reference keeps it alive) and finds its own
   reference; it copies the address from the tool's memory once
   (``/proc/TID/mem``), decides on that copy (the proxy's exact address, a
   ``connect`` port of the policy, or an IP/CIDR ``allow`` rule; deny rules win;
   anything else EACCES), calls ``connect(2)`` itself on its reference with the
   same copied bytes and answers the tool with the result (EINPROGRESS included:
   both share one open file description).

The tool's connect never runs in the tool's context, so a thread rewriting the
address or swapping the descriptor after the copy changes nothing. No
``pidfd_getfd(2)``: container runtimes' default seccomp profiles refuse it without
CAP_SYS_PTRACE, and ADDFD is allowed by all of them.

The gate lets its reference go once the socket has connected (at once, or when a
non-blocking connect completes) or listens, so the tool's ``close`` still ends the
connection; a later connect on it is answered EISCONN without running. A TCP
socket the gate did not make (accepted, or passed in) is refused (EACCES, with a
report). Sockets that are not TCP (Unix, UDP when granted: sockfs names their
protocol) are let through with CONTINUE: that is safe only because anything that
then runs is still under Landlock, whose TCP rules hold no grant for the proxy; the
same backstop covers a tool that stacks its own notifying filter (the filter below
also refuses new listeners with EPERM). At most :data:`MAX_HELD` sockets are held
per run; a sockets its creator no longer has is dropped first, beyond the limit
socket(2) fails with EMFILE and a report.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import select
import socket
import stat
import struct
import threading
from typing import TYPE_CHECKING, Callable, Optional

from ..errors import KernelSupportError
from ..linux import kernel
from ..linux.kernel import (
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    SECCOMP_USER_NOTIF_FLAG_CONTINUE,
)
from ..linux.notify import Listener, gate_unsupported
from ..linux.syscalls import AUDIT_ARCH, MACHINE, NR
from ..policy.netrules import NetRules, format_target
from .admit import Route, admitted, began, is_route
from .proxy import Proxy

if TYPE_CHECKING:
    from ..exec.spec import Command
    from ..policy.model import Policy


_libc = ctypes.CDLL(None, use_errno=True)
_libc.connect.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.socket.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]

SOCK_TYPE_MASK = 0xF
#: The socket(2) type flags a caller may add (linux/net.h): anything else is EINVAL.
SOCK_FLAGS = socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
#: sockfs protocol names of the sockets a connect of the tool may CONTINUE on (Landlock
#: and the main filter decide there); every other socket the gate did not make is refused.
NOT_TCP = ("UNIX", "UDP", "UDPv6")


def prefix() -> bytes:
    """Classic BPF: connect, listen and socket(AF_INET/AF_INET6, SOCK_STREAM...) ->
    USER_NOTIF; seccomp(NEW_LISTENER) -> EPERM; every other call, and a foreign
    architecture, falls through to the instruction after the prefix (:func:`notify_filter`
    puts ALLOW there; a recorder that carries the gate, its own program:
    :meth:`sandlock.linux.notify.Listener.carry`). :meth:`ConnectGate.claims` names the
    same calls.

    Foreign architectures fall through because the main filter, loaded first, already
    kills them (and it refuses the sockets it does not grant before this filter's
    notification counts: ERRNO wins over USER_NOTIF). Arguments are read at their low
    32 bits (little-endian offsets), as the kernel does for ``int`` arguments.
    """
    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld_abs, jeq, jset, alu_and, ret = 0x20, 0x15, 0x45, 0x54, 0x06
    return b"".join([
        op(ld_abs, 4),                                  # 0: A = arch
        op(jeq, AUDIT_ARCH[MACHINE], 0, 15),            # 1: foreign -> 17 (after the prefix)
        op(ld_abs, 0),                                  # 2: A = nr
        op(jeq, NR["connect"], 12, 0),                  # 3: connect -> 16 (notify)
        op(jeq, NR["listen"], 11, 0),                   # 4: listen -> 16 (notify)
        op(jeq, NR["socket"], 0, 6),                    # 5: not socket -> 12
        op(ld_abs, 16),                                 # 6: A = low half of args[0] (family)
        op(jeq, socket.AF_INET, 1, 0),                  # 7: inet -> 9
        op(jeq, socket.AF_INET6, 0, 8),                 # 8: not inet6 -> 17 (after)
        op(ld_abs, 24),                                 # 9: A = low half of args[1] (type)
        op(alu_and, SOCK_TYPE_MASK),                    # 10: A &= SOCK_TYPE_MASK
        op(jeq, socket.SOCK_STREAM, 4, 5),              # 11: stream -> 16 (notify), else 17
        op(jeq, NR["seccomp"], 0, 4),                   # 12: not seccomp -> 17 (after)
        op(ld_abs, 24),                                 # 13: A = low half of args[1] (flags)
        op(jset, kernel.SECCOMP_FILTER_FLAG_NEW_LISTENER, 0, 2),  # 14: listener -> 15, else 17
        op(ret, SECCOMP_RET_ERRNO | errno.EPERM),       # 15
        op(ret, kernel.SECCOMP_RET_USER_NOTIF),         # 16
    ])


def notify_filter() -> bytes:
    """The gate alone: :func:`prefix`, then ALLOW."""
    return prefix() + struct.pack("=HBBI", 0x06, 0, 0, SECCOMP_RET_ALLOW)


def _claimed(nr: int, args: tuple[int, ...]) -> bool:
    """The calls :func:`prefix` notifies, told apart from the rest on a shared listener."""
    if nr in (NR["connect"], NR["listen"]):
        return True
    return nr == NR["socket"] and args[0] & 0xFFFFFFFF in (socket.AF_INET, socket.AF_INET6) \
        and args[1] & SOCK_TYPE_MASK == socket.SOCK_STREAM


def check_support() -> None:
    """Raise KernelSupportError when the kernel cannot mediate connect(2)."""
    why = gate_unsupported()
    if why:
        raise KernelSupportError(f"[network] allow {why}")


#: Connects to remote hosts under way at once per run (each holds a descriptor and a
#: thread); beyond, the tool's connect fails with EAGAIN and a ``network:`` report.
MAX_CONNECTING = 256
#: TCP sockets the gate holds at once per run (made, not yet connected or listening);
#: beyond, after dropping those their creator no longer has, socket(2) fails (EMFILE).
MAX_HELD = 512
#: Sockets the gate let go after they connected, remembered to answer a later connect.
MAX_RETIRED = 4096


class _Held:
    """The gate's reference to one socket it made for the tool."""

    __slots__ = ("fd", "tid", "connecting")

    def __init__(self, fd: int, tid: int) -> None:
        self.fd = fd
        self.tid = tid  #: the thread that made it (checked when the table is full)
        self.connecting = False  #: a non-blocking connect is under way (the watcher's)


class ConnectGate(Listener):
    """Answers the tool's socket(2), listen(2) and connect(2) calls; see the module
    docstring."""

    name = "sandlock-connect"
    prefix = prefix()

    def __init__(self, ports: tuple[tuple[int, int], ...], rules: NetRules,
                 proxy: tuple[str, int], report: Callable[[str], None],
                 route: Optional[Route] = None) -> None:
        super().__init__(notify_filter())
        self.ports = ports
        self.rules = rules
        self.proxy = proxy
        self.report = report
        self.route = route
        self._workers: dict[threading.Thread, int] = {}  #: -> the socket it is connecting
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        self._held: dict[int, _Held] = {}  #: socket inode -> the gate's reference
        self._retired: dict[int, int] = {}  #: inode of a socket let go -> errno for a connect
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._watcher: Optional[threading.Thread] = None
        self._closing = False

    def start(self) -> None:
        super().start()
        self._watcher = threading.Thread(target=self._watch, name="sandlock-connect-watch",
                                         daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Called once the tool's whole tree is gone: abort slow connects, end the loop."""
        with self._lock:  # a worker closes its fd only after leaving the dict, under the lock
            workers = list(self._workers)
            for fd in self._workers.values():
                try:  # a connect still in SYN_SENT is aborted by shutdown (inet_shutdown)
                    _shutdown(fd)
                except OSError:
                    pass
        for worker in workers:
            worker.join()
        super().stop()
        with self._lock:
            self._closing = True
            for held in self._held.values():
                os.close(held.fd)
            self._held.clear()
        self._wake()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        if self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def claims(self, nr: int, args: tuple[int, ...]) -> bool:
        return _claimed(nr, args)

    def _notified(self, ident: int, tid: int, nr: int, args: tuple[int, ...]) -> None:
        try:
            if nr == NR["socket"]:
                self._socket(ident, tid, *(a & 0xFFFFFFFF for a in args[:3]))
            elif nr == NR["listen"]:
                self._listen(ident, tid, args[0] & 0xFFFFFFFF)
            else:
                self._handle(ident, tid, args[0] & 0xFFFFFFFF, args[1], args[2] & 0xFFFFFFFF)
        except Exception:  # noqa: BLE001 - a gate bug must deny, never hang the tool
            self._respond(ident, -errno.EACCES)

    # -- socket(2): the gate makes every TCP socket of the tool
    def _socket(self, ident: int, tid: int, family: int, kind: int, protocol: int) -> None:
        if kind & ~(SOCK_TYPE_MASK | SOCK_FLAGS):
            self._respond(ident, -errno.EINVAL)
            return
        if protocol not in (0, socket.IPPROTO_TCP):
            self._deny(f"protocol {protocol}", "only TCP stream sockets are mediated", hint=False)
            self._respond(ident, -errno.EPROTONOSUPPORT)
            return
        with self._lock:
            if len(self._held) >= MAX_HELD:
                self._drop_abandoned()
            full = len(self._held) >= MAX_HELD
        if full:
            self._deny("more sockets", f"{MAX_HELD} TCP sockets made through the gate are "
                       "neither connected nor closed (the limit per run)", hint=False)
            self._respond(ident, -errno.EMFILE)
            return
        ours = _libc.socket(family, (kind & ~socket.SOCK_CLOEXEC) | socket.SOCK_CLOEXEC,
                            protocol)
        if ours < 0:
            self._respond(ident, -(ctypes.get_errno() or errno.ENOMEM))
            return
        inode = os.fstat(ours).st_ino
        with self._lock:
            self._held[inode] = _Held(ours, tid)
            self._retired.pop(inode, None)
        try:
            kernel.notif_addfd_send(self.listener, ident, ours, bool(kind & socket.SOCK_CLOEXEC))
        except OSError as exc:
            self._release(inode)
            self._respond(ident, -(exc.errno or errno.EMFILE))  # nothing if the call is gone

    def _drop_abandoned(self) -> None:
        """Under the lock, the table full: let go of the sockets not yet connected whose
        maker no longer has them (it closed them, or is gone). Letting go is always safe:
        a later connect on such a socket is refused."""
        for inode, held in list(self._held.items()):
            if not held.connecting and f"socket:[{inode}]" not in _links(held.tid):
                del self._held[inode]
                os.close(held.fd)

    def _release(self, inode: int, answer: int = 0) -> None:
        """Let go of our reference; a later connect on the socket gets ``answer``."""
        with self._lock:
            held = self._held.pop(inode, None)
            if held is not None:
                os.close(held.fd)
            if answer:
                self._retired[inode] = answer
                if len(self._retired) > MAX_RETIRED:
                    del self._retired[next(iter(self._retired))]
        self._wake()

    def _listen(self, ident: int, tid: int, fdnum: int) -> None:
        """A listening socket is not the gate's to keep (its port must be free once the
        tool closes it); listen(2) itself runs in the tool."""
        try:
            mode, _, inode = kernel.fd_inode(tid, fdnum)
        except OSError:
            mode = inode = 0
        if stat.S_ISSOCK(mode):
            self._release(inode, errno.EISCONN)
        self._respond(ident, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)

    # -- connect(2)
    def _handle(self, ident: int, tid: int, fdnum: int, pointer: int, length: int) -> None:
        try:
            mode, _, inode = kernel.fd_inode(tid, fdnum)
        except OSError as exc:
            self._respond(ident, -(errno.EBADF if exc.errno == errno.ENOENT else
                                   exc.errno or errno.EBADF))
            return
        if not stat.S_ISSOCK(mode):
            self._respond(ident, -errno.ENOTSOCK)
            return
        with self._lock:
            held = self._held.get(inode)
            sock = os.dup(held.fd) if held is not None else -1
            retired = self._retired.get(inode, 0)
        if sock < 0:
            self._unknown(ident, tid, fdnum, retired)
            return
        keep = False
        try:
            try:
                raw = _read_memory(tid, pointer, min(length, 128))
            except OSError:
                self._respond(ident, -errno.EFAULT)
                return
            if not self._valid(ident):
                return
            error, target = self._decide(raw)
            if error:
                self._respond(ident, -error)
                return
            if target == self.proxy or target == ("", 0):
                result = _connect(sock, raw, length)
                self._respond(ident, result)
                self._connected(inode, result, target)
                return
            worker = threading.Thread(target=self._slow_connect,
                                      args=(ident, sock, raw, length, inode, target),
                                      daemon=True, name="sandlock-connect-worker")
            with self._lock:
                busy = len(self._workers) >= MAX_CONNECTING
                if not busy:
                    self._workers[worker] = sock
            if busy:
                self._deny("more hosts", f"{MAX_CONNECTING} connects are under way in this run "
                           "(the limit per run)", hint=False)
                self._respond(ident, -errno.EAGAIN)
                return
            keep = True
            worker.start()
        finally:
            if not keep:
                os.close(sock)

    def _unknown(self, ident: int, tid: int, fdnum: int, retired: int) -> None:
        """A connect on a socket the gate does not hold."""
        protocol = kernel.socket_protocol(tid, fdnum)
        if protocol.startswith(NOT_TCP[0]) or protocol in NOT_TCP:
            # Not TCP: Landlock and the main seccomp filter still decide in the tool.
            self._respond(ident, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
            return
        if retired and protocol in ("TCP", "TCPv6"):
            self._respond(ident, -retired)  # connected (or listening) before: no second connect
            return
        self._deny(f"pid {tid}", f"descriptor {fdnum} is a {protocol or 'socket'} socket "
                   "sandlock did not make (accepted, passed in, or dropped); only sockets "
                   "made through the gate may connect", hint=False)
        self._respond(ident, -errno.EACCES)

    def _connected(self, inode: int, result: int, target: Optional[tuple[str, int]]) -> None:
        """After our connect on the socket ``inode``: done -> let it go; under way -> the
        watcher lets it go when it completes; failed or a disconnect -> keep it."""
        if target == ("", 0):
            return
        if result in (0, -errno.EISCONN):
            self._release(inode, errno.EISCONN)
        elif result in (-errno.EINPROGRESS, -errno.EALREADY):
            with self._lock:
                held = self._held.get(inode)
                if held is not None:
                    held.connecting = True
            self._wake()

    def _slow_connect(self, ident: int, sock: int, raw: bytes, length: int, inode: int,
                      target: tuple[str, int]) -> None:
        """A blocking connect to a remote host must not stall every other connect."""
        try:
            since = began()
            result = _connect(sock, raw, length)
            if self.route is not None and is_route(self.route, *target):
                result = admitted(self.route, sock, result, since)
            self._respond(ident, result)
            self._connected(inode, result, target)
        finally:
            with self._lock:
                self._workers.pop(threading.current_thread(), None)
            os.close(sock)

    # -- the watcher: non-blocking connects under way
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # already awake (pipe full), or stopped

    def _watch(self) -> None:
        """Lets go of a socket once its non-blocking connect completed (POLLOUT): the
        socket's pending error is left for the tool (poll never reads it)."""
        while True:
            with self._lock:
                if self._closing:
                    return
                watched = {h.fd: (inode, h) for inode, h in self._held.items() if h.connecting}
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in watched:
                poller.register(fd, select.POLLOUT)
            for fd, events in poller.poll():
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                    continue
                inode, held = watched[fd]
                with self._lock:
                    if self._held.get(inode) is not held:
                        continue  # let go meanwhile; the number may be another's now
                    held.connecting = False
                if not events & (select.POLLERR | select.POLLHUP):
                    self._release(inode, errno.EISCONN)

    def _decide(self, raw: bytes) -> tuple[int, Optional[tuple[str, int]]]:
        """(errno or 0, (address, port)) for the gate's own copy of the address."""
        if len(raw) < 2:
            return errno.EINVAL, None
        family = struct.unpack_from("=H", raw)[0]
        if family == socket.AF_UNSPEC:
            return 0, ("", 0)  # disconnect: harmless
        if family == socket.AF_INET and len(raw) >= 16:
            address: ipaddress._BaseAddress = ipaddress.IPv4Address(raw[4:8])
        elif family == socket.AF_INET6 and len(raw) >= 24:
            address = ipaddress.IPv6Address(raw[8:24])
            if address.ipv4_mapped is not None:
                address = address.ipv4_mapped
        else:
            return errno.EAFNOSUPPORT if family not in (2, 10) else errno.EINVAL, None
        port = struct.unpack_from("!H", raw, 2)[0]
        target = (str(address), port)
        if target == self.proxy or any(low <= port <= high for low, high in self.ports):
            return 0, target
        host = str(address)
        verdict = self.rules.check_name(host, port)
        if verdict:
            verdict = self.rules.check_address(host, address, port)  # type: ignore[arg-type]
        if verdict:
            return 0, target
        self._deny(format_target(host, port), verdict.reason)
        return errno.EACCES, None

    def _deny(self, target: str, reason: str, hint: bool = True) -> None:
        message = f"network: refused connection of {target}: {reason}"
        if hint:
            message = (f"network: refused direct connection to {target}: {reason}; the tool "
                       "reaches hosts only through the proxy in HTTP_PROXY/HTTPS_PROXY/ALL_PROXY "
                       "(does it ignore proxy variables?)")
        with self._lock:
            if target in self._reported or len(self._reported) > 100:
                return
            self._reported.add(target)
        self.report(message)


def _shutdown(fd: int) -> None:
    if _libc.shutdown(fd, socket.SHUT_RDWR) < 0:
        raise OSError(ctypes.get_errno(), "shutdown")


def _read_memory(tid: int, pointer: int, length: int) -> bytes:
    fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, length, pointer)
    finally:
        os.close(fd)


def _links(tid: int) -> set[str]:
    """What the descriptors of thread ``tid``'s process name ("socket:[INODE]"...)."""
    base = f"/proc/{tid}/fd"
    links: set[str] = set()
    try:
        names = os.listdir(base)
    except OSError:
        return links
    for name in names:
        try:
            links.add(os.readlink(f"{base}/{name}"))
        except OSError:
            pass
    return links


def _connect(fd: int, raw: bytes, length: int) -> int:
    """connect(2) on our descriptor with our copy; 0 or -errno for the tool."""
    if _libc.connect(fd, raw, min(length, len(raw))) == 0:
        return 0
    return -ctypes.get_errno()


class Mediation:
    """Everything a run with ``[network] allow`` needs: proxy, gate, environment."""

    def __init__(self, policy: "Policy", report: Optional[Callable[[str], None]] = None,
                 route: Optional[Route] = None) -> None:
        """``route``: the run's credential route, whose connections the gate and the proxy
        admit (:func:`admitted`)."""
        check_support()
        self.events: list[str] = []
        self._report = report
        self._stopped = False
        network = policy.network
        rules = NetRules(network.allow, network.deny, network.hosts)
        ports = tuple((r.low, r.high) for r in network.connect)
        self.proxy = Proxy(rules, self._event, route, ports)
        try:
            self.gate = ConnectGate(ports, rules, self.proxy.address, self._event, route)
        except BaseException:
            self.proxy.stop()
            raise

    def _event(self, message: str) -> None:
        self.events.append(message)
        if self._report is not None:
            self._report(message)

    def command(self, cmd: "Command") -> "Command":
        """``cmd`` with the proxy variables set (they override the caller's). Made as
        ``type(cmd)``: this module sits beside the launcher, not above it."""
        env = dict(cmd.env)
        env.update(self.proxy.environment())
        return type(cmd)(cmd.executable, cmd.argv, tuple(env.items()), cmd.cwd)

    def in_child(self) -> None:
        self.gate.install()

    def start(self) -> None:
        self.gate.start()
        self.proxy.start()

    def stop(self) -> None:
        """Stop both (once: later calls do nothing)."""
        if self._stopped:
            return
        self._stopped = True
        self.gate.stop()
        self.proxy.stop()

    def __enter__(self) -> "Mediation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
