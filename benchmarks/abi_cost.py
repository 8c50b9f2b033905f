"""What strict mode costs on each Landlock ABI, and what each substitute costs per call.

    python -m benchmarks.abi_cost [--rounds 15] [--calls 30] [--ops 20000] [--abis 1,2,...]

Each kernel is simulated with ``SANDLOCK_ABI=N`` on this one (the ruleset an ABI-N kernel
enforces, plus the substitutes sandlock adds there), so the figures compare like with like
on one machine; every measure is interleaved (all ABIs in each round, in turn) and each ratio
is against a baseline measured in the same run.

1. Start-up: ``sandlock run -- /usr/bin/true`` (the compiled-policy cache on, as users run
   it) under the shipped ``base`` and ``read_file`` profiles (plus an exec grant on
   ``/usr/bin/true``), ABI 1..7; baseline ``python -c pass`` (the interpreter floor) and
   the same profile at the newest ABI. Median ms.
2. ``Sandbox.run(["/usr/bin/true"])`` per call, over ``subprocess.run`` of the same command
   in the same worker process (alternating), ABI 1..7, ``base`` profile. Median ms.
3. Per call inside the tool (the best of 20 batches of ``--ops``/20 calls, each measure
   in turn, then the median over the rounds: the cost of the call, not of the load), policy
   ``python`` plus a read grant on ``/dev`` (which turns the ioctl substitute on below
   ABI 5): an allowed ioctl (FIONREAD on a pipe), a refused one (FS_IOC_GETFLAGS on a
   file: refused by the substitute below ABI 5, answered by the filesystem from ABI 5),
   ``kill(child, 0)`` to a child of the tool (through the signal gate below ABI 6), and
   ``getppid()`` as the floor of any syscall. Microseconds.
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
ABIS = (1, 2, 3, 4, 5, 6, 7)
PROFILES = ("base", "read_file")

POLICY = """\
version = 1
extends = ["{profile}"]
[filesystem]
exec = ["/usr/bin/true"]
"""

TOOL_POLICY = """\
version = 1
extends = ["python"]
[filesystem]
read = ["/dev", "{work}"]
exec = ["/usr/bin/sleep"]
"""

TOOL = r"""
import errno, fcntl, json, os, subprocess, sys, time
n, path = int(sys.argv[1]), sys.argv[2]
r, w = os.pipe()
f = os.open(path, os.O_RDONLY)
buf = bytearray(8)
child = subprocess.Popen(["/usr/bin/sleep", "30"])
def fionread():
    fcntl.ioctl(r, 0x541B, buf)
def getflags():
    try:
        fcntl.ioctl(f, 0x80086601, buf)
    except OSError:
        pass
def kill_child():
    os.kill(child.pid, 0)
calls = (("getppid()", os.getppid), ("ioctl FIONREAD (allowed)", fionread),
         ("ioctl FS_IOC_GETFLAGS (refused below ABI 5)", getflags), ("kill(child, 0)", kill_child))
out = {name: float("inf") for name, _ in calls}
batch = max(1, n // 20)
for _ in range(20):  # the best batch of each: what the call costs, not the machine's load
    for name, call in calls:
        start = time.perf_counter()
        for _ in range(batch):
            call()
        out[name] = min(out[name], (time.perf_counter() - start) / batch * 1e6)
child.kill()
child.wait()
print(json.dumps(out))
"""

API_WORKER = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[3])
import sandlock
calls, policy = int(sys.argv[1]), sys.argv[2]
plain, boxed = [], []
with sandlock.Sandbox(policy) as box:
    for _ in range(3):
        box.run(["/usr/bin/true"])
        subprocess.run(["/usr/bin/true"])
    for _ in range(calls):
        start = time.perf_counter()
        subprocess.run(["/usr/bin/true"], check=True)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert box.run(["/usr/bin/true"]).returncode == 0
        boxed.append(time.perf_counter() - start)
print(json.dumps([plain, boxed]))
"""


def _env(abi: int) -> dict[str, str]:
    return {**os.environ, "SANDLOCK_ABI": str(abi), "PYTHONPATH": str(REPO)}


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1e3


def _median(values: list[float], digits: int = 2) -> float:
    return round(statistics.median(values), digits)


def startup(tmp: Path, abis: tuple[int, ...], rounds: int) -> dict[str, dict[str, float]]:
    """Medians of `sandlock run -- /usr/bin/true` per profile and ABI, and ratios."""
    runs: dict[str, tuple[list[str], dict[str, str]]] = {
        "python -c pass": ([sys.executable, "-c", "pass"], dict(os.environ))}
    for profile in PROFILES:
        policy = tmp / f"{profile}.toml"
        policy.write_text(POLICY.format(profile=profile))
        policy.chmod(0o644)
        for abi in abis:
            runs[f"{profile} ABI {abi}"] = ([sys.executable, "-m", "sandlock", "run", "--policy",
                                            str(policy), "--var", f"workspace={tmp}", "--",
                                            "/usr/bin/true"], _env(abi))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for argv, env in runs.values():
        _timed(argv, env)  # warm up, fill the cache
    for _ in range(rounds):
        for name, (argv, env) in runs.items():
            times[name].append(_timed(argv, env))
    floor = statistics.median(times["python -c pass"])
    rows: dict[str, dict[str, float]] = {}
    for name, values in times.items():
        newest = name.rsplit(" ABI ", 1)[0] + f" ABI {max(abis)}"
        med = statistics.median(values)
        rows[name] = {"ms": round(med, 2), "x python": round(med / floor, 2),
                      **({"x newest ABI": round(med / statistics.median(times[newest]), 2)}
                         if newest in times else {})}
    return rows


def api(tmp: Path, abis: tuple[int, ...], rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """Per call of Sandbox.run over subprocess.run, per ABI (workers interleaved)."""
    policy = tmp / "base.toml"
    plain: dict[int, list[float]] = {abi: [] for abi in abis}
    boxed: dict[int, list[float]] = {abi: [] for abi in abis}
    for _ in range(max(1, rounds // 5)):
        for abi in abis:
            done = subprocess.run([sys.executable, "-c", API_WORKER, str(calls), str(policy), str(REPO)],
                                  env=_env(abi), check=True, capture_output=True, text=True)
            one, two = json.loads(done.stdout)
            plain[abi] += one
            boxed[abi] += two
    return {f"ABI {abi}": {"subprocess.run ms": _median([v * 1e3 for v in plain[abi]]),
                           "Sandbox.run ms": _median([v * 1e3 for v in boxed[abi]]),
                           "overhead ms": _median([(b - p) * 1e3 for p, b in zip(plain[abi], boxed[abi])])}
            for abi in abis}


def per_call(tmp: Path, abis: tuple[int, ...], rounds: int, ops: int) -> dict[str, dict[str, float]]:
    """Microseconds per call inside the tool, per ABI."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    work.chmod(0o755)
    target = work / "file"
    target.write_text("x")
    target.chmod(0o644)
    policy = tmp / "tool.toml"
    policy.write_text(TOOL_POLICY.format(work=work))
    policy.chmod(0o644)
    seen: dict[int, dict[str, list[float]]] = {abi: {} for abi in abis}
    for _ in range(max(3, rounds // 3)):
        for abi in abis:
            done = subprocess.run([sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--",
                                   PYTHON, "-c", TOOL, str(ops), str(target)],
                                  env=_env(abi), check=True, capture_output=True, text=True)
            for name, value in json.loads(done.stdout).items():
                seen[abi].setdefault(name, []).append(value)
    return {f"ABI {abi}": {name: _median(values) for name, values in rows.items()}
            for abi, rows in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=30, help="Sandbox.run calls per worker")
    parser.add_argument("--ops", type=int, default=20000, help="calls per measure inside the tool")
    parser.add_argument("--abis", default=",".join(map(str, ABIS)))
    parser.add_argument("--only", action="append", choices=("startup", "api", "per_call"),
                        help="run only this measure (repeatable)")
    args = parser.parse_args()
    only = set(args.only or ("startup", "api", "per_call"))
    abis = tuple(int(a) for a in args.abis.split(","))
    with tempfile.TemporaryDirectory(prefix="sandlock-abi-") as name:
        tmp = Path(name)
        tmp.chmod(0o755)
        out: dict[str, object] = {"kernel": os.uname().release, "cpus": os.cpu_count(),
                                  "rounds": args.rounds}
        for policy in PROFILES:  # the api measure uses the start-up measure's policy files
            (tmp / f"{policy}.toml").write_text(POLICY.format(profile=policy))
            (tmp / f"{policy}.toml").chmod(0o644)
        if "startup" in only:
            out["startup"] = startup(tmp, abis, args.rounds)
        if "api" in only:
            out["api"] = api(tmp, abis, args.rounds, args.calls)
        if "per_call" in only:
            out["per_call_us"] = per_call(tmp, abis, args.rounds, args.ops)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
