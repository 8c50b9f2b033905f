"""What confining an agent framework's tool costs (issue 24), from one caller process.

    python benchmarks/frameworks_cost.py [--n 100] [--heavy 5]

Each row times the same tool call made two ways, interleaved call by call (machine
load hits both alike), and prints the medians of ``--n`` calls and their ratio:

1. LangChain: ``tool(read_text).invoke(...)`` against
   ``sandlock.integrations.langchain.sandboxed_tool(read_text, ...).invoke(...)``.
2. OpenAI Agents SDK: ``function_tool(read_text).on_invoke_tool`` against
   ``sandboxed_function_tool(read_text, ...).on_invoke_tool``.
3. deepagents: ``LocalShellBackend.execute("cat FILE")`` (unconfined, the SDK's own)
   against ``SandlockBackend.execute("cat FILE")``; and ``download_files`` likewise.
   Agents SDK sandbox sessions: ``UnixLocalSandboxClient``'s ``exec("cat FILE")``
   against ``SandlockSandboxClient``'s (a ``sandlock run`` per command).
4. ``--heavy`` calls of a tool whose module imports ``langchain_core`` (the confined
   process imports the tool's module afresh each call: that import is the cost).

``read_text`` lives in this script, whose top imports only the standard library: the
confined process loads it as ``__main__`` on every call, so the imports of the script
are inside ``main()``. Prints one JSON object
after the table. Numbers depend on load: the load average is printed with them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def read_text(path: str) -> str:
    """Read a text file and return its content.

    Args:
        path: the file to read.
    """
    with open(path, encoding="utf-8") as file:
        return file.read()


def main() -> None:
    import argparse
    import asyncio
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--heavy", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    from agents import function_tool
    from agents.sandbox import Manifest
    from agents.sandbox.sandboxes.unix_local import UnixLocalSandboxClient
    from agents.tool_context import ToolContext
    from deepagents.backends import LocalShellBackend
    from langchain_core.tools import tool

    import sandlock
    from benchmarks.api_overhead import interleaved, timed
    from sandlock.integrations.deepagents import SandlockBackend
    from sandlock.integrations.langchain import sandboxed_tool
    from sandlock.integrations.openai_agents import SandlockSandboxClient, sandboxed_function_tool

    workspace = tempfile.mkdtemp()
    note = os.path.join(workspace, "note.md")
    with open(note, "w", encoding="utf-8") as file:
        file.write("water the plants\n")
    box = sandlock.Sandbox({"extends": ["python"], "filesystem": {"read": [HERE, workspace]}})
    out: dict[str, Any] = {"load_before": os.getloadavg()[0], "n": args.n}
    rows: list[tuple[str, float, float]] = []

    plain_lc, ours_lc = tool(read_text), sandboxed_tool(read_text, sandbox=box)
    rows.append(("LangChain tool.invoke", *compare(args.n, lambda: plain_lc.invoke({"path": note}),
                                                   lambda: ours_lc.invoke({"path": note}),
                                                   interleaved)))

    plain_oa, ours_oa = function_tool(read_text), sandboxed_function_tool(read_text, sandbox=box)
    payload = json.dumps({"path": note})

    def invoke(tool: Any) -> Any:
        context = ToolContext(context=None, tool_name="read_text", tool_call_id="1",
                              tool_arguments=payload)
        return asyncio.run(tool.on_invoke_tool(context, payload))
    rows.append(("Agents SDK on_invoke_tool", *compare(args.n, lambda: invoke(plain_oa),
                                                       lambda: invoke(ours_oa), interleaved)))

    local = LocalShellBackend(root_dir=workspace, inherit_env=True)
    confined = SandlockBackend(workspace, env={"PATH": "/usr/bin:/bin"})
    rows.append(("deepagents execute('cat')", *compare(
        args.n, lambda: local.execute("cat note.md"), lambda: confined.execute("cat note.md"),
        interleaved)))
    rows.append(("deepagents download_files", *compare(
        args.n, lambda: local.download_files([note]), lambda: confined.download_files([note]),
        interleaved)))

    async def sessions() -> tuple[float, float]:
        import statistics
        import time

        plain = await UnixLocalSandboxClient().create(manifest=Manifest(root=workspace))
        ours = await SandlockSandboxClient().create(manifest=Manifest(root=workspace))
        samples: tuple[list[float], list[float]] = ([], [])
        async with plain, ours:
            for i in range(5 + max(args.n // 4, 5)):
                for session, into in ((plain, samples[0]), (ours, samples[1])):
                    start = time.perf_counter()
                    await session.exec("cat note.md")
                    if i >= 5:  # after the warm-up
                        into.append(time.perf_counter() - start)
        return statistics.median(samples[0]) * 1e3, statistics.median(samples[1]) * 1e3
    rows.append(("Agents SDK sandbox session exec('cat')", *asyncio.run(sessions())))

    tools_dir = tempfile.mkdtemp()
    with open(os.path.join(tools_dir, "lc_tools.py"), "w", encoding="utf-8") as file:
        file.write("from langchain_core.tools import tool\n\n@tool\ndef read_file(path: str) -> str:\n"
                   "    \"\"\"Read a file.\"\"\"\n    return open(path).read()\n")
    sys.path.insert(0, tools_dir)
    import lc_tools  # type: ignore[import-not-found]

    heavy = sandboxed_tool(lc_tools.read_file, policy={
        "extends": ["venv"], "filesystem": {"read": [tools_dir, workspace]}}, vars={"venv": sys.prefix})
    heavy_ms = timed(args.heavy, lambda: heavy.invoke({"path": note}))
    rows.append(("LangChain, tool module imports langchain_core", 0.0, heavy_ms))

    print(f"{'call':48} {'direct ms':>10} {'confined ms':>12} {'ratio':>8}")
    for name, direct, ours in rows:
        ratio = f"{ours / direct:.1f}x" if direct else "-"
        print(f"{name:48} {direct:10.3f} {ours:12.3f} {ratio:>8}")
        out[name] = {"direct_ms": round(direct, 3), "confined_ms": round(ours, 3)}
    out["load_after"] = os.getloadavg()[0]
    sandlock.shutdown()
    print(json.dumps(out))


def compare(n: int, direct: Any, ours: Any, interleaved: Any) -> tuple[float, float]:
    for _ in range(5):  # warm up: fork server, spares, page cache
        direct()
        ours()
    result: tuple[float, float] = interleaved(n, direct, ours)
    return result


if __name__ == "__main__":
    main()
