"""Typed errors and exit codes.

The library raises these; only the CLI turns them into messages and exit codes.
Exit codes follow the conventions of `timeout(1)` and `env(1)` so that scripts
already written against those tools keep working.
"""

from __future__ import annotations

import enum

TYPE_CHECKING = False  # importing typing costs milliseconds on every `sandlock run`
if TYPE_CHECKING:
    from typing import Optional


class ExitCode(enum.IntEnum):
    """Exit codes of `sandlock run` other than the command's own."""

    TIMEOUT = 124  #: the wall-clock limit expired; the whole process tree was killed
    LAUNCHER = 125  #: sandlock itself failed (bad policy, unsupported kernel, setup error)
    NOT_EXECUTABLE = 126  #: found but could not be executed (including exec denied by policy)
    NOT_FOUND = 127  #: the command was not found
    SIGNAL_BASE = 128  #: 128 + N when the command was killed by signal N


class SandlockError(Exception):
    """Base of every error sandlock raises."""

    exit_code: int = ExitCode.LAUNCHER
    stage: str = "sandlock"


class PolicyError(SandlockError):
    """The policy text is malformed or asks for something invalid.

    The message has the shape ``file:line: key.path: what is wrong``.
    """

    stage = "policy"

    def __init__(
        self,
        message: str,
        *,
        source: str = "<policy>",
        key: str = "",
        line: Optional[int] = None,
        column: Optional[int] = None,
    ) -> None:
        self.source = source
        self.key = key
        self.line = line
        self.column = column
        self.reason = message
        where = source
        if line is not None:
            where += f":{line}"
            if column is not None:
                where += f":{column}"
        prefix = f"{where}: {key}: " if key else f"{where}: "
        super().__init__(prefix + message)


class KernelSupportError(SandlockError):
    """The running kernel cannot enforce a protection the policy relies on (strict mode)."""

    stage = "kernel"


class LandlockError(SandlockError):
    """Building or applying the Landlock ruleset failed."""

    stage = "landlock"


class SeccompError(SandlockError):
    """Building or loading the seccomp filter failed."""

    stage = "seccomp"


class SetupError(SandlockError):
    """The child failed between fork and exec (rlimits, chdir, restriction)."""

    stage = "setup"


class ExecError(SandlockError):
    """The command could not be started: not found (127) or not executable (126)."""

    stage = "exec"

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ----------------------------------------------------------------------------
# Outcomes of the Python API (sandlock.api.sandbox): same exit codes as the CLI.


class TimeoutExpired(SandlockError):
    """The wall-clock limit expired (exit code 124).

    From ``run``/``call``: the whole process tree was killed. From
    ``Process.wait(timeout)``/``communicate(timeout)``: the process still runs,
    as with :mod:`subprocess`.
    """

    stage = "timeout"
    exit_code = ExitCode.TIMEOUT

    def __init__(self, message: str, *, timeout: Optional[float] = None,
                 stdout: object = None, stderr: object = None) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.stdout = stdout
        self.stderr = stderr


class CommandFailed(SandlockError):
    """The command ran and exited non-zero or was killed by a signal (``check=True``).

    ``exit_code`` is the command's own code, or 128+N for signal N, as the CLI's.
    """

    stage = "command"

    def __init__(self, message: str, returncode: int, *, stdout: object = None,
                 stderr: object = None) -> None:
        super().__init__(message)
        self.exit_code = self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class CallError(SandlockError):
    """A confined Python call could not deliver its outcome.

    The arguments could not be sent, the result could not be pickled or has a type
    the caller does not trust, the exception could not be rebuilt, or the process
    died before answering. ``remote_traceback`` holds the confined side's text.
    """

    stage = "call"

    def __init__(self, message: str, *, remote_traceback: str = "",
                 exit_code: int = ExitCode.LAUNCHER) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.exit_code = exit_code
