"""Landlock rights per ABI version, the per-policy plan and its gaps: pure, every ABI 0..7.

The expected values are written out from the kernel documentation
(https://docs.kernel.org/userspace-api/landlock.html), not recomputed with the
code under test, so a wrong table entry shows up as a failing number.
"""

from __future__ import annotations

import pytest

from sandlock.compile import abi as A
from sandlock.compile.abi import Fs, Net, Scope
from sandlock.compile.ruleset import ENV_ABI, detect_abi, gaps, plan, substitutes
from sandlock.errors import LandlockError
from sandlock.linux import kernel
from sandlock.policy.model import Access, Network, PathRule, Policy, PortRange, Scopes

ABIS = range(A.NEWEST_ABI + 1)

# linux/landlock.h values, ABI 1 .. 5
V1_ALL = 0x1FFF  # EXECUTE .. MAKE_SYM
HANDLED = {0: 0, 1: V1_ALL, 2: 0x3FFF, 3: 0x7FFF, 4: 0x7FFF, 5: 0xFFFF, 6: 0xFFFF, 7: 0xFFFF}
READ = Fs.READ_FILE | Fs.READ_DIR
WRITE_V1 = (Fs.WRITE_FILE | Fs.REMOVE_DIR | Fs.REMOVE_FILE | Fs.MAKE_DIR | Fs.MAKE_REG
            | Fs.MAKE_FIFO | Fs.MAKE_SYM)


def since(abi: int, first: int, right: Fs) -> Fs:
    return right if abi >= first else Fs(0)


def test_uapi_values() -> None:
    assert [int(f) for f in Fs] == [1 << n for n in range(16)]
    assert [f.name for f in Fs][12:] == ["MAKE_SYM", "REFER", "TRUNCATE", "IOCTL_DEV"]
    assert (int(Net.BIND_TCP), int(Net.CONNECT_TCP)) == (1, 2)
    assert (int(Scope.ABSTRACT_UNIX_SOCKET), int(Scope.SIGNAL)) == (1, 2)
    assert (A.NET_SINCE, A.SCOPE_SINCE) == (4, 6)
    assert [A.fs_since(f) for f in (Fs.EXECUTE, Fs.MAKE_SYM, Fs.REFER, Fs.TRUNCATE,
                                    Fs.IOCTL_DEV)] == [1, 1, 2, 3, 5]


def test_every_flag_is_in_exactly_one_row_of_the_abi_table() -> None:
    """A flag added to Fs, Net or Scope without a version row fails here, instead of being
    taken for an ABI 1 right; the rows run 1..NEWEST_ABI without a hole."""
    assert sorted(A.ADDED) == list(range(1, A.NEWEST_ABI + 1))
    for enum_, field in ((Fs, "fs"), (Net, "net"), (Scope, "scope")):
        for flag in enum_:
            rows = [v for v, added in A.ADDED.items() if getattr(added, field) & flag]
            assert len(rows) == 1, (flag, rows)
    assert [v for v, added in A.ADDED.items() if added.audit] == [7]


def test_a_kernel_newer_than_the_table_is_reported_not_guessed() -> None:
    newer = A.NEWEST_ABI + 1
    assert A.fs_handled(newer) == A.fs_handled(A.NEWEST_ABI)
    assert A.net_handled(newer) == A.net_handled(A.NEWEST_ABI)
    assert A.scopes_known(newer) == A.scopes_known(A.NEWEST_ABI)
    assert A.newer_than_known(A.NEWEST_ABI) == ""
    note = A.newer_than_known(newer)
    assert f"ABI {newer}" in note and "not restricted" in note


@pytest.mark.parametrize("abi", ABIS)
def test_fs_handled(abi: int) -> None:
    assert int(A.fs_handled(abi)) == HANDLED[abi]
    assert bool(A.fs_handled(abi) & Fs.REFER) == (abi >= 2)
    assert bool(A.fs_handled(abi) & Fs.TRUNCATE) == (abi >= 3)
    assert bool(A.fs_handled(abi) & Fs.IOCTL_DEV) == (abi >= 5)


@pytest.mark.parametrize("abi", ABIS)
def test_fs_read_exec_write(abi: int) -> None:
    if abi == 0:
        assert A.fs_read(0) == A.fs_exec(0) == A.fs_write(0) == Fs(0)
        return
    assert A.fs_read(abi) == READ
    assert A.fs_exec(abi) == READ | Fs.EXECUTE
    expected = (READ | WRITE_V1 | since(abi, 2, Fs.REFER) | since(abi, 3, Fs.TRUNCATE)
                | since(abi, 5, Fs.IOCTL_DEV))
    assert A.fs_write(abi) == expected
    assert A.fs_write(abi, sockets=True) == expected | Fs.MAKE_SOCK


@pytest.mark.parametrize("abi", ABIS)
def test_granted_rights_are_always_handled(abi: int) -> None:
    """The kernel refuses (EINVAL) a rule with a right the ruleset does not handle."""
    handled = A.fs_handled(abi)
    for rights in (A.fs_read(abi), A.fs_exec(abi), A.fs_write(abi, sockets=True)):
        assert rights & ~handled == 0


@pytest.mark.parametrize("abi", ABIS)
def test_never_granted(abi: int) -> None:
    """Device nodes cannot be created; write does not imply execute."""
    write = A.fs_write(abi, sockets=True)
    assert not write & (Fs.MAKE_CHAR | Fs.MAKE_BLOCK | Fs.EXECUTE)
    assert not A.fs_write(abi) & Fs.MAKE_SOCK


@pytest.mark.parametrize("abi", ABIS)
def test_file_rules_get_only_file_rights(abi: int) -> None:
    assert A.FILE_ONLY == (Fs.EXECUTE | Fs.WRITE_FILE | Fs.READ_FILE | Fs.TRUNCATE
                           | Fs.IOCTL_DEV)
    if abi == 0:
        return
    assert A.for_file(A.fs_read(abi)) == Fs.READ_FILE
    assert A.for_file(A.fs_exec(abi)) == Fs.READ_FILE | Fs.EXECUTE
    assert A.for_file(A.fs_write(abi, sockets=True)) == (
        Fs.READ_FILE | Fs.WRITE_FILE | since(abi, 3, Fs.TRUNCATE) | since(abi, 5, Fs.IOCTL_DEV))


@pytest.mark.parametrize("abi", ABIS)
def test_net_and_scopes(abi: int) -> None:
    assert int(A.net_handled(abi)) == (3 if abi >= 4 else 0)
    assert int(A.scopes_known(abi)) == (3 if abi >= 6 else 0)


# ---------------------------------------------------------------------------
# plan(): rights per path and port for one policy

FULL = Policy(
    source="full.toml",
    paths=(PathRule("/data", Access.READ), PathRule("/data", Access.EXEC),
           PathRule("/work", Access.WRITE), PathRule("/usr/bin/cat", Access.EXEC)),
    network=Network(connect=(PortRange(443, 443), PortRange(8000, 8002)),
                    bind=(PortRange(8001, 8001),)),
)


@pytest.mark.parametrize("abi", ABIS)
def test_plan(abi: int) -> None:
    p = plan(FULL, abi)
    assert p.abi == abi
    assert p.handled_fs == HANDLED[abi]
    assert p.handled_net == (3 if abi >= 4 else 0)
    assert p.scoped == (int(Scope.SIGNAL | Scope.ABSTRACT_UNIX_SOCKET) if abi >= 6 else 0)
    assert dict(p.paths) == {
        "/data": int(A.fs_exec(abi)),  # read and exec rules on one path are merged
        "/work": int(A.fs_write(abi)),
        "/usr/bin/cat": int(A.fs_exec(abi)),
    }
    if abi >= 4:
        connect, bind = int(Net.CONNECT_TCP), int(Net.BIND_TCP)
        assert p.ports == ((443, connect), (8000, connect), (8001, connect | bind),
                           (8002, connect))
    else:
        assert p.ports == ()
    assert p.gaps == gaps(FULL, abi)


def test_plan_write_grants_socket_creation_only_with_unix() -> None:
    unix = Policy(paths=(PathRule("/work", Access.WRITE),), network=Network(unix=True))
    assert dict(plan(unix, 7).paths)["/work"] & Fs.MAKE_SOCK
    assert not dict(plan(FULL, 7).paths)["/work"] & Fs.MAKE_SOCK


@pytest.mark.parametrize("signals, abstract, scoped", [
    (True, True, Scope.SIGNAL | Scope.ABSTRACT_UNIX_SOCKET),
    (False, True, Scope.ABSTRACT_UNIX_SOCKET),
    (True, False, Scope.SIGNAL),
    (False, False, Scope(0)),
])
def test_plan_scopes_follow_the_policy(signals: bool, abstract: bool, scoped: Scope) -> None:
    policy = Policy(scope=Scopes(signals, abstract))
    assert plan(policy, 6).scoped == plan(policy, 7).scoped == int(scoped)
    assert plan(policy, 5).scoped == 0


# ---------------------------------------------------------------------------
# gaps(): what a policy relies on that an ABI cannot enforce

NOTHING = Policy(scope=Scopes(False, False))


def gap_names(policy: Policy, abi: int) -> list[str]:
    return [gap.protection for gap in gaps(policy, abi)]


@pytest.mark.parametrize("abi, expected", [
    (0, ["filesystem confinement", "device ioctl restriction", "signal scope"]),
    (1, []),  # the truncate restriction, device ioctls and the signal scope have substitutes
    (2, []),
    (3, []),
    (4, []),
    (5, []),
    (6, []),
    (7, []),
])
def test_gaps_of_the_default_policy(abi: int, expected: list[str]) -> None:
    assert gap_names(Policy(), abi) == expected


@pytest.mark.parametrize("abi, expected", [
    (0, ["filesystem confinement", "device ioctl restriction"]), (1, []), (2, []),
    (3, []), (4, []), (5, []), (6, []), (7, []),
])
def test_gaps_without_scopes(abi: int, expected: list[str]) -> None:
    assert gap_names(NOTHING, abi) == expected


@pytest.mark.parametrize("abi", ABIS)
def test_gap_tcp_grant(abi: int) -> None:
    for network in (Network(connect=(PortRange(443, 443),)), Network(bind=(PortRange(80, 80),))):
        policy = Policy(network=network, scope=Scopes(False, False))
        assert ("TCP port restriction" in gap_names(policy, abi)) == (abi < 4)


@pytest.mark.parametrize("abi", ABIS)
def test_no_tcp_gap_without_a_tcp_grant(abi: int) -> None:
    """Without a TCP grant, seccomp refuses inet stream sockets on every ABI."""
    policy = Policy(network=Network(udp=True), scope=Scopes(False, False))
    assert "TCP port restriction" not in gap_names(policy, abi)


@pytest.mark.parametrize("abi", ABIS)
def test_gap_abstract_unix_scope_only_matters_with_unix_sockets(abi: int) -> None:
    with_unix = Policy(network=Network(unix=True), scope=Scopes(False, True))
    assert ("abstract unix socket scope" in gap_names(with_unix, abi)) == (abi < 6)
    assert "abstract unix socket scope" not in gap_names(Policy(scope=Scopes(False, True)), abi)
    off = Policy(network=Network(unix=True), scope=Scopes(False, False))
    assert "abstract unix socket scope" not in gap_names(off, abi)


@pytest.mark.parametrize("abi", ABIS)
def test_gap_signal_scope(abi: int) -> None:
    """Below ABI 6 the signal gate substitutes for the scope (a gap only without Landlock,
    or when the compiler finds the gate unsupported here)."""
    policy = Policy(scope=Scopes(True, False))
    assert ("signal scope" in gap_names(policy, abi)) == (abi == 0)
    assert ("signal scope" in [s.protection for s in substitutes(policy, abi)]) == (0 < abi < 6)
    assert "signal scope" not in [s.protection for s in substitutes(Policy(scope=Scopes(False, False)), 3)]


@pytest.mark.parametrize("abi", ABIS)
def test_gap_device_ioctl(abi: int) -> None:
    """Below ABI 5 the seccomp ioctl allowlist substitutes for the right, on every policy
    (whether one reaches a device cannot be known there; a gap only without Landlock;
    tests/test_substitute_ioctl.py attacks it on the real kernel)."""
    tty = Policy(paths=(PathRule("/dev/tty", Access.WRITE),), scope=Scopes(False, False))
    harmless = Policy(paths=tuple(PathRule(p, Access.WRITE) for p in
                                  ("/dev/null", "/dev/zero", "/dev/urandom")),
                      scope=Scopes(False, False))
    for policy in (tty, harmless, NOTHING):
        assert ("device ioctl restriction" in gap_names(policy, abi)) == (abi == 0)
        assert ("device ioctl restriction" in [s.protection for s in substitutes(policy, abi)]
                ) == (0 < abi < 5)


@pytest.mark.parametrize("abi", [1, 2])
def test_truncate_substitute(abi: int) -> None:
    """Without the truncate right the seccomp substitute covers it: not a gap
    (tests/test_substitutes.py attacks it on the real kernel)."""
    assert gaps(NOTHING, abi) == ()
    (sub,) = [s for s in substitutes(NOTHING, abi) if s.protection == "truncate restriction"]
    assert sub.needs_abi == 3
    assert str(sub).startswith("truncate restriction (Landlock ABI 3+ enforces it): substitute: "
                               "seccomp: truncate(2) by path")
    assert all("truncate restriction" not in [s.protection for s in substitutes(NOTHING, newer)]
               for newer in range(3, A.NEWEST_ABI + 1))
    assert substitutes(NOTHING, 0) == ()


def test_gap_messages_say_what_is_lost() -> None:
    everything = Policy(paths=(PathRule("/dev/tty", Access.READ),),
                        network=Network(connect=(PortRange(1, 1),), unix=True))
    assert [str(gap) for gap in gaps(everything, 0)] == [
        ("filesystem confinement (needs Landlock ABI 1): Landlock is unavailable: every file the "
         "user can reach is reachable, including sandlock's own code and state directory "
         "(~/.cache/sandlock: cached plans, key): a tool can change what later runs do"),
        ("TCP port restriction (needs Landlock ABI 4): TCP connect/bind is possible to and on any "
         "port, not only the granted ones"),
        ("device ioctl restriction (needs Landlock ABI 5): ioctl(2) on granted devices is not "
         "restricted"),
        "signal scope (needs Landlock ABI 6): the tool can signal every process of the same user",
        ("abstract unix socket scope (needs Landlock ABI 6): the tool can connect to abstract unix "
         "sockets outside the sandbox"),
    ]
    assert gaps(everything, 7) == ()


# ---------------------------------------------------------------------------
# SANDLOCK_ABI: pretend an older kernel


def test_detect_abi_override(monkeypatch: pytest.MonkeyPatch) -> None:
    real = kernel.landlock_abi()
    monkeypatch.delenv(ENV_ABI, raising=False)
    assert detect_abi() == real
    for pretend in range(real + 1):
        monkeypatch.setenv(ENV_ABI, str(pretend))
        assert detect_abi() == pretend
    monkeypatch.setenv(ENV_ABI, "-1")
    assert detect_abi() == 0


def test_detect_abi_refuses_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    real = kernel.landlock_abi()
    monkeypatch.setenv(ENV_ABI, "new")
    with pytest.raises(LandlockError, match=r"^SANDLOCK_ABI='new' is not an integer$"):
        detect_abi()
    monkeypatch.setenv(ENV_ABI, str(real + 1))
    with pytest.raises(LandlockError) as info:
        detect_abi()
    assert str(info.value) == (f"SANDLOCK_ABI={real + 1} but this kernel only has Landlock "
                               f"ABI {real}")
