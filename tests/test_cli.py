"""The command line: exit codes and messages of every subcommand.

In-process through click's CliRunner where nothing forks; `run` through the real
entry point (it forks and execs). The SANDLOCK_ABI tests run the real kernel with
a pretend-older Landlock ABI, to show strict refusal and best-effort warnings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import ABI, POLICIES, require_abi, run_confined, sandlock, write_policy

from sandlock import __version__
from sandlock.cli import launch
from sandlock.cli.main import cli
from sandlock.compile.ruleset import ENV_ABI, IOCTL_HOW, SIGNAL_HOW
from sandlock.errors import PolicyError
from sandlock.policy.model import load_policy

READ_FILE = POLICIES / "read_file.toml"
WORKSPACE_LINE = 1 + READ_FILE.read_text().splitlines().index('read = ["${workspace}"]')


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


@pytest.fixture(autouse=True)
def real_abi(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that want a pretend ABI set it themselves."""
    monkeypatch.delenv(ENV_ABI, raising=False)


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_ABI}
    env.update(extra)
    return env


# ---------------------------------------------------------------------------
# --version, --help


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"sandlock, version {__version__}\n"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_commands_and_examples(flag: str) -> None:
    result = invoke(flag)
    assert result.exit_code == 0
    for word in ("run", "check", "explain", "validate", "policies", "Examples:",
                 "sandlock run --policy policies/read_file.toml --var workspace=$PWD -- cat"):
        assert word in result.stdout


def test_run_help_documents_options_and_exit_codes() -> None:
    result = invoke("run", "--help")
    assert result.exit_code == 0
    for word in ("--policy", "--var NAME=VALUE", "--timeout", "--best-effort", "124 timeout",
                 "125 sandlock failed", "126 not executable", "127 not found"):
        assert word in result.stdout


def test_run_help_through_the_fast_entry_point() -> None:
    result = sandlock("run", "--help")
    assert result.returncode == 0
    assert "Usage: sandlock run [OPTIONS] COMMAND..." in result.stdout


# ---------------------------------------------------------------------------
# check


def test_check_table() -> None:
    result = invoke("check")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == f"# Kernel {os.uname().release} (Landlock ABI {ABI})"
    second = next(i for i, line in enumerate(lines) if i and line.startswith("# "))
    features = {line.split("\t")[0]: line.split("\t")[1] for line in lines[1:second]}
    assert features["Landlock"] == ("yes" if ABI else "no")
    assert lines[second].startswith("# Gaps a strict policy may accept by name")
    assert lines[second + 1].split("\t")[0] == "tcp-ports"
    assert {"seccomp filters", "seccomp user notification", "unprivileged user namespaces",
            "Landlock TCP bind/connect rules"} <= set(features)


def test_check_json() -> None:
    result = invoke("check", "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["landlock_abi"] == ABI == report["abi_in_use"]
    assert report["kernel"] == os.uname().release
    assert all(set(f) == {"feature", "available", "detail"} for f in report["features"])
    seccomp = next(f for f in report["features"] if f["feature"] == "seccomp filters")
    assert seccomp["available"] is True


def test_check_json_with_pretend_abi() -> None:
    require_abi(4, "pretending ABI 3 on a newer kernel")
    report = json.loads(invoke("check", "--json", env={ENV_ABI: "3"}).stdout)
    assert (report["landlock_abi"], report["abi_in_use"]) == (ABI, 3)
    available = {f["feature"]: f["available"] for f in report["features"]}
    assert available["Landlock TRUNCATE (truncate restriction)"] is True
    assert available["Landlock TCP bind/connect rules"] is False


def test_check_with_a_bad_abi_override() -> None:
    result = invoke("check", env={ENV_ABI: "x"})
    assert (result.exit_code, result.stderr) == (125, "sandlock: SANDLOCK_ABI='x' is not an integer\n")


# ---------------------------------------------------------------------------
# explain


def test_explain_json(tmp_path: Path) -> None:
    result = invoke("explain", "--policy", str(READ_FILE), "--var", f"workspace={tmp_path}",
                    "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["layers"] == ["<builtin:base>", str(READ_FILE)]
    assert report["source"] == str(READ_FILE)
    assert report["compat"] == "strict"
    assert report["abi"] == ABI
    assert {"access": "read", "path": str(tmp_path), "optional": False,
            "origin": f"{READ_FILE}:{WORKSPACE_LINE} filesystem.read[0]"} in report["paths"]
    assert {"access": "exec", "path": "/usr/bin/cat"} in [
        {k: p[k] for k in ("access", "path")} for p in report["paths"]]
    assert report["network"] == {"connect": [], "bind": [], "udp": False, "unix": False,
                                 "allow": [], "deny": [], "hosts": {}}
    assert report["env"] == {"pass": ["PATH", "LANG", "LC_*", "TERM", "TZ"], "set": {}}
    assert report["limits"] == {"timeout": 30.0, "file_size": 2**20}
    assert "ptrace" in report["seccomp"]["denied"]
    if ABI >= 6:
        assert report["not_enforced"] == []


def test_explain_json_not_enforced_under_abi_3(tmp_path: Path) -> None:
    require_abi(4, "pretending ABI 3 on a newer kernel")
    policy = write_policy(tmp_path, """\
        version = 1
        extends = ["base"]
        [network]
        connect = [443]
    """)
    result = invoke("explain", "--policy", str(policy), "--json", env={ENV_ABI: "3"})
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["abi"] == 3
    assert report["network"]["connect"] == ["443"]
    assert report["not_enforced"] == [
        ("TCP port restriction (needs Landlock ABI 4): TCP connect/bind is possible to and on any "
         "port, not only the granted ones"),
    ]
    # below ABI 6 the signal scope has its substitute, the signal gate; below ABI 5 the
    # device ioctl restriction has its own (the profile reads directories where root may
    # have made device nodes)
    assert [(p["protection"], p["enforced_by"].split(":")[0]) for p in report["protections"]] == [
        ("filesystem confinement", "Landlock (ABI 1+)"), ("truncate restriction", "Landlock (ABI 3+)"),
        ("TCP port restriction", "not enforced"), ("device ioctl restriction", "substitute"),
        ("signal scope", "substitute")]
    assert report["substitutes"] == [
        f"signal scope (Landlock ABI 6+ enforces it): substitute: {SIGNAL_HOW}",
        f"device ioctl restriction (Landlock ABI 5+ enforces it): substitute: {IOCTL_HOW}"]


def test_explain_text_without_description(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, "version = 1\n")
    result = invoke("explain", "--policy", str(policy))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"policy: {policy}"


def test_explain_text(tmp_path: Path) -> None:
    require_abi(6, "a policy fully enforced on this kernel")
    result = invoke("explain", "--policy", str(READ_FILE), "--var", f"workspace={tmp_path}")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert f"layers: <builtin:base> -> {READ_FILE}" in out
    assert f"read\t{tmp_path}\t{READ_FILE}:{WORKSPACE_LINE} filesystem.read[0]" in out
    assert "network: tcp connect none; tcp bind none; udp no; unix sockets no" in out
    assert "Everything this policy relies on is enforced on this kernel." in out


def test_explain_text_under_abi_3(tmp_path: Path) -> None:
    require_abi(4, "pretending ABI 3 on a newer kernel")
    result = invoke("explain", "--policy", str(READ_FILE), "--var", f"workspace={tmp_path}",
                    env={ENV_ABI: "3"})
    assert result.exit_code == 0
    assert "kernel Landlock ABI: 3" in result.stdout
    assert f"signal scope: substitute: {SIGNAL_HOW}\n" in result.stdout
    assert "truncate restriction: Landlock (ABI 3+)\n" in result.stdout
    assert "Everything this policy relies on is enforced on this kernel." in result.stdout
    tcp = write_policy(tmp_path, """\
        version = 1
        [network]
        connect = [443]
    """)
    result = invoke("explain", "--policy", str(tcp), env={ENV_ABI: "3"})
    assert ("NOT enforced on this kernel:\n  - TCP port restriction (needs Landlock ABI 4)"
            in result.stdout)
    assert "strict mode: `sandlock run` will refuse to start with this policy here." in result.stdout


def test_explain_errors(tmp_path: Path) -> None:
    missing = invoke("explain")
    assert missing.exit_code == 125
    assert missing.stderr == "sandlock: missing --policy FILE\n"
    undefined = invoke("explain", "--policy", str(READ_FILE))
    assert undefined.exit_code == 125
    assert "filesystem.read[0]: undefined variable ${workspace}" in undefined.stderr
    bad_var = invoke("explain", "--policy", str(READ_FILE), "--var", "workspace")
    assert bad_var.exit_code == 125
    assert bad_var.stderr == "sandlock: --var expects NAME=VALUE, got 'workspace'\n"


# ---------------------------------------------------------------------------
# A bad policy: exit 125 and the library's message, whichever command reads it

BAD_POLICIES = {
    "unknown key": "version = 1\n[filesystem]\nreed = []\n",
    "bad size": '[limits]\nmemory = "lots"\n',
    "bad port": "[network]\nconnect = [1, 70000]\n",
    "write on /": '[filesystem]\nwrite = ["/"]\n',
    "syntax": "version = 1\nextends = [\n",
    "relative path": '[filesystem]\nread = ["data"]\n',
    "cycle": 'extends = ["policy.toml"]\n',
}


def expected_message(path: Path) -> str:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return f"sandlock: {info.value}\n"


@pytest.mark.parametrize("name", list(BAD_POLICIES))
def test_bad_policy_in_explain_and_validate(tmp_path: Path, name: str) -> None:
    path = write_policy(tmp_path, BAD_POLICIES[name])
    message = expected_message(path)
    explained = invoke("explain", "--policy", str(path))
    assert (explained.exit_code, explained.stderr) == (125, message)
    validated = invoke("validate", str(path))
    assert (validated.exit_code, validated.stderr, validated.stdout) == (125, message, "")


@pytest.mark.parametrize("name", ["unknown key", "write on /", "syntax"])
def test_bad_policy_in_run(tmp_path: Path, name: str) -> None:
    path = write_policy(tmp_path, BAD_POLICIES[name])
    marker = tmp_path / "ran"
    result = run_confined(path, ["/usr/bin/touch", str(marker)])
    assert result.returncode == 125
    assert result.stderr == expected_message(path)
    assert not marker.exists()


def test_missing_policy_file_in_run(tmp_path: Path) -> None:
    result = run_confined(tmp_path / "nope.toml", ["true"])
    assert (result.returncode, result.stderr) == (
        125, f"sandlock: {tmp_path / 'nope.toml'}: policy file does not exist\n")


# ---------------------------------------------------------------------------
# validate


def test_validate_shipped_policies() -> None:
    files = sorted(str(p) for p in POLICIES.glob("*.toml"))
    result = invoke("validate", *files)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [f"{f}: ok" for f in files]


def test_validate_reports_every_file(tmp_path: Path) -> None:
    good = write_policy(tmp_path, 'extends = ["base"]\n[filesystem]\nread = ["${data}"]\n',
                        "good.toml")
    unknown = write_policy(tmp_path, '[syscalls]\ndeny = ["notasyscall"]\n', "unknown.toml")
    useless = write_policy(tmp_path, '[syscalls]\nallow = ["read"]\n', "useless.toml")
    result = invoke("validate", str(unknown), str(good), str(useless), str(tmp_path / "no.toml"))
    assert result.exit_code == 125
    assert result.stdout == f"{good}: ok\n"
    errors = result.stderr.splitlines()
    assert errors[0].startswith(f"sandlock: {unknown}: syscalls.deny: unknown syscall "
                                "'notasyscall' on ")
    assert errors[1].startswith(f"sandlock: {useless}: syscalls.allow: 'read' is not denied by "
                                "default")
    assert errors[2] == f"sandlock: {tmp_path / 'no.toml'}: policy file does not exist"
    assert len(errors) == 3


def test_validate_does_not_need_paths_or_variables(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, '[filesystem]\nread = ["/no/such/dir", "${ws}/x"]\n')
    assert invoke("validate", str(policy)).exit_code == 0
    assert invoke("validate", "--var", "ws=relative", str(policy)).exit_code == 125


def test_validate_needs_a_file() -> None:
    assert invoke("validate").exit_code == 2  # click usage error


THREE_ERRORS = """\
version = 1
colour = "red"
[network]
connect = [0]
[env]
pass = ["BAD-NAME"]
"""


def test_validate_reports_every_schema_error_of_a_file(tmp_path: Path) -> None:
    bad = write_policy(tmp_path, THREE_ERRORS, "bad.toml")
    result = invoke("validate", str(bad))
    assert (result.exit_code, result.stdout) == (125, "")
    assert result.stderr.splitlines() == [
        f"sandlock: {bad}:2: colour: unknown key (expected one of: version, description, extends, "
        "compat, accept, filesystem, network, scope, env, limits, syscalls, credentials, mcp)",
        f"sandlock: {bad}:4: network.connect[0]: invalid port range 0: ports are 1-65535, "
        "low <= high",
        f"sandlock: {bad}:6: env.pass[0]: invalid variable name or glob 'BAD-NAME'"]


def test_validate_reads_a_registry_directory_and_goes_on(tmp_path: Path) -> None:
    """A directory is a registry as ``run --policies`` reads it; an empty one is one error
    line, and the other arguments are still checked."""
    registry = tmp_path / "tools"
    registry.mkdir()
    good = write_policy(registry, 'extends = ["base"]\n[filesystem]\nread = ["${workspace}"]\n',
                        "read_file.toml")
    bad = write_policy(registry, THREE_ERRORS, "shell.toml")
    empty = tmp_path / "empty"
    empty.mkdir()
    single = write_policy(tmp_path, "version = 1\n", "single.toml")
    result = invoke("validate", str(registry), str(empty), str(single))
    assert result.exit_code == 125
    assert result.stdout.splitlines() == [f"{good}: ok", f"{single}: ok"]
    errors = result.stderr.splitlines()
    assert len(errors) == 4, result.stderr
    assert all(line.startswith(f"sandlock: {bad}:") for line in errors[:3]), errors
    assert errors[3] == (f"sandlock: {empty}: no tools found (expected NAME.toml files, "
                         "or [tools.NAME] tables)")


def test_validate_reads_a_tools_file_as_run_does(tmp_path: Path) -> None:
    tools = write_policy(tmp_path, """\
        [tools.read_file]
        extends = ["base"]
        filesystem.read = ["${workspace}"]

        [tools.shell]
        colour = "red"
        network.connect = [0]

        [tools.grep]
        extends = ["no-such-profile"]

        [tools.ls]
        extends = ["base"]
        """, "tools.toml")
    result = invoke("validate", str(tools))
    assert result.exit_code == 125
    assert result.stdout.splitlines() == [f"{tools} [tools.read_file]: ok",
                                          f"{tools} [tools.ls]: ok"]
    errors = result.stderr.splitlines()
    assert len(errors) == 3, result.stderr
    assert errors[0].startswith(f"sandlock: {tools} [tools.shell]:6: colour: unknown key")
    assert errors[1].startswith(f"sandlock: {tools} [tools.shell]:7: network.connect[0]: "
                                "invalid port range 0")
    assert errors[2].startswith(f"sandlock: {tools} [tools.grep]: extends[0]: unknown built-in "
                                "profile 'no-such-profile'")
    # what validate accepts, run --policies runs
    good = write_policy(tmp_path, '[tools.t]\nextends = ["base"]\nfilesystem.exec = ["/usr/bin/true"]\n',
                        "good.toml")
    assert invoke("validate", str(good)).exit_code == 0
    ran = sandlock("run", "--tool", "t", "--policies", str(good), "--", "/usr/bin/true")
    assert ran.returncode == 0, ran.stderr


# ---------------------------------------------------------------------------
# policies


def test_policies_list() -> None:
    result = invoke("policies")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == '# built-in profiles (use with extends = ["NAME"])'
    names = {line.split("\t")[0]: line.split("\t")[1] for line in lines[1:]}
    assert names["base"].startswith("System libraries")
    assert names["python"].startswith("A CPython 3 interpreter")


def test_policies_show_one() -> None:
    result = invoke("policies", "base")
    assert result.exit_code == 0
    assert result.stdout.startswith("# base:")
    assert 'write = ["/dev/null"]' in result.stdout


@pytest.mark.parametrize("name", ["nope", "../profiles/base", "/etc/passwd"])
def test_policies_unknown(name: str) -> None:
    result = invoke("policies", name)
    assert (result.exit_code, result.stderr) == (125, f"sandlock: unknown built-in profile {name!r}\n")


# ---------------------------------------------------------------------------
# run: argument errors (exit 125, nothing started)

USAGE_LINE = f"usage: {launch.USAGE}"


@pytest.mark.parametrize("args, message", [
    (["--policy", str(READ_FILE)], "sandlock: error: no command given\n" + USAGE_LINE),
    (["--policy", str(READ_FILE), "--"], "sandlock: error: no command given\n" + USAGE_LINE),
    (["--policy"], "sandlock: error: --policy needs a value\n" + USAGE_LINE),
    (["--", "true"], "sandlock: missing --policy FILE"),
    (["--policy", str(READ_FILE), "--var", "workspace", "--", "true"],
     "sandlock: --var expects NAME=VALUE, got 'workspace'"),
    (["--policy", str(READ_FILE), "--var", "=x", "--", "true"],
     "sandlock: --var expects NAME=VALUE, got '=x'"),
    (["--policy", str(READ_FILE), "--var", "1x=y", "--", "true"],
     "sandlock: --var: invalid variable name '1x'"),
    (["--policy", str(READ_FILE), "--var", "workspace=/tmp", "--timeout", "soon", "--", "true"],
     "sandlock: --timeout: invalid duration 'soon' (use e.g. 500ms, 30s, 2m, 1h)"),
    (["--policy", str(READ_FILE), "--var", "workspace=/tmp", "--timeout=0", "--", "true"],
     "sandlock: --timeout: duration must be positive and finite, got '0'"),
    # a misspelt option is an error, never taken for the command
    (["--policy", str(READ_FILE), "--timout", "5s", "--", "true"],
     "sandlock: error: unknown option '--timout' (put the command after --)\n" + USAGE_LINE),
    (["--best-effort=yes", "--policy", str(READ_FILE), "--", "true"],
     "sandlock: error: unknown option '--best-effort=yes' (put the command after --)\n"
     + USAGE_LINE),
])
def test_run_argument_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]
                             ) -> None:
    """The fast `run` parser, in-process: each of these fails before any fork."""
    assert launch.main_run(args) == 125
    assert capsys.readouterr().err == message + "\n"


@pytest.mark.parametrize("args, message", [
    (["--policy", str(READ_FILE)], "sandlock: error: no command given"),
    (["--", "true"], "sandlock: missing --policy FILE"),
    (["--policy", str(READ_FILE), "--var", "oops", "--", "true"],
     "sandlock: --var expects NAME=VALUE, got 'oops'"),
    (["--policy", str(READ_FILE), "--var", "workspace=/tmp", "--timeout", "1x", "--", "true"],
     "sandlock: --timeout: invalid duration '1x' (use e.g. 500ms, 30s, 2m, 1h)"),
])
def test_run_argument_errors_through_the_entry_point(args: list[str], message: str) -> None:
    result = sandlock("run", *args)
    assert result.returncode == 125
    assert result.stderr.splitlines()[0] == message
    assert result.stdout == ""


def test_run_var_error_through_click() -> None:
    result = invoke("run", "--var", "novalue", "--", "true")
    assert (result.exit_code, result.stderr) == (
        125, "sandlock: --var expects NAME=VALUE, got 'novalue'\n")


# ---------------------------------------------------------------------------
# SANDLOCK_ABI: strict refuses, best-effort warns, on the real kernel


def run_read_file(workspace: Path, target: Path, abi: int, *extra: str
                  ) -> tuple[int, str, list[str]]:
    result = run_confined(READ_FILE, ["cat", str(target)], variables={"workspace": str(workspace)},
                          env=env_with(**{ENV_ABI: str(abi)}), extra=extra)
    return result.returncode, result.stdout, result.stderr.splitlines()


TCP_GAP = ("TCP port restriction (needs Landlock ABI 4): TCP connect/bind is possible to and on "
           "any port, not only the granted ones")


@pytest.mark.parametrize("abi", [1, 2, 3, 4, 5])
def test_strict_runs_on_an_older_abi(workspace: Path, abi: int) -> None:
    """The truncate restriction (below ABI 3) and the signal scope (below ABI 6) have
    substitutes (tests/test_substitutes.py attacks them): a shipped profile runs strict."""
    require_abi(abi, f"pretending ABI {abi}")
    code, out, err = run_read_file(workspace, workspace / "notes.md", abi)
    assert (code, out, err) == (0, "hello from the workspace\n", [])


@pytest.mark.parametrize("abi", [1, 2, 3])
def test_strict_refuses_what_has_no_substitute(tmp_path: Path, workspace: Path, abi: int) -> None:
    """TCP port rules below ABI 4 have none: strict mode still refuses."""
    require_abi(abi, f"pretending ABI {abi}")
    policy = write_policy(tmp_path, f"""\
        extends = ["{READ_FILE}"]
        [network]
        connect = [443]
    """)
    result = run_confined(policy, ["cat", str(workspace / "notes.md")],
                          variables={"workspace": str(workspace)},
                          env=env_with(**{ENV_ABI: str(abi)}))
    assert (result.returncode, result.stdout) == (125, "")
    assert result.stderr.splitlines() == [
        f"sandlock: this kernel (Landlock ABI {abi}) cannot enforce what {policy} relies on:",
        f"  - {TCP_GAP} [accept: tcp-ports]",
        ("Refusing to run. Use a newer kernel, remove the grant that needs it, accept one gap by "
         'its name with --accept NAME (or accept = ["NAME"] in the policy), or every gap with '
         '--best-effort (or compat = "best-effort").'),
    ]


@pytest.mark.parametrize("abi", [1, 2, 3, 4, 5])
def test_best_effort_warns_and_still_confines(workspace: Path, outside: Path, abi: int) -> None:
    require_abi(abi, f"pretending ABI {abi}")
    code, out, err = run_read_file(workspace, workspace / "notes.md", abi, "--best-effort")
    assert (code, out, err) == (0, "hello from the workspace\n", [])  # nothing left unenforced
    code, out, err = run_read_file(workspace, outside / "secret.txt", abi, "--best-effort")
    assert (code, out) == (1, "")
    assert any("Permission denied" in line for line in err)


#: What the no-Landlock gap says a best-effort run leaves open beyond the user's files.
LATER_RUNS = ("including sandlock's own code and state directory (~/.cache/sandlock: cached "
              "plans, key): a tool can change what later runs do")


def test_strict_refuses_without_landlock(workspace: Path) -> None:
    """Strict refuses; best-effort runs and warns, as `explain` says, that without Landlock
    sandlock's own code and state are the tool's to change, and with them later runs."""
    code, _, err = run_read_file(workspace, workspace / "notes.md", 0)
    assert code == 125
    assert err[0] == (f"sandlock: this kernel (Landlock ABI 0) cannot enforce what {READ_FILE} "
                      "relies on:")
    assert any(line.startswith("  - filesystem confinement (needs Landlock ABI 1): SANDLOCK_ABI=0 "
                               "pretends a kernel without Landlock") and "every file the user can "
               "reach is reachable" in line and "--best-effort" in line for line in err), err
    code, out, err = run_read_file(workspace, workspace / "notes.md", 0, "--best-effort")
    explained = invoke("explain", "--policy", str(READ_FILE), "--var", f"workspace={workspace}",
                       env={ENV_ABI: "0"})
    assert (code, out, explained.exit_code) == (0, "hello from the workspace\n", 0), err
    assert any(line.startswith("sandlock: warning:   - filesystem confinement (needs Landlock "
                               "ABI 1): ") and LATER_RUNS in line for line in err), err
    assert "filesystem confinement (needs Landlock ABI 1): SANDLOCK_ABI=0 pretends a kernel " \
           "without Landlock" in explained.stdout and LATER_RUNS in explained.stdout, explained.stdout


def test_best_effort_in_the_policy_file(workspace: Path, tmp_path: Path) -> None:
    require_abi(3, "pretending ABI 3")
    policy = write_policy(tmp_path, f"""\
        extends = ["{READ_FILE}"]
        compat = "best-effort"
    """)
    result = run_confined(policy, ["cat", str(workspace / "notes.md")],
                          variables={"workspace": str(workspace)}, env=env_with(**{ENV_ABI: "3"}))
    assert (result.returncode, result.stdout) == (0, "hello from the workspace\n")
    assert result.stderr.splitlines() == []  # the signal scope has its substitute at ABI 3


@pytest.mark.parametrize("value, message", [
    ("new", "sandlock: SANDLOCK_ABI='new' is not an integer"),
    (str(ABI + 1), f"sandlock: SANDLOCK_ABI={ABI + 1} but this kernel only has Landlock ABI {ABI}"),
])
def test_bad_abi_override(workspace: Path, value: str, message: str) -> None:
    result = run_confined(READ_FILE, ["cat", str(workspace / "notes.md")],
                          variables={"workspace": str(workspace)}, env=env_with(**{ENV_ABI: value}))
    assert (result.returncode, result.stdout, result.stderr) == (125, "", message + "\n")


#: Run in a fresh interpreter (which cannot start with a directory on stdin, stdout or
#: stderr, so it takes one on stdout after it started): the Python CLI's `run`, argv[1:].
PYTHON_CLI_WITH_A_DIRECTORY = """\
import os, sys
from sandlock.cli.run import main
fd = os.open(os.environ["DIRECTORY"], os.O_RDONLY | os.O_DIRECTORY)
os.dup2(fd, 1)
main(sys.argv[1:])
"""


@pytest.mark.parametrize("front", ["native", "python"])
def test_a_directory_is_never_the_tools_stdio(tmp_path: Path, front: str) -> None:
    """A run given a directory as stdin (the native front end, which the Python CLI could
    not even start under) or stdout (the Python launcher) is refused with exit 125 and
    says why; the tool never runs (attack round 33: a walk from a directory descriptor
    reaches what the policy grants through a mount the table does not list)."""
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    marker = out / "ran"
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["base"]
        [filesystem]
        exec = ["/usr/bin/touch"]
        write = ["{out}"]
    """)
    argv = ["run", "--policy", str(policy), "--", "/usr/bin/touch", str(marker)]
    if front == "native":
        helper = Path(launch.__file__).parents[1] / "exec" / "helper" / "sandlock-run"
        if not helper.exists():
            pytest.skip("the native front end is not built here")
        directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            done = subprocess.run([str(helper), *argv], stdin=directory, capture_output=True,
                                  text=True, timeout=60, cwd=tmp_path)
        finally:
            os.close(directory)
        name = "stdin"
    else:
        done = subprocess.run([sys.executable, "-P", "-c", PYTHON_CLI_WITH_A_DIRECTORY, *argv],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "DIRECTORY": str(tmp_path),
                                   "PYTHONPATH": str(Path(launch.__file__).parents[2])})
        name = "stdout"
    assert done.returncode == 125, done.stderr
    assert f"sandlock: {name} is a directory: a tool is never given one" in done.stderr, done.stderr
    assert not marker.exists()
