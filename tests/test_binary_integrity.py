"""The single-file binary never runs code a tool could have written (issue 11 items 2
and 7, issue 17 item 4).

The stub (scripts/persistent_stub.c) unpacks the frozen CLI once into
``$XDG_CACHE_HOME/sandlock/bin/<hash>/``. Each attack below plays the tool (or the other
user) by writing into that directory directly, then checks what the *next* run of the
binary does: it must repair the unpack or refuse with exit 125, and never execute what
was planted. Each test has its own HOME and XDG_CACHE_HOME. Runs as root and as an
ordinary user, and only when the binary exists (see tests/test_binary.py).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import IS_ROOT, eventually, require_abi, write_policy
from test_binary import BINARY, POLICY

pytestmark = pytest.mark.skipif(
    not BINARY.is_file(),
    reason=f"{BINARY} not built (run scripts/build_binary.sh, or set SANDLOCK_BINARY)")

PLANTED = "#!/bin/sh\necho planted > {marker}\nexit 0\n"


def payload_id() -> str:
    """The hash the stub names its unpack directory after (the trailer's last 40 bytes)."""
    with open(BINARY, "rb") as handle:
        handle.seek(-64, os.SEEK_END)
        trailer = handle.read(64)
    assert trailer[:8] == b"SLPAYLD1", "not a persistent-stub build"
    return trailer[24:64].decode()


class Stage:
    """One test's private HOME and cache, a policy, and a marker a planted program writes."""

    def __init__(self, tmp_path: Path, workspace: Path) -> None:
        self.root = tmp_path
        self.home = tmp_path / "home"
        self.home.mkdir(mode=0o700)
        self.cache = self.home / ".cache"
        self.marker = tmp_path / "planted-ran"
        self.policy = write_policy(tmp_path, POLICY)
        self.workspace = workspace

    @property
    def bins(self) -> Path:
        return self.cache / "sandlock" / "bin"

    @property
    def unpacked(self) -> Path:
        return self.bins / payload_id()

    def env(self, **extra: str) -> dict[str, str]:
        return {"HOME": str(self.home), "XDG_CACHE_HOME": str(self.cache), **extra}

    def argv(self, code: int = 7) -> list[str]:
        return [str(BINARY), "run", "--policy", str(self.policy), "--var",
                f"ws={self.workspace}", "--", "/usr/bin/sh", "-c", f"exit {code}"]

    def run(self, env: Optional[dict[str, str]] = None, code: int = 7,
            prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        pairs = [f"{k}={v}" for k, v in (self.env() if env is None else env).items()]
        return subprocess.run([*prefix, "/usr/bin/env", "-i", *pairs, *self.argv(code)],
                              cwd=self.root, capture_output=True, text=True, timeout=120,
                              check=False)

    def plant(self, path: Path, size: Optional[int] = None) -> None:
        """Write the tool's program at ``path`` (padded to ``size`` bytes if given)."""
        text = PLANTED.format(marker=self.marker)
        if size is not None:
            text += "#" * (size - len(text) - 1) + "\n"
        path.write_text(text)
        path.chmod(0o755)

    def assert_not_planted(self) -> None:
        assert not self.marker.exists(), "the planted program ran"


@pytest.fixture
def stage(tmp_path: Path, workspace: Path) -> Stage:
    require_abi(1, "filesystem confinement")
    return Stage(tmp_path, workspace)


def ok(done: subprocess.CompletedProcess[str], code: int = 7) -> None:
    assert done.returncode == code, done.stderr


def refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 125, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sandlock: "), done.stderr
    assert "XDG_CACHE_HOME" in lines[0], done.stderr
    for word in words:
        assert word in lines[0], done.stderr


# ---------------------------------------------------------------------------
# Attack 1: a tool with write on $HOME plants a program in the unpack directory


@pytest.mark.parametrize("how", ["other-size", "same-size", "symlink", "directory-symlink"])
def test_replaced_unpacked_program_is_not_run(stage: Stage, how: str) -> None:
    ok(stage.run())
    program = stage.unpacked / "sandlock"
    size = program.stat().st_size
    if how == "directory-symlink":
        elsewhere = stage.root / "tool-dir"
        stage.unpacked.rename(elsewhere)
        stage.plant(elsewhere / "sandlock", size)
        stage.unpacked.symlink_to(elsewhere)
    else:
        program.unlink()
        if how == "symlink":
            target = stage.root / "tool-program"
            stage.plant(target, size)
            program.symlink_to(target)
        else:
            stage.plant(program, size if how == "same-size" else None)
    ok(stage.run())
    stage.assert_not_planted()
    ok(stage.run(code=3), 3)  # repaired, and stays so
    stage.assert_not_planted()


def test_precreated_unpack_directory_is_not_trusted(stage: Stage) -> None:
    """The tool creates ``bin/<hash>/sandlock`` before the binary's first run."""
    stage.unpacked.mkdir(parents=True, mode=0o700)
    for directory in (stage.cache / "sandlock", stage.bins):
        directory.chmod(0o700)
    stage.plant(stage.unpacked / "sandlock")
    ok(stage.run())
    stage.assert_not_planted()


def test_module_added_inside_the_unpack_is_noticed(stage: Stage) -> None:
    """A module added inside the unpacked tree (next to the stdlib) is noticed: the
    directory it lands in changed since the unpack."""
    ok(stage.run())
    internal = stage.unpacked / "_internal"
    (internal / "sitecustomize.py").write_text(f"open({str(stage.marker)!r}, 'w')\n")
    ok(stage.run())
    stage.assert_not_planted()
    assert not (internal / "sitecustomize.py").exists()


@pytest.mark.parametrize("granted", ["home", "cache", "binary-directory"])
def test_policy_that_could_write_the_unpack_or_the_binary_is_refused(stage: Stage,
                                                                     granted: str) -> None:
    """The other half of attack 1: with the state directory and the binary named by the
    stub (SANDLOCK_STATE_DIR, SANDLOCK_STUB), no policy gets write access to either."""
    installed = stage.root / "bin" / "sandlock"
    installed.parent.mkdir()
    shutil.copy2(BINARY, installed)
    target = {"home": stage.home, "cache": stage.cache, "binary-directory": installed.parent}
    pol = write_policy(stage.root, POLICY + 'write = ["${target}"]\n', "writes.toml")
    argv = [str(installed), "run", "--policy", str(pol), "--var", f"ws={stage.workspace}",
            "--var", f"target={target[granted]}", "--", "/usr/bin/true"]
    stage.cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["/usr/bin/env", "-i", *[f"{k}={v}" for k, v in stage.env().items()],
                           *argv], cwd=stage.root, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 125, done.stderr
    assert "filesystem.write" in done.stderr, done.stderr


# ---------------------------------------------------------------------------
# Issue 17 item 4: damaged or interrupted unpacks repair themselves


def _libpython(root: Path) -> Path:
    return next((root / "_internal").glob("libpython*"))


@pytest.mark.parametrize("damage", ["delete-program", "truncate-libpython", "delete-stdlib-zip",
                                    "delete-everything-inside"])
def test_damaged_unpack_is_repaired(stage: Stage, damage: str) -> None:
    ok(stage.run())
    if damage == "delete-program":
        (stage.unpacked / "sandlock").unlink()
    elif damage == "truncate-libpython":
        os.truncate(_libpython(stage.unpacked), 4096)
    elif damage == "delete-stdlib-zip":
        (stage.unpacked / "_internal" / "base_library.zip").unlink()
    else:
        for child in stage.unpacked.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    ok(stage.run(code=4), 4)
    ok(stage.run(code=5), 5)
    assert sorted(p.name for p in stage.bins.iterdir()) == [payload_id()]


def test_concurrent_runs_repair_a_damaged_unpack_once(stage: Stage) -> None:
    ok(stage.run())
    os.truncate(_libpython(stage.unpacked), 0)
    pairs = [f"{k}={v}" for k, v in stage.env().items()]
    runs = [subprocess.Popen(["/usr/bin/env", "-i", *pairs, *stage.argv()], cwd=stage.root,
                             stderr=subprocess.PIPE) for _ in range(4)]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 7, err
    assert sorted(p.name for p in stage.bins.iterdir()) == [payload_id()]
    ok(stage.run())


@pytest.mark.parametrize("umask", ["0027", "0077"])
def test_callers_umask_changes_neither_the_unpack_nor_the_command(stage: Stage,
                                                                   umask: str) -> None:
    """The unpack's modes are the payload's whatever the umask; the command still runs
    under the caller's umask."""
    pairs = [f"{k}={v}" for k, v in stage.env().items()]
    argv = [*stage.argv()[:-1], "umask"]
    done = subprocess.run(["/bin/sh", "-c", f'umask {umask}; exec "$@"', "sh", "/usr/bin/env",
                           "-i", *pairs, *argv], cwd=stage.root, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == umask
    assert stat.S_IMODE((stage.unpacked / "sandlock").stat().st_mode) == 0o755
    ok(stage.run())


def test_interrupted_unpacks_are_removed_by_the_next_unpack(stage: Stage) -> None:
    stage.bins.mkdir(parents=True, mode=0o700)
    (stage.cache / "sandlock").chmod(0o700)
    old, fresh = stage.bins / ".unpack-old123", stage.bins / ".unpack-new123"
    for leftover in (old, fresh):
        (leftover / "_internal").mkdir(parents=True)
        (leftover / "_internal" / "libpython3.so").write_bytes(b"\0" * 4096)
    hour_ago = time.time() - 3600
    for path in (old / "_internal" / "libpython3.so", old / "_internal", old):
        os.utime(path, (hour_ago, hour_ago))
    ok(stage.run())
    names = sorted(p.name for p in stage.bins.iterdir())
    assert names == [".unpack-new123", payload_id()], names  # a concurrent unpack is left alone


def test_unpack_that_cannot_be_written_is_cleaned_up_and_retried(stage: Stage) -> None:
    """A write that fails half-way (here: a file-size limit; a full disk takes the same
    path) leaves nothing behind, exits 125 with a message, and the next run unpacks."""
    done = stage.run(prefix=("/usr/bin/prlimit", "--fsize=1000000"))
    assert done.returncode == 125, done.stderr
    assert "cannot unpack" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert list(stage.bins.iterdir()) == []
    ok(stage.run())


@pytest.mark.skipif(not IS_ROOT, reason="mounting a small tmpfs (a real full disk) needs root")
def test_full_disk_during_unpack_is_125_and_the_next_run_retries(stage: Stage) -> None:
    small = stage.root / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(small)],
                   check=True)
    try:
        env = stage.env(XDG_CACHE_HOME=str(small))
        done = stage.run(env)
        assert done.returncode == 125, done.stderr
        assert "No space left on device" in done.stderr
        assert list((small / "sandlock" / "bin").iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
    ok(stage.run())


# ---------------------------------------------------------------------------
# Attack 2: no unpack into a shared $TMPDIR (the run-once mode is gone)


def test_no_private_directory_means_no_tmpdir_unpack(stage: Stage) -> None:
    """The old fallback unpacked into $TMPDIR/sandlock-XXXXXX, where a concurrent tool
    with write on $TMPDIR replaced the program between unpack and exec. A racer that
    tries exactly that finds nothing to replace: the binary refuses instead."""
    shared = stage.root / "shared-cache"
    (shared / "sandlock" / "bin").mkdir(parents=True)
    (shared / "sandlock" / "bin").chmod(0o777)
    scratch = stage.root / "tmpdir"
    scratch.mkdir()
    stop = threading.Event()

    def racer() -> None:
        while not stop.is_set():
            for program in scratch.glob("sandlock-*/sandlock"):
                try:
                    program.unlink()
                    stage.plant(program)
                except OSError:
                    pass

    thread = threading.Thread(target=racer, daemon=True)
    thread.start()
    try:
        done = stage.run(stage.env(XDG_CACHE_HOME=str(shared), TMPDIR=str(scratch)))
    finally:
        stop.set()
        thread.join()
    stage.assert_not_planted()
    refused(done, str(shared / "sandlock" / "bin"))
    assert list(scratch.iterdir()) == []
    assert list((shared / "sandlock" / "bin").iterdir()) == []


# ---------------------------------------------------------------------------
# Attack 3: a state directory inside a tree someone else controls is never used


def _other_users_directory(tmp_path: Path) -> Path:
    """A directory owned by another (non-root) user: made for the test when root,
    otherwise one the system already has."""
    if IS_ROOT:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        shutil.chown(theirs, "sandlock-ci", "sandlock-ci")
        return theirs
    for candidate in ("/var/cache/man", "/var/cache/apt/archives/partial", "/var/spool/mail"):
        try:
            info = os.stat(candidate)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid not in (0, os.geteuid()):
            return Path(candidate)
    pytest.skip("no directory owned by another user on this machine")


def test_home_in_another_users_tree_is_refused(stage: Stage) -> None:
    """Root with HOME inside another user's directory (sudo -E, shared CI homes): that
    user could swap a path component between any check and the use. Refused."""
    theirs = _other_users_directory(stage.root)
    home = theirs / "home"
    before = sorted(os.listdir(theirs)) if os.access(theirs, os.R_OK) else None
    done = stage.run({"HOME": str(home)})
    refused(done, str(theirs))
    stage.assert_not_planted()
    if before is not None:
        assert sorted(os.listdir(theirs)) == before


@pytest.mark.parametrize("where", ["bin-world-writable", "ancestor-world-writable",
                                   "ancestor-sticky-not-root", "symlinked-component",
                                   "cache-is-a-file", "state-dir-group-writable"])
def test_unusable_state_directory_is_125_with_a_message(stage: Stage, where: str) -> None:
    cache = stage.root / "c"
    if where == "bin-world-writable":
        (cache / "sandlock" / "bin").mkdir(parents=True, mode=0o700)
        (cache / "sandlock").chmod(0o700)
        (cache / "sandlock" / "bin").chmod(0o777)
        blamed = cache / "sandlock" / "bin"
    elif where in ("ancestor-world-writable", "ancestor-sticky-not-root"):
        shared = stage.root / "shared"
        shared.mkdir()
        shared.chmod(0o777 if where == "ancestor-world-writable" else 0o1777)
        cache = shared / "mine"
        cache.mkdir(mode=0o700)
        blamed = shared
    elif where == "symlinked-component":
        real = stage.root / "real"
        real.mkdir(mode=0o700)
        (stage.root / "link").symlink_to(real)
        cache = stage.root / "link" / "cache"
        blamed = stage.root / "link"
    elif where == "cache-is-a-file":
        cache.write_text("not a directory\n")
        blamed = cache
    else:
        (cache / "sandlock").mkdir(parents=True, mode=0o700)
        (cache / "sandlock").chmod(0o770)
        blamed = cache / "sandlock"
    done = stage.run(stage.env(XDG_CACHE_HOME=str(cache)))
    if where == "ancestor-sticky-not-root" and IS_ROOT:
        ok(done)  # sticky and root's, like /tmp: others cannot rename root's entries there
    else:
        refused(done, str(blamed))
    stage.assert_not_planted()


def test_missing_home_is_not_created(stage: Stage) -> None:
    missing = stage.root / "gone" / "home"
    refused(stage.run({"HOME": str(missing)}), str(stage.root / "gone"))
    assert not (stage.root / "gone").exists()


def test_state_directory_readable_by_others_is_made_private(stage: Stage) -> None:
    """``~/.cache/sandlock`` made 0755 by an older version (or os.makedirs): nobody else
    could write in it, so the stub keeps it and takes group and other access away."""
    (stage.cache / "sandlock").mkdir(parents=True, mode=0o700)
    (stage.cache / "sandlock").chmod(0o755)
    ok(stage.run())
    assert stat.S_IMODE((stage.cache / "sandlock").stat().st_mode) == 0o700


# ---------------------------------------------------------------------------
# What the stub tells the CLI


def test_stub_exports_its_real_path_and_state_directory(stage: Stage) -> None:
    """SANDLOCK_STUB (the real path of the binary, even when started through a symlink)
    and SANDLOCK_STATE_DIR (the state root used), so the CLI can refuse write grants
    that reach either."""
    alias = stage.root / "alias"
    alias.symlink_to(BINARY)
    argv = ["/usr/bin/env", "-i", *[f"{k}={v}" for k, v in stage.env().items()], str(alias),
            *stage.argv()[1:-3], "/usr/bin/cat"]
    child = subprocess.Popen(argv, cwd=stage.root, stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen: list[bytes] = []
    try:
        def started() -> bool:
            # The kernel switches /proc/PID/exe before it lays out the new environment
            # (until then environ is the stub's, which has other SANDLOCK_ names): wait
            # until both are there, and keep that environment (read again, it could be an
            # exited program's: empty).
            try:
                exe = os.readlink(f"/proc/{child.pid}/exe")
                data = Path(f"/proc/{child.pid}/environ").read_bytes()
            except OSError:
                return False
            if exe.startswith(str(stage.bins)) and b"\0SANDLOCK_STUB=" in b"\0" + data:
                seen.append(data)
            return bool(seen)
        ok = eventually(started, 60)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(60)
    assert child.stderr is not None
    assert ok, f"the unpacked program did not start: {child.stderr.read()!r}"
    values = dict(item.decode().split("=", 1) for item in seen[0].split(b"\0") if b"=" in item)
    assert values["SANDLOCK_STUB"] == os.path.realpath(BINARY)
    assert values["SANDLOCK_STATE_DIR"] == str(stage.cache / "sandlock")


# ---------------------------------------------------------------------------
# The native front end linked into the stub (exec/helper/sandlock_run.c, SANDLOCK_BUNDLED):
# a cached plan runs without the frozen program; anything else executes the program the
# stub checked. Its entries are keyed by the binary's real path and state directory.


def traced(stage: Stage, argv: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    """``argv`` (the binary first) with the front end's debug lines, from the stage."""
    pairs = [f"{k}={v}" for k, v in stage.env(SANDLOCK_NATIVE_DEBUG="1", **extra).items()]
    return subprocess.run(["/usr/bin/env", "-i", *pairs, *argv], cwd=stage.root,
                          capture_output=True, text=True, timeout=120, check=False)


def way(done: subprocess.CompletedProcess[str]) -> str:
    """"hit", or the front end's reason to fall back."""
    lines = [line for line in done.stderr.splitlines() if line.startswith("sandlock-run: ")
             and not line.startswith("sandlock-run: key: ")]
    for line in lines:
        if line.startswith("sandlock-run: fallback: "):
            return line.removeprefix("sandlock-run: fallback: ")
        if line == "sandlock-run: hit: running it":
            return "hit"
    raise AssertionError(f"no line of the front end: {done.stderr!r}")


def reading(stage: Stage, path: Path, binary: Path = BINARY, **var: str) -> list[str]:
    argv = [str(binary), "run", "--policy", str(stage.policy), "--var", f"ws={stage.workspace}"]
    for name, value in var.items():
        argv += ["--var", f"{name}={value}"]
    return [*argv, "--", "/usr/bin/cat", str(path)]


def test_a_cached_plan_runs_natively_and_confined_in_the_binary(stage: Stage) -> None:
    secret = stage.root / "secret.txt"
    secret.write_text("top secret\n")
    first = traced(stage, reading(stage, stage.workspace / "notes.md"))
    assert first.returncode == 0 and way(first) != "hit", first.stderr  # no cache yet
    second = traced(stage, reading(stage, stage.workspace / "notes.md"))
    assert (second.returncode, way(second), second.stdout) == (
        0, "hit", "hello from the workspace\n"), second.stderr
    denied = traced(stage, reading(stage, secret))
    assert way(denied) == "hit" and denied.returncode == 1, denied.stderr
    assert "Permission denied" in denied.stderr and "top secret" not in denied.stdout
    # control: switched off, the same run goes through the frozen CLI, with the same answer
    off = traced(stage, reading(stage, secret), SANDLOCK_NATIVE_RUN="0")
    assert way(off) == "off (SANDLOCK_NATIVE_RUN=0)" and off.returncode == 1, off.stderr
    assert "Permission denied" in off.stderr


def test_a_copy_of_the_binary_in_a_directory_the_tool_may_write_runs_no_stored_plan(
        stage: Stage) -> None:
    """A plan stored through the binary at one path is not run by the same build at
    another: the copy's run protects the copy (its path is in the key, as SANDLOCK_STUB),
    so a policy letting the tool write beside the copy is refused there, not run."""
    tools = stage.root / "tools"
    tools.mkdir()
    policy = write_policy(stage.root, POLICY + 'write = ["${tools}"]\n', "writes.toml")
    here = stage.root / "bin" / "sandlock"
    here.parent.mkdir()
    shutil.copy2(BINARY, here)

    def run(binary: Path) -> subprocess.CompletedProcess[str]:
        return traced(stage, [str(binary), "run", "--policy", str(policy), "--var",
                              f"ws={stage.workspace}", "--var", f"tools={tools}", "--",
                              "/usr/bin/true"])

    assert run(here).returncode == 0
    stored = run(here)
    assert (stored.returncode, way(stored)) == (0, "hit"), stored.stderr  # control
    shutil.copy2(BINARY, tools / "sandlock")
    copy = run(tools / "sandlock")
    assert copy.returncode == 125 and way(copy) == "no entry", copy.stderr
    assert "filesystem.write" in copy.stderr, copy.stderr


def test_a_fallback_after_a_hit_executes_the_repaired_program(stage: Stage) -> None:
    """Entries exist and the tool replaces the unpacked program: the next run that is no
    hit (another --var) executes the program the stub checked, unpacked again."""
    assert traced(stage, reading(stage, stage.workspace / "notes.md")).returncode == 0
    assert way(traced(stage, reading(stage, stage.workspace / "notes.md"))) == "hit"
    program = stage.unpacked / "sandlock"
    size = program.stat().st_size
    program.unlink()
    stage.plant(program, size)
    again = traced(stage, reading(stage, stage.workspace / "notes.md", other="1"))
    assert (again.returncode, way(again), again.stdout) == (
        0, "no entry", "hello from the workspace\n"), again.stderr
    stage.assert_not_planted()


def test_the_binary_ignores_python_variables_natively_and_in_its_fallback(stage: Stage) -> None:
    """The frozen interpreter ignores PYTHONPATH (isolated), so the front end need not fall
    back on it: a sitecustomize planted there runs neither way."""
    planted = stage.root / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(f"open({str(stage.marker)!r}, 'w').close()\n")
    # control: an interpreter that reads its environment runs it
    subprocess.run(["/usr/bin/python3", "-c", "pass"], env={"PYTHONPATH": str(planted)},
                   check=True)
    assert stage.marker.exists()
    stage.marker.unlink()
    assert traced(stage, reading(stage, stage.workspace / "notes.md")).returncode == 0
    hit = traced(stage, reading(stage, stage.workspace / "notes.md"), PYTHONPATH=str(planted))
    assert (hit.returncode, way(hit)) == (0, "hit"), hit.stderr
    off = traced(stage, reading(stage, stage.workspace / "notes.md"), PYTHONPATH=str(planted),
                 SANDLOCK_NATIVE_RUN="0")
    assert off.returncode == 0, off.stderr
    stage.assert_not_planted()
