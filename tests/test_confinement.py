"""What a confined tool can and cannot reach, proved on the real kernel.

Every test runs a real probe through `sandlock run` (a separate process, the
shipped CLI) and checks what happened inside: the errno the probe got, and that
no file outside the grant was created or changed. Where a denial could also come
from something other than sandlock (the kernel refusing an unprivileged user,
say), a control run with the grant shows that the same probe succeeds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Iterator, Optional

import pytest
from conftest import POLICIES, PYTHON, python_probe, require_abi, require_tool, run_confined, write_policy

PROBE = """\
import errno, os, socket, sys

def action():
{body}

try:
    action()
except OSError as exc:
    print(errno.errorcode.get(exc.errno, exc.errno))
else:
    print("OK")
"""


def attempt(tmp_path: Path, body: str, **kwargs: object) -> str:
    """Run ``body`` (a function body) in a python sandbox: "OK" or the errno name it raised."""
    code = PROBE.format(body=textwrap.indent(textwrap.dedent(body).strip(), "    "))
    result = python_probe(tmp_path, code, **kwargs)  # type: ignore[arg-type]
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def snapshot(directory: Path) -> dict[str, Optional[bytes]]:
    """Every entry below ``directory`` with its content (None for directories and links)."""
    out: dict[str, Optional[bytes]] = {}
    for path in sorted(directory.rglob("*")):
        is_file = path.is_file() and not path.is_symlink()
        out[str(path.relative_to(directory))] = path.read_bytes() if is_file else None
    return out


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "filesystem confinement")


# ----------------------------------------------------------------------------
# Filesystem

WRITE_WS = 'write = ["${workspace}"]\nread = ["${readonly}"]'


@pytest.fixture
def readonly(tmp_path: Path) -> Path:
    """A directory the test policies grant read access to, and nothing more."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "data.txt").write_text("read-only data\n")
    return ro


def fs_attempt(tmp_path: Path, workspace: Path, readonly: Path, body: str) -> str:
    return attempt(tmp_path, body, filesystem=WRITE_WS,
                   variables={"workspace": str(workspace), "readonly": str(readonly)})


ALLOWED_FS = {
    "read workspace": "assert open(f'{WS}/notes.md').read() == 'hello from the workspace\\n'",
    "list workspace": "assert 'notes.md' in os.listdir(WS)",
    "read granted dir": "assert open(f'{RO}/data.txt').read() == 'read-only data\\n'",
    "create": "open(f'{WS}/new.txt', 'w').write('made')",
    "overwrite": "open(f'{WS}/notes.md', 'w').write('changed')",
    "truncate": "os.truncate(f'{WS}/notes.md', 0)",
    "delete": "os.unlink(f'{WS}/notes.md')",
    "rename inside": "os.rename(f'{WS}/notes.md', f'{WS}/renamed.md')",
    "mkdir and rename across dirs inside":
        "os.mkdir(f'{WS}/d'); os.rename(f'{WS}/notes.md', f'{WS}/d/n.md')",
    "hardlink inside": "os.link(f'{WS}/notes.md', f'{WS}/link.md')",
    "symlink inside": "os.symlink('notes.md', f'{WS}/sym'); open(f'{WS}/sym').read()",
}


@pytest.mark.parametrize("body", ALLOWED_FS.values(), ids=ALLOWED_FS.keys())
def test_allowed_file_operations_work(tmp_path: Path, workspace: Path, readonly: Path,
                                      body: str) -> None:
    header = f"WS = {str(workspace)!r}; RO = {str(readonly)!r}\n"
    assert fs_attempt(tmp_path, workspace, readonly, header + body) == "OK"


#: (operation, probe, expected errno). {OUT} is never granted, {RO} is read-only.
DENIED_FS = [
    ("read outside", "open(f'{OUT}/secret.txt').read()", "EACCES"),
    ("list outside", "os.listdir(OUT)", "EACCES"),
    ("create outside", "open(f'{OUT}/new.txt', 'x')", "EACCES"),
    ("overwrite outside", "open(f'{OUT}/secret.txt', 'w')", "EACCES"),
    ("append outside", "open(f'{OUT}/secret.txt', 'a')", "EACCES"),
    ("truncate outside", "os.truncate(f'{OUT}/secret.txt', 0)", "EACCES"),
    ("delete outside", "os.unlink(f'{OUT}/secret.txt')", "EACCES"),
    ("mkdir outside", "os.mkdir(f'{OUT}/d')", "EACCES"),
    ("fifo outside", "os.mkfifo(f'{OUT}/fifo')", "EACCES"),
    ("symlink outside", "os.symlink('/etc/passwd', f'{OUT}/sym')", "EACCES"),
    ("rename out of the workspace", "os.rename(f'{WS}/notes.md', f'{OUT}/stolen.md')", "EACCES"),
    ("rename into the workspace", "os.rename(f'{OUT}/secret.txt', f'{WS}/secret.txt')", "EACCES"),
    ("hardlink out of the workspace", "os.link(f'{WS}/notes.md', f'{OUT}/link.md')", "EACCES"),
    # Linking a file the tool cannot read into a place it can would grant new rights: REFER.
    ("hardlink into the workspace", "os.link(f'{OUT}/secret.txt', f'{WS}/secret.txt')", "EXDEV"),
    ("read through a symlink escape",
     "os.symlink(f'{OUT}/secret.txt', f'{WS}/esc'); open(f'{WS}/esc').read()", "EACCES"),
    ("write through a symlink escape",
     "os.symlink(f'{OUT}/secret.txt', f'{WS}/esc'); open(f'{WS}/esc', 'w').write('x')", "EACCES"),
    ("write through a planted symlink", "open(f'{WS}/planted', 'w').write('x')", "EACCES"),
    ("write a read-only file", "open(f'{RO}/data.txt', 'w')", "EACCES"),
    ("truncate a read-only file", "os.truncate(f'{RO}/data.txt', 0)", "EACCES"),
    ("create in a read-only dir", "open(f'{RO}/new.txt', 'x')", "EACCES"),
    ("delete in a read-only dir", "os.unlink(f'{RO}/data.txt')", "EACCES"),
    ("rename a read-only file into the workspace",
     "os.rename(f'{RO}/data.txt', f'{WS}/data.txt')", "EACCES"),
    ("hardlink a read-only file into the workspace",
     "os.link(f'{RO}/data.txt', f'{WS}/data.txt')", "EXDEV"),
    ("exec outside the exec grants", "os.execv('/usr/bin/id', ['id'])", "EACCES"),
    ("exec a file written in the workspace",
     "p = f'{WS}/tool'; shutil.copy('/usr/bin/true', p); os.chmod(p, 0o755); os.execv(p, [p])",
     "EACCES"),
]


@pytest.mark.parametrize("body,expected", [c[1:] for c in DENIED_FS], ids=[c[0] for c in DENIED_FS])
def test_denied_file_operations_fail_and_change_nothing(tmp_path: Path, workspace: Path,
                                                        readonly: Path, outside: Path,
                                                        body: str, expected: str) -> None:
    (workspace / "planted").symlink_to(outside / "secret.txt")
    before = snapshot(outside), snapshot(readonly)
    header = (f"import shutil\nWS = {str(workspace)!r}; RO = {str(readonly)!r}; "
              f"OUT = {str(outside)!r}\n")
    assert fs_attempt(tmp_path, workspace, readonly, header + body) == expected
    assert (snapshot(outside), snapshot(readonly)) == before
    assert (workspace / "notes.md").read_text() == "hello from the workspace\n"


def test_exec_outside_the_policy_is_exit_126_with_a_reason(workspace: Path) -> None:
    # read_file grants cat, head, tail, ls, wc and grep; sort is in /usr/bin but not granted.
    result = run_confined(POLICIES / "read_file.toml",
                          ["/usr/bin/sort", str(workspace / "notes.md")],
                          variables={"workspace": str(workspace)})
    assert result.returncode == 126
    assert "/usr/bin/sort: permission denied (the policy does not grant exec" in result.stderr
    assert result.stdout == ""


# ----------------------------------------------------------------------------
# TCP through Landlock port rules


@pytest.fixture
def listeners() -> Iterator[tuple[int, int]]:
    """Two TCP listeners on 127.0.0.1: (granted port, other port)."""
    socks = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        socks.append(sock)
    yield socks[0].getsockname()[1], socks[1].getsockname()[1]
    for sock in socks:
        sock.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


CONNECT = "s = socket.socket(); s.settimeout(10); s.connect(('127.0.0.1', {port}))"


def test_tcp_connect_only_to_granted_port(tmp_path: Path, listeners: tuple[int, int]) -> None:
    require_abi(4, "TCP port rules")
    granted, other = listeners
    net = f"connect = [{granted}]"
    assert attempt(tmp_path, CONNECT.format(port=granted), network=net) == "OK"
    # The other port has a listener too: EACCES comes from Landlock, not from the peer.
    assert attempt(tmp_path, CONNECT.format(port=other), network=net) == "EACCES"
    v6 = f"s = socket.socket(socket.AF_INET6); s.connect(('::1', {other}))"
    assert attempt(tmp_path, v6, network=net) == "EACCES"


def test_tcp_connect_port_range(tmp_path: Path, listeners: tuple[int, int]) -> None:
    require_abi(4, "TCP port rules")
    granted, other = listeners
    net = f'connect = ["{granted}-{granted}"]'
    assert attempt(tmp_path, CONNECT.format(port=granted), network=net) == "OK"
    assert attempt(tmp_path, CONNECT.format(port=other), network=net) == "EACCES"


def test_tcp_bind_only_on_granted_port(tmp_path: Path) -> None:
    require_abi(4, "TCP port rules")
    granted, other = free_port(), free_port()
    net = f"bind = [{granted}]"
    bind = "s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(1)"
    assert attempt(tmp_path, bind.format(port=granted), network=net) == "OK"
    assert attempt(tmp_path, bind.format(port=other), network=net) == "EACCES"
    # Port 0 would let the kernel pick any port: it is a port of its own to Landlock.
    assert attempt(tmp_path, bind.format(port=0), network=net) == "EACCES"
    # connect is a separate right: a bind grant does not allow connecting.
    assert attempt(tmp_path, CONNECT.format(port=granted), network=net) == "EACCES"


def test_listen_without_a_bind_grant_is_refused(tmp_path: Path) -> None:
    # listen() on an unbound socket would bind an ephemeral port: no bind grant, no listen.
    body = "s = socket.socket(); s.listen(1)"
    assert attempt(tmp_path, body, network="connect = [443]") == "EPERM"


def test_no_network_grant_means_no_inet_socket(tmp_path: Path) -> None:
    for family, kind in (("AF_INET", "SOCK_STREAM"), ("AF_INET6", "SOCK_STREAM"),
                         ("AF_INET", "SOCK_DGRAM"), ("AF_UNIX", "SOCK_STREAM")):
        body = f"socket.socket(socket.{family}, socket.{kind})"
        assert attempt(tmp_path, body) == "EPERM", family


def test_https_client_reaches_port_443_only(tmp_path: Path, listeners: tuple[int, int]) -> None:
    require_tool("curl")  # https_client grants it
    require_abi(4, "TCP port rules")
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python", "{POLICIES / 'https_client.toml'}"]
        """)
    connect = "s = socket.socket(); s.settimeout(10); s.connect(('127.0.0.1', int(sys.argv[1])))"
    probe = PROBE.format(body=textwrap.indent(connect, "    "))
    results = {}
    for port in (443, listeners[0]):
        run = run_confined(policy, [PYTHON, "-c", probe, str(port)])
        assert run.returncode == 0, run.stderr
        results[port] = run.stdout.strip()
    # Nothing listens on 443 here: the kernel answers, so Landlock let the connect through.
    assert results[443] in ("ECONNREFUSED", "OK")
    assert results[listeners[0]] == "EACCES"


# ----------------------------------------------------------------------------
# Socket families and protocols (seccomp)

DENIED_SOCKETS = {
    "raw icmp": "socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)",
    "raw ipv6": "socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)",
    "icmp datagram (ping)": "socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)",
    "packet": "socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)",
    "netlink route": "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)",
    "netlink audit": "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9)",
    "mptcp": "socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262)",
    "mptcp v6": "socket.socket(socket.AF_INET6, socket.SOCK_STREAM, 262)",
    "sctp stream": "socket.socket(socket.AF_INET, socket.SOCK_STREAM, 132)",
    "sctp seqpacket": "socket.socket(socket.AF_INET, socket.SOCK_SEQPACKET, 132)",
    "udplite": "socket.socket(socket.AF_INET, socket.SOCK_DGRAM, 136)",
    "vsock": "socket.socket(40, socket.SOCK_STREAM, 0)",
    "family above AF_MAX": "socket.socket(200, socket.SOCK_STREAM, 0)",
    "family below every granted one (AF_UNSPEC)": "socket.socket(0, socket.SOCK_STREAM, 0)",
    "family between granted ones (AF_AX25)": "socket.socket(3, socket.SOCK_SEQPACKET, 0)",
    "tcp fast open": "s = socket.socket(); s.sendto(b'x', 0x20000000, ('127.0.0.1', 9))",
    "tcp fast open via sendmsg":
        "s = socket.socket(); s.sendmsg([b'x'], [], 0x20000000, ('127.0.0.1', 9))",
    "garbage in the upper bits of the family": (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "r = libc.syscall(ctypes.c_long(41), ctypes.c_long((1 << 32) | 17), ctypes.c_long(3), "
        "ctypes.c_long(0)); "
        "e = ctypes.get_errno(); "
        "assert r < 0, 'created'; raise OSError(e, os.strerror(e))"),
    "garbage in the upper bits of a granted family": (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "r = libc.syscall(ctypes.c_long(41), ctypes.c_long((1 << 32) | 1), ctypes.c_long(1), "
        "ctypes.c_long(0)); "
        "e = ctypes.get_errno(); "
        "assert r < 0, 'created'; raise OSError(e, os.strerror(e))"),
}


@pytest.mark.parametrize("body", DENIED_SOCKETS.values(), ids=DENIED_SOCKETS.keys())
def test_other_socket_kinds_denied_even_with_every_grant(tmp_path: Path, body: str) -> None:
    network = "connect = [9]\nbind = [9]\nudp = true\nunix = true"
    assert attempt(tmp_path, body, network=network) == "EPERM"


def test_udp_only_when_granted(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver:
        receiver.bind(("127.0.0.1", 0))
        receiver.settimeout(10)
        port = receiver.getsockname()[1]
        body = (f"s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                f"s.sendto(b'datagram', ('127.0.0.1', {port}))")
        assert attempt(tmp_path, body) == "EPERM"
        assert attempt(tmp_path, body, network="udp = true") == "OK"
        assert receiver.recv(100) == b"datagram"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: sun_path holds only 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="sl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_unix_socket_only_when_granted(tmp_path: Path, short_dir: Path) -> None:
    address = str(short_dir / "agent.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(address)
        server.listen(1)
        server.settimeout(10)
        body = f"s = socket.socket(socket.AF_UNIX); s.connect({address!r}); s.sendall(b'hi')"
        assert attempt(tmp_path, body) == "EPERM"
        # Granted, a pathname socket is reachable anywhere (Landlock cannot scope it before
        # ABI 9): this is why `unix` is off by default.
        assert attempt(tmp_path, body, network="unix = true") == "OK"
        conn, _ = server.accept()
        with conn:
            assert conn.recv(10) == b"hi"


def test_unix_grant_allows_a_server_in_the_workspace(tmp_path: Path, short_dir: Path) -> None:
    body = (f"s = socket.socket(socket.AF_UNIX); s.bind({str(short_dir / 's')!r}); s.listen(1)")
    fs = 'write = ["${workspace}"]'
    variables = {"workspace": str(short_dir)}
    granted = attempt(tmp_path, body, filesystem=fs, network="unix = true", variables=variables)
    assert granted == "OK"
    (short_dir / "s").unlink()
    assert attempt(tmp_path, body, filesystem=fs, variables=variables) == "EPERM"


@pytest.fixture
def abstract_listener() -> Iterator[bytes]:
    name = f"\0sandlock-test-{uuid.uuid4().hex}".encode()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen(4)
        yield name


def test_abstract_unix_socket_outside_is_out_of_scope(tmp_path: Path,
                                                      abstract_listener: bytes) -> None:
    require_abi(6, "abstract unix socket scope")
    body = f"s = socket.socket(socket.AF_UNIX); s.connect({abstract_listener!r})"
    assert attempt(tmp_path, body, network="unix = true") == "EPERM"
    unscoped = "\n[scope]\nabstract_unix = false\n"
    assert attempt(tmp_path, body, network="unix = true", extra_toml=unscoped) == "OK"


# ----------------------------------------------------------------------------
# Signals (Landlock scope)


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of the same user, started outside any sandbox."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_signal_to_a_process_outside_fails(tmp_path: Path,
                                           bystander: subprocess.Popen[bytes]) -> None:
    require_abi(6, "signal scope")
    body = f"os.kill({bystander.pid}, {int(signal.SIGTERM)})"
    assert attempt(tmp_path, body) == "EPERM"
    assert bystander.poll() is None


def test_signal_through_a_pidfd_to_a_process_outside_fails(
        tmp_path: Path, bystander: subprocess.Popen[bytes]) -> None:
    require_abi(6, "signal scope")
    body = f"import signal; signal.pidfd_send_signal(os.pidfd_open({bystander.pid}), 15)"
    assert attempt(tmp_path, body) == "EPERM"
    assert bystander.poll() is None


def test_signal_scope_off_lets_the_signal_through(tmp_path: Path,
                                                  bystander: subprocess.Popen[bytes]) -> None:
    # The control for the test above: the same probe, with the scope turned off.
    body = f"os.kill({bystander.pid}, {int(signal.SIGTERM)})"
    assert attempt(tmp_path, body, extra_toml="\n[scope]\nsignals = false\n",
                   head='compat = "best-effort"\n') == "OK"
    assert bystander.wait(timeout=30) == -signal.SIGTERM


def test_signal_scope_off_is_refused_in_strict_mode(tmp_path: Path) -> None:
    """With the scope off the tool could SIGSTOP its launcher (the timeout never fires)
    or kill the caller: strict mode refuses, naming it; best-effort runs and says so."""
    strict = python_probe(tmp_path, "print('ran')", extra_toml="\n[scope]\nsignals = false\n")
    assert strict.returncode == 125 and "ran" not in strict.stdout
    assert "signal scope" in strict.stderr and "launcher" in strict.stderr, strict.stderr
    lenient = python_probe(tmp_path, "print('ran')", extra_toml="\n[scope]\nsignals = false\n",
                           head='compat = "best-effort"\n')
    assert lenient.returncode == 0 and lenient.stdout.strip() == "ran", lenient.stderr
    assert "NOT enforced" in lenient.stderr and "[scope] signals = false" in lenient.stderr


def test_signals_inside_the_sandbox_still_work(tmp_path: Path) -> None:
    body = """\
        import time
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(pid, 15)
        assert os.waitpid(pid, 0)[1] == 15
    """
    assert attempt(tmp_path, body) == "OK"


# ----------------------------------------------------------------------------
# Environment and inherited descriptors

ENV_PROBE = "import json, os; print(json.dumps(dict(os.environ)))"


def test_callers_secrets_do_not_reach_the_tool(tmp_path: Path) -> None:
    caller = {**os.environ, "OPENAI_API_KEY": "secret-key", "AWS_SECRET_ACCESS_KEY": "secret-aws",
              "LANG": "C.UTF-8"}
    result = python_probe(tmp_path, ENV_PROBE, env=caller)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert "OPENAI_API_KEY" not in seen and "AWS_SECRET_ACCESS_KEY" not in seen
    assert not any("secret" in value for value in seen.values())
    assert seen["LANG"] == "C.UTF-8"
    assert set(seen) <= {"PATH", "LANG", "TERM", "TZ", "PYTHONDONTWRITEBYTECODE",
                         "PYTHONNOUSERSITE"} | {k for k in seen if k.startswith("LC_")}


def test_default_environment_without_an_env_section(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n'
                                    '[filesystem]\nexec = ["/usr/bin/env"]\n')
    caller = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C",
              "TERM": "dumb", "TZ": "UTC", "HOME": "/root", "USER": "me", "SSH_AUTH_SOCK": "/x",
              "GITHUB_TOKEN": "secret"}
    result = run_confined(policy, ["env"], env=caller)
    assert result.returncode == 0, result.stderr
    names = {line.split("=", 1)[0] for line in result.stdout.splitlines()}
    assert names == {"PATH", "LANG", "LC_ALL", "TERM", "TZ"}


def test_env_pass_globs_and_set(tmp_path: Path, workspace: Path) -> None:
    caller = {**os.environ, "TOOL_A": "1", "TOOL_B": "2", "TOOLBOX": "no", "OTHER": "no"}
    extra = '\n[env]\npass = ["TOOL_*"]\nset = { HOME = "${workspace}", TOOL_B = "overridden" }\n'
    result = python_probe(tmp_path, ENV_PROBE, env=caller, extra_toml=extra,
                          variables={"workspace": str(workspace)})
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["TOOL_A"] == "1"
    assert seen["TOOL_B"] == "overridden"
    assert seen["HOME"] == str(workspace)
    assert "TOOLBOX" not in seen and "OTHER" not in seen


def test_inherited_descriptor_is_not_usable(tmp_path: Path, outside: Path) -> None:
    """A descriptor the caller opened on a file outside the policy is closed before exec."""
    policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n')
    fd = os.open(outside / "secret.txt", os.O_RDWR)
    try:
        probe = textwrap.dedent(f"""\
            import errno, os
            for how in (lambda: os.read({fd}, 100), lambda: os.write({fd}, b'x'),
                        lambda: os.fstat({fd})):
                try:
                    how()
                    print("usable")
                except OSError as exc:
                    print(errno.errorcode[exc.errno])
            """)
        result = subprocess.run([sys.executable, "-m", "sandlock", "run", "--policy", str(policy),
                                 "--", PYTHON, "-c", probe], pass_fds=(fd,), check=False,
                                capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["EBADF"] * 3
    assert (outside / "secret.txt").read_text() == "top secret\n"


def test_non_utf8_arguments_and_environment_pass_through(tmp_path: Path, workspace: Path) -> None:
    """argv and env are bytes on Linux; a file name that is not UTF-8 must still work."""
    name = b"caf\xe9.txt"
    with open(os.path.join(os.fsencode(workspace), name), "wb") as handle:
        handle.write(b"latin-1 name\n")
    env = {**{os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()},
           b"LC_BYTES": b"\xff\xfe"}
    result = subprocess.run(
        [sys.executable, "-m", "sandlock", "run", "--policy", str(POLICIES / "read_file.toml"),
         "--var", f"workspace={workspace}", "--", "cat",
         os.path.join(os.fsencode(workspace), name)],
        capture_output=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"latin-1 name\n"



@pytest.mark.parametrize("abi", range(1, 7))
def test_pretended_older_kernel_still_confines_files_and_network(tmp_path: Path, workspace: Path,
                                                                 outside: Path, abi: int) -> None:
    """Best-effort on an old ABI drops only what that ABI lacks, never the whole sandbox."""
    probe = PROBE.format(body=textwrap.indent(textwrap.dedent(f"""\
        results = []
        for how in (lambda: open({str(outside / 'secret.txt')!r}).read(),
                    lambda: open({str(outside / 'new')!r}, 'x'),
                    lambda: open({str(workspace / 'new')!r}, 'x').write('ok'),
                    lambda: socket.socket()):
            try:
                how()
                results.append("OK")
            except OSError as exc:
                results.append(errno.errorcode[exc.errno])
        print(*results)"""), "    "))
    policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n'
                                    '[filesystem]\nwrite = ["${workspace}"]\n')
    result = run_confined(policy, [PYTHON, "-c", probe], variables={"workspace": str(workspace)},
                          env={**os.environ, "SANDLOCK_ABI": str(abi)}, extra=["--best-effort"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:4] == ["EACCES", "EACCES", "OK", "EPERM"]
    # What the ABI lacks that this policy relies on has a substitute (the signal gate
    # below 6, the truncate rule below 3): nothing is reported as not enforced.
    assert "NOT enforced" not in result.stderr, result.stderr
    assert not (outside / "new").exists()


def test_the_tool_has_no_capabilities_and_no_new_privs(tmp_path: Path) -> None:
    """As root too: every capability set the tool could use is empty, and no_new_privs
    keeps execve from refilling them (so uid 0 cannot setuid or chown inside)."""
    done = python_probe(tmp_path, """
        import os
        status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        for name in ("CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs"):
            print(name, int(status[name].strip(), 16))
        try:
            os.setuid(12345)
            print("setuid worked")
        except OSError as exc:
            print("setuid", exc.errno)
        """, filesystem='read = ["/proc"]')
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[:5] == ["CapInh 0", "CapPrm 0", "CapEff 0", "CapAmb 0", "NoNewPrivs 1"]
    assert lines[5] == "setuid 1"  # EPERM, as root and as a user


def test_signal_scope_off_through_the_api(tmp_path: Path) -> None:
    """The API refuses the same policy in strict mode and reports it in best-effort."""
    import sandlock
    from sandlock.errors import SandlockError

    text = 'version = 1\n{head}extends = ["base"]\n[filesystem]\nexec = ["/usr/bin/true"]\n' \
           '[scope]\nsignals = false\n'
    with pytest.raises(SandlockError, match="signal scope"):
        sandlock.Sandbox(write_policy(tmp_path, text.format(head="")))
    box = sandlock.Sandbox(write_policy(tmp_path, text.format(head='compat = "best-effort"\n'),
                                        name="lenient.toml"))
    try:
        assert any("signal scope" in w for w in box.warnings)
        assert box.run(["/usr/bin/true"]).returncode == 0
    finally:
        box.close()
