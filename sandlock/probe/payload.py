"""The escape attempts `sandlock probe` runs *inside* the sandbox.

This file is not imported by sandlock: :mod:`sandlock.probe.harness` passes its source to
``/usr/bin/python3 -I -S -B -c`` (so the sandbox needs no read grant for it) with
one JSON argument describing the targets the harness prepared outside the
sandbox. Each probe makes the real syscall an attacker would make and prints one
JSON line ``{"id", "outcome", "detail"}``: ``allowed`` when the kernel let it
through, ``blocked`` with the errno when it did not, ``skipped`` when the
harness had nothing to aim at, ``error`` when the probe itself broke. Lines are
printed as they are produced, so a crash loses only the probe that crashed.

Only the standard library is used. Risky probes (bombs, clone, foreign-ABI
syscalls, anything that could change this process) run in a forked child.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import stat
import struct
import sys
import time
from typing import Any, Callable

Outcome = tuple[str, str]  #: ("allowed" | "blocked" | "skipped" | "error", detail)

# Descriptors open before we open anything: what the launcher let through.
_INHERITED = []
for _fd in range(3, 256):
    try:
        os.fstat(_fd)
        _INHERITED.append(_fd)
    except OSError:
        pass

CFG = json.loads(sys.argv[1])
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
MACHINE = os.uname().machine
#: Syscall numbers (kernel syscall tables) for the raw calls Python has no wrapper for.
NR = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "unshare": 272, "clone": 56, "mount": 165,
        "umount2": 166, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250,
        "add_key": 248, "personality": 135, "kexec_load": 246, "init_module": 175,
        "io_uring_setup": 425, "pidfd_getfd": 438, "pidfd_send_signal": 424, "clone3": 435,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "chroot": 161, "ioctl": 16,
        "getpid": 39, "setns": 308, "ioprio_set": 251,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "unshare": 97, "clone": 220, "mount": 40,
        "umount2": 39, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219,
        "add_key": 217, "personality": 92, "kexec_load": 104, "init_module": 105,
        "io_uring_setup": 425, "pidfd_getfd": 438, "pidfd_send_signal": 424, "clone3": 435,
        "name_to_handle_at": 264, "open_by_handle_at": 265, "chroot": 51, "ioctl": 29,
        "getpid": 172, "setns": 268, "ioprio_set": 30,
    },
}.get(MACHINE, {})


class Blocked(Exception):
    """The attempt failed: the sandbox (or the kernel) refused it."""


def emit(probe_id: str, outcome: str, detail: str = "") -> None:
    sys.stdout.write(json.dumps({"id": probe_id, "outcome": outcome, "detail": detail}) + "\n")
    sys.stdout.flush()


def why(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    if code:
        return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
    return f"{type(exc).__name__}: {exc}"


def sys_call(name: str, *args: Any) -> int:
    """A raw syscall; raise OSError on failure, return the result."""
    if name not in NR:
        raise Blocked(f"{name}: unknown on {MACHINE}")
    result = LIBC.syscall(NR[name], *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


Probe = Callable[[], Outcome]
PROBES: list[tuple[str, str | None, Probe]] = []


def probe(probe_id: str, needs: str | None = None) -> Callable[[Probe], Probe]:
    """Register a probe; ``needs`` names a config key without which it is skipped."""
    def register(fn: Probe) -> Probe:
        PROBES.append((probe_id, needs, fn))
        return fn
    return register


def in_child(fn: Callable[[], int], timeout: float = 10.0) -> tuple[str, int]:
    """Run ``fn`` in a forked child; return ("exit", code) or ("signal", signum).

    ``fn`` returns an exit code (0 = the attempt succeeded).
    """
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()
        except OSError as exc:
            code = exc.errno or 98
        except BaseException:  # noqa: BLE001 - the child must reach _exit whatever happens
            code = 97
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", 0
        time.sleep(0.005)
    if os.WIFSIGNALED(status):
        return "signal", os.WTERMSIG(status)
    return "exit", os.WEXITSTATUS(status)


def child_outcome(result: tuple[str, int], what: str) -> Outcome:
    kind, value = result
    if kind == "exit" and value == 0:
        return "allowed", what
    if kind == "exit":
        return "blocked", f"{errno.errorcode.get(value, value)}"
    if kind == "signal":
        return "blocked", f"killed by {signal.Signals(value).name}"
    return "blocked", "did not finish"


def read_file(path: str, size: int = 4096) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(size)


def writable() -> str | None:
    return CFG.get("writable") or None


def scratch(name: str) -> str:
    """A path in the first writable directory the policy grants."""
    return os.path.join(CFG["writable"], f".sandlock-probe-{name}")


# ---------------------------------------------------------------------------
# Filesystem


@probe("fs.read_outside")
def _() -> Outcome:
    data = read_file(CFG["secret"])
    return "allowed", f"read {len(data)} bytes"


@probe("fs.list_outside")
def _() -> Outcome:
    return "allowed", f"listed {len(os.listdir(CFG['outside']))} names"


@probe("fs.write_outside")
def _() -> Outcome:
    with open(CFG["victims"]["fs.write_outside"], "ab") as handle:
        handle.write(b"appended by the sandbox\n")
    return "allowed", "appended"


@probe("fs.overwrite_outside")
def _() -> Outcome:
    with open(CFG["victims"]["fs.overwrite_outside"], "wb") as handle:
        handle.write(b"overwritten by the sandbox\n")
    return "allowed", "overwritten"


@probe("fs.create_outside")
def _() -> Outcome:
    fd = os.open(CFG["victims"]["fs.create_outside"], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.close(fd)
    return "allowed", "created"


@probe("fs.truncate_outside")
def _() -> Outcome:
    os.truncate(CFG["victims"]["fs.truncate_outside"], 0)
    return "allowed", "truncated with truncate(2)"


@probe("fs.delete_outside")
def _() -> Outcome:
    os.unlink(CFG["victims"]["fs.delete_outside"])
    return "allowed", "deleted"


@probe("fs.rmdir_outside")
def _() -> Outcome:
    os.rmdir(CFG["victims"]["fs.rmdir_outside"])
    return "allowed", "removed directory"


@probe("fs.rename_outside")
def _() -> Outcome:
    source = CFG["victims"]["fs.rename_outside"]
    os.rename(source, source + ".renamed")
    return "allowed", "renamed within the outside directory"


@probe("fs.mkfifo_outside")
def _() -> Outcome:
    os.mkfifo(CFG["victims"]["fs.mkfifo_outside"])
    return "allowed", "made a FIFO"


@probe("fs.symlink_create_outside")
def _() -> Outcome:
    os.symlink("/etc/passwd", CFG["victims"]["fs.symlink_create_outside"])
    return "allowed", "made a symlink"


@probe("fs.rename_out_to_workspace", needs="writable")
def _() -> Outcome:
    os.rename(CFG["victims"]["fs.rename_out_to_workspace"], scratch("stolen"))
    return "allowed", "moved a file from outside into the workspace"


@probe("fs.rename_workspace_to_outside", needs="writable")
def _() -> Outcome:
    planted = scratch("planted")
    with open(planted, "wb") as handle:
        handle.write(b"planted\n")
    try:
        os.rename(planted, CFG["victims"]["fs.rename_workspace_to_outside"])
    finally:
        if os.path.exists(planted):
            os.unlink(planted)
    return "allowed", "moved a workspace file to outside"


@probe("fs.hardlink_into_workspace", needs="writable")
def _() -> Outcome:
    link = scratch("hardlink")
    os.link(CFG["secret"], link)
    data = read_file(link)
    return "allowed", f"linked and read {len(data)} bytes"


@probe("fs.hardlink_to_outside", needs="writable")
def _() -> Outcome:
    planted = scratch("planted-link")
    with open(planted, "wb") as handle:
        handle.write(b"planted\n")
    try:
        os.link(planted, CFG["victims"]["fs.hardlink_to_outside"])
    finally:
        os.unlink(planted)
    return "allowed", "linked a workspace file into outside"


@probe("fs.symlink_escape", needs="writable")
def _() -> Outcome:
    link = scratch("symlink")
    try:
        os.symlink(CFG["secret"], link)
    except OSError as exc:
        return "blocked", f"symlink: {why(exc)}"
    data = read_file(link)
    return "allowed", f"read {len(data)} bytes through a symlink"


@probe("fs.symlink_dir_escape", needs="writable")
def _() -> Outcome:
    link = scratch("symlink-dir")
    try:
        os.symlink(CFG["outside"], link)
    except OSError as exc:
        return "blocked", f"symlink: {why(exc)}"
    data = read_file(os.path.join(link, os.path.basename(CFG["secret"])))
    return "allowed", f"read {len(data)} bytes through a directory symlink"


@probe("fs.dotdot_traversal", needs="readable_dir")
def _() -> Outcome:
    base = CFG["readable_dir"]
    path = base + "/.." * base.count("/") + CFG["secret"]
    data = read_file(path)
    return "allowed", f"read {len(data)} bytes via {path}"


@probe("fs.dotdot_relative", needs="readable_dir")
def _() -> Outcome:
    os.chdir(CFG["readable_dir"])
    try:
        rel = os.path.relpath(CFG["secret"], CFG["readable_dir"])
        data = read_file(rel)
    finally:
        os.chdir("/")
    return "allowed", f"read {len(data)} bytes via {rel}"


@probe("fs.proc_self_root")
def _() -> Outcome:
    data = read_file("/proc/self/root" + CFG["secret"])
    return "allowed", f"read {len(data)} bytes"


@probe("fs.proc_self_cwd")
def _() -> Outcome:
    try:
        os.chdir(CFG["outside"])  # chdir is not a Landlock right: this may succeed
    except OSError as exc:
        return "blocked", f"chdir: {why(exc)}"
    try:
        name = os.path.basename(CFG["secret"])
        for path in (name, "/proc/self/cwd/" + name):
            try:
                data = read_file(path)
                return "allowed", f"read {len(data)} bytes via {path}"
            except OSError as exc:
                last = f"{path}: {why(exc)}"
    finally:
        os.chdir("/")
    return "blocked", last


@probe("fs.opath_reopen")
def _() -> Outcome:
    fd = os.open(CFG["secret"], os.O_PATH)  # O_PATH opens are not checked by Landlock
    try:
        for path in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}"):
            try:
                data = read_file(path)
                return "allowed", f"read {len(data)} bytes via {path}"
            except OSError as exc:
                last = f"{path}: {why(exc)}"
        dirfd = os.open(CFG["outside"], os.O_PATH | os.O_DIRECTORY)
        try:
            nfd = os.open(os.path.basename(CFG["secret"]), os.O_RDONLY, dir_fd=dirfd)
            os.close(nfd)
            return "allowed", "openat() through an O_PATH directory fd"
        except OSError as exc:
            last += f"; openat(O_PATH dir): {why(exc)}"
        finally:
            os.close(dirfd)
    finally:
        os.close(fd)
    return "blocked", last


@probe("fs.open_by_handle")
def _() -> Outcome:
    buf = ctypes.create_string_buffer(8 + 128)
    struct.pack_into("I", buf, 0, 128)
    mount_id = ctypes.c_int(0)
    sys_call("name_to_handle_at", -100, CFG["secret"].encode(), buf, ctypes.byref(mount_id), 0)
    fd = sys_call("open_by_handle_at", -100, buf, os.O_RDONLY)
    os.close(fd)
    return "allowed", "opened the file by handle"


@probe("fs.mknod_device", needs="writable")
def _() -> Outcome:
    os.mknod(scratch("device"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    return "allowed", "made a character device node in the workspace"


@probe("fs.hardlink_opath", needs="writable")
def _() -> Outcome:
    """Link an O_PATH descriptor (not checked at open) into the workspace."""
    fd = os.open(CFG["secret"], os.O_PATH)
    attempts = []
    try:
        calls: tuple[tuple[str, Callable[[], int]], ...] = (
            ("linkat(AT_EMPTY_PATH)",
             lambda: LIBC.linkat(fd, b"", -100, scratch("opath-link").encode(), 0x1000)),
            ("linkat(/proc/self/fd, AT_SYMLINK_FOLLOW)",
             lambda: LIBC.linkat(-100, f"/proc/self/fd/{fd}".encode(), -100,
                                 scratch("opath-link2").encode(), 0x400)),
        )
        for name, call in calls:
            if call() == 0:
                return "allowed", f"{name} made a link to the secret in the workspace"
            attempts.append(f"{name}: {errno.errorcode.get(ctypes.get_errno(), '?')}")
    finally:
        os.close(fd)
    return "blocked", "; ".join(attempts)


@probe("fs.rename_exchange", needs="writable")
def _() -> Outcome:
    mine = scratch("exchange")
    with open(mine, "wb") as handle:
        handle.write(b"planted\n")
    try:
        if LIBC.renameat2(-100, mine.encode(), -100,
                          CFG["victims"]["fs.rename_exchange"].encode(), 2) == 0:  # EXCHANGE
            return "allowed", "swapped a workspace file with a file outside"
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    finally:
        if os.path.exists(mine):
            os.unlink(mine)


@probe("fs.write_read_only_grant", needs="ro_file")
def _() -> Outcome:
    fd = os.open(CFG["ro_file"], os.O_WRONLY | os.O_APPEND)  # nothing is written
    os.close(fd)
    return "allowed", f"opened {CFG['ro_file']} for writing"


@probe("fs.create_in_read_only_grant", needs="ro_dir")
def _() -> Outcome:
    fd = os.open(os.path.join(CFG["ro_dir"], f".sandlock-probe-{CFG['token']}"),
                 os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    return "allowed", f"created a file in {CFG['ro_dir']}"


@probe("fs.inotify_outside")
def _() -> Outcome:
    fd = LIBC.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    try:
        if LIBC.inotify_add_watch(fd, CFG["outside"].encode(), 0xFFF) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)
    return "allowed", "watching a directory outside (names and events, not contents)"


@probe("fs.stat_outside")
def _() -> Outcome:
    info = os.stat(CFG["secret"])
    return "allowed", f"size {info.st_size}, owner {info.st_uid}"


@probe("fs.chmod_outside")
def _() -> Outcome:
    os.chmod(CFG["victims"]["fs.chmod_outside"], 0o777)
    return "allowed", "chmod 0777"


@probe("fs.chown_outside")
def _() -> Outcome:
    os.chown(CFG["victims"]["fs.chown_outside"], os.getuid(), os.getgid())
    return "allowed", "chown (to the caller's own ids: root could give the file away)"


@probe("fs.utime_outside")
def _() -> Outcome:
    os.utime(CFG["victims"]["fs.utime_outside"], (0, 0))
    return "allowed", "set the timestamps to 1970"


@probe("fs.xattr_outside")
def _() -> Outcome:
    os.setxattr(CFG["victims"]["fs.xattr_outside"], "user.sandlock_probe", b"from the sandbox")
    return "allowed", "wrote a user.* extended attribute"


# ---------------------------------------------------------------------------
# Exec


def spawn_status(argv: list[str], path: str | None = None
                 ) -> tuple[int | None, str | None]:
    """fork + execve; (exit code or -signal, None) or (None, errno text) if exec failed."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            null = os.open("/dev/null", os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
        except OSError:
            pass
        try:
            os.execv(path or argv[0], argv)
        except OSError as exc:
            os.write(wfd, str(exc.errno).encode())
        os._exit(127)
    os.close(wfd)
    report = os.read(rfd, 64)
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    if report:
        code = int(report)
        return None, f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
    return os.waitstatus_to_exitcode(status), None


def exec_outcome(argv: list[str], path: str | None = None) -> Outcome:
    code, failed = spawn_status(argv, path)
    if failed:
        return "blocked", f"execve: {failed}"
    if code == 0:
        return "allowed", f"ran, exit {code}"
    return "blocked", f"started but failed (exit {code}): it could not read or run the target"


@probe("exec.outside_binary")
def _() -> Outcome:
    return exec_outcome([CFG["prog_outside"]])


@probe("exec.system_binary")
def _() -> Outcome:
    return exec_outcome([CFG["system_binary"]])


@probe("exec.shebang_script")
def _() -> Outcome:
    return exec_outcome([CFG["script_outside"]])


@probe("exec.interpreter_script")
def _() -> Outcome:
    return exec_outcome([sys.executable, "-I", "-S", CFG["py_outside"]])


@probe("exec.ld_so_outside", needs="loader")
def _() -> Outcome:
    return exec_outcome([CFG["loader"], CFG["prog_outside"]])


@probe("exec.ld_so_readable", needs="ld_target")
def _() -> Outcome:
    return exec_outcome([CFG["loader"], CFG["ld_target"]])


@probe("exec.opath_execveat")
def _() -> Outcome:
    fd = os.open(CFG["prog_outside"], os.O_PATH)
    try:
        return exec_outcome([CFG["prog_outside"]], path=f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def tiny_elf() -> bytes | None:
    """A 132-byte static x86_64 program that exits with status 42: code the sandbox wrote."""
    if MACHINE != "x86_64":
        return None
    code = bytes([0xBF, 42, 0, 0, 0, 0xB8, 60, 0, 0, 0, 0x0F, 0x05])  # exit(42)
    base, size = 0x400000, 64 + 56 + 12
    header = (b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
              + struct.pack("<HHIQQQIHHHHHH", 2, 0x3E, 1, base + 120, 64, 0, 0, 64, 56, 1, 0, 0, 0))
    program = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000)
    return header + program + code


def run_fd(fd: int | None, path: str | None = None) -> int:
    """fork + exec of an fd (fexecve) or a path; the exit code, or 100 + errno if exec failed."""
    pid = os.fork()
    if pid == 0:
        try:
            os.execve(path if path is not None else int(fd or 0), ["probe"], {})
        except OSError as exc:
            os._exit(100 + (exc.errno or 0) % 100)
        os._exit(99)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def ran(code: int, what: str) -> Outcome:
    if code == 42:
        return "allowed", what
    if code >= 100:
        err = code - 100
        return "blocked", f"execve: {errno.errorcode.get(err, err)}"
    return "blocked", f"exit {code}"


@probe("exec.memfd")
def _() -> Outcome:
    elf = tiny_elf()
    if elf is None:
        return "skipped", "no built-in test program for this architecture"
    fd = os.memfd_create("sandlock-probe", 0)
    try:
        os.write(fd, elf)
        return ran(run_fd(fd), "executed a program written into a memfd (fexecve)")
    finally:
        os.close(fd)


@probe("exec.setuid_plant")
def _() -> Outcome:
    """Leave a set-user-id program behind (chmod, fchmod, open(O_CREAT), mknod). Without a
    writable grant, fchmod a pipe: the same syscall and mode, nothing left behind."""
    routes: dict[str, Callable[[], object]] = {}
    if writable():
        def chmod() -> None:
            target = scratch("setuid")
            open(target, "w").close()
            os.chmod(target, 0o4755)

        routes = {
            "chmod 4755": chmod,
            "open(O_CREAT, 06755)": lambda: os.close(os.open(
                scratch("setuid-open"), os.O_CREAT | os.O_WRONLY, 0o6755)),
            "mknod(S_IFREG | 04755)": lambda: os.mknod(scratch("setuid-mknod"),
                                                       stat.S_IFREG | 0o4755),
        }
    read_end, write_end = os.pipe()
    routes["fchmod 2755"] = lambda: os.fchmod(read_end, 0o2755)
    done, refused = [], []
    try:
        for what, attempt in routes.items():
            try:
                attempt()
                done.append(what)
            except OSError as exc:
                refused.append(f"{what}: {why(exc)}")
    finally:
        os.close(read_end)
        os.close(write_end)
        for name in ("setuid", "setuid-open", "setuid-mknod"):
            if writable() and os.path.lexists(scratch(name)):
                os.unlink(scratch(name))
    if done:
        return "allowed", f"set a set-id mode by {', '.join(done)}"
    return "blocked", "; ".join(refused)


@probe("exec.written_binary", needs="writable")
def _() -> Outcome:
    elf = tiny_elf()
    if elf is None:
        return "skipped", "no built-in test program for this architecture"
    path = scratch("program")
    with open(path, "wb") as handle:
        handle.write(elf)
    os.chmod(path, 0o755)
    try:
        return ran(run_fd(None, path), "executed a program written into the workspace")
    finally:
        os.unlink(path)


@probe("exec.read_granted_file", needs="ld_target")
def _() -> Outcome:
    return exec_outcome([CFG["ld_target"]])


@probe("exec.setuid_no_new_privs")
def _() -> Outcome:
    PR_GET_NO_NEW_PRIVS = 39
    value = LIBC.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0)
    if value == 1:
        return "blocked", "no_new_privs is set: setuid bits and file capabilities are ignored"
    return "allowed", f"no_new_privs is {value}: a setuid binary would gain privileges"


# ---------------------------------------------------------------------------
# Secrets


@probe("secrets.env_canary")
def _() -> Outcome:
    name, value = CFG["env_canary"]
    leaked = [k for k, v in os.environ.items() if value in v]
    if leaked:
        return "allowed", f"the caller's secret is in the environment as {', '.join(leaked)}"
    return "blocked", f"{name} not passed ({len(os.environ)} variables present)"


@probe("secrets.ssh_key", needs="ssh_key")
def _() -> Outcome:
    data = read_file(CFG["ssh_key"])
    return "allowed", f"read {len(data)} bytes of {CFG['ssh_key']}"


@probe("secrets.home_listing", needs="home")
def _() -> Outcome:
    return "allowed", f"listed {len(os.listdir(CFG['home']))} names in {CFG['home']}"


@probe("secrets.etc_shadow")
def _() -> Outcome:
    data = read_file(CFG["shadow"])
    return "allowed", f"read {len(data)} bytes"


@probe("secrets.parent_environ")
def _() -> Outcome:
    data = read_file(f"/proc/{os.getppid()}/environ")
    return "allowed", f"read {len(data)} bytes of the launcher's environment"


@probe("secrets.parent_mem")
def _() -> Outcome:
    fd = os.open(f"/proc/{os.getppid()}/mem", os.O_RDONLY)
    os.close(fd)
    return "allowed", "opened the launcher's memory"


@probe("secrets.helper_environ", needs="helper_pid")
def _() -> Outcome:
    data = read_file(f"/proc/{CFG['helper_pid']}/environ")
    leaked = CFG["env_canary"][1].encode() in data
    return "allowed", f"read {len(data)} bytes{' including the secret' if leaked else ''}"


@probe("secrets.helper_mem", needs="helper_pid")
def _() -> Outcome:
    fd = os.open(f"/proc/{CFG['helper_pid']}/mem", os.O_RDONLY)
    try:
        data = os.pread(fd, 256, CFG["helper_addr"])
    finally:
        os.close(fd)
    leaked = CFG["helper_canary"].encode() in data
    return "allowed", f"read {len(data)} bytes{' including the secret' if leaked else ''}"


@probe("secrets.inherited_fds")
def _() -> Outcome:
    found = []
    for fd in _INHERITED:
        try:
            data = os.pread(fd, 4096, 0)
        except OSError:
            data = b""
        found.append(f"{fd}{' (the secret)' if CFG['canary'].encode() in data else ''}")
    if found:
        return "allowed", f"descriptors open at start: {', '.join(found)}"
    return "blocked", f"no descriptor above 2 (the caller had fd {CFG['caller_fd']} open)"


# ---------------------------------------------------------------------------
# Credential routes: the secret the route attaches. The harness serves the policy's
# routes with a canary secret of its own; this payload never gets it, only its shape
# (CFG["credential"]["shape"]), and reports what it finds of that shape.


def secret_in(data: bytes) -> str | None:
    """The first value shaped like the route's secret in ``data``."""
    import re

    found = re.search(CFG["credential"]["shape"].encode(), data)
    return found.group(0).decode() if found else None


def route_request(url: str, headers: list[tuple[str, str]]) -> tuple[int, bytes]:
    """One HTTP/1.0 GET to ``url`` (http://127.0.0.1:PORT/path); (status, whole answer)."""
    host_port, _, path = url.split("://", 1)[1].partition("/")
    host, _, port = host_port.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        head = f"GET /{path} HTTP/1.0\r\nHost: {host_port}\r\n" + "".join(
            f"{n}: {v}\r\n" for n, v in headers) + "\r\n"
        sock.sendall(head.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    words = data.split(b"\r\n", 1)[0].split()
    return (int(words[1]) if len(words) > 1 and words[1].isdigit() else 0), data


@probe("credentials.env", needs="credential")
def _() -> Outcome:
    for name, value in os.environ.items():
        if secret_in(f"{name}={value}".encode()):
            return "allowed", f"the secret is in the environment ({name})"
    held = sorted(n for n, v in os.environ.items() if v.startswith("sandlock-placeholder-"))
    return "blocked", (f"not among {len(os.environ)} variables (placeholders only: "
                       f"{', '.join(held) or 'none'})")


@probe("credentials.parent_environ", needs="credential")
def _() -> Outcome:
    data = read_file(f"/proc/{os.getppid()}/environ", 1 << 20)
    found = secret_in(data)
    return "allowed", (f"the secret is in the launcher's environment: {found}" if found else
                       f"read {len(data)} bytes of the launcher's environment (a from_env "
                       "secret would be there)")


@probe("credentials.parent_mem", needs="credential")
def _() -> Outcome:
    """Open the launcher's memory, then scan what it maps read-write for the secret."""
    ppid = os.getppid()
    fd = os.open(f"/proc/{ppid}/mem", os.O_RDONLY)
    try:
        scanned = 0
        with open(f"/proc/{ppid}/maps") as maps:
            regions = [line.split() for line in maps]
        for fields in regions:
            if not fields[1].startswith("rw"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for offset in range(start, end, 1 << 20):
                try:
                    data = os.pread(fd, min(1 << 20, end - offset) + 64, offset)
                except OSError:
                    break
                scanned += len(data)
                found = secret_in(data)
                if found:
                    return "allowed", f"the secret is in the launcher's memory: {found}"
        return "allowed", f"opened the launcher's memory and read {scanned} bytes of it"
    finally:
        os.close(fd)


@probe("credentials.proc_environ", needs="credential")
def _() -> Outcome:
    """Every /proc/N/environ this process can read."""
    read, refused = 0, 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            data = read_file(f"/proc/{entry}/environ", 1 << 20)
        except OSError:
            refused += 1
            continue
        read += 1
        found = secret_in(data)
        if found:
            return "allowed", f"the secret is in /proc/{entry}/environ: {found}"
    return "blocked", f"not in the {read} environments readable (its own); {refused} refused"


@probe("credentials.route_without_placeholder", needs="credential")
def _() -> Outcome:
    """Ask the route for its upstream without this run's placeholder: none, a guessed
    key, a guessed placeholder, the placeholder of another credential's shape."""
    answers = []
    for route in CFG["credential"]["routes"]:
        guessed = "sandlock-placeholder-" + route["name"] + "-" + "A" * 32
        for label, value in (("none", None), ("guessed key", "sk-guess"),
                             ("guessed placeholder", guessed)):
            url, headers = route["url"] + "/", []
            if value is not None and route["query"]:
                url += f"?{route['query']}={value}"
            elif value is not None:
                headers.append((route["header"], f"Bearer {value}"))
            status, data = route_request(url, headers)
            found = secret_in(data)
            if found:
                return "allowed", f"the route answered with the secret ({label}): {found}"
            answers.append((route["name"], label, status, b"placeholder" in data))
    through = [a for a in answers if a[2] != 403 or not a[3]]
    if through:
        return "allowed", "the route did not refuse: " + ", ".join(
            f"{n} {label} -> {status}" for n, label, status, _ in through)
    return "blocked", f"{len(answers)} requests refused with 403 (no placeholder of this run)"


@probe("credentials.placeholder_echo", needs="credential")
def _() -> Outcome:
    """Send the placeholder, where the secret goes, to another loopback server that
    echoes what it receives: only the route ever swaps it for the secret."""
    echoed = []
    for route in CFG["credential"]["routes"]:
        place = route["placeholder"]
        url = f"http://127.0.0.1:{CFG['credential']['echo']}/{route['name']}/"
        headers = [("Authorization", f"Bearer {place}")]
        if route["header"] and route["header"].lower() != "authorization":
            headers.append((route["header"], place))
        if route["query"]:
            url += f"?{route['query']}={place}"
        _, data = route_request(url, headers)
        found = secret_in(data)
        if found:
            return "allowed", f"the echo holds the secret: {found}"
        if place.encode() not in data:
            return "error", f"the echo server did not echo the request ({len(data)} bytes)"
        echoed.append(route["name"])
    return "blocked", f"the echo holds the placeholder only ({', '.join(echoed)})"


# ---------------------------------------------------------------------------
# Network


def tcp(family: int = socket.AF_INET, proto: int = 0) -> socket.socket:
    return socket.socket(family, socket.SOCK_STREAM, proto)


def try_listen(sock: socket.socket) -> str:
    try:
        sock.listen(1)
        return "and listening"
    except OSError as exc:
        return f"(listen: {why(exc)})"


def connect_probe(family: int, address: Any, what: str) -> Outcome:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(3)
        sock.connect(address)
        return "allowed", what
    finally:
        sock.close()


@probe("net.tcp_connect_denied_port")
def _() -> Outcome:
    port = CFG["ports"]["tcp_denied"]
    return connect_probe(socket.AF_INET, ("127.0.0.1", port), f"connected to 127.0.0.1:{port}")


@probe("net.tcp6_connect_denied_port", needs="tcp6")
def _() -> Outcome:
    port = CFG["tcp6"]
    return connect_probe(socket.AF_INET6, ("::1", port), f"connected to [::1]:{port}")


@probe("net.tcp_connect_granted_port", needs="tcp_granted")
def _() -> Outcome:
    port = CFG["tcp_granted"]
    return connect_probe(socket.AF_INET, ("127.0.0.1", port), f"connected to 127.0.0.1:{port}")


@probe("net.tcp_fastopen")
def _() -> Outcome:
    port = CFG["ports"]["tcp_denied"]
    sock = tcp()
    try:
        sock.sendto(b"x", 0x20000000, ("127.0.0.1", port))  # MSG_FASTOPEN
        return "allowed", f"sendto(MSG_FASTOPEN) to 127.0.0.1:{port}"
    finally:
        sock.close()


@probe("net.tcp_bind_denied_port")
def _() -> Outcome:
    port = CFG["ports"]["bind_denied"]
    sock = tcp()
    try:
        sock.bind(("127.0.0.1", port))
        return "allowed", f"bound 127.0.0.1:{port} {try_listen(sock)}"
    finally:
        sock.close()


@probe("net.tcp_bind_ephemeral")
def _() -> Outcome:
    sock = tcp()
    try:
        sock.bind(("127.0.0.1", 0))
        return "allowed", f"bound 127.0.0.1:{sock.getsockname()[1]} {try_listen(sock)}"
    finally:
        sock.close()


@probe("net.tcp_listen_autobind")
def _() -> Outcome:
    sock = tcp()
    try:
        sock.listen(1)  # no bind(): the kernel picks a port
        return "allowed", f"listening on port {sock.getsockname()[1]} without bind()"
    finally:
        sock.close()


@probe("net.udp_send")
def _() -> Outcome:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.sendto(CFG["canary"].encode(), ("127.0.0.1", CFG["ports"]["udp"]))
        return "allowed", f"sent a datagram to 127.0.0.1:{CFG['ports']['udp']}"
    finally:
        sock.close()


@probe("net.icmp_socket")
def _() -> Outcome:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP).close()
    return "allowed", "created an ICMP (ping) socket"


@probe("net.raw_socket")
def _() -> Outcome:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
    return "allowed", "created a raw socket"


@probe("net.packet_socket")
def _() -> Outcome:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close()
    return "allowed", "created a packet socket"


@probe("net.netlink_socket")
def _() -> Outcome:
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()  # NETLINK_ROUTE
    return "allowed", "created a NETLINK_ROUTE socket"


@probe("net.mptcp")
def _() -> Outcome:
    sock = tcp(proto=262)  # IPPROTO_MPTCP: not covered by Landlock's TCP rules
    try:
        sock.settimeout(3)
        sock.connect(("127.0.0.1", CFG["ports"]["tcp_denied"]))
        return "allowed", "MPTCP connect to the denied port"
    finally:
        sock.close()


def proxy_url() -> Any:
    from urllib.parse import urlsplit

    url = os.environ.get("HTTP_PROXY")
    return urlsplit(url) if url else None


@probe("net.proxy_port_elsewhere")
def _() -> Outcome:
    if proxy_url() is None:
        return "skipped", "no [network] allow, so no proxy"
    port = proxy_url().port  # Landlock port rules are per port: must not reach 127.0.0.2:PORT
    return connect_probe(socket.AF_INET, ("127.0.0.2", port), f"connected to 127.0.0.2:{port}")


@probe("net.proxy_unlisted_host")
def _() -> Outcome:
    import base64

    url = proxy_url()
    if url is None:
        return "skipped", "no [network] allow, so no proxy"
    auth = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    try:
        sock.sendall(f"CONNECT sandlock-probe.invalid:443 HTTP/1.1\r\n"
                     f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
        status = sock.recv(200).split(b"\r\n")[0].decode(errors="replace")
    finally:
        sock.close()
    if " 200 " in status + " ":
        return "allowed", "the proxy opened a tunnel to sandlock-probe.invalid:443"
    return "blocked", status


@probe("net.sctp")
def _() -> Outcome:
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        try:
            socket.socket(socket.AF_INET, kind, 132).close()  # IPPROTO_SCTP
            return "allowed", "created an SCTP socket"
        except OSError as exc:
            last = why(exc)
    return "blocked", last


@probe("net.other_families")
def _() -> Outcome:
    opened = []
    for family in range(1, 46):
        if family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
            continue
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):
            try:
                fd = socket.socket(family, kind).detach()
            except OSError:
                continue
            os.close(fd)
            opened.append(f"{family}/{kind}")
    if opened:
        return "allowed", f"created sockets of family/type {', '.join(opened)}"
    return "blocked", "every other address family refused"


@probe("net.unix_pathname_outside", needs="unix_path")
def _() -> Outcome:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(CFG["unix_path"])
        return "allowed", f"connected to {CFG['unix_path']} (an ssh-agent-like listener)"
    finally:
        sock.close()


@probe("net.unix_abstract_outside", needs="abstract")
def _() -> Outcome:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + CFG["abstract"])
        return "allowed", f"connected to the abstract socket @{CFG['abstract']}"
    finally:
        sock.close()


@probe("net.unix_bind_outside")
def _() -> Outcome:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(CFG["victims"]["net.unix_bind_outside"])
        return "allowed", "created a socket file outside"
    finally:
        sock.close()


@probe("net.io_uring")
def _() -> Outcome:
    params = ctypes.create_string_buffer(120)
    fd = sys_call("io_uring_setup", 4, params)
    os.close(fd)
    return "allowed", "created an io_uring instance (it bypasses seccomp and socket checks)"


# ---------------------------------------------------------------------------
# Processes


@probe("proc.signal_outside", needs="helper_pid")
def _() -> Outcome:
    os.kill(CFG["helper_pid"], signal.SIGUSR1)  # the helper ignores SIGUSR1
    return "allowed", f"signalled pid {CFG['helper_pid']}"


@probe("proc.signal_parent")
def _() -> Outcome:
    os.kill(os.getppid(), 0)
    return "allowed", "signal 0 to the launcher succeeded"


@probe("proc.pidfd_signal", needs="helper_pid")
def _() -> Outcome:
    fd = os.pidfd_open(CFG["helper_pid"])
    try:
        sys_call("pidfd_send_signal", fd, signal.SIGUSR1, None, 0)
    finally:
        os.close(fd)
    return "allowed", "pidfd_send_signal to the helper"


@probe("proc.pidfd_getfd", needs="helper_pid")
def _() -> Outcome:
    fd = os.pidfd_open(CFG["helper_pid"])
    try:
        stolen = sys_call("pidfd_getfd", fd, 0, 0)
        os.close(stolen)
    finally:
        os.close(fd)
    return "allowed", "took a copy of the helper's stdin"


@probe("proc.ptrace_outside", needs="helper_pid")
def _() -> Outcome:
    PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17
    sys_call("ptrace", PTRACE_SEIZE, CFG["helper_pid"], 0, 0)
    sys_call("ptrace", PTRACE_DETACH, CFG["helper_pid"], 0, 0)
    return "allowed", "attached to the helper with ptrace"


@probe("proc.process_vm_readv", needs="helper_pid")
def _() -> Outcome:
    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    buf = ctypes.create_string_buffer(256)
    local = Iovec(ctypes.cast(buf, ctypes.c_void_p), 256)
    remote = Iovec(CFG["helper_addr"], 256)
    count = sys_call("process_vm_readv", CFG["helper_pid"], ctypes.byref(local), 1,
                     ctypes.byref(remote), 1, 0)
    leaked = CFG["helper_canary"].encode() in buf.raw
    secret = " including the secret" if leaked else ""
    return "allowed", f"read {count} bytes of the helper's memory{secret}"


def unshare_probe(flag: int, name: str) -> Outcome:
    return child_outcome(in_child(lambda: sys_call("unshare", flag) and 0), f"unshare({name})")


@probe("proc.userns")
def _() -> Outcome:
    return unshare_probe(0x10000000, "CLONE_NEWUSER")


@probe("proc.mountns")
def _() -> Outcome:
    return unshare_probe(0x00020000, "CLONE_NEWNS")


@probe("proc.netns")
def _() -> Outcome:
    return unshare_probe(0x40000000, "CLONE_NEWNET")


@probe("proc.clone_newuser")
def _() -> Outcome:
    def attempt() -> int:
        pid = sys_call("clone", 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        return 0
    return child_outcome(in_child(attempt), "clone(CLONE_NEWUSER)")


@probe("proc.clone3")
def _() -> Outcome:
    args = ctypes.create_string_buffer(88)
    struct.pack_into("Q", args, 0, 0x10000000)  # flags = CLONE_NEWUSER
    struct.pack_into("Q", args, 32, signal.SIGCHLD)  # exit_signal

    def attempt() -> int:
        pid = sys_call("clone3", args, 88)
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        return 0
    return child_outcome(in_child(attempt), "clone3(CLONE_NEWUSER)")


@probe("proc.mount")
def _() -> Outcome:
    target = CFG["victims"]["proc.mount"]

    def attempt() -> int:
        sys_call("mount", b"none", target.encode(), b"tmpfs", 0, None)
        sys_call("umount2", target.encode(), 2)  # MNT_DETACH
        return 0
    return child_outcome(in_child(attempt), f"mounted a tmpfs on {target}")


@probe("proc.chroot")
def _() -> Outcome:
    return child_outcome(in_child(lambda: sys_call("chroot", b"/") and 0), "chroot(/)")


@probe("proc.sigio_outside", needs="helper_pid")
def _() -> Outcome:
    """Ask the kernel to signal another process on I/O (F_SETOWN + F_SETSIG); the
    harness checks whether the helper received SIGUSR2."""
    import fcntl
    rfd, wfd = os.pipe()
    try:
        fcntl.fcntl(rfd, fcntl.F_SETOWN, CFG["helper_pid"])
        fcntl.fcntl(rfd, 10, signal.SIGUSR2)  # F_SETSIG
        fcntl.fcntl(rfd, fcntl.F_SETFL, os.O_ASYNC)
        os.write(wfd, b"x")
    finally:
        os.close(rfd)
        os.close(wfd)
    return "allowed", "armed SIGIO to the helper and triggered it"


@probe("proc.prlimit_outside", needs="helper_pid")
def _() -> Outcome:
    import resource
    resource.prlimit(CFG["helper_pid"], resource.RLIMIT_CORE, (0, 0))
    return "allowed", "changed a resource limit of a process outside (RLIMIT_CPU would kill it)"


@probe("proc.sched_outside", needs="helper_pid")
def _() -> Outcome:
    """Scheduling knobs of another process: Landlock has no hook for them."""
    pid = CFG["helper_pid"]
    attempts: dict[str, Callable[[], Any]] = {
        "setpriority": lambda: os.setpriority(os.PRIO_PROCESS, pid, 19),
        "sched_setaffinity": lambda: os.sched_setaffinity(pid, os.sched_getaffinity(pid)),
        "sched_setscheduler": lambda: os.sched_setscheduler(pid, os.SCHED_IDLE,
                                                            os.sched_param(0)),
        "ioprio_set": lambda: sys_call("ioprio_set", 1, pid, 3 << 13),  # WHO_PROCESS, IDLE
    }
    done, refused = [], []
    for name, attempt in attempts.items():
        try:
            attempt()
            done.append(name)
        except (OSError, Blocked) as exc:
            refused.append(f"{name}: {why(exc)}")
    if done:
        return "allowed", f"changed another process with {', '.join(done)}"
    return "blocked", "; ".join(refused)


@probe("ipc.sysv_shm_outside", needs="shm_id")
def _() -> Outcome:
    LIBC.shmat.restype = ctypes.c_void_p
    address = LIBC.shmat(CFG["shm_id"], None, 0o10000)  # SHM_RDONLY
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    data = ctypes.string_at(address, 64)
    LIBC.shmdt(ctypes.c_void_p(address))
    leaked = CFG["canary"].encode() in data
    return "allowed", f"attached SysV shared memory made outside{' (the secret)' * leaked}"


@probe("ipc.sysv_msg_outside", needs="msg_id")
def _() -> Outcome:
    buf = ctypes.create_string_buffer(8 + 128)
    count = LIBC.msgrcv(CFG["msg_id"], buf, 128, 0, 0o4000)  # IPC_NOWAIT
    if count < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    leaked = CFG["canary"].encode() in buf.raw
    return "allowed", f"received from a SysV message queue outside{' (the secret)' * leaked}"


@probe("ipc.posix_shm_outside", needs="posix_shm")
def _() -> Outcome:
    data = read_file(CFG["posix_shm"])
    return "allowed", f"read {len(data)} bytes of {CFG['posix_shm']}"


@probe("ipc.posix_mqueue_outside", needs="mqueue")
def _() -> Outcome:
    if not hasattr(LIBC, "mq_open"):
        return "skipped", "mq_open is not in this C library"
    LIBC.mq_open.restype = ctypes.c_int
    fd = LIBC.mq_open(CFG["mqueue"].encode(), os.O_RDONLY | os.O_NONBLOCK)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.close(fd)
    return "allowed", f"opened the POSIX message queue {CFG['mqueue']}"


@probe("proc.timeout_escape")
def _() -> Outcome:
    """Leave a daemon behind (setsid + double fork); the harness checks it died."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
        except OSError:
            pass  # refused below Landlock ABI 6 (the signal gate's session): detach anyway
        if os.fork() == 0:
            os.write(wfd, str(os.getpid()).encode())
            for fd in (0, 1, 2):
                os.close(fd)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            time.sleep(120)
        os._exit(0)
    os.close(wfd)
    daemon = int(os.read(rfd, 32) or 0)
    os.close(rfd)
    os.waitpid(pid, 0)
    return "allowed", f"daemon pid {daemon} detached (setsid + double fork)"


# ---------------------------------------------------------------------------
# Limits (only meaningful when the policy sets them; the harness decides)


def limit(name: str) -> Any:
    return CFG["limits"].get(name)


@probe("limits.fork_bomb", needs="limits.processes")
def _() -> Outcome:
    cap = limit("processes") + 16
    rfd, wfd = os.pipe()
    children = []
    failure = None
    try:
        for _ in range(cap):
            try:
                pid = os.fork()
            except OSError as exc:
                failure = exc
                break
            if pid == 0:
                os.close(wfd)
                os.read(rfd, 1)
                os._exit(0)
            children.append(pid)
    finally:
        os.close(wfd)
        os.close(rfd)
        for pid in children:
            os.waitpid(pid, 0)
    if failure is not None:
        return "blocked", f"fork failed after {len(children)} processes: {why(failure)}"
    return "allowed", f"forked {len(children)} processes (limit {limit('processes')})"


@probe("limits.memory_bomb", needs="limits.memory")
def _() -> Outcome:
    size = limit("memory") + (64 << 20)
    try:
        block = bytearray(size)
    except MemoryError:
        return "blocked", f"allocating {size >> 20} MiB failed (MemoryError)"
    del block
    return "allowed", f"allocated {size >> 20} MiB"


@probe("limits.file_size_bomb", needs="limits.file_size")
def _() -> Outcome:
    path = scratch("bigfile") if writable() else CFG["victims"]["fs.create_outside"] + ".big"
    size = limit("file_size")
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    except OSError as exc:
        return "blocked", f"nothing writable to grow: {why(exc)}"
    try:
        os.pwrite(fd, b"x", size)  # one byte past the limit, sparse
        return "allowed", f"wrote past {size} bytes"
    finally:
        os.close(fd)
        os.unlink(path)


@probe("limits.cpu_burn", needs="limits.cpu")
def _() -> Outcome:
    seconds = limit("cpu")
    if seconds > 2:
        soft, hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_CPU)
        if hard == seconds:
            return "blocked", f"RLIMIT_CPU is {hard} s in the sandbox (not burned: limit > 2 s)"
        return "allowed", f"RLIMIT_CPU is {soft}/{hard}, policy says {seconds}"

    def burn() -> int:
        end = time.monotonic() + seconds + 3
        while time.monotonic() < end:
            pass
        return 0
    return child_outcome(in_child(burn, timeout=seconds + 6), f"burned {seconds + 3} s of CPU")


@probe("limits.open_files", needs="limits.open_files")
def _() -> Outcome:
    cap = limit("open_files") + 16
    fds = []
    try:
        for _ in range(cap):
            fds.append(os.dup(1))
    except OSError as exc:
        return "blocked", f"dup failed after {len(fds)} new descriptors: {why(exc)}"
    finally:
        for fd in fds:
            os.close(fd)
    return "allowed", f"opened {len(fds)} descriptors (limit {limit('open_files')})"


@probe("limits.raise_limit", needs="limits.any")
def _() -> Outcome:
    import resource
    raised = []
    for name, res in (("cpu", resource.RLIMIT_CPU), ("memory", resource.RLIMIT_AS),
                      ("processes", resource.RLIMIT_NPROC), ("open_files", resource.RLIMIT_NOFILE),
                      ("file_size", resource.RLIMIT_FSIZE)):
        if limit(name) is None:
            continue
        soft, hard = resource.getrlimit(res)
        try:
            resource.setrlimit(res, (hard + 1, hard + 1))
            raised.append(name)
            resource.setrlimit(res, (soft, hard))  # lowering is always allowed
        except (OSError, ValueError):
            pass
    if raised:
        return "allowed", f"raised the hard limit of {', '.join(raised)}"
    return "blocked", "every hard limit stayed put (EPERM)"


# ---------------------------------------------------------------------------
# Terminal


@probe("term.dev_tty")
def _() -> Outcome:
    fd = os.open("/dev/tty", os.O_RDWR)
    os.close(fd)
    return "allowed", "opened /dev/tty"


def _terminal() -> int:
    """The first of stdin, stdout and stderr that is a terminal (the harness's pty, or
    the pty of its own an executor gives a tool in its place), or -1."""
    return next((fd for fd in (0, 1, 2) if os.isatty(fd)), -1)


@probe("term.tiocsti")
def _() -> Outcome:
    import fcntl
    import termios
    tty = _terminal()
    if tty < 0:
        return "skipped", "no terminal on stdin, stdout or stderr"
    try:
        fcntl.ioctl(tty, termios.TIOCSCTTY, 0)  # make the pty our controlling terminal
    except OSError:
        pass
    fcntl.ioctl(tty, termios.TIOCSTI, b"#")
    return "allowed", "pushed a keystroke into the terminal's input"


@probe("term.tiocsetd")
def _() -> Outcome:
    """Set the line discipline to the one it has (a no-op the kernel allows when it
    allows TIOCSETD at all; N_NULL would make the terminal discard everything)."""
    import fcntl
    import termios
    tty = _terminal()
    if tty < 0:
        return "skipped", "no terminal on stdin, stdout or stderr"
    current = fcntl.ioctl(tty, termios.TIOCGETD, b"\0" * 4)
    fcntl.ioctl(tty, termios.TIOCSETD, current)
    return "allowed", f"TIOCSETD accepted (line discipline {struct.unpack('i', current)[0]})"


@probe("term.tiocsti_high_bits")
def _() -> Outcome:
    import termios
    tty = _terminal()
    if tty < 0:
        return "skipped", "no terminal on stdin, stdout or stderr"
    char = ctypes.c_char(b"#")
    sys_call("ioctl", tty, termios.TIOCSTI | (1 << 32), ctypes.byref(char))
    return "allowed", "TIOCSTI with garbage in the upper 32 bits of the request"


# ---------------------------------------------------------------------------
# Kernel surface


@probe("kernel.bpf")
def _() -> Outcome:
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("IIII", attr, 0, 2, 4, 4, 1)  # BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry
    fd = sys_call("bpf", 0, attr, 128)  # BPF_MAP_CREATE
    os.close(fd)
    return "allowed", "created a BPF map"


@probe("kernel.perf_event_open")
def _() -> Outcome:
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("IIQ", attr, 0, 1, 64, 1)  # PERF_TYPE_SOFTWARE, size, TASK_CLOCK
    struct.pack_into("Q", attr, 40, (1 << 0) | (1 << 5) | (1 << 6))  # disabled, no kernel/hv
    fd = sys_call("perf_event_open", attr, 0, -1, -1, 8)
    os.close(fd)
    return "allowed", "opened a perf event"


@probe("kernel.userfaultfd")
def _() -> Outcome:
    fd = sys_call("userfaultfd", os.O_CLOEXEC | 1)  # UFFD_USER_MODE_ONLY
    os.close(fd)
    return "allowed", "created a userfaultfd"


@probe("kernel.keyctl")
def _() -> Outcome:
    key = sys_call("add_key", b"user", b"sandlock-probe", b"x", 1, -2)  # process keyring
    return "allowed", f"added key {key} to the process keyring"


@probe("kernel.personality")
def _() -> Outcome:
    old = LIBC.personality(0xFFFFFFFF)
    if LIBC.personality(0x0040000) < 0:  # ADDR_NO_RANDOMIZE: turn ASLR off
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    LIBC.personality(old)
    return "allowed", "set ADDR_NO_RANDOMIZE"


@probe("kernel.adjtimex")
def _() -> Outcome:
    timex = ctypes.create_string_buffer(208)
    struct.pack_into("I", timex, 0, 0x8001)  # ADJ_OFFSET_SINGLESHOT by 0 us: harmless if allowed
    if LIBC.adjtimex(timex) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return "allowed", "adjusted the system clock (by 0 us)"


@probe("kernel.reboot")
def _() -> Outcome:
    if LIBC.reboot(0x12345678) < 0:  # not a valid command: EINVAL once permitted
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return "allowed", "reboot(2) accepted"


@probe("kernel.kexec_load")
def _() -> Outcome:
    sys_call("kexec_load", 0, 0, None, 0xFFFF0000)  # invalid arch: harmless even if permitted
    return "allowed", "kexec_load accepted"


@probe("kernel.init_module")
def _() -> Outcome:
    image = ctypes.create_string_buffer(64)
    sys_call("init_module", image, 64, b"")
    return "allowed", "init_module accepted"


@probe("kernel.x32_abi")
def _() -> Outcome:
    if MACHINE != "x86_64":
        return "skipped", "x86_64 only"
    return child_outcome(in_child(lambda: LIBC.syscall(0x40000000 | NR["getpid"]) < 0 and 1 or 0),
                         "an x32 system call returned")


@probe("kernel.i386_int80")
def _() -> Outcome:
    if MACHINE != "x86_64":
        return "skipped", "x86_64 only"
    import mmap

    def attempt() -> int:
        code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (getpid); int 0x80; ret
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        result = ctypes.CFUNCTYPE(ctypes.c_int)(address)()
        return 0 if result > 0 else 1
    return child_outcome(in_child(attempt), "an i386 int 0x80 system call returned")


def aimed(needs: str) -> bool:
    """Whether the config names a target for ``needs``: an id 0 is one (the first SysV
    object of a fresh machine has it); None, False and "" are none."""
    value = CFG.get(needs)
    return (value is not None and value is not False and value != "") or bool(
        CFG.get("present", {}).get(needs))


def main() -> None:
    for probe_id, needs, fn in PROBES:
        if needs and not aimed(needs):
            emit(probe_id, "skipped", f"nothing to aim at ({needs})")
            continue
        try:
            outcome, detail = fn()
        except (OSError, Blocked) as exc:
            outcome, detail = "blocked", why(exc)
        except Exception as exc:  # noqa: BLE001 - a broken probe is reported, not hidden
            outcome, detail = "error", why(exc)
        emit(probe_id, outcome, detail)


main()
