"""A measuring process: times operations on request, one batch at a time.

Every in-process number comes from a worker, not from the harness itself, for
three reasons: the harness's own memory (matplotlib, results) must not inflate
the fork being measured; the caller-memory benchmark needs callers of a chosen
size; and multikernel's wheel has the import name ``sandlock`` too, so it can
only run in a process whose ``sys.path`` holds it instead of ours.

This file is a standalone script (run with ``python -I``) so that it imports no
``sandlock`` before choosing which one. Protocol, one JSON object per line:
the worker announces ``{"ready": ..., "ops": {name: skip reason or null}}``;
the harness sends ``{"op": NAME, "n": COUNT, "arg": ...}`` and the worker
answers ``{"samples": [{"total": seconds, ...}, ...]}`` or ``{"error": text}``.
Only one worker runs an operation at a time, so workers never compete for CPU
except in the concurrency benchmark, which asks several at once on purpose.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import mmap
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

Sample = dict[str, float]
Op = Callable[[Any], Sample]
TRUE = ["/bin/true"]


def hold_memory(mib: int) -> Optional[mmap.mmap]:
    """Map and touch ``mib`` MiB in 4 KiB pages, like a heap of Python objects.

    Huge pages are refused on purpose: with them a 2 GiB caller has 1,024 page
    table entries to copy at fork instead of 524,288, which would flatter any
    launcher that forks the caller.
    """
    if mib <= 0:
        return None
    size = mib << 20
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    page = mmap.PAGESIZE
    for offset in range(0, size, page):
        area[offset] = 1
    return area


def plain_true(_: Any) -> Sample:
    """subprocess.run(["/bin/true"]); ``exec`` is when Popen() returns (after execve)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(TRUE)
    t1 = time.perf_counter()
    proc.wait()
    t2 = time.perf_counter()
    if proc.returncode != 0:
        raise RuntimeError(f"/bin/true exited {proc.returncode}")
    return {"total": t2 - t0, "exec": t1 - t0}


def plain_run(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode} unconfined")
    return elapsed


def rate(call: Callable[[], Any], arg: dict[str, Any]) -> Sample:
    """Run ``call`` back to back between two instants of the system-wide monotonic clock."""
    while time.monotonic() < arg["start"]:
        time.sleep(min(0.001, max(0.0, arg["start"] - time.monotonic())))
    count, end = 0, arg["end"]
    start = time.monotonic()
    while time.monotonic() < end:
        call()
        count += 1
    return {"total": time.monotonic() - start, "count": float(count)}


def threaded_rate(call: Callable[[], Any], arg: dict[str, Any]) -> Sample:
    """Like :func:`rate`, with ``arg["threads"]`` threads of this one process."""
    results: list[Sample] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            results.append(rate(call, arg))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body) for _ in range(arg["threads"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"total": max(r["total"] for r in results), "count": sum(r["count"] for r in results)}


# ----------------------------------------------------------------------------
# Our sandlock


class Ours:
    """Operations on this checkout's sandlock: the launcher, and the public API if present."""

    def __init__(self, config: dict[str, Any]) -> None:
        from sandlock.compile import compiler
        from sandlock.exec import launcher
        from sandlock.policy import model as policy

        self.launcher, self.compiler, self.policy = launcher, compiler, policy
        self.true_policy: str = config["true_policy"]
        self.compiled = compiler.compile_policy(policy.load_policy(self.true_policy, {}))
        self.true_cmd = launcher.prepare_command(self.compiled, TRUE)
        self.cache: dict[str, Any] = {}
        self.api: Optional[Api] = None
        if config.get("api"):
            self.api, self.api_reason = find_api(self.true_policy)
        else:
            self.api_reason = "this worker measures the launcher (start one with api=True)"

    def ops(self) -> dict[str, tuple[Op, Optional[str]]]:
        """The launcher's or the API's operations, never both in one process.

        ``launcher.Child.wait()`` kills every child of its caller once the command
        ends (the CLI's clean-up of escaped daemons), and the API's fork server is
        such a child: so each has a worker of its own.
        """
        api_why = None if self.api else self.api_reason
        launcher_why = "this worker measures the API" if self.api else None
        return {
            "plain": (plain_true, None),
            "launcher": (self.launcher_true, launcher_why),
            "launcher_percall": (self.launcher_percall, launcher_why),
            "launcher_stamps": (self.launcher_stamps, launcher_why or self.stamps_why()),
            "api": (self.api_true, api_why),
            "paths": (self.paths, launcher_why),
            "session": (self.session, launcher_why),
            "session_api": (self.session_api, api_why),
            "workload": (self.workload, launcher_why),
            "rate": (self.rate, None),
        }

    def launcher_true(self, _: Any) -> Sample:
        """A policy compiled once, then fork -> confine -> exec -> wait."""
        t0 = time.perf_counter()
        child = self.launcher.spawn(self.compiled, self.true_cmd)
        t1 = time.perf_counter()
        code = child.wait()
        t2 = time.perf_counter()
        if code != 0:
            raise RuntimeError(f"confined /bin/true exited {code}")
        return {"total": t2 - t0, "exec": t1 - t0}

    def stamps_why(self) -> Optional[str]:
        if hasattr(self.launcher, "TIMING_FD"):
            return None
        return "sandlock.exec.launcher has no TIMING_FD hook to time the child from fork to execve"

    def launcher_stamps(self, _: Any) -> Sample:
        """The child's own path, from the stamps it writes to ``launcher.TIMING_FD``.

        fork: the parent just before fork() -> the child's first line; child: first
        line -> just before execve (setsid ... landlock_restrict_self, seccomp).
        """
        read, write = os.pipe()
        self.launcher.TIMING_FD = write
        try:
            sample = self.launcher_true(None)
            raw = os.read(read, 24)
        finally:
            self.launcher.TIMING_FD = -1
            os.close(read)
            os.close(write)
        before_fork, child_start, before_exec = (int.from_bytes(raw[i:i + 8], "little")
                                                 for i in range(0, 24, 8))
        return {**sample, "fork": (child_start - before_fork) / 1e9,
                "child": (before_exec - child_start) / 1e9,
                "to_execve": (before_exec - before_fork) / 1e9}

    def confined(self, path: str, variables: dict[str, str], argv: list[str],
                 capture: bool = False) -> Sample:
        """One tool call as an agent makes it: load + compile its policy, run, read, close."""
        launcher = self.launcher
        t0 = time.perf_counter()
        loaded = self.policy.load_policy(path, variables)
        t1 = time.perf_counter()
        compiled = self.compiler.compile_policy(loaded)
        t2 = time.perf_counter()
        try:
            cmd = launcher.prepare_command(compiled, argv)
            code = self.spawn_wait(compiled, cmd, capture)
        finally:
            compiled.close()
        t3 = time.perf_counter()
        if code != 0:
            raise RuntimeError(f"{argv} exited {code} confined by {path}")
        return {"total": t3 - t0, "load": t1 - t0, "compile": t2 - t1, "run": t3 - t2}

    def spawn_wait(self, compiled: Any, cmd: Any, capture: bool) -> int:
        if not capture:
            with open(os.devnull, "wb") as null:
                return int(self.launcher.spawn(compiled, cmd, stdout=null.fileno()).wait())
        read, write = os.pipe2(os.O_CLOEXEC)
        try:
            child = self.launcher.spawn(compiled, cmd, stdout=write)
        finally:
            os.close(write)
        with open(read, "rb") as out:
            out.read()
        return int(child.wait())

    def launcher_percall(self, _: Any) -> Sample:
        return self.confined(self.true_policy, {}, TRUE)

    def api_true(self, _: Any) -> Sample:
        t0 = time.perf_counter()
        code = self.api.run_true()  # type: ignore[union-attr]
        t1 = time.perf_counter()
        if code != 0:
            raise RuntimeError(f"api run(/bin/true) exited {code}")
        return {"total": t1 - t0}

    def paths(self, arg: dict[str, Any]) -> Sample:
        return self.confined(arg["policy"], {}, TRUE)

    def session(self, arg: dict[str, Any]) -> Sample:
        """The agent session: every call with its own policy (mode "launcher") or none."""
        t0 = time.perf_counter()
        for call in arg["calls"]:
            if arg["mode"] == "plain":
                plain_run(call["argv"])
            else:
                self.confined(call["policy"], call["vars"], call["argv"], capture=True)
        return {"total": time.perf_counter() - t0}

    def session_api(self, arg: dict[str, Any]) -> Sample:
        """The session through the API: a registry made at its start ("registry") or before
        it and kept across sessions ("warm": an agent's steady state), or a Sandbox per call.
        """
        api = self.api
        assert api is not None
        if arg["mode"] == "warm" and "warm" not in self.cache:
            self.cache["warm"] = api.registry(arg["tools"])
        t0 = time.perf_counter()
        if arg["mode"] in ("registry", "warm"):
            registry = self.cache["warm"] if arg["mode"] == "warm" else api.registry(arg["tools"])
            try:
                codes = [api.run_tool(registry, c["tool"], c["vars"], c["argv"])
                         for c in arg["calls"]]
            finally:
                if arg["mode"] == "registry":
                    registry.close()
        else:
            codes = [api.run(c["policy"], c["vars"], c["argv"]) for c in arg["calls"]]
        elapsed = time.perf_counter() - t0
        failed = [(c["argv"], code) for c, code in zip(arg["calls"], codes) if code != 0]
        if failed:
            raise RuntimeError(f"{failed[0][0]} exited {failed[0][1]} via the API")
        return {"total": elapsed}

    def workload(self, arg: dict[str, Any]) -> Sample:
        """A longer program inside (policy compiled once, as a registry would) or outside."""
        if arg["mode"] == "plain":
            return {"total": plain_run(arg["argv"])}
        key = json.dumps([arg["policy"], arg["vars"]])
        if key not in self.cache:
            self.cache[key] = self.compiler.compile_policy(
                self.policy.load_policy(arg["policy"], arg["vars"]))
        compiled = self.cache[key]
        cmd = self.launcher.prepare_command(compiled, arg["argv"])
        t0 = time.perf_counter()
        code = self.spawn_wait(compiled, cmd, capture=True)
        elapsed = time.perf_counter() - t0
        if code != 0:
            raise RuntimeError(f"{arg['argv']} exited {code} confined")
        return {"total": elapsed}

    def rate(self, arg: dict[str, Any]) -> Sample:
        calls: dict[str, Callable[[], Any]] = {
            "plain": lambda: plain_true(None),
            "launcher": lambda: self.launcher_true(None),
        }
        if self.api:
            calls["api"] = lambda: self.api_true(None)
        call = calls[arg["mode"]]
        return threaded_rate(call, arg) if arg.get("threads", 1) > 1 else rate(call, arg)


class Api:
    """Adapter over the public API (``sandlock.api.sandbox``), whose shape is checked at run time.

    The benchmark must not break while that module changes, so it needs only
    ``Sandbox(policy_path, vars=...)`` whose ``run(argv, stdout=, stderr=)`` returns
    an object with a ``returncode``; anything else is reported as a skip reason.
    The fork server is started before the first timed call (``start()``), as an
    agent would at start-up; otherwise the first call pays for it.
    """

    def __init__(self, module: Any, true_policy: str) -> None:
        self.module = module
        if hasattr(module, "start"):
            module.start()
        self.true_box = module.Sandbox(true_policy, vars={})
        try:
            from sandlock.exec import native as nativeexec

            native = nativeexec.enabled()
        except ImportError:
            native = False
        #: which path a command call takes: the C helper (posix_spawn) or the fork server
        self.path = "sandlock-exec" if native else "fork server"

    def run_true(self) -> int:
        return int(self.true_box.run(TRUE).returncode)

    def run(self, path: str, variables: dict[str, str], argv: list[str]) -> int:
        """One tool call with its own policy: load + compile it, run with stdout captured."""
        with self.module.Sandbox(path, vars=variables) as box:
            result = box.run(argv, stdout=self.module.PIPE, stderr=self.module.DEVNULL)
        return int(result.returncode)

    def registry(self, directory: str) -> Any:
        """``sandlock.api.registry.Registry`` over a directory of ``TOOL.toml`` policies."""
        from sandlock.api.registry import Registry

        return Registry(directory)

    def run_tool(self, registry: Any, tool: str, variables: dict[str, str],
                 argv: list[str]) -> int:
        result = registry.run(tool, argv, vars=variables, stdout=self.module.PIPE,
                              stderr=self.module.DEVNULL)
        return int(result.returncode)


def find_api(true_policy: str) -> tuple[Optional[Api], str]:
    try:
        import sandlock.api.sandbox as module  # optional: written by another issue
    except ImportError as exc:
        return None, f"sandlock.api.sandbox is not importable ({exc})"
    if not hasattr(module, "Sandbox"):
        return None, "sandlock.api.sandbox has no Sandbox class"
    try:
        return Api(module, true_policy), ""
    except Exception as exc:  # noqa: BLE001 - an unfinished API is a skip, with its reason
        return None, f"sandlock.api.sandbox.Sandbox(policy, vars=...) failed: {type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------
# multikernel's sandlock wheel


class Multikernel:
    """multikernel's ``sandlock`` (PyPI) in-process API: ``Sandbox(...).run(argv)``."""

    def __init__(self, config: dict[str, Any]) -> None:
        wheel: Any = importlib.import_module("sandlock")  # main() put the wheel first on sys.path
        self.box = wheel.Sandbox(fs_readable=config["mk_readable"])  # reused, like ours

    def ops(self) -> dict[str, tuple[Op, Optional[str]]]:
        return {"plain": (plain_true, None), "mk": (self.run_true, None)}

    def run_true(self, _: Any) -> Sample:
        t0 = time.perf_counter()
        result = self.box.run(TRUE)
        elapsed = time.perf_counter() - t0
        if not result.success:
            raise RuntimeError(f"multikernel Sandbox.run(/bin/true) failed: {result}")
        return {"total": elapsed}


# ----------------------------------------------------------------------------

def serve(ops: dict[str, tuple[Op, Optional[str]]], info: dict[str, Any]) -> None:
    reply({"ready": True, "pid": os.getpid(), "info": info,
           "ops": {name: why for name, (_, why) in ops.items()}})
    for line in sys.stdin:
        request = json.loads(line)
        op, why = ops[request["op"]]
        try:
            if why:
                raise RuntimeError(why)
            gc.collect()
            gc.disable()
            try:
                samples = [op(request.get("arg")) for _ in range(request.get("n", 1))]
            finally:
                gc.enable()
            reply({"samples": samples})
        except Exception as exc:  # noqa: BLE001 - the harness decides what a failure means
            reply({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", help="JSON: mode, repo or mk dir, policies, hold_mib")
    config = json.loads(parser.parse_args().config)
    if config.get("native") is False:  # the API's other path, for comparison
        os.environ["SANDLOCK_NATIVE"] = "0"
    sys.path.insert(0, config["mk_dir"] if config["mode"] == "multikernel" else config["repo"])
    held = hold_memory(config.get("hold_mib", 0))  # noqa: F841 - kept alive on purpose
    target = Multikernel(config) if config["mode"] == "multikernel" else Ours(config)
    api = getattr(target, "api", None)
    serve(target.ops(), {"api_path": api.path} if api else {})


if __name__ == "__main__":
    main()
