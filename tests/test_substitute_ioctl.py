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

import pytest
from conftest import PYTHON, require_abi, run_confined, write_policy

from sandlock.compile import abi as A
from sandlock.compile import devices, grants, ruleset
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
    ('read = ["/dev/null", "/dev/urandom"]', "", None),
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


@pytest.mark.parametrize("substitute", [True, False], ids=["found", "control"])
def test_devices_bound_elsewhere_get_the_substitute(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    substitute: bool) -> None:
    """A chroot's (or a container root's) ``dev``, bound from /dev, holds the same devices
    under another name: a policy granting that tree got neither the substitute nor a gap,
    and strict mode ran it silently at ABI 4. Control: with the mount table not consulted,
    the driver answers."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("binds /dev elsewhere: needs root")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    subprocess.run(["mount", "--rbind", "/dev", str(root / "dev")], check=True)
    try:
        # A bind of /dev is a filesystem without nodev under the grant too: this check alone.
        monkeypatch.setattr(devices, "_may_hold_devices", lambda _path, _mounts: False)
        if not substitute:
            monkeypatch.setattr(devices, "_device_mounts", lambda _mounts: ())
        policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                        f'[filesystem]\nread = ["{root}"]\n')
        assert ruleset.grants_devices(loads_policy(policy.read_text())) == substitute
        import sandlock

        with sandlock.Sandbox(policy) as box:
            result = box.run([PYTHON, "-c", ATTACK.replace("/dev/ptmx", f"{root}/dev/ptmx")],
                             capture_output=True, text=True)
        said = str(result.stdout).strip() or str(result.stderr)
        assert said == "refused EACCES" if substitute else said.startswith("pty "), said
    finally:
        subprocess.run(["umount", "-R", "-l", str(root / "dev")], check=False)


@pytest.mark.parametrize("substitute", [True, False], ids=["found", "control"])
def test_a_directory_holding_a_device_node_gets_the_substitute(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               substitute: bool) -> None:
    """A directory granted for reading that holds a device node root made there (a
    debootstrap rootfs's ``dev``, a ``cp -a`` of /dev): below ABI 5 the policy got
    neither the substitute nor a gap, and the node's driver took any ioctl (attack round
    30, the part left open). A directory on a filesystem mounted without ``nodev`` may hold
    such nodes, whatever it holds now. Control: with the mount's options not looked at,
    the driver answers."""
    import stat

    if os.geteuid() != 0:
        pytest.skip("makes a device node: needs root")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    scene = tmp_path / "scene"
    (scene / "dev").mkdir(parents=True)
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here: its numbers name no driver")
    node = scene / "dev" / "fuse"
    os.mknod(node, stat.S_IFCHR | 0o600, os.stat("/dev/fuse").st_rdev)
    if not substitute:
        monkeypatch.setattr(devices, "_may_hold_devices", lambda _path, _mounts: False)
    policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                    f'[filesystem]\nread = ["{scene}"]\nwrite = ["{tmp_path / "out"}"]\n')
    (tmp_path / "out").mkdir()
    assert ruleset.grants_devices(loads_policy(policy.read_text())) == substitute
    import sandlock

    with sandlock.Sandbox(policy) as box:
        result = box.run([PYTHON, "-c", KMSG_IOCTL.replace("os.O_WRONLY", "os.O_RDONLY"),
                          str(node)], capture_output=True, text=True)  # fuse: ENOTTY too
    said = str(result.stdout).strip() or str(result.stderr)
    assert said == ("EACCES" if substitute else "ENOTTY"), said


def test_a_nodev_directory_with_a_device_mount_below_gets_the_substitute(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch
                                                                         ) -> None:
    """``nodev`` on the filesystem of a granted directory is not enough: one mounted below it
    without ``nodev`` may hold a device node, and its driver took the ioctl. The tree alone
    (nothing mounted below) is one where no node opens as a device."""
    import shutil
    import stat
    import subprocess

    if os.geteuid() != 0 or not shutil.which("mount") or not os.path.exists("/dev/fuse"):
        pytest.skip("mounts and makes a device node: needs root and /dev/fuse")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    scene = tmp_path / "scene"
    scene.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "nodev", "tmpfs", str(scene)], check=True)
    try:
        assert not devices._may_hold_devices(str(scene), grants.read_mounts())
        (scene / "inner").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(scene / "inner")], check=True)
        node = scene / "inner" / "fuse"
        os.mknod(node, stat.S_IFCHR | 0o600, os.stat("/dev/fuse").st_rdev)
        assert devices._may_hold_devices(str(scene), grants.read_mounts())
        # The profile's own directories are on the root filesystem: this grant alone here.
        real = devices._may_hold_devices
        monkeypatch.setattr(devices, "_may_hold_devices",
                            lambda path, mounts: path == str(scene) and real(path, mounts))
        policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                        f'[filesystem]\nread = ["{scene}"]\n')
        import sandlock

        with sandlock.Sandbox(policy) as box:
            result = box.run([PYTHON, "-c", KMSG_IOCTL.replace("os.O_WRONLY", "os.O_RDONLY"),
                              str(node)], capture_output=True, text=True)
        said = str(result.stdout).strip() or str(result.stderr)
        assert said == "EACCES", said
    finally:
        subprocess.run(["umount", "-R", "-l", str(scene)], check=False)


@pytest.mark.parametrize("substitute", [True, False], ids=["found", "control"])
@pytest.mark.parametrize("scene", ["covered", "moved-beneath"])
def test_a_mount_shown_over_a_nodev_one_is_the_one_judged(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          scene: str, substitute: bool) -> None:
    """The filesystem a granted directory shows is the mount its descriptor is on, not the
    last or deepest line of the mount table with its name (attack round 31): a nodev mount
    at ``x/y`` covered by a mount at ``x`` without nodev, and a mount without nodev moved
    over a nodev one at ``x`` (the table lists it first), both showed a node made there
    and its driver took the ioctl while `explain` said every protection held. Control:
    with the check off the driver answers."""
    import shutil
    import stat
    import subprocess

    if os.geteuid() != 0 or not shutil.which("mount") or not os.path.exists("/dev/fuse"):
        pytest.skip("mounts and makes a device node: needs root and /dev/fuse")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    base = tmp_path / "scene"
    (base / "x" / "y").mkdir(parents=True)
    (base / "old").mkdir()

    def mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True)

    try:
        if scene == "covered":
            mount("-t", "tmpfs", "-o", "nodev", "tmpfs", str(base / "x" / "y"))
            mount("-t", "tmpfs", "tmpfs", str(base / "x"))
            (base / "x" / "y").mkdir()
            granted = base / "x" / "y"
        else:
            mount("-t", "tmpfs", "tmpfs", str(base / "old"))
            mount("-t", "tmpfs", "-o", "nodev", "tmpfs", str(base / "x"))
            mount("--move", str(base / "old"), str(base / "x"))
            granted = base / "x"
        node = granted / "fuse"
        os.mknod(node, stat.S_IFCHR | 0o600, os.stat("/dev/fuse").st_rdev)
        real = devices._may_hold_devices  # the profile's own directories: judged elsewhere
        monkeypatch.setattr(devices, "_may_hold_devices", lambda path, mounts: (
            substitute and path == str(granted) and real(path, mounts)))
        policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                        f'[filesystem]\nread = ["{granted}"]\n')
        assert ruleset.grants_devices(loads_policy(policy.read_text())) == substitute
        import sandlock

        with sandlock.Sandbox(policy) as box:
            result = box.run([PYTHON, "-c", KMSG_IOCTL.replace("os.O_WRONLY", "os.O_RDONLY"),
                              str(node)], capture_output=True, text=True)
        said = str(result.stdout).strip() or str(result.stderr)
        assert said == ("EACCES" if substitute else "ENOTTY"), said
    finally:  # a covered mount shows once the one over it is gone: until none is left
        for _ in range(4):
            for point in (base / "x" / "y", base / "x", base / "old"):
                subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


def _probe(box_policy: Path, node: Path) -> str:
    """What an unknown ioctl on ``node`` answers a tool under ``box_policy`` (ABI set by
    the caller): its driver's ENOTTY, or the substitute's EACCES."""
    import sandlock

    with sandlock.Sandbox(box_policy) as box:
        result = box.run([PYTHON, "-c", KMSG_IOCTL.replace("os.O_WRONLY", "os.O_RDONLY"),
                          str(node)], capture_output=True, text=True)
    return str(result.stdout).strip() or str(result.stderr)


def _only(monkeypatch: pytest.MonkeyPatch, granted: Path, on: bool = True) -> None:
    """The mount check judges ``granted`` alone (the profile's own directories are on the
    root filesystem, which would put the substitute on by themselves); off: nothing."""
    real = devices._may_hold_devices
    monkeypatch.setattr(devices, "_may_hold_devices", lambda path, mounts: (
        on and path == str(granted) and real(path, mounts)))


@pytest.mark.parametrize("substitute", [True, False], ids=["found", "control"])
@pytest.mark.parametrize("scene", ["bound-with-dev", "bound-with-a-mount-below"])
def test_a_directory_shown_by_another_mount_of_its_filesystem_is_judged_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scene: str, substitute: bool) -> None:
    """Landlock's rule is on the directory, so a bind of its filesystem elsewhere shows it
    with the grant: the directory granted on a nodev mount, the same filesystem bound at
    another place without nodev (or still nodev, with a mount without it below the
    directory there), and a node made through that other place answered KVM_CREATE_VM at
    ABI 4 while `explain` said every protection held (attack round 32). Control: with the
    check off the driver answers."""
    import shutil
    import stat
    import subprocess

    if os.geteuid() != 0 or not shutil.which("mount") or not os.path.exists("/dev/fuse"):
        pytest.skip("mounts and makes a device node: needs root and /dev/fuse")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()

    def mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True)

    try:
        mount("-t", "tmpfs", "-o", "nodev", "tmpfs", str(here))
        (here / "D" / "sub").mkdir(parents=True)
        mount("--bind", str(here), str(there))
        if scene == "bound-with-dev":
            mount("-o", "remount,bind,dev", str(there))
            node = there / "D" / "fuse"
        else:
            mount("-t", "tmpfs", "tmpfs", str(there / "D" / "sub"))
            node = there / "D" / "sub" / "fuse"
        os.mknod(node, stat.S_IFCHR | 0o666, os.stat("/dev/fuse").st_rdev)
        _only(monkeypatch, here / "D", substitute)
        policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                        f'[filesystem]\nread = ["{here / "D"}"]\n')
        assert ruleset.grants_devices(loads_policy(policy.read_text())) == substitute
        assert _probe(policy, node) == ("EACCES" if substitute else "ENOTTY")
    finally:
        for _ in range(3):
            for point in (there / "D" / "sub", there, here):
                subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


@pytest.mark.parametrize("recheck", [True, False], ids=["found", "control"])
@pytest.mark.parametrize("change", ["a-mount-below", "a-node-for-the-file"])
def test_a_cached_plan_judges_its_devices_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                change: str, recheck: bool) -> None:
    """A plan compiled and cached while its grants reached no device: a mount without nodev
    made below a granted nodev directory afterwards, or a device node put in a granted
    file's place, and the next run (a cache hit) ran the stored filter without the
    substitute: the driver answered at ABI 4 while a fresh compile would have put it on
    (attack round 32). Control: with the hit's judgement off, the stale plan runs."""
    import shutil
    import stat
    import subprocess

    from sandlock.compile import cache

    if os.geteuid() != 0 or not shutil.which("mount") or not os.path.exists("/dev/fuse"):
        pytest.skip("mounts and makes a device node: needs root and /dev/fuse")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    monkeypatch.delenv(cache.ENV_NO_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    scene = tmp_path / "scene"
    scene.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "nodev", "tmpfs", str(scene)], check=True)
    try:
        (scene / "sub").mkdir()
        if change == "a-mount-below":
            granted, node = scene, scene / "sub" / "fuse"
        else:
            granted = node = tmp_path / "file"
            node.write_text("x")
        _only(monkeypatch, scene)
        if not recheck:
            monkeypatch.setattr(cache, "_devices_fresh", lambda _value: True)
        policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                        f'[filesystem]\nread = ["{granted}"]\n')
        assert not ruleset.grants_devices(loads_policy(policy.read_text()))
        _probe(policy, node)  # compiled and cached (no node yet, or a plain file)
        if change == "a-mount-below":
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(scene / "sub")], check=True)
        else:
            node.unlink()
        os.mknod(node, stat.S_IFCHR | 0o666, os.stat("/dev/fuse").st_rdev)
        assert _probe(policy, node) == ("EACCES" if recheck else "ENOTTY")
    finally:
        for _ in range(3):
            for point in (scene / "sub", scene):
                subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


@pytest.mark.parametrize("refused", [True, False], ids=["found", "control"])
def test_a_directory_descriptor_into_an_unlisted_mount_is_never_the_tools(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool) -> None:
    """A tree unmounted lazily is in no mount table, yet a descriptor of it still walks it:
    the directory granted through a nodev bind of the same filesystem, a descriptor of the
    filesystem's other (detached, device-enabled) mount given to the tool as its stdin, and
    the tool opened a node there through /proc/self/fd/0 and its driver answered at ABI 4
    while nothing was reported (attack round 33). A directory is never a tool's stdio now.
    Control: with that refusal off, the driver answers."""
    import shutil
    import stat
    import subprocess

    from sandlock.api import sandbox as api
    from sandlock.errors import SetupError

    if os.geteuid() != 0 or not shutil.which("mount") or not os.path.exists("/dev/fuse"):
        pytest.skip("mounts and makes a device node: needs root and /dev/fuse")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    detached, shown = tmp_path / "detached", tmp_path / "shown"
    detached.mkdir()
    shown.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(detached)], check=True)
    try:
        (detached / "R").mkdir()
        os.mknod(detached / "R" / "fuse", stat.S_IFCHR | 0o666, os.stat("/dev/fuse").st_rdev)
        subprocess.run(["mount", "--bind", str(detached), str(shown)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,nodev", str(shown)], check=True)
        handle = os.open(detached, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        subprocess.run(["umount", "-l", str(detached)], check=True)
        _only(monkeypatch, shown / "R")
        if not refused:
            monkeypatch.setattr(api, "refuse_directories", lambda _stdio: None)
        shell = os.path.realpath("/bin/sh")
        policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                        f'[filesystem]\nread = ["{shown / "R"}"]\n'
                                        f'exec = ["{shell}"]\n')
        assert not ruleset.grants_devices(loads_policy(policy.read_text()))
        import sandlock

        with sandlock.Sandbox(policy) as box:
            # Python cannot start on a directory: the shell moves it to descriptor 5 first.
            ask = [shell, "-c", 'exec 5<&0 0</dev/null; exec "$0" -c "$1" /proc/self/fd/5/R/fuse',
                   PYTHON, KMSG_IOCTL.replace("os.O_WRONLY", "os.O_RDONLY")]
            if refused:
                with pytest.raises(SetupError, match="stdin is a directory"):
                    box.run(ask, stdin=handle, capture_output=True, text=True)
            else:
                result = box.run(ask, stdin=handle, capture_output=True, text=True)
                assert str(result.stdout).strip() == "ENOTTY", result
        os.close(handle)
    finally:
        for _ in range(3):
            for point in (shown, detached):
                subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


def test_a_block_node_of_a_harmless_character_devices_numbers_is_a_device(tmp_path: Path) -> None:
    """The harmless numbers are those of character devices (/dev/null is 1,3): a block
    node with the same numbers is major 1 of the block devices (the RAM disk), whose
    driver answers ioctls; it was taken for /dev/null (attack round 31)."""
    import stat

    if os.geteuid() != 0:
        pytest.skip("makes a device node: needs root")
    block = tmp_path / "b13"
    os.mknod(block, stat.S_IFBLK | 0o600, os.makedev(1, 3))
    char = tmp_path / "c13"
    os.mknod(char, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    assert devices._is_device(str(block))
    assert not devices._is_device(str(char))


#: A device's driver reached by an ioctl no allowlist holds: its own answer (ENOTTY, /dev/kmsg
#: has no ioctls), or the substitute's refusal (EACCES).
KMSG_IOCTL = """\
import errno, fcntl, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
try:
    fcntl.ioctl(fd, 0x4B3A, 0)  # KDSETMODE, which the kmsg driver does not know
    print("done")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@pytest.mark.parametrize("substitute", [True, False], ids=["found", "control"])
def test_a_device_node_granted_outside_dev_gets_the_substitute(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               substitute: bool) -> None:
    """A device node root made outside /dev (mknod: a chroot's `dev`, a copy of /dev),
    granted by its name: below ABI 5 the policy got neither the substitute nor a gap, and
    its driver took any ioctl on a read grant (attack round 30: KVM_CREATE_VM). Control:
    with the node's type not looked at, the driver answers."""
    import stat

    if os.geteuid() != 0:
        pytest.skip("makes a device node: needs root")
    require_abi(4, "pretending ABI 4")
    monkeypatch.setenv("SANDLOCK_ABI", "4")
    kmsg = os.stat("/dev/kmsg").st_rdev
    node = tmp_path / "scene" / "kmsg"
    node.parent.mkdir()
    os.mknod(node, stat.S_IFCHR | 0o600, kmsg)
    # The profile's own directories may hold devices too (below): this check alone here.
    monkeypatch.setattr(devices, "_may_hold_devices", lambda _path, _mounts: False)
    if not substitute:
        monkeypatch.setattr(devices, "_is_device", lambda _path: False)
    policy = write_policy(tmp_path, f'version = 1\nextends = ["python"]\n'
                                    f'[filesystem]\nread = ["{node}"]\nwrite = ["{node}"]\n')
    assert ruleset.grants_devices(loads_policy(policy.read_text())) == substitute
    import sandlock

    with sandlock.Sandbox(policy) as box:
        result = box.run([PYTHON, "-c", KMSG_IOCTL, str(node)], capture_output=True, text=True)
    said = str(result.stdout).strip() or str(result.stderr)
    assert said == ("EACCES" if substitute else "ENOTTY"), said
