"""A small MCP server for the gateway tests (run as a script, confined or not).

Tools: ``read`` (a file), ``crash`` (the process dies mid-call), ``pid`` (which process
answered), ``slow`` (sleeps, then says which process answered: concurrent calls must not
share one). A hostile server is tests/mcp_hostile.py.

``--secret PATH``: at start-up, try to read PATH and say on stderr whether it could
(every instance the gateway starts does, the listing one included). Its first stderr line
carries a terminal escape sequence, which must reach the terminal escaped.
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("sandlock-test", log_level="WARNING")


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
    sys.stderr.write("test server up \x1b[31mred\x1b[0m\n")
    if sys.argv[1:2] == ["--secret"]:
        try:
            with open(sys.argv[2], encoding="utf-8") as file:
                sys.stderr.write(f"secret: readable {file.read().strip()}\n")
        except OSError as exc:
            sys.stderr.write(f"secret: denied (errno {exc.errno})\n")
    sys.stderr.flush()
    server.run()
