#!/usr/bin/env bash
# CI (.ci/run, as root): the README's install command and its first example on a fresh
# Debian 12 (debootstrap minbase plus python3, what a new machine starts from), as root and
# as a user with sudo, each in a rootfs of its own; as the user, the README's test command
# too. All must succeed.
# The README must contain the commands run here, verbatim.
#
#   scripts/fresh_machine_test.sh [root|user]...    # default: root user
#
# Needs root, debootstrap and the Debian mirror: each rootfs comes from
# scripts/debian_rootfs.sh (about half a minute from its cache). Inside, the tests run with
# SANDLOCK_EXPECT_TOOLS=1: a test tool that scripts/system-packages.txt does not list
# fails instead of skipping.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
INSTALL='scripts/install.sh && . ~/.venvs/sandlock/bin/activate'
FIRST='sandlock run --policy read_file --var workspace=$PWD -- cat notes.md'
TEST='scripts/test.sh'
for line in "$INSTALL" "$FIRST" "$TEST"; do
    grep -qxF "$line" "$ROOT/README.md" || { echo "README.md has no line: $line" >&2; exit 1; }
done

[ "$(id -u)" = 0 ] || { echo "$0: needs root (debootstrap, chroot, mount)" >&2; exit 1; }
WORK="$(mktemp -d /var/tmp/sandlock-fresh.XXXXXX)"
ROOTS=()
TIMES=()

mounted_under() { awk -v dir="$1" '$5 == dir || index($5, dir "/") == 1 { print $5 }' /proc/self/mountinfo; }

cleanup() {
    local dir pid
    for dir in "${ROOTS[@]}"; do
        for pid in $(ls /proc | grep -E '^[0-9]+$'); do  # processes left in this rootfs
            [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$dir" ] && kill -9 "$pid" 2>/dev/null
        done
        for mount in proc sys dev; do
            umount -R "$dir/$mount" 2>/dev/null || umount -lR "$dir/$mount" 2>/dev/null || true
        done
    done
    if [ -n "$(mounted_under "$WORK")" ]; then  # never delete through a mount of /dev or /sys
        echo "fresh machine: still mounted, $WORK left in place:" $(mounted_under "$WORK") >&2
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

timed() {  # timed LABEL COMMAND...: run it, note how long it took
    local start=$SECONDS
    "${@:2}"
    TIMES+=("$1 $((SECONDS - start))s")
    echo "fresh machine: $1 took $((SECONDS - start))s"
}

fresh_root() {  # fresh_root DIR: Debian minbase + python3, mounts, resolver, this tree
    local dir="$1"
    "$ROOT/scripts/debian_rootfs.sh" "$dir"
    ROOTS+=("$dir")
    mount -t proc proc "$dir/proc"
    mount --rbind /sys "$dir/sys" && mount --make-rslave "$dir/sys"
    mount --rbind /dev "$dir/dev" && mount --make-rslave "$dir/dev"
    cp /etc/resolv.conf "$dir/etc/resolv.conf"
    if [ ! -e "$dir/etc/hosts" ]; then  # as the Debian installer writes it (sudo asks for the name)
        printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
            "$(hostname)" > "$dir/etc/hosts"
    fi
    # This network's trust: where the host's pip is told to trust a CA bundle (a proxy's),
    # a new machine here would be too. Beside the system store, which apt may rewrite.
    if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
        cp "$PIP_CERT" "$dir/etc/host-network-ca.crt"
    fi
}

copy_tree() {  # copy_tree DEST: the files of this checkout (as a clone has them)
    mkdir -p "$1"
    if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
        (cd "$ROOT" && git ls-files -z | tar --null -T - -cf -) | tar -C "$1" -xf -
    else
        tar -C "$ROOT" --exclude=./build --exclude=./dist --exclude='*.egg-info' \
            --exclude=__pycache__ --exclude=sandlock-exec -cf - . | tar -C "$1" -xf -
    fi
}

# What a newcomer types: the install command, the README's first example, the test command
# (each line stops the run if it fails: sh -e does not stop inside an && list).
INSTALLED="cd ~/sandlock && { $INSTALL; } || exit 1
cd \"\$(mktemp -d)\" && echo 'hello from the workspace' > notes.md && { $FIRST; } || exit 1"
NEWCOMER="$INSTALLED
cd ~/sandlock && $TEST"
ENV=(HOME PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
     SANDLOCK_EXPECT_TOOLS=1 SANDLOCK_EXPECT_NATIVE=1 "SANDLOCK_EXPECT_ABI=${SANDLOCK_EXPECT_ABI:-}"
     PYTEST_ADDOPTS=-rs)  # the log says why each skipped test skipped
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    ENV+=(PIP_CERT=/etc/host-network-ca.crt)
fi

as_root() {
    local dir="$WORK/root"
    timed "root: debootstrap" fresh_root "$dir"
    copy_tree "$dir/root/sandlock"
    # The install and the first example only: the suite runs on the fresh machine as the
    # user (the product's setting) and as root on CI's own host; a third run would cost
    # CI ten minutes of its ninety.
    echo "== fresh machine, as root: $INSTALL; the first example"
    timed "root: install, first example" chroot "$dir" /usr/bin/env -i "${ENV[@]/#HOME/HOME=/root}" \
        /bin/sh -ec "$INSTALLED"
}

as_user() {
    local dir="$WORK/user"
    timed "user: debootstrap" fresh_root "$dir"
    # A user's machine: an account that may use sudo (install.sh runs apt-get through it).
    chroot "$dir" /bin/sh -ec 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq sudo >/dev/null && useradd --create-home --shell /bin/sh newcomer \
        && echo "newcomer ALL=(ALL) NOPASSWD:ALL" > /etc/sudoers.d/newcomer'
    copy_tree "$dir/home/newcomer/sandlock"
    chroot "$dir" chown -R newcomer:newcomer /home/newcomer/sandlock
    echo "== fresh machine, as a user with sudo: $INSTALL; the first example; $TEST"
    timed "user: install, first example, tests" chroot "$dir" runuser -u newcomer -- \
        /usr/bin/env -i "${ENV[@]/#HOME/HOME=/home/newcomer}" /bin/sh -ec "$NEWCOMER"
}

main() {
    local who one
    for who in "${@:-root user}"; do
        for one in $who; do
            case "$one" in
                root) as_root ;;
                user) as_user ;;
                *) echo "usage: $0 [root|user]..." >&2; exit 2 ;;
            esac
        done
    done
    echo "fresh machine: passed (${TIMES[*]/%/;})"
}

main "$@"; exit  # read whole before it runs: an edit of this file meanwhile changes nothing
