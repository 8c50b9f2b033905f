"""Whether a policy's grants may let its tool open a device node: the decision that puts
the ioctl substitute on a plan below Landlock ABI 5 (docs/design.md, "Substitutes for older
Landlock ABIs"), where Landlock cannot restrict a device's ioctls itself.

It is made from the grants' paths, the objects they name now and the mount table, never
from the policy model, so that a plan read back from the cache makes it again at every
hit (:mod:`sandlock.compile.cache`): a mount made, or a device node put in a granted
file's place, after the plan was compiled changes the answer.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from . import grants

#: Devices whose ioctls are harmless; granting them does not rely on IOCTL_DEV.
HARMLESS_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
#: The same character devices by their numbers (major 1, Documentation/admin-guide/
#: devices.txt), wherever a node of them lies. A block device of these numbers is another
#: driver (major 1 of the block devices is the RAM disk).
_HARMLESS_NUMBERS = frozenset(os.makedev(1, minor) for minor in (3, 5, 7, 8, 9))


def reachable(granted: Sequence[tuple[str, bool]]) -> bool:
    """Whether grants ``granted``, each (path, whether it is granted for reading or
    executing), may reach a device whose ioctls Landlock restricts from ABI 5 on: a grant
    of ``/``, ``/dev`` or a path under it (but the harmless ones); one reaching a mount of
    /dev's filesystems elsewhere (a chroot's ``dev`` bound from /dev); a granted path that
    is itself a device (a node root made elsewhere with mknod); or a directory granted for
    reading or executing that may hold device nodes root made (:func:`_may_hold_devices`).
    A write grant is left out of the last: ABI 5 lets a write grant reach devices too. The
    mount table unknown: any grant may reach one."""
    paths = [path for path, _ in granted]
    if any(path in ("/", "/dev") or path.startswith("/dev/") and path not in HARMLESS_DEVICES
           for path in paths):
        return True
    if any(_is_device(path) for path in paths):  # a node root made elsewhere (mknod)
        return True
    try:
        mounts = grants.read_mounts()
    except Exception:  # noqa: BLE001 - unknown: the substitute applies, never a silent gap
        return bool(paths)
    places = _device_mounts(tuple(mounts.values()))
    if any(_nested(point, path) or _nested(path, point) for path in paths for point in places):
        return True
    return any(_may_hold_devices(path, mounts) for path, read in granted if read)


def _is_device(path: str) -> bool:
    """Whether ``path`` is a block device, or a character device other than the harmless
    ones, wherever it lies (a node made with mknod in a chroot's ``dev`` or a copy of /dev)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode) and st.st_rdev not in _HARMLESS_NUMBERS


def _may_hold_devices(path: str, mounts: dict[int, grants.Mount]) -> bool:
    """Whether directory ``path`` may hold device nodes that open as devices. Landlock's
    rule is on the directory itself, so wherever a mount of its filesystem shows it (a
    bind of that filesystem elsewhere), the grant holds there too: the directory may hold
    them if any such mount, or any mount at or below where one shows it, is without
    ``nodev``. Which mount the path itself reaches is asked of its descriptor (its
    ``mnt_id``), never guessed from the names in the table: a mount stacked over another,
    or moved beneath one, shows another filesystem than the deepest or last line says.
    Unknown: it may."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False  # nothing there: no rule is made for it
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            return False
        device, inner = grants.position(fd, mounts)  # the mount of its mnt_id
    except (OSError, ValueError, grants.Unjudgeable):
        return True
    finally:
        os.close(fd)
    if inner.startswith(grants.ROOT_FRAME):  # on a mount the table does not show
        return True
    for mount in mounts.values():
        if mount.device == device and _nested(inner, mount.root):
            shown = mount.point.rstrip("/") + inner[len(mount.root.rstrip("/")):] or "/"
            if not mount.nodev or any(not below.nodev for below in mounts.values()
                                      if _nested(below.point, shown)):
                return True
    return False


def _nested(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _device_mounts(mounts: tuple[grants.Mount, ...]) -> tuple[str, ...]:
    """Where a filesystem mounted on /dev or below it is mounted elsewhere (the same
    superblock)."""
    devices = {m.device for m in mounts if _nested(m.point, "/dev")}
    return tuple(m.point for m in mounts if m.device in devices and not _nested(m.point, "/dev"))
