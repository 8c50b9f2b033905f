"""sandlock.compile.grants: policy paths resolved by descriptor, and what no write grant may reach.

The attacks themselves (a confined tool planting links, forging caches, racing the
check) are in tests/test_integrity.py; these tests pin the rules one by one, on the
real filesystem, as root and as an ordinary user.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import write_policy

from sandlock.compile import compiler, grants
from sandlock.compile.abi import WRITE_RIGHTS, Fs
from sandlock.compile.grants import GrantError
from sandlock.errors import PolicyError
from sandlock.policy.model import load_policy

READ = int(Fs.READ_FILE | Fs.READ_DIR)
WRITE = int(WRITE_RIGHTS)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_resolve_gives_the_canonical_object_and_its_ancestors(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    got = grants.resolve(f"{tmp_path}/a/./b/../b")
    try:
        assert got.canonical == f"{tmp_path}/a/b" and got.is_dir
        assert os.fstat(got.fd).st_ino == os.stat(tmp_path / "a" / "b").st_ino
        target = os.stat(tmp_path / "a" / "b")
        assert got.chain[-1] == (target.st_dev, target.st_ino)
        assert len(got.chain) == len(Path(got.canonical).parts)  # "/" and each component
        assert got.chain[0] == (os.stat("/").st_dev, os.stat("/").st_ino)
    finally:
        got.close()


def test_links_in_system_directories_are_followed() -> None:
    """/etc/localtime and /bin (merged /usr) are links that root owns in root's directories."""
    for path in ("/bin/sh", "/etc/localtime"):
        if not os.path.islink(path) and not os.path.islink(os.path.dirname(path)):
            continue
        before = fds()
        got = grants.resolve(path)
        assert got.canonical == os.path.realpath(path)
        got.close()
        assert fds() == before  # every descriptor opened on the way was closed


def test_a_link_in_a_writable_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = fds()
    with pytest.raises(GrantError, match="is a symbolic link .* name the link's target instead"):
        grants.resolve(f"{tmp_path}/link/x")
    assert fds() == before


def test_a_link_loop_in_system_style_is_bounded(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(GrantError):
        grants.resolve(f"{tmp_path}/loop")


def refuse(paths: list[tuple[str, int]], policy_files: tuple[str, ...] = ()) -> str:
    with pytest.raises(GrantError) as error:
        grants.check_rules(paths, WRITE, policy_files)
    return error.value.reason


def test_write_on_the_state_directory_or_above_is_refused(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for granted in (home, home / ".cache"):
        assert "sandlock's state directory" in refuse([(str(granted), WRITE)])
    (home / ".cache" / "sandlock" / "policies").mkdir(parents=True)
    assert "lies inside" in refuse([(str(home / ".cache" / "sandlock" / "policies"), WRITE)])
    # A read grant reaching it is refused too (its plans hold other runs' texts and
    # --var values); read and write grants beside it are fine.
    with pytest.raises(GrantError, match="state directory"):
        grants.check_rules([(str(home), READ)], WRITE, ())
    (home / "work").mkdir()
    grants.check_rules([(str(home / "work"), READ), (str(home / "work"), WRITE)], WRITE, ())


def test_every_place_a_later_run_looks_is_protected(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """XDG_CACHE_HOME today does not make the default location writable: a later run
    with another environment would look there."""
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    home.mkdir()
    xdg.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    assert "state directory" in refuse([(str(home), WRITE)])
    assert "state directory" in refuse([(str(xdg), WRITE)])


def test_write_on_the_policy_file_or_its_directory_is_refused(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, "version = 1\n")
    assert "a policy file this run is built from" in refuse([(str(tmp_path), WRITE)],
                                                            (str(policy),))
    assert "a policy file" in refuse([(str(policy), WRITE)], (str(policy),))


def test_write_on_the_installation_or_import_path_is_refused() -> None:
    package = os.path.dirname(grants.__file__)
    # A checkout under /opt (as CI's copy) is refused as a system directory first.
    assert any(what in refuse([(package, WRITE)])
               for what in ("sandlock's installation", "system directories"))
    # A venv under /opt is refused as a system directory first; elsewhere as Python's.
    assert any(what in refuse([(sys.prefix, WRITE)])
               for what in ("Python installation", "system directories"))


def test_write_on_a_system_directory_is_refused_but_a_file_there_is_not(tmp_path: Path) -> None:
    assert "system directories" in refuse([("/usr/share", WRITE)])
    assert "never allowed" in refuse([("/proc/sys", WRITE)])
    grants.check_rules([("/dev/null", WRITE)], WRITE, ())


def test_refusal_names_the_policy_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    policy = load_policy(write_policy(tmp_path, f'version = 1\n[filesystem]\nwrite = ["{home}"]\n'))
    with pytest.raises(PolicyError) as error:
        compiler.compile_policy(policy)
    assert str(error.value).startswith(f"{tmp_path}/policy.toml:3: filesystem.write[0]: ")
    assert "covers" in str(error.value)


def test_later_run_findings_name_exec_grants_under_a_write_grant(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "bin").mkdir(parents=True)
    (ws / "bin" / "tool").write_text("#!/bin/sh\n")
    lines = grants.later_run_findings(
        [(str(ws), "a.toml:4 filesystem.write[0]")],
        [(str(ws / "bin" / "tool"), "a.toml:5 filesystem.exec[0]"), ("/usr/bin", "a.toml:5")],
        [(str(ws / "bin"), "b.toml:4 filesystem.exec[0]")])
    assert len(lines) == 2
    assert "this policy's exec grant" in lines[0] and "later runs of this policy" in lines[0]
    assert "covers this policy's exec grant" in lines[0]
    assert "another policy's exec grant" in lines[1] and "other policy's rights" in lines[1]


def test_probe_reports_later_run_findings(tmp_path: Path) -> None:
    """`sandlock probe` of a policy whose write grant covers a neighbour's exec grant."""
    from sandlock.probe.harness import later_run_findings

    pol, ws = tmp_path / "pol", tmp_path / "ws"
    pol.mkdir()
    (ws / "bin").mkdir(parents=True)
    a = write_policy(pol, 'version = 1\n[filesystem]\nwrite = ["${ws}"]\n', "a.toml")
    # the neighbour names the directory itself (one filled from this run's --var is not
    # compared: its own runs get their own value, tests/test_first_try.py)
    write_policy(pol, f'version = 1\n[filesystem]\nexec = ["{ws}/bin"]\n', "b.toml")
    found = later_run_findings(load_policy(a, {"ws": str(ws)}), {"ws": str(ws)})
    assert len(found) == 1 and "b.toml" in found[0] and "another policy's" in found[0]


def test_thousands_of_paths_hold_one_descriptor_at_a_time(tmp_path: Path) -> None:
    """A policy may name more paths than the descriptor limit (sandlock learn does)."""
    import resource


    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for index in range(300):
        (tmp_path / f"d{index}").mkdir()
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds() + 64, hard))
    try:
        paths = [(str(tmp_path / f"d{index}"), READ) for index in range(300)]
        fd = grants.build_ruleset(7, int(Fs.READ_FILE | Fs.READ_DIR), 0, 0, paths, (), 0, WRITE, ())
        os.close(fd)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_probe_reports_write_grants_over_a_neighbour_policy_file(tmp_path: Path) -> None:
    from sandlock.probe.harness import later_run_findings

    pol = tmp_path / "pol"
    pol.mkdir()
    a = write_policy(pol, f'version = 1\n[filesystem]\nwrite = ["{pol}/b.toml"]\n', "a.toml")
    write_policy(pol, 'version = 1\n', "b.toml")
    found = later_run_findings(load_policy(a))
    assert any("another policy's file" in line and "b.toml" in line for line in found), found


def test_a_policy_named_through_a_link_protects_the_real_file(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    policy = write_policy(real, "version = 1\n")
    (tmp_path / "link.toml").symlink_to(policy)
    assert "a policy file" in refuse([(str(real), WRITE)], (str(tmp_path / "link.toml"),))


def test_a_registry_file_is_protected(tmp_path: Path) -> None:
    from sandlock.compile import ruleset
    from sandlock.policy.model import Policy

    tools = tmp_path / "tools.toml"
    tools.write_text("[tools.t]\nversion = 1\n")
    files = ruleset.policy_files(Policy(layers=(f"{tools} [tools.t]",)))
    assert files == (str(tools),)
    assert "a policy file" in refuse([(str(tools), WRITE)], files)


def test_where_sandlock_modules_were_loaded_from_is_protected() -> None:
    import json

    where = os.path.dirname(os.path.realpath(json.__file__))
    reason = refuse([(os.path.join(where, "decoder.py"), WRITE)])  # raises unless refused
    assert "a later sandlock run" in reason
