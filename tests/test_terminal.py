"""A tool run from the caller's terminal, on the real kernel.

The tool leads a session of its own, so the terminal never sends it the job's signals;
but a tool given the terminal itself could change its settings (termios: ISIG and a
control character it will see) and so make the terminal send its foreground job (the one
that ran sandlock) SIGINT, SIGQUIT or SIGTSTP. So the tool gets a pseudo-terminal of its
own, relayed by the launcher (:mod:`sandlock.exec.terminal`): what it sets is the pty's.

The harness is a terminal (a pty whose master the test holds) with a job-control shell:
the job runs in a group of its own, in front. A sleeper started in the job beside the
launcher is what the attack would reach; the same tool run as the launcher used to run it
(a session of its own, the caller's terminal inherited) is the positive control: the
terminal did signal the job, and the sleeper stopped or died.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import PYTHON, REPO, require_abi, write_policy
from test_native_run import FRONT, require_front

from sandlock.compile import cache

#: The tool: one of the terminal's signal characters made "q" on the first terminal among its
#: stdio, then it waits (argv[2] s), saying which of the terminal's signals it got.
TOOL = """\
import os, signal, sys, termios, time
for each in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP):  # os.write: no reentrant print
    signal.signal(each, lambda n, _: os.write(1, f"tool got {signal.Signals(n).name}\\n".encode()))
tty = next(fd for fd in (0, 1, 2) if os.isatty(fd))
attrs = termios.tcgetattr(tty)
attrs[3] |= termios.ISIG
attrs[6][getattr(termios, sys.argv[1])] = b"q"
termios.tcsetattr(tty, termios.TCSANOW, attrs)
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""

#: The sleeper: the job's other process, with the signals' default actions (a
#: non-interactive shell starts its background jobs with SIGINT and SIGQUIT ignored).
SLEEPER = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); "
           "signal.signal(signal.SIGQUIT, signal.SIG_DFL); time.sleep(30)")
#: The job: the sleeper in it, then the launcher in the job's shell's place.
JOB = f'"{PYTHON}" -c "{SLEEPER}" & echo $! > sleeper; exec "$@"'
#: An interactive shell, as far as job control goes: the session's leader runs the job in a
#: process group of its own, put in front (a group whose parent is outside it, in the same
#: session: the terminal's stop signals stop it; an orphaned group would ignore them).
SHELL = """\
import os, sys
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    os.execvp("sh", ["sh", "-c", sys.argv[1], "sh", *sys.argv[2:]])
try:
    os.setpgid(pid, pid)
except PermissionError:  # the child did it, and has exec'd since
    pass
os.tcsetpgrp(0, pid)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""

#: What each control character makes the terminal send.
SIGNALS = {"VSUSP": "SIGTSTP", "VINTR": "SIGINT", "VQUIT": "SIGQUIT"}


def _lead() -> None:  # in the shell: a session, the terminal its own, its group in front
    import fcntl

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    os.tcsetpgrp(0, os.getpgrp())


def _state(pid: int) -> str:
    """The process's state letter (T: stopped, Z: dead), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _read_until(master: int, shown: bytes, wanted: bytes, seconds: float = 30) -> bytes:
    deadline = time.monotonic() + seconds
    while wanted not in shown and time.monotonic() < deadline:
        if select.select([master], [], [], 0.2)[0]:
            try:
                shown += os.read(master, 4096)
            except OSError:
                break
    return shown


class Terminal:
    """A terminal with a job-control shell running ``argv`` as its foreground job."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, *,
                 rows: int = 0, columns: int = 0, stdout: Optional[int] = None) -> None:
        import fcntl
        import struct

        self.cwd = cwd
        self.master, slave = os.openpty()
        if rows:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.mode = termios.tcgetattr(slave)
        self.shown = b""
        self.job = subprocess.Popen([sys.executable, "-c", SHELL, JOB, *argv], stdin=slave,
                                    stdout=slave if stdout is None else stdout, stderr=slave,
                                    start_new_session=True, preexec_fn=_lead, cwd=cwd, env=env)
        os.close(slave)

    def wait_for(self, wanted: bytes) -> None:
        self.shown = _read_until(self.master, self.shown, wanted)
        assert wanted in self.shown, self.shown

    def sleeper(self) -> int:
        return int((self.cwd / "sleeper").read_text())

    def finish(self) -> int:
        """The job's exit status, what the terminal showed read meanwhile (a terminal
        nobody reads holds its writers)."""
        deadline = time.monotonic() + 20
        while self.job.poll() is None and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.shown += os.read(self.master, 65536)
                except OSError:
                    break
        try:
            code = self.job.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.job.pid, 9)
            self.job.wait()
            code = -1
        while select.select([self.master], [], [], 0.2)[0]:
            try:
                self.shown += os.read(self.master, 4096)
            except OSError:
                break
        return code

    def close(self) -> None:
        try:
            os.kill(self.sleeper(), 9)
        except (OSError, ValueError):
            pass
        os.close(self.master)


def _policy(tmp_path: Path, program: str, timeout: str = "2s") -> tuple[Path, Path]:
    (tmp_path / "tool").mkdir()
    tool = tmp_path / "tool" / "tool.py"
    tool.write_text(program)
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{tmp_path / 'tool'}"]
        [limits]
        timeout = "{timeout}"
        """)
    return policy, tool


def _launcher(tmp_path: Path, path: str, policy: Path) -> tuple[list[str], dict[str, str]]:
    """The command line of ``sandlock run`` through ``path`` (the Python CLI, or the native
    front end on a plan it has stored), up to the tool's argv."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if path == "python":
        return [sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--"], env
    require_front()
    # Below it, the front end hands every such plan to the Python CLI before it looks at
    # the terminal (the signal gate); the "python" rows are those runs.
    require_abi(6, "the native front end runs no plan that needs the signal gate")
    env = {name: value for name, value in env.items() if name not in cache.PYTHON_ENV}
    env.update({"XDG_CACHE_HOME": str(tmp_path / "cache"), "SANDLOCK_NATIVE_RUN": "1",
                "SANDLOCK_NATIVE_DEBUG": "1"})
    argv = [str(FRONT), "run", "--policy", str(policy), "--"]
    warm = subprocess.run([*argv, PYTHON, "-c", "pass"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert warm.returncode == 0, warm.stderr
    return argv, env


def _in_a_terminal(tmp_path: Path, path: str, program: str, args: list[str], typed: bytes,
                   **options: int) -> tuple[int, str, Terminal]:
    """``program`` as a tool (2 s timeout) in a terminal; ``typed`` once it says ready.
    (the exit status, the sleeper's state after, the terminal)"""
    policy, tool = _policy(tmp_path, program)
    launcher, env = _launcher(tmp_path, path, policy)
    term = Terminal([*launcher, PYTHON, str(tool), *args], env, tmp_path, **options)
    try:
        term.wait_for(b"ready")
        os.write(term.master, typed)
        time.sleep(0.5)  # the terminal's signal, if any, has arrived
        state = _state(term.sleeper())
        code = term.finish()
        if path == "native":  # a terminal: the Python CLI relays it, never the front end
            assert b"fallback: a terminal" in term.shown, term.shown
        return code, state, term
    finally:
        term.close()


@pytest.mark.parametrize("path", ["python", "native"])
@pytest.mark.parametrize("character", sorted(SIGNALS))
def test_a_tool_cannot_make_the_terminal_signal_the_job(tmp_path: Path, path: str,
                                                        character: str) -> None:
    """The tool sets ISIG and makes "q" the signal character on what it has as stdin; "q"
    is typed. The pty's line discipline signals the tool's own group (it says so), never
    the caller's job: the sleeper beside the launcher runs on, and the run still ends at
    its timeout."""
    code, state, term = _in_a_terminal(tmp_path, path, TOOL, [character, "30"], b"q")
    assert state in ("S", "R"), (state, term.shown)
    assert f"tool got {SIGNALS[character]}".encode() in term.shown, term.shown
    assert code == 124, (code, term.shown)


@pytest.mark.parametrize("character", sorted(SIGNALS))
def test_the_terminal_did_signal_the_job_of_a_tool_given_it(tmp_path: Path,
                                                            character: str) -> None:
    """The positive control: the same tool in a session of its own with the caller's
    terminal (as the launcher ran it before the pty) makes the terminal signal the job."""
    policy, tool = _policy(tmp_path, TOOL)
    term = Terminal(["setsid", "-w", PYTHON, str(tool), character, "3"], dict(os.environ),
                    tmp_path)
    try:
        term.wait_for(b"ready")
        os.write(term.master, b"q")
        time.sleep(0.5)
        state = _state(term.sleeper())
        assert state in (("T",) if character == "VSUSP" else ("Z", "gone")), state
        term.finish()
    finally:
        term.close()


#: The tool: the terminal's output suspended (as Ctrl-S does), then it waits past its timeout.
SUSPENDS = """\
import termios, time
print("ready", flush=True)
time.sleep(0.5)
termios.tcflow(1, termios.TCOOFF)
time.sleep(30)
"""


@pytest.mark.parametrize("path", ["python", "native"])
def test_a_tool_that_suspends_the_terminals_output_does_not_hold_the_launcher(
        tmp_path: Path, path: str) -> None:
    """The launcher's line about the timeout would block for ever on a suspended output
    (and with it the launcher). The sleeper is still running: nothing stopped the job."""
    code, state, term = _in_a_terminal(tmp_path, path, SUSPENDS, [], b"")
    assert code == 124 and b"timeout" in term.shown, (code, term.shown)
    assert state in ("S", "R"), state


#: The tool: what a terminal program asks of its terminal, shown; then a line read.
ASKS = """\
import os, sys, termios, fcntl, struct
rows, columns = struct.unpack("HHHH", fcntl.ioctl(1, termios.TIOCGWINSZ, b"\\0" * 8))[:2]
own = os.ttyname(0) == os.ttyname(1) == os.ttyname(2)
print(f"ready size={rows}x{columns} tty={own} ctty={os.tcgetpgrp(0) == os.getpgrp()}",
      flush=True)
print("got", repr(sys.stdin.readline()), flush=True)
print("x" * 100000 + "end", flush=True)
"""


def test_the_tool_gets_a_terminal_of_its_own_with_the_callers_size(tmp_path: Path) -> None:
    """Interactive (stdin and stdout the terminal, in front): the tool has a pty as its
    controlling terminal on 0, 1 and 2, the caller's size, the line typed (the caller's
    terminal raw, the pty's line discipline cooking), and every byte it wrote before it
    exited. The caller's terminal is left as it was."""
    code, _, term = _in_a_terminal(tmp_path, "python", ASKS, [], b"hello\r",
                                   rows=33, columns=77)
    assert code == 0, term.shown
    assert b"ready size=33x77 tty=True ctty=True" in term.shown, term.shown
    assert b"got 'hello\\n'" in term.shown, term.shown
    assert term.shown.count(b"x") >= 100000 and b"end" in term.shown, len(term.shown)


def test_the_callers_terminal_is_left_as_it_was(tmp_path: Path) -> None:
    policy, tool = _policy(tmp_path, "import termios\n"
                                     "a = termios.tcgetattr(0); a[3] &= ~termios.ECHO\n"
                                     "termios.tcsetattr(0, termios.TCSANOW, a)\n")
    launcher, env = _launcher(tmp_path, "python", policy)
    term = Terminal([*launcher, PYTHON, str(tool)], env, tmp_path)
    try:
        assert term.finish() == 0, term.shown
        assert termios.tcgetattr(term.master) == term.mode
    finally:
        term.close()


#: The tool in a pipeline: what it reads of its stdin, then it waits, reading nothing.
READS = """\
import sys, time
print("read", repr(sys.stdin.read()), "tty", sys.stdin.isatty(), flush=True)
print("ready", file=sys.stderr, flush=True)
time.sleep(1)
"""

#: A reader beside the tool (a pager in the pipeline): what it gets of the terminal.
PAGER = (f'"{PYTHON}" -c "import os; tty = os.open(\'/dev/tty\', os.O_RDONLY); '
         f'open(\'paged\', \'wb\').write(os.read(tty, 100))" & exec "$@"')


def test_a_pipelines_tool_reads_nothing_from_the_terminal(tmp_path: Path) -> None:
    """stdout not a terminal: the tool's stdin is /dev/null, not the terminal (a relay would
    take keys eagerly, before any tool asked: a pager's beside it, the shell's
    type-ahead). The key typed while it runs goes to the reader beside it."""
    policy, tool = _policy(tmp_path, READS)
    launcher, env = _launcher(tmp_path, "python", policy)
    out = tmp_path / "out"
    with open(out, "wb") as sink:
        term = Terminal(["sh", "-c", PAGER, "sh", *launcher, PYTHON, str(tool)], env, tmp_path,
                        stdout=sink.fileno())
    try:
        term.wait_for(b"ready")
        os.write(term.master, b"k\r")
        assert term.finish() == 0, term.shown
        assert out.read_bytes() == b"read '' tty False\n", (out.read_bytes(), term.shown)
        for _ in range(100):
            if (tmp_path / "paged").exists() and (tmp_path / "paged").read_bytes():
                break
            time.sleep(0.05)
        assert (tmp_path / "paged").read_bytes() == b"k\n", term.shown
    finally:
        term.close()


def test_native_runs_never_hand_over_a_terminal(tmp_path: Path) -> None:
    code, _, term = _in_a_terminal(tmp_path, "native", ASKS, [], b"hi\r")
    assert code == 0 and b"tty=True ctty=True" in term.shown, term.shown


#: The tool: a line read, what it got said.
ECHOES = """\
import sys
print("ready", flush=True)
print("got", repr(sys.stdin.readline()), flush=True)
"""


def test_ctrl_z_does_not_stop_the_tool(tmp_path: Path) -> None:
    """Interactive, the caller's terminal is raw: Ctrl-Z reaches the pty, whose suspend
    character starts disabled (a stopped tool could only wait for its timeout, Ctrl-C
    pending)."""
    code, _, term = _in_a_terminal(tmp_path, "python", ECHOES, [], b"a\x1ab\r")
    assert code == 0 and b"got 'a\\x1ab\\n'" in term.shown, (code, term.shown)


#: The tool: its size said at the start and on each SIGWINCH, until a line is read.
RESIZES = """\
import fcntl, os, signal, struct, sys, termios
def say(*_):  # os.write: a print here that interrupts the tool's own print would raise
    rows, columns = struct.unpack("HHHH", fcntl.ioctl(1, termios.TIOCGWINSZ, b"\\0" * 8))[:2]
    os.write(1, f"size={rows}x{columns}\\n".encode())
signal.signal(signal.SIGWINCH, say)
say()
os.write(1, b"ready\\n")
sys.stdin.readline()
"""


def test_the_callers_new_size_reaches_the_tool(tmp_path: Path) -> None:
    """The caller's terminal resized (its job gets SIGWINCH): the pty gets the new size,
    and the tool its own SIGWINCH."""
    import fcntl
    import struct

    policy, tool = _policy(tmp_path, RESIZES)
    launcher, env = _launcher(tmp_path, "python", policy)
    term = Terminal([*launcher, PYTHON, str(tool)], env, tmp_path, rows=20, columns=60)
    try:
        term.wait_for(b"ready")
        assert b"size=20x60" in term.shown, term.shown
        fcntl.ioctl(term.master, termios.TIOCSWINSZ, struct.pack("HHHH", 41, 99, 0, 0))
        term.wait_for(b"size=41x99")
        os.write(term.master, b"\r")
        assert term.finish() == 0, term.shown
    finally:
        term.close()


@pytest.mark.parametrize("path", ["python", "native"])
def test_a_stop_signal_for_the_job_does_not_stop_the_launcher(tmp_path: Path,
                                                              path: str) -> None:
    """SIGTSTP to the launcher's job (Ctrl-Z on a terminal its pipeline reads): ignored
    while the tool runs, which leads a session of its own and never gets it; stopped, the
    launcher would never end the tool at its timeout. No terminal here: the native front
    end runs it."""
    import signal

    policy, tool = _policy(tmp_path, 'print("ready", flush=True)\nimport time\ntime.sleep(30)\n')
    launcher, env = _launcher(tmp_path, path, policy)
    run = subprocess.Popen([*launcher, PYTHON, str(tool)], env=env, cwd=tmp_path,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, process_group=0)  # a group not orphaned
    try:
        assert run.stdout is not None
        assert run.stdout.readline() == b"ready\n"
        os.killpg(run.pid, signal.SIGTSTP)
        time.sleep(0.2)
        assert _state(run.pid) != "T"
        _, err = run.communicate(timeout=20)
        assert run.returncode == 124 and b"timeout" in err, (run.returncode, err)
        if path == "native":
            assert b"hit: running it" in err, err
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
            run.wait()


#: The agent: the tool run through the API with the agent's own stdio (its terminal),
#: then one line of its own (it is still there).
AGENT = """\
import sys
import sandlock
with sandlock.Sandbox(sys.argv[1]) as box:
    result = box.run(sys.argv[2:], timeout=2)
print("agent: the call ended", result.returncode, flush=True)
"""


@pytest.mark.parametrize("character", sorted(SIGNALS))
def test_an_api_call_cannot_make_the_agents_terminal_signal_its_job(tmp_path: Path,
                                                                    character: str) -> None:
    """The same attack through ``Sandbox.run`` from an agent whose stdio is its terminal
    (the API's default: the caller's own): the tool gets a pty relayed for the call, with
    no controlling terminal (nobody gets its signals), the caller's terminal never raw.
    The agent and the sleeper beside it run on; the call ends at its timeout."""
    policy, tool = _policy(tmp_path, TOOL)
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    term = Terminal([sys.executable, str(agent), str(policy), PYTHON, str(tool), character, "30"],
                    {**os.environ, "PYTHONPATH": str(REPO)}, tmp_path)
    try:
        term.wait_for(b"ready")
        os.write(term.master, b"q")
        time.sleep(0.5)
        assert _state(term.sleeper()) in ("S", "R"), term.shown
        assert term.finish() == 0, term.shown
        assert b"agent: the call ended 124" in term.shown, term.shown
    finally:
        term.close()


def test_an_api_call_takes_no_input_from_the_agents_terminal(tmp_path: Path) -> None:
    """The API never reads the agent's terminal for a call (its prompt's keys would be
    taken while the call runs): a terminal on stdin is /dev/null to the tool."""
    policy, tool = _policy(tmp_path, READS)
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    term = Terminal([sys.executable, str(agent), str(policy), PYTHON, str(tool)],
                    {**os.environ, "PYTHONPATH": str(REPO)}, tmp_path)
    try:
        assert term.finish() == 0, term.shown
        assert b"read '' tty False" in term.shown, term.shown
        assert b"agent: the call ended 0" in term.shown, term.shown
    finally:
        term.close()


# -- a hostile tool against the relay itself (attack round 28) ---------------------------

#: The tool: output without end (its terminal's reader may never read it), then it waits.
FLOODS = """\
import os, sys
print("ready", flush=True)
block = b"x" * 65536
while True:
    os.write(1, block)
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("caller", ["run", "api"])
def test_a_terminal_nobody_drains_does_not_hold_the_run(tmp_path: Path, caller: str) -> None:
    """The tool floods its output and the caller's terminal is never read: the run still
    ends soon after its timeout (the relay gives up on the terminal, sandlock's own lines
    too), and the caller's terminal is left as it was (not raw)."""
    policy, tool = _policy(tmp_path, FLOODS)
    if caller == "run":
        launcher, env = _launcher(tmp_path, "python", policy)
        argv = [*launcher, PYTHON, str(tool)]
    else:  # the agent says how the call ended in a file: its terminal takes nothing
        agent = tmp_path / "agent.py"
        agent.write_text(AGENT.replace('print("agent: the call ended", result.returncode, '
                                       'flush=True)',
                                       'open("agent.out", "w").write(str(result.returncode))'))
        argv = [sys.executable, str(agent), str(policy), PYTHON, str(tool)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
    term = Terminal(argv, env, tmp_path)
    try:
        started = time.monotonic()
        code = term.job.wait(timeout=60)  # the terminal is not read meanwhile
        assert time.monotonic() - started < 30, code
        assert termios.tcgetattr(term.master) == term.mode
        if caller == "run":
            assert code == 124, code
        else:
            assert code == 0 and (tmp_path / "agent.out").read_text() == "124", code
    finally:
        if term.job.poll() is None:
            os.killpg(term.job.pid, 9)
        term.close()


#: The tool: raw mode on its terminal, then never reads while input keeps coming.
IGNORES_INPUT = """\
import sys, termios, time, tty
tty.setraw(0)
print("ready", flush=True)
time.sleep(3)
"""


def test_input_the_tool_never_reads_does_not_spin_the_relay(tmp_path: Path) -> None:
    """The pty's input queue full (the tool reads nothing, input keeps coming): the relay
    waits for room instead of polling in a loop. The launcher's CPU time over the run
    (a spinning relay takes a core: about 3 s here) stays well under a second."""
    policy, tool = _policy(tmp_path, IGNORES_INPUT, "20s")
    launcher, env = _launcher(tmp_path, "python", policy)
    term = Terminal([*launcher, PYTHON, str(tool)], env, tmp_path)
    try:
        term.wait_for(b"ready")
        pid = _launcher_pid(term)
        os.set_blocking(term.master, False)
        until = time.monotonic() + 1  # more than the two terminals' input queues hold
        while time.monotonic() < until:
            try:
                os.write(term.master, b"y" * 4096)
            except BlockingIOError:
                time.sleep(0.01)
        before = _cpu_seconds(pid)
        time.sleep(1.5)
        spent = _cpu_seconds(pid) - before
        os.set_blocking(term.master, True)
        assert term.finish() == 0, term.shown
        assert spent < 0.5, spent
    finally:
        term.close()


def _launcher_pid(term: Terminal) -> int:
    """The launcher: the job's shell exec'd it (the job's process group leader)."""
    return int(Path(f"/proc/{term.job.pid}/task/{term.job.pid}/children").read_text().split()[0])


#: The tool: 3 MB of output, then it exits.
WRITES = """\
import os
data = b"z" * 3000000
view = memoryview(data)
while view:
    view = view[os.write(1, view):]
"""


def test_a_non_blocking_terminal_gets_all_the_output(tmp_path: Path) -> None:
    """The caller's terminal description is non-blocking (as an agent may leave it) and
    read slowly: every byte the tool wrote reaches it."""
    import fcntl

    policy, tool = _policy(tmp_path, WRITES)
    launcher, env = _launcher(tmp_path, "python", policy)
    master, slave = os.openpty()
    flags = fcntl.fcntl(slave, fcntl.F_GETFL)
    fcntl.fcntl(slave, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        run = subprocess.Popen([*launcher, PYTHON, str(tool)], env=env, cwd=tmp_path,
                               stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE)
        os.close(slave)
        slave = -1
        got = 0
        while True:
            time.sleep(0.002)
            if not select.select([master], [], [], 2)[0]:
                if run.poll() is not None:
                    break
                continue
            try:
                got += os.read(master, 4096).count(b"z")
            except OSError:
                break
        run.wait(timeout=60)
        assert run.returncode == 0, run.stderr.read() if run.stderr else b""
        assert got == 3000000
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)


def test_a_launcher_in_another_session_leaves_the_terminal_alone(tmp_path: Path) -> None:
    """A terminal on stdin and stdout that is not the launcher's controlling terminal
    (setsid; an agent started in a session of its own): not interactive. The terminal is
    not put in raw mode under whoever owns it, and the tool reads nothing of it."""
    policy, tool = _policy(tmp_path, READS)
    launcher, env = _launcher(tmp_path, "python", policy)
    term = Terminal(["setsid", "-w", *launcher, PYTHON, str(tool)], env, tmp_path)
    try:
        term.wait_for(b"ready")
        during = termios.tcgetattr(term.master)
        assert term.finish() == 0, term.shown
        assert during == term.mode
        assert b"read '' tty False" in term.shown, term.shown
    finally:
        term.close()


# -- attack round 29 ---------------------------------------------------------------------

def test_a_terminal_on_stdin_alone(tmp_path: Path) -> None:
    """stdin a terminal, stdout and stderr not (`tool >log 2>&1` from a shell): the run
    works (its size is read from the terminal on stdin) and the tool reads nothing."""
    policy, tool = _policy(tmp_path, READS)
    launcher, env = _launcher(tmp_path, "python", policy)
    master, slave = os.openpty()
    try:
        done = subprocess.run([*launcher, PYTHON, str(tool)], env=env, cwd=tmp_path, stdin=slave,
                              capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == b"read '' tty False\n", done.stdout
        import sandlock

        with sandlock.Sandbox(str(policy)) as box:
            result = box.run([PYTHON, str(tool)], stdin=slave, capture_output=True)
        assert result.returncode == 0 and result.stdout == b"read '' tty False\n", result
    finally:
        os.close(master)
        os.close(slave)


def test_a_pty_master_given_as_stdout_gets_the_output(tmp_path: Path) -> None:
    """A pty master as the tool's stdout (a terminal to isatty): the relay writes to it
    (what its slave reads), never to a new pty of /dev/ptmx opened again from its path."""
    import sandlock

    policy, tool = _policy(tmp_path, 'print("HELLO-FROM-TOOL", flush=True)\n')
    master, slave = os.openpty()
    try:
        with sandlock.Sandbox(str(policy)) as box:
            result = box.run([PYTHON, str(tool)], stdin=subprocess.DEVNULL, stdout=master)
        assert result.returncode == 0, result
        got = _read_until(slave, b"", b"HELLO-FROM-TOOL", 10)
        assert b"HELLO-FROM-TOOL" in got, got
    finally:
        os.close(master)
        os.close(slave)


def test_a_relay_left_behind_closes_what_it_holds(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's terminal cannot be opened again (another user's, after su: the relay
    uses the caller's blocking description) and takes nothing: the call still ends, and
    the relay stuck writing, left behind, closes its descriptors once the terminal takes
    the output (a long-lived agent would otherwise leak five a call)."""
    import sandlock
    from sandlock.exec import terminal

    monkeypatch.setattr(terminal, "_own_description", lambda fd, _flags: os.dup(fd))
    monkeypatch.setattr(terminal, "GRACE", 1.0)
    policy, tool = _policy(tmp_path, WRITES)
    master, slave = os.openpty()
    try:
        with sandlock.Sandbox(str(policy)) as box:
            box.run([PYTHON, "-c", "pass"])  # its helper processes started
            before = len(os.listdir("/proc/self/fd"))
            result = box.run([PYTHON, str(tool)], stdin=subprocess.DEVNULL, stdout=slave)
            assert result.returncode == 124, result  # killed at its timeout, writing
            assert len(os.listdir("/proc/self/fd")) > before  # the relay, left behind
            got = 0
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(os.listdir("/proc/self/fd")) > before:
                if select.select([master], [], [], 0.1)[0]:
                    got += len(os.read(master, 65536))
            assert len(os.listdir("/proc/self/fd")) == before, got
    finally:
        os.close(master)
        os.close(slave)
