#!/bin/sh
# Install sandlock and run CI steps confined: the one script behind the GitHub action
# (ci/github/action.yml) and the GitLab template (ci/gitlab/sandlock.gitlab-ci.yml).
#
#   ci/run-step.sh install [SOURCE]    pip-install sandlock into $SANDLOCK_VENV; SOURCE is
#                                      what pip installs (default: the sandlock tree this
#                                      script is in)
#   ci/run-step.sh run POLICY COMMAND  run COMMAND (`sandlock shell`: /bin/sh -c) in the sandbox of
#                                      POLICY (a file, or a shipped profile's name), the
#                                      working directory (the job's checkout) as ${workspace}
#
# Environment:
#   SANDLOCK_VENV      the venv (default: $RUNNER_TEMP, $TMPDIR or /tmp, + /sandlock-venv);
#                      keep it outside the checkout: a policy that may write the checkout
#                      must not reach the sandlock it runs on (sandlock refuses it anyway)
#   SANDLOCK_PIP_ARGS  more pip arguments (offline or pinned installs), split on spaces
#   SANDLOCK_VARS      more --var NAME=VALUE for the policy, one per line
#
# COMMAND is handed to the confined shell as one argument, never re-parsed here; its
# exit status is this script's (125: sandlock refused to start it, see its message).
set -eu

here="$(cd "$(dirname "$0")" && pwd)"
venv="${SANDLOCK_VENV:-${RUNNER_TEMP:-${TMPDIR:-/tmp}}/sandlock-venv}"

case "${1:-}" in
install)
    source="${2:-$here/..}"
    if [ ! -x "$venv/bin/pip" ]; then
        python3 -m venv "$venv"
    fi
    # shellcheck disable=SC2086 # SANDLOCK_PIP_ARGS is a list of words
    "$venv/bin/pip" install -q --disable-pip-version-check ${SANDLOCK_PIP_ARGS:-} "$source"
    echo "sandlock: installed in $venv" >&2
    ;;
run)
    if [ "$#" -ne 3 ]; then
        echo "usage: $0 run POLICY COMMAND" >&2
        exit 125
    fi
    policy="$2"
    command="$3"
    set -- --policy "$policy" --var "workspace=$PWD"
    if [ -n "${SANDLOCK_VARS:-}" ]; then
        newline='
'
        old_ifs="$IFS"
        IFS="$newline"
        for pair in $SANDLOCK_VARS; do
            [ -n "$pair" ] && set -- "$@" --var "$pair"
        done
        IFS="$old_ifs"
    fi
    echo "sandlock: this step runs confined by $policy" >&2
    exec "$venv/bin/sandlock" shell "$@" -c "$command"  # the one way a command string runs
    ;;
*)
    echo "usage: $0 install [SOURCE] | run POLICY COMMAND" >&2
    exit 125
    ;;
esac
