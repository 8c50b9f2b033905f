#!/bin/sh
# Docker's default seccomp profile (profiles/seccomp/default.json of Debian's
# golang-github-docker-docker-dev) for tests/test_container_profile.py, without that
# package's ~900 MB of Go build dependencies: the .deb alone is downloaded and the one
# file extracted.
#
#   scripts/docker_seccomp_profile.sh [FILE]   # default /var/cache/sandlock-ci/docker-seccomp.json
#
# The tests find it through SANDLOCK_DOCKER_PROFILE=FILE (or at the package's own path
# when the package is installed).
set -eu
OUT="${1:-/var/cache/sandlock-ci/docker-seccomp.json}"
MEMBER=./usr/share/gocode/src/github.com/docker/docker/profiles/seccomp/default.json
[ -s "$OUT" ] && exit 0
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && apt-get download -q golang-github-docker-docker-dev >/dev/null 2>&1)
dpkg-deb --fsys-tarfile "$WORK"/golang-github-docker-docker-dev_*.deb | tar -x -C "$WORK" "$MEMBER"
mkdir -p "$(dirname "$OUT")"
install -m 0644 "$WORK/$MEMBER" "$OUT"
echo "docker seccomp profile: $OUT"
