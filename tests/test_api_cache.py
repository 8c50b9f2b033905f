"""The API reads a policy file's plan back from the cache of compiled policies, as
`sandlock run` does (sandlock/compile/cache.py, ``through``): a hit confines as a miss
does, and the options the cache's key does not hold are never served from it.

Each Sandbox here is made in a fresh interpreter against a private cache directory
(XDG_CACHE_HOME); a hit is recognised by what it did not import: sandlock.policy.model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import write_policy
from test_fastpath import cache_env, run  # noqa: F401

POLICY = """\
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}"]
write = ["${out}"]
exec = ["/usr/bin/cat", "/usr/bin/sh", "/usr/bin/dash", "/usr/bin/sleep"]
[env]
set = { GREETING = "from the policy" }
[limits]
timeout = "30s"
"""

# Makes one Sandbox in a fresh interpreter, runs each command, and prints as JSON whether
# the policy model was imported before the first run, and each run's code and output.
RUNNER = """\
import json, sys
import sandlock
policy, variables, options, commands, cwd = json.loads(sys.argv[1])
box = sandlock.Sandbox(policy, vars=variables, **options)
parsed = "sandlock.policy.model" in sys.modules
runs = []
for argv in commands:
    done = box.run(argv, capture_output=True, cwd=cwd)
    runs.append([done.returncode, done.stdout.decode(errors="replace")])
grants = box.grants()["read"]
box.close()
print(json.dumps({"parsed": parsed, "runs": runs, "grants": grants}))
"""


@pytest.fixture
def scene(tmp_path: Path) -> dict[str, Path]:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello from the workspace\n")
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("top secret\n")
    return {"ws": ws, "out": out, "outside": outside,
            "policy": write_policy(tmp_path, POLICY, name="tool.toml")}


def api(scene: dict[str, Path], env: dict[str, str], commands: list[list[str]],
        cwd: Optional[Path] = None, policy: Any = None, **options: Any) -> dict[str, Any]:
    """``policy``: a dict instead of the scene's file."""
    variables = {"ws": str(scene["ws"]), "out": str(scene["out"])}
    done = subprocess.run([sys.executable, "-c", RUNNER,
                           json.dumps([str(scene["policy"]) if policy is None else policy,
                                       variables, options, commands,
                                       None if cwd is None else str(cwd)])],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def reads(scene: dict[str, Path]) -> list[list[str]]:
    return [["/usr/bin/cat", str(scene["ws"] / "notes.md")],
            ["/usr/bin/cat", str(scene["outside"] / "secret.txt")],
            ["/usr/bin/sh", "-c", "echo $GREETING"]]


def test_a_plan_the_api_stored_is_read_back_and_confines_alike(
        scene: dict[str, Path], cache_env: dict[str, str]) -> None:  # noqa: F811
    first = api(scene, cache_env, reads(scene))
    second = api(scene, cache_env, reads(scene))
    assert first["parsed"] and not second["parsed"]  # a miss, then a hit
    for result in (first, second):
        (code, text), (denied, secret), (_, greeting) = result["runs"]
        assert (code, text) == (0, "hello from the workspace\n")
        assert denied != 0 and "top secret" not in secret
        assert greeting == "from the policy\n"  # the plan's [env] set
        assert str(scene["ws"]) in result["grants"]  # the policy, loaded when asked for


def test_a_plan_the_cli_stored_is_a_hit_for_the_api(
        scene: dict[str, Path], cache_env: dict[str, str]) -> None:  # noqa: F811
    done, seen = run(scene["policy"], ["/usr/bin/cat", str(scene["ws"] / "notes.md")], cache_env,
                     ws=str(scene["ws"]), out=str(scene["out"]))
    assert done.returncode == 0 and seen["parsed"], done.stderr
    result = api(scene, cache_env, reads(scene))
    assert not result["parsed"]
    assert result["runs"][0] == [0, "hello from the workspace\n"]
    assert result["runs"][1][0] != 0 and "top secret" not in result["runs"][1][1]


def test_a_changed_policy_file_is_a_miss(scene: dict[str, Path],
                                         cache_env: dict[str, str]) -> None:  # noqa: F811
    api(scene, cache_env, [])
    scene["policy"].write_text(scene["policy"].read_text().replace('read = ["${ws}"]', "read = []"))
    result = api(scene, cache_env, reads(scene)[:1])
    assert result["parsed"]
    assert result["runs"][0][0] != 0  # the new file's grants: the workspace is no longer read


SLOW = [["/usr/bin/sleep", "3"]]


@pytest.mark.parametrize("shorter", [True, False], ids=["timeout=", "control"])
def test_a_timeout_option_is_never_served_from_the_cache(
        scene: dict[str, Path], cache_env: dict[str, str], shorter: bool) -> None:  # noqa: F811
    """The key holds no API timeout: the plan stored with the file's 30 s must not stand
    in for ``timeout=0.5``. Control: without it, the same run is a hit and completes."""
    api(scene, cache_env, [])
    options: dict[str, Any] = {"timeout": 0.5} if shorter else {}
    result = api(scene, cache_env, SLOW, **options)
    assert result["parsed"] == shorter
    assert (result["runs"][0][0] != 0) == shorter, result


def test_a_dry_run_is_never_served_from_the_cache(scene: dict[str, Path],
                                                  cache_env: dict[str, str]) -> None:  # noqa: F811
    """A stored plan grants the real directory: a dry run (whose grants move to copies)
    served from it would write the caller's files."""
    write = [["/usr/bin/sh", "-c", "echo changed > made.txt"]]  # in the working directory
    api(scene, cache_env, [])
    result = api(scene, cache_env, write, scene["out"], review="dry-run")
    assert result["parsed"] and result["runs"][0][0] == 0, result
    assert not (scene["out"] / "made.txt").exists()
    control = api(scene, cache_env, write, scene["out"])
    assert not control["parsed"] and (scene["out"] / "made.txt").read_text() == "changed\n"


def test_without_a_usable_cache_the_api_compiles(scene: dict[str, Path],
                                                 cache_env: dict[str, str]) -> None:  # noqa: F811
    env = {**cache_env, "SANDLOCK_NO_CACHE": "1"}
    for _ in range(2):
        result = api(scene, env, reads(scene)[:1])
        assert result["parsed"] and result["runs"] == [[0, "hello from the workspace\n"]]
    stored = Path(cache_env["XDG_CACHE_HOME"]) / "sandlock" / "policies"
    assert not stored.exists() or not os.listdir(stored)


LATER = """\
import json, os, sys
import sandlock
policy, first, then = sys.argv[1:]
os.chdir(first)
box = sandlock.Sandbox(policy)
hit = "sandlock.policy.model" not in sys.modules
os.chdir(then)
print(json.dumps([hit, box.grants()["write"], box.timeout]))
"""


def test_the_policy_of_a_hit_is_the_one_its_plan_was_compiled_from(
        tmp_path: Path, cache_env: dict[str, str]) -> None:  # noqa: F811
    """Loaded on first use, after the caller changed directory: ${cwd} is still the one
    the plan was compiled with (the policy's grants, its judge under trace)."""
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n[filesystem]\n'
                                    'write = ["${cwd}"]\n[limits]\ntimeout = "7s"\n', name="cwd.toml")
    first, then = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    then.mkdir()
    seen = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-P", "-c", LATER, str(policy), str(first), str(then)],
                              env=cache_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen.append(json.loads(done.stdout))
    assert [hit for hit, _, _ in seen] == [False, True]
    for _, writes, timeout in seen:
        assert str(first) in writes and str(then) not in writes
        assert timeout == 7.0


#: POLICY as a dict: its plan is cached as a file's is, keyed by its JSON.
AS_DICT: dict[str, Any] = {
    "version": 1, "extends": ["base"],
    "filesystem": {"read": ["${ws}"], "write": ["${out}"],
                   "exec": ["/usr/bin/cat", "/usr/bin/sh", "/usr/bin/dash", "/usr/bin/sleep"]},
    "env": {"set": {"GREETING": "from the policy"}}, "limits": {"timeout": "30s"}}


def test_a_dict_plan_is_read_back_and_confines_alike(
        scene: dict[str, Path], cache_env: dict[str, str]) -> None:  # noqa: F811
    first = api(scene, cache_env, reads(scene), policy=AS_DICT)
    second = api(scene, cache_env, reads(scene), policy=AS_DICT)
    assert first["parsed"] and not second["parsed"]  # a miss, then a hit
    for result in (first, second):
        (code, text), (denied, secret), (_, greeting) = result["runs"]
        assert (code, text) == (0, "hello from the workspace\n")
        assert denied != 0 and "top secret" not in secret
        assert greeting == "from the policy\n"
        assert str(scene["ws"]) in result["grants"]  # the dict, loaded when asked for


def test_a_changed_dict_is_a_miss(scene: dict[str, Path],
                                  cache_env: dict[str, str]) -> None:  # noqa: F811
    api(scene, cache_env, [], policy=AS_DICT)
    narrower = {**AS_DICT, "filesystem": {**AS_DICT["filesystem"], "read": []}}
    result = api(scene, cache_env, reads(scene)[:1], policy=narrower)
    assert result["parsed"]
    assert result["runs"][0][0] != 0  # its own grants: the workspace is no longer read


@pytest.mark.parametrize("changed", [True, False], ids=["layer changed", "control"])
def test_a_dict_whose_extended_file_changed_is_a_miss(
        scene: dict[str, Path], cache_env: dict[str, str],  # noqa: F811
        tmp_path: Path, changed: bool) -> None:
    """The file a dict extends is re-read at every hit: narrowed since, the stored plan
    (which granted the workspace) must not be served. Control: unchanged, a hit."""
    layer = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n[filesystem]\n'
                                   f'read = ["{scene["ws"]}"]\n', name="layer.toml")
    policy = {"version": 1, "extends": [str(layer)],
              "filesystem": {"exec": ["/usr/bin/cat"]}}
    assert api(scene, cache_env, reads(scene)[:1], policy=policy)["runs"][0][0] == 0
    if changed:
        layer.write_text('version = 1\nextends = ["base"]\n')
    result = api(scene, cache_env, reads(scene)[:1], policy=policy)
    assert result["parsed"] == changed
    assert (result["runs"][0][0] != 0) == changed


def test_a_dict_of_other_types_is_compiled_every_time(
        scene: dict[str, Path], cache_env: dict[str, str]) -> None:  # noqa: F811
    """Only exact JSON types are keyed by their JSON (a subclass may load as something
    else): a dict holding a str subclass is compiled in each process. Control: the same
    dict of plain strs is stored, then read back."""
    seen: dict[str, list[str]] = {}
    for kind in ("Name", "str"):
        for _ in range(2):
            done = subprocess.run([sys.executable, "-c", f"""
import sys
import sandlock
class Name(str):
    pass
sandlock.Sandbox({{"extends": ["base"], "filesystem": {{"read": [{kind}("/usr")]}}}}).close()
print("sandlock.policy.model" in sys.modules)
"""], env=cache_env, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
            seen.setdefault(kind, []).append(done.stdout.strip())
    assert seen == {"Name": ["True", "True"], "str": ["True", "False"]}


FILE_NAMED_AS_DICT = """\
import json, os, sys
import sandlock
policy, name, cwd = json.loads(sys.argv[1])
os.chdir(cwd)
sandlock.Sandbox(policy).close()  # stores the dict's plan
with open(name, "w") as handle:  # a file holding the dict's text exactly
    handle.write(json.dumps(policy, sort_keys=True))
try:
    sandlock.Sandbox(name)
except sandlock.PolicyError:
    print("refused")
else:
    print("served")
"""


def test_a_file_holding_a_dicts_text_is_not_served_its_plan(
        tmp_path: Path, cache_env: dict[str, str]) -> None:  # noqa: F811
    """A dict's plan is stored under a name no file has: a tool that writes the dict's
    JSON into a file in the caller's directory (under any name) gets a policy error for
    its invalid TOML, never the plan the dict was compiled to."""
    work = tmp_path / "work"
    work.mkdir()
    policy = {"version": 1, "extends": ["base"], "filesystem": {"write": [str(work)]}}
    done = subprocess.run([sys.executable, "-P", "-c", FILE_NAMED_AS_DICT,
                           json.dumps([policy, "policy.json", str(work)])],
                          env=cache_env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused"]


IMPORTS = """
import json, sys
import sandlock
box = sandlock.Sandbox(json.loads(sys.argv[1]))
print(json.dumps(sorted(name for name in ("typing", "dataclasses", "inspect", "sandlock.policy.model")
                        if name in sys.modules)))
"""


def test_a_hit_imports_neither_typing_nor_dataclasses(cache_env: dict[str, str]) -> None:  # noqa: F811
    """What the first Sandbox() of a cached plan costs is mostly imports: typing and
    dataclasses (with inspect) were 10 of its 34 ms. Neither is on that path."""
    policy = json.dumps({"extends": ["base"], "filesystem": {"exec": ["/usr/bin/true"]}})
    seen = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", IMPORTS, policy], env=cache_env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen.append(json.loads(done.stdout))
    assert "sandlock.policy.model" in seen[0]  # a miss compiles (and imports what it needs)
    assert seen[1] == [], seen[1]
