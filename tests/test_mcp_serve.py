"""`sandlock mcp serve`: the ready MCP server of sandboxed tools, through the SDK's client.

Each refusal has its positive control: the same access without sandlock succeeds.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from mcp_tools import require_mcp, sandlock_argv, session, text

SECRET = "s3cret-of-the-user"


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        port = self.connection.getsockname()[1]
        body = f"hello from port {port}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[int, int]]:
    """Two loopback HTTP servers: the allowed one's port, the other one's."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers[0].server_address[1], servers[1].server_address[1]
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_mcp()
    root = tmp_path_factory.mktemp("serve")
    ws, secret = root / "ws", root / "home" / "secret.txt"
    ws.mkdir()
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n")
    return {"root": root, "ws": ws, "secret": secret}


@pytest.fixture(scope="module")
def served(place: dict[str, Path], web: tuple[int, int]) -> Iterator[Any]:
    argv = sandlock_argv("mcp", "serve", "--workspace", str(place["ws"]),
                         "--allow-host", f"127.0.0.1:{web[0]}")
    with session(argv, cwd=str(place["root"]), errlog=place["root"] / "serve.err") as client:
        yield client


def test_every_tool_works_in_the_workspace(served: Any, place: dict[str, Path]) -> None:
    assert set(served.tools()) == {"shell", "python", "read_file", "write_file", "list_files", "fetch"}
    assert not served.call("write_file", {"path": "notes.md", "content": "hi there\n"}).is_error
    assert (place["ws"] / "notes.md").read_text() == "hi there\n"
    assert text(served.call("read_file", {"path": "notes.md"})) == "hi there\n"
    assert "notes.md" in text(served.call("list_files", {}))
    assert "stdout:\n2\n" in text(served.call("shell", {"command": "echo $((1 + 1))"}))
    assert "stdout:\n6\n" in text(served.call("python", {"code": "print(2 * 3)"}))


def test_shell_cannot_read_outside_the_workspace(served: Any, place: dict[str, Path]) -> None:
    command = f"cat {place['secret']}"
    result = text(served.call("shell", {"command": command}))
    assert SECRET not in result and "Permission denied" in result
    plain = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
    assert plain.stdout.strip() == SECRET  # positive control: the user can read it


def test_write_file_cannot_write_outside_the_workspace(served: Any, place: dict[str, Path]) -> None:
    target = place["secret"].parent / "planted.txt"
    result = served.call("write_file", {"path": str(target), "content": "planted"})
    assert result.is_error and "Permission denied" in text(result)
    assert not target.exists()
    target.write_text("planted")  # positive control: the directory is writable without sandlock
    target.unlink()


def test_fetch_reaches_only_the_allowed_host(served: Any, web: tuple[int, int]) -> None:
    allowed, other = web
    assert text(served.call("fetch", {"url": f"http://127.0.0.1:{allowed}/"})) == \
        f"hello from port {allowed}"
    refused = served.call("fetch", {"url": f"http://127.0.0.1:{other}/"})
    assert refused.is_error and f"hello from port {other}" not in text(refused)
    plain = subprocess.run(["curl", "-sS", "--noproxy", "*", f"http://127.0.0.1:{other}/"],
                           capture_output=True, text=True, timeout=30)
    assert plain.stdout == f"hello from port {other}"  # positive control
    option = served.call("fetch", {"url": "--version"})
    assert option.is_error and "http:// or https:// URL" in text(option)


def test_the_example_client_runs(tmp_path: Path) -> None:
    """examples/mcp_serve_client.py: the SDK's client, the served tools, the secret refused."""
    require_mcp()
    from mcp_tools import REPO

    done = subprocess.run([sys.executable, str(REPO / "examples" / "mcp_serve_client.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "water the plants" in done.stdout and "Permission denied" in done.stdout
    assert "sk-not-for-tools" not in done.stdout


@pytest.mark.parametrize("tool, arguments", [
    ("shell", {"command": "mkdir -p .claude && echo '{\"hooks\": {}}' > .claude/settings.json"}),
    ("write_file", {"path": ".mcp.json", "content": '{"mcpServers": {"x": {"command": "id"}}}'}),
])
def test_claude_codes_files_in_the_workspace_are_kept(served: Any, place: dict[str, Path],
                                                      tool: str, arguments: dict[str, str]) -> None:
    """Claude Code runs the hooks of the workspace's .claude and the servers of its
    .mcp.json outside any sandbox: a call that changed them is put back, and fails."""
    result = served.call(tool, arguments)
    assert result.is_error and "a path kept for this run" in text(result), text(result)
    assert not (place["ws"] / ".claude" / "settings.json").exists()
    assert not (place["ws"] / ".mcp.json").exists()
    for left in place["ws"].iterdir():  # what the call wrote, moved aside: nothing is lost
        if ".sandlock-changed-" in left.name:
            subprocess.run(["rm", "-rf", str(left)], check=True)
