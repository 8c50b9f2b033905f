#!/bin/sh
# The Debian/Ubuntu packages of scripts/system-packages.txt that a use needs.
#
#   scripts/system-packages.sh list USE...     # print them, one a line (USE: install, test, ci)
#   scripts/system-packages.sh missing USE...  # only those dpkg does not have installed
#   scripts/system-packages.sh ensure USE...   # install the missing ones with apt-get (with
#                                              # sudo when not root), naming them first
set -eu
LIST="$(dirname "$0")/system-packages.txt"

list() {
    for use in "$@"; do
        awk -v use="$use" '!/^#/ && NF { n = split($2, uses, ","); for (i = 1; i <= n; i++)
                                         if (uses[i] == use) print $1 }' "$LIST"
    done | awk '!seen[$0]++'
}

missing() {
    for package in $(list "$@"); do
        dpkg-query -W -f='${Status}\n' "$package" 2>/dev/null | grep -q '^install ok installed$' \
            || echo "$package"
    done
}

ensure() {
    if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        echo "sandlock: this is not Debian or Ubuntu (no apt-get): install the equivalents of:" \
             $(list "$@") >&2
        return 0
    fi
    need="$(missing "$@" | tr '\n' ' ')"
    [ -n "$need" ] || return 0
    if [ "$(id -u)" = 0 ]; then
        sudo=""
    elif command -v sudo >/dev/null 2>&1; then
        sudo="sudo"
    else
        echo "sandlock: these packages are missing and there is no sudo: as root, run" >&2
        echo "sandlock:     apt-get install $need" >&2
        return 1
    fi
    echo "sandlock: installing the system packages it needs with apt-get${sudo:+ (sudo)}: $need" >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    # shellcheck disable=SC2086  # one word per package
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need \
        >/dev/null
    left="$(missing "$@" | tr '\n' ' ')"
    if [ -n "$left" ]; then
        echo "sandlock: apt-get did not install: $left" >&2
        return 1
    fi
}

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
    list|missing|ensure) "$command" "$@" ;;
    *) echo "usage: $0 list|missing|ensure USE... (USE: install, test, ci)" >&2; exit 2 ;;
esac
