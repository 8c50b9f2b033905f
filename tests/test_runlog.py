"""The run log (SANDLOCK_LOG): every run appends one authenticated, chained record;
`sandlock log --verify` finds a record removed, edited, moved or cut off the end, and
no confined tool can write the log or be granted any access to it.

Every tampering test first verifies the untouched log (the control), then changes it
as an attacker with write access would, and expects verify to say so.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from conftest import REPO, reboot_keyring

from sandlock.compile import cachekey, runlog
from sandlock.policy.profiles import path as profile_path


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "area" / "log"  # "area": a directory a grant can cover it by
    yield where
    state = cachekey.key_directory()
    if state is not None:  # the anchor this test's log left in the state directory
        anchor = Path(state, runlog.ANCHORS, runlog._anchor_name(str(where)))
        anchor.unlink(missing_ok=True)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


def cli(log_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), runlog.ENV: str(log_dir)}
    return subprocess.run([sys.executable, "-P", "-m", "sandlock", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def run(log_dir: Path, ws: Path, *argv: str, policy: str = "shell") -> subprocess.CompletedProcess[str]:
    return cli(log_dir, "run", "--policy", policy, "--var", f"workspace={ws}", "--", *argv)


def lines(log_dir: Path) -> list[bytes]:
    return (log_dir / runlog.LOG_FILE).read_bytes().splitlines(keepends=True)


def verify(log_dir: Path) -> subprocess.CompletedProcess[str]:
    return cli(log_dir, "log", "--verify")


@pytest.fixture
def logged(log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A log of three records, verified intact (the control of every tampering test).
    Appended in-process: the chain does not depend on what ran."""
    monkeypatch.setenv(runlog.ENV, str(log_dir))
    for argv, code in ((["/bin/true"], 0), (["/bin/false"], 1), (["/bin/echo", "third"], 0)):
        runlog.append(profile_path("shell"), argv, code)
    assert runlog.verify() == (3, [])
    return log_dir


def test_cli_records_and_verifies(log_dir: Path, ws: Path) -> None:
    """`sandlock run` appends; `sandlock log --verify` says intact, then altered."""
    for argv in (["/bin/true"], ["/bin/false"]):
        run(log_dir, ws, *argv)
    done = verify(log_dir)
    assert done.returncode == 0 and "2 records: intact" in done.stdout, done.stderr
    records = [json.loads(line) for line in lines(log_dir)]
    assert [r["command"] for r in records] == [["/bin/true"], ["/bin/false"]]
    assert [r["exit"] for r in records] == [0, 1] and [r["seq"] for r in records] == [1, 2]
    shipped = profile_path("shell")
    assert records[0]["policy"] == shipped
    assert records[0]["policy_sha256"] == hashlib.sha256(Path(shipped).read_bytes()).hexdigest()
    assert records[0]["uid"] == os.geteuid() and records[0]["api"] is False
    _rewrite(log_dir, [lines(log_dir)[0], _edit_exit(lines(log_dir)[1])])
    done = verify(log_dir)
    assert done.returncode == 1 and "record 2 was altered" in done.stderr, done.stderr


def test_trace_records_what_it_saw_refused(log_dir: Path, ws: Path, tmp_path: Path) -> None:
    """`sandlock trace` is a run too: its record carries the refusals it saw."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not granted\n")
    done = cli(log_dir, "trace", "--policy", "shell", "--var", f"workspace={ws}", "--",
               "/bin/cat", str(outside))
    assert done.returncode == 1, done.stderr
    (record,) = [json.loads(line) for line in lines(log_dir)]
    assert record["command"] == ["/bin/cat", str(outside)] and record["exit"] == 1
    assert any(str(outside) in refusal for refusal in record["refused"]), record
    assert verify(log_dir).returncode == 0


def _rewrite(log_dir: Path, new: list[bytes]) -> None:
    (log_dir / runlog.LOG_FILE).write_bytes(b"".join(new))


def _edit_exit(line: bytes) -> bytes:
    record = json.loads(line)
    record["exit"] = 0
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n"


@pytest.mark.parametrize(("attack", "says"), [
    ("removed", "does not follow record 1"),
    ("edited", "record 2 was altered"),
    ("truncated", "cut off its end"),
    ("reordered", "does not follow record 0"),
    ("cut-line", "is cut"),
], ids=["removed", "edited", "truncated", "reordered", "cut-line"])
def test_tampering_is_detected(logged: Path, attack: str, says: str) -> None:
    first, second, third = lines(logged)
    _rewrite(logged, {"removed": [first, third], "edited": [first, _edit_exit(second), third],
                      "truncated": [first, second], "reordered": [second, first, third],
                      "cut-line": [first, second, third[:-20]]}[attack])
    count, problems = runlog.verify()
    assert any(says in problem for problem in problems), problems


def test_the_log_still_verifies_after_a_reboot(logged: Path) -> None:
    """A reboot replaces the keyring's cache key; the log is keyed by the records key
    file, which stays, so its records still verify (with the cache's key they read as
    forged after every reboot). Control: the cache key did change, and a record edited
    after the reboot is still caught."""
    reboot_keyring()
    assert runlog.verify() == (3, [])
    first, second, third = lines(logged)
    _rewrite(logged, [first, _edit_exit(second), third])
    assert any("record 2 was altered" in problem for problem in runlog.verify()[1])


def test_replaced_by_older_copy(logged: Path) -> None:
    """A copy of the log saved earlier, put back after more runs: the anchor moved on."""
    older = (logged / runlog.LOG_FILE).read_bytes()
    runlog.append("p.toml", ["/bin/true"], 0)
    assert runlog.verify() == (4, [])  # control
    (logged / runlog.LOG_FILE).write_bytes(older)
    assert any("older copy" in problem for problem in runlog.verify()[1])


def test_tool_cannot_write_the_log(logged: Path, ws: Path) -> None:
    target = logged / runlog.LOG_FILE
    attack = f"echo FORGED-$((6*7)) >> {target}"
    done = run(logged, ws, "/bin/sh", "-c", attack)
    assert "Permission denied" in done.stderr and done.returncode != 0  # Landlock: EACCES
    assert b"FORGED-42" not in target.read_bytes()
    assert runlog.verify() == (4, [])  # the refused run logged, the chain intact
    # Control: the same write, unconfined, goes through, and verify catches it.
    subprocess.run(["/bin/sh", "-c", attack], check=True)
    assert b"FORGED-42" in target.read_bytes() and runlog.verify()[1]


@pytest.mark.parametrize("grant", ["read", "write"])
def test_grant_reaching_the_log_is_refused(log_dir: Path, ws: Path, tmp_path: Path,
                                           grant: str) -> None:
    policy = tmp_path / "p.toml"
    log_dir.parent.mkdir()
    policy.write_text(f'version = 1\nextends = ["shell"]\n[filesystem]\n{grant} = ["{log_dir.parent}"]\n')
    # Control: with the log off, the same policy runs (and its plan is cached).
    env = {k: v for k, v in os.environ.items() if k != runlog.ENV}
    off = subprocess.run([sys.executable, "-P", "-m", "sandlock", "run", "--policy", str(policy),
                          "--var", f"workspace={ws}", "--", "/bin/true"], capture_output=True,
                         text=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=60)
    assert off.returncode == 0, off.stderr
    done = run(log_dir, ws, "/bin/true", policy=str(policy))  # a cache hit checks grants again
    assert done.returncode == 125 and str(log_dir) in done.stderr, done.stderr
    assert ("run log" if grant == "read" else "state directory") in done.stderr
    assert not (log_dir / runlog.LOG_FILE).exists()


def test_tool_text_stays_one_line(log_dir: Path, ws: Path) -> None:
    run(log_dir, ws, "/bin/echo", "a\nb\x1b[31m\u202e")
    data = (log_dir / runlog.LOG_FILE).read_bytes()
    assert data.count(b"\n") == 1 and b"\x1b" not in data and data.isascii()
    assert json.loads(data)["command"][1] == "a\nb\x1b[31m\u202e"


def test_api_run_is_logged(log_dir: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock import Sandbox

    monkeypatch.setenv(runlog.ENV, str(log_dir))
    with Sandbox("shell", vars={"workspace": str(ws)}) as box:
        assert box.run(["/bin/true"]).returncode == 0
        monkeypatch.setenv(runlog.ENV, str(log_dir / "elsewhere"))
        with pytest.raises(runlog.LogError, match="changed after"):
            box.run(["/bin/true"])  # its grants were never checked against that log
    record = json.loads(lines(log_dir)[0])
    assert record["api"] is True and record["command"] == ["/bin/true"] and record["exit"] == 0
    monkeypatch.setenv(runlog.ENV, str(log_dir))
    assert runlog.verify() == (1, [])


def test_api_popen_and_call_are_logged(log_dir: Path, ws: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way the API runs a tool leaves a record: a process from popen() when it ends
    (once, however often it is waited for), and a call() with the function's name."""
    from sandlock import Sandbox

    monkeypatch.setenv(runlog.ENV, str(log_dir))
    with Sandbox("shell", vars={"workspace": str(ws)}) as box:
        process = box.popen(["/bin/sh", "-c", "exit 3"])
        assert process.wait() == 3 and process.wait() == 3 and process.poll() == 3
        assert box.call(len, "abc") == 3
    records = [json.loads(line) for line in lines(log_dir)]
    assert [(r["command"], r["exit"], r["api"]) for r in records] == [
        (["/bin/sh", "-c", "exit 3"], 3, True), (["call()", "len"], 0, True)]
    assert runlog.verify() == (2, [])


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runlog.ENV, raising=False)
    assert runlog.directory() is None and runlog.exposed() == []
    monkeypatch.setenv(runlog.ENV, "0")
    assert runlog.directory() is None


@pytest.mark.parametrize("value", ["relative/dir", "yes"])
def test_a_log_that_names_no_place_is_an_error(value: str, ws: Path) -> None:
    done = cli(Path(value), "run", "--policy", "shell", "--var", f"workspace={ws}", "--",
               "/bin/true")
    assert done.returncode == 125 and "SANDLOCK_LOG must be" in done.stderr, done.stderr


def test_a_grant_reaching_the_records_key_is_refused(ws: Path, tmp_path: Path) -> None:
    """The records key (run log, undo records) is a file beside the cache's: no grant of
    any right may reach it, whether it exists yet or not (a tool granted it could forge
    a record that verifies). Control: a grant beside it runs."""
    directory = cachekey.key_directory()
    if directory is None:
        pytest.skip("this uid has no home directory in the password database")
    from sandlock.compile import cache

    assert cachekey.records_secret(cache.open_private_dir)[0] is not None  # it exists now
    beside = Path(directory).parent / f"sandlock-test-beside-{os.getpid()}"
    beside.mkdir(exist_ok=True)
    try:
        for target, refused in ((cachekey.records_path(), True), (str(beside), False)):
            policy = tmp_path / "p.toml"
            policy.write_text(f'version = 1\nextends = ["shell"]\n[filesystem]\nread = ["{target}"]\n')
            env = {k: v for k, v in os.environ.items() if k != runlog.ENV}
            done = subprocess.run(
                [sys.executable, "-P", "-m", "sandlock", "run", "--policy", str(policy), "--var",
                 f"workspace={ws}", "--", "/bin/true"], capture_output=True, text=True,
                env={**env, "PYTHONPATH": str(REPO)}, timeout=60)
            if refused:
                assert done.returncode == 125, done.stderr
                assert "run log and undo records" in done.stderr
            else:
                assert done.returncode == 0, done.stderr
    finally:
        beside.rmdir()


def test_a_log_that_cannot_be_written_stops_the_run_before_it_starts(
        log_dir: Path, ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log directory sandlock does not trust (here: readable by others) is found before
    the tool runs: exit 125, nothing ran (found after it, the tool had run unlogged and
    its exit code was lost behind the error). The same for `trace` and the API. Control:
    the private directory logs the same run."""
    import sandlock

    log_dir.mkdir(parents=True, mode=0o755)
    os.chmod(log_dir, 0o755)
    marker = ws / "ran"
    done = run(log_dir, ws, "/bin/sh", "-c", f"touch {marker}")
    assert done.returncode == 125 and "nothing was run" in done.stderr, done.stderr
    assert not marker.exists()
    traced = cli(log_dir, "trace", "--policy", "shell", "--var", f"workspace={ws}", "--",
                 "/bin/sh", "-c", f"touch {marker}")
    assert traced.returncode == 125 and not marker.exists(), traced.stderr
    monkeypatch.setenv(runlog.ENV, str(log_dir))
    with pytest.raises(sandlock.SandlockError, match="private directory"):
        sandlock.Sandbox({"extends": ["shell"]}, vars={"workspace": str(ws)})
    os.chmod(log_dir, 0o700)  # control
    done = run(log_dir, ws, "/bin/sh", "-c", f"touch {marker}")
    assert done.returncode == 0 and marker.exists(), done.stderr
    assert runlog.verify() == (1, [])


@pytest.mark.parametrize("mode", ["cli", "api"])
def test_a_best_effort_run_records_what_it_did_not_enforce(log_dir: Path, ws: Path, mode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A best-effort run on a kernel that lacks a protection runs without it; its record
    says which (as `run`, `explain` and the API do), so that the log never shows such a
    run as fully confined. Control: on this kernel's full ABI the TCP rules are not listed."""
    from sandlock import Sandbox

    policy = ws.parent / "ports.toml"  # a TCP port rule: ABI 4
    policy.write_text('version = 1\nextends = ["shell"]\n[network]\nconnect = [443]\n')
    for abi, gaps in (("3", True), ("", False)):
        if abi:
            monkeypatch.setenv("SANDLOCK_ABI", abi)
        else:
            monkeypatch.delenv("SANDLOCK_ABI", raising=False)
        if mode == "cli":
            done = cli(log_dir, "run", "--best-effort", "--policy", str(policy), "--var",
                       f"workspace={ws}", "--", "/bin/true")
            assert done.returncode == 0, done.stderr
        else:
            monkeypatch.setenv(runlog.ENV, str(log_dir))
            with Sandbox(policy, vars={"workspace": str(ws)}, best_effort=True) as box:
                assert box.run(["/bin/true"]).returncode == 0
        record = json.loads(lines(log_dir)[-1])
        # (a user without a pids cgroup has one more line: the per-user process limit)
        tcp = any("TCP port restriction" in line for line in record["not_enforced"])
        assert tcp is gaps, record["not_enforced"]
    monkeypatch.setenv(runlog.ENV, str(log_dir))
    assert runlog.verify() == (2, [])


def _as_written_without(log_dir: Path, field: str) -> None:
    """Rewrite the log as a version whose records lack ``field`` would have written it:
    each record authentic (MAC, chain, anchor), so only the fields differ."""
    key, prev, out = runlog._key(), runlog.GENESIS, []
    for line in lines(log_dir):
        record = json.loads(line)
        del record[field], record["mac"]
        record["prev"] = prev
        record["mac"] = prev = runlog._mac(key, record)
        out.append(json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    _rewrite(log_dir, out)
    logs, anchors = runlog._open_dirs(str(log_dir), create=False)
    try:
        runlog._write_anchor(anchors, str(log_dir), key, len(out), prev)
    finally:
        os.close(logs)
        os.close(anchors)


@pytest.mark.parametrize("field", ["not_enforced", "reports"])
def test_records_of_the_version_before_not_enforced_still_verify(logged: Path, field: str) -> None:
    """Records written before ``not_enforced`` existed lack it and still verify (their MAC
    covers what they hold). Control: records lacking another field are not records, even
    authentic: the set of fields is one of the two versions', nothing else."""
    _as_written_without(logged, field)
    count, problems = runlog.verify()
    if field == "not_enforced":
        assert (count, problems) == (3, [])
    else:
        assert problems and "not a record" in problems[0], problems
