"""Every shipped policy in policies/ loads, lints, and runs its intended tool confined.

These are the policies users copy first, so each is exercised end to end on the
real kernel: the tool does its job inside, and the obvious abuse fails.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from conftest import POLICIES, PYTHON, require_abi, run_confined, sandlock

from sandlock.policy.model import load_policy

SHIPPED = sorted(POLICIES.glob("*.toml"))
EXERCISED = {"read_file", "write_file", "shell", "https_client", "python_runner"}
#: https_client grants /usr/bin/curl by name; a machine without curl cannot load it.
needs_curl = pytest.mark.skipif(not Path("/usr/bin/curl").exists(),
                                reason="curl is not installed (apt install curl)")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(4, "the shipped policies (files and TCP ports)")


def test_every_shipped_policy_is_exercised_here() -> None:
    assert {p.stem for p in SHIPPED} == EXERCISED


@pytest.mark.parametrize("policy", [
    pytest.param(p, marks=[needs_curl] if p.stem == "https_client" else []) for p in SHIPPED
], ids=[p.stem for p in SHIPPED])
def test_shipped_policy_loads_and_validates(policy: Path, workspace: Path) -> None:
    loaded = load_policy(policy, {"workspace": str(workspace)})
    assert loaded.description
    assert "base" in " ".join(loaded.layers) or "python" in " ".join(loaded.layers)
    lint = sandlock("validate", str(policy))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    explain = sandlock("explain", "--policy", str(policy), "--var", f"workspace={workspace}")
    assert explain.returncode == 0, explain.stderr


def run(name: str, argv: list[str], workspace: Path, **kwargs: object
        ) -> subprocess.CompletedProcess[str]:
    return run_confined(POLICIES / f"{name}.toml", argv, variables={"workspace": str(workspace)},
                        **kwargs)  # type: ignore[arg-type]


def test_read_file(workspace: Path, outside: Path) -> None:
    result = run("read_file", ["cat", str(workspace / "notes.md")], workspace)
    assert (result.returncode, result.stdout) == (0, "hello from the workspace\n"), result.stderr
    listing = run("read_file", ["ls", str(workspace)], workspace)
    assert listing.stdout.split() == ["notes.md"]
    denied = run("read_file", ["cat", str(outside / "secret.txt")], workspace)
    assert denied.returncode == 1 and "Permission denied" in denied.stderr
    assert "top secret" not in denied.stdout
    # the policy grants no write, not even in the workspace
    writer = run("read_file", ["/usr/bin/cp", str(workspace / "notes.md"), str(workspace / "x")],
                 workspace)
    assert writer.returncode == 126
    assert not (workspace / "x").exists()


def test_write_file(tmp_path: Path, workspace: Path, outside: Path) -> None:
    policy = POLICIES / "write_file.toml"
    target = workspace / "out.txt"
    args = ["run", "--policy", str(policy), "--var", f"workspace={workspace}", "--"]
    made = sandlock(*args, "tee", str(target), input="written by tee\n")
    assert made.returncode == 0, made.stderr
    assert target.read_text() == "written by tee\n"
    moved = sandlock(*args, "mv", str(target), str(workspace / "moved.txt"))
    assert moved.returncode == 0, moved.stderr
    escape = sandlock(*args, "tee", str(outside / "planted"), input="x\n")
    assert escape.returncode == 1 and "Permission denied" in escape.stderr
    assert not (outside / "planted").exists()
    stolen = sandlock(*args, "mv", str(outside / "secret.txt"), str(workspace / "s.txt"))
    assert stolen.returncode == 1
    assert (outside / "secret.txt").read_text() == "top secret\n"


def test_shell(workspace: Path, outside: Path) -> None:
    script = f'cd "{workspace}" && echo made > made.txt && ls && cat made.txt && echo "$HOME"'
    result = run("shell", ["sh", "-c", script], workspace)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["made.txt", "notes.md", "made", str(workspace)]
    escape = run("shell", ["sh", "-c", f'echo x > "{outside}/planted"'], workspace)
    assert escape.returncode != 0 and not (outside / "planted").exists()
    secret = run("shell", ["cat", str(outside / "secret.txt")], workspace)
    assert secret.returncode == 1 and "Permission denied" in secret.stderr


def test_shell_has_no_network(workspace: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}))\n"
                "except OSError as exc:\n    print(exc.errno)\nelse:\n    print('connected')\n")
        # python3 is one of the /usr/bin programs the shell policy lets it run
        result = run("shell", ["sh", "-c", 'exec /usr/bin/python3 -c "$1"', "sh", code], workspace)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"  # EPERM: no inet socket at all
    if not Path("/usr/bin/curl").exists():
        return
    curl = run("shell", ["curl", "-sS", f"http://127.0.0.1:{port}/"], workspace)
    assert curl.returncode == 7  # couldn't connect


@pytest.fixture
def web_listener() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


@needs_curl
def test_https_client(workspace: Path, web_listener: int) -> None:
    other = run("https_client", ["curl", "-v", f"http://127.0.0.1:{web_listener}/"], workspace)
    assert other.returncode == 7
    assert "Permission denied" in other.stderr  # Landlock, although a listener is there
    https = run("https_client", ["curl", "-v", "https://127.0.0.1:443/"], workspace)
    # Nothing listens on 443 here: "refused" means the connect reached the kernel's TCP stack.
    assert "Permission denied" not in https.stderr
    assert https.returncode == 0 or "Connection refused" in https.stderr, https.stderr


@needs_curl
def test_https_client_cannot_read_files(workspace: Path) -> None:
    result = run("https_client", ["curl", "-sS", f"file://{workspace}/notes.md"], workspace)
    assert result.returncode != 0 and "hello" not in result.stdout


def test_python_runner(workspace: Path) -> None:
    code = (
        "import json, os\n"
        "open('result.json', 'w').write(json.dumps({'sum': sum(range(10))}))\n"
        "try:\n    open('/etc/passwd').read()\n"
        "except PermissionError:\n    print('passwd denied')\n"
        "print(os.environ['HOME'] == os.getcwd() or os.environ['HOME'])\n"
    )
    # -P: `python -m` would put the working directory (the tool's writable workspace) on
    # sandlock's own import path, which sandlock refuses (tests/test_integrity.py).
    result = subprocess.run(
        [sys.executable, "-P", "-m", "sandlock", "run", "--policy",
         str(POLICIES / "python_runner.toml"), "--var", f"workspace={workspace}", "--", PYTHON,
         "-c", code],
        cwd=workspace, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["passwd denied", "True"]
    assert (workspace / "result.json").read_text() == '{"sum": 45}'
