"""`sandlock trace`, `sandlock learn` and the exec report of `sandlock run`, with real tools.

Every test runs real programs on the real kernel. For each tool: a too-strict policy
makes it fail, `trace` names the missing grant; `learn` writes a policy under which
the same command succeeds while a planted ``$HOME/.ssh/id_rsa`` stays unreadable.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator, Sequence

import pytest
from conftest import PLANTED_KEY, require_tool

from sandlock.compile import abi as A
from sandlock.linux import kernel
from sandlock.trace import record as T
from sandlock.trace.learn import cover

REPO = Path(__file__).resolve().parent.parent
SECRET = PLANTED_KEY

pytestmark = pytest.mark.skipif(T.supported() is not None, reason=str(T.supported()))


def cli(args: Sequence[str], cwd: Path, home: Path, timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    """The sandlock of the tree under test (an installed copy would not be the one the
    mutation check changed), with -P: ``python -m`` would otherwise put ``cwd`` on the
    import path and so make it a directory no policy may write."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-P", "-m", "sandlock", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def policy(directory: Path, body: str, name: str = "strict.toml") -> Path:
    path = directory.parent / name
    path.write_text("version = 1\n" + body)
    return path


def learn_then_run(work: Path, home: Path, argv: Sequence[str], options: Sequence[str] = ()
                   ) -> tuple[Path, str]:
    """`learn` then `run` of ``argv``; returns the draft's path and text."""
    out = work.parent / "learned.toml"
    learned = cli(["learn", *options, "-o", str(out), "--", *argv], work, home)
    assert learned.returncode == 0, learned.stderr
    text = out.read_text()
    assert ".ssh" not in text.replace("# ", "")  # not granted (a comment may name it)
    assert f'"{home}"' not in text and f'"{home}/"' not in text
    ran = cli(["run", "--policy", str(out), "--var", f"workspace={work.resolve()}", "--", *argv],
              work, home)  # the directory it was learned in (${workspace}), as learn says
    assert ran.returncode == 0, (text, ran.stderr)
    return out, text


def secret_refused(learned: Path, work: Path, home: Path, argv: Sequence[str]) -> None:
    """Under the learned policy, the tool itself cannot read the planted key."""
    ran = cli(["run", "--policy", str(learned), "--var", f"workspace={work.resolve()}", "--",
               *argv], work, home)
    assert SECRET not in ran.stdout + ran.stderr
    assert ran.returncode != 0


# ----------------------------------------------------------------------------
# Pure parts


def test_notify_filter_ends_with_allow_then_notify() -> None:
    prog = T.notify_filter(False)
    assert len(prog) % 8 == 0
    assert prog[-16:-8][4:] == (kernel.SECCOMP_RET_ALLOW).to_bytes(4, "little")
    assert prog[-8:][4:] == (kernel.SECCOMP_RET_USER_NOTIF).to_bytes(4, "little")
    # with [network] allow, connect is left to the host-allowlist supervisor
    assert len(T.notify_filter(True)) == len(prog) - 8


def test_interpreters_of_an_elf_and_a_script(tmp_path: Path) -> None:
    loaders = T.interpreters("/bin/sh")
    assert loaders and "ld" in os.path.basename(loaders[0][0])
    script = tmp_path / "s"
    script.write_text("#!/bin/sh -e\necho\n")
    chain = T.interpreters(str(script))
    assert chain[0] == ("/bin/sh", f"#! interpreter of {script}")
    assert len(chain) == 2  # and the shell's own loader


def test_judge_names_the_smallest_grant() -> None:
    judge = T.Judge(7, [("/usr/lib", int(A.fs_read(7)), True)], {443: int(A.Net.CONNECT_TCP)})
    read = T.Event("openat", (T.Target("/etc/gitconfig", "/etc/gitconfig", "file"),), 0)
    fine = T.Event("openat", (T.Target("/usr/lib/x", "/usr/lib/x", "file"),), 0)
    missing = T.Event("openat", (T.Target("/etc/nope", "/etc/nope", ""),), 0)
    create = T.Event("openat", (T.Target("/usr/lib/new", "/usr/lib/new", ""),), T.O_CREAT | 1)
    port = T.Event("connect", port=8080, family=2, sock_type=1)
    granted_port = T.Event("connect", port=443, family=2, sock_type=1)
    lines = [str(d) for d in judge.denials([read, fine, missing, create, port, granted_port])]
    assert lines[0] == 'denied read /etc/gitconfig -> [filesystem] read += "/etc/gitconfig"'
    # a write grant `run` refuses (a system directory) is never suggested: why there is none
    assert lines[1].startswith('denied create /usr/lib -> [filesystem] (no policy line: '
                               '`sandlock run` refuses write += "/usr/lib": ')
    assert lines[2:] == ["denied connect TCP port 8080 -> [network] connect += [8080]"]


def test_cover_leaves_a_hole(tmp_path: Path) -> None:
    (tmp_path / "a" / "secret").mkdir(parents=True)
    (tmp_path / "a" / "ok").mkdir()
    (tmp_path / "b").mkdir()
    got = cover(str(tmp_path), [str(tmp_path / "a" / "secret")])
    assert sorted(got) == [str(tmp_path / "a" / "ok"), str(tmp_path / "b")]


# ----------------------------------------------------------------------------
# `sandlock run` names the file an exec refusal was about


def test_run_names_the_refused_interpreter(work: Path, home: Path) -> None:
    script = work / "tool.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    strict = policy(work, f'extends = ["base"]\n[filesystem]\nexec = ["{script}"]\n')
    result = cli(["run", "--policy", str(strict), "--", str(script)], work, home)
    assert result.returncode == 126
    shell = os.path.realpath("/bin/sh")  # the file the link leads to is the one refused
    assert f"{shell} (#! interpreter of {script}" in result.stderr
    assert "has no read or exec grant" in result.stderr
    assert f'exec += "{shell}"' in result.stderr
    assert f"{script} (the command)" not in result.stderr  # the script itself is granted


def test_run_names_a_missing_exec_right_on_a_readable_file(work: Path, home: Path) -> None:
    strict = policy(work, 'extends = ["base"]\n[filesystem]\nread = ["/usr/bin"]\n')
    result = cli(["run", "--policy", str(strict), "--", "/usr/bin/true"], work, home)
    assert result.returncode == 126
    assert "/usr/bin/true (the command) has no exec grant" in result.stderr


def test_run_hints_at_trace_when_the_command_fails(work: Path, home: Path) -> None:
    strict = policy(work, 'extends = ["base"]\n[filesystem]\nexec = ["/usr/bin/false"]\n')
    result = cli(["run", "--policy", str(strict), "--", "/usr/bin/false"], work, home)
    assert result.returncode == 1
    assert "sandlock: hint: false exited with 1; `sandlock trace`" in result.stderr


# ----------------------------------------------------------------------------
# Recording never widens the sandbox


def test_trace_still_refuses_what_run_refuses(work: Path, home: Path) -> None:
    strict = policy(work, 'extends = ["base"]\n[filesystem]\nexec = ["/usr/bin/cat"]\n')
    result = cli(["trace", "--policy", str(strict), "--json", "--report", "-", "--",
                  "/usr/bin/cat", str(home / ".ssh" / "id_rsa")], work, home)
    assert result.returncode == 1
    assert SECRET not in result.stdout
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["exit_code"] == 1
    assert {"right": "read", "path": str(home / ".ssh" / "id_rsa"), "section": "filesystem",
            "grant": f'read += "{home / ".ssh" / "id_rsa"}"',
            "warning": f"exposes {home / '.ssh'}, a place of secrets (keys, credentials): grant "
                       "it only if the tool must read it"} in report["denials"]


def test_learn_never_grants_a_listed_home_or_its_keys(work: Path, home: Path) -> None:
    out = work.parent / "learned.toml"
    learned = cli(["learn", "-o", str(out), "--", "/bin/sh", "-c",
                   'ls "$HOME" >/dev/null; cat "$HOME/.ssh/id_rsa"; ls /usr/share >/dev/null'],
                  work, home)
    assert SECRET not in learned.stdout + learned.stderr  # refused during the recorded run
    assert "Permission denied" in learned.stderr
    text = out.read_text()
    grants = [line for line in text.splitlines() if line.lstrip().startswith('"')]
    assert not any(".ssh" in g or g.strip().startswith((f'"{home}"', f'"{home}/.ssh')) for g in grants)
    # A directory holding a secret cannot be listed in the recorded run (Landlock grants
    # a directory with everything beneath it), and is never granted in the draft.
    assert f"refused during the recorded run, not granted: read {home} (ls)" in text
    assert f"read {home}/.ssh/id_rsa (cat)" in text


# ----------------------------------------------------------------------------
# Real tools


def test_git(work: Path, home: Path) -> None:
    git = require_tool("git")
    repo = work
    env = {**os.environ, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run([git, "init", "-q", str(repo)], check=True, env=env)
    subprocess.run([git, "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a", "commit",
                    "-q", "--allow-empty", "-m", "first"], check=True, env=env)
    (home / ".gitconfig").write_text("[core]\n\tpager = cat\n")
    strict = policy(work, f'extends = ["base"]\n[filesystem]\nexec = ["{git}"]\n'
                          '[env]\npass = ["PATH", "HOME"]\n')
    traced = cli(["trace", "--policy", str(strict), "--", "git", "log"], repo, home)
    assert traced.returncode != 0
    assert any(f"denied read {p}" in traced.stderr
               for p in ("/etc/gitconfig", str(home / ".gitconfig"), str(repo)))
    learned, _ = learn_then_run(repo, home, ["git", "log"])
    secret_refused(learned, repo, home, ["git", "hash-object", str(home / ".ssh" / "id_rsa")])


def test_cc(work: Path, home: Path) -> None:
    cc = require_tool("cc")
    (work / "hello.c").write_text('#include <stdio.h>\nint main(void){puts("hi");return 0;}\n')
    strict = policy(work, f'extends = ["base"]\n[filesystem]\nexec = ["{cc}"]\n'
                          'read = ["/usr/include"]\nwrite = ["${cwd}"]\n'
                          '[env]\npass = ["PATH"]\nset = { TMPDIR = "${cwd}" }\n')
    traced = cli(["trace", "--policy", str(strict), "--", "cc", "-o", "hello", "hello.c"], work, home)
    assert traced.returncode != 0
    assert any(f"denied exec {p}" in traced.stderr for p in ("cc1", "/as", "/ld", "collect2")) or \
        "denied exec" in traced.stderr and "gcc" in traced.stderr, traced.stderr
    learned, _ = learn_then_run(work, home, ["cc", "-o", "hello", "hello.c"])
    assert subprocess.run([str(work / "hello")], capture_output=True, text=True).stdout == "hi\n"
    secret_refused(learned, work, home, ["cc", "-E", "-x", "c", str(home / ".ssh" / "id_rsa")])


def test_python_venv(work: Path, home: Path) -> None:
    python = "/usr/bin/python3"  # the distribution's, which the python profile grants
    if not os.path.exists(python):
        pytest.skip("no /usr/bin/python3")
    venv = work / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    vpython = venv / "bin" / "python"
    strict = policy(work, 'extends = ["python"]\n')
    code = "import json, email, sys; print(sys.prefix)"
    traced = cli(["trace", "--policy", str(strict), "--", str(vpython), "-c", code], work, home)
    assert f"denied read {venv / 'pyvenv.cfg'}" in traced.stderr, traced.stderr
    learned, _ = learn_then_run(work, home, [str(vpython), "-c", code])
    secret_refused(learned, work, home, [str(vpython), "-c",
                                         f"print(open({str(home / '.ssh' / 'id_rsa')!r}).read())"])


@pytest.fixture
def server() -> Iterator[int]:
    """A loopback HTTP server answering one short response per connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    done.set()
    listener.close()


def test_curl(work: Path, home: Path, server: int) -> None:
    curl = require_tool("curl")
    url = f"http://127.0.0.1:{server}/"
    strict = policy(work, f'extends = ["base"]\n[filesystem]\nexec = ["{curl}"]\n'
                          '[network]\nconnect = [1]\n')
    traced = cli(["trace", "--policy", str(strict), "--", "curl", "-sS", url], work, home)
    assert traced.returncode != 0
    assert f"denied connect TCP port {server} -> [network] connect += [{server}]" in traced.stderr
    learned, text = learn_then_run(work, home, ["curl", "-sS", "-o", "/dev/null", url],
                                   ["--allow-net"])
    assert f"connect = [{server}]" in text
    secret_refused(learned, work, home, ["curl", "-sS", f"file://{home}/.ssh/id_rsa"])


def test_rg(work: Path, home: Path) -> None:
    rg = require_tool("rg")
    (work / "notes.txt").write_text("needle\n")
    strict = policy(work, f'extends = ["base"]\n[filesystem]\nexec = ["{rg}"]\n')
    traced = cli(["trace", "--policy", str(strict), "--", "rg", "needle", "."], work, home)
    assert traced.returncode != 0
    assert f"denied read {work}" in traced.stderr, traced.stderr
    learned, _ = learn_then_run(work, home, ["rg", "needle", "."])
    secret_refused(learned, work, home, ["rg", "OPENSSH", str(home / ".ssh" / "id_rsa")])


