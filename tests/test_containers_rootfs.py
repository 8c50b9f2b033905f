"""A container's root file system owned by its user: every `base` policy is refused, and
the message must name the real cause (the owner of ``/``), not only that ``/lib`` is a
link.

Made for real: a tree with the usual links (``/lib -> usr/lib``...) and the host's
``/usr``, ``/etc``, ``/opt``, ``/dev`` and this worktree bind-mounted in a private
mount namespace, entered with chroot (root only). The refusal itself is right: a tool
running as the owner of ``/`` could rename ``/lib`` and plant a link in its place.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IS_ROOT, require_abi, require_private_mounts

WORKTREE = str(Path(__file__).resolve().parent.parent)
POLICY = 'version = 1\nextends = ["base"]\n[filesystem]\nexec = ["/usr/bin/true"]\n'
OWNER = 1001  # not root; need not exist

pytestmark = pytest.mark.skipif(not IS_ROOT, reason="a chroot with bind mounts needs root")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "filesystem confinement")


def run_in_rootfs(tmp_path: Path, owner: int, mode: int = 0o755) -> subprocess.CompletedProcess[str]:
    root = tmp_path / "rootfs"
    for name in ("usr", "etc", "opt", "dev", "proc", "tmp", WORKTREE.lstrip("/")):
        (root / name).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.lexists(f"/{link}") and os.path.islink(f"/{link}"):
            os.symlink(os.readlink(f"/{link}"), root / link)
        else:
            (root / link).mkdir()
    (root / "tmp/p.toml").write_text(POLICY)
    os.chmod(root / "tmp/p.toml", 0o644)
    os.chown(root, owner, 0)
    os.chmod(root, mode)
    binds = " ".join(f"mount --rbind {shlex.quote(d)} {shlex.quote(str(root) + d)};"
                     for d in ("/usr", "/etc", "/opt", "/dev", WORKTREE))
    inner = [sys.executable, "-m", "sandlock", "run", "--policy", "/tmp/p.toml", "--",
             "/usr/bin/true"]
    script = (f"{binds} mount -t proc proc {shlex.quote(str(root))}/proc; "
              f"exec chroot {shlex.quote(str(root))} env -C /tmp SANDLOCK_NO_CACHE=1 "
              f"PYTHONPATH={shlex.quote(WORKTREE)} " + shlex.join(inner))
    require_private_mounts()
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-e", "-c", script],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})


def test_a_root_owned_rootfs_runs_base(tmp_path: Path) -> None:
    """The control: the same tree with ``/`` owned by root runs."""
    result = run_in_rootfs(tmp_path, 0)
    assert result.returncode == 0, result.stderr


def test_a_rootfs_owned_by_the_user_names_the_owner_of_root(tmp_path: Path) -> None:
    result = run_in_rootfs(tmp_path, OWNER)
    assert result.returncode == 125, result.stderr
    assert "'/lib'" in result.stderr  # the link that was refused...
    assert f"'/' is owned by uid {OWNER}, not root" in result.stderr  # ...and why
    assert "chown root /" in result.stderr and "rename or replace the link" in result.stderr
    assert "in a directory a tool may be able to write" not in result.stderr
    assert "Traceback" not in result.stderr


def test_a_world_writable_root_names_the_mode(tmp_path: Path) -> None:
    result = run_in_rootfs(tmp_path, 0, 0o777)
    assert result.returncode == 125, result.stderr
    assert "'/' is writable by its group or by others (mode 0777)" in result.stderr
    assert "chmod go-w /" in result.stderr
