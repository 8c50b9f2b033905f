"""Guards that had no test failing without them (scripts/mutation_check.py found them).

Each test attacks through the guard and asserts the specific refusal; its positive
control shows the same attack goes through where the guard does not apply, so the
refusal is the guard's and not a crash or an attack that never ran.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, require_abi, run_confined, write_policy

from sandlock.net import proxy as proxy_module
from sandlock.policy.netrules import NetRules, parse_pins, parse_rules

# ----------------------------------------------------------------------------
# The password database's home: a later launcher without HOME (cron, a service, `env -i`,
# the API in a daemon) keeps its cache in getpwuid()'s home, whatever this run's HOME is.

HOME_WRITER = """\
version = 1
extends = ["base"]
[filesystem]
write = ["{home}"]
exec = ["/usr/bin/true"]
"""


def test_a_write_grant_on_the_password_database_home_is_refused(tmp_path: Path) -> None:
    require_abi(1, "write grants")
    home = pwd.getpwuid(os.geteuid()).pw_dir
    if not os.path.isdir(home) or home == "/" or os.path.realpath(home) == "/":
        pytest.skip(f"this user's home {home!r} is not a directory of its own")
    # HOME and XDG_CACHE_HOME elsewhere: only the password database names that home.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDLOCK_")}
    env.update(HOME=str(elsewhere), XDG_CACHE_HOME=str(elsewhere / "cache"))
    policy = write_policy(tmp_path, HOME_WRITER.format(home=home))
    done = run_confined(policy, ["/usr/bin/true"], env=env)
    assert done.returncode == 125, (done.stdout, done.stderr)
    state = os.path.join(home, ".cache", "sandlock")
    assert f"this write grant covers {state!r}, sandlock's state directory" in done.stderr
    assert "Traceback" not in done.stderr
    # The control: the same grant on a directory that is no one's home runs.
    other = tmp_path / "other"
    other.mkdir()
    done = run_confined(write_policy(tmp_path, HOME_WRITER.format(home=other), "other.toml"),
                        ["/usr/bin/true"], env=env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("prefix", [True, False], ids=["pycache-prefix", "control"])
def test_a_write_grant_on_the_bytecode_prefix_is_refused(tmp_path: Path, prefix: bool) -> None:
    """PYTHONPYCACHEPREFIX moves the bytecode of sandlock's own modules to that directory,
    where the next launcher reads it (a .pyc whose header names its source's size and
    mtime is loaded as that module): a tool that may write there could run code before
    any sandbox. A write grant reaching it is refused, as the import path is. Control:
    without the variable the same grant runs."""
    require_abi(1, "write grants")
    cache_dir = tmp_path / "bytecode"
    cache_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    if prefix:
        env["PYTHONPYCACHEPREFIX"] = str(cache_dir)
    policy = write_policy(tmp_path, HOME_WRITER.format(home=cache_dir))
    done = run_confined(policy, ["/usr/bin/true"], env=env)
    if prefix:
        assert done.returncode == 125 and "PYTHONPYCACHEPREFIX" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------
# deny rules on the address a name resolves to, for public addresses too. The name is
# resolved by a stand-in for getaddrinfo (a public answer); nothing is sent: the proxy is
# stopped first, so a connect that passes every check ends with "the run is over"
# before any socket connects (that is the positive control).

PUBLIC = "93.184.216.34"  #: a global unicast address (never contacted)


def fake_resolver(answer: str) -> Any:
    def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer, port))]
    return getaddrinfo


def stopped_proxy(deny: list[str]) -> proxy_module.Proxy:
    rules = NetRules(parse_rules(["api.example.test"], "allow"), parse_rules(deny, "deny"),
                     parse_pins({}))
    server = proxy_module.Proxy(rules, lambda message: None)
    server.stop()
    return server


@pytest.mark.parametrize("deny", [PUBLIC, "93.184.216.0/24", f"{PUBLIC}:443"])
def test_a_deny_rule_on_a_public_address_refuses_a_name_resolving_to_it(
        deny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ipaddress.ip_address(PUBLIC).is_global
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver(PUBLIC))
    server = stopped_proxy([deny])
    with pytest.raises(proxy_module.Refused) as refused:
        server.connect("api.example.test", 443, "test")
    assert refused.value.status == 403
    assert str(refused.value) == f"{PUBLIC} is denied by deny[0] {deny!r}"
    # The control: without the deny rule the same answer passes every check and only
    # the stopped proxy keeps the connect from happening.
    with pytest.raises(proxy_module.Refused) as passed:
        stopped_proxy([]).connect("api.example.test", 443, "test")
    assert (passed.value.status, str(passed.value)) == (502, "the run is over")
    # A deny rule on another port leaves the address reachable.
    with pytest.raises(proxy_module.Refused) as other:
        stopped_proxy([f"{PUBLIC}:8443"]).connect("api.example.test", 443, "test")
    assert str(other.value) == "the run is over"



def test_a_write_grant_on_a_directory_a_pth_file_names_is_refused(tmp_path: Path) -> None:
    """A .pth file of a site directory names a directory that does not exist yet: the
    interpreter skips it today and puts it on its import path once it exists. A write grant
    from which a tool could make it (and plant a module the next launcher imports) is
    refused. Control: without that .pth file the same grant runs. The site directory is a
    venv's of this test's own (the suite's own venv is shared with whatever runs beside
    the test, which a .pth file planted there would change)."""
    import site
    import subprocess
    import sys

    require_abi(1, "write grants")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    directory = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    # the suite's packages (sandlock's dependencies) through a .pth file of the new venv
    (directory / "suite.pth").write_text("\n".join([str(REPO), *site.getsitepackages()]) + "\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    policy = write_policy(tmp_path, HOME_WRITER.format(home=ws))

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([python, "-P", "-m", "sandlock", "run", "--policy", str(policy), "--",
                               "/usr/bin/true"], capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})

    control = run()
    planted = directory / "zz-sandlock-test.pth"
    planted.write_text(f"# a comment\nimport os\n{ws / 'lib'}\n")
    named = subprocess.run([python, "-c", "import sys; print(sys.path)"],
                           capture_output=True, text=True, check=True).stdout
    done = run()
    assert str(ws / "lib") not in named  # it does not exist: not on the path yet
    assert control.returncode == 0, control.stderr
    assert done.returncode == 125 and "import path" in done.stderr, done.stderr


def test_a_protected_path_through_a_link_to_nothing_is_refused(tmp_path: Path) -> None:
    """The state directory named through a link whose target does not exist yet, inside a
    write grant: a tool could make the directory there, and a later run would trust what
    it put in it. Such a grant is refused (sandlock cannot tell where the object would
    be). Control: the same grant, the state directory named without a link, runs."""
    require_abi(1, "write grants")
    ws = tmp_path / "ws"
    ws.mkdir()
    link = tmp_path / "link"
    link.symlink_to(ws / "target")
    policy = write_policy(tmp_path, HOME_WRITER.format(home=ws))
    env = {k: v for k, v in os.environ.items() if k != "SANDLOCK_STATE_DIR"}
    done = run_confined(policy, ["/usr/bin/true"],
                        env={**env, "SANDLOCK_STATE_DIR": str(link / "state")})
    control = run_confined(policy, ["/usr/bin/true"],
                           env={**env, "SANDLOCK_STATE_DIR": str(tmp_path / "state")})
    assert done.returncode == 125 and "symbolic link to nothing" in done.stderr, done.stderr
    assert control.returncode == 0, control.stderr
