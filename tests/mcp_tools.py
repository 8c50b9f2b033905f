"""Shared by the MCP tests: the SDK requirement and a blocking MCP client.

The client is the SDK's own (``mcp.ClientSession`` over ``stdio_client``), driven from
synchronous tests through an anyio blocking portal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVER = Path(__file__).resolve().parent / "mcp_server.py"
HOSTILE = Path(__file__).resolve().parent / "mcp_hostile.py"
#: A call that gets no answer in this time fails the test (a hang is a failure, quickly).
CALL_TIMEOUT = 90.0


def require_mcp() -> None:
    """Skip without the mcp SDK (fail when SANDLOCK_EXPECT_INTEGRATIONS=1, as in CI)."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        message = "the mcp SDK is not installed (pip install 'sandlock[mcp]')"
        if os.environ.get("SANDLOCK_EXPECT_INTEGRATIONS") == "1":
            pytest.fail(f"{message}, but SANDLOCK_EXPECT_INTEGRATIONS=1")
        pytest.skip(message)


def sandlock_argv(*args: str) -> list[str]:
    """``sandlock ARGS`` from this checkout (``-P``: the working directory is no import path)."""
    return [sys.executable, "-P", "-m", "sandlock", *args]


def python_policy(*reads: str, isolation: str = "call") -> str:
    """A policy for the test server: the interpreter, the mcp SDK, this directory, ``reads``."""
    import mcp

    site = os.path.dirname(os.path.dirname(mcp.__file__))
    grants = [sys.prefix, site, str(SERVER.parent), *reads]
    return (f'version = 1\nextends = ["python"]\n[filesystem]\nread = {grants!r}\n'
            f'[mcp]\nisolation = "{isolation}"\n').replace("'", '"')


class Client:
    """One MCP session; every method blocks until the answer is there."""

    def __init__(self, portal: Any, session: Any) -> None:
        self.portal = portal
        self.session = session

    def tools(self) -> list[str]:
        return [tool.name for tool in self.portal.call(self.session.list_tools).tools]

    def call(self, name: str, arguments: Optional[dict[str, Any]] = None) -> Any:
        """The tool's result (``is_error`` for a tool's failure); an MCP error raises."""
        return self.portal.call(lambda: self.session.call_tool(
            name, arguments or {}, read_timeout_seconds=CALL_TIMEOUT))

    def at_once(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Any]:
        """The results of ``calls`` sent together (each an exception or a result)."""
        import anyio

        async def all_of() -> list[Any]:
            out: list[Any] = [None] * len(calls)

            async def one(index: int, name: str, arguments: dict[str, Any]) -> None:
                try:
                    out[index] = await self.session.call_tool(
                        name, arguments, read_timeout_seconds=CALL_TIMEOUT)
                except Exception as exc:  # an MCP error
                    out[index] = exc

            async with anyio.create_task_group() as group:
                for index, (name, arguments) in enumerate(calls):
                    group.start_soon(one, index, name, arguments)
            return out

        result: list[Any] = self.portal.call(all_of)
        return result


def text(result: Any) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


@contextlib.contextmanager
def session(argv: Sequence[str], *, cwd: str, errlog: Path,
            env: Optional[dict[str, str]] = None) -> Iterator[Client]:
    """An initialized MCP session with the stdio server ``argv`` (its stderr to ``errlog``)."""
    from anyio.from_thread import start_blocking_portal
    from mcp import ClientSession, StdioServerParameters, stdio_client

    environment = {"PYTHONPATH": str(REPO), **(env or {})}
    params = StdioServerParameters(command=argv[0], args=list(argv[1:]), cwd=cwd, env=environment)
    with open(errlog, "w", encoding="utf-8") as log, start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(stdio_client(params, errlog=log)) as streams:
            with portal.wrap_async_context_manager(ClientSession(*streams)) as client:
                portal.call(client.initialize)
                yield Client(portal, client)


NODE_FILESYSTEM = "@modelcontextprotocol/server-filesystem"


def npm_package(package: str) -> Path:
    """``package`` installed by npm into $XDG_CACHE_HOME/sandlock-tests/npm (once); its
    directory. Skips without npm or its registry, unless SANDLOCK_EXPECT_INTEGRATIONS=1."""
    import shutil
    import subprocess

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sandlock-tests" / "npm"
    where = cache / "node_modules" / package
    if (where / "package.json").is_file():
        return where
    reason = None
    if shutil.which("npm") is None or shutil.which("node") is None:
        reason = "node and npm are not installed (Debian: nodejs npm)"
    else:
        cache.mkdir(parents=True, exist_ok=True)
        run = subprocess.run(["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund",
                              "--loglevel=error", package],
                             capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if run.returncode != 0 or not (where / "package.json").is_file():
            reason = f"npm could not install {package} into {cache}: {run.stderr.strip()[-300:]}"
    if reason is not None:
        if os.environ.get("SANDLOCK_EXPECT_INTEGRATIONS") == "1":
            pytest.fail(f"{reason}, but SANDLOCK_EXPECT_INTEGRATIONS=1")
        pytest.skip(reason)
    return where
