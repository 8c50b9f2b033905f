"""The per-ABI matrix: every built-in profile's escape suite at Landlock ABI 1 to 6, strict.

``SANDLOCK_ABI=N`` makes sandlock build the ruleset an ABI-N kernel enforces (and the
substitutes an ABI-N run takes); the kernel here is newer, so what the ABI-N ruleset lets
through is what an ABI-N kernel lets through. For each profile, the probe
(:mod:`sandlock.probe`) runs through `sandlock run`'s launcher at the kernel's own ABI
(the reference) and at every older ABI, in strict mode; each row (outcome and verdict)
must be the reference's, except where :data:`STRICTER` documents a substitute stricter
than Landlock. A profile strict mode refuses at some ABI is listed in
:data:`EXPECTED_REFUSALS`, with the gap it names: when a substitute for that gap lands,
its entry goes and the rows are compared there too.

The probe prepares its targets once per run; one run takes about a second, so the
matrix (13 profiles, 7 ABIs) costs about 75 s on two cores.
"""

from __future__ import annotations

import sys
import venv
from pathlib import Path
from typing import Optional

import pytest
from conftest import require_abi

from sandlock.compile import seccomp
from sandlock.errors import KernelSupportError
from sandlock.policy.model import builtin_profiles, load_profile
from sandlock.probe.harness import FAILING, Report, probe_policy

#: The older ABIs the matrix pretends (the kernel's own is the reference).
ABIS = (1, 2, 3, 4, 5, 6)

#: Profiles strict mode refuses below some ABI, until a substitute covers the gap:
#: profile -> (the gap's accept name the refusal names, the first ABI that runs it).
EXPECTED_REFUSALS: dict[str, tuple[str, int]] = {
    # [network] connect: the TCP port restriction is Landlock ABI 4's (no substitute yet).
    "https_client": ("tcp-ports", 4),
    "psql": ("tcp-ports", 4),
    "redis_cli": ("tcp-ports", 4),
}

#: Rows where an ABI's run is documented as stricter than the reference (a substitute
#: refuses more than Landlock does): (profile or "*", row id) -> (ABIs, the reason).
#: Empty: every substitute blocks exactly what Landlock blocks, on these rows.
STRICTER: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}

Rows = dict[str, tuple[str, str]]


@pytest.fixture(scope="module")
def variables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The profiles' variables, on one prepared workspace shared by every run."""
    base = tmp_path_factory.mktemp("matrix")
    (base / "ws" / ".tmp").mkdir(parents=True)
    (base / "tmp").mkdir()
    prefix = Path(sys.prefix)
    if not (prefix / "pyvenv.cfg").is_file():
        prefix = base / "venv"
        venv.create(prefix, with_pip=False, symlinks=True)
    for path in (base, base / "ws", base / "ws" / ".tmp", base / "tmp"):
        path.chmod(0o755)
    return {"workspace": str(base / "ws"), "private_tmp": str(base / "tmp"), "venv": str(prefix)}


_REFERENCE: dict[str, Rows] = {}


def _rows(report: Report) -> Rows:
    return {r.id: (r.outcome, r.verdict) for r in report.results}


def _probe(name: str, abi: Optional[int], variables: dict[str, str],
           monkeypatch: pytest.MonkeyPatch) -> Report:
    """The probe of profile ``name`` at ``abi`` (None: the kernel's own), strict."""
    if abi is None:
        monkeypatch.delenv("SANDLOCK_ABI", raising=False)
    else:
        monkeypatch.setenv("SANDLOCK_ABI", str(abi))
    policy = load_profile(name, variables)
    assert policy.compat.value == "strict" and not policy.accept
    return probe_policy(policy)


def _reference(name: str, variables: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Rows:
    if name not in _REFERENCE:
        report = _probe(name, None, variables, monkeypatch)
        failed = [r for r in report.results if r.verdict in FAILING]
        assert not failed, (name, failed)
        _REFERENCE[name] = _rows(report)
    return _REFERENCE[name]


def _differences(name: str, abi: int, reference: Rows, got: Rows) -> dict[str, object]:
    out: dict[str, object] = {}
    for row in sorted(set(reference) | set(got)):
        if reference.get(row) == got.get(row):
            continue
        documented = STRICTER.get((name, row)) or STRICTER.get(("*", row))
        if documented is not None and abi in documented[0]:
            continue
        out[row] = {"reference": reference.get(row), f"abi {abi}": got.get(row)}
    return out


def _older(abi: int) -> None:
    """Skip (or fail, under SANDLOCK_EXPECT_ABI) unless the kernel is newer than ``abi``."""
    require_abi(abi + 1, f"pretending Landlock ABI {abi} against the kernel's own")


@pytest.mark.parametrize("name", builtin_profiles())
@pytest.mark.parametrize("abi", ABIS)
def test_profile_at_abi(name: str, abi: int, variables: dict[str, str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    _older(abi)
    refusal = EXPECTED_REFUSALS.get(name)
    if refusal is not None and abi < refusal[1]:
        with pytest.raises(KernelSupportError) as refused:
            _probe(name, abi, variables, monkeypatch)
        assert f"[accept: {refusal[0]}]" in str(refused.value), str(refused.value)
        return
    reference = _reference(name, variables, monkeypatch)
    report = _probe(name, abi, variables, monkeypatch)  # a refusal here is a regression
    assert report.abi == abi
    assert _differences(name, abi, reference, _rows(report)) == {}


def test_tables_name_real_things() -> None:
    from sandlock.policy.model import ACCEPTABLE_GAPS
    from sandlock.probe.harness import SPECS

    for name, (gap, since) in EXPECTED_REFUSALS.items():
        assert name in builtin_profiles() and gap in ACCEPTABLE_GAPS and since in ABIS, name
    ids = {spec.id for spec in SPECS}
    for (name, row), (abis, reason) in STRICTER.items():
        assert (name == "*" or name in builtin_profiles()) and row in ids and reason
        assert set(abis) <= set(ABIS)


# Positive controls: the matrix sees a missing substitute (the run is not the reference's).


def test_matrix_sees_the_truncate_substitute_missing(variables: dict[str, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _older(2)
    reference = _reference("python", variables, monkeypatch)
    monkeypatch.setattr(seccomp, "truncate_rules", lambda: [])
    got = _rows(_probe("python", 2, variables, monkeypatch))
    assert "fs.truncate_outside" in _differences("python", 2, reference, got)


def test_matrix_sees_the_signal_gate_missing(variables: dict[str, str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlock.exec import launcher

    _older(5)
    reference = _reference("python", variables, monkeypatch)
    monkeypatch.setattr(seccomp, "signal_rules", lambda: [])
    monkeypatch.setattr(launcher, "_own_gate", lambda _c, _s, _b, hook: (None, hook))
    got = _rows(_probe("python", 5, variables, monkeypatch))
    assert "proc.signal_outside" in _differences("python", 5, reference, got)
