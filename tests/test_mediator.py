"""The API's host-allowlist mediation runs outside the agent's process (issue 12 item 6).

A tool under ``[network] allow`` talks to a proxy and a connect gate; their
parsing faces the tool. They run in a mediator process started for the call (a
clean exec, empty environment), so a tool flooding the proxy uses up the
mediator's descriptors, never the agent's, and at most MAX_CLIENTS of them.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import helper_tools
import pytest
from conftest import REPO, require_abi

import sandlock
from sandlock.net import listener

TESTS = str(REPO / "tests")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(4, "host allowlists (Landlock TCP rules)")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_tool_flooding_the_proxy_cannot_exhaust_the_agents_descriptors(tmp_path: Path) -> None:
    ready, release = tmp_path / "ready", tmp_path / "release"
    policy = {"extends": ["python"], "filesystem": {"read": [TESTS], "write": [str(tmp_path)]},
              "network": {"allow": ["example.test:443"]}}
    with sandlock.Sandbox(policy, timeout=120) as box:
        release.touch()
        box.call(helper_tools.flood_proxy, 0, str(ready), str(release))  # warm: spares, servers
        ready.unlink()
        release.unlink()
        before = _fds()
        outcome: dict[str, Any] = {}

        def flood() -> None:
            try:
                outcome["opened"] = box.call(helper_tools.flood_proxy, 2000, str(ready),
                                             str(release))
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome["error"] = exc

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        end = time.monotonic() + 120
        while not ready.exists() and thread.is_alive() and time.monotonic() < end:
            time.sleep(0.05)
        assert ready.exists(), outcome
        during = _fds()
        failures = 0
        opened = []
        for _ in range(200):  # the agent's own work goes on
            try:
                opened.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                failures += 1
        for fd in opened:
            os.close(fd)
        release.touch()
        thread.join(120)
        assert not thread.is_alive()
    assert failures == 0
    # The call's own pipes and sockets, not one per tool connection.
    assert during - before < 32, (before, during)
    assert outcome.get("opened") == 2000, outcome


def test_the_proxy_holds_at_most_the_cap_of_connections_with_a_report(tmp_path: Path) -> None:
    policy = {"extends": ["python"], "network": {"allow": ["example.test:443"]}}
    script = (f"import socket,os,urllib.parse as u,resource,time\n"
              f"s,h=resource.getrlimit(resource.RLIMIT_NOFILE);resource.setrlimit(resource.RLIMIT_NOFILE,(h,h))\n"
              f"p=u.urlsplit(os.environ['HTTP_PROXY'])\n"
              f"k=[socket.create_connection((p.hostname,p.port))"
              f" for _ in range({listener.MAX_CLIENTS + 50})]\n"
              f"time.sleep(1)\n")
    with sandlock.Sandbox({**policy, "extends": ["python"]}) as box:
        result = box.run(["/usr/bin/python3", "-I", "-S", "-c", script], capture_output=True)
    assert result.returncode == 0, result
    assert any(f"{listener.MAX_CLIENTS} are open (the limit per server)" in line
               for line in result.network_events), result.network_events
