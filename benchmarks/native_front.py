"""50 calls in series of a confined `/bin/true`, as ratios against baselines of the same run.

    python benchmarks/native_front.py [--calls N] [--rounds N] [--json]

Rows (each skipped with a printed reason when unavailable), every one a whole process
from spawn to reaped exit, 50 in a row, the rows interleaved round by round:

- ``native CLI``: the front end ``sandlock/exec/helper/sandlock-run`` with
  ``SANDLOCK_NATIVE_RUN=1`` on a cached policy: it verifies the entry, re-checks it,
  builds the ruleset and runs the tool itself (docs/design.md "Native front end"); the row
  is measured only once its debug line shows that it ran the hit itself;
- ``sandlock command``: the installed ``sandlock`` beside this interpreter (the same front
  end, built with no path in it: it learns its Python CLI's from a record), measured only
  once it runs the hit itself;
- ``single-file binary``: ``dist/sandlock`` (or ``SANDLOCK_BINARY``), whose stub runs the
  same front end once it has checked its unpack, measured only once it runs the hit itself;
- ``Python CLI``: ``python -m sandlock run`` on the same cached policy;
- ``bwrap``: ``bwrap --ro-bind / / --dev /dev --unshare-net /bin/true`` (bubblewrap);
- ``C floor``: a small C program compiled here, the least any such tool does: fork, a
  Landlock ruleset with one rule, no_new_privs, a one-instruction seccomp filter, exec,
  wait;
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
from typing import Any, Optional

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


FLOOR = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv);
int main(int argc, char **argv) {
    if (argc < 2)
        return 2;
    pid_t pid = fork();
    if (pid == 0) {
        struct { uint64_t fs, net, scoped; } attr = {0x1fff, 0, 0}; /* ABI 1's rights */
        int ruleset = (int)syscall(444, &attr, sizeof attr, 0U);
        struct { uint64_t allowed; int32_t fd; } __attribute__((packed)) rule = {
            1 | 4 | 8, open("/", O_PATH | O_CLOEXEC)}; /* execute, read file, read dir */
        struct { uint16_t code; uint8_t jt, jf; uint32_t k; } allow = {0x06, 0, 0, 0x7fff0000U};
        struct { unsigned short len; void *filter; } prog = {1, &allow};
        if (ruleset < 0 || syscall(445, ruleset, 1, &rule, 0U) < 0 ||
            prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 || syscall(446, ruleset, 0U) < 0 ||
            syscall(SYS_seccomp, 1, 0U, &prog) < 0)
            _exit(125);
        execv(argv[1], argv + 1);
        _exit(127);
    }
    int status;
    if (pid < 0 || waitpid(pid, &status, 0) < 0)
        return 125;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
"""


def build_floor(out: Path) -> Optional[str]:
    """The C floor's program; the reason when it cannot be built."""
    import subprocess

    source = out.with_suffix(".c")
    source.write_text(FLOOR)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler"
    built = subprocess.run([cc, "-O2", "-o", str(out), str(source)], capture_output=True,
                           text=True, check=False)
    return None if built.returncode == 0 else built.stderr.strip()[-300:] or "cc failed"


def ran_the_hit(argv: list[str], env: dict[str, str]) -> Optional[str]:
    """None when the front end ran the hit itself (its debug line says so); else why the
    row would not measure the native run."""
    import subprocess

    done = subprocess.run(argv, env={**env, "SANDLOCK_NATIVE_DEBUG": "1"}, capture_output=True,
                          text=True, timeout=60, check=False)
    notes = [line for line in done.stderr.splitlines() if line.startswith("sandlock-run: ")]
    ran = "sandlock-run: hit: running it" in notes and not any(
        line.startswith("sandlock-run: fallback: ") for line in notes)
    return None if ran else f"the front end did not run the hit itself: {notes[-1:]}"


#: The target of issue 25 for the command line: the series at most this many times the
#: unconfined one.
SERIES_LIMIT = 3.0


def step(rounds: int, calls: int) -> dict[str, Any]:
    """The ``cli`` step of ``python -m benchmarks``: this module in a fresh process."""
    import subprocess

    done = subprocess.run([sys.executable, str(Path(__file__)), "--json", "--rounds",
                           str(rounds), "--calls", str(calls)], cwd=REPO, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        from benchmarks.measure import BenchmarkError

        raise BenchmarkError(f"benchmarks/native_front.py exited {done.returncode}: "
                             f"{done.stderr.strip()[-400:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def table(data: dict[str, Any]) -> list[str]:
    """The report's lines for this step's results (empty when it did not run)."""
    seconds, calls = data.get("seconds"), data.get("calls", 50)
    if not seconds or "unconfined" not in seconds:
        return []
    base, bw = seconds["unconfined"], seconds.get("bwrap")
    out = [f"**Command line: {calls} calls of `/bin/true` in series** (whole processes, "
           "rows interleaved; `benchmarks/native_front.py`)", "",
           "| row | per call | x unconfined | x bwrap |", "|---|---|---|---|"]
    for name, value in seconds.items():
        out.append(f"| {name} | {value / calls * 1e3:.2f} ms | {value / base:.2f}x | "
                   f"{f'{value / bw:.2f}x' if bw else '-'} |")
    out += [f"| {name} | skipped: {why} | | |" for name, why in data.get("skipped", {}).items()]
    native = seconds.get("native CLI")
    if native is not None:
        ratio = native / base
        out += ["", f"Target (issue 25): the native CLI's series ≤ {SERIES_LIMIT:g}x the unconfined "
                f"one: {ratio:.2f}x, {'met' if ratio <= SERIES_LIMIT else 'missed'}; ≤ bwrap: "
                f"{'met' if bw and native <= bw else 'missed' if bw else 'not measured'}."]
    return out + [""]


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
        # No interpreter variable (PYTHONPATH...): with one the front end hands every run
        # to Python (the import path it protects would not be the one its entry saw).
        env = {k: v for k, v in os.environ.items()
               if k != "SANDLOCK_NO_CACHE" and not k.startswith("PYTHON")}
        env.update({"XDG_CACHE_HOME": str(Path(tmp) / "cache"), "SANDLOCK_NATIVE_RUN": "1"})
        python_env = {**env, "PYTHONPATH": str(REPO)}  # the package here, for `python -m`
        run_args = ["run", "--policy", str(policy), "--", true]
        rows: dict[str, list[str]] = {}
        if FRONT.exists():
            rows["native CLI"] = [str(FRONT), *run_args]
        else:
            skipped["native CLI"] = f"{FRONT} is not built"
        command = Path(sys.executable).parent / "sandlock"
        if command.exists() and command.read_bytes()[:4] == b"\x7fELF":
            rows["sandlock command"] = [str(command), *run_args]
        else:
            skipped["sandlock command"] = f"{command} is not the native command"
        binary = Path(os.environ.get("SANDLOCK_BINARY") or REPO / "dist" / "sandlock")
        if binary.is_file():
            rows["single-file binary"] = [str(binary), *run_args]
        else:
            skipped["single-file binary"] = f"{binary} is not built (scripts/build_binary.sh)"
        rows["Python CLI"] = [sys.executable, "-m", "sandlock", *run_args]
        bwrap = shutil.which("bwrap")
        if bwrap:
            rows["bwrap"] = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-net", true]
        else:
            skipped["bwrap"] = "not installed (apt-get install bubblewrap)"
        floor = Path(tmp) / "floor"
        why = build_floor(floor)
        if why is None:
            rows["C floor"] = [str(floor), true]
        else:
            skipped["C floor"] = why
        rows["unconfined"] = [true]
        envs = {name: python_env if name == "Python CLI" else env for name in rows}
        for name, argv in rows.items():  # warm: the cache entry, the page cache
            series(argv, envs[name], 2)
        for name in ("native CLI", "sandlock command", "single-file binary"):  # one that fell
            # back would measure Python
            why = ran_the_hit(rows[name], env) if name in rows else None
            if why is not None:
                skipped[name] = why
                del rows[name]
        times: dict[str, list[float]] = {name: [] for name in rows}
        names = list(rows)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                times[name].append(series(rows[name], envs[name], args.calls))
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {"calls": args.calls, "rounds": args.rounds, "seconds": median, "skipped": skipped}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.calls} calls in series, median of {args.rounds} rounds (interleaved)")
    base, bw = median["unconfined"], median.get("bwrap")
    for name, seconds in median.items():
        vs_bwrap = f"{seconds / bw:6.2f}x bwrap" if bw else ""
        print(f"  {name:<18} {seconds:7.3f} s  {seconds / args.calls * 1000:7.2f} ms/call  "
              f"{seconds / base:7.1f}x unconfined  {vs_bwrap}")
    for name, why in skipped.items():
        print(f"  {name:<18} skipped: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
