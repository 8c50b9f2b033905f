"""The cache of compiled policies (sandlock/compile/cache.py): a hit behaves like a miss.

Every test runs the real CLI twice or more against a private cache directory
(XDG_CACHE_HOME) and checks on the real kernel what the confined command could
do. A hit is recognised by what it did not import: sandlock.policy.model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_abi, write_policy

from sandlock.compile import cache as fastpath
from sandlock.policy import model as policy

CAT_POLICY = """\
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}"]
exec = ["/usr/bin/cat", "/usr/bin/sh", "/usr/bin/dash", "/usr/bin/sleep"]
"""

# Runs `sandlock run` in a fresh interpreter and reports, as JSON on fd 3's stand-in
# (the last line of stderr), the exit code and whether the policy model was imported.
RUNNER = """\
import json, sys
from sandlock.cli import launch
code = launch.main_run(sys.argv[1:])
sys.stderr.write("\\n" + json.dumps({"code": code, "parsed": "sandlock.policy.model" in sys.modules}))
"""


@pytest.fixture
def cache_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(fastpath.ENV_NO_CACHE, None)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return env


def run(policy_file: Path, argv: list[str], env: dict[str, str], **variables: str
        ) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    args = ["--policy", str(policy_file)]
    for name, value in variables.items():
        args += ["--var", f"{name}={value}"]
    done = subprocess.run([sys.executable, "-c", RUNNER, *args, "--", *argv], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    head, _, last = done.stderr.rpartition("\n")
    done.stderr = head
    return done, json.loads(last)


def entries(env: dict[str, str]) -> list[Path]:
    directory = Path(env["XDG_CACHE_HOME"]) / "sandlock" / "policies"
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))


def test_second_run_is_a_hit_and_confines_the_same(workspace: Path, outside: Path,
                                                     cache_env: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    pol = write_policy(workspace.parent, CAT_POLICY)
    for expect_parsed in (True, False):
        inside, info = run(pol, ["cat", str(workspace / "notes.md")], cache_env, ws=str(workspace))
        assert (info["code"], info["parsed"]) == (0, expect_parsed), inside.stderr
        assert inside.stdout == "hello from the workspace\n"
        denied, info = run(pol, ["cat", str(outside / "secret.txt")], cache_env, ws=str(workspace))
        assert info["code"] == 1 and not info["parsed"]
        assert "Permission denied" in denied.stderr and "top secret" not in denied.stdout
        code, info = run(pol, ["sh", "-c", "exit 3"], cache_env, ws=str(workspace))
        assert info["code"] == 3, code.stderr
    assert len(entries(cache_env)) == 1
    assert oct(Path(cache_env["XDG_CACHE_HOME"], "sandlock", "policies").stat().st_mode & 0o777) == "0o700"


def test_other_variables_are_another_entry(workspace: Path, outside: Path,
                                            cache_env: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    pol = write_policy(workspace.parent, CAT_POLICY)
    run(pol, ["cat", str(workspace / "notes.md")], cache_env, ws=str(workspace))
    done, info = run(pol, ["cat", str(outside / "secret.txt")], cache_env, ws=str(outside))
    assert (info["code"], info["parsed"]) == (0, True)
    assert done.stdout == "top secret\n"
    assert len(entries(cache_env)) == 2


def test_vanished_path_is_an_error_as_without_cache(workspace: Path,
                                                     cache_env: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    data = workspace / "data"
    data.mkdir()
    pol = write_policy(workspace, CAT_POLICY.replace('["${ws}"]', '["${ws}/data"]'))
    assert run(pol, ["cat", "/dev/null"], cache_env, ws=str(workspace))[1]["code"] == 0
    data.rmdir()
    cached, info = run(pol, ["cat", "/dev/null"], cache_env, ws=str(workspace))
    uncached, _ = run(pol, ["cat", "/dev/null"], {**cache_env, fastpath.ENV_NO_CACHE: "1"},
                      ws=str(workspace))
    assert info["code"] == 125
    assert "does not exist" in cached.stderr
    assert cached.stderr == uncached.stderr


def test_changed_extended_file_is_seen(workspace: Path, outside: Path,
                                       cache_env: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    write_policy(workspace.parent, CAT_POLICY, name="parent.toml")
    pol = write_policy(workspace.parent, 'version = 1\nextends = ["parent.toml"]\n')
    secret = str(outside / "secret.txt")
    assert run(pol, ["cat", secret], cache_env, ws=str(workspace))[1]["code"] == 1
    write_policy(workspace.parent, CAT_POLICY.replace('["${ws}"]', f'["${{ws}}", "{outside}"]'),
                 name="parent.toml")
    done, info = run(pol, ["cat", secret], cache_env, ws=str(workspace))
    assert (info["code"], info["parsed"]) == (0, True)
    assert done.stdout == "top secret\n"


def test_optional_path_that_appears_is_granted(workspace: Path, cache_env: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    later = workspace / "later"
    pol = write_policy(workspace.parent, CAT_POLICY.replace(
        '["${ws}"]', '[{ path = "${ws}/later", optional = true }]'))
    assert run(pol, ["cat", str(later / "f")], cache_env, ws=str(workspace))[1]["code"] == 1
    later.mkdir()
    (later / "f").write_text("now here\n")
    done, info = run(pol, ["cat", str(later / "f")], cache_env, ws=str(workspace))
    assert (info["code"], done.stdout) == (0, "now here\n")


def test_write_grant_turned_into_root_symlink_is_refused(tmp_path: Path,
                                                         cache_env: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    out = tmp_path / "out"
    out.mkdir()
    pol = write_policy(tmp_path, CAT_POLICY.replace('read = ["${ws}"]', 'write = ["${ws}/out"]'))
    assert run(pol, ["cat", "/dev/null"], cache_env, ws=str(tmp_path))[1]["code"] == 0
    out.rmdir()
    out.symlink_to("/")
    done, info = run(pol, ["cat", "/dev/null"], cache_env, ws=str(tmp_path))
    assert info["code"] == 125
    assert "policy.toml:4: filesystem.write[0]" in done.stderr  # the full path names the line
    assert "is a symbolic link (to '/')" in done.stderr


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o707])
def test_cache_dir_others_can_reach_is_not_used(workspace: Path, cache_env: dict[str, str],
                                                mode: int) -> None:
    require_abi(1, "filesystem confinement")
    directory = Path(cache_env["XDG_CACHE_HOME"]) / "sandlock" / "policies"
    directory.mkdir(parents=True)
    directory.chmod(mode)
    pol = write_policy(workspace.parent, CAT_POLICY)
    for _ in range(2):
        done, info = run(pol, ["cat", str(workspace / "notes.md")], cache_env, ws=str(workspace))
        assert (info["code"], info["parsed"]) == (0, True), done.stderr
    assert entries(cache_env) == []


def test_corrupt_entry_is_ignored_and_replaced(workspace: Path, outside: Path,
                                               cache_env: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    pol = write_policy(workspace.parent, CAT_POLICY)
    run(pol, ["cat", "/dev/null"], cache_env, ws=str(workspace))
    [entry] = entries(cache_env)
    good = entry.read_bytes()
    for bad in (b"", b"garbage", good[:-7], good[:40] + bytes([good[40] ^ 1]) + good[41:]):
        entry.write_bytes(bad)
        denied, info = run(pol, ["cat", str(outside / "secret.txt")], cache_env, ws=str(workspace))
        assert (info["code"], info["parsed"]) == (1, True), denied.stderr
        assert entry.read_bytes() == good


def test_no_cache_variable_turns_it_off(workspace: Path, cache_env: dict[str, str]) -> None:
    pol = write_policy(workspace.parent, CAT_POLICY)
    env = {**cache_env, fastpath.ENV_NO_CACHE: "1"}
    for _ in range(2):
        assert run(pol, ["cat", "/dev/null"], env, ws=str(workspace))[1]["parsed"] is True
    assert not (Path(cache_env["XDG_CACHE_HOME"]) / "sandlock").exists()


def test_key_covers_what_compilation_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tripwire: the key holds the inputs of the built-in variables. A new built-in
    variable (or a new input of one) must be added to fastpath._key too."""
    assert set(policy.builtin_vars()) == {"cwd", "home", "tmpdir"}
    pol = write_policy(tmp_path, "version = 1\n")
    text = pol.read_bytes()
    base = fastpath._key(str(pol), text, {}, None, False)
    assert fastpath._key(str(pol), text + b"\n", {}, None, False) != base
    assert fastpath._key(str(pol), text, {"a": "1"}, None, False) != base
    assert fastpath._key(str(pol), text, {}, "1s", False) != base
    assert fastpath._key(str(pol), text, {}, None, True) != base
    for name in ("HOME", "TMPDIR", "SANDLOCK_ABI", "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, "/x")
        assert fastpath._key(str(pol), text, {}, None, False) != base
        monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert fastpath._key(str(pol), text, {}, None, False) != base


def test_policy_with_fields_the_cache_does_not_know_is_not_cached() -> None:
    plain = policy.loads_policy("version = 1\n")
    assert fastpath._cacheable(plain)
    for name, known in fastpath.KNOWN_FIELDS.items():
        assert known <= {f for f in getattr(policy, name).__dataclass_fields__}, name


def test_host_allowlist_policies_are_not_cached() -> None:
    """Features the cached path does not reproduce (here issue 7's host rules) are never cached."""
    with_hosts = policy.loads_policy('version = 1\n[network]\nallow = ["example.com:443"]\n')
    assert not fastpath._cacheable(with_hosts)


def test_best_effort_warnings_are_the_same_on_a_hit(workspace: Path,
                                                    cache_env: dict[str, str]) -> None:
    require_abi(4, "pretending an older ABI below TCP rules")
    pol = write_policy(workspace.parent, CAT_POLICY + "[network]\nconnect = [443]\n")
    env = {**cache_env, "SANDLOCK_ABI": "3"}
    first, info = run(pol, ["cat", "/dev/null"], env, ws=str(workspace))
    assert (info["code"], info["parsed"]) == (125, True)  # strict: refused, not cached
    args = ["--best-effort", "--policy", str(pol), "--var", f"ws={workspace}", "--", "cat",
            "/dev/null"]
    results = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", RUNNER, *args], env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        head, _, last = done.stderr.rpartition("\n")
        results.append((head, json.loads(last)))
    (miss, miss_info), (hit, hit_info) = results
    assert (miss_info["parsed"], hit_info["parsed"]) == (True, False)
    assert miss_info["code"] == hit_info["code"] == 0
    assert "TCP port restriction" in miss and miss == hit


@pytest.mark.parametrize("handler", [False, True])
def test_run_exit_code_and_atexit_handlers_survive_the_quick_exit(workspace: Path,
                                                                  cache_env: dict[str, str],
                                                                  handler: bool) -> None:
    """`sandlock run` leaves with os._exit only when no atexit handler is owed a run."""
    require_abi(1, "filesystem confinement")
    pol = write_policy(workspace.parent, CAT_POLICY)
    code = ("import atexit, sys\n"
            + ("atexit.register(lambda: print('atexit ran', flush=True))\n" if handler else "")
            + "from sandlock.cli import run as runcli\n"
            + f"runcli.main(['run', '--policy', {str(pol)!r}, '--var', 'ws={workspace}', '--',"
            + " 'sh', '-c', 'echo out; exit 4'])\n")
    done = subprocess.run([sys.executable, "-c", code], env=cache_env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 4, done.stderr
    assert done.stdout == ("out\natexit ran\n" if handler else "out\n")


def test_a_process_limit_is_cached_and_still_applied(workspace: Path, cache_env: dict[str, str]
                                                     ) -> None:
    """A policy with ``processes`` is a hit too, and the limit holds on the hit (through a
    pids cgroup when the caller can make one, else RLIMIT_NPROC for an ordinary user). As
    root without a cgroup the strict refusal must come back on every run, never a hit."""
    require_abi(1, "filesystem confinement")
    from sandlock.linux import cgroups

    pol = write_policy(workspace.parent, CAT_POLICY + "[limits]\nprocesses = 3\n")
    forks = "sleep 1 & sleep 1 & sleep 1 & sleep 1 & sleep 1 & sleep 1 & wait"
    root_without_cgroup = os.geteuid() == 0 and cgroups.find()[0] is None
    for expect_parsed in (True, False):
        done, info = run(pol, ["sh", "-c", forks], cache_env, ws=str(workspace))
        if root_without_cgroup:
            assert info["code"] == 125 and info["parsed"], done.stderr
            continue
        # The shell cannot start a fourth process: the limit holds, on the miss and the hit.
        assert info["parsed"] == expect_parsed and info["code"] == 2, done.stderr
        assert "fork" in done.stderr.lower(), done.stderr


def test_a_change_to_the_code_that_shapes_an_entry_makes_every_entry_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key holds the size and mtime of every module of the package root and of each
    subpackage (cache.PACKAGES): exec/ builds the child's steps a native entry holds, cli/
    decides what is refused. A file that is no module (a profile is read as a layer and
    compared on its own) is not in it."""
    import shutil

    import sandlock

    copy = tmp_path / "sandlock"
    shutil.copytree(sandlock.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(fastpath, "PACKAGE_DIR", str(copy))
    before = fastpath._code_id()
    for shaping in ("errors.py", "policy/model.py", "compile/seccomp.py", "linux/kernel.py",
                    "exec/spec.py", "cli/launch.py"):
        os.utime(copy / shaping, ns=(1, 1))
        after = fastpath._code_id()
        assert after != before, shaping
        before = after
    os.utime(copy / "policy" / "profiles" / "base.toml", ns=(1, 1))
    assert fastpath._code_id() == before


# Counts the loads of the policy (sandlock.policy.model._merge: one per parse, whatever it
# extends) in a `sandlock run` of a fresh interpreter.
COUNTING_RUNNER = """\
import json, sys
from sandlock.policy import model
merged = []
real = model._merge
model._merge = lambda *a, **k: merged.append(1) or real(*a, **k)
from sandlock.cli import launch
code = launch.main_run(sys.argv[1:])
sys.stderr.write("\\n" + json.dumps({"code": code, "loads": len(merged)}))
"""


def test_a_miss_loads_the_policy_once(workspace: Path, cache_env: dict[str, str]) -> None:
    """The plan is made from one load: the entry's path checks (the optional paths skipped
    included) come from it, not from loading the policy again to store it."""
    require_abi(1, "filesystem confinement")
    pol = write_policy(workspace.parent,
                       CAT_POLICY + 'write = [{ path = "${ws}/gone", optional = true }]\n')
    loads = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", COUNTING_RUNNER, "--policy", str(pol), "--var",
                               f"ws={workspace}", "--", "cat", str(workspace / "notes.md")],
                              env=cache_env, capture_output=True, text=True, timeout=60, check=False)
        head, _, last = done.stderr.rpartition("\n")
        info = json.loads(last)
        assert info["code"] == 0, head
        loads.append(info["loads"])
    assert loads == [1, 0]  # the miss loads once and stores; the hit loads nothing
    assert len(entries(cache_env)) == 1
