"""A hostile tool against the credential routes and the MCP gateway: each attack that
got through, as a test on the real route server (TLS to a real loopback upstream) or the
real gateway (confined instances on the real kernel), with its positive control.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from test_credential_attacks import (  # noqa: F401 - fixtures used by name
    ALLOWED,
    SECRET,
    _request,
    ask,
    ask_half_closed,
    certificate,
    count_connections,
    other,
    route,
    upstream,
)
from test_credentials import Server

from sandlock.net import http as H
from sandlock.policy import credentials as C

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
