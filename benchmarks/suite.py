"""The benchmarks of issue 5, each returning plain data for the report.

1. In-process: confined ``/bin/true`` from a Python caller vs ``subprocess.run``.
2. Whole process: ``sandlock run`` vs /bin/true, bwrap, runsc, srt, multikernel.
3. Scaling: policy paths, caller memory, concurrent callers, a 50-call agent session.
4. Work: CPU-bound and syscall-heavy programs inside vs outside.

Every comparison runs its contenders interleaved (see :mod:`benchmarks.measure`)
and every confined run is checked to exit 0, so a sandbox that refuses the
command can never pass for a fast one.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from . import api_series, native_front
from .contenders import MULTIKERNEL_VERSION, Setup, version_of
from .measure import (
    Batch,
    BenchmarkError,
    Worker,
    command_batch,
    interleave,
    summarize,
    summarize_samples,
    why_command_fails,
)

REPO = Path(__file__).resolve().parent.parent
PYTHON = "/usr/bin/python3"  # the interpreter the built-in `python` profile grants
TRUE = "/bin/true"


@dataclass(frozen=True)
class Plan:
    """How much to measure: the full report, or the quick CI smoke run."""

    quick: bool
    rounds_inprocess: int
    rounds_whole: int
    rounds_scaling: int
    memory_mib: tuple[int, ...]
    path_counts: tuple[int, ...]
    callers: tuple[int, ...]
    rate_window: float
    rate_repeats: int
    session_rounds: int
    work_rounds: int
    cpu_loop: int
    file_count: int
    file_passes: int
    syscall_loop: int
    slow_contenders: bool
    cap: float  #: seconds one slow contender may take in one comparison

    @classmethod
    def make(cls, quick: bool) -> Plan:
        cores = os.cpu_count() or 1
        if quick:
            return cls(True, 10, 6, 5, (0, 256), (1, 10, 100), (1, cores), 0.5, 1, 2, 3,
                       300_000, 300, 2, 100_000, slow_contenders=False, cap=5.0)
        return cls(False, 60, 30, 25, (0, 512, 2048), (1, 10, 100, 1000),
                   tuple(sorted({1, 2, cores, 2 * cores})), 1.5, 3, 11, 10,
                   4_000_000, 2000, 5, 1_000_000, slow_contenders=True, cap=30.0)


@dataclass
class Context:
    plan: Plan
    setup: Setup
    tmp: Path
    skipped: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)

    def skip(self, what: str, why: str) -> None:
        self.skipped[what] = why
        print(f"skip: {what}: {why}", file=sys.stderr, flush=True)

    def worker(self, **config: Any) -> Worker:
        base = {"mode": "ours", "repo": str(REPO), "true_policy": str(self.true_policy)}
        worker = Worker({**base, **config})
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers.clear()

    @property
    def true_policy(self) -> Path:
        return self.tmp / "true.toml"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# Fixtures: policies and files, written once per run into a temporary directory


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def prepare(ctx: Context) -> None:
    """Policies for /bin/true, the path-count series, the session tools and workloads."""
    true_exe = os.path.realpath(TRUE)
    write(ctx.true_policy, f"""\
        version = 1
        description = "base only: /bin/true and what any dynamic program needs"
        extends = ["base"]
        [filesystem]
        exec = ["{true_exe}"]
        """)
    for count in ctx.plan.path_counts:
        dirs = ctx.tmp / f"paths-{count}"
        for index in range(count):
            (dirs / f"d{index}").mkdir(parents=True, exist_ok=True)
        entries = ", ".join(f'"{dirs}/d{i}"' for i in range(count))
        write(ctx.tmp / f"paths-{count}.toml", f"""\
            version = 1
            extends = ["{ctx.true_policy}"]
            [filesystem]
            read = [{entries}]
            """)
    workspace = ctx.tmp / "workspace"
    for index in range(20):
        lines = "".join(f"line {n} of file {index}{' needle' if n % 7 == 0 else ''}\n"
                        for n in range(200))
        write(workspace / f"notes{index:02d}.txt", lines)
    for tool in ("cat", "ls", "grep", "wc", "head"):
        write(ctx.tmp / "tools" / f"{tool}.toml", f"""\
            version = 1
            description = "{tool} in the workspace"
            extends = ["base"]
            [filesystem]
            read = ["${{workspace}}"]
            exec = ["{shutil.which(tool) or '/usr/bin/' + tool}"]
            """)
    write(ctx.tmp / "tools" / "python.toml", """\
        version = 1
        description = "python3 reading the workspace"
        extends = ["python"]
        [filesystem]
        read = ["${workspace}"]
        """)
    small = ctx.tmp / "small-files"
    small.mkdir(exist_ok=True)
    for index in range(ctx.plan.file_count):
        (small / f"f{index:05d}").write_bytes(b"x" * 512)


# ----------------------------------------------------------------------------
# 1. In-process


def inprocess(ctx: Context, mk_dir: Optional[Path]) -> dict[str, Any]:
    """Confined /bin/true from a Python caller, against subprocess.run in the same process."""
    ours = ctx.worker()
    contenders: dict[str, Batch] = {
        "subprocess.run": ours.batch("plain"),
        "launcher, compiled once": ours.batch("launcher"),
        "launcher, load+compile per call": ours.batch("launcher_percall"),
    }
    api = ctx.worker(api=True)
    if api.ops["api"]:
        ctx.skip("in-process: sandlock.api", api.ops["api"])
    else:
        # Its baseline in the same process (the "from the same process").
        contenders["api: subprocess.run"] = api.batch("plain")
        contenders["api Sandbox.run"] = api.batch("api")
        ctx.versions["sandlock.api command path"] = api.info.get("api_path", "?")
        if api.info.get("api_path") == "sandlock-exec":
            forkserver = ctx.worker(api=True, native=False)
            contenders["api Sandbox.run, fork server (SANDLOCK_NATIVE=0)"] = forkserver.batch("api")
    if mk_dir is not None:
        try:
            mk = Worker({"mode": "multikernel", "mk_dir": str(mk_dir),
                         "mk_readable": multikernel_readable()}, flags=("-I", "-S"))
            ctx.workers.append(mk)
            contenders["multikernel: subprocess.run"] = mk.batch("plain")
            contenders[f"multikernel {MULTIKERNEL_VERSION}: Sandbox.run"] = mk.batch("mk")
        except BenchmarkError as exc:
            ctx.skip("in-process: multikernel", str(exc))
    if ours.ops["launcher_stamps"]:
        ctx.skip("fork-to-exec inside the child", ours.ops["launcher_stamps"])
    else:
        contenders["launcher, child timed (TIMING_FD)"] = ours.batch("launcher_stamps")
    samples = interleave(contenders, ctx.plan.rounds_inprocess, skipped=ctx.skipped)
    return {name: summarize_samples(s) for name, s in samples.items()}


def multikernel_readable() -> list[str]:
    """What our ``base`` profile grants /bin/true, in multikernel's terms."""
    wanted = ["/usr/lib", "/lib64", "/etc/ld.so.cache", os.path.realpath(TRUE)]
    return [p for p in wanted if os.path.exists(p)]


# ----------------------------------------------------------------------------
# 2. Whole process


def whole_process(ctx: Context, mk_dir: Optional[Path]) -> dict[str, Any]:
    setup, plan = ctx.setup, ctx.plan
    true_policy = str(ctx.true_policy)
    commands: dict[str, list[str]] = {
        "/bin/true": [TRUE],
        "python -c pass": [sys.executable, "-c", "pass"],
    }
    pip_cli = Path(sys.executable).parent / "sandlock"
    found = str(pip_cli) if pip_cli.exists() else shutil.which("sandlock")
    if found:
        commands["sandlock run (pip)"] = [found, "run", "--policy", true_policy, "--", TRUE]
    else:
        ctx.skip("sandlock run (pip)", "no `sandlock` command beside this Python or on PATH")
    binary = REPO / "dist" / "sandlock"
    if binary.exists():
        commands["sandlock run (dist/sandlock)"] = [str(binary), "run", "--policy", true_policy,
                                                    "--", TRUE]
    else:
        ctx.skip("sandlock run (dist/sandlock)", "dist/sandlock not built (scripts/build_binary.sh)")
    bwrap, why = setup.binary("bwrap")
    if bwrap:
        commands["bwrap"] = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-net", TRUE]
        ctx.versions["bubblewrap"] = version_of([bwrap, "--version"])
    else:
        ctx.skip("bwrap", why)
    if plan.slow_contenders:
        runsc, why = setup.binary("runsc")
        if runsc:
            commands["runsc (gVisor)"] = [runsc, "--rootless", "--network=none", "do", TRUE]
            ctx.versions["runsc"] = version_of([runsc, "--version"])
        else:
            ctx.skip("runsc", why)
        srt, why = setup.srt()
        if srt:
            commands["srt"] = [*srt, TRUE]
            ctx.versions["srt"] = setup.srt_version()
        else:
            ctx.skip("srt", why)
    else:
        ctx.skip("runsc, srt", "quick mode leaves out the slow contenders")
    if mk_dir is not None:
        code = (f"import sys; sys.path.insert(0, {str(mk_dir)!r}); import sandlock; "
                f"r = sandlock.Sandbox(fs_readable={multikernel_readable()!r}).run([{TRUE!r}]); "
                "sys.exit(0 if r.success else 1)")
        commands[f"multikernel {MULTIKERNEL_VERSION} (python -c)"] = [sys.executable, "-I", "-S",
                                                                    "-c", code]
    contenders: dict[str, Batch] = {}
    for name, argv in commands.items():
        why_not = why_command_fails(argv)
        if why_not:
            ctx.skip(name, why_not)
        else:
            contenders[name] = command_batch(argv)
    samples = interleave(contenders, plan.rounds_whole, budget=0.05, skipped=ctx.skipped)
    return {name: summarize_samples(s) for name, s in samples.items()}


# ----------------------------------------------------------------------------
# 3. Scaling


def paths(ctx: Context) -> dict[str, Any]:
    """Per-call cost (load + compile + run) as the policy grants 1..1000 directories."""
    worker = ctx.worker()
    contenders: dict[str, Batch] = {"subprocess.run": worker.batch("plain")}
    for count in ctx.plan.path_counts:
        contenders[str(count)] = worker.batch("paths", {"policy": str(ctx.tmp / f"paths-{count}.toml")})
    samples = interleave(contenders, ctx.plan.rounds_scaling, cap=ctx.plan.cap,
                         skipped=ctx.skipped)
    return {name: summarize_samples(s) for name, s in samples.items()}


def memory(ctx: Context) -> dict[str, Any]:
    """Confined /bin/true from callers holding 0 .. 2 GiB of touched memory."""
    contenders: dict[str, Batch] = {}
    for mib in ctx.plan.memory_mib:
        progress(f"memory: starting a caller holding {mib} MiB")
        worker = ctx.worker(hold_mib=mib)
        contenders[f"{mib}:subprocess.run"] = worker.batch("plain")
        contenders[f"{mib}:launcher"] = worker.batch("launcher")
        api = ctx.worker(hold_mib=mib, api=True)
        if not api.ops["api"]:
            contenders[f"{mib}:api"] = api.batch("api")
    samples = interleave(contenders, ctx.plan.rounds_scaling, skipped=ctx.skipped)
    out: dict[str, Any] = {}
    for name, s in samples.items():
        size, mode = name.split(":", 1)
        out.setdefault(size, {})[mode] = summarize_samples(s)
    return out


def concurrency(ctx: Context) -> dict[str, Any]:
    """Sandboxes per second with 1..N callers running back to back, vs unconfined.

    Callers are processes (one worker each); the API is also measured with N
    threads of one process, since it claims to be thread-safe.
    """
    plan = ctx.plan
    workers = [ctx.worker() for _ in range(max(plan.callers))]
    api_workers = [ctx.worker(api=True) for _ in range(max(plan.callers))]
    variants = ["plain", "launcher"]
    if api_workers[0].ops["api"]:
        ctx.skip("concurrency via sandlock.api", api_workers[0].ops["api"])
    else:
        variants += ["api", "api threads"]
    rates: dict[str, dict[str, list[float]]] = {}
    for repeat in range(plan.rate_repeats):
        for callers in plan.callers:
            for variant in variants if repeat % 2 == 0 else variants[::-1]:
                start = time.monotonic() + 0.05
                mode, _, threads = variant.partition(" ")
                arg = {"mode": mode, "start": start, "end": start + plan.rate_window,
                       "threads": callers if threads else 1}
                pool = api_workers if mode == "api" else workers
                used = pool[:1] if threads else pool[:callers]
                for worker in used:
                    worker.send("rate", 1, arg)
                results, failures = [], []
                for worker in used:  # every answer is read, to stay in step
                    try:
                        results.append(worker.receive()[0])
                    except BenchmarkError as exc:
                        failures.append(str(exc))
                if failures:
                    ctx.skip(f"concurrency {variant}", failures[0])
                    continue
                total = sum(r["count"] for r in results) / max(r["total"] for r in results)
                rates.setdefault(str(callers), {}).setdefault(variant, []).append(total)
    return {callers: {mode: summarize(values).as_dict() for mode, values in by_mode.items()}
            for callers, by_mode in rates.items()}


def session_calls(ctx: Context) -> list[dict[str, Any]]:
    """50 tool calls of an agent, each under the policy of its own tool."""
    workspace = str(ctx.tmp / "workspace")
    variables = {"workspace": workspace}
    tools = ctx.tmp / "tools"
    code = ("import pathlib, sys; "
            "print(sum(len(p.read_text()) for p in pathlib.Path(sys.argv[1]).iterdir()))")
    cycle = [
        ("cat", ["cat", f"{workspace}/notes{{i:02d}}.txt"]),
        ("ls", ["ls", "-la", workspace]),
        ("grep", ["grep", "-rn", "needle", workspace]),
        ("python", [PYTHON, "-c", code, workspace]),
        ("head", ["head", "-n", "50", f"{workspace}/notes{{i:02d}}.txt"]),
        ("wc", ["wc", "-l", f"{workspace}/notes{{i:02d}}.txt"]),
        ("cat", ["cat", f"{workspace}/notes{{i:02d}}.txt"]),
    ]
    calls = []
    for index in range(50):
        tool, argv = cycle[index % len(cycle)]
        calls.append({"tool": tool, "policy": str(tools / f"{tool}.toml"), "vars": variables,
                      "argv": [a.format(i=index % 20) for a in argv]})
    return calls


def session(ctx: Context) -> dict[str, Any]:
    worker = ctx.worker()
    calls = session_calls(ctx)
    contenders: dict[str, Batch] = {
        "unconfined (subprocess.run)": worker.batch("session", {"mode": "plain", "calls": calls}),
        "launcher, policy loaded per call": worker.batch("session", {"mode": "launcher",
                                                                    "calls": calls}),
    }
    api = ctx.worker(api=True)
    if api.ops["session_api"]:
        ctx.skip("session via sandlock.api", api.ops["session_api"])
    else:
        contenders["api, Sandbox per call"] = api.batch("session_api", {"mode": "per call",
                                                                       "calls": calls})
        tools = str(ctx.tmp / "tools")
        contenders["api, Registry made at session start"] = api.batch(
            "session_api", {"mode": "registry", "calls": calls, "tools": tools})
        contenders["api, Registry already warm"] = api.batch(
            "session_api", {"mode": "warm", "calls": calls, "tools": tools})
    samples = interleave(contenders, ctx.plan.session_rounds, budget=0.0, skipped=ctx.skipped)
    return {name: summarize_samples(s) for name, s in samples.items()}


# ----------------------------------------------------------------------------
# 4. Work inside the sandbox


def workloads(ctx: Context) -> dict[str, Any]:
    plan = ctx.plan
    small = ctx.tmp / "small-files"
    programs = {
        f"CPU: Python loop of {plan.cpu_loop:,} additions":
            f"x = 0\nfor i in range({plan.cpu_loop}):\n    x += i * i",
        f"files: {plan.file_passes} x read {plan.file_count:,} files of 512 B":
            (f"import os\nd = {str(small)!r}\nnames = os.listdir(d)\n"
             f"for _ in range({plan.file_passes}):\n"
             "    for n in names:\n        with open(os.path.join(d, n), 'rb') as f: f.read()"),
        f"syscalls: {plan.syscall_loop:,} x getppid()":
            f"import os\nfor _ in range({plan.syscall_loop}): os.getppid()",
    }
    worker = ctx.worker()
    policy = str(ctx.tmp / "tools" / "python.toml")
    contenders: dict[str, Batch] = {}
    for name, code in programs.items():
        argv = [PYTHON, "-c", code]
        base = {"argv": argv, "policy": policy, "vars": {"workspace": str(small)}}
        contenders[f"{name}|unconfined"] = worker.batch("workload", {**base, "mode": "plain"})
        contenders[f"{name}|confined"] = worker.batch("workload", {**base, "mode": "launcher"})
    samples = interleave(contenders, plan.work_rounds, budget=0.0, skipped=ctx.skipped)
    out: dict[str, Any] = {}
    for key, s in samples.items():
        name, mode = key.split("|")
        out.setdefault(name, {})[mode] = summarize_samples(s)
    return out


# ----------------------------------------------------------------------------


def machine(ctx: Context) -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    sys.path.insert(0, str(REPO))
    from sandlock.compile import compiler
    from sandlock.linux import kernel
    from sandlock.policy import model as policy

    try:  # the filter every syscall of the workloads runs through
        tool = policy.load_policy(ctx.tmp / "tools" / "python.toml", {"workspace": str(ctx.tmp)})
        with compiler.compile_policy(tool) as compiled:
            instructions: Any = len(compiled.bpf) // 8  # struct sock_filter is 8 bytes
    except Exception as exc:  # noqa: BLE001 - context for the report, not a measurement
        instructions = f"? ({exc})"
    return {"cpu": cpu, "seccomp_instructions": instructions, "cores": os.cpu_count(),
            "kernel": platform.release(),
            "landlock_abi": kernel.landlock_abi(), "python": platform.python_version(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_start": round(os.getloadavg()[0], 2),
            "user": "root" if os.geteuid() == 0 else "unprivileged"}


def run_all(ctx: Context, only: Optional[set[str]] = None) -> dict[str, Any]:
    """Every benchmark in order; each failure becomes a skip with its reason."""
    prepare(ctx)
    mk_dir, why = ctx.setup.multikernel()
    if mk_dir is None:
        ctx.skip("multikernel sandlock", why)
    results: dict[str, Any] = {"machine": machine(ctx), "mode": "quick" if ctx.plan.quick else "full"}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("inprocess", lambda: inprocess(ctx, mk_dir)),
        ("whole", lambda: whole_process(ctx, mk_dir)),
        ("paths", lambda: paths(ctx)),
        ("memory", lambda: memory(ctx)),
        ("concurrency", lambda: concurrency(ctx)),
        ("session", lambda: session(ctx)),
        ("workloads", lambda: workloads(ctx)),
        ("api", lambda: api_series.step(*((2, 20, 3) if ctx.plan.quick else (15, 50, 15)))),
        ("cli", lambda: native_front.step(*((2, 10) if ctx.plan.quick else (7, 50)))),
    ]
    for name, step in steps:
        if only and name not in only:
            continue
        progress(f"benchmark: {name}")
        t0 = time.perf_counter()
        try:
            results[name] = step()
        except BenchmarkError as exc:
            ctx.skip(name, str(exc))
        finally:
            ctx.close()
        progress(f"benchmark: {name} took {time.perf_counter() - t0:.1f} s")
    results["machine"]["load_end"] = round(os.getloadavg()[0], 2)
    results["skipped"] = dict(ctx.skipped)
    results["versions"] = dict(ctx.versions)
    return results
