"""`sandlock probe`: run a battery of escape attempts inside a policy's sandbox.

The harness (this module, outside the sandbox) prepares targets the policy does
not grant -- a directory with a secret and victim files, loopback TCP/UDP
listeners, an ssh-agent-like Unix socket, an abstract socket, a helper process
holding a secret in its memory and environment, an inheritable descriptor on
the secret, a pty as stdin -- then starts :mod:`sandlock.probe.payload` through
exactly the launcher path of `sandlock run` (:func:`compiler.compile_policy`,
:func:`launcher.prepare_command`, :func:`launcher.spawn`). Nothing is simulated:
every row is the kernel's answer to a real syscall, cross-checked afterwards
where an effect can be seen (a file changed, a daemon survived).

Each attempt that got through is then explained by the policy entry that grants
it, or by a documented limit of the kernel (README "What sandlock does not
protect against"). Anything allowed and unexplained is an ESCAPE.

The payload is Python, so the probe adds to the policy what the interpreter
needs to start (the built-in ``python`` profile) and reports every path it
added. Explanations are computed against the user's policy only: an attempt
that succeeded only because of such an added path is shown as ``probe-grant``,
never as granted by the policy.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import sys
import tempfile
import termios
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable, Optional

from ..compile import compiler
from ..errors import SandlockError
from ..exec import launcher
from ..linux import kernel
from ..policy.model import Access, PathRule, Policy, PortRange, load_profile

PAYLOAD = Path(__file__).with_name("payload.py")
INTERPRETER = "/usr/bin/python3"
ENV_CANARY = "SANDLOCK_PROBE_API_KEY"  #: a secret-looking name no sane policy passes
#: What the credential routes' secret looks like (the payload searches for it).
CREDENTIAL_SHAPE = "SANDLOCK-CRED-[0-9a-f]{32}"
RUN_TIMEOUT = 60.0  #: seconds; the payload itself needs one or two

#: Verdicts. Only ESCAPE and error make the run fail.
BLOCKED, GRANTED, NOT_ENFORCEABLE, PROBE_GRANT, SKIPPED, ESCAPE, ERROR = (
    "blocked", "granted", "not-enforceable", "probe-grant", "skipped", "ESCAPE", "error")
FAILING = (ESCAPE, ERROR)

README_LIMITS = "README: not protected"


# ---------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Result:
    """One attempt: what the kernel answered and why that is (or is not) fine."""

    id: str
    what: str
    outcome: str  #: allowed / blocked / skipped / error, as seen in the sandbox
    verdict: str  #: one of the verdict constants
    reason: str  #: the policy entry or kernel limit that explains an allowed outcome
    detail: str  #: errno or what happened

    def as_dict(self) -> dict[str, str]:
        return dict(vars(self))


@dataclass(frozen=True)
class Report:
    policy: str
    abi: int
    uid: int
    runtime_grants: tuple[str, ...]  #: what the probe added so its interpreter can start
    not_enforced: tuple[str, ...]  #: gaps of this kernel (best-effort policies only)
    results: tuple[Result, ...]
    stderr: str = ""
    #: grants through which this tool could change what a later run executes
    later_runs: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every attempt the policy does not grant was blocked."""
        return not any(r.verdict in FAILING for r in self.results)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for result in self.results:
            out[result.verdict] = out.get(result.verdict, 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "abi": self.abi, "uid": self.uid, "ok": self.ok,
                "counts": self.counts(), "runtime_grants": list(self.runtime_grants),
                "not_enforced": list(self.not_enforced),
                "results": [r.as_dict() for r in self.results], "stderr": self.stderr,
                "later_runs": list(self.later_runs)}


# ---------------------------------------------------------------------------
# What the policy grants (computed on the user's policy, never on the probe's additions)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


_SATISFIES = {Access.READ: (Access.READ, Access.WRITE, Access.EXEC),
              Access.WRITE: (Access.WRITE,), Access.EXEC: (Access.EXEC,)}


def path_grant(rules: tuple[PathRule, ...], path: str, access: Access) -> PathRule | None:
    """The rule that gives ``access`` to ``path`` (both sides resolved as the kernel does)."""
    real = os.path.realpath(path)
    for rule in rules:
        if rule.access in _SATISFIES[access] and any(
                _under(candidate, os.path.realpath(rule.path)) for candidate in {path, real}):
            return rule
    return None


def _describe(rule: PathRule) -> str:
    return f"filesystem.{rule.access.value} {rule.path!r} ({rule.origin})"


def _port_granted(ranges: tuple[PortRange, ...], port: int) -> PortRange | None:
    return next((r for r in ranges if r.low <= port <= r.high), None)


@dataclass
class Context:
    """Everything an explanation may look at."""

    policy: Policy  #: the user's policy, as loaded
    extra: tuple[PathRule, ...]  #: paths the probe added for its interpreter
    gaps: tuple[str, ...]
    root: bool
    cfg: dict[str, Any]
    parent_pid: int

    def path(self, key: str, access: Access, *, victim: str | None = None) -> str | None:
        target = self.cfg["victims"][victim] if victim else self.cfg.get(key)
        if not target:
            return None
        rule = path_grant(self.policy.paths, target, access)
        return _describe(rule) if rule else None

    def extra_path(self, target: str, access: Access) -> str | None:
        rule = path_grant(self.extra, target, access)
        return f"{rule.path!r} ({rule.origin})" if rule else None

    def allowed_syscall(self, *names: str) -> str | None:
        hit = [n for n in names if n in self.policy.syscalls.allow]
        return f"syscalls.allow contains {', '.join(hit)}" if hit else None

    def gap(self, protection: str) -> str | None:
        hit = next((g for g in self.gaps if g.startswith(protection)), None)
        return f"not enforceable on this kernel: {hit}" if hit else None


Explain = Callable[[Context], Optional[str]]


def _none(_: Context) -> str | None:
    return None


@dataclass(frozen=True)
class Spec:
    """What a probe tries, which policy entry would grant it, which kernel limit explains it."""

    id: str
    what: str
    grant: Explain = _none
    limit: Explain = _none
    #: what the attempt relies on that the probe's own added paths could provide
    runtime: tuple[tuple[str, Access], ...] = ()


def _fs(key: str, access: Access, victim: bool = False) -> Explain:
    def explain(ctx: Context) -> str | None:
        if victim:
            return ctx.path("", access, victim=key)
        return ctx.path(key, access)
    return explain


def _fs_gap(ctx: Context) -> str | None:
    return ctx.gap("filesystem confinement")


def _either(*explains: Explain) -> Explain:
    def explain(ctx: Context) -> str | None:
        return next((why for why in (e(ctx) for e in explains) if why), None)
    return explain


def _victim_dir(key: str) -> Explain:
    """Write access to the directory that holds victim ``key`` (create, delete, rename)."""
    def explain(ctx: Context) -> str | None:
        rule = path_grant(ctx.policy.paths, os.path.dirname(ctx.cfg["victims"][key]), Access.WRITE)
        return _describe(rule) if rule else None
    return explain


def _metadata(what: str) -> Explain:
    def explain(ctx: Context) -> str | None:
        return (f"not enforceable: Landlock does not govern {what} ({README_LIMITS}: "
                "metadata)")
    return explain


def _proc(suffix: str) -> Explain:
    def explain(ctx: Context) -> str | None:
        pid = ctx.cfg["helper_pid"] if "helper" in suffix else ctx.parent_pid
        rule = path_grant(ctx.policy.paths, f"/proc/{pid}/{suffix.split('/')[-1]}", Access.READ)
        return _describe(rule) if rule else None
    return explain


def _connect(key: str) -> Explain:
    def explain(ctx: Context) -> str | None:
        port = ctx.cfg["ports"].get(key) if key in ctx.cfg["ports"] else ctx.cfg.get(key)
        span = _port_granted(ctx.policy.network.connect, port) if port else None
        return f"network.connect includes {span}" if span else None
    return explain


def _bind(ctx: Context) -> str | None:
    span = _port_granted(ctx.policy.network.bind, ctx.cfg["ports"]["bind_denied"])
    return f"network.bind includes {span}" if span else None


def _tcp_gap(ctx: Context) -> str | None:
    return ctx.gap("TCP port restriction")


def _signals(ctx: Context) -> str | None:
    return None if ctx.policy.scope.signals else "scope.signals = false"


def _signal_gap(ctx: Context) -> str | None:
    return ctx.gap("signal scope")


def _env(ctx: Context) -> str | None:
    passed = [p for p in ctx.policy.env.passed if fnmatchcase(ENV_CANARY, p)]
    return f"env.pass {passed[0]!r} matches {ENV_CANARY}" if passed else None


def _syscall(*names: str) -> Explain:
    return lambda ctx: ctx.allowed_syscall(*names)


def _limit_unset(name: str) -> Explain:
    def explain(ctx: Context) -> str | None:
        if getattr(ctx.policy.limits, name) is None:
            return f"limits.{name} is not set (not attempted)"
        return None
    return explain


def _nproc_root(ctx: Context) -> str | None:
    from ..linux.cgroups import find

    if ctx.root and find()[0] is None:  # else a pids cgroup per run (sandlock.linux.cgroups)
        return (f"not enforceable: RLIMIT_NPROC does not apply to root ({README_LIMITS}: "
                "process counting)")
    return None


def _unix_pathname(ctx: Context) -> str | None:
    if ctx.policy.network.unix:
        return ("not enforceable: network.unix = true and Landlock before ABI 9 does not "
                f"restrict connect() to a socket file ({README_LIMITS}: pathname Unix sockets)")
    return None


def _abstract(ctx: Context) -> str | None:
    if ctx.policy.network.unix and not ctx.policy.scope.abstract_unix:
        return "network.unix = true and scope.abstract_unix = false"
    return None


def _abstract_gap(ctx: Context) -> str | None:
    return ctx.gap("abstract unix socket scope")


def _unix_bind(ctx: Context) -> str | None:
    rule = path_grant(ctx.policy.paths, ctx.cfg["outside"], Access.WRITE)
    if rule and ctx.policy.network.unix:
        return f"network.unix = true and {_describe(rule)}"
    return None


def _listen(ctx: Context) -> str | None:
    """listen() on an unbound socket binds an ephemeral port without Landlock's bind hook
    (https://github.com/landlock-lsm/linux/issues/15). seccomp can refuse listen()
    altogether, but only when no listener of any kind is granted."""
    why = ("not enforceable: Landlock does not control listen(), which binds an unbound "
           f"socket to an ephemeral port (landlock-lsm/linux#15; {README_LIMITS}: listening)")
    if ctx.policy.network.bind:
        return f"{why}; network.bind grants listeners, so listen() cannot be refused"
    if ctx.policy.network.unix:
        return f"{why}; network.unix = true, and seccomp cannot tell a Unix listen() from a TCP one"
    return _tcp_gap(ctx)


def _ld_so(ctx: Context) -> str | None:
    return ("not enforceable: the dynamic loader runs any readable ELF file; exec rights are "
            f"checked only by execve ({README_LIMITS}: executing code by reading it)")


FS_READ = Access.READ
SPECS: tuple[Spec, ...] = (
    # filesystem
    Spec("fs.read_outside", "read a file outside the grants", _fs("secret", FS_READ), _fs_gap),
    Spec("fs.list_outside", "list a directory outside", _fs("outside", FS_READ), _fs_gap),
    Spec("fs.write_outside", "append to a file outside",
         _fs("fs.write_outside", Access.WRITE, True), _fs_gap),
    Spec("fs.overwrite_outside", "overwrite (O_TRUNC) a file outside",
         _fs("fs.overwrite_outside", Access.WRITE, True), _fs_gap),
    Spec("fs.create_outside", "create a file outside", _victim_dir("fs.create_outside"), _fs_gap),
    Spec("fs.truncate_outside", "truncate(2) a file outside",
         _fs("fs.truncate_outside", Access.WRITE, True),
         _either(_fs_gap, lambda c: c.gap("truncate restriction"))),
    Spec("fs.delete_outside", "delete a file outside", _victim_dir("fs.delete_outside"), _fs_gap),
    Spec("fs.rmdir_outside", "remove a directory outside", _victim_dir("fs.rmdir_outside"),
         _fs_gap),
    Spec("fs.rename_outside", "rename a file outside", _victim_dir("fs.rename_outside"), _fs_gap),
    Spec("fs.mkfifo_outside", "make a FIFO outside", _victim_dir("fs.mkfifo_outside"), _fs_gap),
    Spec("fs.symlink_create_outside", "make a symlink outside",
         _victim_dir("fs.symlink_create_outside"), _fs_gap),
    Spec("fs.rename_out_to_workspace", "move a file from outside into the workspace",
         _victim_dir("fs.rename_out_to_workspace"), _fs_gap),
    Spec("fs.rename_workspace_to_outside", "move a workspace file outside",
         _victim_dir("fs.rename_workspace_to_outside"), _fs_gap),
    Spec("fs.hardlink_into_workspace", "hard-link an outside file into the workspace and read it",
         _victim_dir("fs.create_outside"), _fs_gap),
    Spec("fs.hardlink_to_outside", "hard-link a workspace file into outside",
         _victim_dir("fs.hardlink_to_outside"), _fs_gap),
    Spec("fs.symlink_escape", "read outside through a symlink made in the workspace",
         _fs("secret", FS_READ), _fs_gap),
    Spec("fs.symlink_dir_escape", "read outside through a directory symlink in the workspace",
         _fs("secret", FS_READ), _fs_gap),
    Spec("fs.dotdot_traversal", "read outside via granted/../../ (absolute path)",
         _fs("secret", FS_READ), _fs_gap),
    Spec("fs.dotdot_relative", "read outside via ../ relative to a granted directory",
         _fs("secret", FS_READ), _fs_gap),
    Spec("fs.proc_self_root", "read outside via /proc/self/root", _fs("secret", FS_READ), _fs_gap),
    Spec("fs.proc_self_cwd", "chdir outside, read via ./ and /proc/self/cwd",
         _fs("secret", FS_READ), _fs_gap),
    Spec("fs.opath_reopen", "open O_PATH, reopen via /proc/self/fd, openat from an O_PATH dir",
         _fs("secret", FS_READ), _fs_gap),
    Spec("fs.open_by_handle", "open_by_handle_at (bypasses path checks)",
         _syscall("name_to_handle_at", "open_by_handle_at")),
    Spec("fs.mknod_device", "make a device node in the workspace", limit=_fs_gap),
    Spec("fs.hardlink_opath", "link an O_PATH descriptor of an outside file into the workspace",
         _victim_dir("fs.create_outside"), _fs_gap),
    Spec("fs.rename_exchange", "swap a workspace file with a file outside (RENAME_EXCHANGE)",
         _victim_dir("fs.rename_exchange"), _fs_gap),
    Spec("fs.write_read_only_grant", "open a file under a read-only grant for writing",
         _fs("ro_file", Access.WRITE), _fs_gap),
    Spec("fs.create_in_read_only_grant", "create a file under a read-only grant",
         _fs("ro_dir", Access.WRITE), _fs_gap),
    Spec("fs.inotify_outside", "watch a directory outside with inotify", _fs("outside", FS_READ),
         _metadata("inotify watches")),
    Spec("fs.stat_outside", "stat a file outside", _fs("secret", FS_READ), _metadata("stat")),
    Spec("fs.chmod_outside", "chmod a file outside", _fs("fs.chmod_outside", Access.WRITE, True),
         _metadata("chmod")),
    Spec("fs.chown_outside", "chown a file outside", _fs("fs.chown_outside", Access.WRITE, True),
         _metadata("chown")),
    Spec("fs.utime_outside", "change the timestamps of a file outside",
         _fs("fs.utime_outside", Access.WRITE, True), _metadata("utimensat")),
    Spec("fs.xattr_outside", "write an extended attribute on a file outside",
         _fs("fs.xattr_outside", Access.WRITE, True), _metadata("setxattr")),
    # exec
    Spec("exec.outside_binary", "execve a binary outside the grants",
         _fs("prog_outside", Access.EXEC), _fs_gap),
    Spec("exec.system_binary", "execve a system binary not granted exec",
         _fs("system_binary", Access.EXEC), _fs_gap, runtime=(("system_binary", Access.EXEC),)),
    Spec("exec.shebang_script", "execve a #! script outside", _fs("script_outside", Access.EXEC),
         _fs_gap),
    Spec("exec.interpreter_script", "python3 reading a script outside",
         _fs("py_outside", FS_READ), _fs_gap),
    Spec("exec.ld_so_outside", "ld.so running a binary outside", _fs("prog_outside", FS_READ),
         _fs_gap),
    Spec("exec.ld_so_readable", "ld.so running a readable ELF not granted exec",
         _fs("ld_target", Access.EXEC), _ld_so,
         runtime=(("ld_target", FS_READ), ("loader", Access.EXEC))),
    Spec("exec.opath_execveat", "execve via /proc/self/fd of an O_PATH fd",
         _fs("prog_outside", Access.EXEC), _fs_gap),
    Spec("exec.memfd", "fexecve a program written into a memfd", _syscall("memfd_create")),
    Spec("exec.written_binary", "execve a program written into the workspace",
         _fs("writable", Access.EXEC), _fs_gap),
    Spec("exec.read_granted_file", "execve a file the policy grants read, not exec",
         _fs("ld_target", Access.EXEC), _fs_gap),
    Spec("exec.setuid_plant", "leave a set-user-id program behind (chmod, open, mknod)"),
    Spec("exec.setuid_no_new_privs", "gain privileges through a setuid binary (no_new_privs)"),
    # secrets
    Spec("secrets.env_canary", "see a secret in the caller's environment", _env),
    Spec("secrets.ssh_key", "read ~/.ssh", _fs("ssh_key", FS_READ), _fs_gap),
    Spec("secrets.home_listing", "list the home directory", _fs("home", FS_READ), _fs_gap),
    Spec("secrets.etc_shadow", "read /etc/shadow", _fs("shadow", FS_READ), _fs_gap),
    Spec("secrets.parent_environ", "read the launcher's /proc/PID/environ", _proc("environ"),
         _fs_gap),
    Spec("secrets.parent_mem", "open the launcher's /proc/PID/mem", _proc("mem"), _fs_gap),
    Spec("secrets.helper_environ", "read another process's /proc/PID/environ",
         _proc("helper/environ"), _fs_gap),
    Spec("secrets.helper_mem", "read another process's /proc/PID/mem", _proc("helper/mem"),
         _fs_gap),
    Spec("secrets.inherited_fds", "use a descriptor the caller had open"),
    # credential routes (issue 16): nothing in a policy grants the secret to the tool
    Spec("credentials.env", "find a credential's secret in the tool's environment"),
    Spec("credentials.parent_environ", "read the route server's /proc/PPID/environ",
         limit=_fs_gap),
    Spec("credentials.parent_mem", "read the secret in the route server's /proc/PPID/mem",
         limit=_fs_gap),
    Spec("credentials.proc_environ", "find the secret in any readable /proc/N/environ",
         limit=_fs_gap),
    Spec("credentials.route_without_placeholder",
         "use the route without this run's placeholder (none, a guessed key or placeholder)"),
    Spec("credentials.placeholder_echo",
         "send the placeholder to another loopback server and read the echo"),
    # network
    Spec("net.tcp_connect_denied_port", "TCP connect to a loopback port not granted",
         _connect("tcp_denied"), _tcp_gap),
    Spec("net.tcp6_connect_denied_port", "TCP connect to [::1] on a port not granted",
         _connect("tcp6"), _tcp_gap),
    Spec("net.tcp_connect_granted_port", "TCP connect to a granted port (control)",
         _connect("tcp_granted"), _tcp_gap),
    Spec("net.tcp_fastopen", "sendto(MSG_FASTOPEN) to a port not granted",
         _connect("tcp_denied"), _tcp_gap),
    Spec("net.tcp_bind_denied_port", "TCP bind+listen on a port not granted", _bind, _tcp_gap),
    Spec("net.tcp_bind_ephemeral", "TCP bind to port 0 (kernel-chosen)", limit=_tcp_gap),
    Spec("net.tcp_listen_autobind", "TCP listen() without bind()", limit=_listen),
    Spec("net.udp_send", "send a UDP datagram",
         lambda c: "network.udp = true" if c.policy.network.udp else None),
    Spec("net.icmp_socket", "create an ICMP (ping) socket"),
    Spec("net.raw_socket", "create a raw IP socket"),
    Spec("net.packet_socket", "create a packet socket"),
    Spec("net.netlink_socket", "create a netlink socket"),
    Spec("net.mptcp", "MPTCP connect (outside Landlock's TCP rules)"),
    Spec("net.sctp", "create an SCTP socket"),
    Spec("net.proxy_port_elsewhere", "[network] allow: the proxy's port on another address"),
    Spec("net.proxy_unlisted_host", "[network] allow: CONNECT through the proxy to an unlisted host"),
    Spec("net.other_families", "create a socket of any other address family"),
    Spec("net.unix_pathname_outside", "connect to a Unix socket file outside (ssh-agent)",
         limit=_unix_pathname),
    Spec("net.unix_abstract_outside", "connect to an abstract Unix socket outside", _abstract,
         _abstract_gap),
    Spec("net.unix_bind_outside", "create a Unix socket file outside", _unix_bind, _fs_gap),
    Spec("net.io_uring", "create an io_uring instance", _syscall("io_uring_setup")),
    # processes
    Spec("proc.signal_outside", "signal a process outside the sandbox", _signals, _signal_gap),
    Spec("proc.signal_parent", "signal the launcher", _signals, _signal_gap),
    Spec("proc.pidfd_signal", "pidfd_send_signal to a process outside", _signals, _signal_gap),
    Spec("proc.pidfd_getfd", "steal a descriptor with pidfd_getfd", _syscall("pidfd_getfd")),
    Spec("proc.ptrace_outside", "ptrace a process outside", _syscall("ptrace")),
    Spec("proc.process_vm_readv", "read another process's memory", _syscall("process_vm_readv")),
    Spec("proc.userns", "unshare a user namespace", _syscall("unshare")),
    Spec("proc.mountns", "unshare a mount namespace", _syscall("unshare")),
    Spec("proc.netns", "unshare a network namespace", _syscall("unshare")),
    Spec("proc.clone_newuser", "clone(CLONE_NEWUSER)", _syscall("clone")),
    Spec("proc.clone3", "clone3(CLONE_NEWUSER)", _syscall("clone3")),
    Spec("proc.mount", "mount a tmpfs", _syscall("mount")),
    Spec("proc.chroot", "chroot", _syscall("chroot")),
    Spec("proc.sigio_outside", "have the kernel signal a process outside (F_SETOWN)", _signals,
         _signal_gap),
    Spec("proc.prlimit_outside", "change a resource limit of a process outside",
         _syscall("prlimit64")),
    Spec("proc.sched_outside", "renice / re-pin / reschedule a process outside",
         _syscall("setpriority", "sched_setaffinity", "sched_setscheduler", "ioprio_set")),
    Spec("ipc.sysv_shm_outside", "attach a SysV shared memory segment made outside",
         _syscall("shmat")),
    Spec("ipc.sysv_msg_outside", "read a SysV message queue made outside", _syscall("msgrcv")),
    Spec("ipc.posix_shm_outside", "read POSIX shared memory (/dev/shm) made outside",
         _fs("posix_shm", FS_READ), _fs_gap),
    Spec("ipc.posix_mqueue_outside", "open a POSIX message queue made outside"),
    Spec("proc.timeout_escape", "leave a daemon behind (setsid + double fork)"),
    # limits
    Spec("limits.fork_bomb", "fork past limits.processes", _limit_unset("processes"), _nproc_root),
    Spec("limits.memory_bomb", "allocate past limits.memory", _limit_unset("memory")),
    Spec("limits.file_size_bomb", "write past limits.file_size", _limit_unset("file_size")),
    Spec("limits.cpu_burn", "burn CPU past limits.cpu", _limit_unset("cpu")),
    Spec("limits.open_files", "open descriptors past limits.open_files",
         _limit_unset("open_files")),
    Spec("limits.raise_limit", "raise a hard resource limit",
         lambda c: None if _limits(c.policy) else "[limits] sets nothing (not attempted)"),
    # terminal
    Spec("term.dev_tty", "open /dev/tty", _fs("dev_tty", Access.READ), _fs_gap),
    Spec("term.tiocsti", "inject a keystroke into the terminal (TIOCSTI)", _syscall("ioctl")),
    Spec("term.tiocsetd", "switch the terminal's line discipline (TIOCSETD)", _syscall("ioctl")),
    Spec("term.tiocsti_high_bits", "TIOCSTI with garbage upper bits", _syscall("ioctl")),
    # kernel surface
    Spec("kernel.bpf", "bpf(BPF_MAP_CREATE)", _syscall("bpf")),
    Spec("kernel.perf_event_open", "perf_event_open", _syscall("perf_event_open")),
    Spec("kernel.userfaultfd", "userfaultfd", _syscall("userfaultfd")),
    Spec("kernel.keyctl", "add a key to a keyring", _syscall("add_key", "keyctl")),
    Spec("kernel.personality", "personality(ADDR_NO_RANDOMIZE)", _syscall("personality")),
    Spec("kernel.adjtimex", "adjust the system clock", _syscall("adjtimex", "clock_adjtime")),
    Spec("kernel.reboot", "reboot(2)", _syscall("reboot")),
    Spec("kernel.kexec_load", "kexec_load", _syscall("kexec_load")),
    Spec("kernel.init_module", "init_module", _syscall("init_module")),
    Spec("kernel.x32_abi", "an x32 system call"),
    Spec("kernel.i386_int80", "an i386 system call (int 0x80)"),
)
SPEC_BY_ID = {spec.id: spec for spec in SPECS}


def _limits(policy: Policy) -> dict[str, int]:
    names = ("cpu", "memory", "processes", "open_files", "file_size")
    return {n: getattr(policy.limits, n) for n in names if getattr(policy.limits, n) is not None}


# ---------------------------------------------------------------------------
# The harness: targets outside the sandbox


HELPER = """\
import os, signal, sys
secret = ("SANDLOCK-HELPER-" + os.environ["SANDLOCK_PROBE_HELPER"]).encode()
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGUSR2, lambda *_: print("SIGUSR2", flush=True))
print(os.getpid(), id(secret) + sys.getsizeof(b"") - 1, flush=True)
sys.stdin.read()
"""

VICTIMS = ("fs.write_outside", "fs.overwrite_outside", "fs.truncate_outside", "fs.delete_outside",
           "fs.rename_outside", "fs.rename_out_to_workspace", "fs.chmod_outside",
           "fs.utime_outside", "fs.xattr_outside", "fs.rename_exchange",
           "fs.chown_outside")
ABSENT = ("fs.create_outside", "fs.mkfifo_outside", "fs.symlink_create_outside",
          "fs.rename_workspace_to_outside", "fs.hardlink_to_outside", "net.unix_bind_outside")


class Harness:
    """Targets outside the sandbox; a context manager that removes them all."""

    def __init__(self, policy: Policy, home: str | None = None) -> None:
        self.policy = policy
        self.token = secrets.token_hex(8)
        self.canary = f"SANDLOCK-CANARY-{self.token}"
        #: the secret the credential routes serve (never a real one); the payload gets
        #: only its shape, CREDENTIAL_SHAPE
        self.credential_secret = f"SANDLOCK-CRED-{secrets.token_hex(16)}"
        self.threads: list[threading.Thread] = []
        self.dir = Path(tempfile.mkdtemp(prefix="sandlock-probe-"))
        self.home = home or os.path.expanduser("~")
        self.sockets: list[socket.socket] = []
        self.fds: list[int] = []
        self.helper: Any | None = None
        self.cfg: dict[str, Any] = {}
        self.short: Path | None = None  #: a short directory for the Unix socket, if needed
        self.ipc: list[tuple[str, Any]] = []  #: SysV and POSIX IPC objects to remove
        self.created: list[Path] = []  #: files outside self.dir to remove, if they exist

    def __enter__(self) -> Harness:  # noqa: PYI034 - Self needs Python 3.11
        try:
            self._prepare()
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError):
                raise SandlockError(f"probe: cannot prepare the targets outside the sandbox: "
                                    f"{exc}") from None
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self) -> None:
        outside = self.dir / "outside"
        outside.mkdir()
        secret = outside / "secret.txt"
        secret.write_text(self.canary + "\n")
        victims: dict[str, str] = {}
        for name in VICTIMS:
            path = outside / f"{name}.txt"
            path.write_text(f"original content of {name}\n")
            victims[name] = str(path)
        for name in ABSENT:
            victims[name] = str(outside / f"{name}.new")
        victims["fs.rmdir_outside"] = str(outside / "emptydir")
        os.mkdir(victims["fs.rmdir_outside"])
        victims["proc.mount"] = str(outside / "mnt")
        os.mkdir(victims["proc.mount"])
        self.originals = {name: self._state(victims[name]) for name in VICTIMS}
        prog = outside / "prog"
        shutil.copy(_true_binary(), prog)
        prog.chmod(0o755)
        script = outside / "script.sh"
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
        evil = outside / "evil.py"
        evil.write_text("raise SystemExit(0)\n")
        # The caller had this open and inheritable: the launcher must close it.
        caller_fd = os.open(secret, os.O_RDONLY)
        os.set_inheritable(caller_fd, True)
        self.fds.append(caller_fd)
        ssh = Path(self.home) / ".ssh"
        keys = sorted(p for p in ssh.iterdir() if p.is_file()) if ssh.is_dir() else []
        self.cfg = {
            "outside": str(outside), "secret": str(secret), "canary": self.canary,
            "victims": victims, "prog_outside": str(prog), "script_outside": str(script),
            "py_outside": str(evil), "system_binary": _system_binary(),
            "loader": _loader(), "ld_target": _libc(),
            "home": self.home if os.path.isdir(self.home) else None,
            "ssh_key": str(keys[0]) if keys else None, "caller_fd": caller_fd,
            "env_canary": [ENV_CANARY, self.canary],
            "writable": self._writable(), "readable_dir": self._readable_dir(),
            "shadow": "/etc/shadow", "dev_tty": "/dev/tty", "token": self.token,
            "posix_shm": self._posix_shm(), **self._read_only_targets(),
            "limits": _limits(self.policy),
        }
        self._listen()
        if self.policy.credentials:
            self._echo()
        self._start_helper()
        self._ipc()
        self.cfg["present"] = {f"limits.{k}": True for k in self.cfg["limits"]}
        self.cfg["present"]["limits.any"] = bool(self.cfg["limits"])

    def _writable(self) -> str | None:
        for rule in self.policy.paths:
            if rule.access is Access.WRITE and os.path.isdir(rule.path) and \
                    os.access(rule.path, os.W_OK) and not rule.path.startswith("/dev"):
                return rule.path
        return None

    def _readable_dir(self) -> str | None:
        for rule in self.policy.paths + runtime_rules(self.policy):
            if os.path.isdir(rule.path) and rule.path != "/":
                return rule.path
        return None

    def _listen(self) -> None:
        net = self.policy.network
        tcp = self._socket(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0),
                           avoid=net.connect)
        udp = self._socket(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))
        free = socket.socket()
        for _ in range(20):  # a port nobody listens on and the policy does not grant for bind
            free.close()
            free = socket.socket()
            free.bind(("127.0.0.1", 0))
            if not _port_granted(net.bind, free.getsockname()[1]):
                break
        bind_port = free.getsockname()[1]
        free.close()
        self.cfg["ports"] = {"tcp_denied": tcp.getsockname()[1], "udp": udp.getsockname()[1],
                             "bind_denied": bind_port}
        try:
            tcp6 = self._socket(socket.AF_INET6, socket.SOCK_STREAM, ("::1", 0), avoid=net.connect)
            self.cfg["tcp6"] = tcp6.getsockname()[1]
        except OSError:
            self.cfg["tcp6"] = None
        self.cfg["tcp_granted"] = self._granted_listener(net.connect)
        agent = self.dir / "outside" / "agent.sock"
        if len(str(agent)) > 100:  # sun_path holds 108 bytes
            self.short = Path(tempfile.mkdtemp(prefix="slp-", dir="/tmp"))
            agent = self.short / "agent.sock"
        self._socket(socket.AF_UNIX, socket.SOCK_STREAM, str(agent))
        self.cfg["unix_path"] = str(agent)
        abstract = f"sandlock-probe-{self.token}"
        self._socket(socket.AF_UNIX, socket.SOCK_STREAM, "\0" + abstract)
        self.cfg["abstract"] = abstract

    def _echo(self) -> None:
        """A loopback HTTP server that answers each request with the bytes it received:
        the tool sends it the placeholder where the secret goes and reads the echo."""
        server = self._socket(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
        thread = threading.Thread(target=_echo_loop, args=(server,), daemon=True,
                                  name="sandlock-probe-echo")
        thread.start()
        self.threads.append(thread)
        self.cfg["credential"] = {"shape": CREDENTIAL_SHAPE, "echo": server.getsockname()[1],
                                  "routes": []}

    def _socket(self, family: int, kind: int, address: Any,
                avoid: tuple[PortRange, ...] = ()) -> socket.socket:
        for _ in range(20):
            sock = socket.socket(family, kind)
            try:
                sock.bind(address)
                if kind == socket.SOCK_STREAM:
                    sock.listen(8)
            except OSError:
                sock.close()
                raise
            if family == socket.AF_UNIX or not _port_granted(avoid, sock.getsockname()[1]):
                self.sockets.append(sock)
                return sock
            sock.close()
        raise SandlockError("probe: could not find a loopback port the policy does not grant")

    def _granted_listener(self, ranges: tuple[PortRange, ...]) -> int | None:
        for span in ranges:
            for port in range(span.low, min(span.high, span.low + 20) + 1):
                try:
                    sock = self._socket(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", port))
                except OSError:
                    continue
                return int(sock.getsockname()[1])
        return None

    def _posix_shm(self) -> str | None:
        shm = Path("/dev/shm")
        if not (shm.is_dir() and os.access(shm, os.W_OK)):
            return None
        path = shm / f"sandlock-probe-{self.token}"
        path.write_text(self.canary)
        self.created.append(path)
        return str(path)

    def _read_only_targets(self) -> dict[str, str | None]:
        """A directory the policy grants only read on, that the caller could write to,
        and a file in it: read access must not turn into write access."""
        writes = tuple(r for r in self.policy.paths if r.access is Access.WRITE)
        for rule in self.policy.paths:
            if rule.access is Access.WRITE or not os.path.isdir(rule.path) or \
                    path_grant(writes, rule.path, Access.WRITE) or \
                    not os.access(rule.path, os.W_OK):
                continue
            try:
                files = sorted(e.path for e in os.scandir(rule.path)
                               if e.is_file(follow_symlinks=False) and os.access(e.path, os.W_OK))
            except OSError:
                continue
            self.created.append(Path(rule.path) / f".sandlock-probe-{self.token}")
            return {"ro_dir": rule.path, "ro_file": files[0] if files else None}
        return {"ro_dir": None, "ro_file": None}

    def _ipc(self) -> None:
        """A SysV shared memory segment, a SysV message queue and a POSIX message
        queue, each holding the secret, as a database or X server would leave them."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        canary = self.canary.encode()
        shm = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
        if shm >= 0:
            self.ipc.append(("shm", shm))
            address = libc.shmat(shm, None, 0)
            if address not in (None, ctypes.c_void_p(-1).value):
                ctypes.memmove(address, canary, len(canary))
                libc.shmdt(ctypes.c_void_p(address))
        msg = libc.msgget(0, 0o1000 | 0o600)
        if msg >= 0:
            self.ipc.append(("msg", msg))
            buf = ctypes.create_string_buffer(1 .to_bytes(8, sys.byteorder) + canary)
            libc.msgsnd(msg, buf, len(canary), 0o4000)
        name = f"/sandlock-probe-{self.token}".encode()
        mq = -1
        if hasattr(libc, "mq_open"):  # in libc since glibc 2.34, in librt before
            libc.mq_open.restype = ctypes.c_int
            mq = libc.mq_open(name, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600, None)
        if mq >= 0:
            os.close(mq)
            self.ipc.append(("mq", name))
        self.cfg.update(shm_id=shm if shm >= 0 else None, msg_id=msg if msg >= 0 else None,
                        mqueue=name.decode() if mq >= 0 else None)

    def _close_ipc(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for kind, ident in self.ipc:
            if kind == "shm":
                libc.shmctl(ident, 0, None)  # IPC_RMID
            elif kind == "msg":
                libc.msgctl(ident, 0, None)
            else:
                libc.mq_unlink(ident)
        self.ipc.clear()

    def _start_helper(self) -> None:
        import subprocess

        env = {"PATH": os.environ.get("PATH", os.defpath), ENV_CANARY: self.canary,
               "SANDLOCK_PROBE_HELPER": self.token}
        self.helper = subprocess.Popen([_interpreter(), "-I", "-S", "-c", HELPER], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.helper.stdout is not None
        line = self.helper.stdout.readline().split()
        if len(line) != 2:
            raise SandlockError("probe: the helper process did not start")
        self.cfg["helper_pid"], self.cfg["helper_addr"] = int(line[0]), int(line[1])
        self.cfg["helper_canary"] = f"SANDLOCK-HELPER-{self.token}"

    @staticmethod
    def _state(path: str) -> tuple[Any, ...] | None:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        data = Path(path).read_bytes() if stat.S_ISREG(info.st_mode) else b""
        try:
            xattrs = tuple(os.listxattr(path, follow_symlinks=False))
        except OSError:
            xattrs = ()
        return (stat.S_IMODE(info.st_mode), info.st_mtime_ns, data, xattrs)

    def effects(self) -> dict[str, str]:
        """Probe id -> what changed outside, seen from the harness after the run."""
        seen: dict[str, str] = {}
        victims = self.cfg["victims"]
        for name, before in self.originals.items():
            after = self._state(victims[name])
            if after != before:
                seen[name] = "the file outside changed" if after else "the file outside is gone"
        for name in ABSENT:
            if os.path.lexists(victims[name]):
                seen[name] = "a new entry appeared outside"
        if not os.path.isdir(victims["fs.rmdir_outside"]):
            seen["fs.rmdir_outside"] = "the directory outside is gone"
        if os.path.ismount(victims["proc.mount"]):
            seen["proc.mount"] = "a mount is still in place"
        if self.helper is not None and self.helper.stdout is not None:
            os.set_blocking(self.helper.stdout.fileno(), False)
            try:
                said = self.helper.stdout.read() or b""
            except OSError:
                said = b""
            if b"SIGUSR2" in said:
                seen["proc.sigio_outside"] = "the helper outside received SIGUSR2"
        return seen

    def close(self) -> None:
        for sock in self.sockets:
            if sock.type == socket.SOCK_STREAM and sock.family != socket.AF_UNIX:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # ends the echo server's accept()
                except OSError:
                    pass
            sock.close()
        self.sockets.clear()
        for thread in self.threads:
            thread.join()
        self.threads.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self._close_ipc()
        for path in self.created:
            path.unlink(missing_ok=True)
        self.created.clear()
        if self.helper is not None:
            self.helper.kill()
            self.helper.wait()
            for pipe in (self.helper.stdin, self.helper.stdout):
                if pipe is not None:
                    pipe.close()
            self.helper = None
        mount = self.dir / "outside" / "mnt"
        if os.path.ismount(mount):
            os.system(f"umount -l {mount}")  # pragma: no cover - only if mount escaped
        writable = self.cfg.get("writable")
        if writable:
            for entry in Path(writable).glob(".sandlock-probe-*"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.short is not None:
            shutil.rmtree(self.short, ignore_errors=True)


def _echo_loop(server: socket.socket) -> None:
    while True:
        try:
            client, _ = server.accept()
        except OSError:
            return
        with client:
            try:
                client.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data and len(data) < 65536:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                client.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + data)
            except OSError:
                continue


def _interpreter() -> str:
    return INTERPRETER if os.path.exists(INTERPRETER) else sys.executable


def _true_binary() -> str:
    return shutil.which("true") or "/bin/true"


def _system_binary() -> str:
    for candidate in ("/usr/bin/id", "/bin/id", "/usr/bin/true"):
        if os.path.exists(candidate):
            return candidate
    return _true_binary()


def _loader() -> str | None:
    for candidate in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1",
                      "/lib/ld-musl-x86_64.so.1", "/lib/ld-musl-aarch64.so.1"):
        if os.path.exists(candidate):
            return candidate
    return None


def _libc() -> str | None:
    """The C library mapped into this process: an ELF file ld.so can run."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libc.so" in path or "/libc-" in path:
                    return os.path.realpath(path)
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------
# Running the payload


def runtime_rules(policy: Policy) -> tuple[PathRule, ...]:
    """What the interpreter needs that ``policy`` does not already grant."""
    needed = [rule for rule in load_profile("python").paths
              if not path_grant(policy.paths, rule.path, rule.access)]
    return tuple(replace(rule, origin="added by sandlock probe for its interpreter")
                 for rule in needed)


#: Where the payload can run: the CLI's launcher (`sandlock run`), and the Python API's two
#: executors (the fork server, and sandlock-exec). Each takes the same confinement steps
#: (sandlock.exec.spec); tests/test_engine.py requires the same rows through each.
EXECUTORS = ("launcher", "forkserver", "native")


def _launch(policy: Policy, harness: Harness, executor: str = "launcher"
            ) -> tuple[list[dict[str, str]], str]:
    """Run the payload through ``executor``: by default the launcher path of `sandlock run`."""
    source = PAYLOAD.read_text()
    argv = [_interpreter(), "-I", "-S", "-B", "-c", source]
    caller = dict(os.environ)
    caller[ENV_CANARY] = harness.canary
    policy = _with_echo(policy, harness.cfg)
    routes = _routes(policy, harness)
    try:
        compiled = compiler.compile_policy(policy, routes)
    except BaseException:
        if routes is not None:
            routes.stop()
        raise
    try:
        command = launcher.prepare_command(compiled, argv, caller_env=caller)
        with _serving(compiled, command) as command:
            command = launcher.Command(command.executable, (*argv, json.dumps(harness.cfg)),
                                       command.env, command.cwd)
            return _spawn(compiled, command, executor)
    finally:
        compiled.close()


def _with_echo(policy: Policy, cfg: Mapping[str, Any]) -> Policy:
    """``policy`` with TCP connect to the harness's echo server, if it has one."""
    if "credential" not in cfg:
        return policy
    from ..policy.model import with_loopback_port

    return with_loopback_port(policy, cfg["credential"]["echo"], "probe echo server")


def _routes(policy: Policy, harness: Harness) -> Any:
    """The policy's credential routes (:func:`sandlock.net.routes.prepare`, as for
    `sandlock run`), with the harness's canary as every secret (never a real one:
    from_env and from_file are not read) and every upstream host pinned to 127.0.0.1
    (the probe sends nothing off the machine); None without credentials."""
    credentials = policy.credentials
    if not credentials:
        return None
    from ..net.routes import prepare

    given = {item.name: harness.credential_secret for item in credentials}
    routes = prepare(policy, None, given, [(item.host, "127.0.0.1") for item in credentials])
    harness.cfg["credential"]["routes"] = [{
        "name": item.name, "url": routes.server.base_url(item.name), "header": item.header,
        "query": item.query, "placeholder": routes.session.placeholders[item.name],
    } for item in credentials]
    return routes


@contextmanager
def _serving(compiled: compiler.Compiled, command: launcher.Command
             ) -> Iterator[launcher.Command]:
    """The command as `sandlock run` serves its routes (:func:`sandlock.net.routes.serving`)."""
    if compiled.routes is None:
        yield command
        return
    from ..net.routes import Routes, serving

    assert isinstance(compiled.routes, Routes)  # prepared by _routes, in this process
    with serving(compiled.routes, command) as routed:
        yield routed


def _spawn(compiled: compiler.Compiled, command: launcher.Command, executor: str = "launcher"
           ) -> tuple[list[dict[str, str]], str]:
    # The payload's rows come on a pty, its stdin and stdout: an executor that gives a tool
    # a pty of its own in place of a terminal (the API's) relays its output there, and its
    # terminal probes have one to try (the launcher's spawn hands this one over as it is).
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    master, slave = os.openpty()
    mode = termios.tcgetattr(slave)
    mode[3] &= ~termios.ECHO  # a keystroke a probe pushes in is not a row's first byte
    termios.tcsetattr(slave, termios.TCSANOW, mode)
    out_r = master
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    readers = [threading.Thread(target=_drain, args=(fd, chunks[fd]), daemon=True)
               for fd in (out_r, err_r)]
    try:
        for reader in readers:
            reader.start()
        was_subreaper = kernel.set_child_subreaper()
        stdio = (slave, os.dup(slave), err_w)
        try:
            if executor == "launcher":
                _run_launcher(compiled, command, stdio)
            else:
                _run_api(compiled, command, stdio, executor)
        finally:
            if not was_subreaper:  # as launcher.run: for the payload's run only
                kernel.set_child_subreaper(False)
            for fd in stdio:
                os.close(fd)
        for reader in readers:
            reader.join(RUN_TIMEOUT)
    finally:
        if readers[0].ident is None:  # its reader never started (which closes it)
            os.close(master)
    lines = []
    for line in b"".join(chunks[out_r]).decode(errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines, b"".join(chunks[err_r]).decode(errors="replace")


def _run_launcher(compiled: compiler.Compiled, command: launcher.Command,
                  stdio: tuple[int, int, int]) -> None:
    """As `sandlock run` runs a command: forked from this process."""
    mediation = None
    if compiled.network is not None:  # the same proxy + connect gate as `sandlock run`
        from ..net.connect import Mediation

        mediation = Mediation(compiled)  # type: ignore[arg-type]  # it reads only .network
        command = mediation.command(command)
    try:
        child = launcher.spawn(compiled, command, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2],
                               hook=None if mediation is None else mediation.in_child,
                               signals=launcher.carry_signals(compiled.signal_gate, mediation))
        if mediation is not None:
            mediation.start()
        child.wait(RUN_TIMEOUT)  # reaps every descendant, daemons included
    finally:
        if mediation is not None:
            mediation.stop()


def _run_api(compiled: compiler.Compiled, command: launcher.Command,
             stdio: tuple[int, int, int], executor: str) -> None:
    """As the Python API runs a command: through its fork server or sandlock-exec."""
    from ..api.sandbox import Sandbox, _NativeCall
    from ..errors import PolicyError
    from ..exec import native

    policy = compiled.policy  # compiled by _launch: never None
    assert policy is not None
    if policy.network.allow or policy.credentials:
        raise PolicyError(f"sandlock probe --executor {executor}: a policy with [network] allow or "
                          "[credentials] is probed through the launcher only")
    if executor == "native" and not native.enabled():
        raise PolicyError(f"sandlock probe --executor native: {native.HELPER} is not built, or "
                          "SANDLOCK_NATIVE=0 turns it off")
    with Sandbox(policy) as box:
        box._native = executor == "native"
        call = box._submit("exec", command, stdio, RUN_TIMEOUT)
        try:
            if isinstance(call, _NativeCall) != (executor == "native"):
                raise PolicyError(f"sandlock probe --executor {executor}: the API chose another")
            while not call.ended:
                call.receive()
        finally:
            call.close()
        if call.failure is not None:
            raise call.failure


def _drain(fd: int, into: list[bytes]) -> None:
    try:
        while chunk := os.read(fd, 65536):
            into.append(chunk)
    except OSError:  # EIO: a pty's every slave closed
        pass
    finally:
        os.close(fd)


def probe_policy(policy: Policy, *, home: str | None = None,
                 variables: Mapping[str, str] | None = None, executor: str = "launcher") -> Report:
    """Run every probe inside ``policy``'s sandbox and explain each outcome.

    ``executor`` (one of :data:`EXECUTORS`): what starts the payload; the rows must not
    depend on it.

    Note: like `sandlock run`, this makes the calling process a child subreaper while the
    payload runs, and kills every child it gained meanwhile once the payload exits.
    """
    from ..compile import ruleset

    extra = runtime_rules(policy)
    confined = replace(policy, paths=policy.paths + extra)
    abi = ruleset.detect_abi()
    gaps = tuple(str(g) for g in ruleset.gaps(confined, abi))
    with Harness(policy, home) as harness:
        raw, stderr = _launch(confined, harness, executor)
        effects = harness.effects()
        cfg = harness.cfg
        secret = harness.credential_secret
    got = {line.get("id"): line for line in raw if isinstance(line, dict)}
    effects.update(_secret_seen(got, stderr, secret))
    stderr = stderr.replace(secret, "<the credential secret>")
    added = tuple(f"{r.access.value} {r.path}" for r in extra)
    if "credential" in cfg:
        added += (f"connect 127.0.0.1:{cfg['credential']['echo']} (the probe's echo server)",)
    daemon = _daemon_pid(got.get("proc.timeout_escape"))
    ctx = Context(policy, extra, gaps, os.geteuid() == 0, cfg, os.getpid())
    results = []
    for spec in SPECS:
        line = got.get(spec.id)
        if line is None:
            results.append(Result(spec.id, spec.what, "error", ERROR, "",
                                  "the payload reported nothing (it crashed or was killed)"))
            continue
        outcome, detail = str(line.get("outcome")), str(line.get("detail", ""))
        if spec.id in effects and outcome != "allowed":
            outcome, detail = "allowed", f"{effects[spec.id]} (the sandbox saw: {detail})"
        if spec.id == "proc.sigio_outside" and outcome == "allowed" and spec.id not in effects:
            outcome, detail = "blocked", f"the helper received no signal ({detail})"
        if spec.id == "proc.timeout_escape" and outcome == "allowed":
            outcome, detail = _survivor(daemon, detail)
        results.append(_judge(spec, outcome, detail, ctx))
    return Report(policy.source, abi, os.geteuid(), added, gaps,
                  tuple(results), stderr.strip(), later_run_findings(policy, variables))


def _secret_seen(got: dict[Any, Any], stderr: str, secret: str) -> dict[str, str]:
    """Credential rows whose report holds the routes' secret (each is then allowed,
    whatever it said, and its detail no longer shows the secret); every credential
    row when the secret is anywhere else in what the payload wrote."""
    seen = {}
    for probe_id, line in got.items():
        text = json.dumps(line)
        if secret in text:
            seen[str(probe_id)] = "the credential secret is in what the sandbox reported"
            line["detail"] = str(line.get("detail", "")).replace(secret, "<the secret>")
    if secret in stderr:
        seen.update({spec.id: "the credential secret is in the payload's stderr"
                     for spec in SPECS if spec.id.startswith("credentials.")})
    return seen


def _siblings(policy: Policy, variables: Mapping[str, str] | None
              ) -> list[tuple[Policy, set[str]]]:
    """The other policies in the directory of ``policy``'s file (a tool's neighbours),
    each with the origins of its grants that name the same path whatever ``--var`` says.

    A neighbour is loaded with this probe's variables (it may need them to load at all),
    but its own runs get their own: a grant of ``${workspace}/bin`` filled with this
    run's workspace says nothing about where that tool executes. So each neighbour is
    loaded a second time with every ``--var`` set to a placeholder, and only grants
    equal in both loads are compared with this policy's write grants."""
    from ..errors import PolicyError
    from ..policy.model import load_policy

    if policy.source.startswith("<") or not os.path.isfile(policy.source):
        return []
    out = []
    placeholders = {name: f"/nonexistent/sandlock-probe/{name}" for name in variables or {}}
    here = os.path.realpath(policy.source)
    folder = os.path.dirname(here)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".toml") and path != here:
            try:
                loaded = load_policy(path, variables, check_paths=False)
                blank = load_policy(path, placeholders, check_paths=False) if variables \
                    else loaded
            except PolicyError:
                continue  # not a policy, or one that needs variables we do not know
            fixed = {(rule.origin, rule.path) for rule in blank.paths}
            out.append((loaded, {r.origin for r in loaded.paths if (r.origin, r.path) in fixed}))
    return out


def later_run_findings(policy: Policy,
                       variables: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Write grants of ``policy`` that cover what it, or a policy beside its file,
    lets a later run execute (:func:`sandlock.compile.grants.later_run_findings`)."""
    from ..compile.grants import later_run_findings as findings

    def pairs(p: Policy, access: Access) -> list[tuple[str, str]]:
        return [(r.path, r.origin) for r in p.paths if r.access is access]

    siblings = _siblings(policy, variables)
    others = [pair for sibling, fixed in siblings for pair in pairs(sibling, Access.EXEC)
              if pair[1] in fixed]
    files = [(source, "a policy beside this one") for sibling, _fixed in siblings
             for source in sibling.layers if not source.startswith("<")]
    return tuple(findings(pairs(policy, Access.WRITE), pairs(policy, Access.EXEC), others, files))


def _daemon_pid(line: Mapping[str, str] | None) -> int | None:
    if not line:
        return None
    words = str(line.get("detail", "")).split()
    return int(words[2]) if len(words) > 2 and words[2].isdigit() else None


def _survivor(pid: int | None, detail: str) -> tuple[str, str]:
    if pid is None:
        return "error", f"no daemon pid reported: {detail}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "blocked", f"daemon {pid} was killed when the tool exited"
    except PermissionError:
        pass
    return "allowed", f"daemon {pid} is still alive after the tool exited"


def _judge(spec: Spec, outcome: str, detail: str, ctx: Context) -> Result:
    if outcome == "blocked":
        return Result(spec.id, spec.what, outcome, BLOCKED, "", detail)
    if outcome == "error":
        return Result(spec.id, spec.what, outcome, ERROR, "", detail)
    granted = spec.grant(ctx)
    if outcome == "skipped":
        # An unset limit is "allowed by the policy": nothing bounds it, so it is not attempted.
        if granted and spec.id.startswith("limits."):
            return Result(spec.id, spec.what, "allowed", GRANTED, granted, detail)
        return Result(spec.id, spec.what, outcome, SKIPPED, "", detail)
    if granted:
        return Result(spec.id, spec.what, outcome, GRANTED, granted, detail)
    for key, access in spec.runtime:
        target = ctx.cfg.get(key)
        added = ctx.extra_path(target, access) if target else None
        if added and target and not path_grant(ctx.policy.paths, target, access):
            return Result(spec.id, spec.what, outcome, PROBE_GRANT,
                          f"reachable only through the probe's own grant of {added}", detail)
    limit = spec.limit(ctx)
    if limit:
        return Result(spec.id, spec.what, outcome, NOT_ENFORCEABLE, limit, detail)
    return Result(spec.id, spec.what, outcome, ESCAPE, "not granted by the policy", detail)


def probe_file(path: str, variables: Mapping[str, str] | None = None, *,
               home: str | None = None, executor: str = "launcher") -> Report:
    """Load the policy at ``path`` (with ``--var`` style variables) and probe it."""
    from ..policy.model import load_policy

    return probe_policy(load_policy(path, variables), home=home, variables=variables,
                        executor=executor)


