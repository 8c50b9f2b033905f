"""`sandlock probe`: how outcomes are judged, the harness, and the command line.

The judging logic is pure and tested on hand-made outcomes; everything that
runs in a sandbox goes through the real launcher on the real kernel (the full
tables per policy are asserted in test_escape.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import POLICIES, require_abi, sandlock, write_policy
from test_escape import CORE_GAPS

from sandlock.cli.main import cli
from sandlock.policy.model import Access, PathRule, loads_policy
from sandlock.probe import harness as P

READ_FILE = POLICIES / "read_file.toml"


def test_every_payload_probe_has_a_spec_and_back() -> None:
    """The payload and the harness agree on the ids: no probe is run unjudged."""
    ran = re.findall(r'^@probe\("([a-z0-9_.]+)"', P.PAYLOAD.read_text(), re.MULTILINE)
    assert len(ran) == len(set(ran))
    assert set(ran) == set(P.SPEC_BY_ID)
    assert len(P.SPECS) == len(P.SPEC_BY_ID)


def test_payload_is_standalone() -> None:
    """It runs as `python3 -I -S -c`: only the standard library, never sandlock."""
    source = P.PAYLOAD.read_text()
    assert "sandlock." not in re.sub(r'"[^"\n]*"', "", source.split('"""', 2)[2])
    compile(source, str(P.PAYLOAD), "exec")
    # it travels as one argv string: the kernel caps each at MAX_ARG_STRLEN (128 KiB)
    assert len(source.encode()) < 100_000


@pytest.mark.any_user
@pytest.mark.parametrize(("value", "aimed"), [(0, True), (7, True), ("/x", True), (None, False),
                                              (False, False), ("", False)])
def test_an_id_0_is_a_target(value: object, aimed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first SysV object of a fresh machine has id 0: a probe aimed at it runs (it was
    skipped, so one executor's rows differed from another's on a fresh machine). Control:
    None, False and "" still mean nothing to aim at."""
    source = P.PAYLOAD.read_text()
    assert source.endswith("\nmain()\n")
    space: dict[str, object] = {"__name__": "payload"}
    monkeypatch.setattr(sys, "argv", ["payload", json.dumps({"shm_id": value})])
    exec(compile(source[:-len("main()\n")], str(P.PAYLOAD), "exec"), space)  # noqa: S102
    assert space["aimed"]("shm_id") is aimed  # type: ignore[operator]


def rule(path: str, access: Access) -> PathRule:
    return PathRule(path, access, origin="t.toml:1")


def test_path_grant_follows_the_kernel(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    rules = (rule(str(tmp_path / "link"), Access.READ), rule(str(tmp_path / "ab"), Access.WRITE))
    assert P.path_grant(rules, str(tmp_path / "a" / "f"), Access.READ) == rules[0]
    assert P.path_grant(rules, str(tmp_path / "a" / "f"), Access.WRITE) is None
    assert P.path_grant(rules, str(tmp_path / "ab" / "f"), Access.READ) == rules[1]  # write reads
    assert P.path_grant(rules, str(tmp_path / "ab" / "f"), Access.EXEC) is None
    assert P.path_grant(rules, str(tmp_path / "abc"), Access.READ) is None  # not a prefix match


def context(text: str = "version = 1\n", extra: tuple[PathRule, ...] = (),
            root: bool = False, **cfg: object) -> P.Context:
    policy = loads_policy(text)
    base = {"victims": {}, "ports": {"tcp_denied": 1111, "bind_denied": 2222, "udp": 3333}}
    return P.Context(policy, extra, (), root, {**base, **cfg}, os.getpid())


def judge(probe_id: str, outcome: str, ctx: P.Context) -> P.Result:
    return P._judge(P.SPEC_BY_ID[probe_id], outcome, "detail", ctx)


def test_allowed_and_unexplained_is_an_escape() -> None:
    result = judge("net.udp_send", "allowed", context())
    assert result.verdict == P.ESCAPE
    report = P.Report("p", 7, 0, (), (), (result,))
    assert not report.ok and report.counts() == {P.ESCAPE: 1}


def test_allowed_by_the_policy_names_the_entry() -> None:
    ctx = context("version = 1\n[network]\nudp = true\nconnect = [\"1000-2000\"]\n")
    assert judge("net.udp_send", "allowed", ctx).reason == "network.udp = true"
    connect = judge("net.tcp_connect_denied_port", "allowed", ctx)
    assert (connect.verdict, connect.reason) == (P.GRANTED, "network.connect includes 1000-2000")


def test_blocked_and_error() -> None:
    assert judge("kernel.bpf", "blocked", context()).verdict == P.BLOCKED
    error = judge("kernel.bpf", "error", context())
    assert error.verdict == P.ERROR
    assert not P.Report("p", 7, 0, (), (), (error,)).ok


def test_syscall_allow_explains_only_its_own_syscall() -> None:
    ctx = context('version = 1\n[syscalls]\nallow = ["ptrace"]\n')
    assert judge("proc.ptrace_outside", "allowed", ctx).verdict == P.GRANTED
    assert judge("kernel.bpf", "allowed", ctx).verdict == P.ESCAPE


def test_unset_limit_is_granted_but_not_attempted() -> None:
    skipped = judge("limits.memory_bomb", "skipped", context())
    assert (skipped.outcome, skipped.verdict) == ("allowed", P.GRANTED)
    assert "not set" in skipped.reason
    limited = context('version = 1\n[limits]\nprocesses = 10\n', root=True)
    from sandlock.linux import cgroups  # root with a pids cgroup per run: the limit binds

    assert judge("limits.fork_bomb", "allowed", limited).verdict == (
        P.NOT_ENFORCEABLE if cgroups.find()[0] is None else P.ESCAPE)
    user = context('version = 1\n[limits]\nprocesses = 10\n', root=False)
    assert judge("limits.fork_bomb", "allowed", user).verdict == P.ESCAPE


def test_a_path_only_the_probe_added_is_never_the_policys_grant() -> None:
    added = (rule("/usr/lib", Access.READ), rule("/lib64/ld-linux-x86-64.so.2", Access.EXEC))
    ctx = context(extra=added, ld_target="/usr/lib/x86_64-linux-gnu/libc.so.6",
                  loader="/lib64/ld-linux-x86-64.so.2")
    result = judge("exec.ld_so_readable", "allowed", ctx)
    assert result.verdict == P.PROBE_GRANT and "probe's own grant" in result.reason
    # the same attempt under a policy that grants the library itself is a documented limit
    base = context('version = 1\nextends = ["base"]\n', extra=(),
                   ld_target=P._libc(), loader=P._loader())
    assert judge("exec.ld_so_readable", "allowed", base).verdict == P.NOT_ENFORCEABLE


def test_listen_without_bind_is_a_core_gap_only_without_listeners() -> None:
    connect_only = context("version = 1\n[network]\nconnect = [443]\n")
    assert judge("net.tcp_listen_autobind", "allowed", connect_only).verdict == P.ESCAPE
    with_bind = context("version = 1\n[network]\nconnect = [443]\nbind = [8080]\n")
    assert judge("net.tcp_listen_autobind", "allowed", with_bind).verdict == P.NOT_ENFORCEABLE


def test_runtime_rules_add_only_what_is_missing() -> None:
    python = loads_policy('version = 1\nextends = ["python"]\n')
    assert P.runtime_rules(python) == ()
    empty = P.runtime_rules(loads_policy("version = 1\n"))
    assert any(r.access is Access.EXEC and "python3" in r.path for r in empty)
    assert all("added by sandlock probe" in r.origin for r in empty)


def test_harness_sees_effects_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    policy = loads_policy('version = 1\nextends = ["python"]\n')
    with P.Harness(policy, home=str(tmp_path)) as harness:
        assert harness.effects() == {}
        victims = harness.cfg["victims"]
        Path(victims["fs.write_outside"]).write_text("changed")
        os.unlink(victims["fs.delete_outside"])
        Path(victims["fs.create_outside"]).write_text("new")
        os.chmod(victims["fs.chmod_outside"], 0o600)
        assert set(harness.effects()) == {"fs.write_outside", "fs.delete_outside",
                                          "fs.create_outside", "fs.chmod_outside"}
        helper = harness.cfg["helper_pid"]
        os.kill(helper, 0)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ProcessLookupError):
        os.kill(helper, 0)


# ---------------------------------------------------------------------------
# The command line (real kernel)


def test_probe_plain_text(workspace: Path) -> None:
    require_abi(6, "probing the shipped policies")
    done = sandlock("probe", "--policy", str(READ_FILE), "--var", f"workspace={workspace}")
    lines = done.stdout.splitlines()
    assert "# escape attempts" in lines
    rows = [line.split("\t") for line in lines if "\t" in line]
    assert {row[0] for row in rows} == set(P.SPEC_BY_ID)
    assert all(len(row) == 3 for row in rows)
    verdicts = {r[0]: r[1] for r in rows}
    assert verdicts["fs.read_outside"] == "blocked"
    escapes = {i for i, v in verdicts.items() if v == "ESCAPE"}
    assert escapes <= set(CORE_GAPS), escapes
    assert done.returncode == (1 if escapes else 0), done.stderr
    assert lines[-1].endswith(": FAILED" if escapes else ": OK")
    assert "added so the probe's Python can start" in done.stdout


def test_probe_table_on_a_terminal(workspace: Path) -> None:
    """Aligned columns under a header on a terminal (tab-separated lines otherwise)."""
    require_abi(6, "probing the shipped policies")
    master, slave = os.openpty()
    env = {**os.environ, "COLUMNS": "160", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "sandlock", "probe", "--policy",
                             str(READ_FILE), "--var", f"workspace={workspace}"],
                            stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(60) in (0, 1), proc.stderr.read() if proc.stderr else ""
    text = out.decode(errors="replace")
    lines = text.replace("\r\n", "\n").splitlines()
    header = lines.index("escape attempts") + 1
    assert lines[header].split() == ["probe", "verdict", "why"], lines[header]
    assert set(lines[header + 1]) == {"-", " "} and "\t" not in text
    assert "fs.read_outside" in text and "kernel.i386_int80" in text
    if proc.stderr:
        proc.stderr.close()


def test_probe_bad_policy_is_125(tmp_path: Path) -> None:
    bad = write_policy(tmp_path, "version = 1\n[filesystem]\nread = ['relative']\n")
    done = sandlock("probe", "--policy", str(bad))
    assert done.returncode == 125
    assert "not absolute" in done.stderr
    undefined = sandlock("probe", "--policy", str(READ_FILE))
    assert undefined.returncode == 125 and "undefined variable ${workspace}" in undefined.stderr


def test_probe_strict_refuses_like_run(workspace: Path, tmp_path: Path) -> None:
    """On a kernel without TCP port rules (ABI 3; no substitute) the probe refuses to
    start, exactly as run does; at ABI 5 the signal gate stands in for the signal scope
    and both run, every attempt blocked."""
    tcp = write_policy(tmp_path, f'extends = ["{READ_FILE}"]\n[network]\nconnect = [443]\n')
    env = {**os.environ, "SANDLOCK_ABI": "3"}
    probe = sandlock("probe", "--policy", str(tcp), "--var", f"workspace={workspace}", env=env)
    run = sandlock("run", "--policy", str(tcp), "--var", f"workspace={workspace}", "--",
                   "cat", str(workspace / "notes.md"), env=env)
    assert probe.returncode == run.returncode == 125
    assert "TCP port restriction" in probe.stderr and "TCP port restriction" in run.stderr
    env = {**os.environ, "SANDLOCK_ABI": "5"}
    probe = sandlock("probe", "--policy", str(READ_FILE), "--var", f"workspace={workspace}",
                     env=env)
    assert probe.returncode == 0, probe.stdout + probe.stderr


def test_best_effort_gaps_are_reported_not_hidden(tmp_path: Path, workspace: Path) -> None:
    """Pretend an ABI 3 kernel: TCP ports cannot be restricted, and the probe says so."""
    require_abi(4, "pretending an older ABI than the real one")
    policy = write_policy(tmp_path, 'version = 1\ncompat = "best-effort"\nextends = ["python"]\n'
                                    "[network]\nconnect = [1]\n[scope]\nsignals = false\n")
    done = sandlock("probe", "--policy", str(policy), "--json",
                    env={**os.environ, "SANDLOCK_ABI": "3"})
    report = json.loads(done.stdout)
    rows = {r["id"]: r for r in report["results"]}
    assert report["abi"] == 3 and any("TCP port" in g for g in report["not_enforced"])
    for probe_id in ("net.tcp_connect_denied_port", "net.tcp_bind_denied_port"):
        assert rows[probe_id]["outcome"] == "allowed"
        assert rows[probe_id]["verdict"] == P.NOT_ENFORCEABLE
        assert "not enforceable on this kernel: TCP port restriction" in rows[probe_id]["reason"]
    assert rows["proc.signal_outside"]["verdict"] == P.GRANTED
    assert done.returncode == (0 if report["ok"] else 1)


def test_probe_exit_code_follows_the_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 1 on an escape (the judging is tested above; this is the CLI contract)."""
    escape = P.Result("net.udp_send", "send", "allowed", P.ESCAPE, "not granted", "sent")
    fine = P.Result("kernel.bpf", "bpf", "blocked", P.BLOCKED, "", "EPERM")
    for rows, code in (((fine,), 0), ((fine, escape), 1)):
        report = P.Report("p.toml", 7, 0, (), (), rows)
        monkeypatch.setattr(P, "probe_file", lambda *a, report=report, **k: report)
        result = CliRunner().invoke(cli, ["probe", "--policy", "p.toml", "--json"])
        assert result.exit_code == code, result.output
        assert json.loads(result.output)["ok"] is (code == 0)
