"""The key that authenticates the compiled-policy cache (:mod:`sandlock.compile.cache`).

Entries are only as safe as this key is secret: whoever reads it can forge an entry
that widens a later run. Two stores, the first that works:

1. **The caller's kernel user keyring** (keyrings(7),
   :func:`sandlock.linux.kernel.user_keyring_secret`): no tool can reach it, since the
   seccomp filter refuses keyctl, add_key and request_key to every tool.
2. **A key file**, where the keyring is refused (containers: runc gives a fresh
   session keyring where reading the user keyring fails, Docker's profile answers
   keyctl/add_key with EPERM, podman's add_key with ENOSYS). It is
   ``<home>/.cache/sandlock/key``, ``<home>`` the effective uid's home directory from
   the password database (never HOME or XDG_CACHE_HOME: every run of this uid,
   whatever its environment, must agree on the one place no tool may reach).
   Nothing keeps a tool from reading a file but Landlock, so, wherever a key file is
   the store (or one exists), a grant of any right that reaches it, above it, or
   through a mount, is refused (:func:`exposed`, :class:`sandlock.compile.grants.SecretCheck`);
   write grants there were refused already (a state directory,
   :func:`sandlock.compile.grants.protected`, lists that directory for every HOME).

The file is trusted only if every check holds, each on a descriptor, never a name
opened twice: its directory reached from ``/`` without following a link, owned by the
euid with no access for group or others, every directory above it owned by root or the
euid and writable by no one else (:func:`sandlock.compile.cache.open_private_dir`); the
file opened in that directory with ``O_NOFOLLOW`` (a planted symbolic link is refused,
not followed) and ``O_NONBLOCK`` (a FIFO cannot hang the launcher), then ``fstat``: a
regular file, owned by the euid, mode exactly 0600, exactly 32 bytes, one link (a hard
link elsewhere would be a second name a grant could reach), on its directory's
filesystem (a file bind-mounted over the key from elsewhere would come from a tree the
grant checks place apart). Any failure means no cache (every run compiles its policy:
slower, equally safe) and ``sandlock check`` says why; a bad file is never repaired
or replaced automatically, since it may be an attack to report. A missing key is made
from ``os.urandom`` under a temporary name (``O_CREAT|O_EXCL``, 0600) and published
with ``link``, which never replaces a key another launcher published first (both then
read the one that won).

What this does not cover: a same-uid process that is not confined can read the file
(as it can read the user keyring); a tool confined by something else, or by a sandlock
that predates the protected state directories, could have planted a key before it
existed (no check on a file of the same uid can tell who wrote it: remove the file to
make a new key).
"""

from __future__ import annotations

import errno
import os
from stat import S_IMODE, S_ISREG

from ..linux import kernel
from ..linux.statedir import key_directory as key_directory
from ..linux.statedir import not_private as not_private
from ..linux.statedir import open_private_dir as open_private_dir

TYPE_CHECKING = False  # typing costs milliseconds; the cache exists to save them
if TYPE_CHECKING:
    from typing import Callable, Optional

#: The description of the cache key in the user keyring (see keyrings(7)).
KEY_NAME = b"sandlock:policy-cache:v1"
KEY_BYTES = 32
KEY_FILE = "key"
#: Where the store is named in ``sandlock check``.
KEYRING = "the kernel user keyring"
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC




def key_path() -> Optional[str]:
    directory = key_directory()
    return None if directory is None else os.path.join(directory, KEY_FILE)


def secret(open_private_dir: Callable[..., Optional[int]]) -> tuple[Optional[bytes], str]:
    """(the cache key, where it is kept) or (None, why there is no cache).
    ``open_private_dir``: :func:`sandlock.compile.cache.open_private_dir`."""
    key = kernel.user_keyring_secret(KEY_NAME)
    if key is not None:
        return key, KEYRING
    import ctypes

    refused = ctypes.get_errno()
    why = f"the kernel keyring is refused here ({os.strerror(refused) if refused else 'unavailable'})"
    directory = key_directory()
    if directory is None:
        return None, (f"{why}, and uid {os.geteuid()} has no existing home directory in the "
                      "password database")
    fd = open_private_dir(directory, create=True, private_from=1)
    if fd is None:
        return None, (f"{why}, and {directory!r} cannot be opened or made as a private "
                      f"directory (owned by uid "
                      f"{os.geteuid()}, no access for group or others, reached without a "
                      "symbolic link through directories only root or this uid can write)")
    key, problem = _file_key(fd, KEY_FILE)
    where = os.path.join(directory, KEY_FILE)
    if key is None:
        return None, f"{why}, and the key file {where!r} {problem}"
    return key, f"the key file {where!r} ({why}; no grant may reach it)"


def _file_key(directory: int, name: str) -> tuple[Optional[bytes], str]:
    """(the key of file ``name`` in ``directory``, made on first use; closes
    ``directory``) or (None, why not, as the end of a sentence)."""
    try:
        key, problem = read_key(directory, name)
        if key is None and problem is None:
            made = _create(directory, name)
            if made is not None:
                return None, f"cannot be made: {made}"
            key, problem = read_key(directory, name)
    finally:
        os.close(directory)
    if key is None:
        return None, (f"is not trusted: {problem or 'missing'}; remove it and the next run "
                      "makes a new one")
    return key, ""


#: The key of records that must verify as long as they exist (the run log, undo
#: records): a file beside the cache key's, since the keyring's key does not survive
#: a reboot or the user's last logout, and a record made with it would then read as
#: forged. No grant of any right may reach it (grants.SecretCheck), whether it exists
#: yet or not.
RECORDS_FILE = "records-key"


def records_path() -> Optional[str]:
    directory = key_directory()
    return None if directory is None else os.path.join(directory, RECORDS_FILE)


#: The other state directories this user's runs kept state in (an XDG_CACHE_HOME, a HOME
#: or a SANDLOCK_LOG of some run), one per line, beside the records key: a later run in
#: another environment refuses grants on them too (grants._state_dirs).
ROOTS_FILE = "roots"
ROOTS_MAX = 256  #: the directories kept (those that no longer exist are dropped first)


def roots_path() -> Optional[str]:
    directory = key_directory()
    return None if directory is None else os.path.join(directory, ROOTS_FILE)


class RootsUnreadable(OSError):
    """The list of state directories exists but cannot be read as written (its mode, or
    its directory's, changed: a tool of this uid may chmod them): nothing is granted."""


def known_roots(open_private_dir: Callable[..., Optional[int]]) -> list[str]:
    """The directories :func:`remember_root` listed; none where nothing was listed yet
    (no state directory in the password database home). :class:`RootsUnreadable` where
    the list or its directory is there but cannot be read through the private directory
    (never "none": a tool that made it unreadable would switch off every refusal)."""
    directory = key_directory()
    if directory is None or not os.path.lexists(directory):
        return []
    fd = open_private_dir(directory, create=False, private_from=1)
    if fd is None:
        raise RootsUnreadable(0, f"{directory!r} is not private (owned by this uid, mode 0700, "
                                 "reached without a link)", directory)
    try:
        return _read_roots(fd)
    finally:
        os.close(fd)


def _read_roots(directory: int) -> list[str]:
    """The list in ``directory`` ([] where there is none); RootsUnreadable otherwise."""
    from ..policy.readfile import read_policy_bytes

    try:
        data = read_policy_bytes(ROOTS_FILE, directory, os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RootsUnreadable(exc.errno or 0, f"cannot read {ROOTS_FILE!r}: "
                              f"{exc.strerror or exc} (make it 0600 again)") from None
    return [line for line in os.fsdecode(data).split("\n")
            if line.startswith("/") and os.path.dirname(line) != line]


def remember_root(open_private_dir: Callable[..., Optional[int]], root: str) -> bool:
    """List ``root`` (absolute, normalised) among the state directories, unless it is the
    password database home's own; replaced whole, through the private directory. False
    when the list cannot be written (a full or read-only disk, a private directory that
    cannot be had): then the runs of other environments would not refuse a grant on
    ``root``, and the caller must keep nothing there."""
    directory = key_directory()
    if directory is None or not root.startswith("/") or os.path.dirname(root) == root:
        return False  # no list to be in; never "/": it would refuse every grant
    if root == directory:
        return True  # every run refuses the password database home's own
    try:
        fd = open_private_dir(directory, create=True, private_from=1)
        if fd is None:
            return False
        try:
            # One writer at a time: two runs adding two directories at once would each
            # rename its list over the other's, and one directory would go unlisted.
            lock = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = lock
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
            known = _read_roots(fd)
            if root in known:
                return True
            kept = [r for r in known if _present(r)][-(ROOTS_MAX - 1):] + [root]
            tmp = f".{ROOTS_FILE}.{os.getpid()}.{os.urandom(8).hex()}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                          0o600, dir_fd=fd)
            try:
                data = os.fsencode("".join(f"{r}\n" for r in kept))
                if os.write(out, data) != len(data):
                    raise OSError(errno.ENOSPC, "short write")
            except OSError:
                os.unlink(tmp, dir_fd=fd)
                raise
            finally:
                os.close(out)
            os.rename(tmp, ROOTS_FILE, src_dir_fd=fd, dst_dir_fd=fd)
            return True
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return False


def _present(path: str) -> bool:
    """False only when ``path`` is gone (a directory the launcher cannot reach now, a tool
    having changed a mode on the way, stays listed)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def records_secret(open_private_dir: Callable[..., Optional[int]]) -> tuple[Optional[bytes], str]:
    """(the records key, where it is kept) or (None, why there is none)."""
    directory = key_directory()
    if directory is None:
        return None, f"uid {os.geteuid()} has no existing home directory in the password database"
    fd = open_private_dir(directory, create=True, private_from=1)
    if fd is None:
        return None, not_private(directory)
    where = os.path.join(directory, RECORDS_FILE)
    key, problem = _file_key(fd, RECORDS_FILE)
    if key is None:
        return None, f"the key file {where!r} {problem}"
    return key, f"the key file {where!r}"


def read_key(directory: int, name: str = KEY_FILE) -> tuple[Optional[bytes], Optional[str]]:
    """(the key in ``directory``'s key file ``name``, None) if every check holds; (None,
    why not) if one fails; (None, None) if there is no key file."""
    try:
        fd = os.open(name, _READ, dir_fd=directory)
    except FileNotFoundError:
        return None, None
    except OSError as exc:  # ELOOP: a symbolic link; EACCES, ENXIO...
        return None, f"cannot open it without following a link ({exc.strerror})"
    try:
        info = os.fstat(fd)
        if not S_ISREG(info.st_mode):
            return None, "not a regular file"
        if info.st_uid != os.geteuid():
            return None, f"owned by uid {info.st_uid}, not {os.geteuid()}"
        if S_IMODE(info.st_mode) != 0o600:
            return None, f"mode {S_IMODE(info.st_mode):04o}, not 0600"
        if info.st_size != KEY_BYTES:
            return None, f"{info.st_size} bytes, not {KEY_BYTES}"
        if info.st_nlink != 1:
            return None, f"{info.st_nlink} links to it, not 1"
        if info.st_dev != os.fstat(directory).st_dev:
            return None, "on another filesystem than its directory"
        data = os.pread(fd, KEY_BYTES, 0)
        if len(data) != KEY_BYTES:
            return None, f"read {len(data)} bytes, not {KEY_BYTES}"
        return data, None
    except (OSError, ValueError) as exc:
        return None, f"cannot check it ({exc})"
    finally:
        os.close(fd)


def _create(directory: int, name: str = KEY_FILE) -> Optional[str]:
    """Make a key and publish it as the key file ``name`` unless one was published first;
    the reason it failed, or None. (Between the ``link`` and the ``unlink`` the key has
    two links: a launcher reading it then runs once without the cache.)"""
    tmp = f".{name}.{os.getpid()}.{os.urandom(8).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=directory)
    except OSError as exc:
        return str(exc.strerror)
    try:
        try:
            os.fchmod(fd, 0o600)  # exactly, whatever the umask
            if os.write(fd, os.urandom(KEY_BYTES)) != KEY_BYTES:
                return "a short write"
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, name, src_dir_fd=directory, dst_dir_fd=directory,
                    follow_symlinks=False)
        except FileExistsError:
            pass  # another launcher published one first: use it
        return None
    except OSError as exc:
        return str(exc.strerror)
    finally:
        try:
            os.unlink(tmp, dir_fd=directory)
        except OSError:
            pass


def exposed() -> Optional[str]:
    """The key file's path where no grant may reach it: a key file exists, or the
    keyring is refused here (the next run would make one). None where the keyring
    holds the key and no key file exists."""
    path = key_path()
    if path is None:
        return None
    if os.path.lexists(path) or kernel.user_keyring_secret(KEY_NAME) is None:
        return path
    return None
