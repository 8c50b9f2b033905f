"""A loopback TCP server for one run's tool: one thread per connection, a cap on them,
and a stop that leaves nothing behind. The base of the host-allowlist proxy
(:mod:`sandlock.net.proxy`) and the credential route server (:mod:`sandlock.net.routes`).

It listens from construction (its port goes into the tool's policy and environment
before the tool starts) and serves after :meth:`LoopbackServer.start`. The tool may
open connections until a descriptor runs out: at most :data:`MAX_CLIENTS` are served at
once. When that many are open, a new connection takes the place of the oldest one that
has not yet sent its request (its head; to the route server, its body too: a body sent a
byte at a time would hold a slot for ever) and holds a slot only until then;
if every one has, the new one is closed at once. Either is reported once per server.
Under the API one route server serves every call of a Sandbox: this is what keeps one
call from starving another's requests by holding idle connections.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, Optional

#: Connections served at once per server; more are closed and reported.
MAX_CLIENTS = 256
#: Distinct refusal lines reported per run (a tool could vary them without end).
MAX_REPORTS = 100


class LoopbackServer:
    """Subclasses define :meth:`_serve` (one connection, in its own thread; it ends with
    :meth:`_done`), :attr:`name` (of its threads) and :attr:`what` (in reports)."""

    name = "sandlock-server"
    what = "server"

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report = report
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(1024)
        self.address: tuple[str, int] = self._listener.getsockname()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        #: Connections that have not sent their request head yet, oldest first.
        self._idle: dict[socket.socket, None] = {}
        self._reported: set[str] = set()
        self._acceptor: Optional[threading.Thread] = None
        self._closing = False

    @property
    def port(self) -> int:
        return self.address[1]

    def start(self) -> None:
        self._acceptor = threading.Thread(target=self._accept_loop, name=self.name, daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        """Stop accepting, cut every open connection, wait for every thread."""
        with self._lock:
            self._closing = True
            sockets = list(self._open)
            self._on_stop()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._acceptor is not None:
            self._acceptor.join()
        self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    def _on_stop(self) -> None:
        """Called under the lock as the server stops (forget per-run state)."""

    def _unserved(self, client: socket.socket) -> None:
        """Called for a connection closed at once, never served (the server is full)."""

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ plumbing

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            evicted: Optional[socket.socket] = None
            with self._lock:
                if self._closing:
                    client.close()
                    return
                full = len(self._threads) >= MAX_CLIENTS
                if full and self._idle:  # the oldest one still silent makes room
                    evicted = next(iter(self._idle))
                    del self._idle[evicted]
                    full = False
                if not full:
                    self._open.add(client)
                    self._idle[client] = None
                    thread = threading.Thread(target=self._serve, args=(client,), daemon=True,
                                              name=f"{self.name}-conn")
                    self._threads.add(thread)
            if evicted is not None:
                try:  # its thread sees EOF and ends; the slot is the new connection's
                    evicted.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._report_once(f"network: the {self.what} let an idle connection go: "
                                  f"{MAX_CLIENTS} are open (the limit per server)")
            if full:
                self._unserved(client)
                client.close()
                self._report_once(f"network: refused a connection to the {self.what}: "
                                  f"{MAX_CLIENTS} are open (the limit per server)")
                continue
            thread.start()

    def _heard(self, client: socket.socket) -> None:
        """``client`` has sent its request head: no longer the first to let go."""
        with self._lock:
            self._idle.pop(client, None)

    def _track(self, sock: socket.socket) -> bool:
        """Count ``sock`` (an upstream) among the open ones; False when stopping."""
        with self._lock:
            if self._closing:
                return False
            self._open.add(sock)
            return True

    def _swap(self, old: socket.socket, new: socket.socket) -> bool:
        """Count ``new`` in place of ``old`` (a socket that wraps it and took its
        descriptor, which leaves ``old`` unable to cut anything); False when stopping."""
        with self._lock:
            self._open.discard(old)
            if self._closing:
                return False
            self._open.add(new)
            return True

    def _untrack(self, sock: socket.socket) -> None:
        """No longer count ``sock`` (an upstream about to be closed)."""
        with self._lock:
            self._open.discard(sock)

    def _done(self, *socks: Optional[socket.socket]) -> None:
        """The end of one connection's thread: close its sockets, forget the thread."""
        with self._lock:
            for sock in socks:
                if sock is not None:
                    self._open.discard(sock)
                    self._idle.pop(sock, None)
                    sock.close()
            self._threads.discard(threading.current_thread())

    def _report_once(self, message: str) -> bool:
        """Report ``message`` unless it was already (or too many were); True if it was new."""
        with self._lock:
            if message in self._reported or len(self._reported) > MAX_REPORTS:
                return False
            self._reported.add(message)
        self.report(message)
        return True
