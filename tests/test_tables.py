"""One source for every table: copies that cannot import it are checked against it.

The syscall numbers live in :mod:`sandlock.linux.syscalls`. The probe payload runs as
source text inside the sandbox and keeps its own table; the C helper keeps ``#define``
fallbacks for headers older than a syscall. Both are read here as text and compared.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from sandlock.linux import syscalls

PACKAGE = Path(syscalls.__file__).resolve().parent.parent
PAYLOAD = PACKAGE / "probe" / "payload.py"
HELPER = PACKAGE / "exec" / "helper" / "sandlock_exec.c"
#: The installed uapi headers: the x86_64 table, and the generic one aarch64 uses.
HEADERS = {"x86_64": ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"),
           "aarch64": ("/usr/include/asm-generic/unistd.h",)}


def payload_table() -> dict[str, dict[str, int]]:
    """The payload's ``NR = {arch: {name: number}}.get(MACHINE, {})``, as data."""
    tree = ast.parse(PAYLOAD.read_text(), str(PAYLOAD))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["NR"]
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)):
            table = ast.literal_eval(node.value.func.value)
            assert isinstance(table, dict)
            return table
    raise AssertionError(f"no NR = {{...}}.get(MACHINE, {{}}) in {PAYLOAD}")


def helper_fallbacks() -> dict[str, int]:
    """The C helper's ``#ifndef __NR_x / #define __NR_x N`` fallbacks."""
    text = "".join(path.read_text() for path in (HELPER, HELPER.with_name("confine.h")))
    found = re.findall(r"#ifndef\s+__NR_(\w+)\s*\n\s*#define\s+__NR_(\w+)\s+(\d+)", text)
    assert all(a == b for a, b, _ in found), found
    return {name: int(number) for name, _, number in found}


def header_numbers(path: str) -> dict[str, int]:
    """``__NR_name`` -> number from a uapi header, following ``__NR3264_`` aliases."""
    text = Path(path).read_text()
    raw = dict(re.findall(r"#define\s+(__NR(?:3264)?_\w+)\s+(\w+)", text))
    out = {}
    for macro, value in raw.items():
        if not macro.startswith("__NR_"):
            continue
        while value in raw:
            value = raw[value]
        if value.isdigit():
            out[macro[len("__NR_"):]] = int(value)
    return out


def test_the_table_knows_this_machine() -> None:
    assert syscalls.MACHINE in syscalls.TABLES, f"no syscall table for {syscalls.MACHINE}"
    assert syscalls.NR is syscalls.TABLES[syscalls.MACHINE]
    assert set(syscalls.AUDIT_ARCH) == set(syscalls.TABLES)


@pytest.mark.parametrize("arch", sorted(syscalls.TABLES))
def test_the_table_matches_the_kernel_headers(arch: str) -> None:
    """Every number as the installed uapi header has it. A name the header lacks must be
    newer than the header (403 and up, shared by every architecture): aarch64 has no
    ``open`` or ``rename``, and the table must not claim one."""
    path = next((p for p in HEADERS[arch] if os.path.exists(p)), None)
    if path is None:
        pytest.skip(f"no uapi header for {arch} here ({', '.join(HEADERS[arch])})")
    known = header_numbers(path)
    table = syscalls.TABLES[arch]
    assert {name: table[name] for name in table if name in known} == {
        name: known[name] for name in table if name in known}
    newer = {name: nr for name, nr in table.items() if name not in known}
    assert all(nr >= 403 for nr in newer.values()), f"{path} has no {sorted(newer)}"


def test_numbers_from_403_are_shared() -> None:
    """Since Linux 5.1 every architecture numbers new syscalls alike."""
    new = {name for table in syscalls.TABLES.values() for name, nr in table.items() if nr >= 403}
    for name in new:
        assert len({table.get(name) for table in syscalls.TABLES.values()}) == 1, name


@pytest.mark.parametrize("arch", sorted(syscalls.TABLES))
def test_the_probe_payload_table_is_the_same(arch: str) -> None:
    copy = payload_table()
    assert set(copy) == set(syscalls.TABLES), "the payload knows other architectures"
    table = syscalls.TABLES[arch]
    missing = sorted(set(copy[arch]) - set(table))
    assert not missing, f"add {missing} to sandlock/linux/syscalls.py"
    assert copy[arch] == {name: table[name] for name in copy[arch]}


def test_the_c_helper_fallbacks_are_the_same() -> None:
    fallbacks = helper_fallbacks()
    assert fallbacks, f"no __NR_ fallback found in {HELPER}: has the pattern changed?"
    for arch, table in syscalls.TABLES.items():
        missing = sorted(set(fallbacks) - set(table))
        assert not missing, f"add {missing} to sandlock/linux/syscalls.py"
        assert fallbacks == {name: table[name] for name in fallbacks}, arch


def test_the_readers_are_not_vacuous(tmp_path: Path) -> None:
    """A wrong number in a copy is found."""
    header = tmp_path / "unistd.h"
    header.write_text("#define __NR3264_truncate 45\n#define __NR_truncate __NR3264_truncate\n"
                      "#define __NR_openat 56\n")
    assert header_numbers(str(header)) == {"truncate": 45, "openat": 56}
    assert payload_table()["x86_64"]["ptrace"] == 101
    assert "close_range" in helper_fallbacks()


# ----------------------------------------------------------------------------
# Process helpers: one reader of /proc/.../children, one reaper (sandlock.linux.process)

ORPHANS = r"""
import os, time
from sandlock.linux import kernel, process

kernel.set_child_subreaper()
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:                      # a daemon: forks a grandchild, which sleeps, and exits
    if os.fork() == 0:
        os.close(read_end)
        os.write(write_end, b"%d\n" % os.getpid())
        time.sleep(600)
        os._exit(0)
    os._exit(0)
os.close(write_end)
os.waitpid(pid, 0)
grandchild = int(os.read(read_end, 64))
kept = os.fork()                  # a child the host had before: spared
if kept == 0:
    time.sleep(600)
    os._exit(0)
before = process.children()
process.reap_descendants(frozenset({kept}))
after = process.children()
os.kill(kept, 9)
os.waitpid(kept, 0)
print(grandchild in before, kept in before, after == {kept}, os.path.exists(f"/proc/{grandchild}"))
"""


def test_the_reaper_kills_what_was_reparented_and_spares_the_rest() -> None:
    """A double-forked grandchild is re-parented to a subreaper, found in its children
    and killed; a child the caller had before survives the reaping."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", ORPHANS], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.split() == ["True", "True", "True", "False"], result.stderr


def test_children_are_read_from_every_thread() -> None:
    """A child forked by a second thread is listed under that thread's task, not the
    main thread's (while the thread lives: then it moves to a sibling)."""
    import subprocess
    import threading

    from sandlock.linux import process

    started: list[subprocess.Popen[bytes]] = []
    forked, done = threading.Event(), threading.Event()

    def fork_and_stay() -> None:
        started.append(subprocess.Popen(["sleep", "600"]))
        forked.set()
        done.wait()

    thread = threading.Thread(target=fork_and_stay)
    thread.start()
    try:
        forked.wait()
        child = started[0]
        main_only = _read_children(f"/proc/self/task/{os.getpid()}/children")
        assert child.pid not in main_only
        assert child.pid in process.children()
        assert child.pid in process.children(os.getpid())
        assert process.children(child.pid) == set()
        gone = 2**22 + 12345  # above pid_max's default: no such process
        with pytest.raises(OSError):
            process.children(gone, strict=True)
        assert process.children(gone) == set()
    finally:
        done.set()
        thread.join()
        for proc in started:
            proc.kill()
            proc.wait()


def _read_children(path: str) -> set[int]:
    with open(path) as handle:
        return {int(p) for p in handle.read().split()}


def test_one_signal_list() -> None:
    import signal

    from sandlock.linux import process

    assert set(process.FORWARDED_SIGNALS) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                              signal.SIGQUIT}
    assert set(process.DEFAULTED_SIGNALS) == {signal.SIGPIPE, signal.SIGXFSZ,
                                              *process.FORWARDED_SIGNALS}
    assert all(type(s) is int for s in process.DEFAULTED_SIGNALS)


# ----------------------------------------------------------------------------
# The environment filter (sandlock.policy.environment)

from fnmatch import fnmatchcase  # noqa: E402

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NAME = st.text(alphabet="ABCLX_*?[]!-a1", max_size=6)


@given(st.lists(_NAME, max_size=5), st.lists(_NAME, max_size=8))
def test_the_environment_filter_is_fnmatchcase(patterns: list[str], names: list[str]) -> None:
    from sandlock.policy import environment

    test = environment.matcher(tuple(patterns))
    for name in names + patterns:
        assert test(name) == any(fnmatchcase(name, p) for p in patterns), (name, patterns)


def test_the_environment_is_pass_then_set() -> None:
    from sandlock.policy import environment

    caller = {"PATH": "/bin", "LC_ALL": "C", "LANG": "C", "SECRET_TOKEN": "s", "HOME": "/h"}
    env = environment.build(("PATH", "LC_*", "H?ME"), (("HOME", "/tmp"), ("NEW", "1")), caller)
    assert env == {"PATH": "/bin", "LC_ALL": "C", "HOME": "/tmp", "NEW": "1"}
    assert environment.build((), (), caller) == {}


# ----------------------------------------------------------------------------
# Landlock: what a ruleset holds for an ABI is compile.abi's; the kernel takes the whole struct

def test_a_ruleset_for_every_abi_up_to_this_kernels() -> None:
    """The rights each ABI's table names make a ruleset on this kernel, the attribute
    struct passed whole (its newer fields 0 for an older ABI)."""
    from sandlock.compile import abi as A
    from sandlock.linux import kernel

    real = kernel.landlock_abi()
    if real < 1:
        pytest.skip("Landlock is unavailable on this kernel")
    for version in range(1, min(real, A.NEWEST_ABI) + 1):
        fd = kernel.create_ruleset(int(A.fs_handled(version)), int(A.net_handled(version)),
                                   int(A.scopes_known(version)))
        os.close(fd)


# ----------------------------------------------------------------------------
# trace's table of recorded syscalls: each entry is decoded

def test_trace_decodes_mknod(tmp_path: Path) -> None:
    """mkfifo (mknodat) in a directory the policy only reads is reported as a create
    there, not an internal error (the file type was once masked with a function)."""
    import shutil
    import subprocess
    import sys

    from sandlock.trace import record

    why = record.supported()
    if why is not None:
        pytest.skip(why)
    mkfifo = shutil.which("mkfifo")
    if mkfifo is None:
        pytest.skip("no mkfifo here")
    work = tmp_path / "work"  # apart from the policy file: a write grant may not cover it
    work.mkdir()
    policy = tmp_path / "p.toml"
    policy.write_text(f'version = 1\nextends = ["base"]\n[filesystem]\nread = ["{work}"]\n'
                      f'exec = ["{os.path.realpath(mkfifo)}"]\n')
    result = subprocess.run([sys.executable, "-m", "sandlock", "trace", "--policy", str(policy), "--",
                             mkfifo, str(work / "fifo")], capture_output=True, text=True, timeout=120)
    assert "internal error" not in result.stderr, result.stderr
    assert f'denied create {work} -> [filesystem] write += "{work}"' in result.stderr, result.stderr
    assert result.returncode == 1
