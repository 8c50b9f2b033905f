"""The one table of syscall numbers sandlock needs, per architecture.

Python has no wrapper for these calls (Landlock, seccomp, keyrings, pidfd_getfd), seccomp
filters match numbers, and ``sandlock trace`` names the numbers it is notified of; every
module takes the numbers from here. Sources, in the kernel tree:

- x86_64: ``arch/x86/entry/syscalls/syscall_64.tbl`` (the 64-bit ABI; x32 numbers carry
  bit 30 and are refused by the filters, see :mod:`sandlock.compile.seccomp`);
- aarch64: the generic table, ``include/uapi/asm-generic/unistd.h``, which became
  ``scripts/syscall.tbl`` in Linux 6.11. It has no ``open``, ``mkdir``, ``rename`` and
  their old siblings: only the ``*at`` forms exist there.

Numbers from 403 up (``clone3``, ``pidfd_*``, ``io_uring_*``, ``landlock_*``,
``fchmodat2``...) are the same on every architecture since Linux 5.1.
tests/test_tables.py checks this table against the installed uapi headers, the probe
payload's copy (it runs as source text in the sandbox and cannot import this module)
and the C helper's fallback ``#define``s.
"""

from __future__ import annotations

import os

#: ``name -> number`` per architecture (``uname -m``).
TABLES: dict[str, dict[str, int]] = {
    "x86_64": {
        "add_key": 248, "bind": 49, "bpf": 321, "chroot": 161, "clone": 56, "clone3": 435,
        "close_range": 436, "connect": 42, "creat": 85, "execve": 59, "execveat": 322,
        "fchmodat2": 452, "getpid": 39, "init_module": 175, "io_uring_setup": 425, "ioctl": 16,
        "ioprio_set": 251, "kexec_load": 246, "keyctl": 250, "landlock_add_rule": 445,
        "landlock_create_ruleset": 444, "landlock_restrict_self": 446, "link": 86, "linkat": 265,
        "mkdir": 83, "mkdirat": 258, "mknod": 133, "mknodat": 259, "mount": 165,
        "name_to_handle_at": 303, "open": 2, "open_by_handle_at": 304, "openat": 257,
        "openat2": 437, "perf_event_open": 298, "personality": 135, "pidfd_getfd": 438,
        "pidfd_open": 434, "pidfd_send_signal": 424, "process_vm_readv": 310, "ptrace": 101,
        "rename": 82, "renameat": 264, "renameat2": 316, "rmdir": 84, "seccomp": 317, "setns": 308,
        "socket": 41, "symlink": 88, "symlinkat": 266, "truncate": 76, "umount2": 166,
        "unlink": 87, "unlinkat": 263, "unshare": 272, "userfaultfd": 323,
        # the signal gate (sandlock.linux.signalgate)
        "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
        "rt_tgsigqueueinfo": 297, "fcntl": 72, "setsid": 112,
        # the connect gate (sandlock.net.connect)
        "listen": 50,
    },
    "aarch64": {
        "add_key": 217, "bind": 200, "bpf": 280, "chroot": 51, "clone": 220, "clone3": 435,
        "close_range": 436, "connect": 203, "execve": 221, "execveat": 281, "fchmodat2": 452,
        "getpid": 172, "init_module": 105, "io_uring_setup": 425, "ioctl": 29, "ioprio_set": 30,
        "kexec_load": 104, "keyctl": 219, "landlock_add_rule": 445, "landlock_create_ruleset": 444,
        "landlock_restrict_self": 446, "linkat": 37, "mkdirat": 34, "mknodat": 33, "mount": 40,
        "name_to_handle_at": 264, "open_by_handle_at": 265, "openat": 56, "openat2": 437,
        "perf_event_open": 241, "personality": 92, "pidfd_getfd": 438, "pidfd_open": 434,
        "pidfd_send_signal": 424, "process_vm_readv": 270, "ptrace": 117, "renameat": 38,
        "renameat2": 276, "seccomp": 277, "setns": 268, "socket": 198, "symlinkat": 36,
        "truncate": 45, "umount2": 39, "unlinkat": 35, "unshare": 97, "userfaultfd": 282,
        # the signal gate (sandlock.linux.signalgate)
        "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
        "rt_tgsigqueueinfo": 240, "fcntl": 25, "setsid": 157,
        # the connect gate (sandlock.net.connect)
        "listen": 201,
    },
}

#: ``AUDIT_ARCH_*`` (``include/uapi/linux/audit.h``): what a seccomp filter reads from
#: ``seccomp_data.arch`` to tell the native ABI from a foreign one (i386 ``int 0x80``).
AUDIT_ARCH: dict[str, int] = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

MACHINE = os.uname().machine
#: This machine's table; empty on an architecture sandlock does not know, where every
#: feature that needs a number says so instead of calling a wrong one.
NR: dict[str, int] = TABLES.get(MACHINE, {})
