"""What a confined child does between fork and exec, as data: one list of steps.

:func:`child_steps` is the only place that decides which steps a child takes and in
which order. The list is then interpreted, never restated, by each executor:

- :mod:`sandlock.exec.engine` in Python: the CLI's launcher, the fork server and its
  spares (``call()``), the probe;
- ``sandlock-exec`` in C (``helper/sandlock_exec.c``, ``child()``): the API's commands.

Each executor declares the steps it implements (the C helper says so in its first
message, see :mod:`sandlock.exec.wire`) and refuses a list with any other step before
it forks, so a step added here cannot be skipped silently by an executor that was
not taught it. ``tests/test_engine.py`` runs the probe through every executor and
requires identical rows.

A step is a tuple ``(name, *args)``; on the wire, one string ``name`` or
``name=arg[:arg]``. Kept free of enum/dataclasses: this module is on `sandlock run`'s
per-call path.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Collection, Optional, Sequence, Union

    from ..compile.compiler import Compiled

    Step = tuple[Union[str, int], ...]

class Command:
    """What to execute: resolved path, argv, the whole environment, working directory."""

    __slots__ = ("executable", "argv", "env", "cwd")

    def __init__(self, executable: str, argv: tuple[str, ...], env: tuple[tuple[str, str], ...],
                 cwd: Optional[str] = None) -> None:
        self.executable = executable
        self.argv = argv
        self.env = env
        self.cwd = cwd

    def __repr__(self) -> str:
        return (f"Command(executable={self.executable!r}, argv={self.argv!r}, "
                f"env=<{len(self.env)} vars>, cwd={self.cwd!r})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Command) and (self.executable, self.argv, self.env, self.cwd) == (
            other.executable, other.argv, other.env, other.cwd)

    def __hash__(self) -> int:
        return hash((self.executable, self.argv, self.env, self.cwd))


#: The version of the step language and of the request wire (:mod:`sandlock.exec.wire`).
#: A helper speaking another version is an error, never a fallback.
VERSION = 3

CGROUP = "cgroup"      #: join the run's pids cgroup: first, so that everything is counted
SESSION = "session"    #: setsid(): the child leads its own session and process group
PARENT = "parent"      #: PR_SET_PDEATHSIG(SIGKILL), then exit if the parent is already gone
SIGNALS = "signals"    #: default dispositions (SIGPIPE, SIGXFSZ, forwarded ones), empty mask
STDIO = "stdio"        #: the executor's stdio on 0, 1, 2
CHDIR = "chdir"        #: (path): the working directory
RLIMIT = "rlimit"      #: (resource, value): soft = hard = value
CAPS = "caps"          #: drop every capability the executor holds (root gives its tool none)
CLOEXEC = "cloexec"    #: close-on-exec for every descriptor >= 3
NNP = "nnp"            #: PR_SET_NO_NEW_PRIVS
LANDLOCK = "landlock"  #: landlock_restrict_self(the run's ruleset)
SECCOMP = "seccomp"    #: the policy's seccomp filter
NOTIFY = "notify"      #: a supervisor's notifying filter (host allowlist, trace), its listener sent
EXEC = "exec"          #: execve(executable, argv, environment)

#: Every step, in the only order :func:`child_steps` emits them.
ORDER = (CGROUP, SESSION, PARENT, SIGNALS, STDIO, CHDIR, RLIMIT, CAPS, CLOEXEC, NNP, LANDLOCK,
         SECCOMP, NOTIFY, EXEC)
#: Steps no list may lack (Landlock's is absent only where the kernel has none and the
#: policy accepts that: best-effort).
REQUIRED = (CAPS, CLOEXEC, NNP, SECCOMP)


def child_steps(compiled: Compiled, cmd: Command, *, in_group: bool, notify: bool = False,
                exec_: bool = True) -> tuple[Step, ...]:
    """The steps of a child that runs ``cmd`` under ``compiled``.

    ``in_group``: the run has a pids cgroup (then RLIMIT_NPROC is not set: the group
    counts the sandbox, the rlimit the whole user). ``notify``: a supervisor's filter
    follows the policy's. ``exec_=False``: the child runs Python instead (a spare of
    ``call()``), its own last steps given by :func:`call_steps`.
    """
    steps: list[Step] = []
    if in_group:
        steps.append((CGROUP,))
    steps += [(SESSION,), (PARENT,), (SIGNALS,), (STDIO,)]
    if cmd.cwd is not None:
        steps.append((CHDIR, cmd.cwd))
    steps += [(RLIMIT, res, value) for res, value in compiled.child_rlimits(in_group)]
    steps += [(CAPS,), (CLOEXEC,), (NNP,)]
    if compiled.ruleset_fd >= 0:
        steps.append((LANDLOCK,))
    steps.append((SECCOMP,))
    if notify:
        steps.append((NOTIFY,))
    if exec_:
        steps.append((EXEC,))
    return tuple(steps)


def call_steps(cwd: str, notify: bool) -> tuple[Step, ...]:
    """What a confined spare does once a ``call()`` reaches it: its working directory,
    then the host allowlist's filter if the policy has one."""
    return ((CHDIR, cwd),) + (((NOTIFY,),) if notify else ())


def encode(steps: Sequence[Step]) -> list[str]:
    """The wire form: one string per step."""
    out = []
    for name, *args in steps:
        out.append(str(name) if not args else f"{name}={':'.join(map(str, args))}")
    return out


#: The kernel's number of resource limits (RLIM_NLIMITS, the same on every architecture:
#: include/uapi/asm-generic/resource.h): a step's RESOURCE is below it.
RLIM_NLIMITS = 16
#: The largest rlim_t (RLIM_INFINITY, 64 bits): a step's VALUE is at most this.
RLIM_MAX = 2**64 - 1


def _decimal(text: str, largest: int) -> bool:
    """Whether ``text`` is ASCII decimal digits only, at least one, at most ``largest``:
    the C helper's parse_decimal(). ``int()`` alone takes " 5", "+5", "-1", "1_0" and
    other scripts' digits."""
    return text.isascii() and text.isdigit() and int(text) <= largest


def decode(strings: Sequence[str]) -> tuple[Step, ...]:
    """The inverse of :func:`encode`; ValueError for a step this version does not know."""
    steps: list[Step] = []
    for text in strings:
        name, sep, rest = text.partition("=")
        if name not in ORDER:
            raise ValueError(f"unknown confinement step {name!r} (step language v{VERSION})")
        if name == CHDIR:
            steps.append((name, rest))
        elif name == RLIMIT:
            res, colon, value = rest.partition(":")
            if not (sep and colon and _decimal(res, RLIM_NLIMITS - 1) and _decimal(value, RLIM_MAX)):
                raise ValueError(f"bad rlimit step {text!r}: not rlimit=RESOURCE:VALUE in decimal "
                                 f"digits, RESOURCE below {RLIM_NLIMITS}, VALUE at most {RLIM_MAX}")
            steps.append((name, int(res), int(value)))
        elif sep:
            raise ValueError(f"confinement step {name!r} takes no argument")
        else:
            steps.append((name,))
    return tuple(steps)


def check(steps: Sequence[Step], implemented: Collection[str], who: str) -> None:
    """Refuse ``steps`` if ``who`` does not implement each of them, or if the
    confinement steps are missing or out of order (a list not made here)."""
    missing = sorted({str(s[0]) for s in steps} - set(implemented))
    if missing:
        raise ValueError(f"{who} does not implement the confinement step(s) {', '.join(missing)}")
    names = [s[0] for s in steps]
    ranks = [ORDER.index(str(n)) for n in names]
    if ranks != sorted(ranks):
        raise ValueError(f"confinement steps out of order: {', '.join(map(str, names))}")
    for required in REQUIRED:
        if required not in names:
            raise ValueError(f"a confinement without the {required!r} step")
