"""The API's arguments and faults around it: typed errors before anything starts,
no descriptor left behind, no limit silently lifted, and the next call still works."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import REPO, eventually, proc_state, require_abi

import sandlock
from sandlock.exec import native as nativeexec

TESTS = str(REPO / "tests")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "the Python API")


@pytest.fixture(scope="module")
def box() -> Iterator[sandlock.Sandbox]:
    policy = {"extends": ["python"], "limits": {"timeout": "1s"},
              "filesystem": {"read": [TESTS], "exec": ["/usr/bin/sleep", "/usr/bin/cat"]}}
    with sandlock.Sandbox(policy) as sandbox:
        yield sandbox


def fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def run_script(code: str) -> Any:
    """Run ``code`` in a fresh interpreter (limits it sets stay there); its last line
    of stdout is JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=TESTS)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("timeout", [-1, -0.001, 0, math.nan, math.inf, -math.inf, 1e12])
def test_a_timeout_that_is_not_a_positive_finite_number_is_refused(
        box: sandlock.Sandbox, timeout: float) -> None:
    """Never "no limit": the policy's own 1s used to be lifted, sleep 4 exiting 0."""
    before = fds()
    for start in (lambda: box.run(["sleep", "4"], timeout=timeout),
                  lambda: box.popen(["sleep", "4"], timeout=timeout),
                  lambda: sandlock.Sandbox(box.policy, timeout=timeout)):
        with pytest.raises(ValueError, match="positive, finite"):
            start()
    assert fds() == before
    with pytest.raises(TypeError, match="number of seconds"):
        box.run(["sleep", "4"], timeout="1")  # type: ignore[arg-type]


def test_bad_input_is_refused_before_the_command_starts(box: sandlock.Sandbox,
                                                        tmp_path: Path) -> None:
    before = fds()
    marker = tmp_path / "ran"
    for bad in (3, 2.5, ["x"], object()):
        with pytest.raises(TypeError, match="input must be bytes or str"):
            box.run(["sh", "-c", f"touch {marker}"], input=bad)  # type: ignore[arg-type]
    assert fds() == before
    assert not marker.exists()
    # any bytes-like input is accepted, beyond what the annotation names
    assert box.run(["cat"], input=bytearray(b"ok"),  # type: ignore[arg-type]
                   capture_output=True).stdout == b"ok"


@pytest.mark.parametrize("options, error", [
    ({"vars": "x=1"}, TypeError), ({"vars": {"x": 1}}, TypeError),
    ({"trusted_types": [1]}, TypeError), ({"trusted_types": 5}, TypeError),
    ({"max_result_size": "big"}, TypeError), ({"max_result_size": -1}, ValueError),
])
def test_bad_sandbox_options_are_typed_errors_and_leak_nothing(options: dict[str, Any],
                                                               error: type) -> None:
    before = fds()
    with pytest.raises(error):
        sandlock.Sandbox({"extends": ["python"]}, **options)
    assert fds() == before


@pytest.mark.parametrize("key", ["memory", "file_size"])
@pytest.mark.parametrize("size", [2**63, 2**64, 2**70])
def test_sizes_beyond_what_setrlimit_takes_are_refused(key: str, size: int) -> None:
    with pytest.raises(sandlock.PolicyError, match=f"limits.{key}: .*(largest limit|too large)"):
        sandlock.Sandbox({"extends": ["python"], "limits": {key: size}})


def test_a_memory_limit_nothing_can_start_under_is_said_so() -> None:
    """It used to be a tool "killed by signal 11" (139)."""
    with pytest.raises(sandlock.PolicyError, match="limits.memory: .*no program can start"):
        sandlock.Sandbox({"extends": ["python"], "limits": {"memory": "1"}})


def test_too_few_descriptors_is_named_as_such() -> None:
    """RLIMIT_NOFILE=5 used to read "libseccomp is not available"."""
    out = run_script("""
        import json, resource, sandlock
        resource.setrlimit(resource.RLIMIT_NOFILE, (5, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            sandlock.Sandbox({"extends": ["python"]})
            print(json.dumps(["no error"]))
        except Exception as exc:
            print(json.dumps([type(exc).__name__, str(exc)]))
    """)
    assert out[0] == "SetupError" and "RLIMIT_NOFILE (ulimit -n) is 5" in out[1], out


def test_call_under_emfile_leaks_no_descriptor() -> None:
    """8 threads calling at RLIMIT_NOFILE=32: calls may fail (EMFILE), descriptors
    must not stay behind (they grew by one or two per failure)."""
    out = run_script("""
        import json, os, resource, threading, sandlock, api_tools
        box = sandlock.Sandbox({"extends": ["python"], "filesystem": {"read": [os.getcwd()]}})
        box.call(api_tools.add, 1, 2)
        sandlock.shutdown()
        before = len(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, hard))
        failed = []
        def worker():
            for _ in range(25):
                try:
                    box.call(api_tools.add, 1, 2)
                except Exception as exc:
                    failed.append(type(exc).__name__)
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sandlock.shutdown()
        after = len(os.listdir("/proc/self/fd"))
        print(json.dumps([before, after, box.call(api_tools.add, 1, 2), sorted(set(failed))]))
    """)
    before, after, then, failed = out
    assert after <= before, out
    assert then == 3
    assert set(failed) <= {"OSError", "SetupError", "CallError"}, out


def has_one_child(server: nativeexec.Server) -> bool:
    return len(server.children()) == 1


def is_reaped(pid: int) -> bool:
    return proc_state(pid) in ("Z", "gone")


@pytest.mark.skipif(not nativeexec.enabled(), reason="the native helper is not built")
def test_the_next_call_works_after_the_idle_spare_is_killed(box: sandlock.Sandbox) -> None:
    for _ in range(10):
        assert box.run(["cat"], input=b"").returncode == 0
        server = nativeexec.get()
        assert eventually(functools.partial(has_one_child, server))
        [spare] = server.children()
        os.kill(spare, signal.SIGKILL)
        assert eventually(functools.partial(is_reaped, spare))
        result = box.run(["cat"], input=b"")
        assert result.returncode == 0, result
