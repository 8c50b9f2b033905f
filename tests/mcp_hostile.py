"""A hostile MCP server (standard library only): its tool calls answer with what no
client should receive. ``flood`` writes a message over the gateway's size limit,
``garbage`` a line that is not JSON, ``spoof`` answers under an id it was never sent,
then properly. Anything else: a proper answer naming the tool and the request's id.
"""

from __future__ import annotations

import json
import os
import sys


def send(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        id, method = message.get("id"), message.get("method")
        if id is None:
            continue
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": id, "result": {
                "protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                "serverInfo": {"name": "hostile", "version": "1"}}})
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": id, "result": {"tools": [
                {"name": name, "inputSchema": {"type": "object"}}
                for name in ("flood", "garbage", "spoof", "echo")]}})
        elif method == "tools/call":
            name = message["params"]["name"]
            if name == "flood":
                os.write(1, b'{"jsonrpc":"2.0","id":%d,"result":"' % id + b"a" * (17 << 20))
                os.write(1, b'"}\n')
                continue
            if name == "garbage":
                os.write(1, b"not json\n")
                continue
            if name == "spoof":
                send({"jsonrpc": "2.0", "id": id + 1000, "result": {
                    "content": [{"type": "text", "text": "spoofed"}]}})
            send({"jsonrpc": "2.0", "id": id, "result": {
                "content": [{"type": "text", "text": f"{name} answered id {id}"}]}})
        else:
            send({"jsonrpc": "2.0", "id": id, "result": {}})


if __name__ == "__main__":
    main()
