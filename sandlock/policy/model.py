"""Parse a TOML allowlist into an immutable, validated :class:`Policy`.

Parse, then apply: this module reads policy files and checks that named paths
exist, but it never opens a path for the sandbox or calls a restricting syscall.
Everything not granted here is denied by :mod:`sandlock.compile.ruleset` and
:mod:`sandlock.compile.seccomp`.

Pipeline: TOML text -> schema check of one layer (keys, types, values, with the
file and line of every error) -> variable expansion -> ``extends`` merge (lists
union, scalars overridden by the child) -> path checks -> :class:`Policy`.
"""

from __future__ import annotations

import enum
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import PolicyError
from . import builtins as _builtins
from .positions import find_deep_nesting, find_element_lines, find_line
from .profiles import DIR as _SHIPPED

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - Python < 3.11
    import tomli as _toml

PROFILE_DIR = Path(_SHIPPED)  #: the shipped profiles and tool policies (package data)
DEFAULT_ENV_PASS = ("PATH", "LANG", "LC_*", "TERM", "TZ")
#: Paths a policy may never grant write access to (nor anything beneath /proc, /sys).
FORBIDDEN_WRITE = ("/", "/proc", "/sys")
#: Deepest nesting of arrays and inline tables a policy may use (the schema needs 3).
MAX_NESTING = 32
#: Longest chain of ``extends`` from a policy to its most distant base.
MAX_EXTENDS_DEPTH = 32
#: Most layers one policy may merge, counting a file each time it is extended.
MAX_LAYERS = 256
#: Largest size (bytes) a limit may name: 2^60, far beyond any memory or file.
MAX_SIZE = 1 << 60
#: Longest duration (seconds) a limit may name: about 31 years.
MAX_DURATION = 10**9
#: Largest count a limit may name.
MAX_COUNT = 1 << 62
#: Smallest ``[limits] memory`` (RLIMIT_AS, bytes): below about 3 MiB the dynamic loader
#: cannot even map libc (measured: ``/bin/true`` and ``/bin/sh`` need ~3 MiB, python3
#: ~10 MiB), and the tool dies in execve (SIGSEGV, or 127 from the loader).
MIN_MEMORY = 8 << 20
#: Smallest ``[limits] open_files`` (RLIMIT_NOFILE): stdio and one descriptor for the
#: loader to open each library with; with fewer no dynamically linked program starts.
MIN_OPEN_FILES = 4


class Access(str, enum.Enum):
    READ = "read"
    WRITE = "write"
    EXEC = "exec"


class Compat(str, enum.Enum):
    STRICT = "strict"
    BEST_EFFORT = "best-effort"


#: The gaps a strict policy may accept one by one (``accept = [NAME, ...]``, ``--accept
#: NAME``, ``Sandbox(accept=...)``), every other gap still refused: the stable name, and
#: the protection it gives up (each :class:`sandlock.compile.ruleset.Gap` carries its name).
#: Filesystem confinement (no Landlock at all) has none: only best-effort runs without it.
ACCEPTABLE_GAPS = {
    "tcp-ports": "TCP port restriction (Landlock ABI 4)",
    "ioctl-dev": "device ioctl restriction (Landlock ABI 5)",
    "abstract-unix": "abstract unix socket scope (Landlock ABI 6)",
    "signal-scope": "signal scope (Landlock ABI 6, or the signal gate; or [scope] signals = false)",
    "processes": "process limit of [limits] processes (a pids cgroup this caller can create)",
}


def accept_names(value: object) -> tuple[str, ...]:
    """``accept``: names of :data:`ACCEPTABLE_GAPS`, each checked (an error names its index)."""
    names = _string_list(value)
    for index, name in enumerate(names):
        if name not in ACCEPTABLE_GAPS:
            raise _Bad(f"unknown gap name {name!r} (expected one of: {', '.join(ACCEPTABLE_GAPS)})",
                       (index,))
    return names


@dataclass(frozen=True)
class PathRule:
    """One path the policy grants, with the access it grants there."""

    path: str
    access: Access
    optional: bool = False
    origin: str = ""  #: "file:line key" for messages


@dataclass(frozen=True)
class PortRange:
    """TCP ports ``low`` to ``high``, both included."""

    low: int
    high: int

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class Network:
    """``[network]``: the ports, socket kinds and hosts a tool may use."""

    connect: tuple[PortRange, ...] = ()
    bind: tuple[PortRange, ...] = ()
    udp: bool = False
    unix: bool = False
    #: Host allowlist (issue 7), :class:`sandlock.policy.netrules.HostRule` tuples and (name, address) pins.
    allow: tuple[Any, ...] = ()
    deny: tuple[Any, ...] = ()
    hosts: tuple[tuple[str, str], ...] = ()

    @property
    def tcp(self) -> bool:
        return bool(self.connect or self.bind or self.allow)


@dataclass(frozen=True)
class Scopes:
    """``[scope]``: whether signals and abstract unix sockets stay inside the sandbox."""

    signals: bool = True
    abstract_unix: bool = True


@dataclass(frozen=True)
class EnvSpec:
    """``[env]``: the variables passed from the caller, and those set."""

    passed: tuple[str, ...] = DEFAULT_ENV_PASS
    set: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Limits:
    """``[limits]``: the wall-clock timeout and the rlimits of a run."""

    timeout: float | None = None  #: seconds of wall clock
    cpu: int | None = None  #: seconds of CPU (RLIMIT_CPU)
    memory: int | None = None  #: bytes of address space (RLIMIT_AS)
    processes: int | None = None  #: RLIMIT_NPROC (per user: see README)
    open_files: int | None = None  #: RLIMIT_NOFILE
    file_size: int | None = None  #: bytes (RLIMIT_FSIZE)


#: Syscalls whose ``[syscalls] allow`` lets the tool make or join namespaces (user
#: namespaces: unshare(2), clone(2) flags, setns(2)). Landlock and seccomp stay on in
#: them, but a user namespace hands the tool every capability over it, and with those
#: the kernel code behind many of them (netfilter, mounts): a large attack surface.
NAMESPACE_SYSCALLS = ("unshare", "clone", "clone3", "setns")


@dataclass(frozen=True)
class Syscalls:
    """``[syscalls]``: names denied beyond the default list, and defaults allowed."""

    deny: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()


@dataclass(frozen=True)
class Policy:
    """The effective policy of one tool after ``extends`` and variables."""

    source: str = "<policy>"
    description: str = ""
    compat: Compat = Compat.STRICT
    #: Names of :data:`ACCEPTABLE_GAPS` a strict run accepts (reported, never silent).
    accept: tuple[str, ...] = ()
    paths: tuple[PathRule, ...] = ()
    network: Network = field(default_factory=Network)
    scope: Scopes = field(default_factory=Scopes)
    env: EnvSpec = field(default_factory=EnvSpec)
    limits: Limits = field(default_factory=Limits)
    syscalls: Syscalls = field(default_factory=Syscalls)
    layers: tuple[str, ...] = ()  #: every file merged, base first
    #: ``[credentials]`` (issue 16): :class:`sandlock.policy.credentials.Credential` tuples.
    credentials: tuple[Any, ...] = ()
    #: (source, text) of every layer read from a file or profile, exactly as compiled
    inputs: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    #: The optional paths skipped because they did not exist when loaded (the compiled-policy
    #: cache re-checks them on a hit, without loading the policy a second time).
    absent: tuple[str, ...] = field(default=(), compare=False, repr=False)
    #: ``[mcp] isolation``: read only by the MCP gateway (:data:`MCP_ISOLATION`).
    mcp_isolation: str = "call"

    def own_text(self) -> str | None:
        """The policy's own TOML text (its last layer: the file ``source`` names, or the
        text given) exactly as loaded; None for a policy given as a dict. Every layer it
        extends is read from a file, so only its own can lack a text: ``inputs`` then
        holds one entry fewer than ``layers``."""
        if self.inputs and len(self.inputs) == len(self.layers):
            return self.inputs[-1][1]
        return None

    def with_compat(self, compat: Compat) -> Policy:
        from dataclasses import replace

        return replace(self, compat=compat)

    def with_accept(self, names: Sequence[str], source: str = "--accept") -> Policy:
        """This policy accepting the gaps ``names`` too (a PolicyError naming ``source``
        and the name for one that is not in :data:`ACCEPTABLE_GAPS`)."""
        from dataclasses import replace

        try:
            added = accept_names(list(names))
        except _Bad as bad:
            raise PolicyError(str(bad), source=source) from None
        return replace(self, accept=_union((*self.accept, *added)))

    def with_timeout(self, timeout: float | None) -> Policy:
        from dataclasses import replace

        return replace(self, limits=replace(self.limits, timeout=timeout))


def cautions(policy: Policy) -> tuple[str, ...]:
    """What the policy lets a tool do that its author should hear about, though it is
    allowed: ``file:line: key: why`` lines, for validate, explain and the run that
    compiles the policy (a cached run stays quiet). Today: namespaces
    (:data:`NAMESPACE_SYSCALLS`)."""
    opened = [name for name in policy.syscalls.allow if name in NAMESPACE_SYSCALLS]
    if not opened:
        return ()
    where = policy.source
    for source, text in reversed(policy.inputs):  # the layer that says it, with its line
        line = find_line(text, ["syscalls", "allow"])
        if line is not None:
            where = f"{source}:{line}"
            break
    return (f"{where}: syscalls.allow: {', '.join(opened)} let the tool create or join "
            "namespaces (e.g. `unshare -U`): Landlock and seccomp still confine it there, but "
            "a user namespace gives it capabilities inside, and with them far more kernel code "
            "to attack; allow these only for a tool that needs them",)


# ----------------------------------------------------------------------------
# Schema of one layer: key -> validator. A validator returns the normalized value
# or raises _Bad; the caller adds file, line and key path.


class _Bad(Exception):
    def __init__(self, message: str, subkey: Sequence[str | int] = ()) -> None:
        super().__init__(message)
        self.subkey = tuple(subkey)


def _shown(value: object) -> str:
    """``repr(value)``, cut short: a message must stay one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + "..." + text[-10:]


def _typename(value: object) -> str:
    return {
        bool: "a boolean", int: "an integer", float: "a float", str: "a string",
        list: "an array", dict: "a table",
    }.get(type(value), type(value).__name__)


def _expect(value: object, kind: type, what: str) -> Any:
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise _Bad(f"expected {what}, got {_typename(value)}")
    return value


def _string(value: object) -> str:
    text: str = _expect(value, str, "a string")
    if "\x00" in text:
        raise _Bad("must not contain a NUL character")
    return text


def _boolean(value: object) -> bool:
    result: bool = _expect(value, bool, "true or false")
    return result


def _string_list(value: object) -> tuple[str, ...]:
    items = _expect(value, list, "an array of strings")
    out = []
    for index, item in enumerate(items):
        try:
            out.append(_string(item))
        except _Bad as bad:
            raise _Bad(str(bad), (index,)) from None
    return tuple(out)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1000, "KIB": 1024, "M": 1024**2, "MB": 1000**2,
               "MIB": 1024**2, "G": 1024**3, "GB": 1000**3, "GIB": 1024**3, "T": 1024**4,
               "TB": 1000**4, "TIB": 1024**4}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0}


def parse_size(value: object) -> int:
    """``512MiB``, ``64MB``, ``1G`` or a plain integer number of bytes, at most MAX_SIZE."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        text = _expect(value, str, 'a size such as 512MiB or an integer number of bytes')
        match = _SIZE.match(text)
        if not match or match.group(2).upper() not in _SIZE_UNITS:
            raise _Bad(f"invalid size {_shown(text)} (use e.g. 64MiB, 1GiB, 500MB)")
        number = float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
        size = int(number) if number <= MAX_SIZE else MAX_SIZE + 1  # inf has no int
    if size <= 0:
        raise _Bad(f"size must be positive, got {_shown(value)}")
    if size > MAX_SIZE:
        raise _Bad(f"size {_shown(value)} is too large (at most {MAX_SIZE} bytes, 1024PiB)")
    return size


def parse_duration(value: object) -> float:
    """``30s``, ``500ms``, ``2m``, ``1h`` or a number of seconds."""
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = float(min(max(value, 0), MAX_DURATION + 1))  # a float cannot hold every int
    elif isinstance(value, float):
        seconds = value
    else:
        text = _expect(value, str, "a duration such as 30s or a number of seconds")
        match = _DURATION.match(text)
        if not match:
            raise _Bad(f"invalid duration {_shown(text)} (use e.g. 500ms, 30s, 2m, 1h)")
        seconds = min(float(match.group(1)) * _DURATION_UNITS[match.group(2)],
                      MAX_DURATION + 1)  # digits beyond a float's range are not "inf"
    if not 0 < seconds < float("inf"):
        raise _Bad(f"duration must be positive and finite, got {_shown(value)}")
    if seconds > MAX_DURATION:
        raise _Bad(f"duration {_shown(value)} is too long (at most {MAX_DURATION}s, about 31 years)")
    return seconds


def _memory(value: object) -> int:
    """``[limits] memory``: a size no smaller than MIN_MEMORY."""
    size = parse_size(value)
    if size < MIN_MEMORY:
        raise _Bad(f"{_shown(value)} of address space is below the smallest memory limit, "
                   f"8MiB ({MIN_MEMORY} bytes): no program can start under about 3MiB (the "
                   "loader maps libc into it), and most need 64MiB or more")
    return size


def _open_files(value: object) -> int:
    """``[limits] open_files``: a count no smaller than MIN_OPEN_FILES."""
    number = _count(value)
    if number < MIN_OPEN_FILES:
        raise _Bad(f"{number} open files is too few: no program can start with fewer than "
                   f"{MIN_OPEN_FILES} (its standard streams and one for the loader)")
    return number


def _count(value: object) -> int:
    number: int = _expect(value, int, "a positive integer")
    if number <= 0:
        raise _Bad(f"expected a positive integer, got {number}")
    if number > MAX_COUNT:
        raise _Bad(f"{_shown(number)} is too large (at most {MAX_COUNT}, 2^62)")
    return number


def _cpu_seconds(value: object) -> int:
    return max(1, int(-(-parse_duration(value) // 1)))


def parse_ports(value: object, *, ephemeral: bool = False) -> tuple[PortRange, ...]:
    """An array of ports: integers 1-65535 or ``"low-high"`` strings.

    ``ephemeral`` (``bind`` only) also accepts port 0: a Landlock bind rule on port 0
    lets the tool bind port 0, so that the kernel picks a free port from
    ``net.ipv4.ip_local_port_range`` (a test server's usual ``bind(("127.0.0.1", 0))``);
    explicit ports stay refused unless granted. See ``struct landlock_net_port_attr``
    in https://docs.kernel.org/userspace-api/landlock.html. Connecting to port 0
    means nothing, so ``connect`` keeps 1-65535."""
    items = _expect(value, list, "an array of ports (integers or \"low-high\" strings)")
    out = []
    for index, item in enumerate(items):
        try:
            out.append(_port_range(item, 0 if ephemeral else 1))
        except _Bad as bad:
            raise _Bad(str(bad), (index,)) from None
    return tuple(out)


def _bind_ports(value: object) -> tuple[PortRange, ...]:
    return parse_ports(value, ephemeral=True)


def _port_range(item: object, lowest: int = 1) -> PortRange:
    if isinstance(item, int) and not isinstance(item, bool):
        low = high = item
    elif isinstance(item, str) and re.fullmatch(r"\s*\d{1,5}\s*(-\s*\d{1,5}\s*)?", item):
        parts = [int(p) for p in item.split("-")]
        low, high = parts[0], parts[-1]
    else:
        raise _Bad(f"expected a port number or \"low-high\" range, got {_shown(item)}")
    if not lowest <= low <= high <= 65535:
        what = ("ports are 0-65535 (0: an ephemeral port the kernel picks), low <= high"
                if lowest == 0 else "ports are 1-65535, low <= high")
        raise _Bad(f"invalid port range {_shown(item)}: {what}")
    return PortRange(low, high)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_GLOB = re.compile(r"^[A-Za-z0-9_*?\[\]]+$")
_SYSCALL = re.compile(r"^[a-z_][a-z0-9_]*$")


def _env_pass(value: object) -> tuple[str, ...]:
    names = _string_list(value)
    for index, name in enumerate(names):
        if not _ENV_GLOB.match(name):
            raise _Bad(f"invalid variable name or glob {name!r}", (index,))
    return names


def _env_set(value: object) -> tuple[tuple[str, str], ...]:
    table = _expect(value, dict, "a table of NAME = \"value\"")
    out = []
    for name, item in table.items():
        if not _ENV_NAME.match(name):
            raise _Bad(f"invalid environment variable name {name!r}", (name,))
        try:
            out.append((name, _string(item)))
        except _Bad as bad:
            raise _Bad(str(bad), (name,)) from None
    return tuple(out)


def _syscall_names(value: object) -> tuple[str, ...]:
    names = _string_list(value)
    for index, name in enumerate(names):
        if not _SYSCALL.match(name):
            raise _Bad(f"invalid syscall name {name!r}", (index,))
    return names


def _compat(value: object) -> Compat:
    text = _string(value)
    try:
        return Compat(text)
    except ValueError:
        raise _Bad(f'expected "strict" or "best-effort", got {text!r}') from None


#: How the MCP gateway (``sandlock mcp``) runs a tool's server: a fresh confined
#: instance per call, or one per tool kept warm (sandlock/integrations/mcp/gateway.py).
MCP_ISOLATION = ("call", "tool")


def _isolation(value: object) -> str:
    text = _string(value)
    if text not in MCP_ISOLATION:
        raise _Bad(f'expected "call" or "tool", got {text!r}')
    return text


def _version(value: object) -> int:
    if _expect(value, int, "an integer") != 1:
        raise _Bad(f"unsupported policy version {value!r} (this sandlock reads version 1)")
    return 1


def _path_entries(value: object) -> tuple[tuple[str, bool], ...]:
    items = _expect(value, list, 'an array of paths or { path = "...", optional = true } tables')
    out = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            out.append((_string(item), False))
            continue
        if not isinstance(item, dict):
            raise _Bad(f"expected a path string or a table, got {_typename(item)}", (index,))
        unknown = sorted(set(item) - {"path", "optional"})
        if unknown:
            raise _Bad(f"unknown key {unknown[0]!r} (expected path, optional)", (index, unknown[0]))
        if "path" not in item:
            raise _Bad("missing key 'path'", (index,))
        try:
            path = _string(item["path"])
        except _Bad as bad:
            raise _Bad(str(bad), (index, "path")) from None
        try:
            optional = _boolean(item.get("optional", False))
        except _Bad as bad:
            raise _Bad(str(bad), (index, "optional")) from None
        out.append((path, optional))
    return tuple(out)


def _host_rules(kind: str) -> Callable[[object], Any]:
    """``allow``/``deny`` host rules; netrules is imported only by policies that use them."""

    def check(value: object) -> Any:
        from . import netrules

        try:
            return netrules.parse_rules(_string_list(value), kind)
        except netrules.RuleError as bad:
            raise _Bad(str(bad), (bad.index,)) from None

    return check


def _host_pins(value: object) -> tuple[tuple[str, str], ...]:
    from . import netrules

    try:
        return netrules.parse_pins(_expect(value, dict, 'a table of "name" = "IP address" or "system"'))
    except netrules.RuleError as bad:
        raise _Bad(str(bad), (bad.index,)) from None


def _credentials(value: object) -> Any:
    """``[credentials.NAME]`` tables; sandlock.policy.credentials is imported only when used."""
    from . import credentials

    try:
        return credentials.parse_table(value)
    except credentials.CredentialError as bad:
        raise _Bad(str(bad), bad.key) from None


def _merge_credentials(layers: list[_Layer], items: tuple[Any, ...],
                       variables: Mapping[str, str]) -> tuple[Any, ...]:
    if not items:
        return ()
    from . import credentials

    def expand(text: str) -> str:
        try:
            return _expand(text, variables)
        except _Bad as bad:
            raise credentials.CredentialError(str(bad)) from None

    try:
        return credentials.merge(items, expand)
    except credentials.CredentialError as bad:
        raise layers[-1].error(str(bad), ["credentials", *bad.key]) from None


Validator = Callable[[object], Any]
SCHEMA: dict[str, Validator | dict[str, Validator]] = {
    "version": _version,
    "description": _string,
    "extends": _string_list,
    "compat": _compat,
    "accept": accept_names,
    "filesystem": {"read": _path_entries, "write": _path_entries, "exec": _path_entries},
    "network": {"connect": parse_ports, "bind": _bind_ports, "udp": _boolean, "unix": _boolean,
                "allow": _host_rules("allow"), "deny": _host_rules("deny"), "hosts": _host_pins},
    "scope": {"signals": _boolean, "abstract_unix": _boolean},
    "env": {"pass": _env_pass, "set": _env_set},
    "limits": {
        "timeout": parse_duration, "cpu": _cpu_seconds, "memory": _memory,
        "processes": _count, "open_files": _open_files, "file_size": parse_size,
    },
    "syscalls": {"deny": _syscall_names, "allow": _syscall_names},
    "credentials": _credentials,
    "mcp": {"isolation": _isolation},
}


def effective(policy: Policy, port: int) -> Policy:
    """The policy a run of ``policy`` (with ``[credentials]``) is compiled from, once its
    route server listens on ``port``: the one computation of the grants credential
    routes add, for every executor (`sandlock run`, `trace`, the API, `sandlock probe`),
    applied before compiling so the Landlock rules and the seccomp filter agree on it.

    - TCP connect to ``127.0.0.1:PORT`` (:func:`with_loopback_port`): that address only,
      decided by the connect gate, which admits each connection to the route for its run
      (:meth:`sandlock.net.routes.RouteServer.admit`): always through the gate, also for a
      policy that reaches other hosts by port, so no other process borrows the route.

    The credentials stay in the policy (the executor serves them; a policy holding them
    is never stored in the compiled-policy cache, so no run's port outlives the run)."""
    return with_loopback_port(policy, port, "credential routes", gated=True)


def with_loopback_port(policy: Policy, port: int, why: str, gated: bool = False) -> Policy:
    """``policy`` granting TCP connect to ``127.0.0.1:PORT``, whose text names ``why``.

    A Landlock port rule is a port on every address: as a ``connect`` entry the route's
    port reached any host listening on it (an exfiltration server listening on every
    port). So it is an allowed ``127.0.0.1:PORT`` of the host allowlist, whose connect gate
    decides by address: under ``[network] allow`` beside the policy's rules, and for a
    policy that reaches no other host (no ``connect``, no ``udp``) as its one rule (the gate
    and proxy then run for it). A policy that already reaches every host on its
    ``connect`` ports, or by UDP, gets a ``connect`` entry as those are (it adds no host
    the policy cannot reach already), unless ``gated``: the gate decides every connect
    to the port (its ``connect`` ports it lets reach any host, as Landlock would)."""
    from dataclasses import replace

    network = policy.network
    if gated or network.allow or not (network.connect or network.udp):
        from .netrules import parse_rules

        extra = parse_rules([f"127.0.0.1:{port}"], "allow")[0]
        network = replace(network, allow=(*network.allow, replace(
            extra, where=f"allow[{len(network.allow)}]", text=f"{why} {extra.text}")))
    else:
        network = replace(network, connect=(*network.connect, PortRange(port, port)))
    return replace(policy, network=network)


def check_limits(policy: Policy) -> None:
    """Check the limits of a ``Policy`` built without the loader (the API takes one)
    with the very validators of its keys: a PolicyError naming the key, as loading says."""
    checks = SCHEMA["limits"]
    assert isinstance(checks, dict)
    for key, check in checks.items():
        value = getattr(policy.limits, key)
        if value is not None and key != "timeout":  # a float of seconds, checked by its users
            try:
                check(value)
            except _Bad as bad:
                raise PolicyError(str(bad), source=policy.source, key=f"limits.{key}") from None


# ----------------------------------------------------------------------------
# One layer


@dataclass
class _Layer:
    """One file, profile or dict of a policy, validated, before the merge."""

    source: str
    text: str | None
    base_dir: Path | None
    values: dict[str, Any]  # "section.key" or "key" -> validated value
    prefix: tuple[str, ...] = ()  #: where this table sits in ``text`` (lines only)

    def error(self, message: str, key: Sequence[str | int]) -> PolicyError:
        line = find_line(self.text, [*self.prefix, *key]) if self.text is not None else None
        return PolicyError(message, source=self.source, key=_keypath(key), line=line)


def _keypath(key: Sequence[str | int]) -> str:
    out = ""
    for part in key:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _check_layer(data: Mapping[str, Any], layer: _Layer,
                 errors: list[PolicyError] | None = None) -> None:
    """Validate one layer's keys into ``layer.values``. The first error is raised, or,
    given ``errors``, every key is checked and each error appended (``validate``)."""
    for name, value in data.items():
        rule = SCHEMA.get(name)
        try:
            if rule is None:
                raise layer.error(f"unknown key (expected one of: {', '.join(SCHEMA)})", [name])
            if callable(rule):
                layer.values[name] = _run(rule, value, [name], layer)
                continue
            if not isinstance(value, dict):
                raise layer.error(f"expected a table, got {_typename(value)}", [name])
        except PolicyError as exc:
            if errors is None:
                raise
            errors.append(exc)
            continue
        for key, item in value.items():
            try:
                check = rule.get(key)
                if check is None:
                    raise layer.error(f"unknown key (expected one of: {', '.join(rule)})",
                                      [name, key])
                layer.values[f"{name}.{key}"] = _run(check, item, [name, key], layer)
            except PolicyError as exc:
                if errors is None:
                    raise
                errors.append(exc)
        if name == "env":
            layer.values["env"] = True


def schema_errors(data: Mapping[str, Any], source: str, text: str | None = None,
                  prefix: Sequence[str] = ()) -> list[PolicyError]:
    """Every schema error of one policy (each key checked on its own), for
    ``sandlock validate``: loading stops at the first. ``prefix``: where the policy's
    table sits in ``text`` (``("tools", NAME)`` in a registry file), to find lines."""
    errors: list[PolicyError] = []
    layer = _Layer(source, text, None, {}, tuple(prefix))
    _check_layer(data, layer, errors)
    return errors


def _run(check: Validator, value: object, key: list[str | int], layer: _Layer) -> Any:
    try:
        return check(value)
    except _Bad as bad:
        raise layer.error(str(bad), key + list(bad.subkey)) from None


# ----------------------------------------------------------------------------
# Variables

_VAR = re.compile(r"\$\{([^}]*)\}")
builtin_vars = _builtins.builtin_vars  #: ``${cwd}``, ``${home}``, ``${tmpdir}`` (one source)


def _expand(text: str, variables: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in variables:
            known = ", ".join(sorted(variables)) or "none"
            raise _Bad(f"undefined variable ${{{name}}} (defined: {known}; set one with --var {name}=VALUE)")
        return variables[name]

    if "${" in _VAR.sub("", text):
        raise _Bad(f"unterminated variable reference in {text!r}")
    out = _VAR.sub(one, text)
    if out == "~" or out.startswith("~/"):
        out = variables.get("home", os.path.expanduser("~")) + out[1:]
    return out


# ----------------------------------------------------------------------------
# Loading and merging


def _profile_path(name: str) -> Path:
    return PROFILE_DIR / f"{name}.toml"


def _is_profile(path: Path) -> bool:
    """True if ``path`` names a shipped profile (a name too long for a file is none)."""
    try:
        return path.parent == PROFILE_DIR and path.is_file()
    except (OSError, ValueError):
        return False


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with sandlock."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _parse_text(text: str, source: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] | None = _toml.loads(text)
    except RecursionError:  # the parser recurses once per level: a thousand exhaust it
        data = None
    except ValueError as exc:
        if isinstance(exc, _toml.TOMLDecodeError):
            raise _syntax_error(exc, source) from None
        # An integer of more digits than Python converts (sys.get_int_max_str_digits).
        digits = re.search(r"\d{1000}", text)
        raise PolicyError("TOML value out of range: a number with too many digits", source=source,
                          line=text.count("\n", 0, digits.start()) + 1 if digits else None) from None
    if data is None or _nested_deeper(data, MAX_NESTING):
        raise PolicyError(f"arrays and tables nested more than {MAX_NESTING} deep", source=source,
                          line=find_deep_nesting(text, MAX_NESTING))
    return data


def _nested_deeper(data: object, limit: int) -> bool:
    """Whether tables and arrays in ``data`` nest deeper than ``limit`` (no recursion:
    the depth is what is being checked)."""
    stack = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        values = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack += [(value, depth + 1) for value in values if isinstance(value, (dict, list))]
    return False


def _syntax_error(exc: Exception, source: str) -> PolicyError:
    match = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
    message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
    line, column = (int(match.group(1)), int(match.group(2))) if match else (None, None)
    return PolicyError(f"TOML syntax error: {message}", source=source, line=line, column=column)


def _read(path: Path, source: str) -> str:
    from .readfile import read_policy_bytes

    try:
        return _decode(read_policy_bytes(str(path)), source)
    except FileNotFoundError:
        raise PolicyError("policy file does not exist", source=source) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise PolicyError(f"cannot read policy file: {getattr(exc, 'strerror', None) or exc}",
                          source=source) from None


def _decode(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"cannot read policy file: {exc}", source=source) from None


def _load_layers(
    data: Mapping[str, Any], source: str, text: str | None, base_dir: Path | None,
    stack: tuple[str, ...], loaded: list[int] | None = None, seen: set[str] | None = None,
) -> list[_Layer]:
    """This layer and everything it extends, base first, each file once.

    A file two extended policies both extend (a diamond: ``cc`` extends ``base`` and
    ``tmpdir``, which extends ``base`` too) is merged where it first appears, never
    again later: merged twice, its scalars would override those of a layer between.

    ``stack``: the real paths from the top policy down to this one (cycles, depth);
    ``loaded``: how many layers were read so far, in a one-element list shared by the
    whole load (a diamond of extends must not multiply the files read without bound);
    ``seen``: the real paths of the files merged so far, shared the same way.
    """
    loaded = [0] if loaded is None else loaded
    merged = set(stack[:1]) if seen is None else seen  # shared, like ``loaded``
    layer = _Layer(source, text, base_dir, {})
    _check_layer(data, layer)
    layers: list[_Layer] = []
    for index, name in enumerate(layer.values.get("extends", ())):
        key: list[str | int] = ["extends", index]
        if len(stack) >= MAX_EXTENDS_DEPTH:
            raise layer.error(f"extends chain longer than {MAX_EXTENDS_DEPTH} files "
                              f"(from {stack[0]})", key)
        loaded[0] += 1
        if loaded[0] > MAX_LAYERS:
            raise layer.error(f"extends brings in more than {MAX_LAYERS} files (counting "
                              "each file every time it is extended)", key)
        if "/" in name or name.endswith(".toml"):
            if base_dir is None and not os.path.isabs(name):
                raise layer.error(f"cannot resolve relative path {name!r} without a policy file", key)
            path = (base_dir or Path("/")) / name
        else:
            path = _profile_path(name)
            if not _is_profile(path):
                known = ", ".join(builtin_profiles())
                raise layer.error(f"unknown built-in profile {name!r} (known: {known})", key)
        try:
            real = str(path.resolve())
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic link loop (< 3.13)
            raise layer.error(f"extended policy {str(path)!r} cannot be resolved: "
                              f"{getattr(exc, 'strerror', None) or exc}", key) from None
        if real in stack:
            chain = " -> ".join([*stack, real])
            raise layer.error(f"extends cycle: {chain}", key)
        if not os.path.lexists(path):
            raise layer.error(f"extended policy {str(path)!r} does not exist", key)
        if real in merged:
            continue
        merged.add(real)
        shown = f"<builtin:{name}>" if path.parent == PROFILE_DIR else str(path)
        child_text = _read(path, shown)  # regular files only, bounded, never blocks
        layers += _load_layers(_parse_text(child_text, shown), shown, child_text, path.parent,
                               (*stack, real), loaded, merged)
    layers.append(layer)
    return layers


def _union(items: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(items))


def _merge(layers: list[_Layer], variables: Mapping[str, str], check_paths: bool = True) -> Policy:
    scalars: dict[str, Any] = {}
    lists: dict[str, list[Any]] = {}
    env_set: dict[str, str] = {}
    env_given = False
    paths: list[PathRule] = []
    absent: list[str] = []
    for layer in layers:
        for key, value in layer.values.items():
            section, _, name = key.partition(".")
            if key in ("extends", "version", "env"):
                env_given = env_given or key == "env"
            elif section == "filesystem":
                paths += _resolve_paths(layer, name, value, variables, check_paths, absent)
            elif key == "env.set":
                for var, raw in value:
                    try:
                        env_set[var] = _expand(raw, variables)
                    except _Bad as bad:
                        raise layer.error(str(bad), ["env", "set", var]) from None
            elif isinstance(value, tuple):
                lists.setdefault(key, []).extend(value)
            else:
                scalars[key] = value
    get = scalars.get
    merged = {k: _union(v) for k, v in lists.items()}
    return Policy(
        source=layers[-1].source,
        description=get("description", ""),
        compat=get("compat", Compat.STRICT),
        accept=merged.get("accept", ()),  # every layer's, like every list: see README
        paths=_union(paths),
        network=Network(merged.get("network.connect", ()), merged.get("network.bind", ()),
                        get("network.udp", False), get("network.unix", False),
                        merged.get("network.allow", ()), merged.get("network.deny", ()),
                        merged.get("network.hosts", ())),
        scope=Scopes(get("scope.signals", True), get("scope.abstract_unix", True)),
        env=EnvSpec(merged.get("env.pass", ()), tuple(env_set.items())) if env_given
        else EnvSpec(),
        limits=Limits(get("limits.timeout"), get("limits.cpu"), get("limits.memory"),
                      get("limits.processes"), get("limits.open_files"), get("limits.file_size")),
        syscalls=Syscalls(merged.get("syscalls.deny", ()), merged.get("syscalls.allow", ())),
        layers=tuple(layer.source for layer in layers),
        credentials=_merge_credentials(layers, merged.get("credentials", ()), variables),
        inputs=tuple((layer.source, layer.text) for layer in layers if layer.text is not None),
        absent=_union(absent),
        mcp_isolation=get("mcp.isolation", "call"),
    )


def _resolve_paths(
    layer: _Layer, name: str, entries: tuple[tuple[str, bool], ...], variables: Mapping[str, str],
    check_paths: bool = True, absent: list[str] | None = None,
) -> list[PathRule]:
    access = Access(name)
    out = []
    lines = find_element_lines(layer.text, ["filesystem", name]) if layer.text is not None else []
    for index, (raw, optional) in enumerate(entries):
        key: list[str | int] = ["filesystem", name, index]
        try:
            path = _expand(raw, variables)
        except _Bad as bad:
            raise layer.error(str(bad), key) from None
        if not os.path.isabs(path):
            raise layer.error(f"path {path!r} is not absolute (use ${{cwd}}/... or an absolute path)",
                              key)
        path = os.path.normpath(path)
        if path.startswith("//"):
            path = "/" + path.lstrip("/")
        # What the path resolves to is checked on its descriptor when the ruleset is
        # built (sandlock.compile.grants): a second, name-based look here could only race.
        if access is Access.WRITE and write_never_allowed(path):
            raise layer.error(f"write access to {path!r} is never allowed", key)
        if check_paths and not os.path.exists(path):
            if optional:
                if absent is not None:
                    absent.append(path)
                continue
            raise layer.error(f"{path!r} does not exist (mark it {{ path = ..., optional = true }} "
                              "if it may be absent)", key)
        line = lines[index] if index < len(lines) else None
        origin = f"{layer.source}:{line}" if line else layer.source
        out.append(PathRule(path, access, optional, f"{origin} filesystem.{name}[{index}]"))
    return out


def write_never_allowed(path: str) -> bool:
    """A normalized absolute ``path`` no policy may grant write access to
    (:data:`FORBIDDEN_WRITE`, or anything beneath /proc and /sys): the policy loader
    refuses it, and `trace` and `learn` never suggest it."""
    return path in FORBIDDEN_WRITE or path.startswith(("/proc/", "/sys/"))


def _variables(extra: Mapping[str, str] | None, source: str) -> dict[str, str]:
    variables = builtin_vars(source)
    for name, value in (extra or {}).items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise PolicyError(f"invalid variable name {_shown(name)}", source="--var")
        if not isinstance(value, str) or "\x00" in value:
            raise PolicyError(f"{name}: the value must be a string without NUL characters",
                              source="--var")
        variables[name] = value
    return variables


def _resolve(path: Path, source: str) -> Path:
    """``path.resolve()``, its failures (a link loop, a deleted working directory) as
    PolicyError."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic link loop (< 3.13)
        raise PolicyError(f"cannot resolve the policy's path: {getattr(exc, 'strerror', None) or exc}",
                          source=source) from None


def load_policy(path: str | os.PathLike[str], variables: Mapping[str, str] | None = None,
                *, check_paths: bool = True, data: bytes | None = None) -> Policy:
    """Load a policy file with ``--var`` style variables.

    ``check_paths=False`` skips the existence check (for linting on another machine).
    ``data``: the file's bytes, already read by the caller (`sandlock run` reads a
    policy once and compiles exactly what it keyed its cache on).
    """
    file = Path(path)
    source = str(path)
    text = _read(file, source) if data is None else _decode(data, source)
    return loads_policy(text, variables, source=source, base_dir=_resolve(file, source).parent,
                        check_paths=check_paths)


def loads_policy(
    text: str, variables: Mapping[str, str] | None = None, *, source: str = "<string>",
    base_dir: Path | None = None, check_paths: bool = True,
) -> Policy:
    """Load a policy from TOML text."""
    data = _parse_text(text, source)
    real = str(_resolve(Path(source), source)) if base_dir is not None else source
    return _merge(_load_layers(data, source, text, base_dir, (real,)),
                  _variables(variables, source), check_paths)


def policy_from_dict(
    data: Mapping[str, Any], variables: Mapping[str, str] | None = None, *,
    source: str = "<dict>", base_dir: Path | None = None, check_paths: bool = True,
) -> Policy:
    """Load a policy from an already-parsed mapping (same schema as the TOML file)."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"expected a mapping, got {_typename(data)}", source=source)
    return _merge(_load_layers(data, source, None, base_dir, (source,)),
                  _variables(variables, source), check_paths)


def load_profile(name: str, variables: Mapping[str, str] | None = None) -> Policy:
    """Load a built-in profile by name."""
    path = _profile_path(name)
    if not _is_profile(path):
        raise PolicyError(f"unknown built-in profile {name!r} (known: {', '.join(builtin_profiles())})",
                          source=name)
    return load_policy(path, variables)
