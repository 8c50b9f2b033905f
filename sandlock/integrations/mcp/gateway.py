"""``sandlock mcp``: put any stdio MCP server behind sandlock, one policy per tool.

The gateway is the agent's side: it runs unconfined, speaks MCP to the client on its own
stdin/stdout, and starts the server only inside sandboxes, every time:

* the handshake (``initialize``) and everything that is not a tool call (``tools/list``,
  resources, prompts, ``ping``) go to one confined *listing* instance, under the registry's
  ``listing`` entry, or ``default`` when there is none;
* ``tools/call`` of tool NAME runs under the registry entry ``NAME`` (``NAME.toml`` or
  ``[tools.NAME]``), else ``default``; a tool with neither is refused with an MCP error
  naming it, never run under some other policy, and so is a name that is no entry but
  reads as one to a loose server (``READ`` beside ``read``) and a call whose params hold
  ``name`` in another case beside it (Go's encoding/json reads that one);
* the entry's ``[mcp] isolation`` chooses how: ``"call"`` (the default) starts a fresh
  confined instance for the call (initialize it, call, stop it), so no call sees another's
  state and concurrent calls never share one; ``"tool"`` keeps one instance per entry warm
  and sends it every call of the tools under it (ids remapped); one that exits is replaced
  at the next call, and it lives at most its policy's ``limits.timeout``.

Everything a server writes is hostile input (:mod:`.wire`): each message is bounded, parsed
as JSON and classified by shape; a server that writes anything else on stdout is stopped
and the calls waiting on it get an error, and so is one that writes a message holding a key
that reads as one of JSON-RPC's regardless of case (``ID`` beside or instead of ``id``): a
client decoding keys that way (Go's encoding/json) reads another message than the gateway
does. Its stderr reaches the gateway's stderr one escaped line at a time. A message is
relayed rebuilt from its own members, re-encoded: a response from its ``result`` or
``error``, under the client's id; a notification from its ``method`` and ``params``, in
either direction; nothing else its sender added. A server speaks for its own requests
only (:meth:`Instance._accepted`): progress on a token of a request in flight on it, log
messages named after it, list changes and resource updates from the listing instance.
Requests from a server to the client (sampling, roots, elicitation) are answered "method
not found" and not relayed, and a server's message with a method and no id that is no MCP
notification (``notifications/...``) is dropped.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import select
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence

from ...errors import SandlockError
from ...trace.emit import printable
from . import wire

if TYPE_CHECKING:
    from ...api.registry import Registry
    from ...api.sandbox import Process, Sandbox

#: The registry entries with a meaning of their own (see the module's docstring).
LISTING = "listing"
DEFAULT = "default"
#: Tool calls running at once; later ones wait for a slot.
MAX_CALLS = 16
#: A server's stderr line is shown up to this many characters.
MAX_STDERR_LINE = 2000
#: How long a new instance may take to answer ``initialize`` (a server's start-up).
START_TIMEOUT = 120.0
#: How long a stopped instance gets to exit after its stdin closes, before it is killed.
STOP_GRACE = 0.5
#: How long a write to a server may wait for it to read (its stdin pipe full): past it the
#: server is stopped. A server that never read its input held the write lock for ever, and
#: the gateway's one thread reading the client blocked behind it (a notification for it).
WRITE_TIMEOUT = 10.0
#: Notifications from the client queued for one server (beyond, they are dropped): they
#: are written by a thread of the instance's, never by the one reading the client.
NOTIFY_QUEUE = 256
#: The prefix of every notification MCP defines; a notification without it is dropped,
#: either way: a server that dispatches on the method alone would run a client's
#: ``tools/call`` sent as one, in the listing instance, under the listing policy; a client
#: that does would take a server's ``elicitation/create`` for a request from the gateway.
NOTIFICATION = "notifications/"


class ServerFailed(Exception):
    """The instance cannot answer (it exited, or broke the protocol): the reason."""


def _token(value: Any) -> Optional[tuple[str, Any]]:
    """A progress token as it is compared (MCP's are strings or integers; ``1`` and ``"1"``
    and ``true`` are three things), or None if it is none."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return type(value).__name__, value
    return None


class _Pending:
    """A client's request in flight, for its cancellation: ``cancelled`` once the client
    cancels it; ``target``, the instance and id its request has there, once it has one
    (a call's ``initialize`` first, then the call itself)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.target: Optional[tuple["Instance", int]] = None


class _Write:
    """Bytes for a server, queued: ``done`` once written or given up (``error``); a
    request's id and slot, which a write given up ends."""

    def __init__(self, data: bytes, note: bool,
                 request: Optional[tuple[int, "_Slot"]] = None) -> None:
        self.data, self.note, self.request = data, note, request
        self.done = threading.Event()
        self.error: Optional[str] = None


class _Slot:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.response: Optional[dict[str, Any]] = None
        self.why: Optional[str] = None  #: why it is done without a response


class Instance:
    """One confined server process and the requests waiting on it."""

    def __init__(self, box: Sandbox, argv: Sequence[str], label: str,
                 notify_client: Callable[[dict[str, Any]], None], stderr: IO[str],
                 listing: bool = False, logger: Optional[str] = None) -> None:
        from ...api.sandbox import PIPE

        self.label = label
        #: who its log messages are from, in a form no tool or logger name can take
        self.logger = logger or json.dumps(label)
        self.listing = listing  #: the listing instance: it alone speaks of lists and resources
        self._notify_client = notify_client
        self._stderr = stderr
        self.process: Process = box.popen(list(argv), stdin=PIPE, stdout=PIPE, stderr=PIPE)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._waiting: dict[int, _Slot] = {}
        #: the progress tokens of the requests in flight here (their ids on this instance)
        self._tokens: dict[int, tuple[str, Any]] = {}
        self._outbox: Optional[queue.Queue[Optional[_Write]]] = None
        self._queued = 0  #: notifications queued and not yet written (under _lock)
        self._closing = False  #: stop() began: nothing more is queued
        self.failed: Optional[str] = None
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._relay_stderr, daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- to the server

    def _send(self, message: dict[str, Any]) -> None:
        """Write ``message`` to the server, in turn after everything sent before it, and
        wait until it is written: at most :data:`WRITE_TIMEOUT` for the server to read,
        past which it is stopped (ServerFailed)."""
        item = self._queue(wire.encode(message), note=False)
        item.done.wait()
        if item.error is not None:
            raise ServerFailed(item.error)

    def notify_soon(self, message: dict[str, Any]) -> None:
        """Send a notification in turn, without waiting for the server to read it (the
        thread that reads the client waited up to WRITE_TIMEOUT on a server that read
        nothing); dropped when NOTIFY_QUEUE of them wait already, or the server is gone."""
        try:
            self._queue(wire.encode(message), note=True)
        except ServerFailed:
            pass

    def _queue(self, data: bytes, note: bool,
               request: Optional[tuple[int, _Slot]] = None) -> "_Write":
        """Everything written to the server goes through one queue and one writer thread,
        in the order it was sent: a notification never waits, and never overtakes or is
        overtaken by a request."""
        item = _Write(data, note, request)
        with self._lock:
            if self.failed is not None or self._closing:
                raise ServerFailed(self.failed or "was stopped")
            if note and self._queued >= NOTIFY_QUEUE:
                item.done.set()
                return item
            if self._outbox is None:
                self._outbox = queue.Queue()
                writer = threading.Thread(target=self._post, args=(self._outbox,), daemon=True)
                self._threads.append(writer)
                writer.start()
            self._queued += note
            self._outbox.put(item)
        return item

    def _post(self, outbox: "queue.Queue[Optional[_Write]]") -> None:
        while (item := outbox.get()) is not None:
            try:
                with self._write_lock:
                    self._write(item.data)
            except ServerFailed as exc:
                item.error = str(exc)
            finally:
                with self._lock:
                    self._queued -= item.note
                    if item.error is not None and item.request is not None:
                        id, slot = item.request  # its call ends (unless it ended already)
                        if self._waiting.pop(id, None) is slot:
                            self._tokens.pop(id, None)
                            slot.why = item.error
                            slot.done.set()
                item.done.set()

    def _write(self, data: bytes) -> None:
        """:meth:`_send`'s write, the write lock held."""
        stdin = self.process.stdin
        if stdin is None or stdin.closed:
            raise ServerFailed(self.failed or "was stopped")
        try:
            stdin.flush()  # nothing is buffered: every write is flushed
            fd = stdin.fileno()
            os.set_blocking(fd, False)
            writable = select.poll()  # not select(): the gateway may hold 1024 descriptors
            writable.register(fd, select.POLLOUT)
            view, deadline = memoryview(data), time.monotonic() + WRITE_TIMEOUT
            while view:
                left = deadline - time.monotonic()
                if left <= 0 or not writable.poll(int(left * 1000) + 1):
                    self._stuck()
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    continue
        except (OSError, ValueError):
            raise ServerFailed(self.failed or "stopped reading its input") from None

    def _stuck(self) -> NoReturn:
        """A server that read nothing for :data:`WRITE_TIMEOUT`: stopped, and said so."""
        with self._lock:
            if self.failed is None:
                self.failed = f"read none of its input for {WRITE_TIMEOUT:g} s"
        self.process.kill()
        raise ServerFailed(self.failed or "stopped reading its input")

    def start(self, method: str, params: Optional[dict[str, Any]]) -> tuple[int, _Slot]:
        """Send a request; its id on this instance, and the slot its response arrives in.
        Queued, not waited for: a write the server does not read in time ends the slot,
        and so does the client's cancellation meanwhile (a call waiting on the write could
        not be cancelled for WRITE_TIMEOUT)."""
        slot = _Slot()
        with self._lock:
            if self.failed is not None:
                raise ServerFailed(self.failed)
            id = next(self._ids)
            self._waiting[id] = slot
            meta = params.get("_meta") if isinstance(params, dict) else None
            token = _token(meta.get("progressToken")) if isinstance(meta, dict) else None
            if token is not None:
                self._tokens[id] = token
        try:
            self._queue(wire.encode(wire.request(id, method, params)), False, (id, slot))
        except ServerFailed:
            with self._lock:
                self._waiting.pop(id, None)
                self._tokens.pop(id, None)
            raise
        return id, slot

    def wait(self, slot: _Slot, timeout: Optional[float] = None) -> dict[str, Any]:
        if not slot.done.wait(timeout):
            raise ServerFailed(f"did not answer within {timeout:g} s")
        if slot.response is None:
            raise ServerFailed(slot.why or self.failed or "stopped")
        return slot.response

    def cancel(self, id: int) -> None:
        """Stop waiting for the answer to ``id``: the client cancelled it. A server that
        never answers kept the call's slot (one of :data:`MAX_CALLS`) for ever; a call's
        own instance is stopped as the call ends, a warm one keeps serving."""
        with self._lock:
            slot = self._waiting.pop(id, None)
            self._tokens.pop(id, None)
        if slot is not None:
            slot.why = "was cancelled by the client"
            slot.done.set()

    def request(self, method: str, params: Optional[dict[str, Any]],
                timeout: Optional[float] = None) -> dict[str, Any]:
        return self.wait(self.start(method, params)[1], timeout)

    def initialize(self, params: dict[str, Any],
                   started: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
        """The handshake: ``initialize`` then ``notifications/initialized``; its response.
        ``started`` is told the id of ``initialize`` here (so that it can be cancelled)."""
        id, slot = self.start("initialize", params)
        if started is not None:
            started(id)
        response = self.wait(slot, START_TIMEOUT)
        if "error" in response:
            raise ServerFailed(f"refused to initialize: {printable(str(response['error']))[:200]}")
        self.notify_soon(wire.notification("notifications/initialized"))
        return response

    # -- from the server

    def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        reason = None
        try:
            for line in wire.lines(stdout.fileno()):
                try:
                    message = wire.decode(line)
                except ValueError:
                    reason = "wrote a line that is not JSON on its stdout"
                    break
                kind = wire.kind(message)
                if kind == "response":
                    with self._lock:
                        slot = self._waiting.pop(message["id"], None)
                        self._tokens.pop(message["id"], None)
                    if slot is not None:  # an id the gateway never sent: dropped
                        slot.response = message
                        slot.done.set()
                elif kind == "notification":
                    if message["method"].startswith(NOTIFICATION):
                        note = self._accepted(message)
                        if note is not None:
                            self._notify_client(note)
                elif kind == "request":
                    self._send(wire.error(message["id"], wire.METHOD_NOT_FOUND,
                                          "the sandlock gateway relays no requests from a server"))
                else:
                    twin = wire.twin(message)
                    reason = ("wrote a message that is not JSON-RPC on its stdout" if twin is None
                              else f"wrote a message holding {printable(repr(twin))[:100]}, which "
                                   "a client reading keys regardless of case (Go's encoding/json) "
                                   "reads as a JSON-RPC member")
                    break
        except wire.TooLarge as exc:
            reason = f"wrote {exc}"
        except (OSError, ServerFailed):
            pass
        self._fail(reason)

    def _accepted(self, message: dict[str, Any]) -> Optional[dict[str, Any]]:
        """A server's notification as the client gets it, or None: dropped. A server speaks
        for its own requests only: progress on a token of a request in flight here; a log
        message named after this instance (its own logger name after it); list changes and
        resource updates from the listing instance alone; no other notification of MCP's
        (a server's ``cancelled`` names a request of its own to the client, which the
        gateway never relays)."""
        method, params = message["method"], message.get("params")
        note = wire.relayed(message)
        if method == "notifications/progress":
            token = _token(params.get("progressToken")) if isinstance(params, dict) else None
            with self._lock:
                ours = token is not None and token in self._tokens.values()
            return note if ours else None
        if method == "notifications/message":
            if isinstance(params, dict):
                logger = params.get("logger")
                named = f"{self.logger}: {json.dumps(logger)}" if isinstance(logger, str) \
                    and logger else self.logger
                note = {**note, "params": {**params, "logger": named}}
            return note
        if method.startswith("notifications/") and not (
                self.listing and (method.endswith("/list_changed")
                                  or method == "notifications/resources/updated")):
            return None
        return note

    def _fail(self, reason: Optional[str]) -> None:
        if reason is not None:
            self.process.kill()
        try:
            status = self.process.wait(timeout=5)
        except SandlockError:
            self.process.kill()
            status = self.process.wait()
        with self._lock:
            if self.failed is None:
                self.failed = reason or f"exited (status {status})"
            waiting, self._waiting = self._waiting, {}
            self._tokens.clear()
        for slot in waiting.values():
            slot.done.set()

    def _relay_stderr(self) -> None:
        stderr = self.process.stderr
        assert stderr is not None
        pending = b""
        fd = stderr.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *done, pending = (pending + chunk).split(b"\n")
            pending = pending[-MAX_STDERR_LINE * 4:]  # a line never ending is cut, not kept
            for line in done:
                self._say(line)
        if pending:
            self._say(pending)

    def _say(self, line: bytes) -> None:
        text = printable(line.decode("utf-8", "replace")[:MAX_STDERR_LINE])
        try:
            self._stderr.write(f"sandlock mcp: [{printable(self.label)}] {text}\n")
            self._stderr.flush()
        except (OSError, ValueError):
            pass

    # -- the end

    def stop(self) -> None:
        """Close its stdin (MCP's stdio shutdown), then kill its tree if it is still there.
        (Only the reader thread waits for the process: one waiter on its supervisor.)"""
        with self._lock:
            self._closing = True
            if self._outbox is not None:
                self._outbox.put(None)  # the writer's end, once what is queued is written
        if self._write_lock.acquire(timeout=STOP_GRACE):
            try:
                stdin = self.process.stdin
                if stdin is not None and not stdin.closed:
                    try:
                        stdin.close()
                    except OSError:
                        pass
            finally:
                self._write_lock.release()
        else:  # a write is stuck on a server that does not read: kill it to end the write
            self.process.kill()
        self._threads[0].join(timeout=STOP_GRACE)
        if self._threads[0].is_alive():
            self.process.kill()
        for thread in self._threads:
            thread.join(timeout=10)


def _ambiguous(params: dict[str, Any]) -> Optional[str]:
    """A key of a tools/call's ``params`` that is ``name`` in another case (or None)."""
    return next((key for key in params if key != "name" and key.casefold() == "name"), None)


def _folded(name: str) -> str:
    """``name`` as a server that looks tools up loosely may read it: NFKC, case-folded,
    without surrounding white space."""
    import unicodedata

    return unicodedata.normalize("NFKC", name).casefold().strip()


class Gateway:
    """The client's server: reads the client's messages, answers them from confined instances."""

    def __init__(self, registry: Registry, argv: Sequence[str], *,
                 variables: Optional[dict[str, str]] = None,
                 stdout: Optional[IO[bytes]] = None, stderr: Optional[IO[str]] = None) -> None:
        self.registry = registry
        self.argv = tuple(argv)
        self.variables = dict(variables or {})
        self._out = stdout if stdout is not None else sys.stdout.buffer
        self._err = stderr if stderr is not None else sys.stderr
        self._out_lock = threading.Lock()
        self._lock = threading.Lock()
        self._warm_lock = threading.Lock()  #: held to read or change ``_warm``
        #: one per entry, held while its warm instance starts (only its own calls wait)
        self._warm_starts: dict[str, threading.Lock] = {}
        self._calls = threading.BoundedSemaphore(MAX_CALLS)
        self._init: Optional[dict[str, Any]] = None
        self._listing: Optional[Instance] = None
        self._warm: dict[str, Instance] = {}
        self._warned: set[str] = set()  #: entries whose unenforced protections were said
        #: client id -> a request in flight (for cancellation)
        self._inflight: dict[wire.Id, _Pending] = {}
        self._workers: list[threading.Thread] = []
        self.listing_entry = LISTING if LISTING in registry else DEFAULT
        if self.listing_entry not in registry:
            raise SandlockError(
                f"{registry.source}: no {LISTING!r} or {DEFAULT!r} entry: the handshake and "
                "tools/list need a policy to run the server under")
        self.registry.sandbox(self.listing_entry, self.variables)  # policy errors now, not later

    # -- the client

    def send(self, message: dict[str, Any]) -> None:
        data = wire.encode(message)
        with self._out_lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (OSError, ValueError):
                pass  # the client is gone; the input loop ends on its end of file

    def serve(self, fd: int = 0) -> None:
        """Answer the client on ``fd`` until it closes it; then stop every instance."""
        try:
            for line in wire.lines(fd):
                self._dispatch(line)
        except wire.TooLarge as exc:
            self._say(f"the client {exc}; closing")
        finally:
            self.close()

    def _dispatch(self, line: bytes) -> None:
        try:
            message = wire.decode(line)
        except ValueError:
            self.send(wire.error(None, wire.PARSE_ERROR, "not JSON"))
            return
        kind = wire.kind(message)
        if kind == "request":
            self._request(message)
        elif kind == "notification":
            self._notification(message)
        elif kind == "invalid":
            id = message.get("id") if isinstance(message, dict) else None
            self.send(wire.error(id if wire.valid_id(id) else None, wire.INVALID_REQUEST,
                                 "not a JSON-RPC 2.0 message (batches are not part of MCP)"))
        # a response: to a server's request, which the gateway never relays

    def _request(self, message: dict[str, Any]) -> None:
        id, method = message["id"], message["method"]
        params = message.get("params")
        if method == "initialize":
            self._initialize(id, params or {})
            return
        if self._listing is None:
            self.send(wire.error(id, wire.INVALID_REQUEST, "initialize first"))
            return
        target = self._call if method == "tools/call" else self._forward
        worker = threading.Thread(target=target, args=(id, method, params), daemon=True)
        self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def _notification(self, message: dict[str, Any]) -> None:
        if not message["method"].startswith(NOTIFICATION):
            return  # JSON-RPC answers no notification, refused or not
        if message["method"] == "notifications/cancelled":
            params = message.get("params") or {}
            request = params.get("requestId")
            with self._lock:
                pending = self._inflight.get(request) if wire.valid_id(request) else None
                target = None
                if pending is not None:
                    pending.cancelled.set()
                    target = pending.target
            if target is not None:
                instance, id = target
                instance.cancel(id)
                instance.notify_soon(wire.notification(
                    "notifications/cancelled", {**params, "requestId": id}))
            return
        if message["method"] == "notifications/initialized":
            return  # each instance gets its own from the gateway's handshake
        if self._listing is not None:
            self._listing.notify_soon(wire.relayed(message))

    @staticmethod
    def _quietly(send: Callable[[dict[str, Any]], None], message: dict[str, Any]) -> None:
        try:
            send(message)
        except ServerFailed:
            pass

    # -- instances

    def _instance(self, entry: str, label: str, listing: bool = False,
                  logger: Optional[str] = None) -> Instance:
        """A new instance under ``entry``; ``logger`` names its log messages (JSON strings
        quote the names a client or server chose: a tool named ``good/status`` or
        ``listing``, a logger name with control characters, read as no other)."""
        box = self.registry.sandbox(entry, self.variables)
        self._warn(entry, box)
        return Instance(box, self.argv, label, self.send, self._err, listing, logger)

    def _warn(self, entry: str, box: Sandbox) -> None:
        """Say, once per entry, what its policy relies on and this kernel does not enforce
        (a best-effort policy, or gaps it accepts), as `sandlock run` does before each run:
        the gateway's stderr is where the client's user reads it. A per-user process limit
        is left to `explain` and `check`, as `run` leaves it unless it can bite."""
        from ...linux.process import PER_USER_LIMIT

        with self._lock:
            if entry in self._warned:
                return
            self._warned.add(entry)
        lines = [line for line in box.warnings if not line.startswith(PER_USER_LIMIT)]
        if lines:
            self._say(f"[{entry}] warning: NOT enforced for this caller on this kernel "
                      f"(Landlock ABI {box.abi}):")
            for line in lines:
                self._say(f"[{entry}] warning:   - {line}")

    def _initialize(self, id: wire.Id, params: dict[str, Any]) -> None:
        if self._init is not None:
            self.send(wire.error(id, wire.INVALID_REQUEST, "already initialized"))
            return
        self._init = params
        try:
            self._listing = self._instance(self.listing_entry, LISTING, listing=True,
                                           logger="listing")
            self.send(wire.answer(id, self._listing.request("initialize", params, START_TIMEOUT)))
            self._listing.notify_soon(wire.notification("notifications/initialized"))
        except (SandlockError, ServerFailed) as exc:
            self._init = None
            if self._listing is not None:
                self._listing.stop()
                self._listing = None
            self.send(wire.error(id, wire.SERVER_FAILED, f"the server could not start: {exc}"))

    def _forward(self, id: wire.Id, method: str, params: Optional[dict[str, Any]]) -> None:
        assert self._listing is not None
        self._relay(self._listing, id, method, params, "the server")

    def _relay(self, instance: Instance, id: wire.Id, method: str,
               params: Optional[dict[str, Any]], who: str,
               pending: Optional[_Pending] = None) -> None:
        own = pending is None
        pending = self._track(id) if pending is None else pending
        try:
            mine, slot = instance.start(method, params)
            self._aim(pending, instance, mine)
            self.send(wire.answer(id, instance.wait(slot)))
        except ServerFailed as exc:
            self.send(wire.error(id, wire.SERVER_FAILED, f"{who} {exc}"))
        finally:
            if own:
                self._untrack(id, pending)

    def _track(self, id: wire.Id) -> _Pending:
        """A client's request, cancellable from now on."""
        pending = _Pending()
        with self._lock:
            self._inflight[id] = pending
        return pending

    def _untrack(self, id: wire.Id, pending: _Pending) -> None:
        with self._lock:
            if self._inflight.get(id) is pending:
                del self._inflight[id]

    def _aim(self, pending: _Pending, instance: Instance, mine: int) -> None:
        """The request is ``mine`` on ``instance`` now: a cancellation goes there (one that
        came before is passed on at once)."""
        with self._lock:
            pending.target = (instance, mine)
            cancelled = pending.cancelled.is_set()
        if cancelled:
            instance.cancel(mine)

    @staticmethod
    def _wait_for(lock: Any, pending: _Pending) -> None:
        """``lock`` acquired, or ServerFailed once the client cancels the request: no wait
        of a call (for a slot, for its tool's start) is beyond the client's reach."""
        while not lock.acquire(timeout=0.2):
            if pending.cancelled.is_set():
                raise ServerFailed("was cancelled by the client")

    def _look_alike(self, tool: str) -> Optional[str]:
        """The registry entry ``tool`` is not but reads as (:func:`_folded`), or None: a
        server that looks tools up loosely would run that entry's tool under ``default``."""
        if tool in self.registry:
            return None
        folded = _folded(tool)
        return next((name for name in self.registry.names if _folded(name) == folded), None)

    def entry(self, tool: str) -> Optional[str]:
        """The registry entry a call of ``tool`` runs under, or None: refused."""
        if tool in self.registry and tool != LISTING:
            return tool
        return DEFAULT if DEFAULT in self.registry else None

    def _call(self, id: wire.Id, method: str, params: Optional[dict[str, Any]]) -> None:
        name = (params or {}).get("name")
        if not isinstance(name, str):
            self.send(wire.error(id, wire.INVALID_PARAMS, "tools/call needs a tool name"))
            return
        twin = _ambiguous(params or {})
        if twin is not None:
            self.send(wire.error(id, wire.INVALID_PARAMS,
                                 f"tools/call params hold {printable(repr(twin))[:100]} beside "
                                 "'name': a server reading keys regardless of case (Go's "
                                 "encoding/json) would run another tool than the one whose "
                                 "policy applies; refused"))
            return
        entry = self.entry(name)
        if entry is None:
            self.send(wire.error(id, wire.TOOL_REFUSED,
                                 f"tool {name!r} has no policy in the sandlock registry "
                                 f"(no [tools.{name}], no default): refused"))
            return
        like = self._look_alike(name)
        if like is not None:
            self.send(wire.error(id, wire.TOOL_REFUSED,
                                 f"tool {name!r} is not {like!r} but reads as it to a server "
                                 "that ignores case, spaces or Unicode forms: refused"))
            return
        who = f"the server of tool {name!r}"
        pending = self._track(id)
        try:
            self._wait_for(self._calls, pending)
        except ServerFailed as exc:
            self._untrack(id, pending)
            self.send(wire.error(id, wire.SERVER_FAILED, f"{who} {exc}"))
            return
        try:
            self._serve_call(entry, name, id, method, params, who, pending)
        finally:
            self._calls.release()
            self._untrack(id, pending)

    def _serve_call(self, entry: str, name: str, id: wire.Id, method: str,
                    params: Optional[dict[str, Any]], who: str, pending: _Pending) -> None:
        try:
            isolation = self.registry.sandbox(entry, self.variables).policy.mcp_isolation
            instance = self._warm_instance(entry, pending) if isolation == "tool" else None
            fresh = instance is None
            if instance is None:
                instance = self._instance(entry, name, logger=f"tool {json.dumps(name)}")
        except (SandlockError, ServerFailed) as exc:
            self.send(wire.error(id, wire.SERVER_FAILED, f"{who} could not start: {exc}"))
            return
        try:
            if fresh:
                assert self._init is not None
                instance.initialize(self._init, lambda mine: self._aim(pending, instance, mine))
            self._relay(instance, id, method, params, who, pending)
        except ServerFailed as exc:
            self.send(wire.error(id, wire.SERVER_FAILED, f"{who} {exc}"))
        finally:
            if fresh:
                instance.stop()

    def _warm_instance(self, entry: str, pending: _Pending) -> Instance:
        """The entry's warm instance, started if need be: while it starts, only the calls of
        the same entry wait (each as long as its client lets it)."""
        with self._warm_lock:
            starting = self._warm_starts.setdefault(entry, threading.Lock())
        self._wait_for(starting, pending)
        try:
            with self._warm_lock:
                instance = self._warm.get(entry)
            if instance is not None and instance.failed is None:
                return instance
            if instance is not None:
                instance.stop()
            instance = self._instance(entry, f"{entry} (warm)",
                                      logger=f"entry {json.dumps(entry)}")
            try:
                assert self._init is not None
                instance.initialize(self._init, lambda mine: self._aim(pending, instance, mine))
            except ServerFailed:
                instance.stop()
                raise
            with self._warm_lock:
                self._warm[entry] = instance
            return instance
        finally:
            starting.release()

    def _say(self, text: str) -> None:
        try:
            self._err.write(f"sandlock mcp: {printable(text)}\n")
            self._err.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        for worker in self._workers:
            worker.join(timeout=1)
        with self._warm_lock:
            instances = list(self._warm.values())
            self._warm.clear()
        if self._listing is not None:
            instances.append(self._listing)
        for instance in instances:
            instance.stop()
