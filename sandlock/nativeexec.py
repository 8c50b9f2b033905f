"""The native fast path of the Python API: one ``sandlock-exec`` per command call.

The fork server (:mod:`sandlock.forkserver`) pays a Python ``fork()`` (~1 ms of
copy-on-write faults) and runs the confinement steps in Python. ``sandlock-exec``
(``sandlock/native/sandlock_exec.c``, compiled at install time by ``setup.py``) does
the same job in C: the caller starts it with ``os.posix_spawn`` (vfork + exec, so
none of the caller's memory is copied, whatever its size: no secrets, no 2 GiB
page-table copy), and it acts as that call's supervisor, speaking the fork server's
per-call wire format on a SEQPACKET socket. Used for ``run``/``popen``/``run_async``
of commands when the helper exists, the policy has no ``[network] allow`` (that
needs the Python connect supervisor) and ``SANDLOCK_NATIVE`` is not ``"0"``;
``call()`` always uses the fork server (the child runs Python, not ``execve``).
"""

from __future__ import annotations

import os
import signal
import socket

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Sequence

    from .launcher import Command, Compiled

#: Built by setup.py next to its source; absent when no C compiler was available.
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "sandlock-exec")
AVAILABLE = os.access(HELPER, os.X_OK)
#: Reset to SIG_DFL for the helper and so for the command: launcher._child's set (an
#: ignored disposition survives execve; caught ones do not).
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM,
                    signal.SIGHUP, signal.SIGQUIT)


def enabled() -> bool:
    """The helper exists and ``SANDLOCK_NATIVE`` does not turn it off (read per call)."""
    return AVAILABLE and os.environ.get("SANDLOCK_NATIVE") != "0"


def spawn(compiled: Compiled, cmd: Command, stdio: Sequence[int], timeout: Optional[float],
          report_start: bool) -> tuple[socket.socket, int]:
    """Start ``sandlock-exec`` for one call; return the caller's end of its socket and
    the helper's pid (the caller's child: reap it with ``waitpid`` after the call).

    Raises OSError if posix_spawn fails.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # The filter travels as the socket's first message: no per-Sandbox state to keep.
        ours.send(compiled.bpf)
        # Helper fd layout: 0-2 stdio, 3 socket, 4 ruleset. posix_spawn's file actions
        # run in order in the child: when a source is itself one of the targets (the
        # caller's stdio), first lift every source above every number involved.
        sources = [*stdio, theirs.fileno()]
        args = [HELPER, "-c", cmd.cwd or os.getcwd()]
        if compiled.ruleset_fd >= 0:
            sources.append(compiled.ruleset_fd)
            args.append("-l")
        if report_start:
            args.append("-s")
        if timeout is not None:
            args += ["-t", repr(float(timeout))]
        for res, value in compiled.rlimits:
            args += ["-r", f"{res}:{value}"]
        args += ["--", cmd.executable, *cmd.argv]  # the path to exec, then argv (argv[0] too)
        if all(fd == i or fd >= len(sources) for i, fd in enumerate(sources)):
            actions = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(sources)]
        else:
            base = max(*sources, len(sources)) + 1
            actions = [(os.POSIX_SPAWN_DUP2, fd, base + i) for i, fd in enumerate(sources)]
            actions += [(os.POSIX_SPAWN_DUP2, base + i, i) for i in range(len(sources))]
        # Its own process group (the terminal's Ctrl-C is the caller's business, as with the
        # fork server), no blocked signal, default dispositions (Python ignores SIGPIPE).
        pid = os.posix_spawn(HELPER, args, dict(cmd.env), file_actions=actions, setpgroup=0,
                             setsigmask=(), setsigdef=_DEFAULT_SIGNALS)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours, pid
