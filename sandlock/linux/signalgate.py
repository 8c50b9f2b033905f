"""The signal gate: the substitute for Landlock's signal scope (ABI 6) on ABI 1-5.

Landlock's ``LANDLOCK_SCOPE_SIGNAL`` lets a confined process signal only processes of
its own domain. Before ABI 6 the gate holds the same line by session instead: the
tool's first process leads a new session S (the ``session`` step of
:mod:`sandlock.exec.spec`) and setsid(2) is refused inside the tool (the policy's
filter, :mod:`sandlock.compile.seccomp`), so every process of the tool is in S and no
process outside can ever join it (setpgid(2) moves a process only within its own
session). The number S cannot be reused while any member lives. The gate learns S from
each caller (a process that carries the notifying filter is in S), so it needs no word
from the executor, whichever process forked the tool.

The filter (:func:`prefix`) sends the signal-sending calls to the supervisor, which
answers from what it reads of the kernel, never of the tool's memory:

- ``kill(0, sig)`` (the caller's own process group, inside S) and ``fcntl(F_SETOWN, 0)``
  are allowed in BPF; ``kill(-1)``, ``F_SETOWN_EX`` and the FIOSETOWN/SIOCSPGRP ioctls are
  refused by the policy's filter (EPERM);
- a call aimed at the caller's own thread group (``kill``/``rt_sigqueueinfo`` of its own
  pid, ``tgkill``/``rt_tgsigqueueinfo`` with its own tgid, ``tkill`` of one of its
  threads, ``F_SETOWN`` to itself) is CONTINUEd: the decision rests on registers, which
  cannot change, and the caller's own pid cannot be reused while it waits;
- ``kill(pid)``, ``rt_sigqueueinfo(pid)`` and ``pidfd_send_signal``: the gate opens a
  pidfd of the target (which pins that process), reads its session from
  ``/proc/PID/stat``, confirms through the pidfd's fdinfo that the same process was still
  there after the read, and if its session is S sends the signal itself through that
  pidfd (no race between check and delivery); the tool gets the result;
- ``kill(-pgid)``: each member of the group is checked and signalled so (a process
  group lies within one session);
- anything else (another process's thread, an owner other than the caller): EPERM.

Cost: one notification round trip per call that is not decided in BPF (``raise()``
included); nothing at ABI 6+, where the gate is not installed. Kernel: seccomp user
notification (5.0; 5.5 for CONTINUE), pidfd_open (5.3), pidfd_send_signal (5.1), the
pidfd ``Pid:`` fdinfo line (5.3): all older than Landlock itself (5.13).
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Optional

from . import kernel
from .kernel import SECCOMP_RET_ALLOW, SECCOMP_RET_USER_NOTIF, SECCOMP_USER_NOTIF_FLAG_CONTINUE
from .notify import Listener
from .syscalls import AUDIT_ARCH, MACHINE, NR

#: The calls the gate answers (the policy's filter refuses the other routes: kill(-1),
#: F_SETOWN_EX, ioctl FIOSETOWN/SIOCSPGRP, setsid).
SYSCALLS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
            "pidfd_send_signal", "fcntl")
NUMBERS: dict[int, str] = {NR[name]: name for name in SYSCALLS if name in NR}
F_SETOWN = 8  #: fcntl(2), asm-generic/fcntl.h
SIGINFO_SIZE = 128  #: sizeof(siginfo_t)
CONTINUE = (0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)


def supported() -> Optional[str]:
    """None when this kernel and architecture can run the gate, else why not."""
    if MACHINE not in AUDIT_ARCH or not all(name in NR for name in SYSCALLS):
        return f"the signal gate is not supported on {MACHINE}"
    if not kernel.seccomp_action_available(kernel.SECCOMP_RET_USER_NOTIF):
        return "seccomp user notification is unavailable"
    return None


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def prefix() -> bytes:
    """Classic BPF placed before another notifying program (or :func:`program`): the
    gate's calls return ALLOW or USER_NOTIF here; every other call, and a foreign
    architecture (the policy's filter kills those), falls through to the instruction
    after the prefix. Arguments are read at their low 32 bits (little-endian offsets):
    pids and fcntl commands are ``int``."""
    ld_abs, jeq, ja, ret = 0x20, 0x15, 0x05, 0x06
    nr_of = [NR[name] for name in SYSCALLS]
    # Layout: 0 arch, 1 native?, 2 nr, 3.. one jeq per call, ja end, KILL (2), FCNTL (4),
    # ALLOW, NOTIFY, end.
    count = len(nr_of)
    kill_at = 3 + count + 1
    fcntl_at = kill_at + 2
    allow_at = fcntl_at + 4
    notify_at = allow_at + 1
    end = notify_at + 1
    prog = [_op(ld_abs, 4), _op(jeq, AUDIT_ARCH[MACHINE], 0, end - 2), _op(ld_abs, 0)]
    for index, name in enumerate(SYSCALLS):
        here = 3 + index
        target = kill_at if name == "kill" else fcntl_at if name == "fcntl" else notify_at
        prog.append(_op(jeq, NR[name], target - here - 1, 0))
    prog.append(_op(ja, end - (3 + count) - 1))
    prog += [_op(ld_abs, 16),                                   # KILL: A = pid
             _op(jeq, 0, allow_at - kill_at - 2, notify_at - kill_at - 2)]
    prog += [_op(ld_abs, 24),                                   # FCNTL: A = cmd
             _op(jeq, F_SETOWN, 0, end - fcntl_at - 2),          # other commands: fall through
             _op(ld_abs, 32),                                   # A = owner
             _op(jeq, 0, allow_at - fcntl_at - 4, notify_at - fcntl_at - 4)]
    prog += [_op(ret, SECCOMP_RET_ALLOW), _op(ret, SECCOMP_RET_USER_NOTIF)]
    assert len(prog) == end
    return b"".join(prog)


def program() -> bytes:
    """The gate alone: :func:`prefix`, then ALLOW."""
    return prefix() + _op(0x06, SECCOMP_RET_ALLOW)


def _s32(value: int) -> int:
    return ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def _stat(pid: int) -> tuple[int, int]:
    """(process group, session) of ``pid`` from /proc/PID/stat (after the comm field,
    which may hold anything: split after its last ')')."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return int(fields[2]), int(fields[3])


def _fdinfo_pid(path: str) -> Optional[int]:
    """The ``Pid:`` of a pidfd's fdinfo (-1 once the process is reaped), or None."""
    with open(path, "rb") as handle:
        for line in handle:
            if line.startswith(b"Pid:"):
                return int(line.split()[1])
    return None


def _tgid(tid: int) -> int:
    with open(f"/proc/{tid}/status", "rb") as handle:
        for line in handle:
            if line.startswith(b"Tgid:"):
                return int(line.split()[1])
    raise OSError(errno.ESRCH, "no Tgid")


def _read_memory(tid: int, pointer: int, length: int) -> bytes:
    fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, length, pointer)
    finally:
        os.close(fd)
    if len(data) != length:
        raise OSError(errno.EFAULT, "short read")
    return data


class Signals:
    """Answers the gate's notifications for a tool. Its session is the caller's own:
    only the tool's processes carry the filter that notifies, each took it in session S
    (the ``session`` step comes first) and none may leave S (setsid is refused), so a
    notifying caller is always in S; it is read while the caller waits in the call and
    checked valid after."""

    def __init__(self) -> None:
        self.prefix = prefix()
        self.numbers = NUMBERS

    def notified(self, listener: Listener, ident: int, tid: int, nr: int,
                 args: tuple[int, ...]) -> None:
        try:
            answer = self._decide(listener, ident, tid, NUMBERS[nr], args)
        except Exception:  # noqa: BLE001 - a gate bug must refuse, never hang the tool
            answer = (-errno.EPERM, 0)
        if answer is not None:
            listener._respond(ident, *answer)

    def _decide(self, listener: Listener, ident: int, tid: int, name: str,
                args: tuple[int, ...]) -> Optional[tuple[int, int]]:
        """(error, flags) for the tool, or None when the call is gone."""
        caller = _tgid(tid)
        session = _stat(caller)[1]
        info = None
        if name in ("rt_sigqueueinfo", "pidfd_send_signal") and args[2]:
            info = _read_memory(tid, args[2], SIGINFO_SIZE)  # our copy, sent as is
        target = 0
        if name == "pidfd_send_signal":
            if args[3] & 0xFFFFFFFF:
                return -errno.EINVAL, 0  # PIDFD_SIGNAL_* (6.9) could reach a whole group
            found = _fdinfo_pid(f"/proc/{tid}/fdinfo/{args[0] & 0xFFFFFFFF}")
            if found is None:
                return -errno.EBADF, 0
            target = found
        if not listener._valid(ident):
            return None  # what was read may belong to another process now
        first, sig = _s32(args[0]), _s32(args[1])
        if name == "fcntl":  # F_SETOWN with an owner other than 0 (the filter's choice)
            return CONTINUE if _s32(args[2]) == caller else (-errno.EPERM, 0)
        if name in ("tgkill", "rt_tgsigqueueinfo"):
            return CONTINUE if first == caller else (-errno.EPERM, 0)
        if name == "tkill":
            own = first == tid or first > 0 and os.path.exists(f"/proc/{caller}/task/{first}")
            return CONTINUE if own else (-errno.EPERM, 0)
        if name == "pidfd_send_signal":
            return (self._signal(target, sig, info, session) if target > 0 else -errno.ESRCH), 0
        if first == caller:
            return CONTINUE  # kill / rt_sigqueueinfo of its own process
        if first > 0:
            return self._signal(first, sig, info if name == "rt_sigqueueinfo" else None, session), 0
        if name == "kill" and first < -1 and first != -(1 << 31):
            return self._signal_group(-first, sig, session), 0
        return -errno.EPERM if first == -1 else -errno.ESRCH, 0

    def _signal(self, pid: int, sig: int, info: Optional[bytes], own: int) -> int:
        """Signal ``pid`` if it is in the session ``own``; 0 or -errno."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            return -errno.ESRCH if exc.errno == errno.ESRCH else -errno.EPERM
        try:
            try:
                _, session = _stat(pid)
            except (OSError, ValueError, IndexError):
                return -errno.ESRCH
            if _fdinfo_pid(f"/proc/self/fdinfo/{pidfd}") != pid:
                return -errno.ESRCH  # reaped since the pidfd was opened: the stat may be another's
            if session != own:
                return -errno.EPERM
            return kernel.pidfd_send_signal(pidfd, sig, info)
        finally:
            os.close(pidfd)

    def _signal_group(self, pgid: int, sig: int, own: int) -> int:
        """kill(-pgid): each member checked and signalled as by :meth:`_signal`; passes
        repeat while they find members not yet signalled (one forked meanwhile)."""
        done: set[int] = set()
        refused = False
        for _ in range(4):
            fresh = False
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in done:
                    continue
                try:
                    pgrp, _ = _stat(int(entry))
                except (OSError, ValueError, IndexError):
                    continue
                if pgrp != pgid:
                    continue
                result = self._signal(int(entry), sig, None, own)
                if result == -errno.EPERM:
                    refused = True
                elif result == 0:
                    done.add(int(entry))
                    fresh = True
            if not fresh:
                break
        if done:
            return 0
        return -errno.EPERM if refused else -errno.ESRCH


class SignalGate(Listener):
    """The gate when no other supervisor of the run has a listener (a process may have
    only one: has_duplicate_listener() in kernel/seccomp.c); otherwise that listener
    carries :class:`Signals` (:meth:`Listener.gate_signals`)."""

    name = "sandlock-signals"
    signals: Signals  # the gate's own handler, always set

    def __init__(self, signals: Signals) -> None:
        super().__init__(program())
        self.signals = signals

    def in_child(self) -> None:
        self.install()

    def _notified(self, ident: int, tid: int, nr: int, args: tuple[int, ...]) -> None:
        self._respond(ident, -errno.ENOSYS)  # not a call of the gate: never notified


def carried(bpf: bytes) -> "Signals":
    """The gate's handler for a run whose other listener carries it (the mediator's or
    the recorder's, whose filter ``bpf`` the child installs): that filter must begin
    with the gate's, else SetupError: a process gets one listener, so a child whose
    filter lacked it would run without the signal scope."""
    from ..errors import SetupError

    signals = Signals()
    if not bytes(bpf).startswith(signals.prefix):
        raise SetupError("malformed request: the signal gate is needed (Landlock ABI < 6) "
                         "and the mediator's filter does not carry it")
    return signals

