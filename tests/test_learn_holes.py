"""Attacks on `sandlock learn` and `sandlock trace` by the tool they record, on the real kernel.

1. Tool-controlled names (file, executable, ``#!`` line) never reach the draft, its
   comments or the terminal unescaped: the draft parses to exactly the grants used.
2. The suggested command line is shell-quoted: pasted, the whole command runs confined.
3. The recorded run reaches no Unix socket outside it (ssh-agent's stand-in here) and
   no network unless asked (``--allow-unix``, ``--allow-net``); a draft that grants
   ``unix``, ``udp`` or ``/proc`` says what it exposes in a WARNING.
8. The recorder never opens a ``#!`` interpreter that is not a regular file (a FIFO
   would hang it), in the CLI and through the API.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest
import tomllib
from conftest import PLANTED_KEY, require_tool

from sandlock.compile import abi as A
from sandlock.trace import emit
from sandlock.trace import learn as L
from sandlock.trace import record as T

REPO = Path(__file__).resolve().parent.parent
SECRET = PLANTED_KEY

pytestmark = pytest.mark.skipif(T.supported() is not None, reason=str(T.supported()))


def cli(args: Sequence[str], cwd: Path, home: Path, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    """The CLI as a separate process (``-P``: the working directory is not put on the
    import path, so it is not a directory the package is loaded from)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-P", "-m", "sandlock", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)




def _draft(events: Sequence[T.Event], allowed: T.Judge, tmp: Path, argv: Sequence[str] = ("x",)
           ) -> tuple[str, list[str]]:
    """(text, warnings) of :func:`sandlock.trace.learn.draft` for ``events``."""
    result = L.draft(events, 7, argv=argv, cwd=str(tmp / "cwd"), tmpdir=str(tmp / "tmp"),
                     home=str(tmp / "home"), allowed=allowed)
    return result.text, result.warnings


def _printable(text: str) -> str:
    return emit.printable(text)


def grants(text: str) -> dict[str, object]:
    """The draft, parsed as the policy loader parses it."""
    return tomllib.loads(text)


# ----------------------------------------------------------------------------
# 1. Names a tool controls, in the draft


NASTY = ["new\nline", 'quo"te', "hash#mark", "close]bracket", "back\\slash", "ctl\x01\x7f",
         "esc\x1b[2J\x1b]0;title\x07", 'tilde\n"~",  #', "bidi\u202etxt", "tab\there",
         "cr\rreturn", "dollar$sign"]


def test_draft_parses_to_exactly_the_grants_when_names_are_hostile(tmp_path: Path) -> None:
    """Every hostile name, as a file read, an executable, a #! interpreter, a program
    name and a refused access: the draft parses, and grants exactly what was used."""
    data = tmp_path / "data"
    data.mkdir()
    for index in range(80):  # never "tight": each file is its own grant
        (data / f"filler{index}").write_text("")
    files = []
    events = []
    for name in NASTY:
        path = data / name
        path.write_text("x")
        files.append(str(path))
        prog = str(tmp_path / name)  # the program that read it (a comment names it)
        events.append(T.Event("openat", (T.Target(str(path), str(path), "file"),), 0, program=prog))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    interp = bin_dir / 'in"ter#]\\\x1b[0m\x7f'  # the kernel ends a #! path at a blank
    interp.write_text("")
    script = bin_dir / "scr\x1bipt\n\"~\", #"
    script.write_text(f"#!{interp}\n")
    events.append(T.Event("execve", (T.Target(str(script), str(script), "file"),), 0))
    refused = tmp_path / "refused\n\"~\",\x1b[31m"
    refused.write_text("")
    events.append(T.Event("openat", (T.Target(str(refused), str(refused), "file"),), 0,
                          program="/x/pro\ngram"))
    rights = int(A.fs_read(7) | A.Fs.EXECUTE)
    allowed = T.Judge(7, [(str(data), rights, True), (str(bin_dir), rights, True)])
    argv = ["sh", "-c", "a | b > 'c'\n\x1b[2J"]
    text, _ = _draft(events, allowed, tmp_path, argv)
    parsed = grants(text)
    fs = parsed["filesystem"]
    assert isinstance(fs, dict)
    assert sorted(fs["read"]) == sorted(files)
    assert sorted(fs["exec"]) == sorted([str(script), str(interp)])
    assert "write" not in fs and "network" not in parsed
    assert parsed["description"] == "learned from: " + shlex.join(argv)
    for line in text.splitlines():  # no control character, in grants or comments
        assert line.isprintable(), repr(line)
    assert f"not granted: read {_printable(str(refused))}" in text


def test_toml_values_read_back_as_written() -> None:
    """The draft's arrays and inline tables (:func:`emit.toml_value`) hold hostile
    strings, as keys too, as exactly themselves, on one line."""
    value: dict[str, emit.TomlValue] = {
        "k": NASTY, "TMPDIR": "${workspace}", "n": [1, 65535], "b": [True, False],
        **{name: name for name in NASTY}}
    text = f"v = {emit.toml_value(value)}"
    assert "\n" not in text and text.isprintable()
    assert grants(text) == {"v": value}


def test_draft_never_names_a_path_it_cannot_spell(tmp_path: Path) -> None:
    """A policy expands ``${...}``, and cannot hold a name that is not UTF-8: such a
    file is left out (and said), never granted under another name."""
    data = tmp_path / "data"
    data.mkdir()
    for index in range(80):
        (data / f"filler{index}").write_text("")
    expands = data / "${home}"
    expands.write_text("")
    raw = os.fsdecode(bytes(data) + b"/bad\xff")
    with open(os.fsencode(raw), "w"):
        pass
    events = [T.Event("openat", (T.Target(p, p, "file"),), 0) for p in (str(expands), raw)]
    allowed = T.Judge(7, [(str(data), int(A.fs_read(7)), True)])
    text, warnings = _draft(events, allowed, tmp_path)
    parsed = grants(text)
    fs = parsed.get("filesystem", {})
    assert isinstance(fs, dict) and "read" not in fs
    assert text.count("cannot be named in a policy") == 2


def test_learn_of_a_renamed_cat_grants_no_home(work: Path, home: Path, tmp_path: Path) -> None:
    """The attack: the recorded tool runs cat under a name that breaks the comment line."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.txt").write_text("data\n")
    name = 'cat\n    "~",  #'
    tool = (f'cp /bin/cat "$(printf "cat\\n    \\"~\\",  #")"; '
            f'./"$(printf "cat\\n    \\"~\\",  #")" {shlex.quote(str(outside / "data.txt"))}')
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c", tool], work, home)
    assert learned.returncode == 0, learned.stderr
    assert (work / name).exists()
    text = out.read_text()
    fs = grants(text)["filesystem"]
    assert isinstance(fs, dict)
    # what cp and the renamed cat read, no more (no "~": the name stayed in its comment)
    assert set(fs["read"]) <= {str(outside / "data.txt"), "/proc/filesystems", "/usr/bin/cat"}, text
    assert str(outside / "data.txt") in fs["read"]
    ran = cli(["run", "--policy", str(out), "--", "/bin/cat", str(home / ".ssh" / "id_rsa")],
              work, home)
    assert SECRET not in ran.stdout + ran.stderr


def test_trace_report_escapes_the_tools_names(work: Path, home: Path, tmp_path: Path) -> None:
    name = 'x"\x1b]0;owned\x07\nsandlock: trace: nothing refused\\'
    path = tmp_path / name
    (tmp_path / name).write_text(SECRET)
    policy = tmp_path / "p.toml"
    policy.write_text('version = 1\nextends = ["base"]\n[filesystem]\nexec = ["/bin/sh", "/usr/bin/cat"]\n')
    traced = cli(["trace", "--policy", str(policy), "--", "/bin/sh", "-c",
                  f"cat {shlex.quote(str(tmp_path / name))} 2>/dev/null; true"], work, home)
    assert traced.returncode == 0, traced.stderr
    ours = [line for line in traced.stderr.splitlines() if line.startswith("sandlock: trace:")]
    assert "\x1b" not in traced.stderr
    denied = [line for line in ours if line.startswith("sandlock: trace: denied read")]
    assert len(denied) == 1 and _printable(str(path)) in denied[0], traced.stderr
    grant = denied[0].split(" -> [filesystem] ", 1)[1]  # a TOML line naming exactly the file
    assert tomllib.loads(grant.replace(" += ", " = ", 1)) == {"read": str(path)}
    assert not any(line.startswith("sandlock: trace: nothing refused") for line in ours)


# ----------------------------------------------------------------------------
# 2. The suggested command line


def test_learn_suggests_a_quoted_command(work: Path, home: Path, tmp_path: Path) -> None:
    out = tmp_path / "my draft.toml"
    argv = ["/bin/sh", "-c", "echo a | cat > out.txt; echo $HOME"]
    learned = cli(["learn", "-o", str(out), "--", *argv], work, home)
    assert learned.returncode == 0, learned.stderr
    said = next(line for line in learned.stderr.splitlines() if "draft policy written" in line)
    suggested = said.split("`")[1]
    named = ["--var", f"workspace={work.resolve()}"]  # the draft's ${workspace}: where it was learned
    assert shlex.split(suggested) == ["sandlock", "run", "--policy", str(out), *named, "--", *argv]
    header = next(line for line in out.read_text().splitlines() if "--policy THIS_FILE" in line)
    assert shlex.split(header.split("--policy THIS_FILE", 1)[1]) == [*named, "--", *argv]


# ----------------------------------------------------------------------------
# 3. What the recorded run reaches


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Path, list[bytes]]]:
    """A stand-in for ssh-agent: a Unix socket server outside every grant of the run
    (mode 0777, so only the sandbox can keep a tool out), which records what it got."""
    sock_dir = tmp_path / "agent"
    sock_dir.mkdir()
    path = sock_dir / "agent.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen(4)
    server.settimeout(0.2)
    got: list[bytes] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    got.append(conn.recv(64))
                    conn.sendall(b"signed")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, got
    done.set()
    thread.join()
    server.close()


def _dial(path: Path) -> list[str]:
    code = textwrap.dedent(f"""\
        import socket, sys
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect({str(path)!r})
            s.sendall(b"sign this")
            print("AGENT:", s.recv(16))
        except OSError as exc:
            print("REFUSED:", exc)
        """)
    return ["/usr/bin/python3", "-c", code]


def test_recorded_run_cannot_reach_an_agent_socket(work: Path, home: Path,
                                                   agent: tuple[Path, list[bytes]]) -> None:
    path, got = agent
    learned = cli(["learn", "--", *_dial(path)], work, home)
    assert learned.returncode == 0, learned.stderr
    assert "REFUSED:" in learned.stdout + learned.stderr, learned.stdout + learned.stderr
    assert got == []
    assert "unix = true" not in learned.stdout


def test_allow_unix_reaches_it_and_the_draft_warns(work: Path, home: Path,
                                                   agent: tuple[Path, list[bytes]]) -> None:
    """Positive control: the same tool, the user having asked for Unix sockets."""
    path, got = agent
    learned = cli(["learn", "--allow-unix", "--", *_dial(path)], work, home)
    assert learned.returncode == 0, learned.stderr
    assert "AGENT: b'signed'" in learned.stdout
    assert got == [b"sign this"]
    draft = learned.stdout[learned.stdout.index("# Draft"):]
    assert grants(draft)["network"] == {"unix": True}
    line = next(x for x in draft.splitlines() if x.startswith("unix = true"))
    assert "WARNING" in line and "ssh-agent" in line
    assert any("WARNING" in x and "unix" in x and "ssh-agent" in x
               for x in learned.stderr.splitlines())


@pytest.fixture
def tcp_server() -> Iterator[tuple[int, list[bytes]]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    got: list[bytes] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                got.append(b"connected")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], got
    done.set()
    thread.join()
    listener.close()


def _tcp(port: int) -> list[str]:
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 5).close()\n"
            "    print('CONNECTED')\nexcept OSError as exc:\n    print('REFUSED:', exc)\n")
    return ["/usr/bin/python3", "-c", code]


def test_recorded_run_has_no_network_unless_asked(work: Path, home: Path,
                                                  tcp_server: tuple[int, list[bytes]]) -> None:
    port, got = tcp_server
    learned = cli(["learn", "--", *_tcp(port)], work, home)
    assert "REFUSED:" in learned.stdout, learned.stdout + learned.stderr
    time.sleep(0.3)
    assert got == []
    asked = cli(["learn", "--allow-net", "--", *_tcp(port)], work, home)  # positive control
    assert "CONNECTED" in asked.stdout, asked.stdout + asked.stderr
    draft = asked.stdout[asked.stdout.index("# Draft"):]
    assert grants(draft)["network"] == {"connect": [port]}


def test_learn_help_names_the_options() -> None:
    helped = subprocess.run([sys.executable, "-P", "-m", "sandlock", "learn", "--help"],
                            capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    assert "--allow-unix" in helped.stdout and "--allow-net" in helped.stdout
    assert "ssh-agent" in helped.stdout


def test_draft_warns_for_unix_udp_and_proc(tmp_path: Path) -> None:
    events = [T.Event("socket", family=1, sock_type=1), T.Event("socket", family=2, sock_type=2),
              T.Event("openat", (T.Target("/proc/1234/status", "/proc/1234/status", "file"),), 0)]
    allowed = T.Judge(7, [("/", int(A.fs_read(7)), True)])
    text, warnings = _draft(events, allowed, tmp_path)
    parsed = grants(text)
    assert parsed["network"] == {"udp": True, "unix": True}
    assert parsed["filesystem"] == {"read": ["/proc"]}
    for key in ("udp = true", "unix = true", '"/proc"'):
        line = next(x for x in text.splitlines() if x.strip().startswith(key))
        assert "WARNING" in line, line
    assert len(warnings) == 3
    assert all(w.startswith("WARNING") for w in warnings)


def test_learn_refuses_a_working_directory_holding_secrets(home: Path) -> None:
    """The recorded run may write its working directory: in HOME, that is ~/.ssh."""
    learned = cli(["learn", "--", "/bin/cat", str(home / ".ssh" / "id_rsa")], home, home)
    assert learned.returncode == 125, learned.stderr
    assert SECRET not in learned.stdout + learned.stderr
    assert "learn: the working directory" in learned.stderr


# ----------------------------------------------------------------------------
# 8. A #! interpreter that is not a regular file

FIFO_TOOL = ('mkfifo fifo && printf "#!%s/fifo\\n" "$PWD" > script && chmod +x script && '
             './script; echo "done $?"')


def test_interpreters_never_open_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    script = tmp_path / "script"
    script.write_text(f"#!{fifo}\n")
    found: list[Optional[list[tuple[str, str]]]] = [None]
    thread = threading.Thread(target=lambda: found.__setitem__(0, T.interpreters(str(script))),
                              daemon=True)
    thread.start()
    thread.join(5)
    alive = thread.is_alive()
    if alive:  # release the old code's blocked open
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not alive
    assert found[0] == [(str(fifo), f"#! interpreter of {script}")]
    assert T.interpreters(str(fifo)) == []


def test_trace_ends_with_a_fifo_interpreter(work: Path, home: Path, tmp_path: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text('version = 1\nextends = ["base"]\n[filesystem]\n'
                      'exec = ["/bin", "/usr/bin"]\nwrite = ["${cwd}"]\n[limits]\ntimeout = "10s"\n')
    started = time.monotonic()
    try:
        traced = cli(["trace", "--policy", str(policy), "--", "/bin/sh", "-c", FIFO_TOOL],
                     work, home, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("sandlock trace hung on a FIFO named as #! interpreter")
    assert time.monotonic() - started < 15
    assert traced.returncode == 0, traced.stderr
    assert "done 126" in traced.stdout


def test_api_trace_ends_with_a_fifo_interpreter(tmp_path: Path) -> None:
    """Through the API, in a child process (on the old code its fork server hangs)."""
    code = textwrap.dedent(f"""\
        import os
        from sandlock import Sandbox
        os.chdir({str(tmp_path)!r})
        policy = {{"version": 1, "extends": ["base"],
                  "filesystem": {{"exec": ["/bin", "/usr/bin"], "write": ["${{cwd}}"]}}}}
        with Sandbox(policy) as box:
            r = box.run(["/bin/sh", "-c", {FIFO_TOOL!r}], capture_output=True, text=True,
                        trace=True, timeout=3)
        print(r.outcome.name, r.returncode, r.stdout.strip(), flush=True)
        os._exit(0)
        """)
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                              timeout=30, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        pytest.fail("Sandbox.run(trace=True) hung on a FIFO named as #! interpreter")
    assert done.stdout.strip() == "EXITED 0 done 126", done.stdout + done.stderr
    assert time.monotonic() - started < 15


def test_run_names_a_fifo_interpreter_without_opening_it(work: Path, home: Path,
                                                         tmp_path: Path) -> None:
    """`sandlock run`'s exec report reads the #! chain too (on EACCES), in the launcher;
    the name it prints is the tool's text: escaped."""
    fifo = work / "fi\x1b[2Jfo"
    os.mkfifo(fifo)
    script = work / "script"
    script.write_text(f"#!{fifo}\n")
    script.chmod(0o755)
    policy = tmp_path / "p.toml"
    policy.write_text(f'version = 1\nextends = ["base"]\n[filesystem]\nexec = ["{script}"]\n')
    try:
        ran = cli(["run", "--policy", str(policy), "--", str(script)], work, home, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("sandlock run hung on a FIFO named as #! interpreter")
    assert ran.returncode == 126, ran.stderr
    assert "\x1b" not in ran.stderr
    assert _printable(str(fifo)) in ran.stderr


def test_a_grant_holding_the_home_directory_is_warned(tmp_path: Path) -> None:
    """Only a run allowed more than learn's own could write above HOME; if a draft
    ever grants it, the grant says so."""
    data = tmp_path / "data"
    (data / "home").mkdir(parents=True)
    new = data / "new"
    events = [T.Event("openat", (T.Target(str(new), str(new), ""),), T.O_CREAT | 1)]
    allowed = T.Judge(7, [("/", int(A.fs_read(7) | A.fs_write(7)), True)])
    result = L.draft(events, 7, argv=["x"], cwd=str(tmp_path / "cwd"), tmpdir=str(tmp_path / "t"),
                     home=str(data / "home"), allowed=allowed)
    fs = grants(result.text)["filesystem"]
    assert isinstance(fs, dict) and fs["write"] == [str(data)]
    line = next(x for x in result.text.splitlines() if x.strip().startswith(f'"{data}"'))
    assert f"WARNING: exposes {data / 'home'}" in line
    assert any(f"exposes {data / 'home'}" in w for w in result.warnings)


def test_learn_runs_beside_names_no_policy_can_spell(work: Path, home: Path) -> None:
    """A name that is not UTF-8, or holds ``${``, beside a secret (the recorded run's
    policy lists the home directory entry by entry) stops no learn: it is left out
    of the recorded run's policy (unreadable there), never misnamed."""
    with open(os.fsencode(home) + b"/bad\xff", "w"):
        pass
    (home / "${home}").write_text("")
    (home / 'line\n"~", #').write_text("")
    learned = cli(["learn", "--", "/bin/true"], work, home)
    assert learned.returncode == 0, learned.stderr
    grants(learned.stdout)


# ----------------------------------------------------------------------------
# 9. A #! line naming no program grants nothing


def test_a_hash_bang_naming_a_directory_grants_nothing(work: Path, home: Path,
                                                       tmp_path: Path) -> None:
    """The tool writes scripts whose ``#!`` names a directory (absolute, and ``..``, which
    the recorder resolved from its own working directory) and runs them: the kernel
    refuses such an exec, so nothing was needed; learn's draft, trace's suggestion and
    run's report grant neither directory. Control: a ``#!`` naming a program (a copy of
    sh) is granted, that file alone."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "private.txt").write_text("private\n")
    shell = tmp_path / "bin" / "mysh"
    shell.parent.mkdir()
    shell.write_bytes(Path("/bin/sh").resolve().read_bytes())
    shell.chmod(0o755)
    tool = (f"printf '#!{outside}\\n' > a; printf '#!..\\n' > b; printf '#!{shell}\\ntrue\\n' > c; "
            "chmod +x a b c; ./a; ./b; ./c; true")
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c", tool], work, home)
    assert learned.returncode == 0, learned.stderr
    execs = grants(out.read_text())["filesystem"]["exec"]  # type: ignore[index]
    assert str(shell) in execs, execs  # control: a real interpreter is granted
    for where in (str(outside), str(work.parent), "~/" + os.path.relpath(work.parent, home)):
        assert where not in execs, (where, execs)
    assert str(tmp_path) not in out.read_text().replace(str(tmp_path) + "/", "")
    # trace and run, with a policy that may run the scripts but grants no interpreter
    policy = tmp_path / "p.toml"
    policy.write_text(f'version = 1\nextends = ["base"]\n[filesystem]\n'
                      f'exec = ["{work / "a"}", "{work / "b"}"]\n')
    for script in ("a", "b"):
        traced = cli(["trace", "--policy", str(policy), "--", str(work / script)], work, home)
        ran = cli(["run", "--policy", str(policy), "--", str(work / script)], work, home)
        for said in (traced.stdout + traced.stderr, ran.stderr):
            assert f'exec += "{outside}"' not in said and f'exec += "{tmp_path}"' not in said, said
        assert "is not a program" in ran.stderr, ran.stderr


def test_trace_warns_that_a_listing_grants_the_whole_directory(work: Path, home: Path,
                                                               tmp_path: Path) -> None:
    """A tool that lists the directory above its workspace: trace's line for it
    (``read += DIR``) would let it read every sibling project, so it carries a warning.
    Control: the line itself is still suggested (it is the smallest that grants it)."""
    projects = tmp_path / "projects"
    (projects / "tool").mkdir(parents=True)
    (projects / "other").mkdir()
    (projects / "other" / ".env").write_text("KEY=1\n")
    policy = tmp_path / "p.toml"
    policy.write_text(f'version = 1\nextends = ["base"]\n[filesystem]\n'
                      f'read = ["{projects / "tool"}"]\nexec = ["/usr/bin/sh", "/usr/bin/dash"]\n')
    traced = cli(["trace", "--policy", str(policy), "--", "/bin/sh", "-c", "cd ..; echo *"],
                 projects / "tool", home)
    said = traced.stdout + traced.stderr
    assert f'read += "{projects}"' in said, said
    assert f"read every file below {projects}" in said, said


# ----------------------------------------------------------------------------
# 9. The output file: written after a run the command controlled, in a directory it may write


def _output_attack(kind: str, work: Path, home: Path, tmp_path: Path
                   ) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """`learn -o` or `trace --report` into the working directory, whose recorded command
    puts a symbolic link to a file it may not write (the user's shell start-up file's
    stand-in) at the output's name, or makes the output's directory such a link."""
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "draft.toml"
    victim.write_text("the user's own file\n")
    (work / "drafts").mkdir()
    plant = (f"ln -s {shlex.quote(str(victim))} draft.toml; mv drafts drafts.old; "
             f"ln -s {shlex.quote(str(victim_dir))} drafts")
    policy = tmp_path / "p.toml"
    policy.write_text(f'version = 1\nextends = ["shell"]\n[filesystem]\nwrite = ["{work}"]\n')
    where = "draft.toml" if kind.endswith("file") else "drafts/draft.toml"
    if kind.startswith("learn"):
        args = ["learn", "-o", where, "--", "/bin/sh", "-c", plant]
    else:
        args = ["trace", "--policy", str(policy), "--var", f"workspace={work}", "--report", where,
                "--", "/bin/sh", "-c", plant]
    return cli(args, work, home), victim, work


@pytest.mark.parametrize("kind", ["learn-file", "learn-directory", "trace-file", "trace-directory"])
def test_the_output_is_never_written_through_a_link_the_command_made(
        kind: str, work: Path, home: Path, tmp_path: Path) -> None:
    done, victim, work = _output_attack(kind, work, home, tmp_path)
    assert victim.read_text() == "the user's own file\n", done.stderr
    if kind.endswith("file"):  # refused, and said so
        assert done.returncode == 125 and "not a regular file with one name" in done.stderr
        assert (work / "draft.toml").is_symlink()
    else:  # written where the directory was when the command started: its new name
        assert done.returncode == 0, done.stderr
        assert (work / "drafts.old" / "draft.toml").read_text().startswith(
            "sandlock: trace" if kind.startswith("trace") else "#")


def test_the_output_replaces_a_file_of_its_own(work: Path, home: Path) -> None:
    """Control: an output file that is there already (a regular file) is replaced whole."""
    (work / "draft.toml").write_text("x" * 100000)
    done = cli(["learn", "-o", "draft.toml", "--", "/bin/true"], work, home)
    assert done.returncode == 0, done.stderr
    assert (work / "draft.toml").read_text().startswith("#")
    assert not [p for p in work.iterdir() if p.name.startswith(".sandlock-output-")]


@pytest.mark.parametrize("walked_from", ["a pipe", "a file"])
def test_a_path_walked_from_no_directory_is_no_access(work: Path, home: Path, tmp_path: Path,
                                                      walked_from: str) -> None:
    """``openat(pipe, "../../x")`` fails in the kernel (ENOTDIR), but the recorder joined the
    path to its own working directory, and the draft granted read of files the command never
    read (a thirteenth attack round). Control: the same file read by its name is granted."""
    outside = tmp_path / "outside"
    outside.mkdir()
    never, read = outside / "never.txt", outside / "read.txt"
    never.write_text("never\n")
    read.write_text("read\n")
    up = "../" * 20
    tool = textwrap.dedent(f"""
        import os
        base = os.pipe()[0] if {walked_from == "a pipe"} else os.open({str(read)!r}, os.O_RDONLY)
        try:
            os.open({(up + str(never)[1:])!r}, os.O_RDONLY, dir_fd=base)
        except OSError as exc:
            print(exc.errno)
        print(open({str(read)!r}).read(), end="")
    """)
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", sys.executable, "-c", tool], work, home)
    assert learned.returncode == 0, learned.stderr
    fs = grants(out.read_text())["filesystem"]
    assert isinstance(fs, dict)
    assert str(read) in fs["read"]
    assert str(never) not in fs["read"], out.read_text()


def test_a_dot_dot_after_a_link_is_walked_from_the_links_target(work: Path, home: Path,
                                                                tmp_path: Path) -> None:
    """``d/../../notes.txt``, ``d`` a link into another tree: the kernel opens the file two
    levels above the link's target; the recorder normalised the path as text first and the
    draft granted a file beside the working directory the tool never read (a fourteenth
    attack round: any path could be granted so)."""
    far = tmp_path / "far" / "p1" / "p2"
    (far / "p3" / "p4").mkdir(parents=True)
    (far / "notes.txt").write_text("read\n")
    beside = tmp_path / "notes.txt"  # where the text d/../../notes.txt from work/ lands
    beside.write_text("never read\n")
    tool = f"ln -s {shlex.quote(str(far / 'p3' / 'p4'))} d && cat d/../../notes.txt"
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c", tool], work, home)
    assert learned.returncode == 0, learned.stderr
    assert learned.stdout == "read\n"
    fs = grants(out.read_text())["filesystem"]
    assert isinstance(fs, dict)
    assert str(far / "notes.txt") in fs["read"], out.read_text()
    assert str(beside) not in fs["read"], out.read_text()


def test_a_descriptor_or_directory_reused_is_walked_anew(work: Path, home: Path,
                                                         tmp_path: Path) -> None:
    """The recorder remembered the directory ``/proc/TID/fd/50`` named, and a ``dup2`` (or a
    ``chdir``, for ``/proc/self/cwd``), which it does not see, made it another: the draft
    missed the files read and named others (a fifteenth attack round). ``/dev/fd/N`` was
    resolved through the recorder's own ``/proc/self``."""
    a, b = tmp_path / "L" / "a", tmp_path / "L" / "b"
    a.mkdir(parents=True)
    b.mkdir()
    for where, name in ((a, "f1"), (b, "f2"), (b, "f3"), (b, "f4")):
        (where / name).write_text(name)
    tool = textwrap.dedent(f"""
        import os
        first = os.open({str(a)!r}, os.O_PATH | os.O_DIRECTORY)
        then = os.open({str(b)!r}, os.O_PATH | os.O_DIRECTORY)
        os.dup2(first, 50)
        open("/proc/self/fd/50/f1").read()
        os.dup2(then, 50)
        open("/proc/self/fd/50/f2").read()
        os.chdir({str(a)!r})
        open("/proc/self/cwd/f1").read()
        os.chdir({str(b)!r})
        open("/proc/self/cwd/f3").read()
        open("/dev/fd/50/f4").read()
    """)
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", sys.executable, "-c", tool], work, home)
    assert learned.returncode == 0, learned.stderr
    fs = grants(out.read_text())["filesystem"]
    assert isinstance(fs, dict)
    reads = fs["read"]
    assert isinstance(reads, list)
    for read in (a / "f1", b / "f2", b / "f3", b / "f4"):  # each file, or its directory
        assert any(str(read) == grant or str(read).startswith(grant + "/") for grant in reads), \
            (read, out.read_text())
    assert not any(grant == str(a) or grant.startswith(str(a / "f2")) for grant in reads)


def test_a_link_to_proc_self_is_the_tools(work: Path, home: Path, tmp_path: Path) -> None:
    """A link the tool made to ``/proc/self/cwd``, followed by the recorder's realpath, named
    the recorder's working directory: the draft missed the file read and named one never
    read there (a sixteenth attack round)."""
    there = tmp_path / "there"
    there.mkdir()
    (there / "data.txt").write_text("data\n")
    (work / "data.txt").write_text("the recorder's, never read\n")
    tool = f"ln -s /proc/self/cwd selfcwd && cd {shlex.quote(str(there))} && " \
           f"cat {shlex.quote(str(work))}/selfcwd/data.txt"
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c", tool], work, home)
    assert learned.returncode == 0, learned.stderr
    assert learned.stdout == "data\n"
    reads = grants(out.read_text())["filesystem"]["read"]  # type: ignore[index]
    assert isinstance(reads, list)
    assert any(str(there / "data.txt") == grant or str(there / "data.txt").startswith(grant + "/")
               for grant in reads), out.read_text()
    assert str(work / "data.txt") not in reads



def test_the_links_of_one_walk_count_together(work: Path, home: Path, tmp_path: Path) -> None:
    """A directory reached through 30 links, and in it a file reached through 30 more: the
    kernel refuses the open (ELOOP: 40 links a walk), but the recorder counted each half
    apart and the draft granted the file at the end (a seventeenth attack round)."""
    secret = tmp_path / "far" / "data.txt"
    secret.parent.mkdir()
    secret.write_text("far\n")
    chain = tmp_path / "chain"
    chain.mkdir()
    for n in range(30):
        (work / f"d{n}").symlink_to(work / f"d{n + 1}" if n < 29 else chain)
        (chain / f"f{n}").symlink_to(chain / f"f{n + 1}" if n < 29 else secret)
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c", "cat d0/f0; cat d0/f29"],
                  work, home)
    assert "far" in learned.stdout  # the second: 31 links, read
    reads = grants(out.read_text())["filesystem"]["read"]  # type: ignore[index]
    assert isinstance(reads, list) and str(secret) in reads, out.read_text()
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c", "cat d0/f0"], work, home)
    assert "far" not in learned.stdout  # ELOOP
    assert str(secret) not in out.read_text(), out.read_text()


def test_a_hard_link_of_a_link_is_walked_anew(work: Path, home: Path, tmp_path: Path) -> None:
    """``d2`` looked up while it was not there, then made a hard link of a symbolic link
    (``ln -P``): the recorder's memo named ``d2`` as it had been, and the read through it was
    recorded in the working directory, not where it went (a seventeenth attack round)."""
    there = tmp_path / "there"
    there.mkdir()
    (there / "data.txt").write_text("there\n")
    tool = (f"ln -s {shlex.quote(str(there))} s; cat d2/data.txt 2>/dev/null; "
            "ln -P s d2 && cat d2/data.txt")
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c", tool], work, home)
    assert learned.stdout == "there\n", learned.stderr
    reads = grants(out.read_text())["filesystem"]["read"]  # type: ignore[index]
    assert isinstance(reads, list)
    assert any(str(there / "data.txt") == grant or str(there / "data.txt").startswith(grant + "/")
               for grant in reads), out.read_text()


def test_another_processs_proc_links_are_not_the_tools(work: Path, home: Path,
                                                       tmp_path: Path) -> None:
    """The tool opened ``/proc/PID/cwd`` and ``/proc/PID/fd/N`` of a process not its own:
    the kernel refused each (Landlock scopes ptrace), but the recorder followed the links
    itself and the draft granted where the user's process stood and the file it held open
    (an eighteenth attack round). Only the tool's own process's links are followed."""
    private = tmp_path / "private-notes"
    private.mkdir()
    (private / "note.txt").write_text("private\n")
    vault = tmp_path / "vault.kdbx"
    vault.write_text("secret\n")
    with open(vault) as held:
        os.dup2(held.fileno(), 57)
        try:
            bystander = subprocess.Popen(["sleep", "60"], cwd=private, pass_fds=(57,))
        finally:
            os.close(57)
    tool = textwrap.dedent(f"""
        import os
        for path in ("/proc/{bystander.pid}/cwd/note.txt", "/proc/{bystander.pid}/fd/57",
                     "/proc/{bystander.pid}/cwd"):
            try:
                os.close(os.open(path, os.O_RDONLY))
                print("read", path)
            except OSError as exc:
                print("refused", exc.errno)
        print(open("/proc/self/cwd/mine.txt").read(), end="")
    """)
    (work / "mine.txt").write_text("mine\n")
    out = tmp_path / "draft.toml"
    try:
        learned = cli(["learn", "-o", str(out), "--", sys.executable, "-c", tool], work, home)
    finally:
        bystander.kill()
        bystander.wait()
    assert learned.returncode == 0, learned.stderr
    assert learned.stdout == "refused 13\n" * 3 + "mine\n", learned.stdout
    text = out.read_text()
    for never in ("private-notes", "vault.kdbx"):
        assert never not in text, text
    reads = grants(text)["filesystem"]["read"]  # type: ignore[index]
    assert isinstance(reads, list)
    assert any(str(work / "mine.txt") == grant or str(work / "mine.txt").startswith(grant + "/")
               or grant == "${workspace}" for grant in reads), text


#: A thread of its own working directory (cloned without CLONE_FS): it changes into
#: argv[1] and reads /proc/self/cwd/argv[2], which the kernel resolves through the
#: process (the thread group's leader), not the thread.
UNSHARED_THREAD = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
static char **args;
static volatile int finished;
static int thread(void *unused) {
    char path[4096], got[64] = {0};
    (void)unused;
    if (chdir(args[1]) == 0) {
        snprintf(path, sizeof path, "/proc/self/cwd/%s", args[2]);
        int fd = open(path, O_RDONLY);
        if (fd >= 0 && read(fd, got, sizeof got - 1) > 0)
            printf("%s", got);
        fflush(stdout);
    }
    finished = 1;
    syscall(SYS_exit, 0);
    return 0;
}
int main(int argc, char **argv) {
    (void)argc;
    args = argv;
    char *stack = malloc(1 << 20);
    if (!stack || clone(thread, stack + (1 << 20), CLONE_VM | CLONE_SIGHAND | CLONE_THREAD |
                        CLONE_FILES | CLONE_SYSVSEM, NULL) < 0)
        return 1;
    while (!finished)
        usleep(1000);
    return 0;
}
"""


def test_proc_self_is_the_process_not_the_thread(work: Path, home: Path, tmp_path: Path) -> None:
    """``/proc/self`` is the thread group's: a thread with a working directory of its own
    read ``/proc/self/cwd/notes``, the kernel opened the process's, and the draft granted
    the thread's instead (a nineteenth attack round)."""
    require_tool("cc")
    source = tmp_path / "thread.c"
    source.write_text(UNSHARED_THREAD)
    program = tmp_path / "thread"
    subprocess.run(["cc", "-O", "-o", str(program), str(source)], check=True)
    private = tmp_path / "private"
    private.mkdir()
    (private / "notes").write_text("never read\n")
    (work / "notes").write_text("read\n")
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", str(program), str(private), "notes"], work, home)
    assert learned.returncode == 0, learned.stderr
    assert learned.stdout == "read\n"  # the kernel's answer: the process's working directory
    text = out.read_text()
    fs = grants(text)["filesystem"]
    assert isinstance(fs, dict)
    everything = [grant for right in fs.values() if isinstance(right, list) for grant in right]
    assert not any(grant == str(private) or grant.startswith(f"{private}/")
                   for grant in everything), text
    assert any(str(work / "notes") == grant or str(work / "notes").startswith(grant + "/")
               or grant == "${workspace}" for grant in fs["read"]), text


def test_a_deleted_directory_or_file_is_no_path(work: Path, home: Path, tmp_path: Path) -> None:
    """The kernel names a deleted working directory or file in /proc as its old path and
    `` (deleted)``: the recorder walked that text, and a link the tool made by that name
    sent the draft anywhere (a twenty-second attack round). What is reached through a
    deleted directory is no access; a deleted file reopened is no path."""
    other = tmp_path / "other"
    (other / "private").mkdir(parents=True)
    (other / "private" / "data.txt").write_text("private\n")
    tool = textwrap.dedent(f"""
        import os
        os.mkdir("d"); os.chdir("d"); os.rmdir("../d")
        os.symlink({str(other)!r}, "../d (deleted)")
        for name in ("notes.txt", "."):
            try:
                os.close(os.open(name, os.O_RDONLY))
            except OSError:
                pass
        os.chdir({str(work)!r})
        fd = os.open("gone.txt", os.O_RDWR | os.O_CREAT, 0o600)
        os.unlink("gone.txt")
        os.symlink({str(other / "private" / "data.txt")!r}, "gone.txt (deleted)")
        os.close(os.open(f"/proc/self/fd/{{fd}}", os.O_RDONLY))
        print("done")
    """)
    out = tmp_path / "draft.toml"
    learned = cli(["learn", "-o", str(out), "--", sys.executable, "-c", tool], work, home)
    assert learned.returncode == 0, learned.stderr
    assert learned.stdout == "done\n"
    fs = grants(out.read_text())["filesystem"]
    assert isinstance(fs, dict)
    everything = [grant for right in fs.values() if isinstance(right, list) for grant in right]
    assert not any(grant == str(other) or grant.startswith(f"{other}/") for grant in everything), \
        out.read_text()
