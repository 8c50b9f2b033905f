"""``python -m benchmarks [--quick] [--out DIR]``: measure, then write the report and plots."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from . import report
from .contenders import Setup
from .suite import REPO, Context, Plan, run_all

STEPS = ("inprocess", "whole", "paths", "memory", "concurrency", "session", "workloads",
         "api")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: fewer rounds, no slow contenders, installs nothing")
    parser.add_argument("--out", type=Path, help="results directory (default: benchmarks/results, "
                        "or a temporary directory with --quick)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "sandlock-bench",
                        help="where srt, multikernel's wheel and matplotlib are installed")
    parser.add_argument("--no-install", action="store_true",
                        help="use only what is already installed")
    parser.add_argument("--only", action="append", choices=STEPS,
                        help="run only this benchmark (repeatable)")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="measure nothing: rewrite the report and plots from a results.json")
    args = parser.parse_args()
    if args.from_json:
        path = report.write(json.loads(args.from_json.read_text()), args.out or args.from_json.parent)
        print(path.read_text())
        return 0
    plan = Plan.make(args.quick)
    out = args.out or (Path(tempfile.gettempdir()) / "sandlock-bench-quick" if args.quick
                       else REPO / "benchmarks" / "results")
    setup = Setup(args.cache, install=not (args.quick or args.no_install))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sandlock-bench-") as tmp:
        ctx = Context(plan, setup, Path(tmp))
        why = setup.matplotlib()
        if why:
            ctx.skip("plots", why)
        try:
            results = run_all(ctx, set(args.only) if args.only else None)
        finally:
            ctx.close()
    results["seconds"] = round(time.perf_counter() - started, 1)
    path = report.write(results, out)
    print(path.read_text())
    print(f"written: {path} ({results['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
