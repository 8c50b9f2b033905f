#!/bin/sh
# Install sandlock from this checkout on Debian or Ubuntu, then run a first confined
# command: the README's install command. Run it again at will (after a `git pull`, say):
# it installs only what is missing and reinstalls the project.
#
#   scripts/install.sh    # as root, or as a user with sudo (for apt-get alone)
#
# 1. the system packages of scripts/system-packages.txt needed to install and run
#    (apt-get, through sudo when not root; it names them first),
# 2. a venv, $SANDLOCK_VENV or ~/.venvs/sandlock (Debian's Python is "externally
#    managed", PEP 668: nothing is installed into it),
# 3. the project and its native helper into the venv (pip install .),
# 4. `sandlock run` of cat in a throw-away workspace, under the read_file policy.
set -eu
cd "$(dirname "$0")/.."
VENV="${SANDLOCK_VENV:-$HOME/.venvs/sandlock}"

scripts/system-packages.sh ensure install
if [ ! -x "$VENV/bin/pip" ]; then
    echo "sandlock: making the venv $VENV" >&2
    /usr/bin/python3 -m venv "$VENV"
fi
echo "sandlock: installing sandlock and its native helper into $VENV (pip install .)" >&2
"$VENV/bin/pip" install -q --disable-pip-version-check .

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "hello from the workspace" > "$work/notes.md"
echo "sandlock: a first confined command, in $work:" >&2
echo "\$ sandlock run --policy read_file --var workspace=\$PWD -- cat notes.md" >&2
(cd "$work" && "$VENV/bin/sandlock" run --policy read_file --var workspace="$work" -- cat notes.md)
echo "sandlock: installed. Put it on PATH in this shell (and in each new one):" >&2
echo "    . $VENV/bin/activate" >&2
