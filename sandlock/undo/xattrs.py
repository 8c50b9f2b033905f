"""The extended attributes review, undo and ``--keep`` carry: ``user.*`` and the POSIX
ACLs. No Landlock right governs setxattr(2), so a tool may set them on whatever its uid
owns; a default ACL decides who may write what is made later in a directory, an access
ACL who else may read or write a file. Others (``security.*``, ``trusted.*``) need
privileges a confined tool does not have."""

from __future__ import annotations

import errno
import os
import struct
from typing import Callable, Optional, Sequence, Union

ACLS = ("system.posix_acl_access", "system.posix_acl_default")
KEPT = ("user.", *ACLS)
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)

#: (name, value) pairs, sorted by name.
Attributes = tuple[tuple[str, bytes], ...]
#: A descriptor, or a path that names the object itself (``/proc/self/fd/N`` of an
#: O_PATH descriptor: a name a tool could swap is never used).
Target = Union[int, str]


def read(target: Target, charge: Optional[Callable[[int], None]] = None) -> Attributes:
    """The kept attributes of ``target``; none on a file system without them. ``charge``
    is told the size of each (a bound of the caller's)."""
    try:
        names = os.listxattr(target)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:  # none can be set there either
            return ()
        raise
    out = []
    for name in sorted(names):
        if name.startswith(KEPT):
            value = os.getxattr(target, name)
            if charge is not None:
                charge(len(name) + len(value))
            out.append((name, value))
    return tuple(out)


def write(target: Target, attributes: Attributes) -> None:
    """Give ``target`` exactly ``attributes`` of the kept kinds (one just made took its
    directory's default ACL, which was not what was recorded); only what differs is set
    or removed."""
    want = dict(attributes)
    have = dict(read(target))
    for name in have:
        if name not in want:
            os.removexattr(target, name)
    for name, value in want.items():
        if have.get(name) != value:
            os.setxattr(target, name, value)


def encoded(attributes: Attributes) -> list[list[str]]:
    """As a record holds them: [name, value in hex] pairs."""
    return [[name, value.hex()] for name, value in attributes]


def decoded(pairs: Optional[Sequence[Sequence[str]]]) -> Attributes:
    return tuple((name, bytes.fromhex(value)) for name, value in pairs or ())


def held(fd: int) -> str:
    """The path of the object an O_PATH descriptor holds (its attributes cannot be read
    through such a descriptor itself)."""
    return f"/proc/self/fd/{fd}"


#: acl_xattr.h: a POSIX ACL as the kernel stores it, a version then (tag, perms, id) entries.
ACL_VERSION = 2
_ACL_HEAD, _ACL_ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
#: The tags, as getfacl(1) names them; the owner, owning group, mask and others have no id.
_ACL_TAGS = {0x01: "user:", 0x02: "user:{}", 0x04: "group:", 0x08: "group:{}", 0x10: "mask:",
             0x20: "other:"}


def acl_text(value: bytes) -> str:
    """A ``system.posix_acl_*`` value as getfacl's short form names what it grants
    (``user::rwx,user:54321:rw-,group::r--,mask::rw-,other::r--``: ids as numbers, which
    no one can rename); ``unreadable`` for what is not such an ACL."""
    size = _ACL_ENTRY.size
    if len(value) < _ACL_HEAD.size or (len(value) - _ACL_HEAD.size) % size \
            or _ACL_HEAD.unpack_from(value)[0] != ACL_VERSION:
        return "unreadable"
    out = []
    for offset in range(_ACL_HEAD.size, len(value), size):
        tag, perms, ident = _ACL_ENTRY.unpack_from(value, offset)
        if tag not in _ACL_TAGS or perms > 7:
            return "unreadable"
        rights = "".join(letter if perms & bit else "-" for letter, bit in (("r", 4), ("w", 2), ("x", 1)))
        out.append(f"{_ACL_TAGS[tag].format(ident)}:{rights}")
    return ",".join(out)
