"""Run a command under a container runtime's default seccomp profile, on this kernel.

    python tests/container_profile.py PROFILE.json -- COMMAND [ARG...]

Where agents run, sandlock itself is often confined by the runtime's default profile:
Docker's and containerd's (Kubernetes RuntimeDefault) or podman's. This launcher reads
such a profile at run time (the JSON a Debian package ships; nothing of it is copied
here), builds its filter with libseccomp for this machine's architecture as the runtime
would for a container with Docker's default capability set (so without
CAP_SYS_PTRACE or CAP_SYS_ADMIN), honours each rule's ``args``, ``includes`` and
``excludes`` (caps, arches, minKernel), sets no_new_privs, loads it and execs the
command. Every process the command starts inherits the filter, as in a container.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from typing import Any

import pyseccomp as seccomp

#: Docker's default capability set (moby oci/caps/defaults.go); podman's is a subset.
DOCKER_CAPS = frozenset({
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"})
#: os.uname().machine -> the profile's names of this architecture (Go's and libseccomp's).
ARCHES = {"x86_64": {"amd64", "SCMP_ARCH_X86_64"}, "aarch64": {"arm64", "SCMP_ARCH_AARCH64"}}
OPS = {"SCMP_CMP_NE": seccomp.NE, "SCMP_CMP_LT": seccomp.LT, "SCMP_CMP_LE": seccomp.LE,
       "SCMP_CMP_EQ": seccomp.EQ, "SCMP_CMP_GE": seccomp.GE, "SCMP_CMP_GT": seccomp.GT,
       "SCMP_CMP_MASKED_EQ": seccomp.MASKED_EQ}


def _kernel() -> tuple[int, ...]:
    release = os.uname().release.split("-", 1)[0]
    return tuple(int(part) for part in release.split(".")[:2] if part.isdigit())


def _applies(rule: dict[str, Any], arch: set[str]) -> bool:
    includes, excludes = rule.get("includes") or {}, rule.get("excludes") or {}
    if not set(includes.get("caps") or ()) <= DOCKER_CAPS:
        return False
    if includes.get("arches") and not arch & set(includes["arches"]):
        return False
    minimum = includes.get("minKernel")
    if minimum and _kernel() < tuple(int(p) for p in minimum.split(".")[:2]):
        return False
    if DOCKER_CAPS & set(excludes.get("caps") or ()):
        return False
    return not (excludes.get("arches") and arch & set(excludes["arches"]))


def _action(name: str, code: int) -> int:
    actions = {"SCMP_ACT_ALLOW": seccomp.ALLOW, "SCMP_ACT_ERRNO": seccomp.ERRNO(code),
               "SCMP_ACT_KILL": seccomp.KILL_THREAD, "SCMP_ACT_KILL_THREAD": seccomp.KILL_THREAD,
               "SCMP_ACT_KILL_PROCESS": seccomp.KILL_PROCESS, "SCMP_ACT_LOG": seccomp.LOG}
    if name not in actions:
        raise SystemExit(f"container_profile: action {name} is not emulated")
    return int(actions[name])


def build(path: str) -> seccomp.SyscallFilter:
    with open(path) as handle:
        profile = json.load(handle)
    default_errno = int(profile.get("defaultErrnoRet") or errno.EPERM)
    arch = ARCHES[os.uname().machine]
    flt = seccomp.SyscallFilter(_action(profile["defaultAction"], default_errno))
    for rule in profile["syscalls"]:
        if not _applies(rule, arch):
            continue
        action = _action(rule["action"], int(rule.get("errnoRet") or default_errno))
        args = [seccomp.Arg(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0))
                for a in rule.get("args") or ()]
        for name in rule["names"]:
            try:
                flt.add_rule(action, name, *args)
            except (OSError, RuntimeError, ValueError):
                pass  # not a syscall of this architecture, or a rule libseccomp merges away
    return flt


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(__doc__)
    flt = build(argv[0])
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise SystemExit("container_profile: prctl(PR_SET_NO_NEW_PRIVS) failed")
    flt.load()
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
