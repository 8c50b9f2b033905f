#!/bin/sh
# The whole test suite from this checkout, on Debian or Ubuntu: the README's test command.
#
#   scripts/test.sh [PYTEST ARGUMENTS]    # as root, or as a user with sudo (apt-get alone)
#
# Installs what is missing of the system packages the tests need (scripts/system-packages.txt,
# apt-get through sudo when not root; it names them first), then the project and the test
# extras into the venv of scripts/install.sh ($SANDLOCK_VENV or ~/.venvs/sandlock), builds
# the native helper in the checkout (the tests import sandlock from it), and runs pytest.
# Tests of a tool that is still missing skip and name its package; SANDLOCK_EXPECT_TOOLS=1
# makes them fail instead.
set -eu
cd "$(dirname "$0")/.."
VENV="${SANDLOCK_VENV:-$HOME/.venvs/sandlock}"

scripts/system-packages.sh ensure install test
if [ ! -x "$VENV/bin/pip" ]; then
    echo "sandlock: making the venv $VENV" >&2
    /usr/bin/python3 -m venv "$VENV"
fi
echo "sandlock: installing sandlock and the test extras into $VENV (pip install '.[test]')" >&2
"$VENV/bin/pip" install -q --disable-pip-version-check '.[test]' setuptools
"$VENV/bin/python" setup.py -q build_helper
PATH="$VENV/bin:$PATH"
export PATH
python -m pytest -q -p no:cacheprovider tests "$@"
