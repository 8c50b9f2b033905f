"""Attacks a confined tool makes to plant privilege or run code from memory.

Standard library only: tests/test_plants.py runs this file with the system python3
inside the sandbox (CLI and ``Sandbox.run``) and calls its functions with
``Sandbox.call``. Each attack returns "done" when the kernel let it through, else
the errno name it got; after the run the test also looks at what was left behind.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import struct
import sys
from typing import Callable

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
#: x86_64 and aarch64 numbers of the syscalls Python has no wrapper for (0: none there).
NR = {"x86_64": {"chmod": 90, "fchmodat": 268, "fchmodat2": 452, "openat2": 437, "creat": 85,
                 "memfd_create": 319},
      "aarch64": {"chmod": 0, "fchmodat": 53, "fchmodat2": 452, "openat2": 437, "creat": 0,
                  "memfd_create": 279}}.get(os.uname().machine, {})
AT_FDCWD, AT_SYMLINK_FOLLOW = -100, 0x400
#: A file capability (VFS_CAP_REVISION_2, CAP_SETUID permitted+effective) as setcap writes it.
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0)


def _syscall(name: str, *args: bytes | int) -> None:
    number = NR.get(name, 0)
    if not number:
        raise OSError(errno.ENOSYS, f"no {name} on this architecture")
    converted = [ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a)
                 for a in args]
    if LIBC.syscall(number, *converted) < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _try(attack: Callable[[], object]) -> str:
    try:
        attack()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "done"


def plant(workspace: str) -> dict[str, str]:
    """Every route to a set-user-id/set-group-id file or a file capability."""
    def path(name: str) -> str:
        return os.path.join(workspace, name)

    def fresh(name: str) -> str:
        with open(path(name), "w") as handle:
            handle.write("#!/bin/sh\nid\n")
        return path(name)

    def fchmod() -> None:
        fd = os.open(fresh("fchmod"), os.O_RDONLY)
        try:
            os.fchmod(fd, 0o2755)
        finally:
            os.close(fd)

    def tmpfile_linked() -> None:
        fd = os.open(workspace, os.O_TMPFILE | os.O_WRONLY, 0o4755)
        try:
            # linkat(AT_SYMLINK_FOLLOW): os.link calls link(2), which does not follow
            if LIBC.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD,
                           path("tmpfile").encode(), AT_SYMLINK_FOLLOW) < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
        finally:
            os.close(fd)

    def creat() -> None:
        fd = LIBC.creat(path("creat").encode(), 0o4755)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        os.close(fd)

    def open_how(mode: int) -> bytes:
        return struct.pack("QQQ", os.O_CREAT | os.O_WRONLY, mode, 0)

    return {
        "os.chmod": _try(lambda: os.chmod(fresh("os_chmod"), 0o4755)),
        "chmod(2)": _try(lambda: _syscall("chmod", fresh("chmod").encode(), 0o4755)),
        "fchmodat(2)": _try(lambda: _syscall("fchmodat", AT_FDCWD, fresh("fchmodat").encode(),
                                             0o6755)),
        "fchmodat2(2)": _try(lambda: _syscall("fchmodat2", AT_FDCWD, fresh("fchmodat2").encode(),
                                              0o4755, 0)),
        "fchmod(2)": _try(fchmod),
        "open(O_CREAT)": _try(lambda: os.close(os.open(path("open"), os.O_CREAT | os.O_WRONLY,
                                                       0o6755))),
        "open(O_TMPFILE)+link": _try(tmpfile_linked),
        "creat(2)": _try(creat),
        "openat2(2)": _try(lambda: _syscall("openat2", AT_FDCWD, path("openat2").encode(),
                                            open_how(0o4755), 24)),
        "mknod(S_IFREG)": _try(lambda: os.mknod(path("mknod"), stat.S_IFREG | 0o4755)),
        "setxattr(security.capability)": _try(
            lambda: os.setxattr(fresh("fcap"), "security.capability", CAPABILITY)),
    }


def controls(workspace: str) -> dict[str, str]:
    """What must keep working: ordinary modes by the same routes."""
    target = os.path.join(workspace, "plain")

    def chmod_plain() -> None:
        open(target, "w").close()
        os.chmod(target, 0o755)

    return {
        "os.chmod 0755": _try(chmod_plain),
        "open 0644": _try(lambda: os.close(os.open(os.path.join(workspace, "created"),
                                                   os.O_CREAT | os.O_WRONLY, 0o644))),
        "sticky dir": _try(lambda: os.mkdir(os.path.join(workspace, "tmp"), 0o1777)),
    }


def planted(workspace: str) -> list[str]:
    """Files below ``workspace`` with a set-id bit or a file capability."""
    found = []
    for name in sorted(os.listdir(workspace)):
        full = os.path.join(workspace, name)
        mode = os.lstat(full).st_mode
        if mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISDIR(mode):
            found.append(f"{name} {oct(mode)}")
        try:
            if "security.capability" in os.listxattr(full, follow_symlinks=False):
                found.append(f"{name} security.capability")
        except OSError:
            pass
    return found


def tiny_elf() -> bytes:
    """A static x86_64 program that exits with status 42."""
    code = bytes([0xBF, 42, 0, 0, 0, 0xB8, 60, 0, 0, 0, 0x0F, 0x05])  # exit(42)
    base, size = 0x400000, 64 + 56 + 12
    header = (b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
              + struct.pack("<HHIQQQIHHHHHH", 2, 0x3E, 1, base + 120, 64, 0, 0, 64, 56, 1, 0, 0, 0))
    program = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000)
    return header + program + code


def _run(target: int | str) -> str:
    pid = os.fork()
    if pid == 0:
        try:
            os.execve(target, ["memfd-program"], {})
        except OSError as exc:
            os._exit(100 + (exc.errno or 0) % 100)
        os._exit(99)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code == 42:
        return "done"
    return errno.errorcode.get(code - 100, f"exit {code}") if code >= 100 else f"exit {code}"


def memfd_exec(flags: int = 0) -> dict[str, str]:
    """Write a program into a memfd and execute it: fexecve and /proc/self/fd/N."""
    try:
        fd = os.memfd_create("tool-program", flags)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return {"memfd_create": name, "fexecve": name, "execve /proc/self/fd": name}
    try:
        os.write(fd, tiny_elf())
        return {"memfd_create": "done", "fexecve": _run(fd),
                "execve /proc/self/fd": _run(f"/proc/self/fd/{fd}"),
                "fchmod +x": _try(lambda: os.fchmod(fd, 0o755))}
    finally:
        os.close(fd)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "plant":
        out: object = {"attacks": plant(sys.argv[2]), "controls": controls(sys.argv[2]),
                       "planted": planted(sys.argv[2])}
    else:
        out = memfd_exec(int(sys.argv[2]))
    print(json.dumps(out))
