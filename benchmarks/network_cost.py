"""What a host allowlist costs (issue 7). Loopback only.

    python benchmarks/network_cost.py [--connections 500] [--runs 30]

1. Per connection, measured inside the sandbox by a Python tool (median of N):
   - ``direct``: connect(2) to a loopback server on a port granted by
     ``connect = [PORT]`` (no ``allow``: Landlock decides, no supervisor);
   - ``supervised connect``: socket(2) + connect(2) + close to the proxy under
     ``allow`` (two seccomp notification round trips: the gate makes the socket and
     installs it with ADDFD, then finds it by inode and connects it itself);
   - ``mediated tunnel``: supervised connect + ``CONNECT host:PORT`` + the
     proxy's checks, pinned resolution and upstream connect + the 200 reply,
     i.e. until the tool holds a usable byte stream to the server.
2. Per run: ``sandlock run -- /bin/true`` with a policy without ``allow`` (the
   fast path, with and without the compiled-policy cache) and the same policy
   with ``allow`` (never cached; proxy + supervisor started and stopped), plus
   whether a no-``allow`` run imports any of the network modules.
3. The HTTP layer (``--http``; ``--baseline TREE``: the same figures for another
   checkout, measured in the same run, interleaved, and the ratio of this tree's to
   it): per request, a plain ``GET`` through the proxy to a loopback server, and a
   ``POST`` with a body through a credential route to a TLS loopback upstream
   (servers in a process of their own, no sandbox: the cost of parsing, checking and
   framing, not of the gate); and the import of the proxy and of the route server
   (fresh interpreter, ``-X importtime``'s cumulative microseconds, the fastest
   of N), and of h11 within it.

    python benchmarks/network_cost.py --http --baseline /path/to/other/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
PYTHON = "/usr/bin/python3"

TOOL = r"""
import base64, json, os, socket, sys, time, urllib.parse
n, port = int(sys.argv[1]), int(sys.argv[2])
def median_us(fn):
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    samples.sort()
    return round(samples[len(samples) // 2], 1)
out = {}
def connect_to(address):
    s = socket.socket()
    s.connect(address)
    s.close()
proxy = os.environ.get("HTTP_PROXY")
if proxy is None:
    out["direct connect"] = median_us(lambda: connect_to(("127.0.0.1", port)))
else:
    p = urllib.parse.urlsplit(proxy)
    auth = base64.b64encode(f"{p.username}:{p.password}".encode()).decode()
    request = (f"CONNECT api.internal.test:{port} HTTP/1.1\r\n"
               f"Proxy-Authorization: Basic {auth}\r\n\r\n").encode()
    out["supervised connect (to the proxy)"] = median_us(lambda: connect_to(("127.0.0.1", p.port)))
    def tunnel():
        s = socket.socket()
        s.connect(("127.0.0.1", p.port))
        s.sendall(request)
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        s.close()
    out["mediated tunnel (connect + CONNECT + upstream)"] = median_us(tunnel)
print(json.dumps(out))
"""

POLICY = """\
version = 1
extends = ["python"]
[filesystem]
exec = ["/usr/bin/true"]
[network]
{network}
"""


def accept_forever(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        conn.close()


def sandlock(policy: Path, *argv: str, env: Optional[dict[str, str]] = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandlock", "run", "--policy", str(policy), "--",
                           *argv], capture_output=True, text=True, check=False, cwd=REPO, env=env)


def per_run_ms(policy: Path, runs: int, env: Optional[dict[str, str]] = None) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        done = sandlock(policy, "/usr/bin/true", env=env)
        samples.append((time.perf_counter() - start) * 1e3)
        assert done.returncode == 0, done.stderr
    return round(statistics.median(samples), 2)


HTTP_PROBE = r"""
import base64, http.server, json, socket, ssl, statistics, sys, threading, time
from sandlock.net.proxy import Proxy
from sandlock.net.routes import RouteServer
from sandlock.policy import credentials as C
from sandlock.policy.netrules import NetRules, parse_pins, parse_rules

n, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def _reply(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")
    do_GET = do_POST = _reply

class Upstream(http.server.ThreadingHTTPServer):
    daemon_threads = True
    context = None
    def get_request(self):
        sock, address = super().get_request()
        return (self.context.wrap_socket(sock, server_side=True) if self.context else sock), address

def serve(context):
    server = Upstream(("127.0.0.1", 0), Handler)
    server.context = context
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]

def median_us(request, address):
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        with socket.create_connection(address, timeout=30) as sock:
            sock.sendall(request)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        samples.append((time.perf_counter() - start) * 1e6)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return round(statistics.median(samples), 1)

plain = serve(None)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
tls = serve(context)
out = {"direct GET (us)": median_us(b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
                                   ("127.0.0.1", plain))}
proxy = Proxy(NetRules(parse_rules([f"api.internal.test:{plain}"], "allow"), (),
                       parse_pins({"api.internal.test": "127.0.0.1"})), lambda m: None)
proxy.start()
auth = base64.b64encode(f"sandlock:{proxy.token}".encode()).decode()
out["GET through the proxy (us)"] = median_us(
    (f"GET http://api.internal.test:{plain}/x HTTP/1.1\r\nHost: api.internal.test\r\n"
     f"Proxy-Authorization: Basic {auth}\r\nUser-Agent: b\r\nAccept: */*\r\n\r\n").encode(),
    proxy.address)
proxy.stop()
item = C.parse_one("api", {"upstream": f"https://api.internal.test:{tls}/v1", "ca_file": cert})
route = RouteServer([item], [("api.internal.test", "127.0.0.1")], lambda m: None)
placeholder = route.session({"api": "sk-bench-secret-0123456789"}).placeholders["api"]
route.start()
body = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}'
request = (f"POST /api/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           f"Authorization: Bearer {placeholder}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
out["POST through a credential route, TLS upstream (us)"] = median_us(request, route.address)
route.stop()
print(json.dumps(out))
"""


def import_us(tree: str, module: str, runs: int, part: str = "") -> float:
    """Cumulative import time of ``module`` (or of ``part`` as ``module`` imports it) in
    a fresh interpreter (-X importtime), the fastest of ``runs`` (the least disturbed by
    other load); 0 when ``part`` is not imported."""
    samples = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                              capture_output=True, text=True, check=True, cwd=tree,
                              env={**os.environ, "PYTHONPATH": tree})
        lines = [x for x in done.stderr.splitlines()
                 if x.rsplit("|", 1)[-1].strip() == (part or module)]
        samples.append(float(lines[-1].split("|")[1]) if lines else 0.0)
    return round(min(samples))


def http_cost(trees: dict[str, str], requests: int, runs: int) -> dict[str, object]:
    """Section 3 for each tree, interleaved (three rounds, median of the rounds); each
    tree's own ``sandlock`` (run from the tree: ``-c`` puts the working directory first)."""
    import shutil

    openssl = shutil.which("openssl")
    assert openssl is not None, "the openssl CLI makes the upstream's certificate"
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-subj", "/CN=api.internal.test", "-addext",
                        "subjectAltName=DNS:api.internal.test", "-days", "2"],
                       check=True, capture_output=True)
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(3):
            for name, tree in trees.items():
                done = subprocess.run([sys.executable, "-c", HTTP_PROBE, str(requests), str(cert),
                                       str(key)], capture_output=True, text=True, check=True,
                                      cwd=tree, env={**os.environ, "PYTHONPATH": tree})
                figures = json.loads(done.stdout)
                for module in ("sandlock.net.proxy", "sandlock.net.routes"):
                    figures[f"import {module} (us, cumulative, fastest)"] = import_us(
                        tree, module, runs)
                figures["of which h11 (us, cumulative, fastest)"] = import_us(
                    tree, "sandlock.net.routes", runs, "h11")
                rounds[name].append(figures)
    out: dict[str, object] = {}
    medians = {name: {key: statistics.median(s[key] for s in samples) for key in samples[0]}
               for name, samples in rounds.items()}
    out.update(medians)
    if len(trees) == 2:
        this, base = medians.values()
        out["ratio (this tree / baseline)"] = {key: round(this[key] / base[key], 2)
                                               for key in this if base.get(key)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--http", action="store_true", help="only section 3, the HTTP layer")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--baseline", help="another checkout to measure section 3 against")
    args = parser.parse_args()
    if args.http:
        trees = {"this tree": str(REPO)}
        if args.baseline:
            trees["baseline"] = str(Path(args.baseline).resolve())
        print(json.dumps(http_cost(trees, args.requests, max(3, args.runs // 3)), indent=2))
        return

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1024)
    port = server.getsockname()[1]
    threading.Thread(target=accept_forever, args=(server,), daemon=True).start()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp, "plain.toml")
        plain.write_text(POLICY.format(network=f"connect = [{port}]"))
        allow = Path(tmp, "allow.toml")
        allow.write_text(POLICY.format(network=f'allow = ["api.internal.test:{port}"]\n'
                                               'hosts = { "api.internal.test" = "127.0.0.1" }'))
        for policy in (plain, allow):
            done = sandlock(policy, PYTHON, "-c", TOOL, str(args.connections), str(port))
            assert done.returncode == 0, done.stderr
            results.update({f"{k} (us, median)": v for k, v in json.loads(done.stdout).items()})
        results["run /bin/true, no allow (ms, median)"] = per_run_ms(plain, args.runs)
        uncached = {**os.environ, "SANDLOCK_NO_CACHE": "1"}
        results["run /bin/true, no allow, policy cache off (ms, median)"] = per_run_ms(
            plain, args.runs, uncached)
        results["run /bin/true, with allow (never cached) (ms, median)"] = per_run_ms(
            allow, args.runs)
        probe = textwrap.dedent(f"""
            import sys
            from sandlock.cli import launch
            launch.execute({str(plain)!r}, {{}}, None, False, ["/usr/bin/true"])
            print(sorted(m for m in sys.modules if m.startswith("sandlock.")))
        """)
        modules = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                 check=True, cwd=REPO).stdout.strip()
        results["no-allow run imports netrules/proxy/connect gate"] = any(
            name in modules
            for name in ("sandlock.policy.netrules", "sandlock.net.proxy", "sandlock.net.connect"))
        # What launcher.run adds for a policy without allow: one attribute test.
        from sandlock.policy.model import load_policy

        network = load_policy(plain).network
        loops = 1_000_000
        start = time.perf_counter()
        for _ in range(loops):
            if network.allow:
                raise AssertionError
        results["no-allow hook: one attribute test (ns)"] = round(
            (time.perf_counter() - start) / loops * 1e9, 1)
    server.close()
    results["machine"] = f"{os.cpu_count()} cores, {os.uname().release}"
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
