"""`sandlock hook claude-code` and `sandlock shell`: the command a model wrote runs,
exactly, inside the sandbox, or not at all.

Each attack is run as Claude Code would: documented hook JSON in, the answer's
``updatedInput.command`` executed by bash. A planted secret outside the policy must
not come out; the same command without the hook (or behind a hand-quoted wrapper)
prints it, so the attack is real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import REPO

import sandlock
from sandlock.integrations import claude_code, shell_rules

SECRET = "top secret"


def hook_input(command: Any, **extra: Any) -> bytes:
    data = {"session_id": "s1", "transcript_path": "/dev/null", "cwd": os.getcwd(),
            "permission_mode": "default", "hook_event_name": "PreToolUse", "tool_name": "Bash",
            "tool_input": {"command": command, "description": "a command"}}
    data.update(extra)
    return json.dumps(data).encode()


def hook(data: bytes, *options: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "sandlock", "hook", "claude-code", *options],
                          input=data, capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def bash(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The Bash tool: the command line run by bash."""
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def rewritten(done: subprocess.CompletedProcess[bytes]) -> str:
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)["hookSpecificOutput"]
    assert answer["hookEventName"] == "PreToolUse" and answer["permissionDecision"] == "allow"
    assert answer["updatedInput"]["description"] == "a command"  # the rest kept
    command = answer["updatedInput"]["command"]
    assert isinstance(command, str)
    return command


def policy_options(workspace: Path) -> tuple[str, ...]:
    return ("--policy", "shell", "--var", f"workspace={workspace}")


#: (name, command): each reads the secret when it runs outside the sandbox (directly,
#: or, for "quote", once it breaks out of a hand-quoted ``sh -c '...'``).
ATTACKS = [
    ("plain", "cat {s}"),
    ("quote", "echo x'; cat {s}; echo '"),
    ("substitution", 'echo "$(cat {s})"'),
    ("backticks", "echo `cat {s}`"),
    ("newline", "true\ncat {s}"),
    ("background", "cat {s} &\nwait"),
    ("option", "-i\ncat {s}"),
]


def naive(command: str) -> str:
    """A wrapper joined by hand: the injection this hook must not be."""
    return f"true -- /bin/sh -c '{command}'"


@pytest.mark.parametrize(("name", "template"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_stays_inside(name: str, template: str, workspace: Path, outside: Path) -> None:
    command = template.format(s=outside / "secret.txt") + "\necho INSIDE-$((6*7))"
    line = rewritten(hook(hook_input(command), *policy_options(workspace)))
    done = bash(line, workspace)
    assert "INSIDE-42" in done.stdout, done.stderr  # the command ran, in the sandbox
    assert SECRET not in done.stdout + done.stderr
    # Control: outside the hook (or behind the hand-quoted wrapper) it reads the secret.
    control = subprocess.run(["bash", "-c", "--", naive(command) if name == "quote" else command],
                             capture_output=True, text=True, cwd=workspace, timeout=60)
    assert SECRET in control.stdout


@pytest.mark.parametrize(("name", "template"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_shell_gets_exactly_the_command(name: str, template: str, tmp_path: Path) -> None:
    """bash hands the wrapped shell exactly the model's text: the rewritten line run
    with ``printf`` in sandlock's place prints its arguments one by one."""
    command = template.format(s="/x y/'\"$HOME") + " \\ \t'\"`$(id)`\"'"
    rules = shell_rules.Rules((), shell_rules.Choice(policy="shell"))
    line = json.loads(claude_code.answer(hook_input(command), rules, {}, prefix=["printf", "%s\\0"])
                      )["hookSpecificOutput"]["updatedInput"]["command"]
    args = bash(line, tmp_path).stdout.split("\0")[:-1]
    kept = [arg for path in claude_code.kept_paths(os.getcwd()) for arg in ("--keep", path)]
    assert args == ["run", *kept, "--policy", "shell", "--", "/bin/sh", "-c", "--", command]


@pytest.mark.parametrize("data", [
    b"{", b"[]", b"null", b"\xff\xfe", b'{"hook_event_name": "PreToolUse"}',
    hook_input("true", hook_event_name="PostToolUse"),
    hook_input("true", tool_name="Write"),
    hook_input(["cat", "/etc/passwd"]),
    hook_input(""),
    hook_input("true\0cat /x"),
    hook_input("x" * (shell_rules.MAX_COMMAND + 1)),
    json.dumps({"hook_event_name": "PreToolUse", "tool_name": "Bash", "tool_input": "true"}).encode(),
    b"[" * 100000,
], ids=["truncated", "array", "null", "not-utf8", "no-tool", "other-event", "other-tool",
        "command-list", "empty", "nul", "huge-command", "input-not-object", "deep-nesting"])
def test_malformed_input_is_blocked(data: bytes) -> None:
    done = hook(data, "--policy", "shell")
    assert done.returncode == claude_code.BLOCK, done
    assert done.stdout == b""  # no answer Claude Code could take for an approval
    assert done.stderr.startswith(b"sandlock: ") and b"Traceback" not in done.stderr


def test_limits_have_controls() -> None:
    """The longest command accepted passes; one more character is refused (above)."""
    assert rewritten(hook(hook_input("x" * shell_rules.MAX_COMMAND), "--policy", "shell"))


def test_huge_input_is_blocked() -> None:
    done = hook(b" " * (claude_code.MAX_INPUT + 1) + hook_input("true"), "--policy", "shell")
    assert done.returncode == claude_code.BLOCK and done.stdout == b""
    assert rewritten(hook(b" " * 1000 + hook_input("true"), "--policy", "shell"))


def _rules(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    return path


def test_first_matching_rule_wins(tmp_path: Path) -> None:
    rules = _rules(tmp_path, """
        [[rule]]
        match = '^git( |$)'
        policy = "git"
        [[rule]]
        match = 'git'
        policy = "policies/other.toml"
        """.replace("\n        ", "\n"))
    git = rewritten(hook(hook_input("git status"), "--rules", str(rules)))
    assert "--policy git --" in git
    other = rewritten(hook(hook_input("echo git"), "--rules", str(rules), "--policy", "shell"))
    assert f"--policy {tmp_path}/policies/other.toml --" in other
    default = rewritten(hook(hook_input("ls"), "--rules", str(rules), "--policy", "shell"))
    assert "--policy shell --" in default
    refused = hook(hook_input("ls"), "--rules", str(rules))  # no rule, no default
    assert refused.returncode == claude_code.BLOCK and refused.stdout == b""
    assert b"no rule" in refused.stderr


@pytest.mark.parametrize(("text", "says"), [
    ("[[rule]]\nmatch = '('\npolicy = 'shell'\n", b"rule[0].match"),
    ("[[rule]]\nmatch = 'x'\n", b"rule[0]"),
    ("[[rule]]\nmatch = 'x'\ntool = 'git'\n", b"--registry"),
    ("[other]\n", b"other"),
    ("not toml [", b"TOML syntax error"),
])
def test_bad_rules_block(tmp_path: Path, text: str, says: bytes) -> None:
    done = hook(hook_input("true"), "--rules", str(_rules(tmp_path, text)), "--policy", "shell")
    assert done.returncode == claude_code.BLOCK and done.stdout == b""
    assert says in done.stderr and b"Traceback" not in done.stderr


@pytest.mark.parametrize(("text", "says"), [
    ("[[rule]]\nmatch = 'a{4294967296}'\npolicy = 'shell'\n", b"rule[0].match"),
    ("[[rule]]\nmatch = '" + "(" * 1000 + ")" * 1000 + "'\npolicy = 'shell'\n", b"rule[0].match"),
    ("x = " + "[" * 2000 + "]" * 2000 + "\n", b"nested more than"),
], ids=["repeat", "groups", "nested"])
def test_rules_the_readers_cannot_take_block_with_their_reason(tmp_path: Path, text: str,
                                                               says: bytes) -> None:
    """re.compile raises OverflowError (RecursionError), tomllib RecursionError: the hook
    ended 125 on them (an internal error, and the command ran unconfined)."""
    done = hook(hook_input("true"), "--rules", str(_rules(tmp_path, text)), "--policy", "shell")
    assert done.returncode == claude_code.BLOCK and done.stdout == b""
    assert says in done.stderr and b"internal error" not in done.stderr, done.stderr


_SLOW_HOOK = """
import sandlock.cli.hook as hook
hook.HOOK_SECONDS = 1.0
from sandlock.cli.run import main
main(["hook", "claude-code", "--rules", {rules!r}, "--policy", "shell"])
"""


def test_a_rule_that_backtracks_on_the_command_blocks_in_time(tmp_path: Path) -> None:
    """A rule's regex that backtracks exponentially, a command of the model's choosing:
    past Claude Code's hook timeout the command would run unconfined. The hook blocks
    first (its limit made 1 s here). Control: the same match takes longer than that."""
    import re

    rules = _rules(tmp_path, "[[rule]]\nmatch = '^(\\w+\\s?)*;$'\npolicy = 'shell'\n")
    command = "a" * 26 + "!"  # each more letter doubles the time: about 4 s here
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _SLOW_HOOK.format(rules=str(rules))],
                          input=hook_input(command), capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == claude_code.BLOCK and b"no answer within 1 s" in done.stderr, \
        done.stderr
    assert time.monotonic() - started < 30
    started = time.monotonic()  # the control: the same match takes longer than the limit
    assert re.compile(r"^(\w+\s?)*;$").search(command) is None
    assert time.monotonic() - started > 1.0


def test_a_default_policy_nested_too_deep_never_lets_the_command_run(tmp_path: Path) -> None:
    """A policy the rules name that the TOML reader cannot take (RecursionError): the hook
    blocks, or answers with a command whose run refuses it; the command never runs."""
    (tmp_path / "deep.toml").write_text("version = 1\nx = " + "[" * 2000 + "]" * 2000 + "\n")
    rules = _rules(tmp_path, '[default]\npolicy = "deep.toml"\n')
    mark = tmp_path / "ran"
    done = hook(hook_input(f"touch {mark}", cwd=str(tmp_path)), "--rules", str(rules))
    assert done.returncode in (0, claude_code.BLOCK), done.stderr
    assert b"Traceback" not in done.stderr and b"internal error" not in done.stderr
    if done.returncode == 0:
        ran = bash(rewritten(done), tmp_path)
        assert ran.returncode == 125 and "nested more than" in ran.stderr, ran.stderr
    assert not mark.exists()


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_a_number_json_has_not_is_blocked(value: bytes) -> None:
    """Python's reader takes NaN and 1e400; written back into the answer they made it no
    JSON, which Claude Code reads as no decision (the command as the model wrote it)."""
    data = hook_input("true").replace(b'"description"', b'"n": ' + value + b', "description"')
    done = hook(data, "--policy", "shell")
    assert done.returncode == claude_code.BLOCK and done.stdout == b"", done.stdout
    assert b"the hook input is not JSON" in done.stderr, done.stderr
    control = hook(data.replace(value, b"1.5"), "--policy", "shell")
    assert json.loads(control.stdout)  # the same input with a finite number is answered


def test_a_block_is_a_block_with_stderr_full() -> None:
    """Its message cannot be written (stderr is /dev/full): the interpreter's last flush
    of it failed too, and the exit status was 120 (Claude Code runs the command)."""
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "sandlock", "hook", "claude-code",
                               "--policy", "shell"], input=b"not json", stdout=subprocess.PIPE,
                              stderr=full, timeout=60,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                   "HOME": os.path.expanduser("~"), "LANG": "C.UTF-8",
                                   "PYTHONPATH": str(REPO)})
    assert done.returncode == claude_code.BLOCK and done.stdout == b""


_BROKEN_HOOK = """
import sys
import time
import sandlock.integrations.claude_code as hook
def answer(*args, **kwargs):
    raise {error}
hook.answer = answer
from sandlock.cli.run import main
main(["hook", "claude-code", "--policy", "shell"])
"""


@pytest.mark.parametrize("error", ["RuntimeError('a bug')", "KeyboardInterrupt()",
                                   "MemoryError()", "UnicodeEncodeError('utf-8', '', 0, 1, 'x')"],
                         ids=["bug", "interrupt", "memory", "encode"])
def test_an_internal_error_blocks_the_command(error: str) -> None:
    """Claude Code runs the command as the model wrote it, unconfined, after any hook exit
    but 0 and 2: a bug in the hook (here one put in its place) must block."""
    done = subprocess.run([sys.executable, "-c", _BROKEN_HOOK.format(error=error)],
                          input=hook_input("true"), capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == claude_code.BLOCK, done.stderr
    assert done.stdout == b"" and b"internal error, the command is blocked" in done.stderr


def test_registry_tool(tmp_path: Path, workspace: Path, outside: Path) -> None:
    registry = tmp_path / "tools"
    registry.mkdir()
    (registry / "sh.toml").write_text('version = 1\nextends = ["shell"]\n')
    rules = _rules(tmp_path, "[default]\ntool = 'sh'\n")
    line = rewritten(hook(hook_input(f"cat {outside}/secret.txt; echo INSIDE"), "--registry",
                          str(registry), "--rules", str(rules), "--var", f"workspace={workspace}"))
    done = bash(line, workspace)
    assert "INSIDE" in done.stdout and SECRET not in done.stdout, done.stderr


def _shell(*args: str, cwd: Optional[Path] = None) -> subprocess.CompletedProcess[str]:
    """``-P``: the workspace, the working directory, is not on the import path."""
    return subprocess.run([sys.executable, "-P", "-m", "sandlock", "shell", *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_shell_runs_command_confined(workspace: Path, outside: Path) -> None:
    command = f"cat {outside}/secret.txt; echo INSIDE-$((6*7)) \"$0\" \"$1\""
    done = _shell(*policy_options(workspace), "-c", command, "name", "arg", cwd=workspace)
    assert "INSIDE-42 name arg" in done.stdout, done.stderr
    assert SECRET not in done.stdout
    assert SECRET in bash(command, workspace).stdout  # control: unconfined, it reads it


@pytest.mark.parametrize("args", [(), ("-i",), ("-l", "-c", "true"), ("-c",), ("-lc", "true")])
def test_shell_runs_nothing_else(args: tuple[str, ...], workspace: Path) -> None:
    done = _shell(*policy_options(workspace), *args)
    assert done.returncode == 125 and "only `sandlock shell" in done.stderr


@pytest.mark.parametrize("command", ["--help", "--policy=/", "--rules", "-c"])
def test_shell_command_is_never_an_option(command: str, workspace: Path) -> None:
    """What follows -c is the command, whatever it looks like: the confined shell gets
    it (and, here, fails to find it), sandlock's options are not touched."""
    done = _shell(*policy_options(workspace), "-c", f"{command}; echo INSIDE-$((6*7))",
                  cwd=workspace)
    assert "INSIDE-42" in done.stdout and "Usage" not in done.stdout, done.stderr


def test_shell_without_policy_refuses(workspace: Path) -> None:
    done = _shell("-c", "true")
    assert done.returncode == 125 and "--policy" in done.stderr


def test_the_example_runs(tmp_path: Path) -> None:
    """examples/claude_code_hook.sh: the hook's JSON in, the rewritten command run; the
    note is read, the key outside the project refused."""
    sandlock = f"{sys.executable} -P -m sandlock"
    done = subprocess.run(["sh", str(REPO / "examples" / "claude_code_hook.sh")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "SANDLOCK": sandlock})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "  water the plants" in done.stdout and "api-key: Permission denied" in done.stdout
    assert "sk-not-for-tools" not in done.stdout


@pytest.mark.parametrize("argv0", ["sandlock", "./sandlock", "bin/sandlock"])
def test_the_rewritten_command_never_names_sandlock_relative_to_the_project(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv0: str) -> None:
    """Claude Code starts the hook by a bare name from the project directory, which its
    tools may write: a ``sandlock`` there, named by the rewritten command, ran unconfined."""
    planted = tmp_path / argv0
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text("#!/bin/sh\n")
    planted.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [argv0, "hook", "claude-code"])
    head = shell_rules.sandlock_argv()
    assert head == [sys.executable, "-P", "-m", "sandlock"]


def test_the_single_file_binary_names_its_stub(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen, the interpreter is the unpacked program (no ``-P``, no ``-m``): the
    rewritten command starts the stub by the real path it set, or is refused."""
    stub = tmp_path / "sandlock"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "argv", ["sandlock"])
    monkeypatch.setenv("SANDLOCK_STUB", str(stub))
    assert shell_rules.sandlock_argv() == [str(stub)]
    monkeypatch.delenv("SANDLOCK_STUB")
    with pytest.raises(sandlock.SandlockError, match="single-file binary"):
        shell_rules.sandlock_argv()


# ----------------------------------------------------------------------------
# The files that choose the next command's policy, in a project a command may write


def _hooked_in(project: Path, command: str, *options: str) -> str:
    done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "hook", "claude-code", *options],
                          input=hook_input(command, cwd=str(project)), capture_output=True,
                          timeout=60, cwd=project,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CLAUDE_PROJECT_DIR": str(project)})
    return rewritten(done)


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "control"])
def test_a_command_cannot_choose_the_policy_of_the_next(tmp_path: Path, kept: bool) -> None:
    """The rules file (and the policies it names) in the project: the first command,
    confined by a policy that writes the project, names a policy of its own for the next
    one. Control: the same line without its --keep options, and the next command writes
    outside the workspace."""
    project = tmp_path / "project"
    (project / "policies").mkdir(parents=True)
    rules = project / "sandlock-rules.toml"
    rules.write_text('[[rule]]\nmatch = "^cat "\npolicy = "policies/read.toml"\n\n'
                     '[default]\npolicy = "shell"\n')
    (project / "policies" / "read.toml").write_text('version = 1\nextends = ["read_file"]\n')
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = (f"printf '[default]\\npolicy = \"evil.toml\"\\n' > sandlock-rules.toml; "
            f"printf 'version = 1\\nextends = [\"base\"]\\n[filesystem]\\nexec = [\"/usr/bin\"]\\n"
            f"write = [\"{outside}\"]\\n' "
            "> evil.toml")
    options = ("--rules", str(rules), "--var", f"workspace={project}")
    first = _hooked_in(project, evil, *options)
    assert ("--keep " + str(rules)) in first and str(project / "policies" / "read.toml") in first
    if not kept:
        first = first.replace(f"--keep {rules} ", "")
    ran = bash(first, project)
    assert ran.returncode == (125 if kept else 0), ran.stderr
    second = _hooked_in(project, f"echo pwned > {outside}/mark", *options)
    bash(second, project)
    assert (outside / "mark").exists() == (not kept)


def test_sandlock_shell_keeps_its_rules(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    rules = project / "rules.toml"
    rules.write_text('[default]\npolicy = "shell"\n')
    done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "shell", "--rules", str(rules),
                           "--var", f"workspace={project}", "-c",
                           "printf '[default]\\npolicy = \"evil.toml\"\\n' > rules.toml"],
                          capture_output=True, text=True, timeout=60, cwd=project,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 125 and "a path kept for this run" in done.stderr, done.stderr
    assert rules.read_text() == '[default]\npolicy = "shell"\n'


def test_a_command_cannot_change_what_a_kept_policy_extends(tmp_path: Path) -> None:
    """The rules' git policy extends a file of the project: the default policy's command
    rewrites that file to grant a write outside; it is put back (the layers are kept)."""
    project = tmp_path / "project"
    (project / "pol").mkdir(parents=True)
    rules = project / "rules.toml"
    rules.write_text('[[rule]]\nmatch = "^git "\npolicy = "pol/git.toml"\n\n[default]\npolicy = "shell"\n')
    (project / "pol" / "git.toml").write_text('version = 1\nextends = ["base", "common.toml"]\n')
    (project / "pol" / "common.toml").write_text('version = 1\n[filesystem]\nexec = ["/usr/bin"]\n')
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = (f"printf 'version = 1\\n[filesystem]\\nexec = [\"/usr/bin\"]\\nwrite = [\"{outside}\"]\\n' "
            "> pol/common.toml")
    options = ("--rules", str(rules), "--var", f"workspace={project}")
    first = _hooked_in(project, evil, *options)
    assert f"--keep {project / 'pol' / 'common.toml'}" in first
    assert bash(first, project).returncode == 125
    second = _hooked_in(project, f"git --version >/dev/null; echo pwned > {outside}/mark", *options)
    bash(second, project)
    assert not (outside / "mark").exists()
    control = bash(first.replace(f"--keep {project / 'pol' / 'common.toml'} ", ""), project)
    assert control.returncode == 0, control.stderr  # the layer was written: kept, it is undone
    bash(second, project)
    assert (outside / "mark").exists()


def test_a_bare_name_that_is_no_shipped_profile_is_a_file_beside_the_rules(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    rules = project / "rules.toml"
    rules.write_text('[default]\npolicy = "mypolicy"\n')
    line = _hooked_in(project, "true", "--rules", str(rules))
    assert f"--policy {project / 'mypolicy'} " in line and f"--keep {project / 'mypolicy'} " in line


def test_a_policy_reached_through_a_link_is_refused(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "pols-real").mkdir(parents=True)
    (project / "pol").symlink_to("pols-real")
    (project / "pols-real" / "git.toml").write_text('version = 1\nextends = ["base"]\n')
    rules = project / "rules.toml"
    rules.write_text('[default]\npolicy = "pol/git.toml"\n')
    done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "hook", "claude-code", "--rules",
                           str(rules)], input=hook_input("true", cwd=str(project)),
                          capture_output=True, timeout=60, cwd=project,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CLAUDE_PROJECT_DIR": str(project)})
    assert done.returncode == 2 and b"symbolic link" in done.stderr, done.stderr


_READONLY = ('version = 1\nextends = ["base"]\n[filesystem]\nread = ["${workspace}"]\n'
             'exec = ["/usr/bin", "/bin"]\n')


@pytest.mark.parametrize("changed", ["policy", "extended", "rules", "control"])
def test_a_command_running_beside_cannot_choose_the_policy_of_another(tmp_path: Path,
                                                                      changed: str) -> None:
    """A command run in the background (Claude Code's run_in_background), confined by a
    policy that writes the project, rewrites a file that chooses the policy of the
    others; its --keep puts the file back only when it ends. A command hooked meanwhile
    must not run under what it wrote: its hook blocks, or its run refuses the file.
    Control: the background command's line without the --keep of the file it rewrites,
    and the other command writes outside the project."""
    project = tmp_path / "project"
    (project / "policies").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    rules = project / "rules.toml"
    rules.write_text('[[rule]]\nmatch = "^true; "\npolicy = "shell"\n\n'
                     '[default]\npolicy = "policies/readonly.toml"\n')
    readonly = project / "policies" / "readonly.toml"
    readonly.write_text('version = 1\nextends = ["more.toml"]\n')
    more = project / "policies" / "more.toml"
    more.write_text(_READONLY)
    (project / "policies" / "evil.toml").write_text(
        _READONLY + f'write = ["{outside}"]\n')
    target, text = {
        "policy": (readonly, f'[filesystem]\nwrite = ["{outside}"]\n'),
        "extended": (more, f'write = ["{outside}"]\n'),
        "rules": (rules, '\n[[rule]]\nmatch = "^echo "\npolicy = "policies/evil.toml"\n'),
        "control": (more, f'write = ["{outside}"]\n'),
    }[changed]
    (project / "hold").touch()
    options = ("--rules", str(rules), "--var", f"workspace={project}")
    first = _hooked_in(project, f"true; cat >> {target} < {project}/add; "
                                f"while [ -e {project}/hold ]; do sleep 0.05; done", *options)
    assert f"--keep {target} " in first
    if changed == "control":
        first = first.replace(f"--keep {target} ", "")
    (project / "add").write_text(text)
    before = target.read_text()
    background = subprocess.Popen(["bash", "-c", first], cwd=project, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        for _ in range(400):
            if target.read_text() != before or background.poll() is not None:
                break
            time.sleep(0.05)
        if target.read_text() == before:
            background.kill()
            raise AssertionError(f"the background command did not change the file: "
                                 f"{background.communicate(timeout=60)}")
        done = subprocess.run([sys.executable, "-P", "-m", "sandlock", "hook", "claude-code",
                               *options], input=hook_input(f"echo pwned > {outside}/mark",
                                                           cwd=str(project)),
                              capture_output=True, timeout=60, cwd=project,
                              env={**os.environ, "PYTHONPATH": str(REPO),
                                   "CLAUDE_PROJECT_DIR": str(project)})
        if done.returncode == 0:
            ran = bash(rewritten(done), project)
            if changed != "control":
                assert ran.returncode == 125 and "running sandlock run" in ran.stderr, ran.stderr
        else:
            assert done.returncode == claude_code.BLOCK and changed == "rules", done.stderr
            assert b"running sandlock run" in done.stderr, done.stderr
    finally:
        (project / "hold").unlink()
        out, err = background.communicate(timeout=60)
    assert (outside / "mark").exists() == (changed == "control")
    if changed != "control":  # the background command's keep put the file back, and failed
        assert background.returncode == 125 and target.read_text() == before, err


@pytest.mark.parametrize("way", ["registry", "policy"])
def test_a_kept_policy_replaced_by_a_link_is_not_read_through_it(tmp_path: Path, way: str) -> None:
    """The background command replaces a kept policy (a registry's entry, a rule's policy)
    by a symbolic link to one it wrote: read through the link, the file's own name is no
    kept path. The name it was opened by is checked too."""
    project = tmp_path / "project"
    (project / "tools").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    rules = project / "rules.toml"
    if way == "registry":
        rules.write_text('[[rule]]\nmatch = "^echo "\ntool = "ro"\n\n'
                         '[default]\npolicy = "shell"\n')
        target = project / "tools" / "ro.toml"
        options: tuple[str, ...] = ("--rules", str(rules), "--registry", str(project / "tools"),
                                    "--var", f"workspace={project}")
    else:
        rules.write_text('[[rule]]\nmatch = "^echo "\npolicy = "ro.toml"\n\n'
                         '[default]\npolicy = "shell"\n')
        target = project / "ro.toml"
        options = ("--rules", str(rules), "--var", f"workspace={project}")
    target.write_text(_READONLY)
    (project / "evil.toml").write_text(_READONLY + f'write = ["{outside}"]\n')
    (project / "hold").touch()
    second = _hooked_in(project, f"echo pwned > {outside}/mark", *options)  # before the link
    first = _hooked_in(project, f"true; ln -sf {project}/evil.toml {target}; "
                                f"while [ -e {project}/hold ]; do sleep 0.05; done", *options)
    background = subprocess.Popen(["bash", "-c", first], cwd=project, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        for _ in range(400):
            if target.is_symlink() or background.poll() is not None:
                break
            time.sleep(0.05)
        assert target.is_symlink(), background.communicate(timeout=60)
        ran = bash(second, project)
        assert ran.returncode == 125 and "running sandlock run" in ran.stderr, ran.stderr
    finally:
        (project / "hold").unlink()
        background.communicate(timeout=60)
    assert not (outside / "mark").exists()
    assert not target.is_symlink() and target.read_text() == _READONLY


def test_a_kept_policy_swapped_out_after_it_was_opened_is_still_checked(tmp_path: Path) -> None:
    """The planted file is renamed over the kept one, opened, then the original renamed
    back: the open file has no name any more ("... (deleted)"), and the name it was opened
    by is what is checked."""
    from sandlock.policy.kept import ChangedByARun, Reading
    from sandlock.undo.keep import keep

    kept_file = tmp_path / "ro.toml"
    kept_file.write_text(_READONLY)
    held = keep(str(kept_file))
    try:
        (tmp_path / "planted").write_text(_READONLY + 'write = ["/"]\n')
        os.rename(tmp_path / "ro.toml", tmp_path / "original")
        os.rename(tmp_path / "planted", kept_file)
        fd = os.open(kept_file, os.O_RDONLY)
        try:
            os.rename(tmp_path / "original", kept_file)  # the planted file: removed
            assert os.readlink(f"/proc/self/fd/{fd}").endswith(" (deleted)")
            data = os.read(fd, 1 << 16)
            for named in (str(kept_file), None):  # by its name; by the name it had alone
                with Reading(fd, named) as reading:
                    with pytest.raises(ChangedByARun, match="running sandlock run"):
                        reading.check(data, str(kept_file))
        finally:
            os.close(fd)
    finally:
        held.close()
