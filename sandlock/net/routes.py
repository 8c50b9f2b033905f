"""The credential route server of one run: a local reverse proxy that injects secrets.

The tool speaks plain HTTP to ``http://127.0.0.1:PORT/<name>/...`` (the base URL in
the variable its credential names) and holds only a placeholder. For each request
the server, in the launcher (a process the tool cannot read: Landlock forbids a
sandboxed process ptrace-class access, hence ``/proc/PID/mem`` and ``environ``, to
anything outside its domain):

1. reads the request through :mod:`sandlock.net.http`, strictly (one request per
   connection; no obs-fold, no bare LF, no ``Content-Length`` beside
   ``Transfer-Encoding``; the body framed again, whatever follows it dropped), and
   drops ``Upgrade`` and refuses rewrite headers: nothing can smuggle a second,
   unchecked request;
2. finds the credential by the first path segment and the run by the placeholder
   the request carries where the secret belongs (header or query parameter): the
   placeholder, random per run, is also what keeps other local processes out;
3. decides on the percent-decoded path (dot segments and encoded slashes refused)
   with :meth:`sandlock.policy.credentials.Credential.check`: deny wins, then methods,
   then paths. A refusal is HTTP 403 naming the rule, and one ``network: refused``
   line to ``report``;
4. replaces the placeholder with the secret, connects to the upstream over TLS,
   verifying its certificate and host name (system store, or ``ca_file``), sends
   the head and exactly the body the head announced, framed by sandlock. The body is
   read whole and checked first (held in memory, then in an unnamed temporary file):
   a body that is malformed, too large or cut short is answered 400 and the upstream
   never sees the request;
5. relays the response as it arrives (SSE and chunked bodies unbuffered, framed
   again for the tool). The
   response head is rewritten: a ``Location`` on the upstream itself points back
   into the route (the tool follows it through the route, under the same rules);
   any other ``Location`` is returned as is and is followed, if at all, by the tool
   itself, with the placeholder. The secret, if the upstream echoes it in a response
   header, is replaced by the placeholder. Redirects are never followed here.
"""

from __future__ import annotations

import marshal
import os
import re
import secrets as _random
import socket
import ssl
import time
import urllib.parse
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

from ..policy.credentials import PLACEHOLDER_PREFIX, Credential, tool_environment
from . import http
from .http import CONNECT_TIMEOUT, HEAD_TIMEOUT, HOP_HEADERS, HttpError
from .listener import MAX_CLIENTS, LoopbackServer
from .mediator import START_TIMEOUT, end_process, raise_nofile, start_process

if TYPE_CHECKING:
    from ..errors import PolicyError
    from ..exec.spec import Command
    from ..policy.credentials import CredentialError
    from ..policy.model import Policy

#: Requests of one run (one session) under way through the route at once: under the API a
#: Sandbox's calls share one route server, and a call must not hold all of its
#: :data:`sandlock.net.listener.MAX_CLIENTS` slots with requests that wait on the upstream.
MAX_PER_SESSION = MAX_CLIENTS // 4
#: Admitted connections remembered at once (:meth:`RouteServer.admit`; each is forgotten
#: when it ends): beyond, the oldest are.
MAX_ADMITTED = 4096
#: Request headers the route never forwards: they concern this hop, or would turn the
#: connection into something other than one checked request (Upgrade, h2c).
DROP_REQUEST = HOP_HEADERS | {"host", "te", "trailer", "upgrade", "http2-settings", "expect"}
DROP_RESPONSE = HOP_HEADERS - {"proxy-authorization"} | {"upgrade"}
_METHOD = re.compile(r"^[A-Z]{1,20}$")


class BadRequest(HttpError):
    """Answer ``status`` with this message; ``report`` it when it is a refusal by rule."""

    def __init__(self, status: int, message: str, refusal: bool = False) -> None:
        super().__init__(status, message)
        self.refusal = refusal


class Session:
    """The placeholders of one run (or one API call), valid until :meth:`close`."""

    def __init__(self, server: "RouteServer", placeholders: dict[str, str],
                 secrets: dict[str, str]) -> None:
        self.server = server
        self.placeholders = placeholders  #: credential name -> placeholder
        self.secrets = secrets

    @property
    def sid(self) -> str:
        """What names this session to the route server when a gate admits a connection of
        its tool (:meth:`RouteServer.admit`): one of its placeholders (none is a secret)."""
        return min(self.placeholders.values())

    def environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` for the tool: see :func:`sandlock.policy.credentials.tool_environment`."""
        return tool_environment(self.server.credentials, env, self.secrets, self.placeholders,
                                {c.name: self.server.base_url(c.name)
                                 for c in self.server.credentials})

    def close(self) -> None:
        self.server._forget(self)


class RouteServer(LoopbackServer):
    """Listen now (the port is granted to the tool before it starts); serve after :meth:`start`."""

    name = "sandlock-routes"
    what = "credential route server"

    def __init__(self, credentials: Sequence[Credential], pins: Sequence[tuple[str, str]],
                 report: Callable[[str], None]) -> None:
        self.credentials = tuple(credentials)
        self._by_name = {c.name: c for c in credentials}
        # "system" pins mean the system resolver, as without a pin; only addresses are kept.
        self._pins = {name: address for name, address in pins if address != "system"}
        self._tls = {c.name: _tls_context(c) for c in credentials}  # ca_file read here
        super().__init__(report)
        self._sessions: dict[str, tuple[Credential, str]] = {}  #: placeholder -> (it, secret)
        self._sid_of: dict[str, str] = {}  #: placeholder -> its session's sid
        #: Connections a gate made for a tool, by their address as the server sees the peer
        #: -> (the sid of that tool's session, its run) (:meth:`admit`), oldest first.
        self._admitted: dict[tuple[str, int], tuple[str, str]] = {}
        #: When the last connection from each address ended (CLOCK_MONOTONIC, ns), oldest
        #: first: an admission of a connection begun before then comes too late (it ended).
        self._ended: dict[tuple[str, int], int] = {}
        self._under_way: dict[str, int] = {}  #: run -> its requests being served
        self._claimed: dict[socket.socket, str] = {}  #: connection -> the run it counts for

    def base_url(self, name: str) -> str:
        return f"http://{self.address[0]}:{self.address[1]}/{name}"

    def session(self, secrets: Mapping[str, str]) -> Session:
        """Register fresh placeholders for ``secrets`` (one per credential)."""
        placeholders = {c.name: f"{PLACEHOLDER_PREFIX}{c.name}-{_random.token_urlsafe(24)}"
                        for c in self.credentials}
        session = Session(self, placeholders, dict(secrets))
        with self._lock:
            for item in self.credentials:
                self._sessions[placeholders[item.name]] = (item, secrets[item.name])
                self._sid_of[placeholders[item.name]] = session.sid
        return session

    def _forget(self, session: Session) -> None:
        with self._lock:
            for placeholder in session.placeholders.values():
                self._sessions.pop(placeholder, None)
                self._sid_of.pop(placeholder, None)

    def _on_stop(self) -> None:
        self._sessions.clear()
        self._sid_of.clear()
        self._admitted.clear()
        self._ended.clear()

    def admit(self, peer: tuple[str, int], sid: str, since: int, run: str = "") -> None:
        """A connect gate made the connection whose local address is ``peer``, begun at
        ``since`` (:func:`sandlock.net.admit.began`), for a tool whose session is ``sid``: the
        one connection that may carry that session's placeholders (a placeholder is
        readable where the tool leaves it, such as its command line in /proc: alone it is no
        key to the route). Its admission ends with it; one that comes after it ended (the
        server was full, or let it go) is dropped, or another process could take the address
        later and be served as this run. ``run`` names the call (the API's calls may share a
        session), whose requests :data:`MAX_PER_SESSION` counts."""
        with self._lock:
            self._admitted.pop(peer, None)
            if self._ended.get(peer, -1) >= since:
                return
            self._admitted[peer] = (sid, run)
            while len(self._admitted) > MAX_ADMITTED:  # connections never made or long gone
                del self._admitted[next(iter(self._admitted))]

    def _end(self, peer: tuple[str, int]) -> None:
        """The connection from ``peer`` ended (under the lock): its admission with it."""
        self._admitted.pop(peer, None)
        self._ended.pop(peer, None)
        self._ended[peer] = time.monotonic_ns()
        while len(self._ended) > MAX_ADMITTED:
            del self._ended[next(iter(self._ended))]

    def _unserved(self, client: socket.socket) -> None:
        try:
            peer = client.getpeername()[:2]
        except OSError:
            return
        with self._lock:
            self._end(peer)

    def _serve(self, client: socket.socket) -> None:
        held: list[socket.socket] = [client]  # and the upstream, once connected
        peer: Optional[tuple[str, int]] = None
        try:
            peer = client.getpeername()[:2]
            client.settimeout(HEAD_TIMEOUT)
            try:
                self._forward(client, held, peer)
            except HttpError as bad:
                http.answer(client, bad.status, f"sandlock route: {bad}")
        except (OSError, ValueError, UnicodeError):
            pass
        finally:
            with self._lock:  # one request per connection: its admission ends with it
                if peer is not None:
                    self._end(peer)
                run = self._claimed.pop(client, None)
                if run is not None:
                    self._under_way[run] -= 1
                    if not self._under_way[run]:
                        del self._under_way[run]
            self._done(*held)

    def _refuse(self, message: str) -> BadRequest:
        self._report_once(f"network: refused {message}")
        return BadRequest(403, message, refusal=True)

    # ------------------------------------------------------------------ one request

    def _forward(self, client: socket.socket, held: list[socket.socket],
                 peer: tuple[str, int]) -> None:
        request = http.read_request(client)
        method, target, headers = request.method, request.target, request.headers
        if not _METHOD.match(method):
            raise BadRequest(400, "malformed request line")
        _check_request_headers(headers)
        route_name, path, query = _checked_target(target)
        item = self._by_name.get(route_name)
        if item is None:
            raise BadRequest(404, f"no credential route {route_name!r} (routes: "
                             f"{', '.join(self._by_name)})")
        where = f"{method} {item.origin}{path} (credential route {item.name})"
        secret, placeholder = self._secret(item, headers, query, where, peer)
        self._claim(client, peer)
        allowed, rule = item.check(method, _decoded_path(path))
        if not allowed:
            raise self._refuse(f"{where}: {rule}")
        # The request as the upstream gets it: the secret where the placeholder was.
        if item.query is not None:
            query = _replace_query(query, item.query, placeholder,
                                   urllib.parse.quote(secret, safe=""))
        out = [(n, v) for n, v in headers if n.lower() not in DROP_REQUEST
               and (item.header is None or n.lower() != item.header.lower())]
        host = f"[{item.host}]" if ":" in item.host else item.host
        out.insert(0, ("Host", host if item.port == 443 else f"{host}:{item.port}"))
        if item.header is not None:
            out.append((item.header, item.attach(secret)))
        out.append(("Connection", "close"))
        with request.held_body() as body:  # all of it, checked, before the secret leaves
            self._heard(client)  # until now the first let go, as a silent one (listener.py)
            upstream = http.Upstream(self._connect(item, where))
            held.append(upstream.sock)
            upstream.send(method, f"{path}{'?' + query if query else ''}", out,
                          http.chunks(body))
        client.settimeout(None)
        route = self.base_url(item.name)
        head = upstream.response()
        while head.status < 200:  # interim heads, each through the scrub
            request.interim(_response_head(head, item, route, secret, placeholder))
            head = upstream.response()
        head = _response_head(head, item, route, secret, placeholder)
        try:
            request.respond(head, upstream.body())
        except HttpError:
            pass  # the head may be out: the tool sees the connection end

    def _claim(self, client: socket.socket, peer: tuple[str, int]) -> None:
        """Count the connection's request against its run's :data:`MAX_PER_SESSION` (503
        beyond it); the count ends with the connection (:meth:`_serve`)."""
        with self._lock:
            run = self._admitted.get(peer, ("", ""))[1]
            busy = self._under_way.get(run, 0) >= MAX_PER_SESSION
            if not busy:
                self._under_way[run] = self._under_way.get(run, 0) + 1
                self._claimed[client] = run
        if busy:
            self._report_once(f"network: refused a request of the credential route: "
                              f"{MAX_PER_SESSION} of this run's are under way")
            raise BadRequest(503, f"{MAX_PER_SESSION} requests of this run are under way on the "
                             "route (the limit per run)")

    def _secret(self, item: Credential, headers: list[tuple[str, str]], query: str,
                where: str, peer: tuple[str, int]) -> tuple[str, str]:
        """(secret, placeholder) of the run whose placeholder this request carries, if a
        gate admitted its connection for that run's session (:meth:`admit`)."""
        if item.query is not None:
            values = [v for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)
                      if k == item.query]
            place = f"query parameter {item.query}"
        else:
            assert item.header is not None
            values = [v for n, v in headers if n.lower() == item.header.lower()]
            place = f"header {item.header}"
        pattern = re.compile(re.escape(f"{PLACEHOLDER_PREFIX}{item.name}-") + r"[A-Za-z0-9_-]{32}")
        foreign = None  # a placeholder of a session this connection was not admitted for
        with self._lock:
            sid = self._admitted.get(peer, (None, ""))[0]
            for value in values:
                for found in pattern.findall(value):
                    entry = self._sessions.get(found)
                    if entry is None or entry[0] is not item:
                        continue
                    if sid is not None and self._sid_of.get(found) == sid:
                        return entry[1], found
                    foreign = found
        if foreign is not None:
            raise self._refuse(f"{where}: this connection was not made by a confined tool "
                               "through its connect gate" if sid is None else
                               f"{where}: the placeholder is not of the run whose tool made "
                               "this connection")
        raise self._refuse(f"{where}: the request does not carry this run's placeholder of "
                           f"credentials.{item.name} in its {place}")

    def _connect(self, item: Credential, where: str) -> socket.socket:
        address = self._pins.get(item.host, item.host)
        try:
            raw = socket.create_connection((address, item.port), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            raise BadRequest(502, f"{where}: cannot connect: {exc.strerror or exc}") from None
        if not self._track(raw):
            raw.close()
            raise BadRequest(502, "the run is over")
        try:  # no I/O yet
            tls = self._tls[item.name].wrap_socket(raw, server_hostname=item.host,
                                                   do_handshake_on_connect=False)
        except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
            self._untrack(raw)
            raw.close()
            raise _tls_failed(item, where, exc) from None
        # tls took raw's descriptor: stop() must find tls, or it cuts nothing and the
        # handshake, then the request with the secret, goes on after the run ended
        if not self._swap(raw, tls):
            tls.close()
            raise BadRequest(502, "the run is over")
        try:
            tls.do_handshake()
        except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
            self._untrack(tls)
            tls.close()
            raise _tls_failed(item, where, exc) from None
        tls.settimeout(None)
        return tls


def _tls_failed(item: Credential, where: str, exc: BaseException) -> BadRequest:
    return BadRequest(502, f"{where}: TLS with {item.host} failed: "
                      f"{getattr(exc, 'verify_message', None) or exc}")


def _tls_context(item: Credential) -> ssl.SSLContext:
    """Verifying client context: the system store, or only ``ca_file`` when given."""
    from ..policy.credentials import CredentialError

    try:
        context = ssl.create_default_context(cafile=item.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialError(f"cannot load ca_file {item.ca_file!r}: "
                              f"{getattr(exc, 'strerror', None) or exc}",
                              (item.name, "ca_file")) from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    return context


# ---------------------------------------------------------------------- what the rules read


#: Percent escapes a path may carry: characters that cannot appear raw in a path and
#: have no meaning to a router once decoded. Any other escape (an encoded ``/``, ``.``,
#: ``;``, ``%``, ``?``, NUL, a letter, a non-ASCII byte) is refused: an upstream may
#: decode it before or after routing, and then reads another path than the one checked.
PATH_ESCAPES = frozenset(' "<>[]^`{|}')
_ESCAPE = re.compile(r"%(..)?", re.DOTALL)
#: Request headers (names lower case, ``_`` read as ``-``) refused because they ask the
#: upstream, or a proxy in front of it, to act on another method, path, host or client
#: than the one checked: method overrides (X-HTTP-Method-Override, X-HTTP-Method,
#: X-Method-Override), original-URL and rewrite headers (X-Original-URL, X-Rewrite-URL,
#: X-Original-URI, X-Envoy-Original-Path), forwarding headers (Forwarded, X-Forwarded-*,
#: X-Real-IP, X-Client-IP, True-Client-IP, CF-Connecting-IP, X-Host, Via).
REWRITE_HEADER = re.compile(r"method|override|original|rewrite|forwarded|^via$|^x-host$|"
                            r"real-ip|client-ip|connecting-ip")
#: Query parameters (names decoded, lower case) that frameworks read as the method.
OVERRIDE_PARAMETER = re.compile(r"^-method$|method-override|^x-http-method$")
#: What frameworks read as ``_`` (or ``-``) in a query parameter's name.
_AS_DASH = str.maketrans({"_": "-", ".": "-", " ": "-"})


def _checked_target(target: str) -> tuple[str, str, str]:
    """(route name, upstream path, query) of an origin-form target that no upstream can
    read differently from the rules (see :data:`PATH_ESCAPES`); anything else is a 400
    before the secret is looked up. The path is returned as received: its escapes decode
    to characters that change no segment."""
    if not target or any(not "!" <= c <= "~" for c in target):
        raise BadRequest(400, "the request target has whitespace, control characters or "
                         "non-ASCII bytes")
    if not target.startswith("/") or target.startswith("//"):
        raise BadRequest(400, "only an origin-form target (/name/path) is accepted")
    if "#" in target:
        raise BadRequest(400, "a fragment in the request target is refused")
    raw, _, query = target.partition("?")
    name, _, rest = raw[1:].partition("/")
    path = "/" + rest
    shown = repr(path)[:200]
    if "//" in path or any(segment in (".", "..") for segment in path.split("/")):
        raise BadRequest(400, f"path {shown}: empty, '.' and '..' segments are refused")
    if ";" in path or "\\" in path:
        raise BadRequest(400, f"path {shown}: ';' (path parameters) and '\\' are refused")
    for escape in _ESCAPE.finditer(path):
        code = escape.group(1)
        try:
            char = chr(int(code, 16)) if code is not None and code.isalnum() else None
        except ValueError:
            char = None
        if char not in PATH_ESCAPES:
            raise BadRequest(400, f"path {shown}: the escape {escape.group(0)!r} is refused "
                             f"(only {' '.join(sorted(PATH_ESCAPES))!r} may be "
                             "percent-encoded in a path)")
    # Some upstreams trim each decoded segment (Spring's trimTokens before 4.3; IIS drops
    # trailing dots and spaces): "..%20" would then be "..", and "admin%20" or "admin." a
    # deny rule's "admin". A segment may not begin or end with a space, nor end with a dot.
    for segment in urllib.parse.unquote(path).split("/")[1:]:
        if segment != segment.strip(" ") or segment.endswith("."):
            raise BadRequest(400, f"path {shown}: a segment that begins or ends with a space, "
                             "or ends with a dot, is refused (an upstream may trim it)")
    for pair in re.split("[&;]", query):  # Rack < 3 splits on ';' too
        key = urllib.parse.unquote_plus(pair.partition("=")[0])
        # PHP reads '.', ' ' in a name as '_' and 'name[]' as name
        if OVERRIDE_PARAMETER.search(key.lower().removesuffix("[]").translate(_AS_DASH)):
            raise BadRequest(400, f"query parameter {key[:64]!r} is refused: it asks the "
                             "upstream for another method than the one checked")
    return name, path, query


def _decoded_path(path: str) -> str:
    """The path the rules see: escapes decoded (only :data:`PATH_ESCAPES` remain)."""
    return urllib.parse.unquote(path)


def _check_request_headers(headers: list[tuple[str, str]]) -> None:
    """Refuse headers that ask for another method, path, host or client (see
    :data:`REWRITE_HEADER`), and names with ``_`` (CGI-style servers read them as ``-``)."""
    for name, _ in headers:
        if "_" in name:
            raise BadRequest(400, f"header {name!r}: '_' in a header name is refused (some "
                             "servers read it as '-')")
        if REWRITE_HEADER.search(name.lower()):
            raise BadRequest(400, f"header {name!r} is refused: it asks the upstream for another "
                             "method, path, host or client than the one checked")


def _replace_query(query: str, name: str, placeholder: str, secret: str) -> str:
    pairs = []
    for pair in query.split("&"):
        key, eq, value = pair.partition("=")
        if urllib.parse.unquote_plus(key) == name and eq:
            value = secret if placeholder in urllib.parse.unquote_plus(value) else value
        pairs.append(f"{key}{eq}{value}")
    return "&".join(pairs)


def _response_head(head: http.Head, item: Credential, route: str, secret: str,
                   placeholder: str) -> http.Head:
    """The upstream's response head as the tool gets it (interim 1xx heads too): the
    reason phrase and every header line through :func:`_scrubbed`."""
    reason = _scrubbed("the status line", head.reason, secret, placeholder)
    out: list[tuple[str, str]] = []
    chunked = any(name.lower() == "transfer-encoding" for name, _ in head.headers)
    for name, value in head.headers:
        if name.lower() in DROP_RESPONSE or chunked and name.lower() == "content-length":
            continue
        if name.lower() in ("location", "content-location"):
            value = _route_location(value, item, route)
            value = _hide_in_query(value, secret, placeholder)
        # the name may carry the secret too: the refusal names the line by its place
        name, _, value = _scrubbed(f"its header line {len(out) + 1}", f"{name}: {value}",
                                   secret, placeholder).partition(": ")
        out.append((name, value))
    if head.status >= 200:
        out.append(("Connection", "close"))
    return http.Head(head.status, reason, out)


#: Decoding rounds tried on a response line before searching it for the secret.
DECODE_ROUNDS = 4


def _scrubbed(what: str, text: str, secret: str, placeholder: str) -> str:
    """``text`` (one line of the response head) with the secret, where it appears as is,
    replaced by the placeholder; a 502 if the secret is still in it in any other form
    (:func:`_carries`): refused rather than guessed at."""
    text = text.replace(secret, placeholder)
    if _carries(text, secret):
        raise BadRequest(502, f"the upstream's response carries the secret, encoded, in "
                         f"{what}: refused (the tool must never receive it)")
    return text


def _carries(text: str, secret: str) -> bool:
    """Whether ``text`` holds ``secret`` in a form a client could decode: compared case-
    insensitively (hex digits of escapes, case-folding upstreams) in ``text`` and in every
    form up to :data:`DECODE_ROUNDS` rounds of percent-decoding (each round both with and
    without ``+`` read as a space: any subset of characters may be encoded, in either
    case), and as base64 (standard and URL-safe, at every alignment) in each form."""
    needles = [secret.casefold(), *(n.casefold() for n in _base64_forms(secret))]
    forms = {text}
    frontier = {text}
    for _ in range(DECODE_ROUNDS):
        frontier = {decoded for form in frontier
                    for decoded in (urllib.parse.unquote(form, errors="replace"),
                                    urllib.parse.unquote_plus(form, errors="replace"))} - forms
        forms |= frontier
    folded = [form.casefold() for form in forms]
    return any(needle in form for needle in needles for form in folded)


def _base64_forms(secret: str) -> list[str]:
    """The base64 text of ``secret`` wherever it starts in a longer base64 string (the
    characters that depend on the secret alone, at each of the three alignments), in
    the standard and URL-safe alphabets; none for secrets too short to tell apart."""
    import base64

    data = secret.encode("utf-8")
    out = []
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + data).decode("ascii")
        core = encoded[(offset * 4 + 2) // 3:((offset + len(data)) // 3) * 4]
        if len(core) >= 12:
            out += [core, core.translate(str.maketrans("+/", "-_"))]
    return out


def _hide_in_query(url: str, secret: str, placeholder: str) -> str:
    """A redirect's query parameter whose value, decoded, is the secret gets the
    placeholder instead (the tool follows it through the route, which attaches the
    secret again); any other form of the secret is left for :func:`_scrubbed` to refuse."""
    base, mark, query = url.partition("?")
    if not mark:
        return url
    query, hash_, fragment = query.partition("#")
    pairs = []
    for pair in query.split("&"):
        key, eq, value = pair.partition("=")
        forms = {value}
        for _ in range(DECODE_ROUNDS):
            forms |= {decode(form) for form in forms
                      for decode in (urllib.parse.unquote, urllib.parse.unquote_plus)}
        if secret in forms:
            value = urllib.parse.quote(placeholder, safe="")
        pairs.append(f"{key}{eq}{value}")
    return f"{base}?{'&'.join(pairs)}{hash_}{fragment}"


def _route_location(value: str, item: Credential, route: str) -> str:
    """A redirect on the upstream itself goes back through the route; any other is left
    for the tool, which follows it (if it can) with the placeholder, not the secret."""
    if value.startswith("/") and not value.startswith("//"):
        return route + value
    try:
        url = urllib.parse.urlsplit(value)
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return value
    if url.scheme == "https" and (url.hostname or "").lower() == item.host and port == item.port:
        return route + urllib.parse.urlunsplit(("", "", url.path or "/", url.query, url.fragment))
    return value


# ---------------------------------------------------------------------- one run


class Routes:
    """Everything a run with ``[credentials]`` needs: the secrets read, the route server
    listening, its port granted to the tool, the tool's environment rewritten."""

    def __init__(self, credentials: Sequence[Credential], grants: Sequence[object],
                 pins: Sequence[tuple[str, str]], environ: Mapping[str, str],
                 report: Callable[[str], None],
                 given: Optional[Mapping[str, str]] = None, remote: bool = False) -> None:
        """``remote``: serve from a process of its own (the API: never in the agent's
        process, :class:`sandlock.net.mediator.RemoteRouteServer`); else from a thread of
        this one (`sandlock run`: the launcher holds nothing but the run)."""
        from ..policy.credentials import secrets_for

        secrets = secrets_for(credentials, grants, environ, given)
        self.events: list[str] = []
        self._report = report
        if remote:
            self.server: Any = RemoteRouteServer(credentials, pins, self._event)
        else:
            self.server = RouteServer(credentials, pins, self._event)
        self.session = self.server.session(secrets)
        self._stopped = False

    def _event(self, message: str) -> None:
        self.events.append(message)
        self._report(message)

    @property
    def port(self) -> int:
        """The port the route server listens on, granted to the tool by compiling."""
        return int(self.server.port)

    def admit(self, peer: tuple[str, int], since: int) -> bool:
        """The run's connect gate made a connection to the route from ``peer`` (in this
        process: :class:`RouteServer`, for `sandlock run`, `trace` and `probe`)."""
        self.server.admit(peer, self.session.sid, since)
        return True

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.session.close()
        self.server.stop()

    def __enter__(self) -> "Routes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------
# The API's route server, in a process of its own


class RemoteRouteServer:
    """The caller's handle on a route server in a process of its own; used by
    :class:`sandlock.net.routes.Routes` and its sessions as a ``RouteServer`` is
    (``credentials``, ``port``, ``base_url``, ``session``, ``_forget``, ``start``, ``stop``).

    Wire (SOCK_SEQPACKET, fd 3 in the server): the caller sends ``pickle((credentials,
    pins))`` and gets ``{"port": N}``; then ``marshal(("session", secrets))`` answered by
    ``{name: placeholder}``, ``marshal(("forget", [placeholder...]))`` answered by ``{}``,
    and ``stop`` (or EOF), which ends it. Answers are JSON, read with a size bound and
    checked: the caller never unmarshals what that process says.
    """

    def __init__(self, credentials: Sequence[Credential], pins: Sequence[tuple[str, str]],
                 report: Callable[[str], None]) -> None:
        import pickle
        import threading

        del report  # refusals are the tool's to see (HTTP 403); the agent keeps no log of them
        self.credentials = tuple(credentials)
        self._lock = threading.Lock()
        self._stopped = False
        self._proc, self._sock = start_process("serve_routes", "sandlock.net.routes")
        try:
            self._sock.send(pickle.dumps((self.credentials, tuple(pins))))
            port = self._ask_json(None).get("port")
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"port {port!r}")
        except (OSError, ValueError) as exc:
            end_process(self._proc, self._sock)
            from ..errors import SetupError

            raise SetupError(f"the credential route server did not start ({exc}; exit status "
                             f"{self._proc.returncode})") from None
        self.address = ("127.0.0.1", port)

    @property
    def port(self) -> int:
        return self.address[1]

    def base_url(self, name: str) -> str:
        return f"http://{self.address[0]}:{self.address[1]}/{name}"

    def session(self, secrets: Mapping[str, str]) -> Session:
        with self._lock:
            placeholders = self._ask_json(marshal.dumps(("session", dict(secrets))))
        names = {c.name for c in self.credentials}
        if set(placeholders) != names or not all(
                isinstance(v, str) and v.startswith(f"{PLACEHOLDER_PREFIX}{k}-")
                for k, v in placeholders.items()):
            from ..errors import SetupError

            raise SetupError("the credential route server answered a session with something "
                             "else than its placeholders")
        return Session(self, dict(placeholders), dict(secrets))  # type: ignore[arg-type]

    def _forget(self, session: Session) -> None:
        try:
            with self._lock:
                self._ask_json(marshal.dumps(("forget", list(session.placeholders.values()))))
        except (OSError, ValueError):
            pass  # gone: its placeholders went with it

    def admitter(self) -> socket.socket:
        """A socket for the Sandbox's mediator process, on which its connect gates admit
        the connections they make to the route (``ADMIT host port since sid call``, answered ``ok``:
        :func:`serve_routes`)."""
        import sys

        mediator_end, route_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:
                self._sock.sendmsg([marshal.dumps(("admitter", None))],
                                   [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     route_end.fileno().to_bytes(4, sys.byteorder))])
                self._ask_json(None)
        except BaseException:
            mediator_end.close()
            raise
        finally:
            route_end.close()
        return mediator_end

    def start(self) -> None:
        """Serving since it answered its port."""

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._sock.send(b"stop")
        except OSError:
            pass
        end_process(self._proc, self._sock, gently=True)

    def _ask_json(self, message: Optional[bytes]) -> dict[str, Any]:
        import json

        if message is not None:
            self._sock.send(message)
        self._sock.settimeout(START_TIMEOUT)
        data = self._sock.recv(1 << 16)
        self._sock.settimeout(None)
        answer = json.loads(data.decode()) if data else None
        if not isinstance(answer, dict):
            raise ValueError("no answer" if not data else "not an object")
        return answer


def serve_routes(fd: int) -> None:
    """Main of a Sandbox's credential route server process (never returns)."""
    import json
    import pickle



    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    raise_nofile()
    code = 1
    server: Optional[RouteServer] = None
    try:
        credentials, pins = pickle.loads(sock.recv(1 << 20))
        server = RouteServer(credentials, pins, lambda _message: None)
        server.start()
        sock.send(json.dumps({"port": server.port}).encode())
        sessions: dict[str, Session] = {}
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)  # from the trusted caller only
            if not data or data == b"stop":
                break
            op, arg = marshal.loads(data)
            if op == "admitter" and len(fds) == 1:
                import threading

                threading.Thread(target=_admissions, args=(server, socket.socket(fileno=fds[0])),
                                 name="sandlock-routes-admit", daemon=True).start()
                sock.send(b"{}")
                continue
            for fd in fds:
                os.close(fd)
            if op == "session":
                session = server.session(arg)
                for placeholder in session.placeholders.values():
                    sessions[placeholder] = session
                sock.send(json.dumps(session.placeholders).encode())
            elif op == "forget":
                for placeholder in arg:
                    gone = sessions.pop(placeholder, None)
                    if gone is not None:
                        server._forget(gone)
                sock.send(b"{}")
        code = 0
    except BaseException:  # noqa: BLE001 - the caller sees EOF and reports it
        pass
    finally:
        if server is not None:
            server.stop()
        os._exit(code)



#: An admission from a mediator process: ``ADMIT 127.0.0.1 PORT SINCE SID CALL`` (ASCII).
_ADMISSION = re.compile(rb"ADMIT (127\.0\.0\.1|::1) ([0-9]{1,5}) ([0-9]{1,20}) ([A-Za-z0-9_-]{1,200}) "
                        rb"([0-9a-f]{1,64})")


def _admissions(server: RouteServer, sock: socket.socket) -> None:
    """Admissions of the Sandbox's mediator process (:meth:`RemoteRouteServer.admitter`),
    answered ``ok`` once recorded (its gate answers the tool's connect only then). That
    process parses the tools' traffic: its messages are matched as text, never
    unmarshalled here."""
    sock.set_inheritable(False)
    with sock:
        while True:
            try:
                data = sock.recv(512)
            except OSError:
                return
            if not data:
                return
            said = _ADMISSION.fullmatch(data)
            if said is not None and 0 < int(said[2]) < 65536:
                server.admit((said[1].decode(), int(said[2])), said[4].decode(), int(said[3]),
                             said[5].decode())
            try:
                sock.send(b"ok" if said is not None else b"no")
            except OSError:
                return


def policy_error(policy: "Policy", exc: "CredentialError") -> "PolicyError":
    """A CredentialError found when a run starts, named like a policy error."""
    from ..errors import PolicyError

    key = "credentials" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in exc.key)
    return PolicyError(str(exc), source=policy.source, key=key)


def prepare(policy: "Policy", report: Optional[Callable[[str], None]] = None,
            given: Optional[Mapping[str, str]] = None,
            pins: Optional[Sequence[tuple[str, str]]] = None, remote: bool = False) -> Routes:
    """The route server of a policy with ``[credentials]``, listening but not yet serving,
    for :func:`sandlock.compile.compiler.compile_policy`, which grants its port. Every
    executor gets its routes here: `sandlock run` and `trace` (a thread of the launcher),
    the API (``remote``: a process of its own, never the agent's), `sandlock probe`
    (its canary as ``given`` secrets, with ``pins`` instead of the policy's ``hosts``).
    ``given`` are secrets passed from Python; they take precedence over from_env and
    from_file."""
    from ..policy.credentials import CredentialError

    if given is not None and not (isinstance(given, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in given.items())):
        raise TypeError(f"credentials must be a mapping of str to str, not {type(given).__name__}")
    try:
        return Routes(policy.credentials, policy.paths,
                      policy.network.hosts if pins is None else pins, os.environ,
                      report or (lambda _message: None), given, remote=remote)
    except CredentialError as exc:
        raise policy_error(policy, exc) from None


@contextmanager
def serving(routes: Routes, cmd: "Command") -> Iterator["Command"]:
    """One run of a compiled policy with routes (:func:`sandlock.exec.launcher.run`,
    `sandlock probe`): the command with the tool's environment rewritten, the route
    serving until the ``with`` ends (then stopped: its placeholders die with the run).

    The acceptor thread starts before the tool is forked; it only waits in accept(2),
    holding no lock the forked child could need, and nothing connects before the tool
    exists."""
    with routes:
        env = routes.session.environment(dict(cmd.env))
        routes.start()
        # type(cmd): a command like the caller's (this module sits beside the launcher)
        yield type(cmd)(cmd.executable, cmd.argv, tuple(env.items()), cmd.cwd)


def call_session(routes: Routes, policy: "Policy", given: Mapping[str, str]) -> Session:
    """For one call of a :class:`sandlock.Sandbox` with ``credentials=``: fresh
    placeholders bound to the Sandbox's secrets overridden by ``given``, valid until
    the session is closed (when the call ends). The call's tool gets these placeholders
    only, so the route attaches the call's secrets to the call's requests only."""
    from ..policy.credentials import CredentialError, secrets_for

    if not (isinstance(given, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in given.items())):
        raise TypeError(f"credentials must be a mapping of str to str, not {type(given).__name__}")
    try:
        secrets = secrets_for(policy.credentials, policy.paths, {},
                              {**routes.session.secrets, **given})
    except CredentialError as exc:
        raise policy_error(policy, exc) from None
    session: Session = routes.server.session(secrets)
    return session
