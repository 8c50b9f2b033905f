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


def mounts(mountinfo: str) -> tuple[Optional[str], Optional[str]]:
    """(cgroup2 mount point, cgroup v1 mount point of the pids controller) from
    /proc/self/mountinfo's text (https://docs.kernel.org/filesystems/proc.html)."""
    v2 = v1 = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3 or fields[3] != "/":  # a bind mount of a sub-cgroup: not a root
            continue
        point = fields[4].replace("\\040", " ")
        if after[0] == "cgroup2" and v2 is None:
            v2 = point
        elif after[0] == "cgroup" and "pids" in after[2].split(",") and v1 is None:
            v1 = point
    return v2, v1


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


def _join(mount: str, relative: str) -> str:
    return os.path.normpath(mount + "/" + relative.lstrip("/"))


def _gives_pids(directory: str) -> bool:
    return "pids" in _read(os.path.join(directory, "cgroup.subtree_control")).split()


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK)


def choose(mountinfo: str, cgroup: str) -> tuple[Optional[Base], str]:
    """The base for this caller, or None and why not. Pure but for reading and access
    checks of the cgroup files named by its two arguments."""
    v2_mount, v1_mount = mounts(mountinfo)
    v2_path, v1_path = own_cgroups(cgroup)
    reasons = []
    if v1_mount is not None and v1_path is not None:
        own = _join(v1_mount, v1_path)
        if _writable(own):
            return Base(1, own, v1_path), ""
        reasons.append(f"{own} (cgroup v1 pids) is not writable by this user")
    if v2_mount is not None and v2_path is not None and "pids" in _read(
            os.path.join(v2_mount, "cgroup.controllers")).split():
        own = _join(v2_mount, v2_path)
        if _gives_pids(own) and _writable(own):
            return Base(2, own, v2_path), ""
        parent, parent_rel = os.path.dirname(own), os.path.dirname(v2_path.rstrip("/")) or "/"
        if (v2_path.rstrip("/") and _gives_pids(parent) and _writable(parent)
                and _writable(os.path.join(parent, "cgroup.procs"))):
            return Base(2, parent, parent_rel), ""
        reasons.append(f"neither this process's cgroup {own} nor its parent gives the pids "
                       "controller to a child this user may create and move processes into")
    elif v1_mount is None:
        reasons.append("no cgroup hierarchy has the pids controller")
    return None, "; ".join(reasons)


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
