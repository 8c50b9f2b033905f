"""Reports for `sandlock check` and `sandlock explain`: plain data, printed by the CLI."""

from __future__ import annotations

import os
from typing import Any

from ..linux import kernel
from ..policy.model import Policy, cautions
from . import abi as A
from . import ruleset, seccomp

_RIGHT_DOCS = {
    A.Fs.REFER: "rename/link across directories",
    A.Fs.TRUNCATE: "truncate restriction",
    A.Fs.IOCTL_DEV: "device ioctl restriction",
}


def _userns() -> tuple[bool, str]:
    for path in ("/proc/sys/kernel/unprivileged_userns_clone",
                 "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"):
        try:
            with open(path) as handle:
                value = handle.read().strip()
        except OSError:
            continue
        if path.endswith("unprivileged_userns_clone") and value == "0":
            return False, f"{path} = 0"
        if path.endswith("restrict_unprivileged_userns") and value == "1":
            return False, f"{path} = 1 (AppArmor)"
    try:
        with open("/proc/sys/user/max_user_namespaces") as handle:
            if handle.read().strip() == "0":
                return False, "user.max_user_namespaces = 0"
    except OSError:
        pass
    return True, "not needed by sandlock; reported for comparison with namespace sandboxes"


def _host_allowlist() -> dict[str, Any]:
    """Whether ``[network] allow`` can run here (its gate makes the tool's TCP sockets and
    installs them with SECCOMP_IOCTL_NOTIF_ADDFD; probed, not read from the version)."""
    from ..linux.notify import gate_unsupported

    why = gate_unsupported()
    return {"feature": "host allowlist ([network] allow)", "available": why is None,
            "detail": why or "connect gate: seccomp notification + ADDFD (Linux 5.14+)"}


def kernel_report() -> dict[str, Any]:
    real = kernel.landlock_abi()
    used = ruleset.detect_abi()
    features = _landlock_rows(real, used)
    newer = A.newer_than_known(real)
    if newer:  # rights a newer kernel added are neither handled nor denied: say so
        features.append({"feature": f"Landlock ABI {real} (newer than sandlock knows)",
                         "available": False, "detail": newer})
    for right in (A.Fs.REFER, A.Fs.TRUNCATE, A.Fs.IOCTL_DEV):
        features.append({"feature": f"Landlock {right.name} ({_RIGHT_DOCS[right]})",
                         "available": bool(A.fs_handled(used) & right),
                         "detail": f"ABI {A.fs_since(right)}+"})
    features += [
        {"feature": "Landlock TCP bind/connect rules", "available": bool(A.net_handled(used)),
         "detail": f"ABI {A.NET_SINCE}+"},
        {"feature": "Landlock scopes (signals, abstract unix sockets)",
         "available": bool(A.scopes_known(used)), "detail": f"ABI {A.SCOPE_SINCE}+"},
        {"feature": "Landlock audit logging", "available": A.audit_flags(used),
         "detail": f"ABI {A.AUDIT_SINCE}+"},
    ]
    why = kernel.seccomp_supported()
    features.append({"feature": "seccomp filters", "available": why is None, "detail": why or "yes"})
    notif = why is None and kernel.seccomp_action_available(kernel.SECCOMP_RET_USER_NOTIF)
    features.append({"feature": "seccomp user notification", "available": notif,
                     "detail": "SECCOMP_RET_USER_NOTIF" if notif else _no_notify(why)})
    features.append(_host_allowlist())
    from ..linux import signalgate

    truncate = bool(A.fs_handled(used) & A.Fs.TRUNCATE)
    features.append({"feature": "truncate restriction", "available": why is None or truncate,
                     "detail": "Landlock" if truncate else f"substitute: {ruleset.TRUNCATE_HOW}"})
    ioctl = bool(A.fs_handled(used) & A.Fs.IOCTL_DEV)
    features.append({"feature": "device ioctl restriction", "available": why is None or ioctl,
                     "detail": "Landlock" if ioctl else
                     f"substitute (every policy): {ruleset.IOCTL_HOW}"})
    from .compiler import kernel_lacks

    scoped = bool(A.scopes_known(used) & A.Scope.SIGNAL)
    gate_why = signalgate.supported() or kernel_lacks("signal scope")
    features.append({"feature": "signal scope", "available": scoped or gate_why is None,
                     "detail": "Landlock" if scoped else f"substitute: {ruleset.SIGNAL_HOW}"
                     if gate_why is None else f"not enforced: {gate_why}"})
    from ..linux import cgroups

    base, why = cgroups.find()
    features.append({"feature": "per-sandbox process limit (pids cgroup, [limits] processes)",
                     "available": base is not None,
                     "detail": f"cgroup v{base.version} below {base.path}" if base is not None
                     else f"{why}; RLIMIT_NPROC instead: per user, and not binding root"
                     if os.getuid() != 0 else f"{why}; RLIMIT_NPROC does not bind root: "
                     "`processes` cannot be enforced for this caller"})
    features.append(_nproc_row())
    from . import cachekey
    from .cache import open_private_dir

    key, where = cachekey.secret(open_private_dir)
    features.append({"feature": "compiled-policy cache (authenticated entries)",
                     "available": key is not None,
                     "detail": f"keyed BLAKE2b, key in {where}" if key is not None
                     else "off, every run parses its policy (slower, equally safe): " + where})
    userns, detail = _userns()
    features.append({"feature": "unprivileged user namespaces", "available": userns, "detail": detail})
    from ..policy.model import ACCEPTABLE_GAPS

    return {"kernel": os.uname().release, "landlock_abi": real, "abi_in_use": used,
            "features": features,
            "gap_names": [{"name": name, "gives_up": what} for name, what in ACCEPTABLE_GAPS.items()]}


def _landlock_rows(real: int, used: int) -> list[dict[str, Any]]:
    """The Landlock row, with the real cause when there is none (gVisor, not built, not
    enabled at boot), and a row when SANDLOCK_ABI pretends an older kernel."""
    rows: list[dict[str, Any]] = [{
        "feature": "Landlock", "available": bool(A.fs_handled(real)),
        "detail": f"ABI {real}" if real
        else f"{ruleset.landlock_missing()}; {ruleset.NO_LANDLOCK_ADVICE}"}]
    if used != real:
        rows.append({"feature": "Landlock ABI in use", "available": bool(A.fs_handled(used)),
                     "detail": f"ABI {used}: {ruleset.ENV_ABI}={os.environ.get(ruleset.ENV_ABI)} "
                     "pretends an older kernel"
                     if used else f"{ruleset.landlock_missing()}; {ruleset.NO_LANDLOCK_ADVICE}"})
    return rows


def _no_notify(seccomp_why: str | None) -> str:
    """Why seccomp user notification is missing, and what goes without it."""
    cause = (f"seccomp is unavailable ({seccomp_why})" if seccomp_why else
             "seccomp(SECCOMP_GET_ACTION_AVAIL) refuses SECCOMP_RET_USER_NOTIF (Linux 5.0+; "
             "a container's seccomp profile may refuse it)")
    return (f"{cause}: without it the signal-scope substitute below ABI 6 and [network] allow "
            "(host rules) cannot be enforced")


def _nproc_row() -> dict[str, Any]:
    """RLIMIT_NPROC against the threads this user already has (the kernel counts tasks
    per real uid; https://man7.org/linux/man-pages/man2/getrlimit.2.html): a user at
    its limit cannot start a tool at all. Root is not bound by it."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    feature = "processes this user may start (RLIMIT_NPROC, ulimit -u)"
    if os.getuid() == 0:
        return {"feature": feature, "available": True,
                "detail": "root: RLIMIT_NPROC does not bind (only a pids cgroup limits it)"}
    if soft == resource.RLIM_INFINITY:
        return {"feature": feature, "available": True, "detail": "unlimited"}
    have = _user_tasks(os.getuid())
    if have >= soft:
        from .compiler import process_shortage

        return {"feature": feature, "available": False,
                "detail": f"{process_shortage()} ({have} tasks counted)"}
    return {"feature": feature, "available": True,
            "detail": f"{soft - have} more (limit {soft}, this user has {have} tasks)"}


def _user_tasks(uid: int) -> int:
    """Threads whose real uid is ``uid`` (what RLIMIT_NPROC counts), from /proc."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as handle:
                status = handle.read()
        except OSError:
            continue
        uids = next((line.split()[1:2] for line in status.splitlines()
                     if line.startswith("Uid:")), [])
        threads = next((line.split()[1:2] for line in status.splitlines()
                        if line.startswith("Threads:")), ["1"])
        if uids == [str(uid)]:
            count += int(threads[0]) if threads[0].isdigit() else 1
    return count


#: How `explain` shows the port a credential route gets when a run starts: an address of
#: the host allowlist, which the connect gate decides (policy.model.effective).
ROUTE_ALLOW = "127.0.0.1:the credential route's port (chosen when the run starts)"


def explain_policy(policy: Policy) -> dict[str, Any]:
    abi = ruleset.detect_abi()
    # What runs is compiled from: the grants credential routes add included (with a
    # stand-in port: the real one is chosen per run), so the filter and gaps shown are
    # those of `sandlock run`.
    run = policy
    if policy.credentials:
        from ..policy.model import effective

        run = effective(policy, 1)
    plan = seccomp.plan(run, abi)
    denied = sorted({rule.syscall for rule in plan if not rule.args and rule.syscall != "clone3"})
    limits = {k: v for k, v in vars(policy.limits).items() if v is not None}
    from .compiler import enforced

    landlock_gaps, substitutes = enforced(ruleset.plan(run, abi))
    gaps = (*landlock_gaps, *ruleset.caller_gaps(run))
    return {
        "source": policy.source,
        "description": policy.description,
        "layers": list(policy.layers),
        "compat": policy.compat.value,
        "accept": list(policy.accept),
        "abi": abi,
        "paths": [{"access": r.access.value, "path": r.path, "optional": r.optional,
                   "origin": r.origin} for r in policy.paths],
        "network": {"connect": [str(p) for p in policy.network.connect],
                    "bind": [str(p) for p in policy.network.bind],
                    "udp": policy.network.udp, "unix": policy.network.unix,
                    "allow": [rule.text for rule in policy.network.allow]
                    + ([ROUTE_ALLOW] if run.network.allow != policy.network.allow else []),
                    "deny": [rule.text for rule in policy.network.deny],
                    "hosts": dict(policy.network.hosts)},
        "scope": {"signals": policy.scope.signals, "abstract_unix": policy.scope.abstract_unix},
        "env": {"pass": list(policy.env.passed), "set": dict(policy.env.set)},
        "limits": limits,
        "seccomp": {"rules": len(plan), "denied": denied,
                    "conditional": sorted({rule.syscall for rule in plan if rule.args}
                                          | ({"clone3"} if any(r.syscall == "clone3" for r in plan)
                                             else set()))},
        "protections": _protections(policy, abi, gaps, substitutes),
        "substitutes": [str(sub) for sub in substitutes],
        "not_enforced": [str(gap) for gap in gaps],
        "accepted": [str(gap) for gap in gaps if gap.accepted_by(policy)],
        "refused_in_strict": [str(gap) for gap in gaps if gap.strict and not gap.accepted_by(policy)],
        "refused_grants": _refused_grants(policy, abi),
        "cautions": list(cautions(policy)),
        **({"credentials": _credentials(policy)} if policy.credentials else {}),
    }


#: The protections Landlock gives from some ABI on, with that ABI: what `explain` lists.
_PROTECTIONS = (("filesystem confinement", 1), ("truncate restriction", A.fs_since(A.Fs.TRUNCATE)),
                ("TCP port restriction", A.NET_SINCE),
                ("device ioctl restriction", A.fs_since(A.Fs.IOCTL_DEV)),
                ("signal scope", A.SCOPE_SINCE), ("abstract unix socket scope", A.SCOPE_SINCE))


def _protections(policy: Policy, abi: int, gaps: tuple[ruleset.Gap, ...],
                 substitutes: tuple[ruleset.Substitute, ...]) -> list[dict[str, str]]:
    """Per protection, what enforces it here: "Landlock (ABI N+)", "substitute: ...",
    or "not enforced: ..." (a gap). Protections a policy does not rely on (a TCP rule
    without TCP grants, a scope the policy switches off) are left out unless a gap names them."""
    out = []
    relied = {"TCP port restriction": policy.network.tcp, "signal scope": policy.scope.signals,
              "abstract unix socket scope": policy.scope.abstract_unix and policy.network.unix}
    for name, since in _PROTECTIONS:
        gap = next((g for g in gaps if g.protection == name), None)
        sub = next((s for s in substitutes if s.protection == name), None)
        if gap is not None:
            how = f"not enforced: {gap.consequence}"
        elif sub is not None:
            how = f"substitute: {sub.how}"
        elif not relied.get(name, True) or since > abi:
            continue  # not relied on, or (devices) no grant that needs it
        else:
            how = f"Landlock (ABI {since}+)"
        out.append({"protection": name, "enforced_by": how})
    return out


def _credentials(policy: Policy) -> list[dict[str, Any]]:
    from ..policy.credentials import explain

    return explain(policy.credentials)


def _refused_grants(policy: Policy, abi: int) -> list[str]:
    """Why `sandlock run` would refuse this policy's grants here (sandlock.compile.grants): a
    link outside the system directories, or a write grant reaching what later runs
    trust. Empty when every grant resolves and passes."""
    from .grants import GrantError, check_rules

    plan = ruleset.plan(policy, abi)
    try:
        check_rules(plan.paths, int(A.WRITE_RIGHTS), ruleset.policy_files(policy))
    except GrantError as exc:
        origin = next((r.origin for r in policy.paths if r.path == exc.path), policy.source)
        return [f"{origin}: {exc.path!r}: {exc.reason}"]
    except OSError as exc:
        return [f"{exc.filename or 'a path'}: {exc.strerror}"]
    return []
