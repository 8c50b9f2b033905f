"""MCP's stdio transport as the gateway reads it: one JSON-RPC message per line.

Both sides' bytes are untrusted here (a confined server's most of all): a line is read
with a hard size limit, decoded with :func:`json.loads` only (never evaluated), and a
message is classified by its shape before anything looks inside it. See
https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#stdio
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

if TYPE_CHECKING:
    from typing import TypeGuard

#: The largest message either side may send (bytes of one line). A longer one ends the
#: connection it came on: the rest of that line cannot be told from a next message.
MAX_MESSAGE = 16 * 1024 * 1024
#: The deepest nesting of arrays and objects a message may have. A deeper one is refused
#: as it is read: :func:`json.loads` raises RecursionError on one deep enough, and one
#: just under its limit raises it when re-encoded in a thread with a deeper stack. Either
#: ended the thread that read a server or answered the client, and every call waiting on
#: it waited for ever. (MCP's messages, JSON Schemas included, nest a few levels.)
MAX_DEPTH = 100
#: What :func:`decode` reads as "not JSON" beside ValueError (a name, for the tests).
_RECURSION: tuple[type[BaseException], ...] = (RecursionError,)

#: JSON-RPC error codes (https://www.jsonrpc.org/specification#error_object).
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
#: The implementation-defined range: the gateway's own refusals and failures.
TOOL_REFUSED = -32001
SERVER_FAILED = -32002

Id = Union[int, str]


class TooLarge(Exception):
    """A line longer than :data:`MAX_MESSAGE`."""


def lines(fd: int, limit: int = MAX_MESSAGE) -> Iterator[bytes]:
    """The lines read from ``fd`` (without the newline), each at most ``limit`` bytes,
    until end of file. A longer line raises :class:`TooLarge` (nothing more is read)."""
    pending = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if not chunk:
            if pending.strip():
                yield bytes(pending)
            return
        pending += chunk
        while True:
            end = pending.find(b"\n")
            if end < 0:
                break
            line = bytes(pending[:end])
            del pending[:end + 1]
            if line.strip():
                yield line
        if len(pending) > limit:
            raise TooLarge(f"a message longer than {limit} bytes")


#: Bytes of a line for each container it may open (see :func:`decode`).
MAX_CONTAINER_SHARE = 8


def decode(line: bytes) -> Any:
    """The JSON value of one line (``ValueError`` if it is not JSON, or nested deeper than
    :data:`MAX_DEPTH`). ``NaN``, ``Infinity`` and numbers too large for a float (``1e999``)
    are not JSON (RFC 8259): :func:`json.loads` takes them, :func:`encode` would write
    them back as ``NaN`` or ``Infinity``, and a strict client's parser drops that line."""
    # An empty object is 2 bytes of JSON and about 64 of the gateway's memory once read
    # (a 16 MiB line of them, half a gigabyte): a line may open a container for at most one
    # byte in MAX_CONTAINER_SHARE (an overcount: brackets inside strings count too).
    if (line.count(b"{") + line.count(b"[")) * MAX_CONTAINER_SHARE > len(line) + 4096:
        raise ValueError(f"more than one container for every {MAX_CONTAINER_SHARE} bytes")
    try:
        value = json.loads(line, parse_float=_finite, parse_constant=_not_a_number)
    except _RECURSION:
        raise ValueError(f"nested more than {MAX_DEPTH} deep") from None
    containers = [(value, 1)] if type(value) in (dict, list) else []  # json.loads' types
    while containers:
        item, depth = containers.pop()
        for child in item.values() if type(item) is dict else item:
            if type(child) is dict or type(child) is list:
                if depth >= MAX_DEPTH:
                    raise ValueError(f"nested more than {MAX_DEPTH} deep")
                containers.append((child, depth + 1))
    return value


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("a number too large for a float")
    return value


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def encode(message: dict[str, Any]) -> bytes:
    """One message as a line, in ASCII: JSON escapes every newline and every other
    character, a lone surrogate (valid JSON text, which UTF-8 cannot encode) included."""
    return json.dumps(message, separators=(",", ":")).encode("ascii") + b"\n"


def valid_id(value: object) -> TypeGuard[Id]:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


#: The members of a JSON-RPC message (https://www.jsonrpc.org/specification#request_object).
MEMBERS = frozenset({"jsonrpc", "id", "method", "params", "result", "error"})


def twin(message: object) -> Optional[str]:
    """A key of ``message`` that is none of JSON-RPC's :data:`MEMBERS` but reads as one
    regardless of case (``ID``, ``Method``, ``re\u017fult``), or None. A peer decoding keys
    that way (Go's encoding/json: the last one wins) reads another message than this module
    does: ``{"method": "notifications/message", "ID": 7, "METHOD": null, "result": ...}``
    is a notification here, and there the response to its request 7."""
    if not isinstance(message, dict):
        return None
    return next((key for key in message if key not in MEMBERS and key.casefold() in MEMBERS), None)


def kind(message: object) -> str:
    """``request``, ``notification``, ``response`` or ``invalid``, by shape alone; a message
    holding a :func:`twin` is ``invalid``: it is another message to a case-blind reader."""
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or twin(message) is not None:
        return "invalid"
    method = message.get("method")
    if method is not None:
        if not isinstance(method, str) or not isinstance(message.get("params", {}), dict):
            return "invalid"
        if "id" not in message:
            return "notification"
        return "request" if valid_id(message["id"]) else "invalid"
    if valid_id(message.get("id")) and (("result" in message) != ("error" in message)):
        if "error" in message and not _error_object(message["error"]):
            return "invalid"
        return "response"
    return "invalid"


def _error_object(error: object) -> bool:
    return (isinstance(error, dict) and isinstance(error.get("code"), int)
            and not isinstance(error.get("code"), bool) and isinstance(error.get("message"), str))


def request(id: Id, method: str, params: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def notification(method: str, params: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    return message


def error(id: Optional[Id], code: int, text: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": text}}


def answer(id: Id, response: dict[str, Any]) -> dict[str, Any]:
    """``response`` (a checked :func:`kind` ``response``) under the client's ``id``; only
    its ``result`` or ``error`` is kept, nothing else the server added at the top level."""
    if "error" in response:
        return {"jsonrpc": "2.0", "id": id, "error": response["error"]}
    return {"jsonrpc": "2.0", "id": id, "result": response["result"]}


def relayed(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` (a checked :func:`kind` ``notification``) as the gateway passes it on:
    its ``method`` and ``params`` only, nothing else its sender added at the top level."""
    return notification(message["method"], message.get("params"))
