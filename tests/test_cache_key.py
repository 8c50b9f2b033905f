"""The compiled-policy cache where the kernel keyring is refused (sandlock/compile/cachekey.py).

Every run here is the real CLI in a fresh interpreter under a seccomp filter that makes
keyctl, add_key and request_key fail, as container profiles do (Docker: EPERM; podman's
add_key: ENOSYS), on the real kernel. A hit is recognised by what it did not import
(sandlock.policy.model), as in test_fastpath.py. The key file's directory is the test's
own (``cachekey.key_directory`` points into the scene's HOME, which the scene's
XDG_CACHE_HOME protects as sandlock's state directory, as the real one is).

Attacks: a forged entry signed with a guessed key; a key file the launcher must not
trust (a symbolic link, readable by its group, a second hard link, the wrong size,
owned by another user), each with an entry forged with the key it holds; a policy that
grants read on the key's directory. Each keeps a positive control: with the guard
switched off (a lax key reader, the secret check emptied, the real key) the same
forgery widens the run, so the attack is real.
"""

from __future__ import annotations

import contextlib
import json
import marshal
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from conftest import require_abi, require_private_mounts, write_policy

from sandlock.compile import cache, cachekey

POLICY = """\
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}"]
exec = ["/usr/bin/cat"]
"""

#: Installs the keyring-refusing filter (argv[1]: the errno), then runs argv[2:].
NO_KEYRING = """\
import errno, os, sys
import pyseccomp
f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
for name in ("keyctl", "add_key", "request_key"):
    f.add_rule(pyseccomp.ERRNO(getattr(errno, sys.argv[1])), name)
f.load()
os.execv(sys.argv[2], sys.argv[2:])
"""

#: `sandlock run` with the key directory of the scene; TEST_GUARD_OFF switches a guard off
#: (the positive controls). Reports the exit code and whether the policy was parsed.
RUNNER = """\
import json, os, sys
from sandlock.compile import cachekey, grants
cachekey.key_directory = lambda: os.environ["TEST_KEY_DIR"]
off = os.environ.get("TEST_GUARD_OFF")
if off == "read_key":  # trusts whatever the key name leads to
    def lax(directory, name=cachekey.KEY_FILE):
        try:
            fd = os.open(name, os.O_RDONLY, dir_fd=directory)
        except FileNotFoundError:
            return None, None
        try:
            return os.read(fd, cachekey.KEY_BYTES), None
        finally:
            os.close(fd)
    cachekey.read_key = lax
elif off == "secrets":  # the keys, and the state directory they are in
    grants._secrets = lambda: []
    grants._check_state = lambda *args: None
elif off == "remember_root":  # the list taken as written whether or not it was
    cachekey.remember_root = lambda *args: True
elif off == "blocking_open":  # opens the key file as a plain open(2) would: waits on a FIFO
    cachekey._READ &= ~os.O_NONBLOCK
from sandlock.cli import launch
code = launch.main_run(sys.argv[1:])
sys.stderr.write("\\n" + json.dumps({"code": code, "parsed": "sandlock.policy.model" in sys.modules}))
"""


class Scene:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.home = tmp_path / "home"
        self.home.mkdir(mode=0o700)
        self.ws = tmp_path / "ws"
        self.ws.mkdir()
        (self.ws / "notes.md").write_text("hello from the workspace\n")
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        (self.outside / "secret.txt").write_text("top secret\n")
        self.key_dir = self.home / ".cache" / "sandlock"
        self.key = self.key_dir / cachekey.KEY_FILE
        self.entries = self.key_dir / "policies"
        self.policy = write_policy(tmp_path, POLICY)
        self.env = {k: v for k, v in os.environ.items() if k != cache.ENV_NO_CACHE}
        self.env.update(HOME=str(self.home), XDG_CACHE_HOME=str(self.home / ".cache"),
                        TEST_KEY_DIR=str(self.key_dir))

    def run(self, argv: list[str], refuse: str = "EPERM", policy: Path | None = None,
            guard_off: str = "", wrap: tuple[str, ...] | list[str] = (), timeout: float = 60
            ) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
        """`sandlock run` of ``argv``; the keyring refused with errno ``refuse`` (or not
        at all: ``refuse=""``); ``wrap``: a command line that runs the rest."""
        prefix = [*wrap, *([sys.executable, "-c", NO_KEYRING, refuse] if refuse else [])]
        env = {**self.env, "TEST_GUARD_OFF": guard_off}
        args = ["--policy", str(policy or self.policy), "--var", f"ws={self.ws}", "--", *argv]
        done = subprocess.run([*prefix, sys.executable, "-c", RUNNER, *args], env=env,
                              capture_output=True, text=True, errors="surrogateescape",
                              timeout=timeout, check=False)
        head, _, last = done.stderr.rpartition("\n")
        done.stderr = head
        return done, json.loads(last)

    def check(self, refuse: str = "EPERM") -> dict[str, object]:
        """`sandlock check`'s cache line, with the scene's key directory."""
        code = ("import json, os\nfrom sandlock.compile import cachekey, report\n"
                "cachekey.key_directory = lambda: os.environ['TEST_KEY_DIR']\n"
                "print(json.dumps([f for f in report.kernel_report()['features']\n"
                "                  if 'compiled-policy cache' in f['feature']]))")
        done = subprocess.run([sys.executable, "-c", NO_KEYRING, refuse, sys.executable, "-c", code],
                              env=self.env, capture_output=True, text=True, timeout=60, check=True)
        (line,) = json.loads(done.stdout)
        assert isinstance(line, dict)
        return line

    def entry(self) -> Path:
        (found,) = [p for p in self.entries.iterdir() if not p.name.startswith(".")]
        return found

    def read_outside(self, refuse: str = "EPERM", guard_off: str = ""
                     ) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
        return self.run(["cat", str(self.outside / "secret.txt")], refuse, guard_off=guard_off)

    def forge(self, key: bytes) -> None:
        """Rewrite the entry so that it also grants read on ``outside``, signed with ``key``."""
        path = self.entry()
        data = path.read_bytes()
        head = len(cache.MAGIC) + cache.TAG_BYTES
        stored_key, value = marshal.loads(data[head:])
        plan = list(value["plan"])
        (rights,) = [r for p, r in plan[4] if p == str(self.ws)]
        plan[4] = (*plan[4], (str(self.outside), rights))
        value["plan"] = tuple(plan)
        payload = marshal.dumps((stored_key, value))
        path.write_bytes(cache.MAGIC + cache._tag(key, cache.MAGIC, payload) + payload)


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    require_abi(1, "filesystem confinement")
    return Scene(tmp_path)


def assert_confined(done: subprocess.CompletedProcess[str], info: dict[str, object]) -> None:
    assert info["code"] == 1, done.stderr
    assert "top secret" not in done.stdout and "Permission denied" in done.stderr


def printed(done: subprocess.CompletedProcess[str]) -> bytes:
    return done.stdout.encode("utf-8", "surrogateescape")


def as_text(data: bytes) -> bytes:
    """``data`` as text mode reads it back (universal newlines)."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def assert_widened(done: subprocess.CompletedProcess[str], info: dict[str, object]) -> None:
    """The forged entry was used: a hit that reads what the policy never granted."""
    assert (info["code"], info["parsed"], done.stdout) == (0, False, "top secret\n"), done.stderr


# ----------------------------------------------------------------------------
# The cache works without the keyring


@pytest.mark.parametrize("refuse", ["EPERM", "ENOSYS"])
def test_second_run_is_a_hit_without_the_keyring(scene: Scene, refuse: str) -> None:
    for expect_parsed in (True, False):
        done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse=refuse)
        assert (info["code"], info["parsed"]) == (0, expect_parsed), done.stderr
        assert done.stdout == "hello from the workspace\n"
        assert_confined(*scene.read_outside(refuse=refuse))
    key = scene.key.stat()
    assert (oct(key.st_mode & 0o7777), key.st_size, key.st_uid) == ("0o600", 32, os.geteuid())
    assert oct(scene.key_dir.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in scene.key_dir.iterdir() if p.name.startswith(".")] == []
    assert scene.entry().exists()
    line = scene.check(refuse)
    assert line["available"] is True, line
    assert f"key in the key file {str(scene.key)!r}" in str(line["detail"]), line


def test_the_keyring_stays_first_where_it_works(scene: Scene) -> None:
    for expect_parsed in (True, False):
        done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="")
        assert (info["code"], info["parsed"]) == (0, expect_parsed), done.stderr
    assert not scene.key.exists() and scene.entry().exists()


# ----------------------------------------------------------------------------
# Forgeries


def test_forged_entry_with_a_guessed_key_is_a_miss(scene: Scene) -> None:
    scene.run(["cat", str(scene.ws / "notes.md")])
    scene.forge(os.urandom(32))
    assert_confined(*scene.read_outside())
    # positive control: the same forgery signed with the real key widens the run
    scene.forge(scene.key.read_bytes())
    assert_widened(*scene.read_outside())


KNOWN = bytes(range(32))


def _plant_symlink(scene: Scene) -> None:
    target = scene.root / "planted-key"
    scene.key.rename(target)
    scene.key.symlink_to(target)


def _plant_group_readable(scene: Scene) -> None:
    scene.key.chmod(0o640)


def _plant_second_link(scene: Scene) -> None:
    os.link(scene.key, scene.root / "second-name")


def _plant_other_owner(scene: Scene) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    os.chown(scene.key, 1001 if os.geteuid() != 1001 else 1002, -1)


def _plant_longer(scene: Scene) -> None:
    with scene.key.open("ab") as handle:
        handle.write(b"more than a key")


PLANTS = {"symlink": _plant_symlink, "group-readable": _plant_group_readable,
          "second-hard-link": _plant_second_link, "other-owner": _plant_other_owner,
          "longer": _plant_longer}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_untrusted_key_file_turns_the_cache_off(scene: Scene, plant: str) -> None:
    """A key file a tool could have read or planted (its value known: KNOWN) and an entry
    forged with it: the launcher trusts neither, and `check` says why."""
    scene.key_dir.mkdir(parents=True, mode=0o700)
    scene.key.write_bytes(KNOWN)
    scene.key.chmod(0o600)
    scene.run(["cat", str(scene.ws / "notes.md")])  # an entry signed with KNOWN
    scene.forge(KNOWN)
    PLANTS[plant](scene)
    done, info = scene.read_outside()
    assert_confined(done, info)
    assert info["parsed"] is True
    line = scene.check()
    assert line["available"] is False and "is not trusted" in str(line["detail"]), line
    # positive control: a key reader without the checks takes the forgery
    assert_widened(*scene.read_outside(guard_off="read_key"))


def test_key_file_from_another_filesystem_is_not_trusted(scene: Scene, tmp_path: Path) -> None:
    """A file bind-mounted over the key from another filesystem (here /dev/shm, in a
    mount namespace of the test's own) is not the key sandlock made in its directory."""
    if os.geteuid() != 0 or not Path("/usr/bin/unshare").exists():
        pytest.skip("needs root and unshare(1) for a private bind mount")
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's directory")
    require_private_mounts()
    scene.key_dir.mkdir(parents=True, mode=0o700)
    scene.key.write_bytes(KNOWN)
    scene.key.chmod(0o600)
    scene.run(["cat", str(scene.ws / "notes.md")])
    scene.forge(KNOWN)
    source = shm / f"sandlock-test-key-{os.getpid()}"
    source.write_bytes(KNOWN)
    source.chmod(0o600)
    try:
        mount = ["/usr/bin/unshare", "-m", "--propagation", "private", "sh", "-c",
                 'mount --bind "$0" "$1" && shift && exec "$@"', str(source), str(scene.key)]
        done, info = scene.run(["cat", str(scene.outside / "secret.txt")], wrap=mount)
        assert_confined(done, info)
        assert info["parsed"] is True
        # positive control: a key reader without the checks takes the forgery
        assert_widened(*scene.run(["cat", str(scene.outside / "secret.txt")], wrap=mount,
                                  guard_off="read_key"))
    finally:
        source.unlink()


def test_key_file_that_is_a_fifo_cannot_hang_the_launcher(scene: Scene) -> None:
    """A FIFO in the key file's place (a tool that could reach the directory once, or
    another process of the user): opening it for reading would wait for a writer for
    ever. The launcher opens without blocking, finds no regular file, runs uncached."""
    scene.key_dir.mkdir(parents=True, mode=0o700)
    os.mkfifo(scene.key, 0o600)
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], timeout=30)
    assert (info["code"], info["parsed"], done.stdout) == (0, True, "hello from the workspace\n")
    line = scene.check()
    assert line["available"] is False and "not a regular file" in str(line["detail"]), line
    # positive control: an open that blocks waits on the FIFO until the test gives up
    with pytest.raises(subprocess.TimeoutExpired):
        scene.run(["cat", str(scene.ws / "notes.md")], guard_off="blocking_open", timeout=5)


# ----------------------------------------------------------------------------
# No grant reaches the key


GRANT_HOME = POLICY.replace('read = ["${ws}"]', 'read = ["${ws}", "${home}"]')


def test_grant_that_reaches_the_key_is_refused(scene: Scene) -> None:
    scene.run(["cat", str(scene.ws / "notes.md")])  # makes the key
    policy = write_policy(scene.root, GRANT_HOME.replace("${home}", str(scene.home)), "home.toml")
    done, info = scene.run(["cat", str(scene.key)], policy=policy)
    assert info["code"] == 125, done.stderr
    assert "the key that authenticates sandlock's compiled-policy cache" in done.stderr
    assert done.stdout == ""
    # positive control: without the check the tool reads the key
    done, info = scene.run(["cat", str(scene.key)], policy=policy, guard_off="secrets")
    assert info["code"] == 0, done.stderr
    assert printed(done) == as_text(scene.key.read_bytes())


def test_grant_that_reaches_a_key_file_is_refused_where_the_keyring_works(scene: Scene) -> None:
    """A key file left by a run where the keyring was refused (a container sharing the
    home) stays out of reach of runs that keep their key in the keyring."""
    scene.run(["cat", str(scene.ws / "notes.md")])  # makes the key file
    policy = write_policy(scene.root, GRANT_HOME.replace("${home}", str(scene.home)), "home.toml")
    done, info = scene.run(["cat", str(scene.key)], refuse="", policy=policy)
    assert info["code"] == 125 and done.stdout == "", done.stderr
    assert "the key that authenticates sandlock's compiled-policy cache" in done.stderr
    done, info = scene.run(["cat", str(scene.key)], refuse="", policy=policy, guard_off="secrets")
    assert info["code"] == 0 and printed(done) == as_text(scene.key.read_bytes())


def test_grant_on_home_reaches_the_records_key_even_where_the_keyring_holds_the_cache_key(
        scene: Scene) -> None:
    """Where the keyring holds the cache key, no cache key file is made; but the run log's
    and undo records' key is always a file there (it must outlive a reboot), made or not
    yet: a grant on the home directory reaches it and is refused. Control: a grant on a
    directory of the home beside sandlock's runs."""
    policy = write_policy(scene.root, GRANT_HOME.replace("${home}", str(scene.home)), "home.toml")
    (scene.home / "notes").mkdir()
    (scene.home / "notes" / "note").write_text("mine\n")
    done, info = scene.run(["cat", str(scene.home / "notes" / "note")], refuse="", policy=policy)
    assert info["code"] == 125 and "run log and undo records" in done.stderr, done.stderr
    assert not scene.key.exists()
    narrower = write_policy(scene.root, GRANT_HOME.replace("${home}", str(scene.home / "notes")),
                            "notes.toml")
    done, info = scene.run(["cat", str(scene.home / "notes" / "note")], refuse="", policy=narrower)
    assert (info["code"], done.stdout) == (0, "mine\n"), done.stderr


def test_key_directory_is_the_password_database_home() -> None:
    import pwd

    home = pwd.getpwuid(os.geteuid()).pw_dir
    assert cachekey.key_directory() == os.path.join(home, ".cache", "sandlock")


def test_a_grant_inside_the_state_directory_is_refused(scene: Scene) -> None:
    """The cache's entries hold other runs' policy texts, paths and --var values (a token
    passed so, a path that names a client): no grant may reach inside sandlock's state
    directory, as none may reach its keys. Control: without the check the tool reads an
    entry, and the other run's text with it."""
    private = write_policy(scene.root, POLICY + "# deploy token tok-5e1f9c\n", "private.toml")
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="", policy=private)
    assert info["code"] == 0, done.stderr
    entry = scene.entry()
    nosy = write_policy(scene.root, POLICY.replace('read = ["${ws}"]',
                                                   f'read = ["${{ws}}", "{scene.entries}"]'),
                        "nosy.toml")
    done, info = scene.run(["cat", str(entry)], refuse="", policy=nosy)
    assert info["code"] == 125 and "state directory" in done.stderr, done.stderr
    assert "tok-5e1f9c" not in done.stdout
    done, info = scene.run(["cat", str(entry)], refuse="", policy=nosy, guard_off="secrets")
    assert info["code"] == 0 and "tok-5e1f9c" in done.stdout, done.stderr


@pytest.mark.parametrize("how", ["link-then-up", "relative-home"])
def test_the_state_directory_refused_is_the_one_the_cache_uses(scene: Scene, how: str) -> None:
    """The cache's directory and the one the grants are refused are one path: an
    ``XDG_CACHE_HOME`` that leaves a link with ``..`` (the cache reads it as text, the
    kernel would go up from the link's target) and a relative ``HOME`` (the cache then
    uses the password database's) each sent the refusal elsewhere, and a read grant on
    the cache's parent read other runs' entries. Control: the cache is where the refusal
    looked (the entry exists there)."""
    base = scene.root / "xn"
    base.mkdir()
    (scene.root / "other" / "deep").mkdir(parents=True)
    (base / "link").symlink_to(scene.root / "other" / "deep")
    env = dict(scene.env)
    if how == "link-then-up":
        env["XDG_CACHE_HOME"] = f"{base}/link/.."
        parent = base
    else:  # cwd is scene.root: a relative home would name scene.root/home, or /home
        env.pop("XDG_CACHE_HOME")
        env["HOME"] = "home"
        import pwd

        parent = Path(pwd.getpwuid(os.geteuid()).pw_dir) / ".cache"
    private = write_policy(scene.root, POLICY + "# deploy token tok-77d1\n", "private.toml")
    done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "run", "--policy", str(private),
                           "--var", f"ws={scene.ws}", "--", "cat", str(scene.ws / "notes.md")],
                          env=env, cwd=scene.root, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert (parent / "sandlock" / "policies").is_dir()  # control: the cache is there
    assert not (scene.home / ".cache").exists() and not Path("/home/.cache").exists()
    nosy = write_policy(scene.root, POLICY.replace('read = ["${ws}"]',
                                                   f'read = ["${{ws}}", "{parent}"]'), "nosy.toml")
    done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "run", "--policy", str(nosy),
                           "--var", f"ws={scene.ws}", "--", "cat", str(scene.ws / "notes.md")],
                          env=env, cwd=scene.root, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 125, done.stderr
    assert "state directory" in done.stderr or "that authenticates" in done.stderr, done.stderr


def test_a_state_directory_of_another_environment_is_refused(scene: Scene) -> None:
    """A run with another XDG_CACHE_HOME keeps its plans there; a later run in this
    environment refuses grants on that directory too (the password database home's list
    of state directories). Control: before any run kept state there, the grant runs."""
    elsewhere = scene.root / "xc"
    elsewhere.mkdir()
    nosy = write_policy(scene.root, POLICY.replace('read = ["${ws}"]',
                                                   f'read = ["${{ws}}", "{elsewhere}"]'), "nosy.toml")
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="", policy=nosy)
    assert info["code"] == 0, done.stderr  # control: nothing kept there yet
    private = write_policy(scene.root, POLICY + "# deploy token tok-3a9e\n", "private.toml")
    home_cache = scene.env["XDG_CACHE_HOME"]
    scene.env["XDG_CACHE_HOME"] = str(elsewhere)
    try:
        done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="", policy=private)
    finally:
        scene.env["XDG_CACHE_HOME"] = home_cache
    assert info["code"] == 0, done.stderr
    assert (scene.key_dir / cachekey.ROOTS_FILE).read_text() == f"{elsewhere}/sandlock\n"
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="", policy=nosy)
    assert info["code"] == 125 and "state directory" in done.stderr, done.stderr


def keep_state_in(scene: Scene, where: Path) -> None:
    """A run with XDG_CACHE_HOME=``where``: it keeps state there, and lists it."""
    home_cache = scene.env["XDG_CACHE_HOME"]
    scene.env["XDG_CACHE_HOME"] = str(where)
    try:
        done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="")
    finally:
        scene.env["XDG_CACHE_HOME"] = home_cache
    assert info["code"] == 0, done.stderr


@pytest.mark.parametrize("hidden", ["state-parent", "list", "list-rewritten"])
def test_a_mode_a_tool_changed_hides_no_state_directory(scene: Scene, hidden: str) -> None:
    """A tool may chmod whatever its uid owns, granted or not (Landlock has no such right),
    and undo it later: a state directory behind a directory the launcher cannot search,
    an unreadable list, and a list rewritten while an entry could not be reached must
    neither let a grant reach it nor drop it. (As root the modes do not bind: the test
    needs an ordinary user.)"""
    if os.geteuid() == 0:
        pytest.skip("root searches and reads whatever the mode (CAP_DAC_OVERRIDE)")
    project = scene.root / "proj"
    (project / ".cache").mkdir(parents=True)
    keep_state_in(scene, project / ".cache")
    roots = scene.key_dir / cachekey.ROOTS_FILE
    assert str(project / ".cache" / "sandlock") in roots.read_text()
    nosy = write_policy(scene.root, POLICY.replace('read = ["${ws}"]',
                                                   f'read = ["${{ws}}", "{project}"]'), "nosy.toml")
    hide = {"state-parent": project / ".cache", "list": roots,
            "list-rewritten": project / ".cache"}[hidden]
    mode = hide.stat().st_mode & 0o777
    hide.chmod(0)
    try:
        if hidden == "list-rewritten":  # another environment's first run rewrites the list
            (scene.root / "other").mkdir()
            keep_state_in(scene, scene.root / "other")
        else:
            done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="", policy=nosy)
            assert info["code"] == 125, done.stderr
            assert "state director" in done.stderr, done.stderr
    finally:
        hide.chmod(mode)
    assert str(project / ".cache" / "sandlock") in roots.read_text()
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="", policy=nosy)
    assert info["code"] == 125 and "state directory" in done.stderr, done.stderr


def test_runs_listing_state_directories_at_once_lose_none(tmp_path: Path) -> None:
    """Eight runs listing eight state directories each, all at the same moment: every one
    is in the list after (each rewrites the list whole, one at a time). Without the lock,
    a write made between another's read and write loses that one's directory."""
    key_dir = tmp_path / "home" / ".cache" / "sandlock"
    key_dir.mkdir(parents=True, mode=0o700)
    (tmp_path / "home").chmod(0o700)
    code = ("import os, sys\nfrom sandlock.compile import cache, cachekey\n"
            "cachekey.key_directory = lambda: os.environ['TEST_KEY_DIR']\n"
            "sys.stdin.read()\n"
            "for root in sys.argv[1:]:\n"
            "    cachekey.remember_root(cache.open_private_dir, root)\n")
    roots = []
    for index in range(64):
        root = tmp_path / f"state-{index}"
        root.mkdir()
        roots.append(str(root))
    env = {**os.environ, "TEST_KEY_DIR": str(key_dir)}
    started = [subprocess.Popen([sys.executable, "-c", code, *roots[first::8]], env=env,
                                stdin=subprocess.PIPE) for first in range(8)]
    for process in started:  # released together
        assert process.stdin is not None
        process.stdin.close()
    assert all(process.wait(60) == 0 for process in started)
    listed = (key_dir / cachekey.ROOTS_FILE).read_text().splitlines()
    assert sorted(listed) == sorted(roots)


def test_a_listed_root_or_link_refuses_nothing_else(scene: Scene) -> None:
    """"/" listed (an old list), or a listed directory replaced by a link to "/" (by
    something of the account outside any sandbox), would put every grant inside a state
    directory: neither is one (sandlock keeps no state through a link). Control: the
    listed directory itself is refused."""
    keep_state_in(scene, scene.root / "xc")
    roots = scene.key_dir / cachekey.ROOTS_FILE
    (scene.root / "gone").symlink_to("/")
    roots.write_text(roots.read_text() + f"/\n{scene.root / 'gone'}\n")
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="")
    assert info["code"] == 0, done.stderr
    nosy = write_policy(scene.root, POLICY.replace('read = ["${ws}"]',
                                                   f'read = ["${{ws}}", "{scene.root / "xc"}"]'),
                        "nosy.toml")
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="", policy=nosy)
    assert info["code"] == 125 and "state directory" in done.stderr, done.stderr


@contextlib.contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """No file can be made in ``directory`` (a full or read-only disk, as far as the list
    of state directories goes): immutable for root, mode 0500 for a user."""
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True,
                              check=False)
        if done.returncode:
            pytest.skip(f"no immutable flag on this file system: {done.stderr.strip()}")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)


@pytest.mark.parametrize("guard", ["on", "off"])
def test_a_state_directory_that_cannot_be_listed_keeps_nothing(scene: Scene, guard: str) -> None:
    """A run of another environment (its own XDG_CACHE_HOME) whose directory cannot be
    put in the list (here no file can be made beside the key) stores no plan there: the
    default environment's runs, not knowing it, would let a grant read the policy text and
    the --var values in it. Control (the failure ignored): the plan is stored, unlisted,
    and a read grant on it shows a value of the other run."""
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="")  # the key file
    assert info["code"] == 0, done.stderr
    elsewhere = scene.root / "elsewhere"
    elsewhere.mkdir()
    home_cache = scene.env["XDG_CACHE_HOME"]
    scene.env["XDG_CACHE_HOME"] = str(elsewhere)
    try:
        with unwritable(scene.key_dir):
            done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="",
                                   guard_off="" if guard == "on" else "remember_root")
    finally:
        scene.env["XDG_CACHE_HOME"] = home_cache
    assert info["code"] == 0 and "hello from the workspace" in done.stdout, done.stderr
    assert not (scene.key_dir / cachekey.ROOTS_FILE).exists()  # nothing listed
    stored = [p for p in (elsewhere / "sandlock" / "policies").glob("*")
              if not p.name.startswith(".")]
    nosy = write_policy(scene.root, POLICY.replace(
        'read = ["${ws}"]', f'read = ["${{ws}}", "{elsewhere}"]'), "nosy.toml")
    done, info = scene.run(["cat", *map(str, stored or [scene.ws / "notes.md"])], refuse="",
                           policy=nosy)
    assert info["code"] == 0, done.stderr
    if guard == "on":
        assert not stored
    else:
        assert str(scene.ws) in done.stdout, "the control read no plan of the other run"


def test_a_run_log_that_cannot_be_listed_is_refused(scene: Scene) -> None:
    """The run log kept outside the state directory must be listed too: where the list
    cannot be written the run is refused (exit 125), never run unlisted. Control: the same
    run with a list that can be written logs it."""
    scene.env["SANDLOCK_LOG"] = str(scene.root / "first")
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="")  # the log's key
    assert info["code"] == 0, done.stderr
    scene.env["SANDLOCK_LOG"] = str(scene.root / "log")
    with unwritable(scene.key_dir):
        done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="")
    assert info["code"] == 125 and "cannot list" in done.stderr, done.stderr
    done, info = scene.run(["cat", str(scene.ws / "notes.md")], refuse="")
    assert info["code"] == 0, done.stderr
    assert str(scene.root / "log") in (scene.key_dir / cachekey.ROOTS_FILE).read_text("utf-8")
