"""A second mount of what sandlock trusts, below a write grant, is refused.

Landlock's write grant on a directory covers every mount below it. A bind mount of
sandlock's package, of the Python it runs on, of a directory of its import path or of
its state directory, made below a granted directory, let a tool write there: a module
or ``.pth`` file planted that way runs in the next ``sandlock run``, before any
sandbox. Each attack here is real: a bind mount in a private mount namespace
(tests/mount_attacks.py), a confined tool writing through it; the positive control is
the same attack with the mount check switched off, which plants the file.

As root the real protected directories are mounted (the ones
:func:`sandlock.compile.grants.protected` names); as an ordinary user, in a user and
mount namespace (``unshare -Urm``), the ones that user owns: an import-path directory
and the state directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import IS_ROOT, PYTHON, REPO, require_abi

import sandlock
from sandlock import PACKAGE_DIR
from sandlock.compile import grants
from sandlock.compile.abi import WRITE_RIGHTS

ATTACKS = Path(__file__).resolve().parent / "mount_attacks.py"


def _namespace() -> list[str]:
    """The command that runs a process in a private mount namespace, or skip."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    command = ["unshare", "-m", "--propagation", "private"] if IS_ROOT else ["unshare", "-Urm"]
    done = subprocess.run([*command, "true"], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make a mount namespace ({' '.join(command)}): {done.stderr.strip()}")
    return command


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "the sandbox")


def protected_dirs() -> set[str]:
    return {where for where, *_ in grants.protected(())}


def attack(tmp_path: Path, source: str, behind: str, *, point: str = "mnt", grant: str = "",
           guard: bool = True, cli: bool = False, cover: bool = False,
           env: dict[str, str] | None = None) -> Any:
    """Mount ``source`` at workspace/``point`` and have a tool write ``behind`` through it."""
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    cache_home = tmp_path / "cache"
    cache_home.mkdir(exist_ok=True)
    mount = workspace / point
    relative = os.path.relpath(behind, source) if behind != source else ""
    target = str(mount / relative) if relative else str(mount)
    args = {"source": source, "point": str(mount), "target": target, "behind": behind,
            "workspace": str(workspace), "grant": grant or str(workspace), "guard": guard,
            "cli": cli, "cover": cover, "cache_home": str(cache_home)}
    # The sandlock this test imports, not another installed copy: its installation is
    # what the attack mounts.
    run_env = dict(os.environ if env is None else env)
    paths = run_env.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO) not in paths:
        run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), *paths]))
    done = subprocess.run([*_namespace(), sys.executable, str(ATTACKS), json.dumps(args)],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                          env=run_env)
    assert done.returncode == 0, done.stderr
    if behind != source:  # the attack script removed what the tool planted
        assert not os.path.exists(behind), behind
    return json.loads(done.stdout.splitlines()[-1])


def probe_name() -> str:
    return f"mount-probe-{os.getpid()}.txt"


# ---------------------------------------------------------------------------
# As root: the real installation


root_only = pytest.mark.skipif(not IS_ROOT, reason="the installation belongs to root: only "
                                                   "root can write it, with or without a mount")


def installation() -> dict[str, tuple[str, str]]:
    """(tree to mount, file the tool writes) for each way to reach the installation."""
    site = next(p for p in sys.path if p.endswith("-packages") and os.path.isdir(p))
    return {
        "package": (PACKAGE_DIR, os.path.join(PACKAGE_DIR, probe_name())),
        # the venv: a .pth there would run in every later launcher (a harmless name here)
        "python": (sys.prefix, os.path.join(site, probe_name())),
        "import path": (site, os.path.join(site, probe_name())),
        # a subdirectory of the package: the mount's root lies inside the protected tree
        "inside": (os.path.join(PACKAGE_DIR, "compile"),
                   os.path.join(PACKAGE_DIR, "compile", probe_name())),
        # the package's parent: the protected tree lies below the mount's root
        "parent": (os.path.dirname(PACKAGE_DIR), os.path.join(PACKAGE_DIR, probe_name())),
    }


@root_only
@pytest.mark.parametrize("kind", ["package", "python", "import path", "inside", "parent"])
def test_a_mount_of_the_installation_below_a_write_grant_is_refused(kind: str,
                                                                    tmp_path: Path) -> None:
    source, behind = installation()[kind]
    assert source in protected_dirs() or any(
        source.startswith(p + "/") or p.startswith(source + "/") for p in protected_dirs())
    result = attack(tmp_path, source, behind, cli=kind == "package")
    assert result["api"].startswith("refused: "), result
    refusal = result["api"]
    assert f"'{tmp_path}/ws'" in refusal and f"'{tmp_path}/ws/mnt'" in refusal, refusal
    assert "a later sandlock run" in refusal
    if kind == "package":
        # The compiled policy was cached before the mount and is a hit after it: the hit
        # re-checks the mounts. The command says so with the policy line, exit 125.
        assert result["before"] == 0 and result["hit_before"] == "hit", result
        assert result["hit_after"].startswith("refused: "), result
        assert result["execute"] == 125 and result["cli"]["code"] == 125, result
        assert "policy.toml:4: filesystem.write[0]" in result["cli"]["stderr"]
        assert "mount" in result["cli"]["stderr"] and "Traceback" not in result["cli"]["stderr"]
        assert not result["cli_planted"]


@root_only
@pytest.mark.parametrize("kind", ["package", "python", "inside", "parent"])
def test_the_positive_control_plants_through_the_mount(kind: str, tmp_path: Path) -> None:
    source, behind = installation()[kind]
    assert attack(tmp_path, source, behind, guard=False)["api"] == "planted"


@root_only
def test_a_mount_of_one_protected_file_is_refused(tmp_path: Path) -> None:
    """A bind mount of a single file of the package, granted itself or by its directory."""
    probe = os.path.join(PACKAGE_DIR, probe_name())
    Path(probe).write_text("original\n")
    try:
        for grant in ("", str(tmp_path / "ws" / "file.py")):
            result = attack(tmp_path, probe, probe, point="file.py", grant=grant)
            assert result["api"].startswith("refused: "), result
            assert Path(probe).read_text() == "original\n"
        control = attack(tmp_path, probe, probe, point="file.py", guard=False)
        assert control["api"] == "planted"
    finally:
        os.unlink(probe)


# ---------------------------------------------------------------------------
# Root and ordinary user: what this user owns


def user_env(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """An environment with an import-path directory and a state directory of the user's."""
    imports, home = tmp_path / "imports", tmp_path / "home"
    imports.mkdir()
    (home / ".cache" / "sandlock").mkdir(parents=True)
    env = dict(os.environ, HOME=str(home), PYTHONPATH=f"{REPO}:{imports}")
    env.pop("XDG_CACHE_HOME", None)
    return env, imports, home


@pytest.mark.parametrize("guard", [True, False])
def test_a_mount_of_an_import_path_directory(guard: bool, tmp_path: Path) -> None:
    """The tool plants sitecustomize.py, which the next launcher would import."""
    env, imports, _ = user_env(tmp_path)
    result = attack(tmp_path, str(imports), str(imports / "sitecustomize.py"), guard=guard,
                    env=env)
    if guard:
        assert result["api"].startswith("refused: ") and "import path" in result["api"], result
    else:
        assert result["api"] == "planted"


def test_a_hidden_mount_is_judged_by_its_mount_point(tmp_path: Path) -> None:
    """A mount of the import-path directory covered by a tmpfs: it cannot be opened where
    it is mounted, so its mount point's name decides (refused, though hidden)."""
    env, imports, _ = user_env(tmp_path)
    result = attack(tmp_path, str(imports), str(imports / "sitecustomize.py"), cover=True,
                    env=env)
    assert result["api"].startswith("refused: ") and "import path" in result["api"], result
    assert f"'{tmp_path}/ws/mnt'" in result["api"]


@pytest.mark.parametrize("guard", [True, False])
def test_a_mount_of_the_state_directory(guard: bool, tmp_path: Path) -> None:
    env, _, home = user_env(tmp_path)
    cache = home / ".cache"
    result = attack(tmp_path, str(cache), str(cache / "sandlock" / "planted"), guard=guard,
                    env=env)
    if guard:
        assert result["api"].startswith("refused: ") and "state directory" in result["api"]
    else:
        assert result["api"] == "planted"


# ---------------------------------------------------------------------------
# Inside an import-path directory (no mount needed)


def test_a_write_grant_inside_an_import_path_directory(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``E/sitecustomize`` of an import-path entry ``E``, granted write: the tool adds
    ``__init__.py`` and the next launcher imports it at start-up, before any sandbox."""
    imports = tmp_path / "imports"
    (imports / "sitecustomize").mkdir(parents=True)  # a namespace package: no code
    marker = tmp_path / "ran-before-the-sandbox"
    plant = ["-c", "import sys; open(sys.argv[1], 'w').write(f'open({sys.argv[2]!r}, \"w\")')",
             str(imports / "sitecustomize" / "__init__.py"), str(marker)]
    monkeypatch.syspath_prepend(str(imports))
    policy = {"extends": ["python"], "filesystem": {"write": [str(imports / "sitecustomize")]}}
    with pytest.raises(sandlock.PolicyError, match="lies inside .*import path"):
        sandlock.Sandbox(policy)
    assert not (imports / "sitecustomize" / "__init__.py").exists()
    # The positive control: without the check the tool plants, the next launcher runs it.
    monkeypatch.setattr(grants.WriteCheck, "check", lambda *_: None)
    with sandlock.Sandbox(policy) as box:
        assert box.run([PYTHON, *plant]).returncode == 0
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{imports}")
    subprocess.run([sys.executable, "-m", "sandlock", "run", "--policy", "base", "--",
                    "/usr/bin/true"], env=env, capture_output=True, timeout=60)
    assert marker.exists()


# ---------------------------------------------------------------------------
# Reading mountinfo


def test_mountinfo_paths_are_unescaped() -> None:
    line = (b"36 35 98:0 /my\\040dir\\134x /mnt/a\\011b\\012c rw,noatime master:1 - ext3 "
            b"/dev/root rw,errors=continue\n"
            b"37 35 0:4 net:[4026531840] /run/netns/x rw shared:2 - nsfs nsfs rw\n")
    mounts = grants.parse_mounts(line)
    assert mounts[36].device == "98:0" and mounts[36].root == "/my dir\\x"
    assert mounts[36].point == "/mnt/a\tb\nc"
    assert mounts[37].root == "net:[4026531840]"  # not a directory: judged only if it matters


@pytest.mark.parametrize("data", [b"36 35 98:0 / /mnt rw\n", b"x 35 98:0 / /mnt rw - a b c d\n"])
def test_a_mountinfo_line_that_cannot_be_read_is_refused(data: bytes) -> None:
    with pytest.raises(grants.Unjudgeable, match="cannot read"):
        grants.parse_mounts(data)


def test_a_write_grant_is_refused_when_the_mounts_cannot_be_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grants, "MOUNTINFO", str(tmp_path / "missing"))
    with pytest.raises(grants.GrantError, match="cannot read .*whose mounts it cannot check"):
        grants.check_rules([(str(tmp_path), int(WRITE_RIGHTS))], int(WRITE_RIGHTS), ())


def test_the_mount_around_a_chroot_is_placed_from_the_root() -> None:
    """In a chroot the mount that holds the root is not in mountinfo (its mount point lies
    outside the root): objects on it are placed from the root, compared with each other,
    and never ruled out against a mount of the same filesystem placed from the
    filesystem's root (the chroot's place in it is unknown)."""
    fd = os.open("/tmp", os.O_PATH | os.O_CLOEXEC)
    try:
        device, tree = grants.position(fd, {})  # no mount known, as in a chroot
    finally:
        os.close(fd)
    assert tree == grants.ROOT_FRAME + "/tmp"
    protected = [("/x/p", "a protected tree", (device, grants.ROOT_FRAME + "/x/p"))]
    assert (grants._reaches(device, grants.ROOT_FRAME + "/x", protected) or "").startswith("shows")
    assert (grants._reaches(device, grants.ROOT_FRAME + "/x/p/q", protected) or "").startswith("lies inside")
    assert grants._reaches(device, grants.ROOT_FRAME + "/y", protected) is None
    assert "cannot place" in (grants._reaches(device, "/srv/elsewhere", protected) or "")
    assert grants._reaches("0:999", "/srv/elsewhere", protected) is None


class _Namespace:
    """A process in a mount namespace of its own (``unshare -m``, private), whose working
    directory is ``ws`` with ``state`` bound at ``ws/st`` there only: this process's mount
    table never shows that bind."""

    def __init__(self, ws: Path, state: Path) -> None:
        (state / "marker").write_text("x")
        script = f"mount --bind '{state}' '{ws}/st' && cd '{ws}' && exec sleep 120"
        self.process = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                         script])
        self.cwd = f"/proc/{self.process.pid}/cwd"
        for _ in range(200):
            if os.path.exists(f"{self.cwd}/st/marker"):
                return
            import time

            time.sleep(0.02)
        self.close()
        raise AssertionError("the namespace's bind did not show")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.mark.parametrize("front", ["api", "api-control", "python-cli", "native"])
def test_a_working_directory_in_another_mount_namespace_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   front: str) -> None:
    """A run whose working directory is another mount namespace's (reached through
    /proc/PID/cwd) saw mounts there that no grant check saw: a bind of the state
    directory under the write-granted workspace, and the tool wrote into it; a policy file
    and the import path the same way, which the next run trusted (attack round 35). Every
    run and call now refuses a working directory on a mount its own table does not show.
    Control (the API with the check off): the tool writes into the state directory."""
    if not IS_ROOT or not shutil.which("unshare"):
        pytest.skip("makes a mount namespace: needs root")
    from sandlock.errors import SetupError

    ws, state = tmp_path / "ws", tmp_path / "state"
    (ws / "st").mkdir(parents=True)
    state.mkdir()
    shell = os.path.realpath("/bin/sh")
    policy = tmp_path / "policy.toml"
    policy.write_text(f'version = 1\nextends = ["base"]\n[filesystem]\nexec = ["{shell}"]\n'
                      f'write = ["{ws}"]\n')
    write = [shell, "-c", "echo x > st/planted"]
    from sandlock.compile import cache

    env = {**{k: v for k, v in os.environ.items() if k != cache.ENV_NO_CACHE},
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "PWD": str(ws), "PYTHONPATH": str(REPO)}
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    namespace = _Namespace(ws, state)
    try:
        if front.startswith("api"):
            if front == "api-control":
                monkeypatch.setattr(grants, "refuse_foreign_directory", lambda _path: None)
            with sandlock.Sandbox(str(policy)) as box:
                if front == "api":
                    with pytest.raises(SetupError, match="working directory"):
                        box.run(write, cwd=namespace.cwd)
                else:
                    assert box.run(write, cwd=namespace.cwd).returncode == 0
                    assert (state / "planted").exists()
                    return
        elif front == "python-cli":
            done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "run", "--policy",
                                   str(policy), "--", *write], cwd=namespace.cwd, env=env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 125 and "working directory" in done.stderr, done.stderr
        else:
            front_end = Path(PACKAGE_DIR) / "exec" / "helper" / "sandlock-run"
            if not front_end.exists():
                pytest.skip("the native front end is not built here")
            env = {name: value for name, value in env.items() if name not in cache.PYTHON_ENV}
            env["SANDLOCK_NATIVE_RUN"] = "1"
            run = [str(front_end), "run", "--policy", str(policy), "--", shell, "-c", "true"]
            for _ in range(2):  # stored from the workspace itself, then a native hit there
                done = subprocess.run(run, cwd=ws, env={**env, "SANDLOCK_NATIVE_DEBUG": "1"},
                                      capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr
            assert "hit: running it" in done.stderr, done.stderr
            done = subprocess.run([*run[:-1], "echo x > st/planted"], cwd=namespace.cwd, env=env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 125 and "working directory" in done.stderr, done.stderr
        assert not (state / "planted").exists()
    finally:
        namespace.close()
