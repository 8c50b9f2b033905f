"""Policy parsing and validation: every error names file, line and key; merges and variables.

Pure tests: nothing here forks or restricts anything. Error messages are checked
whole, because the message is the product when a policy is wrong.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from sandlock.errors import ExitCode, PolicyError
from sandlock.policy.model import (
    DEFAULT_ENV_PASS,
    Access,
    Compat,
    PortRange,
    builtin_profiles,
    load_policy,
    load_profile,
    loads_policy,
    parse_duration,
    parse_size,
    policy_from_dict,
)
from sandlock.policy.positions import find_line


def write(directory: Path, text: str, name: str = "policy.toml") -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def failure(tmp_path: Path, text: str, variables: dict[str, str] | None = None) -> PolicyError:
    """The error of loading ``text`` from ``tmp_path/policy.toml``."""
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path, variables)
    assert info.value.exit_code == ExitCode.LAUNCHER
    return info.value


def where(tmp_path: Path, line: int, key: str) -> str:
    return f"{tmp_path / 'policy.toml'}:{line}: {key}: "


# ---------------------------------------------------------------------------
# Unknown keys and wrong types


def test_unknown_top_level_key(tmp_path: Path) -> None:
    error = failure(tmp_path, """
        version = 1
        descripton = "typo"
    """)
    assert str(error) == where(tmp_path, 2, "descripton") + (
        "unknown key (expected one of: version, description, extends, compat, accept, "
        "filesystem, network, scope, env, limits, syscalls, credentials, mcp)")
    assert (error.line, error.key, error.reason.startswith("unknown key")) == (2, "descripton", True)


def test_unknown_key_in_section(tmp_path: Path) -> None:
    error = failure(tmp_path, """
        [network]
        connect = [443]

        [filesystem]
        raed = ["/tmp"]
    """)
    assert str(error) == where(tmp_path, 5, "filesystem.raed") + (
        "unknown key (expected one of: read, write, exec)")


def test_unknown_key_in_path_table(tmp_path: Path) -> None:
    error = failure(tmp_path, """
        [filesystem]
        read = [
            "/tmp",
            { path = "/tmp", optinal = true },
        ]
    """)
    assert str(error) == where(tmp_path, 4, "filesystem.read[1].optinal") + (
        "unknown key 'optinal' (expected path, optional)")


@pytest.mark.parametrize("text, line, key, reason", [
    ('version = "1"', 1, "version", "expected an integer, got a string"),
    ("version = true", 1, "version", "expected an integer, got a boolean"),
    ("description = 5", 1, "description", "expected a string, got an integer"),
    ('description = "a\\u0000b"', 1, "description", "must not contain a NUL character"),
    ('extends = "base"', 1, "extends", "expected an array of strings, got a string"),
    ('extends = ["base", 1]', 1, "extends[1]", "expected a string, got an integer"),
    ("compat = 1", 1, "compat", "expected a string, got an integer"),
    ("filesystem = 3", 1, "filesystem", "expected a table, got an integer"),
    ("network = []", 1, "network", "expected a table, got an array"),
    ('[filesystem]\nread = "/tmp"', 2, "filesystem.read",
     'expected an array of paths or { path = "...", optional = true } tables, got a string'),
    ("[filesystem]\nexec = [1]", 2, "filesystem.exec[0]",
     "expected a path string or a table, got an integer"),
    ('[filesystem]\nwrite = [["/tmp"]]', 2, "filesystem.write[0]",
     "expected a path string or a table, got an array"),
    ("[filesystem]\nread = [{ optional = true }]", 2, "filesystem.read[0]", "missing key 'path'"),
    ("[filesystem]\nread = [{ path = 1 }]", 2, "filesystem.read[0].path",
     "expected a string, got an integer"),
    ('[filesystem]\nread = [{ path = "/tmp", optional = "yes" }]', 2,
     "filesystem.read[0].optional", "expected true or false, got a string"),
    ('[network]\nudp = "yes"', 2, "network.udp", "expected true or false, got a string"),
    ("[network]\nunix = 1", 2, "network.unix", "expected true or false, got an integer"),
    ("[scope]\nsignals = 0", 2, "scope.signals", "expected true or false, got an integer"),
    ('[scope]\nabstract_unix = "off"', 2, "scope.abstract_unix",
     "expected true or false, got a string"),
    ('[env]\npass = "PATH"', 2, "env.pass", "expected an array of strings, got a string"),
    ('[env]\nset = ["HOME=/x"]', 2, "env.set", 'expected a table of NAME = "value", got an array'),
    ("[env]\nset = { HOME = 1 }", 2, "env.set.HOME", "expected a string, got an integer"),
    ("[limits]\nmemory = true", 2, "limits.memory",
     "expected a size such as 512MiB or an integer number of bytes, got a boolean"),
    ("[limits]\nfile_size = [1]", 2, "limits.file_size",
     "expected a size such as 512MiB or an integer number of bytes, got an array"),
    ("[limits]\ntimeout = true", 2, "limits.timeout",
     "expected a duration such as 30s or a number of seconds, got a boolean"),
    ("[limits]\ncpu = [1]", 2, "limits.cpu",
     "expected a duration such as 30s or a number of seconds, got an array"),
    ('[limits]\nprocesses = "64"', 2, "limits.processes", "expected a positive integer, got a string"),
    ("[limits]\nopen_files = 1.5", 2, "limits.open_files",
     "expected a positive integer, got a float"),
    ("[limits]\nprocesses = true", 2, "limits.processes",
     "expected a positive integer, got a boolean"),
    ('[syscalls]\ndeny = "ptrace"', 2, "syscalls.deny", "expected an array of strings, got a string"),
    ("[syscalls]\nallow = [1]", 2, "syscalls.allow[0]", "expected a string, got an integer"),
])
def test_wrong_types(tmp_path: Path, text: str, line: int, key: str, reason: str) -> None:
    assert str(failure(tmp_path, text)) == where(tmp_path, line, key) + reason


# ---------------------------------------------------------------------------
# Bad values


@pytest.mark.parametrize("text, line, key, reason", [
    ("version = 2", 1, "version", "unsupported policy version 2 (this sandlock reads version 1)"),
    ('compat = "loose"', 1, "compat", "expected \"strict\" or \"best-effort\", got 'loose'"),
    ('compat = "Strict"', 1, "compat", "expected \"strict\" or \"best-effort\", got 'Strict'"),
    # sizes
    ('[limits]\nmemory = "12XB"', 2, "limits.memory",
     "invalid size '12XB' (use e.g. 64MiB, 1GiB, 500MB)"),
    ('[limits]\nmemory = "lots"', 2, "limits.memory",
     "invalid size 'lots' (use e.g. 64MiB, 1GiB, 500MB)"),
    ('[limits]\nmemory = "-5MiB"', 2, "limits.memory",
     "invalid size '-5MiB' (use e.g. 64MiB, 1GiB, 500MB)"),
    ('[limits]\nfile_size = "1iB"', 2, "limits.file_size",
     "invalid size '1iB' (use e.g. 64MiB, 1GiB, 500MB)"),
    ("[limits]\nmemory = 0", 2, "limits.memory", "size must be positive, got 0"),
    ("[limits]\nmemory = -1", 2, "limits.memory", "size must be positive, got -1"),
    ('[limits]\nfile_size = "0MiB"', 2, "limits.file_size", "size must be positive, got '0MiB'"),
    # durations
    ('[limits]\ntimeout = "3 days"', 2, "limits.timeout",
     "invalid duration '3 days' (use e.g. 500ms, 30s, 2m, 1h)"),
    ('[limits]\ntimeout = "30S"', 2, "limits.timeout",
     "invalid duration '30S' (use e.g. 500ms, 30s, 2m, 1h)"),
    ('[limits]\ntimeout = "-1s"', 2, "limits.timeout",
     "invalid duration '-1s' (use e.g. 500ms, 30s, 2m, 1h)"),
    ("[limits]\ntimeout = -1", 2, "limits.timeout", "duration must be positive and finite, got -1"),
    ("[limits]\ntimeout = 0", 2, "limits.timeout", "duration must be positive and finite, got 0"),
    ('[limits]\ntimeout = "0s"', 2, "limits.timeout",
     "duration must be positive and finite, got '0s'"),
    ("[limits]\ntimeout = inf", 2, "limits.timeout",
     "duration must be positive and finite, got inf"),
    ("[limits]\ntimeout = nan", 2, "limits.timeout",
     "duration must be positive and finite, got nan"),
    ("[limits]\ncpu = 0", 2, "limits.cpu", "duration must be positive and finite, got 0"),
    ("[limits]\ntimeout = 1e10", 2, "limits.timeout",
     "duration 10000000000.0 is too long (at most 1000000000s, about 31 years)"),
    ('[limits]\ntimeout = "1000000h"', 2, "limits.timeout",
     "duration '1000000h' is too long (at most 1000000000s, about 31 years)"),
    ("[limits]\ntimeout = " + "9" * 400, 2, "limits.timeout",
     "duration 9999999999999999999999999999999999999999...9999999999 is too long "
     "(at most 1000000000s, about 31 years)"),
    ("[limits]\ntimeout = -" + "9" * 400, 2, "limits.timeout",
     "duration must be positive and finite, got -999999999999999999999999999999999999999...9999999999"),
    ('[limits]\ncpu = "' + "9" * 400 + 's"', 2, "limits.cpu",
     "duration '999999999999999999999999999999999999999...99999999s' is too long "
     "(at most 1000000000s, about 31 years)"),
    # sizes
    ('[limits]\nmemory = "999999999999999999999999"', 2, "limits.memory",
     "size '999999999999999999999999' is too large (at most 1152921504606846976 bytes, 1024PiB)"),
    ('[limits]\nmemory = "' + "9" * 400 + '"', 2, "limits.memory",
     "size '999999999999999999999999999999999999999...999999999' is too large "
     "(at most 1152921504606846976 bytes, 1024PiB)"),
    ('[limits]\nfile_size = "' + "9" * 400 + 'TiB"', 2, "limits.file_size",
     "size '999999999999999999999999999999999999999...999999TiB' is too large "
     "(at most 1152921504606846976 bytes, 1024PiB)"),
    (f"[limits]\nmemory = {2**64}", 2, "limits.memory",
     "size 18446744073709551616 is too large (at most 1152921504606846976 bytes, 1024PiB)"),
    (f"[limits]\nfile_size = {2**60 + 1}", 2, "limits.file_size",
     "size 1152921504606846977 is too large (at most 1152921504606846976 bytes, 1024PiB)"),
    ('[limits]\nmemory = "1025PiB"', 2, "limits.memory",
     "invalid size '1025PiB' (use e.g. 64MiB, 1GiB, 500MB)"),
    # counts
    ("[limits]\nprocesses = 0", 2, "limits.processes", "expected a positive integer, got 0"),
    ("[limits]\nopen_files = -3", 2, "limits.open_files", "expected a positive integer, got -3"),
    (f"[limits]\nprocesses = {2**62 + 1}", 2, "limits.processes",
     f"{2**62 + 1} is too large (at most {2**62}, 2^62)"),
    (f"[limits]\nopen_files = {2**64}", 2, "limits.open_files",
     f"{2**64} is too large (at most {2**62}, 2^62)"),
    # ports
    ('[network]\nconnect = "443"', 2, "network.connect",
     'expected an array of ports (integers or "low-high" strings), got a string'),
    ("[network]\nconnect = [0]", 2, "network.connect[0]",
     "invalid port range 0: ports are 1-65535, low <= high"),
    ("[network]\nbind = [80, 65536]", 2, "network.bind[1]",
     "invalid port range 65536: ports are 0-65535 (0: an ephemeral port the kernel picks), "
     "low <= high"),
    ("[network]\nbind = [-1]", 2, "network.bind[0]",
     "invalid port range -1: ports are 0-65535 (0: an ephemeral port the kernel picks), "
     "low <= high"),
    ('[network]\nconnect = ["90-80"]', 2, "network.connect[0]",
     "invalid port range '90-80': ports are 1-65535, low <= high"),
    ('[network]\nconnect = ["0-10"]', 2, "network.connect[0]",
     "invalid port range '0-10': ports are 1-65535, low <= high"),
    ('[network]\nconnect = ["80-"]', 2, "network.connect[0]",
     "expected a port number or \"low-high\" range, got '80-'"),
    ('[network]\nconnect = ["https"]', 2, "network.connect[0]",
     "expected a port number or \"low-high\" range, got 'https'"),
    ("[network]\nconnect = [true]", 2, "network.connect[0]",
     'expected a port number or "low-high" range, got True'),
    ("[network]\nconnect = [443.0]", 2, "network.connect[0]",
     'expected a port number or "low-high" range, got 443.0'),
    ('[network]\nconnect = ["' + "9" * 5000 + '"]', 2, "network.connect[0]",
     "expected a port number or \"low-high\" range, "
     "got '999999999999999999999999999999999999999...999999999'"),
    ("[network]\nconnect = [" + "9" * 30 + "]", 2, "network.connect[0]",
     "invalid port range 999999999999999999999999999999: ports are 1-65535, low <= high"),
    # environment names
    ('[env]\npass = ["PATH", "BAD-NAME"]', 2, "env.pass[1]",
     "invalid variable name or glob 'BAD-NAME'"),
    ('[env]\npass = [""]', 2, "env.pass[0]", "invalid variable name or glob ''"),
    ('[env]\nset = { "1X" = "v" }', 2, "env.set.1X", "invalid environment variable name '1X'"),
    ('[env]\nset = { "A=B" = "v" }', 2, "env.set.A=B", "invalid environment variable name 'A=B'"),
    # syscall names
    ('[syscalls]\ndeny = ["Ptrace"]', 2, "syscalls.deny[0]", "invalid syscall name 'Ptrace'"),
    ('[syscalls]\nallow = ["ptrace", "read;"]', 2, "syscalls.allow[1]",
     "invalid syscall name 'read;'"),
])
def test_bad_values(tmp_path: Path, text: str, line: int, key: str, reason: str) -> None:
    assert str(failure(tmp_path, text)) == where(tmp_path, line, key) + reason


@pytest.mark.parametrize("text, expected", [
    (1, 1), (4096, 4096), ("10", 10), ("5B", 5), ("1K", 1024), ("1KiB", 1024), ("1KB", 1000),
    ("1.5KiB", 1536), ("64MB", 64_000_000), ("512MiB", 512 * 2**20), ("1G", 2**30),
    ("1 gib", 2**30), (" 2 MiB ", 2 * 2**20), ("1TiB", 2**40), ("1TB", 10**12),
    (2**60, 2**60), ("1048576TiB", 2**60),
])
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, expected", [
    (30, 30.0), (1.5, 1.5), ("30", 30.0), ("30s", 30.0), ("30 s", 30.0), ("500ms", 0.5),
    ("2m", 120.0), ("1h", 3600.0), ("0.5h", 1800.0), (10**9, 1e9),
])
def test_durations(text: object, expected: float) -> None:
    assert parse_duration(text) == expected


def test_cpu_limit_rounds_up_to_whole_seconds(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, '[limits]\ncpu = "1500ms"\ntimeout = "1500ms"'))
    assert policy.limits.cpu == 2
    assert policy.limits.timeout == 1.5
    assert load_policy(write(tmp_path, '[limits]\ncpu = "1ms"', "b.toml")).limits.cpu == 1


# ---------------------------------------------------------------------------
# Paths


def test_relative_path_after_expansion(tmp_path: Path) -> None:
    error = failure(tmp_path, """
        [filesystem]
        read = ["/tmp", "${dir}/data"]
    """, {"dir": "project"})
    assert str(error) == where(tmp_path, 2, "filesystem.read[1]") + (
        "path 'project/data' is not absolute (use ${cwd}/... or an absolute path)")


def test_relative_path_literal(tmp_path: Path) -> None:
    error = failure(tmp_path, '[filesystem]\nexec = ["bin/tool"]')
    assert str(error) == where(tmp_path, 2, "filesystem.exec[0]") + (
        "path 'bin/tool' is not absolute (use ${cwd}/... or an absolute path)")


def test_missing_path_names_file_line_and_index(tmp_path: Path) -> None:
    missing = tmp_path / "data"
    error = failure(tmp_path, f"""
        version = 1
        # the data directory
        [filesystem]
        read = [
            "/tmp",
            "{tmp_path}",
            "{missing}",
        ]
    """)
    assert str(error) == where(tmp_path, 7, "filesystem.read[2]") + (
        f"'{missing}' does not exist (mark it {{ path = ..., optional = true }} if it may be absent)")


def test_optional_missing_path_is_dropped(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    policy = load_policy(write(tmp_path, f"""
        [filesystem]
        read = ["{tmp_path}", {{ path = "{missing}", optional = true }}]
        write = [{{ path = "{tmp_path}", optional = true }}]
    """))
    assert [(r.path, r.access, r.optional) for r in policy.paths] == [
        (str(tmp_path), Access.READ, False), (str(tmp_path), Access.WRITE, True)]


def test_missing_path_allowed_without_path_checks(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, '[filesystem]\nread = ["/no/such/dir"]'),
                         check_paths=False)
    assert [r.path for r in policy.paths] == ["/no/such/dir"]


def test_paths_are_normalized_and_carry_their_origin(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    path = write(tmp_path, f'\n[filesystem]\nread = ["{tmp_path}//a/./", "{tmp_path}/a/../a"]')
    policy = load_policy(path)
    assert [r.path for r in policy.paths] == [str(tmp_path / "a")] * 2
    assert policy.paths[1].origin == f"{path}:2 filesystem.read[1]"


@pytest.mark.parametrize("target", ["/", "/proc", "/sys", "//", "/proc/", "/sys/kernel",
                                    "/proc/self/..", "/tmp/../proc/1"])
def test_write_on_forbidden_paths(tmp_path: Path, target: str) -> None:
    error = failure(tmp_path, f'[filesystem]\nwrite = ["{target}"]')
    shown = os.path.normpath(target)
    shown = "/" + shown.lstrip("/")
    assert str(error) == where(tmp_path, 2, "filesystem.write[0]") + (
        f"write access to {shown!r} is never allowed")


def test_write_on_proc_self_symlink_names_the_path(tmp_path: Path) -> None:
    error = failure(tmp_path, '[filesystem]\nwrite = ["/proc/self"]')
    # the path itself is checked before what it resolves to, so the message is stable
    assert str(error) == where(tmp_path, 2, "filesystem.write[0]") + (
        "write access to '/proc/self' is never allowed")


@pytest.mark.parametrize("target", ["/", "/proc", "/sys", "/proc/sys"])
def test_write_through_symlink_to_forbidden_path(tmp_path: Path, target: str) -> None:
    """Where a write grant leads is decided on its descriptor when the ruleset is built
    (sandlock.compile.grants), never on the name at load time, which a tool could swap."""
    from sandlock.compile import compiler

    link = tmp_path / "link"
    link.symlink_to(target)
    policy = load_policy(write(tmp_path, f'[filesystem]\nwrite = ["{link}"]'))
    with pytest.raises(PolicyError) as error:
        compiler.compile_policy(policy)
    assert str(error.value) == where(tmp_path, 2, "filesystem.write[0]") + (
        f"{str(link)!r}: it is a symbolic link (to {target!r}) in a directory a tool may be "
        "able to write; sandlock follows links only in system directories owned by root and "
        "writable by no one else, so that a planted link cannot redirect a grant: name the "
        "link's target instead")


def test_read_on_root_and_proc_is_allowed(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, '[filesystem]\nread = ["/", "/proc"]\nexec = ["/sys"]'))
    assert [r.path for r in policy.paths] == ["/", "/proc", "/sys"]


# ---------------------------------------------------------------------------
# Variables


def test_builtin_variables_and_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, scratch, work = tmp_path / "home", tmp_path / "scratch", tmp_path / "work"
    for directory in (home, scratch, work):
        directory.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.chdir(work)
    policy = loads_policy(textwrap.dedent("""
        [filesystem]
        read = ["${cwd}", "${home}", "${tmpdir}", "~", "~/"]
        [env]
        set = { HOME = "${home}", WHERE = "~", LITERAL = "a~b" }
    """))
    assert [r.path for r in policy.paths] == [str(work), str(home), str(scratch), str(home),
                                              str(home)]
    assert dict(policy.env.set) == {"HOME": str(home), "WHERE": str(home), "LITERAL": "a~b"}


def test_tmpdir_defaults_to_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TMPDIR", raising=False)
    policy = loads_policy('[filesystem]\nread = ["${tmpdir}"]')
    assert [r.path for r in policy.paths] == ["/tmp"]


def test_var_defines_and_overrides(tmp_path: Path) -> None:
    policy = loads_policy('[filesystem]\nread = ["${ws}/sub", "~"]\n[env]\nset = { H = "${home}" }',
                          {"ws": str(tmp_path), "home": str(tmp_path)}, check_paths=False)
    assert [r.path for r in policy.paths] == [f"{tmp_path}/sub", str(tmp_path)]
    assert dict(policy.env.set) == {"H": str(tmp_path)}


def test_undefined_variable(tmp_path: Path) -> None:
    error = failure(tmp_path, '[filesystem]\nread = ["/tmp", "${workspace}/src"]', {"other": "/"})
    assert str(error) == where(tmp_path, 2, "filesystem.read[1]") + (
        "undefined variable ${workspace} (defined: cwd, home, other, tmpdir; "
        "set one with --var workspace=VALUE)")


def test_undefined_variable_in_env_set(tmp_path: Path) -> None:
    error = failure(tmp_path, '[env]\nset = { HOME = "${workspace}" }')
    assert str(error) == where(tmp_path, 2, "env.set.HOME") + (
        "undefined variable ${workspace} (defined: cwd, home, tmpdir; "
        "set one with --var workspace=VALUE)")


@pytest.mark.parametrize("raw", ["${cwd", "${cwd}/${home", "$${", "/a/${"])
def test_unterminated_variable(tmp_path: Path, raw: str) -> None:
    error = failure(tmp_path, f'[filesystem]\nread = ["{raw}"]')
    assert str(error) == where(tmp_path, 2, "filesystem.read[0]") + (
        f"unterminated variable reference in {raw!r}")


@pytest.mark.parametrize("name", ["1x", "a-b", "", "a b", "x.y"])
def test_invalid_var_name(name: str) -> None:
    with pytest.raises(PolicyError) as info:
        loads_policy("version = 1", {name: "/tmp"})
    assert str(info.value) == f"--var: invalid variable name {name!r}"


def test_variables_are_not_expanded_recursively(tmp_path: Path) -> None:
    policy = loads_policy('[filesystem]\nread = ["${a}"]', {"a": "/x/${b}"}, check_paths=False)
    assert [r.path for r in policy.paths] == ["/x/${b}"]


# ---------------------------------------------------------------------------
# TOML syntax


@pytest.mark.parametrize("text, line, column, reason", [
    ("a = 1\nb = = 2", 2, 5, "Invalid value"),
    ('version = 1\n[filesystem]\nread = ["/tmp",\n  "/x" "/y"]', 4, 8, "Unclosed array"),
    ("[x]\n[x]", 2, 3, "Cannot declare ('x',) twice"),
    ('a = "unterminated\n', 1, 18, "Illegal character '\\n'"),
])
def test_toml_syntax_error_has_line_and_column(tmp_path: Path, text: str, line: int, column: int,
                                               reason: str) -> None:
    error = failure(tmp_path, text)
    assert (error.line, error.column) == (line, column)
    assert str(error) == f"{tmp_path / 'policy.toml'}:{line}:{column}: TOML syntax error: {reason}"


def test_toml_syntax_error_at_end_of_document(tmp_path: Path) -> None:
    error = failure(tmp_path, "x = [")
    assert str(error) == f"{tmp_path / 'policy.toml'}: TOML syntax error: Invalid value (at end of document)"


def test_policy_file_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r": cannot read policy file: not a regular file"):
        load_policy(tmp_path)


def test_ports_envs_and_syscalls_accepted(tmp_path: Path) -> None:
    policy = loads_policy(textwrap.dedent("""
        [network]
        connect = [443, " 8000 - 8100 ", "22", "65535-65535"]
        bind = ["1-1024"]
        udp = true
        unix = true
        [env]
        pass = ["PATH", "LC_*", "X?", "[AB]_KEY", "lower_case"]
        [syscalls]
        deny = ["chmod", "_sysctl", "fchmodat2"]
        allow = ["ptrace"]
    """))
    assert [str(p) for p in policy.network.connect] == ["443", "8000-8100", "22", "65535"]
    assert policy.network.bind == (PortRange(1, 1024),)
    assert policy.network.tcp and policy.network.udp and policy.network.unix
    assert policy.env.passed == ("PATH", "LC_*", "X?", "[AB]_KEY", "lower_case")
    assert policy.syscalls.deny == ("chmod", "_sysctl", "fchmodat2")


def test_bind_accepts_port_zero_as_the_ephemeral_port() -> None:
    """A Landlock bind rule on port 0 lets the kernel pick a free port; connect has no port 0."""
    policy = loads_policy('[network]\nbind = [0, "0-0", 8080]')
    assert policy.network.bind == (PortRange(0, 0), PortRange(8080, 8080))
    from sandlock.compile import ruleset
    ports = dict(ruleset.plan(policy, 4).ports)
    assert set(ports) == {0, 8080}
    with pytest.raises(PolicyError, match=r"network\.connect\[0\]: invalid port range 0"):
        loads_policy("[network]\nconnect = [0]")


def test_extends_absolute_path_and_dict_base_dir(tmp_path: Path) -> None:
    parent = write(tmp_path, f'[filesystem]\nread = ["{tmp_path}"]', "parent.toml")
    assert [r.path for r in loads_policy(f'extends = ["{parent}"]').paths] == [str(tmp_path)]
    policy = policy_from_dict({"extends": ["parent.toml"]}, base_dir=tmp_path)
    assert policy.layers == (str(parent), "<dict>")
    assert policy.paths[0].origin == f"{parent}:2 filesystem.read[0]"
    from_dict = policy_from_dict({"filesystem": {"read": [str(tmp_path)]}})
    assert from_dict.paths[0].origin == "<dict> filesystem.read[0]"


def test_missing_and_unreadable_policy_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "none.toml")
    assert str(info.value) == f"{tmp_path / 'none.toml'}: policy file does not exist"
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(PolicyError, match=r"binary.toml: cannot read policy file: .*utf-8"):
        load_policy(binary)


# ---------------------------------------------------------------------------
# extends


def test_extends_unknown_builtin(tmp_path: Path) -> None:
    error = failure(tmp_path, 'version = 1\nextends = ["base", "pyhton"]')
    known = ", ".join(builtin_profiles())
    assert str(error) == where(tmp_path, 2, "extends[1]") + (
        f"unknown built-in profile 'pyhton' (known: {known})")


def test_extends_missing_file(tmp_path: Path) -> None:
    error = failure(tmp_path, 'extends = ["parts/missing.toml"]')
    assert str(error) == where(tmp_path, 1, "extends[0]") + (
        f"extended policy '{tmp_path}/parts/missing.toml' does not exist")


def test_extends_cycle(tmp_path: Path) -> None:
    write(tmp_path, 'extends = ["b.toml"]', "a.toml")
    write(tmp_path, 'version = 1\nextends = ["./a.toml"]', "b.toml")
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "a.toml")
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    assert str(info.value) == f"{b}:2: extends[0]: extends cycle: {a} -> {b} -> {a}"


def test_extends_itself(tmp_path: Path) -> None:
    error = failure(tmp_path, 'extends = ["policy.toml"]')
    me = tmp_path / "policy.toml"
    assert str(error) == where(tmp_path, 1, "extends[0]") + f"extends cycle: {me} -> {me}"


def test_extends_error_in_parent_names_parent_file(tmp_path: Path) -> None:
    write(tmp_path, "[limits]\n\nmemory = \"huge\"", "parent.toml")
    error = failure(tmp_path, 'extends = ["parent.toml"]')
    assert str(error) == (f"{tmp_path / 'parent.toml'}:3: limits.memory: "
                          "invalid size 'huge' (use e.g. 64MiB, 1GiB, 500MB)")


def test_extends_relative_to_the_extending_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write(tmp_path / "shared", f'[filesystem]\nread = ["{data}"]', "common.toml")
    write(tmp_path / "tools", 'extends = ["../shared/common.toml"]', "middle.toml")
    leaf = write(tmp_path / "tools" / "leaf", 'extends = ["../middle.toml"]', "leaf.toml")
    monkeypatch.chdir("/")  # relative to the file, never to the working directory
    policy = load_policy(leaf)
    assert [r.path for r in policy.paths] == [str(data)]
    assert len(policy.layers) == 3
    assert policy.layers[-1] == str(leaf)
    assert Path(policy.layers[0]).resolve() == tmp_path / "shared" / "common.toml"


def test_extends_relative_path_needs_a_file() -> None:
    with pytest.raises(PolicyError) as info:
        loads_policy('extends = ["./other.toml"]', source="<inline>")
    assert str(info.value) == ("<inline>:1: extends[0]: cannot resolve relative path "
                               "'./other.toml' without a policy file")


def test_extends_merge_semantics(tmp_path: Path) -> None:
    one, two, three = (tmp_path / name for name in ("one", "two", "three"))
    for directory in (one, two, three):
        directory.mkdir()
    write(tmp_path, f"""
        description = "parent"
        compat = "best-effort"
        [filesystem]
        read = ["{one}", "{two}"]
        [network]
        connect = [80, "8000-8010"]
        udp = true
        [scope]
        signals = false
        [env]
        pass = ["PATH", "LANG"]
        set = {{ A = "parent", B = "parent" }}
        [limits]
        timeout = "10s"
        memory = "1GiB"
        [syscalls]
        deny = ["chmod"]
        allow = ["ptrace"]
    """, "parent.toml")
    policy = load_policy(write(tmp_path, f"""
        extends = ["parent.toml"]
        description = "child"
        compat = "strict"
        [filesystem]
        read = ["{two}", "{three}"]
        write = ["{three}"]
        [network]
        connect = [443, 80]
        udp = false
        [env]
        pass = ["TERM", "PATH"]
        set = {{ B = "child", C = "child" }}
        [limits]
        timeout = "20s"
        [syscalls]
        deny = ["chown", "chmod"]
    """))
    assert policy.description == "child"
    assert policy.compat is Compat.STRICT
    assert [(r.path, r.access.value) for r in policy.paths] == [
        (str(one), "read"), (str(two), "read"), (str(two), "read"), (str(three), "read"),
        (str(three), "write")]
    assert policy.network.connect == (PortRange(80, 80), PortRange(8000, 8010),
                                      PortRange(443, 443))
    assert policy.network.udp is False
    assert policy.scope.signals is False and policy.scope.abstract_unix is True
    assert policy.env.passed == ("PATH", "LANG", "TERM")
    assert dict(policy.env.set) == {"A": "parent", "B": "child", "C": "child"}
    assert (policy.limits.timeout, policy.limits.memory) == (20.0, 2**30)
    assert policy.syscalls.deny == ("chmod", "chown")
    assert policy.syscalls.allow == ("ptrace",)
    assert policy.layers == (str(tmp_path / "parent.toml"), str(tmp_path / "policy.toml"))
    assert policy.source == str(tmp_path / "policy.toml")


def test_env_default_when_no_env_anywhere(tmp_path: Path) -> None:
    write(tmp_path, "[limits]\ntimeout = 5", "parent.toml")
    policy = load_policy(write(tmp_path, 'extends = ["parent.toml"]'))
    assert policy.env.passed == DEFAULT_ENV_PASS == ("PATH", "LANG", "LC_*", "TERM", "TZ")
    assert policy.env.set == ()


def test_env_in_parent_replaces_the_default(tmp_path: Path) -> None:
    write(tmp_path, '[env]\npass = ["TERM"]', "parent.toml")
    policy = load_policy(write(tmp_path, 'extends = ["parent.toml"]'))
    assert policy.env.passed == ("TERM",)


def test_env_section_without_pass_passes_nothing(tmp_path: Path) -> None:
    """An [env] table is an explicit environment: only what it names gets through."""
    policy = load_policy(write(tmp_path, '[env]\nset = { HOME = "/tmp" }'))
    assert policy.env.passed == ()
    assert dict(policy.env.set) == {"HOME": "/tmp"}
    empty = load_policy(write(tmp_path, "[env]", "empty.toml"))
    assert (empty.env.passed, empty.env.set) == ((), ())


def test_diamond_extends_loads_base_once_without_duplicate_rules() -> None:
    policy = loads_policy('extends = ["base", "python"]')
    assert policy.layers[:2] == ("<builtin:base>", "<builtin:python>")
    assert len(policy.paths) == len(set(policy.paths))


# ---------------------------------------------------------------------------
# Other entry points and the built-in profiles


def test_loads_policy_defaults() -> None:
    policy = loads_policy("")
    assert policy.source == "<string>"
    assert policy.paths == () and policy.layers == ("<string>",)
    assert policy.compat is Compat.STRICT
    assert not policy.network.tcp and not policy.network.udp and not policy.network.unix
    assert policy.scope.signals and policy.scope.abstract_unix
    assert policy.env.passed == DEFAULT_ENV_PASS
    assert vars(policy.limits) == dict.fromkeys(vars(policy.limits))


def test_loads_policy_error_uses_source() -> None:
    with pytest.raises(PolicyError) as info:
        loads_policy("\n\nbogus = 1", source="tool.toml")
    assert str(info.value).startswith("tool.toml:3: bogus: unknown key")


def test_policy_from_dict(tmp_path: Path) -> None:
    policy = policy_from_dict({
        "extends": ["base"],
        "filesystem": {"read": ["${ws}"], "write": [{"path": str(tmp_path), "optional": True}]},
        "network": {"connect": [443, "8000-8001"]},
        "limits": {"memory": "64MiB", "timeout": 2},
    }, {"ws": str(tmp_path)})
    assert policy.source == "<dict>"
    assert policy.layers == ("<builtin:base>", "<dict>")
    assert [(r.path, r.access) for r in policy.paths][-2:] == [
        (str(tmp_path), Access.READ), (str(tmp_path), Access.WRITE)]
    assert [str(p) for p in policy.network.connect] == ["443", "8000-8001"]
    assert (policy.limits.memory, policy.limits.timeout) == (64 * 2**20, 2.0)


def test_policy_from_dict_errors_have_key_but_no_line() -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_dict({"network": {"connect": [1, 2, 99999]}}, source="tool")
    assert str(info.value) == ("tool: network.connect[2]: invalid port range 99999: "
                               "ports are 1-65535, low <= high")
    assert info.value.line is None
    with pytest.raises(PolicyError, match=r"^<dict>: expected a mapping, got an array$"):
        policy_from_dict([], {})  # type: ignore[arg-type]


def test_with_compat_and_timeout_return_new_policies() -> None:
    policy = loads_policy("[limits]\ntimeout = 5")
    changed = policy.with_compat(Compat.BEST_EFFORT).with_timeout(1.5)
    assert (changed.compat, changed.limits.timeout) == (Compat.BEST_EFFORT, 1.5)
    assert (policy.compat, policy.limits.timeout) == (Compat.STRICT, 5.0)


def test_builtin_profiles_load_here() -> None:
    assert {"base", "python"} <= set(builtin_profiles())
    base = load_profile("base")
    assert base.layers == (str(Path(base.source)),)
    granted = {(r.path, r.access) for r in base.paths}
    assert ("/usr/lib", Access.READ) in granted
    assert ("/dev/null", Access.WRITE) in granted
    assert all(os.path.exists(r.path) for r in base.paths)  # optional absent ones were dropped
    assert not any(r.access is Access.WRITE and r.path != "/dev/null" for r in base.paths)
    python = load_profile("python")
    assert python.layers[0] == "<builtin:base>"
    assert ("/usr/bin/python3", Access.EXEC) in {(r.path, r.access) for r in python.paths}
    assert dict(python.env.set)["PYTHONDONTWRITEBYTECODE"] == "1"
    assert not python.network.tcp


def test_unknown_profile() -> None:
    with pytest.raises(PolicyError, match=r"^nope: unknown built-in profile 'nope' \(known: base"):
        load_profile("nope")


# ---------------------------------------------------------------------------
# find_line: where a key sits in the TOML text

LOCATE = '''\
# a comment mentioning [filesystem] and read = ["x"]
version = 1
description = """
[network]
connect = [1]
"""

[filesystem]
read = [
    "/a",   # a comment, with [brackets] and, commas
    { path = "/b,c]", optional = true },
    "/d[1]",
    '/e"',
    "/f\\"]",

    "/g",
]
write = ["/w0", "/w1"]  # trailing comment
exec = [ { path = "/x" },
  { path = "/y" } ]

[ network ]
connect = [
  443,
  "8000-8100",
]
[env]
pass = [
  "set = 1",
]
set = { HOME = "/h", X = "a]b" }

[limits]
"timeout" = "1s"
'''


@pytest.mark.parametrize("key, line", [
    (["version"], 2),
    (["description"], 3),
    (["filesystem"], 8),
    (["filesystem", "read"], 9),
    (["filesystem", "read", 0], 10),
    (["filesystem", "read", 1], 11),
    (["filesystem", "read", 1, "optional"], 11),
    (["filesystem", "read", 2], 12),
    (["filesystem", "read", 3], 13),
    (["filesystem", "read", 4], 14),
    (["filesystem", "read", 5], 16),
    (["filesystem", "read", 9], 9),  # no such element: the key's own line
    (["filesystem", "write", 0], 18),
    (["filesystem", "write", 1], 18),
    (["filesystem", "exec", 1], 20),
    (["network", "connect"], 23),  # not the fake one inside the description string
    (["network", "connect", 1], 25),
    (["env", "set"], 31),  # not the "set = 1" string inside env.pass
    (["env", "set", "X"], 31),
    (["limits", "timeout"], 34),
    (["scope"], None),
    (["filesystem", "nothing"], None),
])
def test_find_line(key: list[str | int], line: int | None) -> None:
    assert find_line(LOCATE, key) == line


@pytest.mark.parametrize("key, line", [
    (["filesystem", "read", 0], 1),
    (["filesystem", "read", 1], 2),
    (["network", "connect"], 3),
    (["env", "pass", 0], 4),
    (["filesystem", "write", 0], 8),
    (["limits", "timeout"], 6),
])
def test_find_line_dotted_keys(key: list[str | int], line: int) -> None:
    text = ('filesystem.read = ["/a",\n  "/b"]\nnetwork.connect = [1]\n"env".pass = ["X"]\n'
            '[limits]\ntimeout = "1s"\n[filesystem]\n"write" = [ "/q" ]\n')
    assert find_line(text, key) == line


def test_find_line_inline_table_section() -> None:
    text = 'version = 1\nfilesystem = { read = ["/a"] }\n'
    assert find_line(text, ["filesystem", "read"]) == 2
    assert find_line(text, ["filesystem", "read", 0]) == 2


def test_find_line_never_raises_on_odd_input() -> None:
    assert find_line("", ["a"]) is None
    assert find_line("a = 1", []) is None
    assert find_line("a = 1", [0]) is None
    assert find_line("a = [\n", ["a", 3]) == 1
    assert find_line('a = """\nunterminated', ["a", 0]) == 1


def test_error_line_inside_multiline_array_with_comments(tmp_path: Path) -> None:
    error = failure(tmp_path, """
        description = \"\"\"
        [filesystem]
        read = ["/fake"]
        \"\"\"
        [filesystem]
        read = [
            # [not, an, element]
            "/tmp",  # first, really

            "relative",
        ]
    """)
    assert str(error) == where(tmp_path, 10, "filesystem.read[1]") + (
        "path 'relative' is not absolute (use ${cwd}/... or an absolute path)")


# ----------------------------------------------------------------------------
# Input that would exhaust the parser: bounded, refused with file and line


@pytest.mark.parametrize("value", ["[" * 1000 + "]" * 1000, "{a = " * 1000 + "1" + "}" * 1000,
                                   "[" * 33 + "]" * 33])
def test_deep_nesting_is_refused_with_its_line(tmp_path: Path, value: str) -> None:
    error = failure(tmp_path, f"version = 1\n\nx = {value}\n")
    assert str(error) == f"{tmp_path / 'policy.toml'}:3: arrays and tables nested more than 32 deep"


def test_deep_dotted_tables_are_refused(tmp_path: Path) -> None:
    error = failure(tmp_path, "version = 1\n[" + ".".join(["a"] * 40) + "]\n")
    assert str(error) == f"{tmp_path / 'policy.toml'}: arrays and tables nested more than 32 deep"


def test_nesting_within_the_bound_reaches_the_schema(tmp_path: Path) -> None:
    error = failure(tmp_path, 'version = 1\ndescription = "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["'
                    "\n# {{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{\nx = " + "[" * 32 + "]" * 32)
    assert "x: unknown key" in str(error)


def test_a_number_of_too_many_digits(tmp_path: Path) -> None:
    error = failure(tmp_path, "version = 1\n[limits]\nprocesses = " + "9" * 5000 + "\n")
    assert str(error) == (f"{tmp_path / 'policy.toml'}:3: TOML value out of range: a number with "
                          "too many digits")


def chain(tmp_path: Path, length: int) -> Path:
    """p0.toml extends p1.toml ... extends p{length - 1}.toml."""
    for index in range(length - 1):
        write(tmp_path, f'version = 1\nextends = ["./p{index + 1}.toml"]\n', f"p{index}.toml")
    write(tmp_path, 'version = 1\ndescription = "last"\n', f"p{length - 1}.toml")
    return tmp_path / "p0.toml"


def test_extends_chain_of_32_files_loads(tmp_path: Path) -> None:
    assert load_policy(chain(tmp_path, 32)).description == "last"


@pytest.mark.parametrize("length", [33, 1000])
def test_extends_chain_is_bounded(tmp_path: Path, length: int) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(chain(tmp_path, length))
    assert str(info.value) == (f"{tmp_path / 'p31.toml'}:2: extends[0]: extends chain longer than "
                               f"32 files (from {tmp_path / 'p0.toml'})")


def test_extends_diamond_is_bounded(tmp_path: Path) -> None:
    """Each file extends the next one twice: 2^30 layers unless the count is bounded."""
    for index in range(30):
        write(tmp_path, f'version = 1\nextends = ["./d{index + 1}.toml", "./d{index + 1}.toml"]\n',
              f"d{index}.toml")
    write(tmp_path, "version = 1\n", "d30.toml")
    # each file is merged once, where it first appears: 31 layers, read once each
    assert len(load_policy(tmp_path / "d0.toml").layers) == 31


def test_extends_count_is_bounded(tmp_path: Path) -> None:
    """More files than MAX_LAYERS, each extended once, is still refused."""
    for index in range(300):
        write(tmp_path, "version = 1\n", f"b{index}.toml")
    names = ", ".join(f'"./b{index}.toml"' for index in range(300))
    write(tmp_path, f"version = 1\nextends = [{names}]\n", "top.toml")
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "top.toml")
    assert "extends brings in more than 256 files" in str(info.value)


@pytest.mark.parametrize("kind", ["loop", "fifo", "device", "directory"])
def test_extends_of_what_is_not_a_policy_file(tmp_path: Path, kind: str) -> None:
    base = tmp_path / "base.toml"
    if kind == "loop":
        base.symlink_to(base.name)
    elif kind == "fifo":
        os.mkfifo(base)
    elif kind == "device":
        base.symlink_to("/dev/zero")
    else:
        base.mkdir()
    error = failure(tmp_path, 'version = 1\nextends = ["./base.toml"]\n')
    assert str(error).startswith(f"{tmp_path / 'policy.toml'}:2: extends[0]: " if kind == "loop"
                                 else f"{base}: cannot read policy file: ")


def test_variable_with_a_nul_is_refused(tmp_path: Path) -> None:
    error = failure(tmp_path, 'version = 1\n[filesystem]\nread = ["${w}"]\n', {"w": "/tmp\x00x"})
    assert str(error) == "--var: w: the value must be a string without NUL characters"


def test_deleted_working_directory(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    try:
        gone.rmdir()
        with pytest.raises(PolicyError) as info:
            loads_policy("version = 1\n", source="inline")
    finally:
        os.chdir(here)
    assert str(info.value) == ("inline: the working directory no longer exists; change to an "
                               "existing directory")
