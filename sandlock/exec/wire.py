"""The wire between the caller and its executors: requests in, reports out.

Requests. The C helper takes one binary layout (``helper/sandlock_exec.c``)::

    u32 version, u32 nsteps, u32 nargs, u32 nenv, then that many NUL-terminated strings:
    the child's steps (spec.encode), the supervisor's options and the command, the
    command's environment

made by :func:`native_request` only. The fork server takes a marshal dict
(:mod:`sandlock.exec.forkserver`) whose ``steps`` field is the same step strings and
whose ``version`` is the same number. Both servers say their version in their first
message (:func:`check_hello`); a mismatch is an error, never a fallback.

Reports, from a call's supervisor on the call's socket (made by the supervisors,
decoded by :func:`sandlock.api.sandbox._Call.receive`):

    T                                    (sandlock-exec) the supervisor took the request: from
                                         here the command may run; without it, never started
    S pid                                the command has exec'd (popen)
    E returncode signal timed_out pid    it ended
    F exit_code ErrorName\\nmessage      the supervisor failed (before or instead of a run)
    X stage\\0errno\\0message              the child failed before exec (:func:`setup_failure`)
    D json                               trace=True: what the policy refused
"""

from __future__ import annotations

import errno
import os
import struct

from ..errors import ExecError, ExitCode, SandlockError, SetupError
from . import spec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Sequence

    from .spec import Command

#: The fork server's kinds of request, each with its own socket and pool of supervisors.
KINDS = ("exec", "call")
#: Fork server requests larger than this travel in a memfd (a SEQPACKET message must fit
#: the socket buffer in one piece).
FORKSERVER_INLINE_LIMIT = 32 * 1024
#: What a spare (a process confined ahead of a Python call) is called in
#: ``/proc/PID/comm`` until a call takes it; then it is called CALL_NAME.
SPARE_NAME = b"sandlock-spare"
CALL_NAME = b"sandlock-call"

#: The native request's header: version, then the counts of steps, arguments, environment.
HEAD = struct.Struct("=IIII")
#: A header that says "the whole request is in the memfd sent last".
IN_MEMFD = HEAD.pack(0, 0, 0, 0)


class VersionError(SetupError):
    """A helper process speaks another version of the wire (a stale build)."""


def check_hello(who: str, hello: bytes) -> frozenset[str]:
    """The steps a server implements, from its first message ``V version step...``;
    VersionError if it is not this version's."""
    words = hello.decode(errors="replace").split()
    if len(words) < 2 or words[0] != "V" or words[1] != str(spec.VERSION):
        said = hello[:80].decode(errors="replace") or "nothing"
        raise VersionError(
            f"{who} speaks another version of sandlock's wire (it said {said!r}; this sandlock "
            f"speaks V {spec.VERSION}): a stale build. Rebuild it (`python setup.py build_helper` "
            "in a checkout, or reinstall sandlock), or set SANDLOCK_NATIVE=0")
    return frozenset(words[2:])


def native_request(steps: Sequence[spec.Step], args: Sequence[str],
                   env: Sequence[tuple[str, str]]) -> bytes:
    """The C helper's request. ValueError for a string execve cannot carry."""
    texts = spec.encode(steps)
    envs = []
    for name, text in env:
        if not name or "=" in name:
            raise ValueError(f"illegal environment variable name: {name!r}")
        envs.append(f"{name}={text}")
    # As posix_spawn encodes them (os.fsencode); a NUL inside a string would shift
    # every string after it, so it is refused as posix_spawn refuses it.
    strings = [*texts, *args, *envs]
    data = b"\0".join(map(os.fsencode, strings)) + b"\0"
    if data.count(0) != len(strings):
        raise ValueError("embedded null byte")
    return HEAD.pack(spec.VERSION, len(texts), len(args), len(envs)) + data


def setup_failure(cmd: Command, report: bytes, ruleset_fd: int = -1) -> SandlockError:
    """The error for a child's ``stage\\0errno\\0message`` report (any executor)."""
    stage, code, text = (report.decode(errors="replace").split("\0", 2) + ["", ""])[:3]
    err = int(code or 0) if code.isdigit() else 0
    if stage == "exec":
        if err in (errno.ENOENT, errno.ENOTDIR):
            return ExecError(f"{cmd.executable}: command not found", ExitCode.NOT_FOUND)
        refused = ""
        if err == errno.EACCES:  # which file of the exec chain: asked of Landlock (failure path only)
            from ..trace.record import exec_refusals_under

            refused = exec_refusals_under(ruleset_fd, cmd.executable, cmd.cwd)
        if err in (errno.EACCES, errno.EPERM):
            return ExecError(f"{cmd.executable}: permission denied (the policy does not grant exec "
                             "on it, or on its interpreter or loader)"
                             + (f": {refused}" if refused else ""), ExitCode.NOT_EXECUTABLE)
        return ExecError(f"{cmd.executable}: cannot execute: {text}", ExitCode.NOT_EXECUTABLE)
    if stage == "chdir":
        return SetupError(f"cannot change directory to {cmd.cwd!r}: {text}")
    if stage == "cgroup":
        return SetupError(f"cannot join the run's pids cgroup ([limits] processes): {text}")
    return SetupError(f"sandbox setup failed at {stage}: {text}")
