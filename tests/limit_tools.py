"""Functions of the process-limit tests: one they run confined with Sandbox.call()
(standard library only: the confined process imports this module afresh), and the
clean-up of the cgroups they make."""

from __future__ import annotations

import os
import signal
import time

#: The directory of the tests (a confined call imports this module from there).
TESTS = os.path.dirname(os.path.realpath(__file__))
#: The process limit of the limit tests' policy.
LIMIT = 6
#: Forks LIMIT + 5 sleepers; prints how many forks succeeded (the tool itself is one
#: of the LIMIT processes).
SPAWN = (f"import sys; sys.path.insert(0, {TESTS!r}); import limit_tools; "
         f"print(limit_tools.spawn_sleepers({LIMIT + 5}))")
#: A policy that runs SPAWN under ``processes = LIMIT``.
POLICY = f"""\
version = 1
extends = ["python"]
[filesystem]
read = [{TESTS!r}]
[limits]
processes = {LIMIT}
timeout = "60s"
"""

def spawn_sleepers(count: int) -> int:
    """Fork up to ``count`` children that sleep (bounded: 30 s); return how many forks
    succeeded. The launcher kills the children when the call ends."""
    made = 0
    for _ in range(count):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
    return made


def remove_cgroup_tree(path: str, *, keep_top: bool = False) -> None:
    """Kill the members of ``path`` and of every group below it and remove them, deepest
    first (``keep_top``: not ``path`` itself). On cgroup v1 killing a group does not
    reach the groups nested inside it."""
    for where, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
        if keep_top and where == path:
            continue
        for _ in range(1000):
            with open(os.path.join(where, "cgroup.procs")) as procs:
                pids = [int(line) for line in procs if line.strip()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.rmdir(where)
        except OSError:
            pass
