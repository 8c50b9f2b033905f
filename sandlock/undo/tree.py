"""The trees of a run's write grants, read, copied and written back through descriptors.

Everything here reaches a file from an open directory one component at a time with
``O_NOFOLLOW`` (a symbolic link is an object to record, never a way to somewhere
else), opens files ``O_NONBLOCK`` (a FIFO cannot hang sandlock) and decides on
``fstat`` of what it opened. A tree is described by a *manifest*: relative path ->
entry (``k`` kind: ``d`` directory, ``f`` regular file, ``l`` symbolic link, ``p``
FIFO, ``o`` device or socket; ``m`` permission bits; ``s`` size; ``t`` atime and
mtime in ns; ``key`` the object's identity and change stamp; ``h`` SHA-256 of a
file's content; ``l`` a link's target).

``key`` is (inode, ctime, mtime, size, mode, links): the kernel sets ctime on every
change of content or metadata and no process can set it (utimensat(2) sets only
atime and mtime), so an object whose key is unchanged is unchanged. Before the tool
starts, :func:`settle` waits until the coarse clock has moved past the last copy's
ctime, so a change in the same clock tick cannot leave the stamp as it was.

:func:`sync` makes a tree what a manifest says, from a source tree whose content is
verified against the manifest's digests: check, stage, then commit (see its docstring
for what is atomic).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

from ..errors import SandlockError
from ..trace.emit import printable
from . import xattrs

Entry = dict[str, Any]
Manifest = dict[str, Entry]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: ioctl_ficlone(2): share the source's extents (btrfs, XFS, bcachefs); EOPNOTSUPP elsewhere.
FICLONE = 0x40049409
CHUNK = 1 << 20
#: Directories nested deeper than this are refused (a descriptor and a stack frame each).
MAX_DEPTH = 256
#: clock_gettime(2)'s CLOCK_REALTIME_COARSE (Python names it on some builds only): the
#: clock inode timestamps are taken from.
CLOCK_REALTIME_COARSE = 5
#: Mode bits a tool's file never brings into the original tree (a tool owns the files it
#: creates and can set them; apply would hand them to the user).
PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID


class UndoError(SandlockError):
    """A dry run, apply, discard, checkpoint or rollback could not be done (nothing was
    changed unless the message says otherwise)."""

    stage = "undo"


class Conflict(UndoError):
    """The tree changed since the run: applying or rolling back would lose that change."""


def key(info: os.stat_result) -> list[int]:
    return [info.st_ino, info.st_ctime_ns, info.st_mtime_ns, info.st_size, info.st_mode,
            info.st_nlink]


def kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISLNK(mode):
        return "l"
    if stat.S_ISFIFO(mode):
        return "p"
    return "o"


def entry(info: os.stat_result) -> Entry:
    return {"k": kind(info.st_mode), "m": stat.S_IMODE(info.st_mode),
            "s": info.st_size if stat.S_ISREG(info.st_mode) else 0,
            "t": [info.st_atime_ns, info.st_mtime_ns], "key": key(info)}


def attributes_of(item: Entry) -> xattrs.Attributes:
    """The extended attributes recorded for an entry (:mod:`sandlock.undo.xattrs`)."""
    return xattrs.decoded(item.get("x"))


def _note_attributes(item: Entry, target: xattrs.Target) -> xattrs.Attributes:
    """Record in ``item`` the attributes of the file or directory ``target``; them."""
    found = xattrs.read(target)
    if found:
        item["x"] = xattrs.encoded(found)
    return found


def _note_directory(item: Entry, parent: int, name: str, info: os.stat_result,
                    rel: str) -> None:
    """:func:`_note_attributes` for the directory ``name`` in ``parent`` (the root when
    ``rel`` is empty), held by a descriptor that needs no permission on it."""
    if not rel:
        _note_attributes(item, parent)
        return
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) != (info.st_dev, info.st_ino):
            raise UndoError(f"{rel!r} changed while it was read")
        _note_attributes(item, xattrs.held(fd))
    finally:
        os.close(fd)


def open_root(path: str) -> int:
    """A descriptor of directory ``path`` (the last component not a link)."""
    try:
        return os.open(path, _DIR)
    except OSError as exc:
        raise UndoError(f"cannot open {path!r} as a directory: {exc.strerror}") from None


def opened_root(path: str) -> tuple[int, Optional[int]]:
    """:func:`open_root`; where the directory's mode refuses this uid and the uid owns it
    (a tool may chmod its own workspace), opened with read, write and search added for
    the moment (:func:`_open_owned`): the mode to put back once done, else None."""
    try:
        return _open_owned(None, path, _DIR, 0o700)
    except OSError as exc:
        raise UndoError(f"cannot open {path!r} as a directory: {exc.strerror}") from None


def closed_as(item: Entry, mode: int) -> None:
    """Record ``item`` (a directory :func:`opened_root` opened) with the ``mode`` it had."""
    item["m"] = mode
    item["key"][4] = stat.S_IFMT(item["key"][4]) | mode


def _names(fd: int) -> list[str]:
    with os.scandir(fd) as listing:
        return sorted(item.name for item in listing)


def _open_owned(parent: Optional[int], name: str, flags: int,
                need: int) -> tuple[int, Optional[int]]:
    """``name`` in ``parent`` opened with ``flags`` (never through a link), and None; or,
    where its mode refuses that and this uid owns it, opened with the ``need`` bits added
    to its mode for the moment, and the mode to put back (os.fchmod) once done with it.

    A tool may chmod whatever its uid owns (no Landlock right covers it): a mode it left
    must not make what it did unreadable, so that it could never be listed, applied or
    rolled back."""
    try:
        return os.open(name, flags, dir_fd=parent), None
    except PermissionError:
        pass
    held = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        info = os.fstat(held)
        if info.st_uid != os.geteuid() or not (stat.S_ISDIR(info.st_mode)
                                               or stat.S_ISREG(info.st_mode)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
        mode = stat.S_IMODE(info.st_mode)
        proc = f"/proc/self/fd/{held}"  # the object held: no name to swap
        os.chmod(proc, mode | need)
        try:
            return os.open(proc, flags & ~os.O_NOFOLLOW), mode
        except BaseException:
            os.chmod(proc, mode)
            raise
    finally:
        os.close(held)


def _subdir(parent: int, name: str, info: os.stat_result, where: str) -> tuple[int, Optional[int]]:
    """``name`` in ``parent`` opened as the directory lstat found there (not a mount), and
    the mode to put back once its subtree is walked (see :func:`_open_owned`), or None."""
    sub, mode = _open_owned(parent, name, _DIR, 0o500)
    got = os.fstat(sub)
    if (got.st_dev, got.st_ino) != (info.st_dev, info.st_ino):
        _put_back(sub, mode)
        os.close(sub)
        raise UndoError(f"{where!r} changed while it was read")
    return sub, mode


def _put_back(fd: int, mode: Optional[int]) -> None:
    if mode is not None:
        os.fchmod(fd, mode)


def walk(root: int, prefix: str = "") -> Iterator[tuple[str, int, str, os.stat_result]]:
    """(relative path, parent descriptor, name, lstat) of everything below ``root``,
    each directory before what it holds; what a directory :func:`is_deep` holds is not
    walked (it is a whole). A mount point below is refused: another filesystem is not
    the tree."""
    device = os.fstat(root).st_dev
    for name in _names(root):
        info = os.stat(name, dir_fd=root, follow_symlinks=False)
        rel = prefix + name
        yield rel, root, name, info
        if stat.S_ISDIR(info.st_mode):
            if info.st_dev != device:
                raise UndoError(f"{rel!r} is another filesystem mounted in the tree")
            if is_deep(rel):
                continue
            sub, mode = _subdir(root, name, info, rel)
            try:
                yield from walk(sub, rel + "/")
            finally:
                try:
                    _put_back(sub, mode)
                finally:
                    os.close(sub)


def is_deep(rel: str) -> bool:
    """A directory at ``rel`` is nested too deep for what it holds to be recorded: a
    tool's ``mkdir -p`` may go on for ever. It is recorded as a whole, never applied,
    and removed as a whole by a rollback."""
    return (rel + "/").count("/") > MAX_DEPTH


def _check_depth(prefix: str) -> None:
    if prefix.count("/") > MAX_DEPTH:
        raise UndoError(f"{printable(prefix[:200])}...: directories nested deeper than "
                        f"{MAX_DEPTH} levels are not supported")


def digest_of(fd: int) -> str:
    sha = hashlib.sha256()
    offset = 0
    while True:
        data = os.pread(fd, CHUNK, offset)
        if not data:
            return sha.hexdigest()
        sha.update(data)
        offset += len(data)


def _transfer(src: int, dst: int, hashing: bool) -> Optional[str]:
    """Copy ``src`` into the empty ``dst`` (a reflink where the filesystem has them);
    the SHA-256 of what was copied when ``hashing``."""
    import fcntl

    try:
        fcntl.ioctl(dst, FICLONE, src)
        return digest_of(src) if hashing else None
    except OSError:
        pass
    sha = hashlib.sha256() if hashing else None
    if sha is None:
        try:
            while os.copy_file_range(src, dst, 1 << 30):
                pass
            return None
        except OSError:  # EXDEV on old kernels, EINVAL on some filesystems: copy by hand
            os.lseek(src, 0, os.SEEK_SET)
            os.lseek(dst, 0, os.SEEK_SET)
            os.ftruncate(dst, 0)
    while True:
        data = os.read(src, CHUNK)
        if not data:
            return None if sha is None else sha.hexdigest()
        if sha is not None:
            sha.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(dst, view):]


def copy_tree(src: int, dst: int, hashing: bool, prefix: str = "") -> tuple[Manifest, int]:
    """Copy the tree below ``src`` into the empty directory ``dst``: content (reflinked
    where possible), permission bits, atime and mtime; links as links; FIFOs made anew;
    devices and sockets recorded, not copied (``skip``). The manifest of ``src`` (each
    entry with ``c``, the copy's key, and ``h`` when ``hashing``) and the newest ctime
    of a copy (:func:`settle`)."""
    _check_depth(prefix)
    out: Manifest = {}
    newest = 0
    if not prefix:
        out[""] = entry(os.fstat(src))
        _note_attributes(out[""], src)
    device = os.fstat(src).st_dev
    for name in _names(src):
        info = os.stat(name, dir_fd=src, follow_symlinks=False)
        rel = prefix + name
        item = out[rel] = entry(info)
        what = item["k"]
        if what == "d":
            if info.st_dev != device:
                raise UndoError(f"{rel!r} is another filesystem mounted in the tree")
            os.mkdir(name, 0o700, dir_fd=dst)
            sub_src, mode = _subdir(src, name, info, rel)
            try:
                sub_dst = os.open(name, _DIR, dir_fd=dst)
                try:
                    inner, last = copy_tree(sub_src, sub_dst, hashing, rel + "/")
                    out.update(inner)
                    newest = max(newest, last)
                    _put_back(sub_src, mode)
                    mode = None
                    xattrs.write(sub_dst, _note_attributes(item, sub_src))
                    os.fchmod(sub_dst, item["m"])
                    os.utime(sub_dst, ns=tuple(item["t"]))
                    item["c"] = key(os.fstat(sub_dst))
                finally:
                    os.close(sub_dst)
            finally:
                try:
                    _put_back(sub_src, mode)
                finally:
                    os.close(sub_src)
        elif what == "f":
            item["h"], item["c"] = _copy_file(src, dst, name, info, hashing, rel, item)
        elif what == "l":
            item["l"] = os.readlink(name, dir_fd=src)
            os.symlink(item["l"], name, dir_fd=dst)
            os.utime(name, ns=tuple(item["t"]), dir_fd=dst, follow_symlinks=False)
            item["c"] = key(os.stat(name, dir_fd=dst, follow_symlinks=False))
        elif what == "p":
            os.mkfifo(name, item["m"], dir_fd=dst)
            os.chmod(name, item["m"], dir_fd=dst)
            os.utime(name, ns=tuple(item["t"]), dir_fd=dst)
            item["c"] = key(os.stat(name, dir_fd=dst, follow_symlinks=False))
        else:
            item["skip"] = True
            continue
        newest = max(newest, item["c"][1])
    if not prefix:  # the root last: copying into it changed its times
        xattrs.write(dst, attributes_of(out[""]))
        os.fchmod(dst, out[""]["m"])
        os.utime(dst, ns=tuple(out[""]["t"]))
        out[""]["c"] = key(os.fstat(dst))
        newest = max(newest, out[""]["c"][1])
    return out, newest


def _copy_file(src: int, dst: int, name: str, info: os.stat_result, hashing: bool,
               rel: str, item: Entry) -> tuple[Optional[str], list[int]]:
    fd, mode = _open_owned(src, name, _FILE, 0o400)
    try:
        _put_back(fd, mode)
        got = os.fstat(fd)
        if not stat.S_ISREG(got.st_mode) or got.st_ino != info.st_ino:
            raise UndoError(f"{rel!r} changed while it was copied")
        out = os.open(name, _NEW, 0o600, dir_fd=dst)
        try:
            digest = _transfer(fd, out, hashing)
            xattrs.write(out, _note_attributes(item, fd))
            os.fchmod(out, stat.S_IMODE(got.st_mode))
            os.utime(out, ns=(got.st_atime_ns, got.st_mtime_ns))
            return digest, key(os.fstat(out))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def settle(newest_ctime: int) -> None:
    """Return once the kernel's coarse clock (the one ctime is taken from) has passed
    ``newest_ctime``: a later change then gets a later ctime (see the module docstring)."""
    while time.clock_gettime_ns(CLOCK_REALTIME_COARSE) <= newest_ctime:
        time.sleep(0.002)


def scan(root: int, reference: Manifest, field: str) -> Manifest:
    """The manifest of ``root`` now, each entry marked ``same`` when its key equals
    ``reference[rel][field]``; the content of every other regular file is hashed
    (``h``), so what is applied later is what was seen now."""
    out: Manifest = {}
    for rel, parent, name, info in _with_root(root):
        item = out[rel] = entry(info)
        base = reference.get(rel)
        item["same"] = base is not None and base.get(field) == item["key"]
        if item["k"] == "d" and rel and is_deep(rel):
            item["deep"] = True  # what it holds is not in the manifest
            item["same"] = False
        if item["k"] == "l":
            item["l"] = os.readlink(name, dir_fd=parent) if rel else ""
        elif item["k"] == "d" and not item["same"]:
            _note_directory(item, parent, name, info, rel)
        elif item["k"] == "f" and not item["same"]:
            fd, mode = _open_owned(parent, name, _FILE, 0o400)
            try:
                if mode is not None:  # its mode put back: its stamp is the one after
                    os.fchmod(fd, mode)
                    moved = key(os.fstat(fd))
                    if moved[0] != item["key"][0] or moved[2:] != item["key"][2:]:
                        raise UndoError(f"{rel!r} changed while it was read")
                    item["key"] = moved
                if key(os.fstat(fd)) != item["key"]:
                    raise UndoError(f"{rel!r} changed while it was read")
                item["h"] = digest_of(fd)
                _note_attributes(item, fd)
            finally:
                os.close(fd)
    return out


def open_up(root: int, files: bool) -> dict[str, int]:
    """Give this uid read, write and search of every directory (and with ``files``, read
    of every regular file) that it owns below ``root``, the root included, and lacks
    them: a tool may have chmod-ed them so that sandlock could not read or change what
    it did. The modes changed, by path (to put back, or to record as the tool's)."""
    changed: dict[str, int] = {}
    for rel, parent, name, info in _with_root(root):
        is_dir = stat.S_ISDIR(info.st_mode)
        need = 0o700 if is_dir else 0o400 if files and stat.S_ISREG(info.st_mode) else 0
        mode = stat.S_IMODE(info.st_mode)
        if mode & need == need or info.st_uid != os.geteuid():
            continue
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent) if rel \
            else os.dup(root)
        try:
            got = os.fstat(fd)
            if (got.st_dev, got.st_ino) != (info.st_dev, info.st_ino):
                raise UndoError(f"{printable(rel)!r} changed while it was read")
            os.chmod(f"/proc/self/fd/{fd}", mode | need)  # the object held: no name to swap
        finally:
            os.close(fd)
        changed[rel] = mode
    return changed


def _with_root(root: int) -> Iterator[tuple[str, int, str, os.stat_result]]:
    yield "", root, "", os.fstat(root)
    yield from walk(root)


def conflicts(root: int, expect: Manifest, limit: int = 10,
              root_mode: Optional[int] = None) -> list[str]:
    """What differs between the tree below ``root`` and ``expect`` (by key), at most
    ``limit`` lines; ``root_mode``: the root's mode before :func:`opened_root` opened it."""
    out = []
    seen = set()
    for rel, _, _, info in _with_root(root):
        seen.add(rel)
        base = expect.get(rel)
        if base is None:
            out.append(f"{printable(rel)} was created")
        elif not rel and root_mode is not None and not (
                base["key"][0] == info.st_ino and stat.S_IMODE(base["key"][4]) == root_mode):
            out.append(". was changed")
        elif (rel or root_mode is None) and not _same_object(base, info):
            out.append(f"{printable(rel or '.')} was changed")
        if len(out) >= limit:
            return out
    out += [f"{printable(rel)} was removed" for rel in expect if rel not in seen]
    return out[:limit]


def _same_object(base: Entry, info: os.stat_result) -> bool:
    """``info`` is the object ``base`` recorded, unchanged. A directory's times and ctime
    are left out: what it holds is compared entry by entry, and a failed write-back
    (a temporary file made, then removed) must not turn into a conflict."""
    now = key(info)
    if stat.S_ISDIR(info.st_mode):
        return bool(base["key"][0] == now[0] and base["key"][4] == now[4])
    return bool(base["key"] == now)


def _parent(cache: dict[str, int], root: int, rel: str) -> tuple[int, str]:
    """The descriptor of ``rel``'s directory (opened component by component, without
    following a link, kept in ``cache``) and its last component."""
    head, _, name = rel.rpartition("/")
    if head in cache:
        return cache[head], name
    fd = root if not head else os.open(head.rpartition("/")[2], _DIR,
                                       dir_fd=_parent(cache, root, head)[0])
    cache[head] = fd
    return fd, name


def refusal(rel: str, want: Entry, links: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why an object a tool left in its scratch at ``rel`` (as recorded: ``want``) is never
    written back into the original tree, or None: a FIFO, device or socket; a set-user-
    or set-group-ID bit; a symbolic link that leads out of the tree (``links``: every
    link of the tree as it will be, :func:`links_of`, whose targets it is walked through);
    a file with another name (a hard link, perhaps to a file outside the tree)."""
    what = want["k"]
    if want.get("deep"):
        return f"a directory nested deeper than {MAX_DEPTH} levels (what it holds was not recorded)"
    if what in ("p", "o"):
        return "a FIFO, device or socket"
    if want["m"] & PRIVILEGE_BITS:
        return "a set-user-ID or set-group-ID bit"
    if what == "l" and not _inside(rel, want.get("l", ""), links or {}):
        return f"a symbolic link leading out of the tree ({want.get('l', '')!r})"
    if what == "f" and want["key"][5] != 1:
        return "a file with more than one hard link"
    return None


def links_of(manifest: Manifest) -> dict[str, str]:
    """The symbolic links of a tree: where each lies, and its target."""
    return {rel: entry.get("l", "") for rel, entry in manifest.items() if entry["k"] == "l"}


def escapes(before: Manifest, after: Manifest) -> list[str]:
    """The links that stay as they were but lead out of the tree once it is ``after``
    (a link the tool made on their way), where they stayed inside as it was ``before``."""
    old, new = links_of(before), links_of(after)
    return [f"{printable(rel)}: the symbolic link ({target!r}) would lead out of the tree "
            "through a link the tool made" for rel, target in new.items()
            if old.get(rel) == target and _inside(rel, target, old)
            and not _inside(rel, target, new)]


#: Links followed in one walk before it counts as leading out (the kernel's limit).
MAX_LINKS = 40


def check_source(source: int, rel: str, want: Entry, field: str, tool_made: bool,
                 cache: dict[str, int], links: Mapping[str, str]) -> Optional[str]:
    """Why ``rel`` of the source tree may not be written back as ``want``, or None.
    ``tool_made``: the source is a tool's scratch (apply): :func:`refusal` too, its links
    walked through ``links``."""
    if tool_made:
        why = refusal(rel, want, links)
        if why is not None:
            return why
    if want["k"] not in ("f", "l"):
        return None
    try:
        parent, name = _parent(cache, source, rel)
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    if not unchanged(info, want, field):
        return "changed since the run ended"
    return None


def unchanged(info: os.stat_result, want: Entry, field: str) -> bool:
    """The object is the one recorded at the end of the run (its stamp: :func:`key`)."""
    return key(info) == want.get(field)


def _inside(rel: str, target: str, links: Mapping[str, str]) -> bool:
    """A link at ``rel`` to ``target`` resolves inside the tree, walked as the kernel walks
    it: through the tree's other ``links`` (a ``..`` after one goes up from its target),
    never above the root. A name the tree does not hold is taken as a directory."""
    if not target or target.startswith("/"):
        return False
    where = rel.split("/")[:-1]  # the link's directory
    pending = target.split("/")
    pending.reverse()  # a stack: the next component is last
    followed = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not where:
                return False
            where.pop()
            continue
        here = "/".join([*where, part])
        if here in links:
            followed += 1
            target = links[here]
            if followed > MAX_LINKS or not target or target.startswith("/"):
                return False
            pending += reversed(target.split("/"))
            continue
        where.append(part)
    return True


def sync(target: int, expect: Manifest, writes: Sequence[tuple[str, Entry]],
         deletes: Sequence[str], source: int, field: str, tool_made: bool,
         root_mode: Optional[int] = None) -> None:
    """Make the tree below ``target`` what ``writes`` and ``deletes`` say.

    1. Check: the tree is exactly ``expect`` (else :class:`Conflict`); every object
       written comes from ``source`` unchanged since recorded (its key is ``want[field]``),
       and passes :func:`check_source`.
    2. Stage: new directories are made; each file is copied from ``source`` into a
       temporary name beside its target, its SHA-256 compared with the record's, its mode
       and times set; links are made under temporary names. Any failure removes what was
       staged: the tree is as before.
    3. Commit: each staged object is renamed over its name (rename(2): atomic per file),
       then deleted objects are removed (deepest first), then directories get their mode
       and times. The whole is not atomic: a failure here (a full disk cannot happen, as
       the data is written; a concurrent change can) leaves a part applied, and says so.
    """
    found = conflicts(target, expect, root_mode=root_mode)
    if found:
        raise Conflict("the tree changed since the run: " + "; ".join(found))
    # A rollback writes into directories the tool may have left closed to this uid: they
    # get the recorded modes at the end (those it made are removed); any other, its own.
    opened = {} if tool_made else open_up(target, files=False)
    src_cache: dict[str, int] = {"": source}
    dst_cache: dict[str, int] = {"": target}
    made: list[tuple[int, str]] = []
    staged: list[tuple[int, str, str]] = []
    gone = set(deletes)
    final = {rel: entry for rel, entry in expect.items() if rel not in gone}
    final.update(writes)  # the tree as it will be
    links = links_of(final)
    try:
        refused = escapes(expect, final) if tool_made else []
        for rel, want in writes:
            why = check_source(source, rel, want, field, tool_made, src_cache, links)
            if why is not None:
                refused.append(f"{printable(rel)}: {printable(why)}")
            old = expect.get(rel)
            if tool_made and old is not None and old.get("skip"):
                refused.append(f"{printable(rel)}: a device or socket in the tree, not copied "
                               "to the dry run: not replaced")
            if rel and old is not None and old["k"] != want["k"] and "d" in (old["k"], want["k"]):
                refused.append(f"{printable(rel)}: changed between a directory and a file "
                               "(not supported)")
        if refused:
            raise UndoError("refusing to write back: " + "; ".join(refused[:10]))
        ordered = sorted(writes, key=lambda pair: (pair[0].count("/"), pair[0]))
        for rel, want in ordered:
            if want["k"] == "d" and rel and rel not in expect:
                parent, name = _parent(dst_cache, target, rel)
                os.mkdir(name, 0o700, dir_fd=parent)
                made.append((parent, name))
        for rel, want in ordered:
            if want["k"] in ("f", "l", "p"):
                parent, name = _parent(dst_cache, target, rel)
                staged.append((parent, name, _stage(source, rel, want, parent, src_cache)))
    except BaseException:
        for parent, _, temp in staged:
            _quietly(os.unlink, temp, parent)
        for parent, name in reversed(made):
            _quietly(os.rmdir, name, parent)
        for head, fd in dst_cache.items():  # their times, as they were
            if head in expect:
                _quietly(os.utime, fd, ns=tuple(expect[head]["t"]))
        _close(src_cache, source)
        _close(dst_cache, target)
        _close_again(target, opened)
        raise
    _close(src_cache, source)
    try:
        _commit(target, dst_cache, staged, writes, deletes, expect)
    except (OSError, UndoError) as exc:
        raise UndoError(f"partly written back ({exc}); the rest of the tree is as it was") from None
    finally:
        _close(dst_cache, target)
        written = {rel for rel, want in writes if want["k"] == "d"} | set(deletes)
        _close_again(target, {rel: mode for rel, mode in opened.items() if rel not in written})


def _close_again(target: int, opened: Mapping[str, int]) -> None:
    """Put back the modes :func:`open_up` changed (deepest first), where they still are."""
    cache: dict[str, int] = {"": target}
    try:
        for rel in sorted(opened, key=lambda r: (-r.count("/"), r)):
            try:
                if rel:
                    parent, name = _parent(cache, target, rel)
                    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
                    try:
                        os.chmod(f"/proc/self/fd/{fd}", opened[rel])
                    finally:
                        os.close(fd)
                else:
                    os.fchmod(target, opened[rel])
            except OSError:
                pass  # gone, or never to be reached again: nothing to put back
    finally:
        _close(cache, target)


def _stage(source: int, rel: str, want: Entry, parent: int,
           src_cache: dict[str, int]) -> str:
    temp = f".sandlock-{os.urandom(6).hex()}.tmp"
    if want["k"] == "l":
        os.symlink(want["l"], temp, dir_fd=parent)
        os.utime(temp, ns=tuple(want["t"]), dir_fd=parent, follow_symlinks=False)
        return temp
    if want["k"] == "p":
        os.mkfifo(temp, 0o600, dir_fd=parent)
        os.chmod(temp, want["m"], dir_fd=parent)
        os.utime(temp, ns=tuple(want["t"]), dir_fd=parent)
        return temp
    src_parent, name = _parent(src_cache, source, rel)
    fd = os.open(name, _FILE, dir_fd=src_parent)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UndoError(f"{rel!r} is no longer a regular file")
        out = os.open(temp, _NEW, 0o600, dir_fd=parent)
        try:
            if not same_content(_transfer(fd, out, hashing=True), want):
                raise UndoError(f"{rel!r}: its content is not what was recorded (changed "
                                "since the run, or tampered with)")
            xattrs.write(out, attributes_of(want))  # none taken from the directory's ACL
            os.fchmod(out, want["m"])
            os.utime(out, ns=tuple(want["t"]))
        except BaseException:
            os.close(out)
            os.unlink(temp, dir_fd=parent)
            raise
        os.close(out)
    finally:
        os.close(fd)
    return temp


def same_content(digest: Optional[str], want: Entry) -> bool:
    """What was copied is what the record says (a snapshot or scratch file changed since
    the run, by a later tool or anyone, is refused)."""
    import hmac

    return digest is not None and hmac.compare_digest(digest, want.get("h") or "")


def _commit(target: int, cache: dict[str, int], staged: list[tuple[int, str, str]],
            writes: Sequence[tuple[str, Entry]], deletes: Sequence[str],
            expect: Manifest) -> None:
    for parent, name, temp in staged:
        os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
    for rel in sorted(deletes, key=lambda r: (-r.count("/"), r)):
        parent, name = _parent(cache, target, rel)
        if expect.get(rel, {}).get("deep"):
            remove_tree(parent, name)
        elif expect.get(rel, {}).get("k") == "d":
            os.rmdir(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
    for rel, want in sorted(writes, key=lambda pair: (-pair[0].count("/"), pair[0])):
        if want["k"] != "d":
            continue
        if rel:
            parent, name = _parent(cache, target, rel)
            fd = os.open(name, _DIR, dir_fd=parent)
        else:
            fd = os.dup(target)
        try:
            xattrs.write(fd, attributes_of(want))
            os.fchmod(fd, want["m"])
            os.utime(fd, ns=tuple(want["t"]))
        finally:
            os.close(fd)


def _close(cache: dict[str, int], keep: int) -> None:
    for fd in cache.values():
        if fd != keep:
            _quietly(os.close, fd)
    cache.clear()


def _quietly(call: Any, *args: Any, **named: Any) -> None:
    try:
        if len(args) == 2:
            call(args[0], dir_fd=args[1])
        else:
            call(*args, **named)
    except OSError:
        pass


def remove_tree(parent: int, name: str) -> None:
    """Remove ``name`` in ``parent`` and everything below it, never following a link; one
    directory open at a time and no recursion (a tool's tree may be nested any depth).

    Each step back up opens "..", which is wherever the directory is now: a tool writing
    the tree meanwhile (another run of it) may have moved it, and the climb would go on
    above ``parent``. So each step up must reach the directory it came down from (its
    device and inode, noted on the way down), or the removal stops (UndoError)."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    below = [name]  # the names from ``parent`` down to the directory ``fd`` is
    fd, _ = _open_owned(parent, name, _DIR, 0o700)
    came_from = [_identity(fd)]  # each directory of ``below``, as it was entered
    try:
        while True:
            os.fchmod(fd, 0o700)  # a tool may leave a directory unwritable
            inner = None
            for child in _names(fd):
                if stat.S_ISDIR(os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode):
                    inner = child
                    break
                os.unlink(child, dir_fd=fd)
            if inner is not None:
                sub, _ = _open_owned(fd, inner, _DIR, 0o700)
                os.close(fd)
                fd = sub
                below.append(inner)
                came_from.append(_identity(fd))
                continue
            done = below.pop()
            came_from.pop()
            if not below:
                break
            up = os.open("..", _DIR, dir_fd=fd)
            os.close(fd)
            fd = up
            if _identity(fd) != came_from[-1]:
                raise UndoError(f"{'/'.join([*below, done])!r} moved while it was removed (something "
                                "else writes the tree): the removal stopped there")
            os.rmdir(done, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _open_file(root: int, rel: str, cache: dict[str, int]) -> Optional[int]:
    """``rel`` below ``root`` opened as a file (never through a link, never blocking), or
    None if it cannot be."""
    try:
        parent, name = _parent(cache, root, rel)
        return os.open(name, _FILE, dir_fd=parent)
    except OSError:
        return None


def digest_at(root: int, rel: str, expect: list[int], cache: dict[str, int]) -> Optional[str]:
    """The SHA-256 of regular file ``rel`` below ``root`` if its key is still ``expect``."""
    fd = _open_file(root, rel, cache)
    if fd is None:
        return None
    try:
        if key(os.fstat(fd)) != expect:
            return None
        return digest_of(fd)
    finally:
        os.close(fd)


def read_at(root: int, rel: str, limit: int, cache: dict[str, int]) -> Optional[bytes]:
    """Up to ``limit`` bytes of regular file ``rel`` below ``root`` (never through a link,
    never blocking), or None if it is not one."""
    fd = _open_file(root, rel, cache)
    if fd is None:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def close_all(cache: dict[str, int], keep: int) -> None:
    _close(cache, keep)
