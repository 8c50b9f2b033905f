"""Everyday tools do their real job on the first `sandlock run`, with the secret unreadable.

Each case is what the README recommends for that tool: a shipped profile, composed
with `extends` and the workspace the way a user would, run once. The tool must do its
job, and in the same kind of run, using its own ability to read files or its
environment, must fail to reach the private key planted in HOME (:data:`PLANTED_KEY`)
and the caller's ``API_KEY``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PLANTED_KEY, require_abi, require_tool, run_confined, write_policy

SECRET = "sk-first-try-0123456789"


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(4, "the shipped profiles (files and TCP ports)")


@pytest.fixture
def env(home: Path) -> dict[str, str]:
    """The caller's environment: HOME holds the planted key, API_KEY a secret."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(home),
            "API_KEY": SECRET}


@pytest.fixture
def policies(tmp_path: Path) -> Path:
    """Policy files live apart from the workspace (a write grant may not cover them)."""
    path = tmp_path / "policies"
    path.mkdir()
    return path


@pytest.fixture
def private_tmp(tmp_path: Path) -> Path:
    path = tmp_path / "private-tmp"
    path.mkdir()
    return path


def confined(policy: Path, argv: list[str], env: dict[str, str], **variables: Path | str
             ) -> subprocess.CompletedProcess[str]:
    return run_confined(policy, argv, variables={k: str(v) for k, v in variables.items()},
                        env=env, timeout=120)


def no_secret(done: subprocess.CompletedProcess[str]) -> None:
    assert PLANTED_KEY not in done.stdout + done.stderr
    assert SECRET not in done.stdout + done.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_git_clones_a_local_repository(policies: Path, work: Path, env: dict[str, str],
                                       home: Path) -> None:
    git = require_tool("git")
    identity = {"GIT_AUTHOR_NAME": "me", "GIT_AUTHOR_EMAIL": "me@example.org",
                "GIT_COMMITTER_NAME": "me", "GIT_COMMITTER_EMAIL": "me@example.org"}
    env = {**env, **identity}
    subprocess.run([git, "init", "-q", str(work / "src")], check=True, env=env)
    (work / "src" / "a.txt").write_text("first\n")
    subprocess.run([git, "-C", str(work / "src"), "add", "a.txt"], check=True, env=env)
    subprocess.run([git, "-C", str(work / "src"), "commit", "-qm", "one"], check=True, env=env)
    policy = write_policy(policies, """\
        version = 1
        extends = ["git"]
        [filesystem]
        write = ["${workspace}"]
        """)
    done = confined(policy, ["git", "clone", "-q", str(work / "src"), str(work / "dst")], env,
                    workspace=work)
    assert done.returncode == 0, done.stderr
    assert (work / "dst" / "a.txt").read_text() == "first\n"
    stolen = confined(policy, ["git", "-C", str(work / "dst"), "hash-object", "-w",
                               str(home / ".ssh" / "id_rsa")], env, workspace=work)
    assert stolen.returncode != 0
    no_secret(stolen)


def test_pytest_in_a_venv(policies: Path, work: Path, env: dict[str, str], home: Path,
                          private_tmp: Path) -> None:
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a venv: no venv with pytest to confine")
    venv = Path(sys.prefix)  # the venv running these tests has pytest
    project = work / "project"
    project.mkdir()
    # pytest reads the first configuration file above its arguments: this one, not one an
    # ungranted parent directory may hold (reading that would be refused).
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_job.py").write_text(
        "import os, pathlib\n"
        "def test_job(tmp_path):\n"
        "    (tmp_path / 'x').write_text('1')\n"
        "def test_secret():\n"
        f"    assert os.environ.get('API_KEY') is None\n"
        f"    try:\n"
        f"        pathlib.Path({str(home / '.ssh' / 'id_rsa')!r}).read_text()\n"
        f"    except PermissionError:\n"
        f"        return\n"
        f"    raise AssertionError('the key was readable')\n")
    policy = write_policy(policies, """\
        version = 1
        extends = ["venv", "tmpdir"]
        [filesystem]
        write = ["${workspace}"]
        """)
    done = confined(policy, [sys.executable, "-m", "pytest", "-q",
                             "-p", "no:cacheprovider", str(project)], env,
                    workspace=project, venv=venv, private_tmp=private_tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert not [p for p in project.iterdir() if p.name.startswith("pytest-of-")]
    no_secret(done)


def test_gcc_and_make_build_a_program(policies: Path, work: Path, env: dict[str, str],
                                      home: Path, private_tmp: Path) -> None:
    require_tool("cc")
    require_tool("make")
    (work / "hello.c").write_text('#include <stdio.h>\nint main(void){puts("built");return 0;}\n')
    (work / "Makefile").write_text(
        f"hello: hello.c\n\tcc -o hello hello.c\n"
        f"leak:\n\t@echo key=$(file < {home / '.ssh' / 'id_rsa'}) api=$(API_KEY)\n")
    policy = write_policy(policies, """\
        version = 1
        extends = ["cc"]
        [filesystem]
        write = ["${workspace}"]
        exec = ["/usr/bin/make", "${workspace}"]
        """)
    done = confined(policy, ["make", "-C", str(work), "hello"], env, workspace=work,
                    private_tmp=private_tmp)
    assert done.returncode == 0, done.stderr
    assert subprocess.run([str(work / "hello")], capture_output=True, text=True).stdout == "built\n"
    leak = confined(policy, ["make", "-s", "-C", str(work), "leak"], env, workspace=work,
                    private_tmp=private_tmp)
    no_secret(leak)


def test_node_runs_a_script(policies: Path, work: Path, env: dict[str, str], home: Path) -> None:
    require_tool("node")
    (work / "job.js").write_text(
        "const fs = require('fs');\n"
        "console.log('sum', [1, 2, 3].reduce((a, b) => a + b));\n"
        f"try {{ console.log(fs.readFileSync({str(home / '.ssh' / 'id_rsa')!r}, 'utf8')); }}\n"
        "catch (e) { console.log('refused', e.code); }\n"
        "console.log('api', process.env.API_KEY);\n")
    policy = write_policy(policies, """\
        version = 1
        extends = ["node"]
        [filesystem]
        read = ["${workspace}"]
        """)
    done = confined(policy, ["node", str(work / "job.js")], env, workspace=work)
    assert done.returncode == 0, done.stderr
    assert "sum 6" in done.stdout and "refused EACCES" in done.stdout
    no_secret(done)


def test_npm_installs_a_local_dependency(work: Path, env: dict[str, str], home: Path,
                                        private_tmp: Path) -> None:
    require_tool("node")
    (work / "dep").mkdir()
    (work / "dep" / "package.json").write_text('{"name": "dep", "version": "1.0.0"}')
    (work / "dep" / "index.js").write_text(
        "const fs = require('fs');\n"
        f"try {{ module.exports = fs.readFileSync({str(home / '.ssh' / 'id_rsa')!r}, 'utf8'); }}\n"
        "catch (e) { module.exports = 'refused ' + e.code + ' ' + process.env.API_KEY; }\n")
    (work / "app").mkdir()
    (work / "app" / "package.json").write_text(
        '{"name": "app", "version": "1.0.0", "dependencies": {"dep": "file:../dep"}}')
    if shutil.which("npm") is None:  # Debian's nodejs has no npm (its npm package is apart)
        pytest.skip("npm is not installed (Debian/Ubuntu package npm)")
    done = confined(Path("npm"), ["npm", "--prefix", str(work / "app"), "install", "--offline"],
                    env, workspace=work, private_tmp=private_tmp)
    assert done.returncode == 0, done.stderr
    assert (work / "app" / "node_modules" / "dep").exists()
    used = confined(Path("npm"), ["node", "-e", "console.log(require('dep'))"],
                    {**env, "NODE_PATH": str(work / "app" / "node_modules")},
                    workspace=work, private_tmp=private_tmp)
    assert used.stdout.strip() == "refused EACCES undefined", used.stderr
    no_secret(used)


def test_sqlite3_creates_and_queries_a_database(policies: Path, work: Path, env: dict[str, str],
                                                home: Path) -> None:
    require_tool("sqlite3")
    policy = write_policy(policies, """\
        version = 1
        extends = ["sqlite3"]
        [filesystem]
        write = ["${workspace}"]
        """)
    database = str(work / "db.sqlite")
    done = confined(policy, ["sqlite3", database, "create table t(a); insert into t values (42);"
                             "select a from t;"], env, workspace=work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "42"
    assert done.stderr == ""  # no warning about ~/.sqliterc
    stolen = confined(policy, ["sqlite3", database,
                               f"select readfile('{home / '.ssh' / 'id_rsa'}');"], env,
                      workspace=work)
    no_secret(stolen)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[int]:
    server = require_tool("redis-server")
    port = free_port()
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(tmp_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port
    finally:
        process.kill()
        process.wait()


def test_redis_cli_sets_and_gets_through_localhost(policies: Path, env: dict[str, str],
                                                    home: Path, redis: int) -> None:
    require_tool("redis-cli")
    policy = write_policy(policies, f"""\
        version = 1
        extends = ["redis_cli"]
        [network]
        connect = [{redis}]
        """)
    argv = ["redis-cli", "-h", "localhost", "-p", str(redis)]
    done = confined(policy, [*argv, "set", "k", "v"], env)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr
    done = confined(policy, [*argv, "get", "k"], env)
    assert done.stdout.strip() == "v", done.stderr
    stolen = confined(policy, [*argv, "--eval", str(home / ".ssh" / "id_rsa")], env)
    no_secret(stolen)


@pytest.fixture
def closing_server() -> Iterator[int]:
    """A TCP server on loopback that accepts and hangs up: enough to show a client
    reached it (and was not refused by the sandbox)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                peer, _ = listener.accept()
            except OSError:
                continue
            peer.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(listener.getsockname()[1])
    stop.set()
    thread.join()
    listener.close()


def test_psql_reaches_its_server(policies: Path, env: dict[str, str], home: Path,
                                 closing_server: int) -> None:
    require_tool("psql")
    policy = write_policy(policies, f"""\
        version = 1
        extends = ["psql"]
        [network]
        connect = [{closing_server}]
        """)
    done = confined(policy, ["psql", "-h", "127.0.0.1", "-p", str(closing_server), "-U", "u",
                             "-d", "d", "-c", "select 1"], env)
    assert "server closed the connection unexpectedly" in done.stderr, done.stderr
    stolen = confined(policy, ["psql", "-f", str(home / ".ssh" / "id_rsa"), "-h", "127.0.0.1",
                               "-p", str(closing_server)], env)
    no_secret(stolen)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private TMPDIR with a short name: Chromium puts its lock socket there, and a
    Unix socket's path has at most 107 bytes (pytest's tmp_path can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="slc-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_headless_chromium_renders_a_page(policies: Path, work: Path, env: dict[str, str],
                                          home: Path, short_tmp: Path) -> None:
    require_tool("chromium")
    private_tmp = short_tmp
    (work / "index.html").write_text("<html><body><p id=x>rendered by chromium</p></body></html>")
    policy = write_policy(policies, """\
        version = 1
        extends = ["chromium"]
        [filesystem]
        read = ["${workspace}"]
        [network]
        unix = true  # the README's advice: Chromium's lock is a Unix socket
        """)

    def render(url: str) -> subprocess.CompletedProcess[str]:
        return confined(policy, ["chromium", "--headless", "--no-sandbox", "--no-zygote",
                                 "--single-process", "--disable-gpu", "--disable-dev-shm-usage",
                                 "--no-first-run",
                                 "--disable-background-networking", "--disable-component-update",
                                 "--disable-sync", "--disable-crash-reporter",
                                 f"--user-data-dir={private_tmp}/profile", "--dump-dom", url],
                        env, workspace=work, private_tmp=private_tmp)

    done = render(f"file://{work}/index.html")
    assert "rendered by chromium" in done.stdout, done.stderr[-2000:]
    stolen = render(f"file://{home}/.ssh/id_rsa")
    no_secret(stolen)


def test_jq_sed_awk_pipeline(policies: Path, work: Path, env: dict[str, str], home: Path) -> None:
    require_tool("jq")
    (work / "data.json").write_text('[{"name": "a", "n": 2}, {"name": "b", "n": 5}]')
    done = confined(Path("shell"), ["sh", "-c", f"cd {work} && jq -r '.[] | \"\\(.name) \\(.n)\"' data.json"
                                    " | sed 's/^/row /' | awk '{s += $3} END {print s}'"],
                    env, workspace=work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "7"
    stolen = confined(Path("shell"), ["sh", "-c", f"jq -Rr . {home}/.ssh/id_rsa; "
                                      "jq -rn 'env.API_KEY'"], env, workspace=work)
    no_secret(stolen)
    assert os.path.exists(home / ".ssh" / "id_rsa")


def test_rg_searches_the_workspace(work: Path, env: dict[str, str], home: Path) -> None:
    require_tool("rg")
    (work / "src").mkdir()
    (work / "src" / "main.py").write_text("def needle():\n    return 42\n")
    done = confined(Path("shell"), ["sh", "-c", f"cd {work} && rg -n needle"], env,
                    workspace=work)
    assert done.returncode == 0, done.stderr
    assert "src/main.py:1:def needle():" in done.stdout
    stolen = confined(Path("shell"), ["rg", "-uu", "PRIVATE", str(home)], env, workspace=work)
    no_secret(stolen)


def _wheel(directory: Path) -> Path:
    """A one-module wheel, made by hand (no build backend, no index)."""
    import zipfile

    path = directory / "hello_first_try-1.0-py3-none-any.whl"
    info = "hello_first_try-1.0.dist-info"
    files = {"hello_first_try.py": "X = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: hello-first-try\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]))
    return path


def test_pip_installs_a_wheel_into_a_venv(policies: Path, work: Path, env: dict[str, str],
                                          private_tmp: Path) -> None:
    python = require_tool("python3")
    venv = work / "venv"
    made = subprocess.run([python, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"no venv with pip here (Debian package python3-venv): {made.stderr[-200:]}")
    wheel = _wheel(work)
    policy = write_policy(policies, """\
        version = 1
        extends = ["venv", "tmpdir"]
        [filesystem]
        write = ["${venv}"]
        read = ["${workspace}"]
        """)
    done = confined(policy, [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                             "--no-index", str(wheel)],
                    {k: v for k, v in env.items() if k != "HOME"},
                    venv=venv, workspace=work, private_tmp=private_tmp)
    assert done.returncode == 0, done.stderr
    used = subprocess.run([str(venv / "bin" / "python"), "-c", "import hello_first_try as h; print(h.X)"],
                          capture_output=True, text=True)
    assert used.stdout.strip() == "42", used.stderr
    no_secret(done)

