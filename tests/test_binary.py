"""The single-file binary (scripts/build_binary.sh -> dist/sandlock) on the real kernel.

Runs only when the binary exists (dist/sandlock, or SANDLOCK_BINARY=PATH); building it
takes a minute, so CI builds it in scripts/ci_extra.sh and runs these tests there.
Each test starts the binary with an empty environment (`env -i`) from a directory
other than the checkout, as a user dropping the file on a machine would.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Optional

import pytest
from conftest import REPO, require_abi, write_policy

BINARY = Path(os.environ.get("SANDLOCK_BINARY") or REPO / "dist" / "sandlock")
if not BINARY.is_file() and os.environ.get("SANDLOCK_EXPECT_BINARY") == "1":
    raise RuntimeError(f"{BINARY} not built, but SANDLOCK_EXPECT_BINARY=1")
pytestmark = pytest.mark.skipif(
    not BINARY.is_file(),
    reason=f"{BINARY} not built (run scripts/build_binary.sh, or set SANDLOCK_BINARY)")

POLICY = """\
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}"]
exec = ["/usr/bin/cat", "/usr/bin/sh", "/usr/bin/dash", "/usr/bin/true"]
"""


def binary(*args: str, cwd: Path, env: Optional[dict[str, str]] = None
           ) -> subprocess.CompletedProcess[str]:
    """``env -i [env] dist/sandlock args`` from ``cwd``: no inherited environment at all."""
    pairs = [f"{k}={v}" for k, v in (env or {}).items()]
    return subprocess.run(["/usr/bin/env", "-i", *pairs, str(BINARY), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def cache(tmp_path: Path) -> dict[str, str]:
    """A private cache directory, so each test sees its own first (uncached) run."""
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


@pytest.mark.parametrize("cached", [False, True], ids=["first-run", "cached"])
def test_binary_confines_under_empty_environment(workspace: Path, outside: Path, tmp_path: Path,
                                                 cache: dict[str, str], cached: bool) -> None:
    require_abi(1, "filesystem confinement")
    pol = write_policy(tmp_path, POLICY)
    args = ["run", "--policy", str(pol), "--var", f"ws={workspace}", "--"]
    runs = 2 if cached else 1
    for _ in range(runs):
        inside = binary(*args, "/usr/bin/cat", str(workspace / "notes.md"), cwd=outside, env=cache)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout == "hello from the workspace\n"
    denied = binary(*args, "/usr/bin/cat", str(outside / "secret.txt"), cwd=outside, env=cache)
    assert denied.returncode == 1
    assert "Permission denied" in denied.stderr and "top secret" not in denied.stdout


def test_binary_passes_exit_codes_through(workspace: Path, tmp_path: Path,
                                          cache: dict[str, str]) -> None:
    require_abi(1, "filesystem confinement")
    pol = write_policy(tmp_path, POLICY)
    args = ["run", "--policy", str(pol), "--var", f"ws={workspace}", "--"]
    assert binary(*args, "/usr/bin/sh", "-c", "exit 3", cwd=Path("/"), env=cache).returncode == 3
    killed = binary(*args, "/usr/bin/sh", "-c", "kill -9 $$", cwd=Path("/"), env=cache)
    assert killed.returncode == 128 + 9
    missing = binary(*args, "/nonexistent/tool", cwd=Path("/"), env=cache)
    assert missing.returncode == 127, missing.stderr


def test_binary_compiles_seccomp_with_bundled_libseccomp(workspace: Path, tmp_path: Path,
                                                         cache: dict[str, str]) -> None:
    """An extra `syscalls.deny` needs libseccomp at run time (the binary bundles it)."""
    require_abi(1, "filesystem confinement")
    pol = write_policy(tmp_path, POLICY + '[syscalls]\ndeny = ["mkdir"]\n')
    done = binary("run", "--policy", str(pol), "--var", f"ws={workspace}", "--", "/usr/bin/true",
                  cwd=tmp_path, env={**cache, "SANDLOCK_NO_CACHE": "1"})
    assert done.returncode == 0, done.stderr


def test_binary_bad_policy_is_125_with_a_message(tmp_path: Path, cache: dict[str, str]) -> None:
    pol = write_policy(tmp_path, 'version = 1\n[filesystem]\nread = ["/no/such/dir"]\n')
    done = binary("run", "--policy", str(pol), "--", "/usr/bin/true", cwd=tmp_path, env=cache)
    assert done.returncode == 125
    assert "does not exist" in done.stderr


def test_binary_full_cli_and_builtin_profiles(tmp_path: Path) -> None:
    listed = binary("policies", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "base" in listed.stdout and "python" in listed.stdout
    assert binary("check", "--json", cwd=tmp_path).returncode in (0, 1)


def test_binary_refuses_a_cache_others_can_write(workspace: Path, tmp_path: Path) -> None:
    """A cache directory others can write is never used, and there is no fallback into a
    shared TMPDIR (where a concurrent tool could swap the program before it runs): exit
    125 with one line saying what to do. tests/test_binary_integrity.py has the rest."""
    shared = tmp_path / "shared"
    (shared / "sandlock" / "bin").mkdir(parents=True)
    (shared / "sandlock" / "bin").chmod(0o777)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    pol = write_policy(tmp_path, POLICY)
    done = binary("run", "--policy", str(pol), "--var", f"ws={workspace}", "--", "/usr/bin/sh",
                  "-c", "exit 5", cwd=tmp_path,
                  env={"XDG_CACHE_HOME": str(shared), "TMPDIR": str(scratch)})
    assert done.returncode == 125, done.stderr
    assert "writable by others" in done.stderr and "XDG_CACHE_HOME" in done.stderr
    assert list((shared / "sandlock" / "bin").iterdir()) == []
    assert list(scratch.iterdir()) == []


def test_binary_probe_runs(workspace: Path, tmp_path: Path, cache: dict[str, str]) -> None:
    """`sandlock probe` reads probe/payload.py as a file: the binary ships it."""
    require_abi(1, "filesystem confinement")
    pol = write_policy(tmp_path, POLICY)
    done = binary("probe", "--policy", str(pol), "--var", f"ws={workspace}", cwd=tmp_path,
                  env=cache)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_binary_concurrent_first_runs_share_one_unpacked_copy(workspace: Path,
                                                              tmp_path: Path) -> None:
    """Several first runs at once: all succeed, one complete copy is kept, no leftovers."""
    require_abi(1, "filesystem confinement")
    pol = write_policy(tmp_path, POLICY)
    cache = tmp_path / "cache"
    argv = ["/usr/bin/env", "-i", f"XDG_CACHE_HOME={cache}", str(BINARY), "run", "--policy",
            str(pol), "--var", f"ws={workspace}", "--", "/usr/bin/sh", "-c", "exit 7"]
    runs = [subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE) for _ in range(4)]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 7, err
    unpacked = cache / "sandlock" / "bin"
    if unpacked.exists():  # a SANDLOCK_PERSISTENT=0 build unpacks into /tmp instead
        entries = sorted(p.name for p in unpacked.iterdir())
        assert len(entries) == 1 and not entries[0].startswith("."), entries
        assert oct(unpacked.stat().st_mode & 0o777) == "0o700"


def test_binary_hook_starts_this_binary_not_a_file_of_the_project(tmp_path: Path,
                                                                  cache: dict[str, str]) -> None:
    """Claude Code runs the hook as ``sandlock hook ...`` from the project: the binary's
    argv[0] is the bare name. The rewritten command named ``<project>/sandlock``, a file
    a tool may write (or a cloned repository holds), and Claude Code ran it unconfined.
    The rewritten command must start this binary, and work."""
    require_abi(1, "filesystem confinement")
    project = tmp_path / "project"
    project.mkdir()
    marker = tmp_path / "ran-unconfined"
    planted = project / "sandlock"
    planted.write_text(f"#!/bin/sh\ntouch {marker}\n")
    planted.chmod(0o755)
    (project / "notes.md").write_text("inside\n")
    event = json.dumps({"hook_event_name": "PreToolUse", "tool_name": "Bash",
                        "cwd": str(project), "tool_input": {"command": "cat notes.md"}})
    env = {"PATH": "/usr/bin:/bin", "CLAUDE_PROJECT_DIR": str(project), **cache}
    hook = subprocess.run(["sandlock", "hook", "claude-code", "--policy", "shell", "--var",
                           f"workspace={project}"], executable=str(BINARY), cwd=project,
                          input=event, env=env, capture_output=True, text=True, timeout=120)
    assert hook.returncode == 0, hook.stderr
    command = json.loads(hook.stdout)["hookSpecificOutput"]["updatedInput"]["command"]
    assert not command.startswith(str(planted)), command
    ran = subprocess.run(["/bin/sh", "-c", command], cwd=project, env=env,
                         capture_output=True, text=True, timeout=120)
    assert not marker.exists()
    assert (ran.returncode, ran.stdout) == (0, "inside\n"), ran.stderr
