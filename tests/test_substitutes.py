"""Substitutes for Landlock protections an older ABI lacks, on the real kernel.

``SANDLOCK_ABI=N`` makes sandlock build the ruleset an ABI-N kernel enforces; the
kernel here is newer, so what the ABI-N ruleset lets through is what an ABI-N kernel
lets through. Each attack is run with the substitute (it must fail) and, as the positive
control, with the substitute switched off (it must succeed), through the API in this
process, where the plan can be patched.
"""

from __future__ import annotations

import errno
import os
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import ABI, PYTHON, require_abi, run_confined, write_policy

from sandlock.compile import seccomp

#: Landlock ABIs without LANDLOCK_ACCESS_FS_TRUNCATE (added in ABI 3).
NO_TRUNCATE = (1, 2)

TRUNCATE_ATTACKS = {
    # truncate(2) by path: Landlock before ABI 3 does not check it at all.
    "truncate": "os.truncate(target, 0)",
    # open(2) with O_TRUNC and read-only access: Landlock before ABI 3 checks READ_FILE only.
    "open_rdonly_trunc": "os.close(os.open(target, os.O_RDONLY | os.O_TRUNC))",
    # access mode 3 (no read, no write): Landlock checks neither, open still truncates.
    "open_accmode3_trunc": "os.close(os.open(target, 3 | os.O_TRUNC))",
}

ATTACK = """\
import errno, os, sys
target = sys.argv[1]
try:
    {attack}
except OSError as exc:
    print("refused", errno.errorcode[exc.errno])
    sys.exit(0)
print("size", os.stat(target).st_size)
"""


def _abi_env(abi: int) -> dict[str, str]:
    return {**os.environ, "SANDLOCK_ABI": str(abi)}


def _victim(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious data\n")
    victim.chmod(0o644)
    return victim


def _api_attack(tmp_path: Path, abi: int, attack: str) -> tuple[str, int]:
    """Run ``attack`` through the API with a read grant on the victim only; what it
    printed and the victim's size afterwards."""
    import sandlock

    require_abi(abi, "the truncate attack at this ABI")
    victim = _victim(tmp_path)
    policy = write_policy(tmp_path, f"""\
        version = 1
        compat = "best-effort"
        extends = ["python"]
        [filesystem]
        read = ["{victim}"]
        """)
    code = ATTACK.format(attack=attack)
    with sandlock.Sandbox(policy) as box:
        result = box.run([PYTHON, "-c", code, str(victim)], capture_output=True, text=True)
    assert isinstance(result.stdout, str), result
    return result.stdout.strip() or str(result.stderr), victim.stat().st_size


@pytest.mark.parametrize("abi", NO_TRUNCATE)
@pytest.mark.parametrize("name", sorted(TRUNCATE_ATTACKS))
def test_truncate_refused_below_abi_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      abi: int, name: str) -> None:
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    said, size = _api_attack(tmp_path, abi, TRUNCATE_ATTACKS[name])
    assert said == "refused EPERM" and size == len("precious data\n"), said


@pytest.mark.parametrize("name", sorted(TRUNCATE_ATTACKS))
def test_truncate_control_without_the_substitute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 name: str) -> None:
    """Positive control: the same attack at ABI 2 with the substitute switched off truncates."""
    monkeypatch.setenv("SANDLOCK_ABI", "2")
    monkeypatch.setattr(seccomp, "truncate_rules", lambda: [], raising=False)
    said, size = _api_attack(tmp_path, 2, TRUNCATE_ATTACKS[name])
    assert said == "size 0" and size == 0, said


@pytest.mark.parametrize("abi", NO_TRUNCATE)
def test_truncate_cli_strict_runs_and_refuses(tmp_path: Path, abi: int) -> None:
    """`sandlock run` in strict mode runs at ABI 1-2 (the substitute covers the gap) and the
    attack fails; writing through a descriptor opened for writing still works."""
    require_abi(abi, "the truncate attack at this ABI")
    victim = _victim(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    code = textwrap.dedent("""\
        import os, sys
        mine = os.path.join(sys.argv[2], "mine.txt")
        with open(mine, "w") as handle:
            handle.write("abcdef")
        with open(mine, "r+") as handle:
            handle.truncate(2)
        print("own", os.stat(mine).st_size)
        with open(mine, "w") as handle:
            pass
        print("own", os.stat(mine).st_size)
        """) + ATTACK.format(attack=TRUNCATE_ATTACKS["open_rdonly_trunc"])
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{victim}"]
        write = ["{ws}"]
        """)
    done = run_confined(policy, [PYTHON, "-c", code, str(victim), str(ws)], env=_abi_env(abi))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["own 2", "own 0", "refused EPERM"], done.stdout
    assert victim.stat().st_size == len("precious data\n")
    assert ABI >= abi


# ----------------------------------------------------------------------------
# The signal scope (Landlock ABI 6) below ABI 6: the signal gate

#: Landlock ABIs without LANDLOCK_SCOPE_SIGNAL.
NO_SIGNAL_SCOPE = (1, 2, 3, 4, 5)

#: Each attack aims SIGTERM at ``victim`` (a sleeper outside the sandbox, same user) and
#: exits with the errno it got (0: the call succeeded). kill(-1) sends signal 0 only: it
#: must fail, and as root a real signal would reach every process of the machine.
SIGNAL_ATTACKS = {
    "kill": "os.kill(victim, signal.SIGTERM)",
    "tkill": "call('tkill', victim, signal.SIGTERM)",
    "tgkill": "call('tgkill', victim, victim, signal.SIGTERM)",
    "rt_sigqueueinfo": "call('rt_sigqueueinfo', victim, signal.SIGTERM, siginfo(-1))",
    "pidfd_send_signal": "signal.pidfd_send_signal(os.pidfd_open(victim), signal.SIGTERM)",
    "kill_pgid": "os.killpg(os.getpgid(victim), signal.SIGTERM)",
    "kill_minus_1": "os.kill(-1, 0)",
    "f_setown_sigio": """
        r, w = os.pipe()
        fcntl.fcntl(r, fcntl.F_SETOWN, victim)
        fcntl.fcntl(r, fcntl.F_SETSIG, signal.SIGTERM)
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)
        os.write(w, b"x")""",
    # The owner setting alone: with signal-driven I/O refused (O_ASYNC, FIOASYNC) what an
    # owner still gets is SIGURG (a TCP socket's urgent data); refused all the same.
    "f_setown_only": """
        r, w = os.pipe()
        fcntl.fcntl(r, fcntl.F_SETOWN, victim)""",
    "f_setown_pgrp": """
        r, w = os.pipe()
        fcntl.fcntl(r, fcntl.F_SETOWN, -os.getpgid(victim))
        fcntl.fcntl(r, fcntl.F_SETSIG, signal.SIGTERM)
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)
        os.write(w, b"x")""",
}

PRELUDE = """\
import ctypes, errno, fcntl, os, signal, sys, time
from sandlock_nr import NR
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    if libc.syscall(NR[name], *args) < 0:
        raise OSError(ctypes.get_errno(), name)
def siginfo(code):
    buf = ctypes.create_string_buffer(128)
    ctypes.memmove(buf, (ctypes.c_int * 3)(signal.SIGTERM, 0, code), 12)
    ctypes.memmove(ctypes.byref(buf, 16), (ctypes.c_int * 2)(os.getpid(), os.getuid()), 8)
    return buf
victim = int(sys.argv[1])
try:
{body}
except OSError as exc:
    sys.exit(exc.errno)
time.sleep(0.2)
sys.exit(0)
"""


def _program(tmp_path: Path, body: str) -> Path:
    """The attack as a script, beside a copy of this machine's syscall numbers."""
    from sandlock.linux.syscalls import NR

    (tmp_path / "sandlock_nr.py").write_text(f"NR = {dict(NR)!r}\n")
    script = tmp_path / "attack.py"
    script.write_text(PRELUDE.format(body=textwrap.indent(textwrap.dedent(body).strip(), "    ")))
    for path in (tmp_path, tmp_path / "sandlock_nr.py", script):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return script


def _confined(tmp_path: Path, abi: int, monkeypatch: pytest.MonkeyPatch, argv: list[str],
              *, gate: bool = True) -> int:
    """Run ``argv`` under the python profile (plus a read grant on ``tmp_path``) through the
    launcher (`sandlock run`'s executor), in this process; its exit code. ``gate=False``:
    the positive control, with the signal gate and its seccomp half switched off."""
    from sandlock.compile import compiler
    from sandlock.exec import launcher
    from sandlock.policy.model import load_policy

    require_abi(abi, "pretending this ABI")
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    policy_file = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{tmp_path}"]
        exec = ["/usr/bin/dash", "/usr/bin/sleep"]
        """, name="signals.toml")
    if not gate:
        monkeypatch.setattr(seccomp, "signal_rules", lambda: [])
        monkeypatch.setattr(launcher, "_own_gate", lambda _c, _s, _b, hook: (None, hook))
    policy = load_policy(str(policy_file), {})
    with compiler.compile_policy(policy) as compiled:
        assert compiled.signal_gate
        cmd = launcher.prepare_command(compiled, argv)
        code = launcher.run(compiled, cmd, forward_signals=False).returncode
    assert code is not None
    return code


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A sleeper outside the sandbox, of the same user, in a process group of its own."""
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield sleeper
    finally:
        sleeper.kill()
        sleeper.wait()


def _reached(sleeper: subprocess.Popen[bytes]) -> bool:
    """Whether a signal has reached the sleeper, seen at once: from the moment a fatal
    signal is sent until the sleeper is reaped, it is pending in the sleeper's status or
    the sleeper is a zombie (every attack here has ended before this is asked)."""
    if sleeper.poll() is not None:
        return True
    fields = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{sleeper.pid}/status").read_text().splitlines() if ":\t" in line)
    return (fields["State"].startswith("Z") or int(fields["SigPnd"], 16) != 0
            or int(fields["ShdPnd"], 16) != 0)


def _dead(sleeper: subprocess.Popen[bytes]) -> bool:
    """The positive controls' check: the sleeper dies within 2 s."""
    try:
        sleeper.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize("abi", NO_SIGNAL_SCOPE)
@pytest.mark.parametrize("name", sorted(SIGNAL_ATTACKS))
def test_signal_outside_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                victim: subprocess.Popen[bytes], abi: int, name: str) -> None:
    script = _program(tmp_path, SIGNAL_ATTACKS[name])
    code = _confined(tmp_path, abi, monkeypatch, [PYTHON, str(script), str(victim.pid)])
    assert code in (errno.EPERM, errno.ESRCH), (name, code)
    assert not _reached(victim)


@pytest.mark.parametrize("name", sorted(set(SIGNAL_ATTACKS) - {"kill_minus_1", "f_setown_only"}))
def test_signal_outside_control_without_the_gate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: subprocess.Popen[bytes],
        name: str) -> None:
    """Positive control: at ABI 5 without the gate every attack kills the sleeper (not
    kill(-1): as root it would reach every process of the machine; not the owner setting
    alone, which sends nothing itself)."""
    script = _program(tmp_path, SIGNAL_ATTACKS[name])
    code = _confined(tmp_path, 5, monkeypatch, [PYTHON, str(script), str(victim.pid)], gate=False)
    assert _reached(victim) and _dead(victim), (name, code)


OWN = {
    "shell_child": ("/usr/bin/dash", "-c", "sleep 10 & kill $!; wait $!; test $? = 143"),
    "python_group": (PYTHON, "-c", textwrap.dedent("""\
        import os, signal, subprocess, sys, time
        kids = [subprocess.Popen(["/usr/bin/sleep", "10"], process_group=0)]
        kids.append(subprocess.Popen(["/usr/bin/sleep", "10"], process_group=kids[0].pid))
        time.sleep(0.1)
        os.killpg(kids[0].pid, signal.SIGTERM)
        codes = [k.wait(timeout=5) for k in kids]
        one = subprocess.Popen(["/usr/bin/sleep", "10"])
        signal.pidfd_send_signal(os.pidfd_open(one.pid), signal.SIGTERM)
        codes.append(one.wait(timeout=5))
        two = subprocess.Popen(["/usr/bin/sleep", "10"])
        os.kill(two.pid, signal.SIGTERM)
        codes.append(two.wait(timeout=5))
        os.kill(os.getpid(), 0)
        signal.signal(signal.SIGUSR1, lambda *_: codes.append("usr1"))
        signal.raise_signal(signal.SIGUSR1)
        signal.pthread_kill(signal.pthread_self() if hasattr(signal, "pthread_self") else
                            __import__("threading").get_ident(), signal.SIGUSR1)
        os.kill(0, 0)
        sys.exit(0 if codes == [-15, -15, -15, -15, "usr1", "usr1"] else f"{codes}")
        """)),
}


@pytest.mark.parametrize("abi", NO_SIGNAL_SCOPE)
@pytest.mark.parametrize("name", sorted(OWN))
def test_signal_own_processes_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abi: int,
                                    name: str) -> None:
    assert _confined(tmp_path, abi, monkeypatch, list(OWN[name])) == 0


def test_setsid_refused_below_abi_6(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that left the tool's session would escape the gate's test."""
    code = _confined(tmp_path, 5, monkeypatch, [PYTHON, "-c", textwrap.dedent("""\
        import errno, os, sys
        if os.fork() == 0:
            try:
                os.setsid()
            except OSError as exc:
                os._exit(exc.errno)
            os._exit(0)
        sys.exit(os.waitstatus_to_exitcode(os.wait()[1]))
        """)])
    assert code == errno.EPERM


@pytest.mark.parametrize("abi", NO_SIGNAL_SCOPE)
def test_signal_cli_strict_runs_and_refuses(tmp_path: Path, victim: subprocess.Popen[bytes],
                                            abi: int) -> None:
    """`sandlock run` in strict mode runs at ABI 1-5 (the gate covers the signal scope)."""
    require_abi(abi, "pretending this ABI")
    script = _program(tmp_path, SIGNAL_ATTACKS["kill"])
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{tmp_path}"]
        """, name="signals.toml")
    done = run_confined(policy, [PYTHON, str(script), str(victim.pid)], env=_abi_env(abi))
    assert done.returncode == errno.EPERM, done.stderr
    assert "NOT enforced" not in done.stderr
    assert not _reached(victim)


@pytest.mark.parametrize("abi", (2, 5))
def test_signal_gate_in_the_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                victim: subprocess.Popen[bytes], abi: int) -> None:
    """Sandbox.run goes through the fork server's supervisor, which runs the gate (the C
    helper does not carry it); so does call(), in the spare its function runs in."""
    import signal

    import sandlock

    require_abi(abi, "pretending this ABI")
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    script = _program(tmp_path, SIGNAL_ATTACKS["kill"])
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{tmp_path}"]
        exec = ["/usr/bin/dash", "/usr/bin/sleep"]
        """, name="signals.toml")
    with sandlock.Sandbox(policy) as box:
        assert box.run([PYTHON, str(script), str(victim.pid)]).returncode == errno.EPERM
        assert box.run(list(OWN["shell_child"])).returncode == 0
        # traced: natively, the gate rides on the recorder process's listener
        traced = box.run([PYTHON, str(script), str(victim.pid)], trace=True)
        assert traced.returncode == errno.EPERM, traced
        assert box.run(list(OWN["shell_child"]), trace=True).returncode == 0
        with pytest.raises(PermissionError):
            box.call(os.kill, victim.pid, signal.SIGTERM)
        box.call(os.kill, 0, 0)  # its own process group
        with pytest.raises(PermissionError):  # a second call: a spare made ahead of it
            box.call(os.kill, victim.pid, signal.SIGTERM)
    assert not _reached(victim)


def _gate_policy(tmp_path: Path, head: str = "", network: str = "") -> Path:
    return write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        {head}
        [filesystem]
        read = ["{tmp_path}"]
        exec = ["/usr/bin/dash", "/usr/bin/sleep"]
        {network}
        """, name="signals.toml")


#: A policy under the signal gate: every signal call of the tool is answered by it.
NO_SCOPE = ('accept = ["signal-scope"]', "[scope]\nsignals = false")


def test_signal_gate_in_call_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     victim: subprocess.Popen[bytes]) -> None:
    """Positive control: the same call() without the signal scope kills the sleeper."""
    import signal

    import sandlock

    require_abi(5, "pretending ABI 5")
    monkeypatch.setenv("SANDLOCK_ABI", "5")
    policy = write_policy(tmp_path, _gate_policy(tmp_path, NO_SCOPE[0]).read_text()
                          + NO_SCOPE[1] + "\n", name="noscope.toml")
    with sandlock.Sandbox(policy) as box:
        assert not box._compiled.signal_gate
        box.call(os.kill, victim.pid, signal.SIGTERM)
    assert _reached(victim) and _dead(victim)  # seen at once, as the refusals are


#: [network] allow: the host allowlist's proxy and connect gate, in the mediator process.
ALLOW = '[network]\nallow = ["example.invalid"]'


@pytest.mark.parametrize("abi", (2, 4, 5))
def test_signal_gate_under_network_allow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         victim: subprocess.Popen[bytes], abi: int) -> None:
    """Under [network] allow the mediator's listener carries the gate (a process gets only
    one listener): run() refuses the signal; below ABI 4 with the TCP gap accepted."""
    import sandlock

    require_abi(abi, "pretending this ABI")
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    script = _program(tmp_path, SIGNAL_ATTACKS["kill"])
    policy = _gate_policy(tmp_path, 'accept = ["tcp-ports"]' if abi < 4 else "", ALLOW)
    with sandlock.Sandbox(policy) as box:
        assert box._compiled.signal_gate
        assert box.run([PYTHON, str(script), str(victim.pid)]).returncode == errno.EPERM
        assert box.run(list(OWN["shell_child"])).returncode == 0
    assert not _reached(victim)


def test_signal_gate_under_network_allow_control(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: subprocess.Popen[bytes]) -> None:
    """Positive control: the same run without the signal scope kills the sleeper."""
    import sandlock

    require_abi(5, "pretending ABI 5")
    monkeypatch.setenv("SANDLOCK_ABI", "5")
    script = _program(tmp_path, SIGNAL_ATTACKS["kill"])
    policy = _gate_policy(tmp_path, NO_SCOPE[0], ALLOW + "\n" + NO_SCOPE[1])
    with sandlock.Sandbox(policy) as box:
        assert box.run([PYTHON, str(script), str(victim.pid)]).returncode == 0
    assert _reached(victim) and _dead(victim)  # seen at once, as the refusals are


def test_signal_gate_on_a_cache_hit(tmp_path: Path, victim: subprocess.Popen[bytes]) -> None:
    """The compiled-policy cache keeps the gate: the second run, read back from the cache
    without parsing the policy, refuses the signal as the first did."""
    import json
    import sys

    require_abi(5, "pretending ABI 5")
    script = _program(tmp_path, SIGNAL_ATTACKS["kill"])
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [filesystem]
        read = ["{tmp_path}"]
        """, name="signals.toml")
    env = {k: v for k, v in _abi_env(5).items() if k != "SANDLOCK_NO_CACHE"}
    env["XDG_CACHE_HOME"] = str(tmp_path.parent / f"{tmp_path.name}-cache")  # not read
    runner = ("import json, sys\nfrom sandlock.cli import launch\ncode = launch.main_run(sys.argv[1:])\n"
              "sys.stderr.write('\\n' + json.dumps([code, 'sandlock.policy.model' in sys.modules]))")
    seen = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", runner, "--policy", str(policy), "--", PYTHON,
                               str(script), str(victim.pid)], env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        seen.append(json.loads(done.stderr.rpartition("\n")[2]))
    assert seen == [[errno.EPERM, True], [errno.EPERM, False]]  # a miss, then a hit
    assert not _reached(victim)


def test_mediator_filter_without_the_gate_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: subprocess.Popen[bytes]) -> None:
    """A mediator whose listener does not carry the gate (here: not asked to) is refused
    by the supervisor, never run without the signal scope: the child may have only the
    mediator's listener, so it could not have a gate of its own."""
    import signal

    import sandlock
    from sandlock.errors import SandlockError
    from sandlock.net import mediator

    require_abi(5, "pretending ABI 5")
    monkeypatch.setenv("SANDLOCK_ABI", "5")
    original = mediator.RemoteMediation.__init__

    def without_gate(self: mediator.RemoteMediation, policy: object, signals: bool = False,
                     *process: object, **options: object) -> None:  # passed on
        original(self, policy, False, *process, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(mediator.RemoteMediation, "__init__", without_gate)
    script = _program(tmp_path, SIGNAL_ATTACKS["kill"])
    with sandlock.Sandbox(_gate_policy(tmp_path, "", ALLOW)) as box:
        result = box.run([PYTHON, str(script), str(victim.pid)])
        assert result.returncode == 125 and "does not carry it" in str(result.error), result
        for _ in range(2):  # a spare made at the call, then one made ahead of it
            with pytest.raises(SandlockError, match="does not carry it"):
                box.call(os.kill, victim.pid, signal.SIGTERM)
    assert not _reached(victim)


@pytest.mark.parametrize("abi", (2, 5))
def test_signal_gate_in_call_under_network_allow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: subprocess.Popen[bytes],
        abi: int) -> None:
    """call() under [network] allow: the spare has no gate's listener of its own; the
    mediator's, installed before the function runs, carries the gate. Two calls: the
    second runs in a spare made ahead of it."""
    import signal

    import sandlock

    require_abi(abi, "pretending this ABI")
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    policy = _gate_policy(tmp_path, 'accept = ["tcp-ports"]' if abi < 4 else "", ALLOW)
    with sandlock.Sandbox(policy) as box:
        for _ in range(2):
            with pytest.raises(PermissionError):
                box.call(os.kill, victim.pid, signal.SIGTERM)
        box.call(os.kill, 0, 0)
    assert not _reached(victim)


def test_signal_gate_in_call_under_network_allow_control(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: subprocess.Popen[bytes]) -> None:
    """Positive control: the same call without the signal scope kills the sleeper."""
    import signal

    import sandlock

    require_abi(5, "pretending ABI 5")
    monkeypatch.setenv("SANDLOCK_ABI", "5")
    policy = _gate_policy(tmp_path, NO_SCOPE[0], ALLOW + "\n" + NO_SCOPE[1])
    with sandlock.Sandbox(policy) as box:
        box.call(os.kill, victim.pid, signal.SIGTERM)
    assert _reached(victim) and _dead(victim)  # seen at once, as the refusals are


#: Signal-driven I/O on the terminal the tool inherits: the kernel makes the terminal's
#: foreground process group the owner (tty_fasync), with no F_SETOWN for the gate to see.
TTY_ASYNC = {
    "o_async": "fcntl.fcntl(0, fcntl.F_SETFL, fcntl.fcntl(0, fcntl.F_GETFL) | os.O_ASYNC)",
    "fioasync": "fcntl.ioctl(0, 0x5452, (1).to_bytes(4, sys.byteorder))",  # FIOASYNC
}


@pytest.mark.parametrize("way", sorted(TTY_ASYNC))
@pytest.mark.parametrize("gate", [True, False], ids=["gated", "control"])
def test_a_terminal_the_tool_inherits_signals_no_foreground_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: bool, way: str) -> None:
    """The caller's terminal on the tool's stdin, its foreground job a sleeper outside the
    sandbox. O_ASYNC on it (FIOASYNC alike) makes each input byte a signal to that job.
    Control: without the gate's seccomp half, the sleeper gets SIGTERM.

    The launcher gives a tool a pty of its own in place of a terminal (test_terminal.py),
    which keeps this route from the caller's terminal too: switched off here, so that the
    seccomp half is what holds (a terminal handed over some other way, a tool's own pty)."""
    import fcntl
    import termios
    import threading

    from sandlock.exec import launcher

    monkeypatch.setattr(launcher, "is_terminal", lambda _fd: False)
    master, slave = os.openpty()

    def foreground() -> None:  # in the sleeper: its own session, the terminal its own
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        os.tcsetpgrp(slave, os.getpgrp())

    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=foreground,
                               pass_fds=(slave,))
    saved = os.dup(0)
    typing = threading.Timer(0.7, os.write, (master, b"x\n"))
    try:
        for _ in range(100):  # the sleeper's terminal's foreground group (stat's tpgid)
            fields = Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[5]) == sleeper.pid:
                break
            time.sleep(0.02)
        assert int(fields[5]) == sleeper.pid, fields
        script = _program(tmp_path, "fcntl.fcntl(0, 10, signal.SIGTERM)\n"  # F_SETSIG
                                    f"{TTY_ASYNC[way]}\ntime.sleep(1.5)")  # input comes
        os.dup2(slave, 0)
        typing.start()
        code = _confined(tmp_path, 5, monkeypatch, [PYTHON, str(script), "0"], gate=gate)
        typing.join()
        if gate:
            assert code == errno.EPERM and not _reached(sleeper), code
        else:
            assert _reached(sleeper) and _dead(sleeper), code
    finally:
        typing.cancel()
        os.dup2(saved, 0)
        os.close(saved)
        sleeper.kill()
        sleeper.wait()
        os.close(master)
        os.close(slave)
