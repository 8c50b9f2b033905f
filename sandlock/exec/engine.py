"""The Python interpreter of the child's confinement steps (:mod:`sandlock.exec.spec`).

Runs in a freshly forked child, so it allocates little and imports nothing: every
call here is a thin wrapper over one syscall (:mod:`sandlock.linux.kernel`). The
steps come from :func:`spec.child_steps`; the resources they name (the cgroup's
procs file, stdio, the ruleset, the filter, the notifying filters' installer, the
program) are the executor's, given in a :class:`Context`.

A failing step raises :class:`StepFailed` naming the stage that
:func:`sandlock.exec.wire.setup_failure` and the C helper report alike.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C half of signal; typeshed has no stub
import os
import resource
import signal

from ..linux import kernel
from ..linux.process import DEFAULTED_SIGNALS
from . import spec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional, Sequence

    from ..linux.kernel import SockFprog

#: The steps this interpreter implements: all of them.
IMPLEMENTS = spec.ORDER

_SIGKILL = int(signal.SIGKILL)
#: A launcher holding capabilities (root, or a real or saved uid 0) gives its tool
#: none (checked once, in the parent).
PRIVILEGED = kernel.has_capabilities()

#: The stage a step's failure is reported as (the C helper uses the same names).
STAGES = {spec.CGROUP: "cgroup", spec.CHDIR: "chdir", spec.RLIMIT: "rlimit",
          spec.LANDLOCK: "landlock", spec.SECCOMP: "seccomp", spec.NOTIFY: "network",
          spec.EXEC: "exec"}


class StepFailed(Exception):
    def __init__(self, stage: str, error: OSError) -> None:
        super().__init__(stage, error)
        self.stage = stage
        self.error = error


class Context:
    """What the steps act on, in the child. Plain attributes; -1/None when absent."""

    __slots__ = ("parent", "group_fd", "stdio", "terminal", "ruleset_fd", "fprog", "notify",
                 "executable", "argv", "env")

    def __init__(self, *, parent: int = -1, group_fd: int = -1,
                 stdio: tuple[int, int, int] = (-1, -1, -1), terminal: int = -1,
                 ruleset_fd: int = -1,
                 fprog: Optional[SockFprog] = None, notify: Optional[Callable[[], None]] = None,
                 executable: str = "", argv: list[bytes] | None = None,
                 env: Optional[dict[bytes, bytes]] = None) -> None:
        self.parent = parent
        self.group_fd = group_fd
        self.stdio = stdio
        self.terminal = terminal  # a pty of the tool's own (exec/terminal.py), or -1
        self.ruleset_fd = ruleset_fd
        self.fprog = fprog
        self.notify = notify
        self.executable = executable
        self.argv = argv or []
        self.env = env


def apply(steps: Sequence[spec.Step], ctx: Context) -> None:
    """Take ``steps`` in order. An EXEC step does not return; a failure raises
    :class:`StepFailed`. The caller has checked the list (:func:`spec.check`)."""
    for step in steps:
        name = step[0]
        try:
            if name == "cgroup":
                os.write(ctx.group_fd, b"0")  # "0": the writing process (cgroup-v2.rst)
            elif name == "session":
                os.setsid()
            elif name == "parent":
                kernel.set_pdeathsig(_SIGKILL)
                if os.getppid() != ctx.parent:
                    os._exit(125)  # the launcher is gone: nobody to confine for
            elif name == "signals":
                # _signal, not signal: the wrapper converts to and from enums, which after
                # fork costs ~200 us of copy-on-write faults; the C functions cost ~10.
                for signum in DEFAULTED_SIGNALS:
                    _signal.signal(signum, _signal.SIG_DFL)
                _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
            elif name == "stdio":
                if ctx.terminal >= 0:  # after the session step: the pty its controlling one
                    import fcntl
                    import termios

                    fcntl.ioctl(ctx.terminal, termios.TIOCSCTTY, 0)
                for target, source in enumerate(ctx.stdio):
                    if source >= 0 and source != target:
                        os.dup2(source, target)
            elif name == "chdir":
                os.chdir(step[1])
            elif name == "rlimit":
                resource.setrlimit(step[1], (step[2], step[2]))  # type: ignore[arg-type]
            elif name == "caps":
                if PRIVILEGED:
                    kernel.drop_capabilities()
            elif name == "cloexec":
                kernel.cloexec_from(3)
            elif name == "nnp":
                kernel.no_new_privs()
            elif name == "landlock":
                kernel.restrict_self(ctx.ruleset_fd)
            elif name == "seccomp":
                assert ctx.fprog is not None
                kernel.load_seccomp(ctx.fprog)
            elif name == "notify":
                assert ctx.notify is not None
                ctx.notify()
            elif name == "exec":
                assert ctx.env is not None
                os.execve(ctx.executable, ctx.argv, ctx.env)
            else:  # spec.check refuses such a list before fork; never skip a step
                raise OSError(0, f"unknown confinement step {name!r}")
        except OSError as exc:
            raise StepFailed(STAGES.get(str(name), "setup"), exc) from None
