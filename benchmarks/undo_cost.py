"""What `--dry-run` and `--checkpoint` cost against a plain `sandlock run` (docs/undo.md).

    python -m benchmarks.undo_cost [--rounds 5] [--large-rounds 3] [--dir DIR] [--skip-large]

Two workspaces: 100 files of 10 KiB (1 MiB) and 20,000 files of 10 KiB (200 MiB), in
``DIR`` (default a new directory in /var/tmp: the disk; pass ``--dir /dev/shm`` for
tmpfs). The tool is ``sh -c 'echo changed > f0'`` under the shipped ``shell`` policy.
Per round, in turn: a plain run; ``cp -a`` of the workspace then ``rm -rf`` of the copy
(the floor of any copy on this filesystem, now: the machine may be shared); a dry run,
then `sandlock discard`; a checkpoint run, then `sandlock discard` (each discard timed
apart). Medians of the whole processes, in ms, and the ratio of each to the plain run
and to the plain run plus ``cp -a``, of the same rounds. The records and
copies live in a cache directory beside the workspace (``XDG_CACHE_HOME``), on the
same filesystem, so a filesystem with reflinks (btrfs, XFS) would clone rather than copy.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POLICY = REPO / "policies" / "shell.toml"
SIZES = {"1 MiB / 100 files": 100, "200 MiB / 20,000 files": 20_000}
FILE_BYTES = 10 << 10


def make_workspace(root: Path, files: int) -> None:
    block = os.urandom(FILE_BYTES)
    for index in range(files):
        folder = root / f"d{index // 500}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{index}").write_bytes(block)


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    took = (time.perf_counter() - start) * 1000
    if done.returncode != 0:
        raise SystemExit(f"{argv[:6]} exited {done.returncode}: {done.stderr[-2000:]}")
    return took, done.stderr


def measure(work: Path, cache: Path, rounds: int) -> dict[str, list[float]]:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    cli = [sys.executable, "-P", "-m", "sandlock"]
    run = [*cli, "run", "--policy", str(POLICY), "--var", f"workspace={work}"]
    tool = ["--", "sh", "-c", "echo changed > d0/f0"]
    out: dict[str, list[float]] = {"plain": [], "cp -a": [], "rm -rf": [], "dry-run": [],
                                   "checkpoint": [], "discard": []}
    copy = work.parent / "copy"
    for _ in range(rounds + 1):  # the first round warms the caches and is dropped
        row = {"plain": timed([*run, *tool], env, work)[0]}
        row["cp -a"] = timed(["cp", "-a", str(work), str(copy)], env, work)[0]
        row["rm -rf"] = timed(["rm", "-rf", str(copy)], env, work)[0]
        for mode in ("dry-run", "checkpoint"):
            took, err = timed([*run, f"--{mode}", *tool], env, work)
            row[mode] = took
            found = re.search(r"run (\S+) \(", err)
            if found is None:
                raise SystemExit(f"no run name in: {err[-2000:]}")
            row["discard"] = timed([*cli, "discard", found.group(1)], env, work)[0]
        if _ > 0:
            for name, value in row.items():
                out[name].append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--large-rounds", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="sandlock-undo-bench-", dir=args.dir))
    filesystem = subprocess.run(["stat", "-f", "-c", "%T", str(top)], capture_output=True,
                                text=True).stdout.strip()
    print(f"# undo cost, {filesystem} ({top}); medians of whole processes, ms", flush=True)
    print("workspace\tplain\tcp -a\trm -rf\tdry-run\tratio\tvs plain+cp\tcheckpoint\tratio\t"
          "vs plain+cp\tdiscard", flush=True)
    try:
        for label, files in SIZES.items():
            if args.skip_large and files > 1000:
                continue
            case = top / str(files)
            work, cache = case / "ws", case / "cache"
            work.mkdir(parents=True)
            cache.mkdir(mode=0o700)
            make_workspace(work, files)
            got = measure(work, cache, args.rounds if files <= 1000 else args.large_rounds)
            med = {name: statistics.median(values) for name, values in got.items()}
            floor = med["plain"] + med["cp -a"]
            print(f"{label}\t{med['plain']:.0f}\t{med['cp -a']:.0f}\t{med['rm -rf']:.0f}\t"
                  f"{med['dry-run']:.0f}\t{med['dry-run'] / med['plain']:.1f}x\t"
                  f"{med['dry-run'] / floor:.2f}x\t{med['checkpoint']:.0f}\t"
                  f"{med['checkpoint'] / med['plain']:.1f}x\t{med['checkpoint'] / floor:.2f}x\t"
                  f"{med['discard']:.0f}", flush=True)
            shutil.rmtree(case)
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
