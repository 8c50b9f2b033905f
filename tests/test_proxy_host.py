"""The host allowlist's HTTP proxy forwards one request per connection, for the URL's site.

An allowed address may serve many sites, chosen by the ``Host`` header (a CDN, shared
hosting, an ingress). The proxy checks the host of the absolute URL, so a ``Host``
naming another site, or a second request pipelined behind the checked one, would reach
a site the allowlist does not name. Each attack here goes through the real proxy to a
raw loopback sink that records every byte it receives and answers every request head
it reads (as a keep-alive server would, so a second request that got through would be
recorded and answered too): the refused requests must leave nothing in it, the allowed
one must arrive (the positive control), and with the guard switched off in this
process the same attack does arrive.
"""

from __future__ import annotations

import base64
import socket
import textwrap
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import PYTHON, require_abi, run_confined, write_policy

from sandlock.net import proxy as P
from sandlock.policy.netrules import NetRules, parse_pins, parse_rules

SITE = "allowed.test"
OTHER = "not-allowed.example"
#: What the sink answers to each request head it reads.
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nsink\n"


class Sink:
    """A raw TCP server on 127.0.0.1: records the bytes of each connection (once it ends)
    and answers each request head it has read with :data:`ANSWER`, never closing first."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open = 0
        self.connections: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True, name="sink").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._open += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data, answered = b"", 0
        try:
            conn.settimeout(30)
            while chunk := conn.recv(65536):
                data += chunk
                while data.count(b"\r\n\r\n") > answered:
                    answered += 1
                    conn.sendall(ANSWER)
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                self.connections.append(data)
                self._open -= 1

    def received(self) -> bytes:
        """Everything every connection sent, once each has ended (10 s at most)."""
        deadline = time.monotonic() + 10
        while self._open and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            return b"".join(self.connections)

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def sink() -> Iterator[Sink]:
    server = Sink()
    yield server
    server.close()


def rules(port: int) -> NetRules:
    return NetRules(parse_rules([f"{SITE}:{port}"], "allow"), (),
                    parse_pins({SITE: "127.0.0.1"}))


def request(port: int, path: str, host: str, *, extra: str = "", body: bytes = b"",
            auth: str = "", method: str = "GET") -> bytes:
    """A request for ``http://allowed.test:PORT/path`` through the proxy, with ``host`` as its
    ``Host`` header (none when empty) and ``auth`` as its Basic proxy credentials."""
    head = f"{method} http://{SITE}:{port}{path} HTTP/1.1\r\n"
    head += f"Host: {host}\r\n" if host else ""
    head += f"Proxy-Authorization: Basic {auth}\r\n" if auth else ""
    return (head + extra + "\r\n").encode() + body


def exchange(address: tuple[str, int], first: bytes, then: bytes = b"") -> bytes:
    """Send ``first``; once its whole answer is in (a head with a ``Content-Length``), send
    ``then`` (a second request on the same connection); end sending; all that comes back."""
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(first)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                return answer
            answer += chunk
        if then:
            sock.sendall(then)
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _length(answer: bytes) -> int:
    """The length of the whole first message in ``answer`` (head and body)."""
    head, _, _ = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(head) + 4


@pytest.fixture
def proxy(sink: Sink) -> Iterator[tuple[P.Proxy, str, list[str]]]:
    """The real proxy in this process (so a guard can be switched off), its credentials
    and the refusals it reported."""
    reports: list[str] = []
    server = P.Proxy(rules(sink.port), reports.append)
    server.start()
    yield server, base64.b64encode(f"sandlock:{server.token}".encode()).decode(), reports
    server.stop()


# ----------------------------------------------------------------------------
# Which Host names the URL's site (pure)


@pytest.mark.parametrize("target, values, same", [
    ("http://allowed.test/x", ["allowed.test"], True),
    ("http://allowed.test/x", ["Allowed.TEST:80"], True),  # any case, the default port written
    ("http://allowed.test:80/x", ["allowed.test"], True),  # or not
    ("http://allowed.test:8080/x", ["ALLOWED.test:8080"], True),
    ("http://[::1]:8080/x", ["[::1]:8080"], True),
    ("http://allowed.test/x", [], True),  # none: the proxy sends the URL's
    ("http://allowed.test:8080/x", ["allowed.test"], False),  # port 80 is another site
    ("http://allowed.test/x", ["allowed.test:8080"], False),
    ("http://allowed.test/x", [OTHER], False),
    ("http://allowed.test/x", ["allowed.test.evil.example"], False),
    ("http://allowed.test/x", [f"{OTHER}@allowed.test"], False),
    ("http://allowed.test/x", ["allowed.test", "allowed.test"], False),  # two, even equal
    ("http://allowed.test/x", [""], False),
])
def test_the_host_header_must_name_the_urls_authority(target: str, values: list[str],
                                                      same: bool) -> None:
    url = urllib.parse.urlsplit(target)
    assert (P._other_host(values, url) == "") is same, values


def test_the_forwarded_host_is_the_urls_authority() -> None:
    for target, host in (("http://Allowed.Test/x", "allowed.test"),
                         ("http://allowed.test:80/x", "allowed.test"),
                         ("http://user:pw@allowed.test:8080/x", "allowed.test:8080"),
                         ("http://[::1]:8080/x", "[::1]:8080")):
        assert P._authority(urllib.parse.urlsplit(target)) == host


# ----------------------------------------------------------------------------
# The real proxy, in this process


def test_a_host_naming_another_site_is_refused_before_the_upstream(
        sink: Sink, proxy: tuple[P.Proxy, str, list[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``Host`` naming another site is a 403 reported once, and opens no connection to
    the allowed address; two ``Host`` headers are a malformed head (400: RFC 9112 section
    3.2; h11 refuses them before the proxy looks). Controls: the same request with the
    URL's ``Host`` is forwarded, and with the check switched off the refused one is too."""
    server, auth, reports = proxy
    port = sink.port
    mismatched = exchange(server.address, request(port, "/mismatch", OTHER, auth=auth))
    doubled = exchange(server.address, request(port, "/doubled", f"{SITE}:{port}", auth=auth,
                                               extra=f"Host: {OTHER}\r\n"))
    assert mismatched.startswith(b"HTTP/1.1 403 "), mismatched
    assert f"the Host header '{OTHER}' names another site".encode() in mismatched
    assert doubled.startswith(b"HTTP/1.1 400 ") and b"multiple Host" in doubled, doubled
    assert sink.received() == b"" and sink.connections == []
    assert reports == [f"network: refused {SITE}:{port} (HTTP proxy): the Host header "
                       f"'{OTHER}' names another site than the URL's host"]
    matching = exchange(server.address, request(port, "/match", f"{SITE}:{port}", auth=auth))
    assert matching.startswith(b"HTTP/1.1 200 ") and matching.endswith(b"sink\n"), matching
    assert sink.received().startswith(b"GET /match HTTP/1.1\r\nHost: allowed.test:")
    monkeypatch.setattr(P, "_other_host", lambda values, url: "")  # the guard switched off
    unchecked = exchange(server.address, request(port, "/mismatch", OTHER, auth=auth))
    assert unchecked.startswith(b"HTTP/1.1 200 "), unchecked
    assert b"GET /mismatch " in sink.received()


def test_a_pipelined_request_never_reaches_the_upstream(
        sink: Sink, proxy: tuple[P.Proxy, str, list[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What follows the first request on a connection is dropped, sent with it (in the
    same segment) or after its answer; the upstream gets the first request alone, with
    exactly the body its head frames (a length, or chunks, sent on with a length).
    Controls: the sink records a second request sent to it directly, and with the proxy
    relaying what the client sends after the request, the late one arrives."""
    server, auth, _ = proxy
    port = sink.port
    second = f"GET /second HTTP/1.1\r\nHost: {OTHER}\r\n\r\n".encode()
    assert exchange(("127.0.0.1", port), b"GET /direct HTTP/1.1\r\nHost: x\r\n\r\n",
                    second).count(b"sink\n") == 2  # the sink reads and answers a second one
    assert b"GET /second " in sink.received()
    sink.connections.clear()
    first = request(port, "/first", f"{SITE}:{port}", auth=auth)
    posted = request(port, "/posted", f"{SITE}:{port}", auth=auth, method="POST",
                     extra="Content-Length: 5\r\n", body=b"hello")
    chunked = request(port, "/chunked", f"{SITE}:{port}", auth=auth, method="POST",
                      extra="Transfer-Encoding: chunked\r\n",
                      body=b"3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n")
    together = [exchange(server.address, head + second) for head in (first, posted, chunked)]
    late = exchange(server.address, first, second)
    assert all(answer.count(b"sink\n") == 1 for answer in [*together, late]), together + [late]
    received = sink.received()
    assert b"/second" not in received and OTHER.encode() not in received, received
    assert sorted(c.split(b" ", 2)[1] for c in sink.connections) == [
        b"/chunked", b"/first", b"/first", b"/posted"]  # the first requests arrived
    for forwarded in sink.connections:
        head, _, body = forwarded.partition(b"\r\n\r\n")
        if forwarded.startswith(b"POST "):
            assert b"\r\nContent-Length: 5" in head and b"Transfer-Encoding" not in head
            assert body == b"hello", forwarded
        else:
            assert body == b"", forwarded
    sink.connections.clear()
    relay: Callable[..., None] = P._pipe
    monkeypatch.setattr(P, "_pipe", lambda client, upstream, forward=True:
                        relay(client, upstream, True))  # the guard switched off
    unguarded = exchange(server.address, first, second)
    assert unguarded.count(b"sink\n") == 2, unguarded
    assert b"GET /second " in sink.received()


def test_a_client_waiting_for_100_continue_gets_it_from_the_proxy(
        sink: Sink, proxy: tuple[P.Proxy, str, list[str]]) -> None:
    """The proxy reads the whole body before it forwards the request, so it answers
    ``Expect: 100-continue`` itself and forwards neither the expectation nor a 100."""
    server, auth, _ = proxy
    head = request(sink.port, "/upload", f"{SITE}:{sink.port}", auth=auth,
                   extra="Content-Length: 5\r\nExpect: 100-continue\r\n")
    with socket.create_connection(server.address, timeout=30) as sock:
        sock.sendall(head)
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
        sock.sendall(b"hello")
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"sink\n") == 1, answer
    received = sink.received()
    assert received.endswith(b"\r\n\r\nhello") and b"Expect" not in received, received


# ----------------------------------------------------------------------------
# A confined tool, through the CLI on the real kernel

TOOL = """
import base64, os, socket, sys, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
AUTH = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
PORT = int(sys.argv[1])

def send(data):
    with socket.create_connection((proxy.hostname, proxy.port), timeout=30) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer

def get(path, host, extra=""):
    return (f"GET http://allowed.test:{PORT}{path} HTTP/1.1\\r\\nHost: {host}\\r\\n"
            f"Proxy-Authorization: Basic {AUTH}\\r\\n{extra}\\r\\n").encode()

second = b"GET /second HTTP/1.1\\r\\nHost: not-allowed.example\\r\\n\\r\\n"
for name, data in (("mismatch", get("/mismatch", "not-allowed.example")),
                   ("match", get("/match", f"allowed.test:{PORT}")),
                   ("pipelined", get("/first", f"allowed.test:{PORT}") + second)):
    answer = send(data)
    print(name, answer.split(b" ")[1].decode(), answer.count(b"sink\\n"))
"""


def test_a_confined_tool_reaches_only_the_urls_site(tmp_path: Path, sink: Sink) -> None:
    """Through ``sandlock run``: the mismatched ``Host`` is a 403 (reported on stderr) and
    leaves nothing in the sink; the matching request (the positive control) is answered
    by the sink; of a pipelined pair only the first request arrives."""
    require_abi(4, "TCP rules under the connect gate")
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [network]
        allow = ["{SITE}:{sink.port}"]
        hosts = {{ "{SITE}" = "127.0.0.1" }}
        """)
    done = run_confined(policy, [PYTHON, "-c", textwrap.dedent(TOOL), str(sink.port)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["mismatch 403 0", "match 200 1", "pipelined 200 1"], \
        done.stdout + done.stderr
    assert f"sandlock: network: refused {SITE}:{sink.port} (HTTP proxy): the Host header " \
           f"'{OTHER}' names another site than the URL's host" in done.stderr, done.stderr
    received = sink.received()
    assert b"GET /match HTTP/1.1\r\n" in received and b"GET /first HTTP/1.1\r\n" in received
    assert b"/mismatch" not in received and b"/second" not in received, received
    assert OTHER.encode() not in received, received
