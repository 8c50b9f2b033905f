"""Read a policy file once, bounded, without ever blocking.

A policy path is named by the caller, but what is there may be anything: a FIFO
(``open`` would wait for a writer), a device (``/dev/zero`` never ends), or a file
someone replaces while a run starts. The file is opened non-blocking, must be a
regular file, and is read in full once, up to :data:`MAX_BYTES`; everything the run
does (the cache key and the compiled policy alike) comes from these bytes. While a
running run keeps the file (``--keep``), they must be what it was before that run.
"""

from __future__ import annotations

import os
from stat import S_ISREG

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

MAX_BYTES = 1 << 20  #: 1 MiB: far beyond any real policy


class FileTooLarge(OSError):
    pass


def read_policy_bytes(path: str, dir_fd: Optional[int] = None, flags: int = 0) -> bytes:
    """The bytes of ``path`` (relative to ``dir_fd`` if given, opened with the extra
    ``flags``); OSError (``strerror`` says why) if it is not a regular file of at most
    MAX_BYTES."""
    from .kept import Reading

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | flags,
                 dir_fd=dir_fd)
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", path)
        # A run keeping it (--keep: the Claude Code hook's rules and policies) puts it back
        # only when it ends: until then it must be what it was (ChangedByARun).
        with Reading(fd, _named(path, dir_fd)) as reading:
            data = read_bounded(fd, MAX_BYTES)
            if data is None:
                raise FileTooLarge(0, f"larger than {MAX_BYTES} bytes", path)
            reading.check(data, path)
        return data
    finally:
        os.close(fd)


def _named(path: str, dir_fd: Optional[int]) -> Optional[str]:
    """``path`` as an absolute name, its links not followed (None if its directory has no
    name here)."""
    if os.path.isabs(path):
        return path
    try:
        base = os.getcwd() if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
    except OSError:
        return None
    return os.path.join(base, path) if base.startswith("/") else None


def read_bounded(fd: int, limit: int) -> Optional[bytes]:
    """All that ``fd`` gives until end of file, or None once it gives more than ``limit``
    bytes (a file that grows without end is never read whole into memory)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
