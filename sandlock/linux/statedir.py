"""sandlock's private state directory: where it is (``~/.cache/sandlock`` of the password
database's home) and how a directory of it is opened without trusting what a tool or
another user could have changed on the way. Below every layer that keeps state there:
the compiled-policy cache (:mod:`sandlock.compile.cachekey`), the kept paths
(:mod:`sandlock.policy.kept`, :mod:`sandlock.undo.keep`), the run log.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional


_PRIVATE_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(path: str, create: bool, private_from: int = 2) -> Optional[int]:
    """A descriptor of directory ``path``, reached from ``/`` one component at a time
    without following a symbolic link, or None if any step cannot be trusted.

    Every directory on the way must be owned by root or the effective uid and writable
    by no one else (a root-owned sticky directory such as /tmp excepted, where only the
    owner may rename what it holds); the last ``private_from`` components (sandlock's
    own) must be owned by the effective uid with no access for group or others. So a
    root caller whose HOME lies in another user's tree keeps no cache there, and no
    one can swap a component between the check and the use: the files are then used
    relative to this descriptor. Missing components are created (0700) if ``create``.
    (Ownership is no defence against a tool of the same uid: entries are authenticated.)
    """
    parts = [p for p in path.split("/") if p]
    if len(parts) < private_from:
        return None  # "/" (or one level under it) is no directory of sandlock's own
    euid = os.geteuid()
    try:
        fd = os.open("/", _PRIVATE_DIR)
    except OSError:
        return None
    try:
        for index, part in enumerate(parts):
            try:
                step = os.open(part, _PRIVATE_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                step = os.open(part, _PRIVATE_DIR, dir_fd=fd)
            os.close(fd)
            fd = step
            info = os.fstat(fd)
            own = index >= len(parts) - private_from
            if own:
                if info.st_uid != euid or info.st_mode & 0o077:
                    raise PermissionError
            elif info.st_uid not in (0, euid) or (
                    info.st_mode & 0o022 and not (info.st_mode & 0o1000 and info.st_uid == 0)):
                raise PermissionError
    except OSError:
        os.close(fd)
        return None
    return fd


def key_directory() -> Optional[str]:
    """The directory of the key file: ``.cache/sandlock`` in the euid's home from the
    password database, or None if it has no entry there or that home does not exist."""
    try:
        import pwd

        home = pwd.getpwuid(os.geteuid()).pw_dir
    except (ImportError, KeyError):
        return None
    if not os.path.isabs(home) or not os.path.isdir(home):
        return None  # never made here: a home that does not exist is no place for it
    return os.path.join(os.path.normpath(home), ".cache", "sandlock")


def not_private(path: str) -> str:
    """Why ``path`` is no place for sandlock's state: what open_private_dir requires."""
    return (f"{path!r} cannot be opened or made as a private directory (owned by uid "
            f"{os.geteuid()}, no access for group or others, reached without a symbolic link "
            "through directories only root or this uid can write)")
