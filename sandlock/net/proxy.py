"""A filtering HTTP and SOCKS5 proxy for one run, in the launcher process.

Host names are checked where the name is known: in an HTTP ``CONNECT host:port``
(TLS), in the absolute URL of a plain HTTP request, and in a SOCKS5 request
with remote resolution (``socks5h://``). The proxy decides with
:class:`sandlock.policy.netrules.NetRules`, resolves the name itself (``hosts`` pins
first, then the caller's resolver), checks every address it got (deny rules;
non-public addresses only when pinned or allowed: DNS rebinding), and connects
to an address it checked. The tool never supplies an address that the proxy
acts on later, so there is nothing to race.

One listening socket on ``127.0.0.1`` and an ephemeral port serves both
protocols (the first byte of a SOCKS5 greeting is 0x05, which no HTTP method
starts with). Clients must present the per-run credentials carried in the
proxy URLs, so other local users cannot borrow the tool's allowlist.

A refusal answers HTTP 403 (SOCKS5: reply 0x02, "not allowed by ruleset") and
is handed to ``report``, which the CLI prints on stderr. The HTTP request head is read
and answered by :mod:`sandlock.net.http` (a malformed or ambiguous one is a 400). A
tunnel (CONNECT, SOCKS5) passes bytes through both ways as sent, once its target is
connected. A plain ``http://`` request is forwarded alone: the upstream gets exactly
one request per client connection, whose ``Host`` is the URL's authority (a ``Host``
naming another site, or two of them, is a 403: an allowed address that serves many
sites by ``Host``, a CDN or shared hosting, would otherwise serve the ones the
allowlist does not name), with its body as the head frames it; what the client sends
after it (a pipelined second request, with yet another ``Host``) is read and dropped,
and only the response passes back.
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import secrets
import select
import socket
import urllib.parse
from typing import Callable, Optional

from ..policy.netrules import IPAddress, NetRules, Verdict, as_address, format_target, normalize_host
from . import http
from .admit import Route, admitted, began, is_route
from .http import CONNECT_TIMEOUT, HEAD_TIMEOUT, HOP_HEADERS, HttpError
from .listener import LoopbackServer

USER = "sandlock"
SOCKS_OK, SOCKS_FAIL, SOCKS_RULESET, SOCKS_UNREACHABLE, SOCKS_REFUSED = 0, 1, 2, 4, 5
SOCKS_BAD_COMMAND, SOCKS_BAD_ADDRESS = 7, 8


class Refused(Exception):
    """The proxy will not open this connection; ``status`` is the HTTP answer."""

    def __init__(self, status: int, reason: str, socks: int) -> None:
        super().__init__(reason)
        self.status = status
        self.socks = socks


class Proxy(LoopbackServer):
    """Listen now (the port goes into the tool's environment); serve after :meth:`start`."""

    name = "sandlock-proxy"
    what = "proxy"

    def __init__(self, rules: NetRules, report: Callable[[str], None],
                 route: Optional[Route] = None, ports: tuple[tuple[int, int], ...] = ()) -> None:
        """``route``: the run's credential route, whose connections are admitted for the run
        (:mod:`sandlock.net.admit`); ``ports``: the policy's ``connect`` ports, which reach
        any host (as the connect gate lets them)."""
        super().__init__(report)
        self.rules = rules
        self.route = route
        self.ports = ports
        self.token = secrets.token_urlsafe(18)

    def url(self, scheme: str) -> str:
        return f"{scheme}://{USER}:{self.token}@{self.address[0]}:{self.address[1]}"

    def environment(self) -> dict[str, str]:
        """Proxy variables for the tool, upper and lower case (curl reads only http_proxy)."""
        env = {"HTTP_PROXY": self.url("http"), "HTTPS_PROXY": self.url("http"),
               "ALL_PROXY": self.url("socks5h"), "NO_PROXY": ""}
        env.update({name.lower(): value for name, value in env.items()})
        return env

    def _serve(self, client: socket.socket) -> None:
        upstream: Optional[socket.socket] = None
        try:
            client.settimeout(HEAD_TIMEOUT)
            first = client.recv(1, socket.MSG_PEEK)
            tunnel = True
            if first == b"\x05":
                upstream = self._socks(client)
            elif first:
                upstream, tunnel = self._http(client)
            if upstream is not None:
                self._heard(client)  # SOCKS: its request is in
                _pipe(client, upstream, forward=tunnel)
        except (OSError, ValueError, UnicodeError):
            pass
        finally:
            self._done(client, upstream)

    def _deny(self, host: str, port: int, reason: str, via: str) -> None:
        self._report_once(f"network: refused {format_target(host, port)} ({via}): {reason}")

    # ------------------------------------------------------------------ the decision

    def connect(self, host: str, port: int, via: str) -> socket.socket:
        """Check ``host:port``, resolve it, check each address, connect to a checked one."""
        host = normalize_host(host)
        any_host = any(low <= port <= high for low, high in self.ports)
        verdict = Verdict(True, "a connect port") if any_host else self.rules.check_name(host, port)
        if not verdict:
            self._deny(host, port, verdict.reason, via)
            raise Refused(403, verdict.reason, SOCKS_RULESET)
        try:
            addresses = self._resolve(host, port)
        except OSError as exc:
            raise Refused(502, f"cannot resolve {host}: {exc}", SOCKS_UNREACHABLE) from None
        refusal: Optional[Verdict] = None
        failure = "no address"
        for address in addresses:
            check = Verdict(True, "a connect port") if any_host else \
                self.rules.check_address(host, address, port)
            if check and (str(address), port) == self.address:
                check = Verdict(False, "that is the sandlock proxy itself")
            if not check:
                refusal = refusal or check
                continue
            family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            if not self._track(sock):
                sock.close()
                raise Refused(502, "the run is over", SOCKS_FAIL)
            try:
                sock.settimeout(CONNECT_TIMEOUT)
                since = began()
                sock.connect((str(address), port))
                sock.settimeout(None)
                if self.route is not None and is_route(self.route, str(address), port) \
                        and admitted(self.route, sock.fileno(), 0, since) != 0:
                    self._untrack(sock)
                    sock.close()
                    raise Refused(502, "the credential route did not admit the connection",
                                  SOCKS_FAIL)
                return sock
            except OSError as exc:
                failure = f"{address}: {exc.strerror or exc}"
                self._untrack(sock)
                sock.close()
        if refusal is not None and failure == "no address":
            self._deny(host, port, refusal.reason, via)
            raise Refused(403, refusal.reason, SOCKS_RULESET)
        raise Refused(502, f"cannot connect to {format_target(host, port)}: {failure}",
                      SOCKS_REFUSED)

    def _resolve(self, host: str, port: int) -> list[IPAddress]:
        pinned = self.rules.pin(host)
        if pinned is not None:
            return [pinned]
        literal = as_address(host)
        if literal is not None:
            return [literal]
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        out: list[IPAddress] = []
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            if address not in out:
                out.append(address)
        return out

    def _authorized(self, credentials: bytes) -> bool:
        expected = f"{USER}:{self.token}".encode()
        return hmac.compare_digest(credentials, expected)

    # ------------------------------------------------------------------ HTTP

    def _http(self, client: socket.socket) -> tuple[Optional[socket.socket], bool]:
        """(the upstream connected for ``client``'s request, or None when it was answered
        here; whether the connection is a tunnel, CONNECT, rather than one forwarded
        ``http://`` request)."""
        try:
            head, rest = http.read_head(client)
            self._heard(client)
            request = http.parse_request(client, head, rest)
        except HttpError as bad:
            http.answer(client, bad.status, f"sandlock proxy: {bad}")
            return None, False
        method = request.method
        if not self._http_authorized(request.values("proxy-authorization")):
            http.answer(client, 407, "sandlock proxy: use the proxy URL from HTTP_PROXY/"
                        "HTTPS_PROXY (it carries the credentials of this run)",
                        extra=[("Proxy-Authenticate", 'Basic realm="sandlock"')])
            return None, False
        if method == "CONNECT":
            host, port = _host_port(request.target)
            via = "HTTPS proxy"
        else:
            url = urllib.parse.urlsplit(request.target)
            if url.scheme != "http" or not url.hostname:
                http.answer(client, 400, "sandlock proxy forwards http:// URLs; use CONNECT for TLS")
                return None, False
            host, port = url.hostname, url.port or 80
            via = "HTTP proxy"
            other = _other_host(request.values("host"), url)
            if other:
                self._deny(normalize_host(host), port, other, via)
                http.answer(client, 403, f"sandlock: {format_target(normalize_host(host), port)}: "
                            f"{other}")
                return None, False
        try:
            upstream = self.connect(host, port, via)
        except Refused as refused:
            status_text = f"sandlock: {format_target(normalize_host(host), port)}: {refused}"
            http.answer(client, refused.status, status_text)
            return None, False
        client.settimeout(None)
        if method != "CONNECT":
            return self._forward(client, request, url, upstream), False
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            upstream.sendall(rest)
        return upstream, True

    def _forward(self, client: socket.socket, request: http.Request, url: urllib.parse.SplitResult,
                 upstream: socket.socket) -> Optional[socket.socket]:
        """Send ``request`` to ``upstream`` alone: its head with the ``Host`` of its URL, then
        its whole body, read as the head frames it (:meth:`sandlock.net.http.Request.held_body`:
        bounded, a client waiting for ``100 Continue`` gets it here) and sent with a
        ``Content-Length``. What the client sent after the body stays unread, never sent.
        None when the body is refused (answered here); the upstream is closed unless returned."""
        try:
            with request.held_body() as body:
                framed = {n.lower() for n, _ in request.headers} & _FRAMING
                size = body.seek(0, 2)
                body.seek(0)
                kept = [(n, v) for n, v in request.headers if n.lower() not in _NOT_FORWARDED]
                length = [("Content-Length", str(size))] if framed else []
                path = urllib.parse.urlunsplit(("", "", url.path or "/", url.query, ""))
                upstream.sendall(http.head_bytes(
                    f"{request.method} {path} {request.version}",
                    [("Host", _authority(url)), *kept, *length, ("Connection", "close")]))
                for data in http.chunks(body):
                    upstream.sendall(data)
        except BaseException as exc:  # the client cut short, or its body refused
            self._untrack(upstream)
            upstream.close()
            if not isinstance(exc, HttpError):
                raise
            http.answer(client, exc.status, f"sandlock proxy: {exc}")
            return None
        return upstream

    def _http_authorized(self, values: list[str]) -> bool:
        """The first ``Proxy-Authorization`` carries this run's credentials (Basic)."""
        for value in values[:1]:
            scheme, _, data = value.strip().partition(" ")
            if scheme.lower() != "basic":
                return False
            try:
                return self._authorized(base64.b64decode(data.strip(), validate=True))
            except ValueError:
                return False
        return False

    # ------------------------------------------------------------------ SOCKS5 (RFC 1928, 1929)

    def _socks(self, client: socket.socket) -> Optional[socket.socket]:
        _, count = _recv_exact(client, 2)
        methods = _recv_exact(client, count)
        if 2 not in methods:  # username/password: the run's credentials are required
            client.sendall(b"\x05\xff")
            return None
        client.sendall(b"\x05\x02")
        _, length = _recv_exact(client, 2)
        user = _recv_exact(client, length)
        password = _recv_exact(client, _recv_exact(client, 1)[0])
        if not self._authorized(user + b":" + password):
            client.sendall(b"\x01\x01")
            return None
        client.sendall(b"\x01\x00")
        _, command, _, kind = _recv_exact(client, 4)
        if kind == 1:
            host = socket.inet_ntop(socket.AF_INET, _recv_exact(client, 4))
        elif kind == 4:
            host = socket.inet_ntop(socket.AF_INET6, _recv_exact(client, 16))
        elif kind == 3:
            host = _recv_exact(client, _recv_exact(client, 1)[0]).decode("ascii")
        else:
            _socks_reply(client, SOCKS_BAD_ADDRESS)
            return None
        port = int.from_bytes(_recv_exact(client, 2), "big")
        if command != 1:  # only CONNECT; no BIND, no UDP ASSOCIATE
            _socks_reply(client, SOCKS_BAD_COMMAND)
            return None
        try:
            upstream = self.connect(host, port, "SOCKS5 proxy")
        except Refused as refused:
            _socks_reply(client, refused.socks)
            return None
        client.settimeout(None)
        _socks_reply(client, SOCKS_OK)
        return upstream


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ValueError("connection closed mid-request")
        data += chunk
    return data


#: Headers that frame a request body: the proxy sends the body it read with its own length.
_FRAMING = frozenset({"content-length", "transfer-encoding"})
#: Request headers the proxy writes itself or that end with it: the hop's own, ``Host``
#: (the URL's), the body's framing, and ``Expect`` (the proxy answered ``100 Continue``
#: before it read the body; the upstream gets the body whole).
_NOT_FORWARDED = HOP_HEADERS | _FRAMING | {"host", "expect"}


def _authority(url: urllib.parse.SplitResult) -> str:
    """The ``Host`` that names ``url``'s site: its host (IPv6 in brackets), and its port
    unless it is 80, the default of ``http://`` (RFC 9110 section 7.2)."""
    host = url.hostname or ""
    literal = f"[{host}]" if ":" in host else host
    return literal if (url.port or 80) == 80 else f"{literal}:{url.port}"


def _other_host(values: list[str], url: urllib.parse.SplitResult) -> str:
    """Why the ``Host`` headers ``values`` of a request for ``url`` name another site than
    the URL's authority, or "" when they do not: one ``Host``, equal to the authority as
    written or as :func:`_authority` writes it (any case, the default port present or
    not), or none (the proxy sends the URL's). A server that serves many sites on one
    address picks the site by ``Host``, not by the address the proxy checked. (Two
    ``Host`` headers are a malformed head that h11 refuses first, 400 as RFC 9112
    section 3.2 asks; they are refused here too, whatever reads the head.)"""
    if len(values) > 1:
        return f"{len(values)} Host headers (one request names one site: its URL's)"
    if not values:
        return ""
    authority = _authority(url).lower()
    same = {url.netloc.rpartition("@")[2].lower(), authority}
    if (url.port or 80) == 80:
        same.add(f"{authority}:80")
    if values[0].strip().lower() in same:
        return ""
    shown = values[0] if len(values[0]) <= 100 else values[0][:100] + "..."
    return f"the Host header {shown!r} names another site than the URL's host"


def _host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"CONNECT target {target!r} is not host:port")
    return host, int(port)


def _socks_reply(sock: socket.socket, code: int) -> None:
    sock.sendall(bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]))


def _pipe(client: socket.socket, upstream: socket.socket, forward: bool = True) -> None:
    """Copy bytes both ways until both sides have finished sending (poll: no FD_SETSIZE
    limit). ``forward`` False (a forwarded ``http://`` request, already sent): what the
    client sends is read and dropped, never sent to the upstream, and its end still ends
    the upstream's input; only the response passes."""
    peer = {client.fileno(): (client, upstream), upstream.fileno(): (upstream, client)}
    poller = select.poll()
    for fd in peer:
        poller.register(fd, select.POLLIN)
    while peer:
        for fd, _ in poller.poll():
            source, sink = peer[fd]
            data = source.recv(65536)
            if data:
                if forward or source is upstream:
                    sink.sendall(data)
                continue
            poller.unregister(fd)
            del peer[fd]
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
