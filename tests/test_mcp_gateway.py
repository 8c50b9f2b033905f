"""`sandlock mcp -- SERVER`: any stdio MCP server, confined per tool, on the real kernel.

The server is tests/mcp_server.py (the SDK's MCPServer) and, when npm can install it,
the Node `@modelcontextprotocol/server-filesystem`; the client is the SDK's ClientSession.
Each attack has its positive control: the same server without sandlock reads the secret.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from mcp_tools import (
    HOSTILE,
    NODE_FILESYSTEM,
    SERVER,
    npm_package,
    python_policy,
    require_mcp,
    sandlock_argv,
    session,
    text,
)

SECRET = "s3cret-do-not-leak"


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A workspace with a file, a secret beside it, and a registry (no `default` entry)."""
    require_mcp()
    root = tmp_path_factory.mktemp("mcp")
    ws, registry, secret = root / "ws", root / "registry", root / "secret" / "key.txt"
    for directory in (ws, registry, secret.parent):
        directory.mkdir()
    (ws / "data.txt").write_text("hello from the workspace\n")
    secret.write_text(SECRET + "\n")
    (registry / "listing.toml").write_text(python_policy())
    (registry / "read.toml").write_text(python_policy("${workspace}"))
    for tool in ("crash", "slow", "flood", "garbage", "spoof", "echo"):
        (registry / f"{tool}.toml").write_text(python_policy())
    (registry / "pid.toml").write_text(python_policy(isolation="tool"))
    return {"root": root, "ws": ws, "registry": registry, "secret": secret}


@pytest.fixture(scope="module")
def gateway(place: dict[str, Path]) -> Iterator[Any]:
    argv = sandlock_argv("mcp", "--registry", str(place["registry"]),
                         "--var", f"workspace={place['ws']}", "--",
                         sys.executable, str(SERVER), "--secret", str(place["secret"]))
    with session(argv, cwd=str(place["ws"]), errlog=place["root"] / "gateway.err") as client:
        yield client


def _mcp_error(exc: BaseException) -> str:
    from mcp import MCPError

    assert isinstance(exc, MCPError), repr(exc)
    return str(exc)


def test_lists_and_calls_through_confined_instances(gateway: Any) -> None:
    assert {"read", "crash", "pid", "slow"} <= set(gateway.tools())
    result = gateway.call("read", {"path": "data.txt"})
    assert not result.is_error and text(result) == "hello from the workspace\n"


def test_unknown_tool_is_refused_naming_it(gateway: Any) -> None:
    from mcp import MCPError

    for name in ("nope", "listing"):  # no entry, no default; the listing entry is no tool's
        with pytest.raises(MCPError) as raised:
            gateway.call(name, {})
        assert f"tool {name!r} has no policy" in _mcp_error(raised.value)


def test_secret_refused_by_the_kernel_in_every_instance(gateway: Any, place: dict[str, Path]) -> None:
    result = gateway.call("read", {"path": str(place["secret"])})
    assert result.is_error and SECRET not in text(result)
    log = (place["root"] / "gateway.err").read_text()
    assert "[listing] secret: denied (errno 13)" in log  # the listing instance is confined too
    assert "[read] secret: denied (errno 13)" in log
    assert "secret: readable" not in log and SECRET not in log


def test_secret_readable_without_sandlock(place: dict[str, Path]) -> None:
    """Positive control: the same server, unconfined, reads the secret."""
    argv = [sys.executable, str(SERVER), "--secret", str(place["secret"])]
    with session(argv, cwd=str(place["ws"]), errlog=place["root"] / "plain.err") as client:
        assert text(client.call("read", {"path": str(place["secret"])})).strip() == SECRET
    assert f"secret: readable {SECRET}" in (place["root"] / "plain.err").read_text()


def test_server_stderr_reaches_the_terminal_escaped(gateway: Any, place: dict[str, Path]) -> None:
    gateway.call("pid")
    log = (place["root"] / "gateway.err").read_text()
    assert "test server up \\x1b[31mred\\x1b[0m" in log and "\x1b" not in log


def test_crash_mid_call_is_an_error_and_the_next_call_works(gateway: Any) -> None:
    from mcp import MCPError

    with pytest.raises(MCPError) as raised:
        gateway.call("crash")
    assert "the server of tool 'crash' exited (status 3)" in _mcp_error(raised.value)
    assert text(gateway.call("read", {"path": "data.txt"})) == "hello from the workspace\n"


def test_hostile_output_is_refused_and_the_next_call_works(place: dict[str, Path]) -> None:
    from mcp import MCPError

    argv = sandlock_argv("mcp", "--registry", str(place["registry"]), "--",
                         sys.executable, str(HOSTILE))
    with session(argv, cwd=str(place["ws"]), errlog=place["root"] / "hostile.err") as client:
        flood, garbage, spoof = client.at_once([("flood", {}), ("garbage", {}), ("spoof", {})])
        assert isinstance(flood, MCPError) and "a message longer than" in str(flood), flood
        assert isinstance(garbage, MCPError) and "not JSON" in str(garbage), garbage
        assert text(spoof) == "spoof answered id 2"  # the reply under an unsent id was dropped
        assert text(client.call("echo")) == "echo answered id 2"  # ids remapped per instance


def test_concurrent_calls_never_share_a_per_call_instance(gateway: Any) -> None:
    first, second = gateway.at_once([("slow", {"seconds": 1.0}), ("slow", {"seconds": 1.0})])
    assert not first.is_error and not second.is_error
    assert text(first) != text(second)  # two processes answered
    warm = {text(gateway.call("pid")) for _ in range(2)}
    assert len(warm) == 1 and warm.isdisjoint({text(first), text(second)})  # [mcp] isolation = "tool"


def test_registry_without_a_listing_policy_is_refused(place: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "read.toml").write_text(python_policy())
    run = subprocess.run(sandlock_argv("mcp", "--registry", str(tmp_path), "--", "true"),
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert run.returncode == 125, run
    assert "no 'listing' or 'default' entry" in run.stderr and "Traceback" not in run.stderr


def test_node_filesystem_server(place: dict[str, Path], tmp_path: Path) -> None:
    """The npm reference server, asked to serve all of / : the policy, not its own check,
    keeps it to the workspace. Positive control: the same server unconfined reads the secret."""
    package = npm_package(NODE_FILESYSTEM)
    (tmp_path / "default.toml").write_text(
        f'version = 1\nextends = ["node"]\n[filesystem]\nread = ["{package.parent.parent}", '
        '"${workspace}"]\n')
    server = ["node", str(package / "dist" / "index.js"), "/"]
    argv = sandlock_argv("mcp", "--registry", str(tmp_path), "--var", f"workspace={place['ws']}",
                         "--", *server)
    with session(argv, cwd=str(place["ws"]), errlog=tmp_path / "gateway.err") as client:
        assert {"read_text_file", "list_directory"} <= set(client.tools())
        read = client.call("read_text_file", {"path": str(place["ws"] / "data.txt")})
        assert text(read) == "hello from the workspace\n"
        secret = client.call("read_text_file", {"path": str(place["secret"])})
        assert secret.is_error and SECRET not in text(secret)
        assert "EACCES" in text(secret) or "permission denied" in text(secret).lower()
    with session(server, cwd=str(place["ws"]), errlog=tmp_path / "plain.err") as client:
        assert text(client.call("read_text_file", {"path": str(place["secret"])})).strip() == SECRET
