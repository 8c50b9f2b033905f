"""Substitutes for Landlock protections an older ABI lacks, on the real kernel.

``SANDLOCK_ABI=N`` makes sandlock build the ruleset an ABI-N kernel enforces; the
kernel here is newer, so what the ABI-N ruleset lets through is what an ABI-N kernel
lets through. Each attack is run with the substitute (it must fail) and, as the positive
control, with the substitute switched off (it must succeed), through the API in this
process, where the plan can be patched.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from conftest import ABI, PYTHON, require_abi, run_confined, write_policy

from sandlock.compile import seccomp

#: Landlock ABIs without LANDLOCK_ACCESS_FS_TRUNCATE (added in ABI 3).
NO_TRUNCATE = (1, 2)

TRUNCATE_ATTACKS = {
    # truncate(2) by path: Landlock before ABI 3 does not check it at all.
    "truncate": "os.truncate(target, 0)",
    # open(2) with O_TRUNC and read-only access: Landlock before ABI 3 checks READ_FILE only.
    "open_rdonly_trunc": "os.close(os.open(target, os.O_RDONLY | os.O_TRUNC))",
    # access mode 3 (no read, no write): Landlock checks neither, open still truncates.
    "open_accmode3_trunc": "os.close(os.open(target, 3 | os.O_TRUNC))",
}

ATTACK = """\
import errno, os, sys
target = sys.argv[1]
try:
    {attack}
except OSError as exc:
    print("refused", errno.errorcode[exc.errno])
    sys.exit(0)
print("size", os.stat(target).st_size)
"""


def _abi_env(abi: int) -> dict[str, str]:
    return {**os.environ, "SANDLOCK_ABI": str(abi)}


def _victim(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious data\n")
    victim.chmod(0o644)
    return victim


def _api_attack(tmp_path: Path, abi: int, attack: str) -> tuple[str, int]:
    """Run ``attack`` through the API with a read grant on the victim only; what it
    printed and the victim's size afterwards."""
    import sandlock

    require_abi(abi, "the truncate attack at this ABI")
    victim = _victim(tmp_path)
    policy = write_policy(tmp_path, f"""\
        version = 1
        compat = "best-effort"
        extends = ["python"]
        [filesystem]
        read = ["{victim}"]
        """)
    code = ATTACK.format(attack=attack)
    with sandlock.Sandbox(policy) as box:
        result = box.run([PYTHON, "-c", code, str(victim)], capture_output=True, text=True)
    assert isinstance(result.stdout, str), result
    return result.stdout.strip() or str(result.stderr), victim.stat().st_size


@pytest.mark.parametrize("abi", NO_TRUNCATE)
@pytest.mark.parametrize("name", sorted(TRUNCATE_ATTACKS))
def test_truncate_refused_below_abi_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      abi: int, name: str) -> None:
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    said, size = _api_attack(tmp_path, abi, TRUNCATE_ATTACKS[name])
    assert said == "refused EPERM" and size == len("precious data\n"), said


@pytest.mark.parametrize("name", sorted(TRUNCATE_ATTACKS))
def test_truncate_control_without_the_substitute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 name: str) -> None:
    """Positive control: the same attack at ABI 2 with the substitute switched off truncates."""
    monkeypatch.setenv("SANDLOCK_ABI", "2")
    monkeypatch.setattr(seccomp, "truncate_rules", lambda: [], raising=False)
    said, size = _api_attack(tmp_path, 2, TRUNCATE_ATTACKS[name])
    assert said == "size 0" and size == 0, said


@pytest.mark.parametrize("abi", NO_TRUNCATE)
def test_truncate_cli_strict_runs_and_refuses(tmp_path: Path, abi: int) -> None:
    """`sandlock run` in strict mode runs at ABI 1-2 (the substitute covers the gap) and the
    attack fails; writing through a descriptor opened for writing still works."""
    require_abi(abi, "the truncate attack at this ABI")
    victim = _victim(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    code = textwrap.dedent("""\
        import os, sys
        mine = os.path.join(sys.argv[2], "mine.txt")
        with open(mine, "w") as handle:
            handle.write("abcdef")
        with open(mine, "r+") as handle:
            handle.truncate(2)
        print("own", os.stat(mine).st_size)
        with open(mine, "w") as handle:
            pass
        print("own", os.stat(mine).st_size)
        """) + ATTACK.format(attack=TRUNCATE_ATTACKS["open_rdonly_trunc"])
    policy = write_policy(tmp_path, f"""\
        version = 1
        compat = "best-effort"  # until the signal scope has its substitute
        extends = ["python"]
        [filesystem]
        read = ["{victim}"]
        write = ["{ws}"]
        """)
    done = run_confined(policy, [PYTHON, "-c", code, str(victim), str(ws)], env=_abi_env(abi))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["own 2", "own 0", "refused EPERM"], done.stdout
    assert victim.stat().st_size == len("precious data\n")
    assert ABI >= abi
