"""A small MCP server for the gateway tests (run as a script, confined or not).

Tools: ``read`` (a file, relative to the working directory or absolute), ``crash``
(the process dies mid-call), ``pid`` (which process answered), ``slow`` (sleeps, then
says which process answered: concurrent calls must not share one).
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("sandlock-test")


@server.tool()
def read(path: str) -> str:
    """The text of a file."""
    with open(path, encoding="utf-8") as file:
        return file.read()


@server.tool()
def crash() -> str:
    """Die without answering."""
    os._exit(3)


@server.tool()
def pid() -> str:
    """The id of the process that answered."""
    return str(os.getpid())


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then say which process answered."""
    time.sleep(seconds)
    return str(os.getpid())


if __name__ == "__main__":
    sys.stderr.write("test server up\n")
    server.run()
