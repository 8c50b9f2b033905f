"""Landlock access rights as pure functions of the ABI version.

Every constant comes from the kernel's uapi header ``linux/landlock.h``; see
https://docs.kernel.org/userspace-api/landlock.html for what each right covers.
Nothing here touches the kernel, so every ABI from 1 to :data:`NEWEST_ABI` can be
tested on any machine.
"""

from __future__ import annotations

import enum


class Fs(enum.IntFlag):
    """``LANDLOCK_ACCESS_FS_*`` (docs: "Filesystem flags")."""

    EXECUTE = 1 << 0
    WRITE_FILE = 1 << 1
    READ_FILE = 1 << 2
    READ_DIR = 1 << 3
    REMOVE_DIR = 1 << 4
    REMOVE_FILE = 1 << 5
    MAKE_CHAR = 1 << 6
    MAKE_DIR = 1 << 7
    MAKE_REG = 1 << 8
    MAKE_SOCK = 1 << 9
    MAKE_FIFO = 1 << 10
    MAKE_BLOCK = 1 << 11
    MAKE_SYM = 1 << 12
    REFER = 1 << 13  # ABI 2
    TRUNCATE = 1 << 14  # ABI 3
    IOCTL_DEV = 1 << 15  # ABI 5


class Net(enum.IntFlag):
    """``LANDLOCK_ACCESS_NET_*`` (ABI 4, docs: "Network flags")."""

    BIND_TCP = 1 << 0
    CONNECT_TCP = 1 << 1


class Scope(enum.IntFlag):
    """``LANDLOCK_SCOPE_*`` (ABI 6, docs: "Scope flags")."""

    ABSTRACT_UNIX_SOCKET = 1 << 0
    SIGNAL = 1 << 1


NEWEST_ABI = 7

#: The ABI version in which each right first appeared.
_FS_SINCE = {Fs.REFER: 2, Fs.TRUNCATE: 3, Fs.IOCTL_DEV: 5}
NET_SINCE = 4
SCOPE_SINCE = 6
#: ABI 7 added LANDLOCK_RESTRICT_SELF_LOG_* flags (audit); nothing policy-visible.
AUDIT_SINCE = 7

#: Rights that make sense on a non-directory; a rule on a file with any other right
#: is refused by the kernel with EINVAL.
FILE_ONLY = Fs.EXECUTE | Fs.WRITE_FILE | Fs.READ_FILE | Fs.TRUNCATE | Fs.IOCTL_DEV

#: Every right but reading and executing: a grant holding any of these lets a tool
#: change what is there (sandlock.compile.grants refuses such grants on what later runs trust).
WRITE_RIGHTS = Fs(((1 << 16) - 1) & ~(Fs.EXECUTE | Fs.READ_FILE | Fs.READ_DIR))


def _known(abi: int, rights: Fs) -> Fs:
    out = Fs(0)
    for right in Fs:
        if right & rights and _FS_SINCE.get(right, 1) <= abi:
            out |= right
    return out


def fs_handled(abi: int) -> Fs:
    """Every filesystem right this ABI knows: all of them are handled, so any not granted is denied."""
    if abi < 1:
        return Fs(0)
    return _known(abi, Fs(~0 & ((1 << 16) - 1)))


def fs_read(abi: int) -> Fs:
    """``filesystem.read``: open files for reading and list directories."""
    return _known(abi, Fs.READ_FILE | Fs.READ_DIR)


def fs_exec(abi: int) -> Fs:
    """``filesystem.exec``: read plus execute."""
    return fs_read(abi) | _known(abi, Fs.EXECUTE)


def fs_write(abi: int, *, sockets: bool = False) -> Fs:
    """``filesystem.write``: read plus create, write, truncate, delete and rename.

    Device nodes can never be created; socket files only when the policy grants
    ``network.unix`` (creating one is how a Unix socket server starts).
    """
    rights = (
        Fs.WRITE_FILE | Fs.REMOVE_DIR | Fs.REMOVE_FILE | Fs.MAKE_DIR | Fs.MAKE_REG
        | Fs.MAKE_FIFO | Fs.MAKE_SYM | Fs.REFER | Fs.TRUNCATE | Fs.IOCTL_DEV
    )
    if sockets:
        rights |= Fs.MAKE_SOCK
    return fs_read(abi) | _known(abi, rights)


def for_file(rights: Fs) -> Fs:
    """The subset of ``rights`` the kernel accepts on a rule for a non-directory."""
    return rights & FILE_ONLY


def net_handled(abi: int) -> Net:
    """TCP rights this ABI can restrict (none before ABI 4)."""
    return Net.BIND_TCP | Net.CONNECT_TCP if abi >= NET_SINCE else Net(0)


def scopes_known(abi: int) -> Scope:
    """IPC scopes this ABI can apply (none before ABI 6)."""
    return Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL if abi >= SCOPE_SINCE else Scope(0)


def fs_since(right: Fs) -> int:
    """The first ABI version that knows ``right``."""
    return _FS_SINCE.get(right, 1)


def audit_flags(abi: int) -> bool:
    """Whether landlock_restrict_self takes the ``LANDLOCK_RESTRICT_SELF_LOG_*`` flags."""
    return abi >= AUDIT_SINCE
