"""An MCP client (the `mcp` SDK's own) talking to `sandlock mcp serve`: the ready server
of sandboxed tools. Every tool call runs in its own sandbox, kept to the workspace.

    pip install 'sandlock-agent[mcp]'
    python examples/mcp_serve_client.py

The same server in an MCP client's configuration (`.mcp.json`, Claude Desktop, Cursor):
    {"mcpServers": {"sandlock": {"command": "sandlock",
                                 "args": ["mcp", "serve", "--workspace", "/path/to/project"]}}}
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

from mcp import ClientSession, StdioServerParameters, stdio_client


def text(result: object) -> str:
    return "".join(getattr(block, "text", "") for block in getattr(result, "content", []))


async def main(workspace: str, secret: str) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = StdioServerParameters(
        command=sys.executable, args=["-P", "-m", "sandlock", "mcp", "serve", "--workspace",
                                      workspace],
        env={"PYTHONPATH": here, "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    async with stdio_client(server) as streams, ClientSession(*streams) as session:
        await session.initialize()
        tools = [tool.name for tool in (await session.list_tools()).tools]
        print("tools:", ", ".join(sorted(tools)))
        await session.call_tool("write_file", {"path": "notes.md", "content": "water the plants\n"})
        inside = await session.call_tool("shell", {"command": "cat notes.md"})
        print("shell, inside the workspace:", text(inside).strip().replace("\n", " | "))
        outside = await session.call_tool("shell", {"command": f"cat {secret}"})
        print("shell, outside it:", text(outside).strip().replace("\n", " | "))
        return 1 if "sk-not-for-tools" in text(outside) else 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        workspace, secret = os.path.join(root, "ws"), os.path.join(root, "api-key")
        os.mkdir(workspace)
        with open(secret, "w") as file:
            file.write("sk-not-for-tools\n")
        sys.exit(asyncio.run(main(workspace, secret)))
