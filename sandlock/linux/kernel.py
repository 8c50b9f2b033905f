"""The few raw syscalls sandlock makes, through ctypes.

Landlock (https://docs.kernel.org/userspace-api/landlock.html) has no libc
wrapper, and the PyPI ``landlock`` binding knows only filesystem rights up to
ABI 5 (no TCP rules, no scopes), so sandlock calls the three syscalls itself.
The seccomp filter is compiled by libseccomp (:mod:`sandlock.compile.seccomp`) but
loaded here with ``seccomp(2)`` so that the child after fork does not need
libseccomp at all.
"""

from __future__ import annotations

import ctypes
import errno
import os

from .syscalls import MACHINE, NR

TYPE_CHECKING = False  # typing and platform cost milliseconds on every `sandlock run`
if TYPE_CHECKING:
    from typing import Optional

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc.prctl
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

# prctl(2) options, from linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
PR_GET_SECCOMP = 21
PR_SET_NAME = 15  # https://man7.org/linux/man-pages/man2/pr_set_name.2const.html
# seccomp(2), from linux/seccomp.h
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_GET_ACTION_AVAIL = 2
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# Seccomp user notification, for the supervisors that answer notified syscalls
# (sandlock.net.connect, sandlock.trace.record):
# https://docs.kernel.org/userspace-api/seccomp_filter.html#userspace-notification
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
#: SECCOMP_IOCTL_NOTIF_RECV, _SEND and _ID_VALID (_IOWR/_IOWR/_IOW on '!' 0, 1, 2).
NOTIF_RECV, NOTIF_SEND, NOTIF_ID_VALID = 0xC0502100, 0xC0182101, 0x40082102
#: sizeof(struct seccomp_notif); struct seccomp_notif_resp as packed by struct.
NOTIF_SIZE, RESP_FORMAT = 80, "=QqiI"
# landlock(7), from linux/landlock.h
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_RULE_NET_PORT = 2
# close_range(2)
CLOSE_RANGE_CLOEXEC = 1 << 2


class RulesetAttr(ctypes.Structure):
    """``struct landlock_ruleset_attr``."""

    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    """``struct landlock_path_beneath_attr`` (packed)."""

    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class NetPortAttr(ctypes.Structure):
    """``struct landlock_net_port_attr``."""

    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


class SockFilter(ctypes.Structure):
    """``struct sock_filter`` (one classic BPF instruction, 8 bytes)."""

    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    """``struct sock_fprog``."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def landlock_abi() -> int:
    """The running kernel's Landlock ABI version, 0 when Landlock is unavailable."""
    if "landlock_create_ruleset" not in NR:
        return 0
    version = _syscall(NR["landlock_create_ruleset"], None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(0, int(version))


def landlock_errno() -> int:
    """Why :func:`landlock_abi` returned 0 (EOPNOTSUPP: disabled at boot; ENOSYS: not built)."""
    return ctypes.get_errno()


def create_ruleset(fs: int, net: int, scoped: int) -> int:
    """Create a ruleset fd (close-on-exec).

    The whole struct is passed whatever the ABI: the kernel copies it with
    copy_struct_from_user, so a kernel older than a field accepts it as long as that
    field is 0, and refuses it (E2BIG) otherwise; a right the ABI lacks can never be
    dropped silently here. Which fields may be non-zero for an ABI is
    :mod:`sandlock.compile.abi`'s business.
    """
    attr = RulesetAttr(fs, net, scoped)
    return _check(_syscall(NR["landlock_create_ruleset"], ctypes.byref(attr),
                           ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0)),
                  "landlock_create_ruleset")


def add_path_rule(ruleset: int, path_fd: int, access: int) -> None:
    attr = PathBeneathAttr(access, path_fd)
    _check(_syscall(NR["landlock_add_rule"], ruleset, LANDLOCK_RULE_PATH_BENEATH,
                    ctypes.byref(attr), ctypes.c_uint32(0)), "landlock_add_rule(path)")


def add_port_rule(ruleset: int, port: int, access: int) -> None:
    attr = NetPortAttr(access, port)
    _check(_syscall(NR["landlock_add_rule"], ruleset, LANDLOCK_RULE_NET_PORT,
                    ctypes.byref(attr), ctypes.c_uint32(0)), "landlock_add_rule(port)")


def restrict_self(ruleset: int) -> None:
    _check(_syscall(NR["landlock_restrict_self"], ruleset, ctypes.c_uint32(0)),
           "landlock_restrict_self")


def no_new_privs() -> None:
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def set_pdeathsig(signal_number: int) -> None:
    _check(_prctl(PR_SET_PDEATHSIG, signal_number, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def set_name(name: bytes) -> None:
    """The thread's name (``/proc/PID/comm``, what ps shows), truncated to 15 bytes."""
    buffer = ctypes.create_string_buffer(name[:15])
    address = ctypes.cast(buffer, ctypes.c_void_p).value or 0
    _check(_prctl(PR_SET_NAME, address, 0, 0, 0), "prctl(PR_SET_NAME)")


def set_child_subreaper(on: bool = True) -> bool:
    """Make this process a child subreaper (or no longer one); returns whether it was one.

    A library caller must be given back the setting it had: a subreaper adopts every
    orphan below it, and a caller that never waits for them keeps them as zombies, which
    count against its user's process limit."""
    was = ctypes.c_int(0)
    _check(_prctl(PR_GET_CHILD_SUBREAPER, ctypes.addressof(was), 0, 0, 0),
           "prctl(PR_GET_CHILD_SUBREAPER)")
    _check(_prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    return bool(was.value)


def make_fprog(bpf: bytes) -> tuple[SockFprog, object]:
    """A ``sock_fprog`` over ``bpf``; keep the second value alive as long as the first."""
    count = len(bpf) // 8
    array = (SockFilter * count).from_buffer_copy(bpf)
    return SockFprog(count, ctypes.cast(array, ctypes.POINTER(SockFilter))), array


def load_seccomp(prog: SockFprog) -> None:
    _check(_syscall(NR["seccomp"], SECCOMP_SET_MODE_FILTER, 0, ctypes.byref(prog)),
           "seccomp(SECCOMP_SET_MODE_FILTER)")


#: linux/seccomp.h
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV = 1 << 5  # Linux 5.19: no EINTR once received


def install_listener(prog: SockFprog, sock: int) -> None:
    """Load a filter that notifies a supervisor (SECCOMP_RET_USER_NOTIF) and send its
    listener fd over the unix socket ``sock``; this process keeps no copy of it
    (https://docs.kernel.org/userspace-api/seccomp_filter.html#userspace-notification)."""
    import socket

    flags = SECCOMP_FILTER_FLAG_NEW_LISTENER | SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV
    fd = _syscall(NR["seccomp"], SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(prog))
    if fd < 0 and ctypes.get_errno() == errno.EINVAL:  # kernel without WAIT_KILLABLE_RECV
        fd = _syscall(NR["seccomp"], SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER,
                      ctypes.byref(prog))
    _check(fd, "seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")
    try:
        socket.send_fds(socket.socket(fileno=os.dup(sock)), [b"L"], [fd])
    finally:
        os.close(fd)  # the tool must never hold its own listener


def seccomp_action_available(action: int) -> bool:
    value = ctypes.c_uint32(action)
    return bool(_syscall(NR["seccomp"], SECCOMP_GET_ACTION_AVAIL, 0, ctypes.byref(value)) == 0)


#: SECCOMP_IOCTL_NOTIF_ADDFD (_IOW('!', 3, struct seccomp_notif_addfd), Linux 5.9) and
#: its flag SECCOMP_ADDFD_FLAG_SEND (Linux 5.14): install a descriptor of the supervisor
#: in the notified process and answer the call with its number, in one step
#: (https://docs.kernel.org/userspace-api/seccomp_filter.html#userspace-notification).
NOTIF_ADDFD = 0x40182103
SECCOMP_ADDFD_FLAG_SEND = 1 << 1
#: struct seccomp_notif_addfd: id, flags, srcfd, newfd, newfd_flags.
ADDFD_FORMAT = "=QIIII"
#: The first kernel with everything a host-allowlist gate uses (ADDFD with SEND).
ADDFD_SEND_KERNEL = "5.14"


def notif_addfd_send(listener: int, ident: int, srcfd: int, cloexec: bool) -> int:
    """Install our ``srcfd`` in the process of notification ``ident`` and answer its call
    with the new descriptor's number (returned here); the same open file, so both sides
    share one socket. OSError (ENOENT) if the call is gone."""
    import fcntl
    import struct

    flags = os.O_CLOEXEC if cloexec else 0
    request = struct.pack(ADDFD_FORMAT, ident, SECCOMP_ADDFD_FLAG_SEND, srcfd, 0, flags)
    return int(fcntl.ioctl(listener, NOTIF_ADDFD, request))


def _probe_addfd(result: list[int]) -> None:
    """In a thread of its own (a filter binds only the thread that loads it, and this
    thread then ends): load an allow-all filter with a listener, ask that listener to
    ADDFD+SEND for a notification that cannot exist. A kernel that knows the flag looks
    the notification up (ENOENT); one that does not refuses the flag (EINVAL)."""
    import fcntl
    import struct

    allow = (SockFilter * 1)(SockFilter(0x06, 0, 0, 0x7FFF0000))
    prog = SockFprog(1, ctypes.cast(allow, ctypes.POINTER(SockFilter)))
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0:  # this thread only; it ends next
        result.append(ctypes.get_errno())
        return
    listener = _syscall(NR["seccomp"], SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER,
                        ctypes.byref(prog))
    if listener < 0:
        result.append(ctypes.get_errno())
        return
    try:
        request = struct.pack(ADDFD_FORMAT, 0, SECCOMP_ADDFD_FLAG_SEND, listener, 0, 0)
        fcntl.ioctl(listener, NOTIF_ADDFD, request)
        result.append(0)
    except OSError as exc:
        result.append(exc.errno or errno.EINVAL)
    finally:
        os.close(listener)


_addfd_verdict: list[Optional[str]] = []


def addfd_send_unsupported() -> Optional[str]:
    """None when this kernel has SECCOMP_IOCTL_NOTIF_ADDFD with SECCOMP_ADDFD_FLAG_SEND
    (Linux 5.14), else why not; probed once per process."""
    if _addfd_verdict:
        return _addfd_verdict[0]
    import threading

    result: list[int] = []
    if "seccomp" in NR:
        thread = threading.Thread(target=_probe_addfd, args=(result,), name="sandlock-probe")
        thread.start()
        thread.join()
    code = result[0] if result else errno.ENOSYS
    verdict = None if code == errno.ENOENT else (
        f"seccomp's SECCOMP_IOCTL_NOTIF_ADDFD with SECCOMP_ADDFD_FLAG_SEND (Linux "
        f"{ADDFD_SEND_KERNEL}+) is not available here ({os.strerror(code)})")
    _addfd_verdict.append(verdict)
    return verdict


def fd_inode(tid: int, target: int) -> tuple[int, int, int]:
    """(st_mode, st_dev, st_ino) of what descriptor ``target`` of thread ``tid`` refers to
    (the object, through /proc: a socket's inode number is its identity while it lives)."""
    info = os.stat(f"/proc/{tid}/fd/{target}")
    return info.st_mode, info.st_dev, info.st_ino


def socket_protocol(tid: int, target: int) -> str:
    """The protocol name of the socket at descriptor ``target`` of thread ``tid`` ("TCP",
    "TCPv6", "UDP", "UNIX-STREAM"...: sockfs's ``system.sockprotoname`` attribute, read
    through /proc without taking the descriptor); "" if it is not a socket or is gone."""
    try:
        name = os.getxattr(f"/proc/{tid}/fd/{target}", "system.sockprotoname")
    except OSError:
        return ""
    return name.rstrip(b"\0").decode("ascii", "replace")


def pidfd_send_signal(pidfd: int, signum: int, info: Optional[bytes] = None) -> int:
    """pidfd_send_signal(2) (Linux 5.1) with an optional ``siginfo_t`` copy; 0 or -errno
    (https://man7.org/linux/man-pages/man2/pidfd_send_signal.2.html)."""
    buf = None if info is None else ctypes.create_string_buffer(info, 128)
    if _syscall(NR["pidfd_send_signal"], pidfd, signum, buf, 0) == 0:
        return 0
    return -ctypes.get_errno()


def cloexec_from(low: int) -> None:
    """Mark every descriptor >= ``low`` close-on-exec (one syscall, Linux 5.11+).

    Landlock needs 5.13, so close_range is always there; a failure is an error
    (closing instead would also close the error pipe and the ruleset fd, which the
    child still needs, and an inherited descriptor must never survive silently).
    """
    _check(_syscall(NR["close_range"], ctypes.c_uint(low), ctypes.c_uint(0xFFFFFFFF),
                    ctypes.c_uint(CLOSE_RANGE_CLOEXEC)), "close_range(CLOSE_RANGE_CLOEXEC)")


def seccomp_supported() -> Optional[str]:
    """None if seccomp filters can be installed, else why not."""
    if "seccomp" not in NR:
        return f"architecture {MACHINE} is not supported"
    if _prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0:
        return f"prctl(PR_GET_SECCOMP): {os.strerror(ctypes.get_errno())}"
    return None


# capabilities(7): the tool of a root caller keeps none of root's capabilities.
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


# Looked up once, here: a lookup in a freshly forked child (dlsym, a new function
# object) costs ~0.2 ms of its time before exec.
_capget, _capset = _libc.capget, _libc.capset
#: capset's arguments for "no capability at all" (the kernel only reads them), built
#: once for the same reason.
_NO_CAPABILITIES = (ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)),
                    ctypes.byref((_CapData * 2)()))


def has_capabilities() -> bool:
    """Whether this process holds any capability (permitted, effective or inheritable;
    ambient ones are also permitted). Root normally does; so does a process whose
    effective uid is no longer 0 but whose real or saved one is (it keeps its
    permitted set), or one started from a file-capability binary."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_capget(ctypes.byref(header), ctypes.byref(data)), "capget")
    return any(d.effective or d.permitted or d.inheritable for d in data)


def drop_capabilities() -> None:
    """Empty the effective, permitted, inheritable and ambient sets.

    Only a process with capabilities (root, or a file-capability binary) has
    anything to drop. The bounding set is left alone on purpose: under
    no_new_privs (set next), execve intersects the new permitted set with the old
    one, which is empty, even for uid 0 and even for file capabilities
    (cap_bprm_creds_from_file; https://docs.kernel.org/userspace-api/no_new_privs.html),
    so nothing can be regained, and one capset costs ~40 fewer syscalls after fork.
    """
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _check(_capset(*_NO_CAPABILITIES), "capset")



# keyrings(7): the key that authenticates sandlock's cache lives in the caller's user
# keyring, which no tool can reach: keyctl, add_key and request_key are refused to
# every tool by the seccomp filter, unconditionally (sandlock.compile.seccomp).
KEY_SPEC_USER_KEYRING = -4
KEYCTL_SEARCH = 10
KEYCTL_READ = 11


def user_keyring_secret(description: bytes, size: int = 32) -> Optional[bytes]:
    """The ``size``-byte secret named ``description`` in the user keyring, made from
    os.urandom on first use; None where keyrings are unavailable (a container's
    seccomp profile, an architecture without the numbers here) or it cannot be read.
    Two processes making it at once may each add one: the later replaces the earlier,
    and what the earlier stored with its copy simply stops verifying."""
    if "keyctl" not in NR:
        return None
    keyctl, user = NR["keyctl"], ctypes.c_long(KEY_SPEC_USER_KEYRING)
    key_id = _syscall(keyctl, KEYCTL_SEARCH, user, b"user", description, 0)
    if key_id < 0:
        if ctypes.get_errno() not in (errno.ENOKEY, errno.EKEYEXPIRED, errno.EKEYREVOKED):
            return None
        secret = os.urandom(size)
        key_id = _syscall(NR["add_key"], b"user", description, secret, ctypes.c_size_t(size), user)
        if key_id < 0:
            return None
    buffer = ctypes.create_string_buffer(size)
    got = _syscall(keyctl, KEYCTL_READ, ctypes.c_long(key_id), buffer, ctypes.c_size_t(size))
    if got != size:
        return None
    return buffer.raw
