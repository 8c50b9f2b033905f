"""The I/O pump of a call: feed its stdin, drain its stdout/stderr (or the result pipe of
``call()``) and read its supervisor's reports, in the caller's thread, without deadlock.

One :class:`_Pump` per call, driven either by ``poll()`` (:meth:`_Pump.run`) or by the
running asyncio loop (:meth:`_Pump.run_async`); no thread is started. What the reports
say is decoded by the call itself (:meth:`sandlock.api.sandbox._Call.receive`); the pump
only collects bytes, up to a limit when one is given.
"""

from __future__ import annotations

import os
import select
import socket
import time

TYPE_CHECKING = False  # importing typing costs milliseconds on the API's first Sandbox()
if TYPE_CHECKING:
    from typing import Any, Callable, Iterable, Mapping, Optional, Protocol
else:
    Protocol = object

#: Bytes read or written per ready fd and turn.
_CHUNK = 1 << 16


class Pumped(Protocol):
    """What the pump needs of a call (``_Call``): its supervisor's socket and its end."""

    @property
    def sock(self) -> socket.socket: ...
    @property
    def ended(self) -> bool: ...
    #: The caller's own end of the call (monotonic), if it has one.
    @property
    def deadline(self) -> Optional[float]: ...
    def receive(self) -> None: ...
    def send(self, message: bytes) -> None: ...
    def expire(self) -> None: ...


def _now() -> float:
    return time.monotonic()


def _earliest(*deadlines: Optional[float]) -> Optional[float]:
    known = [d for d in deadlines if d is not None]
    return min(known) if known else None


class _Pump:
    """Feed stdin, drain stdout/stderr and follow the supervisor, without deadlock.

    Plain handlers driven either by poll() (:meth:`run`) or by an asyncio loop
    (:meth:`run_async`); no thread is started.
    """

    def __init__(self, call: Pumped, writes: Mapping[int, bytes], reads: Iterable[int],
                 limit: Optional[int] = None) -> None:
        self.call = call
        self.writes = {fd: memoryview(data) for fd, data in writes.items()}
        self.reads = {fd: bytearray() for fd in reads}
        self.output: dict[int, bytes] = {}
        self.limit = limit
        self.overflow = False
        self.finished: list[int] = []
        for fd in (*self.writes, *self.reads):
            os.set_blocking(fd, False)

    @property
    def done(self) -> bool:
        return not self.writes and not self.reads and self.call.ended

    def watched(self) -> tuple[list[int], list[int]]:
        reading = list(self.reads)
        if not self.call.ended:
            reading.append(self.call.sock.fileno())
        return reading, list(self.writes)

    def readable(self, fd: int) -> bool:
        """Handle one readable fd; True when it is finished (stop watching it)."""
        if fd == self.call.sock.fileno():
            self.call.receive()
            return self.call.ended
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            return False
        buffer = self.reads[fd]
        if chunk and self.limit is not None and len(buffer) + len(chunk) > self.limit:
            self.overflow = True
            self.call.send(b"K")
            chunk = b""
        if chunk:
            buffer += chunk
            return False
        self.output[fd] = bytes(self.reads.pop(fd))
        self.finished.append(fd)
        return True

    def writable(self, fd: int) -> bool:
        view = self.writes[fd]
        try:
            view = view[os.write(fd, view[:_CHUNK]):]
        except BlockingIOError:
            return False
        except (BrokenPipeError, ConnectionResetError):
            view = view[:0]  # the command stopped reading, as subprocess does: not an error
        self.writes[fd] = view
        if view:
            return False
        del self.writes[fd]
        self.finished.append(fd)
        return True

    def close_finished(self) -> None:
        """Close the fds that reached EOF (only once nothing watches them any more)."""
        for fd in self.finished:
            os.close(fd)
        self.finished.clear()

    def run(self, deadline: Optional[float] = None) -> bool:
        """Drive until done; False if the (monotonic) deadline passed first."""
        while not self.done:
            poller = select.poll()
            reading, writing = self.watched()
            for fd in reading:
                poller.register(fd, select.POLLIN)
            for fd in writing:
                poller.register(fd, select.POLLOUT)
            wait = None
            limit = _earliest(deadline, self.call.deadline)
            if limit is not None:
                left = limit - time.monotonic()
                if left <= 0:
                    if limit == deadline:
                        return False
                    self.expire()
                    break
                wait = int(left * 1000) + 1
            for fd, _events in poller.poll(wait):
                if fd in self.writes:
                    self.writable(fd)
                elif fd in self.reads or fd == self.call.sock.fileno():
                    self.readable(fd)
            self.close_finished()
        return True

    def expire(self) -> None:
        """The call's own deadline passed (see :meth:`_Call.expire`): stop waiting for
        its pipes, keep what was read."""
        self.call.expire()
        for fd, buffer in self.reads.items():
            self.output[fd] = bytes(buffer)
        self.finished.extend([*self.reads, *self.writes])
        self.reads.clear()
        self.writes.clear()

    async def run_async(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        timer: list[Any] = [None, None]  # the handle, the deadline it is armed for

        def arm() -> None:  # the call's own deadline, as it is now
            deadline = self.call.deadline
            if deadline is None or deadline == timer[1]:
                return
            if timer[0] is not None:
                timer[0].cancel()
            timer[:] = [loop.call_later(max(0.0, deadline - _now()), expired), deadline]

        def expired() -> None:
            if not self.done:
                self.expire()
            if not finished.done():
                finished.set_result(None)

        # Only fds still registered are ever removed: a closed fd number may already
        # belong to another task's pipe.
        reading, writing = (set(fds) for fds in self.watched())

        def after(fd: int, done_with_fd: bool, watching: set[int],
                  remove: Callable[[int], bool]) -> None:
            if done_with_fd:
                remove(fd)
                watching.discard(fd)
                self.close_finished()
            if self.done and not finished.done():
                finished.set_result(None)
            arm()

        def on_read(fd: int) -> None:
            after(fd, self.readable(fd), reading, loop.remove_reader)

        def on_write(fd: int) -> None:
            after(fd, self.writable(fd), writing, loop.remove_writer)

        for fd in reading:
            loop.add_reader(fd, on_read, fd)
        for fd in writing:
            loop.add_writer(fd, on_write, fd)
        arm()
        try:
            if not self.done:
                await finished
        finally:
            if timer[0] is not None:
                timer[0].cancel()
            for fd in reading:
                loop.remove_reader(fd)
            for fd in writing:
                loop.remove_writer(fd)
            self.close_finished()

    def close(self) -> None:
        """Close what is left (after an error or cancellation)."""
        self.close_finished()
        for fd in (*self.writes, *self.reads):
            os.close(fd)
        self.writes.clear()
        self.reads.clear()


def _wait_readable(sock: socket.socket, timeout: Optional[float]) -> bool:
    poller = select.poll()  # not select(): the caller may have more than 1024 fds
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(None if timeout is None else int(timeout * 1000)))
