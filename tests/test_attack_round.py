"""A hostile tool against the credential routes and the MCP gateway: each attack that
got through, as a test on the real route server (TLS to a real loopback upstream) or the
real gateway (confined instances on the real kernel), with its positive control.
"""

from __future__ import annotations

import io
import json
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import test_credential_attacks as attacks
from test_credential_attacks import ALLOWED, SECRET, _request, ask, ask_half_closed, dial
from test_credentials import Server

from sandlock.net import http as H
from sandlock.policy import credentials as C

#: The route, its TLS upstream and their certificate, as tests/test_credential_attacks.py
#: stands them up.
certificate, other, upstream, route = (attacks.certificate, attacks.other, attacks.upstream,
                                       attacks.route)

# ----------------------------------------------------------------------------
# Credential routes: a denied path with a trailing slash


@pytest.mark.any_user
def test_a_denied_path_with_a_trailing_slash_never_gets_the_secret(
        route: Any, upstream: Server) -> None:
    """``deny = ["/v1/admin"]``: ``/v1/admin/`` is the same handler on most routers
    (Express, Rails, Spring): it is denied too, and so is ``/v1/admin`` by ``"/v1/admin/"``."""
    server, placeholder = route(deny=["/v1/chat/admin", "/v1/keys/"])
    for target in ("/api/v1/chat/admin/", "/api/v1/chat/ADMIN/", "/api/v1/keys"):
        status, response = ask(server, _request(target, "", placeholder))
        assert status == 403 and "denied by credentials.api.deny" in response, response
    assert upstream.seen == []


@pytest.mark.any_user
def test_positive_control_the_slash_only_rule_lets_them_through(
        route: Any, upstream: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """With deny rules matched on the path as written, both reach the upstream with the
    secret; the rules themselves still deny the paths as written."""
    monkeypatch.setattr(C, "_slashless", lambda path: path)
    server, placeholder = route(deny=["/v1/chat/admin", "/v1/keys/"])
    for target in ("/api/v1/chat/admin/", "/api/v1/keys"):
        status, response = ask(server, _request(target, "", placeholder))
        assert status == 200, response
    assert [s["headers"]["Authorization"] for s in upstream.seen] == [f"Bearer {SECRET}"] * 2
    for target in ("/api/v1/chat/admin", "/api/v1/keys/"):
        assert ask(server, _request(target, "", placeholder))[0] == 403


# ----------------------------------------------------------------------------
# Credential routes: a secret h11 refuses to send


EDGE_SECRET = "sk-edge-" + "7" * 16 + " "


def _edge_route(upstream: Server, certificate: tuple[Path, Path]) -> tuple[Any, str]:
    from sandlock.net import routes as R

    server = R.RouteServer([attacks._credential(upstream, certificate[0])],
                           [(attacks.HOST, "127.0.0.1")], lambda _message: None)
    placeholder = server.session({"api": EDGE_SECRET}).placeholders["api"]
    server.start()
    return server, placeholder


@pytest.mark.any_user
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_secret_that_ends_with_a_space_never_comes_back_in_the_refusal(
        upstream: Server, certificate: tuple[Path, Path]) -> None:
    """h11 refuses a header value that ends with a space as it builds the request, and
    its message quotes the value: the route's thread died with ``Illegal header value
    b'Bearer <secret> '`` in a traceback on the launcher's stderr (which an agent reads
    back with the tool's output), and the tool got no answer. Now it is a 400 that quotes
    nothing, and such a secret is refused when a run starts."""
    server, placeholder = _edge_route(upstream, certificate)
    try:
        status, response = ask(server, _request("/api/v1/x", "", placeholder))
    finally:
        server.stop()
    assert status == 400 and "sandlock route: " in response, response
    assert EDGE_SECRET.strip() not in response
    item = attacks._credential(upstream, certificate[0])
    with pytest.raises(C.CredentialError, match="ends with a space or tab"):
        C.secrets_for([item], [], {}, {"api": EDGE_SECRET})
    assert C.secrets_for([item], [], {}, {"api": EDGE_SECRET.strip()})  # control


@pytest.mark.any_user
def test_positive_control_h11_quotes_the_value_it_refuses() -> None:
    """What the route used to put in its answer: h11's own message, with the secret."""
    import h11

    with pytest.raises(h11.LocalProtocolError) as refused:
        h11.Connection(h11.CLIENT).send(h11.Request(method="GET", target="/", headers=[
            ("Host", "a"), ("Authorization", f"Bearer {EDGE_SECRET}")]))
    assert EDGE_SECRET in str(refused.value)


# ----------------------------------------------------------------------------
# Credential routes: bodies held at once


def _hold_a_body(server: Any, placeholder: str, size: int) -> socket.socket:
    """A connection that has sent all but the last byte of a ``size``-byte body, once the
    route holds it (its request is in the route, not yet at the upstream)."""
    sock = dial(server, 30)
    head = ALLOWED.format(placeholder=placeholder) + f"Content-Length: {size}\r\n\r\n"
    sock.sendall(head.encode() + b"a" * (size - 1))
    held = getattr(H, "_HELD", None)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (held is None or held.count < size - 1):
        time.sleep(0.05)
        if held is None and time.monotonic() > deadline - 19:
            break
    return sock


def _finish(sock: socket.socket) -> int:
    sock.sendall(b"a")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return int(data.split(b" ", 2)[1])


def _body_request(placeholder: str, size: int) -> bytes:
    return (ALLOWED.format(placeholder=placeholder) + f"Content-Length: {size}\r\n\r\n"
            ).encode() + b"b" * size


@pytest.mark.any_user
def test_request_bodies_held_at_once_are_bounded(
        route: Any, upstream: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each body is held whole before the upstream is connected (up to 1 GiB), one per
    connection (up to 256): without a bound on them together a tool fills the launcher's
    disk (or memory: /tmp is often a tmpfs). Past the bound a request is a 503 from the
    route, and its upstream never sees it; a body held is counted until its request ends."""
    monkeypatch.setattr(H, "HELD_LIMIT", 3 << 20, raising=False)
    server, placeholder = route()
    first = _hold_a_body(server, placeholder, 2 << 20)
    status, response = ask_half_closed(server, _body_request(placeholder, 2 << 20))
    assert status == 503 and "sandlock route: " in response, response[:300]
    assert upstream.seen == []
    assert _finish(first) == 200
    status, response = ask_half_closed(server, _body_request(placeholder, 2 << 20))
    assert status == 200, response[:300]  # the first one's bytes were given back
    assert [len(s["body"]) for s in upstream.seen] == [2 << 20] * 2


@pytest.mark.any_user
def test_a_request_refused_while_its_body_is_sent_still_gets_its_answer(
        route: Any, upstream: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route refuses a request before its body is all in (here: past the bound on bodies
    held). Closed with the body's bytes unread, the connection was reset: the tool's send
    failed or its answer was lost (ECONNRESET), instead of its reading why. The route now
    half-closes after its answer and drains what the tool still sends, for a moment."""
    monkeypatch.setattr(H, "HELD_LIMIT", 1 << 20)
    server, placeholder = route()
    status, response = ask_half_closed(server, _body_request(placeholder, 8 << 20))
    assert status == 503 and "sandlock route: " in response, response[:300]
    assert upstream.seen == []


@pytest.mark.any_user
def test_positive_control_unbounded_the_bodies_are_held_together(
        route: Any, upstream: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(H, "HELD_LIMIT", 1 << 40)
    server, placeholder = route()
    first = _hold_a_body(server, placeholder, 2 << 20)
    status, response = ask_half_closed(server, _body_request(placeholder, 2 << 20))
    assert status == 200, response[:300]
    assert _finish(first) == 200


# ----------------------------------------------------------------------------
# Credential routes: connections that sent a head and trickle their body


def _trickling(server: Any, placeholder: str, count: int) -> list[socket.socket]:
    """``count`` connections that sent an allowed request's head with their placeholder
    and one byte of a 100-byte body, once the route has read their heads."""
    held = []
    for _ in range(count):
        sock = dial(server, 30)
        sock.sendall((ALLOWED.format(placeholder=placeholder)
                      + "Content-Length: 100\r\n\r\nx").encode())
        held.append(sock)
    time.sleep(1.0)
    return held


def _status(server: Any, request: bytes) -> int:
    """The route's answer's status; 0 when it closed the connection without one."""
    try:
        return ask_half_closed(server, request)[0]
    except OSError:
        return 0


@pytest.mark.any_user
def test_a_request_still_sending_its_body_is_let_go_before_another_is_refused(
        route: Any, upstream: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the API one route server serves every call of a Sandbox. A call that fills
    its connections with requests whose heads are in and whose bodies never end (a byte
    every 29 s keeps each one) kept every other call's requests out: only a connection
    without its head was let go. A request counts as silent until its body is in."""
    from sandlock.net import listener

    monkeypatch.setattr(listener, "MAX_CLIENTS", 8)
    server, placeholder = route()
    hogs = _trickling(server, placeholder, 8)
    try:
        status = _status(server, _body_request(placeholder, 5))
    finally:
        for sock in hogs:
            sock.close()
    assert status == 200
    assert [s["body"] for s in upstream.seen] == ["bbbbb"]


@pytest.mark.any_user
def test_positive_control_a_request_in_is_not_let_go_for_another(
        route: Any, upstream: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a connection counted as heard once its head is in, the same victim is refused."""
    from sandlock.net import listener

    monkeypatch.setattr(listener, "MAX_CLIENTS", 8)
    server, placeholder = route()
    read_request = H.read_request

    def heard_at_its_head(sock: socket.socket) -> H.Request:
        request = read_request(sock)
        server._heard(sock)
        return request

    monkeypatch.setattr(H, "read_request", heard_at_its_head)
    hogs = _trickling(server, placeholder, 8)
    try:
        status = _status(server, _body_request(placeholder, 5))
    finally:
        for sock in hogs:
            sock.close()
    assert status == 0 and upstream.seen == []


# ----------------------------------------------------------------------------
# The MCP gateway, driven in this process with raw JSON lines (the SDK's client sends
# none of these shapes); its instances are the real confined processes.

LENIENT = Path(__file__).resolve().parent / "mcp_lenient.py"
MCP_SECRET = "mcp-s3cret-" + "x" * 8
#: Seconds an answer may take (a confined instance starts, answers, stops).
ANSWER = 60.0


def _policy(*reads: str, isolation: str = "call") -> str:
    grants = [sys.prefix, str(LENIENT.parent), *reads]
    return (f'version = 1\nextends = ["python"]\n[filesystem]\nread = {json.dumps(grants)}\n'
            f'[mcp]\nisolation = "{isolation}"\n')


def _strict(line: bytes) -> dict[str, Any]:
    """A line the gateway wrote, read as strict JSON (RFC 8259), as a client's parser does."""
    def refuse(text: str) -> float:
        raise AssertionError(f"the gateway wrote {text} (not JSON): {line[:200]!r}")

    def finite(text: str) -> float:
        return float(text) if abs(float(text)) != float("inf") else refuse(text)

    message: dict[str, Any] = json.loads(line, parse_constant=refuse, parse_float=finite)
    return message


class Driver:
    """A :class:`Gateway` serving raw lines written here; its answers read back here."""

    def __init__(self, registry: Path, secret: Path) -> None:
        self._start(registry, [sys.executable, str(LENIENT), "--secret", str(secret)], "attack")

    def _start(self, registry: Path, server: list[str], client: str) -> None:
        """The gateway serving ``server`` for ``registry``, initialized as ``client``."""
        from sandlock.api.registry import Registry
        from sandlock.integrations.mcp.gateway import Gateway

        self.registry = Registry(registry)
        into, self._write = os.pipe()
        self._read, out = os.pipe()
        self.err = io.StringIO()
        self.gateway = Gateway(self.registry, server, stdout=os.fdopen(out, "wb"),
                               stderr=self.err)
        self._thread = threading.Thread(target=self.gateway.serve, args=(into,), daemon=True)
        self._thread.start()
        self._pending = b""
        self.notes: list[dict[str, Any]] = []
        self.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": client, "version": "1"}}})
        assert "result" in self.answer(0), self.err.getvalue()
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def send(self, message: Any) -> None:
        self.line(json.dumps(message))

    def line(self, text: str) -> None:
        os.write(self._write, text.encode() + b"\n")

    def answer(self, id: Any, timeout: float = ANSWER) -> dict[str, Any]:
        """The response to ``id`` (notifications before it kept in ``notes``); an
        AssertionError when none comes in time."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = _strict(line)
                if "id" not in message:
                    self.notes.append(message)
                elif message["id"] == id:
                    return dict(message)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise AssertionError(f"no answer to {id!r} in {timeout:g} s")
            self._pending += os.read(self._read, 1 << 20)

    def call(self, id: int, params: dict[str, Any], timeout: float = ANSWER) -> dict[str, Any]:
        self.send({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})
        return self.answer(id, timeout)

    def close(self) -> None:
        os.close(self._write)
        self._thread.join(timeout=30)
        self.registry.close()
        os.close(self._read)


@pytest.fixture(scope="module")
def mcp_place(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A registry whose ``listing``, ``wide`` and ``default`` entries may read the secret,
    ``narrow`` may not; ``deep``, ``deep-note`` and ``surrogate`` keep one warm instance each."""
    root = tmp_path_factory.mktemp("mcp-attack")
    registry, secret = root / "registry", root / "secret" / "key.txt"
    for directory in (registry, secret.parent):
        directory.mkdir()
        os.chmod(directory, 0o755)
    secret.write_text(MCP_SECRET + "\n")
    os.chmod(secret, 0o644)
    for name, reads in (("listing", [str(secret.parent)]), ("wide", [str(secret.parent)]),
                        ("default", [str(secret.parent)]),
                        ("narrow", []), ("hang", [])):
        (registry / f"{name}.toml").write_text(_policy(*reads))
    for name in ("deep", "deep-note", "surrogate", "nan", "inf", "hang-warm"):
        (registry / f"{name}.toml").write_text(_policy(isolation="tool"))
    return {"registry": registry, "secret": secret}


@pytest.fixture
def mcp(mcp_place: dict[str, Path]) -> Iterator[Driver]:
    driver = Driver(mcp_place["registry"], mcp_place["secret"])
    yield driver
    driver.close()


def _text(response: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in response["result"]["content"])


@pytest.mark.parametrize("tool", ["deep", "deep-note", "surrogate", "nan", "inf"])
def test_a_hostile_server_line_never_leaves_a_call_unanswered(mcp: Driver, tool: str) -> None:
    """A message nested 50000 deep (json.loads: RecursionError) or holding a lone surrogate
    (valid JSON; UTF-8 cannot encode it) killed the thread that read the instance or the
    one that answered the client: the call, and every later call sent to that warm
    instance, waited for ever. ``NaN`` and ``-1e999`` (no JSON, read by json.loads) were
    written back as ``NaN`` and ``-Infinity``, which a strict client's parser refuses.
    Now the first and the last are refused as not JSON (the instance is stopped and
    replaced), the surrogate relayed as the JSON escape it came as."""
    first = mcp.call(1, {"name": tool, "arguments": {}}, timeout=30)
    if tool == "surrogate":
        assert _text(first) == "a\ud800b"
    else:
        assert first["error"]["code"] == -32002 and "not JSON" in first["error"]["message"]
    again = mcp.call(2, {"name": tool, "arguments": {}}, timeout=30)  # the same entry's instance
    assert ("result" in again) == (tool == "surrogate"), again
    assert _text(mcp.call(3, {"name": "narrow", "arguments": {}})).startswith("narrow: denied")
    assert "Traceback" not in mcp.err.getvalue()


@pytest.mark.any_user
def test_a_message_deeper_than_the_bound_is_not_json() -> None:
    """Past the bound, not only past json.loads' recursion limit: a message 980 deep is
    decoded, and re-encoding it in a thread a few dozen frames deep raises RecursionError."""
    from sandlock.integrations.mcp import wire

    def nested(depth: int) -> bytes:
        return b'{"a":' * (depth - 1) + b"[]" + b"}" * (depth - 1)

    with pytest.raises(ValueError, match="nested more than"):
        wire.decode(nested(wire.MAX_DEPTH + 1))
    assert wire.decode(nested(wire.MAX_DEPTH))  # control: at the bound
    assert wire.decode(b"3") == 3 and wire.decode(b"[]") == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_positive_control_without_the_depth_bound_the_call_waits(
        mcp: Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock.integrations.mcp import wire

    monkeypatch.setattr(wire, "MAX_DEPTH", 1 << 30)
    monkeypatch.setattr(wire, "_RECURSION", ())  # a RecursionError no longer read as "not JSON"
    with pytest.raises(AssertionError, match="no answer"):
        mcp.call(1, {"name": "deep-note", "arguments": {}}, timeout=5)


def test_a_case_variant_name_key_is_refused(mcp: Driver) -> None:
    """``{"name": "wide", "Name": "narrow"}``: the gateway chose the policy of ``wide``; a
    server decoding with Go's encoding/json (case-insensitive keys, the last one wins)
    runs ``narrow`` under it. Refused, naming both keys."""
    response = mcp.call(1, {"name": "wide", "Name": "narrow", "arguments": {}})
    assert response["error"]["code"] == -32602, response
    assert "'Name'" in response["error"]["message"] and "'name'" in response["error"]["message"]
    assert _text(mcp.call(2, {"name": "narrow", "arguments": {}})) == "narrow: denied (errno 13)"
    assert _text(mcp.call(3, {"name": "wide", "arguments": {}})) == f"wide: {MCP_SECRET}"


def test_positive_control_without_the_key_check_narrow_runs_under_wide(
        mcp: Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock.integrations.mcp import gateway

    monkeypatch.setattr(gateway, "_ambiguous", lambda params: None)
    response = mcp.call(1, {"name": "wide", "Name": "narrow", "arguments": {}})
    assert _text(response) == f"narrow: {MCP_SECRET}"


@pytest.mark.parametrize("name", ["NARROW", " narrow", "narrow\t", "\uff4earrow"])
def test_a_look_alike_of_a_registered_name_is_refused(mcp: Driver, name: str) -> None:
    """``NARROW`` has no entry: it ran under ``default``, and a server that reads tool
    names regardless of case, spaces or Unicode form ran ``narrow`` there, under a policy
    wider than narrow's. A name that reads as a registered one is refused, naming it."""
    response = mcp.call(1, {"name": name, "arguments": {}})
    assert response["error"]["code"] == -32001, response
    assert "'narrow'" in response["error"]["message"]
    assert _text(mcp.call(2, {"name": "other", "arguments": {}})) == f"other: {MCP_SECRET}"


def test_positive_control_a_look_alike_runs_the_tool_under_default(
        mcp: Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock.integrations.mcp import gateway

    monkeypatch.setattr(gateway, "_folded", lambda name: name)
    assert _text(mcp.call(1, {"name": "NARROW", "arguments": {}})) == f"narrow: {MCP_SECRET}"


def test_a_tool_call_sent_as_a_notification_never_reaches_a_server(mcp: Driver) -> None:
    """A notification is no tool call to the gateway: it went to the listing instance,
    where a server that dispatches on the method alone ran the tool under the listing
    policy. Only MCP's own notifications (``notifications/...``) are relayed."""
    mcp.send({"jsonrpc": "2.0", "method": "tools/call",
              "params": {"name": "narrow", "arguments": {}}})
    mcp.send({"jsonrpc": "2.0", "id": 9, "method": "ping"})
    assert "result" in mcp.answer(9)  # after the notification, had it been relayed
    assert not any(MCP_SECRET in json.dumps(note) for note in mcp.notes), mcp.notes


def test_positive_control_relayed_the_notification_runs_the_tool(
        mcp: Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock.integrations.mcp import gateway

    monkeypatch.setattr(gateway, "NOTIFICATION", "")
    mcp.send({"jsonrpc": "2.0", "method": "tools/call",
              "params": {"name": "narrow", "arguments": {}}})
    mcp.send({"jsonrpc": "2.0", "id": 9, "method": "ping"})
    mcp.answer(9)
    assert [note["params"]["data"] for note in mcp.notes] == [f"narrow: {MCP_SECRET}"]


def _hang_and_cancel(driver: Driver, ids: range, tool: str) -> None:
    """Calls of ``tool`` (``hang``: an instance each; ``hang-warm``: one warm instance)
    under ``ids``, each cancelled by the client once it runs."""
    for id in ids:
        driver.send({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                     "params": {"name": tool, "arguments": {}}})
    def running(id: int) -> bool:
        """Its tools/call is sent to the server (after the ``initialize`` a new instance
        gets, id 1 there): cancelled earlier, it would end as the server starts."""
        pending = driver.gateway._inflight.get(id)
        return pending is not None and pending.target is not None and pending.target[1] >= 2

    deadline = time.monotonic() + ANSWER
    while time.monotonic() < deadline and not all(running(id) for id in ids):
        time.sleep(0.05)
    for id in ids:
        driver.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": id, "reason": "took too long"}})


def test_a_cancelled_call_gives_its_slot_back(
        mcp_place: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that never answers a call kept one of the gateway's MAX_CALLS slots after
    the client cancelled the call (without a policy timeout, for ever): MAX_CALLS such
    calls and no tool call ran again. A cancelled call is given up (its own instance
    stopped, a warm one left serving)."""
    from sandlock.integrations.mcp import gateway

    monkeypatch.setattr(gateway, "MAX_CALLS", 2)
    driver = Driver(mcp_place["registry"], mcp_place["secret"])
    try:
        for first, tool in ((1, "hang-warm"), (4, "hang")):
            _hang_and_cancel(driver, range(first, first + 2), tool)
            answer = driver.call(first + 2, {"name": "narrow", "arguments": {}}, timeout=30)
            assert _text(answer) == "narrow: denied (errno 13)", tool
    finally:
        driver.close()


def test_positive_control_a_cancelled_call_left_running_keeps_its_slot(
        mcp_place: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock.integrations.mcp import gateway

    monkeypatch.setattr(gateway, "MAX_CALLS", 2)
    monkeypatch.setattr(gateway.Instance, "cancel", lambda self, id: None, raising=False)
    driver = Driver(mcp_place["registry"], mcp_place["secret"])
    try:
        _hang_and_cancel(driver, range(1, 3), "hang-warm")
        with pytest.raises(AssertionError, match="no answer"):
            driver.call(3, {"name": "narrow", "arguments": {}}, timeout=3)
        for pending in list(driver.gateway._inflight.values()):
            if pending.target is not None:
                pending.target[0].process.kill()  # (the test's own clean-up)
    finally:
        driver.close()


@pytest.mark.any_user
def test_a_message_dense_with_containers_is_not_json() -> None:
    """A line of empty objects: 2 bytes each, about 64 of the gateway's memory each once
    read (1 MiB of them took 24 MiB; each of the gateway's readers holds a 16 MiB line)."""
    from sandlock.integrations.mcp import wire

    dense = b"[" + b",".join([b"{} "] * 500_000) + b"]"  # 4 bytes each
    with pytest.raises(ValueError, match="container for every"):
        wire.decode(dense)
    text = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"content": [
        {"type": "text", "text": "int main() { return f({1, 2}[0]); }\n" * 20_000}]}})
    assert wire.decode(text.encode())["id"] == 1  # control: code full of brackets, in a string
