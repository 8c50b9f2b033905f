#!/usr/bin/env bash
# A Debian 12 rootfs (debootstrap minbase plus python3, what a new machine starts from)
# unpacked into DIR; the CI's fresh-machine and container tests both start from it.
#
#   scripts/debian_rootfs.sh DIR
#
# Needs root, debootstrap (installed from scripts/system-packages.txt, `ci`, when missing)
# and the Debian mirror (SANDLOCK_DEBIAN_MIRROR). The packages debootstrap fetches are
# kept in a tarball under /var/cache/sandlock-ci (rebuilt after a week), so a rootfs takes
# about half a minute to make.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SUITE=bookworm
MIRROR="${SANDLOCK_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
[ $# = 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$0: needs root (debootstrap)" >&2; exit 1; }
command -v debootstrap >/dev/null || "$ROOT/scripts/system-packages.sh" ensure ci
if [ -d /var/cache ]; then CACHE=/var/cache/sandlock-ci; else CACHE="$HOME/.cache/sandlock-ci"; fi
mkdir -p "$CACHE"
TARBALL="$CACHE/debootstrap-$SUITE-minbase-python3.tgz"
if [ ! -s "$TARBALL" ] || [ -n "$(find "$TARBALL" -mtime +7)" ]; then
    download="$(mktemp -d /var/tmp/sandlock-debootstrap.XXXXXX)"
    trap 'rm -rf "$download"' EXIT
    debootstrap --variant=minbase --include=python3 --make-tarball="$TARBALL.new" \
        "$SUITE" "$download" "$MIRROR" >/dev/null
    mv "$TARBALL.new" "$TARBALL"
fi
debootstrap --variant=minbase --include=python3 --unpack-tarball="$TARBALL" \
    "$SUITE" "$1" "$MIRROR" >/dev/null
