"""Messages with the real cause where containers differ from a desktop: `policies` and
`validate` run from ``/`` (a container's default working directory), a kernel without
Landlock (gVisor), and what `check` reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ABI, sandlock, write_policy

from sandlock.compile import report, ruleset
from sandlock.linux import kernel
from sandlock.policy.model import PROFILE_DIR

SHELL = str(PROFILE_DIR / "shell.toml")
NOTE = "${workspace} was not given (--var workspace=DIR); it defaulted to the working directory '/'"


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOCK_")}
    env["SANDLOCK_NO_CACHE"] = "1"
    env.update(extra)
    return env


# ----------------------------------------------------------------------------
# Undefined variables stand in as the working directory: say so


def test_validate_from_root_names_the_variable_and_its_stand_in() -> None:
    result = sandlock("validate", SHELL, cwd="/", env=cli_env())
    assert result.returncode == 125, result.stderr
    assert "write access to '/' is never allowed" in result.stderr
    assert NOTE in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_validate_elsewhere_or_with_the_variable_is_ok(tmp_path: Path) -> None:
    """The controls: the same profile from another directory, or from / with --var."""
    assert sandlock("validate", SHELL, cwd=str(tmp_path), env=cli_env()).returncode == 0
    given = sandlock("validate", "--var", f"workspace={tmp_path}", SHELL, cwd="/", env=cli_env())
    assert given.returncode == 0, given.stderr


def test_a_real_error_is_not_blamed_on_a_variable(tmp_path: Path) -> None:
    """No variable filled: the message is the policy's own, with no note."""
    policy = write_policy(tmp_path, 'version = 1\n[filesystem]\nwrite = ["/proc/self"]\n')
    result = sandlock("validate", str(policy), cwd="/", env=cli_env())
    assert result.returncode == 125 and "never allowed" in result.stderr
    assert "was not given" not in result.stderr


def test_policies_from_root_lists_profiles_as_needing_the_variable() -> None:
    result = sandlock("policies", cwd="/", env=cli_env())
    assert result.returncode == 0, result.stderr
    rows = dict(line.split("\t", 1) for line in result.stdout.splitlines()[1:])
    for name, var in (("shell", "workspace"), ("write_file", "workspace"),
                      ("python_runner", "workspace"), ("tmpdir", "private_tmp"),
                      ("cc", "private_tmp")):
        assert "not loadable" not in rows[name], rows[name]
        assert f"(needs --var {var}=DIR: the working directory '/' cannot stand in" in rows[name]
    assert rows["shell"].startswith("A shell in the workspace")
    assert "needs" not in rows["base"]


def test_policies_elsewhere_lists_plain_descriptions(tmp_path: Path) -> None:
    result = sandlock("policies", cwd=str(tmp_path), env=cli_env())
    assert result.returncode == 0
    assert "(needs --var" not in result.stdout and "not loadable" not in result.stdout


# ----------------------------------------------------------------------------
# No Landlock: the cause and what to do


POLICY = 'version = 1\nextends = ["python"]\n'


@pytest.mark.skipif(ABI < 1, reason="needs Landlock to pretend it absent")
def test_run_without_landlock_says_why_and_what_to_do(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, POLICY)
    result = sandlock("run", "--policy", str(policy), "--", "/usr/bin/python3", "-c", "pass",
                      env=cli_env(SANDLOCK_ABI="0"))
    assert result.returncode == 125, result.stderr
    assert "SANDLOCK_ABI=0 pretends a kernel without Landlock" in result.stderr
    assert "in a VM" in result.stderr and "--best-effort" in result.stderr
    control = sandlock("run", "--policy", str(policy), "--", "/usr/bin/python3", "-c", "pass",
                      env=cli_env())
    assert control.returncode == 0 and "pretends" not in control.stderr


@pytest.mark.skipif(ABI < 1, reason="needs Landlock to pretend it absent")
def test_probe_and_check_without_landlock_say_why(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, POLICY)
    probe = sandlock("probe", "--policy", str(policy), env=cli_env(SANDLOCK_ABI="0"))
    assert "pretends a kernel without Landlock" in probe.stderr + probe.stdout
    assert "Traceback" not in probe.stderr
    check = sandlock("check", "--json", env=cli_env(SANDLOCK_ABI="0"))
    rows = {row["feature"]: row for row in json.loads(check.stdout)["features"]}
    assert not rows["Landlock ABI in use"]["available"]
    assert "in a VM" in rows["Landlock ABI in use"]["detail"]
    plain = json.loads(sandlock("check", "--json", env=cli_env()).stdout)
    assert "Landlock ABI in use" not in {row["feature"] for row in plain["features"]}


def test_the_absence_of_landlock_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's answers this machine cannot give (a message, not a protection):
    gVisor's uname, a kernel built without Landlock, one where it is not enabled."""
    monkeypatch.delenv(ruleset.ENV_ABI, raising=False)
    monkeypatch.setattr(kernel, "landlock_abi", lambda: 0)
    monkeypatch.setattr(kernel, "landlock_errno", lambda: 38)  # ENOSYS
    gvisor = os.uname_result(("Linux", "h", "4.4.0", ruleset.GVISOR_VERSION, "x86_64"))
    real = os.uname()
    monkeypatch.setattr(os, "uname", lambda: gvisor)
    assert "this is gVisor (runsc)" in ruleset.landlock_missing()
    landlock = report.kernel_report()["features"][0]
    assert not landlock["available"] and "gVisor" in landlock["detail"]
    assert "--best-effort" in landlock["detail"]
    monkeypatch.setattr(os, "uname", lambda: real)
    assert "built without it" in ruleset.landlock_missing()
    monkeypatch.setattr(kernel, "landlock_errno", lambda: 95)  # EOPNOTSUPP
    assert "not enabled at boot" in ruleset.landlock_missing()


# ----------------------------------------------------------------------------
# check: each restriction with its cause


def test_check_reports_processes_and_the_pids_cgroup() -> None:
    check = sandlock("check", "--json", env=cli_env())
    assert check.returncode == 0, check.stderr
    rows = {row["feature"]: row for row in json.loads(check.stdout)["features"]}
    nproc = rows["processes this user may start (RLIMIT_NPROC, ulimit -u)"]
    cgroup = rows["per-sandbox process limit (pids cgroup, [limits] processes)"]
    if os.getuid() == 0:
        assert "does not bind" in nproc["detail"]
    else:
        assert nproc["available"] and ("more" in nproc["detail"] or nproc["detail"] == "unlimited")
    assert cgroup["detail"] and ("below" in cgroup["detail"] or "RLIMIT_NPROC" in cgroup["detail"])


def test_check_names_a_user_at_its_process_limit(tmp_path: Path) -> None:
    """A user at RLIMIT_NPROC: `check` says so (prlimit sets the limit of the check
    process to the number of tasks this user has)."""
    if os.getuid() == 0:
        pytest.skip("RLIMIT_NPROC does not bind root")
    have = report._user_tasks(os.getuid())
    check = sandlock("check", "--json", env=cli_env())
    assert check.returncode == 0
    code = ("import json, resource, sys; from sandlock.compile import report; "
            "resource.setrlimit(resource.RLIMIT_NPROC, (1, resource.getrlimit("
            "resource.RLIMIT_NPROC)[1])); print(json.dumps(report._nproc_row()))")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=cli_env(), timeout=60)
    row = json.loads(out.stdout)
    assert have >= 1 and not row["available"], row
    assert "RLIMIT_NPROC (ulimit -u) is 1" in row["detail"]
