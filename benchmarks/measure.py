"""Timing primitives: worker processes, whole-process timing, interleaved rounds, summaries.

Contenders of one comparison are run in interleaved rounds (a shuffled order
each round), so a slow minute of the machine (another tenant, frequency
scaling, page cache) lands on all of them alike instead of on whichever ran
then. Each contender runs a small batch per round, sized so that cheap and
expensive contenders spend similar time per round.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

Sample = dict[str, float]
#: A contender runs ``n`` times and returns one sample per run.
Batch = Callable[[int], list[Sample]]

WORKER = Path(__file__).resolve().parent / "worker.py"


@dataclass(frozen=True)
class Summary:
    """Median and spread (10th and 90th percentiles) of one measured quantity, in seconds."""

    median: float
    p10: float
    p90: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "n": self.n}


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * fraction
    low, high = math.floor(position), math.ceil(position)
    weight = position - low
    return sorted_values[low] * (1 - weight) + sorted_values[high] * weight


def summarize(values: Sequence[float]) -> Summary:
    ordered = sorted(values)
    return Summary(percentile(ordered, 0.5), percentile(ordered, 0.1), percentile(ordered, 0.9),
                   len(ordered))


def summarize_samples(samples: Sequence[Sample]) -> dict[str, dict[str, float]]:
    """One summary per key of the samples (``total`` and any phases)."""
    keys = samples[0].keys() if samples else ()
    return {key: summarize([s[key] for s in samples]).as_dict() for key in keys}


class BenchmarkError(RuntimeError):
    """A contender failed while being measured: the harness skips it with this reason."""


# ----------------------------------------------------------------------------
# Whole processes


def time_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> float:
    """Wall time of one run of ``argv``, from spawn to reaped, output discarded.

    posix_spawn (vfork + exec in glibc) keeps the harness's own cost small and
    identical for every contender, including the ``/bin/true`` floor.
    """
    null = os.open(os.devnull, os.O_RDWR)
    try:
        actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1),
                   (os.POSIX_SPAWN_DUP2, null, 2)]
        t0 = time.perf_counter()
        pid = os.posix_spawn(argv[0], list(argv), dict(env or os.environ), file_actions=actions)
        _, status = os.waitpid(pid, 0)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(null)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise BenchmarkError(f"{' '.join(argv)} exited {code}")
    return elapsed


def command_batch(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> Batch:
    return lambda n: [{"total": time_command(argv, env)} for _ in range(n)]


def why_command_fails(argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
                      timeout: float = 120) -> Optional[str]:
    """None if ``argv`` runs and exits 0; otherwise the reason, with its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=dict(env or os.environ), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
    return f"exited {proc.returncode}: {last[:200]}"


# ----------------------------------------------------------------------------
# Worker processes


class Worker:
    """A measuring process (see worker.py) driven one request at a time."""

    TIMEOUT = 300

    def __init__(self, config: Mapping[str, Any], python: str = sys.executable,
                 flags: Sequence[str] = ("-I",)) -> None:
        self.config = dict(config)
        self.proc = subprocess.Popen([python, *flags, str(WORKER), json.dumps(self.config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        self.pid: int = hello["pid"]
        self.info: dict[str, Any] = hello.get("info", {})
        #: op name -> None if available, else why not
        self.ops: dict[str, Optional[str]] = hello["ops"]

    def _read(self) -> dict[str, Any]:
        """The next answer; a worker silent for ``TIMEOUT`` seconds is killed, never waited on."""
        assert self.proc.stdout is not None
        watchdog = threading.Timer(self.TIMEOUT, self.proc.kill)
        watchdog.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            watchdog.cancel()
        if not line:
            code = self.proc.wait()
            why = f"no answer in {self.TIMEOUT} s" if code == -9 else f"exited {code}"
            raise BenchmarkError(f"worker {self.config.get('mode')}: {why}")
        message: dict[str, Any] = json.loads(line)
        return message

    def send(self, op: str, n: int = 1, arg: Any = None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "n": n, "arg": arg}) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> list[Sample]:
        message = self._read()
        if "error" in message:
            raise BenchmarkError(message["error"])
        samples: list[Sample] = message["samples"]
        return samples

    def request(self, op: str, n: int = 1, arg: Any = None) -> list[Sample]:
        self.send(op, n, arg)
        return self.receive()

    def batch(self, op: str, arg: Any = None) -> Batch:
        return lambda n: self.request(op, n, arg)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------
# Interleaved rounds


def interleave(contenders: Mapping[str, Batch], rounds: int, *, budget: float = 0.02,
               max_batch: int = 20, cap: float = 30.0, min_rounds: int = 3, seed: int = 5,
               skipped: Optional[dict[str, str]] = None) -> dict[str, list[Sample]]:
    """Run every contender ``rounds`` times in a shuffled order; return its samples.

    A first warm-up call per contender both validates it and sizes its batch
    (about ``budget`` seconds per round). A contender so slow that its rounds
    would take more than ``cap`` seconds takes part in the first rounds only
    (at least ``min_rounds``). A contender that fails is dropped and its reason
    put in ``skipped``; the others go on.
    """
    batches: dict[str, int] = {}
    last_round: dict[str, int] = {}
    for name, run in contenders.items():
        try:
            t0 = time.perf_counter()
            run(1)
            elapsed = max(time.perf_counter() - t0, 1e-6)
        except BenchmarkError as exc:
            if skipped is None:
                raise
            skipped[name] = str(exc)
            continue
        batches[name] = max(1, min(max_batch, int(budget / elapsed)))
        last_round[name] = max(min_rounds, int(cap / (elapsed * batches[name])))
    rng = random.Random(seed)
    samples: dict[str, list[Sample]] = {name: [] for name in batches}
    for index in range(rounds):
        order = list(batches)
        rng.shuffle(order)
        for name in order:
            if name not in samples or index >= last_round[name]:
                continue
            try:
                samples[name] += contenders[name](batches[name])
            except BenchmarkError as exc:
                if skipped is None:
                    raise
                skipped[name] = str(exc)
                del samples[name]
    return samples
