"""`sandlock hook claude-code` (Claude Code's PreToolUse hook) and `sandlock shell`
(a SHELL that runs each ``-c COMMAND`` confined): both choose a policy for a command
string by the user's rules (:mod:`sandlock.integrations.shell_rules`).

Kept apart from :mod:`sandlock.cli.main`, which only registers them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Optional

import click

from ..errors import ExitCode, SandlockError
from ..trace.emit import printable
from .launch import main_run, parse_vars, say

_RULES_HELP = "TOML rules choosing a policy by the command (see docs/integrations-agents-ci.md)."


def _options(fn: click.decorators.FC) -> click.decorators.FC:
    for option in reversed((
            click.option("--policy", help="Policy for commands no rule matches (a file, or a "
                                          "shipped profile's name)."),
            click.option("--registry", help="Directory of tool policies the rules' tool = NAME "
                                            "name."),
            click.option("--rules", help=_RULES_HELP),
            click.option("--var", "variables", multiple=True, metavar="NAME=VALUE",
                         help="Define ${NAME} for the policy (repeatable)."))):
        fn = option(fn)
    return fn


@click.group()
def hook() -> None:
    """Hooks of coding agents that confine each command they run."""


@hook.command("claude-code")
@_options
@click.option("--ask", is_flag=True, help="Let the user confirm each rewritten command "
                                           "(permissionDecision \"ask\", not \"allow\").")
def claude_code(policy: Optional[str], registry: Optional[str], rules: Optional[str],
                variables: Sequence[str], ask: bool) -> None:
    """Claude Code PreToolUse hook: rewrite each Bash command to run under sandlock.

    Reads the hook's JSON on stdin; prints the answer. Exit 2 (Claude Code blocks the
    command) whenever the command cannot be confined: invalid input, no rule and no
    default policy, a bad rules file.
    """
    from ..integrations.claude_code import BLOCK, MAX_INPUT, answer
    from ..integrations.shell_rules import load_rules
    from ..policy.readfile import read_bounded

    try:
        data = read_bounded(0, MAX_INPUT)
        if data is None:
            raise SandlockError(f"the hook input is larger than {MAX_INPUT} bytes: refused")
        text = answer(data, load_rules(rules, policy, registry), parse_vars(variables), ask=ask)
    except (SandlockError, OSError) as exc:
        say(printable(str(exc)))
        raise click.exceptions.Exit(BLOCK) from None
    sys.stdout.write(text + "\n")


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "allow_interspersed_args": False})
@_options
@click.pass_context
def shell(ctx: click.Context, policy: Optional[str], registry: Optional[str],
          rules: Optional[str], variables: Sequence[str]) -> None:
    """A SHELL that runs `-c COMMAND [NAME ARGS...]` confined, the policy chosen as the
    Claude Code hook chooses it. Nothing else: no interactive shell, no other option.
    """
    from ..integrations.shell_rules import load_rules, run_arguments

    args = list(ctx.args)
    if len(args) < 2 or args[0] != "-c":
        say("shell: only `sandlock shell [OPTIONS] -c COMMAND [NAME ARGS...]` is run "
            "(no interactive shell, no other shell option)")
        raise click.exceptions.Exit(ExitCode.LAUNCHER)
    try:
        chosen = load_rules(rules, policy, registry)
        run_args = run_arguments(chosen.choose(args[1]), parse_vars(variables), args[1], args[2:])
    except SandlockError as exc:
        say(printable(str(exc)))
        raise click.exceptions.Exit(ExitCode.LAUNCHER) from None
    sys.stdout.flush()
    raise click.exceptions.Exit(main_run(run_args))


def register(group: click.Group) -> None:
    """Add `hook` and `shell` to the click group of :mod:`sandlock.cli.main`."""
    group.add_command(hook)
    group.add_command(shell)



