"""A hostile tool against the credential routes and the MCP gateway: each attack that
got through, as a test on the real route server (TLS to a real loopback upstream) or the
real gateway (confined instances on the real kernel), with its positive control.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import test_credential_attacks as attacks
from test_credential_attacks import ALLOWED, SECRET, _request, ask, ask_half_closed
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
# Credential routes: bodies held at once


def _hold_a_body(server: Any, placeholder: str, size: int) -> socket.socket:
    """A connection that has sent all but the last byte of a ``size``-byte body, once the
    route holds it (its request is in the route, not yet at the upstream)."""
    sock = socket.create_connection(server.address, timeout=30)
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
def test_positive_control_unbounded_the_bodies_are_held_together(
        route: Any, upstream: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(H, "HELD_LIMIT", 1 << 40)
    server, placeholder = route()
    first = _hold_a_body(server, placeholder, 2 << 20)
    status, response = ask_half_closed(server, _body_request(placeholder, 2 << 20))
    assert status == 200, response[:300]
    assert _finish(first) == 200
