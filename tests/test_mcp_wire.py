"""The MCP gateway's reading of untrusted bytes, and the registry key choosing isolation.

Pure: no process is started, so the outcome does not depend on the user.
"""

from __future__ import annotations

import os
import threading

import pytest

from sandlock.errors import PolicyError
from sandlock.integrations.mcp import wire
from sandlock.policy.model import loads_policy

pytestmark = pytest.mark.any_user


def _lines(data: bytes, limit: int) -> list[bytes]:
    read, write = os.pipe()

    def feed() -> None:
        os.write(write, data)
        os.close(write)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        return list(wire.lines(read, limit))
    finally:
        writer.join()
        os.close(read)


def test_lines_are_split_and_bounded() -> None:
    assert _lines(b'{"a":1}\n\n  \n{"b":2}', 100) == [b'{"a":1}', b'{"b":2}']
    assert _lines(b"x" * 100 + b"\n", 100) == [b"x" * 100]
    with pytest.raises(wire.TooLarge):
        _lines(b"x" * 300, 100)  # never ends: refused once past the limit, not buffered on


@pytest.mark.parametrize(("message", "kind"), [
    ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {}}, "request"),
    ({"jsonrpc": "2.0", "method": "notifications/progress"}, "notification"),
    ({"jsonrpc": "2.0", "id": "a", "result": {}}, "response"),
    ({"jsonrpc": "2.0", "id": 1, "error": {"code": -1, "message": "no"}}, "response"),
    ({"jsonrpc": "2.0", "id": 1, "error": {"code": "x", "message": "no"}}, "invalid"),
    ({"jsonrpc": "2.0", "id": 1, "result": {}, "error": {"code": 1, "message": ""}}, "invalid"),
    ({"jsonrpc": "2.0", "id": True, "method": "x"}, "invalid"),
    ({"jsonrpc": "2.0", "id": [1], "result": {}}, "invalid"),
    ({"jsonrpc": "2.0", "method": "x", "params": "not an object"}, "invalid"),
    ({"jsonrpc": "1.0", "id": 1, "method": "x"}, "invalid"),
    ([{"jsonrpc": "2.0", "id": 1, "method": "x"}], "invalid"),
])
def test_messages_are_classified_by_shape(message: object, kind: str) -> None:
    assert wire.kind(message) == kind


def test_answer_keeps_only_the_result_under_the_clients_id() -> None:
    response = {"jsonrpc": "2.0", "id": 7, "result": {"ok": 1}, "extra": "dropped"}
    assert wire.answer("client-1", response) == {"jsonrpc": "2.0", "id": "client-1", "result": {"ok": 1}}
    assert wire.encode({"a": "x\ny"}).count(b"\n") == 1  # one line, whatever the text holds


def test_isolation_is_a_policy_key_with_two_values() -> None:
    assert loads_policy("version = 1\n").mcp_isolation == "call"
    assert loads_policy('version = 1\n[mcp]\nisolation = "tool"\n').mcp_isolation == "tool"
    with pytest.raises(PolicyError, match=r'mcp\.isolation.*expected "call" or "tool", got .warm.'):
        loads_policy('version = 1\n[mcp]\nisolation = "warm"\n')
