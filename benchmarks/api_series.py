"""The Python API's own figures (issue 25): what an agent's tool calls cost in series.

``python -m benchmarks.api_series [--rounds N] [--calls 50] [--starts N] [--json]``, and
the ``api`` step of ``python -m benchmarks`` (which runs this module in a process of
its own and puts its tables in the report).

1. **50 calls in series** of ``/bin/true``, one contender after another in shuffled
   rounds (machine load hits them alike), medians of the series' wall time:
   ``subprocess.run`` (the baseline), ``Sandbox.run``, the same through the fork server
   (the path of the next two), under ``[network] allow`` (a host allowlist: the
   Sandbox's warm mediator, a proxy and connect gate per call), with ``trace=True``,
   under ``[credentials]`` (the Sandbox's route server), and ``Sandbox.call`` of
   ``operator.add``. Every confined run must exit 0 (``call`` must return 3).
2. **Start**: ``import sandlock`` and the first ``Sandbox()`` of a small policy, timed
   inside fresh processes, interleaved with ``python -c pass`` (the interpreter's floor):
   the policy as a file and as a dict, whose plans the compiled-policy cache holds
   (stored by an untimed process first; each timed one must be a hit, seen by the policy
   model not being imported), and the dict compiled (``SANDLOCK_NO_CACHE=1``, the
   cold start: each must not be a hit).

Ratios are within this run. Nothing here asserts a time (tests/test_benchmarks.py
runs it for its shape only).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO  #: where the measured sandlock package is (--root)
TRUE = "/bin/true"
#: A small policy: what /bin/true and a confined Python function need.
POLICY: dict[str, Any] = {"extends": ["python"],
                          "filesystem": {"exec": [TRUE, os.path.realpath(TRUE)]}}
#: The targets of issue 25: (row, baseline row, limit as a ratio), and the absolute ones.
RATIO_TARGETS = (("Sandbox.run, [network] allow", "Sandbox.run", 2.0),
                 ("Sandbox.run, trace=True", "Sandbox.run", 2.0))
OVERHEAD_LIMIT_MS = 0.3
START_LIMIT_MS = 30.0

START = """
import json, sys, time
t0 = time.perf_counter()
import sandlock
t1 = time.perf_counter()
policy = json.loads(sys.argv[1])
box = sandlock.Sandbox(policy)
t2 = time.perf_counter()
print(json.dumps([t1 - t0, t2 - t1, "sandlock.policy.model" not in sys.modules]))
"""

#: The same policy as a file (``--starts``: its plan read back from the cache).
POLICY_TOML = ('version = 1\nextends = ["python"]\n[filesystem]\nexec = [%s]\n'
               % ", ".join(json.dumps(path) for path in POLICY["filesystem"]["exec"]))


def contenders(calls: int) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """The series, each a function making ``calls`` calls and checking each; and a
    function closing what they opened."""
    import sandlock

    def runs(box: Any, **options: Any) -> Callable[[], None]:
        def series() -> None:
            for _ in range(calls):
                result = box.run([TRUE], **options)
                if result.returncode != 0:
                    raise RuntimeError(f"a confined run failed: {result!r}")
        return series

    def unconfined() -> None:
        for _ in range(calls):
            subprocess.run([TRUE], check=True)

    plain = sandlock.Sandbox(POLICY)
    forkserver = sandlock.Sandbox(POLICY)
    forkserver._native = False  # commands through the fork server (as SANDLOCK_NATIVE=0)
    boxes = [plain, forkserver]
    series: dict[str, Callable[[], None]] = {"subprocess.run": unconfined,
                                             "Sandbox.run": runs(plain),
                                             "Sandbox.run, fork server": runs(forkserver)}
    try:
        network = sandlock.Sandbox({**POLICY, "network": {"allow": ["example.test:443"]}})
        boxes.append(network)
        series["Sandbox.run, [network] allow"] = runs(network)
    except sandlock.SandlockError as exc:
        print(f"skip: [network] allow: {exc}", file=sys.stderr)
    series["Sandbox.run, trace=True"] = runs(plain, trace=True)
    try:
        routed = sandlock.Sandbox({**POLICY, "credentials": {"api": {
            "upstream": "https://api.example.test/v1", "env": "API_KEY",
            "base_url_env": "API_BASE_URL"}}}, credentials={"api": "sk-benchmark"})
        boxes.append(routed)
        series["Sandbox.run, [credentials]"] = runs(routed)
    except sandlock.SandlockError as exc:
        print(f"skip: [credentials]: {exc}", file=sys.stderr)

    def call() -> None:
        for _ in range(calls):
            if plain.call(operator.add, 1, 2) != 3:
                raise RuntimeError("a confined call returned a wrong result")

    series["Sandbox.call(operator.add)"] = call

    def close() -> None:
        for box in boxes:
            box.close()

    return series, close


def measure_series(rounds: int, calls: int) -> dict[str, Any]:
    series, close = contenders(calls)
    try:
        for run in series.values():  # warm-up: servers, spares, the mediator, page cache
            run()
        samples: dict[str, list[float]] = {name: [] for name in series}
        for _ in range(rounds):
            order = list(series)
            random.shuffle(order)
            for name in order:
                started = time.perf_counter()
                series[name]()
                samples[name].append(time.perf_counter() - started)
    finally:
        close()
    return {name: {"median": statistics.median(values), "p10": _quantile(values, 0.1),
                   "p90": _quantile(values, 0.9), "n": len(values)}
            for name, values in samples.items()}


def measure_starts(count: int, require_hits: bool = True) -> dict[str, Any]:
    """Fresh processes (the package's bytecode compiled first, as an install has it). A
    start that should have read its plan from the cache and did not ends the measure,
    unless ``require_hits`` is off (a tree from before that cache): then each kind counts
    its hits."""
    import compileall
    import tempfile

    compileall.compile_dir(str(ROOT / "sandlock"), quiet=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("SANDLOCK_NO_CACHE", None)
    with tempfile.TemporaryDirectory(prefix="sandlock-bench-start-") as where:
        policy_file = os.path.join(where, "start.toml")
        with open(policy_file, "w") as handle:
            handle.write(POLICY_TOML)
        cold = {**env, "SANDLOCK_NO_CACHE": "1"}
        #: kind: (argument, environment, whether its plan is read back from the cache)
        kinds = {"file": (json.dumps(policy_file), env, True),
                 "dict": (json.dumps(POLICY), env, True),
                 "compiled": (json.dumps(POLICY), cold, False)}
        for argument, _, _ in (kinds["file"], kinds["dict"]):  # stores the plans: timed hits
            subprocess.run([sys.executable, "-c", START, argument], check=True, env=env,
                           capture_output=True, cwd=where)
        timed: dict[str, dict[str, list[float]]] = {
            kind: {"import": [], "first": [], "wall": []} for kind in kinds}
        hits = dict.fromkeys(kinds, 0)
        floors = []
        for _ in range(count):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True, env=env, cwd=where)
            floors.append(time.perf_counter() - started)
            for kind, (argument, environment, cached) in kinds.items():
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-c", START, argument], check=True,
                                      env=environment, capture_output=True, text=True,
                                      cwd=where)  # not the caller's: -c imports from there first
                timed[kind]["wall"].append(time.perf_counter() - started)
                imported, first, hit = json.loads(done.stdout)
                hits[kind] += hit
                if hit != cached and require_hits:
                    raise SystemExit(f"start of a policy {kind}: the cache was "
                                     f"{'not ' if cached else ''}used")
                timed[kind]["import"].append(imported)
                timed[kind]["first"].append(first)
    out: dict[str, Any] = {"python_c_pass": statistics.median(floors), "n": count}
    for kind, values in timed.items():
        out[kind] = {"import": statistics.median(values["import"]),
                     "first_sandbox": statistics.median(values["first"]),
                     "both": statistics.median([a + b for a, b in zip(values["import"],
                                                                      values["first"])]),
                     "process": statistics.median(values["wall"]), "hits": hits[kind]}
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def table(data: dict[str, Any]) -> list[str]:
    """The report's lines for this step's results (empty when it did not run)."""
    series, starts = data.get("series"), data.get("starts")
    if not series:
        return []
    calls = data.get("calls", 50)
    base = series["subprocess.run"]["median"]
    plain = series.get("Sandbox.run", {}).get("median", 0.0)
    out = [f"**Python API: {calls} calls of `/bin/true` in series** (baseline "
           "`subprocess.run` in the same process; shuffled rounds)", "",
           "| series | x subprocess.run | x Sandbox.run | per call | over subprocess.run | "
           "spread (series) |", "|---|---|---|---|---|---|"]
    for name, stats in series.items():
        median = stats["median"]
        out.append(f"| {name} | {median / base:.2f}x | "
                   f"{median / plain if plain else 0:.2f}x | {median / calls * 1e3:.3f} ms | "
                   f"{(median - base) / calls * 1e3:+.3f} ms | "
                   f"{stats['p10'] * 1e3:.1f} – {stats['p90'] * 1e3:.1f} ms |")
    out += ["", "| target (issue 25) | measured | limit | verdict |", "|---|---|---|---|"]
    if plain:
        over = (plain - base) / calls * 1e3
        out.append(f"| Sandbox.run over subprocess.run, per call | {over:+.3f} ms | "
                   f"≤ {OVERHEAD_LIMIT_MS} ms | {_verdict(over <= OVERHEAD_LIMIT_MS)} |")
    for name, against, limit in RATIO_TARGETS:
        if name in series and against in series:
            ratio = series[name]["median"] / series[against]["median"]
            out.append(f"| {name} / {against} | {ratio:.2f}x | ≤ {limit}x | "
                       f"{_verdict(ratio <= limit)} |")
    if starts:
        for kind, what in (("file", "a policy file, its plan cached"),
                           ("dict", "a dict, its plan cached"),
                           ("compiled", "a dict, compiled (`SANDLOCK_NO_CACHE=1`)")):
            got = starts.get(kind)
            if got is None:
                continue
            both = got["both"] * 1e3
            verdict = _verdict(both <= START_LIMIT_MS) if kind != "compiled" else "(no cache)"
            out.append(f"| `import sandlock` + first `Sandbox()` of {what} | "
                       f"{got['import'] * 1e3:.1f} + {got['first_sandbox'] * 1e3:.1f} = "
                       f"{both:.1f} ms | ≤ {START_LIMIT_MS} ms | {verdict} |")
        wholes = ", ".join(f"{starts[kind]['process'] * 1e3:.1f} ms ({kind})"
                           for kind in ("file", "dict", "compiled") if kind in starts)
        out += ["", f"Whole process (`python -c` importing sandlock and making one Sandbox): "
                f"{wholes}, against {starts['python_c_pass'] * 1e3:.1f} ms for `python -c "
                f"pass` (medians of {starts['n']})."]
    return out + [""]


def _verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


def step(rounds: int, calls: int, starts: int) -> dict[str, Any]:
    """Run this module in a fresh process (the harness's own imports stay out of it)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.api_series", "--json",
                           "--rounds", str(rounds), "--calls", str(calls),
                           "--starts", str(starts)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        from .measure import BenchmarkError

        raise BenchmarkError(f"benchmarks.api_series exited {done.returncode}: "
                             f"{done.stderr.strip()[-400:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--starts", type=int, default=15, help="fresh processes timed (0: none)")
    parser.add_argument("--json", action="store_true", help="print only the JSON results")
    parser.add_argument("--hits-unchecked", action="store_true",
                        help="measure starts whether or not they read the cache (a tree "
                        "from before the API's plan cache); each kind counts its hits")
    parser.add_argument("--root", type=Path, default=REPO,
                        help="the directory holding the sandlock package to measure (another "
                        "checkout's, for a before/after comparison; default: this one)")
    args = parser.parse_args()
    global ROOT
    ROOT = args.root.resolve()
    sys.path.insert(0, str(ROOT))
    data: dict[str, Any] = {"calls": args.calls, "root": str(ROOT),
                            "load_before": os.getloadavg()[0]}
    data["series"] = measure_series(args.rounds, args.calls)
    if args.starts:
        data["starts"] = measure_starts(args.starts, not args.hits_unchecked)
    data["load_after"] = os.getloadavg()[0]
    if not args.json:
        print("\n".join(table(data)))
        print(f"load average {data['load_before']:.2f} -> {data['load_after']:.2f}")
    print(json.dumps(data))


if __name__ == "__main__":
    main()
