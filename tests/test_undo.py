"""Review and undo (docs/undo.md) on the real kernel, with real tools (sh, sed, rm, python3):
`sandlock run --dry-run` then `changes`, `discard`, `apply`; `--checkpoint` then
`rollback`; and the attacks on apply and rollback, each with its control (the same
attack with the guard switched off succeeds)."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import POLICIES

from sandlock.undo import record, session, tree

SHELL = str(POLICIES / "shell.toml")
#: A tool that deletes, rewrites, creates and chmods files in its workspace.
EDIT = ("sed -i s/world/there/ a.txt && rm b.txt && rm -r gone && echo new > n.txt && "
        "chmod 700 sub/c.txt && /usr/bin/python3 -c \"open('sub/py.txt', 'w').write('from python\\n')\" "
        "&& printf 'esc' > \"x$(printf '\\033')[31m\"")


@pytest.fixture
def ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A workspace, and a private cache (records, snapshots, scratch) for this test."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    work = tmp_path / "ws"
    (work / "sub").mkdir(parents=True)
    (work / "gone").mkdir()
    (work / "a.txt").write_text("hello\nworld\n")
    (work / "b.txt").write_text("keep me\n")
    (work / "sub" / "c.txt").write_bytes(b"\x00binary\xff")
    (work / "gone" / "d.txt").write_text("d\n")
    os.chmod(work / "b.txt", 0o640)
    for index, path in enumerate(sorted(work.rglob("*"), reverse=True)):
        os.utime(path, ns=(1_500_000_000_000_000_000 + index, 1_600_000_000_000_000_000 + index))
    os.utime(work, ns=(1_500_000_000_000_000_000, 1_600_000_000_000_000_000))
    return work


def state(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything below ``root`` a rollback must restore: kind, mode, mtime, bytes."""
    out: dict[str, tuple[Any, ...]] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        info = path.lstat()
        body: Any = None
        if stat.S_ISREG(info.st_mode):
            body = path.read_bytes()
        elif stat.S_ISLNK(info.st_mode):
            body = os.readlink(path)
        out[str(path.relative_to(root))] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode),
                                            info.st_mtime_ns, body)
    return out


def cli(*args: str, cwd: Optional[Path] = None) -> subprocess.CompletedProcess[str]:
    # -P: the working directory (the workspace) is not put on sandlock's import path
    return subprocess.run([sys.executable, "-P", "-m", "sandlock", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def reviewed(ws: Path, flag: str, script: str) -> tuple[subprocess.CompletedProcess[str], str]:
    done = cli("run", "--policy", SHELL, "--var", f"workspace={ws}", flag, "--", "sh", "-c",
               script, cwd=ws)
    found = re.search(r"run (\S+) \((dry-run|checkpoint)\)", done.stderr)
    assert found, done.stderr
    return done, found.group(1)


def scratch_of(name: str) -> Path:
    return Path(record.scratch_path()) / name / "0"


def test_dry_run_shows_the_change_and_discard_leaves_the_workspace(ws: Path) -> None:
    before = state(ws)
    done, name = reviewed(ws, "--dry-run", "pwd && " + EDIT)
    assert done.returncode == 0, done.stderr
    assert state(ws) == before  # the originals were never granted
    assert done.stdout.strip() == str(scratch_of(name))  # the tool worked in the copy
    err = done.stderr
    for line in (f"M {ws}/a.txt", "-world", "+there", f"D {ws}/b.txt", f"D {ws}/gone/",
                 f"A {ws}/n.txt", f"m {ws}/sub/c.txt mode 0644 -> 0700", "+from python",
                 f"A {ws}/x\\x1b[31m", "+esc"):
        assert f"sandlock: {line}\n" in err or f"sandlock:     {line}\n" in err, (line, err)
    assert "\x1b" not in err  # the tool's file name and content, escaped
    listed = cli("changes", "--no-diff", name)
    assert listed.returncode == 0 and f"D {ws}/b.txt" in listed.stdout
    assert cli("discard", name).returncode == 0
    assert state(ws) == before
    assert not scratch_of(name).parent.exists()
    gone = cli("apply", name)
    assert gone.returncode == 125 and f"no run {name}" in gone.stderr


def test_apply_lands_what_the_tool_did(ws: Path, tmp_path: Path) -> None:
    direct = tmp_path / "direct"
    subprocess.run(["cp", "-a", str(ws), str(direct)], check=True)
    subprocess.run(["sh", "-c", EDIT], cwd=direct, check=True)
    _, name = reviewed(ws, "--dry-run", EDIT)
    applied = cli("apply", name)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.strip() == f"applied 8 change(s) of run {name}"

    def shape(root: Path) -> dict[str, tuple[Any, ...]]:
        return {rel: (kind, mode, body) for rel, (kind, mode, _, body) in state(root).items()}

    assert shape(ws) == shape(direct)
    assert not scratch_of(name).parent.exists()


def test_rollback_restores_byte_for_byte(ws: Path) -> None:
    before = state(ws)
    done, name = reviewed(ws, "--checkpoint", EDIT)
    assert done.returncode == 0, done.stderr
    assert (ws / "a.txt").read_text() == "hello\nthere\n" and not (ws / "b.txt").exists()
    back = cli("rollback", name)
    assert back.returncode == 0, back.stderr
    assert state(ws) == before  # content, modes, mtimes; created files gone, deleted back
    assert cli("rollback", name).returncode == 125


def test_rollback_after_a_reboot(ws: Path) -> None:
    """A checkpoint taken before a reboot rolls back after it: its record is keyed by
    the records key file, not by the keyring's cache key, which a reboot replaces."""
    from conftest import reboot_keyring

    before = state(ws)
    done, name = reviewed(ws, "--checkpoint", EDIT)
    assert done.returncode == 0, done.stderr
    reboot_keyring()
    back = cli("rollback", name)
    assert back.returncode == 0, back.stderr
    assert state(ws) == before


# ----------------------------------------------------------------------------
# Attacks on apply: what the tool left in its scratch


def _refused(name: str, ws: Path, why: str) -> None:
    before = state(ws)
    with pytest.raises(tree.UndoError, match=re.escape(why)):
        session.apply(name)
    assert state(ws) == before  # nothing half-applied


def test_apply_does_not_follow_or_plant_a_link_out_of_the_tree(
        ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "outside.txt"
    secret.write_text("outside\n")
    _, name = reviewed(ws, "--dry-run", f"rm a.txt && ln -s {secret} a.txt")
    _refused(name, ws, "a symbolic link leading out of the tree")
    assert secret.read_text() == "outside\n"
    # control: a naive copy follows it (the outside file's bytes land in the workspace) ...
    naive = tmp_path / "naive"
    subprocess.run(["cp", "-rL", str(scratch_of(name)), str(naive)], check=True)
    assert (naive / "a.txt").read_text() == "outside\n"
    # ... and apply without the guard plants the link in the user's tree
    monkeypatch.setattr(tree, "refusal", lambda *args: None)
    session.apply(name)
    assert os.readlink(ws / "a.txt") == str(secret)


@pytest.mark.parametrize("chain", ["new", "existing"])
def test_apply_does_not_plant_a_chain_of_links_out_of_the_tree(
        ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chain: str) -> None:
    """Links that each look inside on their own lead out together: ``sub/up -> ..`` is
    the tree's root, so ``x -> sub/up/../outside.txt`` is the file beside the tree (the
    kernel follows ``up``, then goes up from the root). ``existing``: the link through
    ``up`` was the user's, inside until the tool made ``up``. Control: apply without the
    guard, and writing through ``x`` changes the file outside."""
    secret = tmp_path / "outside.txt"
    secret.write_text("outside\n")
    if chain == "existing":
        (ws / "x").symlink_to("sub/up/../outside.txt")
        script = "ln -s .. sub/up"
    else:
        script = "ln -s .. sub/up && ln -s sub/up/../outside.txt x"
    _, name = reviewed(ws, "--dry-run", script)
    listed = cli("changes", "--no-diff", name)
    assert "apply refuses it" in listed.stdout, listed.stdout
    _refused(name, ws, "out of the tree")
    monkeypatch.setattr(tree, "refusal", lambda *args: None)  # control
    monkeypatch.setattr(tree, "escapes", lambda *args: [])
    session.apply(name)
    with open(ws / "x", "a") as handle:
        handle.write("through the link\n")
    assert secret.read_text() == "outside\nthrough the link\n"


def test_apply_refuses_a_fifo(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, name = reviewed(ws, "--dry-run", "mkfifo \"$(printf '\\033')pipe\"")
    refused = cli("apply", name)  # the tool's file name, escaped in the refusal
    assert refused.returncode == 125 and "\\x1bpipe: a FIFO, device or socket" in refused.stderr
    assert "\x1b" not in refused.stderr
    _refused(name, ws, "\\x1bpipe: a FIFO, device or socket")
    monkeypatch.setattr(tree, "refusal", lambda *args: None)  # control
    session.apply(name)
    assert stat.S_ISFIFO((ws / "\x1bpipe").lstat().st_mode)


def _planted(ws: Path, plant: Any) -> str:
    """A dry run during which ``plant(scratch)`` runs outside the sandbox: what a tool
    confined by less (no seccomp filter against set-user-ID bits, a Landlock ABI or
    policy that lets it link a file from elsewhere) or any process of the user could
    leave in the scratch. Returns the run's name."""
    script = "echo mine > mine.txt && : > ready && while [ ! -e go ]; do sleep 0.02; done; rm go ready"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "sandlock", "run", "--policy", SHELL,
                             "--var", f"workspace={ws}", "--dry-run", "--", "sh", "-c", script],
                            cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = Path(record.scratch_path())
    deadline = time.monotonic() + 60
    while not list(base.glob("*/0/ready")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    scratch = list(base.glob("*/0/ready"))[0].parent
    plant(scratch)
    (scratch / "go").touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return scratch.parent.name


def test_apply_refuses_a_hard_link_to_a_file_outside(
        ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not the tool's\n")
    secret.chmod(0o600)
    name = _planted(ws, lambda scratch: os.link(secret, scratch / "leak.txt"))
    _refused(name, ws, "leak.txt: a file with more than one hard link")
    monkeypatch.setattr(tree, "refusal", lambda *args: None)  # control
    session.apply(name)
    assert (ws / "leak.txt").read_text() == "not the tool's\n"


def test_apply_refuses_a_setuid_file(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def plant(scratch: Path) -> None:
        (scratch / "suid").write_text("#!/bin/sh\n")
        os.chmod(scratch / "suid", 0o4755)

    name = _planted(ws, plant)
    _refused(name, ws, "suid: a set-user-ID or set-group-ID bit")
    monkeypatch.setattr(tree, "refusal", lambda *args: None)  # control
    session.apply(name)
    assert (ws / "suid").stat().st_mode & stat.S_ISUID


def test_apply_refuses_when_the_original_changed(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, name = reviewed(ws, "--dry-run", EDIT)
    (ws / "a.txt").write_text("the user's own edit\n")
    _refused(name, ws, "the tree changed since the run: a.txt was changed")
    monkeypatch.setattr(tree, "conflicts", lambda root, expect, **_: [])  # control
    session.apply(name)
    assert (ws / "a.txt").read_text() == "hello\nthere\n"  # the user's edit is lost


def test_apply_refuses_a_scratch_changed_after_the_run(ws: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, name = reviewed(ws, "--dry-run", EDIT)
    target = scratch_of(name) / "n.txt"
    target.write_text("changed after the review\n")
    _refused(name, ws, "n.txt: changed since the run ended")


# ----------------------------------------------------------------------------
# Attacks on rollback: the snapshot and the record


@pytest.mark.parametrize("guard", ["digest", "stamp"])
def test_rollback_refuses_a_tampered_snapshot(ws: Path, monkeypatch: pytest.MonkeyPatch,
                                              guard: str) -> None:
    """Two checks, each tested alone (the other switched off): the snapshot file's stamp
    (a rewrite changes its ctime) and its content's digest."""
    _, name = reviewed(ws, "--checkpoint", "echo tool > a.txt")
    snap = Path(record.runs_path()) / name / "snap" / "0" / "a.txt"
    info = snap.stat()
    snap.write_text("planted\n")
    os.utime(snap, ns=(info.st_atime_ns, info.st_mtime_ns))
    after = state(ws)
    if guard == "digest":
        monkeypatch.setattr(tree, "unchanged", lambda info, want, field: True)
        why = "its content is not what was recorded"
    else:
        monkeypatch.setattr(tree, "same_content", lambda digest, want: True)
        why = "a.txt: changed since the run ended"
    with pytest.raises(tree.UndoError, match=why):
        session.rollback(name)
    assert state(ws) == after
    # control: with both checks off the planted bytes are restored
    monkeypatch.setattr(tree, "same_content", lambda digest, want: True)
    monkeypatch.setattr(tree, "unchanged", lambda info, want, field: True)
    session.rollback(name)
    assert (ws / "a.txt").read_text() == "planted\n"


def _forge(name: str, change: Any) -> None:
    path = Path(record.runs_path()) / name / record.RECORD
    data = path.read_bytes()
    value = json.loads(data[record.TAG_BYTES:])
    change(value)
    path.write_bytes(data[:record.TAG_BYTES] + json.dumps(value).encode())


def test_rollback_refuses_a_forged_record(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, name = reviewed(ws, "--checkpoint", "echo tool > a.txt")

    def evil(value: dict[str, Any]) -> None:  # "restore" b.txt as the tool wants it
        snap = Path(record.runs_path()) / name / "snap" / "0" / "b.txt"
        snap.write_text("forged\n")
        entry = value["before"][0]["b.txt"]
        entry["h"] = __import__("hashlib").sha256(b"forged\n").hexdigest()
        entry["s"] = len("forged\n")
        entry["c"] = tree.key(snap.lstat())
        value["after"][0]["b.txt"]["same"] = False

    _forge(name, evil)
    with pytest.raises(tree.UndoError, match="does not verify"):
        session.rollback(name)
    assert (ws / "b.txt").read_text() == "keep me\n"
    monkeypatch.setattr(record, "authentic", lambda tag, body: True)  # control
    session.rollback(name)
    assert (ws / "b.txt").read_text() == "forged\n"


def test_rollback_refuses_when_changed_since_the_run(ws: Path) -> None:
    _, name = reviewed(ws, "--checkpoint", "echo tool > a.txt")
    (ws / "new.txt").write_text("made later\n")
    later = state(ws)
    back = cli("rollback", name)
    assert back.returncode == 125 and "new.txt was created" in back.stderr
    assert state(ws) == later


# ----------------------------------------------------------------------------
# What a review cannot cover is refused, with the policy's line


def test_a_write_grant_on_a_single_file_is_refused(ws: Path, tmp_path: Path) -> None:
    policy = tmp_path / "one.toml"
    policy.write_text(f'version = 1\nextends = ["shell"]\n[filesystem]\nwrite = ["{ws}/a.txt"]\n')
    done = cli("run", "--policy", str(policy), "--var", f"workspace={ws}", "--dry-run", "--",
               "true")
    assert done.returncode == 125
    assert f"one.toml:4 filesystem.write[0]: '{ws}/a.txt' is a write grant on a single file" \
        in done.stderr
    scratch = Path(record.scratch_path())
    assert not scratch.exists() or not any(scratch.iterdir())


def test_run_names_are_checked(ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's name comes from the command line: `discard ../../victim` must not remove
    <cache>/victim (relative to the runs directory)."""
    victim = tmp_path / "cache" / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep\n")
    for bad in ("../../victim", "x", "20260101-120000-0123abcd/.."):
        done = cli("discard", bad)
        assert done.returncode == 125 and "is not the name of a run" in done.stderr, done.stderr
    assert (victim / "precious.txt").read_text() == "keep\n"
    monkeypatch.setattr(record, "RUN_NAME", re.compile(".*"))  # control: without the check
    record.open_base(record.runs_path())  # (made on first use)
    session.forget("../../victim")
    assert not victim.exists()
    both = cli("run", "--policy", SHELL, "--dry-run", "--checkpoint", "--", "true")
    assert both.returncode == 125 and "exclude each other" in both.stderr


# ----------------------------------------------------------------------------
# The API


def test_api_dry_run_then_apply_and_checkpoint_then_rollback(ws: Path) -> None:
    from sandlock import Sandbox
    from sandlock.undo import show

    before = state(ws)
    with Sandbox(SHELL, vars={"workspace": str(ws)}, review="dry-run") as box:
        done = box.run(["sh", "-c", "pwd && " + EDIT], cwd=str(ws), capture_output=True,
                       text=True)
        assert done.returncode == 0, done.stderr
        name = box.finish_review()
    assert done.stdout.strip() == str(scratch_of(name))
    assert state(ws) == before
    listed = show.lines(name, session.load(name), diffs=False)
    assert f"M {ws}/a.txt" in listed and f"D {ws}/b.txt" in listed
    assert session.apply(name) == 8
    assert (ws / "a.txt").read_text() == "hello\nthere\n"

    applied = state(ws)
    with Sandbox(SHELL, vars={"workspace": str(ws)}, review="checkpoint") as box:
        assert box.run(["sh", "-c", "rm -r sub n.txt"], cwd=str(ws)).returncode == 0
    assert not (ws / "sub").exists()
    assert session.rollback(box.finish_review()) == 4  # sub/, its two files, n.txt
    assert state(ws) == applied


# ----------------------------------------------------------------------------
# The copies are no other tool's to read


READER = """\
version = 1
extends = ["shell"]
[filesystem]
read = ["${cache}"]
"""


@pytest.mark.parametrize("flag", ["--checkpoint", "--dry-run"])
def test_another_tool_cannot_read_a_runs_copy(ws: Path, tmp_path: Path, flag: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's snapshot and a pending dry run's copy hold the workspace's files. A
    tool whose policy reads the cache directory (and not the workspace) is refused while
    they exist, naming them; once discarded, the same policy runs. The reviewed run itself
    still works in its own copy (the other tests)."""
    (ws / "private.txt").write_text("only for the workspace's tool\n")
    done, name = reviewed(ws, flag, "true")
    assert done.returncode == 0, done.stderr
    cache = os.environ["XDG_CACHE_HOME"]
    copies = list(Path(cache).rglob("private.txt"))
    assert copies, "the run kept no copy"
    reader = tmp_path / "reader.toml"
    reader.write_text(READER)
    other = tmp_path / "other"
    other.mkdir()

    def read(path: Path, granted: str = cache) -> subprocess.CompletedProcess[str]:
        return cli("run", "--policy", str(reader), "--var", f"workspace={other}", "--var",
                   f"cache={granted}", "--", "cat", str(path))

    refused = read(copies[0])
    assert refused.returncode == 125 and "only for the workspace" not in refused.stdout
    assert name in refused.stderr and "sandlock discard" in refused.stderr, refused.stderr
    assert cli("discard", name).returncode == 0
    # with no copy left the grant is still refused: it covers sandlock's state directory
    # (other runs' plans); positive control: a grant beside it in the cache directory runs,
    # and reads what is there (the copy's bytes, kept elsewhere)
    again = read(copies[0])
    assert again.returncode == 125 and name not in again.stderr, again.stderr
    assert "state directory" in again.stderr, again.stderr
    kept = Path(cache, "kept", "private.txt")
    kept.parent.mkdir()
    kept.write_text("only for the workspace's tool\n")
    allowed = read(kept, str(kept.parent))
    assert allowed.returncode == 0 and "only for the workspace" in allowed.stdout, allowed.stderr


# ----------------------------------------------------------------------------
# Modes a tool set: it may chmod whatever its uid owns (no Landlock right covers it)

#: Deletes a file, leaves a directory it cannot list (with a file in it), one it cannot
#: enter, a file it cannot read, and a directory of the tree it cannot write.
LOCKS = ("rm b.txt && mkdir z && echo in > z/in && chmod 0311 z && mkdir shut && chmod 0 shut "
         "&& echo s > unreadable && chmod 0 unreadable && echo y > sub/new && chmod 0500 sub")


def _as_user() -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads and writes whatever the mode (CAP_DAC_OVERRIDE): needs a user")


@pytest.mark.parametrize("root", ["kept", "closed"])
def test_modes_a_tool_set_do_not_stop_a_rollback(ws: Path, root: str) -> None:
    """After a checkpoint, every change is undone whatever modes the tool left (``closed``:
    its workspace itself too); the tool's own directories and files are removed.
    (Before, the run's end could not be recorded and the run could never be rolled back.)"""
    _as_user()
    before = state(ws)
    script = LOCKS + (f" && chmod 0 {ws}" if root == "closed" else "")
    done, name = reviewed(ws, "--checkpoint", script)
    assert done.returncode == 0, done.stderr
    assert f"D {ws}/b.txt" in done.stderr, done.stderr
    if root == "closed":
        assert stat.S_IMODE(ws.stat().st_mode) == 0  # as the tool left it
    back = cli("rollback", name)
    assert back.returncode == 0, back.stderr
    assert state(ws) == before


def test_modes_a_tool_set_do_not_stop_a_dry_run(ws: Path, tmp_path: Path) -> None:
    """A dry run's changes are listed, applied (modes included) and discarded whatever
    modes the tool left in its copy."""
    _as_user()
    _, name = reviewed(ws, "--dry-run", LOCKS)
    listed = cli("changes", "--no-diff", name)
    assert listed.returncode == 0 and f"A {ws}/z/in" in listed.stdout, listed.stderr
    applied = cli("apply", name)
    assert applied.returncode == 0, applied.stderr
    assert stat.S_IMODE((ws / "z").stat().st_mode) == 0o311
    assert stat.S_IMODE((ws / "unreadable").stat().st_mode) == 0
    assert stat.S_IMODE((ws / "sub").stat().st_mode) == 0o500
    os.chmod(ws / "unreadable", 0o600)
    assert (ws / "unreadable").read_text() == "s\n"
    for where in ("z", "shut", "sub"):
        os.chmod(ws / where, 0o700)
    # the same in a run that is thrown away, its copy of the workspace closed too
    _, name = reviewed(ws, "--dry-run", "rm -r z shut && " + LOCKS.replace("rm b.txt", "rm a.txt")
                       + ' && chmod 0 "$PWD"')
    assert cli("discard", name).returncode == 0
    assert not scratch_of(name).parent.exists()


def test_a_tree_nested_past_the_limit_does_not_stop_a_rollback(ws: Path) -> None:
    """A tool nests directories deeper than sandlock records (tree.MAX_DEPTH) after
    deleting a file: the run's end is still recorded (the deepest directory as a whole),
    `changes` lists it, and `rollback` brings the file back and removes the whole chain.
    (Before, the end could not be recorded and the run could never be rolled back.)"""
    before = state(ws)
    chain = "/".join(["d"] * (tree.MAX_DEPTH + 40))
    done, name = reviewed(ws, "--checkpoint", f"rm b.txt && mkdir -p {chain} && echo x > {chain}/f")
    assert done.returncode == 0, done.stderr
    listed = cli("changes", "--no-diff", name)
    assert listed.returncode == 0 and f"D {ws}/b.txt" in listed.stdout, listed.stderr
    assert "deeper than" in listed.stdout, listed.stdout
    back = cli("rollback", name)
    assert back.returncode == 0, back.stderr
    assert state(ws) == before


def test_a_tree_nested_past_the_limit_is_not_applied_and_is_discarded(ws: Path) -> None:
    """In a dry run the same chain cannot be applied (it was not recorded whole): apply
    refuses, changing nothing; discard removes the copy."""
    before = state(ws)
    chain = "/".join(["d"] * (tree.MAX_DEPTH + 40))
    _, name = reviewed(ws, "--dry-run", f"mkdir -p {chain} && echo x > {chain}/f")
    _refused(name, ws, "deeper than")
    assert cli("discard", name).returncode == 0
    assert not scratch_of(name).parent.exists()
    assert state(ws) == before


#: A second run of the tool, writing the same tree while the rollback removes what the
#: first made: once the remover has begun emptying ``zz/proj/x`` (its first file gone), it
#: moves that directory up to the tree's root.
RACER = """
import os, sys
root, chain = sys.argv[1], sys.argv[2]
top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
inner = os.open(chain + "/x", os.O_RDONLY | os.O_DIRECTORY)
print("armed", flush=True)
while True:
    try:
        os.stat("f00000", dir_fd=inner)
    except FileNotFoundError:
        os.rename(chain + "/x", "x", dst_dir_fd=top)
        print("moved", flush=True)
        break
"""


def test_removing_a_tree_never_climbs_out_of_it(tmp_path: Path) -> None:
    """The remover of a tool's (deep) tree walked back up with "..", which is wherever the
    directory is now: moved by a concurrent run of the tool to the tree's root, the climb
    went on above the root, emptied and removed it, and deleted what was beside it (a chain
    named like the root, ``d/zz/proj/x``, keeps each extra step's rmdir succeeding). Each
    step up must reach the directory it came down from."""
    outside = tmp_path / "v"
    root = outside / "proj"
    chain = root / "d" / "zz" / "proj"
    (chain / "x").mkdir(parents=True)
    for index in range(20000):
        (chain / "x" / f"f{index:05}").touch()
    (root / "a.txt").write_text("the user's\n")
    (outside / "outside.txt").write_text("never granted\n")
    (outside / "other").mkdir()
    (outside / "other" / "keep.txt").write_text("never granted\n")
    racer = subprocess.Popen([sys.executable, "-c", RACER, str(root), str(chain)],
                             stdout=subprocess.PIPE, text=True)
    assert racer.stdout is not None and racer.stdout.readline() == "armed\n"
    parent = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(tree.UndoError, match="moved while it was removed"):
            tree.remove_tree(parent, "d")
    finally:
        os.close(parent)
        racer.kill()
        out = racer.communicate()[0]
    assert out == "moved\n"  # the race was run as meant: the directory moved mid-removal
    assert (outside / "outside.txt").read_text() == "never granted\n"
    assert (outside / "other" / "keep.txt").read_text() == "never granted\n"
    assert (root / "a.txt").read_text() == "the user's\n"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755


def _acl_attack_or_skip(ws: Path) -> None:
    from test_keep import PYTHON3, WIDE_DEFAULT

    if not os.path.exists(PYTHON3):
        pytest.skip(f"{PYTHON3} is not installed")
    try:
        os.setxattr(ws / "a.txt", "user.probe", b"1")
        os.setxattr(ws, "system.posix_acl_default", WIDE_DEFAULT)
    except OSError as exc:
        pytest.skip(f"no extended attributes or ACLs here: {exc}")
    os.removexattr(ws / "a.txt", "user.probe")
    os.removexattr(ws, "system.posix_acl_default")


def _set_by_the_tool() -> str:
    """A command that gives the workspace a default ACL letting anyone write what is made
    there later, and ``a.txt`` an attribute (setxattr: no Landlock right governs it)."""
    from test_keep import WIDE_DEFAULT, _setting

    return (_setting(".", "system.posix_acl_default", WIDE_DEFAULT) + " && "
            + _setting("a.txt", "user.note", b"tool"))


@pytest.mark.parametrize("flag", ["--checkpoint", "--dry-run"])
def test_an_acl_or_attribute_the_tool_set_is_a_change(ws: Path, flag: str) -> None:
    """A checkpointed tool gave its workspace a default ACL: the review said "0 change(s)",
    rollback "rolled back 0 path(s)", and every file the user made there later was
    writable by anyone (an eighteenth attack round). The attributes ``--keep`` keeps
    (``user.*`` and the POSIX ACLs) are part of what undo records, shows and puts back."""
    from test_keep import WIDE_DEFAULT, attributes

    _acl_attack_or_skip(ws)
    done, name = reviewed(ws, flag, _set_by_the_tool())
    assert done.returncode == 0, done.stderr
    for line in (f"a {ws}/ extended attributes: system.posix_acl_default set "
                 "(user::rwx,group::rwx,other::rwx)",
                 f"a {ws}/a.txt extended attributes: user.note set"):
        assert f"sandlock: {line}\n" in done.stderr, (line, done.stderr)
    if flag == "--checkpoint":
        back = cli("rollback", name)
        assert back.returncode == 0, back.stderr
        assert attributes(ws) == attributes(ws / "a.txt") == {}
        (ws / "later.txt").write_text("the user's\n")
        assert attributes(ws / "later.txt") == {}
    else:
        assert attributes(ws) == attributes(ws / "a.txt") == {}  # the tool worked in a copy
        applied = cli("apply", name)
        assert applied.returncode == 0, applied.stderr
        assert attributes(ws) == {"system.posix_acl_default": WIDE_DEFAULT}
        assert attributes(ws / "a.txt") == {"user.note": b"tool"}


def test_what_rollback_makes_again_takes_no_acl_from_around_it(ws: Path) -> None:
    """A file the tool removed is made again by rollback in a directory whose default ACL
    the tool set (one naming another user, who may then write it): it gets the attributes
    it had (none), not the directory's."""
    from test_keep import NAMED_WRITER, _setting, attributes

    _acl_attack_or_skip(ws)
    done, name = reviewed(ws, "--checkpoint",
                          _setting(".", "system.posix_acl_default", NAMED_WRITER) + " && rm b.txt")
    assert done.returncode == 0, done.stderr
    back = cli("rollback", name)
    assert back.returncode == 0, back.stderr
    assert attributes(ws / "b.txt") == {} and stat.S_IMODE((ws / "b.txt").stat().st_mode) == 0o640


@pytest.mark.parametrize("flag", ["--checkpoint", "--dry-run"])
def test_the_users_own_attributes_survive(ws: Path, flag: str) -> None:
    """The user's attribute on a file the tool appends to: a dry run's copy carries it (or
    applying would drop it from the original), and a rollback puts it back on a file the
    tool replaced (``sed -i`` makes a new file, without it)."""
    from test_keep import attributes

    _acl_attack_or_skip(ws)
    os.setxattr(ws / "a.txt", "user.mine", b"the user's")
    os.setxattr(ws / "sub" / "c.txt", "user.mine", b"the user's")
    before = state(ws)
    done, name = reviewed(ws, flag, "echo more >> a.txt && sed -i s/binary/bin/ sub/c.txt")
    assert done.returncode == 0, done.stderr
    back = cli("rollback" if flag == "--checkpoint" else "apply", name)
    assert back.returncode == 0, back.stderr
    assert attributes(ws / "a.txt") == {"user.mine": b"the user's"}
    if flag == "--checkpoint":
        assert state(ws) == before
        assert attributes(ws / "sub" / "c.txt") == {"user.mine": b"the user's"}
    else:
        assert (ws / "a.txt").read_text() == "hello\nworld\nmore\n"
        assert attributes(ws / "sub" / "c.txt") == {}  # as the tool left it


def test_the_review_shows_every_mode_and_acl_apply_would_write(ws: Path) -> None:
    """A mode or ACL change beside a content change, or on an added file or directory, was
    not shown: the review was a one-line diff, and apply gave another user the user's
    private file (a nineteenth attack round)."""
    from test_keep import NAMED_WRITER, WIDE_DEFAULT, _setting

    _acl_attack_or_skip(ws)
    command = ("echo more >> b.txt && " + _setting("b.txt", "system.posix_acl_access", NAMED_WRITER)
               + " && chmod 666 b.txt && echo x > open.txt && chmod 666 open.txt && mkdir shared"
               + " && echo x > run.sh && chmod 750 run.sh && echo x > team.txt && chmod 664 team.txt"
               + " && " + _setting("shared", "system.posix_acl_default", WIDE_DEFAULT)
               + " && " + _setting("sub/c.txt", "user.x", b"1") + " && chmod 600 sub/c.txt")
    done, name = reviewed(ws, "--dry-run", command)
    assert done.returncode == 0, done.stderr
    listed = cli("changes", "--no-diff", name)
    assert listed.returncode == 0, listed.stderr
    # what each ACL grants: uid 54321 may write b.txt (chmod 666 widened its mask and
    # others), anyone may write what is made in shared/
    for line in (f"M {ws}/b.txt mode 0640 -> 0666 extended attributes: system.posix_acl_access set "
                 "(user::rw-,user:54321:rw-,group::r--,mask::rw-,other::rw-)",
                 f"A {ws}/open.txt mode 0666", f"A {ws}/run.sh mode 0750",
                 f"A {ws}/team.txt mode 0664",
                 f"A {ws}/shared/ extended attributes: system.posix_acl_default set "
                 "(user::rwx,group::rwx,other::rwx)",
                 f"m {ws}/sub/c.txt mode 0644 -> 0600 extended attributes: user.x set"):
        assert f"{line}\n" in listed.stdout, (line, listed.stdout)
        assert f"sandlock: {line}\n" in done.stderr, (line, done.stderr)


@pytest.mark.parametrize("flag", ["--checkpoint", "--dry-run"])
def test_a_directory_whose_times_alone_changed_is_listed(ws: Path, flag: str) -> None:
    """A tool made and removed a file in ``sub/`` and set ``old/``'s times: apply (or
    rollback) writes both directories' times back, yet the review listed "0 change(s)" (a
    twenty-first attack round). Such a directory is listed; one that holds a listed change
    is not listed again for its times (its change explains them)."""
    (ws / "old").mkdir()
    done, name = reviewed(ws, flag, "echo x > sub/gone && rm sub/gone && touch -d 2001-01-01 old"
                          " && echo x > new.txt")
    assert done.returncode == 0, done.stderr
    listed = cli("changes", "--no-diff", name)
    assert listed.returncode == 0, listed.stderr
    assert f"t {ws}/sub/\n" in listed.stdout and f"t {ws}/old/\n" in listed.stdout, listed.stdout
    assert f"A {ws}/new.txt\n" in listed.stdout, listed.stdout
    assert f"t {ws}/\n" not in listed.stdout, listed.stdout  # new.txt's change is in it
    assert "3 change(s)" in listed.stdout, listed.stdout
    back = cli("rollback" if flag == "--checkpoint" else "apply", name)
    assert back.returncode == 0, back.stderr
    in_2001 = (ws / "old").stat().st_mtime < 1_000_000_000  # the tool's times, or the user's back
    assert in_2001 == (flag == "--dry-run")


@pytest.mark.parametrize("mode", ["644", "755"])
def test_a_file_replaced_by_a_directory_is_a_change(ws: Path, mode: str) -> None:
    """A checkpointed tool replaced a file with a directory of the same mode: the review
    listed nothing for it (or, with another mode, a mode change), and rollback refused the
    whole run (a twentieth attack round). The review names the change and the refusal."""
    done, name = reviewed(ws, "--checkpoint", f"rm a.txt && mkdir a.txt && chmod {mode} a.txt")
    assert done.returncode == 0, done.stderr
    listed = cli("changes", "--no-diff", name)
    (line,) = [line for line in listed.stdout.splitlines() if line.startswith(f"M {ws}/a.txt")]
    assert "was a file" in line and "rollback refuses it" in line, line


def test_what_the_tool_puts_where_a_socket_was_is_shown_and_refused(ws: Path) -> None:
    """A socket in the tree is not copied into a dry run's copy: the tool wrote a script
    at its name, the review listed nothing for it, and apply replaced the socket with the
    script (a twenty-first attack round). It is listed, and apply refuses it."""
    import socket

    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(ws / "agent.sock"))
    try:
        done, name = reviewed(ws, "--dry-run", "printf '#!/bin/sh\\n' > agent.sock && "
                                               "chmod 755 agent.sock && echo x >> a.txt")
        assert done.returncode == 0, done.stderr
        listed = cli("changes", "--no-diff", name)
        (line,) = [line for line in listed.stdout.splitlines() if "agent.sock" in line]
        assert line.startswith(f"M {ws}/agent.sock") and "was a device or socket" in line, line
        assert "apply refuses it" in line, line
        applied = cli("apply", name)
        assert applied.returncode == 125, applied.stderr
        assert stat.S_ISSOCK((ws / "agent.sock").lstat().st_mode)
        assert (ws / "a.txt").read_text() == "hello\nworld\n"  # nothing half-applied
    finally:
        listener.close()


@pytest.mark.parametrize("replaced", [False, True])
def test_a_socket_the_checkpointed_tool_removed_is_listed(ws: Path, replaced: bool) -> None:
    """Rollback does not make a socket again: its removal is listed, saying so; a file the
    tool put in its place is listed, and rollback removes it."""
    import socket

    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(ws / "agent.sock"))
    try:
        command = "rm agent.sock" + (" && echo x > agent.sock" if replaced else "")
        done, name = reviewed(ws, "--checkpoint", command)
        assert done.returncode == 0, done.stderr
        listed = cli("changes", "--no-diff", name)
        (line,) = [line for line in listed.stdout.splitlines() if "agent.sock" in line]
        if replaced:
            assert line.startswith(f"M {ws}/agent.sock") and "rollback removes it" in line, line
        else:
            assert line.startswith(f"D {ws}/agent.sock") and "not made again" in line, line
        back = cli("rollback", name)
        assert back.returncode == 0, back.stderr
        assert not os.path.lexists(ws / "agent.sock")
    finally:
        listener.close()


def test_an_acl_is_shown_as_what_it_grants() -> None:
    """The review names who an ACL lets in (ids as numbers); anything else is unreadable."""
    from test_keep import NAMED_WRITER, WIDE_DEFAULT

    from sandlock.undo.xattrs import acl_text

    assert acl_text(NAMED_WRITER) == "user::rw-,user:54321:rw-,group::r--,mask::rw-,other::r--"
    assert acl_text(WIDE_DEFAULT) == "user::rwx,group::rwx,other::rwx"
    assert acl_text(struct.pack("<IHHI", 2, 0x08, 5, 100)) == "group:100:r-x"
    for bad in (b"", b"\x02\0\0", struct.pack("<IHHI", 1, 1, 7, 0), struct.pack("<IHHI", 2, 0x40, 7, 0),
                struct.pack("<IHHI", 2, 1, 8, 0), NAMED_WRITER[:-1]):
        assert acl_text(bad) == "unreadable", bad
