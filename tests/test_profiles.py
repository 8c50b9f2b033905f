"""The shipped profiles run the real tools they are for, confined, on the real kernel.

Each profile is composed with ``extends`` the way a user would (the profile plus
the workspace the tool works on) and the tool does its everyday job inside:
git commits, cc compiles and links, node and npm start, a venv's interpreter and
pip run, curl verifies a TLS server against a CA named by SSL_CERT_FILE, and a
private TMPDIR is the only temporary directory. The last test installs the built
wheel into a fresh venv and uses the shipped policies from there by name.
"""

from __future__ import annotations

import http.server
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, require_abi, sandlock, write_policy

from sandlock.policy.model import PROFILE_DIR, builtin_profiles, load_policy

PROFILES = {"base", "python", "read_file", "write_file", "shell", "python_runner", "https_client",
            "git", "cc", "node", "venv", "tls", "tmpdir", "sqlite3", "redis_cli", "psql", "chromium", "npm"}
#: What the child sees of the caller's environment (the profiles pass what they need).
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": os.environ.get("HOME", "/")}


LAUNCHER = str(Path(sys.executable).parent / "sandlock")


def needs(program: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(shutil.which(program) is None, reason=f"{program} is not installed")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(4, "the shipped profiles (files and TCP ports)")


def run(policy: Path, argv: list[str], variables: dict[str, str], *, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    args = ["run", "--policy", str(policy)]
    for name, value in variables.items():
        args += ["--var", f"{name}={value}"]
    # The entry point, not `python -m sandlock`: -m puts the working directory on the import
    # path, and sandlock refuses a write grant that covers its own import path.
    return subprocess.run([LAUNCHER, *args, "--", *argv], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=120, cwd=str(cwd) if cwd else None)


def test_every_profile_is_listed_and_loads(tmp_path: Path) -> None:
    assert set(builtin_profiles()) == PROFILES
    listing = sandlock("policies")
    assert listing.returncode == 0, listing.stderr
    listed = {line.split("\t")[0]: line.split("\t")[1] for line in listing.stdout.splitlines()[1:]}
    assert set(listed) == PROFILES
    assert not [name for name, text in listed.items() if text.startswith("(not loadable")]
    for name in sorted(PROFILES - {"https_client"} if shutil.which("curl") is None else PROFILES):
        policy = load_policy(PROFILE_DIR / f"{name}.toml", {"workspace": str(tmp_path),
                             "private_tmp": str(tmp_path), "venv": str(tmp_path)}, check_paths=False)
        assert policy.description, name


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_no_profile_grants_private_keys(name: str, tmp_path: Path) -> None:
    secrets = ("/etc/ssl/private", "/etc/pki/tls/private", "/etc/ssl", "/etc/pki", "/etc", "/")
    policy = load_policy(PROFILE_DIR / f"{name}.toml", {"workspace": str(tmp_path),
                         "private_tmp": str(tmp_path), "venv": str(tmp_path)}, check_paths=False)
    assert not [rule.path for rule in policy.paths if rule.path.rstrip("/") in secrets]


def test_bare_name_selects_the_shipped_policy(workspace: Path, tmp_path: Path) -> None:
    """--policy read_file and extends = ["read_file"] need no checkout."""
    by_name = run(Path("read_file"), ["cat", str(workspace / "notes.md")],
                  {"workspace": str(workspace)}, cwd=tmp_path)
    assert (by_name.returncode, by_name.stdout) == (0, "hello from the workspace\n"), by_name.stderr
    extended = write_policy(tmp_path, 'version = 1\nextends = ["read_file"]\n')
    again = run(extended, ["cat", str(workspace / "notes.md")], {"workspace": str(workspace)})
    assert again.stdout == "hello from the workspace\n", again.stderr
    unknown = run(Path("no_such_tool"), ["true"], {}, cwd=tmp_path)
    assert unknown.returncode == 125
    assert "nor a built-in policy" in unknown.stderr


def test_a_file_in_the_working_directory_does_not_shadow_a_shipped_name(tmp_path: Path,
                                                                        workspace: Path) -> None:
    """A tool may write its working directory: a file named like a shipped policy there
    must not become the policy of the next run."""
    (tmp_path / "read_file").write_text('version = 1\n[filesystem]\nread = ["/"]\n')
    result = run(Path("read_file"), ["cat", "/etc/hostname"], {"workspace": str(workspace)},
                 cwd=tmp_path)
    assert result.returncode != 0 and result.stdout == ""


@needs("git")
def test_git_init_commit_log(tmp_path: Path) -> None:
    repo, home = tmp_path / "repo", tmp_path / "home"
    repo.mkdir()
    home.mkdir()
    policy = write_policy(tmp_path, 'version = 1\nextends = ["git"]\n[filesystem]\nwrite = ["${repo}"]\n')
    identity = {"GIT_AUTHOR_NAME": "A", "GIT_AUTHOR_EMAIL": "a@example.org", "HOME": str(home),
                "GIT_COMMITTER_NAME": "A", "GIT_COMMITTER_EMAIL": "a@example.org"}

    def git(*argv: str) -> subprocess.CompletedProcess[str]:
        return run(policy, ["git", *argv], {"repo": str(repo)}, cwd=repo, env=identity)

    assert git("init", "-q").returncode == 0
    (repo / "notes.md").write_text("hello\n")
    assert git("add", "notes.md").returncode == 0
    commit = git("commit", "-q", "-m", "first")
    assert commit.returncode == 0, commit.stderr
    log = git("log", "--format=%s %an")
    assert (log.returncode, log.stdout) == (0, "first A\n"), log.stderr
    # Configuration outside the repository is read-only: no planted alias or hook path.
    planted = git("config", "--global", "alias.st", "!sh")
    assert planted.returncode != 0 and not (home / ".gitconfig").exists()


@needs("cc")
def test_cc_compiles_links_and_runs(tmp_path: Path) -> None:
    src, scratch = tmp_path / "src", tmp_path / "scratch"
    src.mkdir()
    scratch.mkdir()
    (src / "hello.c").write_text('#include <stdio.h>\n#include <math.h>\n'
                                 'int main(void) { printf("hello %.0f\\n", sqrt(16.0)); return 0; }\n')
    policy = write_policy(tmp_path, 'version = 1\nextends = ["cc"]\n'
                                    '[filesystem]\nwrite = ["${src}"]\nexec = ["${src}"]\n')
    variables = {"src": str(src), "private_tmp": str(scratch)}
    built = run(policy, ["cc", "-O2", "hello.c", "-lm"], variables, cwd=src)
    assert built.returncode == 0, built.stderr
    ran = run(policy, ["./a.out"], variables, cwd=src)
    assert (ran.returncode, ran.stdout) == (0, "hello 4\n"), ran.stderr
    assert list(scratch.iterdir()) == []  # the driver's temporary files went there and are gone


@needs("node")
def test_node_and_npm(tmp_path: Path) -> None:
    code = ('const fs = require("fs"); fs.readFileSync("/etc/ssl/openssl.cnf");'
            'console.log(require("crypto").createHash("sha256").update("x").digest("hex").slice(0, 8),'
            ' require("tls").rootCertificates.length > 0)')
    node = run(Path("node"), ["node", "-e", code], {}, cwd=tmp_path)
    assert (node.returncode, node.stdout) == (0, "2d711642 true\n"), node.stderr
    if shutil.which("npm"):
        npm = run(Path("node"), ["npm", "--version"], {}, cwd=tmp_path,
                  env={"npm_config_update_notifier": "false", "npm_config_cache": str(tmp_path),
                       "HOME": str(tmp_path)})
        assert npm.returncode == 0 and npm.stdout.strip()[0].isdigit(), npm.stderr


def test_venv_python_and_pip(tmp_path: Path) -> None:
    """Item 5: a venv interpreter needs pyvenv.cfg; the venv profile grants it."""
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    without = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n', "plain.toml")
    assert run(without, [python, "-c", "pass"], {}).returncode != 0  # the reported failure
    shown = run(Path("venv"), [python, "-c", "import sys; print(sys.prefix)"], {"venv": str(venv)})
    assert (shown.returncode, shown.stdout) == (0, f"{venv}\n"), shown.stderr
    pip = run(Path("venv"), [python, "-m", "pip", "--version"], {"venv": str(venv)},
              env={"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert pip.returncode == 0 and pip.stdout.startswith("pip "), pip.stderr
    assert str(venv) in pip.stdout
    # Read-only: the venv cannot be changed by a tool using the profile.
    planted = run(Path("venv"), [python, "-c", f"open({str(venv / 'lib' / 'x.pth')!r}, 'w')"],
                  {"venv": str(venv)})
    assert planted.returncode != 0 and not (venv / "lib" / "x.pth").exists()


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A TLS server on loopback with its own CA-less self-signed certificate."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-days", "1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            self.send_response(200)
            self.send_header("Content-Length", "6")
            self.end_headers()
            self.wfile.write(b"hello\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hello)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], cert
    finally:
        server.shutdown()
        server.server_close()


@needs("curl")
@needs("openssl")
def test_tls_client_verifies_with_the_ca_variable(tmp_path: Path, https_server: tuple[int, Path]) -> None:
    port, cert = https_server
    policy = write_policy(tmp_path, f'''\
        version = 1
        extends = ["tls"]
        [filesystem]
        read = ["{cert}"]
        exec = ["/usr/bin/curl"]
        [network]
        connect = [{port}]
        ''')
    url = f"https://127.0.0.1:{port}/"
    ok = run(policy, ["curl", "-fsS", url], {}, env={"SSL_CERT_FILE": str(cert), "CURL_CA_BUNDLE": str(cert)})
    assert (ok.returncode, ok.stdout) == (0, "hello\n"), ok.stderr
    unverified = run(policy, ["curl", "-fsS", url], {})  # the system CAs do not know this server
    assert unverified.returncode == 60, unverified.stderr  # CURLE_PEER_FAILED_VERIFICATION


def test_tls_reads_the_ca_bundle_never_private_keys(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, 'version = 1\nextends = ["tls", "python"]\n')
    code = ("import os, ssl\n"
            "print(len(ssl.create_default_context().get_ca_certs()) > 0)\n"
            "try:\n    os.listdir('/etc/ssl/private'); print('listed')\n"
            "except PermissionError:\n    print('denied')\n")
    result = run(policy, ["/usr/bin/python3", "-c", code], {})
    assert (result.returncode, result.stdout) == (0, "True\ndenied\n"), result.stderr


def test_tmpdir_is_private_and_the_only_temporary_directory(tmp_path: Path) -> None:
    mine = tmp_path / "call-tmp"
    mine.mkdir()
    policy = write_policy(tmp_path, 'version = 1\nextends = ["tmpdir", "python"]\n')
    code = ("import tempfile, sys\n"
            "with tempfile.NamedTemporaryFile(delete=False) as f: f.write(b'x')\n"
            "print(f.name.startswith(sys.argv[1] + '/'))\n"
            "try:\n    open(sys.argv[2], 'w'); print('wrote')\n"
            "except PermissionError:\n    print('denied')\n")
    shared = tmp_path / "shared.txt"
    result = run(policy, ["/usr/bin/python3", "-c", code, str(mine), str(shared)], {"private_tmp": str(mine)})
    assert (result.returncode, result.stdout) == (0, "True\ndenied\n"), result.stderr
    assert len(list(mine.iterdir())) == 1 and not shared.exists()
    # Forgetting the variable is an error, never a grant of the shared /tmp.
    forgotten = run(policy, ["/usr/bin/python3", "-c", "pass"], {})
    assert forgotten.returncode == 125 and "private_tmp" in forgotten.stderr, forgotten.stderr


def _dependency_dir(target: Path) -> Path:
    """The runtime dependencies of this interpreter's sandlock, linked into ``target``
    (so that the wheel test needs no package index)."""
    import importlib.util

    target.mkdir()
    for module in ("click", "h11", "pyseccomp"):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        source = Path(spec.origin)
        source = source.parent if source.name == "__init__.py" else source
        (target / source.name).symlink_to(source)
    return target


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")
def test_wheel_installed_in_a_fresh_venv_ships_the_policies(tmp_path: Path, workspace: Path) -> None:
    """Built from a copy of the checkout, installed with --no-deps into a new venv."""
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".mypy_cache",
        ".ruff_cache", ".benchmarks", "benchmarks", "sandlock-exec"))
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check"]
    env = {**ENV, "PIP_NO_INDEX": "1", "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""}
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"),
                    str(source)], check=True, env=env, capture_output=True)
    (wheel,) = (tmp_path / "wheels").glob("sandlock_agent-*.whl")
    assert wheel.name.endswith("-py3-none-linux_" + os.uname().machine + ".whl")
    subprocess.run([*pip, "install", "--no-deps", str(wheel)], check=True, env=env, capture_output=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "sandlock_test_deps.pth").write_text(f"{_dependency_dir(tmp_path / 'deps')}\n")

    def installed(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "sandlock"), *args], capture_output=True, text=True,
                              env=ENV, cwd=tmp_path, timeout=120)

    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import sandlock; print(sandlock.__file__, sandlock.__distribution__)"],
                           capture_output=True, text=True, env=ENV, cwd=tmp_path, check=True)
    assert where.stdout.startswith(str(site)) and where.stdout.endswith(" sandlock-agent\n")
    listing = installed("policies")
    assert {"read_file", "git", "venv", "tmpdir"} <= {line.split("\t")[0] for line in
                                                      listing.stdout.splitlines()[1:]}
    by_name = installed("run", "--policy", "read_file", "--var", f"workspace={workspace}",
                        "--", "cat", str(workspace / "notes.md"))
    assert by_name.stdout == "hello from the workspace\n", by_name.stderr
    extended = write_policy(tmp_path, 'version = 1\nextends = ["read_file"]\n', "mine.toml")
    again = installed("run", "--policy", str(extended), "--var", f"workspace={workspace}",
                      "--", "cat", str(workspace / "notes.md"))
    assert again.stdout == "hello from the workspace\n", again.stderr
    assert (site / "sandlock" / "policy" / "profiles" / "https_client.toml").is_file()
