"""How a confined call ended, as the caller sees it: :class:`Result`, :class:`Outcome`,
the denials of a traced call, and the traceback text of a confined function's exception.

Plain values built from what a call's supervisor reported (:class:`sandlock.api.sandbox._Call`);
nothing here reads a socket or a pipe.
"""

from __future__ import annotations

import enum

from ..errors import CommandFailed, SandlockError, TimeoutExpired

TYPE_CHECKING = False  # typing and dataclasses cost ~10 ms on the API's first Sandbox()
if TYPE_CHECKING:
    from typing import Any, Optional, Protocol

    from ..trace.record import Denial
else:
    Protocol = object


class Outcome(str, enum.Enum):
    """How a confined call ended."""

    EXITED = "exited"  #: the command ran and exited (any code)
    SIGNALLED = "signalled"  #: killed by a signal it did not ask for (returncode 128+N)
    TIMED_OUT = "timed out"  #: the wall-clock limit expired; the tree was killed (124)
    NOT_STARTED = "not started"  #: refused before exec: not found (127), not executable
    #: or denied exec (126), setup failure (125); ``Result.error`` says which


class Result:
    """What :meth:`Sandbox.run` returns. ``returncode`` follows the CLI's exit codes.

    Immutable; equal to another Result with the same fields (and hashed by them).
    ``network_events``: under ``[network] allow``, one line per connection the policy
    refused. ``denials``: with ``trace=True``, each access the policy refused
    (:class:`sandlock.trace.record.Denial`: right, path or port, interpreter detail, the
    policy line that grants it), as `sandlock trace --json` lists them; always ``()``
    without ``trace``. ``error``: why it did not start (``NOT_STARTED`` only)."""

    __slots__ = ("args", "returncode", "stdout", "stderr", "outcome", "signal", "error", "pid",
                 "network_events", "denials")
    __match_args__ = ("args", "returncode", "stdout", "stderr", "outcome", "signal", "error",
                      "pid", "network_events", "denials")

    args: tuple[str, ...]
    returncode: int
    stdout: Any
    stderr: Any
    outcome: Outcome
    signal: Optional[int]
    error: Optional[SandlockError]
    pid: Optional[int]
    network_events: tuple[str, ...]
    denials: tuple["Denial", ...]

    def __init__(self, args: tuple[str, ...], returncode: int, stdout: Any = None,
                 stderr: Any = None, outcome: Outcome = Outcome.EXITED,
                 signal: Optional[int] = None, error: Optional[SandlockError] = None,
                 pid: Optional[int] = None, network_events: tuple[str, ...] = (),
                 denials: tuple["Denial", ...] = ()) -> None:
        for name, value in zip(self.__slots__, (args, returncode, stdout, stderr, outcome,
                                                signal, error, pid, network_events, denials)):
            object.__setattr__(self, name, value)

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a Result")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a Result")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return "Result(" + ", ".join(f"{name}={getattr(self, name)!r}"
                                     for name in self.__slots__) + ")"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Result, self._fields())

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.EXITED and self.returncode == 0

    def check(self) -> "Result":
        """Raise the typed error for anything but a zero exit; return self otherwise."""
        if self.error is not None:
            raise self.error
        if self.outcome is Outcome.TIMED_OUT:
            raise TimeoutExpired(f"{self.args[0]}: timed out; its process tree was killed",
                                 stdout=self.stdout, stderr=self.stderr)
        if self.returncode != 0:
            how = (f"was killed by signal {self.signal}" if self.signal
                   else f"exited with code {self.returncode}")
            raise CommandFailed(f"{self.args[0]} {how}", self.returncode, stdout=self.stdout,
                                stderr=self.stderr)
        return self

    check_returncode = check


class RemoteTraceback(Exception):
    """Set as ``__cause__`` of an exception re-raised from a confined call."""

    def __str__(self) -> str:
        return "\n\nTraceback in the confined process:\n" + str(self.args[0])


class Ended(Protocol):
    """What a :class:`Result` is made of: the reports of one call (``_Call``)."""

    @property
    def failure(self) -> Optional[SandlockError]: ...
    @property
    def status(self) -> Optional[tuple[int, int, bool]]: ...  # returncode, signal, timed out
    @property
    def pid(self) -> Optional[int]: ...
    @property
    def network_events(self) -> tuple[str, ...]: ...
    @property
    def denials(self) -> tuple["Denial", ...]: ...


def _result(call: Ended, args: tuple[str, ...], stdout: Any, stderr: Any) -> Result:
    """The Result of a call that has ended (a failure or a status was reported)."""
    if call.failure is not None:
        return Result(args, int(call.failure.exit_code), stdout, stderr,
                      Outcome.NOT_STARTED, error=call.failure, pid=call.pid,
                      network_events=call.network_events, denials=call.denials)
    assert call.status is not None
    code, sig, timed_out = call.status
    outcome = (Outcome.TIMED_OUT if timed_out else Outcome.SIGNALLED if sig
               else Outcome.EXITED)
    return Result(args, code, stdout, stderr, outcome, sig or None, None, call.pid,
                  call.network_events, call.denials)


def _decode(data: Optional[bytes], encoding: Optional[str], errors: Optional[str]) -> Any:
    """A captured stream as text (``text=True``), newlines made universal as subprocess does."""
    if data is None:
        return None
    text = data.decode(encoding or "utf-8", errors or "strict")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _denials(data: bytes) -> tuple["Denial", ...]:
    """One ``D`` report of a traced call (sandlock.exec.server._send_denials): JSON made by the
    call's supervisor, which judged the recorded accesses."""
    import json

    from ..trace.record import Denial

    return tuple(Denial(d["right"], d.get("path", ""), d.get("port", -1), d.get("detail", ""),
                        d["section"], d["grant"], d.get("warning", "")) for d in json.loads(data))
