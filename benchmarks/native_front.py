"""50 calls in series of a confined `/bin/true`, as ratios against baselines of the same run.

    python benchmarks/native_front.py [--calls N] [--rounds N] [--json]

Rows (each skipped with a printed reason when unavailable), every one a whole process
from spawn to reaped exit, 50 in a row, the rows interleaved round by round:

- ``native CLI``: the front end ``sandlock/exec/helper/sandlock-run`` with
  ``SANDLOCK_NATIVE_RUN=1`` on a cached policy (today it verifies the entry, then execs
  the Python CLI: docs/design.md "Native front end");
- ``native checks``: a copy of the front end whose "Python" is ``/bin/true``: what the
  native path costs up to and including the verified entry and every re-check (the
  grant checks' witness included), then one exec; the row is measured only once its
  debug line shows it went through all of them;
- ``Python CLI``: ``python -m sandlock run`` on the same cached policy;
- ``bwrap``: ``bwrap --ro-bind / / --dev /dev --unshare-net /bin/true`` (bubblewrap);
- ``unconfined``: ``/bin/true``.

Each row's median time per call is printed with its ratio to ``unconfined`` and to
``bwrap``. Nothing is asserted: this is a measurement (tests/ holds no timed assertion).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
HELPER = REPO / "sandlock" / "exec" / "helper"
FRONT = HELPER / "sandlock-run"
POLICY = """\
version = 1
description = "benchmarks/native_front.py: base only, plus /bin/true"
extends = ["base"]
[filesystem]
exec = ["{true}"]
"""


def series(argv: list[str], env: dict[str, str], calls: int) -> float:
    """Seconds for ``calls`` runs of ``argv`` in a row (each must exit 0)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    actions = [(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)]
    try:
        start = time.perf_counter()
        for _ in range(calls):
            pid = os.posix_spawn(argv[0], argv, env, file_actions=actions)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"{' '.join(argv)}: exit {os.waitstatus_to_exitcode(status)}")
        return time.perf_counter() - start
    finally:
        os.close(devnull)


def build_checks_copy(out: Path) -> Optional[str]:
    """The front end with /bin/true as its Python, for the package here; the reason when
    it cannot be built."""
    sys.path.insert(0, str(REPO))
    import setup  # noqa: PLC0415 - the one build recipe (warnings, defines)

    return setup.front_end_variant(str(out), "/bin/true", str(FRONT))


HIT = "a hit: running it natively is not written yet"


def reached_the_hit(argv: list[str], env: dict[str, str]) -> Optional[str]:
    """None when the front end went through every check to the hit (its debug line says
    so); else why the row would not measure the checks."""
    import subprocess

    done = subprocess.run(argv, env={**env, "SANDLOCK_NATIVE_DEBUG": "1"}, capture_output=True,
                          text=True, timeout=60, check=False)
    found = [line.split(": ", 2)[2] for line in done.stderr.splitlines()
             if line.startswith("sandlock-run: fallback: ")]
    return None if found == [HIT] else f"the front end stopped early: {found}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    true = os.path.realpath("/bin/true")
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="sandlock-native-bench-") as tmp:
        policy = Path(tmp) / "policy.toml"
        policy.write_text(POLICY.format(true=true))
        env = {k: v for k, v in os.environ.items() if k != "SANDLOCK_NO_CACHE"}
        env.update({"XDG_CACHE_HOME": str(Path(tmp) / "cache"), "SANDLOCK_NATIVE_RUN": "1",
                    "PYTHONPATH": str(REPO)})
        run_args = ["run", "--policy", str(policy), "--", true]
        rows: dict[str, list[str]] = {}
        if FRONT.exists():
            rows["native CLI"] = [str(FRONT), *run_args]
            why = build_checks_copy(Path(tmp) / "sandlock-run-checks")
            if why is None:
                rows["native checks"] = [str(Path(tmp) / "sandlock-run-checks"), *run_args]
            else:
                skipped["native checks"] = why
        else:
            skipped["native CLI"] = skipped["native checks"] = f"{FRONT} is not built"
        rows["Python CLI"] = [sys.executable, "-m", "sandlock", *run_args]
        bwrap = shutil.which("bwrap")
        if bwrap:
            rows["bwrap"] = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-net", true]
        else:
            skipped["bwrap"] = "not installed (apt-get install bubblewrap)"
        rows["unconfined"] = [true]
        for argv in rows.values():  # warm: the cache entry, the page cache
            series(argv, env, 2)
        if "native checks" in rows:  # a row that fell back early measures nothing it names
            why = reached_the_hit(rows["native checks"], env)
            if why is not None:
                skipped["native checks"] = why
                del rows["native checks"]
        times: dict[str, list[float]] = {name: [] for name in rows}
        names = list(rows)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                times[name].append(series(rows[name], env, args.calls))
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {"calls": args.calls, "rounds": args.rounds, "seconds": median, "skipped": skipped}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.calls} calls in series, median of {args.rounds} rounds (interleaved)")
    base, bw = median["unconfined"], median.get("bwrap")
    for name, seconds in median.items():
        vs_bwrap = f"{seconds / bw:6.2f}x bwrap" if bw else ""
        print(f"  {name:<14} {seconds:7.3f} s  {seconds / args.calls * 1000:7.2f} ms/call  "
              f"{seconds / base:7.1f}x unconfined  {vs_bwrap}")
    for name, why in skipped.items():
        print(f"  {name:<14} skipped: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
