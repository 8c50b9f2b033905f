"""The one HTTP/1.1 layer of the host-allowlist proxy and the credential route server.

Both servers read bytes the confined tool controls; the route server also holds the
secrets. Everything that reads or writes HTTP for them is here: the request head (read
with a size bound, a header count bound and a deadline), its grammar and body framing,
the body (``Content-Length`` or chunked, bounded), the upstream's response, and the
answers and errors they write. Neither server frames a message by hand.

The grammar is `h11 <https://h11.readthedocs.io>`_'s (RFC 9110/9112: request line,
token header names, ``Content-Length`` digits, one chunked coding, chunk sizes and
their CRLFs). h11 is lenient where a server that forwards a request must not be: it
unfolds obs-fold lines, takes a bare LF for a line end, lets control bytes through in
header values and lets ``Transfer-Encoding`` win over a ``Content-Length`` beside it
(RFC 9112 section 6.3: "ought to be handled as an error"). Each of those is
read differently by some server behind the route, which is how a second request is
smuggled past the rules; :func:`read_head` and :func:`parse_request` refuse them
before h11 sees the head.

A body is never forwarded as received: it is decoded here and framed again by h11 for
the upstream (the upstream sees chunk sizes sandlock wrote, never the tool's), and
what follows it on the connection (a pipelined second request) is dropped: one request
per connection.
"""

from __future__ import annotations

import re
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import IO, Any, Callable, Iterable, Iterator, Sequence, TypeVar

try:
    import h11
except ImportError:  # a broken install: say which part is missing, never a traceback
    from ..errors import SetupError

    raise SetupError("[network] allow and [credentials] need the Python package h11 (a "
                     "dependency of sandlock): install it, e.g. pip install 'h11>=0.16'") from None

_Event = TypeVar("_Event", bound="h11.Event")

#: Bytes of a request head (request line and headers), and of an upstream's response head.
HEAD_LIMIT = 64 * 1024
#: Header lines in a request head.
MAX_HEADERS = 100
#: Bytes of a request body (announced or sent); more is 413, never forwarded whole.
BODY_LIMIT = 1 << 30
#: Bytes of a held request body kept in memory; the rest waits in an unnamed temporary file.
BODY_IN_MEMORY = 1 << 20
#: Bytes of request bodies held at once by this process (a run's launcher, a Sandbox's
#: route server), memory and temporary files together: without it, as many bodies as
#: connections (256 of 1 GiB) would fill the disk or, in a tmpfs, the memory.
HELD_LIMIT = BODY_LIMIT
HEAD_TIMEOUT = 30.0  #: seconds a client may take to send its request head
CONNECT_TIMEOUT = 15.0  #: seconds to connect to an upstream
RECEIVE = 65536  #: bytes asked of one recv(2)
LINGER = 2.0  #: seconds an answered connection is drained of what the client still sends
#: Request headers that concern the hop to the proxy or route, never the origin server.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization"})
REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found",
           407: "Proxy Authentication Required", 413: "Content Too Large",
           431: "Request Header Fields Too Large", 501: "Not Implemented", 502: "Bad Gateway",
           503: "Service Unavailable"}
#: Bytes no head line may hold: controls but HTAB, and DEL (RFC 9110 section 5.5).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_END = re.compile(rb"\n\r?\n")


class HttpError(Exception):
    """Answer ``status`` with this message (and forward nothing)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Request:
    """One request head, parsed: ``headers`` as sent (names in their case); its body is
    read with :meth:`body`, the answer written with :meth:`interim` and :meth:`respond`
    (framed for the client's version and method)."""

    __slots__ = ("method", "target", "version", "headers", "_conn", "_sock")

    def __init__(self, method: str, target: str, version: str,
                 headers: list[tuple[str, str]], conn: h11.Connection,
                 sock: socket.socket) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self._conn = conn
        self._sock = sock

    def values(self, name: str) -> list[str]:
        """The values of header ``name`` (any case)."""
        name = name.lower()
        return [v for n, v in self.headers if n.lower() == name]

    def body(self) -> Iterator[bytes]:
        """The body's bytes as they arrive, its framing removed; :class:`HttpError` when
        it is malformed, larger than :data:`BODY_LIMIT` or cut short. Whatever follows it
        on the connection stays unread."""
        total = 0
        while True:
            event = _next(self._conn, self._sock, "request body")
            if isinstance(event, h11.Data):
                total += len(event.data)
                if total > BODY_LIMIT:
                    raise HttpError(413, f"the request body is larger than {BODY_LIMIT} bytes")
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise HttpError(400, "malformed request body")

    @contextmanager
    def held_body(self) -> Iterator[IO[bytes]]:
        """The whole body, read and checked before anything is forwarded (as a reverse
        proxy that buffers requests does): a file at its start, in memory up to
        :data:`BODY_IN_MEMORY` bytes, then an unnamed temporary file, closed when the
        ``with`` ends. A body that is malformed, too large or cut short, or that would
        take the bytes held at once past :data:`HELD_LIMIT`, raises :class:`HttpError`
        here, so its head never leaves. A client waiting for ``100 Continue`` gets it
        first."""
        if self._conn.they_are_waiting_for_100_continue:
            self._send(h11.InformationalResponse(status_code=100, headers=[]))
        held = tempfile.SpooledTemporaryFile(max_size=BODY_IN_MEMORY)
        taken = 0
        try:
            for data in self.body():
                _HELD.take(len(data))
                taken += len(data)
                held.write(data)
            held.seek(0)
            yield held
        finally:
            held.close()
            _HELD.give(taken)

    def interim(self, head: "Head") -> None:
        """An interim (1xx) response head, as the upstream sent it (after the body)."""
        self._send(_head(h11.InformationalResponse, 502, _UNPASSABLE, status_code=head.status,
                         reason=head.reason, headers=list(head.headers)))

    def respond(self, head: "Head", body: Iterable[bytes]) -> None:
        """The response, its body written as it comes (after the request's body)."""
        _message(self._send, _head(h11.Response, 502, _UNPASSABLE, status_code=head.status,
                                   reason=head.reason, headers=list(head.headers)), body)

    def _send(self, event: h11.Event) -> None:
        _emit(self._conn, self._sock, event, 502, _UNPASSABLE)


class _Held:
    """The count of request body bytes held at once in this process (:data:`HELD_LIMIT`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def take(self, count: int) -> None:
        with self._lock:
            if self.count + count > HELD_LIMIT:
                raise HttpError(503, f"request bodies of {HELD_LIMIT} bytes are held at once "
                                "(the limit); send it again later")
            self.count += count

    def give(self, count: int) -> None:
        with self._lock:
            self.count -= count


_HELD = _Held()


class Head:
    """A response head: status, reason phrase, headers (names in their case)."""

    __slots__ = ("status", "reason", "headers")

    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers


def read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(the request head up to and with its blank line, the bytes after it): at most
    :data:`HEAD_LIMIT` bytes and :data:`MAX_HEADERS` lines, every line ended by CRLF, no
    bare CR, no obs-fold, no control byte. :class:`ValueError` when the client closes
    before the head ends (nothing to answer)."""
    data = b""
    while True:
        end = _END.search(data)
        if end is not None:
            break
        if len(data) > HEAD_LIMIT:
            raise HttpError(431, "request head too large")
        chunk = sock.recv(RECEIVE)
        if not chunk:
            raise ValueError("connection closed before the request head ended")
        data += chunk
    head, rest = data[:end.end()], data[end.end():]
    check_head(head)
    return head, rest


def check_head(head: bytes) -> None:
    """Refuse a head that h11 would read one way and another server another way."""
    if len(head) > HEAD_LIMIT + 4:
        raise HttpError(431, "request head too large")
    if not head.endswith(b"\r\n\r\n") or head.count(b"\n") != head.count(b"\r\n") \
            or head.count(b"\r") != head.count(b"\r\n"):
        raise HttpError(400, "malformed request head: every line must end with CRLF "
                        "(a bare LF or CR is refused)")
    lines = head[:-4].split(b"\r\n")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header lines")
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "malformed header line (obs-fold is refused)")
    if any(_CONTROL.search(line) for line in lines):
        raise HttpError(400, "a control character in the request head is refused")


def parse_request(sock: socket.socket, head: bytes, rest: bytes = b"") -> Request:
    """The request in ``head`` (from :func:`read_head`), whose body is ``rest`` and then
    what ``sock`` sends. Refused: anything h11 refuses (request line, header names with
    whitespace before the colon, differing ``Content-Length`` values, a transfer coding
    other than ``chunked``), ``Content-Length`` beside ``Transfer-Encoding``, and an
    announced body over :data:`BODY_LIMIT`. A missing ``Host`` is not refused: neither
    server passes the client's on (the route names its upstream; the proxy sends its
    absolute URL's, after refusing a ``Host`` that names another site), so h11 is given
    an empty one to parse the head, never passed on."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT + 64)
    lines = head.split(b"\r\n")
    synthetic = not any(line.split(b":", 1)[0].lower() == b"host" for line in lines[1:])
    conn.receive_data(head[:-2] + b"Host: \r\n\r\n" if synthetic else head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
        raise HttpError(status, f"malformed request head ({exc})") from None
    if not isinstance(event, h11.Request):
        raise HttpError(400, "malformed request head")
    headers = [(n.decode("ascii"), v.decode("latin-1")) for n, v in event.headers.raw_items()]
    if synthetic:
        headers.pop()
    check_framing(headers)
    if rest:  # (receive_data(b"") would mean the end of the connection)
        conn.receive_data(rest)
    return Request(event.method.decode("ascii"), event.target.decode("latin-1"),
                   f"HTTP/{event.http_version.decode('ascii')}", headers, conn, sock)


def check_framing(headers: list[tuple[str, str]]) -> None:
    """One framing, never two (h11 would let ``Transfer-Encoding`` win; RFC 9112 section
    6.3: a possible smuggling attempt, "ought to be handled as an error"), and no
    announced body over :data:`BODY_LIMIT`."""
    framing = {n.lower() for n, _ in headers} & {"content-length", "transfer-encoding"}
    if len(framing) == 2:
        raise HttpError(400, "Content-Length and Transfer-Encoding together are refused")
    for name, value in headers:
        if name.lower() == "content-length" and int(value) > BODY_LIMIT:
            raise HttpError(413, f"the request body is larger than {BODY_LIMIT} bytes")


def read_request(sock: socket.socket) -> Request:
    """:func:`read_head` then :func:`parse_request`."""
    head, rest = read_head(sock)
    return parse_request(sock, head, rest)


def head_bytes(start: str, headers: Iterable[tuple[str, str]]) -> bytes:
    """A head as sent: the start line, ``Name: value`` lines, the blank line (for the
    proxy, which keeps the client's HTTP version and sends the body it held after it;
    its headers come from :func:`parse_request`)."""
    return (start + "\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers) + "\r\n").encode("latin-1")


def answer(sock: socket.socket, status: int, text: str,
           extra: Sequence[tuple[str, str]] = ()) -> None:
    """A complete plain-text answer that ends the connection (errors, refusals)."""
    body = (text + "\n").encode("utf-8", "replace")
    headers = [*extra, ("Content-Type", "text/plain; charset=utf-8"),
               ("Content-Length", str(len(body))), ("Connection", "close")]
    try:
        sock.sendall(head_bytes(f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}", headers)
                     + body)
        _linger(sock)
    except OSError:
        pass


def _linger(sock: socket.socket) -> None:
    """Half-close, then drain what the client still sends (a body the answer refused), for
    at most :data:`LINGER` seconds: closed with bytes unread, the socket resets the
    connection, and the client may lose the answer (a lingering close, as web servers do)."""
    sock.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + LINGER
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        if not sock.recv(RECEIVE):
            return


# ---------------------------------------------------------------------- to an upstream


class Upstream:
    """One request to an upstream and its response, framed by h11 (the client side)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)

    def send(self, method: str, target: str, headers: Sequence[tuple[str, str]],
             body: Iterable[bytes]) -> None:
        """The request: its head, then its body framed as the head announces (the
        chunk sizes are h11's, never the tool's), then its end."""
        _message(self._send, _head(h11.Request, 400, _UNSENDABLE, method=method, target=target,
                                   headers=list(headers)), body)

    def _send(self, event: h11.Event) -> None:
        _emit(self._conn, self.sock, event, 400, _UNSENDABLE)

    def response(self) -> Head:
        """The next response head (interim 1xx ones first; 101 is refused: nothing but
        HTTP/1.1 passes); :class:`HttpError` 502 when the upstream closes first."""
        event = _next(self._conn, self.sock, "upstream response", status=502)
        if not isinstance(event, (h11.Response, h11.InformationalResponse)) \
                or event.status_code == 101:
            raise HttpError(502, "the upstream closed or switched protocols instead of answering")
        return Head(event.status_code, event.reason.decode("latin-1"),
                    [(n.decode("ascii"), v.decode("latin-1"))
                     for n, v in event.headers.raw_items()])

    def body(self) -> Iterator[bytes]:
        """The response body as it arrives (unbuffered), until its end or the upstream's."""
        while True:
            try:
                event = _next(self._conn, self.sock, "upstream response", status=502)
            except HttpError:
                return  # cut short: the client sees its connection end
            if not isinstance(event, h11.Data):
                return
            yield bytes(event.data)


#: Why a message h11 refuses to write is not sent. Never h11's own text: it quotes the
#: value it refused, in a route's request the header with the secret (a secret that ends
#: with a space reached the tool that way, and the launcher's stderr in a traceback).
_UNSENDABLE = "the request cannot be forwarded as HTTP/1.1"
_UNPASSABLE = "the upstream's response cannot be passed on as HTTP/1.1"


def _head(kind: Callable[..., _Event], status: int, message: str, **fields: Any) -> _Event:
    """The h11 event ``kind(**fields)`` (h11 checks a head as it builds it); an
    :class:`HttpError` ``status`` with ``message`` when h11 refuses it."""
    try:
        return kind(**fields)
    except h11.ProtocolError:
        raise HttpError(status, message) from None


def _emit(conn: h11.Connection, sock: socket.socket, event: h11.Event, status: int,
          message: str) -> None:
    """``event`` framed by ``conn`` onto ``sock``; an :class:`HttpError` ``status`` with
    ``message`` when h11 refuses it."""
    try:
        data = conn.send(event)
    except h11.ProtocolError:
        raise HttpError(status, message) from None
    sock.sendall(data or b"")


def _message(send: Callable[[h11.Event], None], head: h11.Event, body: Iterable[bytes]) -> None:
    """A whole message: ``head``, its body as it comes (h11 frames it as the head
    announces: the chunk sizes are never the peer's), then its end."""
    send(head)
    for data in body:
        if data:
            send(h11.Data(data=data))
    send(h11.EndOfMessage())


def chunks(held: IO[bytes]) -> Iterator[bytes]:
    """The bytes of ``held`` (from :meth:`Request.held_body`), read :data:`RECEIVE` at a time."""
    while data := held.read(RECEIVE):
        yield data


def _next(conn: h11.Connection, sock: socket.socket, what: str, status: int = 400) -> object:
    """The next h11 event of ``conn``, reading ``sock`` as needed (its end included)."""
    while True:
        try:
            event = conn.next_event()
        except h11.ProtocolError as exc:
            raise HttpError(status, f"malformed or incomplete {what} ({exc})") from None
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(sock.recv(RECEIVE))

