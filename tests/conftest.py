"""Shared fixtures: run the real CLI on the real kernel, and kernel-feature gates.

Kernel-dependent tests skip with a stated reason when the kernel lacks a feature,
unless SANDLOCK_EXPECT_ABI names an ABI the machine must have: then they fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import pytest
from hypothesis import settings

from sandlock.exec.forkserver import children_of
from sandlock.linux import kernel

REPO = Path(__file__).resolve().parent.parent
POLICIES = REPO / "policies"
PYTHON = "/usr/bin/python3"  # the system interpreter the python profile grants
ABI = kernel.landlock_abi()
IS_ROOT = os.geteuid() == 0

#: Test modules whose outcome does not depend on who runs them: pure parsing, pure
#: tables and plans, the package layout, the wheel build. They are marked ``any_user``,
#: so the unprivileged CI pass leaves them out (``-m "not any_user"``); every other test
#: runs as root and as an ordinary user.
ANY_USER = frozenset({"test_abi", "test_layout", "test_packaging", "test_policy_fuzz",
                      "test_seccomp_plan"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "any_user: the outcome does not depend on the user "
                                       "running the test (see conftest.ANY_USER)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in ANY_USER:
            item.add_marker(pytest.mark.any_user)


# The test tree may be read-only for the unprivileged CI user: keep no example database.
settings.register_profile("sandlock", database=None, deadline=None)
settings.load_profile("sandlock")


# ----------------------------------------------------------------------------
# Processes, as /proc shows them (exits are seen asynchronously: poll with eventually)


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` (R, S, Z, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return proc_state(pid) not in ("Z", "X", "gone")


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """Every descendant of the single-threaded process ``pid``."""
    children = children_of(pid)
    return children + [p for c in children for p in descendants(c)]


def eventually(predicate: Callable[[], object], limit: float = 10.0) -> bool:
    """Poll until ``predicate()`` holds (exits are reaped asynchronously); not a
    timing assertion: False only after ``limit`` seconds."""
    end = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def require_native() -> None:
    """Skip without the C helper (or fail, when SANDLOCK_EXPECT_NATIVE=1 says it is built)."""
    from sandlock.exec import native

    if not native.AVAILABLE:
        message = f"{native.HELPER} is not built (SANDLOCK_NO_NATIVE=1 at install time?)"
        if os.environ.get("SANDLOCK_EXPECT_NATIVE") == "1":
            pytest.fail(f"{message}, but SANDLOCK_EXPECT_NATIVE=1")
        pytest.skip(message)


def require_abi(minimum: int, what: str) -> None:
    """Skip (or fail, when SANDLOCK_EXPECT_ABI says the kernel must have it)."""
    if ABI >= minimum:
        return
    expected = os.environ.get("SANDLOCK_EXPECT_ABI")
    message = f"{what} needs Landlock ABI {minimum}; this kernel has {ABI}"
    if expected and int(expected) >= minimum:
        pytest.fail(f"{message}, but SANDLOCK_EXPECT_ABI={expected}")
    pytest.skip(message)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello from the workspace\n")
    return ws


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the workspace that no policy grants."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text("top secret\n")
    return out


def write_policy(directory: Path, text: str, name: str = "policy.toml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def sandlock(*args: str, env: Optional[dict[str, str]] = None, input: Optional[str] = None,
             timeout: float = 60, cwd: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would: a separate process, real kernel."""
    return subprocess.run([sys.executable, "-m", "sandlock", *args], capture_output=True,
                          text=True, env=env, input=input, timeout=timeout, cwd=cwd)


def run_confined(policy: Path, argv: Sequence[str], *, variables: Optional[dict[str, str]] = None,
                 env: Optional[dict[str, str]] = None, timeout: float = 60,
                 extra: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    args = ["run", "--policy", str(policy)]
    for name, value in (variables or {}).items():
        args += ["--var", f"{name}={value}"]
    return sandlock(*args, *extra, "--", *argv, env=env, timeout=timeout)


PROBE_POLICY = """\
version = 1
{head}extends = ["python"]
[filesystem]
{filesystem}
[network]
{network}
"""


def python_probe(tmp_path: Path, code: str, *, filesystem: str = "", network: str = "",
                 extra_toml: str = "", variables: Optional[dict[str, str]] = None,
                 env: Optional[dict[str, str]] = None, timeout: float = 60, head: str = ""
                 ) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the system python3 inside a python-profile sandbox.

    A probe reports what happened by printing it or by exiting with the errno it got.
    ``head``: top-level keys (``compat = ...``), placed before the tables.
    """
    policy = write_policy(tmp_path, PROBE_POLICY.format(filesystem=filesystem, network=network,
                                                        head=head)
                          + extra_toml, name="probe.toml")
    return run_confined(policy, [PYTHON, "-c", textwrap.dedent(code)], variables=variables,
                        env=env, timeout=timeout)
