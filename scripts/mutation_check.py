"""Switch each security guard off in a copy of the package and require its tests to fail.

A test that still passes with its guard gone proves nothing (the run may have crashed,
or the attack never ran). For each entry of :data:`scripts.mutation_guards.GUARDS`
this script copies the source tree to a temporary directory, replaces the guard's code
snippet there (it must occur exactly once: the table follows the code), rebuilds the
native helper when the snippet is in its C source, runs only that guard's tests with
the copy on PYTHONPATH, and prints one line:

    killed            the tests failed: they depend on the guard
    SURVIVED          the tests passed without the guard: a test defect
    snippet missing   the code changed: update the table
    error             pytest could not run the tests (collection error, none selected)

First the unmutated tests run once (all guards' tests together) and must pass, else a
"killed" means nothing. Exit status 1 if anything but "killed" was printed.

Run it as root (CI does, after the lint step): the set-id, file-capability and pids
cgroup guards only show as root. ``--only NAME`` (repeatable) checks some guards;
``--list`` prints the table.

    python scripts/mutation_check.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mutation_guards import GUARDS, Guard  # noqa: E402

ROOT = HERE.parent
#: What a copy needs to import sandlock and run its tests.
COPIED = ("sandlock", "tests", "policies", "pyproject.toml", "setup.py", "README.md")
HELPER = Path("sandlock", "exec", "helper", "sandlock-exec")
PYTEST = ("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly")


def copy_tree(source: Path, target: Path) -> None:
    for name in COPIED:
        where = source / name
        if where.is_dir():
            shutil.copytree(where, target / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif where.exists():
            shutil.copy2(where, target / name)
    if not (target / HELPER).exists():
        raise SystemExit(f"mutation check: {source / HELPER} is not built "
                         "(python setup.py build_helper)")


def mutate(tree: Path, guard: Guard) -> str:
    """Apply the guard's replacement in ``tree``: "" when done, else why not."""
    path = tree / guard.file
    text = path.read_text()
    if text.count(guard.snippet) != 1:
        return "snippet missing"
    path.write_text(text.replace(guard.snippet, guard.replacement))
    if guard.file.endswith((".c", ".h")):
        built = subprocess.run([sys.executable, "setup.py", "-q", "build_helper"], cwd=tree,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if built.returncode != 0:
            print(built.stdout[-3000:], file=sys.stderr)
            return "error (the mutated helper does not build)"
    return ""


def pytest(tree: Path, tests: Sequence[str]) -> tuple[int, str]:
    """(pytest's exit status, the first FAILED line of its summary or "")."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, *PYTEST, "-rfE", *tests], cwd=tree, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    if done.returncode != 0 and not failed:
        print(done.stdout[-3000:], file=sys.stderr)
    return done.returncode, failed[0] if failed else ""


def check(guard: Guard, workdir: str) -> str:
    """killed (with the first test that failed), SURVIVED, snippet missing or error."""
    with tempfile.TemporaryDirectory(prefix="sandlock-mutant-", dir=workdir) as tmp:
        tree = Path(tmp)
        os.chmod(tree, 0o755)
        copy_tree(ROOT, tree)
        why = mutate(tree, guard)
        if why:
            return why
        code, failed = pytest(tree, guard.tests)
    if code == 0:
        return "SURVIVED"
    # A failure, not an error (a fixture, an import): the mutant broke the attack's outcome.
    return f"killed: {failed[len('FAILED '):]}" if code == 1 and failed else \
        f"error (pytest exit {code})"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="NAME")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--workdir", default=tempfile.gettempdir(),
                        help="where the copies are made (default: the temporary directory)")
    args = parser.parse_args(argv)
    unknown = set(args.only) - {g.name for g in GUARDS}
    if unknown:
        parser.error(f"no guard named {', '.join(sorted(unknown))}")
    guards = [g for g in GUARDS if not args.only or g.name in args.only]
    if args.list:
        for guard in guards:
            print(f"{guard.name} | {guard.file} | {' '.join(guard.tests)}")
        return 0
    if os.geteuid() != 0:
        print("mutation check: run it as root (set-id, capability and cgroup guards)",
              file=sys.stderr)
    start = time.monotonic()
    everything = list(dict.fromkeys(t for g in guards for t in g.tests))
    code, first = pytest(ROOT, everything)
    print(f"unmutated: {'pass' if code == 0 else f'FAIL (pytest exit {code}) {first}'} "
          f"({time.monotonic() - start:.0f}s)", flush=True)
    if code != 0:
        return 1
    failed = 0
    for guard in guards:
        began = time.monotonic()
        verdict = check(guard, args.workdir)
        killed = verdict.startswith("killed")
        failed += not killed
        outcome, _, detail = verdict.partition(": ")
        print(f"{outcome:<16} {guard.name} ({time.monotonic() - began:.0f}s)"
              + (f"\n{'':<16}   {detail[:150]}" if detail else ""), flush=True)
    print(f"{len(guards) - failed} of {len(guards)} guards killed in "
          f"{time.monotonic() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
