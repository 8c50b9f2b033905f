"""What a tool call costs through `sandlock mcp`, against the same server unconfined.

    python -m benchmarks.mcp_cost [--rounds 15]

One MCP session (the SDK's ClientSession over stdio) per configuration, all open at once;
each round times one ``tools/call`` in each, in turn (interleaved, so load hits all alike);
medians in ms and each ratio against the unconfined server measured in the same run:

1. ``direct``: tests/mcp_server.py (the SDK's MCPServer), unconfined; its ``pid`` tool.
2. ``per-call``: the same server behind the gateway, ``[mcp] isolation = "call"`` (a fresh
   confined instance per call: start, initialize, call, stop).
3. ``per-tool``: behind the gateway, ``isolation = "tool"`` (one warm confined instance).
4. ``fresh direct``: what per-call isolation does without sandlock: a new unconfined
   server per call (start it, initialize, call, stop it), the client's own session.
5. ``serve shell``: `sandlock mcp serve`'s ``shell`` tool running ``true`` (a sandbox per call).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "tests" / "mcp_server.py"


def _policy(isolation: str) -> str:
    import mcp

    reads = [sys.prefix, os.path.dirname(os.path.dirname(mcp.__file__)), str(SERVER.parent)]
    return (f'version = 1\nextends = ["python"]\n[filesystem]\nread = {reads!r}\n'
            f'[mcp]\nisolation = "{isolation}"\n').replace("'", '"')


@contextlib.contextmanager
def _session(argv: list[str], cwd: str) -> Iterator[Any]:
    from anyio.from_thread import start_blocking_portal
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(command=argv[0], args=argv[1:], cwd=cwd,
                                   env={"PYTHONPATH": str(REPO)})
    with open(os.devnull, "w") as quiet, start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(stdio_client(params, errlog=quiet)) as streams:
            with portal.wrap_async_context_manager(ClientSession(*streams)) as client:
                portal.call(client.initialize)
                yield lambda name, args: portal.call(client.call_tool, name, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    options = parser.parse_args()
    sandlock = [sys.executable, "-P", "-m", "sandlock"]
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        ws = Path(root, "ws")
        ws.mkdir()
        configs: dict[str, tuple[list[str], str, dict[str, Any]]] = {
            "direct": ([sys.executable, str(SERVER)], "pid", {})}
        for isolation, name in (("call", "per-call"), ("tool", "per-tool")):
            registry = Path(root, name)
            registry.mkdir()
            (registry / "default.toml").write_text(_policy(isolation))
            configs[name] = ([*sandlock, "mcp", "--registry", str(registry), "--",
                              sys.executable, str(SERVER)], "pid", {})
        configs["serve shell"] = ([*sandlock, "mcp", "serve", "--workspace", str(ws)], "shell",
                                  {"command": "true"})
        calls = {name: (stack.enter_context(_session(argv, root)), tool, args)
                 for name, (argv, tool, args) in configs.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call, tool, args in calls.values():
            call(tool, args)  # warm-up
        for _ in range(options.rounds):
            for name, (call, tool, args) in calls.items():
                start = time.perf_counter()
                result = call(tool, args)
                times[name].append((time.perf_counter() - start) * 1000)
                assert not result.is_error, (name, result)
            start = time.perf_counter()
            with _session(configs["direct"][0], root) as fresh:
                fresh("pid", {})
            times.setdefault("fresh direct", []).append((time.perf_counter() - start) * 1000)
    base = statistics.median(times["direct"])
    print(f"tools/call, median of {options.rounds} interleaved rounds (ms; x the unconfined server)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:12} {median:9.1f} ms  x{median / base:7.1f}")


if __name__ == "__main__":
    main()
