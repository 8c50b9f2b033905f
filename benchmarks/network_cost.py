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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

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
