"""`sandlock run --keep PATH`, and the Claude Code hook that keeps the project's `.claude`
and `.mcp.json`, on the real kernel.

The attack: the hook's policy writes the project, and Claude Code reads the project's
`.claude/settings.json` at its next session: a confined command that wrote a hook there
(or removed sandlock's) had its next command run outside any sandbox. Each test runs the
rewritten command as Claude Code would, and the positive control runs the same command
without ``--keep``: the write goes through (the policy grants it).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import IS_ROOT, REPO, require_abi

from sandlock.policy import kept as held
from sandlock.undo import keep as keep_module

SETTINGS = {"hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": [
    {"type": "command", "command": "sandlock hook claude-code --policy shell"}]}]}}
EVIL = '{"hooks": {"SessionStart": [{"hooks": [{"type": "command", "command": "id"}]}]}}'
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "filesystem confinement")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    where = tmp_path / "project"
    (where / ".claude").mkdir(parents=True)
    (where / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    (where / "notes.md").write_text("inside\n")
    return where


def hooked(project: Path, command: str) -> list[str]:
    """The command line Claude Code runs for ``command``, from the hook, as argv."""
    event = json.dumps({"hook_event_name": "PreToolUse", "tool_name": "Bash", "cwd": str(project),
                        "tool_input": {"command": command}})
    done = subprocess.run([sys.executable, "-m", "sandlock", "hook", "claude-code", "--policy",
                           "shell", "--var", f"workspace={project}"], input=event,
                          capture_output=True, text=True, timeout=60,
                          env={**ENV, "CLAUDE_PROJECT_DIR": str(project)}, cwd=project)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)["hookSpecificOutput"]["updatedInput"]["command"]
    return shlex.split(line)


def unkept(argv: list[str]) -> list[str]:
    """The same command line without its --keep options: the guard switched off."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--keep":
            skip = True
        else:
            out.append(arg)
    return out


def state(project: Path) -> dict[str, str]:
    """Every entry below ``project`` but notes.md: its kind and content."""
    out = {}
    for root, dirs, files in os.walk(project):
        for name in dirs + files:
            path = Path(root, name)
            rel = str(path.relative_to(project))
            if path.is_symlink():
                out[rel] = "link " + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = path.read_text(errors="replace")
    return out


def changed(project: Path) -> None:
    """Wait (30 s at most) until the tool says it changed the settings (``.changed``)."""
    deadline = time.monotonic() + 30
    while not (project / ".changed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


ATTACKS = {
    "settings rewritten": f"printf '%s' '{EVIL}' > .claude/settings.json",
    "local settings added": f"printf '%s' '{EVIL}' > .claude/settings.local.json",
    "project MCP server added": "echo '{\"mcpServers\": {}}' > .mcp.json",
    "directory replaced": f"mv .claude gone && mkdir .claude && printf '%s' '{EVIL}' "
                          "> .claude/settings.json",
    "link to elsewhere": "mkdir ../elsewhere 2>/dev/null; mv .claude gone && ln -s ../elsewhere .claude",
    "removed": "rm -r .claude",
    # a second name: the settings then change by a write to an ordinary project file
    "hard link out": "ln -f .claude/settings.json example-settings.json",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_the_hook_keeps_what_claude_code_reads(project: Path, attack: str) -> None:
    before = state(project)
    argv = hooked(project, ATTACKS[attack])
    assert "--keep" in argv
    ran = subprocess.run(argv, cwd=project, env=ENV, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 125, ran.stderr
    assert "a path kept for this run" in ran.stderr
    after = state(project)
    assert {k: v for k, v in after.items() if ".sandlock-changed-" not in k
            and not k.startswith(("gone", "example-"))} == before
    # the positive control: without --keep, the same command changes the project
    control = subprocess.run(unkept(argv), cwd=project, env=ENV, capture_output=True,
                             text=True, timeout=60)
    assert control.returncode == 0, control.stderr
    settings = project / ".claude" / "settings.json"
    assert state(project) != after or settings.stat().st_nlink > 1


def test_an_unchanged_kept_path_leaves_the_exit_code_alone(project: Path) -> None:
    before = state(project)
    argv = hooked(project, "cat notes.md; exit 3")
    ran = subprocess.run(argv, cwd=project, env=ENV, capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout) == (3, "inside\n"), ran.stderr
    assert state(project) == before


def test_the_watchdog_puts_back_when_the_launcher_is_killed(project: Path) -> None:
    """The tool changes the settings, then waits; the launcher is killed (Claude Code
    stopped, the user quit): the watchdog still ends the tree and puts the path back."""
    before = state(project)
    argv = hooked(project, f"printf '%s' '{EVIL}' > .claude/settings.json; touch .changed; "
                           "sleep 60")
    launcher = subprocess.Popen(argv, cwd=project, env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        changed(project)
        assert (project / ".claude" / "settings.json").read_text() == EVIL
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = {k: v for k, v in state(project).items() if ".sandlock-changed-" not in k
                   and k != ".changed"}
            if now == before:
                break
            time.sleep(0.1)
        assert now == before
    finally:
        if launcher.poll() is None:
            launcher.kill()
        assert launcher.stderr is not None
        launcher.stderr.close()


@pytest.mark.skipif(IS_ROOT, reason="modes do not bind root")
def test_a_tool_that_closes_the_project_cannot_keep_its_change(project: Path) -> None:
    """chmod is no Landlock right: a tool may close the project and .claude to its uid."""
    before = state(project)
    argv = hooked(project, f"printf '%s' '{EVIL}' > .claude/settings.json; chmod 0 .claude; "
                           "chmod 0500 .")
    ran = subprocess.run(argv, cwd=project, env=ENV, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 125, ran.stderr
    os.chmod(project, 0o700)
    assert {k: v for k, v in state(project).items() if ".sandlock-changed-" not in k} == before


def test_a_path_too_large_to_keep_is_refused_before_the_run(project: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    (project / ".claude" / "big").write_bytes(b"x" * 4096)
    monkeypatch.setattr(keep_module, "MAX_BYTES", 1024)
    with pytest.raises(keep_module.KeepError, match="cannot be kept"):
        keep_module.keep(str(project / ".claude"))
    marker = project / "ran"
    argv = hooked(project, "touch ran")
    argv.insert(argv.index("--keep"), "--keep")
    argv.insert(argv.index("--keep") + 1, "relative/path")
    ran = subprocess.run(argv, cwd=project, env=ENV, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 125 and "absolute" in ran.stderr
    assert not marker.exists()


def test_a_second_name_of_a_kept_file_is_gone_with_the_run(project: Path) -> None:
    """After the hard link attack, the settings have one name again: a later write to the
    name the tool made outside .claude changes nothing Claude Code reads."""
    argv = hooked(project, ATTACKS["hard link out"])
    ran = subprocess.run(argv, cwd=project, env=ENV, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 125, ran.stderr
    settings = project / ".claude" / "settings.json"
    assert settings.stat().st_nlink == 1
    (project / "example-settings.json").write_text(EVIL)
    assert json.loads(settings.read_text()) == SETTINGS


def test_a_run_beside_a_hostile_one_puts_back_what_was_there_before_both(project: Path
                                                                         ) -> None:
    """A long run (a server in the background) changes the settings and stays; a run
    started meanwhile must not take the changed settings for what it has to put back."""
    before = state(project)
    hostile = hooked(project, f"printf '%s' '{EVIL}' > .claude/settings.json; touch .changed; "
                              "sleep 6")
    first = subprocess.Popen(hostile, cwd=project, env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        changed(project)
        # started while the first runs (6 s), ended after it (10 s)
        second = subprocess.Popen(hooked(project, "sleep 10"), cwd=project, env=ENV,
                                  stderr=subprocess.PIPE, text=True)
        first.communicate(timeout=60)
        second.communicate(timeout=60)
    finally:
        for each in (first, locals().get("second")):
            if each is not None and each.poll() is None:
                each.kill()
    assert {k: v for k, v in state(project).items() if ".sandlock-changed-" not in k
            and k != ".changed"} == before


def test_the_hook_keeps_the_project_not_where_a_command_went(project: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A command's ``cd`` (through a link it made, too) moves Claude Code's working
    directory; the settings Claude Code reads stay in the project it was started in."""
    from sandlock.integrations import claude_code, shell_rules

    monkeypatch.setenv("CLAUDE_PROJECT_DIR", str(project))
    assert claude_code.kept_paths("/somewhere/else") == [
        str(project / ".claude"), str(project / ".mcp.json")]
    monkeypatch.delenv("CLAUDE_PROJECT_DIR")
    assert claude_code.kept_paths(str(project)) == [
        str(project / ".claude"), str(project / ".mcp.json")]
    with pytest.raises(shell_rules.Refused):
        claude_code.kept_paths(None)


# ----------------------------------------------------------------------------
# A directory above the kept path moved, a link kept, a restore that cannot be written


def _kept_and_put_back(path: Path) -> Optional[str]:
    """A second run keeping ``path`` (in process), put back at once: what it said."""
    second = keep_module.keep(str(path))
    try:
        return keep_module.put_back(second)
    finally:
        second.close()


def keep_run(where: Path, keep: list[Path], command: str, *, workspace: Path
             ) -> subprocess.CompletedProcess[str]:
    """`sandlock run --policy shell` of ``command`` in ``where``, keeping ``keep``."""
    argv = [sys.executable, "-P", "-m", "sandlock", "run", "--policy", "shell", "--var",
            f"workspace={workspace}"]
    for path in keep:
        argv += ["--keep", str(path)]
    return subprocess.run([*argv, "--", "/bin/sh", "-c", command], cwd=where, env=ENV,
                          capture_output=True, text=True, timeout=60)


def repository(tmp_path: Path) -> Path:
    where = tmp_path / "repo"
    (where / ".git" / "hooks").mkdir(parents=True)
    (where / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (where / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return where


MOVES = {
    # the directory holding the kept file is moved, a copy made in its place and changed
    "parent copied": (".git/config", "mv .git .git.tmp && cp -a .git.tmp .git && "
                                      "printf '[core]\\n\\tfsmonitor = evil\\n' >> .git/config"),
    # the same, the original removed: it is made again around the kept file
    "parent removed": (".git/config", "rm -r .git && mkdir .git && echo evil > .git/config"),
    # a link to a directory of the tool's in its place
    "parent a link": (".git/config", "mv .git .git.tmp && mkdir -p ../evil && "
                                     "echo evil > ../evil/config && ln -s ../evil .git"),
}


@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_directory_above_the_kept_path_moved_by_the_tool(tmp_path: Path, move: str) -> None:
    repo = repository(tmp_path)
    kept, command = MOVES[move]
    ran = keep_run(repo, [repo / kept, repo / ".git" / "hooks"], command, workspace=tmp_path)
    assert ran.returncode == 125, ran.stderr
    assert (repo / ".git").is_dir() and not (repo / ".git").is_symlink()
    assert (repo / ".git" / "config").read_text() == "[core]\n\tbare = false\n"
    assert (repo / ".git" / "hooks").is_dir()
    if move != "parent removed":  # copied, or moved back: the rest of the original is there
        assert (repo / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    # what the tool left, moved aside once: the link, or its config in the directory it
    # made (a directory at the name is taken as it is, its kept paths put back by name)
    aside = [p for p in repo.rglob("*") if ".sandlock-changed-" in p.name]
    assert len(aside) == 1, ran.stderr
    if move == "parent a link":
        assert "a directory above the kept path" in ran.stderr
    # the positive control: the same command without --keep leaves the change in place
    control = repository(tmp_path / "control")
    done = keep_run(control, [], command, workspace=tmp_path / "control")
    assert done.returncode == 0, done.stderr
    assert (control / ".git" / "config").read_text() != "[core]\n\tbare = false\n"


def test_a_directory_two_levels_up_moved_by_the_tool(tmp_path: Path) -> None:
    """The hook's case with a workspace wider than the project: the project itself moved."""
    ws = tmp_path / "ws"
    project = ws / "proj"
    (project / ".claude").mkdir(parents=True)
    (project / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    command = (f"mv proj proj.orig && cp -a proj.orig/. proj/ 2>/dev/null; mkdir -p proj && "
               f"printf '%s' '{EVIL}' > proj/.claude/settings.json")
    ran = keep_run(ws, [project / ".claude", project / ".mcp.json"], command, workspace=ws)
    assert ran.returncode == 125, ran.stderr
    assert json.loads((project / ".claude" / "settings.json").read_text()) == SETTINGS
    assert not (project / ".mcp.json").exists()


@pytest.mark.parametrize("where", ["the kept path", "inside it, out", "inside it, up"])
def test_a_kept_link_is_refused_unless_it_stays_inside(tmp_path: Path, where: str) -> None:
    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    (project / "config" / "mcp.json").write_text("{}")
    (project / ".claude").mkdir()
    if where == "the kept path":
        (project / ".mcp.json").symlink_to("config/mcp.json")
        kept = project / ".mcp.json"
    else:
        target = str(project / "config" / "mcp.json") if where.endswith("out") else "../config/mcp.json"
        (project / ".claude" / "settings.json").symlink_to(target)
        kept = project / ".claude"
    ran = keep_run(project, [kept], "echo evil > config/mcp.json", workspace=project)
    assert ran.returncode == 125 and "cannot be kept" in ran.stderr and "link" in ran.stderr
    assert (project / "config" / "mcp.json").read_text() == "{}"  # it never ran


def test_a_link_that_stays_inside_the_kept_directory_is_kept(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / ".claude").mkdir(parents=True)
    (project / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    (project / ".claude" / "current.json").symlink_to("settings.json")
    ran = keep_run(project, [project / ".claude"],
                   f"rm .claude/current.json && printf '%s' '{EVIL}' > .claude/current.json",
                   workspace=project)
    assert ran.returncode == 125, ran.stderr
    assert os.readlink(project / ".claude" / "current.json") == "settings.json"


@pytest.mark.skipif(not IS_ROOT, reason="a small file system of its own needs root (mount)")
def test_a_full_disk_never_leaves_a_half_written_kept_path(tmp_path: Path) -> None:
    """The tool writes the settings, then fills the disk: the restore is written whole
    beside the path before it is renamed in, or not at all."""
    small = tmp_path / "small"
    small.mkdir()
    good = json.dumps(SETTINGS) + " " * 20000
    script = f"""
set -e
mount -t tmpfs -o size=256k tmpfs {small}
mkdir -p {small}/proj/.claude
printf '%s' '{good}' > {small}/proj/.claude/settings.json
cd {small}/proj
set +e
{shlex.join([sys.executable, "-P", "-m", "sandlock", "run", "--policy", "shell", "--var",
             f"workspace={small}/proj", "--keep", f"{small}/proj/.claude", "--", "/bin/sh", "-c",
             "echo '{}' > .claude/settings.json; cat /dev/zero > fill 2>/dev/null; true"])}
"""
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                           script + f"echo rc=$?; ls -a {small}/proj/.claude 2>&1; "
                           f"wc -c < {small}/proj/.claude/settings.json 2>&1; true"],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert "rc=125" in done.stdout, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    size = lines[-1].strip()
    # either put back whole, or nothing there (the tool's version moved aside): never a part
    assert size == str(len(good)) or "No such file" in size, done.stdout
    assert "sandlock-restore" not in done.stdout  # no staged copy left behind


def test_a_kept_path_inside_another_is_put_back_first(tmp_path: Path) -> None:
    """The hook keeps .claude, then the rules file in it: the outer path's copy, put back
    last, is what was; put back first, the inner path's walk took it for a directory the
    tool made and moved the tool's edited one back over it."""
    project = tmp_path / "project"
    (project / ".claude").mkdir(parents=True)
    (project / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    (project / ".claude" / "rules.toml").write_text('[default]\npolicy = "shell"\n')
    command = (f"mv .claude .claude-old && printf '%s' '{EVIL}' > .claude-old/settings.json "
               "&& cp -a .claude-old .claude")
    ran = keep_run(project, [project / ".claude", project / ".claude" / "rules.toml"], command,
                   workspace=project)
    assert ran.returncode == 125, ran.stderr
    assert json.loads((project / ".claude" / "settings.json").read_text()) == SETTINGS
    assert (project / ".claude" / "rules.toml").read_text() == '[default]\npolicy = "shell"\n'


def test_two_kept_paths_under_a_directory_the_tool_removed(tmp_path: Path) -> None:
    """Both walks find the directory gone: the one made again for the first stands for it
    in the second (not moved aside as the tool's)."""
    project = tmp_path / "project"
    (project / "conf" / "p").mkdir(parents=True)
    (project / "conf" / "rules.toml").write_text("rules\n")
    (project / "conf" / "p" / "dev.toml").write_text("dev\n")
    ran = keep_run(project, [project / "conf" / "rules.toml", project / "conf" / "p" / "dev.toml"],
                   "rm -r conf", workspace=project)
    assert ran.returncode == 125, ran.stderr
    assert (project / "conf" / "rules.toml").read_text() == "rules\n"
    assert (project / "conf" / "p" / "dev.toml").read_text() == "dev\n"
    assert not [p for p in project.iterdir() if ".sandlock-changed-" in p.name], ran.stderr



def test_threads_keeping_paths_of_one_directory_share_one_chain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sandlock mcp serve` keeps paths in threads at once. Two threads that both find no
    chain held for the directory must not both make one (the second would replace the
    first in the table, and the first's close take the second's out while it is used):
    both chains are made at once here (each waits for the other, at most a second)."""
    import threading

    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text("{}")
    both = threading.Barrier(2)
    made = keep_module._Chain.__init__

    def at_once(self: object, real: str) -> None:
        try:
            both.wait(timeout=1)  # the other thread is here too, unless it must wait its turn
        except threading.BrokenBarrierError:
            pass
        made(self, real)  # type: ignore[arg-type]

    monkeypatch.setattr(keep_module._Chain, "__init__", at_once)
    kept: dict[str, keep_module.Kept] = {}

    def worker(name: str) -> None:
        kept[name] = keep_module.keep(str(tmp_path / name))

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("a.json", "b.json")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert kept["a.json"].chain is kept["b.json"].chain
        assert kept["a.json"].chain is not None and kept["a.json"].chain.users == 2
    finally:
        for each in kept.values():
            each.close()
    assert not keep_module._CHAINS


@pytest.mark.parametrize("above", ["rules", "project"])
def test_a_directory_above_a_kept_path_made_unsearchable(tmp_path: Path, above: str) -> None:
    """Landlock does not govern chmod: the tool takes the search right off a directory
    it owns above a kept path (one it is not granted: ~/.config above the hook's rules
    file, or ~/src above the project), to make the walk down to it fail. Every held
    directory's mode is put back first: .claude is as it was, and so is that mode."""
    config = tmp_path / "config"
    rules = config / "hook" / "rules.toml"
    rules.parent.mkdir(parents=True)
    rules.write_text('[default]\npolicy = "shell"\n')
    base = tmp_path / "src"
    project = base / "project"
    (project / ".claude").mkdir(parents=True)
    (project / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    hidden = config if above == "rules" else base
    command = f"printf '%s' '{EVIL}' > .claude/settings.json && chmod 000 {shlex.quote(str(hidden))}"
    try:
        ran = keep_run(project, [project / ".claude", rules], command, workspace=project)
    finally:
        mode = hidden.stat().st_mode & 0o777 if os.access(hidden.parent, os.X_OK) else None
        hidden.chmod(0o755)  # the test's own cleanup: the product must have done this
    assert ran.returncode == 125, ran.stderr
    assert "internal error" not in ran.stderr, ran.stderr
    assert mode != 0, ran.stderr  # its mode is back
    assert json.loads((project / ".claude" / "settings.json").read_text()) == SETTINGS, ran.stderr
    assert rules.read_text() == '[default]\npolicy = "shell"\n'
    assert not [p for p in base.iterdir() if ".sandlock-changed-" in p.name]
    assert not [p for p in tmp_path.iterdir() if ".sandlock-changed-" in p.name]


def test_a_kept_path_that_cannot_be_put_back_leaves_the_others_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever one kept path's put-back raises, the others are put back, and the run
    says which could not be (in process: the launcher's loop over them)."""
    from sandlock.exec import launcher

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "settings.json").write_text("{}")
    first = keep_module.keep(str(tmp_path / "a" / "settings.json"))
    second = keep_module.keep(str(tmp_path / "b" / "settings.json"))
    try:
        (tmp_path / "b" / "settings.json").write_text(EVIL)
        real = keep_module._put_back

        def broken(kept: keep_module.Kept) -> object:
            if kept is first:
                raise ValueError("an unexpected failure")
            return real(kept)

        monkeypatch.setattr(keep_module, "_put_back", broken)
        out, into = os.pipe()
        launcher._put_back([first, second], into)
        os.close(into)
        with os.fdopen(out) as said:
            report = said.read()
    finally:
        first.close()
        second.close()
    assert (tmp_path / "b" / "settings.json").read_text() == "{}"
    assert "an unexpected failure" in report, report


def test_a_run_keeping_a_path_by_another_name_shares_what_was_there(tmp_path: Path) -> None:
    """Two runs keep one .claude under two names (the real path, as `mcp serve` names it,
    and one through a link, as the hook may): the second, started after the first's tool
    changed it, must put back what was there before both, not the change."""
    real = tmp_path / "real"
    (real / ".claude").mkdir(parents=True)
    (real / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    link = tmp_path / "link"
    link.symlink_to(real)
    first = keep_module.keep(str(real / ".claude"))
    try:
        (real / ".claude" / "settings.json").write_text(EVIL)  # the first run's tool
        said = _kept_and_put_back(link / ".claude")
    finally:
        first.close()
    assert said is not None and "as it was before the run" in said
    assert json.loads((real / ".claude" / "settings.json").read_text()) == SETTINGS


def test_a_failed_mend_closes_its_descriptor_once(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A mend consumes the descriptor it is given, whatever it raises: closed again by
    the put-back, the number would be another thread's by then (mcp serve's calls run at
    once), here the one the failing mend opened last."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "settings.json").write_text("{}")
    kept = keep_module.keep(str(tmp_path / "dir" / "settings.json"))
    others: list[int] = []

    def failing(self: keep_module._Chain, fd: int, depth: int) -> object:
        os.close(fd)
        others.append(os.open("/dev/null", os.O_RDONLY))  # the lowest number: fd's
        raise OSError(13, "Permission denied")

    try:
        monkeypatch.setattr(keep_module._Chain, "_descend", lambda self, fd, depth: (fd, 0))
        monkeypatch.setattr(keep_module._Chain, "mend", failing)
        with pytest.raises(keep_module.KeepError, match="Permission denied"):
            keep_module.put_back(kept)
        assert others and os.fstat(others[0])  # still open: not closed a second time
    finally:
        for fd in others:
            os.close(fd)
        kept.close()


def test_a_kept_paths_shared_copy_outlasts_many_others(tmp_path: Path) -> None:
    """The shared copy of what a kept path was, and its locks, are not pruned while a run
    keeps it: other paths kept meanwhile (more than the cache's bound) made the next run
    think it was alone, and take the running tool's change for what was there."""
    (tmp_path / ".claude").mkdir()
    (tmp_path / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    first = keep_module.keep(str(tmp_path / ".claude"))
    try:
        (tmp_path / ".claude" / "settings.json").write_text(EVIL)  # the running tool's change
        others = tmp_path / "others"
        others.mkdir()
        for index in range(300):  # each another kept path: its copy and its two locks
            (others / f"{index}.json").write_text("{}")
            keep_module.keep(str(others / f"{index}.json")).close()
        said = _kept_and_put_back(tmp_path / ".claude")
    finally:
        first.close()
    assert said is not None, "the second run took the change for what was there"
    assert json.loads((tmp_path / ".claude" / "settings.json").read_text()) == SETTINGS
    # still bounded: the copies no run keeps are removed past the bound
    from sandlock.compile.cachekey import key_directory

    where = key_directory()
    assert where is not None
    copies = [n for n in os.listdir(os.path.join(where, held.KEEP_DIR))
              if not n.startswith(".") and "." not in n]
    assert len(copies) <= keep_module.MAX_COPIES + 1


def test_a_run_never_undoes_another_runs_put_back(tmp_path: Path) -> None:
    """Two runs at once: one keeps .claude (its tool rewrites the settings), the other a
    rules file in it. The first puts .claude back as a new directory; the second, ending
    later, held the old one (the tool's): moved back, it undid the first's put-back. A
    directory at the name is taken as it is, and the kept paths in it are put back."""
    project = tmp_path / "project"
    (project / ".claude").mkdir(parents=True)
    (project / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    (project / ".claude" / "rules.toml").write_text('[default]\npolicy = "shell"\n')
    whole = keep_module.keep(str(project / ".claude"))
    inner = keep_module.keep(str(project / ".claude" / "rules.toml"))
    try:
        (project / ".claude" / "settings.json").write_text(EVIL)  # the first run's tool
        said = keep_module.put_back(whole)
        assert said is not None and "as it was before the run" in said
        assert keep_module.put_back(inner) is None  # the rules file is as it was
    finally:
        inner.close()
        whole.close()
    assert json.loads((project / ".claude" / "settings.json").read_text()) == SETTINGS


def test_a_directory_made_in_place_of_one_above_and_made_unsearchable(tmp_path: Path) -> None:
    """A directory at the name of one held is taken as it is, with the mode of the one
    held: the tool's own, made unsearchable (chmod 000), would stop the walk down."""
    ws = tmp_path / "ws"
    project = ws / "a" / "proj"
    (project / ".claude").mkdir(parents=True)
    (project / ".claude" / "settings.json").write_text(json.dumps(SETTINGS))
    mode = (ws / "a").stat().st_mode & 0o777
    command = (f"mv a a.old && mkdir -p a/proj/.claude && printf '%s' '{EVIL}' > "
               "a/proj/.claude/settings.json && chmod 000 a")
    try:
        ran = keep_run(ws, [project / ".claude"], command, workspace=ws)
    finally:
        now = (ws / "a").stat().st_mode & 0o777
        (ws / "a").chmod(0o755)
    assert ran.returncode == 125, ran.stderr
    assert now == mode, ran.stderr
    assert json.loads((project / ".claude" / "settings.json").read_text()) == SETTINGS, ran.stderr


def _two_runs(tmp_path: Path, first_kept: Path, first_tool: str, second_kept: Path
              ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """Two runs at once in ``tmp_path / "w"``: the first keeps ``first_kept`` and runs
    ``first_tool`` (then waits for the second to start); the second, started once the
    first's tool is done, keeps ``second_kept`` and ends after the first."""
    project = tmp_path / "w"

    def start(kept: Path, command: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-P", "-m", "sandlock", "run", "--policy", "shell", "--var",
                f"workspace={tmp_path}", "--keep", str(kept), "--", "/bin/sh", "-c", command]
        return subprocess.Popen(argv, cwd=project, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 30
        while not (tmp_path / name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    first = start(first_kept, f"{first_tool} && touch ../changed && "
                              "while [ ! -e ../started ]; do sleep 0.05; done")
    wait_for("changed")
    second = start(second_kept, "touch ../started; while [ ! -e ../first-done ]; do sleep 0.05; done")
    wait_for("started")
    if second.poll() is not None:  # refused before its tool ran
        (tmp_path / "started").touch()
    out, err = first.communicate(timeout=60)
    (tmp_path / "first-done").touch()
    out2, err2 = second.communicate(timeout=60)
    return (subprocess.CompletedProcess(first.args, first.returncode, out, err),
            subprocess.CompletedProcess(second.args, second.returncode, out2, err2))


def test_a_run_started_after_a_tool_replaced_the_parent_shares_what_was_there(
        tmp_path: Path) -> None:
    """Two runs keep .claude/settings.json; the first's tool replaces .claude with a
    directory of its own. The second, started then, found no copy under the new
    directory's identity and took the tool's file for what was there; it put it back
    after the first had put the original back. The copy is named by the real path."""
    project = tmp_path / "w"
    (project / ".claude").mkdir(parents=True)
    kept = project / ".claude" / "settings.json"
    kept.write_text(json.dumps(SETTINGS))
    _, second = _two_runs(tmp_path, kept, f"mv .claude .claude.old && mkdir .claude && "
                                          f"printf '%s' '{EVIL}' > .claude/settings.json", kept)
    assert json.loads(kept.read_text()) == SETTINGS, second.stderr


@pytest.mark.parametrize("order", ["inner second", "outer second"])
def test_runs_keeping_nested_paths_at_once(tmp_path: Path, order: str) -> None:
    """One run keeps .claude, another .claude/settings.json, at once; the first's tool
    writes a hook into the settings. The second took that for what was there, and put
    it back after the first had put the original back. It is refused now (nothing ran),
    and the settings are the original's."""
    project = tmp_path / "w"
    (project / ".claude").mkdir(parents=True)
    settings = project / ".claude" / "settings.json"
    settings.write_text(json.dumps(SETTINGS))
    outer, inner = project / ".claude", settings
    first_kept, second_kept = (outer, inner) if order == "inner second" else (inner, outer)
    first, second = _two_runs(tmp_path, first_kept,
                              f"printf '%s' '{EVIL}' > .claude/settings.json", second_kept)
    assert first.returncode == 125, first.stderr
    assert second.returncode == 125 and "a running sandlock run keeps" in second.stderr, \
        second.stderr
    assert json.loads(settings.read_text()) == SETTINGS


def test_a_nested_probe_never_takes_the_lock_of_a_deciding_run(tmp_path: Path) -> None:
    """Looking for a run that keeps a path around this one took that path's ``.held``
    lock for an instant: a run deciding then, for that path, took it for another run's
    and read a stale copy. A run deciding holds the path's ``.lock``: its path counts as
    kept, and its ``.held`` is not touched."""
    import fcntl

    from sandlock.compile.cachekey import key_directory

    outer = tmp_path / ".claude"
    outer.mkdir()
    directory = os.open(os.path.join(str(key_directory()), held.KEEP_DIR),
                        os.O_RDONLY | os.O_DIRECTORY)
    name = held.copy_name(str(outer))
    deciding = os.open(f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600, dir_fd=directory)
    os.close(os.open(f"{name}.held", os.O_RDWR | os.O_CREAT, 0o600, dir_fd=directory))
    try:
        fcntl.flock(deciding, fcntl.LOCK_EX)  # another run, deciding about .claude now
        found = keep_module._kept_around(directory, str(outer / "settings.json"))
    finally:
        os.close(deciding)
        os.close(directory)
    assert found == str(outer)


# ----------------------------------------------------------------------------
# A tenth attack round: what the tool sets beside a file's bytes and mode

USER, GROUP, OTHER, NAMED, MASK = 0x01, 0x04, 0x20, 0x02, 0x10


def _acl(*entries: tuple[int, int, int]) -> bytes:
    """A POSIX ACL as the kernel stores it (``system.posix_acl_*``): (tag, perms, id)."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


ANYONE = 0xFFFFFFFF
#: Every local user may write what the user later makes in the directory (a file made
#: with umask 022 came out -rw-rw-rw-+).
WIDE_DEFAULT = _acl((USER, 7, ANYONE), (GROUP, 7, ANYONE), (OTHER, 7, ANYONE))
#: uid 54321 may write the file (an access ACL equal to a mode would be only a mode).
NAMED_WRITER = _acl((USER, 6, ANYONE), (NAMED, 6, 54321), (GROUP, 4, ANYONE), (MASK, 6, ANYONE),
                    (OTHER, 4, ANYONE))
SET_ATTRIBUTES = {
    "a default ACL on the kept directory": (".claude", "system.posix_acl_default", WIDE_DEFAULT),
    "an ACL on a kept file": (".claude/settings.json", "system.posix_acl_access", NAMED_WRITER),
    "an attribute of a kept file": (".claude/settings.json", "user.note", b"x"),
}
PYTHON3 = "/usr/bin/python3"


def attributes(path: Path) -> dict[str, bytes]:
    return {name: os.getxattr(path, name) for name in os.listxattr(path)
            if name.startswith(("user.", "system.posix_acl_"))}


def _setting(where: str, name: str, value: bytes) -> str:
    """A command that gives ``where`` the attribute ``name`` (Landlock does not govern it)."""
    return (f"{PYTHON3} -c \"import os; os.setxattr('{where}', '{name}', "
            f"bytes.fromhex('{value.hex()}'))\"")


def _attributes_or_skip(project: Path) -> None:
    if not os.path.exists(PYTHON3):
        pytest.skip(f"{PYTHON3} is not installed")
    probe = project / "notes.md"
    try:
        os.setxattr(probe, "user.probe", b"1")
        os.setxattr(project / ".claude", "system.posix_acl_default", WIDE_DEFAULT)
    except OSError as exc:
        pytest.skip(f"no extended attributes or ACLs here: {exc}")
    os.removexattr(probe, "user.probe")
    os.removexattr(project / ".claude", "system.posix_acl_default")


@pytest.mark.parametrize("attack", sorted(SET_ATTRIBUTES))
def test_an_acl_or_attribute_the_tool_set_is_taken_back(project: Path, attack: str) -> None:
    """setxattr is no Landlock right either: a default ACL on .claude made every file the
    user wrote there later writable by every local user, and the run said nothing."""
    _attributes_or_skip(project)
    where, name, value = SET_ATTRIBUTES[attack]
    target = project / where
    before = attributes(target)
    argv = hooked(project, _setting(where, name, value))
    ran = subprocess.run(argv, cwd=project, env=ENV, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 125, ran.stderr
    assert "a path kept for this run" in ran.stderr
    assert attributes(target) == before == {}
    # the positive control: without --keep, the same command sets it
    control = subprocess.run(unkept(argv), cwd=project, env=ENV, capture_output=True,
                             text=True, timeout=60)
    assert control.returncode == 0, control.stderr
    assert attributes(target) == {name: value}


def test_a_kept_path_put_back_takes_no_acl_from_the_directory_around_it(project: Path) -> None:
    """What is put back is made anew in the project, whose default ACL (the tool's) a new
    file and directory take: they are given what was kept instead."""
    _attributes_or_skip(project)
    command = (_setting(".", "system.posix_acl_default", WIDE_DEFAULT)
               + f" && printf '%s' '{EVIL}' > .claude/settings.json")
    argv = hooked(project, command)
    ran = subprocess.run(argv, cwd=project, env=ENV, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 125, ran.stderr
    assert json.loads((project / ".claude" / "settings.json").read_text()) == SETTINGS
    assert attributes(project / ".claude") == attributes(project / ".claude" / "settings.json") == {}
    # the positive control: a directory made there now takes the tool's ACL
    (project / "made").mkdir()
    assert "system.posix_acl_default" in attributes(project / "made")


def _read_refused(path: Path, match: str = "running sandlock run") -> None:
    """Reading ``path`` as a policy file is refused (what a running run keeps, changed)."""
    from sandlock.policy.kept import ChangedByARun, Reading

    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ChangedByARun, match=match):
            with Reading(fd, str(path)) as reading:
                reading.check(os.read(fd, 1 << 16), str(path))
    finally:
        os.close(fd)


@pytest.mark.parametrize("which", ["keep", "state"])
def test_a_tool_that_opens_sandlocks_directories_to_others_changes_nothing(
        tmp_path: Path, which: str) -> None:
    """A tool may chmod what its uid owns (Landlock does not govern it): sandlock's keep
    directory, or its state directory, opened to the group made every later --keep run
    fail, and the check of kept policy files skip (its directory no longer private). They
    are made private again. The chmod itself is the control: it is done, confined."""
    from conftest import PYTHON, run_confined, write_policy

    from sandlock.compile.cachekey import key_directory

    state = Path(str(key_directory()))
    target = state / held.KEEP_DIR if which == "keep" else state
    kept_file = tmp_path / "kept.toml"
    kept_file.write_text("version = 1\n")
    keep_module.keep(str(kept_file)).close()  # the keep directory exists
    before = target.stat().st_mode & 0o7777
    policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n')
    try:
        done = run_confined(policy, [PYTHON, "-c", f"import os; os.chmod({str(target)!r}, 0o770)"])
        assert done.returncode == 0 and target.stat().st_mode & 0o777 == 0o770, done.stderr
        first = keep_module.keep(str(kept_file))  # a run keeping it, as a hooked one does
        try:
            assert target.stat().st_mode & 0o077 == 0
            kept_file.write_text('version = 1\n[filesystem]\nwrite = ["/"]\n')  # its tool
            os.chmod(target, 0o770)  # again, while the run keeps it
            _read_refused(kept_file)
        finally:
            first.close()
            kept_file.write_text("version = 1\n")
    finally:
        os.chmod(target, before)


def test_a_keep_directory_that_cannot_be_trusted_refuses_the_read(tmp_path: Path) -> None:
    """A directory above the keep directory opened to others (a tool may chmod its uid's
    ~/.cache): whether a running run keeps a policy file cannot be told any more. The
    read is refused; it was allowed unchecked."""
    from sandlock.compile.cachekey import key_directory

    above = Path(str(key_directory())).parent
    kept_file = tmp_path / "kept.toml"
    kept_file.write_text("version = 1\n")
    first = keep_module.keep(str(kept_file))
    before = above.stat().st_mode & 0o7777
    try:
        kept_file.write_text('version = 1\n[filesystem]\nwrite = ["/"]\n')
        os.chmod(above, 0o777)
        _read_refused(kept_file, "cannot tell whether")
    finally:
        os.chmod(above, before)
        first.close()


def test_a_stored_copy_that_is_not_this_users_is_not_trusted(tmp_path: Path) -> None:
    """What a kept path was is read from its copy in the keep directory; one that another
    uid made there (the directory open to others a moment) says nothing: its content,
    the changed file's own, must not vouch for the change."""
    import marshal

    from sandlock.policy.kept import copy_name, keep_directory

    if not IS_ROOT:
        pytest.skip("gives a file to another uid: needs root")
    kept_file = tmp_path / "kept.toml"
    kept_file.write_text("version = 1\n")
    first = keep_module.keep(str(kept_file))
    try:
        changed = b'version = 1\n[filesystem]\nwrite = ["/"]\n'
        kept_file.write_bytes(changed)
        directory = keep_directory()
        assert directory is not None
        name = copy_name(os.path.realpath(kept_file))
        forged = os.open(f".{name}.forged", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600,
                         dir_fd=directory)
        os.write(forged, marshal.dumps((0o755, ("f", 0o644, changed, ()))))
        os.fchown(forged, 54321, 54321)
        os.close(forged)
        os.rename(f".{name}.forged", name, src_dir_fd=directory, dst_dir_fd=directory)
        os.close(directory)
        _read_refused(kept_file)
    finally:
        first.close()
