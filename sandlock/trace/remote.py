"""``trace=True`` on the native path: a Sandbox's recorder, in a process of its own.

A traced command through the fork server is recorded and judged by its Python
supervisor. On the native path the command's supervisor is C, so the recording runs
in a recorder process of the Sandbox (a :class:`sandlock.net.mediator.WarmProcess`:
a clean ``python -I -S``, started on the first traced call, kept warm, ended by
``close()``), which also starts the ``sandlock-exec`` server those commands run on:
it is the ancestor of every process of the tool, as Yama asks of whoever reads the
tool's memory. Each call gets a :class:`sandlock.trace.record.Recorder` of its own
there: the process answers the call's socket with the recorder's filter (JSON) and the
socket on which the confined child sends its listener (the ``notify`` step); at
``stop`` it judges what was recorded (:class:`sandlock.trace.record.Judge`, with the
rules the caller sent once) and answers with JSON lists of denials, then ``end``. The
recorded paths come from the tool's memory: they are parsed here, never in the
caller, which reads JSON only, with a size bound.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Optional

from ..net.mediator import CALL, SIGNALS, STOP, RemoteCall, WarmProcess, serve_warm

#: The end of a call's denials (each message before it is one JSON list).
_END = b"end"

#: Bytes of denials the caller takes from one call (beyond, the rest is dropped).
DENIALS_LIMIT = 16 << 20


class RecorderProcess(WarmProcess):
    """A Sandbox's recorder process; ``rules`` are what its judge decides by
    (:meth:`sandlock.api.sandbox.Sandbox._trace_rules`)."""

    def __init__(self, rules: tuple[int, list[tuple[str, int, bool]], dict[int, int]],
                 native: bool) -> None:
        abi, paths, ports = rules
        super().__init__(json.dumps([abi, paths, sorted(ports.items()), native]).encode(),
                         "serve", "sandlock.trace.remote", native=native)


class RemoteRecording(RemoteCall):
    """The caller's handle on one call's recorder: ``gate`` (its filter and the socket
    the child sends its listener on), ``start``, ``stop``, then ``batches``: the JSON
    lists of denials the process judged, each as a ``D`` report carries it.
    ``signals``: the recorder's listener also carries the signal gate (Landlock ABI < 6)."""

    what = "trace recorder"

    def __init__(self, process: RecorderProcess, signals: bool = False,
                 ahead: bool = False) -> None:
        self.batches: list[bytes] = []
        super().__init__(process, SIGNALS if signals else CALL, ahead)

    def _read_end(self) -> Any:
        batches, size = [], 0
        while (message := self._sock.recv(1 << 17)) != _END:
            if not message:
                raise EOFError("the recorder ended before its denials did")
            size += len(message)
            if size <= DENIALS_LIMIT:
                batches.append(message)
        return batches

    def _ended(self, answer: Any) -> None:
        self.batches = answer


# ----------------------------------------------------------------------------
# The recorder process


def serve(fd: int) -> None:
    """Main of the recorder process (never returns): the rules once, then a thread for each
    call; ends when the caller's socket and every call's have closed."""
    def setup(config: bytes, fds: list[int]) -> tuple[Any, bool]:
        for fd in fds:  # none is sent to a recorder
            os.close(fd)
        abi, paths, ports, native = json.loads(config.decode())
        return (abi, [tuple(r) for r in paths], dict(ports)), native

    serve_warm(fd, setup, _serve_call, "sandlock-recorder-call")


def _serve_call(rules: tuple[Any, ...], sock: socket.socket, signals: bool) -> None:
    """One call: a recorder of its own, until the caller says ``stop`` (then its
    denials, judged) or closes the call's socket."""
    from .record import Judge, Recorder

    recorder: Optional[Recorder] = None
    try:
        recorder = Recorder()
        if signals:  # the signal gate rides on the recorder's listener (before its bpf goes)
            from ..linux.signalgate import Signals

            recorder.gate_signals(Signals())
        sock.sendmsg([json.dumps({"bpf": recorder.notify_bpf.hex()}).encode()],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                       recorder.child_end.to_bytes(4, sys.byteorder))])
        recorder.run(sock.fileno())  # this thread records until the caller speaks or goes
        said = sock.recv(16)  # "stop", or b"" when the caller is gone
        recorder.stop()
        if said == STOP:
            for batch in Judge(*rules).batches(recorder.events):
                sock.send(batch.encode())
            sock.send(_END)
    except BaseException:  # noqa: BLE001 - the caller sees EOF and reports it
        if recorder is not None:
            recorder.stop()
    finally:
        sock.close()
