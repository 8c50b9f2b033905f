"""A tool given the caller's terminal, on the real kernel.

The tool leads a session of its own, so the terminal never sends it the job's signals;
but it may change the terminal's settings (pagers and editors do), and with them make
the terminal send its foreground job (the one that ran sandlock) Ctrl-Z's SIGTSTP. The
launcher ignores the stop signals while its tool runs: stopped, it would never end the
tool at its timeout. The sleeper started beside the launcher in the same job is the
positive control: the terminal did send the job SIGTSTP, and it stopped.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, require_abi, write_policy
from test_native_run import FRONT, require_front

from sandlock.compile import cache

#: The tool: the terminal's suspend character made "q", then it waits past its timeout.
TOOL = """\
import termios, time
attrs = termios.tcgetattr(0)
attrs[3] |= termios.ISIG
attrs[6][termios.VSUSP] = b"q"
termios.tcsetattr(0, termios.TCSANOW, attrs)
print("ready", flush=True)
time.sleep(30)
"""

#: The job: a sleeper in it (the control), then the launcher in the job's shell's place.
JOB = 'sleep 30 & echo $! > sleeper; exec "$@"'
#: An interactive shell, as far as job control goes: the session's leader runs the job in a
#: process group of its own, put in front (a group whose parent is outside it, in the same
#: session: the terminal's stop signals stop it; an orphaned group would ignore them).
SHELL = """\
import os, sys
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    os.execvp("sh", ["sh", "-c", sys.argv[1], "sh", *sys.argv[2:]])
os.setpgid(pid, pid)
os.tcsetpgrp(0, pid)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def _lead() -> None:  # in the shell: a session, the terminal its own, its group in front
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    os.tcsetpgrp(0, os.getpgrp())


def _in_a_terminal(argv: list[str], env: dict[str, str], cwd: Path,
                   typed: bytes = b"q") -> tuple[int, str, bytes]:
    """Run ``argv`` as a terminal's foreground job; type "q" once the tool says ready.
    (the exit status, the sleeper's state, what the terminal showed)"""
    master, slave = os.openpty()
    shown = b""
    sleeper = 0
    try:
        job = subprocess.Popen([sys.executable, "-c", SHELL, JOB, *argv], stdin=slave, stdout=slave,
                               stderr=slave, start_new_session=True, preexec_fn=_lead,
                               cwd=cwd, env=env)
        os.close(slave)
        slave = -1
        deadline = time.monotonic() + 30
        while b"ready" not in shown and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    shown += os.read(master, 4096)
                except OSError:
                    break
        assert b"ready" in shown, shown
        os.write(master, typed)
        sleeper = int((cwd / "sleeper").read_text())
        state = "?"
        for _ in range(100):  # stopped by the terminal, while the run goes on
            state = Path(f"/proc/{sleeper}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "T":
                break
            time.sleep(0.02)
        try:
            code = job.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, 9)
            job.wait()
            code = -1
        while select.select([master], [], [], 0.2)[0]:
            try:
                shown += os.read(master, 4096)
            except OSError:
                break
        return code, state, shown
    finally:
        if sleeper:
            os.kill(sleeper, 9)
        if slave >= 0:
            os.close(slave)
        os.close(master)


#: The tool: the terminal's output suspended (as Ctrl-S does), then it waits past its timeout.
SUSPENDS = """\
import termios, time
print("ready", flush=True)
time.sleep(0.5)
termios.tcflow(1, termios.TCOOFF)
time.sleep(30)
"""


@pytest.mark.parametrize("path", ["python", "native"])
def test_a_tool_that_makes_the_terminal_stop_the_job_still_times_out(tmp_path: Path,
                                                                    path: str) -> None:
    code, state, shown = _timed_out(tmp_path, path, TOOL, b"q")
    assert state == "T", (state, shown)  # the control: the terminal stopped the job
    assert code == 124 and b"timeout" in shown, (code, shown)


@pytest.mark.parametrize("path", ["python", "native"])
def test_a_tool_that_suspends_the_terminals_output_does_not_hold_the_launcher(
        tmp_path: Path, path: str) -> None:
    """The launcher's line about the timeout would block for ever on the suspended output
    (and with it the launcher: `sandlock run` never returned). The sleeper is still running:
    nothing stopped the job."""
    code, state, shown = _timed_out(tmp_path, path, SUSPENDS, b"")
    assert code == 124 and b"timeout" in shown, (code, shown)
    assert state != "T", state


def _timed_out(tmp_path: Path, path: str, program: str, typed: bytes) -> tuple[int, str, bytes]:
    """``program`` as a tool with a 2 s timeout, run through ``path`` (the Python CLI, or
    the native front end on a plan it has stored) in a terminal."""
    (tmp_path / "tool").mkdir()
    tool = tmp_path / "tool" / "tool.py"
    tool.write_text(program)
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{tmp_path / 'tool'}"]
        [limits]
        timeout = "2s"
        """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if path == "python":
        argv = [sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--", PYTHON,
                str(tool)]
    else:
        require_front()
        require_abi(6, "the native front end runs no plan that needs the signal gate")
        env = {name: value for name, value in env.items() if name not in cache.PYTHON_ENV}
        env.update({"XDG_CACHE_HOME": str(tmp_path / "cache"), "SANDLOCK_NATIVE_RUN": "1",
                    "SANDLOCK_NATIVE_DEBUG": "1"})
        argv = [str(FRONT), "run", "--policy", str(policy), "--", PYTHON, str(tool)]
        warm = subprocess.run([*argv[:-1], "-c", "pass"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert warm.returncode == 0, warm.stderr
    code, state, shown = _in_a_terminal(argv, env, tmp_path, typed)
    if path == "native":
        assert b"hit: running it" in shown, shown
    return code, state, shown
