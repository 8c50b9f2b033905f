"""[limits] processes in the cgroup shapes containers give, on real mounts.

A container sees its own cgroup, not the host's hierarchy: cgroup v1 bind-mounts the
container's cgroup (mountinfo root ``/libpod_parent/...``, often read-only), a private
cgroup namespace shows a fresh mount whose root is the namespace root, and a mount made
outside the namespace has a root above it (``/..``). As root, each shape is made here
in a private mount namespace (``unshare -m``): the host's pids hierarchy is unmounted
there and the shape mounted instead, so ``cgroups.find`` sees what a container shows.
Where a cgroup can be used the limit must hold; where none can, the reason must name
the real cause. cgroup v2 with the pids controller is not to be had on a host whose
pids controller is bound to v1: its shapes are checked on planted trees.

Safety: the "container" is a pids cgroup of the test with pids.max = OUTER_MAX; the
tools fork LIMIT + 5 sleepers at most; every subprocess has a timeout.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import limit_tools
import pytest
from conftest import IS_ROOT, PYTHON, require_abi, require_private_mounts, write_policy

from sandlock.linux import cgroups

TESTS = str(Path(__file__).resolve().parent)
HOST_BASE, HOST_WHY = cgroups.find()
OUTER_MAX = 100
LIMIT = limit_tools.LIMIT
SPAWN, POLICY = limit_tools.SPAWN, limit_tools.POLICY
FIND = "from sandlock.linux import cgroups; b, why = cgroups.find(); " \
       "print(b.wire() if b else None); print(why)"

needs_v1_root = pytest.mark.skipif(
    not IS_ROOT or HOST_BASE is None or HOST_BASE.version != 1,
    reason="mounting cgroup shapes needs root and a writable cgroup v1 pids hierarchy "
           f"({HOST_WHY or 'not root'})")


def sandlock_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOCK_")}
    env["SANDLOCK_NO_CACHE"] = "1"
    return env


@pytest.fixture
def container() -> Iterator[cgroups.Group]:
    """The container's cgroup: a pids cgroup of the test below the host's hierarchy,
    capped at OUTER_MAX."""
    assert HOST_BASE is not None
    group = cgroups.Group(HOST_BASE, OUTER_MAX)
    os.close(group.procs_fd)
    group.procs_fd = -1
    path = group.path
    try:
        yield group
    finally:
        limit_tools.remove_cgroup_tree(path)
        group.path = ""


def in_shape(group: cgroups.Group, mount: str, *argv: str, cgroupns: bool = False,
             fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in ``group``, in a private mount namespace where the host's pids
    hierarchy is unmounted and ``mount`` shows instead: the container's cgroup bind-mounted
    (its root is not ``/``; read-only after a remount when ``"ro"`` is in its name), or,
    with ``fresh``, a new mount of the pids hierarchy made inside a new cgroup namespace."""
    os.makedirs(mount, exist_ok=True)
    host = HOST_BASE.path if HOST_BASE else ""
    script = [f"echo $$ > {shlex.quote(group.path)}/cgroup.procs"]
    if cgroupns:
        script.append("exec unshare -C sh -e -c " + shlex.quote(
            (f"mount -t cgroup -o pids none {shlex.quote(mount)}; " if fresh else "")
            + f"umount -l {shlex.quote(host)}; exec \"$0\" \"$@\"") + " " + shlex.join(argv))
    else:
        script.append(f"mount --bind {shlex.quote(group.path)} {shlex.quote(mount)}")
        if "ro" in os.path.basename(mount):
            script.append(f"mount -o remount,bind,ro {shlex.quote(mount)}")
        script.append(f"umount -l {shlex.quote(host)}")
        script.append("exec " + shlex.join(argv))
    require_private_mounts()
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-e", "-c",
                           "\n".join(script)], capture_output=True, text=True,
                          env=sandlock_env(), timeout=120)


def _run_limited(tmp_path: Path) -> list[str]:
    policy = write_policy(tmp_path, POLICY)
    return [sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--",
            PYTHON, "-c", SPAWN]


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "filesystem confinement")


# ----------------------------------------------------------------------------
# Real mounts (root): the shapes containers give


@needs_v1_root
def test_v1_container_cgroup_bind_mounted_is_used(tmp_path: Path,
                                                  container: cgroups.Group) -> None:
    """podman/Docker on a cgroup v1 host, writable (--privileged): mountinfo root
    /<container's cgroup>, mounted at the hierarchy's usual place."""
    mount = str(tmp_path / "pids")
    found = in_shape(container, mount, sys.executable, "-c", FIND)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines()[0] == str((1, mount, container.relative)), found.stdout
    result = in_shape(container, mount, *_run_limited(tmp_path))
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == LIMIT - 1  # the limit holds in the nested group
    assert "process limit" not in result.stderr
    assert not [n for n in os.listdir(container.path) if n.startswith(cgroups.PREFIX)]


@needs_v1_root
def test_v1_read_only_container_cgroup_names_the_cause(tmp_path: Path,
                                                       container: cgroups.Group) -> None:
    """Without --privileged the container's cgroup mount is read-only: root is refused,
    and the message says read-only, not that no hierarchy has the pids controller."""
    mount = str(tmp_path / "pids-ro")
    found = in_shape(container, mount, sys.executable, "-c", FIND)
    assert found.returncode == 0, found.stderr
    none, why = found.stdout.splitlines()
    assert none == "None" and "read-only" in why and mount in why, why
    assert "--privileged" in why and "no cgroup hierarchy" not in why
    result = in_shape(container, mount, *_run_limited(tmp_path))
    assert result.returncode == 125, result.stderr
    assert "read-only" in result.stderr and "Traceback" not in result.stderr


@needs_v1_root
def test_cgroup_namespace_with_a_mount_from_outside_names_the_cause(
        tmp_path: Path, container: cgroups.Group) -> None:
    """A new cgroup namespace that kept the host's mount: its root lies above the
    namespace (``/..``), so this process's cgroup cannot be placed in it."""
    host = HOST_BASE.path if HOST_BASE else ""
    require_private_mounts()
    kept = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-e", "-c",
         f"echo $$ > {shlex.quote(container.path)}/cgroup.procs; exec unshare -C "
         + shlex.join([sys.executable, "-c", FIND])], capture_output=True, text=True,
        env=sandlock_env(), timeout=60)
    assert kept.returncode == 0, kept.stderr
    none, why = kept.stdout.splitlines()
    assert none == "None" and "outside this process's cgroup namespace" in why, why
    assert host in why


@needs_v1_root
def test_private_cgroup_namespace_with_its_own_mount_is_used(
        tmp_path: Path, container: cgroups.Group) -> None:
    """--cgroupns=private with a writable pids mount made inside it: root ``/`` is the
    container's cgroup, and the limit holds in a group below it."""
    mount = str(tmp_path / "pids")
    found = in_shape(container, mount, sys.executable, "-c", FIND, cgroupns=True, fresh=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines()[0] == str((1, mount, "/")), found.stdout
    result = in_shape(container, mount, *_run_limited(tmp_path), cgroupns=True, fresh=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == LIMIT - 1
    assert not [n for n in os.listdir(container.path) if n.startswith(cgroups.PREFIX)]


@needs_v1_root
def test_v2_hierarchy_without_pids_names_the_cause(tmp_path: Path,
                                                   container: cgroups.Group) -> None:
    """Only a cgroup2 mount in sight, its pids controller bound to v1 elsewhere: the
    message says the v2 hierarchy does not offer pids (and that v1's is not mounted)."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    host = HOST_BASE.path if HOST_BASE else ""
    script = (f"echo $$ > {shlex.quote(container.path)}/cgroup.procs; "
              f"mount -t cgroup2 none {shlex.quote(str(v2))}; umount -l {shlex.quote(host)}; "
              + shlex.join([sys.executable, "-c", FIND]))
    require_private_mounts()
    found = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-e", "-c",
                            script], capture_output=True, text=True, env=sandlock_env(),
                           timeout=60)
    assert found.returncode == 0, found.stderr
    none, why = found.stdout.splitlines()
    assert none == "None" and "does not offer the pids controller" in why, why
    assert "not mounted here" in why and str(v2) in why


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """A directory the user can reach (pytest's are root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="sandlock-test-ctr-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_user(uid: int, argv: list[str], cwd: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "env", "-C", cwd,
            f"HOME={cwd}", *argv]


@needs_v1_root
@pytest.mark.parametrize("delegated", [True, False])
def test_v1_container_cgroup_delegated_to_a_user(user_dir: Path, container: cgroups.Group,
                                                 delegated: bool) -> None:
    """An ordinary user in a container whose cgroup (bind-mounted, root not ``/``) is
    delegated to it (chowned, with cgroup.procs): the limit holds for that user's runs.
    Not delegated: the message names the owner and says it is not delegated."""
    uid = 1001
    if delegated:
        for name in ("", "cgroup.procs", "tasks"):
            os.chown(os.path.join(container.path, name), uid, uid)
    tmp_path = user_dir
    mount = str(tmp_path / "pids")
    found = in_shape(container, mount, *_as_user(uid, [sys.executable, "-c", FIND], str(tmp_path)))
    assert found.returncode == 0, found.stderr
    base, why = found.stdout.splitlines()
    if not delegated:
        assert base == "None" and f"not writable by uid {uid}" in why and "not delegated" in why
        assert "owned by uid 0" in why
        return
    assert base == str((1, mount, container.relative)), found.stdout
    policy = write_policy(tmp_path, POLICY)
    os.chmod(policy, 0o644)
    result = in_shape(container, mount, *_as_user(uid, [
        sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--", PYTHON, "-c",
        SPAWN], str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == LIMIT - 1  # per sandbox, not RLIMIT_NPROC's per user
    assert "process limit" not in result.stderr
    assert not [n for n in os.listdir(container.path) if n.startswith(cgroups.PREFIX)]


def test_this_caller_is_told_the_real_cause() -> None:
    """On this machine as it is: root has a base; an ordinary user is told who owns the
    hierarchy and that it is not delegated (not that no hierarchy has pids)."""
    if HOST_BASE is not None:
        assert HOST_WHY == ""
        return
    assert "no cgroup hierarchy" not in HOST_WHY or "mounted" in HOST_WHY
    if not IS_ROOT and "pids" in Path("/proc/self/cgroup").read_text():
        assert "not delegated" in HOST_WHY and f"uid {os.geteuid()}" in HOST_WHY, HOST_WHY


# ----------------------------------------------------------------------------
# Planted trees: cgroup v2 shapes this host cannot give


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _line(version: int, point: Path, root: str, options: str = "rw,relatime") -> str:
    kind = "cgroup2 cgroup2 rw" if version == 2 else "cgroup cgroup rw,pids"
    return f"39 31 0:36 {root} {point} {options} - {kind}\n"


def test_v1_mount_root_places_the_cgroup(tmp_path: Path) -> None:
    _tree(tmp_path, {"pids/ctr/cgroup.procs": ""})
    mountinfo = _line(1, tmp_path / "pids", "/libpod_parent/libpod-1")
    base, why = cgroups.choose(mountinfo, "8:pids:/libpod_parent/libpod-1/ctr\n0::/\n")
    assert base == cgroups.Base(1, str(tmp_path / "pids/ctr"), "/libpod_parent/libpod-1/ctr")
    base, why = cgroups.choose(mountinfo, "8:pids:/elsewhere\n0::/\n")
    assert base is None and "does not contain this process's cgroup /elsewhere" in why
    base, why = cgroups.choose(_line(1, tmp_path / "pids", "/.."), "8:pids:/\n")
    assert base is None and "outside this process's cgroup namespace" in why


def test_mountinfo_escapes_are_decoded(tmp_path: Path) -> None:
    point = tmp_path / "a b"
    _tree(point, {"cgroup.procs": ""})
    escaped = str(point).replace(" ", "\\040")
    (mount,) = cgroups.cgroup_mounts(f"39 31 0:36 / {escaped} ro,relatime - cgroup c rw,pids\n")
    assert mount.point == str(point) and mount.readonly


def test_v2_container_namespace_root_holding_processes(tmp_path: Path) -> None:
    """--cgroupns=private on a v2 host: ``/`` is the container's cgroup. It holds the
    container's processes, so it cannot give pids to children: the message says so and
    what would help."""
    _tree(tmp_path, {"cgroup.controllers": "cpu memory pids\n", "cgroup.subtree_control": "",
                     "cgroup.procs": "1\n"})
    base, why = cgroups.choose(_line(2, tmp_path, "/"), "0::/\n")
    assert base is None and "root of this cgroup namespace" in why, why
    assert "+pids" in why and "does not give the pids controller" in why


def test_v2_delegated_container_cgroup_is_used(tmp_path: Path) -> None:
    """The container moved its processes to /init and gives pids to its children (a
    delegated --cgroupns=private setup): the base is the namespace root."""
    _tree(tmp_path, {"cgroup.controllers": "cpu memory pids\n",
                     "cgroup.subtree_control": "pids\n", "cgroup.procs": "",
                     "init/cgroup.controllers": "pids\n", "init/cgroup.subtree_control": "",
                     "init/cgroup.procs": "1\n"})
    assert cgroups.choose(_line(2, tmp_path, "/"), "0::/init\n") == (
        cgroups.Base(2, str(tmp_path), "/"), "")
    # The same with the namespace's cgroup shown through a bind mount of the host's path.
    assert cgroups.choose(_line(2, tmp_path, "/system.slice/ctr.scope"),
                          "0::/system.slice/ctr.scope/init\n") == (
        cgroups.Base(2, str(tmp_path), "/system.slice/ctr.scope"), "")


def test_v2_read_only_mount_names_the_cause(tmp_path: Path) -> None:
    _tree(tmp_path, {"cgroup.controllers": "pids\n", "cgroup.subtree_control": "pids\n",
                     "cgroup.procs": ""})
    assert cgroups.choose(_line(2, tmp_path, "/"), "0::/\n")[0] == cgroups.Base(
        2, str(tmp_path), "/")  # the control: the same tree mounted read-write is used
    base, why = cgroups.choose(_line(2, tmp_path, "/", "ro,nosuid"), "0::/\n")
    assert base is None and "read-only" in why and "--privileged" in why, why
