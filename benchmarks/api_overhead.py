"""Overhead of the Python API (issue 6), measured from one caller process.

    python benchmarks/api_overhead.py [--n 500] [--total 10000] [--threads 8] [--no-big]
                                      [--native | --no-native]

``--no-native`` runs commands through the fork server (SANDLOCK_NATIVE=0) even when
the native helper sandlock-exec is built; ``--native`` requires the helper.

1. ``Sandbox.run(["/bin/true"])`` against ``subprocess.run(["/bin/true"])``, the two
   interleaved call by call (so machine load hits both alike); median of ``--n``.
2. The same while the caller holds 2 GiB (a bytearray with every page touched):
   ``subprocess`` forks the caller (vfork + exec), sandlock asks its fork server.
3. ``Sandbox.call()`` round trip of a trivial function: ``operator.add`` (already
   loaded in the fork server), called back to back and, as an agent calls its tools
   (between model steps), one call every 20 ms; and a function of this script
   (imported afresh in each call's process: this script's imports dominate).
4. ``--threads`` threads share ``--total`` calls (run and call mixed); then counts
   failures, processes left under the fork server besides its idle supervisors and
   their spares, and file descriptors of this process that were not there before.

Prints one JSON object (the numbers) after a human summary. Numbers depend on load:
the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def trivial(a: int, b: int) -> int:
    """The user function of part 3 (lives in this script: loaded as __main__)."""
    return a + b


def interleaved(n: int, first: Callable[[], Any], second: Callable[[], Any]) -> tuple[float, float]:
    a, b = [], []
    for _ in range(n):
        t = time.perf_counter()
        first()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        second()
        b.append(time.perf_counter() - t)
    return statistics.median(a) * 1e3, statistics.median(b) * 1e3


def timed(n: int, fn: Callable[[], Any], pause: float = 0.0) -> float:
    samples = []
    for _ in range(n):
        if pause:
            time.sleep(pause)
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def cpu_ms_per_call(n: int, fn: Callable[[], Any], servers: list[int]) -> float:
    """CPU time (user + system) of every process involved, per call: less sensitive to
    other load than wall time. Counts the caller and its reaped children, the servers
    (fork server, native server) and their supervisors, each with the children it
    reaped. Clock ticks (10 ms): use a large ``n``."""
    def process(pid: int) -> float:  # its own and its reaped children's CPU seconds
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def total() -> float:
        t = os.times()
        live = [p for s in servers for p in (s, *tree(s))]  # supervisors live on between calls
        return t.user + t.system + t.children_user + t.children_system + sum(map(process, live))

    before = total()
    for _ in range(n):
        fn()
    return (total() - before) / n * 1e3


def tree(pid: int) -> list[int]:
    from sandlock.exec.forkserver import children_of  # imported by main() from this checkout

    children = children_of(pid)
    return children + [p for c in children for p in tree(c)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--total", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--no-big", action="store_true", help="skip the 2 GiB caller")
    parser.add_argument("--native", action=argparse.BooleanOptionalAction, default=None,
                        help="commands through sandlock-exec (default: when built)")
    args = parser.parse_args()
    if args.native is not None:
        os.environ["SANDLOCK_NATIVE"] = "1" if args.native else "0"

    sys.path.insert(0, os.path.dirname(HERE))
    import sandlock
    from sandlock.exec import forkserver

    policy = {"extends": ["python"], "filesystem": {"read": [HERE],
                                                    "exec": ["/bin/true", "/usr/bin/true"]}}
    box = sandlock.Sandbox(policy)
    from sandlock.exec import native as nativeexec

    if args.native and not nativeexec.AVAILABLE:
        raise SystemExit(f"--native: {nativeexec.HELPER} is not built")
    out: dict[str, Any] = {"load_before": os.getloadavg()[0],
                           "path": "native" if nativeexec.enabled() else "forkserver"}
    for _ in range(20):  # warm up: fork server, page cache, pools
        box.run(["/bin/true"])
        subprocess.run(["/bin/true"])

    sub, ours = interleaved(args.n, lambda: subprocess.run(["/bin/true"]),
                            lambda: box.run(["/bin/true"]))
    out["true"] = {"subprocess_ms": sub, "sandlock_ms": ours, "overhead_ms": ours - sub}

    server_pid = forkserver.get().pid
    # The native path's server (the caller's child) and its supervisors: counted live.
    servers = [server_pid] + ([nativeexec.get().pid] if nativeexec.enabled() else [])
    time.sleep(0.2)  # let the supervisors of the warm-up calls be reaped (counted before)
    out["cpu_ms_per_call"] = {
        "subprocess": cpu_ms_per_call(args.n, lambda: subprocess.run(["/bin/true"]), servers),
        "sandlock": cpu_ms_per_call(args.n, lambda: box.run(["/bin/true"]), servers),
    }

    if not args.no_big:
        ballast = bytearray(2 << 30)
        for offset in range(0, len(ballast), 4096):
            ballast[offset] = 1
        sub, ours = interleaved(args.n // 5 or 1, lambda: subprocess.run(["/bin/true"]),
                                lambda: box.run(["/bin/true"]))
        out["true_2GiB_caller"] = {"subprocess_ms": sub, "sandlock_ms": ours,
                                   "overhead_ms": ours - sub}
        del ballast

    box.call(operator.add, 1, 2)
    out["call_ms"] = {"operator.add": timed(args.n, lambda: box.call(operator.add, 1, 2)),
                      "operator.add_every_20ms": timed(
                          args.n // 2 or 1, lambda: box.call(operator.add, 1, 2), pause=0.02),
                      "script_function": timed(args.n // 5 or 1, lambda: box.call(trivial, 1, 2))}

    fds_before = sorted(os.listdir("/proc/self/fd"))
    failures: list[str] = []
    counter = iter(range(args.total))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            try:
                if index % 4 == 3:
                    assert box.call(operator.add, index, 1) == index + 1
                else:
                    assert box.run(["/bin/true"]).returncode == 0
            except Exception as exc:  # noqa: BLE001 - counted
                failures.append(repr(exc))

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    server = forkserver.get()
    deadline = time.monotonic() + 10
    def idle() -> set[int]:  # supervisors, and spares (confined, waiting, no call yet)
        return {*server.children(), *server.spares()}

    while set(tree(server.pid)) != idle() and time.monotonic() < deadline:
        time.sleep(0.01)  # supervisors that just reported are reaped asynchronously
    leaked = [p for p in tree(server.pid) if p not in idle()]
    mine = [server.pid, *tree(server.pid)]
    if nativeexec.enabled():  # the native server: only its spare once calls are over
        native = nativeexec.get().pid
        while tree(native)[1:] and time.monotonic() < deadline:
            time.sleep(0.01)
        leaked += tree(native)[1:]  # beyond one child (the spare) with no child
        mine += [native, *tree(native)]
    leaked += [p for p in tree(os.getpid()) if p not in mine]
    out["concurrency"] = {
        "threads": args.threads, "calls": args.total, "seconds": elapsed,
        "calls_per_second": args.total / elapsed, "failures": len(failures),
        "first_failures": failures[:3], "leaked_processes": len(leaked),
        "leaked_fds": len(set(os.listdir("/proc/self/fd")) - set(fds_before)),
    }
    out["load_after"] = os.getloadavg()[0]
    box.close()

    t = out["true"]
    print(f"path for commands: {out['path']}")
    print(f"run(/bin/true): sandlock {t['sandlock_ms']:.3f} ms, subprocess {t['subprocess_ms']:.3f}"
          f" ms, overhead {t['overhead_ms']:.3f} ms (median of {args.n})")
    cpu = out["cpu_ms_per_call"]
    print(f"  CPU time of all processes per call: sandlock {cpu['sandlock']:.3f} ms, "
          f"subprocess {cpu['subprocess']:.3f} ms")
    if "true_2GiB_caller" in out:
        t = out["true_2GiB_caller"]
        print(f"  caller holding 2 GiB: sandlock {t['sandlock_ms']:.3f} ms, subprocess "
              f"{t['subprocess_ms']:.3f} ms, overhead {t['overhead_ms']:.3f} ms")
    c = out["call_ms"]
    print(f"call(): operator.add {c['operator.add']:.3f} ms back to back, "
          f"{c['operator.add_every_20ms']:.3f} ms one call every 20 ms; function of this "
          f"script {c['script_function']:.3f} ms")
    k = out["concurrency"]
    print(f"{k['threads']} threads x {k['calls']} calls: {k['calls_per_second']:.0f}/s, "
          f"{k['failures']} failures, {k['leaked_processes']} leaked processes, "
          f"{k['leaked_fds']} leaked fds")
    print(f"load average {out['load_before']:.2f} -> {out['load_after']:.2f} (2 cores)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
