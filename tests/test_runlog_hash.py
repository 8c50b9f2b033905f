"""The run log's ``policy_sha256`` names the bytes compiled for the run (the policy's
own file, as before: not what it ``extends``), never the file as it is when the run
ends.

The attack: the policy file is replaced while its run is under way (the tool waits
for the swap), and the record, authenticated and verified intact, named the new
file's bytes, which never ran. Controls: the same run with the file unchanged records
the file's hash, and a run of the replaced file records the replacement's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, eventually, require_abi
from test_runlog import lines, log_dir, verify  # noqa: F401 - log_dir: the run log's directory

import sandlock
from sandlock.compile import runlog

ORIGINAL = 'version = 1\nextends = ["shell"]\n[limits]\ntimeout = "30s"\n'
REPLACED = "# swapped in while the run was under way\n" + ORIGINAL
#: The tool: says it started, then waits until the test has replaced the policy.
WAIT_FOR_SWAP = 'touch "$1/started"; while [ ! -e "$1/go" ]; do sleep 0.05; done'


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def hashes(logs: Path) -> list[str]:
    return [json.loads(line)["policy_sha256"] for line in lines(logs)]


def replace(policy: Path, text: str) -> None:
    """The swap: a new file renamed over the policy (as an editor saves it)."""
    new = policy.with_suffix(".new")
    new.write_text(text)
    os.replace(new, policy)


@pytest.fixture
def logs(log_dir: Path) -> Path:  # noqa: F811 - test_runlog's (it removes the log's anchor after)
    return log_dir


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    """(the policy file, holding ORIGINAL; the tool's workspace)."""
    (tmp_path / "pol").mkdir()
    (tmp_path / "ws").mkdir()
    policy = tmp_path / "pol" / "p.toml"
    policy.write_text(ORIGINAL)
    return policy, tmp_path / "ws"


def cli_run(logs: Path, command: str, policy: Path, ws: Path, cached: bool,
            swap: bool) -> None:
    """`sandlock COMMAND` of WAIT_FOR_SWAP under ``policy``; ``swap``: the policy
    replaced by REPLACED once the tool has started."""
    for marker in ("started", "go"):
        (ws / marker).unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), runlog.ENV: str(logs)}
    if not cached:
        env["SANDLOCK_NO_CACHE"] = "1"
    argv = [sys.executable, "-P", "-m", "sandlock", command, "--policy", str(policy), "--var",
            f"workspace={ws}", "--", "/bin/sh", "-c", WAIT_FOR_SWAP, "sh", str(ws)]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            assert eventually(lambda: (ws / "started").exists() or process.poll() is not None,
                              limit=30)
            if swap:
                replace(policy, REPLACED)
            (ws / "go").touch()
            _, err = process.communicate(timeout=30)
        finally:
            process.kill()
    assert process.returncode == 0, err


@pytest.mark.parametrize(("command", "cached"), [("run", False), ("run", True), ("trace", False)],
                         ids=["run-compiled", "run-from-cache", "trace"])
def test_cli_records_the_policy_it_ran(logs: Path, places: tuple[Path, Path],
                                       command: str, cached: bool) -> None:
    """`sandlock run` / `trace`: the record of a run whose policy was swapped during it
    names the original bytes (with the cache on, the second run is read back from it;
    `trace` always compiles)."""
    require_abi(1, "sandlock run")
    if command == "trace":
        from sandlock.trace.record import supported

        if supported():
            pytest.skip(f"sandlock trace: {supported()}")
    policy, ws = places
    cli_run(logs, command, policy, ws, cached, swap=False)  # control: unchanged
    cli_run(logs, command, policy, ws, cached, swap=True)
    assert policy.read_text() == REPLACED and sha(REPLACED) != sha(ORIGINAL)
    cli_run(logs, command, policy, ws, cached, swap=False)  # control: the new one ran
    assert hashes(logs) == [sha(ORIGINAL), sha(ORIGINAL), sha(REPLACED)]
    done = verify(logs)
    assert done.returncode == 0 and "3 records: intact" in done.stdout, done.stderr


def test_api_records_the_policy_it_compiled(logs: Path, places: tuple[Path, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A Sandbox compiles its policy once: every record of its runs names those bytes,
    also after the file was replaced."""
    require_abi(1, "the Python API")
    monkeypatch.setenv(runlog.ENV, str(logs))
    policy, ws = places
    with sandlock.Sandbox(str(policy), vars={"workspace": str(ws)}) as box:
        assert box.run(["/bin/true"]).returncode == 0  # control: unchanged
        replace(policy, REPLACED)
        assert box.run(["/bin/true"]).returncode == 0
        with box.popen(["/bin/true"]) as process:
            assert process.wait() == 0
    with sandlock.Sandbox(str(policy), vars={"workspace": str(ws)}) as box:
        assert box.run(["/bin/true"]).returncode == 0  # control: the new one ran
    assert hashes(logs) == [sha(ORIGINAL)] * 3 + [sha(REPLACED)]
    assert runlog.verify() == (4, [])


def test_registry_records_the_policy_it_read(logs: Path, places: tuple[Path, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A Registry reads its files once, when made: a file replaced later is not what runs."""
    require_abi(1, "the Python API")
    monkeypatch.setenv(runlog.ENV, str(logs))
    policy, ws = places
    with sandlock.Registry(str(policy.parent)) as tools:
        replace(policy, REPLACED)
        assert tools.run("p", ["/bin/true"], vars={"workspace": str(ws)}).returncode == 0
    assert hashes(logs) == [sha(ORIGINAL)]


def test_text_and_dict_policies(logs: Path, places: tuple[Path, Path],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy given as TOML text: the hash of that text (no file is read for it, not
    even one that happens to bear its placeholder name); as a dict: none (no bytes)."""
    require_abi(1, "the Python API")
    monkeypatch.setenv(runlog.ENV, str(logs))
    _, ws = places
    monkeypatch.chdir(ws)
    Path(ws, "<string>").write_text(REPLACED)  # what reading the source's name would find
    with sandlock.Sandbox.from_toml(ORIGINAL, vars={"workspace": str(ws)}) as box:
        assert box.run(["/bin/true"]).returncode == 0
    with sandlock.Sandbox({"extends": ["shell"]}, vars={"workspace": str(ws)}) as box:
        assert box.run(["/bin/true"]).returncode == 0
    assert hashes(logs) == [sha(ORIGINAL), None]
