"""What the signal gate costs (the substitute for Landlock's signal scope below ABI 6).

    python benchmarks/signal_gate.py [--runs 31] [--signals 2000]

1. Per run: ``sandlock run -- /bin/true`` at ``SANDLOCK_ABI=5`` (the gate's filter and
   its listener thread; such a policy is never cached) against ``SANDLOCK_ABI=7``
   (Landlock's scope, no gate; cached after the first run) and ``SANDLOCK_ABI=7`` with
   the cache off (the same full path as ABI 5, without the gate), interleaved; medians.
2. Per call, measured inside the tool (median of the per-call mean over the runs):
   ``kill(child, 0)`` to a child of the tool (through the gate: pidfd, /proc, the
   supervisor's pidfd_send_signal), ``kill(getpid(), 0)`` (the gate's CONTINUE) and
   ``kill(0, 0)`` (allowed in BPF), at ABI 5 and at ABI 7 (direct).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = "/usr/bin/python3"

TOOL = r"""
import json, os, subprocess, sys, time
n = int(sys.argv[1])
child = subprocess.Popen(["/usr/bin/sleep", "30"])
out = {}
for name, pid in (("kill(child)", child.pid), ("kill(self)", os.getpid()), ("kill(0)", 0)):
    start = time.perf_counter()
    for _ in range(n):
        os.kill(pid, 0)
    out[name] = (time.perf_counter() - start) / n * 1e6
child.kill()
child.wait()
print(json.dumps(out))
"""

POLICY = """\
version = 1
extends = ["python"]
[filesystem]
exec = ["/usr/bin/true", "/usr/bin/sleep"]
"""


def _sandlock(policy: Path, argv: list[str], abi: int, cache: bool = True) -> str:
    env = {**os.environ, "SANDLOCK_ABI": str(abi), "PYTHONPATH": str(REPO)}
    if not cache:
        env["SANDLOCK_NO_CACHE"] = "1"
    done = subprocess.run([sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--",
                           *argv], capture_output=True, text=True, env=env, check=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=31)
    parser.add_argument("--signals", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy.toml"
        policy.write_text(POLICY)
        os.chmod(tmp, 0o755)
        os.chmod(policy, 0o644)
        kinds = {"ABI 5 (signal gate)": (5, True), "ABI 7 (Landlock scope, cached)": (7, True),
                 "ABI 7, cache off": (7, False)}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for abi, cache in kinds.values():
            _sandlock(policy, ["/usr/bin/true"], abi, cache)  # warm up (and fill the cache)
        for _ in range(args.runs):
            for kind, (abi, cache) in kinds.items():
                start = time.perf_counter()
                _sandlock(policy, ["/usr/bin/true"], abi, cache)
                times[kind].append((time.perf_counter() - start) * 1e3)
        startup = {k: round(statistics.median(v), 2) for k, v in times.items()}
        per_call: dict[str, dict[str, list[float]]] = {"ABI 5": {}, "ABI 7": {}}
        for _ in range(max(3, args.runs // 5)):
            for label, abi in (("ABI 5", 5), ("ABI 7", 7)):
                row = json.loads(_sandlock(policy, [PYTHON, "-c", TOOL, str(args.signals)], abi))
                for name, value in row.items():
                    per_call[label].setdefault(name, []).append(value)
        calls = {label: {name: round(statistics.median(v), 2) for name, v in rows.items()}
                 for label, rows in per_call.items()}
    print(json.dumps({"startup_ms_median": startup, "per_call_us_median": calls,
                      "runs": args.runs, "signals_per_run": args.signals}, indent=2))


if __name__ == "__main__":
    main()
