"""`sandlock trace` sees the socket families the policy refuses (issue 23).

The policy filter's errno would outrank the recorder's notification, so a recorded run's
filter leaves socket(2) to the recorder, which refuses from the same rules with the same
errno (:func:`sandlock.compile.seccomp.refusal`) and reports the ``[network]`` grant.
Every test runs a real probe on the real kernel: it exits after printing the errno
each socket(2) got.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_network_allow import Server, http_server, needs_kernel, net_policy  # noqa: F401
from test_substitutes import (
    ALLOW,
    NO_SCOPE,
    SIGNAL_ATTACKS,
    _gate_policy,
    _program,
    _reached,
    victim,  # noqa: F401
)
from test_trace import cli, policy

from sandlock.cli.launch import load_full
from sandlock.compile import compiler, seccomp
from sandlock.exec import launcher
from sandlock.policy.model import Network, Policy
from sandlock.trace import record as T

pytestmark = pytest.mark.skipif(T.supported() is not None, reason=str(T.supported()))

PYTHON = os.path.realpath(sys.executable)
#: (family, type) probed: refused or granted by [network], and families never granted.
SOCKETS = [(socket.AF_UNIX, socket.SOCK_STREAM), (socket.AF_UNIX, socket.SOCK_DGRAM),
           (socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_INET6, socket.SOCK_DGRAM),
           (socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET, socket.SOCK_RAW),
           (socket.AF_NETLINK, socket.SOCK_RAW), (socket.AF_PACKET, socket.SOCK_DGRAM),
           (50, socket.SOCK_STREAM)]
PROBE = ("import socket, sys\n"
         "out = []\n"
         "for f, t in %r:\n"
         "    try:\n"
         "        socket.socket(f, t).close(); out.append(0)\n"
         "    except OSError as e:\n"
         "        out.append(e.errno)\n"
         "print('ERRNOS', out)\n" % ([(int(f), int(t)) for f, t in SOCKETS],))


def body(network: str = "") -> str:
    return f'extends = ["base"]\n[filesystem]\nexec = ["{PYTHON}"]\n{network}'


def errnos(stdout: str) -> list[int]:
    line = next(x for x in stdout.splitlines() if x.startswith("ERRNOS "))
    return [int(v) for v in line[8:-1].split(", ")]


@pytest.mark.parametrize("network", ["", "[network]\nunix = true\n",
                                     "[network]\nudp = true\nconnect = [80]\n"])
def test_trace_refuses_exactly_what_run_refuses(work: Path, home: Path, network: str) -> None:
    strict = policy(work, body(network))
    ran = cli(["run", "--policy", str(strict), "--", PYTHON, "-c", PROBE], work, home)
    traced = cli(["trace", "--policy", str(strict), "--", PYTHON, "-c", PROBE], work, home)
    assert ran.returncode == 0 and traced.returncode == 0, (ran.stderr, traced.stderr)
    assert errnos(traced.stdout) == errnos(ran.stdout)
    assert 0 in errnos(ran.stdout) or not network  # the grants let something through
    assert set(errnos(ran.stdout)) <= {0, 1, 97}  # EPERM, or EAFNOSUPPORT of the kernel


def test_trace_names_the_refused_family_and_its_grant(work: Path, home: Path) -> None:
    strict = policy(work, body())
    result = cli(["trace", "--policy", str(strict), "--json", "--report", "-", "--",
                  PYTHON, "-c", PROBE], work, home)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout[result.stdout.index("{"):])
    denials = {(d["path"], d["grant"]) for d in report["denials"] if d["right"] == "socket"}
    assert ("AF_UNIX SOCK_STREAM socket", "unix = true") in denials
    assert ("AF_INET SOCK_DGRAM socket", "udp = true") in denials
    assert ("AF_INET6 SOCK_DGRAM socket", "udp = true") in denials
    assert ("AF_INET SOCK_STREAM socket", "connect = [PORT] (any TCP grant)") in denials
    assert ("AF_NETLINK SOCK_RAW socket", "(no policy line: sandlock allows no such socket)") \
        in denials
    text = cli(["trace", "--policy", str(strict), "--", PYTHON, "-c", PROBE], work, home)
    assert "denied socket AF_UNIX SOCK_STREAM socket -> [network] unix = true" in text.stderr


def test_recorded_plan_leaves_socket_to_the_recorder() -> None:
    network = Network(unix=True)
    full = seccomp.socket_rules(network)
    assert [r for r in full if r.syscall == "socket"]
    for rule in full:
        assert (rule in seccomp.plan(_policy(network), sockets_recorded=True)) \
            == (rule.syscall != "socket")
    args = (socket.AF_INET, socket.SOCK_DGRAM, 0, 0, 0, 0)
    assert seccomp.refusal(full, "socket", args) == 1
    assert seccomp.refusal(full, "socket", (socket.AF_UNIX, socket.SOCK_STREAM, 0, 0, 0, 0)) == 0
    # garbage in the upper half of the family: refused (AF_MAX and above, on 64 bits), as
    # the filter compiled from the same rules does
    assert seccomp.refusal(full, "socket", (socket.AF_INET | 1 << 32, 2, 0, 0, 0, 0)) == 1


def _policy(network: Network) -> Policy:
    import dataclasses

    return dataclasses.replace(Policy(), network=network)


def _traced_errnos(work: Path, recorder_rules: bool, capfd: pytest.CaptureFixture[str]) -> list[int]:
    strict = policy(work, body())
    loaded = load_full(str(strict), None, None, {}, None, False, None)
    compiled = compiler.compile_policy(loaded, None, sockets_recorded=True)
    cmd = launcher.prepare_command(compiled, [PYTHON, "-c", PROBE])
    sockets = seccomp.socket_rules(loaded.network) if recorder_rules else None
    with compiled, T.Recorder(sockets=sockets) as recorder:
        launcher.run(compiled, cmd, recorder=recorder)
        recorder.stop()
    return errnos(capfd.readouterr().out)


def test_the_recorder_is_what_refuses(work: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Positive control: the recorded run's filter alone lets AF_UNIX and UDP through (the
    recorder told to CONTINUE everything); with the policy's rules the recorder refuses."""
    assert _traced_errnos(work, True, capfd)[:4] == [1, 1, 1, 1]
    assert _traced_errnos(work, False, capfd)[:4] == [0, 0, 0, 0]


ALLOW_PROBE = """
import errno, socket, urllib.request, urllib.error
for host in ("a.example.test", "example.test"):
    try:
        print(host, urllib.request.urlopen(f"http://{host}:%(port)d/").status)
    except urllib.error.HTTPError as e:
        print(host, e.code)
s = socket.socket()
try:
    s.connect(("127.0.0.1", %(port)d)); print("direct OK")
except OSError as e:
    print("direct", errno.errorcode[e.errno])
try:
    open(%(secret)r).read(); print("file OK")
except OSError as e:
    print("file", errno.errorcode[e.errno])
for args in ((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_UDP), (socket.AF_UNIX, 1, 0)):
    try:
        socket.socket(*args).close(); print("socket OK")
    except OSError as e:
        print("socket", errno.errorcode[e.errno])
"""


def test_trace_records_a_policy_with_a_host_allowlist(
        work: Path, home: Path, http_server: Server) -> None:  # noqa: F811
    """The connect gate rides on the recorder's listener: the refused file is reported,
    the allowlist still answers 403 for an unlisted host and refuses a direct connect;
    the allowed host is reached (the gate works, the refusals are not a broken network)."""
    needs_kernel()
    port = http_server.port
    secret = work.parent / "unlisted.txt"
    secret.write_text("not for the tool\n")
    strict = net_policy(work.parent, [f"a.example.test:{port}"])
    code = ALLOW_PROBE % {"port": port, "secret": str(secret)}
    expected = ["a.example.test 200", "example.test 403", "direct EACCES", "file EACCES",
                "socket EPERM", "socket EPERM"]  # the policy's rules before the gate's
    ran = cli(["run", "--policy", str(strict), "--", PYTHON, "-c", code], work, home)
    assert ran.stdout.splitlines() == expected, ran.stderr
    before = http_server.accepted
    traced = cli(["trace", "--policy", str(strict), "--json", "--report", "-", "--",
                  PYTHON, "-c", code], work, home)
    assert traced.returncode == 0, traced.stderr
    lines = traced.stdout[:traced.stdout.index("{")].splitlines()
    assert lines == expected, traced.stderr
    assert http_server.accepted == before + 1  # only the allowed host, through the proxy
    report = json.loads(traced.stdout[traced.stdout.index("{"):])
    assert {"right": "read", "path": str(secret), "section": "filesystem",
            "grant": f'read += "{secret}"'} in report["denials"]
    assert "refused direct connection to 127.0.0.1" in traced.stderr
    assert "refused example.test" in traced.stderr
    assert {"right": "socket", "path": "AF_UNIX SOCK_STREAM socket", "section": "network",
            "grant": "unix = true"} in report["denials"]


def _trace_at_abi5(policy_file: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "LANG": "C.UTF-8", "SANDLOCK_ABI": "5", "PYTHONPATH": str(Path(__file__).parent.parent)}
    return subprocess.run([sys.executable, "-P", "-m", "sandlock", "trace", "--policy",
                           str(policy_file), "--", *argv], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("scoped", [True, False])
def test_signal_gate_rides_with_the_connect_gate_on_the_recorder(
        tmp_path: Path, victim: subprocess.Popen[bytes], scoped: bool) -> None:  # noqa: F811
    """Landlock ABI 5 (no signal scope), [network] allow, traced: the recorder's listener
    carries the connect gate and the signal gate; a kill of a process outside is refused.
    Control: the same policy without the signal scope kills it (the attack works)."""
    from conftest import require_abi

    require_abi(5, "pretending ABI 5")
    script = _program(tmp_path, SIGNAL_ATTACKS["kill"])
    if scoped:
        policy_file = _gate_policy(tmp_path, "", ALLOW)
    else:
        policy_file = _gate_policy(tmp_path, NO_SCOPE[0], ALLOW + "\n" + NO_SCOPE[1])
    result = _trace_at_abi5(policy_file, [PYTHON, str(script), str(victim.pid)])
    assert result.returncode == (errno.EPERM if scoped else 0), result.stderr
    assert _reached(victim) != scoped
