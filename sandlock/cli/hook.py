"""`sandlock hook claude-code` (Claude Code's PreToolUse hook) and `sandlock shell`
(a SHELL that runs each ``-c COMMAND`` confined): both choose a policy for a command
string by the user's rules (:mod:`sandlock.integrations.shell_rules`).

Kept apart from :mod:`sandlock.cli.main`, which only registers them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn, Optional

import click

from ..errors import ExitCode, SandlockError
from ..trace.emit import printable
from .launch import main_run, parse_vars, say, silence_stdout

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
    # Claude Code runs the command as the model wrote it, unconfined, after any hook
    # exit but 0 and 2, and after its hook timeout (60 s by default): every way this can
    # end, an internal error, an answer that cannot be written or one that takes too long
    # (a rule's regex and a command of the model's choosing) included, is 0 with the
    # answer written whole, or 2.
    import signal

    def too_long(*_: object) -> None:
        if _blocking:  # already on the way out with 2
            return
        raise TimeoutError(f"no answer within {HOOK_SECONDS:g} s (a rule's regular "
                           "expression that backtracks on this command?)")

    try:
        signal.signal(signal.SIGALRM, too_long)
        signal.setitimer(signal.ITIMER_REAL, HOOK_SECONDS)
        from ..integrations.claude_code import MAX_INPUT, answer
        from ..integrations.shell_rules import load_rules
        from ..policy.readfile import read_bounded

        data = read_bounded(0, MAX_INPUT)
        if data is None:
            raise SandlockError(f"the hook input is larger than {MAX_INPUT} bytes: refused")
        text = answer(data, load_rules(rules, policy, registry), parse_vars(variables), ask=ask)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        signal.setitimer(signal.ITIMER_REAL, 0)
    except (SandlockError, OSError) as exc:
        _block(printable(str(exc)))
    except BaseException as exc:  # noqa: BLE001 - any other end lets the command run unconfined
        _block(f"internal error, the command is blocked: {type(exc).__name__}: "
               f"{printable(str(exc))}")


#: Seconds the hook takes at most before it blocks the command (Claude Code's own hook
#: timeout, 60 s by default, would let the command run unconfined).
HOOK_SECONDS = 20.0
_blocking = False


def _block(why: str) -> NoReturn:
    """Exit 2, ``why`` on stderr, nothing more on stdout (an answer in part would be none)."""
    import signal

    from ..integrations.claude_code import BLOCK

    global _blocking
    _blocking = True
    signal.setitimer(signal.ITIMER_REAL, 0)
    say(why)
    # What stays buffered (stdout; stderr if it could not be written: /dev/full) goes
    # nowhere: the interpreter's last flush failing would make the exit status 120.
    silence_stdout()
    try:
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    raise click.exceptions.Exit(BLOCK)


SHELL_USAGE = ("sandlock shell [--policy P | --registry DIR] [--rules FILE] [--var NAME=VALUE]... "
               "-c COMMAND [NAME ARGS...]")


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": []}, add_help_option=False,
               short_help="A SHELL that runs each -c COMMAND confined.")
@click.pass_context
def shell(ctx: click.Context) -> None:
    """A SHELL that runs `-c COMMAND [NAME ARGS...]` confined, the policy chosen as the
    Claude Code hook chooses it. Nothing else: no interactive shell, no other option.

    Parsed here, not by click: nothing after ``-c`` is an option (a command ``--help``
    or ``--policy=x`` is the command), and COMMAND, NAME and ARGS go to the confined
    shell as they are.
    """
    from ..integrations.shell_rules import load_rules, run_arguments

    args = list(ctx.args)
    given: dict[str, str] = {}
    pairs: list[str] = []
    while args and args[0] != "-c":
        name, eq, value = args.pop(0).partition("=")
        if name in ("-h", "--help") and not eq:
            click.echo(f"Usage: {SHELL_USAGE}\n\n{shell.__doc__}")
            return
        if name not in ("--policy", "--registry", "--rules", "--var"):
            say(f"shell: only `{SHELL_USAGE}` is run (no interactive shell, no other shell "
                f"option; got {printable(name)!r})")
            raise click.exceptions.Exit(ExitCode.LAUNCHER)
        if not eq:
            if not args:
                say(f"shell: {name} needs a value")
                raise click.exceptions.Exit(ExitCode.LAUNCHER)
            value = args.pop(0)
        if name == "--var":
            pairs.append(value)
        else:
            given[name] = value
    if len(args) < 2:
        say(f"shell: only `{SHELL_USAGE}` is run (no interactive shell, no other shell option)")
        raise click.exceptions.Exit(ExitCode.LAUNCHER)
    try:
        chosen = load_rules(given.get("--rules"), given.get("--policy"), given.get("--registry"))
        run_args = run_arguments(chosen.choose(args[1]), parse_vars(pairs), args[1], args[2:])
        run_args = [*(arg for path in chosen.files for arg in ("--keep", path)), *run_args]
    except SandlockError as exc:
        say(printable(str(exc)))
        raise click.exceptions.Exit(ExitCode.LAUNCHER) from None
    sys.stdout.flush()
    raise click.exceptions.Exit(main_run(run_args))


def register(group: click.Group) -> None:
    """Add `hook` and `shell` to the click group of :mod:`sandlock.cli.main`."""
    group.add_command(hook)
    group.add_command(shell)



