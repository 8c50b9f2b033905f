#!/bin/sh
# What Claude Code does with sandlock's PreToolUse hook, by hand: it sends the hook the
# Bash call as JSON, takes the rewritten command from the answer, and runs that.
#
#   examples/claude_code_hook.sh
#
# In .claude/settings.json the hook is one entry (docs/integrations-agents-ci.md):
#   {"hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": [{"type": "command",
#     "command": "sandlock hook claude-code --policy shell --var workspace=\"$CLAUDE_PROJECT_DIR\""}]}]}}
set -eu
SANDLOCK="${SANDLOCK:-sandlock}"
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir "$root/project"
echo 'water the plants' > "$root/project/notes.md"
echo 'sk-not-for-tools' > "$root/api-key"
cd "$root/project"
for command in "cat notes.md" "cat $root/api-key"; do
    call=$(python3 -c 'import json, os, sys; print(json.dumps({"hook_event_name": "PreToolUse",
        "tool_name": "Bash", "tool_input": {"command": sys.argv[1]}, "cwd": os.getcwd(),
        "session_id": "example"}))' "$command")
    answer=$(printf '%s' "$call" | $SANDLOCK hook claude-code --policy shell --var "workspace=$PWD")
    rewritten=$(printf '%s' "$answer" | python3 -c 'import json, sys
print(json.load(sys.stdin)["hookSpecificOutput"]["updatedInput"]["command"])')
    echo "model's command: $command"
    echo "runs as:         $rewritten"
    bash -c "$rewritten" 2>&1 | sed 's/^/  /' || true
done
