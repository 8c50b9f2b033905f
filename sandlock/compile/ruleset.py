"""Landlock rights for a policy on a given ABI, and the ruleset that carries them.

:func:`plan` is pure: it maps each policy path to the rights this ABI knows and
lists every protection the policy relies on that the ABI lacks (:class:`Gap`).
:func:`build` turns a plan into one ruleset fd (filesystem, TCP ports and scopes
together: a second layered ruleset would deny cross-directory rename and link).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import LandlockError
from ..linux import kernel
from ..linux.process import PER_USER_LIMIT
from ..policy.model import ACCEPTABLE_GAPS, Access, Policy
from . import abi as A
from . import grants

ENV_ABI = "SANDLOCK_ABI"


@dataclass(frozen=True)
class Gap:
    """A protection the policy relies on that this kernel (or this caller) cannot apply.

    ``needs`` says what would enforce it when that is not a Landlock ABI
    (``needs_abi`` 0). ``strict``: a strict-mode policy refuses to run with this gap,
    unless its ``accept`` names it (``name``, one of the policy model's ACCEPTABLE_GAPS;
    empty: only best-effort accepts it).
    """

    protection: str
    needs_abi: int
    consequence: str
    needs: str = ""
    strict: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if self.name and self.name not in ACCEPTABLE_GAPS:
            raise ValueError(f"gap name {self.name!r} is not in ACCEPTABLE_GAPS")

    def accepted_by(self, policy: Policy) -> bool:
        """Whether ``policy`` accepts this gap by name (``accept``)."""
        return bool(self.name) and self.name in policy.accept

    def __str__(self) -> str:
        needs = self.needs or f"Landlock ABI {self.needs_abi}"
        return f"{self.protection} (needs {needs}): {self.consequence}"


@dataclass(frozen=True)
class Substitute:
    """A protection this Landlock ABI lacks that sandlock enforces another way, without
    privilege or namespaces (docs/design.md "Substitutes for older Landlock ABIs")."""

    protection: str
    needs_abi: int
    how: str

    def __str__(self) -> str:
        return f"{self.protection} (Landlock ABI {self.needs_abi}+ enforces it): substitute: {self.how}"


#: How each substitute enforces its protection (what `explain` and `check` say).
TRUNCATE_HOW = ("seccomp: truncate(2) by path and open(2) with O_TRUNC without write access "
                "are refused (EPERM); ftruncate(2) on a descriptor opened for writing works")
SIGNAL_HOW = ("seccomp user notification: the supervisor lets a signal through only to a "
              "process of the tool's own session (setsid() refused inside the tool)")
IOCTL_HOW = ("seccomp: ioctl(2) is refused (EACCES) on every descriptor, devices or not, "
             "except the requests Landlock always allows on devices, pipe and socket queries "
             "and the terminal's settings and size (sandlock.compile.seccomp.IOCTL_ALWAYS)")


#: What is lost without each protection a substitute can stand in for (the gap's words
#: when neither Landlock nor the substitute holds it).
CONSEQUENCE = {
    "truncate restriction": "truncate(2) and O_TRUNC reach every file the tool can open",
    "device ioctl restriction": "ioctl(2) on granted devices is not restricted",
    "signal scope": "the tool can signal every process of the same user",
}
#: The name `accept` takes for a substitute's protection left a gap (policy.model.ACCEPTABLE_GAPS).
GAP_NAME = {"device ioctl restriction": "ioctl-dev", "signal scope": "signal-scope"}


def substitutes(policy: Policy, abi: int) -> tuple[Substitute, ...]:
    """Protections ``policy`` relies on that Landlock ABI ``abi`` lacks and that a
    substitute enforces instead (the kernel's support for the substitute itself is the
    compiler's check). None without Landlock at all: then nothing is confined anyway."""
    fs, out = A.fs_handled(abi), []
    if fs and not fs & A.Fs.TRUNCATE:
        out.append(Substitute("truncate restriction", A.fs_since(A.Fs.TRUNCATE), TRUNCATE_HOW))
    if fs and policy.scope.signals and not A.scopes_known(abi) & A.Scope.SIGNAL:
        out.append(Substitute("signal scope", A.SCOPE_SINCE, SIGNAL_HOW))
    # Every policy: whether its grants reach no device cannot be known from the mount
    # table (docs/design.md). An ``ioctl`` in [syscalls] allow lifts every ioctl refusal,
    # this one too: a gap then.
    if fs and not fs & A.Fs.IOCTL_DEV and "ioctl" not in policy.syscalls.allow:
        out.append(Substitute("device ioctl restriction", A.fs_since(A.Fs.IOCTL_DEV), IOCTL_HOW))
    return tuple(out)


def substituted(policy: Policy, abi: int, protection: str) -> bool:
    """Whether ``protection`` is enforced by a substitute for ``policy`` on ``abi``."""
    return any(s.protection == protection for s in substitutes(policy, abi))


@dataclass(frozen=True)
class Plan:
    """The Landlock ruleset of a policy for one ABI, and what it cannot enforce."""

    abi: int
    handled_fs: int
    handled_net: int
    scoped: int
    paths: tuple[tuple[str, int], ...]  #: (path, rights for a directory at that path)
    ports: tuple[tuple[int, int], ...]  #: (port, Net rights)
    gaps: tuple[Gap, ...]
    substitutes: tuple[Substitute, ...] = ()


def access_rights(access: Access, abi: int, *, sockets: bool) -> int:
    if access is Access.READ:
        return int(A.fs_read(abi))
    if access is Access.EXEC:
        return int(A.fs_exec(abi))
    return int(A.fs_write(abi, sockets=sockets))


def gaps(policy: Policy, abi: int) -> tuple[Gap, ...]:
    """Protections ``policy`` relies on that Landlock ABI ``abi`` cannot enforce."""
    out = []
    fs, net, scopes = A.fs_handled(abi), A.net_handled(abi), A.scopes_known(abi)
    if not fs:
        out.append(Gap("filesystem confinement", 1, f"Landlock is unavailable: {NO_LANDLOCK_REACH}"))
    # Without the truncate right (ABI 1-2) the seccomp substitute refuses truncation
    # (substitutes()): not a gap.
    if not net and policy.network.tcp:
        out.append(Gap("TCP port restriction", A.NET_SINCE,
                       "TCP connect/bind is possible to and on any port, not only the granted ones",
                       name="tcp-ports"))
    if not fs & A.Fs.IOCTL_DEV and not substituted(policy, abi, "device ioctl restriction"):
        out.append(Gap("device ioctl restriction", A.fs_since(A.Fs.IOCTL_DEV),
                       CONSEQUENCE["device ioctl restriction"],
                       name=GAP_NAME["device ioctl restriction"]))
    if not scopes & A.Scope.SIGNAL and policy.scope.signals \
            and not substituted(policy, abi, "signal scope"):
        out.append(Gap("signal scope", A.SCOPE_SINCE, CONSEQUENCE["signal scope"],
                       name=GAP_NAME["signal scope"]))
    if not scopes & A.Scope.ABSTRACT_UNIX_SOCKET and policy.scope.abstract_unix and policy.network.unix:
        out.append(Gap("abstract unix socket scope", A.SCOPE_SINCE,
                       "the tool can connect to abstract unix sockets outside the sandbox",
                       name="abstract-unix"))
    return tuple(out)


def process_gap(limit: Optional[int], cgroup_why: Optional[str], root: bool) -> Optional[Gap]:
    """The gap of ``[limits] processes = limit`` for a caller that can (``cgroup_why``
    None) or cannot (the reason) create a pids cgroup; ``root``: real uid 0, which
    RLIMIT_NPROC does not bind (kernel/fork.c: the INIT_USER exemption)."""
    if limit is None or cgroup_why is None:
        return None
    needs = f"a pids cgroup this caller can create; none here: {cgroup_why}"
    if root:
        return Gap(f"process limit (processes = {limit})", 0,
                   "RLIMIT_NPROC does not bind root: the tool can fork without limit "
                   "(a fork bomb can take the machine down)", needs, name="processes")
    return Gap(f"{PER_USER_LIMIT} (processes = {limit})", 0,
               "enforced with RLIMIT_NPROC instead, which counts every process of this user, "
               "not of the sandbox (the tool may fork only while this user has fewer than "
               f"{limit} processes in all)", needs, strict=False, name="processes")


def caller_gaps(policy: Policy) -> tuple[Gap, ...]:
    """Protections ``policy`` relies on that this caller cannot have enforced (not a
    matter of the Landlock ABI): a per-sandbox ``processes`` limit; and the signal scope
    when the policy itself switches it off."""
    out = []
    if not policy.scope.signals:
        # Not a shortfall of the kernel but the policy's own choice; still nothing may stop
        # the launcher (its timeout would never fire) or kill the caller unless that is
        # accepted knowingly: strict mode refuses, best-effort runs and reports it.
        out.append(Gap("signal scope", 0,
                       "the policy switches it off ([scope] signals = false): the tool can stop "
                       "or kill every process of this user, sandlock's launcher (whose timeout "
                       "then never fires) and the caller included",
                       "[scope] signals = true, or accept = [\"signal-scope\"] to accept this",
                       name="signal-scope"))
    limit = policy.limits.processes
    if limit is not None:
        from ..linux import cgroups

        base, why = cgroups.find()
        gap = process_gap(limit, None if base is not None else why, os.getuid() == 0)
        if gap is not None:
            out.append(gap)
    return tuple(out)


def plan(policy: Policy, abi: int) -> Plan:
    """Rights per path and port for ``policy`` on ``abi``: pure, testable for every ABI."""
    sockets = policy.network.unix
    merged: dict[str, int] = {}
    for rule in policy.paths:
        merged[rule.path] = merged.get(rule.path, 0) | access_rights(rule.access, abi, sockets=sockets)
    ports: dict[int, int] = {}
    net = A.net_handled(abi)
    for kind, ranges in ((A.Net.CONNECT_TCP, policy.network.connect),
                         (A.Net.BIND_TCP, policy.network.bind)):
        for span in ranges if kind & net else ():
            for port in range(span.low, span.high + 1):
                ports[port] = ports.get(port, 0) | int(kind)
    wanted = A.Scope(0)
    if policy.scope.signals:
        wanted |= A.Scope.SIGNAL
    if policy.scope.abstract_unix:
        wanted |= A.Scope.ABSTRACT_UNIX_SOCKET
    scoped = wanted & A.scopes_known(abi)
    return Plan(abi, int(A.fs_handled(abi)), int(A.net_handled(abi)), int(scoped),
                tuple(merged.items()), tuple(sorted(ports.items())), gaps(policy, abi),
                substitutes(policy, abi))


#: gVisor's ``uname -v`` (google/gvisor pkg/sentry/syscalls/linux/linux64.go,
#: _LINUX_VERSION): its user-space kernel implements no Landlock.
GVISOR_VERSION = "#1 SMP Sun Jan 10 15:06:54 PST 2016"
#: What a run without Landlock reaches: every file of the user, sandlock's own among them.
#: Only a Landlock ruleset keeps a tool off what a later run trusts (the write grants
#: :func:`sandlock.compile.grants.protected` refuses are grants of a ruleset): without
#: one the tool may rewrite sandlock's installation, the plans it caches and, where the
#: key is a file, read the key that authenticates them, so it persists across runs.
NO_LANDLOCK_REACH = ("every file the user can reach is reachable, including sandlock's own "
                     "code and state directory (~/.cache/sandlock: cached plans, key): a tool "
                     "can change what later runs do")
#: What to do without Landlock (the consequence of every message that says it is absent).
NO_LANDLOCK_ADVICE = ("run the tool in a VM or on a host whose kernel has Landlock (Linux 5.13+, "
                      "\"landlock\" in the lsm= boot parameter), or pass --best-effort to run it "
                      "without filesystem confinement on purpose")


def landlock_missing() -> str:
    """Why no Landlock ABI is in use here: ``SANDLOCK_ABI=0`` pretending, gVisor (recognised
    by its fixed ``uname -v``), or the kernel's answer to landlock_create_ruleset
    (https://docs.kernel.org/userspace-api/landlock.html: ENOSYS built without it,
    EOPNOTSUPP built but not enabled at boot)."""
    import errno

    real = kernel.landlock_abi()
    err = kernel.landlock_errno()  # right after the call that set it
    if real:
        return (f"{ENV_ABI}={os.environ.get(ENV_ABI, '0')} pretends a kernel without Landlock "
                f"(this kernel has Landlock ABI {real})")
    if GVISOR_VERSION in os.uname().version:
        return ("Landlock is not available in this kernel: this is gVisor (runsc), whose "
                "kernel implements no Landlock")
    why = {errno.ENOSYS: "the kernel was built without it (CONFIG_SECURITY_LANDLOCK)",
           errno.EOPNOTSUPP: "it is built in but not enabled at boot (lsm=)"}.get(
        err, os.strerror(err) if err else "landlock_create_ruleset is unknown on this architecture")
    return f"Landlock is not available in this kernel: {why}"


def detect_abi() -> int:
    """The kernel's Landlock ABI, lowered by ``SANDLOCK_ABI`` to pretend an older kernel."""
    real = kernel.landlock_abi()
    wanted = os.environ.get(ENV_ABI)
    if wanted:
        try:
            pretend = int(wanted)
        except ValueError:
            raise LandlockError(f"{ENV_ABI}={wanted!r} is not an integer") from None
        if pretend > real:
            raise LandlockError(f"{ENV_ABI}={pretend} but this kernel only has Landlock ABI {real}")
        return max(pretend, 0)
    return real


def build(p: Plan, policy_files: tuple[str, ...] = ()) -> int:
    """Create the ruleset fd for ``p`` (close-on-exec). Paths are resolved here, in the
    parent, to the descriptors the rules are made from, so the child only has to call
    landlock_restrict_self; ``policy_files`` are the files the policy was read from,
    which no write grant may reach (:mod:`sandlock.compile.grants`).

    The work is :func:`sandlock.compile.grants.build_ruleset`, which takes plain values so
    that the cached run path (:mod:`sandlock.compile.cache`) shares it without importing
    this module and the policy model."""
    return grants.build_ruleset(p.abi, p.handled_fs, p.handled_net, p.scoped, p.paths, p.ports,
                                int(A.FILE_ONLY), int(A.WRITE_RIGHTS), policy_files)


def policy_files(policy: Policy) -> tuple[str, ...]:
    """The files ``policy`` was read from (built-in profiles and texts excluded)."""
    # A tool of a registry file is "FILE [tools.NAME]": the file is what a tool could change.
    return tuple(s.split(" [tools.", 1)[0] for s in policy.layers if s and not s.startswith("<"))
