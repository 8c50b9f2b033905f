"""Smoke tests of the benchmark harness: its pieces work and its report is well formed.

No timing is asserted (performance is what the benchmarks report, not what
tests check); only that each piece measures something, validates what it
runs, and turns failures into stated skips.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the harness runs from the checkout, it is not installed
    sys.path.insert(0, str(REPO))

from benchmarks import measure, report
from benchmarks.measure import BenchmarkError, Worker

TRUE_POLICY = """\
version = 1
extends = ["base"]
[filesystem]
exec = ["/usr/bin/true"]
"""


def test_percentiles_interpolate_like_numpy() -> None:
    summary = measure.summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (summary.median, summary.p10, summary.p90, summary.n) == (3.0, 1.4, 4.6, 5)


def test_interleave_runs_every_contender_each_round_and_drops_failures() -> None:
    calls: list[str] = []

    def fine(name: str) -> measure.Batch:
        return lambda n: [calls.append(name) or {"total": 0.001} for _ in range(n)]  # type: ignore[func-returns-value]

    def broken(n: int) -> list[measure.Sample]:
        raise BenchmarkError("refused")

    skipped: dict[str, str] = {}
    samples = measure.interleave({"a": fine("a"), "b": fine("b"), "bad": broken}, rounds=4,
                                 budget=0.0, skipped=skipped)
    assert sorted(samples) == ["a", "b"]
    assert len(samples["a"]) == len(samples["b"]) == 4
    assert calls.count("a") == 5  # one warm-up, then one per round
    assert skipped == {"bad": "refused"}


def test_time_command_checks_the_exit_code() -> None:
    assert measure.time_command(["/bin/true"]) > 0
    with pytest.raises(BenchmarkError, match="exited 1"):
        measure.time_command(["/bin/false"])
    assert measure.why_command_fails(["/bin/false"]) is not None


def test_worker_measures_plain_and_confined_true(tmp_path: Path) -> None:
    policy = tmp_path / "true.toml"
    policy.write_text(TRUE_POLICY)
    with Worker({"mode": "ours", "repo": str(REPO), "true_policy": str(policy)}) as worker:
        assert worker.ops["plain"] is None and worker.ops["launcher"] is None
        for op in ("plain", "launcher", "launcher_percall"):
            samples = worker.request(op, 2)
            assert len(samples) == 2 and all(s["total"] > 0 for s in samples)
    config = {"mode": "ours", "repo": str(REPO), "true_policy": str(policy), "api": True}
    with Worker(config) as worker:
        # The API is measured in a worker of its own, or skipped with a stated reason.
        assert worker.ops["launcher"] is not None
        if worker.ops["api"] is None:
            assert len(worker.request("api", 2)) == 2
        else:
            assert "sandlock.api.sandbox" in worker.ops["api"]


def test_worker_reports_a_confined_command_that_fails(tmp_path: Path) -> None:
    """A sandbox that refuses the command must never pass for a fast one."""
    policy = tmp_path / "true.toml"
    policy.write_text(TRUE_POLICY)
    with Worker({"mode": "ours", "repo": str(REPO), "true_policy": str(policy)}) as worker:
        arg = {"mode": "launcher", "argv": ["/bin/cat", "/etc/hostname"],
               "policy": str(policy), "vars": {}}
        with pytest.raises(BenchmarkError):
            worker.request("workload", 1, arg)


def test_report_states_targets_and_skips() -> None:
    stats = {"total": {"median": 0.001, "p10": 0.0009, "p90": 0.0012, "n": 10}}
    slow = {"total": {"median": 0.003, "p10": 0.0029, "p90": 0.0032, "n": 10}}
    results = {
        "machine": {"date": "today", "cpu": "cpu", "cores": 2, "memory_gib": 1, "kernel": "6.x",
                    "landlock_abi": 7, "python": "3", "user": "root"},
        "mode": "quick",
        "inprocess": {"subprocess.run": stats, "launcher, compiled once": slow},
        "whole": {"/bin/true": stats, "bwrap": slow},
        "skipped": {"srt": "quick mode"},
    }
    text = report.markdown(results, [])
    assert "| in-process overhead (launcher (no API measured)) over subprocess.run | 2.00 ms" in text
    assert "**missed** by 1.00 ms" in text
    assert "- srt: quick mode" in text


def test_quick_harness_end_to_end(tmp_path: Path) -> None:
    """``python -m benchmarks --quick`` for the cheapest benchmark writes its report."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "inprocess",
                           "--out", str(out), "--cache", str(tmp_path / "cache")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    text = (out / "results.md").read_text()
    assert "**In-process: `/bin/true` confined from a Python caller**" in text
    assert "| launcher, compiled once |" in text
    assert (out / "results.json").exists()


def test_the_cli_series_reports_each_row_and_its_target() -> None:
    """``benchmarks/native_front.py`` (the ``cli`` step): one round of two calls per row;
    its table names each row measured or skipped, and the target of issue 25."""
    from benchmarks import native_front

    data = native_front.step(rounds=1, calls=2)
    assert {"Python CLI", "unconfined"} <= set(data["seconds"])
    assert {"native CLI", "bwrap", "C floor"} <= set(data["seconds"]) | set(data["skipped"])
    text = "\n".join(native_front.table(data))
    assert "| Python CLI |" in text and "| unconfined |" in text
    assert ("Target (issue 25)" in text) is ("native CLI" in data["seconds"])


def test_api_series_reports_every_series_and_its_targets() -> None:
    """``benchmarks.api_series`` (the ``api`` step): one round of two calls per series,
    one fresh start; its table names each series and each target of issue 25."""
    from benchmarks import api_series

    data = api_series.step(rounds=1, calls=2, starts=1)
    assert {"subprocess.run", "Sandbox.run", "Sandbox.run, trace=True",
            "Sandbox.call(operator.add)"} <= set(data["series"])
    assert data["starts"]["n"] == 1
    text = "\n".join(api_series.table(data))
    for row in ("| Sandbox.run over subprocess.run, per call |",
                "| Sandbox.run, trace=True / Sandbox.run |",
                "| `import sandlock` + first `Sandbox()` of a policy file, its plan cached |",
                "| `import sandlock` + first `Sandbox()` of a dict, its plan cached |",
                "| `import sandlock` + first `Sandbox()` of a dict, compiled (`SANDLOCK_NO_CACHE=1`) |"):
        assert row in text


def test_the_confinement_cost_reports_each_step() -> None:
    """``benchmarks/confine_cost.py``: one round of a few starts per row, for its shape."""
    from benchmarks import confine_cost

    data = confine_cost.measure(runs=3, rounds=1, profile="python")
    if "skipped" in data:
        pytest.skip(data["skipped"])
    assert list(data["us"]) == list(confine_cost.ROWS)
    assert data["instructions"] > 1 and all(value > 0 for value in data["us"].values())
    assert len(confine_cost.table(data)) == 2 + 2 + len(confine_cost.ROWS)
