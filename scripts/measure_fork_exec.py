#!/usr/bin/env python3
"""Time the confined child's path from fork to execve on this machine.

Each launch writes three CLOCK_MONOTONIC stamps to a pipe (see
``sandlock.exec.launcher.TIMING_FD``): the parent just before fork, the child just
after fork, the child just before execve. Reported, as median and p90 over N
launches of /usr/bin/true under a minimal policy:

- fork: the parent's ``os.fork()`` until the child runs its first line
- child path: first line in the child -> just before execve (setsid, PDEATHSIG,
  signals, rlimits, close-on-exec, no_new_privs, landlock_restrict_self, seccomp)
- fork to exec: the sum, the whole time the child spends before the command
- spawn: the parent's view, fork until the close-on-exec pipe reports exec done
  (includes execve itself)

and, for comparison, the same parent's view for a plain unconfined fork + execve.

    python scripts/measure_fork_exec.py [-n 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from sandlock.compile import compiler
from sandlock.exec import launcher
from sandlock.policy.model import loads_policy

POLICY = """\
version = 1
extends = ["base"]
[filesystem]
exec = ["/usr/bin/true"]
[network]
connect = [443]
"""


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def plain_spawn_us() -> float:
    """Fork + execve of /usr/bin/true without any confinement, parent's view."""
    errr, errw = os.pipe2(os.O_CLOEXEC)
    start = time.monotonic_ns()
    pid = os.fork()
    if pid == 0:  # pragma: no cover
        try:
            os.execv("/usr/bin/true", [b"true"])
        finally:
            os._exit(127)
    os.close(errw)
    os.read(errr, 1)
    done = time.monotonic_ns()
    os.close(errr)
    os.waitpid(pid, 0)
    return (done - start) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2000, help="launches (default 2000)")
    args = parser.parse_args()

    devnull = os.open(os.devnull, os.O_RDWR)
    with tempfile.TemporaryDirectory() as tmp:
        policy = loads_policy(POLICY, source=str(Path(tmp) / "measure.toml"))
        compiled = compiler.compile_policy(policy)
        command = launcher.prepare_command(compiled, ["/usr/bin/true"])
        read_end, write_end = os.pipe()
        launcher.TIMING_FD = write_end
        fork, path, total, spawn = [], [], [], []
        try:
            for _ in range(args.n):
                start = time.monotonic_ns()
                child = launcher.spawn(compiled, command, stdin=devnull, stdout=devnull,
                                       stderr=devnull)
                spawned = time.monotonic_ns()
                child.wait()
                assert child.returncode == 0, child.returncode
                raw = os.read(read_end, 24)
                before_fork, child_start, before_exec = (
                    int.from_bytes(raw[i:i + 8], "little") for i in range(0, 24, 8))
                fork.append((child_start - before_fork) / 1000)
                path.append((before_exec - child_start) / 1000)
                total.append((before_exec - before_fork) / 1000)
                spawn.append((spawned - start) / 1000)
        finally:
            launcher.TIMING_FD = -1
            compiled.close()
    plain = [plain_spawn_us() for _ in range(args.n)]

    print(f"{args.n} launches of /usr/bin/true, Landlock ABI {compiled.abi}, "
          f"{len(compiled.bpf) // 8} BPF instructions; microseconds")
    print(f"{'':36} {'median':>8} {'p90':>8}")
    for name, values in (("fork (parent -> child's 1st line)", fork),
                         ("child path (1st line -> execve)", path),
                         ("fork to exec (sum)", total),
                         ("spawn, parent's view (incl. exec)", spawn),
                         ("plain fork+exec, parent's view", plain)):
        print(f"{name:36} {statistics.median(values):8.0f} {percentile(values, 0.9):8.0f}")


if __name__ == "__main__":
    main()
