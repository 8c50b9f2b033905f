"""Landlock access rights as pure functions of the ABI version.

Every constant comes from the kernel's uapi header ``linux/landlock.h``; see
https://docs.kernel.org/userspace-api/landlock.html for what each right covers.
Nothing here touches the kernel, so every ABI from 1 to :data:`NEWEST_ABI` can be
tested on any machine.
"""

from __future__ import annotations

import enum

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable


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


class Added:
    """What one Landlock ABI version added (the kernel documentation's "Previous
    limitations" and each flag's "since" note)."""

    __slots__ = ("fs", "net", "scope", "audit")

    def __init__(self, fs: int = 0, net: int = 0, scope: int = 0, audit: bool = False) -> None:
        self.fs, self.net, self.scope, self.audit = Fs(fs), Net(net), Scope(scope), audit


#: The one per-ABI table: what each version added. A new ABI is a new row here, and every
#: flag of Fs, Net and Scope must sit in exactly one row (tests/test_abi.py), so a right
#: added to an enum without a version fails the tests instead of being taken for ABI 1.
ADDED: dict[int, Added] = {
    1: Added(fs=Fs.EXECUTE | Fs.WRITE_FILE | Fs.READ_FILE | Fs.READ_DIR | Fs.REMOVE_DIR
             | Fs.REMOVE_FILE | Fs.MAKE_CHAR | Fs.MAKE_DIR | Fs.MAKE_REG | Fs.MAKE_SOCK
             | Fs.MAKE_FIFO | Fs.MAKE_BLOCK | Fs.MAKE_SYM),
    2: Added(fs=Fs.REFER),
    3: Added(fs=Fs.TRUNCATE),
    4: Added(net=Net.BIND_TCP | Net.CONNECT_TCP),
    5: Added(fs=Fs.IOCTL_DEV),
    6: Added(scope=Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL),
    7: Added(audit=True),  # LANDLOCK_RESTRICT_SELF_LOG_* flags; nothing policy-visible
}
NEWEST_ABI = max(ADDED)


def _since(test: Callable[[Added], object]) -> int:
    return next(version for version, added in sorted(ADDED.items()) if test(added))


def _upto(abi: int) -> list[Added]:
    """The rows of every version up to ``abi`` (a newer kernel: every row this table has)."""
    return [added for version, added in ADDED.items() if version <= abi]


NET_SINCE = _since(lambda added: added.net)
SCOPE_SINCE = _since(lambda added: added.scope)
AUDIT_SINCE = _since(lambda added: added.audit)

#: Rights that make sense on a non-directory; a rule on a file with any other right
#: is refused by the kernel with EINVAL.
FILE_ONLY = Fs.EXECUTE | Fs.WRITE_FILE | Fs.READ_FILE | Fs.TRUNCATE | Fs.IOCTL_DEV

#: Every right but reading and executing: a grant holding any of these lets a tool
#: change what is there (sandlock.compile.grants refuses such grants on what later runs trust).
WRITE_RIGHTS = Fs(((1 << 16) - 1) & ~(Fs.EXECUTE | Fs.READ_FILE | Fs.READ_DIR))


def _known(abi: int, rights: Fs) -> Fs:
    out = Fs(0)
    for added in _upto(abi):
        out |= added.fs
    return out & rights


def fs_handled(abi: int) -> Fs:
    """Every filesystem right this ABI knows: all of them are handled, so any not granted is denied."""
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
    out = Net(0)
    for added in _upto(abi):
        out |= added.net
    return out


def scopes_known(abi: int) -> Scope:
    """IPC scopes this ABI can apply (none before ABI 6)."""
    out = Scope(0)
    for added in _upto(abi):
        out |= added.scope
    return out


def fs_since(right: Fs) -> int:
    """The first ABI version that knows ``right``."""
    return _since(lambda added: added.fs & right)


def audit_flags(abi: int) -> bool:
    """Whether landlock_restrict_self takes the ``LANDLOCK_RESTRICT_SELF_LOG_*`` flags."""
    return any(added.audit for added in _upto(abi))


def newer_than_known(abi: int) -> str:
    """A note when the kernel's ABI is newer than this table: the rights that version
    added are unknown to sandlock, so they are neither handled nor denied."""
    if abi <= NEWEST_ABI:
        return ""
    return (f"this kernel has Landlock ABI {abi}; sandlock knows up to {NEWEST_ABI}: whatever "
            f"ABI {NEWEST_ABI + 1}+ added is not restricted (a newer sandlock would handle it)")
