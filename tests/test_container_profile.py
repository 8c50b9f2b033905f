"""sandlock under container runtimes' default seccomp profiles (issue 22).

Where agents run, sandlock is itself confined by the runtime's profile: Docker's and
containerd's default (Kubernetes RuntimeDefault) refuses ``pidfd_getfd`` without
CAP_SYS_PTRACE, which the host allowlist's connect gate once used to take the tool's
socket. ``tests/container_profile.py`` loads the real profile (read from the JSON a Debian
package ships, at test time) on this kernel and execs a command under it; here the host
allowlist's tests (CLI, API ``run``, ``call``), trace and learn run under it, as root and
as an ordinary user. The positive control shows that the Docker profile bites: a process
under it cannot take a child's descriptor with pidfd_getfd, which works without it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import tomllib
from conftest import REPO, require_abi, require_tool

LAUNCHER = Path(__file__).with_name("container_profile.py")
#: Docker's profile: the file scripts/docker_seccomp_profile.sh extracts (named by
#: SANDLOCK_DOCKER_PROFILE), or the one golang-github-docker-docker-dev installs.
DOCKER_PROFILE = "/usr/share/gocode/src/github.com/docker/docker/profiles/seccomp/default.json"
PROFILES = ("docker", "podman")


def profile_file(name: str) -> str:
    """The JSON of runtime ``name``'s default profile (podman's from its Debian package)."""
    if name == "podman":
        return require_tool("/usr/share/containers/seccomp.json")
    for path in (os.environ.get("SANDLOCK_DOCKER_PROFILE", ""), DOCKER_PROFILE):
        if path and os.path.isfile(path):
            return path
    message = ("Docker's default seccomp profile is not here: scripts/docker_seccomp_profile.sh "
               "extracts it (then SANDLOCK_DOCKER_PROFILE=FILE)")
    if os.environ.get("SANDLOCK_EXPECT_DOCKER_PROFILE") == "1":
        pytest.fail(f"{message}, but SANDLOCK_EXPECT_DOCKER_PROFILE=1")
    pytest.skip(message)


@pytest.fixture(params=PROFILES)
def profile(request: pytest.FixtureRequest) -> str:
    return profile_file(request.param)


def under(profile: str, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """``argv`` under ``profile`` (the launcher runs with the interpreter of the tests)."""
    done: subprocess.CompletedProcess[str] = subprocess.run(  # type: ignore[call-overload]
        [sys.executable, str(LAUNCHER), profile, "--", *argv], capture_output=True, text=True,
        **kwargs)
    return done


STEAL = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.read(r, 1)
    os._exit(0)
pidfd = os.pidfd_open(pid)
got = libc.syscall(438, pidfd, r, 0)  # pidfd_getfd (x86_64 and aarch64 alike)
print("OK" if got >= 0 else errno.errorcode[ctypes.get_errno()])
os.write(w, b"x")
os.waitpid(pid, 0)
"""


def test_the_docker_profile_refuses_pidfd_getfd() -> None:
    """Positive control: the profile bites where the old gate took the tool's socket."""
    docker = profile_file("docker")
    assert under(docker, [sys.executable, "-c", STEAL]).stdout.strip() == "EPERM"
    plain = subprocess.run([sys.executable, "-c", STEAL], capture_output=True, text=True)
    assert plain.stdout.strip() == "OK", plain.stderr


#: The host allowlist's tests, run under each profile: the CLI (curl, urllib, TLS), the
#: gate's attack tests, the API's run and call, and descriptor hygiene.
NETWORK_TESTS = [
    "tests/test_network_allow.py::test_allowed_host_works_with_curl_and_urllib_over_http_and_tls",
    "tests/test_network_allow.py::test_refusals_answer_403_with_the_rule_and_are_reported",
    "tests/test_network_allow.py::test_direct_connections_are_refused_whatever_the_route",
    "tests/test_network_allow.py::test_racing_thread_cannot_redirect_an_allowed_connect",
    "tests/test_network_allow.py::test_fast_open_and_non_blocking_connect",
    "tests/test_network_allow.py::test_ip_rules_allow_direct_connections_without_the_proxy",
    "tests/test_network_allow.py::test_api_run_is_mediated_like_the_cli",
    "tests/test_network_allow.py::test_api_call_is_mediated",
    "tests/test_network_allow.py::test_api_mediation_leaks_no_descriptor_or_thread",
    "tests/test_connect_gate.py",
    # trace and learn of networked tools
    "tests/test_trace.py::test_curl",
    "tests/test_learn_holes.py::test_recorded_run_has_no_network_unless_asked",
]


def all_pass_under(profile: str, tests: list[str]) -> None:
    """``tests`` run under ``profile``: every one passes, none is skipped."""
    done = under(profile, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *tests], cwd=REPO, timeout=600,
                 env={**os.environ, "PYTHONPATH": str(REPO)})
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.fullmatch(r"\d+ passed in .*", tail), tail  # nothing skipped, nothing failed


def test_host_allowlist_trace_and_learn_under_the_profile(profile: str) -> None:
    require_abi(4, "TCP rules under the connect gate")
    all_pass_under(profile, NETWORK_TESTS)


#: The native front end's run (exec/helper/sandlock-run), under each profile: its parity with
#: the Python CLI, its confinement and the probe's rows, its signals and its tree.
NATIVE_TESTS = [
    "tests/test_native_run.py::test_the_hit_runs_what_the_python_cli_runs",
    "tests/test_native_run.py::test_the_hit_is_confined",
    "tests/test_native_run.py::test_the_probe_gives_the_same_rows_natively",
    "tests/test_native_run.py::test_a_signal_to_the_front_end_reaches_the_tool",
    "tests/test_native_run.py::test_the_tools_tree_dies_with_the_front_end",
    "tests/test_native_run.py::test_the_callers_own_children_are_left_alone",
]


def test_the_native_run_under_the_profile(profile: str) -> None:
    require_abi(4, "TCP rules in the confinement test")
    all_pass_under(profile, NATIVE_TESTS)


@pytest.fixture
def servers() -> Iterator[tuple[int, int]]:
    """A loopback TCP listener and a UDP socket: (tcp port, udp port)."""
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    yield tcp.getsockname()[1], udp.getsockname()[1]
    tcp.close()
    udp.close()


def test_learn_tells_udp_from_tcp_under_the_profile(profile: str, servers: tuple[int, int],
                                                    work: Path, home: Path) -> None:
    """learn names a connected socket's type without taking the tool's descriptor: under
    the Docker profile a UDP connect was once drafted as a TCP connect grant."""
    tcp, udp = servers
    code = (f"import socket\nsocket.create_connection(('127.0.0.1', {tcp}), 5).close()\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"u.connect(('127.0.0.1', {udp}))\nu.close()\nprint('DONE')\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    learned = under(profile, [sys.executable, "-P", "-m", "sandlock", "learn", "--allow-net", "--",
                              "/usr/bin/python3", "-c", code], cwd=work, env=env, timeout=120)
    assert "DONE" in learned.stdout, learned.stdout + learned.stderr
    draft = tomllib.loads(learned.stdout[learned.stdout.index("# Draft"):])
    assert draft["network"] == {"connect": [tcp], "udp": True}, learned.stdout
