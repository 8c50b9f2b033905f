"""Recording what a confined tool touched, and saying which of it the policy refuses.

Used by `sandlock trace` and `sandlock learn` (:mod:`sandlock.cli.trace`), never by a
plain `sandlock run`: that path loads no notifying filter and starts no recorder.

How a run is recorded without weakening it. The child loads, after the policy's
own seccomp filter, a second filter that answers ``SECCOMP_RET_USER_NOTIF`` for the
syscalls Landlock can refuse (open, exec, create, remove, rename, link, truncate,
TCP connect and bind) and for ``socket``. The :class:`Recorder` in the launcher
receives each notification, copies the path or address from the tool's memory
(``/proc/TID/mem``, checked with ``SECCOMP_IOCTL_NOTIF_ID_VALID`` after the copy),
notes it, and always answers ``SECCOMP_USER_NOTIF_FLAG_CONTINUE``: the kernel then
runs the syscall in the tool's context, where Landlock and the policy's seccomp
filter decide as they would without tracing
(https://docs.kernel.org/userspace-api/seccomp_filter.html#userspace-notification).
What was copied is used only to *describe* the call, never to answer it, so a tool
that rewrites its memory after the copy can only make the record wrong, not the
sandbox weaker. A syscall the policy's filter refuses with an errno never reaches a
notifying filter (the errno action takes precedence). So a recorded run's policy filter
leaves out its socket(2) refusals (:func:`sandlock.compile.seccomp.plan` with
``sockets_recorded``), and the recorder answers socket(2) itself, from the same rules
and with the same errno (:func:`sandlock.compile.seccomp.refusal`): its arguments are
integers in the notification, nothing the tool can change after the check. A socket
call the recorder cannot answer (its thread gone) fails with ENOSYS: refused too.

Which recorded accesses were refused is then computed by :class:`Judge` from the
same Landlock rights the ruleset was built from (:func:`sandlock.compile.ruleset.plan`),
on each path as it resolved when the call was made (whether it existed, what it
was): a prediction of Landlock's verdict, not an observation of the errno.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

from ..compile import abi as A
from ..compile.seccomp import Rule, refusal, socket_grant
from ..linux import kernel
from ..linux.kernel import (
    SECCOMP_RET_ALLOW,
    SECCOMP_USER_NOTIF_FLAG_CONTINUE,
)
from ..linux.notify import Listener
from ..linux.syscalls import AUDIT_ARCH, MACHINE, NR
from .emit import Unspellable, policy_path, printable

if TYPE_CHECKING:
    from ..policy.model import Policy

AT_FDCWD = -100
AT_REMOVEDIR = 0x200
AT_EMPTY_PATH = 0x1000
RENAME_EXCHANGE = 2
O_ACCMODE, O_CREAT, O_TRUNC, O_DIRECTORY = 3, 0o100, 0o1000, 0o200000
O_NOFOLLOW, O_PATH = 0o400000, 0o10000000
PATH_MAX = 4096

#: syscall -> argument layout, for every syscall recorded (its number on this machine
#: comes from :mod:`sandlock.linux.syscalls`; aarch64 has only the ``*at`` forms). Layout letters:
#: ``d`` a directory fd, ``p`` a path (relative to the ``d`` before it, else the cwd),
#: ``f`` open flags, ``h`` a pointer to ``struct open_how`` (flags first), ``m`` a mode,
#: ``x`` other flags, ``s`` a socket fd, ``a`` a sockaddr pointer, ``l`` its length,
#: ``F`` socket family, ``T`` socket type, ``_`` ignored.
SYSCALLS: dict[str, str] = {
    "open": "pf", "creat": "p", "openat": "dpf", "openat2": "dph", "execve": "p",
    "execveat": "dp__x", "mkdir": "p", "mkdirat": "dp", "mknod": "pm", "mknodat": "dpm",
    "unlink": "p", "unlinkat": "dpx", "rmdir": "p", "rename": "pp", "renameat": "dpdp",
    "renameat2": "dpdpx", "link": "pp", "linkat": "dpdp", "symlink": "_p", "symlinkat": "_dp",
    "truncate": "p", "connect": "sal", "bind": "sal", "socket": "FT",
}
_BY_NR = {NR[name]: name for name in SYSCALLS if name in NR}


def notify_filter(network_mediated: bool) -> bytes:
    """Classic BPF: every syscall of :data:`SYSCALLS` -> USER_NOTIF, the rest ALLOW.

    ``network_mediated``: the policy has ``[network] allow``, whose own connect gate
    answers connect(2) (:mod:`sandlock.net.connect`); connect is then left to it, so
    that this filter's CONTINUE can never stand in for that gate's decision.
    Foreign architectures fall through to ALLOW: the policy's filter kills them.
    """
    numbers = [nr for nr, name in sorted(_BY_NR.items())
               if not (network_mediated and name == "connect")]

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld_abs, jeq, ret = 0x20, 0x15, 0x06
    count = len(numbers)
    prog = [op(ld_abs, 4), op(jeq, AUDIT_ARCH[MACHINE], 0, count + 1), op(ld_abs, 0)]
    for index, nr in enumerate(numbers):  # match -> the notify return after the allow
        prog.append(op(jeq, nr, count - index, 0))
    prog += [op(ret, SECCOMP_RET_ALLOW), op(ret, kernel.SECCOMP_RET_USER_NOTIF)]
    return b"".join(prog)


def supported() -> Optional[str]:
    """None when this kernel and architecture can record a run, else why not."""
    if MACHINE not in AUDIT_ARCH:
        return f"recording is not supported on {MACHINE}"
    if not kernel.seccomp_action_available(kernel.SECCOMP_RET_USER_NOTIF):
        return "recording needs seccomp user notification (Linux 5.9+)"
    from ..linux.notify import memory_unreadable

    why = memory_unreadable(ancestor=True)  # the recorder is the tool's launcher or supervisor
    return None if why is None else f"recording {why}"


# ----------------------------------------------------------------------------
# What was recorded


@dataclass(frozen=True)
class Target:
    """One path of a call, as it resolved when the call was made."""

    given: str  #: absolute, before links were followed
    real: str  #: links followed (the last one only when the call follows it)
    kind: str  #: "file", "dir", "other" or "" (did not exist)


@dataclass(frozen=True)
class Event:
    """One notified syscall (nothing here decided anything)."""

    syscall: str
    targets: tuple[Target, ...] = ()
    flags: int = 0
    port: int = -1
    family: int = -1
    sock_type: int = -1
    program: str = ""  #: the calling process's executable (learn only)
    refused: int = 0  #: the errno the recorder answered (a socket the policy refuses)


def _kind(path: str, follow: bool) -> str:
    try:
        info = os.stat(path) if follow else os.lstat(path)
    except OSError:
        return ""
    if stat.S_ISDIR(info.st_mode):
        return "dir"
    return "file" if stat.S_ISREG(info.st_mode) else "other"


class Recorder(Listener):
    """Receives the notifications of :func:`notify_filter`, records, always CONTINUEs.

    The launcher calls :meth:`in_child` in the forked child (after the policy's
    filter, before execve), :meth:`start` in the parent right after fork, and
    :meth:`stop` once the tool's tree is gone; :attr:`events` then holds the record.
    """

    name = "sandlock-trace"

    def __init__(self, *, network_mediated: bool = False, programs: bool = False,
                 sockets: Optional[tuple[Rule, ...]] = None) -> None:
        super().__init__(notify_filter(network_mediated))
        self._programs = programs
        #: The policy's socket rules (:func:`sandlock.compile.seccomp.socket_rules`) when its
        #: filter was compiled without them (``sockets_recorded``): this recorder enforces
        #: them. None: the policy's filter does, and socket(2) is CONTINUEd.
        self.sockets = sockets
        self._dirs: dict[str, tuple[str, int]] = {}  #: directories walked (real path, links),
        # cleared on any change
        self.events: list[Event] = []
        self.lost = 0  #: notifications that could not be read (the caller went away)

    def in_child(self) -> None:
        self.install()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the recorder thread
    def _dispatch(self, ident: int, tid: int, nr: int, args: tuple[int, ...]) -> None:
        """socket(2) is refused by the policy's rules first, as the policy's filter would
        before any listener (the connect gate this recorder carries included)."""
        if self.sockets is not None and _BY_NR.get(nr) == "socket":
            if self._socket(ident, tid, args, self.sockets):
                return
        super()._dispatch(ident, tid, nr, args)

    def _notified(self, ident: int, tid: int, nr: int, args: tuple[int, ...]) -> None:
        try:
            event = self._describe(tid, _BY_NR.get(nr, ""), args)
            if event is not None and self._valid(ident):
                self.events.append(event)
            elif event is None:
                self.lost += 1
        except Exception:  # noqa: BLE001 - a recording bug must never stop the tool
            self.lost += 1
        # Always CONTINUE: Landlock and the policy's filter decide in the tool.
        self._respond(ident, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)

    def _socket(self, ident: int, tid: int, args: tuple[int, ...], rules: tuple[Rule, ...]) -> bool:
        """socket(2) in a recorded run: refused exactly as the policy's filter would (the
        same rules, the same errno, decided on the notification's own arguments) and
        recorded; True when answered so. Any failure here refuses (EPERM). A socket the
        rules allow goes on (False): to the connect gate if it claims it, else it is
        recorded and CONTINUEd (:meth:`_notified`)."""
        error = errno.EPERM
        try:
            error = refusal(rules, "socket", args)
            if error:
                program = _readlink(f"/proc/{tid}/exe") if self._programs else ""
                self.events.append(Event("socket", family=args[0] & 0xFFFFFFFF,
                                         sock_type=args[1] & 0xF, program=program, refused=error))
        except Exception:  # noqa: BLE001 - deny by default
            error = error or errno.EPERM
        if error:
            self._respond(ident, -error)
        return bool(error)

    def _describe(self, tid: int, name: str, args: Sequence[int]) -> Optional[Event]:
        if not name:
            return None
        layout = SYSCALLS[name]
        program = _readlink(f"/proc/{tid}/exe") if self._programs else ""
        if name == "socket":
            return Event(name, family=args[0] & 0xFFFFFFFF, sock_type=args[1] & 0xF,
                         program=program)
        if name in ("connect", "bind"):
            return self._address(tid, name, args, program)
        with open(f"/proc/{tid}/mem", "rb", buffering=0) as mem:
            raw: list[tuple[int, str]] = []  # (dirfd, path)
            dirfd, flags = AT_FDCWD, 0
            for index, letter in enumerate(layout):
                value = args[index]
                if letter == "d":
                    dirfd = struct.unpack("=i", struct.pack("=I", value & 0xFFFFFFFF))[0]
                elif letter == "p":
                    raw.append((dirfd, _read_string(mem, value)))
                    dirfd = AT_FDCWD
                elif letter in "fx":
                    flags = value & 0xFFFFFFFF
                elif letter == "h":
                    mem.seek(value)
                    flags = struct.unpack("=Q", (mem.read(8) + bytes(8))[:8])[0]
                elif letter == "m":
                    flags = value & 0xFFFFFFFF
        if name == "creat":
            flags = O_CREAT | O_TRUNC | 1
        targets = []
        for dirfd, path in raw:
            follow = self._follows(name, flags, path)
            target = self._resolve(tid, dirfd, path, follow, name == "execveat" and not path)
            if target is None:  # walked from no directory: the kernel fails the call
                return None
            targets.append(target)
        if name in ("rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir", "symlink",
                    "symlinkat", "unlink", "unlinkat", "link", "linkat"):
            self._dirs.clear()  # a hard link of a symbolic link makes a name a link too
        return Event(name, tuple(targets), flags, program=program)

    @staticmethod
    def _follows(name: str, flags: int, path: str) -> bool:
        if name in ("open", "openat", "openat2", "creat"):
            return not flags & O_NOFOLLOW
        return name in ("execve", "execveat", "truncate")

    def _resolve(self, tid: int, dirfd: int, path: str, follow: bool, empty: bool
                 ) -> Optional[Target]:
        """What ``path`` names for thread ``tid``; None for a relative one whose ``dirfd`` is
        no directory (a pipe, a socket, a file, nothing), which the kernel refuses (ENOTDIR,
        EBADF): joined to the recorder's working directory, it named a
        file the tool never read, and learn granted it."""
        if empty or not path:
            base = f"/proc/{tid}/fd/{dirfd}" if dirfd != AT_FDCWD else f"/proc/{tid}/cwd"
            real = _readlink(base)
            if real.endswith(DELETED):
                return None  # an object with no name: no path was walked
            return Target(real, real, _kind(real, True))
        if path.startswith("/"):
            given = path
        else:
            base = f"/proc/{tid}/cwd" if dirfd == AT_FDCWD else f"/proc/{tid}/fd/{dirfd}"
            walked_from = _readlink(base)
            if not walked_from.startswith("/") or (dirfd != AT_FDCWD and not os.path.isdir(base)):
                return None  # a file as dirfd: ENOTDIR, though its link is a path
            if walked_from.endswith(DELETED):
                return None  # a removed directory holds nothing, and its text is no path
            given = os.path.join(walked_from, path)
        # Never normalised as text: ``link/..`` is the parent of the link's target, as the
        # kernel walks it (normalised, ``d/../../notes.txt`` named a file beside the
        # working directory, and learn granted it instead of the one the tool read); and
        # walked by _walk, which reads /proc/self (and /dev/fd, a link to it) as the tool's.
        parent, leaf = os.path.split(given)
        try:
            if leaf in ("", ".", ".."):
                (real_parent, _, links), leaf = _walk(tid, given), ""
            else:
                real_parent, links = self._dirs.get(parent) or ("", 0)
                if not real_parent:
                    real_parent, through_proc, links = _walk(tid, parent)
                    # not through /proc: a descriptor or working directory there changes
                    # with no call the recorder sees (dup2, chdir), and the memo named the old
                    # one (every call that makes or moves a name clears it)
                    if len(self._dirs) < 4096 and not through_proc:
                        self._dirs[parent] = (real_parent, links)
            real = os.path.join(real_parent, leaf) if leaf else real_parent
            if follow and os.path.islink(real):
                real = _walk(tid, real, links)[0]  # the links of one walk, all told
        except _TooManyLinks:
            return None  # ELOOP: the kernel read nothing
        except _NoPath:
            return None  # a deleted object: its /proc link's text names no path
        except _NotTheTools:
            return None  # EACCES: another process's (the tool's own children's too: the
            # recorder cannot tell which processes share the tool's Landlock domain)
        if real == f"/proc/{os.getpid()}" or real.startswith(f"/proc/{os.getpid()}/"):
            return None  # this process's own: never what the tool reached
        return Target(given, real, _kind(real, follow))

    def _address(self, tid: int, name: str, args: Sequence[int], program: str) -> Optional[Event]:
        length = min(args[2] & 0xFFFFFFFF, 128)
        with open(f"/proc/{tid}/mem", "rb", buffering=0) as mem:
            mem.seek(args[1])
            raw = mem.read(length)
        if len(raw) < 4:
            return Event(name, program=program)
        family = struct.unpack_from("=H", raw)[0]
        if family not in (socket.AF_INET, socket.AF_INET6):
            return Event(name, family=family, program=program)
        sock_type = _socket_type(tid, args[0] & 0xFFFFFFFF)
        return Event(name, port=struct.unpack_from("!H", raw, 2)[0], family=family,
                     sock_type=sock_type, program=program)


#: What the kernel resolves for the process that walks: read as the tool's, never this one's.
_SELF = ("/proc/self", "/proc/thread-self")
_MAX_LINKS = 40  #: the kernel's bound on the links of one walk (ELOOP past it)


class _TooManyLinks(Exception):
    """A walk past :data:`_MAX_LINKS` links: the kernel answers ELOOP and reads nothing."""


#: How the kernel ends the text of a /proc link to a deleted object (d_path): the text
#: is then no path (the tool may have made a link by that very name).
DELETED = " (deleted)"


class _NoPath(Exception):
    """A link under /proc to a deleted object: it names no path to walk."""


class _NotTheTools(Exception):
    """A link under ``/proc/PID`` of a process other than the tool's: what it names is
    that process's (its working directory, its descriptors), which Landlock's ptrace
    scope refuses the tool, and the recorder must never read for it."""


def _process(tid: int) -> int:
    """The process (thread group) of thread ``tid``; 0 if it is gone."""
    try:
        with open(f"/proc/{tid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _walk(tid: int, path: str, links: int = 0) -> tuple[str, bool, int]:
    """``path`` (absolute) with every link followed as the kernel follows it for thread
    ``tid``: :func:`os.path.realpath`, but ``/proc/self`` is the tool's (its process, and
    ``/proc/thread-self`` its thread), wherever it comes
    (a link the tool made to ``/proc/self/cwd``, read by realpath here, named the recorder's
    working directory); and whether the walk went through /proc, whose links change with
    calls the recorder does not see (dup2, chdir); the links followed, ``links`` before it
    included (:class:`_TooManyLinks` past :data:`_MAX_LINKS`: one walk, all told). A link
    under ``/proc/PID`` of another process is never followed (:class:`_NotTheTools`)."""
    done, todo, through_proc = "/", path.split("/")[::-1], False
    foreign = False  # under /proc/PID of a process not the tool's
    known: list[int] = []

    def tools() -> int:  # the tool's process, read once a walk (when it is needed)
        if not known:
            known.append(_process(tid))
        return known[0]

    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            done = os.path.dirname(done)
            foreign = foreign and done.startswith("/proc/")
            continue
        here = os.path.join(done, part)
        if here in _SELF:  # the thread group's, as the kernel reads it for the tool
            process = tools() or tid
            done = f"/proc/{process}" if here == "/proc/self" else f"/proc/{process}/task/{tid}"
            through_proc, foreign = True, False
            continue
        if done == "/proc" and part.isdigit():
            foreign = int(part) != tid and _process(int(part)) != tools()
        through_proc = through_proc or here.startswith("/proc/")
        try:
            target = os.readlink(here)
        except OSError:  # no link, or nothing there: as named
            done = here
            continue
        if foreign:
            raise _NotTheTools(here)
        if here.startswith("/proc/") and target.endswith(DELETED):
            raise _NoPath(here)
        links += 1
        if links > _MAX_LINKS:
            raise _TooManyLinks(here)
        if target.startswith("/"):
            done = "/"
        todo.extend(target.split("/")[::-1])
    return done, through_proc, links


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _read_string(mem: Any, pointer: int) -> str:
    """A NUL-terminated string from the tool's memory, a page at a time (a string
    near the end of a mapping must not fail because the next page is unmapped)."""
    out = b""
    while len(out) < PATH_MAX:
        chunk = 4096 - (pointer + len(out)) % 4096
        mem.seek(pointer + len(out))
        data = mem.read(chunk)
        if not data:
            break
        end = data.find(b"\0")
        if end >= 0:
            return os.fsdecode(out + data[:end])
        out += data
    return os.fsdecode(out[:PATH_MAX])


def _socket_type(tid: int, fdnum: int) -> int:
    """SOCK_STREAM or SOCK_DGRAM of the tool's socket, by the protocol sockfs names for
    it (read through /proc: no descriptor of the tool is taken); -1 if unknown."""
    protocol = kernel.socket_protocol(tid, fdnum)
    if protocol in ("TCP", "TCPv6"):
        return socket.SOCK_STREAM
    return socket.SOCK_DGRAM if protocol in ("UDP", "UDPv6") else -1


# ----------------------------------------------------------------------------
# Interpreters of an executable (ELF PT_INTERP, #!)


#: The most of an executable :func:`interpreters` reads: the ``#!`` line, or the ELF
#: header, its program headers and the PT_INTERP string (offsets beyond are ignored).
READ_LIMIT = 64 * 1024


def _open_regular(path: str) -> int:
    """A read-only descriptor of ``path`` if it is a regular file, else -1.

    The path is the tool's (a ``#!`` line it wrote): a FIFO would block the open (and
    the recorder with it), a device's open can act. So the file's type is checked
    before the open and again on the descriptor, the open never waits (O_NONBLOCK),
    never takes a terminal (O_NOCTTY) and follows no link swapped in meanwhile
    (O_NOFOLLOW on the resolved path)."""
    try:
        real = os.path.realpath(path)
        if not stat.S_ISREG(os.lstat(real).st_mode):
            return -1
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return -1


def is_program(interp: str) -> bool:
    """An interpreter (a ``#!`` line, an ELF loader: the tool's text) the kernel could run:
    an absolute name of a regular file. A directory, a FIFO or a missing file fails the
    exec whatever the policy (no grant is needed, none may be suggested); a relative name
    is resolved from the working directory of the exec, which is not known here."""
    try:
        return interp.startswith("/") and stat.S_ISREG(os.stat(interp).st_mode)
    except (OSError, ValueError):
        return False


def interpreters(path: str, depth: int = 0) -> list[tuple[str, str]]:
    """(interpreter, why) the kernel also opens for exec when ``path`` is executed:
    the ELF loader (PT_INTERP) or the ``#!`` line, recursively (binfmt_script).
    Reads at most :data:`READ_LIMIT` bytes of a regular file (:func:`_open_regular`)."""
    if depth > 4:
        return []
    fd = _open_regular(path)
    if fd < 0:
        return []

    def read(offset: int, size: int) -> bytes:
        if offset < 0 or size <= 0 or offset >= READ_LIMIT:
            return b""
        return os.pread(fd, min(size, READ_LIMIT - offset), offset)

    try:
        head = read(0, 256)
        if head.startswith(b"#!"):
            line = head[2:].split(b"\n", 1)[0].strip()
            if not line:
                return []
            interp = os.fsdecode(line.split()[0])
            why = f"#! interpreter of {path}"
            return [(interp, why), *interpreters(interp, depth + 1)]
        if head[:4] != b"\x7fELF" or len(head) < 64:
            return []
        wide, little = head[4] == 2, head[5] == 1
        end = "<" if little else ">"
        if wide:
            phoff, = struct.unpack_from(end + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
        else:
            phoff, = struct.unpack_from(end + "I", head, 28)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 42)
        for index in range(min(phnum, 64)):
            entry = read(phoff + index * phentsize, phentsize)
            if len(entry) < (56 if wide else 32) or struct.unpack_from(end + "I", entry)[0] != 3:
                continue
            if wide:
                offset, = struct.unpack_from(end + "Q", entry, 8)
                size, = struct.unpack_from(end + "Q", entry, 32)
            else:
                offset, = struct.unpack_from(end + "I", entry, 4)
                size, = struct.unpack_from(end + "I", entry, 16)
            interp = os.fsdecode(read(offset, min(size, PATH_MAX)).rstrip(b"\0"))
            return [(interp, f"ELF interpreter of {path}")] if interp else []
    except (OSError, struct.error):
        pass
    finally:
        os.close(fd)
    return []


# ----------------------------------------------------------------------------
# Which accesses the policy refuses

#: How each right is named to people, and the policy line that grants it.
RIGHT_NAMES = (
    (A.Fs.EXECUTE, "exec"), (A.Fs.WRITE_FILE, "write"), (A.Fs.TRUNCATE, "truncate"),
    (A.Fs.READ_FILE, "read"), (A.Fs.READ_DIR, "read"),
    (A.Fs.MAKE_REG | A.Fs.MAKE_DIR | A.Fs.MAKE_SYM | A.Fs.MAKE_FIFO | A.Fs.MAKE_SOCK
     | A.Fs.MAKE_CHAR | A.Fs.MAKE_BLOCK, "create"),
    (A.Fs.REMOVE_FILE | A.Fs.REMOVE_DIR, "remove"), (A.Fs.REFER, "move"),
)


@dataclass(frozen=True)
class Need:
    """One access a call needed: ``rights`` on ``path`` (a file, or the directory in
    which something is created, removed or moved)."""

    right: str  #: read, write, exec, create, remove, move, truncate, connect, bind
    path: str = ""
    rights: int = 0
    port: int = -1
    detail: str = ""  #: why, when it is not the call's own path (an interpreter)
    program: str = ""


def _name(rights: int) -> str:
    for mask, name in RIGHT_NAMES:
        if rights & mask:
            return name
    return "access"


def _make_right(kind: str) -> int:
    return int(A.Fs.MAKE_DIR if kind == "dir" else A.Fs.MAKE_SYM if kind == "link" else A.Fs.MAKE_REG)


def needs(event: Event, abi: int) -> list[Need]:
    """The Landlock rights ``event`` needed (nothing for a call that failed before
    Landlock looks, such as opening a path that does not exist)."""
    out: list[Need] = []
    prog = event.program
    name, flags, targets = event.syscall, event.flags, event.targets

    def add(rights: int, path: str, detail: str = "") -> None:
        rights &= int(A.fs_handled(abi))
        if rights and path.startswith("/"):
            out.append(Need(_name(rights), path, rights, detail=detail, program=prog))

    def parent(target: Target) -> str:
        return os.path.dirname(target.real) or "/"

    if name in ("open", "openat", "openat2", "creat"):
        target = targets[0]
        if flags & O_PATH:
            return out
        if not target.kind:
            if flags & O_CREAT:
                add(int(A.Fs.MAKE_REG), parent(target))
            return out
        mode = flags & O_ACCMODE
        rights = 0
        if mode in (0, 2):
            rights |= int(A.Fs.READ_DIR if target.kind == "dir" else A.Fs.READ_FILE)
        if mode in (1, 2):
            rights |= int(A.Fs.WRITE_FILE)
        if flags & O_TRUNC and mode:
            rights |= int(A.Fs.TRUNCATE)
        add(rights, target.real)
    elif name in ("execve", "execveat"):
        target = targets[0]
        if target.kind != "file":
            return out
        add(int(A.Fs.EXECUTE | A.Fs.READ_FILE), target.real)
        for interp, why in interpreters(target.real):
            if is_program(interp):
                add(int(A.Fs.EXECUTE | A.Fs.READ_FILE), os.path.realpath(interp), why)
    elif name in ("mkdir", "mkdirat"):
        if not targets[0].kind:
            add(int(A.Fs.MAKE_DIR), parent(targets[0]))
    elif name in ("mknod", "mknodat"):
        if not targets[0].kind:
            fmt = stat.S_IFMT(flags)
            right = {stat.S_IFIFO: A.Fs.MAKE_FIFO, stat.S_IFSOCK: A.Fs.MAKE_SOCK,
                     stat.S_IFCHR: A.Fs.MAKE_CHAR, stat.S_IFBLK: A.Fs.MAKE_BLOCK}.get(fmt, A.Fs.MAKE_REG)
            add(int(right), parent(targets[0]))
    elif name in ("symlink", "symlinkat"):
        if not targets[0].kind:
            add(int(A.Fs.MAKE_SYM), parent(targets[0]))
    elif name in ("unlink", "unlinkat", "rmdir"):
        target = targets[0]
        if target.kind:
            gone = target.kind == "dir" or name == "rmdir" or flags & AT_REMOVEDIR
            add(int(A.Fs.REMOVE_DIR if gone else A.Fs.REMOVE_FILE), parent(target))
    elif name in ("rename", "renameat", "renameat2", "link", "linkat"):
        source, dest = targets[0], targets[-1]
        if not source.kind:
            return out
        linking = name.startswith("link")
        refer = int(A.Fs.REFER) if parent(source) != parent(dest) else 0
        kind = "dir" if source.kind == "dir" else "file"
        if not linking:
            add(int(A.Fs.REMOVE_DIR if kind == "dir" else A.Fs.REMOVE_FILE) | refer, parent(source))
        add(_make_right(kind) | refer, parent(dest))
        if dest.kind and not linking:
            add(int(A.Fs.REMOVE_DIR if dest.kind == "dir" else A.Fs.REMOVE_FILE), parent(dest))
    elif name == "truncate":
        if targets[0].kind:
            add(int(A.Fs.TRUNCATE), targets[0].real)
    elif name in ("connect", "bind") and event.port >= 0:
        if A.net_handled(abi) and event.sock_type in (socket.SOCK_STREAM, -1):
            out.append(Need(name, port=event.port, rights=int(
                A.Net.CONNECT_TCP if name == "connect" else A.Net.BIND_TCP), program=prog))
    return out


@dataclass(frozen=True)
class Denial:
    """An access the policy refuses, with the smallest policy line that grants it."""

    right: str
    path: str = ""
    port: int = -1
    detail: str = ""
    section: str = ""
    grant: str = ""  #: the policy line, as in ``as_dict()`` and ``trace --json``
    warning: str = ""  #: what that grant would expose, when it is dangerous

    @property
    def line(self) -> str:
        """:attr:`grant` under its former name, kept for callers written against it."""
        return self.grant

    def __str__(self) -> str:
        """One line, the tool's names escaped (:func:`sandlock.trace.emit.printable`)."""
        what = self.path if self.port < 0 else f"TCP port {self.port}"
        why = f" ({self.detail})" if self.detail else ""
        caution = f" (WARNING: {self.warning})" if self.warning else ""
        return printable(f"denied {self.right} {what}{why} -> [{self.section}] {self.grant}"
                         f"{caution}")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"right": self.right, "section": self.section, "grant": self.grant}
        if self.path:
            out["path"] = self.path
        if self.port >= 0:
            out["port"] = self.port
        if self.detail:
            out["detail"] = self.detail
        if self.warning:
            out["warning"] = self.warning
        return out


def shown(path: str) -> str:
    """A path as a policy would name it (/proc/1234/... of the tool is /proc/self/...)."""
    parts = path.split("/")
    if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit():
        return "/".join(["", "proc", "self", *parts[3:]])
    return path


#: Relative to the home directory: never granted by learn, never readable in its run.
HOME_SECRETS = (".ssh", ".gnupg", ".aws", ".config/gcloud", ".azure", ".kube", ".docker",
                ".netrc", ".git-credentials", ".password-store", ".local/share/keyrings",
                ".pki", ".config/gh", ".npmrc", ".pypirc", ".cache/sandlock")
SYSTEM_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-",
                  "/etc/sudoers", "/etc/sudoers.d", "/etc/ssl/private")


def secrets(home: str) -> list[str]:
    """Every path learn's recorded run may not read, links resolved; a grant `trace`
    suggests on or around one comes with a WARNING."""
    from ..compile.grants import Unjudgeable, _state_dirs  # sandlock's own cache and key
    from ..errors import SetupError

    out = [os.path.join(home, s) for s in HOME_SECRETS] + list(SYSTEM_SECRETS)
    try:
        out += _state_dirs()
    except Unjudgeable as exc:
        raise SetupError(str(exc)) from None
    from ..compile.reviewdirs import copies  # other runs' copies of their tools' files

    out += [where for where, _ in copies(())]
    try:
        out += [os.path.join("/etc/ssh", n) for n in os.listdir("/etc/ssh") if n.endswith("_key")]
    except OSError:
        pass
    return sorted({os.path.realpath(p) for p in out})


#: What a grant of /proc whole exposes (a tool's own /proc/self entries have a new
#: number every run, so nothing narrower grants them).
PROC_EXPOSES = ("/proc whole: your other processes' command lines, and the environment and "
                "memory maps of those of the same user")
#: Temporary directories every program of the machine shares: a grant there reaches
#: what other programs (and users) keep there, and lets the tool plant files for them.
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")


def _home() -> str:
    return os.path.expanduser("~")


def _granted_path(need: Need) -> str:
    path = shown(need.path)
    return "/proc" if path.startswith("/proc/self") else path  # a new number every run


def grant_line(need: Need) -> tuple[str, str]:
    """(section, line) that grants ``need`` and no more."""
    if need.port >= 0:
        return "network", f"{need.right} += [{need.port}]"
    path = _granted_path(need)
    key = {"read": "read", "exec": "exec"}.get(need.right, "write")
    try:
        return "filesystem", f"{key} += {policy_path(path)}"
    except Unspellable as exc:
        return "filesystem", f"(no policy line: {exc})"


def suggestion(need: Need, policy_files: Sequence[str] = ()) -> tuple[str, str, str]:
    """(section, line, warning): :func:`grant_line`, unless `sandlock run` would refuse
    that grant (the loader's :func:`sandlock.policy.model.write_never_allowed`, the
    grant check of :mod:`sandlock.compile.grants` on what later runs trust): then the
    line says why there is none. ``warning``: what a grant that runs would expose (a
    place of secrets, :func:`secrets`; a shared temporary directory, :data:`SHARED_TMP`)."""
    section, line = grant_line(need)
    if need.port >= 0 or line.startswith("("):
        return section, line, ""
    path = _granted_path(need)
    if line.startswith("write"):
        from ..compile.grants import GrantError, check_rules
        from ..policy.model import write_never_allowed

        if write_never_allowed(os.path.normpath(path)):
            return section, f"(no policy line: write access to {path!r} is never allowed)", ""
        try:
            check_rules([(path, need.rights)], int(A.WRITE_RIGHTS), policy_files)
        except GrantError as exc:
            return section, f"(no policy line: `sandlock run` refuses {line}: {exc.reason})", ""
        except OSError:
            pass  # gone since: the line stands, `run` says more if it is granted
        if os.path.realpath(path) in SHARED_TMP:
            return section, line, (f"{path} is shared with every other program: the tool could "
                                   "read or replace their files there; grant a private directory "
                                   "instead (the tmpdir profile's ${private_tmp})")
        return section, line, ""
    if path == "/proc":
        return section, line, PROC_EXPOSES
    real = os.path.realpath(path)
    inside = [s for s in secrets(_home()) if real == s or real.startswith(s.rstrip("/") + "/")
              or s.startswith(real.rstrip("/") + "/")]
    if inside:
        return section, line, (f"exposes {inside[0]}, a place of secrets (keys, credentials): "
                               "grant it only if the tool must read it")
    if need.rights & int(A.Fs.READ_DIR) and os.path.isdir(real):
        return section, line, (f"lets the tool read every file below {path}, where it only "
                               "listed the directory (a listing is granted with all it holds): "
                               "grant it only if that is meant")
    return section, line, ""


#: The largest batch of :meth:`Judge.batches` (its reader takes at most 64 KiB at once).
BATCH_LIMIT = 60000


@dataclass
class Judge:
    """Landlock's verdict on a recorded access, from the rights the ruleset holds."""

    abi: int
    rules: list[tuple[str, int, bool]] = field(default_factory=list)  #: (real path, rights, dir)
    ports: dict[int, int] = field(default_factory=dict)
    #: The policy's own files: what `run` refuses a write grant on (compile/grants.py).
    policy_files: tuple[str, ...] = ()

    @classmethod
    def for_policy(cls, policy: "Policy", abi: int) -> "Judge":
        from ..compile import ruleset

        plan = ruleset.plan(policy, abi)
        rules = [(os.path.realpath(path), rights, os.path.isdir(path)) for path, rights in plan.paths]
        return cls(abi, rules, dict(plan.ports), tuple(ruleset.policy_files(policy)))

    def granted(self, path: str) -> int:
        total = 0
        for rule, rights, is_dir in self.rules:
            if path == rule:
                total |= rights if is_dir else rights & int(A.FILE_ONLY)
            elif is_dir and (rule == "/" or path.startswith(rule + "/")):
                total |= rights
        return total

    def refused(self, need: Need) -> bool:
        if need.port >= 0:
            return not self.ports.get(need.port, 0) & need.rights
        return bool(need.rights & ~self.granted(need.path))

    def batches(self, events: Iterable[Event]) -> Iterator[str]:
        """:meth:`denials` as JSON lists of their :meth:`Denial.as_dict`, each at most
        :data:`BATCH_LIMIT` bytes unless one denial alone is longer (a path is at most
        4 KiB): the messages a supervisor sends its caller."""
        import json

        batch: list[str] = []
        size = 0
        for denial in self.denials(events):
            item = json.dumps(denial.as_dict())
            if batch and size + len(item) > BATCH_LIMIT:
                yield "[" + ",".join(batch) + "]"
                batch, size = [], 0
            batch.append(item)
            size += len(item) + 1
        if batch:
            yield "[" + ",".join(batch) + "]"

    def denials(self, events: Iterable[Event]) -> list[Denial]:
        out: dict[tuple[str, str, int], Denial] = {}
        for event in events:
            if event.syscall == "socket" and event.refused:
                denial = socket_denial(event)
                out.setdefault((denial.right, denial.path, -1), denial)
                continue
            for need in needs(event, self.abi):
                if not self.refused(need):
                    continue
                key = (need.right, need.path, need.port)
                if key not in out:
                    section, line, warning = suggestion(need, self.policy_files)
                    out[key] = Denial(need.right, shown(need.path), need.port, need.detail,
                                      section, line, warning)
        return list(out.values())


def _constant(prefix: str, value: int) -> str:
    for member in (socket.AddressFamily if prefix == "AF_" else socket.SocketKind):
        if member.value == value and member.name.startswith(prefix):
            return member.name
    return f"{prefix}{value}"


def socket_denial(event: Event) -> Denial:
    """A socket(2) the recorder refused for the policy, with the ``[network]`` line that
    grants it (:func:`sandlock.compile.seccomp.socket_grant`, the table the filter uses)."""
    what = f"{_constant('AF_', event.family)} {_constant('SOCK_', event.sock_type)} socket"
    grant = socket_grant(event.family, event.sock_type)
    return Denial("socket", what, section="network",
                  grant=grant or "(no policy line: sandlock allows no such socket)")


# ----------------------------------------------------------------------------
# After the execve of a plain `sandlock run` failed with EACCES


def exec_refusals_under(ruleset_fd: int, executable: str, cwd: Optional[str] = None) -> str:
    """:func:`exec_refusals` asked in a child confined by the run's ruleset (the
    launcher's own process is not confined); "" when the ruleset is gone or the probe
    cannot run."""
    if ruleset_fd < 0:
        return ""
    try:
        chain = [(executable, "the command"), *interpreters(os.path.join(cwd or "", executable))]
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
    except OSError:
        return ""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the probe child
        try:
            os.close(read_end)
            if cwd is not None:
                os.chdir(cwd)
            kernel.no_new_privs()
            kernel.restrict_self(ruleset_fd)
            os.write(write_end, exec_refusals(chain).encode(errors="replace")[:60000])
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = b""
        while chunk := os.read(read_end, 65536):
            data += chunk
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return data.decode(errors="replace")


def link_chain(path: str) -> list[str]:
    """``path``, then each file its symbolic links lead to, the last one the file itself
    (what Landlock checks: a grant on a link grants nothing on its target). A directory
    link on the way (``/lib64`` -> ``usr/lib64``) adds its resolved path at the end."""
    hops = [os.path.abspath(path)]
    for _ in range(40):  # the kernel's limit of links followed (MAXSYMLINKS)
        try:
            target = os.readlink(hops[-1])
        except OSError:
            break
        hops.append(os.path.normpath(os.path.join(os.path.dirname(hops[-1]), target)))
    real = os.path.realpath(hops[-1])
    if real != hops[-1]:
        hops.append(real)
    return hops


def _exec_refusal(path: str, why: str, grant: str) -> str:
    """One refused file of an exec chain, escaped: a ``#!`` line is the tool's text. A
    path through links names the file they lead to, whose grant is missing, and the chain."""
    hops = link_chain(path)
    line = grant_line(Need("exec", hops[-1], int(A.Fs.EXECUTE | A.Fs.READ_FILE)))[1]
    if len(hops) > 1:
        why = f"{why}, reached through {' -> '.join(hops[:-1])}"
    return printable(f"{hops[-1]} ({why}) has no {grant} grant: [filesystem] {line}")


def exec_refusals(chain: Sequence[tuple[str, str]]) -> str:
    """Which file of an exec ``chain`` (the command, then its interpreters) this (confined)
    process may not read or execute, asked of Landlock itself: each file is opened for reading, then passed to
    an execve that fails with E2BIG *after* the kernel opened it for exec (the argument
    count is checked once the file is open, before anything is loaded), so an EACCES
    is the policy's answer for that file alone. Runs only on the failure path."""
    import resource

    found = []
    try:  # the argument-space limit is max(128 KiB, stack limit / 4): 40000 pointers exceed it
        resource.setrlimit(resource.RLIMIT_STACK, (65536, resource.getrlimit(resource.RLIMIT_STACK)[1]))
        many: Optional[list[bytes]] = [b"-"] * 40000
    except (OSError, ValueError):
        many = None  # never probe exec without a guaranteed E2BIG
    for index, (path, why) in enumerate(chain):
        if index and not is_program(path):  # an interpreter no grant can make runnable
            found.append(printable(f"{path} ({why}) is not a program (not the absolute name "
                                   "of a regular file): no grant makes it runnable"))
            break
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            if exc.errno == errno.EACCES:
                found.append(_exec_refusal(path, why, "read or exec"))
                continue
        if many is None:
            continue
        try:
            os.execve(path, many, {})
        except OSError as exc:
            if exc.errno == errno.EACCES:
                found.append(_exec_refusal(path, why, "exec"))
    return "; ".join(found)
