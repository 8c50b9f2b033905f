"""Host allowlists (issue 7): rule parsing, the proxy, and the connect gate.

Everything runs on loopback: test servers listen on 127.0.0.1 and are reached
through ``hosts`` pins (a pinned name may resolve to a private address because
the pin is explicit). Integration tests run the real CLI on the real kernel and
check what happened: HTTP status, errno, what the servers saw.
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pytest
from conftest import PYTHON, require_abi, require_tool, run_confined, write_policy

from sandlock.errors import PolicyError
from sandlock.policy import netrules
from sandlock.policy.model import loads_policy
from sandlock.policy.netrules import NetRules, parse_pins, parse_rules

CURL = shutil.which("curl")
OPENSSL = shutil.which("openssl")


# ----------------------------------------------------------------------------
# Rules (pure)


def rules(allow: list[str], deny: Sequence[str] = (),
          hosts: Optional[dict[str, object]] = None) -> NetRules:
    return NetRules(parse_rules(allow, "allow"), parse_rules(list(deny), "deny"),
                    parse_pins(hosts or {}))


@pytest.mark.parametrize("text, message", [
    ("*", "every host"),
    ("*.com", "over-broad"),
    ("*.", "every host"),
    ("*..com", "not a valid host name"),
    ("https://api.github.com", "is a URL"),
    ("api.github.com/repos", "paths are not rules"),
    ("api.*.com", "only wildcard"),
    ("a*.example.com", "only wildcard"),
    ("0.0.0.0/0", "over-broad"),
    ("::/0", "over-broad"),
    ("10.0.0.1/8", "host bits set"),
    ("example.com:0", "ports are 1-65535"),
    ("example.com:70000", "ports are 1-65535"),
    ("example.com:443-80", "ports are 1-65535"),
    ("example.com:https", "bad port"),
    ("[::1", "missing ']'"),
    ("[example.com]:443", "only IPv6"),
    ("exa mple.com", "not a valid host name"),
    ("", "empty rule"),
])
def test_bad_rules_are_refused_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(netrules.RuleError, match=message.replace("*", r"\*")):
        parse_rules(["ok.example", text], "allow")


def test_rule_forms() -> None:
    parsed = parse_rules(["API.GitHub.com.", "*.npmjs.org", "203.0.113.0/24:5432",
                          "[2001:db8::1]:443", "2001:db8::/32", "host.test:8000-8100"], "allow")
    assert (parsed[0].name, parsed[0].ports) == ("api.github.com", ((80, 80), (443, 443)))
    assert (parsed[1].name, parsed[1].wildcard) == ("npmjs.org", True)
    assert str(parsed[2].net) == "203.0.113.0/24" and parsed[2].ports == ((5432, 5432),)
    assert str(parsed[3].net) == "2001:db8::1/128"
    assert parsed[5].ports == ((8000, 8100),)
    assert parse_rules(["evil.test"], "deny")[0].ports == ((1, 65535),)


def test_wildcard_matches_subdomains_only_and_ports_default_to_80_443() -> None:
    r = rules(["*.example.test"])
    assert r.check_name("a.example.test", 443)
    assert r.check_name("deep.a.example.test", 80)
    assert not r.check_name("example.test", 443)
    assert not r.check_name("badexample.test", 443)
    assert not r.check_name("a.example.test", 8443)


def test_deny_wins_and_names_the_rule() -> None:
    r = rules(["*.example.test:1-65535"], deny=["bad.example.test"])
    verdict = r.check_name("BAD.example.test.", 8080)
    assert not verdict and "deny[0] 'bad.example.test'" in verdict.reason
    assert r.check_name("good.example.test", 8080)
    assert "no allow rule matches other.test:443" in rules(["x.test"]).check_name(
        "other.test", 443).reason


def test_ip_rules_and_ipv4_mapped_addresses() -> None:
    r = rules(["203.0.113.0/24:5432", "[2001:db8::1]:443"], deny=["203.0.113.66"])
    assert r.check_name("203.0.113.7", 5432)
    assert r.check_name("::ffff:203.0.113.7", 5432)
    assert not r.check_name("203.0.113.7", 5433)
    assert not r.check_name("203.0.113.66", 5432)
    assert r.check_name("[2001:db8::1]", 443)


def test_non_public_results_need_a_pin_or_an_ip_rule() -> None:
    """DNS rebinding: a public name resolving to loopback/private/link-local is refused."""
    from ipaddress import ip_address

    r = rules(["api.test", "10.1.0.0/16:443"], deny=["192.0.2.0/24"],
              hosts={"pinned.test": "127.0.0.1"})
    assert r.check_address("api.test", ip_address("93.184.216.34"), 443)
    for private in ("127.0.0.1", "10.2.3.4", "169.254.169.254", "::1", "fe80::1",
                    "::ffff:10.2.3.4"):
        verdict = r.check_address("api.test", ip_address(private), 443)
        assert not verdict and "DNS rebinding" in verdict.reason, private
    assert r.check_address("pinned.test", ip_address("127.0.0.1"), 443)
    assert not r.check_address("pinned.test", ip_address("127.0.0.2"), 443)
    assert r.check_address("api.test", ip_address("10.1.2.3"), 443)
    assert not r.check_address("pinned.test", ip_address("192.0.2.1"), 443)


def test_a_system_pin_trusts_the_resolvers_answer_for_that_name_only() -> None:
    """``hosts = { name = "system" }``: private/loopback answers for that one name are accepted;
    the name still needs an allow rule, deny rules on addresses still win."""
    from ipaddress import ip_address

    r = rules(["mirror.internal", "api.test"], deny=["10.9.0.0/16"],
              hosts={"Mirror.Internal": "system"})
    assert r.hosts == (("mirror.internal", "system"),) and r.pin("mirror.internal") is None
    for private in ("10.0.0.5", "127.0.0.1", "::1"):
        verdict = r.check_address("mirror.internal", ip_address(private), 443)
        assert verdict and 'hosts: mirror.internal = "system"' in verdict.reason, private
    assert not r.check_address("api.test", ip_address("10.0.0.5"), 443)
    assert not r.check_address("mirror.internal", ip_address("10.9.1.1"), 443)
    assert not r.check_name("mirror.internal", 8080)
    assert not rules(["api.test"], hosts={"mirror.internal": "system"}).check_name(
        "mirror.internal", 443)


def test_pins_are_validated() -> None:
    assert parse_pins({"API.Internal.test": "::ffff:127.0.0.1"}) == (("api.internal.test",
                                                                     "127.0.0.1"),)
    with pytest.raises(netrules.RuleError, match='IP address string or "system"'):
        parse_pins({"a.test": "example.com"})
    with pytest.raises(netrules.RuleError, match='IP address string or "system"'):
        parse_pins({"a.test": "System"})
    with pytest.raises(netrules.RuleError, match="only wildcard|not a valid"):
        parse_pins({"*.a.test": "127.0.0.1"})


def test_policy_schema_errors_carry_file_line_and_key() -> None:
    text = 'version = 1\n[network]\nallow = ["ok.test",\n  "*.com"]\n'
    with pytest.raises(PolicyError) as info:
        loads_policy(text, source="p.toml")
    assert "network.allow[1]" in str(info.value) and "over-broad" in str(info.value)
    policy = loads_policy('[network]\nallow = ["a.test"]\ndeny = ["b.a.test"]\n'
                          'hosts = { "a.test" = "127.0.0.1" }\n')
    assert policy.network.tcp and policy.network.allow[0].name == "a.test"
    assert policy.network.hosts == (("a.test", "127.0.0.1"),)
    with pytest.raises(PolicyError, match="network.hosts.x.test"):
        loads_policy('[network]\nhosts = { "x.test" = "nope" }\n')


def new_threads(before: set[threading.Thread], settle: float = 10.0) -> list[str]:
    """Threads alive that were not ``before`` and still are after ``settle`` seconds: a leak
    stays. (Threads of earlier tests may end meanwhile, and the test's HTTP server ends a
    connection's thread after the connection: a count blamed the test for either.)"""
    deadline = time.monotonic() + settle
    while True:
        new = sorted(thread.name for thread in threading.enumerate() if thread not in before)
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def test_no_allow_rules_import_nothing_of_the_network_layer(tmp_path: Path) -> None:
    """The fast path is unchanged: no netrules, proxy or supervisor import, no thread."""
    require_abi(4, "a TCP port grant")
    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n'
                          '[filesystem]\nexec = ["/usr/bin/true"]\n[network]\nconnect = [443]\n')
    code = textwrap.dedent(f"""
        import sys, threading
        from sandlock.cli import launch
        code = launch.execute({str(policy)!r}, {{}}, None, False, ["true"])
        loaded = sorted(m for m in sys.modules if m.split(".")[-1] in
                        ("netrules", "proxy", "connect") or m in ("sandlock.net.http", "h11"))
        print(code, loaded, threading.active_count())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["0", "[]", "1"], out.stderr


@pytest.mark.any_user
def test_the_http_layer_is_imported_only_with_the_network_layer() -> None:
    """``import sandlock`` and its public names do not import the HTTP layer or h11; the
    proxy does (control: the check sees an import when there is one)."""
    code = textwrap.dedent("""
        import sys
        import sandlock
        sandlock.Sandbox, sandlock.Policy
        before = sorted(m for m in ("h11", "sandlock.net.http") if m in sys.modules)
        import sandlock.net.proxy
        after = sorted(m for m in ("h11", "sandlock.net.http") if m in sys.modules)
        print(before, after)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["[]", "['h11',", "'sandlock.net.http']"], out.stderr


# ----------------------------------------------------------------------------
# Loopback servers


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello {self.headers['Host']} {self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, context: "ssl.SSLContext | None" = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.context = context
        self.accepted = 0

    def get_request(self):  # type: ignore[no-untyped-def]
        sock, address = super().get_request()
        self.accepted += 1
        if self.context is not None:
            sock = self.context.wrap_socket(sock, server_side=True)
        return sock, address

    @property
    def port(self) -> int:
        return int(self.server_address[1])


def _serve(server: Server) -> Iterator[Server]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def http_server() -> Iterator[Server]:
    yield from _serve(Server())


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A TLS server for api.internal.test with a certificate made for this test run."""
    if OPENSSL is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-subj", "/CN=api.internal.test", "-addext",
                    "subjectAltName=DNS:api.internal.test", "-days", "2"],
                   check=True, capture_output=True)
    os.chmod(directory, 0o755)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    for server in _serve(Server(context)):
        yield server, cert


NET_POLICY = """\
version = 1
extends = ["python"]
[filesystem]
read = [{read}]
exec = [{exec}]
[network]
allow = [{allow}]
deny = [{deny}]
hosts = {{ {hosts} }}
{extra}
"""

PINS = ["api.internal.test", "other.internal.test", "a.example.test", "deep.a.example.test",
        "example.test", "bad.example.test"]


def net_policy(tmp_path: Path, allow: list[str], deny: Sequence[str] = (), read: Sequence[str] = (),
               extra: str = "") -> Path:
    return write_policy(tmp_path, NET_POLICY.format(
        read=", ".join(f'"{p}"' for p in ["/etc/ssl", *read]),
        exec=f'"{CURL}"' if CURL else "",
        allow=", ".join(f'"{r}"' for r in allow), deny=", ".join(f'"{r}"' for r in deny),
        hosts=", ".join(f'"{name}" = "127.0.0.1"' for name in PINS), extra=extra),
        name="net.toml")


def needs_kernel() -> None:
    require_abi(4, "TCP rules under the connect gate")


def needs_curl() -> str:
    return require_tool("curl")


def py(policy: Path, *parts: str) -> subprocess.CompletedProcess[str]:
    code = "\n".join(textwrap.dedent(part) for part in parts)
    return run_confined(policy, [PYTHON, "-c", code], timeout=120)


# ----------------------------------------------------------------------------
# Allowed and refused through the proxy


def test_allowed_host_works_with_curl_and_urllib_over_http_and_tls(
        tmp_path: Path, http_server: Server, tls: tuple[Server, Path]) -> None:
    needs_kernel()
    curl = needs_curl()
    server, cert = tls
    policy = net_policy(tmp_path, [f"api.internal.test:{http_server.port}",
                                   f"api.internal.test:{server.port}"], read=[str(cert.parent)])
    plain = run_confined(policy, [curl, "-sS", f"http://api.internal.test:{http_server.port}/c"])
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == f"hello api.internal.test:{http_server.port} /c\n"
    secure = run_confined(policy, [curl, "-sS", "--cacert", str(cert),
                                   f"https://api.internal.test:{server.port}/t"])
    assert secure.returncode == 0, secure.stderr
    assert secure.stdout == f"hello api.internal.test:{server.port} /t\n"
    out = py(policy, f"""
        import os, ssl, subprocess, urllib.request
        print(urllib.request.urlopen("http://api.internal.test:{http_server.port}/u").read().decode(), end="")
        ctx = ssl.create_default_context(cafile={str(cert)!r})
        print(urllib.request.urlopen("https://api.internal.test:{server.port}/s", context=ctx).read().decode(), end="")
        r = subprocess.run([{CURL!r}, "-sS", "--proxy", os.environ["ALL_PROXY"], "--cacert", {str(cert)!r},
                            "https://api.internal.test:{server.port}/socks"], capture_output=True, text=True)
        print(r.stdout, end="")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"hello api.internal.test:{http_server.port} /u",
                                       f"hello api.internal.test:{server.port} /s",
                                       f"hello api.internal.test:{server.port} /socks"]


def test_refusals_answer_403_with_the_rule_and_are_reported(
        tmp_path: Path, http_server: Server, tls: tuple[Server, Path]) -> None:
    needs_kernel()
    needs_curl()
    server, cert = tls
    port = http_server.port
    policy = net_policy(tmp_path, [f"*.example.test:{port}", f"api.internal.test:{server.port}"],
                        deny=["bad.example.test"], read=[str(cert.parent)])
    out = py(policy, f"""
        import os, subprocess, urllib.request, urllib.error
        for host in ("a.example.test", "deep.a.example.test", "example.test", "bad.example.test",
                     "other.internal.test"):
            try:
                body = urllib.request.urlopen(f"http://{{host}}:{port}/").read().decode().strip()
                print(host, 200, body)
            except urllib.error.HTTPError as err:
                print(host, err.code, err.read().decode().strip())
        r = subprocess.run([{CURL!r}, "-sS", "--cacert", {str(cert)!r},
                            "https://other.internal.test:{server.port}/"], capture_output=True, text=True)
        print("curl-https", r.returncode, "403" in r.stderr)
        r = subprocess.run([{CURL!r}, "-sS", "--proxy", os.environ["ALL_PROXY"],
                            "http://bad.example.test:{port}/"], capture_output=True, text=True)
        print("curl-socks", r.returncode, "(2)" in r.stderr)
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"a.example.test 200 hello a.example.test:{port} /"
    assert lines[1] == f"deep.a.example.test 200 hello deep.a.example.test:{port} /"
    assert lines[2].startswith("example.test 403 ") and "no allow rule matches" in lines[2]
    assert lines[3].startswith("bad.example.test 403 ") and "deny[0] 'bad.example.test'" in lines[3]
    assert lines[4].startswith("other.internal.test 403 ")
    assert lines[5] == "curl-https 56 True"  # curl: CONNECT tunnel failed, response 403
    assert lines[6].startswith("curl-socks 97 True")  # SOCKS5 reply 2: not allowed by ruleset
    assert f"sandlock: network: refused bad.example.test:{port} (HTTP proxy): denied by " \
           "deny[0] 'bad.example.test'" in out.stderr
    assert f"refused other.internal.test:{server.port} (HTTPS proxy)" in out.stderr
    assert f"refused bad.example.test:{port} (SOCKS5 proxy)" in out.stderr


@pytest.mark.any_user
def test_a_name_with_a_byte_no_host_name_has_matches_no_rule() -> None:
    """The resolver reads a name only up to a NUL: ``8.8.8.8\\0.allowed.test`` matched
    ``*.allowed.test`` and led to 8.8.8.8. Only DNS names and IP literals match a rule."""
    allowed = rules(["*.allowed.test"])
    for name in ("8.8.8.8\0.allowed.test", "evil.example\0.allowed.test", "a b.allowed.test",
                 "x\n.allowed.test", "caf\u00e9.allowed.test", "-x.allowed.test", ".allowed.test",
                 "a..allowed.test", "%00.allowed.test", "x" * 64 + ".allowed.test"):
        verdict = allowed.check_name(name, 443)
        assert not verdict and "not a host name" in verdict.reason, (name, verdict)
    for name in ("ok-1.allowed.test", "_srv.allowed.test", "XN--CAF-DMA.allowed.test.",
                 "[::1]", "192.0.2.1"):
        assert allowed.check_name(name, 443).reason != "", name
    assert allowed.check_name("ok-1.allowed.test", 443)


def test_a_socks_name_cut_by_a_nul_never_reaches_the_resolver(
        tmp_path: Path, http_server: Server) -> None:
    """Through the proxy (SOCKS5 names are bytes; HTTP refuses a NUL in its head): the name
    is refused before any lookup. Control: the old check let it through, and the proxy's
    refusal then named what the cut name resolved to (loopback here, refused as DNS
    rebinding; a public address would have been connected)."""
    needs_kernel()
    port = http_server.port
    policy = net_policy(tmp_path, [f"*.allowed.test:{port}"])
    out = py(policy, f"""
        import os, socket, urllib.parse
        proxy = urllib.parse.urlsplit(os.environ["ALL_PROXY"])
        sock = socket.create_connection((proxy.hostname, proxy.port))
        sock.sendall(b"\\x05\\x01\\x02")
        assert sock.recv(2) == b"\\x05\\x02"
        user, password = proxy.username.encode(), proxy.password.encode()
        sock.sendall(bytes([1, len(user)]) + user + bytes([len(password)]) + password)
        assert sock.recv(2) == b"\\x01\\x00"
        name = b"127.0.0.1\\x00.allowed.test"
        sock.sendall(b"\\x05\\x01\\x00\\x03" + bytes([len(name)]) + name + ({port}).to_bytes(2, "big"))
        print("reply", sock.recv(10)[1])
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reply 2", out.stdout + out.stderr  # not allowed by ruleset
    assert "not a host name" in out.stderr and "resolved" not in out.stderr, out.stderr


def test_public_name_resolving_to_loopback_is_refused(tmp_path: Path, http_server: Server) -> None:
    """DNS rebinding: ``localhost`` resolves to 127.0.0.1 and is not pinned."""
    needs_kernel()
    port = http_server.port
    policy = net_policy(tmp_path, [f"localhost:{port}"])
    out = py(policy, f"""
        import urllib.request, urllib.error
        try:
            urllib.request.urlopen("http://localhost:{port}/")
        except urllib.error.HTTPError as err:
            print(err.code, err.read().decode().strip())
    """)
    assert out.stdout.startswith("403 ") and "DNS rebinding" in out.stdout, out.stderr
    allowed = net_policy(tmp_path, [f"localhost:{port}", f"127.0.0.1:{port}"])
    ok = py(allowed, f"""
        import urllib.request
        print(urllib.request.urlopen("http://localhost:{port}/").status)
    """)
    assert ok.stdout.strip() == "200", ok.stderr


def test_system_pin_reaches_a_name_the_system_resolver_answers_with_loopback(
        tmp_path: Path, http_server: Server) -> None:
    """``localhost`` resolves to loopback through the system resolver (no pin to an address):
    refused as DNS rebinding above, reached once ``hosts`` trusts the resolver for it."""
    needs_kernel()
    port = http_server.port
    policy = write_policy(tmp_path, f"""\
        version = 1
        extends = ["python"]
        [network]
        allow = ["localhost:{port}"]
        hosts = {{ "localhost" = "system" }}
        """, "system.toml")
    ok = py(policy, f"""
        import urllib.request
        print(urllib.request.urlopen("http://localhost:{port}/").status)
    """)
    assert ok.stdout.strip() == "200", ok.stdout + ok.stderr
    assert http_server.accepted >= 1


def test_proxy_demands_the_runs_credentials(tmp_path: Path, http_server: Server) -> None:
    """Other local processes cannot borrow the tool's allowlist."""
    from sandlock.net.proxy import Proxy

    proxy = Proxy(rules([f"api.internal.test:{http_server.port}"],
                        hosts={"api.internal.test": "127.0.0.1"}), lambda m: None)
    proxy.start()
    try:
        with socket.create_connection(proxy.address) as sock:
            sock.sendall(f"GET http://api.internal.test:{http_server.port}/ HTTP/1.1\r\n"
                         "Host: x\r\n\r\n".encode())
            assert sock.recv(100).startswith(b"HTTP/1.1 407 ")
        with socket.create_connection(proxy.address) as sock:
            sock.sendall(b"\x05\x01\x00")  # SOCKS5, "no authentication" only
            assert sock.recv(2) == b"\x05\xff"
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler(
            {"http": proxy.url("http")}))
        assert opener.open(f"http://api.internal.test:{http_server.port}/").status == 200
    finally:
        proxy.stop()


@pytest.mark.any_user
@pytest.mark.parametrize("extra, status", [
    ("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400),
    ("Content-Length: 0\r\nContent-Length: 5\r\n", 400),
    ("X-A: 1\r\n Content-Length: 5\r\n", 400),
    ("X-A: 1\nContent-Length: 5\r\n", 400),
    ("X-A: a\x01b\r\n", 400),
    ("".join(f"X-H{i}: {i}\r\n" for i in range(200)), 431),
    ("", 200),  # control: the same request well formed goes through
], ids=["CL and TE", "two lengths", "obs-fold", "bare LF", "control byte", "too many headers",
        "control"])
def test_the_proxy_refuses_an_ambiguous_head_before_connecting(
        http_server: Server, extra: str, status: int) -> None:
    """The proxy reads heads through the same layer as the credential route: a head
    another server could read differently is a 400 (431) and opens no upstream."""
    import base64

    from sandlock.net.proxy import Proxy

    proxy = Proxy(rules([f"api.internal.test:{http_server.port}"],
                        hosts={"api.internal.test": "127.0.0.1"}), lambda m: None)
    proxy.start()
    auth = base64.b64encode(f"sandlock:{proxy.token}".encode()).decode()
    before = http_server.accepted
    try:
        with socket.create_connection(proxy.address, timeout=30) as sock:
            sock.sendall(f"GET http://api.internal.test:{http_server.port}/ HTTP/1.1\r\n"
                         f"Host: api.internal.test:{http_server.port}\r\n"
                         f"Proxy-Authorization: Basic {auth}\r\n{extra}\r\n"
                         "hello".encode("latin-1"))
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    finally:
        proxy.stop()
    assert answer.split(b" ", 2)[1] == str(status).encode(), answer[:300]
    assert (http_server.accepted > before) == (status == 200)


# ----------------------------------------------------------------------------
# Bypass attempts: only mediated connections leave the sandbox

PROBE_HEAD = """
import ctypes, errno, os, socket, struct, threading, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
P = proxy.port
def err(f):
    try:
        f()
        return "OK"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def tcp_to(addr, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.connect(addr)
        return s.getpeername()
    finally:
        s.close()
"""


def test_direct_connections_are_refused_whatever_the_route(
        tmp_path: Path, http_server: Server) -> None:
    needs_kernel()
    port = http_server.port
    before = http_server.accepted
    policy = net_policy(tmp_path, [f"api.internal.test:{port}"])
    out = py(policy, PROBE_HEAD, f"""
        S = {port}
        print("direct", err(lambda: tcp_to(("127.0.0.1", S))))
        print("mapped", err(lambda: tcp_to(("::ffff:127.0.0.1", S), socket.AF_INET6)))
        print("v6-loop", err(lambda: tcp_to(("::1", S), socket.AF_INET6)))
        # Landlock port rules are per port, not per address: the proxy's port on any
        # other address must still be refused (a hostile server may listen on every port).
        print("proxy-port-elsewhere", err(lambda: tcp_to(("127.0.0.2", P))))
        print("proxy-port-v6", err(lambda: tcp_to(("::1", P), socket.AF_INET6)))
        print("proxy-mapped", err(lambda: tcp_to(("::ffff:127.0.0.1", P), socket.AF_INET6)))
        print("proxy", err(lambda: tcp_to(("127.0.0.1", P))))
        res = {{}}  # from a second thread: the supervisor takes the socket via that thread
        t = threading.Thread(target=lambda: res.update(r=err(lambda: tcp_to(("127.0.0.1", P)))))
        t.start()
        t.join()
        print("proxy-from-thread", res["r"])
        print("udp", err(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)))
        print("udp6", err(lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)))
        print("raw", err(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)))
        print("icmp-dgram", err(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)))
        print("mptcp", err(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262)))
        print("sctp", err(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 132)))
        print("packet", err(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)))
        print("unix", err(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)))
        print("dns", err(lambda: socket.getaddrinfo("api.internal.test", 80)))
        libc = ctypes.CDLL(None, use_errno=True)
        def sys_errno(*args):
            return "OK" if libc.syscall(*args) >= 0 else errno.errorcode[ctypes.get_errno()]
        print("io_uring", sys_errno(425, 8, ctypes.create_string_buffer(120)))
        # A notifying filter of the tool's own could answer CONTINUE for its connects.
        prog = struct.pack("HBBI", 6, 0, 0, 0x7FFF0000)
        buf = ctypes.create_string_buffer(prog)
        fprog = struct.pack("HxxxxxxQ", 1, ctypes.addressof(buf))
        print("own-listener", sys_errno(317, 1, 8, ctypes.create_string_buffer(fprog)))
    """)
    assert out.returncode == 0, out.stderr
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    for allowed in ("proxy", "proxy-mapped", "proxy-from-thread"):
        assert got.pop(allowed) == "OK", (allowed, out.stderr)
    assert got.pop("dns") != "OK"  # no resolver reachable: names are the proxy's business
    assert {k: v for k, v in got.items()} == {
        "direct": "EACCES", "mapped": "EACCES", "v6-loop": "EACCES",
        "proxy-port-elsewhere": "EACCES", "proxy-port-v6": "EACCES",
        "udp": "EPERM", "udp6": "EPERM", "raw": "EPERM", "icmp-dgram": "EPERM", "mptcp": "EPERM",
        "sctp": "EPERM", "packet": "EPERM", "unix": "EPERM", "io_uring": "EPERM",
        "own-listener": "EPERM"}
    assert http_server.accepted == before, "a direct connection reached the server"
    assert f"refused direct connection to 127.0.0.1:{port}" in out.stderr
    assert "ignore proxy variables?" in out.stderr


def test_udp_and_dns_exfiltration_never_leave(tmp_path: Path) -> None:
    needs_kernel()
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    policy = net_policy(tmp_path, ["api.internal.test:80"])
    out = py(policy, PROBE_HEAD, f"""
        def send():
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"secret", ("127.0.0.1", {port}))
        print(err(send))
        def dns():
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"\\x12\\x34secret-in-a-query", ("127.0.0.1", 53))
        print(err(dns))
        def tcp_dns():
            tcp_to(("127.0.0.1", 53))
        print(err(tcp_dns))
    """)
    assert out.stdout.split() == ["EPERM", "EPERM", "EACCES"], out.stderr
    with pytest.raises(socket.timeout):
        listener.recv(100)
    listener.close()


def test_racing_thread_cannot_redirect_an_allowed_connect(
        tmp_path: Path, http_server: Server) -> None:
    """A second thread flips the sockaddr between the proxy and a forbidden server while
    connect(2) is in flight; every connection that succeeds is to the proxy."""
    needs_kernel()
    before = http_server.accepted
    policy = net_policy(tmp_path, [f"api.internal.test:{http_server.port}"])
    out = py(policy, PROBE_HEAD, f"""
        libc = ctypes.CDLL(None, use_errno=True)
        good = struct.pack("!HH4s8x", 0, P, socket.inet_aton("127.0.0.1"))
        bad = struct.pack("!HH4s8x", 0, {http_server.port}, socket.inet_aton("127.0.0.1"))
        good = struct.pack("=H", socket.AF_INET) + good[2:]
        bad = struct.pack("=H", socket.AF_INET) + bad[2:]
        buf = ctypes.create_string_buffer(good, 16)
        stop = False
        def flip():
            while not stop:
                ctypes.memmove(buf, bad, 16)
                ctypes.memmove(buf, good, 16)
        t = threading.Thread(target=flip)
        t.start()
        outcomes = {{}}
        for _ in range(400):
            s = socket.socket()
            if libc.connect(s.fileno(), buf, 16) == 0:
                key = "to-proxy" if s.getpeername() == ("127.0.0.1", P) else repr(s.getpeername())
            else:
                key = errno.errorcode[ctypes.get_errno()]
            outcomes[key] = outcomes.get(key, 0) + 1
            s.close()
        stop = True
        t.join()
        print(sorted(outcomes.items()))
    """)
    assert out.returncode == 0, out.stderr
    outcomes = dict(eval(out.stdout))  # our own probe's repr of a list of pairs
    assert set(outcomes) <= {"to-proxy", "EACCES"}, outcomes
    assert sum(outcomes.values()) == 400
    assert http_server.accepted == before, "a raced connect reached the forbidden server"


def test_fast_open_and_non_blocking_connect(tmp_path: Path, http_server: Server) -> None:
    needs_kernel()
    port = http_server.port
    before = http_server.accepted
    policy = net_policy(tmp_path, [f"api.internal.test:{port}"])
    out = py(policy, PROBE_HEAD, f"""
        import select
        S = {port}
        # sendto(MSG_FASTOPEN) connects without connect(2): refused by seccomp.
        s = socket.socket()
        print("tfo-sendto", err(lambda: s.sendto(b"GET / HTTP/1.0\\r\\n\\r\\n", socket.MSG_FASTOPEN, ("127.0.0.1", S))))
        s.close()
        # TCP_FASTOPEN_CONNECT defers the SYN to the first write; connect(2) still decides.
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_TCP, 30, 1)
        print("tfo-connect-direct", err(lambda: s.connect(("127.0.0.1", S))))
        s.close()
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_TCP, 30, 1)
        s.connect(("127.0.0.1", P))
        auth = __import__("base64").b64encode(f"{{proxy.username}}:{{proxy.password}}".encode()).decode()
        s.sendall(f"GET http://api.internal.test:{{S}}/tfo HTTP/1.1\\r\\nHost: api.internal.test:{{S}}\\r\\n"
                  f"Proxy-Authorization: Basic {{auth}}\\r\\n\\r\\n".encode())
        print("tfo-connect-proxy", s.makefile("rb").readline().decode().strip())
        s.close()
        # Non-blocking: EINPROGRESS (or 0) to the proxy, then writable with SO_ERROR 0.
        s = socket.socket()
        s.setblocking(False)
        code = s.connect_ex(("127.0.0.1", P))
        select.select([], [s], [], 10)
        print("nonblock-proxy", errno.errorcode.get(code, "OK"), s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), s.getpeername()[1] == P)
        s.close()
        s = socket.socket()
        s.setblocking(False)
        print("nonblock-direct", errno.errorcode.get(s.connect_ex(("127.0.0.1", S)), "OK"))
        s.close()
    """)
    assert out.returncode == 0, out.stderr
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert got["tfo-sendto"] == "EPERM"
    assert got["tfo-connect-direct"] == "EACCES"
    assert got["tfo-connect-proxy"] == "HTTP/1.0 200 OK"
    assert got["nonblock-proxy"] in ("EINPROGRESS 0 True", "OK 0 True")
    assert got["nonblock-direct"] == "EACCES"
    assert http_server.accepted == before + 1  # only the proxied request


def test_tool_ignoring_proxy_variables_fails_closed_with_a_hint(
        tmp_path: Path, http_server: Server) -> None:
    needs_kernel()
    curl = needs_curl()
    policy = net_policy(tmp_path, [f"api.internal.test:{http_server.port}"])
    out = run_confined(policy, [curl, "-sS", "--noproxy", "*",
                                f"http://127.0.0.1:{http_server.port}/"])
    assert out.returncode == 7  # curl: failed to connect
    assert "refused direct connection" in out.stderr and "ignore proxy variables" in out.stderr


BIND_PROBE = """
import errno, socket
def bind(port):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        return s.getsockname()[1]
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
free = socket.socket()
free.bind(("127.0.0.1", 0))
port = free.getsockname()[1]
free.close()
ephemeral = bind(0)
print(type(ephemeral).__name__, ephemeral != 0, bind(port))
"""


@pytest.mark.parametrize("allow", [False, True], ids=["landlock", "mediated"])
def test_bind_zero_grants_an_ephemeral_port_and_nothing_else(tmp_path: Path, allow: bool) -> None:
    """``bind = [0]``: a test server's ``bind(("127.0.0.1", 0))`` and ``listen`` work; an
    explicit port that is not granted stays refused (EACCES from Landlock)."""
    needs_kernel()
    if allow:
        policy = net_policy(tmp_path, ["api.internal.test:80"], extra="bind = [0]")
    else:
        policy = write_policy(tmp_path, 'version = 1\nextends = ["python"]\n[network]\nbind = [0]\n',
                              name="bind0.toml")
    out = py(policy, BIND_PROBE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["int", "True", "EACCES"], out.stdout + out.stderr


def test_connect_ports_of_the_core_policy_still_apply(tmp_path: Path, http_server: Server) -> None:
    needs_kernel()
    port = http_server.port
    policy = net_policy(tmp_path, ["api.internal.test:80"], extra=f"connect = [{port}]")
    out = py(policy, PROBE_HEAD, f"""
        print(err(lambda: tcp_to(("127.0.0.1", {port}))), err(lambda: tcp_to(("127.0.0.1", {port} + 1))))
    """)
    assert out.stdout.split() == ["OK", "EACCES"], out.stderr


def test_ip_rules_allow_direct_connections_without_the_proxy(
        tmp_path: Path, http_server: Server) -> None:
    """An IP/CIDR rule (e.g. a database) is enforced by the supervisor on its own copy."""
    needs_kernel()
    port = http_server.port
    policy = net_policy(tmp_path, [f"127.0.0.0/8:{port}"], deny=["127.0.0.3"])
    out = py(policy, PROBE_HEAD, f"""
        print(err(lambda: tcp_to(("127.0.0.1", {port}))), err(lambda: tcp_to(("127.0.0.3", {port}))),
              err(lambda: tcp_to(("127.0.0.1", {port} + 1))))
    """)
    assert out.stdout.split() == ["OK", "EACCES", "EACCES"], out.stderr


def test_thousand_connections_leak_no_descriptor_or_thread(
        tmp_path: Path, http_server: Server) -> None:
    """The launcher (this process) runs the proxy and the supervisor; count its fds."""
    needs_kernel()
    from sandlock.compile import compiler
    from sandlock.exec import launcher
    from sandlock.policy.model import load_policy

    port = http_server.port
    policy = load_policy(net_policy(tmp_path, [f"api.internal.test:{port}"]))
    code = PROBE_HEAD + textwrap.dedent(f"""
        import base64
        auth = base64.b64encode(f"{{proxy.username}}:{{proxy.password}}".encode()).decode()
        ok = denied = 0
        for i in range(1000):
            s = socket.create_connection(("127.0.0.1", P))
            host = "api.internal.test" if i % 10 else "other.internal.test"
            s.sendall(f"CONNECT {{host}}:{port} HTTP/1.1\\r\\nProxy-Authorization: Basic {{auth}}\\r\\n\\r\\n".encode())
            line = s.makefile("rb").readline()
            ok += b" 200 " in line
            denied += b" 403 " in line
            s.close()
        keep = [socket.create_connection(("127.0.0.1", P)) for _ in range(50)]  # left open at exit
        raise SystemExit(0 if (ok, denied) == (900, 100) else f"{{ok}} allowed, {{denied}} refused")
    """)
    def fds() -> list[str]:
        return sorted(os.listdir("/proc/self/fd"))

    baseline_threads = set(threading.enumerate())
    before = fds()
    with compiler.compile_policy(policy) as compiled:
        opened = fds()
        cmd = launcher.prepare_command(compiled, [PYTHON, "-c", textwrap.dedent(code)])
        events: list[str] = []
        child = launcher.run(compiled, cmd, forward_signals=False, report=events.append)
        assert child.returncode == 0
        assert fds() == opened
    assert fds() == before
    assert new_threads(baseline_threads) == []
    assert events == [(f"network: refused other.internal.test:{port} (HTTPS proxy): no allow "
                       f"rule matches other.internal.test:{port}")]


def test_probe_runs_the_network_rows_under_mediation(tmp_path: Path) -> None:
    """`sandlock probe` on an allow policy: the proxy's port elsewhere and an unlisted
    host through the proxy are both blocked (and skipped without ``allow``)."""
    needs_kernel()
    from conftest import sandlock

    policy = write_policy(tmp_path, 'version = 1\nextends = ["base"]\n[network]\n'
                          'allow = ["api.internal.test:80"]\n'
                          'hosts = { "api.internal.test" = "127.0.0.1" }\n')
    out = sandlock("probe", "--policy", str(policy), timeout=180)
    rows = dict(line.split("\t", 1) for line in out.stdout.splitlines() if "\t" in line)
    assert rows["net.proxy_port_elsewhere"] == "blocked\tEACCES: Permission denied", out.stdout
    assert rows["net.proxy_unlisted_host"] == "blocked\tHTTP/1.1 403 Forbidden"
    assert rows["net.tcp_connect_denied_port"].startswith("blocked\tEACCES")


# ----------------------------------------------------------------------------
# The Python API: each call gets its own proxy and connect gate


API_FETCH = """
import sys, urllib.request, urllib.error
for url in sys.argv[1:]:
    try:
        print(urllib.request.urlopen(url, timeout=30).read().decode().strip())
    except urllib.error.HTTPError as err:
        print(err.code)
"""


@pytest.mark.parametrize("native", ["1", "0"])
def test_api_run_is_mediated_like_the_cli(tmp_path: Path, http_server: Server, native: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """run() of a policy with ``allow``: names through the proxy, refusals as 403 and in
    Result.network_events, direct connections EACCES (whichever path commands take)."""
    needs_kernel()
    import sandlock
    from sandlock.api import sandbox as api_sandbox

    monkeypatch.setenv("SANDLOCK_NATIVE", native)
    native_calls: list[object] = []

    class Counted(api_sandbox._NativeCall):
        def __init__(self, *args: Any) -> None:
            native_calls.append(self)
            super().__init__(*args)

    monkeypatch.setattr(api_sandbox, "_NativeCall", Counted)
    port = http_server.port
    before = http_server.accepted
    policy = net_policy(tmp_path, [f"api.internal.test:{port}"], deny=["bad.example.test"])
    with sandlock.Sandbox(policy) as box:
        for _ in range(3):  # a new proxy and supervisor per call
            result = box.run([PYTHON, "-c", API_FETCH, f"http://api.internal.test:{port}/a",
                              f"http://bad.example.test:{port}/b"], capture_output=True,
                             text=True)
            assert result.returncode == 0, result.stderr
            assert result.stdout.splitlines() == [f"hello api.internal.test:{port} /a", "403"]
            assert any(f"refused bad.example.test:{port} (HTTP proxy)" in line
                       for line in result.network_events), result.network_events
        direct = box.run([PYTHON, "-c", PROBE_HEAD + f"print(err(lambda: tcp_to(('127.0.0.1', {port}))))"],
                         capture_output=True, text=True)
        assert direct.stdout.strip() == "EACCES", direct.stderr
        assert any("refused direct connection to 127.0.0.1" in line
                   for line in direct.network_events)
    assert http_server.accepted == before + 3  # the three allowed fetches, nothing else
    # SANDLOCK_NATIVE=1: the native supervisor installs the gate (its notify step) and
    # sends the listener to the mediator; 0: the fork server's does
    from sandlock.exec import native as helper

    assert len(native_calls) == (4 if native == "1" and helper.AVAILABLE else 0)


def test_api_call_is_mediated(tmp_path: Path, http_server: Server) -> None:
    """call() of a Python function under ``allow``: the same proxy and supervisor, on a
    fresh process and on the ones prepared ahead of the next calls."""
    needs_kernel()
    import api_tools

    import sandlock

    tests = str(Path(__file__).parent)
    port = http_server.port
    before = http_server.accepted
    policy = net_policy(tmp_path, [f"api.internal.test:{port}"], read=[tests])
    with sandlock.Sandbox(policy) as box:
        for n in range(4):
            assert box.call(api_tools.fetch, f"http://api.internal.test:{port}/{n}") == (
                200, f"hello api.internal.test:{port} /{n}\n")
            status, body = box.call(api_tools.fetch, f"http://other.internal.test:{port}/")
            assert status == 403 and "no allow rule matches" in body
            assert box.call(api_tools.connect_errno, "127.0.0.1", port) == "EACCES"
    assert http_server.accepted == before + 4


def test_api_mediation_leaks_no_descriptor_or_thread(tmp_path: Path, http_server: Server) -> None:
    """Each call's proxy and supervisor are stopped when it ends: run, call, popen,
    a timeout and a refused start leave the caller's fds and threads as they were."""
    needs_kernel()
    import api_tools

    import sandlock

    port = http_server.port
    policy = net_policy(tmp_path, [f"api.internal.test:{port}"], read=[str(Path(__file__).parent)])
    url = f"http://api.internal.test:{port}/"
    with sandlock.Sandbox(policy) as box:
        box.run([PYTHON, "-c", "pass"])  # the servers are up: their sockets are no leak
        assert box.call(api_tools.add, 1, 2) == 3
        fds, threads = _open_kinds(), set(threading.enumerate())
        for _ in range(5):
            assert box.run([PYTHON, "-c", API_FETCH, url], capture_output=True).returncode == 0
            assert box.call(api_tools.fetch, url)[0] == 200
            with box.popen([PYTHON, "-c", API_FETCH, url], stdout=sandlock.PIPE) as process:
                assert process.stdout is not None and process.stdout.read()
                assert process.wait() == 0
            timed_out = box.run([PYTHON, "-c", "import time; time.sleep(30)"], timeout=0.2)
            assert timed_out.outcome is sandlock.Outcome.TIMED_OUT
            missing = box.run(["/nonexistent/tool"])
            assert missing.returncode == 127
        assert _open_kinds() == fds
        assert new_threads(threads) == []


def _open_kinds() -> dict[str, int]:
    """How many descriptors of each kind this process holds (socket, pipe, a file's path):
    the Sandbox's warm parts are made again between calls (the next call's mediation and
    spare, asked for ahead), so their numbers may change, never their count."""
    kinds: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        kind = target.split(":", 1)[0] if target.endswith("]") else target
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# ----------------------------------------------------------------------------
# The shipped https_client policy: TLS works, the private keys beside the CAs do not


def test_https_client_policy_reaches_tls_but_not_private_keys(
        tmp_path: Path, tls: tuple[Server, Path]) -> None:
    needs_kernel()
    needs_curl()
    server, cert = tls
    policies = Path(__file__).resolve().parent.parent / "policies"
    policy = write_policy(tmp_path, f"""\
version = 1
extends = ["python", "{policies / 'https_client.toml'}"]
[filesystem]
read = ["{cert}"]
[network]
connect = [{server.port}]
""", name="https.toml")
    url = f"https://api.internal.test:{server.port}/t"
    resolve = f"api.internal.test:{server.port}:127.0.0.1"
    done = py(policy, f"""
        import os, subprocess
        def curl(*args):
            return subprocess.run([{CURL!r}, "-s", "--resolve", {resolve!r}, *args, {url!r}],
                                  capture_output=True, text=True)
        print("pinned", curl("--cacert", {str(cert)!r}).returncode)
        print("store", curl().returncode)  # 60: the CA store was read, the test CA is not in it
        try:
            print("private", os.listdir("/etc/ssl/private"))
        except OSError as exc:
            print("private", exc.errno)
    """)
    assert done.stdout.splitlines() == ["pinned 0", "store 60", "private 13"], done


# ----------------------------------------------------------------------------
# DNS rebinding to this host's own addresses


def test_this_hosts_own_addresses_count_as_local() -> None:
    """Every address `ip -o addr` lists (non-loopback ones included) is refused for a
    name that is not pinned or allowed by address."""
    rules = NetRules(parse_rules(["api.example.test"], "allow"), (), ())
    listed = subprocess.run([require_tool("ip"), "-o", "addr"], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    import ipaddress

    addresses = [ipaddress.ip_address(line.split()[3].split("/")[0])
                 for line in listed.stdout.splitlines()]
    assert set(addresses) <= netrules.local_addresses()
    for address in addresses:
        assert not rules.check_address("api.example.test", address, 443).allowed, address


def test_a_global_address_of_this_host_is_local() -> None:
    """In a network namespace of its own, give lo a global address: a public name
    resolving to it must be refused (it leads to this host's services)."""
    require_tool("ip")
    code = textwrap.dedent("""
        import ipaddress, subprocess
        from sandlock.policy.netrules import NetRules, parse_rules
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "addr", "add", "1.2.3.4/32", "dev", "lo"], check=True)
        rules = NetRules(parse_rules(["api.example.test"], "allow"), (), ())
        print(rules.check_address("api.example.test", ipaddress.ip_address("1.2.3.4"), 443).allowed,
              rules.check_address("api.example.test", ipaddress.ip_address("1.2.3.5"), 443).allowed)
    """)
    unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    done = subprocess.run([*unshare, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"cannot make a network namespace here: {done.stderr.strip()}")
    assert done.stdout.split() == ["False", "True"], done
