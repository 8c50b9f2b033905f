"""The seccomp filter: a pure plan, compiled to BPF by libseccomp (once per process).

The filter allows by default and refuses (EPERM) what no tool needs, plus every
socket family, type and protocol the policy does not grant. libseccomp adds the
architecture check (foreign ABIs such as i386 ``int 0x80`` kill the process) and
refuses x32 system calls on x86_64. See
https://docs.kernel.org/userspace-api/seccomp_filter.html and seccomp_rule_add(3).

Integer arguments are compared on their low 32 bits only (``MASKED_EQ`` with
0xffffffff): the kernel ignores the upper half of an ``int`` argument, so an
exact 64-bit comparison could be bypassed by setting garbage high bits.
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .errors import PolicyError, SeccompError
from .policy import Network, Policy

# Comparison operators, as in libseccomp's enum scmp_compare.
NE, LT, LE, EQ, GE, GT, MASKED_EQ = 1, 2, 3, 4, 5, 6, 7
LOW32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Cmp:
    arg: int
    op: int
    value: int
    mask: int = 0  # for MASKED_EQ: (arg & mask) == value


@dataclass(frozen=True)
class Rule:
    syscall: str
    errno: int = errno.EPERM
    args: tuple[Cmp, ...] = ()


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
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # asm-generic/ioctls.h: terminal input injection
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


def _socket_rules(grants: dict[int, dict[int, tuple[int, ...]]]) -> list[Rule]:
    rules = [Rule("socket", args=(Cmp(0, GE, AF_MAX),))]
    for family in range(AF_MAX):
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
    # socketpair(2) only ever makes connected AF_UNIX pairs: harmless, used by many tools.
    rules.append(Rule("socketpair", args=(Cmp(0, NE, AF_UNIX),)))
    return rules


def plan(policy: Policy) -> tuple[Rule, ...]:
    """The rules of the filter for ``policy``: pure data, no kernel involved."""
    allow = set(policy.syscalls.allow)
    names = [n for n in DEFAULT_DENY if n not in allow] + list(policy.syscalls.deny)
    rules = [Rule(name) for name in dict.fromkeys(names)]
    if "clone" not in allow:
        rules += [Rule("clone", args=(Cmp(0, MASKED_EQ, flag, flag),))
                  for flag in NAMESPACE_FLAGS.values()]
    if "clone3" not in allow:
        # clone3 passes its flags in memory seccomp cannot read; ENOSYS makes libc fall back to clone.
        rules.append(Rule("clone3", errno=errno.ENOSYS))
    if "ioctl" not in allow:
        rules += [Rule("ioctl", args=(_eq32(1, request),)) for request in (TIOCSTI, TIOCLINUX)]
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
    rules += _socket_rules(socket_grants(policy.network))
    return tuple(rules)


def check_names(policy: Policy) -> None:
    """Raise PolicyError for syscall names this architecture does not know, or an
    ``allow`` entry that is not in the default deny list (it would grant nothing)."""
    special = {"clone", "clone3", "ioctl", "personality", *SELF_ONLY}
    for name in policy.syscalls.allow:
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
    (scripts/build_binary.sh) carries libseccomp.so.2 in its bundle directory.
    """
    bundle = getattr(sys, "_MEIPASS", None)
    bundled = os.path.join(bundle, "libseccomp.so.2") if bundle else ""
    if "pyseccomp" in sys.modules or not os.path.exists(bundled):
        import pyseccomp

        return pyseccomp
    import ctypes.util

    system = ctypes.util.find_library
    ctypes.util.find_library = lambda name: bundled if name == "seccomp" else system(name)
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
            if sc.resolve_syscall(arch, rule.syscall) < 0:
                continue  # not a syscall on this architecture: nothing to deny
            args = [sc.Arg(c.arg, c.op, c.mask if c.op == MASKED_EQ else c.value,
                           c.value if c.op == MASKED_EQ else 0) for c in rule.args]
            filt.add_rule(sc.ERRNO(rule.errno), rule.syscall, *args)
        with os.fdopen(os.memfd_create("sandlock-bpf", os.MFD_CLOEXEC), "w+b") as out:
            filt.export_bpf(out)
            out.seek(0)
            return out.read()
    except OSError as exc:
        raise SeccompError(f"libseccomp could not build the filter: {exc}") from None


#: Filters compiled in this process, by plan. Never stored on disk: a file a tool could
#: write would be trusted by the next launcher (the compiled-policy cache, which does
#: keep a filter, authenticates its entries; see sandlock.fastpath).
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
