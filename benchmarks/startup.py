"""Start-up of one confined `/bin/true`, as ratios against baselines measured in the same run.

    python benchmarks/startup.py [--rounds N] [--binary PATH] [--pip PATH] [--json]

Each round runs every contender once, in a rotated order, so that drift on a busy
machine hits all of them alike. Wall time is from spawn to reaped exit. Peak memory
is the largest resident set in the contender's process tree (for the binary, its
Python process rather than the bootloader that unpacks it), measured apart with GNU
time, because a child spawned from this Python process would report this process's
resident set as its own high-water mark; GNU time's own ~2 MiB is the floor.

Contenders (each skipped with a printed reason when unavailable):
  - ``python -c pass`` with the interpreter of the pip-installed ``sandlock`` command;
  - ``sandlock run --policy P -- /bin/true``, pip command and ``dist/sandlock``, each
    with the compiled-policy cache (the steady state of an agent) and without it;
  - ``runsc --rootless --network=none do /bin/true`` (gVisor), ``bwrap --ro-bind / /
    --dev /dev --unshare-net /bin/true`` (bubblewrap), and ``/bin/true`` alone.
P extends only the ``base`` profile and grants exec on ``true``.

Targets (issue 4): pip command <= 2.5x ``python -c pass``; binary <= 0.5x runsc, and
under 40 ms median (stretch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
GNU_TIME = "/usr/bin/time"
POLICY = """\
version = 1
description = "benchmarks/startup.py: base only, plus /bin/true"
extends = ["base"]
[filesystem]
exec = ["{true}"]
"""


class Contender:
    def __init__(self, name: str, argv: list[str], env: Optional[dict[str, str]] = None) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(os.environ if env is None else env)
        self.times: list[float] = []
        self.rss_kib = 0

    def once(self) -> tuple[float, int]:
        """(seconds, exit status) of one run."""
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                       (os.POSIX_SPAWN_DUP2, devnull, 2)]
            start = time.perf_counter()
            pid = os.posix_spawn(self.argv[0], self.argv, self.env, file_actions=actions)
            _, status = os.waitpid(pid, 0)
            elapsed = time.perf_counter() - start
        finally:
            os.close(devnull)
        return elapsed, os.waitstatus_to_exitcode(status)

    def record(self) -> None:
        elapsed, code = self.once()
        if code != 0:
            raise RuntimeError(f"{self.name}: exit code {code} ({' '.join(self.argv)})")
        self.times.append(elapsed)

    def measure_rss(self, runs: int = 3) -> None:
        """Peak resident set (KiB) over ``runs`` runs, with GNU time (0 if it is missing)."""
        if not os.path.exists(GNU_TIME):
            return
        with tempfile.NamedTemporaryFile("r") as out:
            for _ in range(runs):
                subprocess.run([GNU_TIME, "-f", "%M", "-o", out.name, *self.argv], env=self.env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
                out.seek(0)
                self.rss_kib = max(self.rss_kib, int(out.read().split()[-1]))

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times) * 1000

    def spread_ms(self) -> tuple[float, float]:
        ordered = sorted(self.times)
        low = ordered[int(len(ordered) * 0.1)]
        high = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
        return low * 1000, high * 1000


def find_pip_command(explicit: Optional[str]) -> Optional[str]:
    if explicit:
        return explicit
    beside = Path(sys.executable).with_name("sandlock")
    if beside.exists():
        return str(beside)
    return shutil.which("sandlock")


def interpreter_of(script: str) -> str:
    """The Python a console script runs with (its #! line), for a fair `python -c pass`."""
    with open(script, "rb") as handle:
        first = handle.readline().decode(errors="replace").strip()
    if first.startswith("#!") and "python" in first:
        return first[2:].split()[0]
    return sys.executable


def usable(argv: list[str]) -> Optional[str]:
    """None if ``argv`` runs and exits 0 here, else why not."""
    if not os.path.exists(argv[0]):
        return f"{argv[0]} not found"
    probe = Contender("probe", argv)
    try:
        _, code = probe.once()
    except OSError as exc:
        return str(exc)
    return None if code == 0 else f"exits with {code} here"


def contenders(args: argparse.Namespace, policy: str) -> tuple[list[Contender], list[str]]:
    out: list[Contender] = []
    skipped: list[str] = []
    true = shutil.which("true") or "/bin/true"
    run = ["run", "--policy", policy, "--", true]
    nocache = {**os.environ, "SANDLOCK_NO_CACHE": "1"}
    pip = find_pip_command(args.pip)
    python = interpreter_of(pip) if pip else sys.executable
    wanted: list[tuple[str, list[str], Optional[dict[str, str]]]] = [
        ("python -c pass", [python, "-c", "pass"], None),
        ("/bin/true", [true], None),
    ]
    if pip:
        wanted += [("pip command", [pip, *run], None),
                   ("pip command, no cache", [pip, *run], nocache)]
    else:
        skipped.append("pip command: no `sandlock` beside this Python or on PATH (--pip PATH)")
    binary = args.binary or os.environ.get("SANDLOCK_BINARY") or str(REPO / "dist" / "sandlock")
    if os.path.isfile(binary):
        wanted += [("binary", [binary, *run], None), ("binary, no cache", [binary, *run], nocache)]
    else:
        skipped.append(f"binary: {binary} not built (scripts/build_binary.sh)")
    for name, argv in (
        ("runsc (gVisor)", [shutil.which("runsc") or "/usr/bin/runsc", "--rootless",
                            "--network=none", "do", true]),
        ("bubblewrap", [shutil.which("bwrap") or "/usr/bin/bwrap", "--ro-bind", "/", "/", "--dev",
                        "/dev", "--unshare-net", true]),
    ):
        why = usable(argv)
        if why:
            skipped.append(f"{name}: {why}")
        else:
            wanted.append((name, argv, None))
    for name, argv, env in wanted:
        out.append(Contender(name, argv, env))
    return out, skipped


def measure(items: list[Contender], rounds: int, warmup: int) -> None:
    for item in items:  # warm the page cache and the compiled-policy cache
        for _ in range(warmup):
            item.once()
    for index in range(rounds):
        shift = index % len(items)
        for item in items[shift:] + items[:shift]:
            item.record()
    for item in items:
        item.measure_rss()


def table(items: list[Contender]) -> list[dict[str, object]]:
    by_name = {item.name: item for item in items}
    python = by_name.get("python -c pass")
    runsc = by_name.get("runsc (gVisor)")
    rows = []
    for item in items:
        low, high = item.spread_ms()
        rows.append({
            "contender": item.name, "median_ms": round(item.median_ms, 2),
            "p10_ms": round(low, 2), "p90_ms": round(high, 2),
            "x_python": round(item.median_ms / python.median_ms, 2) if python else None,
            "x_runsc": round(item.median_ms / runsc.median_ms, 3) if runsc else None,
            "max_rss_mib": round(item.rss_kib / 1024, 1) if item.rss_kib else None,
        })
    return rows


def markdown(rows: list[dict[str, object]], skipped: list[str], rounds: int) -> str:
    uname = os.uname()
    lines = [f"{rounds} interleaved rounds on {uname.sysname} {uname.release}, "
             f"{os.cpu_count()} cores; policy: base profile + exec /bin/true.", "",
             "| contender | median | p10 – p90 | x python -c pass | x runsc | peak RSS |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio_py = "–" if row["x_python"] is None else f"{row['x_python']:.2f}x"
        ratio_runsc = "–" if row["x_runsc"] is None else f"{row['x_runsc']:.2f}x"
        lines.append(f"| {row['contender']} | {row['median_ms']:.1f} ms | {row['p10_ms']:.1f} – "
                     f"{row['p90_ms']:.1f} ms | {ratio_py} | {ratio_runsc} | "
                     f"{'–' if row['max_rss_mib'] is None else str(row['max_rss_mib']) + ' MiB'} |")
    by = {str(row["contender"]): row for row in rows}
    lines.append("")
    if "pip command" in by and by["pip command"]["x_python"] is not None:
        ratio = float(by["pip command"]["x_python"])  # type: ignore[arg-type]
        lines.append(f"- pip command: {ratio:.2f}x `python -c pass` (target <= 2.5x: "
                     f"{'met' if ratio <= 2.5 else 'MISSED'})")
    if "binary" in by:
        median = float(by["binary"]["median_ms"])  # type: ignore[arg-type]
        if by["binary"]["x_runsc"] is not None:
            ratio = float(by["binary"]["x_runsc"])  # type: ignore[arg-type]
            lines.append(f"- binary: {ratio:.2f}x runsc (target <= 0.5x: "
                         f"{'met' if ratio <= 0.5 else 'MISSED'})")
        lines.append(f"- binary: {median:.1f} ms median (stretch < 40 ms: "
                     f"{'met' if median < 40 else 'missed'})")
    for reason in skipped:
        lines.append(f"- skipped: {reason}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--binary", help="the single-file binary (default dist/sandlock)")
    parser.add_argument("--pip", help="the pip-installed sandlock command")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sandlock-startup-") as tmp:
        policy = os.path.join(tmp, "true.toml")
        with open(policy, "w") as handle:
            handle.write(POLICY.format(true=os.path.realpath(shutil.which("true") or "/bin/true")))
        items, skipped = contenders(args, policy)
        measure(items, args.rounds, args.warmup)
    rows = table(items)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "rows": rows, "skipped": skipped}, indent=2))
    else:
        print(markdown(rows, skipped, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
