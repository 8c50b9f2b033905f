"""Turn measured results into a markdown report (ratios first) and PNG plots.

Ratios are always against a baseline measured in the same run and the same
process: ``subprocess.run`` for in-process calls, ``/bin/true`` for whole
processes, the unconfined run for sessions, workloads and throughput.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from . import api_series, native_front

Stats = dict[str, dict[str, float]]


def ms(seconds: float) -> str:
    value = seconds * 1000
    if value < 1:
        return f"{value:.3f} ms"
    if value < 100:
        return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"
    if value < 10_000:
        return f"{value:.0f} ms"
    return f"{seconds:.1f} s"


def spread(stats: Stats, key: str = "total") -> str:
    return f"{ms(stats[key]['p10'])} – {ms(stats[key]['p90'])}"


def median(stats: Stats, key: str = "total") -> float:
    return stats[key]["median"]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


# ----------------------------------------------------------------------------
# Targets of issue 5


def confined_mode(stats: dict[str, Any], api: str, launcher: str) -> tuple[Optional[str], str]:
    """The public API's figures when it was measured, else the launcher's (said so)."""
    if api in stats:
        return api, "API"
    if launcher in stats:
        return launcher, "launcher (no API measured)"
    return None, ""


def verdict(value: float, limit: float, unit: str = "x") -> str:
    if value <= limit:
        return "**met**"
    if unit == "x":
        return f"**missed** by {(value / limit - 1) * 100:.0f}% of the limit"
    return f"**missed** by {ms(value - limit)}"


def baseline(inproc: dict[str, Any], name: str) -> Any:
    """The ``subprocess.run`` samples taken in the same worker process as ``name``'s."""
    own = ("multikernel: subprocess.run" if name.startswith("multikernel")
           else "api: subprocess.run" if name.startswith("api") else "")
    return inproc.get(own) or inproc.get("subprocess.run")


def targets(results: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    inproc, whole = results.get("inprocess", {}), results.get("whole", {})
    name, what = confined_mode(inproc, "api Sandbox.run", "launcher, compiled once")
    if name and baseline(inproc, name):
        overhead = median(inproc[name]) - median(baseline(inproc, name))
        if "bwrap" in whole and "/bin/true" in whole:
            bwrap = median(whole["bwrap"]) - median(whole["/bin/true"])
            rows.append([f"in-process overhead ({what}) / bwrap's overhead over /bin/true",
                         f"{ms(overhead)} / {ms(bwrap)} = {overhead / bwrap:.2f}x", "≤ 0.25x",
                         verdict(overhead / bwrap, 0.25)])
        rows.append([f"in-process overhead ({what}) over subprocess.run", ms(overhead), "< 1 ms",
                     verdict(overhead, 0.001, "s")])
    mem = results.get("memory", {})
    if mem:
        biggest = max(mem, key=int)
        name, what = confined_mode(mem[biggest], "api", "launcher")
        if name and "subprocess.run" in mem[biggest]:
            overhead = median(mem[biggest][name]) - median(mem[biggest]["subprocess.run"])
            rows.append([f"same, caller holding {int(biggest) / 1024:g} GiB ({what})", ms(overhead),
                         "≤ 1 ms" if int(biggest) >= 2048 else "≤ 1 ms (at 2 GiB; quick run)",
                         verdict(overhead, 0.001, "s")])
    ses = results.get("session", {})
    base = ses.get("unconfined (subprocess.run)")
    modes = [m for m in ("api, Registry already warm", "api, Registry made at session start",
                         "api, Sandbox per call")
             if m in ses] or [m for m in ("launcher, policy loaded per call",) if m in ses]
    for name in modes if base else []:
        ratio = median(ses[name]) / median(base)
        rows.append([f"50-call agent session ({name}) / unconfined",
                     f"{ms(median(ses[name]))} / {ms(median(base))} = {ratio:.2f}x", "≤ 1.1x",
                     verdict(ratio, 1.1)])
    conc = results.get("concurrency", {})
    if conc:
        name, what = confined_mode(next(iter(conc.values())), "api", "launcher")

        def peak(mode: str) -> tuple[float, str]:
            """The best rate over all caller counts: what the machine can do with that mode."""
            return max((v[mode]["median"], n) for n, v in conc.items() if mode in v)

        if name and all("plain" in v for v in conc.values()):
            (confined, at), (plain, plain_at) = peak(name), peak("plain")
            ratio = confined / plain
            rows.append([f"confined /bin/true per second on all cores ({what}) / unconfined, "
                         "best of 1..N callers each",
                         (f"{confined:.0f}/s ({at} callers) / {plain:.0f}/s ({plain_at}) "
                          f"= {ratio:.2f}x"), "≥ 0.5x",
                         "**met**" if ratio >= 0.5 else
                         f"**missed** by {(1 - ratio / 0.5) * 100:.0f}% of the floor"])
    for work, modes in results.get("workloads", {}).items():
        if {"confined", "unconfined"} <= modes.keys():
            ratio = median(modes["confined"]) / median(modes["unconfined"])
            rows.append([f"workload {work.split(':')[0]}: confined / unconfined", f"{ratio:.3f}x",
                         "≤ 1.05x", verdict(ratio, 1.05)])
    return rows


# ----------------------------------------------------------------------------


def markdown(results: dict[str, Any], plots: list[str]) -> str:
    m = results["machine"]
    out = [(f"Measured {m['date']} on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
            f"Linux {m['kernel']} (Landlock ABI {m['landlock_abi']}), Python {m['python']}, "
            f"as {m['user']}; {results['mode']} run (`python -m benchmarks"
            f"{' --quick' if results['mode'] == 'quick' else ''}`). Medians; spread is p10 – p90."
            f"{load_note(m)}"), ""]
    rows = targets(results)
    if rows:
        out += ["**Targets of issue 5** (ratios within this run)", ""]
        out += table(["target", "measured", "limit", "verdict"], rows)

    inproc = results.get("inprocess", {})
    if inproc:
        out += [("**In-process: `/bin/true` confined from a Python caller** "
                 "(baseline `subprocess.run` in the same process)"), ""]
        rows = []
        for name, stats in inproc.items():
            base = baseline(inproc, name)
            ratio = f"{median(stats) / median(base):.2f}x" if base else ""
            over = ms(median(stats) - median(base)) if base and base is not stats else "—"
            fork_exec = ms(median(stats, "exec")) if "exec" in stats else ""
            rows.append([name, ratio, over, ms(median(stats)), spread(stats), fork_exec])
        out += table(["caller", "ratio", "overhead", "median", "spread", "fork → exec"], rows)
        out += [("fork → exec: until `Popen()` / `spawn()` returns, i.e. until execve closes "
                 "the close-on-exec pipe (parent's view, execve included).")]
        timed = inproc.get("launcher, child timed (TIMING_FD)")
        if timed and "to_execve" in timed:
            out += [(f"Inside the child (`launcher.TIMING_FD` stamps, medians of each): fork to "
                     f"the child's first line {ms(median(timed, 'fork'))}; child path (setsid … "
                     f"landlock_restrict_self, seccomp) {ms(median(timed, 'child'))}; fork to just "
                     f"before execve {ms(median(timed, 'to_execve'))}.")]
        out += [""]

    whole = results.get("whole", {})
    if whole and "/bin/true" in whole:
        out += ["**Whole process: one confined `/bin/true` per command** (baseline `/bin/true`)", ""]
        base = median(whole["/bin/true"])
        rows = [[name, f"{median(s) / base:.1f}x", ms(median(s) - base), ms(median(s)), spread(s)]
                for name, s in sorted(whole.items(), key=lambda kv: median(kv[1]))]
        out += table(["command", "ratio", "overhead", "median", "spread"], rows)

    out += paths_table(results.get("paths", {}))
    out += memory_table(results.get("memory", {}))
    out += concurrency_table(results.get("concurrency", {}))

    ses = results.get("session", {})
    if ses and "unconfined (subprocess.run)" in ses:
        base = median(ses["unconfined (subprocess.run)"])
        out += [("**Agent session: 50 tool calls in series** (cat, ls, grep, python -c, head, "
                 "wc; each under its own tool's policy, output captured)"), ""]
        rows = [[name, f"{median(s) / base:.2f}x", ms(median(s)), ms(median(s) / 50), spread(s)]
                for name, s in ses.items()]
        out += table(["mode", "ratio", "session", "per call", "spread"], rows)

    out += api_series.table(results.get("api", {}))
    out += native_front.table(results.get("cli", {}))
    work = results.get("workloads", {})
    if work:
        bpf = results["machine"].get("seccomp_instructions", "?")
        out += [(f"**Work inside vs outside** (`/usr/bin/python3 -c ...`, policy compiled once; "
                 f"its seccomp filter has {bpf} BPF instructions)"), ""]
        rows = []
        for name, modes in work.items():
            if {"confined", "unconfined"} <= modes.keys():
                c, u = modes["confined"], modes["unconfined"]
                rows.append([name, f"{median(c) / median(u):.3f}x", ms(median(u)), ms(median(c)),
                             spread(c)])
        out += table(["workload", "ratio", "unconfined", "confined", "confined spread"], rows)

    for plot in plots:
        out += [f"![{plot}]({plot})", ""]
    if results.get("skipped"):
        out += ["Not measured in this run:", ""]
        out += [f"- {what}: {why}" for what, why in results["skipped"].items()]
        out += [""]
    if results.get("versions"):
        out += ["Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), ""]
    return "\n".join(out)


def load_note(machine: dict[str, Any]) -> str:
    """Other work on the machine inflates every contender of a comparison, and the spreads."""
    if "load_start" not in machine:
        return ""
    return (f" Load average (1 min) {machine['load_start']:g} at the start, "
            f"{machine.get('load_end', '?')} at the end, on {machine['cores']} cores.")


def paths_table(data: dict[str, Any]) -> list[str]:
    if "subprocess.run" not in data:
        return []
    base = median(data["subprocess.run"])
    out = [("**Policy size: per call load + compile + run of `/bin/true`** "
            "(N granted directories; baseline `subprocess.run`)"), ""]
    rows = [[name, f"{median(s) / base:.1f}x", ms(median(s)), phase(s, "load"),
             phase(s, "compile"), phase(s, "run"), spread(s)]
            for name, s in data.items() if name != "subprocess.run"]
    return out + table(["paths", "ratio", "per call", "load (parse)", "compile (ruleset, BPF)",
                        "fork → exit", "spread"], rows)


def phase(stats: Stats, key: str) -> str:
    return ms(median(stats, key)) if key in stats else "—"


def memory_table(data: dict[str, Any]) -> list[str]:
    if not data:
        return []
    modes = [m for m in ("launcher", "api") if any(m in v for v in data.values())]
    out = ["**Caller memory: `/bin/true` from a process holding touched 4 KiB pages**", ""]
    rows = []
    for mib, by_mode in data.items():
        row = [f"{mib} MiB", ms(median(by_mode["subprocess.run"]))]
        for mode in modes:
            if mode in by_mode:
                over = median(by_mode[mode]) - median(by_mode["subprocess.run"])
                row += [f"{ms(median(by_mode[mode]))} (+{ms(over)})"]
            else:
                row += ["—"]
        rows.append(row)
    return out + table(["caller holds", "subprocess.run", *[f"{m} (overhead)" for m in modes]], rows)


def concurrency_table(data: dict[str, Any]) -> list[str]:
    if not data:
        return []
    modes = [m for m in ("launcher", "api", "api threads") if any(m in v for v in data.values())]
    out = [("**Throughput: `/bin/true` per second, N callers back to back** (processes; "
            "`api threads`: N threads of one process)"), ""]
    rows = []
    for callers, by_mode in data.items():
        plain = by_mode.get("plain", {}).get("median", 0.0)
        row = [callers, f"{plain:.0f}/s"]
        for mode in modes:
            rate = by_mode.get(mode, {}).get("median")
            row += [f"{rate:.0f}/s ({rate / plain:.2f}x)" if rate and plain else "—"]
        rows.append(row)
    return out + table(["callers", "unconfined", *[f"{m} (ratio)" for m in modes]], rows)


# ----------------------------------------------------------------------------
# Plots


def plots(results: dict[str, Any], out: Path) -> tuple[list[str], str]:
    """Write the PNGs; return their file names, or a reason when matplotlib is missing."""
    try:
        # matplotlib is optional (the plots are skipped without it); unused-ignore keeps
        # mypy quiet both where it is installed and where it is not
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        return [], f"plots skipped: matplotlib unavailable ({exc})"
    written = []
    for name, draw in (("whole_process.png", plot_whole), ("paths.png", plot_paths),
                       ("memory.png", plot_memory), ("concurrency.png", plot_concurrency)):
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        if draw(results, ax):
            fig.tight_layout()
            fig.savefig(out / name)
            written.append(name)
        plt.close(fig)
    return written, ""


def errorbars(stats_list: list[Stats], scale: float = 1000) -> tuple[list[float], list[list[float]]]:
    mids = [s["total"]["median"] * scale for s in stats_list]
    low = [max(0.0, m - s["total"]["p10"] * scale) for m, s in zip(mids, stats_list)]
    high = [max(0.0, s["total"]["p90"] * scale - m) for m, s in zip(mids, stats_list)]
    return mids, [low, high]


def plot_whole(results: dict[str, Any], ax: Any) -> bool:
    whole = results.get("whole", {})
    if not whole:
        return False
    items = sorted(whole.items(), key=lambda kv: median(kv[1]))
    mids, err = errorbars([s for _, s in items])
    names = [n for n, _ in items]
    for y, (name, mid) in enumerate(zip(names, mids)):
        color = "tab:green" if name.startswith("sandlock") else "tab:gray"
        ax.errorbar([mid], [y], xerr=[[err[0][y]], [err[1][y]]], fmt="o", color=color, capsize=3)
        ax.text((mid + err[1][y]) * 1.15, y, f"{mid:.2f} ms" if mid < 10 else f"{mid:.0f} ms",
                va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names)
    ax.set_xscale("log")
    ax.set_xlim(right=max(m + e for m, e in zip(mids, err[1])) * 3)
    ax.set_xlabel("wall time per run, ms (log; dot = median, whiskers = p10–p90)")
    ax.set_title("Whole process: one sandboxed /bin/true")
    ax.grid(axis="x", alpha=0.3)
    return True


def plot_paths(results: dict[str, Any], ax: Any) -> bool:
    data = results.get("paths", {})
    counts = [k for k in data if k != "subprocess.run"]
    if not counts:
        return False
    xs = [int(k) for k in counts]
    for key, label in (("total", "per call"), ("load", "load (parse)"),
                       ("compile", "compile (ruleset, BPF)"), ("run", "fork → exit")):
        if all(key in data[k] for k in counts):
            ax.plot(xs, [data[k][key]["median"] * 1000 for k in counts], marker="o", label=label)
    if "subprocess.run" in data:
        ax.axhline(median(data["subprocess.run"]) * 1000, color="gray", linestyle="--",
                   label="subprocess.run")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("granted directories in the policy")
    ax.set_ylabel("ms (median, log)")
    ax.set_title("Cost per call vs policy size")
    ax.legend()
    return True


def plot_memory(results: dict[str, Any], ax: Any) -> bool:
    data = results.get("memory", {})
    if not data:
        return False
    sizes = sorted(data, key=int)
    for mode in ("subprocess.run", "launcher", "api"):
        present = [s for s in sizes if mode in data[s]]
        if present:
            mids, err = errorbars([data[s][mode] for s in present])
            ax.errorbar([int(s) for s in present], mids, yerr=err, marker="o", capsize=3,
                        label=mode)
    ax.set_yscale("log")
    ax.set_xlabel("memory the caller holds, MiB")
    ax.set_ylabel("ms per /bin/true (median, p10–p90; log)")
    ax.set_title("Cost per call vs the caller's memory")
    ax.legend()
    return True


def plot_concurrency(results: dict[str, Any], ax: Any) -> bool:
    data = results.get("concurrency", {})
    if not data:
        return False
    callers = sorted(data, key=int)
    for mode, label in (("plain", "unconfined"), ("launcher", "launcher"), ("api", "api"),
                        ("api threads", "api, threads of one process")):
        present = [c for c in callers if mode in data[c]]
        if present:
            ax.plot([int(c) for c in present], [data[c][mode]["median"] for c in present],
                    marker="o", label=label)
    ax.set_xticks([int(c) for c in callers])
    ax.set_xlabel("parallel callers")
    ax.set_ylabel("/bin/true per second (median)")
    ax.set_title("Throughput")
    ax.set_ylim(bottom=0)
    ax.legend()
    return True


def write(results: dict[str, Any], out: Path) -> Path:
    """results.json, the PNGs and results.md into ``out``; returns the markdown path."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    names, why = plots(results, out)
    if why:
        results.setdefault("skipped", {}).setdefault("plots", why)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = out / "results.md"
    report.write_text(markdown(results, names))
    return report
