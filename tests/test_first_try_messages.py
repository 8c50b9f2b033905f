"""What a new user sees on a first try (issue 23): every refusal and every death named,
every suggestion one that `sandlock run` accepts, warnings where a policy opens more than
it seems to. Real runs through the CLI, as root and as an ordinary user."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import run_confined, sandlock, write_policy

from sandlock.cli.main import cli
from sandlock.policy.model import loads_policy

UNSHARE = shutil.which("unshare")
SHELL = """\
extends = ["base"]
[filesystem]
exec = ["/usr/bin", "/usr/lib"]
"""
NAMESPACES = SHELL + """\
[syscalls]
allow = ["unshare", "clone", "clone3", "setns"]
"""


# -- item 7: namespaces allowed by [syscalls] allow; layers listed once ----------------


def test_namespace_syscalls_warned_by_validate_and_explain(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, NAMESPACES)
    runner = CliRunner()
    validated = runner.invoke(cli, ["validate", str(policy)], catch_exceptions=False)
    assert validated.exit_code == 0
    assert f"warning: {policy}:5: syscalls.allow: unshare, clone, clone3, setns" in validated.stderr
    explained = runner.invoke(cli, ["explain", "--policy", str(policy)], catch_exceptions=False)
    assert explained.exit_code == 0
    assert "WARNING" in explained.stdout and "namespaces" in explained.stdout
    quiet = write_policy(tmp_path, SHELL, name="quiet.toml")  # the control: no allow, no word
    assert "create or join" not in runner.invoke(cli, ["validate", str(quiet)]).stderr
    assert "WARNING" not in runner.invoke(cli, ["explain", "--policy", str(quiet)]).stdout


@pytest.mark.skipif(UNSHARE is None, reason="needs unshare(1) (util-linux)")
def test_namespace_syscalls_warned_when_run_compiles(tmp_path: Path) -> None:
    """The warning comes with the run that compiles the policy; the confined
    ``unshare -U`` it warns about does work; without the allow it is refused."""
    assert UNSHARE is not None
    unconfined = subprocess.run([UNSHARE, "-U", "true"], capture_output=True, text=True)
    if unconfined.returncode != 0:  # a chroot, or user namespaces turned off
        pytest.skip(f"unshare -U fails here unconfined too: {unconfined.stderr.strip()}")
    policy = write_policy(tmp_path, NAMESPACES)
    first = run_confined(policy, [UNSHARE, "-U", "true"])
    assert "create or join namespaces" in first.stderr
    assert first.returncode == 0, first.stderr
    control = run_confined(write_policy(tmp_path, SHELL, name="shell.toml"), [UNSHARE, "-U", "true"])
    assert control.returncode != 0 and "namespaces" not in control.stderr


def test_diamond_extends_lists_and_merges_each_layer_once(tmp_path: Path) -> None:
    """``cc`` extends base and tmpdir, which extends base again: base is listed once, and
    a scalar set between two mentions of base is not overridden by the second."""
    policy = loads_policy('extends = ["cc"]', {"private_tmp": str(tmp_path)})
    assert policy.layers.count("<builtin:base>") == 1
    write_policy(tmp_path, 'compat = "strict"\n', name="base.toml")
    write_policy(tmp_path, 'extends = ["base.toml"]\ncompat = "best-effort"\n', name="mid.toml")
    write_policy(tmp_path, 'extends = ["base.toml"]\n', name="other.toml")
    top = write_policy(tmp_path, 'extends = ["mid.toml", "other.toml"]\n', name="top.toml")
    from sandlock.policy.model import Compat, load_policy

    merged = load_policy(top)
    assert [Path(layer).name for layer in merged.layers] == ["base.toml", "mid.toml",
                                                             "other.toml", "top.toml"]
    assert merged.compat is Compat.BEST_EFFORT


# -- item 5: a tool killed by a signal -------------------------------------------------


def test_signal_death_named(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, SHELL)
    done = run_confined(policy, ["sh", "-c", "kill -ABRT $$"])
    assert done.returncode == 134
    assert done.stderr.strip().splitlines()[-1] == "sandlock: sh was killed by SIGABRT (exit 134)"
    piped = run_confined(policy, ["sh", "-c", "kill -PIPE $$"])  # as a shell: no word
    assert piped.returncode == 141 and piped.stderr == ""


def test_signal_of_a_limit_names_the_limit(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, SHELL + "[limits]\nfile_size = 1024\ncpu = 1\n")
    variables = {"out": str(tmp_path / "big")}
    done = run_confined(policy, ["sh", "-c", "kill -XFSZ $$"], variables=variables)
    assert done.returncode == 128 + 25
    assert "killed by SIGXFSZ (exit 153); [limits] file_size" in done.stderr
    spun = run_confined(policy, ["sh", "-c", "while :; do :; done"], timeout=30)
    assert spun.returncode in (128 + 9, 128 + 24)
    assert "[limits] cpu" in spun.stderr
    plain = run_confined(write_policy(tmp_path, SHELL, name="plain.toml"),
                         ["sh", "-c", "kill -XFSZ $$"])  # no limit: no hint
    assert "killed by SIGXFSZ" in plain.stderr and "[limits]" not in plain.stderr


def test_signal_name_escaped(tmp_path: Path) -> None:
    """The tool's name is the user's text: a control character in it is escaped."""
    link = tmp_path / "a\x1b[2Jb"
    link.symlink_to("/bin/sh")
    policy = write_policy(tmp_path, SHELL + f'read = ["{tmp_path}"]\n')
    done = sandlock("run", "--policy", str(policy), "--", str(link), "-c", "kill -TERM $$")
    assert "\x1b" not in done.stderr
    assert "a\\x1b[2Jb was killed by SIGTERM" in done.stderr


# -- item 8: one name for a denial's policy line ----------------------------------------


def test_denial_grant_is_one_name() -> None:
    from sandlock.trace.record import Denial

    denial = Denial("read", "/etc/x", -1, "", "filesystem", 'read += "/etc/x"')
    assert denial.grant == 'read += "/etc/x"' == denial.as_dict()["grant"]
    assert denial.line == denial.grant  # the former name still reads
    assert str(denial) == 'denied read /etc/x -> [filesystem] read += "/etc/x"'


# -- item 10: the per-user process limit is named only when it can bite -----------------


def _per_user_limit_or_skip() -> None:
    import os

    from sandlock.linux import cgroups

    if os.getuid() == 0:
        pytest.skip("as root RLIMIT_NPROC does not bind: that gap is refused in strict mode")
    if cgroups.find()[0] is not None:
        pytest.skip("this user can create a pids cgroup: the limit is per sandbox, no gap")


def test_process_limit_per_user_quiet_unless_it_can_bite(tmp_path: Path) -> None:
    import os
    import subprocess

    from sandlock.linux.process import user_tasks

    _per_user_limit_or_skip()
    limit = 2 * user_tasks(os.getuid()) + 60
    policy = write_policy(tmp_path, SHELL + f"[limits]\nprocesses = {limit}\n")
    quiet = run_confined(policy, ["true"])
    assert quiet.returncode == 0 and quiet.stderr == ""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(40)]
    try:
        loud = run_confined(policy, ["true"])
    finally:
        for each in sleepers:
            each.kill()
            each.wait()
    assert loud.returncode == 0
    lines = loud.stderr.splitlines()
    assert len(lines) == 1 and f"process limit (processes = {limit}) not enforced" in lines[0]
    explained = CliRunner().invoke(cli, ["explain", "--policy", str(policy)])
    assert "RLIMIT_NPROC" in explained.stdout  # the fact stays in explain


# -- item 2: an exec refused through a link names the file the link leads to ------------


def _venv(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A venv's ``bin/sh`` links (twice) to an interpreter elsewhere, as a pyenv venv's
    python3 does; ``bin/tool`` is a script run by it."""
    versions = tmp_path / "versions"
    versions.mkdir()
    real = versions / "sh3.11"
    shutil.copy2("/bin/sh", real)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "sh3").symlink_to(real)
    (venv / "sh").symlink_to("sh3")
    tool = venv / "tool"
    tool.write_text(f"#!{venv / 'sh'}\necho ran\n")
    tool.chmod(0o755)
    return venv, tool, real


def test_exec_refused_through_a_link_names_its_target(tmp_path: Path) -> None:
    venv, tool, real = _venv(tmp_path)
    policy = write_policy(tmp_path, SHELL.replace(
        'exec = ["/usr/bin", "/usr/lib"]', f'exec = ["/usr/bin", "/usr/lib", "{venv}"]'),
        name="venv.toml")
    done = run_confined(policy, [str(tool)])
    assert done.returncode == 126, done.stderr
    assert f'{real} (#! interpreter of {tool}, reached through {venv / "sh"} -> ' \
           f'{venv / "sh3"}) has no read or exec grant: [filesystem] exec += "{real}"' \
        in done.stderr, done.stderr
    assert f'exec += "{venv / "sh"}"' not in done.stderr  # granted already: never suggested
    granted = write_policy(tmp_path, SHELL.replace(
        'exec = ["/usr/bin", "/usr/lib"]', f'exec = ["/usr/bin", "/usr/lib", "{venv}", "{real}"]'),
        name="granted.toml")  # the control: the suggested grant is the one that was missing
    ran = run_confined(granted, [str(tool)])
    assert ran.returncode == 0 and ran.stdout == "ran\n", ran.stderr


# -- item 4: trace never suggests a grant run refuses; dangerous ones come with a WARNING --


def _trace_cli(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    from test_trace import cli

    return cli(args, cwd, home)


def test_trace_suggests_only_grants_run_accepts(tmp_path: Path, work: Path, home: Path) -> None:
    (home / ".ssh" / "config").write_text("Host *\n")
    shared = Path("/var/tmp")
    strict = write_policy(tmp_path, SHELL, name="strict.toml")
    script = (f"echo 1 > /proc/self/oom_score_adj; cat /proc/self/status; cat {home}/.ssh/config; "
              f"echo x > {shared}/sandlock-first-try-$$; cat {sandlock_dir()}/__init__.py")
    traced = _trace_cli(["trace", "--json", "--report", "-", "--policy", str(strict), "--",
                         "sh", "-c", script], work, home)
    denials = json.loads(traced.stdout)["denials"]
    by_path = {d["path"]: d for d in denials}
    # the attempts ran and were refused (each one is in the report) ...
    assert {"/proc/self/oom_score_adj", f"{home}/.ssh/config", str(shared)} <= set(by_path)
    # ... /proc: no line (the loader refuses it), never `write += "/proc"`
    assert by_path["/proc/self/oom_score_adj"]["grant"] == \
        "(no policy line: write access to '/proc' is never allowed)"
    # ... the secret and the shared temporary directory: a WARNING saying what they expose
    assert "a place of secrets" in by_path[f"{home}/.ssh/config"]["warning"]
    assert "/proc whole" in by_path["/proc/self/status"]["warning"]  # as learn says it
    assert "shared with every other program" in by_path[str(shared)]["warning"]
    # every line suggested is one `run` accepts (and `explain` does not refuse)
    for denial in denials:
        if denial["grant"].startswith("("):
            continue
        key, _, value = denial["grant"].partition(" += ")
        body = (SHELL.replace('"/usr/lib"]', f'"/usr/lib", {value}]') if key == "exec"
                else SHELL + f"{key} = [{value}]\n")
        granted = write_policy(tmp_path, body, name="granted.toml")
        done = _trace_cli(["run", "--policy", str(granted), "--", "true"], work, home)
        assert done.returncode == 0, (denial, done.stderr)
    text = _trace_cli(["trace", "--policy", str(strict), "--", "sh", "-c", script], work, home)
    assert 'write += "/proc"' not in text.stderr
    assert "(WARNING: exposes" in text.stderr


def sandlock_dir() -> str:
    import sandlock

    return str(Path(sandlock.__file__).parent)


# -- item 6: learn's drafts work for another user and elsewhere, and agree with themselves --


def test_learn_draft_names_home_as_tilde_and_the_workspace_by_var(
        tmp_path: Path, work: Path, home: Path) -> None:
    (home / ".toolrc").write_text("setting\n")
    out = tmp_path / "draft.toml"
    argv = ["/bin/sh", "-c", 'cat "$HOME/.toolrc" > copy.txt']
    learned = _trace_cli(["learn", "-o", str(out), "--", *argv], work, home)
    assert learned.returncode == 0, learned.stderr
    text = out.read_text()
    assert '"~/.toolrc"' in text and f'"{home}/.toolrc"' not in text
    assert '"${workspace}"' in text and "${cwd}" not in text.replace("(as ${cwd} would)", "")
    assert f"--var workspace={work.resolve()}" in learned.stderr  # the suggested command
    # another user (another HOME) with its own file, run from elsewhere: the draft holds
    other = tmp_path / "other-home"
    other.mkdir()
    (other / ".toolrc").write_text("theirs\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ran = _trace_cli(["run", "--policy", str(out), "--var", f"workspace={work.resolve()}", "--",
                      "/bin/sh", "-c", f'cat "$HOME/.toolrc" > {work}/copy.txt'], elsewhere, other)
    assert ran.returncode == 0, ran.stderr
    assert (work / "copy.txt").read_text() == "theirs\n"
    # the working directory of a run is not granted: only the directory named by --var
    moved = _trace_cli(["run", "--policy", str(out), "--var", f"workspace={work.resolve()}", "--",
                        "/bin/sh", "-c", "echo x > here.txt"], elsewhere, other)
    assert moved.returncode != 0 and not (elsewhere / "here.txt").exists()
    unnamed = _trace_cli(["run", "--policy", str(out), "--", *argv], work, home)
    assert unnamed.returncode == 125 and "--var workspace=" in unnamed.stderr


def test_learn_draft_grants_proc_whole_or_not_at_all(tmp_path: Path, work: Path,
                                                     home: Path) -> None:
    out = tmp_path / "draft.toml"
    learned = _trace_cli(["learn", "-o", str(out), "--", "/bin/sh", "-c",
                          "cat /proc/self/status /proc/filesystems >/dev/null; ls /proc >/dev/null"],
                         work, home)
    assert learned.returncode == 0, learned.stderr
    text = out.read_text()
    assert '"/proc",' in text  # granted whole (the /proc entries of processes), with a WARNING
    assert "listed /proc" not in text and '"/proc/filesystems"' not in text, text


def test_learn_from_home_is_refused_with_a_reason(work: Path, home: Path) -> None:
    learned = _trace_cli(["learn", "--", "/bin/true"], home, home)
    assert learned.returncode == 125
    assert "is your home directory" in learned.stderr and "project directory" in learned.stderr
    assert "<learn>" not in learned.stderr and "Traceback" not in learned.stderr


# -- item 11: probe's neighbour check does not fill a neighbour with this run's --var -----


def test_probe_neighbour_warning_ignores_shared_variables(tmp_path: Path) -> None:
    from sandlock.policy.model import load_policy
    from sandlock.probe.harness import later_run_findings

    policies = tmp_path / "policies"
    policies.mkdir()
    workspace = tmp_path / "ws"
    (workspace / "bin").mkdir(parents=True)
    browser = write_policy(policies, 'extends = ["base"]\n[filesystem]\nwrite = ["${workspace}"]\n',
                           name="chromium.toml")
    write_policy(policies, 'extends = ["base"]\n[filesystem]\nexec = ["${workspace}/bin"]\n',
                 name="make.toml")
    variables = {"workspace": str(workspace)}
    assert later_run_findings(load_policy(browser, variables), variables) == ()
    # the control: the neighbour's exec grant names that directory itself: still said
    write_policy(policies, f'extends = ["base"]\n[filesystem]\nexec = ["{workspace}/bin"]\n',
                 name="make.toml")
    (finding,) = later_run_findings(load_policy(browser, variables), variables)
    assert "covers another policy's exec grant" in finding and "make.toml" in finding


# -- item 12: Chromium needs --no-sandbox under sandlock ---------------------------------


def test_chromium_failing_gets_the_no_sandbox_hint(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("chromium", "other"):  # a stand-in that fails as Chromium's sandbox does
        fake = bin_dir / name
        fake.write_text("#!/bin/sh\necho 'FATAL:zygote_host_impl_linux.cc No usable sandbox!' >&2\n"
                        'for a; do [ "$a" = --no-sandbox ] && exit 0; done; exit 1\n')
        fake.chmod(0o755)
    policy = write_policy(tmp_path, SHELL.replace('"/usr/lib"]', f'"/usr/lib", "{bin_dir}"]'))
    failed = run_confined(policy, [str(bin_dir / "chromium"), "--headless"])
    assert failed.returncode == 1 and "pass --no-sandbox" in failed.stderr
    ran = run_confined(policy, [str(bin_dir / "chromium"), "--headless", "--no-sandbox"])
    assert ran.returncode == 0 and "pass --no-sandbox" not in ran.stderr
    other = run_confined(policy, [str(bin_dir / "other")])
    assert other.returncode == 1 and "no-sandbox" not in other.stderr


# -- item 3 (part): under [network] allow, the network hint only when the network refused --


def test_allowlist_hint_only_when_a_connection_was_refused(tmp_path: Path) -> None:
    from conftest import PYTHON as python
    from conftest import require_abi

    require_abi(4, "TCP rules under the connect gate")
    policy = write_policy(tmp_path, 'extends = ["python"]\n[network]\nallow = ["example.test"]\n')
    plain = run_confined(policy, [python, "-c", "raise SystemExit(3)"])
    assert plain.returncode == 3
    assert "through sandlock's proxy" not in plain.stderr
    assert "no connection was refused" in plain.stderr
    direct = run_confined(policy, [python, "-c", textwrap.dedent("""\
        import socket
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=5)
        except OSError:
            raise SystemExit(3)
        """)])
    assert direct.returncode == 3
    assert "network: refused" in direct.stderr and "through sandlock's proxy" in direct.stderr
