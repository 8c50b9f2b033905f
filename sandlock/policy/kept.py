"""Which paths running runs keep now (``sandlock run --keep``), found by the locks of the
keep directory alone: light enough for every read of a policy file
(:mod:`sandlock.policy.readfile`), below the layer that keeps them.

:mod:`sandlock.undo.keep` stores, per kept path (by its real path), what the path was
before the runs keeping it began (``NAME``), and two locks: ``NAME.lock``, held by a run
deciding what the path was, and ``NAME.held``, held shared by every run keeping it. Until
the last of them ends, the path may hold what a tool of one of them wrote: a policy or
rules file read then must be what it was before those runs, or it is no one's choice
(:func:`differs`, through :class:`Reading`).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

#: The keep directory of the private state directory (no write grant reaches it).
KEEP_DIR = "keep"
#: Bytes of a stored copy read at most (keep.MAX_BYTES of content, and the rest).
MAX_COPY = (16 << 20) + (1 << 20)


def copy_name(path: str) -> str:
    """The name of a kept path's copy, and of its locks: by its real path."""
    import hashlib

    return hashlib.sha256(os.fsencode(path)).hexdigest()[:32]


def keep_directory(create: bool = False) -> Optional[int]:
    """A descriptor of the keep directory, or None if there is none (or no private state
    directory to hold one). A tool may change the mode of what its uid owns (Landlock does
    not govern chmod): sandlock's own two directories are made private again first."""
    from ..linux.statedir import key_directory, open_private_dir

    where = key_directory()
    if where is None:
        return None
    path = os.path.join(where, KEEP_DIR)
    for own in (where, path):
        _private_again(own)
    return open_private_dir(path, create=create, private_from=2)


def _private_again(path: str) -> None:
    """Take access for group and others off the directory ``path`` if this uid owns it
    (reached without following a last symbolic link; anything else is left to
    open_private_dir to refuse)."""
    import stat

    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        info = os.fstat(fd)
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(info.st_mode) & 0o700)
    except OSError:
        pass
    finally:
        os.close(fd)


def _no_keep_directory() -> None:
    """Without the keep directory no run keeps anything. But one that is there and cannot
    be trusted (a directory above it writable by others, which a tool may have made so:
    chmod) hides whether a running run keeps the file being read: refused."""
    from ..linux.statedir import key_directory, not_private

    where = key_directory()
    path = None if where is None else os.path.join(where, KEEP_DIR)
    if path is not None and os.path.lexists(path):
        raise ChangedByARun(0, "cannot tell whether a running sandlock run keeps it: "
                               f"{not_private(path)}; make it so (chmod go-w the directories "
                               "above it)", path)


def own_file(fd: int) -> bool:
    """Whether the keep directory's file ``fd`` is this uid's (no other could have made
    it, unless the directory was open to others a moment)."""
    return os.fstat(fd).st_uid == os.geteuid()


def is_held(directory: int, name: str) -> bool:
    """Whether a run keeps the path of the copy ``name`` now (its ``.held`` locked)."""
    import fcntl

    try:
        held = os.open(f"{name}.held", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(held)


class ChangedByARun(OSError):
    """A file read while a running run keeps it (or a directory around it), which is not
    what it was before that run began: its tool may have written it."""


class Reading:
    """Around the read of a file (its descriptor ``fd``, opened by the absolute name
    ``named`` if known): the ``.lock`` of each directory above the file, by the name it
    was opened by and by the name the kernel gives it now (a link followed, a file renamed
    or removed since), and of those names themselves, taken shared where a run ever kept
    one, so that no run begins keeping one of them meanwhile (runs keeping one already go
    on); then :meth:`check` of what was read."""

    def __init__(self, fd: int, named: Optional[str] = None) -> None:
        #: (kept path, copy name, lock, the file's paths under it)
        self._locks: list[tuple[str, str, int, list[str]]] = []
        self._names: list[str] = []
        if named is not None and named.startswith("/"):
            self._names.append(os.path.normpath(named))
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""  # no /proc: the name it was opened by still counts
        if real.endswith(" (deleted)"):  # removed since it was opened: the name it had
            real = real[:-len(" (deleted)")]
        if real.startswith("/") and real not in self._names:
            self._names.append(real)
        self._directory = keep_directory() if self._names else None
        if self._names and self._directory is None:
            _no_keep_directory()  # none: no run keeps anything; one not private: refused

    def __enter__(self) -> "Reading":
        import fcntl

        directory = self._directory
        if directory is None:
            return self
        under: dict[str, list[str]] = {}
        for name in self._names:
            path = name
            while True:
                under.setdefault(path, []).append(os.path.relpath(name, path))
                if path == "/":
                    break
                path = os.path.dirname(path)
        for path, relatives in under.items():
            copy = copy_name(path)
            try:
                lock = os.open(f"{copy}.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=directory)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(lock, fcntl.LOCK_SH)  # a run deciding holds it a moment
            except BaseException:
                os.close(lock)
                raise
            self._locks.append((path, copy, lock, relatives))
        return self

    def __exit__(self, *exc: object) -> None:
        for _, _, lock, _ in self._locks:
            os.close(lock)
        self._locks = []
        if self._directory is not None:
            os.close(self._directory)
            self._directory = None

    def check(self, data: bytes, name: str) -> None:
        """ChangedByARun if ``data``, read from the file, is not what the file was, under
        each of its names, before the running runs that keep it (or a directory around
        it) began."""
        for kept, copy, _, relatives in self._locks:
            if self._directory is None or not is_held(self._directory, copy):
                continue
            if any(differs(self._directory, copy, rel, data) for rel in relatives):
                raise ChangedByARun(0, f"it is not what it was when a running sandlock run "
                                       f"began keeping {kept!r} (its tool may have changed it; "
                                       "it is put back when that run ends): run this again "
                                       "then", name)


def differs(directory: int, name: str, rel: str, data: bytes) -> bool:
    """Whether ``data`` is not the file at ``rel`` (``.``: the kept path itself) in what the
    kept path of the copy ``name`` was before the runs keeping it (its stored copy, as
    :mod:`sandlock.undo.keep` writes it: ``(mode, node)``, a node ``("f", mode, content,
    attributes)`` or ``("d", mode, {name: node}, attributes)``). A file that was not there
    then, or was none, differs; so does a copy that cannot be read, or that another uid
    made."""
    import marshal

    try:
        with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory),
                  "rb") as stored:
            if not own_file(stored.fileno()):
                return True
            _, node = marshal.loads(stored.read(MAX_COPY))
    except (OSError, ValueError, EOFError, TypeError):
        return True
    for part in [] if rel == "." else rel.split("/"):
        if not isinstance(node, tuple) or node[0] != "d":
            return True
        node = node[2].get(part)
    return not isinstance(node, tuple) or node[0] != "f" or node[2] != data
