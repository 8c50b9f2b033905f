"""The substitute for Landlock's device-ioctl right (ABI 5) on ABI 1-4, on the real kernel.

``SANDLOCK_ABI=N`` makes sandlock build the ruleset an ABI-N kernel enforces. The attack:
a tool granted ``/dev`` for reading opens ``/dev/ptmx`` (mode 0666, so root and an ordinary
user alike) and asks the pty driver for a terminal number (TIOCGPTN), a device ioctl that
Landlock ABI 5 refuses on a device granted without ``ioctl_dev`` and that no rule of
sandlock's allows. With the substitute it is refused (EACCES, as Landlock answers); as the
positive control, with the substitute's rules switched off, the driver answers.
"""

from __future__ import annotations

import errno
import os
import random
import termios
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, require_abi, run_confined, write_policy

from sandlock.compile import abi as A
from sandlock.compile import ruleset
from sandlock.compile import seccomp as S
from sandlock.policy.model import loads_policy

#: Landlock ABIs without LANDLOCK_ACCESS_FS_IOCTL_DEV.
NO_IOCTL_DEV = (1, 2, 3, 4)
TIOCGPTN = 0x80045430  #: asm-generic/ioctls.h _IOR('T', 0x30, unsigned int)
FS_IOC_GETFLAGS = 0x80086601  #: linux/fs.h _IOR('f', 1, long)

ATTACK = """\
import errno, fcntl, os, struct
fd = os.open("/dev/ptmx", os.O_RDONLY | os.O_NOCTTY)
try:
    print("pty", struct.unpack("i", fcntl.ioctl(fd, 0x80045430, bytes(4)))[0])
except OSError as exc:
    print("refused", errno.errorcode[exc.errno])
"""

POLICY = """\
version = 1
{head}extends = ["python"]
[filesystem]
read = ["/dev"{more}]
"""


def _api(tmp_path: Path, code: str, *args: str, head: str = "", more: str = "") -> str:
    """Run ``code`` through the API under the python profile plus a read grant on /dev."""
    import sandlock

    policy = write_policy(tmp_path, POLICY.format(head=head, more=more))
    with sandlock.Sandbox(policy) as box:
        result = box.run([PYTHON, "-c", code, *args], capture_output=True, text=True)
    assert isinstance(result.stdout, str), result
    return result.stdout.strip() or str(result.stderr)


@pytest.mark.parametrize("abi", NO_IOCTL_DEV)
def test_device_ioctl_refused_below_abi_5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          abi: int) -> None:
    require_abi(abi, "pretending this ABI")
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    assert _api(tmp_path, ATTACK) == "refused EACCES"


HIGH_BITS = """\
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
fd = os.open("/dev/ptmx", os.O_RDONLY | os.O_NOCTTY)
buf = ctypes.create_string_buffer(4)
# The kernel reads ioctl's request as an unsigned int: the upper half is ignored.
got = libc.syscall({nr}, fd, ctypes.c_ulong((0xDEAD << 32) | 0x80045430), buf)
print("pty" if got == 0 else "refused " + errno.errorcode[ctypes.get_errno()])
"""


def test_device_ioctl_with_high_bits_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Garbage in the upper half of the request register neither hides the request from
    the filter nor reaches the driver as another one."""
    from sandlock.linux.syscalls import NR

    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    assert _api(tmp_path, HIGH_BITS.format(nr=NR["ioctl"])) == "refused EACCES"
    monkeypatch.setattr(S, "ioctl_rules", lambda: [])
    assert _api(tmp_path, HIGH_BITS.format(nr=NR["ioctl"])) == "pty"


def test_device_ioctl_control_without_the_substitute(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Positive control: at ABI 4 with the substitute's rules switched off the driver answers."""
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    monkeypatch.setattr(S, "ioctl_rules", lambda: [])
    assert _api(tmp_path, ATTACK).startswith("pty ")


def test_device_ioctl_landlock_abi_5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the substitute stands in for: Landlock ABI 5 itself refuses the same ioctl."""
    require_abi(5, "Landlock's own device-ioctl right")
    monkeypatch.setenv("SANDLOCK_ABI", "5")
    assert _api(tmp_path, ATTACK) == "refused EACCES"


@pytest.mark.parametrize("abi", NO_IOCTL_DEV)
def test_device_ioctl_cli_strict_runs_and_refuses(tmp_path: Path, abi: int) -> None:
    """`sandlock run` in strict mode runs at ABI 1-4 (the substitute covers the gap that
    made it refuse before) and the attack fails."""
    require_abi(abi, "pretending this ABI")
    policy = write_policy(tmp_path, POLICY.format(head="", more=""))
    done = run_confined(policy, [PYTHON, "-c", ATTACK], env={**os.environ, "SANDLOCK_ABI": str(abi)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused EACCES", done.stdout
    assert "NOT enforced" not in done.stderr


USES = """\
import errno, fcntl, os, struct, sys
def tried(request, fd, arg=0):
    try:
        fcntl.ioctl(fd, request, arg)
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
r, w = os.pipe()
os.write(w, b"abc")
path = os.path.join(sys.argv[1], "file")
with open(path, "w") as handle:
    handle.write("x")
f = os.open(path, os.O_RDONLY)
print(struct.unpack("i", fcntl.ioctl(r, 0x541B, bytes(4)))[0],  # FIONREAD on a pipe
      tried(0x5421, r, bytes(4)), tried(0x5451, r),            # FIONBIO, FIOCLEX
      tried(0x5401, r, bytes(60)),                              # TCGETS (isatty): not a tty
      tried(0x2, f, bytes(4)),                                  # FIGETBSZ
      tried(0x80086601, f, bytes(8)))                           # FS_IOC_GETFLAGS (lsattr)
"""


@pytest.mark.parametrize("abi", (4, 5))
def test_safe_ioctls_still_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abi: int) -> None:
    """What tools need keeps working at ABI 4; what the substitute refuses beyond Landlock
    (FS_IOC_GETFLAGS on a regular file) is refused only there."""
    require_abi(abi, "pretending this ABI")
    monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)
    said = _api(tmp_path, USES, str(work), more=f', "{work}"]\nwrite = ["{work}"')
    flags = "EACCES" if abi < 5 else ("ok", "ENOTTY", "EOPNOTSUPP")
    first, rest = said.split(" ", 1)
    assert first == "3", said
    parts = rest.split()
    assert parts[:4] == ["ok", "ok", "ENOTTY", "ok"], said
    assert parts[4] == flags if isinstance(flags, str) else parts[4] in flags, said


# ----------------------------------------------------------------------------
# The table and the decision, pure


def test_always_allowed_numbers() -> None:
    """The numbers Python knows agree; none is a refused terminal ioctl."""
    for name, value in S.IOCTL_ALWAYS.items():
        known = getattr(termios, name, None)
        if known is not None:
            assert known == value, name
    assert not set(S.IOCTL_ALWAYS.values()) & {*S.TTY_DENY, S.TIOCSCTTY}
    assert TIOCGPTN not in S.IOCTL_ALWAYS.values() and FS_IOC_GETFLAGS not in S.IOCTL_ALWAYS.values()


#: Run in a child of the test: load the substitute's filter, then ask ioctl(2) on
#: descriptor -1 with each request (argv[1], a file of 8-byte requests) and write each
#: answer's errno (0: done) as one byte to stdout.
ASK_EACH = """\
import ctypes, os, struct, sys
from sandlock.linux import kernel
from sandlock.linux.syscalls import NR
bpf = open(sys.argv[2], "rb").read()
requests = struct.unpack(f"={len(open(sys.argv[1], 'rb').read()) // 8}Q", open(sys.argv[1], "rb").read())
libc = ctypes.CDLL(None, use_errno=True)
kernel.no_new_privs()
prog, keep = kernel.make_fprog(bpf)
kernel.load_seccomp(prog)
answers = bytearray()
for request in requests:
    done = libc.syscall(ctypes.c_long(NR["ioctl"]), ctypes.c_long(-1), ctypes.c_ulong(request),
                        ctypes.c_ulong(0))
    answers.append(0 if done == 0 else ctypes.get_errno())
os.write(1, bytes(answers))
"""


def test_the_loaded_filter_answers_every_request_as_the_table_says(tmp_path: Path) -> None:
    """The substitute's program, loaded into the kernel (by a child process), answers
    ioctl(2) on descriptor -1: every request of IOCTL_ALWAYS reaches the kernel (EBADF),
    every other is refused (EACCES), neighbours and random requests alike, with garbage
    in the upper half of the register or without; and sandlock's own reading of the rules
    (seccomp.refusal, what `trace` reports) says the same of each."""
    import struct
    import subprocess
    import sys

    rules = S.plan(loads_policy('version = 1\n[filesystem]\nread = ["/dev"]\n'), 4)
    (tmp_path / "bpf").write_bytes(S.compile_bpf(rules))
    allowed = set(S.IOCTL_ALWAYS.values())
    rng = random.Random(5)
    low = [*sorted(allowed), *((v + d) & S.LOW32 for v in sorted(allowed) for d in (-1, 1, 1 << 16, 1 << 31)),
           *(rng.getrandbits(32) for _ in range(3000)), *S.TTY_DENY, S.TIOCSCTTY]
    requests = [v | (rng.getrandbits(32) << 32 if i % 2 else 0) for i, v in enumerate(low)]
    (tmp_path / "requests").write_bytes(struct.pack(f"={len(requests)}Q", *requests))
    done = subprocess.run([sys.executable, "-c", ASK_EACH, str(tmp_path / "requests"),
                           str(tmp_path / "bpf")], capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(S.__file__).parents[2])})
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) == len(requests)
    for request, answer in zip(requests, done.stdout):
        said = S.refusal(rules, "ioctl", (2**64 - 1, request, 0, 0, 0, 0))
        if request & S.LOW32 not in allowed:
            assert said == errno.EACCES, hex(request)
        else:  # another rule may refuse it still: FIOASYNC below ABI 6 (EPERM)
            assert said in (0, errno.EPERM), hex(request)
        assert answer == (said or errno.EBADF), hex(request)


def test_the_substitute_is_short() -> None:
    """One comparison per allowed request ahead of libseccomp's program (its complement
    as libseccomp rules took 710 instructions more, loaded by every run below ABI 5)."""
    policy = loads_policy('version = 1\n[filesystem]\nread = ["/dev"]\n')
    longer = len(S.compile_bpf(S.plan(policy, 4))) - len(S.compile_bpf(S.plan(policy, 5)))
    assert longer // 8 <= len(S.IOCTL_ALWAYS) + 8


def test_ioctl_rules_in_the_plan() -> None:
    policy = loads_policy('version = 1\n[filesystem]\nread = ["/dev"]\n')
    for abi in range(1, A.NEWEST_ABI + 1):
        rules = S.plan(policy, abi)
        substituted = any(r.syscall == "ioctl" and r.errno == errno.EACCES for r in rules)
        assert substituted == (abi < A.fs_since(A.Fs.IOCTL_DEV)), abi


@pytest.mark.parametrize("paths, allow, want", [
    ('read = ["/dev"]', "", "substitute"),
    ('read = ["/"]', "", "substitute"),
    ('write = ["/dev/ptmx"]', "", "substitute"),
    ('read = ["/dev/null", "/dev/urandom"]', "", "substitute"),  # every policy now
    ("", "", "substitute"),
    ('read = ["/dev"]', '[syscalls]\nallow = ["ioctl"]\n', "gap"),
])
def test_decision(paths: str, allow: str, want: str | None) -> None:
    policy = loads_policy(f"version = 1\n[filesystem]\n{paths}\n{allow}")
    name = "device ioctl restriction"
    for abi in range(0, A.NEWEST_ABI + 1):
        gap = any(g.protection == name for g in ruleset.gaps(policy, abi))
        sub = ruleset.substituted(policy, abi, name)
        if abi == 0 or want == "gap" and abi < 5:
            assert (gap, sub) == (want is not None, False), abi
        elif want == "substitute" and abi < 5:
            assert (gap, sub) == (False, True), abi
        else:
            assert (gap, sub) == (False, False), abi


def test_plan_text_names_the_substitute() -> None:
    assert "EACCES" in ruleset.IOCTL_HOW and "IOCTL_ALWAYS" in ruleset.IOCTL_HOW
    assert textwrap.dedent(ATTACK).count("0x80045430") == 1


# ----------------------------------------------------------------------------
# What each substitute needs of the kernel, and the refusal when it is missing


def test_this_kernel_has_every_feature() -> None:
    from sandlock.compile import compiler

    for needs in compiler.SUBSTITUTE_NEEDS.values():
        for feature, _release in needs:
            assert compiler.kernel_has(feature), feature
    assert all(compiler.kernel_lacks(p) is None for p in compiler.SUBSTITUTE_NEEDS)


@pytest.mark.parametrize("text, want", [("6.8.0-45-generic", (6, 8)), ("5.4.0", (5, 4)),
                                        ("5.15.167.4-microsoft-standard-WSL2", (5, 15)),
                                        ("4.18.0-553.el8_10.x86_64", (4, 18)), ("junk", (0, 0)),
                                        ("6.12rc1", (6, 12))])
def test_release_numbers(text: str, want: tuple[int, int]) -> None:
    from sandlock.compile import compiler

    assert compiler._release(text) == want


def test_every_substitute_states_its_needs() -> None:
    from sandlock.compile import compiler

    policy = loads_policy('version = 1\n[filesystem]\nread = ["/dev"]\n')
    named = {s.protection for abi in range(1, A.NEWEST_ABI + 1) for s in ruleset.substitutes(policy, abi)}
    assert named == set(compiler.SUBSTITUTE_NEEDS) == set(ruleset.CONSEQUENCE)


@pytest.mark.parametrize("missing, protection, release", [
    ("pidfd_open(2)", "signal scope", "5.3"),
    ("SECCOMP_USER_NOTIF_FLAG_CONTINUE", "signal scope", "5.5"),
    ("seccomp user notification", "signal scope", "5.0"),
    ("pidfd_send_signal(2)", "signal scope", "5.1"),
    ("seccomp filters returning an errno", "device ioctl restriction", "3.5"),
    ("seccomp filters returning an errno", "truncate restriction", "3.5"),
])
def test_a_missing_feature_is_a_gap_naming_the_release(missing: str, protection: str,
                                                       release: str) -> None:
    """The decision table: a kernel without one feature keeps the protection a gap, and
    strict mode's refusal names the feature and the Linux release that has it."""
    from sandlock.compile import compiler

    policy = loads_policy('version = 1\n[filesystem]\nread = ["/dev"]\n')
    plan = ruleset.plan(policy, 1)
    gaps, subs = compiler.enforced(plan, lambda feature: feature != missing)
    assert protection not in [s.protection for s in subs]
    (gap,) = [g for g in gaps if g.protection == protection]
    assert f"{missing} (Linux {release}+)" in str(gap)
    assert f"{missing} (Linux {release}+)" in str(compiler.strict_failure(policy, 1, gaps))
    others = {s.protection for s in plan.substitutes} - {p for p, needs in compiler.SUBSTITUTE_NEEDS.items()
                                                         if missing in dict(needs)}
    assert {s.protection for s in subs} == others


def test_strict_refuses_when_the_gate_cannot_run(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the compiler: a policy relying on the signal scope at ABI 4 on a kernel whose
    detection says pidfd_open is missing is refused, with the release named."""
    from sandlock.compile import compiler
    from sandlock.errors import KernelSupportError
    from sandlock.policy.model import load_policy

    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    monkeypatch.setattr(compiler, "kernel_has", lambda feature: feature != "pidfd_open(2)")
    policy = load_policy(str(write_policy(tmp_path, 'version = 1\nextends = ["python"]\n')), {})
    with pytest.raises(KernelSupportError, match=r"pidfd_open\(2\) \(Linux 5\.3\+\)"):
        compiler.compile_policy(policy)
    monkeypatch.undo()
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    with compiler.compile_policy(policy) as compiled:
        assert compiled.signal_gate


#: A device's driver reached by an ioctl no allowlist holds: its own answer (ENOTTY: the
#: fuse driver does not know it), or the substitute's refusal (EACCES).
ASK_DRIVER = """\
import errno, fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
try:
    fcntl.ioctl(fd, 0x4B3A, 0)  # KDSETMODE, which the fuse driver does not know
    print("done")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


#: Ways a tool reached a device node below ABI 5 when the substitute was put only on
#: policies judged to reach a device from names and the mount table (attack rounds 30-34).
SCENES = ("read-granted-directory", "granted-node", "bind-without-nodev", "cached-then-replaced",
          "mounted-after-the-sandbox", "detached-o-path-stdin")


class Scene:
    """Root's scene under ``tmp_path``: mounts to undo."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.mounts: list[Path] = []

    def mount(self, *args: str) -> None:
        import subprocess

        subprocess.run(["mount", *args], check=True)
        self.mounts.append(Path(args[-1]))

    def node(self, path: Path) -> Path:
        import stat

        os.mknod(path, stat.S_IFCHR | 0o666, os.stat("/dev/fuse").st_rdev)
        return path

    def detach(self, point: Path) -> None:
        import subprocess

        subprocess.run(["umount", "-l", str(point)], check=True)

    def undo(self) -> None:
        import subprocess

        for _ in range(3):  # a covered mount shows once the one over it is gone
            for point in reversed(self.mounts):
                subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


def _policy(tmp_path: Path, read: Path) -> Path:
    return write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                  f'[filesystem]\nread = ["{read}"]\n')


def _ask(box: Any, path: str, **how: Any) -> str:
    result = box.run([PYTHON, "-c", ASK_DRIVER, path], capture_output=True, text=True, **how)
    return str(result.stdout).strip() or str(result.stderr).strip().splitlines()[-1]


@pytest.mark.parametrize("substitute", [True, False], ids=["found", "control"])
@pytest.mark.parametrize("scene", SCENES)
def test_below_abi_5_no_policy_shape_reaches_a_devices_ioctl(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             scene: str, substitute: bool) -> None:
    """Below ABI 5 every policy gets the ioctl substitute. It was put only on a policy
    judged to reach a device, from its grants' names and the mount table, and each of
    these reached one while `explain` said every protection held: a node root made in a
    read-granted directory; a granted file that is a node; a directory granted on a nodev
    mount whose filesystem is bound elsewhere without nodev (Landlock's rule is on the
    inode); a granted file replaced by a node after the plan was cached; a mount made
    under a granted directory after the Sandbox was made; an O_PATH descriptor given as
    stdin, in a tree unmounted lazily (in no mount table).
    Control: with the substitute's rule off, each reaches the fuse driver (ENOTTY)."""
    import shutil

    import sandlock

    if os.geteuid() != 0 or not shutil.which("mount") or not os.path.exists("/dev/fuse"):
        pytest.skip("mounts and makes device nodes: needs root and /dev/fuse")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if not substitute:
        monkeypatch.setattr(S, "ioctl_rules", lambda: [])
    want = "EACCES" if substitute else "ENOTTY"
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    stage = Scene(tmp_path)
    try:
        if scene == "read-granted-directory":
            (here / "dev").mkdir()
            node = stage.node(here / "dev" / "fuse")
            with sandlock.Sandbox(_policy(tmp_path, here)) as box:
                assert _ask(box, str(node)) == want
        elif scene == "granted-node":
            node = stage.node(here / "fuse")
            with sandlock.Sandbox(_policy(tmp_path, node)) as box:
                assert _ask(box, str(node)) == want
        elif scene == "bind-without-nodev":
            stage.mount("-t", "tmpfs", "-o", "nodev", "tmpfs", str(here))
            (here / "D").mkdir()
            stage.mount("--bind", str(here), str(there))
            stage.mount("-o", "remount,bind,dev", str(there))
            node = stage.node(there / "D" / "fuse")
            with sandlock.Sandbox(_policy(tmp_path, here / "D")) as box:
                assert _ask(box, str(node)) == want
        elif scene == "cached-then-replaced":
            granted = here / "file"
            granted.write_text("x")
            policy = _policy(tmp_path, granted)
            with sandlock.Sandbox(policy) as box:
                assert _ask(box, str(granted)) == ("EACCES" if substitute else "ENOTTY")
            granted.unlink()
            stage.node(granted)
            with sandlock.Sandbox(policy) as box:  # a cache hit
                assert _ask(box, str(granted)) == want
        elif scene == "mounted-after-the-sandbox":
            stage.mount("-t", "tmpfs", "-o", "nodev", "tmpfs", str(here))
            (here / "sub").mkdir()
            with sandlock.Sandbox(_policy(tmp_path, here)) as box:
                _ask(box, str(here / "sub" / "fuse"))  # nothing there yet
                stage.mount("-t", "tmpfs", "tmpfs", str(here / "sub"))
                node = stage.node(here / "sub" / "fuse")
                assert _ask(box, str(node)) == want
        else:
            stage.mount("-t", "tmpfs", "tmpfs", str(here))
            (here / "R").mkdir()
            node = stage.node(here / "R" / "fuse")
            stage.mount("--bind", str(here), str(there))
            stage.mount("-o", "remount,bind,nodev", str(there))
            handle = os.open(node, os.O_PATH | os.O_CLOEXEC)
            try:
                stage.detach(here)
                with sandlock.Sandbox(_policy(tmp_path, there / "R")) as box:
                    # (a working directory there is refused: tests/test_mounts.py)
                    assert _ask(box, "/proc/self/fd/0", stdin=handle) == want
            finally:
                os.close(handle)
    finally:
        stage.undo()


@pytest.mark.parametrize("refused", [True, False], ids=["found", "control"])
def test_a_directory_descriptor_is_never_the_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   refused: bool) -> None:
    """A directory is never a tool's stdin, stdout or stderr: a walk from a descriptor of a
    tree no mount table lists (unmounted lazily) reaches what the policy grants through a
    mount sandlock cannot judge (attack round 33: a device node there, reached through
    /proc/self/fd/0 with the grant of the same directory on a listed nodev mount). Control:
    with the refusal and the ioctl substitute off, the tool walks to the driver."""
    import shutil

    import sandlock
    from sandlock.api import sandbox as api
    from sandlock.errors import SetupError

    if os.geteuid() != 0 or not shutil.which("mount") or not os.path.exists("/dev/fuse"):
        pytest.skip("mounts and makes a device node: needs root and /dev/fuse")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    detached, shown = tmp_path / "detached", tmp_path / "shown"
    detached.mkdir()
    shown.mkdir()
    stage = Scene(tmp_path)
    try:
        stage.mount("-t", "tmpfs", "tmpfs", str(detached))
        (detached / "R").mkdir()
        stage.node(detached / "R" / "fuse")
        stage.mount("--bind", str(detached), str(shown))
        stage.mount("-o", "remount,bind,nodev", str(shown))
        handle = os.open(detached, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        stage.detach(detached)
        if not refused:
            monkeypatch.setattr(api, "refuse_directories", lambda _stdio: None)
            monkeypatch.setattr(S, "ioctl_rules", lambda: [])
        shell = os.path.realpath("/bin/sh")
        policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                        f'[filesystem]\nread = ["{shown / "R"}"]\n'
                                        f'exec = ["{shell}"]\n')
        with sandlock.Sandbox(policy) as box:
            # Python cannot start on a directory: the shell moves it to descriptor 5 first.
            ask = [shell, "-c", 'exec 5<&0 0</dev/null; exec "$0" -c "$1" /proc/self/fd/5/R/fuse',
                   PYTHON, ASK_DRIVER]
            if refused:
                with pytest.raises(SetupError, match="stdin is a directory"):
                    box.run(ask, stdin=handle, capture_output=True, text=True)
            else:
                result = box.run(ask, stdin=handle, capture_output=True, text=True)
                assert str(result.stdout).strip() == "ENOTTY", result
        os.close(handle)
    finally:
        stage.undo()
