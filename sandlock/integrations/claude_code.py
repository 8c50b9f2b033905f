"""Claude Code's PreToolUse hook: each Bash command rewritten to run under sandlock.

Claude Code runs the hook before a tool call with a JSON object on standard input
(``hook_event_name`` "PreToolUse", ``tool_name``, ``tool_input`` — for Bash its
``command`` —, ``cwd``, ``session_id``; https://docs.claude.com/en/docs/claude-code/hooks).
The hook answers on standard output with::

    {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "allow",
                            "permissionDecisionReason": "...",
                            "updatedInput": {..., "command": "<rewritten>"}}}

where ``<rewritten>`` is ``sandlock run --policy P -- /bin/sh -c -- '<original>'``
(:func:`sandlock.integrations.shell_rules.rewritten`). Every other answer is a refusal,
given as exit status 2 with the reason on standard error: Claude Code blocks the call
on status 2 whatever else the hook printed, so input this hook cannot read is never
let through unconfined (a malformed answer would be, where exit status 0 means "no
decision").

Input is bounded (:data:`MAX_INPUT`) and checked field by field; anything unexpected
is a refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .shell_rules import Refused, Rules, checked_command, rewritten

#: The most hook input read, in bytes (a Bash call is a few kilobytes).
MAX_INPUT = 1 << 20
EVENT = "PreToolUse"
TOOL = "Bash"
#: Exit status that makes Claude Code block the tool call (stderr goes to the model).
BLOCK = 2


@dataclass(frozen=True)
class Call:
    """The part of the hook's input this hook acts on."""

    tool_input: dict[str, Any]
    command: str
    cwd: Optional[str]
    session_id: Optional[str]


def _not_json(name: str) -> Any:
    """NaN and Infinity, which Python's reader takes and JSON has not: written back into
    the answer, they would make it no JSON (no decision: the command would run)."""
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """A JSON number as a float; 1e400 (infinite as a float) is refused, as NaN is."""
    value = float(text)
    if value - value != 0:  # inf or nan
        raise ValueError(f"{text[:20]} is out of range")
    return value


def parse(data: bytes) -> Call:
    """The Bash call in the hook's input; Refused for anything else."""
    if len(data) > MAX_INPUT:
        raise Refused(f"the hook input is larger than {MAX_INPUT} bytes")
    try:
        found = json.loads(data.decode("utf-8"), parse_constant=_not_json,
                           parse_float=_finite)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused(f"the hook input is not JSON ({type(exc).__name__})") from None
    if not isinstance(found, dict):
        raise Refused("the hook input is not a JSON object")
    if found.get("hook_event_name") != EVENT:
        raise Refused(f"this hook answers {EVENT} events only (configure it under "
                      f"\"{EVENT}\" in settings.json)")
    if found.get("tool_name") != TOOL:
        raise Refused(f"this hook confines {TOOL} commands only (give it the matcher "
                      f"\"{TOOL}\" in settings.json)")
    tool_input = found.get("tool_input")
    if not isinstance(tool_input, dict):
        raise Refused("tool_input is not a JSON object")
    command = checked_command(tool_input.get("command"))
    cwd = found.get("cwd")
    session = found.get("session_id")
    return Call(tool_input, command, cwd if isinstance(cwd, str) else None,
                session if isinstance(session, str) else None)


#: What Claude Code reads from a project that decides what it runs outside any sandbox:
#: its settings (hooks, this one among them; permissions) and its project MCP servers.
#: A policy that writes the project may write them: each rewritten command keeps them
#: (``sandlock run --keep``: put back, and the command fails, if it changed them).
KEPT = (".claude", ".mcp.json")


def kept_paths(cwd: Optional[str]) -> list[str]:
    """The :data:`KEPT` names in the project: ``CLAUDE_PROJECT_DIR``, which Claude Code
    sets for hooks and reads its settings from; the call's working directory only when
    that is not set (a tool's ``cd`` moves the working directory, through a link it made
    too: kept paths there could be anywhere)."""
    import os

    place = os.environ.get("CLAUDE_PROJECT_DIR") or cwd or ""
    if not os.path.isabs(place):
        raise Refused("no project directory to keep .claude in (CLAUDE_PROJECT_DIR is not set "
                      "and the input gives no absolute cwd): the command could rewrite the "
                      "settings that confine it")
    return [os.path.join(os.path.normpath(place), name) for name in KEPT]


def answer(data: bytes, rules: Rules, variables: Mapping[str, str], *, ask: bool = False,
           prefix: Optional[Sequence[str]] = None) -> str:
    """The hook's JSON answer to ``data``: allow the call with its command rewritten.
    Raises Refused when it must be blocked. ``ask``: let the user confirm the rewritten
    command (``"ask"``) instead of approving it (``"allow"``)."""
    call = parse(data)
    choice = rules.choose(call.command)
    updated = dict(call.tool_input)
    updated["command"] = rewritten(choice, variables, call.command, prefix,
                                   keep=list(dict.fromkeys([*kept_paths(call.cwd), *rules.files])))
    decision = {"hookSpecificOutput": {
        "hookEventName": EVENT,
        "permissionDecision": "ask" if ask else "allow",
        "permissionDecisionReason": f"sandlock: confined by {choice.name()}",
        "updatedInput": updated,
    }}
    return json.dumps(decision, allow_nan=False)  # strict JSON, or ValueError: blocked
