"""Property tests of the Python API's arguments (hypothesis).

Whatever a caller passes to ``Sandbox(...)`` and ``Sandbox.run(...)``, the outcome is
a result or a SandlockError, TypeError or ValueError raised before anything starts --
never another exception -- and no descriptor is left open.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator

import pytest
from conftest import require_abi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandlock
from sandlock.errors import SandlockError

ALLOWED = (SandlockError, TypeError, ValueError)

#: Any value of the kinds a caller might get wrong.
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.binary(max_size=8), st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.one_of(st.text(max_size=4), st.integers()),
                    max_size=2),
    st.sampled_from([object(), int, str, [int], {"x": "1"}, -1, -2, -3, 0, 2**31, 1e-9]),
)


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "the Python API")


@pytest.fixture(scope="module")
def box() -> Iterator[sandlock.Sandbox]:
    policy = {"extends": ["python"], "limits": {"timeout": "10s"},
              "filesystem": {"exec": ["/usr/bin/cat", "/usr/bin/true"]}}
    with sandlock.Sandbox(policy) as sandbox:
        sandbox.run(["true"])  # what stays open for the process (servers, caches) opens now
        yield sandbox


def fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.function_scoped_fixture])
@given(options=st.dictionaries(st.sampled_from(
    ["vars", "best_effort", "timeout", "trusted_types", "max_result_size"]), ANY, max_size=3),
    limits=st.dictionaries(st.sampled_from(["memory", "file_size", "timeout", "open_files"]),
                           ANY, max_size=2))
def test_sandbox_arguments(box: sandlock.Sandbox, options: dict[str, Any],
                           limits: dict[str, Any]) -> None:
    before = fds()
    try:
        sandlock.Sandbox({"extends": ["python"], "limits": limits}, **options).close()
    except ALLOWED:
        pass
    assert fds() == before


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.function_scoped_fixture])
@given(argv=st.one_of(st.sampled_from([["cat"], ["true"], ["/usr/bin/cat", "-"], [], "cat"]),
                      ANY),
       options=st.dictionaries(st.sampled_from(
           ["input", "timeout", "cwd", "capture_output", "stdin", "stdout", "stderr", "env",
            "text", "encoding", "errors", "check"]), ANY, max_size=3))
def test_run_arguments(box: sandlock.Sandbox, argv: Any, options: dict[str, Any]) -> None:
    for fd in ("stdin", "stdout", "stderr"):  # never the test's own descriptors
        if isinstance(options.get(fd), int) and options[fd] >= 0:
            options[fd] = -3
    before = fds()
    try:
        box.run(argv, **options)
    except ALLOWED:
        pass
    assert fds() == before


def test_the_fuzzed_values_include_the_reported_cases() -> None:
    """The issue's inputs, explicitly (hypothesis may not draw them)."""
    with sandlock.Sandbox({"extends": ["python"],
                           "filesystem": {"exec": ["/usr/bin/true"]}}) as sandbox:
        for options in ({"timeout": -1}, {"timeout": math.nan}, {"input": 3},
                        {"input": "x", "encoding": "0"}, {"input": "x", "errors": "0"},
                        {"stdin": 2**40}, {"stderr": -2**70}, {"stdout": -5}):
            before = fds()
            with pytest.raises(ALLOWED):
                sandbox.run(["true"], **options)
            assert fds() == before
