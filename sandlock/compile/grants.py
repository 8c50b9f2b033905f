"""Policy paths resolved once, to descriptors, and what no tool may ever write.

Two rules keep one tool from weakening the sandbox of a later one (README, "Threat
model"):

1. **A grant means the object that was checked.** Each policy path is resolved here,
   one component at a time with ``O_PATH | O_NOFOLLOW``, to the descriptor that the
   Landlock rule is made from; every check (is it ``/proc``? does it reach sandlock's
   state?) is made on that resolution, never on a path string opened again later.
   A symbolic link is followed only where no tool can have planted it: directly in
   ``/`` or in a system directory (:data:`SYSTEM_DIRS`), the directory owned by root
   and writable by no one else, the link itself owned by root. Anywhere else the
   grant is refused and the link named, since a tool with write access to its
   directory (in this policy or in another) could point it at ``~/.ssh`` or ``/``.
2. **Nothing sandlock trusts later is writable by a tool.** A write grant is refused
   when it is, contains, or lies inside: sandlock's state directories (every place a
   later run may look for them), the policy files this run was built from, sandlock's
   installation (its package, the Python it runs on, the single-file binary and its
   unpacked program), a directory of its import path (a planted module, package or
   ``.pth`` file would run in the next launcher). Directories under the system
   directories cannot be granted write, since rule 1 trusts the links there.
   Where the cache's key is a file (:mod:`sandlock.compile.cachekey`), a grant of
   any right that reaches it is refused too (:class:`SecretCheck`).

Facts about the objects come from ``fstat`` of descriptors; ancestors are found by
walking ``..`` from a descriptor, so a symlinked home cannot hide that a grant
reaches a protected directory. A second mount of a protected tree (a bind mount of
the venv below a workspace) is found from the mount table: each protected object and
each grant is placed in its filesystem, and a mount that shows one is located by
descriptor (see :class:`Mount`).
"""

from __future__ import annotations

import os
import sys
from stat import S_ISDIR, S_ISLNK, S_ISREG

from .. import PACKAGE_DIR
from ..errors import LandlockError, SandlockError, SetupError
from ..linux import kernel
from ..policy.readfile import read_bounded
from . import reviewdirs

TYPE_CHECKING = False  # typing costs milliseconds on every `sandlock run`
if TYPE_CHECKING:
    from typing import Any, Iterable, Iterator, Optional, Sequence

    #: A state directory as _check_state compares grants with it: (its name, its real
    #: name, its own id or None, the ids above it), found once per compile, not per grant.
    State = tuple[str, str, Optional[tuple[int, int]], set[tuple[int, int]]]

#: Directories whose symbolic links are followed (with "/" itself, not recursively):
#: root-owned system locations no policy may grant write on a directory of.
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
#: Paths no policy may grant write access to, nor anything beneath the last two.
FORBIDDEN_WRITE = ("/", "/proc", "/sys")
MAX_LINKS = 40  # as the kernel's path walk (ELOOP)
_WALK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC

#: Environment variables the single-file binary's stub sets for the program it runs:
#: its own path and the state directory it unpacked into (scripts/persistent_stub.c).
ENV_STUB = "SANDLOCK_STUB"
ENV_STATE = "SANDLOCK_STATE_DIR"


class GrantError(SandlockError):
    """A policy path that cannot be granted as it stands (exit code 125).

    ``path`` is the policy's path as written (after variables); the caller that knows
    the policy line turns this into a PolicyError naming file, line and key.
    """

    stage = "policy"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path!r}: {reason}")
        self.path = path
        self.reason = reason


class Resolved:
    """One policy path resolved to an ``O_PATH`` descriptor (close it with :meth:`close`).

    ``canonical`` is its location without symbolic links; ``chain`` the (device, inode)
    of every directory from ``/`` down to the object itself, included.
    """

    __slots__ = ("fd", "canonical", "chain", "is_dir")

    def __init__(self, fd: int, canonical: str, chain: tuple[tuple[int, int], ...],
                 is_dir: bool) -> None:
        self.fd = fd
        self.canonical = canonical
        self.chain = chain
        self.is_dir = is_dir

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def in_system_dir(canonical: str) -> bool:
    """Whether ``canonical`` is one of :data:`SYSTEM_DIRS` or lies below one."""
    return any(canonical == d or canonical.startswith(d + "/") for d in SYSTEM_DIRS)


def _trusted_link(directory: str, dir_fd: int, link: os.stat_result) -> bool:
    if not (directory == "/" or in_system_dir(directory)):
        return False
    info = os.fstat(dir_fd)
    return info.st_uid == 0 and not info.st_mode & 0o022 and link.st_uid == 0


def _untrusted(what: str, target: str, directory: str, dir_fd: int,
               link: os.stat_result) -> str:
    """Why a link :func:`_trusted_link` refused is not followed, naming the real cause:
    where it is, or which owner or mode of its system directory (or of the link) fails.
    A container whose root file system belongs to its user is the usual case: ``/``
    owned by that user lets a tool running as the user rename ``/lib`` and plant a link
    in its place."""
    head = f"{what} is a symbolic link (to {target!r})"
    tail = ("; sandlock follows links only in system directories owned by root and "
            "writable by no one else, so that a planted link cannot redirect a grant")
    if not (directory == "/" or in_system_dir(directory)):
        return (f"{head} in a directory a tool may be able to write{tail}: name the link's "
                "target instead")
    info = os.fstat(dir_fd)
    if info.st_uid != 0:
        why = (f"{directory!r} is owned by uid {info.st_uid}, not root: a process running as "
               f"uid {info.st_uid} (a tool, when sandlock runs as that user, as in a container "
               f"whose root file system belongs to its user) can rename or replace the link")
        fix = f"make root own {directory!r} (chown root {directory}), or name the link's target"
    elif info.st_mode & 0o022:
        why = (f"{directory!r} is writable by its group or by others (mode "
               f"{info.st_mode & 0o7777:04o}): any of them can replace the link")
        fix = f"chmod go-w {directory}, or name the link's target"
    else:
        why = f"the link is owned by uid {link.st_uid}, not root: its owner can replace it"
        fix = "make root own the link, or name its target"
    return f"{head} in {directory!r}, and {why}{tail}: {fix} instead"


def resolve(path: str) -> Resolved:
    """Open ``path`` (absolute) as :class:`Resolved`, following only trusted links.

    Raises GrantError for an untrusted link or a loop, OSError (from the kernel, its
    ``filename`` the whole path) for a missing component or one that is not a directory.
    """
    try:
        return _resolve(path)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, path) from None


def _resolve(path: str, untrusted: Optional[list[tuple[str, int]]] = None,
             climbed: Optional[list[tuple[str, int]]] = None) -> Resolved:
    """:func:`resolve`; with ``untrusted``, a link it would refuse is followed instead,
    and its location and a descriptor of its directory appended there; with ``climbed``,
    each directory a ``..`` leaves, and a descriptor of the parent it goes to."""
    parts = [p for p in path.split("/") if p]
    parts.reverse()  # a stack: the next component is last
    fd = os.open("/", _DIR)
    root = os.fstat(fd)
    chain = [(root.st_dev, root.st_ino)]
    canon: list[str] = []
    links = 0
    info = root
    try:
        while parts:
            name = parts.pop()
            if name == ".":
                continue
            if name == "..":
                if canon:
                    parent = os.open("..", _DIR, dir_fd=fd)
                    os.close(fd)
                    fd = parent
                    if climbed is not None:
                        climbed.append(("/" + "/".join(canon), os.dup(parent)))
                    canon.pop()
                    chain.pop()
                    info = os.fstat(fd)
                continue
            step = os.open(name, _WALK, dir_fd=fd)
            try:
                info = os.fstat(step)
                if S_ISLNK(info.st_mode):
                    here = "/" + "/".join(canon)
                    target = os.readlink("", dir_fd=step)
                    links += 1
                    if untrusted is not None and not _trusted_link(here, fd, info):
                        untrusted.append((os.path.join(here, name), os.dup(fd)))
                    elif not _trusted_link(here, fd, info):
                        shown = os.path.join(here, name)
                        what = "it" if shown == path else repr(shown)
                        raise GrantError(path, _untrusted(what, target, here, fd, info))
                    if links > MAX_LINKS:
                        raise GrantError(path, "too many levels of symbolic links")
                    parts.extend(reversed([p for p in target.split("/") if p]))
                    if target.startswith("/"):
                        os.close(fd)
                        fd = os.open("/", _DIR)
                        canon.clear()
                        del chain[1:]
                    info = os.fstat(fd)
                    os.close(step)  # the link itself: its target is walked instead
                    continue
            except BaseException:
                os.close(step)
                raise
            os.close(fd)
            fd = step
            canon.append(name)
            chain.append((info.st_dev, info.st_ino))
            if parts and not S_ISDIR(info.st_mode):
                raise NotADirectoryError(20, "Not a directory", "/" + "/".join(canon))
    except BaseException:
        os.close(fd)
        raise
    return Resolved(fd, "/" + "/".join(canon), tuple(chain), S_ISDIR(info.st_mode))


# ----------------------------------------------------------------------------
# What sandlock trusts later


def _password_home() -> Optional[str]:
    """The euid's home directory in the password database, or None."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_dir
    except (ImportError, KeyError):
        return None


def _state_dirs() -> list[str]:
    """Every place a later run (the CLI, the API, the binary) may keep its state: this
    environment's (reviewdirs.state_path, the cache's own definition), and the homes'."""
    homes = [os.environ.get("HOME", ""), _password_home() or ""]
    bases = [os.path.join(h, ".cache") for h in homes if os.path.isabs(h)]
    out = [os.path.dirname(reviewdirs.state_path("x"))]
    out += [os.path.join(os.path.normpath(b), "sandlock") for b in bases]
    from .cachekey import RootsUnreadable, known_roots, open_private_dir

    try:  # those of other environments' runs; not one that is a link now (sandlock
        # keeps no state through one: its target, "/" even, would be refused every grant)
        out += [r for r in known_roots(open_private_dir) if not os.path.islink(r)]
    except RootsUnreadable as exc:
        raise Unjudgeable(f"the list of sandlock's state directories: {exc.strerror}") from None
    stub_state = os.environ.get(ENV_STATE, "")
    if os.path.isabs(stub_state):
        out.append(stub_state)
    from .logdir import exposed as run_log

    out += [where for where, _ in run_log()]  # SANDLOCK_LOG=DIR: its chain is the state too
    return out


def protected(policy_files: Iterable[str],
              modules: Optional[dict[tuple[int, int], str]] = None) -> list[tuple[str, str]]:
    """(path, what it is) for everything a later run trusts, each path once (the first
    reason kept). A write grant on it, above it or inside it is refused. Paths may be
    missing: a grant that covers where one would be created is refused as well.
    ``modules``: :func:`_module_files`, when the caller has it already.

    Inside a directory of the import path too: a tool that may write ``E/json`` (or
    ``E/sitecustomize``) of an entry ``E`` makes it a package by adding ``__init__.py``,
    which the next launcher imports instead of the standard library's (or at start-up)."""
    out = [(p, "sandlock's state directory") for p in _state_dirs()]
    out += [(p, "a policy file this run is built from") for p in policy_files]
    out.append((PACKAGE_DIR, "sandlock's installation"))
    for prefix in dict.fromkeys((sys.prefix, sys.exec_prefix, sys.base_prefix)):
        out.append((prefix, "the Python installation sandlock runs on"))
    if sys.executable:
        out.append((os.path.realpath(sys.executable), "the Python interpreter sandlock runs on"))
    if sys.pycache_prefix:  # PYTHONPYCACHEPREFIX, -X pycache_prefix
        out.append((os.path.abspath(sys.pycache_prefix), "where this interpreter keeps the "
                    "bytecode of sandlock's modules (PYTHONPYCACHEPREFIX: a .pyc planted there "
                    "would run in the next launcher)"))
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        out.append((bundle, "the single-file binary's unpacked program"))
    stub = os.environ.get(ENV_STUB, "")
    if os.path.isabs(stub):
        out.append((stub, "the single-file sandlock binary"))
    # Where the modules this process runs were loaded from (_ancestry opens each through
    # its links; the module files themselves are checked by WriteCheck, by inode).
    loaded = {os.path.dirname(f) for f in (modules or _module_files()).values()}
    out += [(d, "a directory sandlock's own modules were loaded from") for d in sorted(loaded)]
    entries = list(sys.path)
    try:
        import site

        if site.ENABLE_USER_SITE and site.USER_SITE:
            entries.append(site.USER_SITE)
        entries += _pth_directories(site)
    except ImportError:  # pragma: no cover - a frozen build without site
        pass
    for entry in dict.fromkeys(entries):
        if entry and not os.path.isabs(entry) and not os.path.exists(entry):
            continue  # a path hook's marker (editable installs), not a directory
        where = os.path.abspath(entry or ".")
        hint = "" if entry else "; `python -m sandlock` and `python -c` put the working directory there"
        out.append((where, "a directory on sandlock's import path (a module planted there "
                    f"would run in the next launcher{hint})"))
    unique: dict[str, str] = {}
    for where, what in out:
        unique.setdefault(where, what)
    return list(unique.items())


def _pth_directories(site: Any) -> list[str]:
    """Every directory a .pth file of a site directory names, whether it exists or not:
    the next interpreter puts it on its import path once it exists (``site`` skips it
    until then), so a tool that may create it could plant a module there."""
    if sys.flags.no_site:
        return []
    out = []
    for directory, names in _pth_files(site):
        for name in names or ():
            try:
                with open(os.path.join(directory, name), encoding="utf-8",
                          errors="surrogateescape") as handle:
                    lines = handle.read(MAX_PTH).splitlines()
            except OSError:
                continue
            for line in lines:  # as site.addpackage reads them
                if line.startswith("#") or line.startswith(("import ", "import\t")):
                    continue
                line = line.rstrip()
                if line:
                    out.append(os.path.abspath(os.path.join(directory, line)))
    return out


#: The most of a .pth file read (site reads it whole; one larger is no path list).
MAX_PTH = 1 << 20


def _pth_files(site: Any) -> list[tuple[str, Optional[list[str]]]]:
    """Each site directory the interpreter reads .pth files from (its own, and the user's
    while it uses that), with the sorted names of those files (None: it cannot be listed)."""
    sites = [*site.getsitepackages(), *([site.USER_SITE] if site.ENABLE_USER_SITE else [])]
    out: list[tuple[str, Optional[list[str]]]] = []
    for directory in dict.fromkeys(d for d in sites if d):
        try:
            out.append((directory, sorted(n for n in os.listdir(directory) if n.endswith(".pth"))))
        except OSError:
            out.append((directory, None))
    return out


# ----------------------------------------------------------------------------
# Mounts: the other ways to reach what sandlock trusts
#
# A Landlock rule on a directory covers every mount below it, and a bind mount shows
# one directory of a filesystem at a second place: a mount of the venv below a granted
# workspace is the venv, though walking ``..`` from the venv never meets the workspace.
# So each protected object and each write grant is placed in its filesystem (the
# device of its superblock and its path from that filesystem's root), and a grant is
# refused when one of the trees it reaches (its own, and the root of every mount below
# it) holds a protected object or lies inside one.

MOUNTINFO = "/proc/self/mountinfo"
#: A bound on mountinfo (about 150 bytes a mount): a namespace with more mounts than
#: that is refused rather than judged from part of its table.
MAX_MOUNTINFO = 16 << 20
FS_ENCODING = sys.getfilesystemencoding()  # as os.fsdecode, without its cost per field
#: Marks a position given from this process's root rather than from its filesystem's
#: root (:func:`position`, for the mount around a chroot's root).
ROOT_FRAME = "root:"


class Mount:
    """One line of mountinfo (proc(5)): ``device`` the superblock's "major:minor",
    ``root`` the directory of that filesystem the mount shows, ``point`` where it is
    mounted in this process's view."""

    __slots__ = ("device", "root", "point")

    def __init__(self, device: str, root: str, point: str) -> None:
        self.device = device
        self.root = root
        self.point = point


class Unjudgeable(Exception):
    """What the mounts are cannot be known here (the reason): the grant is refused."""


def _unescape(field: bytes) -> str:
    r"""A mountinfo path: the kernel writes space, tab, newline and backslash as
    ``\ooo`` (octal; fs/proc_namespace.c, mangle)."""
    if b"\\" in field:
        out = bytearray()
        index = 0
        while index < len(field):
            code = field[index + 1:index + 4]
            if field[index] == 0x5C and len(code) == 3 and all(0x30 <= c <= 0x37 for c in code):
                out.append(int(code, 8))
                index += 4
            else:
                out.append(field[index])
                index += 1
        field = bytes(out)
    return field.decode(FS_ENCODING, "surrogateescape")


def read_mounts() -> dict[int, Mount]:
    """Every mount of this process's namespace, by mount id, from one bounded read."""
    data = read_mountinfo()
    if _witness is not None:
        _witness.saw_mounts(data)
    return parse_mounts(data)


def read_mountinfo() -> bytes:
    """The bytes of :data:`MOUNTINFO`, from one bounded read."""
    try:
        fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise Unjudgeable(f"cannot read {MOUNTINFO}: {exc.strerror}") from None
    try:
        data = read_bounded(fd, MAX_MOUNTINFO)
    finally:
        os.close(fd)
    if data is None:
        raise Unjudgeable(f"{MOUNTINFO} is larger than {MAX_MOUNTINFO} bytes")
    return data


def parse_mounts(data: bytes) -> dict[int, Mount]:
    """The mounts of mountinfo text ``data`` by mount id; Unjudgeable if a line is not
    as proc(5) describes it."""
    mounts = {}
    for line in data.splitlines():
        # id parent major:minor root point options [optional fields...] - type source super
        fields = line.split(b" ")
        if len(fields) < 10 or b"-" not in fields[6:] or not fields[0].isdigit():
            raise Unjudgeable(f"{MOUNTINFO} has a line sandlock cannot read: {line[:200]!r}")
        mounts[int(fields[0])] = Mount(fields[2].decode("ascii", "replace"),
                                       _unescape(fields[3]), _unescape(fields[4]))
    return mounts


def _within(inner: str, outer: str) -> bool:
    """Whether path ``inner`` is ``outer`` or lies below it (both absolute, normalised)."""
    return outer == "/" or inner == outer or inner.startswith(outer + "/")


def _join(base: str, tail: str) -> str:
    tail = tail.strip("/")
    return base if not tail else base.rstrip("/") + "/" + tail


def mount_id(fd: int) -> int:
    """The id of the mount ``fd`` is on (proc(5), /proc/pid/fdinfo)."""
    info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(info, 4096)
    finally:
        os.close(info)
    start = data.find(b"\nmnt_id:") + 8
    if start < 8:
        raise Unjudgeable(f"/proc/self/fdinfo/{fd} names no mount")
    return int(data[start:data.find(b"\n", start)])


#: What a run or call whose working directory is on a mount this process's table does not
#: show is refused with (another mount namespace's, reached through /proc/PID/cwd, or a
#: tree unmounted lazily): mounts there under a granted directory are ones no grant check
#: saw (attack round 35: the state directory, a policy file and the import path written
#: through binds of another namespace under the workspace).
FOREIGN_CWD = ("the working directory {where!r} is on a mount this process's mount table does "
               "not show (another mount namespace, or a tree unmounted): the grant checks "
               "cannot see what is mounted there; run from a directory of this namespace")
#: The mount ids seen in the table by the last check (a new mount: the table is read again).
_seen_mounts: frozenset[int] = frozenset()


def refuse_foreign_directory(path: Optional[str]) -> None:
    """Raise SetupError unless directory ``path`` (None: the working directory) is on a
    mount of this process's mount table (:data:`FOREIGN_CWD`); a path that cannot be
    opened is left to the run to report."""
    global _seen_mounts
    here = _mount_of(path or ".")
    if here is None or here in _seen_mounts:
        return
    if here == _mount_of("/"):  # a chroot's: the table lists no mount around the root
        return
    try:
        _seen_mounts = frozenset(read_mounts())
    except Unjudgeable:
        _seen_mounts = frozenset()
    if here not in _seen_mounts:
        raise SetupError(FOREIGN_CWD.format(where=path or os.environ.get("PWD", ".")))


def _mount_of(path: str) -> Optional[int]:
    """The id of the mount directory ``path`` is on; None if it cannot be opened, -1 if the
    kernel does not say."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return mount_id(fd)
    except (OSError, ValueError, Unjudgeable):
        return -1
    finally:
        os.close(fd)


def position(fd: int, mounts: dict[int, Mount]) -> tuple[str, str]:
    """(superblock, path from that filesystem's root) of the object open as ``fd``: its
    mount (from the descriptor) shows ``root`` at ``point``; the object lies below."""
    try:
        mount = mounts.get(mount_id(fd))
        here = os.readlink(f"/proc/self/fd/{fd}")
    except (OSError, ValueError) as exc:
        raise Unjudgeable(f"cannot tell which mount {fd} is on: {exc}") from None
    if mount is None and here.startswith("/"):
        # Not in mountinfo: the mount around this process's root, whose mount point lies
        # outside it (a chroot; the kernel lists only mounts reachable from the root). The
        # object is placed by its path from the root, in a frame of its own (ROOT_FRAME):
        # :func:`_reaches` compares it only with objects of that frame.
        try:
            info = os.fstat(fd)
        except OSError as exc:
            raise Unjudgeable(f"cannot tell which mount {fd} is on: {exc}") from None
        return f"{os.major(info.st_dev)}:{os.minor(info.st_dev)}", ROOT_FRAME + here
    if mount is None or not mount.root.startswith("/") or not here.startswith("/"):
        raise Unjudgeable(f"{here!r} is on a mount sandlock does not know")
    if not _within(here, mount.point):
        raise Unjudgeable(f"{here!r} does not lie below its mount point {mount.point!r}")
    return mount.device, _join(mount.root, here[len(mount.point):])


def _ancestry(path: str, mounts: dict[int, Mount],
              seen: Optional[dict[tuple[int, int], set[tuple[int, int]]]] = None) -> tuple[
        Optional[tuple[int, int]], set[tuple[int, int]], Optional[tuple[str, str]]]:
    """(the object's own id or None if missing, ids of its nearest existing directory
    and every ancestor of that, found by walking ``..`` from descriptors, and where the
    object is or would be created in its filesystem (:func:`position`)). ``seen``: as
    for :func:`_up`."""
    own = None
    probe = path
    while True:
        try:
            fd = os.open(probe, os.O_PATH | os.O_CLOEXEC)
            break
        except OSError:
            if os.path.islink(probe):
                # A link to where nothing is yet: the object would be made at its target,
                # which may lie in a granted tree (a tool could make it there).
                raise Unjudgeable(f"{probe!r}, on the way to {path!r}, is a symbolic link "
                                  "to nothing") from None
            parent = os.path.dirname(probe)
            if parent == probe:
                return None, set(), None
            probe = parent
    try:
        info = os.fstat(fd)
        if probe == path:
            own = (info.st_dev, info.st_ino)
        device, inner = position(fd, mounts)
        placed = (device, _join(inner, path[len(probe):]))
        if not S_ISDIR(info.st_mode):
            # The directory that really holds the file: the name may be a symbolic link
            # into another directory, which is the one a grant must not cover.
            real = os.readlink(f"/proc/self/fd/{fd}")
            os.close(fd)
            fd = -1
            fd = os.open(os.path.dirname(real) or "/", _DIR)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return own, _up(fd, seen), placed


def _up(fd: int, seen: Optional[dict[tuple[int, int], set[tuple[int, int]]]] = None
        ) -> set[tuple[int, int]]:
    """Ids of directory ``fd`` and of every directory above it, walking ``..`` from
    descriptors (across mount points, as the kernel's path walk and Landlock do).
    Closes ``fd``. ``seen``: the ids above each directory the walks of this check passed
    so far; a walk that reaches one of them takes them from there (the state directories
    of one user mostly share their ancestors: hundreds of walks would repeat them)."""
    ids: set[tuple[int, int]] = set()
    walked: list[tuple[int, int]] = []
    try:
        info = os.fstat(fd)
        while True:
            at = (info.st_dev, info.st_ino)
            if seen is not None and at in seen:
                ids |= seen[at]
                break
            ids.add(at)
            walked.append(at)
            try:
                parent_fd = os.open("..", _DIR, dir_fd=fd)
            except PermissionError:
                # A directory this uid cannot search: a tool of this uid may have made it
                # so (chmod is no Landlock right) and make it searchable again later, so
                # the walk goes on from its parent, opened by the path the kernel gives.
                here = os.readlink(f"/proc/self/fd/{fd}")
                parent = os.path.dirname(here)
                if not here.startswith("/") or parent == here:
                    break
                parent_fd = os.open(parent, _DIR)
            os.close(fd)
            fd = parent_fd
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) in ids:
                break
    finally:
        os.close(fd)
    if seen is not None:
        above = ids - set(walked)
        for at in reversed(walked):
            above = above | {at}
            seen[at] = above
    return ids


def _exposures(mounts: dict[int, Mount],
               protected: Sequence[tuple[str, str, Optional[tuple[str, str]]]]
               ) -> list[tuple[int, Mount, str, Optional[set[tuple[int, int]]]]]:
    """(mount id, mount, how it reaches a protected object, ids of its root and every
    directory above its mount point, or None if that mount cannot be opened at its
    mount point) for every mount that shows a protected object or lies inside one: a
    write grant on any of those directories reaches the protected object through it.
    The ids come from descriptors (the mount opened at its point, checked to be that
    mount); a mount of a file (``..`` leads nowhere from a file), a mount hidden under
    another, or one renamed away, is judged by its mount point's name instead."""
    out: list[tuple[int, Mount, str, Optional[set[tuple[int, int]]]]] = []
    for key, mount in mounts.items():
        how = _reaches(mount.device, mount.root, protected)
        if how is None:
            continue
        try:
            fd = os.open(mount.point, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            out.append((key, mount, how, None))
            continue
        try:
            here = mount_id(fd) == key and S_ISDIR(os.fstat(fd).st_mode)
        except (OSError, ValueError, Unjudgeable):
            here = False
        if not here:
            os.close(fd)
            out.append((key, mount, how, None))
            continue
        out.append((key, mount, how, _up(fd)))
    return out


def _reaches(device: str, tree: str,
             protected: Sequence[tuple[str, str, Optional[tuple[str, str]]]]) -> Optional[str]:
    """How the tree ``tree`` of the filesystem ``device`` reaches a protected object
    ((path, what, position) each), or None when it reaches none."""
    for where, what, position in protected:
        if position is None or position[0] != device:
            continue
        theirs = position[1]
        if tree.startswith(ROOT_FRAME) != theirs.startswith(ROOT_FRAME):
            # One placed from this process's root, the other from the filesystem's: the
            # root's place in its filesystem is unknown, so neither can be ruled out.
            return (f"is on the filesystem of {where!r}, {what}, and sandlock cannot place "
                    f"the two (the mount around this process's root is not in {MOUNTINFO}: "
                    "a chroot)")
        mine = tree.removeprefix(ROOT_FRAME)
        theirs = theirs.removeprefix(ROOT_FRAME)
        if not mine.startswith("/"):
            return f"shows {tree!r}, which sandlock cannot place beside {where!r}, {what}"
        if _within(theirs, mine):
            return f"shows {where!r}, {what}"
        if _within(mine, theirs):
            return f"lies inside {where!r}, {what}"
    return None


class WriteCheck:
    """Refuses write grants that reach anything a later run trusts, or a forbidden place.

    What is protected, and the mounts, are looked up once, on the first write grant
    checked."""

    #: The grants this checks, and what a tool could do through one that reaches a
    #: protected object (in the refusals).
    GRANT = "write grant"
    HARM = "change what a later sandlock run trusts"

    def __init__(self, policy_files: Iterable[str]) -> None:
        self._policy_files = tuple(policy_files)
        self._protected: Optional[list[tuple[str, str, Optional[tuple[int, int]],
                                             set[tuple[int, int]],
                                             Optional[tuple[str, str]]]]] = None
        self._mounts: dict[int, Mount] = {}
        self._exposures: list[tuple[int, Mount, str, Optional[set[tuple[int, int]]]]] = []
        self._proc = os.stat("/proc").st_dev if os.path.isdir("/proc") else None
        self._modules: dict[tuple[int, int], str] = {}
        self._hard = ""

    def check(self, path: str, got: Resolved) -> None:
        """Raise GrantError if the write grant ``path`` (resolved as ``got``) is refused."""
        real = got.canonical
        if real in FORBIDDEN_WRITE or real.startswith(("/proc/", "/sys/")) or (
                self._proc is not None and got.chain[-1][0] == self._proc):
            via = "" if real == path else f" ({path!r} resolves to it)"
            raise GrantError(path, f"write access to {real!r} is never allowed{via}")
        if got.is_dir and in_system_dir(real):
            raise GrantError(path, (
                f"write access to the directory {real!r} is never allowed: sandlock trusts the "
                f"symbolic links in system directories ({', '.join(SYSTEM_DIRS)}); grant the "
                "files the tool must change instead"))
        self.check_reach(path, got)

    def _trusted(self) -> list[tuple[str, str]]:
        self._modules = _module_files()
        return protected(self._policy_files, self._modules)

    def check_reach(self, path: str, got: Resolved) -> None:
        """Raise GrantError if ``got`` is, covers or lies inside a protected object, or
        reaches one through a mount."""
        try:
            if self._protected is None:
                self._mounts = read_mounts()
                seen: dict[tuple[int, int], set[tuple[int, int]]] = {}
                objects = [(where, what, *_ancestry(where, self._mounts, seen))
                           for where, what in self._trusted()]
                self._protected = objects + _policy_links(self._policy_files, self._mounts)
                self._hard = _hard_links(self._policy_files)
                self._exposures = _exposures(self._mounts, [(where, what, position) for
                                                            where, what, _, _, position
                                                            in self._protected])
                if _witness is not None:
                    # The links are not in it: where they are, no tool can change (a grant
                    # that could is refused now), and the mount table is in it.
                    _witness.saw_protected(objects, self._exposures)
        except Unjudgeable as exc:
            raise GrantError(path, f"{exc}: sandlock refuses a write grant whose mounts it "
                                   "cannot check") from None
        if self._hard:
            raise GrantError(path, self._hard)
        if got.chain[-1] in self._modules:
            raise GrantError(path, (
                f"this write grant is {self._modules[got.chain[-1]]!r}, a module sandlock itself "
                "runs: a tool could change what a later sandlock run executes before any sandbox"))
        for where, what, own, ancestors, _ in self._protected:
            covers = got.is_dir and got.chain[-1] in ancestors
            if covers or own is not None and own in got.chain:
                how = "covers" if covers else "lies inside"
                raise GrantError(path, (
                    f"this {self.GRANT} {how} {where!r}, {what}: a tool could {self.HARM} "
                    "and so weaken or switch off its sandbox. "
                    "Grant a narrower directory, or move that one out of the granted tree"))
        try:
            self.check_mounts(path, got)
        except Unjudgeable as exc:
            raise GrantError(path, f"{exc}: sandlock refuses a write grant whose mounts it "
                                   "cannot check") from None

    def check_mounts(self, path: str, got: Resolved) -> None:
        """Refuse ``got`` if the tree it is in its filesystem, or a mount below it, holds
        a protected object or lies inside one (the comment above :class:`Mount`)."""
        assert self._protected is not None
        device, tree = position(got.fd, self._mounts)
        how = _reaches(device, tree, [(where, what, position) for where, what, _, _, position
                                      in self._protected])
        if how is not None:
            raise GrantError(path, (
                f"this {self.GRANT}, {tree!r} of the filesystem on device {device} (through a "
                f"mount), {how}: a tool could {self.HARM} through it. Grant a directory "
                "outside it"))
        if not got.is_dir:
            return
        here = own = None
        for key, mount, how, above in self._exposures:
            if above is not None:
                below = got.chain[-1] in above
            else:  # a mount that cannot be opened where it is mounted: judged by name
                if here is None:
                    try:
                        here = os.readlink(f"/proc/self/fd/{got.fd}")
                        own = mount_id(got.fd)
                    except OSError as exc:
                        raise Unjudgeable(f"cannot tell where the grant is: {exc}") from None
                below = key != own and _within(mount.point, here)
            if below:
                raise GrantError(path, (
                    f"the mount at {mount.point!r} below this {self.GRANT} (of {mount.root!r} "
                    f"on device {mount.device}) {how}: a tool could {self.HARM} through the "
                    "mount. Unmount it, or grant a directory without such a mount"))


def named_directory() -> str:
    """The working directory as the caller reaches it: ``$PWD`` where that names it (a
    directory the caller entered through a link is reached through it again next time),
    else its real path. The native key holds it too (cache.native_key): the links it goes
    through are protected for a relative policy name, so a plan checked for one way in is
    not the plan of another."""
    here = os.environ.get("PWD", "")
    try:
        same = here.startswith("/") and os.path.samestat(os.stat(here), os.stat("."))
    except OSError:
        same = False
    return here if same else os.getcwd()


def _as_named(name: str) -> str:
    """``name`` as the caller reaches it, for a walk: made absolute from
    :func:`named_directory`; never normalised (``link/..`` is the link's target's parent, as
    the kernel walks it)."""
    if name.startswith("/"):
        return name
    return f"{named_directory()}/{name}"


def _hard_links(policy_files: Iterable[str]) -> str:
    """Why a policy file may be rewritten under another name, or empty: it has more than
    one hard link (the checks see one name; a tool that may write where another lies
    rewrites the policy the next run loads)."""
    for name in policy_files:
        try:
            links = os.stat(name).st_nlink
        except OSError:
            continue
        if links > 1:
            return (f"the policy file {name!r} has {links} hard links: a tool that may write where "
                    "another of them lies could rewrite the policy the next run loads. Keep one "
                    "link (copy the file instead)")
    return ""


def _policy_links(policy_files: Iterable[str], mounts: dict[int, Mount]) -> list[tuple[
        str, str, None, set[tuple[int, int]], Optional[tuple[str, str]]]]:
    """Each symbolic link a policy file is named through, outside the places where
    :func:`resolve` follows links, and each directory the name leaves by ``..``, as a
    protected object (see WriteCheck.check_reach): the link or directory itself (no own
    id: what lies inside it does not change where the name leads), the ids of its
    directory and of every one above, its position. A tool that may write where such a
    link lies replaces it with a policy of its own, which the next run named the same way
    would load: the checks of the file it leads to do not see the link. One that may
    write where a directory left by ``..`` lies moves it (or puts a link in its place),
    and the same ``..`` then leads into a directory of the tool's."""
    out: list[tuple[str, str, None, set[tuple[int, int]], Optional[tuple[str, str]]]] = []
    for name in policy_files:
        found: list[tuple[str, int]] = []
        climbed: list[tuple[str, int]] = []
        try:
            _resolve(_as_named(name), found, climbed).close()
        except (OSError, GrantError):
            pass  # gone or looping since it was read (the steps met so far still count)
        steps = [(where, fd, f"a symbolic link the policy file {name!r} is named through")
                 for where, fd in found]
        steps += [(where, fd, f"a directory the policy file's name {name!r} leaves by '..'")
                  for where, fd in climbed]
        for index, (where, fd, what) in enumerate(steps):
            try:
                try:
                    device, inner = position(fd, mounts)
                except BaseException:
                    os.close(fd)
                    raise
                out.append((where, what, None, _up(fd),  # _up closes fd
                            (device, _join(inner, "/" + os.path.basename(where)))))
            except BaseException:
                for _, rest, _ in steps[index + 1:]:
                    os.close(rest)
                raise
    return out


class SecretCheck(WriteCheck):
    """Refuses any grant, of any right, that reaches a secret a later run relies on: the
    cache key where it is kept in a file (:func:`sandlock.compile.cachekey.exposed`);
    reading it is enough to forge what a later run trusts. No other check: a grant
    of this kind that reaches nothing secret is the caller's to judge."""

    GRANT = "grant"
    HARM = "read it and forge what a later sandlock run trusts"

    def __init__(self, secrets: list[tuple[str, str]]) -> None:
        super().__init__(())
        self._secrets = secrets

    def _trusted(self) -> list[tuple[str, str]]:
        return self._secrets

    def check(self, path: str, got: Resolved) -> None:
        if self._secrets:  # none: nothing to look up (the mounts)
            self.check_reach(path, got)


class CopyCheck(SecretCheck):
    """Refuses any grant, of any right, that reaches another run's copy of a tool's
    files: a checkpoint's snapshot or a pending dry run's copy
    (:mod:`sandlock.compile.reviewdirs`)."""

    HARM = "read files there that only another tool's policy grants"


def _secrets() -> list[tuple[str, str]]:
    """(path, what it is) of every secret no grant may reach, now."""
    from .cachekey import exposed, records_path
    from .logdir import exposed as run_log

    key, records = exposed(), records_path()
    return run_log() + ([] if key is None else [(key, "the key that authenticates sandlock's "
                                                      "compiled-policy cache (kept in a file "
                                                      "here)")]) \
        + ([] if records is None else [(records, "the key that authenticates sandlock's run "
                                                 "log and undo records")])


def _module_files() -> dict[tuple[int, int], str]:
    """(device, inode) -> path of every module file this process has loaded
    (sitecustomize may live in /etc/python3.X, reached through a standard-library link)."""
    out = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if isinstance(name, str) and os.path.isabs(name):
            try:
                info = os.stat(name)
            except OSError:
                continue
            out[(info.st_dev, info.st_ino)] = name
    return out


# ----------------------------------------------------------------------------
# The witness: what one compile's checks saw, for the native front end
# (docs/design.md "Native front end"): it runs a stored plan only where it sees the same


class Witness:
    """What the grant checks of one compile saw, recorded from the very resolutions and
    reads they judged (a second look could see something else: a race). The native front
    end (``sandlock-run``) observes the same facts at a later run and runs the stored plan
    only when all are equal: the checks read nothing else, so their verdict stands. It
    judges nothing itself, so the rules keep one source (this module).

    ``sound`` is False when two reads of one fact differed during the compile: then no
    native entry is written."""

    def __init__(self) -> None:
        self.sound = True
        self.mountinfo: Optional[bytes] = None
        #: (path, chain, canonical, is a directory) per grant, in the plan's order
        self.grants: list[tuple[str, tuple[tuple[int, int], ...], str, bool]] = []
        #: path -> (own id, sorted ancestor ids, position), every checker's protected objects
        self.protected: dict[str, tuple[Optional[tuple[int, int]], list[tuple[int, int]],
                                        Optional[tuple[str, str]]]] = {}
        #: mount id -> (mount point, sorted ids above it, or None: judged by name)
        self.exposures: dict[int, tuple[str, Optional[list[tuple[int, int]]]]] = {}
        #: directory -> sorted names (bytes), or None: the copies' places as listed
        self.listings: dict[str, Optional[list[bytes]]] = {}
        #: What decides members of the protected set and is in no key: the euid's home in
        #: the password database and its state directory (the state directories, the
        #: records key), the cache key file's path where a grant must not reach it
        #: (cachekey.exposed), or None each; the files that decide this interpreter's
        #: import path, with their digests, and its site directories' .pth files.
        self.home: Optional[str] = None
        self.state_dir: Optional[str] = None
        self.key_file: Optional[str] = None
        #: The interpreter's real path (a link to it retargeted makes another one).
        self.interpreter: Optional[str] = None
        self.python_files: list[tuple[str, Optional[bytes]]] = []
        self.site_dirs: list[tuple[str, Optional[list[bytes]]]] = []
        try:
            from .cachekey import exposed, key_directory

            self.home, self.state_dir, self.key_file = _password_home(), key_directory(), exposed()
            self.interpreter = os.path.realpath(sys.executable) if sys.executable else None
            self.python_files, self.site_dirs = _python_world()
            from .cachekey import roots_path

            roots = roots_path()  # decides which state directories are refused too
            if roots is not None:
                self.python_files.append((roots, _digest(roots)))
        except Exception:  # noqa: BLE001 - a witness not taken: no native entry, no error
            self.sound = False

    def _same(self, old: object, new: object) -> None:
        if old is not None and old != new:
            self.sound = False

    def saw_mounts(self, data: bytes) -> None:
        self._same(self.mountinfo, data)
        self.mountinfo = data

    def saw_grant(self, path: str, got: Resolved) -> None:
        self.grants.append((path, got.chain, got.canonical, got.is_dir))

    def saw_protected(self, protected: Sequence[tuple[str, str, Optional[tuple[int, int]],
                                                      set[tuple[int, int]],
                                                      Optional[tuple[str, str]]]],
                      exposures: Sequence[tuple[int, Mount, str, Optional[set[tuple[int, int]]]]]
                      ) -> None:
        for where, _, own, ancestors, position in protected:
            fact = (own, sorted(ancestors), position)
            self._same(self.protected.get(where), fact)
            self.protected[where] = fact
        for key, mount, _, above in exposures:
            seen = (mount.point, None if above is None else sorted(above))
            self._same(self.exposures.get(key), seen)
            self.exposures[key] = seen

    def saw_listing(self, directory: str, names: Optional[Sequence[str]]) -> None:
        listed = None if names is None else sorted(os.fsencode(name) for name in names)
        if directory in self.listings:
            self._same(self.listings[directory], listed)
        self.listings[directory] = listed


def _python_world() -> tuple[list[tuple[str, Optional[bytes]]],
                             list[tuple[str, Optional[list[bytes]]]]]:
    """(files, site directories) that decide this interpreter's import path, beside the
    environment (the front end falls back on any of cache.PYTHON_ENV) and the interpreter
    (in the native key, its real path in the witness): its pyvenv.cfg (either place it
    is looked for), the ._pth and pybuilddir.txt files beside it (which replace or
    extend its path), the sitecustomize and usercustomize it ran, and each site
    directory's .pth files (a line of one adds a directory, or runs code); each file
    with the BLAKE2b of its bytes (None: missing, not a regular file, or above 1 MiB),
    each directory with its sorted .pth names (None: it cannot be listed)."""
    import site

    here = os.path.dirname(sys.executable)
    candidates = [os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")]
    version = f"python{sys.version_info[0]}{sys.version_info[1]}"
    for executable in dict.fromkeys((sys.executable, os.path.realpath(sys.executable))):
        folder, name = os.path.split(executable)
        candidates += [os.path.join(folder, f"{stem}._pth")
                       for stem in dict.fromkeys((os.path.splitext(name)[0], version))]
        candidates.append(os.path.join(folder, "pybuilddir.txt"))
    for name in ("sitecustomize", "usercustomize"):
        where = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(where, str):
            candidates.append(where)
    sites: list[tuple[str, Optional[list[bytes]]]] = []
    for directory, names in _pth_files(site):
        sites.append((directory, None if names is None else sorted(map(os.fsencode, names))))
        candidates += [os.path.join(directory, name) for name in names or ()]
    return [(path, _digest(path)) for path in dict.fromkeys(candidates)], sites


def _digest(path: str) -> Optional[bytes]:
    """The BLAKE2b of the file at ``path`` (None: missing, not a regular file, or above
    1 MiB), as the front end computes it (``same_digest``)."""
    from hashlib import blake2b

    from ..policy.readfile import MAX_BYTES

    data = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = read_bounded(fd, MAX_BYTES) if S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)
    return None if data is None else blake2b(data, digest_size=32).digest()


_witness: Optional[Witness] = None


class witnessing:
    """``with witnessing() as witness:`` records what the grant checks of the compile
    made inside it see (one compile at a time: the CLI's, which stores the plan);
    ``witnessing(False)`` records nothing (``witness`` is None)."""

    def __init__(self, on: bool = True) -> None:
        self._on = on

    def __enter__(self) -> Optional[Witness]:
        global _witness
        _witness = Witness() if self._on else None
        return _witness

    def __exit__(self, *exc: object) -> None:
        global _witness
        _witness = None


def each_rule(paths: Sequence[tuple[str, int]], write_rights: int,
              policy_files: Iterable[str]) -> Iterator[tuple[Resolved, int]]:
    """Resolve each policy path once, check it if it grants any of ``write_rights``, and
    yield it for the caller to make its Landlock rule from; its descriptor is closed when
    the caller asks for the next one (one descriptor at a time, however many paths: a
    policy may name thousands). Raises GrantError or OSError."""
    checker = WriteCheck(policy_files)
    secrets: Optional[SecretCheck] = None
    copies: Optional[CopyCheck] = None
    states: Optional[list[State]] = None
    for path, rights in paths:
        got = resolve(path)
        if _witness is not None:
            _witness.saw_grant(path, got)
        try:
            if copies is None:
                copies = CopyCheck(reviewdirs.copies(
                    [p for p, _ in paths], None if _witness is None else _witness.saw_listing))
            copies.check(path, got)
            if rights & write_rights:
                checker.check(path, got)
            else:
                if secrets is None:
                    secrets = SecretCheck(_secrets())
                secrets.check(path, got)
                if states is None:
                    try:
                        seen: dict[tuple[int, int], set[tuple[int, int]]] = {}
                        states = [_state(where, seen) for where in _state_dirs()]
                    except Unjudgeable as exc:
                        raise GrantError(path, f"{exc}: sandlock refuses every grant until "
                                               "it can read it") from None
                _check_state(path, got, states)
            yield got, rights
        finally:
            got.close()


def _state(where: str, seen: dict[tuple[int, int], set[tuple[int, int]]]) -> State:
    return (where, os.path.realpath(where), *_placed(where, seen))


def _placed(path: str, seen: Optional[dict[tuple[int, int], set[tuple[int, int]]]] = None
            ) -> tuple[Optional[tuple[int, int]], set[tuple[int, int]]]:
    """(``path``'s own id or None if missing, ids of its nearest existing directory and of
    every one above), as :func:`_ancestry` finds them, without placing it among mounts."""
    probe = path
    while True:
        try:
            fd = os.open(probe, _DIR)
            break
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None, set()
            probe = parent
    info = os.fstat(fd)
    return ((info.st_dev, info.st_ino) if probe == path else None), _up(fd, seen)


def _check_state(path: str, got: Resolved, states: Sequence[State]) -> None:
    """Refuse a read or exec grant that is, covers or lies inside a state directory: its
    cached plans and records hold other runs' policy texts, paths and ``--var`` values
    (write grants there are refused by WriteCheck, with the mounts). By ids, walking
    ``..`` from descriptors; not among mounts: a bind mount of the state directory below
    a read grant is not looked for (where the mounts cannot be placed, a chroot, every
    read grant on its filesystem would be refused)."""
    for where, real, own, ancestors in states:
        # By ids, and by the names (a directory the launcher cannot search, made so by a
        # tool of the same uid, hides the ids below it; the grant's own path is real).
        covers = got.is_dir and (got.chain[-1] in ancestors or _within(real, got.canonical))
        if covers or own is not None and own in got.chain or _within(got.canonical, real):
            raise GrantError(path, (
                f"this grant {'covers' if covers else 'lies inside'} {where!r}, sandlock's "
                "state directory: its cached plans and records hold other runs' policy texts, "
                "paths and --var values. Grant a narrower directory, or set XDG_CACHE_HOME "
                "outside the granted tree"))


def check_rules(paths: Sequence[tuple[str, int]], write_rights: int,
                policy_files: Iterable[str]) -> None:
    """Everything :func:`each_rule` checks, without making rules (explain, tests)."""
    for _ in each_rule(paths, write_rights, policy_files):
        pass


# ----------------------------------------------------------------------------
# What `sandlock probe` reports: grants that let this tool change what a later run
# executes (refused grants never get this far: they are errors)


def _exec_targets(paths: Iterable[tuple[str, str]]) -> list[tuple[str, str, tuple[tuple[int, int], ...]]]:
    out = []
    for path, origin in paths:
        try:
            got = resolve(path)
        except (OSError, GrantError):
            continue
        out.append((path, origin, got.chain))
        got.close()
    return out


def later_run_findings(writes: Sequence[tuple[str, str]], own_execs: Sequence[tuple[str, str]],
                       other_execs: Sequence[tuple[str, str]],
                       other_policies: Sequence[tuple[str, str]] = ()) -> list[str]:
    """One line per exec grant (path, origin) that a write grant of this policy covers:
    this tool could replace what that grant lets a later run execute. A program of the
    same policy then runs with this policy's rights only; one of another policy runs
    with that policy's rights, which this tool would gain."""
    dirs = []
    for path, origin in writes:
        try:
            got = resolve(path)
        except (OSError, GrantError):
            continue
        dirs.append((path, origin, got.chain[-1]))
        got.close()
    lines = []
    effects = {
        "this policy's exec grant": "later runs of this policy would execute what the tool left "
                                    "there",
        "another policy's exec grant": "a tool under this policy could plant code that runs with "
                                       "the other policy's rights",
        "another policy's file": "a tool under this policy could rewrite that policy, widening "
                                 "what its later runs may do",
    }
    for kind, targets in (("this policy's exec grant", own_execs),
                          ("another policy's exec grant", other_execs),
                          ("another policy's file", other_policies)):
        for path, origin, chain in _exec_targets(targets):
            for wpath, worigin, wid in dirs:
                if wid in chain:
                    lines.append(f"write grant {wpath!r} ({worigin}) covers {kind} {path!r} "
                                 f"({origin}): {effects[kind]}")
                    break
    return lines


def build_ruleset(abi: int, handled_fs: int, handled_net: int, scoped: int,
                  paths: Sequence[tuple[str, int]], ports: Sequence[tuple[int, int]],
                  file_only: int, write_rights: int, policy_files: Sequence[str]) -> int:
    """One Landlock ruleset fd (close-on-exec) with a rule per path and per TCP port.

    Paths are resolved by :func:`each_rule`, here in the parent, to
    the descriptors the rules are made from (so the child only calls
    landlock_restrict_self); a grant holding any of ``write_rights`` is refused there
    if it reaches what a later run trusts (GrantError). ``rights`` are those for a
    directory; a rule on a non-directory keeps only ``file_only``
    (sandlock.compile.abi.FILE_ONLY; the kernel refuses other rights on a file with EINVAL).
    Returns -1 when there is no Landlock (``abi`` < 1). Raises LandlockError.
    """
    if abi < 1:
        try:  # no rules to make, but the same checks: a refused grant is refused anyway
            for _ in each_rule(paths, write_rights, policy_files):
                pass
        except OSError as exc:
            raise LandlockError(f"cannot open {exc.filename or 'a path'!r} for a rule: "
                                f"{exc.strerror}") from None
        return -1
    try:
        fd = kernel.create_ruleset(handled_fs, handled_net, scoped)
    except OSError as exc:
        raise LandlockError(f"cannot create the Landlock ruleset: {exc.strerror}") from None
    try:
        path = ""
        try:
            for rule, (target, rights) in zip(paths, each_rule(paths, write_rights, policy_files)):
                path = rule[0]  # named in the error below
                kernel.add_path_rule(fd, target.fd, rights if target.is_dir else rights & file_only)
        except OSError as exc:
            if exc.filename is not None or not path:
                raise LandlockError(f"cannot open {exc.filename or 'a path'!r} for a rule: "
                                    f"{exc.strerror}") from None
            raise LandlockError(f"cannot add a rule for {path!r}: {exc.strerror}") from None
        for port, rights in ports:
            try:
                kernel.add_port_rule(fd, port, rights)
            except OSError as exc:
                raise LandlockError(f"cannot add a rule for TCP port {port}: "
                                    f"{exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd
