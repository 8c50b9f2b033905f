"""Processes as /proc shows them: whose children are whose, killing and reaping what
is left, and the signal sets every launcher path shares.

One reader of ``/proc/PID/task/TID/children`` and one "kill and reap the rest" loop:
a launcher is a child subreaper (PR_SET_CHILD_SUBREAPER), so every process its command
leaves behind (a daemon that double-forked, a grandchild of a killed child) is
re-parented to one of its threads and shows up in that thread's ``children`` file
(https://docs.kernel.org/filesystems/proc.html, "/proc/<pid>/task/<tid>/children";
the kernel needs CONFIG_PROC_CHILDREN, which every distribution kernel has).
"""

from __future__ import annotations

import os
import signal
import stat

#: Signals a launcher passes on to its command (the terminal's Ctrl-C, a caller's
#: ``kill``): the command decides what they mean, and the launcher waits for it.
FORWARDED_SIGNALS: tuple[int, ...] = tuple(int(s) for s in (
    signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT))
#: The stop signals a terminal sends its foreground job (Ctrl-Z; a background read or
#: write), ignored by a launcher while its tool runs: the tool leads a session of its own
#: and never gets them, and a tool given the terminal can make it send them (termios):
#: a stopped launcher would never end the tool at its timeout.
JOB_STOPS: tuple[int, ...] = (int(signal.SIGTSTP), int(signal.SIGTTIN), int(signal.SIGTTOU))
#: Signals a command starts with at their default disposition. Python ignores SIGPIPE
#: and SIGXFSZ, and an ignored disposition survives execve (caught ones do not): a tool
#: would otherwise never die of a closed pipe or of its file-size limit. Plain ints, so
#: that a forked child touching them causes no copy-on-write of enum objects.
DEFAULTED_SIGNALS: tuple[int, ...] = (int(signal.SIGPIPE), int(signal.SIGXFSZ), *FORWARDED_SIGNALS)


#: What a run or call given a directory as its stdin, stdout or stderr is refused with,
#: after the descriptor's name: a walk from it reaches what the policy grants through
#: whatever mount it is on, and one the mount table does not list (a tree unmounted
#: lazily, another namespace's) is one the grant checks cannot judge: below Landlock ABI
#: 5 a device node there would escape the ioctl substitute (attack round 33).
DIRECTORY_STDIO = (" is a directory: a tool is never given one (a walk from it may reach "
                   "what the policy grants through mounts sandlock cannot judge)")


def refuse_directories(stdio: tuple[int, ...] | list[int]) -> None:
    """Raise SetupError if a directory is among ``stdio`` (stdin, stdout, stderr; -1 for
    none): see :data:`DIRECTORY_STDIO`. A closed or bad descriptor is not one."""
    for name, fd in zip(("stdin", "stdout", "stderr"), stdio):
        try:
            if fd >= 0 and stat.S_ISDIR(os.fstat(fd).st_mode):
                from ..errors import SetupError

                raise SetupError(name + DIRECTORY_STDIO)
        except OSError:
            pass


def is_terminal(fd: int) -> bool:
    """Whether ``fd`` is open on a terminal (a closed or bad descriptor is not)."""
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _read(path: str) -> bytes:
    """The whole file (``children`` has no size limit: one number per child)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


#: The name of the one gap a strict policy accepts: ``processes`` enforced per user with
#: RLIMIT_NPROC (no pids cgroup; compile/ruleset.py). `sandlock run` names it only when
#: it can bite (cli/launch.py), which reads it here without importing the policy model.
PER_USER_LIMIT = "per-sandbox process limit"


def user_tasks(uid: int) -> int:
    """How many tasks (threads included) the processes of ``uid`` have: what the kernel
    compares with RLIMIT_NPROC (setrlimit(2)). Approximate: processes come and go while
    /proc is read, and one that is not dumpable shows as root's."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid == uid:
                count += len(os.listdir(f"/proc/{name}/task"))
        except OSError:
            continue  # gone meanwhile
    return count


def children(pid: int | None = None, *, strict: bool = False) -> set[int]:
    """The children of ``pid`` (None: this process), whichever of its threads forked or
    adopted them.

    A process or thread that is gone has no children: its file is skipped, unless
    ``strict``, where any read failure raises OSError (a caller deciding that nothing is
    left must not take "could not read" for "none").
    """
    where = "self" if pid is None else str(pid)
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{where}/task")
    except OSError:
        if strict:
            raise
        return found
    for task in tasks:
        try:
            found.update(int(p) for p in _read(f"/proc/{where}/task/{task}/children").split())
        except OSError:
            if strict:
                raise
    return found


def reap_descendants(spared: frozenset[int] = frozenset()) -> None:
    """Kill and reap every child of this process but ``spared``, until none is left.

    Each kill re-parents that child's own children to this process (a subreaper), so
    the loop goes on until a read finds nothing: whatever a command left behind is
    gone when this returns. ``spared`` are children the process had before the
    command started: a launcher used as a library must not kill its host's own
    subprocesses.
    """
    while True:
        pids = [pid for pid in children() if pid not in spared]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
