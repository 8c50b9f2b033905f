#!/usr/bin/env bash
# CI, after the test suite (.ci/run calls `scripts/ci_extra.sh "$VENV"` as root):
# build the single-file binary from the tree, then smoke-test it as root and as the
# unprivileged user: it confines (a read outside the policy fails), passes exit codes
# through, and works under `env -i` from any directory. Then the binary's tests (both
# users; tests/test_binary_integrity.py attacks its unpack directory) and a
# short, threshold-free run of the start-up benchmark. Takes about two minutes.
#
#   scripts/ci_extra.sh VENV          # the CI entry point
#   scripts/ci_extra.sh --smoke BIN   # the smoke test alone, as the calling user
set -euo pipefail

smoke() {
    local bin="$1" work policy out code
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    mkdir "$work/ws" "$work/outside"
    echo "inside" > "$work/ws/file"
    echo "secret" > "$work/outside/secret"
    policy="$work/policy.toml"
    cat > "$policy" <<'EOF'
version = 1
extends = ["base"]
[filesystem]
read = ["${ws}"]
exec = ["/usr/bin/cat", "/usr/bin/sh", "/usr/bin/dash"]
EOF
    cd /
    for attempt in first cached; do
        out="$(env -i "$bin" run --policy "$policy" --var "ws=$work/ws" -- /usr/bin/cat "$work/ws/file")"
        [ "$out" = "inside" ] || { echo "FAIL ($attempt): read inside the policy gave '$out'"; return 1; }
        code=0
        out="$(env -i "$bin" run --policy "$policy" --var "ws=$work/ws" -- /usr/bin/cat \
            "$work/outside/secret" 2>/dev/null)" || code=$?
        [ "$code" = 1 ] && [ -z "$out" ] \
            || { echo "FAIL ($attempt): read outside the policy: exit $code, output '$out'"; return 1; }
        code=0
        env -i "$bin" run --policy "$policy" --var "ws=$work/ws" -- /usr/bin/sh -c 'exit 3' || code=$?
        [ "$code" = 3 ] || { echo "FAIL ($attempt): exit code 3 came back as $code"; return 1; }
    done
    echo "smoke OK as $(id -un): confines, passes exit codes, works under env -i"
}

if [ "${1:-}" = "--smoke" ]; then
    smoke "${2:?usage: $0 --smoke BINARY}"
    exit
fi

VENV="${1:?usage: $0 VENV}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# .ci/run tests a world-readable copy of the tree; build there so the CI user can run it.
SRC="${SANDLOCK_CI_SRC:-/opt/sandlock-ci-src}"
[ -f "$SRC/scripts/build_binary.sh" ] || SRC="$ROOT"

echo "== build the single-file binary"
if ! command -v gcc >/dev/null || ! command -v objdump >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq gcc libc6-dev binutils >/dev/null
fi
"$SRC/scripts/build_binary.sh"
BIN="$SRC/dist/sandlock"
chmod -R a+rX "$SRC/dist"
ls -l "$BIN"

echo "== binary smoke test as root"
"$SRC/scripts/ci_extra.sh" --smoke "$BIN"
echo "== binary smoke test as an unprivileged user"
id sandlock-ci >/dev/null 2>&1 || useradd --create-home --shell /bin/sh sandlock-ci
runuser -u sandlock-ci -- env -i PATH=/usr/bin:/bin HOME=/home/sandlock-ci \
    "$SRC/scripts/ci_extra.sh" --smoke "$BIN"

echo "== binary tests as root and as an unprivileged user"
cd "$SRC"
# tests/test_binary_*.py: the attacks on the unpack directory (issue 11 items 2 and 7).
SANDLOCK_BINARY="$BIN" "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_binary.py \
    tests/test_binary_*.py
runuser -u sandlock-ci -- env -i PATH="$VENV/bin:/usr/bin:/bin" HOME=/home/sandlock-ci \
    SANDLOCK_BINARY="$BIN" SANDLOCK_EXPECT_ABI="${SANDLOCK_EXPECT_ABI:-}" LANG=C.UTF-8 \
    sh -c "cd '$SRC' && python -m pytest -q -p no:cacheprovider tests/test_binary.py tests/test_binary_*.py"

echo "== start-up benchmark (informational, no thresholds)"
"$VENV/bin/python" benchmarks/startup.py --rounds 10 --binary "$BIN" \
    || echo "start-up benchmark failed (informational only)"
