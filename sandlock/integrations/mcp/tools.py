"""``sandlock mcp serve``: an MCP server (stdio) whose tools each run in a sandbox.

Every call is a new confined process under a shipped profile, with the workspace as its
``${workspace}`` variable:

| tool | profile | runs |
|---|---|---|
| ``shell`` | ``shell`` | ``sh -c COMMAND`` in the workspace |
| ``python`` | ``python_runner`` | ``python3 -I -`` with the code on stdin |
| ``read_file`` | ``read_file`` | ``cat -- PATH`` |
| ``list_files`` | ``read_file`` | ``ls -la -- PATH`` |
| ``write_file`` | ``write_file`` | ``tee -- PATH`` with the content on stdin |
| ``fetch`` | ``tls`` + curl + ``[network] allow`` = the ``--allow-host`` list | ``curl URL`` |

``fetch`` does not extend ``https_client``: its ``connect = [443]`` would let curl reach
any server on port 443 beside the allowlist (a ``connect`` port is granted to every
address); it takes the same CA files from ``tls`` and only the hosts given. Without
``--allow-host`` there is no ``fetch`` tool.

The server itself is the agent's side (unconfined); a tool's output reaches it through
files (bounded by the profile's ``file_size``) and at most :data:`MAX_OUTPUT` bytes of
each stream are returned. The tool's arguments reach the sandboxed command as data
(after ``--``, or on stdin), never as options or shell text of the server's.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ...errors import KernelSupportError, PolicyError
from ...trace.emit import printable

if TYPE_CHECKING:
    from ...api.results import Result
    from ...api.sandbox import Sandbox

#: Bytes of a tool's stdout (and of its stderr) returned to the client.
MAX_OUTPUT = 256 * 1024
#: The profile each tool runs under (fetch's policy is built from the host list).
PROFILES = {"shell": "shell", "python": "python_runner", "read_file": "read_file",
            "list_files": "read_file", "write_file": "write_file"}
PYTHON = "/usr/bin/python3"  # the interpreter the python profile grants


def fetch_policy(hosts: Sequence[str]) -> dict[str, Any]:
    """The fetch tool's policy: CA files, curl, and only ``hosts`` (``[network] allow``)."""
    return {"version": 1, "extends": ["tls"],
            "description": "fetch through the host allowlist of `sandlock mcp serve`",
            "filesystem": {"exec": ["/usr/bin/curl"]},
            "network": {"allow": list(hosts)},
            "limits": {"timeout": "60s", "file_size": "64MiB"}}


def _read(file: Any) -> tuple[str, bool]:
    file.seek(0)
    data = file.read(MAX_OUTPUT + 1)
    return data[:MAX_OUTPUT].decode("utf-8", "replace"), len(data) > MAX_OUTPUT


class Tools:
    """The sandboxes of the ready server's tools, compiled once for one workspace."""

    def __init__(self, workspace: str, hosts: Sequence[str] = ()) -> None:
        from ...api.sandbox import Sandbox

        self.workspace = os.path.realpath(workspace)
        if not os.path.isdir(self.workspace):
            raise PolicyError(f"the workspace {self.workspace!r} is not a directory")
        variables = {"workspace": self.workspace}
        by_profile: dict[str, Sandbox] = {}
        self.boxes: dict[str, Sandbox] = {}
        for tool, profile in PROFILES.items():
            if profile not in by_profile:
                by_profile[profile] = Sandbox(profile, vars=variables)
            self.boxes[tool] = by_profile[profile]
        from ..claude_code import KEPT

        #: What Claude Code reads from the workspace (it runs hooks and MCP servers from
        #: them outside any sandbox), which the shell and write tools may write: put back
        #: after each call that changed them, and the call fails (see sandlock.undo.keep).
        self.kept = tuple(os.path.join(self.workspace, name) for name in KEPT)
        self.hosts = tuple(hosts)
        if self.hosts:
            try:
                self.boxes["fetch"] = Sandbox(fetch_policy(self.hosts))
            except KernelSupportError as exc:
                # The compiler's refusal names the gaps; its way out (--accept,
                # --best-effort) is not this command's: serve runs every tool strictly.
                gaps = str(exc).split("\nRefusing to run.", 1)[0]
                raise KernelSupportError(
                    f"the fetch tool (--allow-host): {gaps}\n`sandlock mcp serve` runs every "
                    "tool strictly (it has no --accept or --best-effort): on this kernel run it "
                    "without --allow-host, or run a fetch server behind the gateway (`sandlock "
                    "mcp --registry`), whose policy may accept the gap") from None

    def run(self, tool: str, argv: Sequence[str], input: Optional[str] = None) -> tuple[Result, str, str]:
        """Run ``argv`` under ``tool``'s sandbox in the workspace: the result, stdout, stderr."""
        from ...api.sandbox import DEVNULL
        from ...undo.keep import keep

        held = [keep(path) for path in self.kept]  # KeepError: refused before the call
        try:
            # stdin: never the server's (the protocol stream; the SDK diverts fd 0 while it
            # serves, and this does not depend on it).
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                result = self.boxes[tool].run(
                    list(argv), cwd=self.workspace, stdout=out, stderr=err,
                    stdin=DEVNULL if input is None else None,
                    input=None if input is None else input.encode("utf-8", "surrogateescape"))
                (stdout, cut_out), (stderr, cut_err) = _read(out), _read(err)
        finally:
            _put_back(held)  # the call's whole tree is gone once run() returns
        if cut_out:
            stdout += f"\n[sandlock: output cut at {MAX_OUTPUT} bytes]"
        if cut_err:
            stderr += f"\n[sandlock: error output cut at {MAX_OUTPUT} bytes]"
        return result, stdout, stderr

    def report(self, tool: str, argv: Sequence[str], input: Optional[str] = None) -> str:
        """A command's exit status and output, as one text for the model."""
        result, stdout, stderr = self.run(tool, argv, input)
        text = f"exit status: {result.returncode} ({result.outcome.name.lower()})\n"
        if stdout:
            text += f"stdout:\n{stdout}\n"
        if stderr:
            text += f"stderr:\n{stderr}\n"
        return text

    def output(self, tool: str, argv: Sequence[str], input: Optional[str] = None) -> str:
        """A command's stdout, or a tool error with its stderr when it failed."""
        from mcp.server.mcpserver.exceptions import ToolError

        result, stdout, stderr = self.run(tool, argv, input)
        if result.returncode != 0:
            # The tool's own text: escaped, as the SDK logs the error on the terminal too.
            raise ToolError(f"{tool} failed (exit status {result.returncode}): "
                            f"{printable(stderr.strip(), lines=True)}")
        return stdout

    def close(self) -> None:
        for box in set(self.boxes.values()):
            box.close()


def _put_back(held: Sequence[Any]) -> None:
    """Put back each kept path the call changed; the call fails (a ToolError: the model
    reads why) if any was."""
    from mcp.server.mcpserver.exceptions import ToolError

    from ...undo.keep import KeepError, in_order, put_back

    said = []
    for each in in_order(held):
        try:
            found = put_back(each)
        except KeepError as exc:
            found = str(exc)
        finally:
            each.close()
        if found is not None:
            said.append(found)
    if said:
        raise ToolError(printable("sandlock: " + "; ".join(said)))


def build(workspace: str, hosts: Sequence[str] = ()) -> Any:
    """The MCP server (an ``mcp`` SDK ``MCPServer``; ``.run()`` serves stdio)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    tools = Tools(workspace, hosts)
    server: Any = MCPServer("sandlock", log_level="WARNING", instructions=(
        f"Tools run in sandboxes confined to the workspace {tools.workspace}; paths are "
        "relative to it. Nothing outside it can be read or written; no network except fetch."))

    def shell(command: str) -> str:
        """Run a POSIX shell command in the workspace (no network); its exit status and output."""
        return tools.report("shell", ["sh", "-c", command])

    def python(code: str) -> str:
        """Run Python code (standard library only, no network) in the workspace."""
        return tools.report("python", [PYTHON, "-I", "-"], input=code)

    def read_file(path: str) -> str:
        """The text of a file in the workspace."""
        return tools.output("read_file", ["cat", "--", path])

    def list_files(path: str = ".") -> str:
        """The entries of a directory in the workspace (ls -la)."""
        return tools.output("list_files", ["ls", "-la", "--", path])

    def write_file(path: str, content: str) -> str:
        """Create or overwrite a file in the workspace with ``content``."""
        tools.output("write_file", ["tee", "--", path], input=content)
        return f"wrote {len(content.encode('utf-8', 'surrogateescape'))} bytes"

    def fetch(url: str) -> str:
        """The body of an http(s) URL on an allowed host."""
        if not url.startswith(("http://", "https://")):  # never an option of curl's
            raise ToolError("fetch takes an http:// or https:// URL")
        return tools.output("fetch", ["curl", "-sS", "--fail-with-body", "--max-time", "50",
                                      "--max-filesize", str(MAX_OUTPUT * 4), url])

    for function in (shell, python, read_file, list_files, write_file):
        server.add_tool(function)
    if tools.hosts:
        server.add_tool(fetch)
    return server
