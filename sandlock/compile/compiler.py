"""From a validated policy to a :class:`Compiled` one: what the kernel is given.

:func:`compile_policy` checks that this kernel and this caller can enforce the policy
(or that the policy accepts the gaps: best-effort), builds the Landlock ruleset from
grant descriptors (:mod:`.grants`, :mod:`.ruleset`), the seccomp BPF (:mod:`.seccomp`)
and the rlimits. A :class:`Compiled` is reusable for any number of runs, by any
executor (:mod:`sandlock.exec`); :func:`sandlock.exec.spec.child_steps` turns it into
a child's steps.
"""

from __future__ import annotations

import os
import resource

from ..errors import KernelSupportError
from ..linux import cgroups, kernel

# On `sandlock run`'s per-call path (the cache rebuilds a Compiled): nothing heavy here.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Mapping, Optional, Protocol, Sequence

    from ..policy.model import Limits, Network, Policy
    from . import ruleset

    class Routes(Protocol):
        """What compiling needs of a credential route server (:mod:`sandlock.net.routes`,
        a layer above, which is not imported): the port it listens on, and stopping it."""

        @property
        def port(self) -> int: ...

        def stop(self) -> None: ...


#: Compiled(cgroup=DISCOVER): look for a pids cgroup base now (cgroups.find).
DISCOVER = "discover"


def process_limit(rlimits: Sequence[tuple[int, int]]) -> Optional[int]:
    """The ``processes`` limit carried by a compiled policy's rlimits, or None."""
    for res, value in rlimits:
        if res == resource.RLIMIT_NPROC:
            return value
    return None


class Compiled:
    """A policy made ready for the kernel; reusable for any number of launches.

    The ruleset fd may be shared by many children: landlock_restrict_self only
    reads it. Close it with :meth:`close` when done. (A plain class, not a
    dataclass: importing dataclasses costs more than the whole cached run.)

    ``rlimits`` are the policy's (RLIMIT_NPROC for ``processes`` included). When
    ``processes`` is set and this caller can create pids cgroups, ``cgroup`` is where
    each run's group is made (then RLIMIT_NPROC is not applied: the group counts the
    sandbox, the rlimit the whole user); the attribute exists only then.
    """

    cgroup: Optional[cgroups.Base] = None
    #: The route server of a policy with ``[credentials]`` (:class:`sandlock.net.routes.Routes`),
    #: listening on the port this Compiled grants; None without credentials. An instance
    #: attribute only when set (the compiled-policy cache never holds one).
    routes: Optional[Routes] = None
    #: Each run needs the signal gate (:mod:`sandlock.linux.signalgate`), the substitute
    #: for Landlock's signal scope below ABI 6 (an instance attribute only then).
    signal_gate = False

    #: The run's facts besides the kernel's (the one place every executor reads them; exec/
    #: never reads the policy): where the policy came from, for messages; the environment
    #: spec (:func:`sandlock.policy.environment.build`: names passed, then pairs set); the
    #: wall-clock limit in seconds; the policy's ``[network]`` when it has a host allowlist
    #: (the proxy and connect gate read it, :mod:`sandlock.net.connect`), else None.
    source = ""
    env_passed: tuple[str, ...] = ()
    env_set: tuple[tuple[str, str], ...] = ()
    timeout: Optional[float] = None
    network: Optional[Network] = None
    #: The Landlock plan the ruleset was built from (what the compiled-policy cache stores;
    #: None when the plan was itself read back from it, or sent to a fork server).
    landlock: Optional[ruleset.Plan] = None
    #: A plan read back from the cache has no policy: the bytes of the file ``source``
    #: names that the cache's key was computed from, set by :mod:`sandlock.cli.launch`
    #: (an instance attribute only then; see :meth:`policy_bytes`).
    source_bytes: Optional[bytes] = None

    def __init__(self, policy: Optional[Policy], abi: int, gaps: tuple[ruleset.Gap, ...],
                 ruleset_fd: int, bpf: bytes, rlimits: tuple[tuple[int, int], ...],
                 cgroup: Optional[cgroups.Base] | str = DISCOVER, *,
                 signal_gate: bool = False) -> None:
        #: The policy compiled (None when read back from the cache): for the API and the
        #: probe, which judge against it; exec/ reads only the facts above.
        self.policy = policy
        if policy is not None:
            self.source = policy.source
            self.env_passed, self.env_set = tuple(policy.env.passed), tuple(policy.env.set)
            self.timeout = policy.limits.timeout
            if policy.network.allow:
                self.network = policy.network
        self.abi = abi
        self.gaps = gaps
        self.ruleset_fd = ruleset_fd
        self.bpf = bpf
        self.rlimits = rlimits
        self._fprog, self._keep = kernel.make_fprog(bpf)
        if signal_gate:
            self.signal_gate = True
        if process_limit(rlimits) is not None:
            self.cgroup = cgroups.find()[0] if cgroup == DISCOVER else cgroup  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Compiled(policy={self.source!r}, abi={self.abi}, gaps={self.gaps!r}, "
                f"ruleset_fd={self.ruleset_fd}, bpf=<{len(self.bpf) // 8} insns>, "
                f"rlimits={self.rlimits!r})")

    @property
    def warnings(self) -> list[str]:
        """One line per protection not enforced for this caller on this kernel (in strict
        mode only those a strict policy accepts: a per-user process limit, and the gaps its
        ``accept`` names, each said to be accepted)."""
        # A cached entry's gaps are its lines already, its policy accepts nothing (uncacheable).
        accepted = getattr(self.policy, "accept", ())
        return [f"{gap} [accepted: {gap.name}]" if getattr(gap, "name", "") in accepted
                else str(gap) for gap in self.gaps]

    def policy_bytes(self) -> Optional[bytes]:
        """The policy's own bytes (the file ``source`` names; not what it extends) exactly
        as compiled into this plan, for the run log's ``policy_sha256``; None for a policy
        given as a dict. Never the file read again: it may have been replaced since."""
        if self.policy is None:
            return self.source_bytes
        text = self.policy.own_text()
        return None if text is None else text.encode("utf-8")

    def run_group_limit(self) -> Optional[int]:
        """``pids.max`` of the pids cgroup each run of this policy gets, or None when runs
        get none (no ``processes`` limit, or no cgroup this caller can create). Every
        executor decides by this whether the child's first step is joining a group."""
        if self.cgroup is None:
            return None
        return process_limit(self.rlimits)

    def child_rlimits(self, in_group: bool) -> tuple[tuple[int, int], ...]:
        """What the child sets: RLIMIT_NPROC only when it is not in a pids cgroup."""
        if not in_group:
            return self.rlimits
        return tuple(pair for pair in self.rlimits if pair[0] != resource.RLIMIT_NPROC)

    def environment(self, caller: Mapping[str, str]) -> dict[str, str]:
        """The tool's whole environment from the caller's (the one filter:
        :func:`sandlock.policy.environment.build`)."""
        from ..policy import environment

        return environment.build(self.env_passed, self.env_set, caller)

    def close(self) -> None:
        if self.ruleset_fd >= 0:
            os.close(self.ruleset_fd)
            self.ruleset_fd = -1

    def __enter__(self) -> "Compiled":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rlimits_for(limits: Limits) -> tuple[tuple[int, int], ...]:
    """(resource, value) pairs; core dumps are always off."""
    pairs = [(resource.RLIMIT_CORE, 0)]
    for value, res in ((limits.cpu, resource.RLIMIT_CPU), (limits.memory, resource.RLIMIT_AS),
                       (limits.processes, resource.RLIMIT_NPROC),
                       (limits.open_files, resource.RLIMIT_NOFILE),
                       (limits.file_size, resource.RLIMIT_FSIZE)):
        if value is not None:
            pairs.append((res, value))
    return tuple(pairs)


def clamp_to_hard_limits(pairs: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Never ask for more than the caller's hard limit: a policy can only lower a limit.

    An unprivileged setrlimit above the hard limit fails with EPERM, which would make
    a generous policy unusable under a stricter caller; and with CAP_SYS_RESOURCE it
    would raise the caller's limit, which a sandbox must not do.
    """
    out = []
    for res, value in pairs:
        hard = resource.getrlimit(res)[1]
        out.append((res, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return tuple(out)


def _accept_hint(gap: ruleset.Gap) -> str:
    """How to accept ``gap`` alone (its name), or nothing when only best-effort can."""
    return f" [accept: {gap.name}]" if gap.name else ""


def strict_failure(policy: Policy, abi: int, gaps: Sequence[ruleset.Gap]) -> KernelSupportError:
    lines = "\n".join(f"  - {gap}{_accept_hint(gap)}" for gap in gaps)
    return KernelSupportError(
        f"this kernel (Landlock ABI {abi}) cannot enforce what {policy.source} relies on:\n{lines}\n"
        "Refusing to run. Use a newer kernel, remove the grant that needs it, accept one gap by "
        "its name with --accept NAME (or accept = [\"NAME\"] in the policy), or every gap with "
        "--best-effort (or compat = \"best-effort\")."
    )


def process_failure(policy: Policy, gap: ruleset.Gap) -> KernelSupportError:
    if gap.protection == "signal scope":
        return KernelSupportError(
            f"{policy.source}: {gap}.\nRefusing to run. Keep [scope] signals = true, or accept "
            "this with --accept signal-scope (or accept = [\"signal-scope\"]) or --best-effort.")
    return KernelSupportError(
        f"{policy.source}: cannot enforce the {gap}.\n"
        "Refusing to run. Give sandlock a pids cgroup it can create children in (root with a "
        "writable cgroup hierarchy with the pids controller, or a delegated cgroup subtree), "
        "run as an ordinary user (RLIMIT_NPROC then binds, per user), remove `processes` from "
        "the policy, or accept the gap with --accept processes (or accept = [\"processes\"]) or "
        "--best-effort."
    )


#: Descriptors compiling needs at once beside the caller's: libseccomp's lookup runs
#: ``ldconfig -p`` through a pipe, the ruleset and each grant hold one while building.
SPARE_FDS = 8


def process_shortage() -> str:
    """Why a fork failed with EAGAIN: the caller's RLIMIT_NPROC (ENOMEM reads otherwise)."""
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    return (f"cannot start a process: RLIMIT_NPROC (ulimit -u) is {soft} and this user has "
            "reached it; raise it or end some of the user's processes")


def caller_shortage() -> Optional[str]:
    """What the caller has run out of, if anything: descriptors (RLIMIT_NOFILE) or
    processes (RLIMIT_NPROC). Asked only once compiling failed, so that a shortage is
    named as such, never as a missing library or a bad policy."""
    import errno

    held: list[int] = []
    try:
        for _ in range(SPARE_FDS):
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            return (f"too few file descriptors: RLIMIT_NOFILE (ulimit -n) is {soft} with "
                    f"{soft - len(held)} in use, and sandlock needs {SPARE_FDS} free; raise "
                    "it or close descriptors")
    finally:
        for fd in held:
            os.close(fd)
    try:  # vfork + exec: nothing of the caller is copied
        pid = os.posix_spawn("/bin/true", ["true"], {})
    except OSError as exc:
        return process_shortage() if exc.errno == errno.EAGAIN else None
    os.waitpid(pid, 0)
    return None


def compile_policy(policy: Policy, routes: Optional[Routes] = None, *,
                   sockets_recorded: bool = False) -> Compiled:
    """Check kernel support, build the Landlock ruleset and the seccomp BPF.

    A policy with ``[credentials]`` needs ``routes`` (:func:`_compile_routed`).
    ``sockets_recorded``: for `sandlock trace` only, whose recorder then answers socket(2)
    (:func:`sandlock.compile.seccomp.plan`).
    A caller out of descriptors or processes gets a SetupError that says so (libseccomp's
    lookup, the ruleset and the grants fail in ways that would read as something else)."""
    from ..errors import SandlockError, SetupError

    try:
        return _compile_routed(policy, routes, sockets_recorded)
    except (OSError, SandlockError) as exc:
        why = caller_shortage()
        if why is None:
            raise
        raise SetupError(f"cannot compile {policy.source}: {why}") from exc


def _compile_routed(policy: Policy, routes: Optional[Routes], sockets_recorded: bool = False
                    ) -> Compiled:
    """A policy with ``[credentials]`` is compiled with its route server already listening
    (``routes``, :func:`sandlock.net.routes.prepare`): its grants
    (:func:`sandlock.policy.credentials.effective`) are added here, before the ruleset
    and the filter are built, for every executor alike; the Compiled carries the routes."""
    if not getattr(policy, "credentials", ()):
        return _compile(policy, sockets_recorded)
    if routes is None:
        from ..errors import SetupError

        raise SetupError(f"{policy.source}: [credentials] needs its route server listening "
                         "before the policy is compiled (sandlock.net.routes.prepare)")
    from ..policy.model import effective

    compiled = _compile(effective(policy, routes.port), sockets_recorded)
    compiled.routes = routes
    return compiled


#: What each substitute needs of the kernel beyond Landlock: (feature, the first Linux
#: release that has it). Every one is older than Landlock (5.13), but a container's seccomp
#: profile (or a kernel built without it) can still take one away, so each is asked of the
#: running kernel (:func:`kernel_lacks`), never read from its version number alone.
SUBSTITUTE_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    # seccomp(2) filters (3.5 for SECCOMP_RET_ERRNO); _compile refuses without them at all.
    "truncate restriction": (("seccomp filters returning an errno", "3.5"),),
    "device ioctl restriction": (("seccomp filters returning an errno", "3.5"),),
    # The signal gate (sandlock.linux.signalgate).
    "signal scope": (("seccomp user notification", "5.0"),
                     ("pidfd_send_signal(2)", "5.1"),
                     ("pidfd_open(2)", "5.3"),
                     ("the pidfd fdinfo Pid: line", "5.3"),
                     ("SECCOMP_USER_NOTIF_FLAG_CONTINUE", "5.5")),
}


def _release(text: str) -> tuple[int, int]:
    """(major, minor) of a kernel release string such as ``6.8.0-45-generic``."""
    parts = text.split(".", 2)
    try:
        return int(parts[0]), int("".join(c for c in parts[1][:3] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


def _pidfd_checks() -> dict[str, bool]:
    """pidfd_open, pidfd_send_signal (signal 0: nothing is sent) and the fdinfo Pid: line,
    tried on this process."""
    import signal

    out = {"pidfd_open(2)": False, "pidfd_send_signal(2)": False, "the pidfd fdinfo Pid: line": False}
    try:
        fd = os.pidfd_open(os.getpid())
    except (OSError, AttributeError):
        return out
    out["pidfd_open(2)"] = True
    try:
        try:
            signal.pidfd_send_signal(fd, 0)
            out["pidfd_send_signal(2)"] = True
        except OSError:
            pass
        try:
            with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
                out["the pidfd fdinfo Pid: line"] = f"Pid:\t{os.getpid()}".encode() in info.read()
        except OSError:
            pass
    finally:
        os.close(fd)
    return out


_HAVE: dict[str, bool] = {}


def kernel_has(feature: str) -> bool:
    """Whether the running kernel (as this process sees it) has ``feature`` of
    :data:`SUBSTITUTE_NEEDS`; asked once per process."""
    if not _HAVE:
        _HAVE["seccomp filters returning an errno"] = \
            kernel.seccomp_action_available(kernel.SECCOMP_RET_ERRNO)
        _HAVE["seccomp user notification"] = \
            kernel.seccomp_action_available(kernel.SECCOMP_RET_USER_NOTIF)
        _HAVE.update(_pidfd_checks())
        # A flag of the notification reply: only a reply to a real notification would show
        # it, so the release number stands in (no kernel with Landlock predates it).
        _HAVE["SECCOMP_USER_NOTIF_FLAG_CONTINUE"] = _release(os.uname().release) >= (5, 5)
    return _HAVE.get(feature, False)


def kernel_lacks(protection: str, has: Optional[Callable[[str], bool]] = None) -> Optional[str]:
    """Why the substitute for ``protection`` cannot run on this kernel (naming the feature
    and the Linux release that brought it), or None. ``has``: the detection
    (:func:`kernel_has` by default)."""
    has = has or kernel_has
    missing = [f"{feature} (Linux {release}+)" for feature, release in SUBSTITUTE_NEEDS.get(protection, ())
               if not has(feature)]
    if not missing:
        return None
    return (f"this kernel lacks {', '.join(missing)}: a kernel older than that, or a container's "
            "seccomp profile refusing it")


def enforced(plan: ruleset.Plan, has: Optional[Callable[[str], bool]] = None
             ) -> tuple[tuple[ruleset.Gap, ...], tuple[ruleset.Substitute, ...]]:
    """The plan's gaps and substitutes once this kernel's support for each substitute is
    known (:data:`SUBSTITUTE_NEEDS`; the signal gate also its architecture): a substitute
    the kernel cannot run leaves its protection a gap after all, which strict mode refuses
    naming what is missing. What `sandlock run` enforces and what `explain` says."""
    from . import abi as A
    from . import ruleset

    gaps, kept = plan.gaps, []
    if not A.fs_handled(plan.abi):  # no Landlock at all: say why, and what to do
        gaps = tuple(ruleset.Gap(g.protection, g.needs_abi, f"{ruleset.landlock_missing()}: "
                                 f"{ruleset.NO_LANDLOCK_REACH}; {ruleset.NO_LANDLOCK_ADVICE}")
                     if g.protection == "filesystem confinement" else g for g in gaps)
    for sub in plan.substitutes:
        why_not = kernel_lacks(sub.protection, has)
        if why_not is None and sub.protection == "signal scope":
            from ..linux import signalgate

            why_not = signalgate.supported()
        if why_not is None:
            kept.append(sub)
            continue
        gaps += (ruleset.Gap(sub.protection, sub.needs_abi, ruleset.CONSEQUENCE[sub.protection],
                             f"Landlock ABI {sub.needs_abi}, or its substitute: {why_not}",
                             name=ruleset.GAP_NAME.get(sub.protection, "")),)
    return gaps, tuple(kept)


def _compile(policy: Policy, sockets_recorded: bool = False) -> Compiled:
    from ..policy.model import Compat, check_limits
    from . import ruleset, seccomp

    check_limits(policy)
    why = kernel.seccomp_supported()
    if why:
        raise KernelSupportError(f"seccomp filters are unavailable: {why}")
    abi = ruleset.detect_abi()
    plan = ruleset.plan(policy, abi)
    gaps, substitutes = enforced(plan)
    gate = any(s.protection == "signal scope" for s in substitutes)
    strict = policy.compat is Compat.STRICT
    refused = [gap for gap in gaps if not gap.accepted_by(policy)]
    if refused and strict:
        raise strict_failure(policy, abi, refused)
    caller = ruleset.caller_gaps(policy)
    refused = [gap for gap in caller if gap.strict and not gap.accepted_by(policy)]
    if refused and strict:
        raise process_failure(policy, refused[0])
    if policy.syscalls.allow or policy.syscalls.deny:
        seccomp.check_names(policy)
    bpf = seccomp.bpf_for(seccomp.plan(policy, abi, sockets_recorded=sockets_recorded))
    fd = build_rules(policy, plan)
    rlimits = clamp_to_hard_limits(rlimits_for(policy.limits))
    compiled = Compiled(policy, abi, gaps + caller, fd, bpf, rlimits, signal_gate=gate)
    compiled.landlock = plan
    return compiled


def build_rules(policy: Policy, plan: ruleset.Plan) -> int:
    """The ruleset fd for ``plan``; a grant refused by :mod:`sandlock.compile.grants` becomes a
    PolicyError naming the policy line it came from."""
    from ..errors import PolicyError
    from . import ruleset
    from .grants import GrantError

    try:
        return ruleset.build(plan, ruleset.policy_files(policy))
    except GrantError as exc:
        origin = next((r.origin for r in policy.paths if r.path == exc.path), policy.source)
        where, _, key = origin.partition(" ")
        raise PolicyError(f"{exc.path!r}: {exc.reason}", source=where, key=key) from None


# ----------------------------------------------------------------------------
# The command
