"""An MCP server (standard library only) that reads messages as lenient servers do, and
answers some calls with what a gateway must survive. Run as a script, confined or not.

* Keys are matched case-insensitively, the last one winning: Go's ``encoding/json``
  decodes ``{"name": "a", "Name": "b"}`` into a struct's ``name`` field as ``b``.
* Tool names are read regardless of case and surrounding spaces (``" Narrow"`` is
  ``narrow``).
* A ``tools/call`` sent as a notification (no id) is run too, as JSON-RPC dispatchers
  that look only at the method do; its result comes back as a log notification.
* Tools ``hang*`` never answer. Tool ``deep`` answers with a result nested 50000 deep,
  ``deep-note`` sends such a notification first, ``surrogate`` answers with a lone
  UTF-16 surrogate (``\\ud800``, valid JSON text that no UTF-8 encoder takes back);
  ``nan`` and ``inf`` answer with ``NaN`` and ``-1e999`` (no JSON; Python reads them).
* Any other tool ``NAME`` tries to read the file named by ``--secret PATH`` and answers
  ``NAME: <its text>`` or ``NAME: denied (errno N)``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

DEPTH = 50000
#: One level of it: a bracket padded to the bytes the gateway takes for each container
#: (its bound on containers per byte is not what these lines test).
OPEN = "[" + " " * 7


def send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def raw(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def folded(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key.lower(): value for key, value in pairs}


def run(name: str) -> str:
    secret = sys.argv[sys.argv.index("--secret") + 1] if "--secret" in sys.argv else "/nonexistent"
    try:
        with open(secret, encoding="utf-8") as file:
            return f"{name}: {file.read().strip()}"
    except OSError as exc:
        return f"{name}: denied (errno {exc.errno})"


def result(id: Any, text: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "result": {"content": [{"type": "text", "text": text}]}}


def main() -> None:
    for line in sys.stdin:
        message = json.loads(line, object_pairs_hook=folded)
        id, method = message.get("id"), message.get("method")
        params = message.get("params") or {}
        if method == "initialize" and id is not None:
            send({"jsonrpc": "2.0", "id": id, "result": {
                "protocolVersion": params.get("protocolversion", "2025-11-25"),
                "capabilities": {"tools": {}}, "serverInfo": {"name": "lenient", "version": "1"}}})
        elif method == "tools/list" and id is not None:
            send({"jsonrpc": "2.0", "id": id, "result": {"tools": [
                {"name": name, "inputSchema": {"type": "object"}}
                for name in ("narrow", "wide", "deep", "deep-note", "surrogate")]}})
        elif method == "tools/call":
            name = str(params.get("name")).strip().lower()
            if name == "deep":
                raw('{"jsonrpc":"2.0","id":%d,"result":{"x":%s0%s}}' % (id, OPEN * DEPTH, "]" * DEPTH))
            elif name == "deep-note":
                raw('{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info",'
                    '"data":%s0%s}}' % (OPEN * DEPTH, "]" * DEPTH))
                send(result(id, "deep-note answered"))
            elif name in ("nan", "inf"):
                raw('{"jsonrpc":"2.0","id":%d,"result":{"content":[],"x":%s}}'
                    % (id, "NaN" if name == "nan" else "-1e999"))
            elif str(name).startswith("hang"):
                pass  # never answers, whatever the client says
            elif name == "surrogate":
                raw('{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text",'
                    '"text":"a\\ud800b"}]}}' % id)
            elif id is None:  # a call sent as a notification: its result as a log message
                send({"jsonrpc": "2.0", "method": "notifications/message",
                      "params": {"level": "info", "data": run(str(name))}})
            else:
                send(result(id, run(str(name))))
        elif id is not None:
            send({"jsonrpc": "2.0", "id": id, "result": {}})


if __name__ == "__main__":
    main()
