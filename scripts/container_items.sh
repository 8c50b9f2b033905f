#!/usr/bin/env bash
# One item of the container test (scripts/container_test.sh), run inside the container
# image it builds, as root or as the user `tool`:
#
#   container_items.sh ITEM    # ITEM: quickstart allowlist credentials trace learn
#                              #       processes api check bench probe.NAME
#
# Exit 0 when the item passed; otherwise the last line says why. The image holds this
# file, README.md and policies/*.toml of the tree under /opt/sandlock-ci, and sandlock
# installed from the tree's wheel in /opt/sandlock (on PATH).
set -euo pipefail
CI=/opt/sandlock-ci
WORK="$(mktemp -d)"
cd "$WORK"
mkdir ws
echo "hello from the workspace" > ws/notes.md

fail() { echo "FAIL: $*"; exit 1; }

wait_port() {  # wait_port PORT [https]: until a server answers there (10 s at most)
    local i
    for i in $(seq 100); do
        curl -ksS --max-time 1 -o /dev/null "${2:-http}://127.0.0.1:$1/" 2>/dev/null && return 0
        sleep 0.1
    done
    fail "no server on 127.0.0.1:$1"
}

# The README's quick start, its lines verbatim (each one must be a line of README.md).
QUICK_START='echo "hello from the workspace" > notes.md
sandlock run --policy read_file --var workspace=$PWD -- cat notes.md
git init -q . && git -c user.name=me -c user.email=me@example.com commit -q --allow-empty -m first
sandlock learn -o git-log.toml -- git log --oneline    # one recorded run, permissive but no secrets
grep -n WARNING git-log.toml || true                   # review it (and edit): broader grants first
sandlock run --policy git-log.toml --var workspace=$PWD -- git log --oneline'

quickstart() {
    local line out
    while IFS= read -r line; do
        grep -qxF -- "$line" "$CI/README.md" || fail "README.md has no line: $line"
    done <<< "$QUICK_START"
    mkdir qs && cd qs
    out="$(bash -ec "$QUICK_START" 2>&1)" || { echo "$out"; fail "the quick start exited $?"; }
    echo "$out"
    grep -qx "hello from the workspace" <<< "$out" || fail "the first example printed no file"
    [ "$(grep -c ' first$' <<< "$out")" = 2 ] || fail "git log did not run under learn and run"
}

allowlist() {  # [network] allow: a pinned name on one loopback port, not another
    local out rc
    mkdir srv && echo "allowed page" > srv/ok.txt
    python3 -m http.server --bind 127.0.0.1 --directory srv 8080 >/dev/null 2>&1 &
    python3 -m http.server --bind 127.0.0.1 --directory srv 8081 >/dev/null 2>&1 &
    wait_port 8080 && wait_port 8081
    cat > web.toml <<'EOF'
version = 1
extends = ["base"]
[filesystem]
exec = ["/usr/bin/curl"]
[network]
allow = ["web.test:8080"]
hosts = { "web.test" = "127.0.0.1" }
EOF
    out="$(sandlock run --policy web.toml -- curl -fsS --max-time 20 http://web.test:8080/ok.txt 2>&1)" \
        || { echo "$out"; fail "the allowed host:port was not reachable: $(grep -m1 'sandlock: network' <<< "$out" || true)"; }
    echo "$out"
    [ "$out" = "allowed page" ] || fail "the allowed host:port answered something else"
    rc=0; out="$(sandlock run --policy web.toml -- curl -fsS --max-time 20 http://web.test:8081/ok.txt 2>&1)" || rc=$?
    echo "$out"
    [ "$rc" != 0 ] || fail "another port of the same host was reachable"
    grep -q "no allow rule matches" <<< "$out" || fail "the other port was refused without the rule's reason"
    rc=0; out="$(sandlock run --policy web.toml -- curl -fsS --noproxy '*' --max-time 20 http://127.0.0.1:8080/ok.txt 2>&1)" || rc=$?
    echo "$out"
    [ "$rc" != 0 ] || fail "a direct connection around the proxy was allowed"
    grep -q "refused direct connection" <<< "$out" || fail "the direct connection was refused without a reason"
}

credentials() {  # a credential route: the upstream gets the secret, the tool never holds it
    local secret out
    secret="sk-ci-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
    mkdir tls seen
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout tls/key.pem \
        -out tls/cert.pem -subj /CN=api.internal.test -addext subjectAltName=DNS:api.internal.test \
        -days 2 2>/dev/null
    cat > upstream.py <<'EOF'
import http.server, ssl, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(sys.argv[1], "a") as seen:
            seen.write(f"{self.path} {self.headers.get('Authorization')}\n")
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args): pass
server = http.server.HTTPServer(("127.0.0.1", 8443), Echo)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("tls/cert.pem", "tls/key.pem")
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
EOF
    python3 upstream.py "$WORK/seen/log" &
    wait_port 8443 https
    cat > ws/tool.py <<'EOF'
import os, urllib.request
key, base = os.environ["TEST_API_KEY"], os.environ["TEST_BASE_URL"]
print("tool key:", key)
request = urllib.request.Request(base + "/models", headers={"Authorization": "Bearer " + key})
print("upstream answered:", urllib.request.urlopen(request, timeout=60).read().decode())
EOF
    cat > cred.toml <<EOF
version = 1
extends = ["python"]
[filesystem]
read = ["$WORK/ws"]
[network]
hosts = { "api.internal.test" = "127.0.0.1" }
[credentials.api]
upstream = "https://api.internal.test:8443/v1"
from_env = "TEST_API_KEY"
env = "TEST_API_KEY"
base_url_env = "TEST_BASE_URL"
ca_file = "$WORK/tls/cert.pem"
EOF
    out="$(TEST_API_KEY="$secret" sandlock run --policy cred.toml -- /usr/bin/python3 "$WORK/ws/tool.py" 2>&1)" \
        || { echo "$out"; fail "the tool's request through the route failed: $(tail -1 <<< "$out")"; }
    echo "$out"
    echo "upstream saw: $(sed "s/$secret/<the secret>/" seen/log)"
    grep -qx "/v1/models Bearer $secret" seen/log || fail "the upstream did not get the secret"
    grep -q "upstream answered: ok" <<< "$out" || fail "the tool got no answer"
    grep -q "tool key: sandlock-placeholder-api-" <<< "$out" || fail "the tool's key is no placeholder"
    ! grep -qF "$secret" <<< "$out" || fail "the tool saw the secret"
}

trace() {  # trace names the refused read and the line that grants it
    local out
    out="$(sandlock trace --policy read_file --var workspace="$WORK/ws" -- cat /etc/hostname 2>&1)" && \
        { echo "$out"; fail "cat /etc/hostname was not refused"; }
    echo "$out"
    grep -qF 'sandlock: trace: denied read /etc/hostname -> [filesystem] read += "/etc/hostname"' <<< "$out" \
        || fail "trace did not report the refused read"
}

learn() {  # learn writes a draft under which the same command runs confined
    local out
    cd ws
    sandlock learn -o draft.toml -- cat notes.md || fail "learn exited $?"
    out="$(sandlock run --policy draft.toml --var workspace="$PWD" -- cat notes.md 2>&1)" || { echo "$out"; fail "run of the draft failed"; }
    [ "$out" = "hello from the workspace" ] || { echo "$out"; fail "run of the draft printed something else"; }
}

processes() {  # [limits] processes: a harmless child under the limit (never a fork bomb)
    local out rc=0
    printf 'version = 1\nextends = ["base"]\n[filesystem]\nexec = ["/usr/bin/sh", "/usr/bin/dash", "/usr/bin/true"]\n[limits]\nprocesses = 16\n' > procs.toml
    out="$(sandlock run --policy procs.toml -- sh -c 'true & wait; echo children ran' 2>err)" || rc=$?
    cat err; echo "$out"
    [ "$rc" = 0 ] || fail "sh -c 'true & wait' under processes = 16 exited $rc: $(head -1 err)"
    [ "$out" = "children ran" ] || fail "sh -c 'true & wait' printed something else"
}

api() {  # the Python API: Sandbox(...).run and .call
    python3 - <<'EOF' || fail "the API snippet failed (above)"
import pathlib, sys, tempfile
import sandlock

ws = tempfile.mkdtemp()
pathlib.Path(ws, "notes.md").write_text("hello\n")
box = sandlock.Sandbox("read_file", vars={"workspace": ws})
r = box.run(["cat", "notes.md"], cwd=ws, capture_output=True, text=True, timeout=30)
assert (r.returncode, r.stdout) == (0, "hello\n"), r
r = box.run(["cat", "/etc/passwd"], cwd=ws, capture_output=True, text=True, timeout=30)
assert r.returncode != 0 and "Permission denied" in r.stderr, r
tools_dir = tempfile.mkdtemp()
pathlib.Path(tools_dir, "mytools.py").write_text(
    "def summarize(path):\n    return open(path).read().split()[0]\n")
sys.path.insert(0, tools_dir)
import mytools
py = sandlock.Sandbox({"extends": ["python"], "filesystem": {"read": [ws, tools_dir]}})
assert py.call(mytools.summarize, f"{ws}/notes.md") == "hello"
try:
    py.call(mytools.summarize, "/etc/passwd")
except PermissionError as e:
    print("call outside the grants:", e)
else:
    raise AssertionError("call read /etc/passwd")
sandlock.shutdown()
print("run and call: ok")
EOF
}

check() { sandlock check || fail "sandlock check exited $?"; }

probe() {  # probe NAME: every escape the shipped policy does not grant is blocked
    local out rc=0 why
    out="$(sandlock probe --policy "$CI/policies/$1.toml" --var workspace="$WORK/ws" 2>&1)" || rc=$?
    echo "$out"
    why="$(grep -E 'ESCAPE' <<< "$out" | head -3 | tr '\n' ' ' || true)"
    [ "$rc" = 0 ] || fail "probe of $1 exited $rc: ${why:-$(head -1 <<< "$out")}"
}

bench() {  # the median wall time of 20 `sandlock run ... -- /bin/true`
    printf 'version = 1\nextends = ["base"]\n[filesystem]\nexec = ["/usr/bin/true"]\n' > true.toml
    python3 - <<'EOF'
import statistics, subprocess, sys, time
argv = ["sandlock", "run", "--policy", "true.toml", "--", "/bin/true"]
times = []
for _ in range(20):
    start = time.perf_counter()
    subprocess.run(argv, check=True)
    times.append((time.perf_counter() - start) * 1000)
print(f"sandlock run -- /bin/true: median {statistics.median(times):.1f} ms "
      f"(min {min(times):.1f}, max {max(times):.1f}, n=20)")
EOF
}

case "${1:-}" in
    quickstart|allowlist|credentials|trace|learn|processes|api|check|bench) "$1" ;;
    probe.*) probe "${1#probe.}" ;;
    *) echo "usage: $0 ITEM" >&2; exit 2 ;;
esac
