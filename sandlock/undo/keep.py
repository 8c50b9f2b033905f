"""Paths a run must leave as they were (``sandlock run --keep PATH``): read before the
tool starts, compared once its whole process tree is gone, and put back if it changed.

Landlock cannot deny a path inside a write grant, so a tool that may write a project
may write the files in it that later decide what runs unconfined: the Claude Code hook's
own configuration (``.claude/settings.json``: a hook there runs at the next session,
outside any sandbox; or no sandlock hook at all). Such a path is kept: the run's
watchdog, which outlives the launcher, compares it once the tool's tree is reaped and,
if anything differs (a byte, a mode, an ACL or another extended attribute a tool
may set, a link, a new or missing entry), moves what the tool left aside
(``NAME.sandlock-changed-XXXXXXXX``: nothing is lost) and makes the path what it was.
The run then fails (exit 125) and says so.

Everything is reached from the parent directory's descriptor, opened before the tool
starts, one component at a time with ``O_NOFOLLOW``: a link the tool put in the way is
an entry that differs, never a way elsewhere. Every directory above the path is held
too, and found again by its name once the tool is gone: a tool that moved one of them
(``mv .git .git.old``) and made a new one in its place has changed the path, and the
directory it moved is moved back (or, if it is gone, made again). A parent whose mode
the tool changed (a tool may chmod what its uid owns) gets its mode back first. The
path is put back whole or not at all: what it was is written beside it first, then
renamed into place (a full disk leaves no half-written path). A symbolic link is kept
only inside a kept directory and pointing within it: one that leads out of the kept
path (the path itself, an absolute target, a ``..``) would leave what it points to
unkept. What is kept is bounded (:data:`MAX_ENTRIES`, :data:`MAX_BYTES`,
:data:`MAX_DEPTH`): a larger path is refused before the run, never kept in part.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..errors import SandlockError
from ..policy.kept import KEEP_DIR as KEEP_DIR
from ..policy.kept import MAX_COPY, keep_directory, own_file
from ..policy.kept import copy_name as _copy_name
from . import xattrs

MAX_ENTRIES = 4096
MAX_BYTES = 16 << 20
MAX_DEPTH = 32

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

#: A kept object: ("f", mode, content, attributes), ("l", 0, target, ()) or
#: ("d", mode, {name: Node}, attributes), attributes as sorted (name, value) pairs.
Node = tuple[str, int, Any, tuple[tuple[str, bytes], ...]]
#: The extended attributes kept: those a tool of the user's uid may set on the user's
#: files (security.* and trusted.* need capabilities no tool has). A default ACL on a
#: kept directory made every file the user later wrote there writable by anyone; a
#: ``user.`` attribute is data that programs read.


class KeepError(SandlockError):
    """A path that cannot be kept (before the run) or put back (after it)."""


class _Budget:
    def __init__(self) -> None:
        self.entries = MAX_ENTRIES
        self.bytes = MAX_BYTES

    def take(self, entries: int, size: int) -> None:
        self.entries -= entries
        self.bytes -= size
        if self.entries < 0 or self.bytes < 0:
            raise KeepError(f"more than {MAX_ENTRIES} entries or {MAX_BYTES >> 20} MiB")


def _read(parent: int, name: str, budget: _Budget, depth: int = 0) -> Optional[Node]:
    """``name`` in ``parent`` as a Node; None if there is none. KeepError for what cannot
    be kept (a FIFO, a device, too much), OSError for what cannot be read."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(name, dir_fd=parent)
        if depth == 0:
            raise KeepError("it is a symbolic link: what it points to would not be kept "
                            f"(keep {target!r} instead)")
        if os.path.isabs(target) or ".." in target.split("/"):
            raise KeepError(f"{name!r} is a symbolic link to {target!r}, outside the kept "
                            "path: what it points to would not be kept")
        budget.take(1, len(target))
        return ("l", 0, target, ())
    if stat.S_ISREG(info.st_mode):
        fd = os.open(name, _FILE, dir_fd=parent)
        try:
            got = os.fstat(fd)
            if (got.st_dev, got.st_ino) != (info.st_dev, info.st_ino):
                raise KeepError(f"{name!r} changed while it was read")
            if got.st_nlink > 1:  # another name, anywhere, would change it later
                raise KeepError(f"{name!r} has {got.st_nlink} names (hard links): a file "
                                "outside the kept path could change it; remove the others")
            budget.take(1, 0)
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                budget.take(0, len(chunk))
                chunks.append(chunk)
            return ("f", mode, b"".join(chunks), _attributes(fd, budget))
        finally:
            os.close(fd)
    if stat.S_ISDIR(info.st_mode):
        if depth >= MAX_DEPTH:
            raise KeepError(f"more than {MAX_DEPTH} levels of directories")
        budget.take(1, 0)
        fd = os.open(name, _DIR, dir_fd=parent)
        try:
            got = os.fstat(fd)
            if (got.st_dev, got.st_ino) != (info.st_dev, info.st_ino):
                raise KeepError(f"{name!r} changed while it was read")
            children: dict[str, Node] = {}
            for child in sorted(os.listdir(fd)):
                node = _read(fd, child, budget, depth + 1)
                if node is not None:
                    children[child] = node
            return ("d", mode, children, _attributes(fd, budget))
        finally:
            os.close(fd)
    raise KeepError(f"{name!r} is neither a file, a directory nor a symbolic link")


def _attributes(fd: int, budget: _Budget) -> xattrs.Attributes:
    """The kept extended attributes of the file or directory open at ``fd``."""
    return xattrs.read(fd, lambda size: budget.take(0, size))


def _write(parent: int, name: str, node: Node) -> None:
    """Make ``name`` in ``parent`` (where nothing is) what ``node`` says."""
    kind, mode, content, attributes = node
    if kind == "l":
        os.symlink(content, name, dir_fd=parent)
        return
    if kind == "f":
        fd = os.open(name, _NEW, 0o600, dir_fd=parent)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view):]
            xattrs.write(fd, attributes)
            os.fchmod(fd, mode)  # last: it sets an access ACL's mask to the group bits
        finally:
            os.close(fd)
        return
    os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        for child, sub in content.items():
            _write(fd, child, sub)
        xattrs.write(fd, attributes)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


@dataclass
class Kept:
    """One kept path: its parent's descriptor (O_PATH) and mode, what it was, the
    descriptor whose shared lock says a run keeps it (:func:`_baseline`), and every
    directory from ``/`` down to the parent (:class:`_Chain`)."""

    path: str
    parent: int
    parent_mode: int
    name: str
    before: Optional[Node]
    held: int = -1
    chain: Optional[_Chain] = None
    real: str = ""  #: its real path, as this process's kept paths are listed

    def close(self) -> None:
        for fd in (self.parent, self.held):
            if fd >= 0:
                os.close(fd)
        self.parent = self.held = -1
        if self.chain is not None:
            self.chain.close()
            self.chain = None
        if self.real:
            with _HELD:
                left = _KEPT_HERE.get(self.real, 0) - 1
                if left > 0:
                    _KEPT_HERE[self.real] = left
                else:
                    _KEPT_HERE.pop(self.real, None)
            self.real = ""


_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Chain:
    """The directories from ``/`` down to a kept path's parent (its real path, no link
    on the way), each held by a descriptor (O_PATH) taken before the run."""

    def __init__(self, real: str) -> None:
        self.real = real
        self.users = 1  #: the kept paths in this directory share it (:func:`_chain`)
        self.names = [part for part in real.split("/") if part]
        if len(self.names) > MAX_DEPTH:
            raise KeepError(f"more than {MAX_DEPTH} directories above it")
        self.fds: list[int] = []
        try:
            self.fds.append(os.open("/", _PATH_DIR))
            for part in self.names:
                self.fds.append(os.open(part, _PATH_DIR, dir_fd=self.fds[-1]))
        except BaseException:
            self.close()
            raise
        infos = [os.fstat(fd) for fd in self.fds]
        self.ids = [_identity(info) for info in infos]
        #: Their modes: a tool may chmod what its uid owns (no Landlock right covers it),
        #: and a directory it took the search right off would stop the walk down.
        self.modes = [stat.S_IMODE(info.st_mode) for info in infos]

    def close(self) -> None:
        with _HELD:
            self.users -= 1
            if self.users > 0:
                return
            _CHAINS.pop(self.real, None)
            for fd in self.fds:
                os.close(fd)
            self.fds = []

    def modes_back(self) -> list[str]:
        """Put back the mode of each directory held that the tool changed (by its
        descriptor: no name is resolved); what was done."""
        said = []
        for depth, fd in enumerate(self.fds):
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode != self.modes[depth]:
                os.chmod(f"/proc/self/fd/{fd}", self.modes[depth])
                here = os.path.join("/", *self.names[:depth])
                said.append(f"the tool changed the mode of {here!r}, a directory above the "
                            f"kept path, to {mode:o}: it is {self.modes[depth]:o} again")
        return said

    def walk(self) -> tuple[int, int]:
        """Walk the real path again from ``/``: (the descriptor of the deepest directory
        found by name, opened now; its depth, ``len(names)`` if every name is one)."""
        fd = os.open("/", _PATH_DIR)
        if _identity(os.fstat(fd)) != self.ids[0]:
            os.close(fd)
            raise KeepError("/ is not the directory it was")
        return self._descend(fd, 0)

    def _descend(self, fd: int, depth: int) -> tuple[int, int]:
        try:
            while depth < len(self.names):
                try:
                    deeper = os.open(self.names[depth], _PATH_DIR, dir_fd=fd)
                except OSError:  # gone, or a link or a file in its place
                    break
                # Another directory than the one held is taken as it is: the paths kept in
                # it are put back by name. Moved back, the one held would undo another run's
                # put-back (which makes a kept directory anew) with what that run's tool
                # left. Its mode is the held one's (the tool may take the search right off).
                found = os.fstat(deeper)
                if (_identity(found) != self.ids[depth + 1]
                        and stat.S_IMODE(found.st_mode) != self.modes[depth + 1]):
                    os.chmod(f"/proc/self/fd/{deeper}", self.modes[depth + 1])
                os.close(fd)
                fd, depth = deeper, depth + 1
        except BaseException:
            os.close(fd)
            raise
        return fd, depth

    def mend(self, fd: int, depth: int) -> tuple[int, int, str]:
        """No directory is at the name below ``fd`` (at ``depth``): move what is in its
        place aside (a link, a file), and move the one held back, or make it again (and
        those below it) if it is gone. Consumes ``fd``; returns the next (descriptor, depth) to go on
        from, and what was done."""
        name = self.names[depth]
        aside = f"{name}.sandlock-changed-{os.urandom(4).hex()}"
        here = os.path.join("/", *self.names[:depth + 1])
        try:
            try:
                os.rename(name, aside, src_dir_fd=fd, dst_dir_fd=fd)
                said = (f"the tool moved {here!r}, a directory above the kept path; what it "
                        f"left in its place is at {os.path.join(os.path.dirname(here), aside)!r}")
            except FileNotFoundError:
                said = f"the tool moved or removed {here!r}, a directory above the kept path"
            back = _bring_back(self.fds[depth + 1], self.ids[depth + 1], fd, name)
            if back is not None:
                return (*self._descend(fd, depth), f"{said}; it is back from {back!r}")
            while depth < len(self.names):  # gone: made again, and the directories below it
                part = self.names[depth]
                os.mkdir(part, 0o700, dir_fd=fd)
                deeper = os.open(part, _PATH_DIR, dir_fd=fd)
                os.chmod(f"/proc/self/fd/{deeper}", self.modes[depth + 1])
                os.close(fd)
                fd, depth = deeper, depth + 1
            return fd, depth, f"{said}; it is gone, and was made again (empty but for the kept path)"
        except BaseException:
            os.close(fd)
            raise


#: The chains held in this process, by real path: paths kept in one directory share one.
_CHAINS: dict[str, _Chain] = {}
#: Held by whoever changes the chains or walks one: threads of one process (the
#: calls of `sandlock mcp serve`) keep paths at once, and share the chains.
_HELD = threading.RLock()
#: Entries of a directory looked through for a held one the tool moved there.
MAX_LOOKED_THROUGH = 100_000


def _bring_back(held: int, identity: tuple[int, int], fd: int, name: str) -> Optional[str]:
    """Move the directory ``held`` (O_PATH) back to ``name`` in ``fd``, from wherever the
    tool moved it: found by descriptors and names only (its parent is its ``..``, its name
    the entry of that parent that is it), never by a path a tool could reroute. Where it
    was, or None if it is gone (removed, or not found)."""
    try:
        above = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=held)
    except OSError:  # removed: a removed directory has no parent
        return None
    try:
        if _identity(os.fstat(above)) == identity:  # / itself
            return None
        with os.scandir(above) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_LOOKED_THROUGH:
                    return None
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(info.st_mode) and _identity(info) == identity:
                    found = entry.name
                    break
            else:
                return None
        was = os.path.join(os.readlink(f"/proc/self/fd/{above}"), found)
        os.rename(found, name, src_dir_fd=above, dst_dir_fd=fd)
        if _identity(os.stat(name, dir_fd=fd, follow_symlinks=False)) != identity:
            raise KeepError(f"what was moved back from {was!r} is not the directory held "
                            "(something changed it meanwhile)")
        return was
    finally:
        os.close(above)


def _chain(real: str) -> _Chain:
    with _HELD:
        found = _CHAINS.get(real)
        if found is not None:
            found.users += 1
            return found
        made = _CHAINS[real] = _Chain(real)
        return made


def _identity(info: os.stat_result) -> tuple[int, int]:
    return (info.st_dev, info.st_ino)




def _baseline(parent: str, entry: str, now: Callable[[], tuple[int, Optional[Node]]]
              ) -> tuple[tuple[int, Optional[Node]], int]:
    """What ``entry`` of the directory whose real path is ``parent`` (and that directory's
    mode) was before the runs that keep it now, and the descriptor whose shared lock marks
    this run among them (inherited by its watchdog; closed at exec). By the real path:
    runs keeping one path under two names (one through a link) share it, and so does a
    run started after another's tool replaced the directory with one of its own (by its
    identity, that run found no copy and took the tool's file for what was there).

    A run started beside a running one (a server in the background, whose tool may have
    changed the path already) must put back what was there before both, not what it
    finds: the first of them reads the path (``now``) and stores it; the others read the
    stored copy, as long as one of them holds its lock."""
    import fcntl
    import marshal

    from ..compile.cache import _put  # written whole, read back, then renamed into place

    directory = keep_directory(create=True)
    if directory is None:
        raise KeepError("there is no private state directory to keep it in (~/.cache/sandlock "
                        "of the home in the password database)")
    path = os.path.join(parent, entry)
    name = _copy_name(path)
    try:
        mutex = os.open(f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600, dir_fd=directory)
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)  # one run at a time decides
            held = os.open(f"{name}.held", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o600, dir_fd=directory)
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                alone = False
            try:
                if alone:  # no run keeps it: what is there now is what was
                    before = now()
                    # never the cache's pruning: it took the copies and locks of running
                    # runs for old entries (see _forget_unheld)
                    _put(directory, name, marshal.dumps(before), prune=False)
                    _put(directory, f"{name}.path", os.fsencode(path), prune=False)
                    _forget_unheld(directory)
                else:
                    with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      dir_fd=directory), "rb") as stored:
                        if not own_file(stored.fileno()):
                            raise ValueError("the stored copy is not this user's")
                        before = marshal.loads(stored.read(MAX_COPY))
                fcntl.flock(held, fcntl.LOCK_SH)
                # Held first, then looked for: of two runs keeping nested paths at once,
                # each holds its own before it looks, so one at least sees the other.
                other = _kept_around(directory, path)
                if other is not None:
                    raise KeepError(f"a running sandlock run keeps {other!r}, "
                                    f"{'inside' if other.startswith(path + '/') else 'around'} "
                                    "it (what either kept would be the other's tool's change); "
                                    "run this when it has ended, or keep the same path")
            except BaseException:
                os.close(held)
                raise
        finally:
            os.close(mutex)
    except (OSError, ValueError, EOFError, TypeError) as exc:
        raise KeepError(f"its copy in the state directory: {exc}") from None
    finally:
        os.close(directory)
    return before, held


def _entries(directory: int) -> list[str]:
    """The names in the keep directory (held O_PATH: listed through a descriptor of its
    own), temporary ones (a leading dot) left out."""
    listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
    try:
        return [name for name in os.listdir(listing) if not name.startswith(".")]
    finally:
        os.close(listing)


#: The paths this process keeps now (a run's paths, or mcp serve's calls at once): a
#: path kept inside another of them is not another run's.
_KEPT_HERE: dict[str, int] = {}


def _kept_around(directory: int, path: str) -> Optional[str]:
    """A path above or below ``path`` that another running run keeps (its ``.held`` locked
    by a process other than this one), or None. Two runs keeping nested paths at once do
    not share a copy: the second would take the first's tool's change for what was
    there, and put it back after the first put the original back."""
    import fcntl

    def held(name: str) -> bool:
        """Whether a run keeps (or is deciding to keep) the path of the copy ``name``. Its
        ``.lock`` first: a run deciding holds it, and it would take a ``.held`` probed
        meanwhile for another run's (and read a stale copy)."""
        fds = []
        try:
            for lock in (f"{name}.lock", f"{name}.held"):
                try:
                    fds.append(os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                                       dir_fd=directory))
                except FileNotFoundError:
                    return False
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            for fd in reversed(fds):
                os.close(fd)

    with _HELD:
        here = set(_KEPT_HERE)
    above = os.path.dirname(path)
    while above not in ("/", ""):
        if above not in here and held(_copy_name(above)):
            return above
        above = os.path.dirname(above)
    names = [n[:-len(".path")] for n in _entries(directory) if n.endswith(".path")]
    for name in names:
        try:
            fd = os.open(f"{name}.path", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=directory)
            try:
                below = os.fsdecode(os.read(fd, 65536))
            finally:
                os.close(fd)
        except OSError:
            continue
        if below.startswith(path + "/") and below not in here and held(name):
            return below
    return None


#: Copies of what kept paths were, past which those no run keeps now are removed.
MAX_COPIES = 256


def _forget_unheld(directory: int) -> None:
    """Past MAX_COPIES, remove the copies no run keeps: each one's lock is taken (a run
    deciding holds it), then its ``.held`` (a run keeping it holds it shared); a copy is
    removed only if both are free. The lock files stay (empty): removing one would let
    two runs each lock a file of that name."""
    import fcntl

    names = [n for n in _entries(directory) if "." not in n]
    if len(names) <= MAX_COPIES:
        return
    for name in names:
        try:
            mutex = os.open(f"{name}.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                            dir_fd=directory)
        except OSError:
            continue
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.open(f"{name}.held", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=directory)
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(name, dir_fd=directory)
            finally:
                os.close(held)
        except OSError:  # BlockingIOError: a run holds it
            pass
        finally:
            os.close(mutex)


def keep(path: str) -> Kept:
    """Read ``path`` (absolute) before the run (or take what the runs keeping it beside
    this one read, :func:`_baseline`); KeepError if it cannot be kept."""
    if not os.path.isabs(path):
        raise KeepError(f"--keep {path!r}: give an absolute path")
    path = os.path.normpath(path)
    where, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise KeepError(f"--keep {path!r}: not a path that can be kept")
    try:
        parent = os.open(where, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise KeepError(f"--keep {path!r}: {exc.strerror or exc}") from None

    def now() -> tuple[int, Optional[Node]]:
        return stat.S_IMODE(os.fstat(parent).st_mode), _read(parent, name, _Budget())

    chain = None
    try:
        chain = _chain(os.path.realpath(f"/proc/self/fd/{parent}"))
        if chain.ids[-1] != _identity(os.fstat(parent)):
            raise KeepError("the directory holding it changed while it was read")
        real = os.path.join(chain.real, name)
        with _HELD:
            _KEPT_HERE[real] = _KEPT_HERE.get(real, 0) + 1
        try:
            (mode, before), held = _baseline(chain.real, name, now)
        except BaseException:
            with _HELD:
                left = _KEPT_HERE.pop(real) - 1
                if left > 0:
                    _KEPT_HERE[real] = left
            raise
    except (KeepError, OSError) as exc:
        os.close(parent)
        if chain is not None:
            chain.close()
        why = str(exc) if isinstance(exc, KeepError) else (exc.strerror or str(exc))
        raise KeepError(f"--keep {path!r} cannot be kept: {why}") from None
    return Kept(path, parent, mode, name, before, held, chain, real)


def _remove(parent: int, name: str) -> None:
    """Remove ``name`` in ``parent`` and all below it (a restore that could not be
    written whole), never following a link."""
    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if stat.S_ISDIR(info.st_mode):
        fd = os.open(name, _DIR, dir_fd=parent)
        try:
            for child in os.listdir(fd):
                _remove(fd, child)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)


def in_order(kept: Sequence[Kept]) -> list[Kept]:
    """The order to put kept paths back in: the deepest first. A kept path inside another
    is put back before it: the outer one's copy, put back last, is the whole of what was
    (put back first, the inner one's walk would take it for a directory the tool made)."""
    return sorted(kept, key=lambda each: -each.path.count("/"))


def put_back(kept: Kept) -> Optional[str]:
    """Once the tool's tree is gone: None if ``kept`` is as it was; otherwise make it so
    and say what was done. KeepError if it could not be put back."""
    with _HELD:  # a chain shared with another thread's run is walked and mended by one at once
        try:
            return _put_back(kept)
        except KeepError:
            raise
        except Exception as exc:  # noqa: BLE001 - never stops the other kept paths' put-back
            raise KeepError(f"the tool changed {kept.path!r}, a path kept for this run, and "
                            f"it could not be put back: {type(exc).__name__}: {exc}") from None


def _put_back(kept: Kept) -> Optional[str]:
    said: list[str] = []
    parent = -1
    try:
        if kept.chain is None:
            raise KeepError("it was not held")
        said += kept.chain.modes_back()
        parent, depth = kept.chain.walk()
        for _ in range(len(kept.chain.names) + 1):
            if depth == len(kept.chain.names):
                break
            mended, parent = parent, -1  # mend consumes it, whatever it raises
            parent, depth, done = kept.chain.mend(mended, depth)
            said.append(done)
        else:
            raise KeepError("the directories above it kept changing")
        named = os.path.realpath(os.path.dirname(kept.path))
        if named != kept.chain.real:  # its name went through a link, which now leads elsewhere
            raise KeepError(f"its name now leads to {named!r}, not {kept.chain.real!r}")
        proc = f"/proc/self/fd/{parent}"
        if stat.S_IMODE(os.stat(proc).st_mode) != kept.parent_mode:
            os.chmod(proc, kept.parent_mode)  # the directory held: no name to swap
        try:
            now = _read(parent, kept.name, _Budget())
        except (KeepError, OSError):
            now = ("?", 0, None, ())  # unreadable, too large or a link out now: it changed
        if now != kept.before:
            said.append(_swap(parent, kept))
    except OSError as exc:
        raise KeepError(f"the tool changed {kept.path!r}, a path kept for this run, and it "
                        f"could not be put back: {exc.strerror or exc}") from None
    except KeepError as exc:
        raise KeepError(f"the tool changed {kept.path!r}, a path kept for this run, and it "
                        f"could not be put back: {exc}") from None
    finally:
        if parent >= 0:
            os.close(parent)
    return "; ".join(said) if said else None


def _swap(parent: int, kept: Kept) -> str:
    """Put what ``kept`` was in place in ``parent``: written whole beside it first, then
    renamed in; what was there is moved aside. What was done, as a sentence."""
    staged = None
    if kept.before is not None:
        staged = f"{kept.name}.sandlock-restore-{os.urandom(4).hex()}"
        try:
            _write(parent, staged, kept.before)
        except OSError:
            try:
                _remove(parent, staged)
            except OSError:
                pass
            staged = None
            failed = True
        else:
            failed = False
    else:
        failed = False
    aside = None
    try:
        os.stat(kept.name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        aside = f"{kept.name}.sandlock-changed-{os.urandom(4).hex()}"
        os.rename(kept.name, aside, src_dir_fd=parent, dst_dir_fd=parent)
    where = os.path.join(os.path.dirname(kept.path), aside) if aside else None
    if failed:  # the tool's version is out of the way; what was cannot be written
        raise KeepError(f"it could not be written whole (is the disk full?); nothing is at "
                        f"{kept.path!r} now" + (f", what the tool left is at {where!r}" if where
                                                else ""))
    if staged is not None:
        os.rename(staged, kept.name, src_dir_fd=parent, dst_dir_fd=parent)
    return (f"the tool changed {kept.path!r}, a path kept for this run: it is as it was "
            "before the run again" + (f"; what the tool left is at {where!r}" if where else
                                      " (the tool had removed it)"))
