"""Mediated network for one run: the proxy plus a seccomp gate for connect(2).

Only policies with ``[network] allow`` import this module (:func:`sandlock.exec.launcher.run`).

Why a gate as well as the proxy: Landlock's TCP rules name ports, not
addresses, so a Landlock grant of the proxy's port would also reach *any* host
on that port, and a hostile server can listen on every port. Instead the tool
gets no Landlock grant for the proxy at all, and every ``connect(2)`` it makes
stops in a seccomp user notification
(https://docs.kernel.org/userspace-api/seccomp_filter.html#userspace-notification).
For a TCP socket the gate, in the launcher:

1. takes its own reference to the socket with ``pidfd_getfd(2)`` and asks the
   kernel its family and type (immutable properties of the socket);
2. copies the address from the tool's memory once (``/proc/TID/mem``);
3. decides on that copy: the proxy's exact address, a ``connect`` port of the
   policy, or an IP/CIDR ``allow`` rule (deny rules win); anything else EACCES;
4. calls ``connect(2)`` itself on its reference with the same copied bytes and
   answers the tool with the result (including EINPROGRESS for non-blocking
   sockets, since both share one open file description).

The tool's connect never runs in the tool's context, so a thread rewriting the
address or swapping the descriptor after step 2 changes nothing. Sockets that are
not TCP (Unix, UDP when granted) are let through with CONTINUE: that is safe only
because anything that then runs is still under Landlock, whose TCP rules hold
no grant for the proxy; the same backstop covers a tool that stacks its own
notifying filter (the filter below also refuses new listeners with EPERM).
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
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
from ..linux.notify import Listener
from ..linux.syscalls import AUDIT_ARCH, MACHINE, NR
from ..policy.netrules import NetRules, format_target
from .proxy import Proxy

if TYPE_CHECKING:
    from ..exec.spec import Command
    from ..policy.model import Policy


_libc = ctypes.CDLL(None, use_errno=True)
_libc.connect.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


def notify_filter() -> bytes:
    """Classic BPF: connect -> USER_NOTIF; seccomp(NEW_LISTENER) -> EPERM; else ALLOW.

    Foreign architectures fall through to ALLOW here because the main filter,
    loaded first, already kills them. Arguments are read at their low 32 bits
    (little-endian offsets), as the kernel does for ``int`` arguments.
    """
    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld_abs, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    return b"".join([
        op(ld_abs, 4),                                  # 0: A = arch
        op(jeq, AUDIT_ARCH[MACHINE], 0, 6),             # 1: foreign -> 8 (allow)
        op(ld_abs, 0),                                  # 2: A = nr
        op(jeq, NR["connect"], 6, 0),                   # 3: connect -> 10 (notify)
        op(jeq, NR["seccomp"], 0, 4),                   # 4: not seccomp -> 9 (allow)
        op(ld_abs, 24),                                 # 5: A = low half of args[1] (flags)
        op(jset, kernel.SECCOMP_FILTER_FLAG_NEW_LISTENER, 0, 2),  # 6: listener -> 7 (EPERM)
        op(ret, SECCOMP_RET_ERRNO | errno.EPERM),       # 7
        op(ret, SECCOMP_RET_ALLOW),                     # 8
        op(ret, SECCOMP_RET_ALLOW),                     # 9
        op(ret, kernel.SECCOMP_RET_USER_NOTIF),         # 10
    ])


def check_support() -> None:
    """Raise KernelSupportError when the kernel cannot mediate connect(2)."""
    if MACHINE not in AUDIT_ARCH:
        raise KernelSupportError(f"[network] allow is not supported on {MACHINE}")
    if not kernel.seccomp_action_available(kernel.SECCOMP_RET_USER_NOTIF):
        raise KernelSupportError("[network] allow needs seccomp user notification (Linux 5.9+)")


#: Connects to remote hosts under way at once per run (each holds a descriptor and a
#: thread); beyond, the tool's connect fails with EAGAIN and a ``network:`` report.
MAX_CONNECTING = 256


class ConnectGate(Listener):
    """Answers the tool's connect(2) calls; see the module docstring."""

    name = "sandlock-connect"

    def __init__(self, ports: tuple[tuple[int, int], ...], rules: NetRules,
                 proxy: tuple[str, int], report: Callable[[str], None]) -> None:
        super().__init__(notify_filter())
        self.ports = ports
        self.rules = rules
        self.proxy = proxy
        self.report = report
        self._workers: dict[threading.Thread, int] = {}  #: -> the socket it is connecting
        self._lock = threading.Lock()
        self._reported: set[str] = set()

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

    def _notified(self, ident: int, tid: int, nr: int, args: tuple[int, ...]) -> None:
        del nr  # the filter notifies connect(2) only
        try:
            self._handle(ident, tid, args[0] & 0xFFFFFFFF, args[1], args[2] & 0xFFFFFFFF)
        except Exception:  # noqa: BLE001 - a gate bug must deny, never hang the tool
            self._respond(ident, -errno.EACCES)

    def _handle(self, ident: int, tid: int, fdnum: int, pointer: int, length: int) -> None:
        try:
            sock = kernel.take_fd(tid, fdnum)
        except OSError as exc:
            if exc.errno == errno.EPERM:
                self._deny(f"pid {tid}", "sandlock may not take its socket (the process made "
                           "itself non-dumpable, so ptrace access rules forbid pidfd_getfd)",
                           hint=False)
            self._respond(ident, -(exc.errno or errno.EBADF))
            return
        keep = False
        try:
            try:
                family = kernel.socket_option(sock, socket.SO_DOMAIN)
                kind = kernel.socket_option(sock, socket.SO_TYPE)
            except OSError as exc:
                self._respond(ident, -(exc.errno or errno.ENOTSOCK))
                return
            if family not in (socket.AF_INET, socket.AF_INET6) or kind != socket.SOCK_STREAM:
                # Not TCP: Landlock and the main seccomp filter still decide in the tool.
                self._respond(ident, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
                return
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
            if target == self.proxy:
                self._respond(ident, _connect(sock, raw, length))
                return
            worker = threading.Thread(target=self._slow_connect, args=(ident, sock, raw, length),
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

    def _slow_connect(self, ident: int, sock: int, raw: bytes, length: int) -> None:
        """A blocking connect to a remote host must not stall every other connect."""
        try:
            self._respond(ident, _connect(sock, raw, length))
        finally:
            with self._lock:
                self._workers.pop(threading.current_thread(), None)
            os.close(sock)

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


def _connect(fd: int, raw: bytes, length: int) -> int:
    """connect(2) on our descriptor with our copy; 0 or -errno for the tool."""
    if _libc.connect(fd, raw, min(length, len(raw))) == 0:
        return 0
    return -ctypes.get_errno()


class Mediation:
    """Everything a run with ``[network] allow`` needs: proxy, gate, environment."""

    def __init__(self, policy: "Policy", report: Optional[Callable[[str], None]] = None) -> None:
        check_support()
        self.events: list[str] = []
        self._report = report
        self._stopped = False
        network = policy.network
        rules = NetRules(network.allow, network.deny, network.hosts)
        ports = tuple((r.low, r.high) for r in network.connect)
        self.proxy = Proxy(rules, self._event)
        try:
            self.gate = ConnectGate(ports, rules, self.proxy.address, self._event)
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
