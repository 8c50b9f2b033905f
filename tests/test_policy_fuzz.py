"""Property tests of the policy parser (hypothesis).

Whatever text or mapping a caller hands in, the parser either returns a policy
or raises a sandlock error -- never anything else -- and the policy it returns
is never broader than the text: every path with its access, every port, every
network switch, scope relaxation, syscall allowance, limit and compat mode comes
from the text or from a built-in profile the text extends. Through the CLI,
`validate` always ends in exit 0 or 125.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandlock.cli.main import cli
from sandlock.errors import SandlockError
from sandlock.policy.model import (
    DEFAULT_ENV_PASS,
    Access,
    Compat,
    Policy,
    load_profile,
    loads_policy,
    policy_from_dict,
)

WORKSPACE = "/tmp"
VARIABLES = {"workspace": WORKSPACE}
#: Paths that exist on any Linux, so some generated policies load successfully.
PATHS = ["/usr/lib", "/tmp", "/etc/hosts", "/dev/null", "${workspace}", "${workspace}/../etc",
         "~", "${home}", "/", "/proc", "/proc/self", "/sys", "relative", "${nope}", "/tmp/./x/..",
         "//usr//lib", "/usr/bin/python3"]
WORDS = ["64MiB", "1GiB", "30s", "500ms", "2m", "1-100", "80", "strict", "best-effort", "base",
         "python", "LC_*", "PATH", "ptrace", "io_uring_setup", "bpf", "HOME", "${workspace}"]
SCHEMA = {
    "filesystem": ["read", "write", "exec"],
    "network": ["connect", "bind", "udp", "unix"],
    "scope": ["signals", "abstract_unix"],
    "env": ["pass", "set"],
    "limits": ["timeout", "cpu", "memory", "processes", "open_files", "file_size"],
    "syscalls": ["deny", "allow"],
}
TOP = ["version", "description", "extends", "compat"]

text = st.text(st.characters(codec="utf-8"), max_size=12)
scalars = st.one_of(
    st.booleans(), st.integers(-(2**70), 2**70), st.integers(0, 70000),
    st.floats(allow_nan=True, allow_infinity=True), text,
    st.sampled_from(PATHS), st.sampled_from(WORDS),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["path", "optional", "x", "HOME", "PATH"]), inner,
                      max_size=3),
    max_leaves=8,
)
path_entries = st.lists(
    st.one_of(st.sampled_from(PATHS),
              st.fixed_dictionaries({"path": st.sampled_from(PATHS)},
                                    optional={"optional": st.booleans()})),
    max_size=4)
ports = st.lists(st.one_of(st.integers(-1, 70000), st.sampled_from(["80", "1-100", "9-3", "x"])),
                 max_size=3)
names = st.sampled_from(["ptrace", "bpf", "mount", "io_uring_setup", "clone", "nosuch", "X"])
sizes = st.one_of(st.sampled_from(["64MiB", "1GiB", "12", "0", "-1MiB", "1.5K", "10 PB"]),
                  st.integers(-5, 2**40))
durations = st.one_of(st.sampled_from(["30s", "500ms", "2m", "1h", "0s", "-1s", "5d"]),
                      st.integers(-5, 10**10), st.floats(allow_nan=True))
#: A plausible value for each key; hostile values are mixed in by ``documents``.
PLAUSIBLE = {
    "version": st.just(1), "description": text,
    "extends": st.lists(st.sampled_from(["base", "python", "nope", "../x.toml"]), max_size=2),
    "compat": st.sampled_from(["strict", "best-effort", "lax"]),
    "filesystem": path_entries, "network.connect": ports, "network.bind": ports,
    "network.udp": st.booleans(), "network.unix": st.booleans(),
    "scope": st.booleans(),
    "env.pass": st.lists(st.sampled_from(["PATH", "LC_*", "SANDLOCK_*", "*", "bad name"]),
                         max_size=3),
    "env.set": st.dictionaries(st.sampled_from(["HOME", "X", "1BAD"]),
                               st.sampled_from(["${workspace}", "v", "${nope}"]), max_size=2),
    "limits.timeout": durations, "limits.cpu": durations, "limits.memory": sizes,
    "limits.file_size": sizes, "limits.processes": st.integers(-1, 2**63),
    "limits.open_files": st.integers(-1, 5000),
    "syscalls": st.lists(names, max_size=3),
}


def _plausible(section: str, key: str) -> Any:
    for name in (f"{section}.{key}", section, key):
        if name in PLAUSIBLE:
            return PLAUSIBLE[name]
    return None


@st.composite
def documents(draw: Any) -> dict[str, Any]:
    """Policy-shaped mappings: mostly the real keys with plausible values, some hostile."""
    hostile = draw(st.booleans())  # half the documents only ever use plausible values

    def value(strategy: Any) -> Any:
        if strategy is None or hostile and draw(st.integers(0, 5)) == 0:
            return draw(values)
        return draw(strategy)

    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(TOP), unique=True, max_size=4)):
        doc[key] = value(PLAUSIBLE[key])
    for section in draw(st.lists(st.sampled_from(list(SCHEMA)), unique=True, max_size=5)):
        table = {key: value(_plausible(section, key))
                 for key in draw(st.lists(st.sampled_from(SCHEMA[section]), unique=True,
                                          max_size=4))}
        if hostile and draw(st.integers(0, 9)) == 0:
            table["bogus"] = draw(values)
        doc[section] = draw(values) if hostile and draw(st.integers(0, 9)) == 0 else table
    if hostile and draw(st.integers(0, 9)) == 0:
        doc["bogus"] = draw(values)
    return doc


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{_quote(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def to_toml(doc: dict[str, Any]) -> str:
    plain = [f"{_quote(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [f"[{_quote(k)}]\n" + "\n".join(f"{_quote(kk)} = {toml_value(vv)}"
                                                 for kk, vv in v.items())
              for k, v in doc.items() if isinstance(v, dict)]
    return "\n".join(plain + tables) + "\n"


# ---------------------------------------------------------------------------
# "Never broader than its text"


def _expand(raw: str) -> str:
    """An independent reading of the variable rules in the README."""
    names = {**VARIABLES, "home": os.path.expanduser("~"), "cwd": os.getcwd(),
             "tmpdir": os.environ.get("TMPDIR") or "/tmp"}
    out = re.sub(r"\$\{([^}]*)\}", lambda m: names[m.group(1)], raw)
    if out == "~" or out.startswith("~/"):
        out = names["home"] + out[1:]
    out = os.path.normpath(out)
    return "/" + out.lstrip("/") if out.startswith("//") else out


def _given_paths(doc: dict[str, Any]) -> set[tuple[str, Access]]:
    pairs = set()
    fs = doc.get("filesystem")
    for access in Access:
        entries = fs.get(access.value, []) if isinstance(fs, dict) else []
        for entry in entries if isinstance(entries, list) else []:
            raw = entry.get("path") if isinstance(entry, dict) else entry
            if isinstance(raw, str):
                try:
                    pairs.add((_expand(raw), access))
                except KeyError:
                    pass
    for name in ("base", "python"):
        if name in (doc.get("extends") or []) or (name == "base" and "python" in
                                                   (doc.get("extends") or [])):
            pairs |= {(r.path, r.access) for r in load_profile(name).paths}
    return pairs


def _ports(items: Any) -> set[tuple[int, int]]:
    out = set()
    for item in items if isinstance(items, list) else []:
        numbers = [int(n) for n in re.findall(r"\d+", str(item))]
        if numbers:
            out.add((numbers[0], numbers[-1]))
    return out


def _table(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def assert_not_broader(policy: Policy, doc: dict[str, Any]) -> None:
    given_paths = _given_paths(doc)
    for rule in policy.paths:
        assert (rule.path, rule.access) in given_paths, rule
    net = _table(doc, "network")
    for kind in ("connect", "bind"):
        allowed = _ports(net.get(kind))
        for span in getattr(policy.network, kind):
            assert (span.low, span.high) in allowed, (kind, span)
    assert not policy.network.udp or net.get("udp") is True
    assert not policy.network.unix or net.get("unix") is True
    for name in vars(policy.network):  # any other grant (host allowlists...) needs its key
        assert not getattr(policy.network, name) or name in net, name
    scope = _table(doc, "scope")
    assert policy.scope.signals or scope.get("signals") is False
    assert policy.scope.abstract_unix or scope.get("abstract_unix") is False
    syscalls = _table(doc, "syscalls")
    assert set(policy.syscalls.allow) <= set(syscalls.get("allow") or [])
    limits = _table(doc, "limits")
    for name in SCHEMA["limits"]:
        assert getattr(policy.limits, name) is None or name in limits, name
    assert policy.compat is Compat.STRICT or doc.get("compat") == "best-effort"
    env = _table(doc, "env")
    profile_pass = set(load_profile("python").env.passed)
    given_pass = set(env.get("pass") or [])
    assert set(policy.env.passed) <= given_pass | profile_pass | set(DEFAULT_ENV_PASS)


# ---------------------------------------------------------------------------
# Properties

FUZZ = settings(max_examples=150, suppress_health_check=list(HealthCheck))


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_never_crashes(text: str) -> None:
    try:
        loads_policy(text, VARIABLES)
    except SandlockError:
        pass


@FUZZ
@given(documents())
def test_policy_shaped_toml_never_crashes_nor_broadens(doc: dict[str, Any]) -> None:
    try:
        policy = loads_policy(to_toml(doc), VARIABLES)
    except SandlockError:
        return
    assert_not_broader(policy, doc)


@FUZZ
@given(st.one_of(documents(), st.dictionaries(st.text(max_size=8), values, max_size=4),
                 st.dictionaries(st.sampled_from(list(SCHEMA)),
                                 st.dictionaries(st.text(max_size=6),
                                                 st.one_of(values, st.none(), st.binary(),
                                                           st.tuples(scalars)),
                                                 max_size=3),
                                 max_size=3)))
def test_arbitrary_dicts_never_crash_nor_broaden(doc: dict[str, Any]) -> None:
    try:
        policy = policy_from_dict(doc, VARIABLES)
    except SandlockError:
        return
    assert_not_broader(policy, doc)


@settings(max_examples=60, suppress_health_check=list(HealthCheck))
@given(st.one_of(documents().map(to_toml), st.text(max_size=120)))
def test_validate_exits_0_or_125(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = Path(tmp_path_factory.mktemp("fuzz")) / "policy.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code in (0, 125), (text, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
