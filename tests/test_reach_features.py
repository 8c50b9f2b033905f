"""The newest features where users run them: older kernels and Docker's seccomp profile.

Ubuntu 22.04/24.04 GA, Debian 12, RHEL 9 and AL2023 have Landlock ABI 1 to 5, and agents
often run inside Docker under its default seccomp profile (which refuses keyctl, so the
cache key and the run log's key live in a key file there). Each scene below runs review
and undo, the run log, `shell` and the Claude Code hook, and the MCP gateway and server,
on the real kernel with ``SANDLOCK_ABI=N`` (the ruleset an ABI-N kernel enforces) and under
the Docker profile (tests/container_profile.py); each protection checked has its control
(the same attack without the protection succeeds).

Where a kernel cannot keep a promise the answer is a clear refusal (exit 125, naming what
is missing and the way out) or, for a best-effort policy, a run that says what it dropped:
never a silent weakening. A review (dry run, checkpoint) cannot be best-effort at all: its
promises are Landlock's, and without it the tool writes the originals of a dry run, or
deletes the snapshot a rollback needs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pytest
from conftest import ABI, REPO, require_abi
from mcp_tools import SERVER, python_policy, require_mcp, session, text
from test_container_profile import LAUNCHER, profile_file
from test_mcp_serve import web  # noqa: F401 - the fixture: two loopback HTTP servers

SECRET = "top secret of the user"
#: (id, SANDLOCK_ABI or None for this kernel's, under Docker's default seccomp profile)
SCENES = [("abi1", 1, False), ("abi3", 3, False), ("abi5", 5, False), ("docker", None, True),
          ("docker-abi2", 2, True)]


class Scene:
    """How a command is run in one scene: the ABI sandlock pretends, Docker's profile or not."""

    def __init__(self, abi: Optional[int], docker: bool, cache: Path) -> None:
        if abi is not None and abi > ABI:
            require_abi(abi, f"pretending Landlock ABI {abi}")
        self.abi, self.docker = abi, docker
        self.prefix = [sys.executable, str(LAUNCHER), profile_file("docker"), "--"] if docker else []
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cache)}
        self.env.pop("SANDLOCK_ABI", None)
        self.env.pop("SANDLOCK_LOG", None)
        if abi is not None:
            self.env["SANDLOCK_ABI"] = str(abi)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return [*self.prefix, *argv]

    def run(self, argv: Sequence[str], cwd: Path, input: Optional[str] = None,
            **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=120,
                              cwd=cwd, input=input, env={**self.env, **env})

    def sandlock(self, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
        # -P: the working directory (a workspace) is not on sandlock's import path
        return self.run([sys.executable, "-P", "-m", "sandlock", *args], cwd, **env)


@pytest.fixture(params=SCENES, ids=[scene[0] for scene in SCENES])
def scene(request: pytest.FixtureRequest, tmp_path: Path) -> Scene:
    _, abi, docker = request.param
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    return Scene(abi, docker, cache)


@pytest.fixture
def place(tmp_path: Path) -> dict[str, Path]:
    """A workspace with two files, and a secret beside it that no policy grants."""
    ws, secret = tmp_path / "ws", tmp_path / "home" / "secret.txt"
    ws.mkdir()
    secret.parent.mkdir()
    (ws / "a.txt").write_text("hello\n")
    (ws / "b.txt").write_text("keep me\n")
    secret.write_text(SECRET + "\n")
    return {"root": tmp_path, "ws": ws, "secret": secret}


def files(ws: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(ws.iterdir())}


def run_name(stderr: str, mode: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("sandlock: run ") and f"({mode})" in line:
            return line.split()[2]
    raise AssertionError(stderr)


SHELL = ("--policy", "shell")
#: The tool's edit (in its working directory), then the attack: the original files by
#: their absolute paths, appended to and truncated.
EDIT = "echo x >> a.txt; echo new > n.txt"
ATTACK = "echo pwned >> {ws}/a.txt; printf '' > {ws}/b.txt"


# ----------------------------------------------------------------------------
# Review and undo


def test_dry_run_apply_checkpoint_rollback(scene: Scene, place: dict[str, Path]) -> None:
    ws = place["ws"]
    before = files(ws)
    script = f"{EDIT}; {ATTACK.format(ws=ws)}; true"
    done = scene.sandlock("run", *SHELL, "--var", f"workspace={ws}", "--dry-run", "--",
                          "sh", "-c", script, cwd=ws)
    assert done.returncode == 0, done.stderr
    assert files(ws) == before  # neither the edit nor the attack reached the originals
    assert done.stderr.count("Permission denied") == 2, done.stderr  # the attack was refused
    name = run_name(done.stderr, "dry-run")
    listed = scene.sandlock("changes", "--no-diff", name, cwd=ws)
    assert listed.stdout.splitlines()[1:] == [f"M {ws}/a.txt", f"A {ws}/n.txt"], listed
    applied = scene.sandlock("apply", name, cwd=ws)
    assert applied.returncode == 0, applied.stderr
    assert files(ws) == {"a.txt": "hello\nx\n", "b.txt": "keep me\n", "n.txt": "new\n"}

    edited = files(ws)
    done = scene.sandlock("run", *SHELL, "--var", f"workspace={ws}", "--checkpoint", "--",
                          "sh", "-c", "rm b.txt n.txt; echo y >> a.txt", cwd=ws)
    assert done.returncode == 0 and files(ws) == {"a.txt": "hello\nx\ny\n"}, done.stderr
    back = scene.sandlock("rollback", run_name(done.stderr, "checkpoint"), cwd=ws)
    assert back.returncode == 0, back.stderr
    assert files(ws) == edited

    # control: the same attack, in a run that is not a dry run, reaches the originals
    plain = scene.sandlock("run", *SHELL, "--var", f"workspace={ws}", "--", "sh", "-c",
                           ATTACK.format(ws=ws), cwd=ws)
    assert plain.returncode == 0, plain.stderr
    assert files(ws)["a.txt"].endswith("pwned\n") and files(ws)["b.txt"] == ""


def test_api_review(scene: Scene, place: dict[str, Path]) -> None:
    """``Sandbox(review=...)``, then ``finish_review`` and apply (in a process of the scene)."""
    ws = place["ws"]
    code = f"""
import json, sys
from sandlock import Sandbox
from sandlock.undo import session
ws = {str(ws)!r}
with Sandbox("shell", vars={{"workspace": ws}}, review="dry-run") as box:
    done = box.run(["sh", "-c", {EDIT + "; " + ATTACK.format(ws=ws) + "; true"!r}], cwd=ws)
    name = box.finish_review()
before = open(ws + "/a.txt").read()
dropped = [w for w in box.warnings if not w.startswith("per-sandbox process limit")]
print(json.dumps([done.returncode, before, session.apply(name), dropped]))
"""
    done = scene.run([sys.executable, "-P", "-c", code], ws)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0, "hello\n", 2, []]
    assert files(ws) == {"a.txt": "hello\nx\n", "b.txt": "keep me\n", "n.txt": "new\n"}


def test_no_landlock_refuses_a_review_even_best_effort(place: dict[str, Path], tmp_path: Path) -> None:
    """Without Landlock (``SANDLOCK_ABI=0``) nothing keeps the tool off the originals or the
    snapshot: a review is refused, exit 125, naming why, and nothing is left behind."""
    ws = place["ws"]
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    bare = Scene(0, False, cache)
    before = files(ws)
    for flag, what in (("--dry-run", "the originals a dry run keeps apart"),
                       ("--checkpoint", "the snapshot a rollback restores")):
        done = bare.sandlock("run", *SHELL, "--best-effort", "--var", f"workspace={ws}", flag,
                             "--", "sh", "-c", ATTACK.format(ws=ws), cwd=ws)
        assert done.returncode == 125, done.stderr
        assert (f"sandlock: a {flag[2:]} needs Landlock filesystem confinement, and "
                "SANDLOCK_ABI=0 pretends a kernel without Landlock") in done.stderr
        assert what in done.stderr and "Traceback" not in done.stderr
        assert files(ws) == before
    assert not list(cache.rglob("a.txt"))  # no copy, no snapshot


def test_no_landlock_api_review_control(place: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The API refuses too; with the refusal switched off, the dry run's tool writes the
    original (the attack is real), which the review would have called unchanged."""
    from sandlock import Sandbox
    from sandlock.undo import session
    from sandlock.undo.tree import UndoError

    ws = place["ws"]
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("SANDLOCK_ABI", "0")
    attack = ["sh", "-c", ATTACK.format(ws=ws)]
    with pytest.raises(UndoError, match="needs Landlock filesystem confinement"):
        Sandbox("shell", vars={"workspace": str(ws)}, best_effort=True, review="dry-run")
    assert files(ws)["a.txt"] == "hello\n"
    monkeypatch.setattr(session, "confined_by_landlock", lambda mode: None)
    with Sandbox("shell", vars={"workspace": str(ws)}, best_effort=True, review="dry-run") as box:
        assert box.run(attack, cwd=str(ws)).returncode == 0
        name = box.finish_review()
    assert files(ws)["a.txt"] == "hello\npwned\n"
    assert session.changes(session.load(name)) == []  # what the dry run would have said
    session.forget(name)


def test_a_review_that_cannot_start_says_why_once(place: dict[str, Path], tmp_path: Path) -> None:
    """A review refused while it prepares (here a tree too deep to copy; in a container, a
    uid with no home for the record's key) says why, exit 125, leaves nothing, and does not
    then send the user to discard copies that were never kept ("no run NAME")."""
    from sandlock.undo import tree

    ws = place["ws"]
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (ws / "/".join(["d"] * (tree.MAX_DEPTH + 5))).mkdir(parents=True)
    done = Scene(None, False, cache).sandlock("run", *SHELL, "--var", f"workspace={ws}",
                                              "--dry-run", "--", "true", cwd=ws)
    assert done.returncode == 125 and "nested deeper than 256 levels" in done.stderr, done.stderr
    assert "no run" not in done.stderr and "discard" not in done.stderr, done.stderr
    assert [p for p in cache.rglob("*") if p.is_file()] == []


# ----------------------------------------------------------------------------
# A gap: strict refuses (naming it and the way out), best-effort runs and says it


TCP_POLICY = 'version = 1\nextends = ["shell"]\n{compat}[network]\nconnect = [443]\n'
#: Connects to a loopback port the policy does not grant (bash's /dev/tcp).
CONNECT = "exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED"


@pytest.fixture
def listener() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("abi", [3, 4])
def test_tcp_ports_gap_on_abi3(abi: int, place: dict[str, Path], tmp_path: Path,
                               listener: int) -> None:
    """`connect = [443]` needs ABI 4. On ABI 3 a strict dry run is refused before anything
    is copied; a best-effort one runs and warns, and the warning is true: the tool connects
    to a port it was not granted. On ABI 4 (control) the same connect is refused."""
    ws = place["ws"]
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    pretend = Scene(abi, False, cache)
    strict, best = tmp_path / "strict.toml", tmp_path / "best.toml"
    strict.write_text(TCP_POLICY.format(compat=""))
    best.write_text(TCP_POLICY.format(compat='compat = "best-effort"\n'))
    gap = "TCP port restriction (needs Landlock ABI 4)"
    argv = ["--var", f"workspace={ws}", "--dry-run", "--", "bash", "-c",
            CONNECT.format(port=listener)]
    refused = pretend.sandlock("run", "--policy", str(strict), *argv, cwd=ws)
    copied = list(cache.rglob("a.txt"))
    ran = pretend.sandlock("run", "--policy", str(best), *argv, cwd=ws)
    explained = pretend.sandlock("explain", "--policy", str(best), "--var", f"workspace={ws}",
                                 cwd=ws)
    if abi == 4:  # control: enforced, the connect is refused, nothing to warn of
        assert refused.returncode == ran.returncode == 1 and "CONNECTED" not in ran.stdout
        assert gap not in ran.stderr + explained.stdout
        return
    assert refused.returncode == 125 and gap in refused.stderr, refused.stderr
    assert "--best-effort" in refused.stderr and "[accept: tcp-ports]" in refused.stderr
    assert "Traceback" not in refused.stderr and copied == []
    assert ran.returncode == 0 and "CONNECTED" in ran.stdout, ran.stderr
    assert f"sandlock: warning:   - {gap}" in ran.stderr and "(dry-run)" in ran.stderr
    assert gap in explained.stdout, explained.stdout


def test_api_gap_strict_and_best_effort(place: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock import Sandbox
    from sandlock.errors import KernelSupportError

    ws = place["ws"]
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("SANDLOCK_ABI", "3")
    policy = TCP_POLICY.format(compat="")
    with pytest.raises(KernelSupportError, match=r"TCP port restriction \(needs Landlock ABI 4\)"):
        Sandbox.from_toml(policy, vars={"workspace": str(ws)}, review="dry-run")
    assert not list(cache.rglob("a.txt"))
    box = Sandbox.from_toml(policy, vars={"workspace": str(ws)}, review="dry-run",
                            best_effort=True)
    with box:
        assert any(line.startswith("TCP port restriction") for line in box.warnings)
        assert box.grants()["not_enforced"] == box.warnings
        assert box.run(["sh", "-c", "echo x >> a.txt"], cwd=str(ws)).returncode == 0
    from sandlock.undo import session

    assert session.apply(box.finish_review()) == 1 and files(ws)["a.txt"] == "hello\nx\n"


# ----------------------------------------------------------------------------
# The run log


def test_run_log_records_and_verifies(scene: Scene, place: dict[str, Path],
                                      tmp_path: Path) -> None:
    ws, log = place["ws"], tmp_path / "log"
    log.mkdir(mode=0o700)
    for command in ("true", "echo x >> a.txt"):
        done = scene.sandlock("run", *SHELL, "--var", f"workspace={ws}", "--", "sh", "-c",
                              command, cwd=ws, SANDLOCK_LOG=str(log))
        assert done.returncode == 0 and "not logged" not in done.stderr, done.stderr
    verified = scene.sandlock("log", "--verify", cwd=ws, SANDLOCK_LOG=str(log))
    assert (verified.returncode, verified.stdout) == (0, "2 records: intact\n"), verified.stderr
    # control: the check bites where the log lives (an edited record is caught)
    runs = log / "runs.jsonl"
    runs.write_text(runs.read_text().replace('"exit":0', '"exit":1', 1))
    tampered = scene.sandlock("log", "--verify", cwd=ws, SANDLOCK_LOG=str(log))
    assert tampered.returncode == 1 and "intact" not in tampered.stdout, tampered


# ----------------------------------------------------------------------------
# `sandlock shell` and the Claude Code hook


def test_shell_and_hook_keep_the_secret(scene: Scene, place: dict[str, Path]) -> None:
    ws, secret = place["ws"], place["secret"]
    command = f"cat {secret}; echo INSIDE-$((6*7))"
    shell = scene.sandlock("shell", *SHELL, "--var", f"workspace={ws}", "-c", command, cwd=ws)
    assert "INSIDE-42" in shell.stdout and SECRET not in shell.stdout, shell.stderr
    data = {"session_id": "s", "transcript_path": "/dev/null", "cwd": str(ws),
            "permission_mode": "default", "hook_event_name": "PreToolUse", "tool_name": "Bash",
            "tool_input": {"command": command}}
    answer = scene.run([sys.executable, "-P", "-m", "sandlock", "hook", "claude-code", *SHELL,
                        "--var", f"workspace={ws}"], ws, input=json.dumps(data))
    assert answer.returncode == 0, answer.stderr
    rewritten = json.loads(answer.stdout)["hookSpecificOutput"]["updatedInput"]["command"]
    hooked = scene.run(["bash", "-c", rewritten], ws)  # the Bash tool, in the same scene
    assert "INSIDE-42" in hooked.stdout and SECRET not in hooked.stdout, hooked.stderr
    plain = scene.run(["bash", "-c", command], ws)  # control: unconfined, it reads it
    assert SECRET in plain.stdout


# ----------------------------------------------------------------------------
# MCP: the gateway and the ready server


def _gateway(scene: Scene, place: dict[str, Path], head: str = "", tail: str = ""
             ) -> tuple[list[str], Path]:
    """The gateway of tests/mcp_server.py; its ``read`` entry's policy gets ``head`` (keys
    before the tables) and ``tail`` (tables)."""
    registry = place["root"] / "registry"
    registry.mkdir(exist_ok=True)
    (registry / "listing.toml").write_text(python_policy())
    read = python_policy("${workspace}", isolation="tool")  # one instance for both calls
    read = read.replace("version = 1\n", "version = 1\n" + head, 1)
    (registry / "read.toml").write_text(read + tail)
    argv = scene.argv([sys.executable, "-P", "-m", "sandlock", "mcp", "--registry", str(registry),
                       "--var", f"workspace={place['ws']}", "--", sys.executable, str(SERVER)])
    return argv, place["root"] / "gateway.err"


def _env(scene: Scene) -> dict[str, str]:
    """What the MCP client passes its server (it passes no other variable)."""
    return {name: scene.env[name] for name in ("SANDLOCK_ABI", "XDG_CACHE_HOME") if name in scene.env}


def test_mcp_gateway_and_serve(scene: Scene, place: dict[str, Path],
                               web: tuple[int, int]) -> None:  # noqa: F811
    require_mcp()
    allowed, other = web
    ws, secret = place["ws"], place["secret"]
    argv, errlog = _gateway(scene, place)
    with session(argv, cwd=str(ws), errlog=errlog, env=_env(scene)) as client:
        assert text(client.call("read", {"path": "a.txt"})) == "hello\n"
        stolen = client.call("read", {"path": str(secret)})
        assert stolen.is_error and SECRET not in text(stolen)
    assert "warning" not in errlog.read_text()
    fetch = scene.abi is None or scene.abi >= 4  # below, --allow-host is refused (next test)
    serve = scene.argv([sys.executable, "-P", "-m", "sandlock", "mcp", "serve", "--workspace",
                        str(ws), *(["--allow-host", f"127.0.0.1:{allowed}"] if fetch else [])])
    with session(serve, cwd=str(ws), errlog=place["root"] / "serve.err",
                 env=_env(scene)) as client:
        result = text(client.call("shell", {"command": f"cat {secret}; echo INSIDE-$((6*7))"}))
        assert "INSIDE-42" in result and SECRET not in result, result
        written = client.call("write_file", {"path": str(secret), "content": "planted"})
        assert written.is_error and secret.read_text() == SECRET + "\n"
        if fetch:
            fetched = text(client.call("fetch", {"url": f"http://127.0.0.1:{allowed}/"}))
            assert fetched == f"hello from port {allowed}"
            refused = client.call("fetch", {"url": f"http://127.0.0.1:{other}/"})
            assert refused.is_error and f"hello from port {other}" not in text(refused)


def test_mcp_controls(place: dict[str, Path], web: tuple[int, int]) -> None:  # noqa: F811
    """Positive controls of the test above: the other port answers without sandlock, and
    the same server, unconfined, reads the secret."""
    require_mcp()
    other = web[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{other}/", timeout=30) as answer:
        assert answer.read().decode() == f"hello from port {other}"
    with session([sys.executable, str(SERVER)], cwd=str(place["ws"]),
                 errlog=place["root"] / "plain.err") as client:
        assert text(client.call("read", {"path": str(place["secret"])})).strip() == SECRET


def test_mcp_serve_fetch_refused_below_abi4(place: dict[str, Path], tmp_path: Path) -> None:
    """The host allowlist also needs Landlock's TCP rules (ABI 4: without them the tool can
    bind any port), and serve runs its tools strictly: below ABI 4, --allow-host is refused
    naming the gap and this command's way out, not options it does not have."""
    require_mcp()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    done = Scene(3, False, cache).run(
        [sys.executable, "-P", "-m", "sandlock", "mcp", "serve", "--workspace", str(place["ws"]),
         "--allow-host", "127.0.0.1:9"], place["ws"], input="")
    assert done.returncode == 125, done.stderr
    assert "the fetch tool (--allow-host)" in done.stderr
    assert "TCP port restriction (needs Landlock ABI 4)" in done.stderr
    assert "run it without --allow-host" in done.stderr and "Refusing to run." not in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("compat", ["strict", "best-effort"])
def test_mcp_gateway_gap(compat: str, place: dict[str, Path], tmp_path: Path) -> None:
    """A registry entry needing ABI 4, on ABI 3: strict, the call is an MCP error naming the
    gap; best-effort, it runs and the gateway's stderr says what was dropped."""
    require_mcp()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    pretend = Scene(3, False, cache)
    head = 'compat = "best-effort"\n' if compat == "best-effort" else ""
    argv, errlog = _gateway(pretend, place, head, "[network]\nconnect = [443]\n")
    gap = "TCP port restriction (needs Landlock ABI 4)"
    with session(argv, cwd=str(place["ws"]), errlog=errlog, env=_env(pretend)) as client:
        try:
            outcome: Any = text(client.call("read", {"path": "a.txt"}))
        except Exception as exc:  # an MCP error
            outcome = exc
    said = errlog.read_text()
    if compat == "strict":
        assert isinstance(outcome, Exception) and gap in str(outcome), outcome
        assert "--best-effort" in str(outcome)
    else:
        assert outcome == "hello\n"
        assert f"sandlock mcp: [read] warning:   - {gap}" in said, said
    assert "[listing] warning" not in said and "Traceback" not in said
