"""`sandlock mcp`: the MCP gateway (`-- SERVER...`) and the ready server (`serve`).

The code is in :mod:`sandlock.integrations.mcp`; this module parses the options, prints
errors and chooses the exit code, as every command does.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ..errors import SandlockError

GATEWAY_HELP = """Run an MCP server confined, one policy per tool (speaks MCP on stdin/stdout).

\b
  sandlock mcp --registry DIR|FILE [--var NAME=VALUE]... -- SERVER COMMAND...
  sandlock mcp serve --workspace DIR [--allow-host HOST]...

The registry's `listing` (else `default`) entry confines the instance that answers the
handshake and tools/list; tool NAME's calls run under entry NAME, else `default`, else
are refused. `[mcp] isolation = "call"` (default) starts a fresh instance per call,
"tool" keeps one per entry warm. `serve --help` describes the ready server.
"""


def _fail(exc: SandlockError) -> click.exceptions.Exit:
    from ..trace.emit import printable

    print(f"sandlock mcp: {printable(str(exc), lines=True)}", file=sys.stderr)
    return click.exceptions.Exit(int(exc.exit_code))


@click.command("mcp", help=GATEWAY_HELP, context_settings={
    "help_option_names": ["-h", "--help"], "allow_interspersed_args": False})
@click.option("--registry", "source", required=True, metavar="DIR|FILE",
              help="Tool policies: a directory of NAME.toml, or one file of [tools.NAME].")
@click.option("--var", "variables", multiple=True, metavar="NAME=VALUE",
              help="Define ${NAME} for the policies (repeatable).")
@click.argument("server", nargs=-1, required=True)
def gateway(source: str, variables: tuple[str, ...], server: tuple[str, ...]) -> None:
    from ..api.registry import Registry
    from ..integrations.mcp.gateway import Gateway
    from .launch import parse_vars

    try:
        registry = Registry(source)
        bridge = Gateway(registry, server, variables=parse_vars(variables))
    except SandlockError as exc:
        raise _fail(exc) from None
    try:
        bridge.serve(sys.stdin.fileno())
    finally:
        registry.close()


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workspace", required=True, type=click.Path(file_okay=False, exists=True),
              help="The directory the tools work in (their only writable place).")
@click.option("--allow-host", "hosts", multiple=True, metavar="HOST[:PORT]",
              help="A host the fetch tool may reach (repeatable; none: no fetch).")
def serve(workspace: str, hosts: tuple[str, ...]) -> None:
    """An MCP server (stdio) of sandboxed tools: shell, python, read_file, write_file,
    list_files, fetch; each call in its own sandbox under a shipped profile."""
    from ..integrations.mcp.tools import build

    try:
        server = build(workspace, hosts)
    except SandlockError as exc:
        raise _fail(exc) from None
    except ImportError as exc:  # no mcp SDK, or a 1.x one (no mcp.server.mcpserver)
        raise _fail(SandlockError(f"`sandlock mcp serve` needs the mcp SDK 2.x "
                                  f"(pip install 'sandlock[mcp]'): {exc}")) from None
    server.run()


class _Mcp(click.Command):
    """`mcp serve ...` is the ready server; any other `mcp ...` is the gateway."""

    def invoke(self, ctx: click.Context) -> Any:
        argv = list(ctx.args)
        command = serve if argv[:1] == ["serve"] else gateway
        if command is serve:
            argv = argv[1:]
        with command.make_context(f"{ctx.info_name} {command.name}" if command is serve
                                  else str(ctx.info_name), argv, parent=ctx.parent) as sub:
            return command.invoke(sub)


mcp = _Mcp("mcp", help=GATEWAY_HELP, short_help="Run an MCP server confined, or serve sandboxed tools.",
           context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                             "allow_interspersed_args": False},
           add_help_option=False)


def register(group: Any) -> None:
    """Add `mcp` to the click group of :mod:`sandlock.cli.main`."""
    group.add_command(mcp)
