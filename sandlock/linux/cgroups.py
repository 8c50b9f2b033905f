"""Per-run pids cgroups: ``[limits] processes`` as a limit of the sandbox, root included.

RLIMIT_NPROC binds neither root nor the sandbox (it counts every process of the
user). A pids cgroup counts exactly the processes placed in it and their
descendants, whoever they run as: https://docs.kernel.org/admin-guide/cgroup-v2.html#pid
(v1: https://docs.kernel.org/admin-guide/cgroup-v1/pids.html).

:func:`find` looks, once per process, for a directory where this caller may create
a child cgroup with the pids controller (:class:`Base`): root on a writable
hierarchy, or a delegated subtree the user owns. Each run then gets its own
:class:`Group` (``sandlock-<pid>-<random>`` below the base, ``pids.max`` = the
limit); the confined child moves itself into it by writing ``0`` to the group's
``cgroup.procs`` (an fd opened here, in the parent) as its first step after fork, so
everything it and its descendants do is counted. At the end of the run the group is
killed (``cgroup.kill`` on cgroup v2, else each member by pidfd) and removed.

cgroup v2's "no internal processes" rule: a cgroup that holds processes cannot
give controllers to its children (https://docs.kernel.org/admin-guide/cgroup-v2.html
#no-internal-process-constraint). The caller's own cgroup holds the caller, so a v2
base is either the caller's cgroup when it already gives ``pids`` to its children
(only the root cgroup can hold processes and do so) or its parent when that gives
``pids`` to its children and lets this caller move processes out of its own cgroup
(write access to the parent's ``cgroup.procs``: a delegated subtree, or root).
sandlock never moves the caller nor changes ``cgroup.subtree_control``.
"""

from __future__ import annotations

import os
import signal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

#: The per-run cgroups' name prefix (sandlock-<launcher pid>-<random>).
PREFIX = "sandlock-"
ENV_NO_CGROUP = "SANDLOCK_NO_CGROUP"  #: "1": behave as if no cgroup could be created (tests)


class CgroupError(OSError):
    """A per-run cgroup could not be created, joined or removed."""


class Base:
    """A directory where per-run pids cgroups can be created (cgroup ``version`` 1 or 2).

    ``relative`` is its path as /proc/PID/cgroup shows it (used to check that a
    process belongs to a group before signalling it).
    """

    __slots__ = ("version", "path", "relative")

    def __init__(self, version: int, path: str, relative: str) -> None:
        self.version = version
        self.path = path
        self.relative = relative

    def __repr__(self) -> str:
        return f"Base(version={self.version}, path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Base) and (self.version, self.path, self.relative) == (
            other.version, other.path, other.relative)

    def wire(self) -> tuple[int, str, str]:
        """As plain data, for the fork server's requests and sandlock-exec's ``-p``."""
        return (self.version, self.path, self.relative)


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def _unescape(field: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` space, ``\\011`` tab,
    ``\\012`` newline, ``\\134`` backslash) decoded."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


class Mount:
    """A cgroup mount from /proc/self/mountinfo: ``version`` 1 (a v1 hierarchy with the
    pids controller) or 2; ``point`` where it is mounted; ``root`` the cgroup shown at
    ``point``, as a path in this process's cgroup namespace (``/`` for a whole
    hierarchy; ``/libpod_parent/...`` for a container's bind mount of its own cgroup;
    ``/..`` above the namespace root); ``readonly`` mounted read-only."""

    __slots__ = ("version", "point", "root", "readonly")

    def __init__(self, version: int, point: str, root: str, readonly: bool) -> None:
        self.version, self.point, self.root, self.readonly = version, point, root, readonly

    def place(self, cgroup: str) -> Optional[str]:
        """The directory of ``cgroup`` (a /proc/self/cgroup path) in this mount, or None
        when the mount does not show it (it shows another cgroup, or its root lies
        outside this cgroup namespace and cannot be placed)."""
        if ".." in self.root.split("/"):
            return None
        root = self.root.rstrip("/")
        if cgroup != self.root and not cgroup.startswith(root + "/"):
            return None
        return os.path.normpath(self.point + "/" + cgroup[len(root):].lstrip("/"))

    def shows(self) -> str:
        """How it is named in a reason."""
        ro = ", read-only" if self.readonly else ""
        kind = "cgroup v1 pids hierarchy" if self.version == 1 else "cgroup2 hierarchy"
        return f"the {kind} mounted at {self.point} (root {self.root}{ro})"

    def names(self, path: str) -> str:
        """``path``, a directory of this mount, named with the mount."""
        return self.shows() if path == self.point else f"{path} in {self.shows()}"


def cgroup_mounts(mountinfo: str) -> list[Mount]:
    """The cgroup2 mounts and the cgroup v1 mounts of the pids controller in
    /proc/self/mountinfo's text (https://docs.kernel.org/filesystems/proc.html, 3.5:
    ``id parent dev root point options [optional...] - type source super-options``)."""
    found = []
    for line in mountinfo.splitlines():
        before, sep, after_text = line.partition(" - ")
        fields, after = before.split(), after_text.split()
        if not sep or len(fields) < 6 or len(after) < 3:
            continue
        if after[0] == "cgroup2":
            version = 2
        elif after[0] == "cgroup" and "pids" in after[2].split(","):
            version = 1
        else:
            continue
        readonly = "ro" in fields[5].split(",") or "ro" in after[2].split(",")
        found.append(Mount(version, _unescape(fields[4]), _unescape(fields[3]), readonly))
    return found


def own_cgroups(text: str) -> tuple[Optional[str], Optional[str]]:
    """(v2 path, v1 pids path) of this process, from /proc/self/cgroup's text."""
    v2 = v1 = None
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path
        elif "pids" in controllers.split(","):
            v1 = path
    return v2, v1


def _gives_pids(directory: str) -> bool:
    return "pids" in _read(os.path.join(directory, "cgroup.subtree_control")).split()


def _writable(path: str, mount: Optional[Mount] = None) -> bool:
    """Whether this caller may write ``path`` (root too is refused by a read-only mount)."""
    return not (mount is not None and mount.readonly) and os.access(path, os.W_OK)


def _not_writable(mount: Mount, path: str) -> str:
    """Why this caller cannot create a cgroup in ``path`` (a directory of ``mount``)."""
    if mount.readonly:
        return (f"{mount.names(path)} is read-only: a container's default cgroup mount "
                "(run the container with --privileged, or give it a writable cgroup mount)")
    try:
        owner = os.stat(path).st_uid
    except OSError as exc:
        return f"{mount.names(path)}: {exc.strerror}"
    return (f"{mount.names(path)} is owned by uid {owner} and not writable by uid "
            f"{os.geteuid()}: not delegated to this user (a delegated cgroup is one chowned "
            "to the user, with its cgroup.procs)")


def _outside(mount: Mount, cgroup: str) -> str:
    if ".." in mount.root.split("/"):
        return (f"{mount.shows()} was mounted outside this process's cgroup namespace: "
                f"its cgroup {cgroup} cannot be placed in it")
    return f"{mount.shows()} does not contain this process's cgroup {cgroup}"


def _choose_v1(mounts: list[Mount], own: str) -> tuple[Optional[Base], list[str]]:
    """cgroup v1 has no internal-process rule: the base is this process's own cgroup,
    in the first mount that shows it writable."""
    reasons = []
    for mount in mounts:
        where = mount.place(own)
        if where is None:
            reasons.append(_outside(mount, own))
        elif _writable(where, mount):
            return Base(1, where, own), []
        else:
            reasons.append(_not_writable(mount, where))
    return None, reasons


def _choose_v2(mount: Mount, own: str) -> tuple[Optional[Base], list[str]]:
    where = mount.place(own)
    if where is None:
        return None, [_outside(mount, own)]
    offered = _read(os.path.join(mount.point, "cgroup.controllers")).split()
    if "pids" not in offered:
        return None, [f"{mount.shows()} does not offer the pids controller (cgroup.controllers: "
                      f"{' '.join(offered) or 'none'}; on a host with cgroup v1 the pids "
                      "controller is bound to a v1 hierarchy)"]
    if _gives_pids(where):
        if _writable(where, mount):
            return Base(2, where, own), []
        return None, [_not_writable(mount, where)]
    why = (f"this process's cgroup, {mount.names(where)}, does not give the pids "
           "controller to its children (cgroup.subtree_control)")
    parent_rel = os.path.dirname(own.rstrip("/")) or "/"
    parent = mount.place(parent_rel) if own.rstrip("/") else None
    if parent is None:
        if own.rstrip("/") == "":
            why += (": it is the root of this cgroup namespace (a container's own cgroup), "
                    "and cgroup v2 lets a cgroup that holds processes give no controller to "
                    "its children; move the container's processes into a child cgroup (e.g. "
                    "/init) and write +pids to cgroup.subtree_control, or start the container "
                    "with a delegated cgroup (sandlock never moves processes nor changes "
                    "cgroup.subtree_control)")
        else:
            why += "; its parent is outside the mount"
        return None, [why]
    if not _gives_pids(parent):
        return None, [why + f"; nor does its parent {parent}"]
    for path in (parent, os.path.join(parent, "cgroup.procs")):
        if not _writable(path, mount):
            return None, [why + "; its parent gives it, but " + _not_writable(mount, path)]
    return Base(2, parent, parent_rel), []


def choose(mountinfo: str, cgroup: str) -> tuple[Optional[Base], str]:
    """The base for this caller, or None and why not. Pure but for reading and access
    checks of the cgroup files named by its two arguments.

    A mount's root need not be ``/``: a container sees its own cgroup bind-mounted
    (cgroup v1: mountinfo root ``/libpod_parent/...``) or the root of its cgroup
    namespace; this process's cgroup is placed through that root."""
    mounts = cgroup_mounts(mountinfo)
    v2_path, v1_path = own_cgroups(cgroup)
    reasons = []
    v1_mounts = [m for m in mounts if m.version == 1]
    if v1_path is not None:
        if not v1_mounts:
            reasons.append(f"this process is in the pids cgroup {v1_path} of a cgroup v1 "
                           "hierarchy (/proc/self/cgroup) that is not mounted here")
        base, why = _choose_v1(v1_mounts, v1_path)
        if base is not None:
            return base, ""
        reasons += why
    elif v1_mounts:
        reasons.append("a cgroup v1 pids hierarchy is mounted but /proc/self/cgroup names no "
                       "pids cgroup of this process")
    if v1_path is None or not v1_mounts:
        v2_mounts = [m for m in mounts if m.version == 2]
        if v2_path is None or not v2_mounts:
            if not reasons:
                reasons.append("no cgroup hierarchy has the pids controller (no cgroup v1 pids "
                               "hierarchy or cgroup2 hierarchy is mounted and named in "
                               "/proc/self/cgroup)")
        for mount in v2_mounts:
            base, why = _choose_v2(mount, v2_path or "/")
            if base is not None:
                return base, ""
            reasons += why
    return None, "; ".join(dict.fromkeys(reasons))


_found: Optional[tuple[int, Optional[Base], str]] = None


def find() -> tuple[Optional[Base], str]:
    """Where this process may create per-run pids cgroups (cached per process): the base,
    or None and the reason."""
    global _found
    if _found is None or _found[0] != os.getpid():
        if os.environ.get(ENV_NO_CGROUP) == "1":
            base, why = None, f"{ENV_NO_CGROUP}=1"
        else:
            base, why = choose(_read("/proc/self/mountinfo"), _read("/proc/self/cgroup"))
        _found = (os.getpid(), base, why)
    return _found[1], _found[2]


def sweep(base: Base) -> None:
    """Remove the empty per-run groups below ``base`` whose creator is gone (a launcher,
    supervisor or spare killed before it could remove its own): no group outlives
    its run for longer than the next run's start. A group that still holds a
    process, or whose creator's pid is alive (or reused), is left alone."""
    try:
        names = os.listdir(base.path)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        creator = name[len(PREFIX):].partition("-")[0]
        if not creator.isdigit() or int(creator) == os.getpid():
            continue
        try:
            os.kill(int(creator), 0)
            continue  # alive (or its pid reused): not ours to judge
        except PermissionError:
            continue
        except OSError:
            pass
        try:
            os.rmdir(os.path.join(base.path, name))  # EBUSY while it holds a process
        except OSError:
            pass


class Group:
    """One run's pids cgroup. ``procs_fd`` is its ``cgroup.procs`` (close-on-exec): the
    child writes ``0`` to it to move itself in. :meth:`close` kills what is left and
    removes the group."""

    def __init__(self, base: Base, limit: int) -> None:
        self.base = base
        sweep(base)
        name = f"{PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        self.path = os.path.join(base.path, name)
        self.relative = base.relative.rstrip("/") + "/" + name
        self.procs_fd = -1
        try:
            os.mkdir(self.path, 0o755)
        except OSError as exc:
            raise CgroupError(exc.errno, f"cannot create the pids cgroup {self.path}: "
                                         f"{exc.strerror}") from None
        try:
            with open(os.path.join(self.path, "pids.max"), "w") as handle:
                handle.write(str(limit))
            self.procs_fd = os.open(os.path.join(self.path, "cgroup.procs"),
                                    os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._remove()
            raise CgroupError(exc.errno, f"cannot set up the pids cgroup {self.path}: "
                                         f"{exc.strerror}") from None

    def __repr__(self) -> str:
        return f"Group({self.path!r})"

    def members(self) -> list[int]:
        return [int(p) for p in _read(os.path.join(self.path, "cgroup.procs")).split()]

    def kill(self) -> None:
        """SIGKILL every process of the group, until none is left.

        cgroup v2 (5.14+): one write to ``cgroup.kill``, which the kernel applies to
        every member and to any fork racing with it. Otherwise each member by pidfd,
        checked to still be in the group after its pidfd was opened (so a pid reused
        by a process elsewhere is never signalled); a member's children forked
        meanwhile are seen on the next round, and a fork bomb cannot outgrow
        ``pids.max`` in between.
        """
        if self.base.version == 2:
            try:
                with open(os.path.join(self.path, "cgroup.kill"), "w") as handle:
                    handle.write("1")
            except OSError:
                pass
        line = f":{self.relative}\n"
        for _ in range(10000):
            pids = self.members()
            if not pids:
                return
            for pid in pids:
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    if line in _read(f"/proc/{pid}/cgroup"):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except OSError:
                    pass
                finally:
                    os.close(pidfd)
            os.sched_yield()

    def close(self) -> None:
        """Kill what is left and remove the group (idempotent)."""
        if self.procs_fd >= 0:
            os.close(self.procs_fd)
            self.procs_fd = -1
        if self.path:
            self.kill()
            self._remove()

    def _remove(self) -> None:
        for _ in range(1000):
            try:
                os.rmdir(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno == 16:  # EBUSY: a member still exiting
                    self.kill()
                    os.sched_yield()
                    continue
            break
        self.path = ""
