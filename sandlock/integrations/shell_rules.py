"""Which policy confines a shell command, and the one command line that runs it so.

Used by Claude Code's hook (:mod:`sandlock.integrations.claude_code`) and by
`sandlock shell`: both take a command string a model wrote and must run exactly it,
confined, under a policy chosen by the user's rules.

The rules (``--rules FILE``, TOML)::

    [[rule]]
    match = '^git( |$)'     # a Python regular expression, searched in the command
    policy = "git"          # a policy file (relative to this file) or a shipped profile
    [[rule]]
    match = '^(npm|npx) '
    tool = "npm"            # with --registry DIR: a tool of that registry
    [default]
    policy = "shell"        # no rule matched (else: the command is refused)

The first rule whose ``match`` is found in the command wins. A pattern chooses among
policies the user wrote; it is not a boundary: ``git status; curl ...`` matches
``^git`` and runs, all of it, under the git policy. So every policy a rule names must
be one the user accepts for any command.

The command never passes through a string this module builds by hand: the rewritten
line is ``shlex.join`` of an argument list whose last element is the command itself,
so the shell that reads it hands ``/bin/sh -c`` exactly the original text (quotes,
newlines, ``$(...)``, backticks included). Text no shell argument can hold (a NUL) or
that ``execve`` would refuse (longer than :data:`MAX_COMMAND`) is refused here.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..errors import PolicyError, SandlockError

#: The longest command accepted, in characters: below the kernel's limit on one argument
#: (MAX_ARG_STRLEN, 32 pages: 131072 bytes, execve(2)) with room for UTF-8.
MAX_COMMAND = 32768
#: The shell the command runs in, inside the sandbox.
SHELL = "/bin/sh"


class Refused(SandlockError):
    """The command is not run: no rule chose a policy, or the input cannot be trusted."""


@dataclass(frozen=True)
class Choice:
    """``sandlock run``'s options that name the policy: ``--policy FILE`` or
    ``--tool NAME --policies DIR``."""

    policy: Optional[str] = None
    tool: Optional[str] = None
    registry: Optional[str] = None

    def options(self) -> list[str]:
        if self.tool is not None:
            assert self.registry is not None
            return ["--tool", self.tool, "--policies", self.registry]
        assert self.policy is not None
        return ["--policy", self.policy]

    def name(self) -> str:
        return f"tool {self.tool}" if self.tool is not None else f"policy {self.policy}"


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    choice: Choice


@dataclass(frozen=True)
class Rules:
    """The user's rules, then the default (None: refuse a command no rule matched)."""

    rules: tuple[Rule, ...]
    default: Optional[Choice]
    #: The files that choose the next command's policy: the rules file, the policy files
    #: it and ``--policy`` name, the registry. A command confined by a policy that writes
    #: one of them would choose the policy of the commands after it: each rewritten
    #: command keeps them (``sandlock run --keep``).
    files: tuple[str, ...] = ()

    def choose(self, command: str) -> Choice:
        for rule in self.rules:
            if rule.pattern.search(command):
                return rule.choice
        if self.default is None:
            raise Refused("no rule of the hook's rules matches this command and there is no "
                          "default policy: refused")
        return self.default


def _policy_argument(value: str, base: str) -> str:
    """A policy named by a rule: a shipped profile's bare name as is, anything else (a
    bare name that is no shipped profile too) a path made absolute from ``base`` (the
    command runs in another directory, where a bare name would be looked up)."""
    from ..policy.profiles import is_name, path

    if is_name(value) and os.path.isfile(path(value)):
        return value
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def _choice(table: object, where: str, source: str, registry: Optional[str],
            base: str) -> Choice:
    if not isinstance(table, dict):
        raise PolicyError("expected a table", source=source, key=where)
    keys = set(table) - {"match"}
    if keys not in ({"policy"}, {"tool"}):
        raise PolicyError("give exactly one of policy = FILE or tool = NAME (and match in a "
                          "rule)", source=source, key=where)
    value = table.get("policy", table.get("tool"))
    if not isinstance(value, str) or not value or "\0" in value:
        raise PolicyError("expected a non-empty string", source=source, key=where)
    if "tool" in table:
        if registry is None:
            raise PolicyError("tool = NAME needs --registry DIR", source=source, key=where)
        return Choice(tool=value, registry=registry)
    return Choice(policy=_policy_argument(value, base))


def load_rules(rules_file: Optional[str], policy: Optional[str],
               registry: Optional[str]) -> Rules:
    """The rules of ``--rules FILE`` (if any), with ``--policy P`` as the default."""
    registry = None if registry is None else os.path.abspath(registry)
    default = None if policy is None else Choice(policy=_policy_argument(policy, os.getcwd()))
    if rules_file is None:
        if default is None:
            raise SandlockError("give --policy P, or --rules FILE (with --registry DIR for "
                                "tools)")
        return Rules((), default, _files(None, [default], registry))
    from ..policy.model import _parse_text
    from ..policy.readfile import read_policy_bytes

    try:
        text = read_policy_bytes(rules_file).decode("utf-8")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError
        raise PolicyError(f"cannot read the rules: {getattr(exc, 'strerror', None) or exc}",
                          source=rules_file) from None
    data = _parse_text(text, rules_file)  # PolicyError as for a policy (nesting, syntax)
    base = os.path.dirname(os.path.abspath(rules_file))
    unknown = sorted(set(data) - {"rule", "default"})
    if unknown:
        raise PolicyError("unknown key (expected [[rule]] and [default])", source=rules_file,
                          key=unknown[0])
    found = data.get("rule", [])
    if not isinstance(found, list):
        raise PolicyError("expected [[rule]] tables", source=rules_file, key="rule")
    rules = []
    for index, table in enumerate(found):
        where = f"rule[{index}]"
        choice = _choice(table, where, rules_file, registry, base)
        match = table.get("match")
        if not isinstance(match, str):
            raise PolicyError("expected match = 'REGEX'", source=rules_file, key=f"{where}.match")
        try:
            pattern = re.compile(match)
        except (re.error, OverflowError, RecursionError) as exc:  # a{4294967296}; (((...)))
            raise PolicyError(f"not a regular expression: {exc}", source=rules_file,
                              key=f"{where}.match") from None
        rules.append(Rule(pattern, choice))
    if "default" in data:
        if default is not None:
            raise SandlockError(f"{rules_file}: [default] and --policy both name the default "
                                "policy: keep one")
        default = _choice(data["default"], "default", rules_file, registry, base)
    return Rules(tuple(rules), default,
                 _files(rules_file, [rule.choice for rule in rules] + [default], registry))


def _files(rules_file: Optional[str], choices: Sequence[Optional[Choice]],
           registry: Optional[str]) -> tuple[str, ...]:
    """:attr:`Rules.files`: absolute, each once: the rules file, each policy file and every
    file it extends, the registry (and what its policies extend). A shipped profile is no
    file of the user's. A file reached through a symbolic link is refused: a command could
    point the link elsewhere, and the next command's policy would be read from there."""
    from ..policy.profiles import is_name

    named = [os.path.abspath(rules_file)] if rules_file is not None else []
    for choice in choices:
        if choice is not None and choice.policy is not None and not is_name(choice.policy):
            named += _layers(choice.policy)
    if registry is not None and any(choice is not None and choice.tool is not None
                                    for choice in choices):
        named.append(registry)
        if os.path.isdir(registry):
            for entry in sorted(os.listdir(registry)):
                if entry.endswith(".toml"):
                    named += _layers(os.path.join(registry, entry))[1:]
        else:
            named += _layers(registry)[1:]
    for path in named:
        if os.path.realpath(path) != os.path.normpath(path):
            raise PolicyError(f"reached through a symbolic link (to {os.path.realpath(path)!r}), "
                              "which a confined command could point elsewhere: name the "
                              "file by its real path", source=path)
    return tuple(dict.fromkeys(os.path.normpath(path) for path in named))


#: Files followed through ``extends`` from one policy (as the loader bounds them).
MAX_LAYER_FILES = 64


def _layers(policy_file: str) -> list[str]:
    """``policy_file`` and each file it extends, as the loader finds them (a path relative
    to the file that names it; a bare name is a shipped profile). A file that cannot be
    read or parsed ends the walk there: the run reports it."""
    from ..policy.model import _parse_text
    from ..policy.readfile import read_policy_bytes

    found: list[str] = []
    todo = [os.path.normpath(policy_file)]
    while todo and len(found) < MAX_LAYER_FILES:
        path = todo.pop(0)
        if path in found:
            continue
        found.append(path)
        try:
            extends = _parse_text(read_policy_bytes(path).decode("utf-8"), path).get("extends", [])
        except (OSError, ValueError, AttributeError, SandlockError):  # PolicyError
            continue
        for name in extends if isinstance(extends, list) else []:
            if isinstance(name, str) and ("/" in name or name.endswith(".toml")):
                todo.append(os.path.normpath(os.path.join(os.path.dirname(path), name)))
    return found


def checked_command(command: object) -> str:
    """The command if a shell argument can hold it exactly; Refused otherwise."""
    if not isinstance(command, str):
        raise Refused(f"the command is not a string ({type(command).__name__})")
    if not command.strip():
        raise Refused("the command is empty")
    if "\0" in command:
        raise Refused("the command holds a NUL character, which no shell argument can hold")
    if len(command) > MAX_COMMAND:
        raise Refused(f"the command is longer than {MAX_COMMAND} characters")
    try:
        command.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused("the command is not valid Unicode (a lone surrogate)") from None
    return command


def run_arguments(choice: Choice, variables: Mapping[str, str], command: str,
                  shell_args: Sequence[str] = ()) -> list[str]:
    """`sandlock run`'s arguments (after ``run``) that run ``command`` confined by
    ``choice``: the policy options, ``--var``s, then ``-- /bin/sh -c -- COMMAND`` (the
    second ``--``: a command that begins with ``-`` is the command, not shell options)."""
    out = choice.options()
    for name, value in variables.items():
        out += ["--var", f"{name}={value}"]
    return [*out, "--", SHELL, "-c", "--", checked_command(command), *shell_args]


def sandlock_argv() -> list[str]:
    """How the rewritten command starts sandlock: this same sandlock, never by a name
    relative to the working directory (the project, which tools may write: a
    ``./sandlock`` there would run unconfined). The single-file binary by the real path
    its stub sets; the console script by its absolute path when that is what runs;
    otherwise this interpreter with ``-P`` (the working directory is not put on the
    import path) and ``-m sandlock``. SandlockError when the binary cannot tell."""
    if getattr(sys, "frozen", False):
        from ..compile.grants import ENV_STUB

        stub = os.environ.get(ENV_STUB, "")
        if os.path.isabs(stub) and os.access(stub, os.X_OK):
            return [stub]
        raise SandlockError(f"this sandlock program was not started by its single-file "
                            f"binary ({ENV_STUB} names none): the rewritten command "
                            "would not know which sandlock to run")
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.isabs(script) and os.path.basename(script) == "sandlock" \
            and os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-P", "-m", "sandlock"]


def rewritten(choice: Choice, variables: Mapping[str, str], command: str,
              prefix: Optional[Sequence[str]] = None, keep: Sequence[str] = ()) -> str:
    """The one shell line that runs ``command`` confined, each path of ``keep`` kept
    (``--keep``): ``shlex.join``, nothing joined by hand."""
    head = list(sandlock_argv() if prefix is None else prefix)
    kept = [arg for path in keep for arg in ("--keep", path)]
    return shlex.join([*head, "run", *kept, *run_arguments(choice, variables, command)])
