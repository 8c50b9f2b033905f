"""The seccomp plan: pure rules, checked with a small evaluator of their meaning.

:func:`verdict` applies the rules the way the compiled filter does (allow by
default; a rule whose comparisons all hold returns its errno; 64-bit unsigned
comparisons), so the tests can ask "is socket(AF_PACKET, ...) refused?" for any
argument values, including garbage in the upper 32 bits that the kernel ignores
for ``int`` arguments.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandlock.compile import seccomp as S
from sandlock.errors import PolicyError, SeccompError
from sandlock.policy.model import Network, Policy, PortRange, Syscalls, loads_policy

AF_PACKET, AF_NETLINK, AF_BLUETOOTH, AF_VSOCK, AF_ALG = 17, 16, 31, 40, 38
SOCK_RAW, SOCK_SEQPACKET = 3, 5
SOCK_NONBLOCK, SOCK_CLOEXEC = 0o4000, 0o2000000
IPPROTO_SCTP, IPPROTO_MPTCP, IPPROTO_ICMP = 132, 262, 1
U64 = (1 << 64) - 1

TCP = Network(connect=(PortRange(443, 443),))
UDP = Network(udp=True)
UNIX = Network(unix=True)
NONE = Network()


def holds(cmp: S.Cmp, args: tuple[int, ...]) -> bool:
    value = args[cmp.arg] & U64
    if cmp.op == S.MASKED_EQ:
        return (value & cmp.mask) == cmp.value
    return {
        S.NE: value != cmp.value, S.LT: value < cmp.value, S.LE: value <= cmp.value,
        S.EQ: value == cmp.value, S.GE: value >= cmp.value, S.GT: value > cmp.value,
    }[cmp.op]


def verdict(rules: tuple[S.Rule, ...], syscall: str, *args: int) -> int | None:
    """The errno the filter answers, or None when the call is allowed."""
    padded = tuple(args) + (0,) * (6 - len(args))
    hits = [r.errno for r in rules if r.syscall == syscall and all(holds(c, padded) for c in r.args)]
    return hits[0] if hits else None


def rules_for(network: Network = NONE, *, deny: tuple[str, ...] = (),
              allow: tuple[str, ...] = ()) -> tuple[S.Rule, ...]:
    return S.plan(Policy(network=network, syscalls=Syscalls(deny, allow)))


def unconditional(rules: tuple[S.Rule, ...]) -> set[str]:
    return {r.syscall for r in rules if not r.args}


# ---------------------------------------------------------------------------
# The default deny list and syscalls.allow / syscalls.deny

MUST_DENY = {
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "ptrace",
    "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "open_by_handle_at", "iopl", "ioperm", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "fsopen", "fsmount", "open_tree", "move_mount",
}


def test_default_deny_list_is_present() -> None:
    rules = rules_for()
    assert MUST_DENY <= set(S.DEFAULT_DENY)
    assert set(S.DEFAULT_DENY) <= unconditional(rules)
    assert all(verdict(rules, name) == errno.EPERM for name in S.DEFAULT_DENY)
    for everyday in ("read", "write", "openat", "execve", "clone", "ioctl", "kill"):
        assert verdict(rules, everyday) is None, everyday
    assert len(set(S.DEFAULT_DENY)) == len(S.DEFAULT_DENY)


def test_allow_removes_an_entry_and_deny_adds_one() -> None:
    rules = rules_for(deny=("chmod", "ptrace"), allow=("ptrace", "bpf"))
    assert verdict(rules, "bpf") is None
    assert verdict(rules, "chmod") == errno.EPERM
    assert verdict(rules, "unshare") == errno.EPERM
    # deny wins over allow: naming a syscall in both keeps it refused
    assert verdict(rules, "ptrace") == errno.EPERM
    assert [r.syscall for r in rules if not r.args].count("chmod") == 1


def test_clone_namespace_flags_are_refused() -> None:
    rules = rules_for()
    assert verdict(rules, "clone", 0x01200011) is None  # fork(): CLONE_CHILD_SETTID|CLEARTID|SIGCHLD
    assert verdict(rules, "clone", 0x003D0F00) is None  # pthread_create's flags
    for name, flag in S.NAMESPACE_FLAGS.items():
        assert verdict(rules, "clone", flag | 0x11) == errno.EPERM, name
        assert verdict(rules, "clone", (0xDEAD << 32) | flag) == errno.EPERM, name
    assert set(S.NAMESPACE_FLAGS.values()) == {
        0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000}


def test_clone3_answers_enosys() -> None:
    rules = rules_for()
    assert verdict(rules, "clone3") == errno.ENOSYS
    assert verdict(rules_for(allow=("clone3",)), "clone3") is None


def test_allowing_clone_drops_only_the_flag_rules() -> None:
    rules = rules_for(allow=("clone",))
    assert verdict(rules, "clone", S.NAMESPACE_FLAGS["CLONE_NEWUSER"]) is None
    assert verdict(rules, "unshare") == errno.EPERM


@pytest.mark.parametrize("request_", S.TTY_DENY)
def test_terminal_ioctls_are_refused_on_the_low_32_bits(request_: int) -> None:
    assert S.TTY_DENY == (0x5412, 0x541C, 0x5423, 0x541D, 0x5437, 0x5457)
    rules = rules_for()
    assert verdict(rules, "ioctl", 0, request_) == errno.EPERM
    # the kernel takes the request as an unsigned int: high garbage must not bypass the rule
    assert verdict(rules, "ioctl", 0, (1 << 32) | request_) == errno.EPERM
    assert verdict(rules_for(allow=("ioctl",)), "ioctl", 0, request_) is None


def test_terminal_ioctl_rules_compare_the_request_on_the_low_32_bits() -> None:
    tty_rules = [r for r in rules_for() if r.syscall == "ioctl"]
    assert len(tty_rules) == len(S.TTY_DENY) + 1
    assert all(r.args[0] == S.Cmp(1, S.MASKED_EQ, r.args[0].value, S.LOW32) for r in tty_rules)


@pytest.mark.parametrize("request_, name", [
    (0x5401, "TCGETS"), (0x5402, "TCSETS"), (0x5403, "TCSETSW"), (0x5404, "TCSETSF"),
    (0x5406, "TCSETA"), (0x540B, "TCFLSH"), (0x540A, "TCXONC"), (0x5414, "TIOCSWINSZ"),
    (0x5413, "TIOCGWINSZ"), (0x5424, "TIOCGETD"), (0x802C542A, "TCGETS2"), (0x402C542B, "TCSETS2"),
])
def test_terminal_settings_stay_allowed(request_: int, name: str) -> None:
    """A pager, an editor, a REPL or pexpect sets termios and the window size."""
    assert verdict(rules_for(), "ioctl", 0, request_, 0) is None, name


def test_tiocsctty_may_adopt_a_new_terminal_but_not_steal_one() -> None:
    rules = rules_for()
    assert verdict(rules, "ioctl", 3, S.TIOCSCTTY, 0) is None
    for steal in (1, 2, 1 << 32, U64):
        assert verdict(rules, "ioctl", 3, S.TIOCSCTTY, steal) == errno.EPERM, steal
        assert verdict(rules, "ioctl", 3, (7 << 32) | S.TIOCSCTTY, steal) == errno.EPERM, steal


def test_personality_only_query() -> None:
    rules = rules_for()
    assert verdict(rules, "personality", 0xFFFFFFFF) is None
    assert verdict(rules, "personality", 0x0040000) == errno.EPERM  # ADDR_NO_RANDOMIZE


def test_tcp_fast_open_is_refused() -> None:
    rules = rules_for(TCP)
    assert verdict(rules, "sendto", 3, 0, 0, S.MSG_FASTOPEN) == errno.EPERM
    assert verdict(rules, "sendmsg", 3, 0, S.MSG_FASTOPEN | 0x40) == errno.EPERM
    assert verdict(rules, "sendmmsg", 3, 0, 1, S.MSG_FASTOPEN) == errno.EPERM
    assert verdict(rules, "sendto", 3, 0, 0, 0x40) is None


# ---------------------------------------------------------------------------
# Sockets


def test_socket_grants() -> None:
    stream, dgram = {S.SOCK_STREAM: (0, S.IPPROTO_TCP)}, {S.SOCK_DGRAM: (0, S.IPPROTO_UDP)}
    assert S.socket_grants(NONE) == {}
    assert S.socket_grants(TCP) == {S.AF_INET: stream, S.AF_INET6: stream}
    assert S.socket_grants(Network(bind=(PortRange(8000, 8000),))) == S.socket_grants(TCP)
    assert S.socket_grants(UDP) == {S.AF_INET: dgram, S.AF_INET6: dgram}
    assert S.socket_grants(Network(connect=TCP.connect, udp=True))[S.AF_INET] == {**stream, **dgram}
    assert S.socket_grants(UNIX) == {S.AF_UNIX: {t: (0,) for t in range(16)}}


def allowed(rules: tuple[S.Rule, ...], family: int, kind: int, protocol: int = 0) -> bool:
    return verdict(rules, "socket", family, kind, protocol) is None


@pytest.mark.parametrize("network, inet_stream, inet_dgram, unix", [
    (NONE, False, False, False),
    (TCP, True, False, False),
    (UDP, False, True, False),
    (UNIX, False, False, True),
    (Network(connect=TCP.connect, udp=True, unix=True), True, True, True),
])
def test_socket_rules_per_network_setting(network: Network, inet_stream: bool, inet_dgram: bool,
                                          unix: bool) -> None:
    rules = rules_for(network)
    for family in (S.AF_INET, S.AF_INET6):
        assert allowed(rules, family, S.SOCK_STREAM) == inet_stream
        assert allowed(rules, family, S.SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK) == inet_stream
        assert allowed(rules, family, S.SOCK_STREAM, S.IPPROTO_TCP) == inet_stream
        assert allowed(rules, family, S.SOCK_DGRAM) == inet_dgram
        assert allowed(rules, family, S.SOCK_DGRAM, S.IPPROTO_UDP) == inet_dgram
        # never: raw sockets, SCTP, MPTCP (which Landlock's TCP rules do not cover), ICMP
        assert not allowed(rules, family, SOCK_RAW, IPPROTO_ICMP)
        assert not allowed(rules, family, S.SOCK_STREAM, IPPROTO_SCTP)
        assert not allowed(rules, family, S.SOCK_STREAM, IPPROTO_MPTCP)
        assert not allowed(rules, family, SOCK_SEQPACKET, IPPROTO_SCTP)
        assert not allowed(rules, family, S.SOCK_DGRAM, IPPROTO_ICMP)
    for kind in (S.SOCK_STREAM, S.SOCK_DGRAM, SOCK_SEQPACKET):
        assert allowed(rules, S.AF_UNIX, kind) == unix
    assert not allowed(rules, S.AF_UNIX, S.SOCK_STREAM, 1)
    for family in (AF_PACKET, AF_NETLINK, AF_BLUETOOTH, AF_VSOCK, AF_ALG, 0, 45, 46, 255):
        for kind in (S.SOCK_STREAM, S.SOCK_DGRAM, SOCK_RAW):
            assert not allowed(rules, family, kind), (family, kind)
    # socketpair makes only connected AF_UNIX pairs: always allowed, nothing else is
    assert allowed_pair(rules, S.AF_UNIX) and not allowed_pair(rules, S.AF_INET)


def allowed_pair(rules: tuple[S.Rule, ...], family: int) -> bool:
    return verdict(rules, "socketpair", family, S.SOCK_STREAM, 0) is None


ALL = Network(connect=TCP.connect, udp=True, unix=True)


def test_family_compares_use_the_low_32_bits() -> None:
    """Equality on the family uses MASKED_EQ 0xffffffff; the two range checks are
    unmasked: a ``>=`` can only refuse more (any high bit makes the value larger), and a
    ``<=`` below the first granted family refuses only values whose high bits are clear."""
    for network in (NONE, TCP, UDP, UNIX, ALL):
        granted = sorted(S.socket_grants(network))
        for rule in rules_for(network):
            if rule.syscall != "socket":
                continue
            for cmp in rule.args:
                if cmp.arg == 0:
                    assert (cmp.op, cmp.mask) == (S.MASKED_EQ, S.LOW32) or (
                        (cmp.op, cmp.value) == (S.GE, granted[-1] + 1)) or (
                        (cmp.op, cmp.value) == (S.LE, granted[0] - 1)), cmp
                elif cmp.arg == 2 and cmp.op != S.GT:
                    assert (cmp.op, cmp.mask) == (S.MASKED_EQ, S.LOW32), cmp
                elif cmp.arg == 1:
                    assert (cmp.op, cmp.mask) == (S.MASKED_EQ, S.SOCK_TYPE_MASK), cmp


def kernel_view_allows(grants: dict[int, dict[int, tuple[int, ...]]], family: int, kind: int,
                       protocol: int) -> bool:
    """What the policy means, seen the way the kernel reads int arguments (low 32 bits)."""
    family, kind, protocol = family & S.LOW32, kind & S.LOW32, protocol & S.LOW32
    return protocol in grants.get(family, {}).get(kind & S.SOCK_TYPE_MASK, ())


ARG = st.one_of(st.integers(0, 64), st.integers(0, U64),
                st.builds(lambda hi, lo: (hi << 32) | lo, st.integers(1, 0xFFFFFFFF),
                          st.sampled_from([1, 2, 6, 10, 17, 0])))


def test_socket_refusals_are_few() -> None:
    """Each comparison costs the filter's load on every run: with no socket granted,
    socket(2) is one refusal; with some, the families outside the granted ones' span are
    two ranges, not one rule each."""
    assert [r for r in rules_for(NONE) if r.syscall == "socket"] == [S.Rule("socket")]
    for network in (TCP, UNIX, ALL):
        granted = sorted(S.socket_grants(network))
        families = [r for r in rules_for(network) if r.syscall == "socket" and len(r.args) == 1]
        assert len(families) == 1 + (granted[0] > 0) + sum(
            f not in granted for f in range(granted[0], granted[-1] + 1))


@pytest.mark.parametrize("network", [NONE, TCP, UDP, UNIX, ALL],
                         ids=["none", "tcp", "udp", "unix", "all"])
@given(family=ARG, kind=st.one_of(ARG, st.sampled_from([1, 2, 1 | SOCK_CLOEXEC])),
       protocol=st.one_of(ARG, st.sampled_from([0, 6, 17])))
def test_no_socket_outside_the_grants(network: Network, family: int, kind: int,
                                      protocol: int) -> None:
    """Whatever the upper bits hold, the filter allows a socket only if the kernel
    would create one the policy grants."""
    rules = rules_for(network)
    if allowed(rules, family, kind, protocol):
        assert kernel_view_allows(S.socket_grants(network), family, kind, protocol)


@pytest.mark.parametrize("network", [NONE, TCP, UDP, UNIX], ids=["none", "tcp", "udp", "unix"])
def test_every_granted_socket_is_allowed(network: Network) -> None:
    rules = rules_for(network)
    for family, kinds in S.socket_grants(network).items():
        for kind, protocols in kinds.items():
            for protocol in protocols:
                assert allowed(rules, family, kind | SOCK_CLOEXEC, protocol)


# ---------------------------------------------------------------------------
# check_names and compile_bpf


def test_check_names_rejects_unknown_deny() -> None:
    policy = loads_policy('[syscalls]\ndeny = ["chmod", "notasyscall"]', source="p.toml")
    with pytest.raises(PolicyError, match=r"^p.toml: syscalls.deny: unknown syscall "
                                          r"'notasyscall' on \w+$"):
        S.check_names(policy)


def test_check_names_rejects_allow_outside_the_deny_list() -> None:
    policy = loads_policy('[syscalls]\nallow = ["ptrace", "read"]', source="p.toml")
    with pytest.raises(PolicyError) as info:
        S.check_names(policy)
    assert str(info.value).startswith("p.toml: syscalls.allow: 'read' is not denied by default, "
                                      "so allowing it changes nothing (default deny list: unshare,")


def test_check_names_accepts_valid_names() -> None:
    S.check_names(loads_policy('[syscalls]\ndeny = ["chmod", "fchmodat"]\n'
                               'allow = ["ptrace", "clone", "clone3", "ioctl", "personality"]'))


@pytest.mark.parametrize("network", [NONE, TCP, UDP, UNIX], ids=["none", "tcp", "udp", "unix"])
def test_compile_bpf(network: Network) -> None:
    program = S.compile_bpf(rules_for(network, deny=("chmod",)))
    assert len(program) % 8 == 0  # struct sock_filter is 8 bytes
    assert 8 * 20 < len(program) <= 8 * 4096  # BPF_MAXINSNS
    # the last instruction is a return (BPF_RET | BPF_K = 0x06)
    assert program[-8:][0] == 0x06


def test_compile_bpf_differs_with_the_plan() -> None:
    assert S.compile_bpf(rules_for(NONE)) != S.compile_bpf(rules_for(TCP))


def test_compile_bpf_skips_names_this_architecture_lacks() -> None:
    rules = rules_for() + (S.Rule("no_such_syscall_here"),)
    assert S.compile_bpf(rules) == S.compile_bpf(rules_for())


def test_bpf_for_compiles_once_per_process_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    rules = rules_for(UDP, deny=("sync",))
    first = S.bpf_for(rules)
    assert first == S.compile_bpf(rules)
    assert S.bpf_for(rules) is first
    assert list(tmp_path.iterdir()) == []  # no file a tool could write is read back


# ---------------------------------------------------------------------------
# No privilege plants, no keyring, no executable memfd

MODE_ROUTES = [("chmod", 1, ()), ("fchmod", 1, ()), ("fchmodat", 2, ()), ("fchmodat2", 2, ()),
               ("mknod", 1, ()), ("mknodat", 2, ()), ("creat", 1, ()),
               ("open", 2, ((1, os.O_CREAT),)), ("open", 2, ((1, os.O_TMPFILE),)),
               ("openat", 3, ((2, os.O_CREAT),)), ("openat", 3, ((2, os.O_TMPFILE),))]


def call_args(mode_index: int, mode: int, flags: tuple[tuple[int, int], ...]) -> list[int]:
    args = [0] * 6
    args[mode_index] = mode
    for index, value in flags:
        args[index] = value | os.O_WRONLY
    return args


@pytest.mark.parametrize("name, mode_index, flags", MODE_ROUTES)
@pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o6777, 0o104755, 0o4000 | (1 << 32)])
def test_set_id_modes_are_refused_on_every_route(name: str, mode_index: int,
                                                 flags: tuple[tuple[int, int], ...],
                                                 mode: int) -> None:
    for rules in (rules_for(), rules_for(allow=("ioctl", "clone", "memfd_create"))):
        assert verdict(rules, name, *call_args(mode_index, mode, flags)) == errno.EPERM


@pytest.mark.parametrize("name, mode_index, flags", MODE_ROUTES)
@pytest.mark.parametrize("mode", [0o755, 0o644, 0o1777, 0o600 | (0xFFFF << 32)])
def test_other_modes_stay_allowed(name: str, mode_index: int, flags: tuple[tuple[int, int], ...],
                                  mode: int) -> None:
    assert verdict(rules_for(), name, *call_args(mode_index, mode, flags)) is None


def test_open_without_create_ignores_the_mode_argument() -> None:
    """Without O_CREAT/O_TMPFILE the kernel ignores the mode: whatever the register holds."""
    rules = rules_for()
    assert verdict(rules, "open", 0, os.O_RDONLY, 0o6777) is None
    assert verdict(rules, "openat", 3, 0, os.O_RDWR | os.O_APPEND, 0o4755) is None


def test_openat2_answers_enosys() -> None:
    assert verdict(rules_for(), "openat2") == errno.ENOSYS


def test_plant_rules_test_one_bit_each() -> None:
    """A one-bit mask compares nothing in the upper half: garbage there cannot hide a bit."""
    for rule in rules_for():
        if rule.syscall in S.MODE_ARG or rule.syscall in S.OPEN_FLAGS_MODE:
            assert all(c.op == S.MASKED_EQ and c.mask == c.value and bin(c.mask).count("1") == 1
                       for c in rule.args), rule


@pytest.mark.parametrize("name", ["keyctl", "add_key", "request_key"])
def test_keyring_syscalls_can_never_be_allowed(name: str) -> None:
    policy = loads_policy(f'[syscalls]\nallow = ["ptrace", "{name}"]', source="p.toml")
    with pytest.raises(PolicyError) as info:
        S.check_names(policy)
    assert str(info.value) == (
        f"p.toml: syscalls.allow: {name!r} cannot be allowed: the key management syscalls "
        "(keyctl, add_key, request_key) reach the kernel keyring, where sandlock keeps the key "
        "that authenticates its cache")
    # the plan refuses them even when nobody checked the names first
    assert verdict(rules_for(allow=(name, "ptrace")), name) == errno.EPERM
    assert verdict(rules_for(allow=(name, "ptrace")), "ptrace") is None


@pytest.mark.parametrize("name", ["chmod", "fchmodat2", "openat", "openat2", "mknod"])
def test_plant_syscalls_can_never_be_allowed(name: str) -> None:
    policy = loads_policy(f'[syscalls]\nallow = ["{name}"]', source="p.toml")
    with pytest.raises(PolicyError, match=rf"^p.toml: syscalls.allow: '{name}' cannot be allowed: "
                                          "set-user-id and set-group-id modes are refused"):
        S.check_names(policy)


def test_memfd_create_must_seal_exec_unless_allowed() -> None:
    rules = rules_for()
    for flags in (0, 1, 2, 3, S.MFD_NOEXEC_SEAL << 32, 0x10, 0x10 | 1):
        assert verdict(rules, "memfd_create", 0, flags) == errno.ENOSYS, flags
    for flags in (S.MFD_NOEXEC_SEAL, S.MFD_NOEXEC_SEAL | 1 | 2, S.MFD_NOEXEC_SEAL | (7 << 32)):
        assert verdict(rules, "memfd_create", 0, flags) is None, flags
    assert verdict(rules_for(allow=("memfd_create",)), "memfd_create", 0, 0) is None
    S.check_names(loads_policy('[syscalls]\nallow = ["memfd_create"]'))


# ---------------------------------------------------------------------------
# The exported program


def test_a_program_cut_short_is_refused() -> None:
    program = S.compile_bpf(rules_for())
    S._check_program(program)
    # every cut but the one before the last instruction (libseccomp ends with two returns;
    # that cut is why the export avoids files, which RLIMIT_FSIZE can shorten)
    for size in [*range(0, len(program) - 8), *range(len(program) - 7, len(program))]:
        with pytest.raises(SeccompError, match="libseccomp exported a broken filter"):
            S._check_program(program[:size])
    with pytest.raises(SeccompError, match="more than the kernel's 4096"):
        S._check_program(program * (4097 * 8 // len(program) + 1))


def test_export_does_not_depend_on_the_file_size_limit() -> None:
    """RLIMIT_FSIZE cut the memfd libseccomp wrote to (issue 17): the pipe has no size limit."""
    import resource
    import signal

    reference = S.compile_bpf(rules_for(TCP))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))
            program = S.compile_bpf(rules_for(TCP))
            os.write(write_end, b"ok" if program == reference else b"differs")
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write_end, repr(exc).encode()[:500])
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    assert said == b"ok"


def test_fchmodat2_unknown_to_libseccomp_is_refused_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older libseccomp does not know fchmodat2: the rule must not be skipped."""
    if os.uname().machine not in S.NEWER_SYSCALLS["fchmodat2"]:
        pytest.skip(f"no fchmodat2 number for {os.uname().machine}")
    sc = S._pyseccomp()
    known = sc.resolve_syscall
    monkeypatch.setattr(sc, "resolve_syscall",
                        lambda arch, name: -1 if name == "fchmodat2" else known(arch, name))
    program = S.compile_bpf(rules_for())
    monkeypatch.undo()
    assert program != S.compile_bpf(rules_for())
    assert run_filtered(program, S.NEWER_SYSCALLS["fchmodat2"][os.uname().machine],
                        -100, b"/nonexistent\0", 0o644, 0) == errno.ENOSYS


def run_filtered(program: bytes, number: int, *args: int | bytes) -> int:
    """Load ``program`` in a forked child, make one syscall there; the errno it got (0: none)."""
    import ctypes

    from sandlock.linux import kernel

    pid = os.fork()
    if pid == 0:
        code = 255
        try:
            kernel.no_new_privs()
            prog, keep = kernel.make_fprog(program)
            kernel.load_seccomp(prog)
            libc = ctypes.CDLL(None, use_errno=True)
            result = libc.syscall(number, *[ctypes.c_char_p(a) if isinstance(a, bytes)
                                            else ctypes.c_long(a) for a in args])
            code = ctypes.get_errno() if result < 0 else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
