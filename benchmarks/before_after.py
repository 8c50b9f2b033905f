"""Issue 25's rows for an earlier commit and for this checkout, measured in one run.

    python -m benchmarks.before_after [--before REV] [--rounds N] [--calls N] [--starts N]
                                      [--binary-before FILE] [--binary-after FILE] [--json]

Both trees are installed the way a user installs sandlock: ``pip install`` into a venv
of Debian's ``/usr/bin/python3`` under a temporary directory. The earlier one is ``REV``
(default ``BEFORE``, the last commit before the work of issue 25) taken from this
checkout with ``git archive`` (or a directory that holds such a tree); the later one is
this checkout as it is on disk. Each is copied first (pip builds in the tree).

1. **The command line.** Rows interleaved round by round, each ``--calls`` whole
   processes in a row (``native_front.series``: every run must exit 0): each tree's
   installed ``sandlock run`` on a cached policy (the ``base`` profile plus
   ``/bin/true``), each single-file binary given, ``python3 -I -c pass`` (the
   interpreter's floor), bubblewrap, the C floor of ``native_front``, and ``/bin/true``.
   A row of the later tree is measured only once its front end is seen running the hit
   itself.
2. **The Python API.** ``benchmarks/api_series.py`` run by each venv's interpreter on its
   own install, one tree after the other. Its ratios are to ``subprocess.run`` measured in
   the same process in shuffled rounds; the two trees' absolute times are not interleaved
   with each other, so compare their ratios.

Run it as an ordinary user: root's list of state directories (filled by the test suite)
slows root's runs. Nothing is asserted: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from benchmarks import native_front

REPO = Path(__file__).resolve().parent.parent
#: The last commit before the work of issue 25 (its first commit is 905bc22).
BEFORE = "6fba26c"
PYTHON = "/usr/bin/python3"
POLICY = native_front.POLICY


def install(tree: Path, venv: Path) -> Path:
    """A copy of ``tree`` pip-installed into a new venv at ``venv``; its site directory."""
    copy = venv.with_name(venv.name + "-src")
    shutil.copytree(tree, copy, ignore=shutil.ignore_patterns(".git", "build", "dist", "results",
                                                              "__pycache__"))
    subprocess.run([PYTHON, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(copy)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return site


def earlier_tree(rev: str, into: Path) -> Path:
    """``rev`` of this checkout, unpacked at ``into``; ``rev`` itself when it is a directory
    (a tree unpacked already, for a user who cannot read this checkout's git directory)."""
    if Path(rev).is_dir():
        return Path(rev)
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True,
                             check=False)
    if archive.returncode != 0:
        raise SystemExit(f"before_after: git archive {rev}: "
                         f"{archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def command_rows(commands: dict[str, list[str]], tmp: Path, rounds: int, calls: int
                 ) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds of ``calls`` runs in a row, per row; and the rows skipped, with why."""
    true = os.path.realpath("/bin/true")
    policy = tmp / "policy.toml"
    policy.write_text(POLICY.format(true=true))
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("PYTHON", "SANDLOCK_"))}
    rows: dict[str, list[str]] = {}
    envs: dict[str, dict[str, str]] = {}
    skipped: dict[str, str] = {}
    for name, command in commands.items():  # each its own cache
        rows[name] = [*command, "run", "--policy", str(policy), "--", true]
        envs[name] = {**base_env, "XDG_CACHE_HOME": str(tmp / f"cache-{len(envs)}")}
    rows["python3 -I -c pass"] = [PYTHON, "-I", "-c", "pass"]
    bwrap = shutil.which("bwrap")
    if bwrap:
        rows["bwrap"] = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-net", true]
    else:
        skipped["bwrap"] = "not installed (apt-get install bubblewrap)"
    floor = tmp / "floor"
    why = native_front.build_floor(floor)
    if why is None:
        rows["C floor"] = [str(floor), true]
    else:
        skipped["C floor"] = why
    rows["unconfined"] = [true]
    # Warm: the cache entries, the page cache. Twice: a row's first run adds its cache
    # directory to the user's list of state directories, which every native entry
    # witnesses, so the rows warmed before it fall back once more.
    for _ in range(2):
        for name, argv in rows.items():
            native_front.series(argv, envs.get(name, base_env), 2)
    for name in commands:
        if name.startswith("after") and (why := native_front.ran_the_hit(rows[name], envs[name])):
            skipped[name] = why  # it would measure the Python CLI it fell back to
            del rows[name]
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        order = list(rows)
        random.shuffle(order)
        for name in order:
            times[name].append(native_front.series(rows[name], envs.get(name, base_env), calls))
    for name in commands:  # still its own run at the end: none of the rounds measured Python
        if name in rows and name.startswith("after") and (
                why := native_front.ran_the_hit(rows[name], envs[name])):
            skipped[name] = f"fell back during the measure: {why}"
            del times[name]
    return {name: statistics.median(values) for name, values in times.items()}, skipped


def api_rows(venv: Path, site: Path, rounds: int, calls: int, starts: int) -> dict[str, Any]:
    """``api_series.py``'s JSON, run by the venv's interpreter on its own install."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SANDLOCK_"))}
    argv = [str(venv / "bin" / "python"), str(REPO / "benchmarks" / "api_series.py"), "--json",
            "--root", str(site), "--rounds", str(rounds), "--calls", str(calls), "--starts",
            str(starts), "--hits-unchecked"]
    done = subprocess.run(argv, env=env, cwd=venv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-400:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _per_call(seconds: Optional[float], calls: int) -> str:
    return "-" if seconds is None else f"{seconds / calls * 1e3:.2f} ms"


def _ratio(top: Optional[float], bottom: Optional[float]) -> str:
    return "-" if top is None or not bottom else f"{top / bottom:.2f}x"


def table(data: dict[str, Any]) -> list[str]:
    """The markdown rows: before, after, the target."""
    calls, cli = data["calls"], data["cli"]
    series = cli["seconds"]
    floor, bw, bare = (series.get(k) for k in ("python3 -I -c pass", "bwrap", "unconfined"))
    out = [f"Before: {data['before']}; after: this checkout. {calls} calls a series, "
           f"{data['rounds']} rounds.", "",
           "| row | before | after | target |", "|---|---:|---:|---|"]
    for kind, target in (("sandlock run (pip, cached)", "no slower than bwrap"),
                         ("single-file binary", "no slower than bwrap")):
        old, new = series.get(f"before: {kind}"), series.get(f"after: {kind}")
        if old is None and new is None:
            continue
        out.append(f"| {kind}, per call | {_per_call(old, calls)} | {_per_call(new, calls)} | |")
        out.append(f"| {kind} / `python3 -I -c pass` | {_ratio(old, floor)} | "
                   f"{_ratio(new, floor)} | |")
        out.append(f"| {kind} / bwrap | {_ratio(old, bw)} | {_ratio(new, bw)} | ≤ 1x ({target}) |")
        out.append(f"| {calls} calls through {kind} / unconfined | {_ratio(old, bare)} | "
                   f"{_ratio(new, bare)} | ≤ 3x |")
    for name in ("bwrap", "C floor", "python3 -I -c pass", "unconfined"):
        if name in series:
            out.append(f"| {name} (one measure, both) | {_per_call(series[name], calls)} | | |")
    out += [f"| {name} | skipped: {why} | | |" for name, why in cli["skipped"].items()]
    apis = data["api"]
    out += ["", "| API row | before | after | target |", "|---|---:|---:|---|"]

    def api(side: str, row: str, against: str = "subprocess.run", over: bool = False) -> str:
        got = apis[side].get("series", {})
        if row not in got or against not in got:
            return "-" if "error" not in apis[side] else "error"
        top, bottom = got[row]["median"], got[against]["median"]
        return f"{(top - bottom) / calls * 1e3:+.3f} ms" if over else f"{top / bottom:.2f}x"

    def start(side: str) -> str:
        got = apis[side].get("starts", {}).get("file")
        if got is None:
            return "-"
        hits = "" if got["hits"] == apis[side]["starts"]["n"] else \
            f" ({got['hits']} of {apis[side]['starts']['n']} read the cache)"
        return f"{got['both'] * 1e3:.1f} ms{hits}"

    out.append(f"| `Sandbox.run` over `subprocess.run` | {api('before', 'Sandbox.run', over=True)}"
               f" | {api('after', 'Sandbox.run', over=True)} | ≤ +0.3 ms |")
    for row, target in (("Sandbox.run, [network] allow", "≤ 2x `Sandbox.run`"),
                        ("Sandbox.run, trace=True", "≤ 2x `Sandbox.run`"),
                        ("Sandbox.run, [credentials]", "")):
        out.append(f"| {row} / `Sandbox.run` | {api('before', row, 'Sandbox.run')} | "
                   f"{api('after', row, 'Sandbox.run')} | {target} |")
        out.append(f"| {row} / `subprocess.run` | {api('before', row)} | {api('after', row)} | |")
    out.append(f"| `import sandlock` + first `Sandbox()` (a policy file) | {start('before')} | "
               f"{start('after')} | ≤ 30 ms |")
    for side in ("before", "after"):
        if "error" in apis[side]:
            out.append(f"\n{side}: api_series failed: {apis[side]['error']}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE,
                        help=f"the earlier commit, or a directory holding its tree (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--starts", type=int, default=9)
    parser.add_argument("--binary-before", type=Path, help="the earlier tree's dist/sandlock")
    parser.add_argument("--binary-after", type=Path, help="this tree's dist/sandlock")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandlock-before-after-") as name:
        tmp = Path(name)
        sites = {"before": install(earlier_tree(args.before, tmp / "unpacked"), tmp / "before"),
                 "after": install(REPO, tmp / "after")}
        commands = {f"{side}: sandlock run (pip, cached)": [str(tmp / side / "bin" / "sandlock")]
                    for side in sites}
        for side, binary in (("before", args.binary_before), ("after", args.binary_after)):
            if binary is not None:
                commands[f"{side}: single-file binary"] = [str(binary.resolve())]
        seconds, skipped = command_rows(commands, tmp, args.rounds, args.calls)
        api = {side: api_rows(tmp / side, site, args.rounds, args.calls, args.starts)
               for side, site in sites.items()}
    data = {"before": args.before, "calls": args.calls, "rounds": args.rounds,
            "load": os.getloadavg()[0], "cli": {"seconds": seconds, "skipped": skipped},
            "api": api}
    print(json.dumps(data) if args.json else "\n".join(table(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
