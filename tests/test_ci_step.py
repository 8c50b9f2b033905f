"""ci/run-step.sh, the script behind the GitHub action and the GitLab template, run as
CI runs it: install sandlock from this tree into a venv, then run steps confined.

The install is offline (no network here): the venv sees the dev environment's
dependencies through a ``.pth`` file and pip installs only this tree (``--no-deps
--no-build-isolation --no-index``, given through SANDLOCK_PIP_ARGS as CI may).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, require_tool

SCRIPT = REPO / "ci" / "run-step.sh"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with sandlock installed by ``run-step.sh install`` from a copy of this tree
    (as tests/test_packaging.py builds: the system's setuptools, which needs its wheel
    package; the copy keeps the checkout clean and has no helper built in it)."""
    require_tool("python3:wheel")
    base = tmp_path_factory.mktemp("ci")
    source = base / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".mypy_cache",
        ".ruff_cache", ".benchmarks", "benchmarks", "tests", "sandlock-exec"))
    where = base / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(where)],
                   check=True, timeout=120)
    packages = subprocess.run([str(where / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(packages, "dev-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    done = subprocess.run(["sh", str(source / "ci" / "run-step.sh"), "install", str(source)],
                          capture_output=True, text=True, timeout=600,
                          env=_env(where, HOME=str(base), PIP_NO_INDEX="1", SANDLOCK_PIP_ARGS=(
                              "--no-deps --no-build-isolation")))
    assert done.returncode == 0, done.stderr
    assert (where / "bin" / "sandlock").exists()
    return where


def _env(venv: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SANDLOCK_"))}
    return {**env, "SANDLOCK_VENV": str(venv), **more}


def step(venv: Path, workspace: Path, policy: str, command: str,
         **more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(SCRIPT), "run", policy, command], capture_output=True,
                          text=True, timeout=120, cwd=workspace, env=_env(venv, **more))


def test_step_runs_confined_in_the_checkout(venv: Path, workspace: Path) -> None:
    done = step(venv, workspace, "shell", "echo \"built $((6*7))\" > out.txt; cat notes.md")
    assert done.returncode == 0, done.stderr
    assert (workspace / "out.txt").read_text() == "built 42\n"
    assert "hello from the workspace" in done.stdout
    assert "runs confined by shell" in done.stderr


def test_step_cannot_write_outside(venv: Path, workspace: Path, outside: Path) -> None:
    command = f"echo changed > {outside}/secret.txt"
    done = step(venv, workspace, "shell", command)
    assert done.returncode != 0 and "Permission denied" in done.stderr
    assert (outside / "secret.txt").read_text() == "top secret\n"
    # Control: the same step, unconfined, changes the file.
    subprocess.run(["/bin/sh", "-c", command], check=True, cwd=workspace)
    assert (outside / "secret.txt").read_text() == "changed\n"


def test_command_is_one_argument(venv: Path, workspace: Path, outside: Path) -> None:
    """Quotes and substitutions in the command are the confined shell's, not the script's."""
    done = step(venv, workspace, "shell", f"echo x'\"; cat {outside}/secret.txt; \"'$(id -u)")
    assert "top secret" not in done.stdout + done.stderr
    assert done.stdout == f'x"; cat {outside}/secret.txt; "{os.getuid()}\n', done.stderr


def test_vars_and_exit_status(venv: Path, workspace: Path, tmp_path: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text('version = 1\nextends = ["shell"]\n[env]\nset = { GREETING = "${greeting}" }\n')
    done = step(venv, workspace, str(policy), 'echo "$GREETING"; exit 3',
                SANDLOCK_VARS="greeting=hi there\n")
    assert done.returncode == 3 and done.stdout == "hi there\n", done.stderr
    bad = step(venv, workspace, "no-such-policy", "true")
    assert bad.returncode == 125
