"""The shipped read_file policy confines cat to its workspace (end to end)."""

from pathlib import Path

from conftest import POLICIES, require_abi, run_confined


def test_read_file_policy_reads_inside_denies_outside(workspace: Path, outside: Path) -> None:
    require_abi(1, "filesystem confinement")
    policy = POLICIES / "read_file.toml"
    inside = run_confined(policy, ["cat", str(workspace / "notes.md")],
                          variables={"workspace": str(workspace)})
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout == "hello from the workspace\n"
    denied = run_confined(policy, ["cat", str(outside / "secret.txt")],
                          variables={"workspace": str(workspace)})
    assert denied.returncode == 1
    assert "Permission denied" in denied.stderr
    assert "top secret" not in denied.stdout
