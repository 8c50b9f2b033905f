"""The seccomp filter: a pure plan, compiled to BPF by libseccomp (once per process).

The filter allows by default and refuses (EPERM) what no tool needs, every way to
plant a set-user-id or set-group-id file, executable memfds, the terminal ioctls
that reach past the tool's own output, plus every socket family, type and protocol
the policy does not grant. libseccomp adds the
architecture check (foreign ABIs such as i386 ``int 0x80`` kill the process) and
refuses x32 system calls on x86_64. See
https://docs.kernel.org/userspace-api/seccomp_filter.html and seccomp_rule_add(3).

Integer arguments are compared on their low 32 bits only (``MASKED_EQ`` with
0xffffffff, or a mask of single bits): the kernel ignores the upper half of an
``int`` argument, so an exact 64-bit comparison could be bypassed by setting
garbage high bits.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import PolicyError, SeccompError
from ..linux.syscalls import MACHINE, TABLES
from ..policy.model import Network, Policy
from .abi import NEWEST_ABI

# Comparison operators, as in libseccomp's enum scmp_compare.
NE, LT, LE, EQ, GE, GT, MASKED_EQ = 1, 2, 3, 4, 5, 6, 7
LOW32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Cmp:
    """A comparison of one syscall argument (libseccomp's ``scmp_arg_cmp``)."""

    arg: int
    op: int
    value: int
    mask: int = 0  # for MASKED_EQ: (arg & mask) == value


@dataclass(frozen=True)
class Rule:
    """A syscall refused with ``errno``, when every comparison of ``args`` holds; or, with
    ``only`` (argument, values), whenever the low 32 bits of that argument are none of the
    values (``args`` empty). libseccomp cannot say the latter (one comparison per argument
    in a rule, one default action per filter): its complement took 276 of its rules, 710
    instructions; :func:`compile_bpf` puts it ahead of libseccomp's program instead, one
    comparison per value."""

    syscall: str
    errno: int = errno.EPERM
    args: tuple[Cmp, ...] = ()
    only: "tuple[int, tuple[int, ...]] | None" = None


def _eq32(arg: int, value: int) -> Cmp:
    return Cmp(arg, MASKED_EQ, value, LOW32)


#: Syscalls no tool needs, refused with EPERM. Each is a way out of a sandbox or
#: into the kernel's attack surface (see README "Default deny list").
DEFAULT_DENY: tuple[str, ...] = (
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    # other processes' memory and descriptors
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "process_madvise", "migrate_pages", "move_pages",
    # kernel attack surface
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "lookup_dcookie",
    # the machine itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
    "iopl", "ioperm", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
    "sethostname", "setdomainname",
    "vhangup", "uselib", "_sysctl",
    # System V IPC: ids are global to the IPC namespace and Landlock does not see them,
    # so a tool could attach the caller's shared memory or read its message queues
    "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl", "ipc",
)

#: Syscalls a policy can never allow, with the reason given when one tries. The key
#: management calls reach the kernel keyring, where sandlock keeps the key that
#: authenticates its own cache: no tool may read or replace it.
NEVER_ALLOW: dict[str, str] = {
    **{name: "the key management syscalls (keyctl, add_key, request_key) reach the kernel "
             "keyring, where sandlock keeps the key that authenticates its cache"
       for name in ("keyctl", "add_key", "request_key")},
    **{name: "set-user-id and set-group-id modes are refused on every route that sets a "
             "mode (chmod, open/creat, mknod; openat2 is refused whole), whatever the policy"
       for name in ("chmod", "fchmod", "fchmodat", "fchmodat2", "mknod", "mknodat", "creat",
                    "open", "openat", "openat2")},
}

#: Syscalls that act on the process an argument names (the index): allowed on the
#: caller itself (0), refused on any other pid. Landlock scopes signals only; these
#: would let a tool lower the limits, priority or CPU set of any process of the user.
SELF_ONLY: dict[str, int] = {
    "prlimit64": 0, "sched_setaffinity": 0, "sched_setscheduler": 0, "sched_setparam": 0,
    "sched_setattr": 0, "setpriority": 1, "ioprio_set": 1,
}
#: The ``which`` (argument 0) that means "every process of a user": refused even with
#: who = 0 (PRIO_USER in setpriority(2), IOPRIO_WHO_USER in ioprio_set(2)).
WHICH_USER = {"setpriority": 2, "ioprio_set": 3}

# clone(2) flags that create namespaces (linux/sched.h).
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
#: Terminal ioctls refused on every descriptor (asm-generic/ioctls.h, tty_ioctl(4)): they
#: reach past the tool's own output into the user's terminal. TIOCSTI fakes typed input,
#: TIOCLINUX drives the console (paste selection), TIOCSETD swaps the line discipline
#: (N_NULL: the terminal discards everything afterwards), TIOCCONS redirects the console,
#: TIOCVHANGUP hangs up the terminal, TIOCSLCKTRMIOS locks its settings. Settings a tool
#: on a terminal legitimately changes (termios: TCSETS*, TCSETA*, TCFLSH, TCXONC;
#: TIOCSWINSZ) stay allowed: pagers, editors, REPLs and pexpect need them, and they
#: change how the terminal behaves, not what the user's shell reads.
TIOCSTI, TIOCLINUX, TIOCSETD, TIOCCONS = 0x5412, 0x541C, 0x5423, 0x541D
TIOCVHANGUP, TIOCSLCKTRMIOS = 0x5437, 0x5457
TTY_DENY: tuple[int, ...] = (TIOCSTI, TIOCLINUX, TIOCSETD, TIOCCONS, TIOCVHANGUP, TIOCSLCKTRMIOS)
#: TIOCSCTTY with a non-zero argument steals a terminal that is another session's
#: controlling terminal; with 0 it only adopts a terminal no session owns (a new pty).
TIOCSCTTY = 0x540E

#: The ioctl requests allowed on every descriptor below Landlock ABI 5 (:func:`ioctl_rules`,
#: the substitute for ``LANDLOCK_ACCESS_FS_IOCTL_DEV``, on every policy there); every other
#: request is refused (EACCES, as Landlock answers). Disjoint from :data:`TTY_DENY`
#: (tests/test_substitute_ioctl.py).
#: Numbers from asm-generic/ioctls.h, linux/fs.h, asm-generic/sockios.h, linux/sockios.h
#: (the same on x86_64 and aarch64).
IOCTL_ALWAYS: dict[str, int] = {
    # What Landlock ABI 5 lets through on any device (security/landlock/fs.c,
    # is_masked_device_ioctl(): the VFS answers these before a driver sees them), except
    # FIFREEZE/FITHAW, which need CAP_SYS_ADMIN, a capability no tool has.
    "FIOCLEX": 0x5451, "FIONCLEX": 0x5450, "FIONBIO": 0x5421, "FIOASYNC": 0x5452,
    "FIOQSIZE": 0x5460, "FS_IOC_FIEMAP": 0xC020660B, "FIGETBSZ": 0x2,
    "FICLONE": 0x40049409, "FICLONERANGE": 0x4020940D, "FIDEDUPERANGE": 0xC0189436,
    "FS_IOC_GETFSUUID": 0x80111500, "FS_IOC_GETFSSYSFSPATH": 0x80811501,
    # Queries of pipes and sockets, which Landlock never restricts (not devices).
    "FIONREAD": 0x541B, "TIOCOUTQ": 0x5411, "SIOCATMARK": 0x8905, "SIOCGSTAMP_OLD": 0x8906,
    "SIOCGSTAMPNS_OLD": 0x8907, "SIOCGIFNAME": 0x8910, "SIOCGIFINDEX": 0x8933,
    "SIOCOUTQNSD": 0x894B,
    # The terminal a tool inherits on stdio (Landlock restricts only devices opened inside
    # the sandbox, so isatty(3), termios and the window size work there on ABI 5).
    "TCGETS": 0x5401, "TCSETS": 0x5402, "TCSETSW": 0x5403, "TCSETSF": 0x5404,
    "TCGETA": 0x5405, "TCSETA": 0x5406, "TCSETAW": 0x5407, "TCSETAF": 0x5408,
    "TCSBRK": 0x5409, "TCXONC": 0x540A, "TCFLSH": 0x540B, "TIOCGPGRP": 0x540F,
    "TIOCSPGRP": 0x5410, "TIOCGWINSZ": 0x5413, "TIOCSWINSZ": 0x5414, "TIOCNOTTY": 0x5422,
    "TIOCGETD": 0x5424, "TCSBRKP": 0x5425, "TIOCGSID": 0x5429, "TCGETS2": 0x802C542A,
    "TCSETS2": 0x402C542B, "TCSETSW2": 0x402C542C, "TCSETSF2": 0x402C542D,
}
def ioctl_rules() -> list[Rule]:
    """The substitute for Landlock's device-ioctl right (ABI 5) on ABI 1-4: ioctl(2) with
    a request outside :data:`IOCTL_ALWAYS` is refused (EACCES) on every descriptor.
    Seccomp cannot tell a device from a file or a socket, so this is stricter than
    Landlock, which restricts only devices opened inside the sandbox (docs/design.md
    "Substitutes for older Landlock ABIs" lists what it refuses that ABI 5 allows). The
    request is compared on its low 32 bits, as the kernel reads it: garbage in the upper
    half can neither hide a request nor fake an allowed one."""
    return [Rule("ioctl", errno.EACCES, only=(1, tuple(sorted(set(IOCTL_ALWAYS.values())))))]


#: Mode bits that grant privilege when the file is executed (inode(7)).
S_ISUID, S_ISGID = 0o4000, 0o2000
#: open(2) flags under which the mode argument is used: the file may be created.
O_CREAT = os.O_CREAT
O_TMPFILE_BIT = os.O_TMPFILE & ~os.O_DIRECTORY  # __O_TMPFILE, the bit open(2) tests
#: Syscalls that set a mode, and the index of that argument (chmod(2), open(2), mknod(2)).
#: ``open``/``openat`` use their mode only when creating (``flags`` is argument 1 / 2).
MODE_ARG: dict[str, int] = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2,
                            "mknod": 1, "mknodat": 2, "creat": 1}
OPEN_FLAGS_MODE: dict[str, tuple[int, int]] = {"open": (1, 2), "openat": (2, 3)}
#: Syscalls newer than some libseccomp releases, by architecture, numbers from
#: :mod:`sandlock.linux.syscalls`. Without the number, a rule for them would be skipped
#: as "not a syscall here" while the kernel runs them.
NEWER_SYSCALLS: dict[str, dict[str, int]] = {
    name: {arch: table[name] for arch, table in TABLES.items()} for name in ("fchmodat2",)}

#: memfd_create(2): a memfd lives outside every directory, so Landlock never checks
#: an execve of one. With MFD_NOEXEC_SEAL (Linux 6.3) it is created non-executable and
#: sealed so (F_SEAL_EXEC); without it a tool could run any program it writes.
MFD_NOEXEC_SEAL = 0x0008
PERSONALITY_QUERY = 0xFFFFFFFF
MSG_FASTOPEN = 0x20000000  # connect-by-sendto; refused so every TCP connect passes Landlock
AF_UNIX, AF_INET, AF_INET6, AF_MAX = 1, 2, 10, 46
SOCK_STREAM, SOCK_DGRAM, SOCK_TYPE_MASK = 1, 2, 0xF
IPPROTO_TCP, IPPROTO_UDP = 6, 17


def socket_grants(network: Network) -> dict[int, dict[int, tuple[int, ...]]]:
    """family -> socket type -> allowed protocols; anything absent is refused.

    Inet stream sockets exist only when TCP is granted (Landlock then decides the
    ports); without a grant they are refused here, which also covers kernels whose
    Landlock cannot filter TCP (ABI < 4).
    """
    inet: dict[int, tuple[int, ...]] = {}
    if network.tcp:
        inet[SOCK_STREAM] = (0, IPPROTO_TCP)
    if network.udp:
        inet[SOCK_DGRAM] = (0, IPPROTO_UDP)
    grants: dict[int, dict[int, tuple[int, ...]]] = {}
    if inet:
        grants[AF_INET] = inet
        grants[AF_INET6] = inet
    if network.unix:
        grants[AF_UNIX] = {t: (0,) for t in range(SOCK_TYPE_MASK + 1)}
    return grants


def socket_grant(family: int, kind: int) -> str:
    """The ``[network]`` line that grants a socket of ``family`` and ``kind`` (its type,
    :data:`SOCK_TYPE_MASK` bits), as :func:`socket_grants` reads the policy; "" when no
    policy line grants it (a family or type sandlock never allows)."""
    if family == AF_UNIX:
        return "unix = true"
    if family in (AF_INET, AF_INET6):
        return {SOCK_STREAM: "connect = [PORT] (any TCP grant)", SOCK_DGRAM: "udp = true"}.get(kind, "")
    return ""


def socket_rules(network: Network) -> tuple[Rule, ...]:
    """The socket(2) and socketpair(2) refusals of ``network``: the policy filter's, and in a
    recorded run (:func:`plan` with ``sockets_recorded``) the recorder's, which answers
    socket(2) by :func:`refusal` on these same rules (:mod:`sandlock.trace.record`)."""
    return tuple(_socket_rules(socket_grants(network)))


def _compare(cmp: Cmp, args: tuple[int, ...]) -> bool:
    """One comparison as the kernel runs libseccomp's program: on the 64-bit argument."""
    value = args[cmp.arg] & 0xFFFFFFFFFFFFFFFF
    if cmp.op == MASKED_EQ:
        return value & cmp.mask == cmp.value
    return {NE: value != cmp.value, LT: value < cmp.value, LE: value <= cmp.value,
            EQ: value == cmp.value, GE: value >= cmp.value, GT: value > cmp.value}[cmp.op]


def refusal(rules: tuple[Rule, ...], syscall: str, args: tuple[int, ...]) -> int:
    """The errno the filter compiled from ``rules`` answers ``syscall`` with ``args``, 0 when
    it allows it (every rule of one syscall here has one errno, so the first match is the
    filter's answer)."""
    for rule in rules:  # compile_bpf() puts these ahead of every other rule
        if rule.syscall == syscall and rule.only is not None \
                and args[rule.only[0]] & LOW32 not in rule.only[1]:
            return rule.errno
    for rule in rules:
        if rule.syscall == syscall and rule.only is None \
                and all(_compare(cmp, args) for cmp in rule.args):
            return rule.errno
    return 0


def _socket_rules(grants: dict[int, dict[int, tuple[int, ...]]]) -> list[Rule]:
    """The refusals of every socket ``grants`` does not name, in as few comparisons as
    libseccomp allows (each costs the filter's load, on every run): no granted family, no
    socket at all; otherwise the families below the first granted one by one ``LE`` and
    those above the last by one ``GE``, both on all 64 bits (a value with a high bit set is
    above every family: refused by the ``GE``, never allowed by the ``LE``), and the
    families between them one by one on their low 32 bits (one comparison per argument)."""
    granted = sorted(family for family in grants if family < AF_MAX)
    if not granted:
        return [Rule("socket"), *_socketpair_rules()]
    rules = [Rule("socket", args=(Cmp(0, GE, granted[-1] + 1),))]
    if granted[0] > 0:
        rules.append(Rule("socket", args=(Cmp(0, LE, granted[0] - 1),)))
    for family in range(granted[0], granted[-1] + 1):
        types = grants.get(family)
        if types is None:
            rules.append(Rule("socket", args=(_eq32(0, family),)))
            continue
        for kind in range(SOCK_TYPE_MASK + 1):
            protocols = types.get(kind)
            type_cmp = Cmp(1, MASKED_EQ, kind, SOCK_TYPE_MASK)
            if protocols is None:
                rules.append(Rule("socket", args=(_eq32(0, family), type_cmp)))
                continue
            top = max(protocols)
            rules.append(Rule("socket", args=(_eq32(0, family), type_cmp, Cmp(2, GT, top))))
            rules += [Rule("socket", args=(_eq32(0, family), type_cmp, _eq32(2, proto)))
                      for proto in range(top) if proto not in protocols]
    return rules + _socketpair_rules()


def _socketpair_rules() -> list[Rule]:
    # socketpair(2) only ever makes connected AF_UNIX pairs: harmless, used by many tools.
    return [Rule("socketpair", args=(Cmp(0, NE, AF_UNIX),))]


def _plant_rules() -> list[Rule]:
    """No set-user-id or set-group-id file, by any route that sets a mode.

    Each bit is tested alone (a one-bit mask cannot see the upper half). ``open`` and
    ``openat`` use their mode only with O_CREAT or O_TMPFILE; openat2 passes mode and
    flags in memory seccomp cannot read, so it gets ENOSYS and libc uses openat.
    fchmodat2 (Linux 6.6) is compiled by number when libseccomp does not know it.
    File capabilities need CAP_SETFCAP, which no tool has (capabilities are dropped).
    """
    rules = [Rule(name, args=(Cmp(arg, MASKED_EQ, bit, bit),))
             for name, arg in MODE_ARG.items() for bit in (S_ISUID, S_ISGID)]
    rules += [Rule(name, args=(Cmp(flags, MASKED_EQ, create, create), Cmp(mode, MASKED_EQ, bit, bit)))
              for name, (flags, mode) in OPEN_FLAGS_MODE.items()
              for create in (O_CREAT, O_TMPFILE_BIT) for bit in (S_ISUID, S_ISGID)]
    rules.append(Rule("openat2", errno=errno.ENOSYS))
    return rules


#: open(2) flags (asm-generic/fcntl.h): the access mode and truncation.
O_ACCMODE, O_TRUNC = os.O_ACCMODE, os.O_TRUNC


def truncate_rules() -> list[Rule]:
    """The substitute for Landlock's truncate right (ABI 3) on ABI 1-2, where Landlock
    checks neither truncate(2) nor what O_TRUNC does at open(2).

    truncate(2) by path is refused whole: it names a file seccomp cannot see (tools
    truncate with open + ftruncate(2), which stays allowed: it needs a descriptor opened
    for writing, and opening for writing is what Landlock checks). open/openat with
    O_TRUNC are refused when the access mode is O_RDONLY (Landlock then checks only
    READ_FILE) or 3 (no access: Landlock checks nothing, the kernel still truncates with
    the user's write permission); with O_WRONLY or O_RDWR Landlock checks WRITE_FILE.
    creat(2) is O_WRONLY; openat2 is refused whole already (:func:`_plant_rules`).
    One masked comparison per rule: the access mode and O_TRUNC are low bits.
    """
    rules = [Rule("truncate")]
    rules += [Rule(name, args=(Cmp(flags, MASKED_EQ, mode | O_TRUNC, O_ACCMODE | O_TRUNC),))
              for name, (flags, _) in OPEN_FLAGS_MODE.items() for mode in (os.O_RDONLY, O_ACCMODE)]
    return rules


#: fcntl(2) F_SETOWN_EX (owner in memory, a thread or a group); ioctl(2) FIOSETOWN and
#: SIOCSPGRP (asm-generic/sockios.h: F_SETOWN by another route, the owner in memory).
F_SETOWN_EX, FIOSETOWN, SIOCSPGRP = 15, 0x8901, 0x8902
#: Signal-driven I/O turned on: fcntl(2) F_SETFL with O_ASYNC, ioctl(2) FIOASYNC. On a
#: terminal the kernel itself makes the owner its foreground process group (tty_fasync in
#: drivers/tty/tty_io.c): the caller's job, with no F_SETOWN the gate could judge.
F_SETFL, O_ASYNC, FIOASYNC = 4, 0o20000, 0x5452


def signal_rules() -> list[Rule]:
    """The policy filter's half of the signal gate (:mod:`sandlock.linux.signalgate`), the
    substitute for Landlock's signal scope before ABI 6: setsid(2) is refused so every
    process of the tool stays in the session its first process leads; kill(-1) (every
    process the caller may signal) is refused; so are the SIGIO/SIGURG owner settings
    whose owner sits in memory the gate could only read racily (F_SETOWN_EX, FIOSETOWN,
    SIOCSPGRP), and signal-driven I/O itself (O_ASYNC, FIOASYNC), whose owner the kernel
    may pick; F_SETOWN itself goes to the gate."""
    return [Rule("setsid"), Rule("kill", args=(_eq32(0, LOW32),)),
            Rule("fcntl", args=(_eq32(1, F_SETOWN_EX),)),
            Rule("fcntl", args=(_eq32(1, F_SETFL), Cmp(2, MASKED_EQ, O_ASYNC, O_ASYNC))),
            Rule("ioctl", args=(_eq32(1, FIOSETOWN),)), Rule("ioctl", args=(_eq32(1, SIOCSPGRP),)),
            Rule("ioctl", args=(_eq32(1, FIOASYNC),))]


def plan(policy: Policy, abi: int = NEWEST_ABI, *, sockets_recorded: bool = False) -> tuple[Rule, ...]:
    """The rules of the filter for ``policy`` on Landlock ABI ``abi``: pure data, no
    kernel involved. ``abi`` decides the substitutes for protections it lacks
    (:func:`sandlock.compile.ruleset.substitutes`).

    ``sockets_recorded`` (`sandlock trace` only): the socket(2) refusals are left out, for
    the recorder to answer from the same rules (:func:`socket_rules`, :func:`refusal`) and
    report: an errno here outranks its notification, which would never see them. A run
    without the recorder's filter must never get this plan."""
    from .ruleset import substituted

    allow = set(policy.syscalls.allow) - set(NEVER_ALLOW)
    names = [n for n in DEFAULT_DENY if n not in allow] + list(policy.syscalls.deny)
    rules = [Rule(name) for name in dict.fromkeys(names)]
    rules += _plant_rules()
    if substituted(policy, abi, "truncate restriction"):
        rules += truncate_rules()
    if substituted(policy, abi, "signal scope"):
        rules += signal_rules()
    if "memfd_create" not in allow:
        # (flags & MFD_NOEXEC_SEAL) == 0: an executable memfd. ENOSYS, as on kernels before
        # memfd (3.17): programs then fall back to a file, whose execution Landlock decides.
        rules.append(Rule("memfd_create", errno=errno.ENOSYS,
                          args=(Cmp(1, MASKED_EQ, 0, MFD_NOEXEC_SEAL),)))
    if "clone" not in allow:
        rules += [Rule("clone", args=(Cmp(0, MASKED_EQ, flag, flag),))
                  for flag in NAMESPACE_FLAGS.values()]
    if "clone3" not in allow:
        # clone3 passes its flags in memory seccomp cannot read; ENOSYS makes libc fall back to clone.
        rules.append(Rule("clone3", errno=errno.ENOSYS))
    if substituted(policy, abi, "device ioctl restriction"):
        rules += ioctl_rules()  # TTY_DENY lies outside it: refused there, with EACCES
    elif "ioctl" not in allow:
        rules += [Rule("ioctl", args=(_eq32(1, request),)) for request in TTY_DENY]
        # NE on all 64 bits: 0 with garbage in the upper half is refused too.
        rules.append(Rule("ioctl", args=(_eq32(1, TIOCSCTTY), Cmp(2, NE, 0))))
    if "personality" not in allow:
        rules.append(Rule("personality", args=(Cmp(0, NE, PERSONALITY_QUERY),)))
    for name, pid_arg in SELF_ONLY.items():
        if name not in allow:
            # NE on all 64 bits: pid 0 with garbage in the upper half is refused too.
            rules.append(Rule(name, args=(Cmp(pid_arg, NE, 0),)))
            if name in WHICH_USER:
                rules.append(Rule(name, args=(_eq32(0, WHICH_USER[name]),)))
    if not policy.network.bind and not policy.network.unix:
        # listen() on an unbound TCP socket binds an ephemeral port, and Landlock has no
        # listen right: without a bind grant (or unix sockets, whose servers need
        # listen) there is nothing to listen on.
        rules.append(Rule("listen"))
    rules += [Rule("sendto", args=(Cmp(3, MASKED_EQ, MSG_FASTOPEN, MSG_FASTOPEN),)),
              Rule("sendmsg", args=(Cmp(2, MASKED_EQ, MSG_FASTOPEN, MSG_FASTOPEN),)),
              Rule("sendmmsg", args=(Cmp(3, MASKED_EQ, MSG_FASTOPEN, MSG_FASTOPEN),))]
    rules += [rule for rule in socket_rules(policy.network)
              if not (sockets_recorded and rule.syscall == "socket")]
    return tuple(rules)


def check_names(policy: Policy) -> None:
    """Raise PolicyError for syscall names this architecture does not know, an ``allow``
    entry no policy may have (:data:`NEVER_ALLOW`), or one that is not in the default
    deny list (it would grant nothing)."""
    special = {"clone", "clone3", "ioctl", "personality", "memfd_create", *SELF_ONLY}
    for name in policy.syscalls.allow:
        if name in NEVER_ALLOW:
            raise PolicyError(f"{name!r} cannot be allowed: {NEVER_ALLOW[name]}",
                              source=policy.source, key="syscalls.allow")
        if name not in DEFAULT_DENY and name not in special:
            raise PolicyError(f"{name!r} is not denied by default, so allowing it changes nothing "
                              f"(default deny list: {', '.join(DEFAULT_DENY)})",
                              source=policy.source, key="syscalls.allow")
    known = _resolver()
    for name in policy.syscalls.deny:
        if known(name) < 0:
            raise PolicyError(f"unknown syscall {name!r} on {os.uname().machine}",
                              source=policy.source, key="syscalls.deny")


def _pyseccomp() -> Any:
    """Import pyseccomp; in the single-file binary, make it load the bundled libseccomp.

    pyseccomp looks the library up with ctypes.util.find_library, which reads the
    system's ldconfig cache: a machine without libseccomp2 has none. The binary
    (scripts/build_binary.sh) carries libseccomp.so.2 in its bundle directory. Each lookup
    is answered by the soname itself when dlopen loads it, which is what find_library
    would have named, without its ``ldconfig -p`` process.
    """
    if "pyseccomp" in sys.modules:
        import pyseccomp

        return pyseccomp
    bundle = getattr(sys, "_MEIPASS", None)
    bundled = os.path.join(bundle, "libseccomp.so.2") if bundle else ""
    import ctypes
    import ctypes.util

    system = ctypes.util.find_library
    sonames = {"c": "libc.so.6", "seccomp": bundled if os.path.exists(bundled) else
               "libseccomp.so.2"}

    def find_library(name: str) -> Any:
        """The soname find_library would name, when dlopen finds it: find_library runs
        ``ldconfig -p`` (a process, ~5 ms) for each of pyseccomp's two lookups."""
        known = sonames.get(name)
        try:
            if known is not None:
                ctypes.CDLL(known)  # what pyseccomp does with the name next
                return known
        except OSError:
            pass
        return system(name)

    ctypes.util.find_library = find_library
    try:
        import pyseccomp
    finally:
        ctypes.util.find_library = system
    return pyseccomp


def _resolver() -> Callable[[str], int]:
    pyseccomp = _pyseccomp()

    arch = pyseccomp.system_arch()
    return lambda name: int(pyseccomp.resolve_syscall(arch, name))


def compile_bpf(rules: tuple[Rule, ...]) -> bytes:
    """Compile ``rules`` with libseccomp into classic BPF for the native architecture."""
    try:
        sc = _pyseccomp()
    except (ImportError, OSError, RuntimeError) as exc:
        raise SeccompError(f"libseccomp is not available: {exc} (install libseccomp2)") from None
    try:
        filt = sc.SyscallFilter(sc.ALLOW)
        filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
        filt.set_attr(sc.Attr.CTL_NNP, 0)  # the launcher sets no_new_privs itself
        try:
            # A binary tree of syscall numbers instead of a chain: the kernel emulates the
            # filter for every syscall when it is loaded (the action cache), so a shorter
            # path per syscall makes loading ~70 us faster here. Same verdicts either way.
            filt.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
        except (AttributeError, OSError, ValueError):
            pass  # libseccomp < 2.5: the plain chain
        arch = sc.system_arch()
        for rule in rules:
            if rule.only is not None:
                continue  # ahead of libseccomp's program (below)
            number = sc.resolve_syscall(arch, rule.syscall)
            args = [sc.Arg(c.arg, c.op, c.mask if c.op == MASKED_EQ else c.value,
                           c.value if c.op == MASKED_EQ else 0) for c in rule.args]
            if number < 0:
                number = NEWER_SYSCALLS.get(rule.syscall, {}).get(MACHINE, -1)
                if number < 0:
                    continue  # not a syscall on this architecture: nothing to deny
                # unknown to this libseccomp: refuse it whole (libc falls back to its elder)
                args, filt_errno = [], errno.ENOSYS
            else:
                filt_errno = rule.errno
            filt.add_rule(sc.ERRNO(filt_errno), number, *args)
        program = _export(filt)
        listed = [(int(sc.resolve_syscall(arch, r.syscall)), r) for r in rules if r.only is not None]
    except OSError as exc:
        raise SeccompError(f"libseccomp could not build the filter: {exc}") from None
    program = _allowlists(int(arch), listed) + program
    _check_program(program)
    return program


# Classic BPF (linux/filter.h, linux/bpf_common.h) and seccomp_data (linux/seccomp.h).
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
SECCOMP_RET_ERRNO = 0x00050000
DATA_NR, DATA_ARCH, DATA_ARGS = 0, 4, 16
#: Where an argument's low 32 bits are in seccomp_data (a 64-bit field each).
LOW_HALF = 0 if sys.byteorder == "little" else 4


def _allowlists(arch: int, listed: list[tuple[int, Rule]]) -> bytes:
    """The ``only`` rules as a program that runs ahead of libseccomp's: for the native
    architecture (another goes straight on to libseccomp's, which kills it, as it kills
    x32 numbers), each rule's syscall with an argument whose low 32 bits are none of its
    values returns its errno; everything else goes on to the next rule, then to
    libseccomp's program, which still judges what was let through."""
    blocks = []
    for number, rule in listed:
        if number < 0 or rule.args or rule.only is None:
            raise SeccompError(f"an allowlist rule for {rule.syscall} that cannot be compiled")
        arg, values = rule.only
        # Each jump's offset counts from the next instruction: "on" is the next block.
        code = [(BPF_LD_W_ABS, 0, 0, DATA_NR),
                (BPF_JEQ_K, 0, len(values) + 2, number),
                (BPF_LD_W_ABS, 0, 0, DATA_ARGS + 8 * arg + LOW_HALF)]
        code += [(BPF_JEQ_K, len(values) - index, 0, value) for index, value in enumerate(values)]
        code.append((BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | rule.errno & 0xFFFF))
        blocks.append(code)
    if not blocks:
        return b""
    body = [insn for block in blocks for insn in block]
    head = [(BPF_LD_W_ABS, 0, 0, DATA_ARCH), (BPF_JEQ_K, 0, len(body), arch)]
    if len(body) > 255 or any(max(jt, jf) > 255 for _, jt, jf, _ in body):
        raise SeccompError("the allowlist rules are too long for a jump of classic BPF")
    return b"".join(struct.pack("=HBBI", *insn) for insn in head + body)


#: BPF_MAXINSNS: the kernel refuses longer classic BPF programs (linux/bpf_common.h).
BPF_MAXINSNS = 4096
BPF_INSN = 8  #: sizeof(struct sock_filter)
BPF_CLASS_JMP, BPF_CLASS_RET, BPF_JA = 0x05, 0x06, 0x00


def _export(filt: Any) -> bytes:
    """The program, through a pipe: libseccomp's single write() is not checked for a short
    count, and a file (a memfd) is cut short by RLIMIT_FSIZE; a pipe is not. The pipe holds
    more than the longest program the kernel accepts, so a complete one never blocks, and
    an oversized one fills it (O_NONBLOCK) and is refused below instead of hanging."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        try:
            fcntl.fcntl(write_end, F_SETPIPE_SZ, 2 * BPF_MAXINSNS * BPF_INSN)
        except OSError:
            pass  # over fs.pipe-user-pages-soft: the size it has (refused below if too small)
        room = fcntl.fcntl(write_end, F_GETPIPE_SZ)
        filt.export_bpf(_Fd(write_end))
        os.close(write_end)
        write_end = -1
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    program = b"".join(chunks)
    if len(program) >= room:
        why = (f"more than the kernel's {BPF_MAXINSNS} instructions"
               if room > BPF_MAXINSNS * BPF_INSN else
               "a pipe this small (fs.pipe-user-pages-soft reached?)")
        raise SeccompError(f"the filter does not fit in {room} bytes: {why}")
    return program


F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032  # fcntl(2)


class _Fd:
    """What pyseccomp's export_bpf() needs of a file: its descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def _check_program(program: bytes) -> None:
    """Refuse a program that cannot be what libseccomp meant: empty, not whole
    instructions, too long, a jump past the end, or a last instruction that is not a
    return. A program cut short anywhere fails at least one of these."""
    count, extra = divmod(len(program), BPF_INSN)
    why = ("it is empty" if not program else
           f"{len(program)} bytes is not a whole number of instructions" if extra else
           f"{count} instructions is more than the kernel's {BPF_MAXINSNS}"
           if count > BPF_MAXINSNS else None)
    for index in range(count if why is None else 0):
        code, jt, jf, k = struct.unpack_from("=HBBI", program, index * BPF_INSN)
        if code & 0x07 == BPF_CLASS_JMP:
            far = k if code & 0xF0 == BPF_JA else max(jt, jf)
            if index + 1 + far >= count:
                why = f"instruction {index} jumps past the end"
                break
        if index == count - 1 and code & 0x07 != BPF_CLASS_RET:
            why = "the last instruction is not a return"
    if why:
        raise SeccompError(f"libseccomp exported a broken filter ({why}); nothing was loaded")


#: Filters compiled in this process, by plan. Never stored on disk: a file a tool could
#: write would be trusted by the next launcher (the compiled-policy cache, which does
#: keep a filter, authenticates its entries; see sandlock.compile.cache).
_COMPILED: dict[tuple[Rule, ...], bytes] = {}


def bpf_for(rules: tuple[Rule, ...]) -> bytes:
    """The compiled filter for ``rules``, compiled once per process."""
    data = _COMPILED.get(rules)
    if data is None:
        data = compile_bpf(rules)
        if len(_COMPILED) >= 64:
            _COMPILED.clear()
        _COMPILED[rules] = data
    return data
