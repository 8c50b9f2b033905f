"""[limits] processes is a limit of the sandbox, root included, or a reported gap.

RLIMIT_NPROC does not bind root and counts every process of the user. When the
caller can create a pids cgroup, each run gets its own (sandlock.linux.cgroups); else an
ordinary user keeps RLIMIT_NPROC (reported: per user) and root cannot be limited
(strict: refused, exit 125; best-effort: reported). Every report path is checked:
`sandlock run` stderr, `explain`, `check`, ``Sandbox.warnings``.

Safety: nothing here can fork without bound. Counting tests fork N+5 sleepers at
most. The fork bombs run only inside an outer cap the test sets and verifies first:
as root an outer pids cgroup (pids.max = OUTER_MAX) the launcher is moved into
before it execs; as an ordinary user ``prlimit --nproc``. Without such a cap they
are skipped. Every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import limit_tools
import pytest
from conftest import IS_ROOT, PYTHON, require_abi, write_policy

import sandlock
from sandlock.compile import ruleset
from sandlock.errors import KernelSupportError
from sandlock.linux import cgroups

TESTS = str(Path(__file__).resolve().parent)
BASE, WHY_NOT = cgroups.find()
needs_cgroup = pytest.mark.skipif(
    BASE is None, reason=f"this caller cannot create a pids cgroup ({WHY_NOT})")
OUTER_MAX = 300
LIMIT = limit_tools.LIMIT
SPAWN, POLICY = limit_tools.SPAWN, limit_tools.POLICY


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "filesystem confinement")


def sandlock_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOCK_")}
    env["SANDLOCK_NO_CACHE"] = "1"
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "sandlock", *args], capture_output=True,
                          text=True, env=env or sandlock_env(), timeout=120)


# ----------------------------------------------------------------------------
# The outer cap of the root tests: a pids cgroup the test makes, verifies, then removes


class Outer:
    """A pids cgroup of the test (root, cgroup v1 or a v2 base): ``wrap`` moves a
    command into it before it execs, and refuses to run it if it is not capped."""

    def __init__(self, base: cgroups.Base) -> None:
        self.group = cgroups.Group(base, OUTER_MAX)
        os.close(self.group.procs_fd)
        self.group.procs_fd = -1

    def wrap(self) -> tuple[str, ...]:
        check = textwrap.dedent(f"""\
            import os, sys
            path = {self.group.path!r}
            with open(path + "/cgroup.procs", "w") as procs:
                procs.write("0")
            mine = open("/proc/self/cgroup").read()
            capped = open(path + "/pids.max").read().strip() == "{OUTER_MAX}"
            if ":{self.group.relative}\\n" not in mine or not capped:
                sys.exit(99)  # not inside the cap: run nothing
            os.execv(sys.argv[1], sys.argv[1:])
            """)
        return (sys.executable, "-c", check)

    def leftovers(self) -> tuple[list[int], list[str]]:
        subgroups = [n for n in os.listdir(self.group.path)
                     if os.path.isdir(os.path.join(self.group.path, n))]
        return self.group.members(), subgroups

    def close(self) -> None:
        """Kill and remove the groups the run left inside the cap (a run that failed or
        hung leaves its own group there: with cgroup v1 the cap's kill does not reach a
        nested group), then the cap itself."""
        limit_tools.remove_cgroup_tree(self.group.path, keep_top=True)
        self.group.close()


@pytest.fixture
def outer() -> Iterator[Outer]:
    if not IS_ROOT or BASE is None:
        pytest.skip("an outer pids cgroup needs root and a pids cgroup hierarchy")
    cap = Outer(BASE)
    try:
        yield cap
    finally:
        cap.close()


# ----------------------------------------------------------------------------
# The limit holds, for root too, on every path; nothing is left behind


@needs_cgroup
def test_cli_limit_counts_the_sandbox(tmp_path: Path, outer: Outer) -> None:
    policy = write_policy(tmp_path, POLICY)
    result = cli("run", "--policy", str(policy), "--", PYTHON, "-c", SPAWN, prefix=outer.wrap())
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == LIMIT - 1  # the tool is one of its LIMIT processes
    assert "process limit" not in result.stderr  # enforced: nothing to report
    assert outer.leftovers() == ([], [])


API_PATHS = """\
import os, sys
sys.path.insert(0, {tests!r})
import limit_tools, sandlock
box = sandlock.Sandbox({policy!r})
assert box.warnings == [], box.warnings
spawn = [{python!r}, "-c", {spawn!r}]
native = box.run(spawn, capture_output=True, text=True)
os.environ["SANDLOCK_NATIVE"] = "0"
forked = box.run(spawn, capture_output=True, text=True)
calls = [box.call(limit_tools.spawn_sleepers, {count}) for _ in range(2)]
print(native.stdout.strip(), forked.stdout.strip(), *calls)
"""


@needs_cgroup
def test_api_limit_counts_the_sandbox_on_every_path(tmp_path: Path, outer: Outer) -> None:
    """Native helper, fork server, and call() (the second call runs in a spare made
    ahead of it, so in a group made before the call)."""
    policy = write_policy(tmp_path, POLICY)
    code = API_PATHS.format(tests=TESTS, policy=str(policy), python=PYTHON, spawn=SPAWN,
                            count=LIMIT + 5)
    result = subprocess.run([*outer.wrap(), sys.executable, "-c", code], capture_output=True,
                            text=True, env=sandlock_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(LIMIT - 1)] * 4, result.stderr
    assert outer.leftovers() == ([], [])


def test_in_process_api_reports_and_applies_the_limit(tmp_path: Path) -> None:
    """In this process: with a cgroup nothing is reported and the limit holds; without
    one (an ordinary user here), the per-user gap is in ``warnings``."""
    box = sandlock.Sandbox(str(write_policy(tmp_path, POLICY)), best_effort=True)
    with box:
        if BASE is not None:
            assert box.warnings == []
            assert box.call(limit_tools.spawn_sleepers, LIMIT + 5) == LIMIT - 1
        else:
            assert IS_ROOT or any("per-sandbox process limit" in w and "RLIMIT_NPROC" in w
                                  for w in box.warnings), box.warnings


# ----------------------------------------------------------------------------
# No cgroup: refused for root in strict mode, reported everywhere otherwise

NO_CGROUP = {cgroups.ENV_NO_CGROUP: "1"}


def test_run_without_a_cgroup_refuses_root_and_warns_a_user_once(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, POLICY)
    result = cli("run", "--policy", str(policy), "--", PYTHON, "-c", "print('ran')",
                 env=sandlock_env(**NO_CGROUP))
    if IS_ROOT:
        assert result.returncode == 125, result.stderr
        assert result.stdout == ""
        assert f"process limit (processes = {LIMIT})" in result.stderr
        assert "RLIMIT_NPROC does not bind root" in result.stderr
        assert "--best-effort" in result.stderr and "pids cgroup" in result.stderr
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == 0 and result.stdout == "ran\n", result.stderr
        assert result.stderr.count("per-sandbox process limit") == 1, result.stderr
        assert "per user" in result.stderr or "every process of this user" in result.stderr


def test_best_effort_without_a_cgroup_runs_and_warns_once(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, POLICY)
    result = cli("run", "--best-effort", "--policy", str(policy), "--", PYTHON, "-c",
                 "print('ran')", env=sandlock_env(**NO_CGROUP))
    assert result.returncode == 0 and result.stdout == "ran\n", result.stderr
    assert result.stderr.count(f"process limit (processes = {LIMIT})") == 1, result.stderr


def test_api_without_a_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cgroups.ENV_NO_CGROUP, "1")
    monkeypatch.setattr(cgroups, "_found", None)  # looked up again, with the variable
    try:
        policy = str(write_policy(tmp_path, POLICY))
        if IS_ROOT:
            with pytest.raises(KernelSupportError, match=r"(?s)processes = 6.*best-effort"):
                sandlock.Sandbox(policy)
        with sandlock.Sandbox(policy, best_effort=True) as box:
            (line,) = box.warnings
            assert f"processes = {LIMIT}" in line
            assert ("RLIMIT_NPROC does not bind root" if IS_ROOT else "RLIMIT_NPROC") in line
            assert box.grants()["not_enforced"] == [line]
    finally:
        cgroups._found = None


def test_explain_never_claims_an_unenforced_limit(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, POLICY)
    result = cli("explain", "--policy", str(policy), env=sandlock_env(**NO_CGROUP))
    assert result.returncode == 0, result.stderr
    assert "Everything this policy relies on is enforced" not in result.stdout
    assert f"process limit (processes = {LIMIT})" in result.stdout
    refused = "strict mode: `sandlock run` will refuse" in result.stdout
    assert refused == IS_ROOT  # a user's per-user limit is a gap a strict policy accepts
    report = json.loads(cli("explain", "--policy", str(policy), "--json",
                            env=sandlock_env(**NO_CGROUP)).stdout)
    (line,) = report["not_enforced"]
    assert f"processes = {LIMIT}" in line
    assert report["refused_in_strict"] == ([line] if IS_ROOT else [])


@needs_cgroup
def test_explain_with_a_cgroup_reports_nothing(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, POLICY)
    report = json.loads(cli("explain", "--policy", str(policy), "--json").stdout)
    assert report["not_enforced"] == []


def test_check_reports_whether_processes_is_per_sandbox() -> None:
    result = cli("check", "--json")
    assert result.returncode == 0, result.stderr
    (row,) = [f for f in json.loads(result.stdout)["features"] if "pids cgroup" in f["feature"]]
    assert row["available"] == (BASE is not None)
    if BASE is None:
        assert WHY_NOT in row["detail"]
    no = json.loads(cli("check", "--json", env=sandlock_env(**NO_CGROUP)).stdout)
    (row,) = [f for f in no["features"] if "pids cgroup" in f["feature"]]
    assert not row["available"]
    assert ("does not bind root" if IS_ROOT else "per user") in row["detail"]


# ----------------------------------------------------------------------------
# Fork bombs, only under an outer cap set and verified first

BOMB = textwrap.dedent("""\
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
    """)
#: The tool's first process ends at once; what it forked goes on bombing.
BOMB_AND_EXIT = textwrap.dedent("""\
    import os, sys
    if os.fork() == 0:
        while True:
            try:
                os.fork()
            except OSError:
                pass
    sys.exit(0)
    """)
BOMB_POLICY = """\
version = 1
extends = ["python"]
[limits]
processes = {limit}
timeout = "2s"
"""


@needs_cgroup
@pytest.mark.parametrize(("code", "expected"), [(BOMB, 124), (BOMB_AND_EXIT, 0)],
                         ids=["bomb", "bomb-and-exit"])
def test_root_fork_bomb_is_contained_and_killed(tmp_path: Path, outer: Outer, code: str,
                                                expected: int) -> None:
    """Issue 17 item 6: the bomb is killed at once (timeout: 124; its first process's
    own exit: its code), and nothing of it is left."""
    policy = write_policy(tmp_path, BOMB_POLICY.format(limit=50))
    result = cli("run", "--policy", str(policy), "--", PYTHON, "-c", code, prefix=outer.wrap())
    assert result.returncode == expected, result.stderr
    assert outer.leftovers() == ([], [])
    peak = Path(outer.group.path, "pids.peak")
    if peak.exists():
        assert int(peak.read_text()) <= 50 + 4  # the bomb's group + the launcher's few


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return count


@pytest.mark.skipif(IS_ROOT, reason="root: the bomb runs under an outer pids cgroup above")
def test_user_fork_bomb_under_prlimit(tmp_path: Path) -> None:
    cap = _user_processes() + 60
    policy = write_policy(tmp_path, BOMB_POLICY.format(limit=cap))
    result = cli("run", "--policy", str(policy), "--", PYTHON, "-c", BOMB,
                 prefix=("prlimit", f"--nproc={cap}:{cap}"))
    assert result.returncode == 124, result.stderr


# ----------------------------------------------------------------------------
# Pure parts: where a base is found, what a gap says


def _tree(tmp_path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _mountinfo(v2: str | None = None, v1: str | None = None) -> str:
    lines = []
    if v2:
        lines.append(f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw")
    if v1:
        lines.append(f"39 31 0:36 / {v1} rw,relatime - cgroup cgroup rw,pids")
    return "\n".join(lines) + "\n"


def test_choose_v1_pids_hierarchy(tmp_path: Path) -> None:
    _tree(tmp_path, {"pids/a/cgroup.procs": ""})
    base, why = cgroups.choose(_mountinfo(v1=str(tmp_path / "pids")), "8:pids:/a\n0::/\n")
    assert base == cgroups.Base(1, str(tmp_path / "pids/a"), "/a") and why == ""


def test_choose_v2_own_cgroup_or_its_parent(tmp_path: Path) -> None:
    root = tmp_path / "v2"
    _tree(tmp_path, {"v2/cgroup.controllers": "cpu memory pids\n",
                     "v2/cgroup.subtree_control": "memory pids\n",
                     "v2/app/cgroup.procs": "", "v2/app/cgroup.subtree_control": "",
                     "v2/cgroup.procs": ""})
    mountinfo = _mountinfo(v2=str(root))
    assert cgroups.choose(mountinfo, "0::/\n")[0] == cgroups.Base(2, str(root), "/")
    # In /app, which has processes (this caller): a sibling under the parent.
    assert cgroups.choose(mountinfo, "0::/app\n")[0] == cgroups.Base(2, str(root), "/")
    (root / "cgroup.subtree_control").write_text("memory\n")
    base, why = cgroups.choose(mountinfo, "0::/app\n")
    assert base is None and "pids controller" in why


def test_choose_nothing_without_pids(tmp_path: Path) -> None:
    _tree(tmp_path, {"v2/cgroup.controllers": "cpu memory\n"})
    base, why = cgroups.choose(_mountinfo(v2=str(tmp_path / "v2")), "0::/\n")
    assert base is None and "pids" in why


def test_process_gap_texts() -> None:
    assert ruleset.process_gap(None, "x", True) is None
    assert ruleset.process_gap(8, None, True) is None  # a cgroup: enforced
    root = ruleset.process_gap(8, "no hierarchy", True)
    user = ruleset.process_gap(8, "no hierarchy", False)
    assert root is not None and user is not None
    assert root.strict and not user.strict
    assert str(root).startswith("process limit (processes = 8) (needs a pids cgroup")
    assert "RLIMIT_NPROC does not bind root" in str(root)
    assert "every process of this user" in str(user)
