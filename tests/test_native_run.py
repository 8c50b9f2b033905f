"""The native front end of `sandlock run` (sandlock/exec/helper/sandlock_run.c) and the native
entry it reads (sandlock/compile/cache.py, docs/design.md "Native front end").

The front end trusts an entry only when its keyed BLAKE2b tag verifies with the cache key
and its key bytes equal the ones it built itself: each attack below on the entry or its
directory is made for real, and each has its positive control (the same run without the
attack verifies the entry). Everything it does not handle falls back to the Python CLI,
which then behaves exactly as without it; the debug lines (SANDLOCK_NATIVE_DEBUG=1) say
which way it went.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from conftest import require_abi, require_tool, write_policy

from sandlock.cli import launch
from sandlock.compile import cache, cachekey
from sandlock.linux import syscalls

HELPER_DIR = Path(cache.__file__).resolve().parent.parent / "exec" / "helper"
FRONT = HELPER_DIR / "sandlock-run"
SOURCE = HELPER_DIR / "sandlock_run.c"

POLICY = """\
[filesystem]
read = ["/usr", "/lib", "/etc"]
exec = ["/usr/bin", "/usr/lib"]
"""


#: The "fallback" note of a run the front end ran itself (it writes "hit: running it").
RAN = "none: the hit ran natively"


def require_front() -> None:
    if not FRONT.exists():
        message = f"{FRONT} is not built (python setup.py build_helper)"
        if os.environ.get("SANDLOCK_EXPECT_NATIVE") == "1":
            pytest.fail(f"{message}, but SANDLOCK_EXPECT_NATIVE=1")
        pytest.skip(message)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The front end's environment: none of cache.PYTHON_ENV (with one it falls back: the
    import path it protects would not be the witnessed one)."""
    out = {name: value for name, value in os.environ.items() if name not in cache.PYTHON_ENV}
    out.pop(cache.ENV_NO_CACHE, None)
    out.update({"XDG_CACHE_HOME": str(tmp_path / "cache"), "SANDLOCK_NATIVE_RUN": "1",
                "SANDLOCK_NATIVE_DEBUG": "1"})
    return out


def front(args: list[str], env: dict[str, str], cwd: Path
          ) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """Run the front end; its debug lines by kind (key, entry, fallback), the rest as is."""
    require_front()
    done = subprocess.run([str(FRONT), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)
    notes = dict(re.findall(r"^sandlock-run: (\w+): (.*)$", done.stderr, re.MULTILINE))
    if notes.get("hit") == "running it":  # every check passed: the front end ran the tool
        notes.setdefault("fallback", RAN)
    done.stderr = re.sub(r"^sandlock-run: .*\n", "", done.stderr, flags=re.MULTILINE)
    return done, notes


def native_dir(env: dict[str, str]) -> Path:
    return Path(env["XDG_CACHE_HOME"]) / "sandlock" / cache.NATIVE_DIR


def stored(policy: Path, env: dict[str, str], tmp_path: Path) -> Path:
    """Run once through the front end (a miss: Python stores the plan); the native entry."""
    done, notes = front(["run", "--policy", str(policy), "--", "true"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert notes["fallback"] in ("no entry", "no private cache directory")
    (entry,) = native_dir(env).iterdir()
    return entry


def secret() -> bytes:
    key = cachekey.secret(cache.open_private_dir)[0]
    assert key is not None, "no cache key here"
    return key


# ----------------------------------------------------------------------------
# BLAKE2b, the facts the front end copies, its key bytes


DRIVER = r"""
#include <stdio.h>
#include <unistd.h>
#include "blake2b.h"
int main(void);
int main(void) {
    static uint8_t in[1 << 16];
    uint8_t out[64];
    size_t n = 0;
    ssize_t got;
    while ((got = read(0, in + n, sizeof in - n)) > 0)
        n += (size_t)got;
    if (n < 2 || n < 2u + in[1] || blake2b(out, in[0], in + 2, in[1], in + 2 + in[1], n - 2 - in[1]))
        return 2;
    for (size_t i = 0; i < in[0]; i++)
        printf("%02x", out[i]);
    return 0;
}
"""


@pytest.mark.any_user
def test_blake2b_is_hashlibs_on_many_vectors(tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "no C compiler: the front end could not have been built either"
    (tmp_path / "driver.c").write_text(DRIVER)
    subprocess.run([compiler, "-O2", "-Wall", "-Wextra", "-Werror", f"-I{HELPER_DIR}", "-o",
                    str(tmp_path / "driver"), str(tmp_path / "driver.c")], check=True)
    rng = random.Random(7693)
    for _ in range(120):  # block edges with and without a key, every digest size
        size = rng.randint(1, 64)
        key = rng.randbytes(rng.choice([0, 1, 32, 64, rng.randint(0, 64)]))
        data = rng.randbytes(rng.choice([0, 1, 127, 128, 129, 256, 257, rng.randint(0, 3000)]))
        got = subprocess.run([str(tmp_path / "driver")], input=bytes([size, len(key)]) + key + data,
                             capture_output=True, check=True).stdout.decode()
        assert got == hashlib.blake2b(data, key=key, digest_size=size).hexdigest()


def c_text() -> str:
    return SOURCE.read_text()


def define(text: str, name: str) -> str:
    (found,) = re.findall(rf"^#define\s+{name}\s+(.*?)\s*(?:/\*.*)?$", text, re.MULTILINE)
    return str(found)


def c_array(text: str, name: str) -> list[str]:
    (found,) = re.findall(rf"\b{name}\[[^\]]*\]\s*=\s*\{{(.*?)\}};", text, re.DOTALL)
    return [item.strip().strip('"') for item in found.split(",") if item.strip()]


def drift(text: str) -> list[str]:
    """Every fact of the front end's source that differs from the Python it copies."""
    from sandlock.compile import logdir
    from sandlock.policy.readfile import MAX_BYTES

    facts = {"KEY_NAME": f'"{cachekey.KEY_NAME.decode()}"', "KEY_BYTES": str(cachekey.KEY_BYTES),
             "KEY_FILE": f'"{cachekey.KEY_FILE}"', "TAG_BYTES": str(cache.TAG_BYTES),
             "NATIVE_FORMAT": str(cache.NATIVE_FORMAT), "NATIVE_PREFIX": f'"{cache.NATIVE_PREFIX}"',
             "NATIVE_DIR": f'"{cache.NATIVE_DIR}"', "NATIVE_NAME_BYTES": str(cache.NATIVE_NAME_BYTES),
             "ENV_NO_CACHE": f'"{cache.ENV_NO_CACHE}"', "ENV_LOG": f'"{logdir.ENV}"',
             "ENV_STALE": f'"{cache.ENV_NATIVE_STALE}"'}
    out = [name for name, value in facts.items() if define(text, name) != value]
    if define(text, "POLICY_MAX") != f"(1 << {MAX_BYTES.bit_length() - 1})" or MAX_BYTES & (
            MAX_BYTES - 1):
        out.append("POLICY_MAX")
    if c_array(text, "native_env") != list(cache.NATIVE_ENV):
        out.append("native_env")
    if c_array(text, "python_env") != list(cache.PYTHON_ENV):
        out.append("python_env")
    if c_array(text, "code_dirs") != ["", *cache.PACKAGES]:
        out.append("code_dirs")
    handled = c_array(text, "options_valued") + c_array(text, "options_flag")
    python = c_array(text, "options_python")
    names = [name for name, _, _ in launch.OPTIONS]
    if sorted(handled + [n for n in python if n.startswith("--") and n != "--help"]) != sorted(names):
        out.append("options (launch.OPTIONS)")
    flags = [n for n, metavar, _ in launch.OPTIONS if metavar is None]
    if not set(c_array(text, "options_flag")) <= set(flags) or not set(flags) <= set(
            c_array(text, "options_flag") + python):
        out.append("options_flag")
    import resource
    import signal

    from sandlock.compile import compiler
    from sandlock.exec import launcher
    from sandlock.linux import process
    from sandlock.policy.model import Limits

    if [int(n) for n in c_array(text, "limited")] != list(cache.LIMITED):
        out.append("limited (cache.LIMITED)")
    every = Limits(timeout=1, cpu=1, memory=1, processes=1, open_files=1, file_size=1)
    if sorted(res for res, _ in compiler.rlimits_for(every)) != sorted(cache.LIMITED):
        out.append("cache.LIMITED is not what rlimits_for limits")
    if define(text, "PER_USER_LIMIT") != f'"{process.PER_USER_LIMIT}"':
        out.append("PER_USER_LIMIT")
    if define(text, "DIRECTORY_STDIO") != f'"{process.DIRECTORY_STDIO}"':
        out.append("DIRECTORY_STDIO")
    if define(text, "DEFAULT_PATH") != f'"{os.defpath}"':
        out.append("DEFAULT_PATH")
    if (int(define(text, "PY_SIGRTMIN")), int(define(text, "PY_SIGRTMAX"))) != (
            signal.SIGRTMIN, signal.SIGRTMAX):
        out.append("PY_SIGRTMIN, PY_SIGRTMAX")
    names = c_array(text, "signal_names")
    if names != [signal.Signals(n).name for n in range(1, len(names) + 1)] or len(names) != 31:
        out.append("signal_names")
    if c_array(text, "chromium_names") != list(launch.CHROMIUM_NAMES):
        out.append("chromium_names")
    if [int(getattr(signal, n)) for n in c_array(text, "quiet_signals")] != list(launch.QUIET_SIGNALS):
        out.append("quiet_signals")
    if int(define(text, "WATCHDOG_GRACE_MS")) != launcher.WATCHDOG_GRACE * 1000:
        out.append("WATCHDOG_GRACE_MS")
    if int(define(text, "SIGNAL_BASE")) != 128:
        out.append("SIGNAL_BASE")
    del resource
    fallbacks = re.findall(r"#ifndef\s+__NR_(\w+)\s*\n\s*#define\s+__NR_\1\s+(\d+)", text)
    if not fallbacks:
        out.append("no __NR_ fallback found: has the pattern changed?")
    for arch, table in syscalls.TABLES.items():
        out += [f"__NR_{name} on {arch}" for name, number in fallbacks
                if table.get(name) != int(number)]
    return out


@pytest.mark.any_user
def test_the_front_ends_copies_are_the_python_tables() -> None:
    assert drift(c_text()) == []


@pytest.mark.any_user
@pytest.mark.parametrize(("old", "new"), [
    ('"sandlock:policy-cache:v1"', '"sandlock:policy-cache:v2"'),
    ('#define NATIVE_FORMAT 4', '#define NATIVE_FORMAT 5'),
    ('"XDG_CACHE_HOME",', ""),
    ('"PYTHONPYCACHEPREFIX",', ""),
    ('#define ENV_LOG "SANDLOCK_LOG"', '#define ENV_LOG "SANDLOCK_LOGS"'),
    ('{"--policy", "--var", "--timeout"}', '{"--policy", "--var", "--timeout", "--tool"}'),
    ("__NR_landlock_create_ruleset 444", "__NR_landlock_create_ruleset 445"),
    ("static const int limited[] = {4, 0, 9, 6, 7, 1};", "static const int limited[] = {4, 0, 9, 6, 7};"),
    ('"SIGWINCH", "SIGIO",', '"SIGWINCH", "SIGPOLL",'),
    ("#define PY_SIGRTMIN 34", "#define PY_SIGRTMIN 35"),
    ('"chrome-headless-shell", "headless_shell"}', '"chrome-headless-shell"}'),
])
def test_the_comparison_is_not_vacuous(old: str, new: str) -> None:
    assert old in c_text()
    assert drift(c_text().replace(old, new, 1)) != []


#: name: (options, environment, then native_key's variables, timeout, best_effort)
KEY_CASES: dict[str, tuple[list[str], dict[str, str], dict[str, str], Optional[str], bool]] = {
    "plain": ([], {}, {}, None, False),
    "vars": (["--var", "b=2", "--var", "a=\u00e9=x", "--var=c="], {},
             {"b": "2", "a": "\u00e9=x", "c": ""}, None, False),
    "timeout and best effort": (["--timeout", "3s", "--best-effort"], {}, {}, "3s", True),
    "environment": ([], {"TMPDIR": "/tmp", "SANDLOCK_ABI": "3", "HOME": "/nonexistent/h"}, {},
                    None, False),
}


@pytest.mark.parametrize("case", KEY_CASES)
def test_the_key_bytes_are_native_keys(case: str, tmp_path: Path, env: dict[str, str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """C and Python build the same key (cache.native_key: the one definition), with a
    relative policy path."""
    extra, environment, variables, timeout, best_effort = KEY_CASES[case]
    env.update(environment)
    write_policy(tmp_path, POLICY)
    done, notes = front(["run", "--policy", "policy.toml", *extra, "--", "true"], env, tmp_path)
    monkeypatch.chdir(tmp_path)
    for name in (*cache.NATIVE_ENV, *cache.PYTHON_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # The front end's Python CLI has the directory above the package first on its path,
    # and runs no script (-c).
    monkeypatch.setattr(sys, "path", [str(HELPER_DIR.parents[2]), *sys.path[1:]])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    expected = cache.native_key("policy.toml", POLICY.encode(), variables, timeout, best_effort)
    assert notes["key"] == expected.hex()
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------
# A stored plan, and attacks on it


def test_a_stored_plan_verifies_and_the_run_is_the_pythons(tmp_path: Path,
                                                          env: dict[str, str]) -> None:
    policy = write_policy(tmp_path, POLICY)
    entry = stored(policy, env, tmp_path)
    fields = cache.read_native(entry.read_bytes(), secret())
    assert fields is not None and fields["source"] == str(policy)
    assert entry.name == cache.native_name(fields["key"])
    assert fields["steps"][-1] == "exec" and "seccomp" in fields["steps"]
    done, notes = front(["run", "--policy", str(policy), "--", "sh", "-c", "echo hi; exit 3"],
                        env, tmp_path)
    assert notes["entry"] == "verified"
    assert (done.returncode, done.stdout) == (3, "hi\n")
    done, notes = front(["run", "--policy", str(policy), "--", "no-such-command-here"], env,
                        tmp_path)
    assert notes["entry"] == "verified" and done.returncode == 127


def forge(entry: Path, key: bytes) -> None:
    """Widen the entry's first path to every right and re-tag it with ``key``."""
    data = entry.read_bytes()
    head = len(cache.NATIVE_MAGIC) + cache.TAG_BYTES
    payload = data[head:]
    fields = cache.read_native(data, secret())
    assert fields is not None
    path, rights = fields["paths"][0]
    old = cache._field(os.fsencode(path)) + cache._number(rights)
    assert payload.count(old) == 1
    payload = payload.replace(old, cache._field(os.fsencode(path)) + cache._number(2**16 - 1))
    entry.write_bytes(cache.NATIVE_MAGIC + cache._tag(key, cache.NATIVE_MAGIC, payload) + payload)


@pytest.mark.parametrize("kind", ["record", "plan", "entry"], ids=["as-record", "as-plan", "control"])
def test_a_payload_tagged_as_another_kind_of_file_is_not_trusted(
        kind: str, tmp_path: Path, env: dict[str, str]) -> None:
    """One key tags compiled plans, native entries and front-end records: the tag covers
    the magic, so a payload tagged as one kind never verifies as another (a twenty-third
    attack round; no payload that parses as two kinds was found, this is depth). Control:
    the same payload tagged as an entry is one, in Python and in the front end."""
    policy = write_policy(tmp_path, POLICY)
    entry = stored(policy, env, tmp_path)
    data = entry.read_bytes()
    payload = data[len(cache.NATIVE_MAGIC) + cache.TAG_BYTES:]
    magic = {"record": cache.FRONT_MAGIC, "plan": cache.MAGIC, "entry": cache.NATIVE_MAGIC}[kind]
    entry.write_bytes(cache.NATIVE_MAGIC + cache._tag(secret(), magic, payload) + payload)
    fields = cache.read_native(entry.read_bytes(), secret())
    _, notes = front(["run", "--policy", str(policy), "--", "true"], env, tmp_path)
    if kind == "entry":
        assert fields is not None and notes["entry"] == "verified"
    else:
        assert fields is None
        assert notes["fallback"] == "the entry's tag does not verify" and "entry" not in notes


@pytest.mark.parametrize("attack", [True, False], ids=["forged", "control-real-key"])
def test_a_forged_entry_is_not_trusted(attack: bool, tmp_path: Path, env: dict[str, str]) -> None:
    """A tool that can write the cache rewrites an entry: without the key its tag fails."""
    policy = write_policy(tmp_path, POLICY)
    entry = stored(policy, env, tmp_path)
    forge(entry, os.urandom(32) if attack else secret())
    _, notes = front(["run", "--policy", str(policy), "--", "true"], env, tmp_path)
    if attack:
        assert notes["fallback"] == "the entry's tag does not verify" and "entry" not in notes
    else:
        assert notes["entry"] == "verified"


@pytest.mark.parametrize("attack", [True, False], ids=["other-key", "control-own-key"])
def test_an_entry_under_another_name_is_not_trusted(attack: bool, tmp_path: Path,
                                                    env: dict[str, str]) -> None:
    """A genuine entry of a wide policy, copied to the name of a narrow one, is refused:
    the key is compared in full, not only through the name."""
    (tmp_path / "ws").mkdir()
    wide = write_policy(tmp_path, POLICY + f'write = ["{tmp_path / "ws"}"]\n', "wide.toml")
    narrow = write_policy(tmp_path, POLICY, "narrow.toml")
    wide_entry = stored(wide, env, tmp_path)
    _, notes = front(["run", "--policy", str(narrow), "--", "true"], env, tmp_path)
    (narrow_entry,) = set(native_dir(env).iterdir()) - {wide_entry}
    if attack:
        shutil.copyfile(wide_entry, narrow_entry)
    _, notes = front(["run", "--policy", str(narrow), "--", "true"], env, tmp_path)
    if attack:
        assert notes["fallback"] == "the entry's key differs" and "entry" not in notes
    else:
        assert notes["entry"] == "verified"


@pytest.mark.parametrize("attack", ["symlink", "open-directory", None])
def test_the_entry_and_its_directory_are_checked(attack: str, tmp_path: Path,
                                                 env: dict[str, str]) -> None:
    """An entry that is a symbolic link (to a genuine copy) is not followed; a directory
    others may write is not used. Control: the untouched entry verifies."""
    policy = write_policy(tmp_path, POLICY)
    entry = stored(policy, env, tmp_path)
    if attack == "symlink":
        copy = tmp_path / "copy"
        shutil.copyfile(entry, copy)
        entry.unlink()
        entry.symlink_to(copy)
    elif attack == "open-directory":
        native_dir(env).chmod(0o777)
    _, notes = front(["run", "--policy", str(policy), "--", "true"], env, tmp_path)
    if attack == "symlink":
        assert notes["fallback"] == "no entry"
    elif attack == "open-directory":
        assert notes["fallback"] == "no private cache directory"
    else:
        assert notes["entry"] == "verified"


# ----------------------------------------------------------------------------
# What falls back


FALLS_BACK = {
    "not run": (["--version"], "not a run"),
    "--tool": (["run", "--tool", "x", "--policies", ".", "--", "true"],
               "an option the Python CLI handles"),
    "--accept": (["run", "--policy", "policy.toml", "--accept", "x", "--", "true"],
                 "an option the Python CLI handles"),
    "unknown option": (["run", "--polcy", "policy.toml", "--", "true"], "an unknown option"),
    "profile name": (["run", "--policy", "shell", "--", "true"],
                     "a profile name, or a name that could be one (the Python CLI resolves it)"),
    "no command": (["run", "--policy", "policy.toml"], "no command"),
    "bad var": (["run", "--policy", "policy.toml", "--var", "x", "--", "true"],
                "a --var the Python CLI reports"),
}


@pytest.mark.parametrize("case", FALLS_BACK)
def test_what_falls_back_to_the_python_cli(case: str, tmp_path: Path, env: dict[str, str]) -> None:
    args, why = FALLS_BACK[case]
    write_policy(tmp_path, POLICY)
    done, notes = front(args, env, tmp_path)
    assert notes["fallback"] == why
    python = subprocess.run([sys.executable, "-m", "sandlock", *args], cwd=tmp_path,
                            env={**env, "PYTHONPATH": str(HELPER_DIR.parents[2])},
                            capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (python.returncode, python.stdout)


def test_on_unless_told_and_off_with_the_cache_off(tmp_path: Path, env: dict[str, str]) -> None:
    policy = write_policy(tmp_path, POLICY)
    stored(policy, env, tmp_path)
    args = ["run", "--policy", str(policy), "--", "true"]
    _, notes = front(args, {**env, cache.ENV_NO_CACHE: "1"}, tmp_path)
    assert notes["fallback"] == "the cache is off"
    done, notes = front(args, {**env, "SANDLOCK_NATIVE_RUN": "0"}, tmp_path)
    assert notes["fallback"].startswith("off") and done.returncode == 0
    del env["SANDLOCK_NATIVE_RUN"]
    done, notes = front(args, env, tmp_path)
    assert notes["fallback"] == RAN and done.returncode == 0


@pytest.mark.parametrize(("extra", "environment"), [
    ("[limits]\nprocesses = 50\n", {}),       # a pids cgroup: the front end does not check it
    ("", {"SANDLOCK_ABI": "5"}),              # the signal gate: a supervisor
])
def test_plans_that_need_more_get_no_native_entry(extra: str, environment: dict[str, str],
                                                 tmp_path: Path, env: dict[str, str]) -> None:
    env.update(environment)
    policy = write_policy(tmp_path, POLICY + extra)
    for _ in range(2):
        done, notes = front(["run", "--policy", str(policy), "--", "true"], env, tmp_path)
        assert done.returncode == 0, done.stderr
        assert notes["fallback"] in ("no entry", "no private cache directory")
    assert list((Path(env["XDG_CACHE_HOME"]) / "sandlock" / "policies").iterdir())
    assert not native_dir(env).exists() or not list(native_dir(env).iterdir())


# ----------------------------------------------------------------------------
# Where the keyring is refused: the key file, read with the same checks as Python's


#: Installs a keyring-refusing filter (EPERM, as Docker's profile), then runs argv[1:].
NO_KEYRING = """\
import errno, os, sys
import pyseccomp
f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
for name in ("keyctl", "add_key", "request_key"):
    f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
f.load()
os.execv(sys.argv[1], sys.argv[1:])
"""

#: `sandlock run` whose key file lives in TEST_KEY_DIR (the scene's, not the user's).
STORE = """\
import os, sys
sys.path.insert(0, os.environ["TEST_TREE"])
from sandlock.cli import launch
from sandlock.compile import cachekey
cachekey.key_directory = lambda: os.environ["TEST_KEY_DIR"]
sys.exit(launch.main_run(sys.argv[1:]))
"""


class KeyScene:
    """A HOME with the key file's directory and the cache; a copy of the front end whose
    key directory is that one and whose "Python" is /bin/true (so only its own checks run)."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        require_front()
        self.tmp = tmp_path
        self.key_dir = tmp_path / "home" / ".cache" / "sandlock"
        tree = str(Path(cache.__file__).resolve().parents[2])
        # the tree under test stores the entry (not an installed copy, whose code differs)
        self.env = {**env, "XDG_CACHE_HOME": str(tmp_path / "home" / ".cache"),
                    "TEST_KEY_DIR": str(self.key_dir), "TEST_TREE": tree}
        self.front = tmp_path / "sandlock-run"
        sys.path.insert(0, tree)
        try:
            import setup
        finally:
            sys.path.pop(0)
        why = setup.front_end_variant(str(self.front), "/bin/true", str(FRONT), str(self.key_dir))
        assert why is None, why
        self.policy = write_policy(tmp_path, POLICY)
        self.args = ["run", "--policy", str(self.policy), "--", "true"]

    def no_keyring(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", NO_KEYRING, *argv], env=self.env,
                              cwd=self.tmp, capture_output=True, text=True, timeout=60,
                              check=False)

    def store(self) -> None:
        done = self.no_keyring(sys.executable, "-c", STORE, *self.args[1:])
        assert done.returncode == 0, done.stderr
        assert (self.key_dir / cachekey.KEY_FILE).exists()

    def notes(self) -> dict[str, str]:
        done = self.no_keyring(str(self.front), *self.args)
        return dict(re.findall(r"^sandlock-run: (\w+): (.*)$", done.stderr, re.MULTILINE))


def _symlink(key: Path) -> None:
    real = key.with_name("real-key")
    key.rename(real)
    key.symlink_to(real)


def _second_link(key: Path) -> None:
    os.link(key, key.with_name("second"))


PLANTS: dict[str, Callable[[Path], object]] = {
    "symlink": _symlink,
    "group-readable": lambda key: key.chmod(0o640),
    "second-link": _second_link,
    "longer": lambda key: key.write_bytes(key.read_bytes() + b"x"),
    "open-directory": lambda key: key.parent.chmod(0o750),
    "control": lambda key: None,
}


@pytest.mark.parametrize("plant", PLANTS)
def test_the_key_file_is_checked_as_python_checks_it(plant: str, tmp_path: Path,
                                                    env: dict[str, str]) -> None:
    """Without the keyring the front end reads the key file Python made, and refuses one
    Python would refuse (each then falls back); control: the untouched file verifies."""
    scene = KeyScene(tmp_path, env)
    scene.store()
    PLANTS[plant](scene.key_dir / cachekey.KEY_FILE)
    notes = scene.notes()
    if plant == "control":
        assert notes.get("entry") == "verified", notes
    else:
        assert notes["fallback"] == "no trusted cache key" and "entry" not in notes


@pytest.mark.parametrize("attack", [True, False], ids=["front-end", "control-python-c"])
def test_the_fallback_runs_the_package_beside_it_not_the_working_directorys(
        attack: bool, tmp_path: Path, env: dict[str, str]) -> None:
    """A tool may leave a ``sandlock`` package in the directory the agent calls from: the
    fallback imports the package beside the front end. Control: ``python -c`` with the
    working directory first on sys.path does import the planted one."""
    require_front()
    (tmp_path / "sandlock").mkdir()
    (tmp_path / "sandlock" / "__init__.py").write_text("print('PLANTED')\n")
    env = {**env, "PYTHONPATH": "."}
    argv = ([str(FRONT), "--version"] if attack
            else [sys.executable, "-c", "import sandlock"])
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    assert ("PLANTED" in done.stdout) is not attack, done.stdout


# ----------------------------------------------------------------------------
# Re-checks after a verified entry (cache._fresh's): any change falls back


@pytest.mark.parametrize("change", ["extended-file", "optional-path", None])
def test_a_verified_entry_is_rechecked(change: str, tmp_path: Path, env: dict[str, str]) -> None:
    """An extended file edited, or an optional path that appeared, since the plan was
    compiled: the entry is stale and the Python CLI compiles afresh. Control: unchanged,
    the front end goes on to the hit (base, a built-in profile, is re-read too)."""
    parent = write_policy(tmp_path, POLICY, "parent.toml")
    appears = tmp_path / "appears"
    policy = write_policy(tmp_path, f'extends = ["base", "parent.toml"]\n[filesystem]\n'
                                    f'read = [{{ path = "{appears}", optional = true }}]\n')
    stored(policy, env, tmp_path)
    if change == "extended-file":
        parent.write_text(POLICY.replace('"/etc"', '"/etc", "/var"'))
    elif change == "optional-path":
        appears.mkdir()
    _, notes = front(["run", "--policy", str(policy), "--", "true"], env, tmp_path)
    assert notes["entry"] == "verified"
    assert notes["fallback"] == {
        "extended-file": "stale: an extended policy file changed",
        "optional-path": "stale: a policy path appeared or vanished",
        None: RAN}[change]


@pytest.mark.parametrize("log", ["on", "0"])
def test_with_the_run_log_on_the_python_cli_runs(log: str, tmp_path: Path,
                                                 env: dict[str, str]) -> None:
    """SANDLOCK_LOG is not in the native key: with the log on, the run must be checked
    against it and recorded, which only the Python CLI does; the front end falls back
    (and the record is there). Control: SANDLOCK_LOG=0 (off) goes on to the hit."""
    from sandlock.compile import runlog

    policy = write_policy(tmp_path, POLICY)
    stored(policy, env, tmp_path)
    log_dir = tmp_path / "log"
    done, notes = front(["run", "--policy", str(policy), "--", "true"],
                        {**env, runlog.ENV: str(log_dir) if log == "on" else "0"}, tmp_path)
    assert done.returncode == 0, done.stderr
    if log == "on":
        assert notes["fallback"].startswith("the run log is on"), notes
        assert len((log_dir / runlog.LOG_FILE).read_bytes().splitlines()) == 1
        state = cachekey.key_directory()
        if state is not None:  # the anchor this test's log left in the state directory
            Path(state, runlog.ANCHORS, runlog._anchor_name(str(log_dir))).unlink(missing_ok=True)
    else:
        assert notes["fallback"] == RAN, notes


# ----------------------------------------------------------------------------
# The witness: what the grant checks saw, seen again (compile/grants.py Witness)


def _replace_directory(path: Path) -> None:
    """Another directory of the same name, the old one moved aside (what a tool with write
    access to the parent can do between two runs)."""
    path.rename(path.with_name(path.name + ".old"))
    path.mkdir()


def _plant_link(path: Path) -> None:
    """The directory replaced by a link to another (a tool's planted link)."""
    elsewhere = path.with_name("elsewhere")
    elsewhere.mkdir()
    path.rename(path.with_name(path.name + ".old"))
    path.symlink_to(elsewhere)


def _dangling_link(path: Path) -> None:
    """A link to nothing where a protected directory is missing (a state directory not
    made yet): Python refuses to place it, the front end must not place its parent."""
    path.symlink_to(path.with_name("nowhere"))


def _hard_link(policy: Path) -> None:
    """A second name of the policy file in the write grant (ws, beside it)."""
    os.link(policy, policy.with_name("ws") / "copy.toml")


def _add_root(roots: Path) -> None:
    """Another state directory listed (a run in another environment kept state there):
    which directories are refused changed."""
    with open(roots, "a", encoding="utf-8") as handle:
        handle.write("/nonexistent-sandlock-test-root\n")
    roots.chmod(0o600)


def _rewrite_policy(policy: Path) -> None:
    """The policy file replaced by a copy, same bytes: the key is the same, the file
    (protected: a write grant may not reach it) is another."""
    copy = policy.with_name("copy.toml")
    copy.write_bytes(policy.read_bytes())
    copy.rename(policy)


def mount_or_skip(*args: str) -> None:
    """``mount ARGS``; the test skips where mounting is refused (root in a container
    without CAP_SYS_ADMIN, under its runtime's default seccomp profile)."""
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"mount refused here: {done.stderr.strip()[:200]}")


def _mount(path: Path) -> None:
    mount_or_skip("-t", "tmpfs", "none", str(path))


WITNESSED = {
    "grant-replaced": ("ws", _replace_directory, "stale: a grant resolves to another object"),
    "grant-link": ("ws", _plant_link, "a grant through a link Python would refuse"),
    "policy-replaced": ("policy", _rewrite_policy, "stale: a protected object moved"),
    "checkpoint-made": ("runs", Path.mkdir, "stale: the checkpoints or dry runs changed"),
    "mount": ("mnt", _mount, "stale: the mount table changed"),
    "root-listed": ("roots", _add_root,
                    "stale: a file that decides the Python import path changed"),
    "policy-hard-link": ("policy", _hard_link,
                         "a policy file has more than one hard link (Python judges it)"),
    "link-to-nothing": ("home-state", _dangling_link,
                        "stale: a protected path is a symbolic link to nothing"),
    "unchanged": ("ws", lambda _: None, RAN),
}


@pytest.mark.parametrize("change", WITNESSED)
def test_what_the_grant_checks_saw_is_seen_again(change: str, tmp_path: Path,
                                                 env: dict[str, str]) -> None:
    """The compile that stores a native entry records what its grant checks saw; the front
    end observes the same facts again and goes on only when all are equal (the checks read
    nothing else). A grant's directory replaced, a link planted in its place, a protected
    file replaced, a checkpoint made, a mount: each falls back to the Python CLI, which
    checks afresh. Control: unchanged, the front end goes on to the hit."""
    where, act, why = WITNESSED[change]
    if change == "mount" and os.geteuid() != 0:
        pytest.skip("mounting needs root")
    ws, mnt, home = tmp_path / "ws", tmp_path / "mnt", tmp_path / "home"
    ws.mkdir()
    mnt.mkdir()
    (home / ".cache").mkdir(parents=True)
    env = {**env, "HOME": str(home)}  # its state directory is missing: XDG_CACHE_HOME's is used
    policy = write_policy(tmp_path, f'extends = ["base"]\n{POLICY}write = ["{ws}"]\n')
    stored(policy, env, tmp_path)
    target = {"ws": ws, "policy": policy, "mnt": mnt, "home-state": home / ".cache" / "sandlock",
              "roots": Path(cachekey.roots_path() or "/nonexistent"),
              "runs": Path(env["XDG_CACHE_HOME"]) / "sandlock" / "runs"}[where]
    act(target)
    try:
        done, notes = front(["run", "--policy", str(policy), "--", "true"], env, tmp_path)
    finally:
        if change == "mount":
            subprocess.run(["umount", str(mnt)], check=True)
    assert notes.get("entry") == (None if change == "policy-hard-link" else "verified")
    assert notes["fallback"] == why, notes
    if change in ("grant-link", "link-to-nothing"):  # the Python CLI refuses it, as it must
        assert done.returncode == 125 and "symbolic link" in done.stderr, done.stderr
    elif change == "policy-hard-link":
        assert done.returncode == 125 and "2 hard links" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr


def test_a_policy_named_through_a_link_the_tool_may_write_is_not_the_same_hit(
        tmp_path: Path, env: dict[str, str]) -> None:
    """A relative policy name is walked from ``$PWD`` where that names the working
    directory (grants.named_directory), and the links on that way are protected: a write
    grant on one is refused, since the tool could point it at a policy of its own for the
    caller's next ``cd``. Attack: the plan stored when the caller came in by the real path
    was the hit of a caller that came in through a link in the write grant (the tool had
    made it): the front end ran it, the Python CLI refused it. The native key names the
    directory as the caller reached it: another way in is another entry, checked afresh.
    Control: by the real path again, the stored plan is the hit."""
    pols, out = tmp_path / "pols", tmp_path / "out"
    pols.mkdir()
    out.mkdir()
    write_policy(pols, f'extends = ["base"]\n{POLICY}write = ["{out}"]\n', "p.toml")
    args = ["run", "--policy", "p.toml", "--", "true"]
    done, notes = front(args, {**env, "PWD": str(pols)}, pols)
    assert done.returncode == 0, done.stderr
    assert notes["fallback"] in ("no entry", "no private cache directory"), notes
    (out / "lnk").symlink_to(pols)  # what the tool may make in its grant
    done, notes = front(args, {**env, "PWD": str(out / "lnk")}, pols)
    assert (notes["fallback"], done.returncode) == ("no entry", 125), (done.stderr, notes)
    assert "symbolic link the policy file" in done.stderr
    done, notes = front(args, {**env, "PWD": str(pols)}, pols)
    assert (notes["fallback"], done.returncode) == (RAN, 0), (done.stderr, notes)


@pytest.mark.any_user
def test_a_fact_that_changed_while_the_checks_ran_leaves_no_native_entry() -> None:
    """Two reads of the mount table (or two checkers' looks at one protected object) that
    differ during one compile: the witness is unsound and the plan gets no native entry
    (the front end would compare with facts no single check judged). Control: the same
    read twice keeps it sound."""
    from sandlock.compile.grants import Witness

    for second, sound in ((b"1 0 0:1 / / rw - x y z\n", True), (b"2 0 0:1 / / rw - x y z\n", False)):
        witness = Witness()
        witness.saw_mounts(b"1 0 0:1 / / rw - x y z\n")
        witness.saw_mounts(second)
        assert witness.sound is sound
    witness = Witness()
    witness.saw_listing("/x", ["a"])
    witness.saw_listing("/x", ["a", "b"])
    assert not witness.sound
    routeless: Any = type("Routeless", (), {"routes": None})()  # a plan without routes
    assert cache.native_payload(b"", {"signal_gate": False, "cgroup": None}, routeless,
                                (), witness) is None


@pytest.mark.parametrize("refresh", [True, False])
def test_a_stale_entry_is_written_anew(refresh: bool, tmp_path: Path, env: dict[str, str]) -> None:
    """A stale entry (here: a grant's directory replaced) is handed over with
    SANDLOCK_NATIVE_STALE=1: the Python CLI compiles afresh and writes a new entry, whose
    witness is today's world, so the next run goes on to the hit. Control: told nothing
    (the variable taken out on its way), the Python CLI runs its own cache hit and the
    entry stays stale."""
    ws = tmp_path / "ws"
    ws.mkdir()
    policy = write_policy(tmp_path, f'extends = ["base"]\n{POLICY}write = ["{ws}"]\n')
    stored(policy, env, tmp_path)
    _replace_directory(ws)
    run = ["run", "--policy", str(policy), "--", "true"]
    if refresh:
        done, notes = front(run, env, tmp_path)
    else:  # the Python CLI exactly as the front end starts it, without the variable
        start = ("import sys; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p not in "
                 "('', '.')]; from sandlock.cli.run import main; main(sys.argv[2:])")
        done = subprocess.run([sys.executable, "-c", start, str(HELPER_DIR.parents[2]), *run],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              check=False)
    assert done.returncode == 0, done.stderr
    _, notes = front(run, env, tmp_path)
    assert notes["fallback"] == (RAN if refresh
                                 else "stale: a grant resolves to another object"), notes


def test_a_protected_tree_mounted_twice_still_reaches_the_hit(tmp_path: Path,
                                                              env: dict[str, str]) -> None:
    """The state directory bind-mounted a second time (as containers and bind-mounted homes
    do): ".." of that mount's root is its mount point's parent, so a directory's parents
    depend on the mount it was reached through. The front end must walk up as the checks
    do, each time (a shortcut by inode made every such run stale, for good). Control: the
    first run after the mount is stale (the table changed) and writes the entry anew."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    ws, mnt = tmp_path / "ws", tmp_path / "sub" / "mnt"
    ws.mkdir()
    mnt.mkdir(parents=True)
    policy = write_policy(tmp_path, f'extends = ["base"]\n{POLICY}write = ["{ws}"]\n')
    stored(policy, env, tmp_path)
    mount_or_skip("--bind", env["XDG_CACHE_HOME"], str(mnt))
    try:
        run = ["run", "--policy", str(policy), "--", "true"]
        _, first = front(run, env, tmp_path)
        _, second = front(run, env, tmp_path)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert first["fallback"] == "stale: the mount table changed", first
    assert second["fallback"] == RAN, second


def test_a_python_variable_falls_back(tmp_path: Path, env: dict[str, str]) -> None:
    """PYTHONPATH (or any PYTHON* variable) changes the import path the Python CLI would
    protect: a directory on it may not be granted write, lest a tool plant a module the
    next launcher runs. The witness holds the import path of the interpreter started
    without them, so the front end falls back (and Python refuses the grant here).
    Control: without the variable it goes on to the hit."""
    ws = tmp_path / "ws"
    ws.mkdir()
    policy = write_policy(tmp_path, f'extends = ["base"]\n{POLICY}write = ["{ws}"]\n')
    stored(policy, env, tmp_path)
    run = ["run", "--policy", str(policy), "--", "true"]
    _, control = front(run, env, tmp_path)
    done, notes = front(run, {**env, "PYTHONPATH": str(ws)}, tmp_path)
    _, unrelated = front(run, {**env, "PYTHONUNBUFFERED": "1"}, tmp_path)
    assert control["fallback"] == RAN, control
    assert unrelated == control, unrelated  # one that changes no path: no fallback
    assert notes["fallback"].startswith("a PYTHON* variable is set"), notes
    assert done.returncode == 125 and "import path" in done.stderr, done.stderr


def test_a_pth_file_added_to_a_site_directory_makes_the_entry_stale(
        tmp_path: Path, env: dict[str, str]) -> None:
    """A .pth file in a site directory adds a directory to the import path (what an
    editable install of a project in the workspace does), with no variable changed: the
    witness lists each site directory's .pth files, with their digests, and the front end
    finds the new one. (The file added names a directory that does not exist: the
    interpreter's other users see no change.) Control: unchanged, it goes on to the hit."""
    policy = write_policy(tmp_path, POLICY)
    stored(policy, env, tmp_path)
    run = ["run", "--policy", str(policy), "--", "true"]
    _, control = front(run, env, tmp_path)
    key = bytes.fromhex(control["key"])  # magic, version, then the interpreter it runs
    fields: list[bytes] = []
    while len(fields) < 3:
        size = int.from_bytes(key[:4], "little")
        fields.append(key[4:4 + size])
        key = key[4 + size:]
    python = os.fsdecode(fields[2])
    directory = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    if not os.access(directory, os.W_OK):
        pytest.skip(f"{directory} is not writable by this user")
    planted = directory / f"zz-sandlock-test-{os.getpid()}.pth"
    planted.write_text(f"{tmp_path / 'nowhere'}\n")
    try:
        _, notes = front(run, env, tmp_path)
    finally:
        planted.unlink()
    assert control["fallback"] == RAN, control
    assert notes["fallback"] == "stale: a site directory's .pth files changed", notes


@pytest.mark.any_user
def test_the_native_key_names_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front end runs the interpreter it was built for; an entry stored by another
    (another venv over the same package) saw another import path and Python installation,
    so its key differs and the front end never finds it. Control: the same interpreter,
    the same key."""
    for name in cache.PYTHON_ENV:
        monkeypatch.delenv(name, raising=False)
    args: tuple[Any, ...] = ("/p.toml", b"", {}, None, False)
    mine = cache.native_key(*args)
    assert cache.native_key(*args) == mine
    monkeypatch.setattr(sys, "executable", "/another/venv/bin/python")
    assert cache.native_key(*args) != mine
    monkeypatch.undo()


@pytest.mark.any_user
@pytest.mark.parametrize("id_", ["getuid", "getgid", "getegid"])
def test_the_native_key_names_the_real_ids(id_: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter leaves its user site directory off its path when the real and
    effective ids differ (site.ENABLE_USER_SITE), so what it protects differs: the key
    holds the real uid, gid and effective gid as well as the euid. Control: unchanged."""
    for name in cache.PYTHON_ENV:
        monkeypatch.delenv(name, raising=False)
    args: tuple[Any, ...] = ("/p.toml", b"", {}, None, False)
    mine = cache.native_key(*args)
    assert cache.native_key(*args) == mine
    real = getattr(os, id_)()
    monkeypatch.setattr(os, id_, lambda: real + 1)
    assert cache.native_key(*args) != mine


def test_another_locale_is_another_key(tmp_path: Path, env: dict[str, str]) -> None:
    """The locale decides how the Python CLI decodes the policy's paths (its file system
    encoding): a run in another locale is another key, so the front end does not find
    the entry stored in the first. Control: the same locale goes on to the hit."""
    policy = write_policy(tmp_path, POLICY)
    env = {**env, "LANG": "C.UTF-8"}
    env.pop("LC_ALL", None)
    env.pop("LC_CTYPE", None)
    stored(policy, env, tmp_path)
    run = ["run", "--policy", str(policy), "--", "true"]
    _, same = front(run, env, tmp_path)
    _, other = front(run, {**env, "LANG": "C"}, tmp_path)
    assert same["fallback"] == RAN, same
    assert other["fallback"] == "no entry", other


@pytest.mark.parametrize("how", ["PYTHONNOUSERSITE", "-S", "-I", None])
def test_an_interpreter_started_otherwise_writes_no_native_entry(
        how: Optional[str], tmp_path: Path, env: dict[str, str]) -> None:
    """The front end starts its interpreter with no path variable and no flag; one started
    otherwise (no site directories, no user site, isolated) has another import path, so
    what its checks protected is not what the front end's would: it writes no native
    entry. Control: started as the front end starts it, it writes one."""
    policy = write_policy(tmp_path, POLICY)
    start = ("import sys; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p not in "
             "('', '.')]; from sandlock.cli.run import main; main(sys.argv[2:])")
    flags = [how] if how and how.startswith("-") else []
    extra = {how: "1"} if how == "PYTHONNOUSERSITE" else {}
    done = subprocess.run([sys.executable, *flags, "-c", start, str(HELPER_DIR.parents[2]),
                           "run", "--policy", str(policy), "--", "true"],
                          env={**env, **extra}, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    if how != "-S":  # (without its site directories a venv's interpreter lacks pyseccomp)
        assert done.returncode == 0, done.stderr
    entries = list(native_dir(env).iterdir()) if native_dir(env).exists() else []
    assert len(entries) == (1 if how is None else 0), entries


# ----------------------------------------------------------------------------
# The hit, run natively: what the Python CLI would run and print, confined as it would be

RUN_POLICY = """\
extends = ["base"]
[filesystem]
read = ["/usr", "/lib", "/etc", "{ws}"]
write = ["{ws}/out"]
exec = ["/usr/bin", "/usr/lib", "/bin", "{ws}/tool.sh"]
[env]
pass = ["PATH", "LANG", "LC_*", "KEEP", "SANDLOCK_NATIVE_STALE"]
set = {{ SET = "by-the-policy", KEEP = "replaced" }}
[limits]
file_size = 4096
cpu = 30
"""

#: name: (command, options, extra environment, stdin); each runs natively then through the
#: Python CLI, whose exit code, output and lines must be the same.
PARITY: dict[str, tuple[list[str], list[str], dict[str, str], str]] = {
    "output": (["sh", "-c", "echo out; echo err >&2"], [], {}, ""),
    "exit code and hint": (["sh", "-c", "exit 3"], [], {}, ""),
    "stdin": (["cat"], [], {}, "from the caller\n"),
    "signal": (["sh", "-c", "kill -SEGV $$"], [], {}, ""),
    "sigpipe, quiet": (["sh", "-c", "kill -PIPE $$"], [], {}, ""),
    "sigint, quiet": (["sh", "-c", "kill -INT $$"], [], {}, ""),
    "file size limit": (["sh", "-c", "head -c 10000 /dev/zero > out/big"], [], {}, ""),
    "cpu limit's cause": (["sh", "-c", "kill -KILL $$"], [], {}, ""),
    "timeout": (["sh", "-c", "sleep 1; echo not killed"], ["--timeout", "0.3"], {}, ""),
    "environment": (["env"], [], {"KEEP": "caller", "LC_X": "1", "DROP": "x", "LC_ALL": "C",
                                  "SANDLOCK_NATIVE_STALE": "1"}, ""),
    "realtime signal": (["sh", "-c", "kill -34 $$"], [], {}, ""),
    "a timeout of 1000 hours": (["sh", "-c", "exit 4"], ["--timeout", "1000h"], {}, ""),
    "PATH empty": (["tool.sh"], [], {"PATH": ""}, ""),
    "relative command": (["./tool.sh"], [], {}, ""),
    "empty PATH entry": (["tool.sh"], [], {"PATH": ":/usr/bin:/bin"}, ""),
    "not found": (["no-such-command-here"], [], {}, ""),
    "not executable": (["./data.txt"], [], {}, ""),
}


def run_scene(tmp_path: Path, env: dict[str, str], extra: str = "") -> Path:
    """A workspace with an output directory, a script and a file; the policy over it
    (and ``extra``, more of it)."""
    ws = tmp_path / "ws"
    (ws / "out").mkdir(parents=True)
    (ws / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    (ws / "tool.sh").chmod(0o755)
    (ws / "data.txt").write_text("data\n")
    return write_policy(tmp_path, RUN_POLICY.format(ws=ws) + extra)


def both_ways(args: list[str], env: dict[str, str], cwd: Path, stdin: str = ""
              ) -> tuple[subprocess.CompletedProcess[str], dict[str, str],
                         subprocess.CompletedProcess[str]]:
    """The front end's run, then the Python CLI's (the front end told to fall back)."""
    require_front()
    native = subprocess.run([str(FRONT), *args], env=env, cwd=cwd, input=stdin,
                            capture_output=True, text=True, timeout=60, check=False)
    notes = dict(re.findall(r"^sandlock-run: (\w+): (.*)$", native.stderr, re.MULTILINE))
    native.stderr = re.sub(r"^sandlock-run: .*\n", "", native.stderr, flags=re.MULTILINE)
    python = subprocess.run([str(FRONT), *args], env={**env, "SANDLOCK_NATIVE_RUN": "0"},
                            cwd=cwd, input=stdin, capture_output=True, text=True, timeout=60,
                            check=False)
    python.stderr = re.sub(r"^sandlock-run: .*\n", "", python.stderr, flags=re.MULTILINE)
    return native, notes, python


@pytest.mark.parametrize("case", PARITY)
def test_the_hit_runs_what_the_python_cli_runs(case: str, tmp_path: Path,
                                               env: dict[str, str]) -> None:
    """Exit code, output, warning, hint, timeout and signal lines, the tool's environment and
    its command lookup: the same from the native run as from the Python CLI. A command that
    is not found or not executable falls back (the Python CLI says which), as does one it
    would escape."""
    command, options, extra, stdin = PARITY[case]
    policy = run_scene(tmp_path, env)
    ws = tmp_path / "ws"
    env.update(extra)
    store, _ = front(["run", "--policy", str(policy), *options, "--", "true"], env, ws)  # a miss
    assert store.returncode == 0, store.stderr
    native, notes, python = both_ways(["run", "--policy", str(policy), *options, "--", *command],
                                      env, ws, stdin)
    assert notes["entry"] == "verified"
    if case in ("not found", "not executable", "PATH empty"):
        assert notes.get("fallback", "").startswith("the command is not found"), notes
    else:
        assert notes.get("hit") == "running it" and "fallback" not in notes, notes
    assert (native.returncode, native.stdout, native.stderr) == (
        python.returncode, python.stdout, python.stderr)
    expected = {"exit code and hint": 3, "signal": 139, "timeout": 124, "file size limit": 153,
                "not found": 127, "not executable": 126, "PATH empty": 127, "realtime signal": 162,
                "a timeout of 1000 hours": 4}.get(case)
    if expected is not None:
        assert native.returncode == expected, native.stderr
    if case == "environment":  # the filter held: not merely the same in both
        assert "DROP=" not in native.stdout and "KEEP=replaced" in native.stdout
        assert "SET=by-the-policy" in native.stdout and "LC_X=1" in native.stdout
        assert "SANDLOCK_NATIVE_STALE" not in native.stdout  # the Python CLI's mark only


def test_a_gap_is_warned_of_by_the_hit(tmp_path: Path, env: dict[str, str]) -> None:
    """A protection the run does not have (best effort) is named by the native run exactly
    as by the Python CLI, on every run (the warning is not only the miss's)."""
    policy = write_policy(tmp_path, f'extends = ["base"]\n{POLICY}[scope]\nsignals = false\n')
    args = ["run", "--policy", str(policy), "--best-effort", "--", "true"]
    first, _ = front(args, env, tmp_path)
    native, notes, python = both_ways(args, env, tmp_path)
    assert notes.get("hit") == "running it", notes
    assert "warning: NOT enforced" in native.stderr and "signal scope" in native.stderr
    assert native.stderr == python.stderr == first.stderr
    assert native.returncode == python.returncode == 0


@pytest.mark.parametrize("guard", [True, False], ids=["confined", "control-unconfined"])
def test_the_hit_is_confined(guard: bool, tmp_path: Path, env: dict[str, str]) -> None:
    """Run natively, the tool can neither write nor read outside its grants, nor connect to
    a loopback port the policy does not name; inside its grants it can (its file, its
    port). Control: the same script without sandlock does all three (the attacks are
    real)."""
    import socket

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret\n")
    with socket.socket() as server, socket.socket() as granted:
        for each in (server, granted):
            each.bind(("127.0.0.1", 0))
            each.listen(8)
        port, ok_port = server.getsockname()[1], granted.getsockname()[1]
        # TCP granted on one port: seccomp lets TCP sockets through, Landlock picks the port
        policy = run_scene(tmp_path, env, f"[network]\nconnect = [{ok_port}]\n")
        script = (f"echo planted > {outside}/planted; echo write=$?; "
                  f"cat {outside}/secret; echo read=$?; "
                  f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}'; echo connect=$?; "
                  f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{ok_port}'; echo granted=$?; "
                  "echo ok > out/inside; echo inside=$?")
        if guard:
            stored(policy, env, tmp_path / "ws")
            done, notes = front(["run", "--policy", str(policy), "--", "sh", "-c", script], env,
                                tmp_path / "ws")
            assert notes["fallback"] == RAN, notes
        else:
            done = subprocess.run(["sh", "-c", script], cwd=tmp_path / "ws", capture_output=True,
                                  text=True, timeout=60, check=False)
    results = dict(re.findall(r"^(\w+)=(\d+)$", done.stdout, re.MULTILINE))
    assert results["inside"] == results["granted"] == "0", done.stdout
    escaped = {name: results[name] == "0" for name in ("write", "read", "connect")}
    assert escaped == {"write": not guard, "read": not guard, "connect": not guard}, done.stdout
    assert (outside / "planted").exists() is not guard


@pytest.mark.parametrize("name", ["read_file", "runs"])
def test_the_probe_gives_the_same_rows_natively(name: str, tmp_path: Path,
                                                env: dict[str, str]) -> None:
    """The probe's escape attempts, run through the front end's native hit and through the
    Python CLI, on the same policy file: the same outcome for every one (a step, a rule or
    a limit the native run left out shows up as a different row)."""
    import json

    from sandlock.policy.model import load_policy
    from sandlock.probe import harness

    ws = tmp_path / "ws"
    run_scene(tmp_path, env)
    (ws / "notes.md").write_text("notes\n")
    parent = (Path(__file__).resolve().parent.parent / "policies" / "read_file.toml"
              if name == "read_file" else write_policy(tmp_path, RUN_POLICY.format(ws=ws),
                                                       "runs.toml"))
    # The probe's interpreter: what `sandlock probe` adds to the policy (runtime_rules).
    policy = write_policy(tmp_path, f'extends = ["{parent}", "python"]\n')
    variables = ["--var", f"workspace={ws}"]
    front(["run", "--policy", str(policy), *variables, "--", "true"], env, ws)  # stores
    loaded = load_policy(str(policy), variables={"workspace": str(ws)})
    source = harness.PAYLOAD.read_text()
    through: dict[str, dict[str, str]] = {}
    for way in ("1", "0"):
        with harness.Harness(loaded) as target:
            # No terminal: the front end hands a run with one to the Python CLI
            # (test_terminal.py), which gives the tool a pty of its own.
            done = subprocess.run(
                [str(FRONT), "run", "--policy", str(policy), *variables, "--",
                 harness.INTERPRETER, "-I", "-S", "-B", "-c", source, json.dumps(target.cfg)],
                env={**env, harness.ENV_CANARY: target.canary, "SANDLOCK_NATIVE_RUN": way},
                cwd=ws, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                check=False)
        if way == "1":
            assert "sandlock-run: hit: running it" in done.stderr, done.stderr[-2000:]
        rows = {}
        for line in done.stdout.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            rows[str(row["id"])] = str(row["outcome"])
        through[way] = rows
    assert len(through["1"]) > 100 and sum(o == "blocked" for o in through["1"].values()) > 60
    differ = {k: (v, through["0"].get(k)) for k, v in through["1"].items() if through["0"].get(k) != v}
    assert not differ and through["1"].keys() == through["0"].keys(), differ


def start_native(policy: Path, command: list[str], env: dict[str, str], cwd: Path
                 ) -> subprocess.Popen[str]:
    """The front end's run in the background, its first line of output read."""
    process = subprocess.Popen([str(FRONT), "run", "--policy", str(policy), "--", *command],
                               env=env, cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    if process.stdout.readline() != "ready\n":
        process.kill()
        pytest.fail(f"the run did not start: {process.communicate()}")
    return process


def ended(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Its output once it has exited; killed (with its group) if it does not within 30 s."""
    try:
        return process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split():
            os.killpg(int(pid), 9)
        process.communicate()
        raise


def test_a_signal_to_the_front_end_reaches_the_tool(tmp_path: Path, env: dict[str, str]) -> None:
    """SIGTERM sent to the front end is the tool's to handle (forwarded to its process
    group)."""
    import signal

    policy = run_scene(tmp_path, env)
    ws = tmp_path / "ws"
    stored(policy, env, ws)
    script = 'trap "echo got TERM; exit 7" TERM; echo ready; while :; do sleep 0.05; done'
    process = start_native(policy, ["sh", "-c", script], env, ws)
    process.send_signal(signal.SIGTERM)
    out, err = ended(process)
    assert (process.returncode, out) == (7, "got TERM\n"), err
    assert "sandlock-run: hit: running it" in err


def test_the_tools_tree_dies_with_the_front_end(tmp_path: Path, env: dict[str, str]) -> None:
    """The front end killed (SIGKILL: no chance to clean up): its watchdog, the tool's
    parent and subreaper, kills the tool's whole tree, a process that left the tool's
    session included."""
    import signal
    import time

    policy = run_scene(tmp_path, env)
    ws = tmp_path / "ws"
    stored(policy, env, ws)
    script = "setsid sleep 300 & echo $! > out/escapee; sleep 300 & echo ready; wait"
    process = start_native(policy, ["sh", "-c", script], env, ws)
    escapee = int((ws / "out" / "escapee").read_text())
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{escapee}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(escapee, signal.SIGKILL)
        pytest.fail("the tool's process outlived the front end")


WRAP = "import os, resource, signal, sys; {}; os.execv(sys.argv[1], sys.argv[1:])"


def wrapped(first: str, policy: Path, command: list[str], env: dict[str, str], native: str,
            cwd: Path) -> subprocess.CompletedProcess[str]:
    """The front end's run of ``command``, exec'd by a caller that did ``first``."""
    return subprocess.run([sys.executable, "-c", WRAP.format(first), str(FRONT), "run",
                           "--policy", str(policy), "--", *command],
                          env={**env, "SANDLOCK_NATIVE_RUN": native}, cwd=cwd,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_the_callers_own_children_are_left_alone(native: str, tmp_path: Path,
                                                 env: dict[str, str]) -> None:
    """A caller that started a process and then exec'd sandlock: that process is not the
    run's, and is neither killed nor reaped when the run ends."""
    import signal

    policy = run_scene(tmp_path, env)
    ws = tmp_path / "ws"
    stored(policy, env, ws)
    pidfile = tmp_path / "bystander"
    done = subprocess.run(["sh", "-c", f'sleep 30 <&- >&- 2>&- & echo $! > {pidfile}; exec "$@"',
                           "sh", str(FRONT),
                           "run", "--policy", str(policy), "--", "true"],
                          env={**env, "SANDLOCK_NATIVE_RUN": native}, cwd=ws, capture_output=True,
                          text=True, timeout=60, check=False)
    bystander = int(pidfile.read_text())
    try:
        state = Path(f"/proc/{bystander}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    finally:
        try:
            os.kill(bystander, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert done.returncode == 0, done.stderr
    assert ("sandlock-run: hit: running it" in done.stderr) is (native == "1")
    assert state in ("S", "R"), state


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_a_caller_that_ignores_sigchld_gets_the_tools_exit_code(native: str, tmp_path: Path,
                                                                 env: dict[str, str]) -> None:
    """SIGCHLD ignored by the caller (inherited across exec): the run still waits for its
    tool and exits with its code."""
    policy = run_scene(tmp_path, env)
    ws = tmp_path / "ws"
    stored(policy, env, ws)
    done = wrapped("signal.signal(signal.SIGCHLD, signal.SIG_IGN)", policy,
                   ["sh", "-c", "exit 3"], env, native, ws)
    assert done.returncode == 3, done.stderr
    # The native front end's own wait, not a fallback's (the Python CLI resets SIGCHLD too):
    # with SIGCHLD still ignored, a tool that ends before its watchdog opens a pidfd on it is
    # reaped by the kernel at once, and the run would fall back and run it again.
    assert ("sandlock-run: hit: running it" in done.stderr) is (native == "1"), done.stderr
    assert ("sandlock-run: fallback: off" in done.stderr) is (native == "0"), done.stderr
    assert done.stderr.count("sandlock-run: fallback") == (native == "0"), done.stderr


@pytest.mark.parametrize("case", ["warning", "hint"])
def test_a_stderr_nobody_reads_does_not_stop_the_run(case: str, tmp_path: Path,
                                                     env: dict[str, str]) -> None:
    """stderr a pipe whose reader is gone: sandlock's own lines are lost, never the run
    (a warning written before the tool starts must not keep it from running; the hint
    written after must not turn its exit code into a death by SIGPIPE)."""
    policy = run_scene(tmp_path, env, "[scope]\nsignals = false\n" if case == "warning" else "")
    ws = tmp_path / "ws"
    options = ["--best-effort"] if case == "warning" else []
    stored_run, _ = front(["run", "--policy", str(policy), *options, "--", "true"], env, ws)
    assert stored_run.returncode == 0, stored_run.stderr
    read, write = os.pipe()
    os.close(read)
    del env["SANDLOCK_NATIVE_DEBUG"]  # its lines would be the first to meet the closed pipe
    try:
        done = subprocess.run([str(FRONT), "run", "--policy", str(policy), *options, "--", "sh",
                               "-c", "echo ran > out/marker; exit 3"], env=env, cwd=ws,
                              stdout=subprocess.DEVNULL, stderr=write, timeout=60, check=False)
    finally:
        os.close(write)
    assert done.returncode == 3
    assert (ws / "out" / "marker").read_text() == "ran\n"


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_a_lower_hard_limit_is_another_plan(native: str, tmp_path: Path,
                                            env: dict[str, str]) -> None:
    """A plan caps each limit at the caller's hard limit when it is compiled; a caller with
    a lower hard limit than the one that stored it gets a plan of its own (not the stored
    one, which would fail to set, or with CAP_SYS_RESOURCE raise the caller's limit)."""
    policy = run_scene(tmp_path, env, "")
    policy.write_text(policy.read_text().replace("cpu = 30", "cpu = 30\nopen_files = 100"))
    ws = tmp_path / "ws"
    stored(policy, env, ws)
    done = wrapped("resource.setrlimit(resource.RLIMIT_NOFILE, (50, 50))", policy,
                   ["sh", "-c", "ulimit -n"], env, native, ws)
    assert (done.returncode, done.stdout) == (0, "50\n"), done.stderr


def test_the_python_cli_forwards_a_signal_that_comes_as_its_wait_begins(
        tmp_path: Path, env: dict[str, str]) -> None:
    """A signal caught just before the Python CLI's wait entered poll(2) was forwarded only
    when a second one came (about 1 run in 50 here): the arrival is written to a wakeup
    descriptor the wait watches. Statistical: 60 runs, each signalled as soon as the tool
    is up (the old code passed all 60 about one time in three)."""
    import signal

    policy = run_scene(tmp_path, env)
    ws = tmp_path / "ws"
    stored(policy, env, ws)
    script = 'trap "exit 7" TERM; echo ready; while :; do sleep 0.05; done'
    for _ in range(60):
        process = start_native(policy, ["sh", "-c", script],
                               {**env, "SANDLOCK_NATIVE_RUN": "0"}, ws)
        process.send_signal(signal.SIGTERM)
        _, err = ended(process)
        assert process.returncode == 7, err


@pytest.mark.parametrize("abi", [1, 3, 5])
def test_the_hit_at_an_older_abi(abi: int, tmp_path: Path, env: dict[str, str]) -> None:
    """SANDLOCK_ABI=N (an older kernel's rulesets; in the key): a policy that needs no
    supervisor there (no signal scope to stand in for) runs natively, with the same lines
    as the Python CLI (its warnings), and a write outside its grants is still refused."""
    policy = run_scene(tmp_path, env, "[scope]\nsignals = false\n")
    ws = tmp_path / "ws"
    env["SANDLOCK_ABI"] = str(abi)
    args = ["run", "--policy", str(policy), "--best-effort", "--", "sh", "-c",
            f"echo x > {tmp_path}/planted; echo write=$?; echo ok > out/inside; echo inside=$?"]
    first, _ = front(args, env, ws)
    native, notes, python = both_ways(args, env, ws)
    assert notes.get("hit") == "running it" and "fallback" not in notes, notes
    assert (native.returncode, native.stdout, native.stderr) == (
        python.returncode, python.stdout, python.stderr) == (
        first.returncode, first.stdout, first.stderr)
    assert "inside=0" in native.stdout and "write=0" not in native.stdout, native.stdout
    assert f"Landlock ABI {abi}" in native.stderr


def test_an_environment_entry_with_no_name_is_the_python_clis_to_refuse(
        tmp_path: Path, env: dict[str, str]) -> None:
    """An entry "=x=1" (execve allows it): the Python CLI refuses to pass it (exit 125);
    the native run hands it over rather than pass it on."""
    if shutil.which("perl") is None:
        pytest.skip("perl makes the entry (Python cannot)")
    policy = run_scene(tmp_path, env)
    policy.write_text(policy.read_text().replace('pass = ["PATH"', 'pass = ["*", "PATH"'))
    ws = tmp_path / "ws"
    stored(policy, env, ws)
    done = subprocess.run(["perl", "-e", '$ENV{""} = "x=1"; exec @ARGV', str(FRONT), "run",
                           "--policy", str(policy), "--", "env"], env=env, cwd=ws,
                          capture_output=True, text=True, timeout=60, check=False)
    assert "sandlock-run: fallback: an environment entry with no name" in done.stderr
    assert done.returncode == 125 and "=x=1" not in done.stdout


def test_a_c_locale_reaches_the_hit(tmp_path: Path, env: dict[str, str]) -> None:
    """No locale variable at all (cron, systemd units, containers): the interpreter that
    stores the entry sets LC_CTYPE itself (PEP 538), which the front end never sees; the
    key takes the locale as the caller gave it, so the next run is native."""
    for name in ("LANG", "LC_ALL", "LC_CTYPE", "LANGUAGE"):
        env.pop(name, None)
    policy = write_policy(tmp_path, POLICY)
    run = ["run", "--policy", str(policy), "--", "true"]
    first, _ = front(run, env, tmp_path)
    assert first.returncode == 0, first.stderr
    _, notes = front(run, env, tmp_path)
    assert notes["fallback"] == RAN, notes


@pytest.mark.parametrize("way", ["front end", "control-interpreter"])
def test_the_tool_gets_the_callers_locale_not_the_interpreters(way: str, tmp_path: Path,
                                                               env: dict[str, str]) -> None:
    """Started in the C locale, Python sets LC_CTYPE for its children (PEP 538): the tool's
    environment is still the caller's, from the Python CLI (the first run) as from the
    native run. Control: the interpreter does set it for a child of its own."""
    for name in ("LC_ALL", "LC_CTYPE", "LANGUAGE"):
        env.pop(name, None)
    env["LANG"] = "C"
    if way == "control-interpreter":
        done = subprocess.run([sys.executable, "-c", "import os; os.execvp('env', ['env'])"],
                              env=env, capture_output=True, text=True, timeout=60, check=True)
        assert "LC_CTYPE=" in done.stdout
        return
    policy = write_policy(tmp_path, POLICY + '[env]\npass = ["PATH", "LANG", "LC_*"]\n')
    args = ["run", "--policy", str(policy), "--", "env"]
    first, _ = front(args, env, tmp_path)
    second, notes = front(args, env, tmp_path)
    assert notes["fallback"] == RAN, notes
    assert "LANG=C\n" in first.stdout and "LC_CTYPE" not in first.stdout, first.stdout
    assert first.stdout == second.stdout


def test_a_missing_entry_is_written_by_the_python_cli(tmp_path: Path,
                                                       env: dict[str, str]) -> None:
    """A run in another locale (in the native key, not in the Python CLI's) after the first:
    the front end finds no entry and says so; the Python CLI, which has a hit of its own,
    compiles afresh for it, so the next run in that locale is native. Control: told
    nothing, it keeps its hit and writes no native entry."""
    policy = write_policy(tmp_path, POLICY)
    run = ["run", "--policy", str(policy), "--", "true"]
    stored(policy, {**env, "LANG": "C.UTF-8"}, tmp_path)
    other = {**env, "LANG": "C"}
    env_without_mark = {**other, "SANDLOCK_NATIVE_RUN": "0"}  # the control: no mark given
    done = subprocess.run([str(FRONT), *run], env=env_without_mark, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    _, control = front(run, other, tmp_path)
    assert control["fallback"] == "no entry", control
    _, notes = front(run, other, tmp_path)
    assert notes["fallback"] == RAN, notes


# ----------------------------------------------------------------------------
# The installed command (setup.py COMMAND): no path built in. It runs the Python CLI
# beside it, and learns that CLI's interpreter and package from the record it writes.

#: What pip writes as the console script `sandlock-python` (the tree under test's package).
#: Its own directory stays first on the import path, as in pip's.
PYTHON_CLI = ("#!{python}\nimport sys\nsys.path[1:1] = [{tree!r}]\n"
              "from sandlock.__main__ import main\nmain()\n")


def installed(where: Path, package_parent: Optional[Path] = None) -> Path:
    """A bin directory as an install leaves it: the command built as setup.py builds it,
    with the Python CLI beside it (running the package in ``package_parent``, else the tree
    under test's); the command."""
    require_front()
    tree = str(HELPER_DIR.parents[2])
    sys.path.insert(0, tree)
    try:
        import setup
    finally:
        sys.path.pop(0)
    where.mkdir(parents=True, exist_ok=True)
    why = setup.front_end_variant(str(where / "sandlock"), None, None)
    assert why is None, why
    (where / "sandlock-python").write_text(PYTHON_CLI.format(python=sys.executable,
                                                             tree=str(package_parent or tree)))
    (where / "sandlock-python").chmod(0o755)
    return where / "sandlock"


def run_installed(command: Path, args: list[str], env: dict[str, str], cwd: Path
                  ) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    done = subprocess.run([str(command), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60, check=False)
    notes = dict(re.findall(r"^sandlock-run: (\w+): (.*)$", done.stderr, re.MULTILINE))
    done.stderr = re.sub(r"^sandlock-run: .*\n", "", done.stderr, flags=re.MULTILINE)
    return done, notes


def records(env: dict[str, str]) -> list[Path]:
    return sorted(native_dir(env).glob(cache.FRONT_PREFIX + "*"))


ENV_POLICY = POLICY + '[env]\npass = ["PATH", "SANDLOCK_*"]\n'


def test_the_installed_command_runs_cached_policies_natively(tmp_path: Path,
                                                              env: dict[str, str]) -> None:
    """The first run falls back to the Python CLI beside the command, which stores the plan
    and the record of what it runs with; the next runs natively. Neither hands the
    record's name to the tool, though the policy passes SANDLOCK_*, even one the caller
    set (control: the caller's own SANDLOCK_MARK reaches it both ways)."""
    command = installed(tmp_path / "bin")
    policy = write_policy(tmp_path, ENV_POLICY)
    env.update({"SANDLOCK_MARK": "caller", cache.ENV_FRONT_END: "from-the-caller"})
    args = ["run", "--policy", str(policy), "--", "env"]
    first, notes = run_installed(command, args, env, tmp_path)
    assert first.returncode == 0, first.stderr
    assert notes["fallback"] in ("no private cache directory", "no entry"), notes
    assert len(records(env)) == 1
    second, notes = run_installed(command, args, env, tmp_path)
    assert notes.get("hit") == "running it", notes
    assert second.returncode == 0, second.stderr
    for done in (first, second):
        assert "SANDLOCK_MARK=caller" in done.stdout
        assert cache.ENV_FRONT_END not in done.stdout


def test_an_entry_without_its_record_is_written_again(tmp_path: Path,
                                                      env: dict[str, str]) -> None:
    """A record lost (pruned, or the cache copied) while the entries stay: the command says
    the entry is missing, so the Python CLI, which has a hit of its own, compiles afresh
    and writes the record; the next run is native."""
    command = installed(tmp_path / "bin")
    policy = write_policy(tmp_path, POLICY)
    args = ["run", "--policy", str(policy), "--", "true"]
    run_installed(command, args, env, tmp_path)
    (record,) = records(env)
    record.unlink()
    done, notes = run_installed(command, args, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert notes["fallback"] == "no entry: no record of the Python CLI beside this command"
    _, notes = run_installed(command, args, env, tmp_path)
    assert notes.get("hit") == "running it", notes


@pytest.mark.parametrize("changed", ["exec/spec.py", "cli/launch.py", "control-none"])
def test_a_change_to_the_code_makes_the_plan_stale(changed: str, tmp_path: Path,
                                                   env: dict[str, str]) -> None:
    """The code that builds what a native entry holds (the child's steps: exec/spec.py) or
    decides what the CLI refuses (cli/launch.py) changed in place (an editable install
    after a pull, a file patched): the next run is no hit, so the Python CLI of the new
    code runs it. Control: nothing changed, the run is native."""
    package = tmp_path / "pkg"
    shutil.copytree(HELPER_DIR.parents[1], package / "sandlock",
                    ignore=shutil.ignore_patterns("__pycache__", "sandlock-run", "sandlock-exec"))
    command = installed(tmp_path / "bin", package)
    policy = write_policy(tmp_path, POLICY)
    args = ["run", "--policy", str(policy), "--", "true"]
    run_installed(command, args, env, tmp_path)
    _, notes = run_installed(command, args, env, tmp_path)
    assert notes.get("hit") == "running it", notes
    if changed != "control-none":
        source = package / "sandlock" / changed
        source.write_text(source.read_text() + "\n# changed\n")
    done, notes = run_installed(command, args, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (notes.get("hit") == "running it") is (changed == "control-none"), notes


def test_every_subpackage_is_in_the_code_id() -> None:
    """The code id covers every subpackage (a new one must be added to cache.PACKAGES)."""
    root = HELPER_DIR.parents[1]
    found = sorted(d.name for d in root.iterdir() if (d / "__init__.py").exists())
    assert list(cache.PACKAGES) == found


def test_a_plan_depends_on_no_filesystem_encoding(tmp_path: Path, env: dict[str, str]) -> None:
    """The filesystem encoding follows the locale's data (LOCPATH names where glibc reads
    it), which no key holds: a policy path with a non-ASCII character names other bytes
    under ISO-8859-1 than under UTF-8. A plan stored under the one must not run natively
    under the other: a plan with such a text gets no native entry, and the Python CLI
    refuses it here. Controls: under UTF-8 the Python CLI refuses the path (a link in a
    directory a tool could write), under ISO-8859-1 it grants it."""
    require_tool("/usr/share/i18n/charmaps/ISO-8859-1.gz")
    locales = tmp_path / "locales"
    locales.mkdir()
    subprocess.run(["localedef", "-i", "en_US", "-f", "ISO-8859-1", str(locales / "xx_XX")],
                   capture_output=True, timeout=120, check=False)
    for name in ("LC_ALL", "LC_CTYPE", "LANGUAGE"):
        env.pop(name, None)
    env["LANG"] = "xx_XX"
    latin = {**env, "LOCPATH": str(locales)}
    ask = [sys.executable, "-c", "import sys; print(sys.getfilesystemencoding())"]
    assert subprocess.run(ask, env=latin, capture_output=True, text=True,
                          check=True).stdout.strip() == "iso8859-1"
    work = tmp_path / "w"
    work.mkdir()
    os.mkdir(bytes(work) + b"/\xe9")  # "\u00e9" in ISO-8859-1: a directory
    (tmp_path / "elsewhere").mkdir()
    os.symlink(str(tmp_path / "elsewhere"), bytes(work) + b"/\xc3\xa9")  # in UTF-8: a link
    policy = write_policy(tmp_path, POLICY + f'write = ["{work}/\u00e9"]\n')
    args = ["run", "--policy", str(policy), "--", "true"]
    python, _ = front(args, {**env, "SANDLOCK_NATIVE_RUN": "0"}, tmp_path)
    assert python.returncode == 125 and "symbolic link" in python.stderr, python.stderr
    stored_, _ = front(args, latin, tmp_path)
    assert stored_.returncode == 0, stored_.stderr
    done, notes = front(args, env, tmp_path)
    assert notes.get("hit") != "running it", notes
    assert done.returncode == 125 and "symbolic link" in done.stderr, done.stderr


def _forge(record: Path, other: Path) -> None:
    """A record naming a package of the attacker's, with a tag made without the key."""
    fields = b"".join(len(part).to_bytes(4, "little") + part for part in (
        bytes.fromhex(record.name[len(cache.FRONT_PREFIX):]), b"/usr/bin/python3",
        str(other).encode()))
    record.write_bytes(cache.FRONT_MAGIC + hashlib.blake2b(fields, digest_size=32).digest()
                       + fields)


RECORD_ATTACKS = {"forged": "the entry's tag does not verify",
                  "another command's": "the record's name differs",
                  "control": None}


@pytest.mark.parametrize("attack", RECORD_ATTACKS)
def test_a_record_is_used_only_as_its_python_cli_wrote_it(attack: str, tmp_path: Path,
                                                          env: dict[str, str]) -> None:
    """The record says which interpreter and package the key names: one forged without the
    cache key, or another command's under this one's name, is not used (the Python CLI
    runs the tool, correctly). Control: the record as written gives a native run."""
    one = installed(tmp_path / "one")
    two = installed(tmp_path / "two")
    policy = write_policy(tmp_path, POLICY)
    args = ["run", "--policy", str(policy), "--", "sh", "-c", "echo ran"]
    run_installed(one, args, env, tmp_path)
    (first,) = records(env)
    run_installed(two, args, env, tmp_path)
    (record,) = [path for path in records(env) if path != first]
    if attack == "forged":
        _forge(record, tmp_path / "planted")
    elif attack == "another command's":
        record.write_bytes(first.read_bytes())
    done, notes = run_installed(two, args, env, tmp_path)
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    if RECORD_ATTACKS[attack] is None:
        assert notes.get("hit") == "running it", notes
    else:
        assert notes.get("fallback") == RECORD_ATTACKS[attack], notes


@pytest.mark.parametrize("second", ["installed apart", "a copy, its Python CLI linked"])
def test_a_plan_another_command_stored_is_not_a_hit(second: str, tmp_path: Path,
                                                    env: dict[str, str]) -> None:
    """Each command's Python CLI protects its own directory (the first on its import path,
    and the one its script was run from, through a link too): a plan that grants writing
    where a second command lives, stored through the first, is no hit for the second,
    whose Python CLI refuses it; the tool cannot replace the second's Python CLI. The
    second: installed apart, or a copy of the first with the first's Python CLI linked
    beside it (ln -s). Control: through the first it runs and writes there."""
    # below ABI 6 this policy's signal scope is the signal gate, whose listener only Python
    # carries: the front end keeps no record of it and runs nothing itself
    require_abi(6, "the native front end running a plan itself")
    one = installed(tmp_path / "one")
    cli = tmp_path / "two" / "sandlock-python"
    if second == "installed apart":
        two = installed(tmp_path / "two")
    else:
        cli.parent.mkdir()
        two = Path(shutil.copy(one, cli.parent / "sandlock"))
        cli.symlink_to(tmp_path / "one" / "sandlock-python")
    genuine = os.readlink(cli) if cli.is_symlink() else cli.read_bytes()
    plain = write_policy(tmp_path, POLICY, "plain.toml")
    run_installed(two, ["run", "--policy", str(plain), "--", "true"], env, tmp_path)  # its record
    assert len(records(env)) == 1
    policy = write_policy(tmp_path, POLICY + f'write = ["{tmp_path / "two"}"]\n')
    args = ["run", "--policy", str(policy), "--", "sh", "-c", f"echo planted > {tmp_path / 'two' / 'x'}"]
    done, _ = run_installed(one, args, env, tmp_path)
    assert done.returncode == 0 and (tmp_path / "two" / "x").exists(), done.stderr  # the control
    attack = ["run", "--policy", str(policy), "--", "sh", "-c", f"rm -f {cli}; echo planted > {cli}"]
    done, notes = run_installed(two, attack, env, tmp_path)
    assert notes.get("hit") != "running it", notes
    assert done.returncode == 125 and "sandlock's own modules" in done.stderr, done.stderr
    assert (os.readlink(cli) if cli.is_symlink() else cli.read_bytes()) == genuine


@pytest.mark.parametrize("attack", [True, False], ids=["copy", "control-user-site"])
def test_a_copy_of_the_command_runs_no_package_near_it(attack: bool, tmp_path: Path) -> None:
    """A copy of the command in ~/.local/bin, with a package a tool planted in the user site
    beside it (~/.local/lib/python3.X/site-packages, which a write grant may reach): the
    copy runs only a Python CLI beside itself, finds none and says so (exit 125); nothing
    planted runs. Control: the interpreter with that user site does import the plant."""
    home = tmp_path / "home"
    site = home / ".local" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
        "site-packages"
    (site / "sandlock").mkdir(parents=True)
    marker = tmp_path / "PLANTED"
    (site / "sandlock" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (site / "sandlock" / "__main__.py").write_text("")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "c")}
    if attack:
        copy = home / ".local" / "bin" / "sandlock"
        copy.parent.mkdir(parents=True)
        shutil.copy(installed(tmp_path / "bin"), copy)
        done = subprocess.run([str(copy), "--version"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 125, done.stderr
        assert f"cannot start the Python CLI ({copy.parent}/sandlock-python)" in done.stderr
    else:
        subprocess.run(["/usr/bin/python3", "-c", "import sandlock"], env=env, cwd=tmp_path,
                       capture_output=True, timeout=60, check=False)
    assert marker.exists() is not attack


def test_a_wheel_installed_elsewhere_runs_cached_policies_natively(tmp_path: Path) -> None:
    """A wheel built in one environment and installed in another (a container, a wheel
    cache shared by venvs): the build's interpreter and source are gone, yet the command
    starts its Python CLI, and the second run of a policy is native."""
    from test_packaging import build

    built = build(tmp_path)
    assert built.returncode == 0, built.stderr
    shutil.rmtree(tmp_path / "venv")
    shutil.rmtree(tmp_path / "src")
    venv = tmp_path / "elsewhere"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300,
                   env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_FIND_LINKS": "",
                        "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    import click
    import h11
    import pyseccomp

    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "dependencies.pth").write_text("".join(  # after the install's own site-packages
        f"{Path(module.__file__ or '').parent.parent}\n" for module in (click, h11, pyseccomp)))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "SANDLOCK_NATIVE_DEBUG": "1"}
    policy = write_policy(tmp_path, POLICY)
    args = ["run", "--policy", str(policy), "--", "sh", "-c", "echo ran"]
    first, notes = run_installed(venv / "bin" / "sandlock", args, env, tmp_path)
    assert (first.returncode, first.stdout) == (0, "ran\n"), first.stderr
    assert "fallback" in notes
    second, notes = run_installed(venv / "bin" / "sandlock", args, env, tmp_path)
    assert (second.returncode, second.stdout) == (0, "ran\n"), second.stderr
    assert notes.get("hit") == "running it", notes
