"""Shared fixtures: run the real CLI on the real kernel, and kernel-feature gates.

Kernel-dependent tests skip with a stated reason when the kernel lacks a feature,
unless SANDLOCK_EXPECT_ABI names an ABI the machine must have: then they fail. Tests of
an optional tool (git, curl, ip, ...) skip when it is not installed, naming its package
from scripts/system-packages.txt, unless SANDLOCK_EXPECT_TOOLS=1 (CI): then they fail.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest
from hypothesis import settings

from sandlock.exec.forkserver import children_of
from sandlock.linux import kernel

REPO = Path(__file__).resolve().parent.parent
POLICIES = REPO / "policies"
PYTHON = "/usr/bin/python3"  # the system interpreter the python profile grants
#: The Landlock ABI the runs enforce: the kernel's, or the older one SANDLOCK_ABI simulates
#: (tests of a feature above it skip, as on that kernel; an invalid value: the kernel's,
#: and every run reports the value).
ABI = kernel.landlock_abi()
try:
    ABI = min(ABI, max(0, int(os.environ.get("SANDLOCK_ABI") or ABI)))
except ValueError:
    pass
IS_ROOT = os.geteuid() == 0

#: Test modules whose outcome does not depend on who runs them: pure parsing, pure
#: tables and plans, the package layout, the wheel build. They are marked ``any_user``,
#: so the unprivileged CI pass leaves them out (``-m "not any_user"``); every other test
#: runs as root and as an ordinary user.
ANY_USER = frozenset({"test_abi", "test_install", "test_layout", "test_packaging", "test_policy_fuzz",
                      "test_seccomp_plan"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "any_user: the outcome does not depend on the user "
                                       "running the test (see conftest.ANY_USER)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in ANY_USER:
            item.add_marker(pytest.mark.any_user)


@pytest.fixture
def monkeypatch(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """pytest's own, with the cache of compiled policies off in this process for the test:
    a patch of sandlock's code shapes what this process compiles, but not the cache's key
    (the code's files), so a Sandbox made here would store a plan the patch shaped for the
    tests after it, or read back one it did not shape. Environments passed to subprocesses
    say for themselves whether they use the cache."""
    monkeypatch.setenv("SANDLOCK_NO_CACHE", "1")
    return monkeypatch


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


@functools.lru_cache(maxsize=None)
def _private_mounts() -> Optional[str]:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr.strip()


def require_private_mounts() -> None:
    """Skip unless ``unshare -m --propagation private`` works here (root): it does not
    in a chroot whose root is not a mount point ("cannot change root filesystem
    propagation")."""
    why = _private_mounts()
    if why is not None:
        pytest.skip(f"cannot make a private mount namespace here: {why}")


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``target`` in a daemon thread; the returned dict gets its ``value`` or ``error``."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


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
    simulated = " (SANDLOCK_ABI)" if ABI < kernel.landlock_abi() else ""
    message = f"{what} needs Landlock ABI {minimum}; this kernel has {ABI}{simulated}"
    if expected and int(expected) >= minimum:
        pytest.fail(f"{message}, but SANDLOCK_EXPECT_ABI={expected}")
    pytest.skip(message)


#: The system packages the project and its tests need: scripts/install.sh, scripts/test.sh
#: and .ci/run install them from this list.
SYSTEM_PACKAGES = REPO / "scripts" / "system-packages.txt"


def package_of(tool: str) -> str:
    """The package of scripts/system-packages.txt that provides ``tool`` (third column)."""
    for line in SYSTEM_PACKAGES.read_text().splitlines():
        fields = line.split()
        if fields and not line.startswith("#") and fields[2] == tool:
            return fields[0]
    raise LookupError(f"{tool}: no package of {SYSTEM_PACKAGES.name} provides it: add one")


@functools.lru_cache(maxsize=None)
def _find_tool(tool: str) -> Optional[str]:
    if tool.startswith("python3:"):
        module = tool.split(":", 1)[1]
        found = subprocess.run([PYTHON, "-c", f"import {module}"], capture_output=True)
        return PYTHON if found.returncode == 0 else None
    if tool.startswith("/"):  # a data file a package ships
        return tool if os.path.isfile(tool) else None
    return shutil.which(tool)


def require_tool(tool: str) -> str:
    """The path of ``tool`` (a command on PATH, or python3:MODULE, a module the system
    python3 imports, or the absolute path of a file); skip without it, naming its package
    (or fail, when SANDLOCK_EXPECT_TOOLS=1 says scripts/test.sh or CI installed every one)."""
    package = package_of(tool)
    found = _find_tool(tool)
    if found is not None:
        return found
    message = f"{tool} is not installed (Debian/Ubuntu package {package}; scripts/test.sh installs it)"
    if os.environ.get("SANDLOCK_EXPECT_TOOLS") == "1":
        pytest.fail(f"{message}, but SANDLOCK_EXPECT_TOOLS=1")
    pytest.skip(message)


def readable_by(uid: int, path: object) -> bool:
    """Whether ``uid`` (with no group) can reach and read ``path``: a test that drops
    root reads its interpreter, the venv and the checkout afterwards."""
    done = subprocess.run([PYTHON, "-c", "import os, sys; os.listdir(sys.argv[1])", str(path)],
                          user=uid, group=uid, extra_groups=[], capture_output=True)
    return done.returncode == 0


#: The private key planted in :func:`home`: no confined tool may ever print it.
PLANTED_KEY = "-----BEGIN OPENSSH PRIVATE KEY----- planted"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A temporary HOME with a planted private key (:data:`PLANTED_KEY`)."""
    path = tmp_path / "home"
    (path / ".ssh").mkdir(parents=True)
    (path / ".ssh" / "id_rsa").write_text(PLANTED_KEY)
    return path


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


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


def reboot_keyring() -> bytes:
    """What a reboot (or the user's last logout) does to the kernel user keyring: the
    compiled-policy cache's key there is a new one. Returns the new key; skips where the
    keyring is refused (the cache key is then a file, which a reboot keeps)."""
    import ctypes

    from sandlock.compile.cachekey import KEY_NAME
    from sandlock.linux import kernel
    from sandlock.linux.syscalls import NR

    before = kernel.user_keyring_secret(KEY_NAME)
    if before is None:
        pytest.skip("the kernel keyring is refused here: the cache key is a file already")
    new = os.urandom(len(before))
    added = kernel._syscall(NR["add_key"], b"user", KEY_NAME, new,
                            ctypes.c_size_t(len(new)), ctypes.c_long(kernel.KEY_SPEC_USER_KEYRING))
    assert added >= 0 and kernel.user_keyring_secret(KEY_NAME) == new != before
    return new
