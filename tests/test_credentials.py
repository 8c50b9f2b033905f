"""Credential routes (issue 16): secrets the tool never sees, and HTTP-level rules.

An HTTPS echo server on loopback (a certificate for api.internal.test made for this
test run, trusted through ``ca_file``) records what it receives. The tool runs under
the real CLI on the real kernel and holds only a placeholder; the tests check what
the server got, what the tool could read, and what sandlock printed.
"""

from __future__ import annotations

import http.server
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import PYTHON, require_abi, run_confined, write_policy

from sandlock.errors import PolicyError
from sandlock.policy import credentials as C
from sandlock.policy.model import loads_policy

OPENSSL = shutil.which("openssl")
SECRET = "sk-test-" + secrets.token_hex(16)


# ----------------------------------------------------------------------------
# The model (pure)


def cred(**table: Any) -> C.Credential:
    return C.parse_one("api", {"upstream": "https://api.example.test", **table})


def test_rules_deny_wins_then_methods_then_paths() -> None:
    item = cred(methods=["POST"], paths=["/v1/chat/*"], deny=["/v1/chat/admin*", "GET /v1/*"])
    assert item.check("POST", "/v1/chat/completions")[0]
    assert item.check("POST", "/v1/chat/admin/x") == (
        False, "denied by credentials.api.deny[0] '/v1/chat/admin*'")
    assert item.check("GET", "/v1/chat/x") == (False, "denied by credentials.api.deny[1] 'GET /v1/*'")
    assert item.check("PUT", "/v1/chat/x") == (
        False, "method PUT is not in credentials.api.methods ['POST']")
    allowed, why = item.check("POST", "/v1/files")
    assert not allowed and "no entry of credentials.api.paths ['/v1/chat/*'] matches /v1/files" in why


def test_defaults_header_and_paths_under_the_upstream_path() -> None:
    item = C.parse_one("o", {"upstream": "https://api.example.test:8443/v1/"})
    assert (item.host, item.port, item.base_path, item.origin) == (
        "api.example.test", 8443, "/v1", "https://api.example.test:8443")
    assert item.header == "Authorization" and item.attach("K") == "Bearer K"
    assert item.check("GET", "/v1/models")[0] and not item.check("GET", "/v2/models")[0]
    assert C.parse_one("a", {"upstream": "https://x.test", "header": "x-api-key"}).attach("K") == "K"
    query = C.parse_one("g", {"upstream": "https://x.test", "query": "key"})
    assert query.header is None and query.attach("K") == "K"


@pytest.mark.parametrize("table, message", [
    ({"upstream": "http://api.example.test"}, "must be an https:// URL"),
    ({"upstream": "https://u:p@api.example.test"}, "without user"),
    ({"upstream": "https://api.example.test/a/../b"}, "must be plain"),
    ({}, "missing key 'upstream'"),
    ({"upstream": "https://x.test", "from_env": "A", "from_file": "/k"}, "not both"),
    ({"upstream": "https://x.test", "header": "Host"}, "reserved header"),
    ({"upstream": "https://x.test", "format": "Bearer"}, "exactly once"),
    ({"upstream": "https://x.test", "query": "k", "header": "X"}, "do not apply"),
    ({"upstream": "https://x.test", "methods": ["post"]}, "invalid method"),
    ({"upstream": "https://x.test", "methods": []}, "refuse every request"),
    ({"upstream": "https://x.test", "paths": ["v1/*"]}, "must start with '/'"),
    ({"upstream": "https://x.test", "deny": ["get /x"]}, "not \"\\[METHOD \\]/glob\""),
    ({"upstream": "https://x.test", "env": "A", "base_url_env": "A"}, "must differ"),
    ({"upstream": "https://x.test", "nope": 1}, "unknown key 'nope'"),
    ({"upstream": "https://x.test", "from_env": "BAD-NAME"}, "invalid environment variable"),
])
def test_bad_entries_are_refused_with_a_reason(table: dict[str, Any], message: str) -> None:
    with pytest.raises(C.CredentialError, match=message):
        C.parse_one("api", table)


def test_policy_errors_name_the_line_and_key(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"credentials\.api\.paths\[1\].*must start with '/'") as info:
        loads_policy('version = 1\n[credentials.api]\nupstream = "https://x.test"\n'
                     'paths = ["/a", "b"]\n')
    assert ":4:" in str(info.value)
    with pytest.raises(PolicyError, match=r"credentials\.Bad.*invalid credential name"):
        loads_policy('version = 1\n[credentials.Bad]\nupstream = "https://x.test"\n')
    with pytest.raises(PolicyError, match="not absolute"):
        loads_policy('version = 1\n[credentials.a]\nupstream = "https://x.test"\n'
                     'from_file = "key"\n')
    policy = loads_policy('version = 1\n[credentials.a]\nupstream = "https://x.test"\n'
                          'from_file = "~/k"\n', {"home": "/home/h"})
    assert policy.credentials[0].from_file == "/home/h/k"


def test_secret_sources_and_the_tool_environment(tmp_path: Path) -> None:
    policy = loads_policy(f"""
        version = 1
        [filesystem]
        read = ["{tmp_path}/granted"]
        [credentials.e]
        upstream = "https://x.test"
        from_env = "E_KEY"
        env = "E_KEY"
        base_url_env = "E_URL"
        [credentials.f]
        upstream = "https://y.test/v1"
        from_file = "{tmp_path}/secret"
        [credentials.g]
        upstream = "https://z.test"
    """.replace("\n        ", "\n"), check_paths=False)
    (tmp_path / "secret").write_text("file-secret\n")
    with pytest.raises(C.CredentialError, match="no secret"):
        C.secrets_for(policy.credentials, policy.paths, {"E_KEY": "env-secret"})
    got = C.secrets_for(policy.credentials, policy.paths, {"E_KEY": "env-secret"},
                        {"g": "api-secret"})
    assert got == {"e": "env-secret", "f": "file-secret", "g": "api-secret"}
    with pytest.raises(C.CredentialError, match="contains control characters"):
        C.secrets_for(policy.credentials, policy.paths, {"E_KEY": "a\r\nX: y"}, {"g": "s"})
    with pytest.raises(C.CredentialError, match=r"no \[credentials.zz\]"):
        C.secrets_for(policy.credentials, policy.paths, {"E_KEY": "s"}, {"g": "s", "zz": "s"})
    env = C.tool_environment(policy.credentials, {"E_KEY": "env-secret", "COPY": "x env-secret",
                                                  "PATH": "/bin"}, got,
                             {"e": "P-e", "f": "P-f", "g": "P-g"},
                             {"e": "http://r/e", "f": "http://r/f", "g": "http://r/g"})
    assert env == {"PATH": "/bin", "E_KEY": "P-e", "E_URL": "http://r/e"}


def test_a_secret_file_within_a_grant_is_refused(tmp_path: Path) -> None:
    (tmp_path / "granted").mkdir()
    (tmp_path / "granted" / "key").write_text("s")
    os.symlink(tmp_path / "granted" / "key", tmp_path / "link")
    for name in ("granted/key", "link"):
        policy = loads_policy(f'version = 1\n[filesystem]\nread = ["{tmp_path}/granted"]\n'
                              f'[credentials.a]\nupstream = "https://x.test"\n'
                              f'from_file = "{tmp_path}/{name}"\n')
        with pytest.raises(C.CredentialError, match="within the tool's grant filesystem.read"):
            C.secrets_for(policy.credentials, policy.paths, {})


def test_a_secret_file_with_another_name_within_a_grant_is_refused(tmp_path: Path) -> None:
    """A hard link inside a grant is the same file under a name the check by name never
    sees; a bind mount of a granted directory is the same directory. Both are caught on
    the object: a key file with more than one link is refused, and the grants are
    compared by (st_dev, st_ino) with the key file's directories."""
    (tmp_path / "granted").mkdir()
    (tmp_path / "keys").mkdir()
    key = tmp_path / "keys" / "key"
    key.write_text("s")
    policy = loads_policy(f'version = 1\n[filesystem]\nread = ["{tmp_path}/granted"]\n'
                          f'[credentials.a]\nupstream = "https://x.test"\n'
                          f'from_file = "{key}"\n')
    assert C.secrets_for(policy.credentials, policy.paths, {}) == {"a": "s"}
    os.link(key, tmp_path / "granted" / "copy")  # the tool reads it as granted/copy
    with pytest.raises(C.CredentialError, match="has 2 hard links"):
        C.secrets_for(policy.credentials, policy.paths, {})
    os.unlink(tmp_path / "granted" / "copy")
    assert C.secrets_for(policy.credentials, policy.paths, {}) == {"a": "s"}


def test_a_secret_file_in_a_directory_granted_through_a_bind_mount_is_refused(
        tmp_path: Path) -> None:
    """The grant names a bind mount of the key's directory: no name of one is under the
    other, the (st_dev, st_ino) of the directory is the same."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a bind mount needs root and mount(8)")
    (tmp_path / "keys").mkdir()
    (tmp_path / "view").mkdir()
    (tmp_path / "keys" / "key").write_text("s")
    policy = loads_policy(f'version = 1\n[filesystem]\nread = ["{tmp_path}/view"]\n'
                          f'[credentials.a]\nupstream = "https://x.test"\n'
                          f'from_file = "{tmp_path}/keys/key"\n')
    assert C.secrets_for(policy.credentials, policy.paths, {}) == {"a": "s"}
    subprocess.run(["mount", "--bind", str(tmp_path / "keys"), str(tmp_path / "view")],
                   check=True)
    try:
        with pytest.raises(C.CredentialError, match="the same directory under another name"):
            C.secrets_for(policy.credentials, policy.paths, {})
    finally:
        subprocess.run(["umount", str(tmp_path / "view")], check=True)


# ----------------------------------------------------------------------------
# Servers


class Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _record(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.headers.get("Transfer-Encoding") == "chunked":  # read it all: no RST on close
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size + 2)[:-2]
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
        self.server.seen.append({  # type: ignore[attr-defined]
            "method": self.command, "path": self.path, "headers": dict(self.headers.items()),
            "raw": str(self.headers), "body": body.decode("latin-1")})

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        self._record()
        server: Any = self.server
        if self.path.startswith("/redirect-other"):
            self._send(302, b"", {"Location": f"http://127.0.0.1:{server.other}/landed"})
        elif self.path.startswith("/redirect-self"):
            self._send(302, b"", {"Location": f"https://api.internal.test:{server.port}/v1/landed"})
        elif self.path.startswith("/v1/sse"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for index in (1, 2):
                data = f"data: event {index}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                if index == 1:  # the second only once the tool has seen the first
                    server.ack.wait(60)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        else:
            if self.path.startswith("/v1/ack"):
                server.ack.set()
            self._send(200, f"ok {self.command} {self.path}\n".encode())


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, context: Any = None) -> None:
        super().__init__(("127.0.0.1", 0), Recorder)
        self.context = context
        self.seen: list[dict[str, Any]] = []
        self.ack = threading.Event()
        self.other = 0

    def get_request(self):  # type: ignore[no-untyped-def]
        sock, address = super().get_request()
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
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
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
    return cert, key


@pytest.fixture
def other() -> Iterator[Server]:
    yield from _serve(Server())


@pytest.fixture
def upstream(certificate: tuple[Path, Path], other: Server) -> Iterator[Server]:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    for server in _serve(Server(context)):
        server.other = other.port
        yield server


POLICY = """\
version = 1
extends = ["python"]
[filesystem]
read = ["/proc", "{work}"]
write = ["{work}"]
[network]
connect = [{other}]
hosts = {{ "api.internal.test" = "127.0.0.1" }}
[env]
pass = ["PATH", "TEST_*"]
[credentials.api]
upstream = "https://api.internal.test:{port}/v1"
from_env = "TEST_API_KEY"
env = "TEST_API_KEY"
base_url_env = "TEST_BASE_URL"
ca_file = "{ca}"
methods = ["GET", "POST"]
paths = [{paths}]
deny = ["/v1/admin*"]
"""

CLIENT = """
import json, os, sys, urllib.request, urllib.error
BASE, KEY = os.environ["TEST_BASE_URL"], os.environ["TEST_API_KEY"]
class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **k): return None
opener = urllib.request.build_opener(NoRedirect)
def call(method, url, auth=KEY, body=None):
    req = urllib.request.Request(url, method=method, data=body)
    if auth: req.add_header("Authorization", "Bearer " + auth)
    try:
        r = opener.open(req, timeout=60)
        return [r.status, r.read().decode(), dict(r.headers)]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode(), dict(e.headers)]
"""


def route_policy(tmp_path: Path, upstream: Server, other: Server, cert: Path,
                 paths: tuple[str, ...] = ("/v1/*",)) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    return write_policy(tmp_path, POLICY.format(
        work=work, other=other.port, port=upstream.port, ca=cert,
        paths=", ".join(f'"{p}"' for p in paths)), name="cred.toml")


def tool(policy: Path, *code: str, env_extra: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TEST_API_KEY": SECRET, "TEST_OTHER": "x", **(env_extra or {})}
    source = CLIENT + "\n".join(textwrap.dedent(part) for part in code)
    return run_confined(policy, [PYTHON, "-c", source], env=env, timeout=120)


def needs_kernel() -> None:
    require_abi(4, "the route's TCP port grant")


def test_the_route_attaches_the_secret_and_the_tool_never_holds_it(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    policy = route_policy(tmp_path, upstream, other, certificate[0])
    out = tool(policy, """
        res = {"env": dict(os.environ)}
        res["chat"] = call("POST", BASE + "/chat/completions", body=b'{"m": 1}')
        res["list"] = call("GET", BASE + "/models?limit=2")
        leaks = {}
        for what in ("/proc/self/environ", "/proc/%d/environ" % os.getppid(), "/proc/%d/cmdline" % os.getppid()):
            try:
                leaks[what] = open(what, "rb").read().decode("latin-1")
            except OSError as exc:
                leaks[what] = "errno %d" % exc.errno
        try:
            with open("/proc/%d/mem" % os.getppid(), "rb") as mem:
                leaks["mem"] = mem.read(16).decode("latin-1")
        except OSError as exc:
            leaks["mem"] = "errno %d" % exc.errno
        res["leaks"] = leaks
        import socket
        s = socket.create_connection(("127.0.0.1", %OTHER%))
        s.sendall(b"GET /echo HTTP/1.0\\r\\nAuthorization: Bearer " + KEY.encode() + b"\\r\\n\\r\\n")
        res["other"] = s.recv(1000).decode()
        print(json.dumps(res))
    """.replace("%OTHER%", str(other.port)))  # noqa: E501 - the program is kept as written
    assert out.returncode == 0, out.stderr
    assert SECRET not in out.stdout and SECRET not in out.stderr
    res = json.loads(out.stdout)
    env = res["env"]
    assert env["TEST_API_KEY"].startswith("sandlock-placeholder-api-")
    assert env["TEST_BASE_URL"].startswith("http://127.0.0.1:") and env["TEST_BASE_URL"].endswith("/api/v1")
    assert res["chat"][:2] == [200, "ok POST /v1/chat/completions\n"]
    assert res["list"][:2] == [200, "ok GET /v1/models?limit=2\n"]
    # the upstream got the real secret and the body, never the placeholder
    chat, models = upstream.seen[0], upstream.seen[1]
    assert chat["headers"]["Authorization"] == f"Bearer {SECRET}"
    assert chat["headers"]["Host"] == f"api.internal.test:{upstream.port}"
    assert chat["body"] == '{"m": 1}' and "sandlock-placeholder" not in chat["raw"]
    assert models["headers"]["Authorization"] == f"Bearer {SECRET}"
    # /proc of the launcher: Landlock refuses ptrace-class access (EACCES)
    for what, value in res["leaks"].items():
        assert SECRET not in value
        if what != "/proc/self/environ" and "cmdline" not in what:
            assert value == "errno 13", (what, value)
    # the placeholder sent to another host is only a placeholder
    assert other.seen[0]["headers"]["Authorization"] == "Bearer " + env["TEST_API_KEY"]
    assert SECRET not in json.dumps(other.seen)


def test_method_path_and_deny_refusals_name_the_rule(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    policy = route_policy(tmp_path, upstream, other, certificate[0])
    out = tool(policy, """
        route = BASE[:-len("/v1")]
        print(json.dumps({
            "method": call("DELETE", BASE + "/chat/x"),
            "path": call("GET", route + "/v2/models"),
            "deny": call("POST", BASE + "/admin/users"),
            "dots": call("GET", BASE + "/chat/../../admin"),
            "encoded": call("GET", BASE + "/chat/%2e%2e/admin"),
            "no_placeholder": call("GET", BASE + "/models", auth="sk-guess"),
            "unknown_route": call("GET", route.rsplit("/", 1)[0] + "/nope/v1/x"),
        }))
    """)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["method"][0] == 403 and "method DELETE is not in credentials.api.methods" in res["method"][1]
    assert res["path"][0] == 403
    assert "no entry of credentials.api.paths ['/v1/*'] matches /v2/models" in res["path"][1]
    assert res["deny"][0] == 403 and "denied by credentials.api.deny[0] '/v1/admin*'" in res["deny"][1]
    assert res["dots"][0] == 400 and res["encoded"][0] == 400
    assert res["no_placeholder"][0] == 403 and "placeholder" in res["no_placeholder"][1]
    assert res["unknown_route"][0] == 404
    assert upstream.seen == []  # nothing refused reached the upstream
    lines = [line for line in out.stderr.splitlines() if "network: refused" in line]
    assert any(line.startswith("sandlock: network: refused DELETE https://api.internal.test:")
               and "(credential route api): method DELETE" in line for line in lines), out.stderr
    assert any("denied by credentials.api.deny[0]" in line for line in lines)


def test_redirects_never_carry_the_secret(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    policy = route_policy(tmp_path, upstream, other, certificate[0], ("/v1/*", "/redirect-*"))
    out = tool(policy, """
        route = BASE[:-len("/v1")]
        away = call("GET", route + "/redirect-other")
        home = call("GET", route + "/redirect-self")
        # follow both as a client would: the tool only ever has the placeholder
        followed = [call("GET", away[2]["Location"]), call("GET", home[2]["Location"])]
        print(json.dumps({"away": away, "home": home, "followed": followed, "route": route}))
    """)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["away"][0] == 302 and res["away"][2]["Location"] == f"http://127.0.0.1:{other.port}/landed"
    assert res["home"][0] == 302 and res["home"][2]["Location"] == res["route"] + "/v1/landed"
    assert res["followed"][0][0] == 200 and res["followed"][1][:2] == [200, "ok GET /v1/landed\n"]
    assert other.seen[0]["path"] == "/landed"
    assert SECRET not in json.dumps(other.seen)
    assert upstream.seen[-1]["headers"]["Authorization"] == f"Bearer {SECRET}"


def test_server_sent_events_pass_unbuffered(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    policy = route_policy(tmp_path, upstream, other, certificate[0])
    out = tool(policy, """
        req = urllib.request.Request(BASE + "/sse", headers={"Authorization": "Bearer " + KEY})
        stream = urllib.request.urlopen(req, timeout=120)
        first = stream.readline().decode() + stream.readline().decode()
        # the server sends event 2 only after this acknowledgement: a buffering route
        # would never deliver event 1 first
        print(json.dumps({"first": first, "ack": call("POST", BASE + "/ack")[0],
                          "rest": stream.read().decode()}))
    """)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res == {"first": "data: event 1\n\n", "ack": 200, "rest": "data: event 2\n\n"}


def test_the_python_api_takes_the_secret_as_an_argument(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    from sandlock import Sandbox

    policy = route_policy(tmp_path, upstream, other, certificate[0])
    given = "sk-given-" + secrets.token_hex(8)
    with Sandbox(str(policy), credentials={"api": given}) as box:
        result = box.run([PYTHON, "-c", CLIENT + textwrap.dedent("""
            print(json.dumps({"env": dict(os.environ),
                              "chat": call("POST", BASE + "/chat/x", body=b"{}")}))
        """)], capture_output=True, text=True, timeout=120)
        again = box.run([PYTHON, "-c", CLIENT + "print(call('GET', BASE + '/models')[0])"],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert given not in result.stdout
    res = json.loads(result.stdout)
    assert res["env"]["TEST_API_KEY"].startswith("sandlock-placeholder-api-")
    assert res["chat"][:2] == [200, "ok POST /v1/chat/x\n"]
    assert again.stdout == "200\n", again.stderr
    assert [seen["headers"]["Authorization"] for seen in upstream.seen] == [f"Bearer {given}"] * 2
    with pytest.raises(PolicyError, match=r"credentials\.zz.*no \[credentials.zz\]"):
        Sandbox(str(policy), credentials={"zz": "s"})
    with pytest.raises(TypeError, match="credentials must be a mapping"):
        Sandbox(str(policy), credentials={"api": 1})  # type: ignore[dict-item]


def test_per_call_secrets_reach_that_call_only(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    """run(..., credentials=) and popen(..., credentials=): the call's tool gets its own
    placeholder, the route attaches the call's secret to it, the Sandbox's other calls
    keep the Sandbox's secret, and the call's placeholder dies with the call."""
    needs_kernel()
    from sandlock import Sandbox

    policy = route_policy(tmp_path, upstream, other, certificate[0])
    default, alice, bob = (f"sk-{who}-{secrets.token_hex(8)}" for who in ("box", "alice", "bob"))
    show = CLIENT + "print(json.dumps([KEY, call('GET', BASE + '/models')[0]]))"
    stale = CLIENT + "print(call('GET', BASE + '/models', auth=sys.argv[1])[:2])"
    with Sandbox(str(policy), credentials={"api": default}) as box:
        first = box.run([PYTHON, "-c", show], capture_output=True, text=True, timeout=120,
                        credentials={"api": alice})
        plain = box.run([PYTHON, "-c", show], capture_output=True, text=True, timeout=120)
        waiting = box.popen([PYTHON, "-c", CLIENT + "sys.stdin.read(1); " + show[len(CLIENT):]],
                            stdin=-1, stdout=-1, stderr=-1, text=True, credentials={"api": bob})
        during = box.run([PYTHON, "-c", show], capture_output=True, text=True, timeout=120)
        out, err = waiting.communicate("x", timeout=120)
        placeholder = json.loads(first.stdout)[0]
        after = box.run([PYTHON, "-c", stale, placeholder], capture_output=True, text=True,
                        timeout=120)
        with pytest.raises(PolicyError, match=r"no \[credentials.zz\]"):
            box.run(["/bin/true"], credentials={"zz": "s"})
        with pytest.raises(TypeError, match="credentials must be a mapping"):
            box.run(["/bin/true"], credentials={"api": 1})  # type: ignore[dict-item]
    for done in (first, plain, during, after):
        assert done.returncode == 0, done.stderr
    assert waiting.returncode == 0, err
    keys = [json.loads(done)[0] for done in (first.stdout, plain.stdout, during.stdout, out)]
    assert all(k.startswith("sandlock-placeholder-api-") for k in keys)
    assert keys[1] == keys[2] and len({keys[0], keys[1], keys[3]}) == 3  # the Sandbox's, twice
    assert [json.loads(done)[1] for done in (first.stdout, plain.stdout, during.stdout, out)] \
        == [200] * 4
    assert [seen["headers"]["Authorization"] for seen in upstream.seen] == [
        f"Bearer {alice}", f"Bearer {default}", f"Bearer {default}", f"Bearer {bob}"]
    # the first call's placeholder, used by a later call: the route no longer knows it
    assert after.stdout.startswith('[403, "sandlock route:') and "placeholder" in after.stdout
    assert len(upstream.seen) == 4
    for secret in (default, alice, bob):
        assert all(secret not in text for text in (first.stdout, plain.stdout, out, err))


def test_per_call_secrets_need_a_credential_route(tmp_path: Path) -> None:
    from sandlock import Sandbox

    with Sandbox(str(write_policy(tmp_path, "version = 1\n"))) as box:
        with pytest.raises(ValueError, match=r"needs a policy with \[credentials\]"):
            box.run(["/bin/true"], credentials={"api": "s"})


def test_a_second_request_smuggled_on_the_connection_never_reaches_the_upstream(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    policy = route_policy(tmp_path, upstream, other, certificate[0])
    out = tool(policy, """
        import socket
        host, port = BASE.split("/")[2].split(":")
        answers = []
        for first in (b"Content-Length: 0\\r\\n", b"Transfer-Encoding: chunked\\r\\n",
                      b"Content-Length: 5\\r\\nTransfer-Encoding: chunked\\r\\n"):
            s = socket.create_connection((host, int(port)))
            body = b"0\\r\\n\\r\\n" if b"chunked" in first else b""
            smuggled = b"DELETE /api/v1/admin HTTP/1.1\\r\\nAuthorization: Bearer " + KEY.encode() + b"\\r\\n\\r\\n"
            s.sendall(b"POST /api/v1/chat/x HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer " + KEY.encode()
                      + b"\\r\\n" + first + b"\\r\\n" + body + smuggled)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            answers.append(data.decode().split("\\r\\n")[0])
        s = socket.create_connection((host, int(port)))
        s.sendall(b"GET /api/v1/x HTTP/1.1\\r\\nUpgrade: h2c\\r\\nConnection: Upgrade\\r\\nAuthorization: Bearer " + KEY.encode() + b"\\r\\n\\r\\n")
        answers.append(s.recv(65536).decode().split("\\r\\n")[0])
        print(json.dumps(answers))
    """)  # noqa: E501 - the program is kept as written
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["HTTP/1.1 200 OK", "HTTP/1.1 200 OK",
                                      "HTTP/1.1 400 Bad Request", "HTTP/1.1 200 OK"]
    assert [(s["method"], s["path"]) for s in upstream.seen] == [
        ("POST", "/v1/chat/x"), ("POST", "/v1/chat/x"), ("GET", "/v1/x")]
    assert "Upgrade" not in upstream.seen[-1]["headers"]


@pytest.mark.parametrize("host, ca, message", [
    ("api.internal.test", False, "self-signed certificate"),
    ("wrong.internal.test", True, "Hostname mismatch"),
])
def test_an_upstream_that_fails_verification_never_gets_the_secret(
        tmp_path: Path, upstream: Server, other: Server, certificate: tuple[Path, Path],
        host: str, ca: bool, message: str) -> None:
    needs_kernel()
    (tmp_path / "work").mkdir()
    text = POLICY.format(work=tmp_path / "work", other=other.port, port=upstream.port, ca=certificate[0],
                         paths='"/*"')
    text = text.replace("api.internal.test:", f"{host}:").replace(
        '"api.internal.test" = "127.0.0.1"', f'"{host}" = "127.0.0.1"')
    if not ca:
        text = text.replace(f'ca_file = "{certificate[0]}"\n', "")
    policy = write_policy(tmp_path, text, name="cred.toml")
    out = tool(policy, "print(json.dumps(call('GET', BASE + '/models')))")
    assert out.returncode == 0, out.stderr
    status, body, _ = json.loads(out.stdout)
    assert status == 502 and message in body
    assert upstream.seen == []  # the TLS handshake failed before any byte of the request


def test_a_secret_file_outside_the_grants_is_read_by_sandlock_only(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    keydir = tmp_path / "keys"
    keydir.mkdir()
    (keydir / "api").write_text(SECRET + "\n")
    os.chmod(keydir, 0o700)
    policy = route_policy(tmp_path, upstream, other, certificate[0])
    text = policy.read_text().replace('from_env = "TEST_API_KEY"', f'from_file = "{keydir}/api"')
    policy.write_text(text)
    out = tool(policy, f"""
        try:
            open({str(keydir / "api")!r}).read(); leaked = "read"
        except OSError as exc:
            leaked = exc.errno
        print(json.dumps([leaked, call("GET", BASE + "/models")[0], "TEST_API_KEY" in os.environ]))
    """)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [13, 200, True]
    assert upstream.seen[0]["headers"]["Authorization"] == f"Bearer {SECRET}"
    # the same file within a read grant: refused before anything runs
    policy.write_text(text.replace('read = ["/proc", ', f'read = ["/proc", "{keydir}", '))
    refused = tool(policy, "print('ran')")
    assert refused.returncode == 125 and refused.stdout == ""
    assert "credentials.api.from_file" in refused.stderr
    assert "within the tool's grant filesystem.read" in refused.stderr


def test_routes_work_beside_a_host_allowlist(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    needs_kernel()
    policy = route_policy(tmp_path, upstream, other, certificate[0])
    policy.write_text(policy.read_text().replace(
        "[network]\n", "[network]\nallow = [\"api.internal.test:1\"]\n"))
    out = tool(policy, "print(call('GET', BASE + '/models')[0])")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "200\n"
    assert upstream.seen[0]["headers"]["Authorization"] == f"Bearer {SECRET}"


def test_explain_names_the_route_and_its_port_grant(tmp_path: Path) -> None:
    from conftest import sandlock

    policy = write_policy(tmp_path, 'version = 1\n[credentials.openai]\n'
                          'upstream = "https://api.openai.com/v1"\nfrom_env = "OPENAI_API_KEY"\n'
                          'env = "OPENAI_API_KEY"\nmethods = ["POST"]\n')
    out = sandlock("explain", "--policy", str(policy), "--json")
    assert out.returncode == 0, out.stderr
    (cred,) = json.loads(out.stdout)["credentials"]
    assert cred["upstream"] == "https://api.openai.com/v1" and cred["paths"] == ["/v1/*"]
    assert "TCP connect to the route's 127.0.0.1 port" in cred["grant"]
    text = sandlock("explain", "--policy", str(policy))
    assert "credential openai: route to https://api.openai.com/v1" in text.stdout


# ----------------------------------------------------------------------------
# sandlock probe: the credential rows


PROBED = """\
version = 1
[filesystem]
read = ["/proc", "{work}"]
write = ["{work}"]
[credentials.api]
upstream = "https://api.example.test/v1"
from_env = "SANDLOCK_TEST_NEVER_SET"
env = "API_KEY"
base_url_env = "API_BASE"
[credentials.q]
upstream = "https://q.example.test"
query = "key"
"""
CREDENTIAL_ROWS = {"credentials.env", "credentials.parent_environ", "credentials.parent_mem",
                   "credentials.proc_environ", "credentials.route_without_placeholder",
                   "credentials.placeholder_echo"}


def probed(tmp_path: Path) -> Any:
    from sandlock.probe.harness import probe_policy

    (tmp_path / "work").mkdir()
    policy = loads_policy(PROBED.format(work=tmp_path / "work"))
    return probe_policy(policy, home=str(tmp_path))


def test_probe_rows_the_secret_is_out_of_reach(tmp_path: Path) -> None:
    """`sandlock probe` serves the routes with a canary of its own (from_env is never
    read: the variable is not even set) and every way to the secret is blocked."""
    needs_kernel()
    report = probed(tmp_path)
    rows = {r.id: r for r in report.results if r.id.startswith("credentials.")}
    assert set(rows) == CREDENTIAL_ROWS
    assert {r.verdict for r in rows.values()} == {"blocked"}, rows
    assert "placeholders only: API_KEY" in rows["credentials.env"].detail
    assert rows["credentials.route_without_placeholder"].detail.startswith("6 requests refused")
    assert "placeholder only (api, q)" in rows["credentials.placeholder_echo"].detail
    assert any("the probe's echo server" in grant for grant in report.runtime_grants)
    assert report.ok


def test_probe_rows_catch_a_route_that_leaks(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows are not blind: a route that put the secret in the tool's environment,
    or that served a request without the placeholder, is an ESCAPE, and the report
    never shows the secret."""
    needs_kernel()
    from sandlock.net import routes

    shown: list[str] = []
    real_env = C.tool_environment  # what routes imported and calls
    real_secret = routes.RouteServer._secret

    def leaky_env(credentials: Any, env: Any, secrets_: Any, *rest: Any) -> dict[str, str]:
        shown.extend(secrets_.values())
        return {**real_env(credentials, env, secrets_, *rest), "LEAKED": secrets_["api"]}

    def no_check(self: Any, item: Any, headers: Any, query: str, where: str, peer: Any) -> Any:
        try:
            return real_secret(self, item, headers, query, where, peer)
        except routes.BadRequest:
            with self._lock:
                return next((s, p) for p, (i, s) in self._sessions.items() if i is item)

    monkeypatch.setattr(routes, "tool_environment", leaky_env)
    monkeypatch.setattr(routes.RouteServer, "_secret", no_check)
    report = probed(tmp_path)
    rows = {r.id: r for r in report.results}
    assert rows["credentials.env"].verdict == "ESCAPE"
    assert "LEAKED" in rows["credentials.env"].detail
    assert rows["credentials.route_without_placeholder"].verdict == "ESCAPE"
    assert "the route did not refuse" in rows["credentials.route_without_placeholder"].detail
    assert not report.ok
    assert shown and shown[0].startswith("SANDLOCK-CRED-")
    assert shown[0] not in json.dumps(report.as_dict())



def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on 127.0.0.1:``port`` (/proc/net/tcp, state 0A)."""
    found = set()
    with open("/proc/net/tcp") as handle:
        for line in handle.readlines()[1:]:
            fields = line.split()
            if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":
                found.add(fields[9])
    return found


def _my_socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def test_the_api_route_server_runs_outside_the_agents_process(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    """The route server parses every byte the tool sends it: under the API it listens and
    parses in a process of its own (never the agent's, which holds its keys and history),
    and a tool that floods it leaves the agent's descriptors alone (200 connections: the
    server serves 256 at once, see net.listener.MAX_CLIENTS)."""
    needs_kernel()
    from sandlock import Sandbox

    policy = route_policy(tmp_path, upstream, other, certificate[0])
    given = "sk-given-" + secrets.token_hex(8)
    with Sandbox(str(policy), credentials={"api": given}) as box:
        port = int(box._environment()["TEST_BASE_URL"].rsplit(":", 1)[1].split("/", 1)[0])
        listening = _listening_inodes(port)
        assert listening, "no route server listening"
        assert not listening & _my_socket_inodes(), "the route server's socket is the agent's"
        before = len(os.listdir("/proc/self/fd"))
        flood = box.run([PYTHON, "-c", CLIENT + textwrap.dedent("""
            import socket
            held = []
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", int(BASE.rsplit(":", 1)[1].split("/")[0])))
                s.send(b"GARBAGE \\r\\n")
                held.append(s)
            print(call("GET", BASE + "/models")[0])
        """)], capture_output=True, text=True, timeout=120)
        assert flood.returncode == 0, flood.stderr
        assert len(os.listdir("/proc/self/fd")) - before < 8
    assert given not in flood.stdout


def test_the_route_server_serves_a_bounded_number_of_connections(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    """`sandlock run`'s route server is a thread of the launcher: a tool that opens
    connections without end and sends nothing gets MAX_CLIENTS of them held at most (each
    new one lets the oldest idle one go), with one report; the launcher keeps its threads
    and descriptors."""
    needs_kernel()
    from sandlock.net import listener

    policy = route_policy(tmp_path, upstream, other, certificate[0])
    out = tool(policy, f"""
        import resource, socket
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        port = int(BASE.rsplit(":", 1)[1].split("/")[0])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range({listener.MAX_CLIENTS + 40})]
        closed = 0
        for s in held[:40]:
            s.settimeout(10)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except OSError:  # a timeout: still open, being served
                pass
        print(closed)
    """)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 40 - 1  # the first ones in were let go
    assert f"let an idle connection go: {listener.MAX_CLIENTS} are open" in out.stderr


def test_one_call_cannot_starve_another_calls_route(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    """Under the API a Sandbox's calls share its route server. A call that holds more
    connections than the server serves at once, sending nothing, must not keep another
    call's request out: a connection that has not sent its request head is the one let go."""
    needs_kernel()
    from sandlock import Sandbox
    from sandlock.net import listener

    policy = route_policy(tmp_path, upstream, other, certificate[0])
    hog = CLIENT + textwrap.dedent(f"""
        import resource, socket
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        port = int(BASE.rsplit(":", 1)[1].split("/")[0])
        held = [socket.create_connection(("127.0.0.1", port))
                for _ in range({listener.MAX_CLIENTS + 5})]
        print("holding", len(held), flush=True)
        sys.stdin.read(1)
    """)
    victim = CLIENT + "print(call('GET', BASE + '/models')[0])"
    with Sandbox(str(policy), credentials={"api": "sk-" + secrets.token_hex(8)}) as box:
        attacker = box.popen([PYTHON, "-c", hog], stdin=-1, stdout=-1, stderr=-1, text=True)
        assert attacker.stdout is not None and attacker.stdout.readline().startswith("holding")
        during = box.run([PYTHON, "-c", victim], capture_output=True, text=True, timeout=120)
        attacker.communicate("x", timeout=120)
    assert during.stdout.strip() == "200", during.stderr[-300:]


# ----------------------------------------------------------------------------
# A placeholder alone is no key to the route (a twenty-fourth attack round)


def _outside(base: str, placeholder: str) -> tuple[int, str]:
    """A request to the route from this process, outside any sandbox, with ``placeholder``:
    (status, body)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(base + "/models", headers={"Authorization": f"Bearer {placeholder}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_another_calls_placeholder_is_no_key_to_the_route(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    """One Sandbox, two calls with their own secrets: Bob's tool leaves its placeholder where
    Alice's tool reads it (a command line in /proc, here its output), and Alice's tool sent
    requests with it, under Bob's key (the route chose the secret by the placeholder alone).
    The route serves a placeholder only on a connection the call's own gate or proxy made
    and admitted for that call. Control: Bob's own request with it goes through."""
    needs_kernel()
    from sandlock import Sandbox

    policy = route_policy(tmp_path, upstream, other, certificate[0])
    alice, bob = (f"sk-{who}-{secrets.token_hex(8)}" for who in ("alice", "bob"))
    waiting = CLIENT + textwrap.dedent("""
        print(KEY, flush=True)
        sys.stdin.readline()
        print(json.dumps(call('GET', BASE + '/models?who=bob')[:2]), flush=True)
    """)
    borrow = CLIENT + "print(json.dumps(call('GET', BASE + '/models?who=alice', auth=sys.argv[1])[:2]))"
    with Sandbox(str(policy), credentials={"api": "sk-" + secrets.token_hex(8)}) as box:
        victim = box.popen([PYTHON, "-c", waiting], stdin=-1, stdout=-1, stderr=-1, text=True,
                           credentials={"api": bob})
        assert victim.stdin is not None and victim.stdout is not None
        placeholder = victim.stdout.readline().strip()
        assert placeholder.startswith("sandlock-placeholder-api-"), placeholder
        thief = box.run([PYTHON, "-c", borrow, placeholder], capture_output=True, text=True,
                        timeout=120, credentials={"api": alice})
        victim.stdin.write("go\n")
        victim.stdin.flush()
        own = json.loads(victim.stdout.readline())
        victim.communicate(timeout=120)
    assert thief.returncode == 0, thief.stderr
    status, body = json.loads(thief.stdout)
    assert status == 403 and "not of the run whose tool made this connection" in body, body
    assert own[0] == 200, own  # control: the placeholder is a live one, of Bob's call
    assert [seen["headers"]["Authorization"] for seen in upstream.seen] == [f"Bearer {bob}"]
    assert all("who=alice" not in seen["path"] for seen in upstream.seen)


def test_a_local_process_cannot_borrow_a_runs_route(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    """`sandlock run`: a process outside the sandbox (another local user would do the same)
    that reads the tool's placeholder, from its command line in /proc, connects to the
    route's port itself: refused, the connection was not made through the run's connect
    gate. Control: the tool's own request with it goes through; the policy reaches other
    hosts on a connect port, where the route used to be a Landlock port rule (no gate)."""
    needs_kernel()
    policy = route_policy(tmp_path, upstream, other, certificate[0])
    waiting = CLIENT + textwrap.dedent("""
        print(KEY, BASE, flush=True)
        sys.stdin.readline()
        print(json.dumps(call('GET', BASE + '/models?who=tool')[:2]), flush=True)
    """)
    env = {**os.environ, "TEST_API_KEY": SECRET, "TEST_OTHER": "x"}
    run = subprocess.Popen([sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--",
                            PYTHON, "-c", waiting], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert run.stdin is not None and run.stdout is not None
        placeholder, base = run.stdout.readline().split()
        status, body = _outside(base, placeholder)
        run.stdin.write("go\n")
        run.stdin.flush()
        own = json.loads(run.stdout.readline())
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert status == 403 and "not made by a confined tool through its connect gate" in body, body
    assert own[0] == 200, (own, err)  # control: the placeholder is the run's, live
    assert [seen["path"] for seen in upstream.seen] == ["/v1/models?who=tool"]


def test_one_call_cannot_hold_every_slot_with_requests_under_way(
        tmp_path: Path, upstream: Server, other: Server,
        certificate: tuple[Path, Path]) -> None:
    """A call that sends more complete requests than the shared route server serves at
    once, each to an endpoint that answers slowly (a stream), held every slot: another
    call's request timed out (a twenty-fourth attack round). A run has at most
    MAX_PER_SESSION requests under way (503 beyond); the other call is served."""
    needs_kernel()
    from sandlock import Sandbox
    from sandlock.net import listener, routes

    policy = route_policy(tmp_path, upstream, other, certificate[0])
    hog = CLIENT + textwrap.dedent(f"""
        import resource, socket
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        host, port = BASE.split("/")[2].split(":")
        head = ("GET /api/v1/sse HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer " + KEY
                + "\\r\\n\\r\\n").encode()
        held, statuses = [], {{}}
        for _ in range({listener.MAX_CLIENTS + 5}):
            s = socket.create_connection((host, int(port)))
            s.sendall(head)
            held.append(s)
        for s in held:
            s.settimeout(30)
            status = s.recv(12)[9:12].decode()
            statuses[status] = statuses.get(status, 0) + 1
        print(json.dumps(statuses), flush=True)
        sys.stdin.read(1)
    """)
    victim = CLIENT + "print(call('GET', BASE + '/models')[0])"
    with Sandbox(str(policy), credentials={"api": "sk-" + secrets.token_hex(8)}) as box:
        attacker = box.popen([PYTHON, "-c", hog], stdin=-1, stdout=-1, stderr=-1, text=True)
        assert attacker.stdout is not None
        statuses = json.loads(attacker.stdout.readline())
        during = box.run([PYTHON, "-c", victim], capture_output=True, text=True, timeout=120)
        upstream.ack.set()
        attacker.communicate("x", timeout=120)
    assert statuses == {"200": routes.MAX_PER_SESSION,
                        "503": listener.MAX_CLIENTS + 5 - routes.MAX_PER_SESSION}, statuses
    assert during.stdout.strip() == "200", during.stderr[-300:]
