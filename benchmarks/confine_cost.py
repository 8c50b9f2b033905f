"""What the kernel's confinement itself costs a call: the floor under `Sandbox.run` and
`sandlock run`, as ratios against an unconfined start measured in the same run.

    python -m benchmarks.confine_cost [--runs 1000] [--rounds 5] [--profile python] [--json]

A small C program compiled here starts ``/bin/true`` ``--runs`` times (vfork, then exec,
then wait), each row adding one step in the child before its exec, rows interleaved round
by round, medians:

- ``vfork + exec``: the unconfined start;
- ``+ setsid, no_new_privs``;
- ``+ Landlock``: a ruleset of the profile's paths (and what ``/bin/true`` needs), each
  readable and executable, restricted (``landlock_restrict_self``);
- ``+ a 1-instruction filter``: seccomp's own cost;
- ``+ the profile's filter``: the BPF sandlock compiles for the profile (its instruction
  count is printed), the row's difference with the one above being what its length costs.

The profile's filter is read from the compiler (``compile.seccomp.plan`` and ``bpf_for``), so
a change to the plan shows here. Nothing is asserted (tests/ holds no timed assertion).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent

PROGRAM = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
struct insn { uint16_t code; uint8_t jt, jf; uint32_t k; };
static struct insn filter[4096];
int main(int argc, char **argv);
int main(int argc, char **argv) {
    if (argc < 5)
        return 2;
    int mode = atoi(argv[1]), runs = atoi(argv[2]);
    FILE *in = fopen(argv[3], "rb");
    size_t n = in ? fread(filter, sizeof *filter, 4096, in) : 0;
    if (in)
        fclose(in);
    struct insn allow = {0x06, 0, 0, 0x7fff0000U};
    struct { unsigned short len; void *filter; } one = {1, &allow}, prog = {(unsigned short)n, filter};
    struct { uint64_t fs, net, scoped; } attr = {0x1fff, 0, 0}; /* ABI 1's rights */
    int ruleset = (int)syscall(444, &attr, sizeof attr, 0U);
    for (int i = 4; i < argc; i++) {
        struct { uint64_t allowed; int32_t fd; } __attribute__((packed)) rule = {
            1 | 4 | 8, open(argv[i], O_PATH | O_CLOEXEC)};
        if (rule.fd >= 0)
            syscall(445, ruleset, 1, &rule, 0U);
    }
    char *args[] = {"/bin/true", NULL}, *env[] = {NULL};
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < runs; i++) {
        pid_t pid = vfork();
        if (pid == 0) {
            if (mode >= 1 && (setsid() < 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0))
                _exit(121);
            if (mode >= 2 && syscall(446, ruleset, 0U) < 0)
                _exit(122);
            if (mode >= 3 && syscall(SYS_seccomp, 1, 0U, mode >= 4 ? (void *)&prog : (void *)&one) < 0)
                _exit(123);
            execve(args[0], args, env);
            _exit(127);
        }
        int status;
        if (pid < 0 || waitpid(pid, &status, 0) < 0 || status != 0)
            return 3;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.3f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / runs / 1e3);
    return 0;
}
"""
ROWS = ("vfork + exec", "+ setsid, no_new_privs", "+ Landlock", "+ a 1-instruction filter",
        "+ the profile's filter")


def build(out: Path) -> Optional[str]:
    """The program; the reason when it cannot be built."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler"
    source = out.with_suffix(".c")
    source.write_text(PROGRAM)
    built = subprocess.run([cc, "-O2", "-o", str(out), str(source)], capture_output=True,
                           text=True, check=False)
    return None if built.returncode == 0 else built.stderr.strip()[-300:] or "cc failed"


def profile_parts(name: str) -> tuple[bytes, list[str]]:
    """The profile's seccomp program and the paths it grants read on (existing ones)."""
    sys.path.insert(0, str(REPO))
    from sandlock.compile import seccomp
    from sandlock.policy.model import load_profile

    policy = load_profile(name)
    reads = [rule.path for rule in policy.paths if Path(rule.path).exists()]
    return seccomp.bpf_for(seccomp.plan(policy)), [*reads, *(p for p in START if Path(p).exists())]


#: What /bin/true needs to start, granted beside the profile's paths.
START = ("/usr", "/bin", "/lib", "/lib64", "/etc")


def measure(runs: int, rounds: int, profile: str) -> dict[str, Any]:
    bpf, reads = profile_parts(profile)
    with tempfile.TemporaryDirectory(prefix="sandlock-confine-cost-") as tmp:
        program, filter_file = Path(tmp) / "confine", Path(tmp) / "filter.bpf"
        why = build(program)
        if why is not None:
            return {"skipped": why}
        filter_file.write_bytes(bpf)
        samples: dict[str, list[float]] = {row: [] for row in ROWS}
        for _ in range(rounds):
            for mode, row in enumerate(ROWS):
                done = subprocess.run([str(program), str(mode), str(runs), str(filter_file),
                                       *reads], capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    return {"skipped": f"{row}: exit {done.returncode} {done.stderr.strip()}"}
                samples[row].append(float(done.stdout))
    return {"profile": profile, "instructions": len(bpf) // 8, "grants": len(reads),
            "us": {row: statistics.median(values) for row, values in samples.items()}}


def table(data: dict[str, Any]) -> list[str]:
    if "us" not in data:
        return [f"skipped: {data.get('skipped')}"]
    base = data["us"][ROWS[0]]
    out = [f"Profile {data['profile']!r}: a filter of {data['instructions']} instructions, "
           f"{data['grants']} read grants; per start of /bin/true", "",
           "| row | per start | over the unconfined start | x unconfined |", "|---|---:|---:|---:|"]
    for row, value in data["us"].items():
        out.append(f"| {row} | {value:.1f} us | +{value - base:.1f} us | {value / base:.2f}x |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", default="python")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    data = measure(args.runs, args.rounds, args.profile)
    print(json.dumps(data) if args.json else "\n".join(table(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
