"""Accepting one named gap (``accept = [NAME]``, ``run --accept NAME``, ``Sandbox(accept=)``).

``SANDLOCK_ABI=3`` makes sandlock build an ABI-3 ruleset on this newer kernel: a policy
with a TCP port grant and Unix sockets then has two gaps (``tcp-ports``, ABI 4;
``abstract-unix``, ABI 6; a device grant has a substitute below ABI 5, no gap).
Accepting one must leave the run strict for the other: refused, exit 125, the message
naming the other. Accepting both runs and reports both. The positive control of the
refusal is the same policy accepting both (or best-effort), which runs: the refusal is
the strict check's, not a crash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import PYTHON, require_abi, run_confined, sandlock, write_policy

#: Two gaps at ABI 3: TCP port rules (ABI 4), and the abstract unix socket scope of a
#: policy with Unix sockets (ABI 6).
TWO_GAPS = """\
version = 1
extends = ["python"]
{head}
[filesystem]
read = ["{outside}"]
[network]
connect = [9]
unix = true
"""

IOCTL = "abstract unix socket scope"
TCP = "TCP port restriction"


def _env(abi: int = 3) -> dict[str, str]:
    return {**os.environ, "SANDLOCK_ABI": str(abi)}


def _policy(tmp_path: Path, head: str = "") -> Path:
    outside = tmp_path / "granted.txt"
    outside.write_text("granted\n")
    return write_policy(tmp_path, TWO_GAPS.format(head=head, outside=outside))


@pytest.fixture(autouse=True)
def _abi3() -> None:
    require_abi(3, "pretending Landlock ABI 3")


def test_accept_one_of_two_still_refuses(tmp_path: Path) -> None:
    policy = _policy(tmp_path, 'accept = ["tcp-ports"]')
    done = run_confined(policy, ["/bin/true"], env=_env())
    assert done.returncode == 125, done.stderr
    assert IOCTL in done.stderr and "[accept: abstract-unix]" in done.stderr
    assert TCP not in done.stderr  # the accepted one is not what refuses
    assert "--accept NAME" in done.stderr


def test_accept_one_by_option_still_refuses(tmp_path: Path) -> None:
    done = run_confined(_policy(tmp_path), ["/bin/true"], env=_env(), extra=["--accept", "abstract-unix"])
    assert done.returncode == 125, done.stderr
    assert TCP in done.stderr and IOCTL not in done.stderr


def test_accept_both_runs_and_reports_both(tmp_path: Path) -> None:
    """Positive control of the refusals above: policy key and option together (a union)."""
    policy = _policy(tmp_path, 'accept = ["tcp-ports"]')
    done = run_confined(policy, [PYTHON, "-c", "print('ran')"], env=_env(),
                        extra=["--accept=abstract-unix"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ran\n"
    warned = [line for line in done.stderr.splitlines() if "[accepted:" in line]
    assert len(warned) == 2, done.stderr
    assert any(TCP in line and "[accepted: tcp-ports]" in line for line in warned)
    assert any(IOCTL in line and "[accepted: abstract-unix]" in line for line in warned)


def test_accepted_run_stays_confined(tmp_path: Path) -> None:
    """Accepting a gap is not best-effort for the rest: the filesystem is confined as
    ever (a file outside the grants is refused; the granted one is read)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("secret\n")
    secret.chmod(0o644)
    policy = _policy(tmp_path, 'accept = ["tcp-ports", "abstract-unix"]')
    code = ("import sys\nprint(open(sys.argv[1]).read().strip())\n"
            "try:\n    open(sys.argv[2])\nexcept PermissionError:\n    print('refused')\n")
    done = run_confined(policy, [PYTHON, "-c", code, str(tmp_path / "granted.txt"), str(secret)],
                        env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["granted", "refused"], done.stdout


def test_unknown_name_in_policy_names_file_line_key(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, 'version = 1\n\naccept = ["tcp-ports", "ioctl"]\n')
    done = run_confined(policy, ["/bin/true"], env=_env())
    assert done.returncode == 125
    assert f"{policy}:3: accept[1]: unknown gap name 'ioctl'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_unknown_name_on_the_command_line(tmp_path: Path) -> None:
    done = run_confined(_policy(tmp_path), ["/bin/true"], env=_env(), extra=["--accept", "all"])
    assert done.returncode == 125
    assert "--accept: unknown gap name 'all' (expected one of: tcp-ports," in done.stderr, done.stderr


def test_extends_accepts_the_union(tmp_path: Path) -> None:
    """A layer's accept adds to the layers it extends (every list key merges so)."""
    base = write_policy(tmp_path, 'version = 1\naccept = ["tcp-ports"]\n', name="base.toml")
    policy = _policy(tmp_path, f'accept = ["abstract-unix"]\nextends = ["python", "{base}"]'
                     ).read_text().replace('extends = ["python"]\n', "", 1)
    child = write_policy(tmp_path, policy, name="child.toml")
    done = run_confined(child, [PYTHON, "-c", "pass"], env=_env())
    assert done.returncode == 0, done.stderr
    assert "[accepted: tcp-ports]" in done.stderr and "[accepted: abstract-unix]" in done.stderr


def test_scope_signals_off_needs_its_name(tmp_path: Path) -> None:
    """[scope] signals = false is a strict refusal; accepting "signal-scope" runs it,
    reported; accepting another name does not."""
    text = 'version = 1\nextends = ["python"]\n{head}\n[scope]\nsignals = false\n'
    refused = run_confined(write_policy(tmp_path, text.format(head='accept = ["processes"]')),
                           ["/bin/true"])
    assert refused.returncode == 125 and "--accept signal-scope" in refused.stderr, refused.stderr
    done = run_confined(write_policy(tmp_path, text.format(head='accept = ["signal-scope"]')),
                        [PYTHON, "-c", "pass"])
    assert done.returncode == 0, done.stderr
    assert "[accepted: signal-scope]" in done.stderr


def test_explain_and_check_list_them(tmp_path: Path) -> None:
    policy = _policy(tmp_path, 'accept = ["tcp-ports"]')
    report = json.loads(sandlock("explain", "--policy", str(policy), "--json", env=_env()).stdout)
    assert report["accept"] == ["tcp-ports"]
    assert [TCP in line for line in report["accepted"]] == [True]
    assert [IOCTL in line for line in report["refused_in_strict"]] == [True]
    text = sandlock("explain", "--policy", str(policy), env=_env()).stdout
    assert "accept: tcp-ports" in text and "[accepted]" in text
    assert "will refuse to start" in text
    check = json.loads(sandlock("check", "--json").stdout)
    from sandlock.policy.model import ACCEPTABLE_GAPS

    assert [item["name"] for item in check["gap_names"]] == list(ACCEPTABLE_GAPS)
    assert "abstract-unix" in sandlock("check").stdout


def test_api_accept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sandlock as api
    from sandlock.errors import KernelSupportError, PolicyError

    monkeypatch.setenv("SANDLOCK_ABI", "3")
    policy = _policy(tmp_path)
    with pytest.raises(KernelSupportError, match=IOCTL) as refused:
        api.Sandbox(policy, accept=["tcp-ports"])
    assert TCP not in str(refused.value)
    with api.Sandbox(policy, accept=["tcp-ports", "abstract-unix"]) as box:
        assert len(box.warnings) == 2
        assert all("[accepted: " in line for line in box.warnings)
        assert box.grants()["not_enforced"] == box.warnings
        assert box.run([PYTHON, "-c", "pass"]).returncode == 0
    with pytest.raises(PolicyError, match="accept=: unknown gap name 'x'"):
        api.Sandbox(policy, accept=["x"])
    with pytest.raises(TypeError, match="accept must be"):
        api.Sandbox(policy, accept="tcp-ports")


def test_every_gap_name_is_acceptable() -> None:
    """Each named Gap carries a name of ACCEPTABLE_GAPS; a name outside it is a bug."""
    from sandlock.compile.ruleset import Gap

    with pytest.raises(ValueError):
        Gap("x", 1, "y", name="no-such-gap")
