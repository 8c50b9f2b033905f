"""The full command-line interface (click; what people read is printed by :mod:`.show`).

`sandlock run` normally goes through the lighter parser in :mod:`sandlock.cli.run`;
it is defined here too so that ``sandlock run --help`` documents it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click

from .. import __version__
from ..errors import ExitCode, SandlockError
from . import show
from .launch import SUMMARY as RUN_SUMMARY
from .launch import load, main_run, parse_vars
from .paths import PathArg

EPILOG = """\b
Examples:
  sandlock run --policy policies/read_file.toml --var workspace=$PWD -- cat notes.md
  sandlock explain --policy policies/shell.toml --var workspace=$PWD
  sandlock validate policies/*.toml
  sandlock check
"""


def _console(stderr: bool = False) -> show.Lines:
    return show.Lines(stderr)


def _fail(exc: SandlockError) -> click.exceptions.Exit:
    print(f"sandlock: {exc}", file=sys.stderr)
    return click.exceptions.Exit(int(exc.exit_code))


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Aligned columns on a terminal, tab-separated lines otherwise; every cell escaped."""
    show.table(title, columns, rows)


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sandlock")
def cli() -> None:
    """Run each tool call of an AI agent in its own sandbox (Landlock + seccomp).

    A TOML policy names what one tool may touch; everything else is denied.
    """


var_option = click.option("--var", "variables", multiple=True, metavar="NAME=VALUE",
                          help="Define ${NAME} for the policy (repeatable).")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                               "allow_interspersed_args": False},
             add_help_option=False, short_help=RUN_SUMMARY)
@click.pass_context
def run(ctx: click.Context) -> None:
    """Run COMMAND confined by a policy (`sandlock run --help` lists the options)."""
    sys.exit(main_run(ctx.args))  # the one parser of `run` (and its help): sandlock.cli.run


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check(as_json: bool) -> None:
    """What this kernel supports: Landlock ABI and rights, seccomp, user namespaces."""
    from ..compile.report import kernel_report

    try:
        report = kernel_report()
    except SandlockError as exc:  # a bad SANDLOCK_ABI override
        raise _fail(exc) from None
    if as_json:
        print(json.dumps(report, indent=2))
        return
    rows = [[item["feature"], "yes" if item["available"] else "no", item["detail"]]
            for item in report["features"]]
    _table(f"Kernel {report['kernel']} (Landlock ABI {report['landlock_abi']})",
           ["feature", "available", "detail"], rows)
    _table("Gaps a strict policy may accept by name (accept = [NAME], --accept NAME)",
           ["name", "gives up"], [[item["name"], item["gives_up"]] for item in report["gap_names"]])


@cli.command()
@click.option("--policy", type=PathArg(dir_okay=False), help="Policy file (TOML).")
@click.option("--tool", help="Tool name in the --policies registry.")
@click.option("--policies", type=PathArg(), help="Directory of policies, or one registry file.")
@var_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def explain(policy: str | None, tool: str | None, policies: str | None,
            variables: Sequence[str], as_json: bool) -> None:
    """The effective policy after extends and variables, and what this kernel enforces."""
    from ..compile.report import explain_policy

    try:
        loaded = load(policy, tool, policies, parse_vars(variables))
        report = explain_policy(loaded)
    except SandlockError as exc:
        raise _fail(exc) from None
    if as_json:
        print(json.dumps(report, indent=2))
        return
    out = _console()
    described = f"  ({report['description']})" if report["description"] else ""
    out.print(f"policy: {report['source']}{described}")
    out.print(f"layers: {' -> '.join(report['layers'])}")
    out.print(f"compat: {report['compat']}   kernel Landlock ABI: {report['abi']}")
    if report["accept"]:
        out.print(f"accept: {', '.join(report['accept'])}")
    _table("filesystem", ["access", "path", "from"],
           [[r["access"], r["path"], r["origin"]] for r in report["paths"]])
    net = report["network"]
    out.print(f"network: tcp connect {net['connect'] or 'none'}; tcp bind {net['bind'] or 'none'}; "
              f"udp {'yes' if net['udp'] else 'no'}; unix sockets {'yes' if net['unix'] else 'no'}")
    if net["allow"]:
        out.print(f"host allowlist (per-run proxy + connect gate): allow {net['allow']}; "
                  f"deny {net['deny'] or 'none'}; pinned hosts {net['hosts'] or 'none'}")
    for cred in report.get("credentials", ()):  # credential routes (issue 16)
        out.print(f"credential {cred['name']}: route to {cred['upstream']} (TLS verified with "
                  f"{cred['verify']}); secret from {cred['secret_from']}, attached as "
                  f"{cred['attached_as']}; methods {cred['methods']}; paths {cred['paths']}; "
                  f"deny {cred['deny'] or 'none'}; the tool gets {cred['tool_gets'] or 'nothing'}"
                  f"; grant: {cred['grant']}")
    out.print(f"scopes: signals {'on' if report['scope']['signals'] else 'off'}; abstract unix "
              f"{'on' if report['scope']['abstract_unix'] else 'off'}")
    out.print(f"environment: pass {report['env']['pass']}; set {report['env']['set']}")
    out.print(f"limits: {report['limits']}")
    out.print(f"seccomp: {report['seccomp']['rules']} rules; denied syscalls: "
              f"{', '.join(report['seccomp']['denied'])}; denied with some arguments (set-id "
              f"modes, namespaces, terminal injection, other processes, unexecutable memfds, "
              f"socket kinds not granted): {', '.join(report['seccomp']['conditional'])}")
    for item in report["protections"]:
        out.print(f"{item['protection']}: {item['enforced_by']}")
    for line in report["cautions"]:
        out.print(f"WARNING: {line}")
    for line in report["refused_grants"]:
        out.print(f"REFUSED: `sandlock run` will not start with this grant: {line}")
    if report["not_enforced"]:
        out.print("NOT enforced on this kernel:")
        for line in report["not_enforced"]:
            accepted = " [accepted]" if line in report["accepted"] else ""
            out.print(f"  - {line}{accepted}")
        if report["compat"] == "strict" and report["refused_in_strict"]:
            out.print("strict mode: `sandlock run` will refuse to start with this policy here.")
    elif not report["refused_grants"]:
        out.print("Everything this policy relies on is enforced on this kernel.")


@cli.command()
@click.argument("files", nargs=-1, required=True, type=PathArg())
@var_option
def validate(files: Sequence[str], variables: Sequence[str]) -> None:
    """Check policy files and tool registries (for CI): non-zero exit on any problem.

    Each argument is a policy file, or a registry as `run --policies` reads it: a
    directory of NAME.toml policies, or one file of [tools.NAME] tables. Every
    policy is checked and every schema error of each is reported. Variables a
    policy uses but --var does not define are given placeholder values, and paths
    are not required to exist on this machine, so that syntax, schema and values
    can be checked anywhere.
    """
    try:
        given = parse_vars(variables)
    except SandlockError as exc:
        raise _fail(exc) from None
    failed = 0
    for argument in files:
        for label, errors in _validate_argument(argument, given):
            for error in errors:
                print(f"sandlock: {error}", file=sys.stderr)
            if errors:
                failed += 1
            else:
                print(f"{label}: ok")
    if failed:
        raise click.exceptions.Exit(ExitCode.LAUNCHER)


def _validate_argument(argument: str, given: dict[str, str]) -> Iterator[tuple[str, list[Any]]]:
    """(label, errors) per policy in ``argument``: a file, a tools file, or a directory."""
    from pathlib import Path

    from ..errors import PolicyError

    path = Path(argument)
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError):
        is_dir = False  # the file reader names the problem
    if not is_dir:
        yield from _validate_file(path, given)
        return
    try:
        found = sorted(path.glob("*.toml"))
    except OSError as exc:
        yield argument, [PolicyError(f"cannot read the policies: {exc.strerror or exc}",
                                     source=argument)]
        return
    if not found:
        yield argument, [PolicyError("no tools found (expected NAME.toml files, or [tools.NAME] "
                                     "tables)", source=argument)]
    for file in found:
        yield from _validate_file(file, given)


def _validate_file(path: Any, given: dict[str, str]) -> Iterator[tuple[str, list[Any]]]:
    """A policy file, or a file of ``[tools.NAME]`` tables (one label per tool)."""
    from ..errors import PolicyError
    from ..policy.model import _parse_text, _read, load_policy, policy_from_dict, schema_errors

    source = str(path)
    try:
        text = _read(path, source)
        data = _parse_text(text, source)
    except SandlockError as exc:
        yield source, [exc]
        return
    if "tools" not in data:
        errors: list[Any] = schema_errors(data, source, text)
        if not errors:
            try:
                _checked(_with_placeholders(
                    lambda v: load_policy(path, v, check_paths=False, data=text.encode()),
                    source, given))
            except SandlockError as exc:
                errors.append(exc)
        yield source, errors
        return
    unknown = sorted(set(data) - {"tools"})
    if unknown or not isinstance(data["tools"], dict):
        yield source, [PolicyError("a tools file holds only [tools.NAME] tables"
                                   + (f" (unknown key {unknown[0]!r})" if unknown else ""),
                                   source=source)]
        if not isinstance(data["tools"], dict):
            return
    if not data["tools"]:
        yield source, [PolicyError("no tools found (expected [tools.NAME] tables)", source=source)]
    base = path.resolve().parent
    for name, table in data["tools"].items():
        label = f"{source} [tools.{name}]"
        if not isinstance(table, dict):
            yield label, [PolicyError("expected a table", source=source, key=f"tools.{name}")]
            continue
        problems: list[SandlockError] = list(schema_errors(table, label, text, ("tools", name)))
        if not problems:
            def load(variables: dict[str, str], table: dict[str, Any] = table,
                     label: str = label) -> Any:
                return policy_from_dict(table, variables, source=label, base_dir=base,
                                        check_paths=False)

            try:
                _checked(_with_placeholders(load, label, given))
            except SandlockError as exc:
                problems.append(exc)
        yield label, problems


def _checked(policy: Any) -> None:
    """The syscall names' check, then the policy's cautions as warnings on stderr."""
    from ..compile.seccomp import check_names
    from ..policy.model import cautions

    check_names(policy)
    for line in cautions(policy):
        print(f"sandlock: warning: {line}", file=sys.stderr)


def _with_placeholders(load: Callable[[dict[str, str]], Any], source: str,
                       given: dict[str, str], filled: dict[str, str] | None = None) -> Any:
    """``load(variables)``; undefined variables become a placeholder directory (the
    working directory), recorded in ``filled``. An error after a variable was filled
    says which and with what: the placeholder, not the policy, may be the cause."""
    import re

    from ..errors import PolicyError

    given = dict(given)
    filled = {} if filled is None else filled
    for _ in range(50):
        try:
            return load(given)
        except PolicyError as exc:
            match = re.search(r"undefined variable \$\{([A-Za-z_][A-Za-z0-9_]*)\}", str(exc))
            if not match:
                if not filled:
                    raise
                raise PolicyError(f"{exc.reason} ({placeholder_note(filled)})", source=exc.source,
                                  key=exc.key, line=exc.line, column=exc.column) from None
            given[match.group(1)] = filled[match.group(1)] = os.getcwd()
    raise PolicyError("too many undefined variables", source=source)


def _needs_variables(file: str, filled: dict[str, str]) -> str:
    """A profile's description and the variables it needs, when the working directory
    could not stand in for them (``policies`` run from ``/``); "" if it has none."""
    from pathlib import Path

    from ..policy.model import _parse_text, _read

    try:
        description = _parse_text(_read(Path(file), file), file).get("description")
    except SandlockError:
        return ""
    if not isinstance(description, str):
        return ""
    needs = ", ".join(f"--var {name}=DIR" for name in filled)
    return (f"{description} (needs {needs}: the working directory "
            f"{next(iter(filled.values()))!r} cannot stand in for it)")


def placeholder_note(filled: dict[str, str]) -> str:
    """What stood in for variables --var did not give."""
    return "; ".join(f"${{{name}}} was not given (--var {name}=DIR); it defaulted to the working "
                     f"directory {value!r}" for name, value in filled.items())


def _load_for_validation(load_policy: Any, file: str, given: dict[str, str],
                         filled: dict[str, str] | None = None) -> Any:
    """Load ``file``; undefined variables become a placeholder directory."""
    return _with_placeholders(lambda v: load_policy(file, v, check_paths=False), file, given,
                              filled)


@cli.command()
@click.argument("name", required=False)
def policies(name: str | None) -> None:
    """List the built-in profiles, or show one."""
    from ..policy.model import PROFILE_DIR, builtin_profiles, load_policy

    try:
        os.getcwd()  # each profile is loaded with ${cwd}: say once why none can be
    except OSError:
        raise _fail(SandlockError("the working directory no longer exists; change to an "
                                  "existing directory")) from None
    if name is None:
        rows = []
        for profile in builtin_profiles():
            filled: dict[str, str] = {}
            file = str(PROFILE_DIR / f"{profile}.toml")
            try:  # a tool policy's ${workspace} gets a placeholder, as in validate
                description = _load_for_validation(load_policy, file, {}, filled).description
            except SandlockError as exc:
                description = f"(not loadable here: {exc})"
                if filled:  # not broken: it needs a variable the working directory cannot be
                    description = _needs_variables(file, filled) or description
            rows.append([profile, description])
        _table("built-in profiles (use with extends = [\"NAME\"])", ["name", "description"], rows)
        return
    path = PROFILE_DIR / f"{name}.toml"
    if name not in builtin_profiles():  # a name, never a path
        print(f"sandlock: unknown built-in profile {name!r}", file=sys.stderr)
        raise click.exceptions.Exit(ExitCode.LAUNCHER)
    from ..policy.model import _read

    try:
        sys.stdout.write(_read(path, str(path)))  # bounded and never blocking, as every policy
    except SandlockError as exc:
        raise _fail(exc) from None


@cli.command()
@click.option("--policy", type=PathArg(dir_okay=False), required=True, help="Policy file (TOML).")
@var_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--executor", type=click.Choice(["launcher", "forkserver", "native"]),
              default="launcher", show_default=True,
              help="What starts the payload: `sandlock run`'s launcher, or the Python API's fork "
                   "server or sandlock-exec. Every executor must give the same rows.")
def probe(policy: str, variables: Sequence[str], as_json: bool, executor: str) -> None:
    """Try to escape the policy's sandbox; one row per attempt.

    Exit 0 when every attempt the policy does not grant was blocked, 1 when one
    got through (ESCAPE) or a probe could not run, 125 when the sandbox could
    not be set up.
    """
    from ..policy.profiles import policy_file
    from ..probe.harness import probe_file

    try:
        report = probe_file(policy_file(policy), parse_vars(variables), executor=executor)
    except SandlockError as exc:
        raise _fail(exc) from None
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        out = _console()
        out.print(f"policy: {report.policy}   Landlock ABI {report.abi}   uid {report.uid}")
        if report.runtime_grants:
            out.print("added so the probe's Python can start (never counted as granted by the "
                      f"policy): {', '.join(report.runtime_grants)}")
        for line in report.not_enforced:
            out.print(f"NOT enforced on this kernel: {line}")
        for line in report.later_runs:
            out.print(f"later runs: {line}")
        _table("escape attempts", ["probe", "verdict", "why"],
               [[r.id, r.verdict, r.reason or r.detail] for r in report.results])
        counts = ", ".join(f"{n} {k}" for k, n in sorted(report.counts().items()))
        out.print(f"{counts}: {'OK' if report.ok else 'FAILED'}")
        if report.stderr and not report.ok:
            out.print("probe stderr:")
            for line in report.stderr.splitlines():
                out.print(line)
    if not report.ok:
        raise click.exceptions.Exit(1)


from .trace import register as _register_recording  # noqa: E402 - after the group exists

_register_recording(cli)  # `trace` and `learn`
from .mcp import register as _register_mcp  # noqa: E402

_register_mcp(cli)  # `mcp`: the MCP gateway and the ready server


from .hook import register as _register_hooks  # noqa: E402 - after the group exists
from .log import log as _log_command  # noqa: E402

_register_hooks(cli)  # `hook claude-code` and `shell`
cli.add_command(_log_command)  # `log --verify`

from .undo import COMMANDS as _UNDO_COMMANDS  # noqa: E402 - after the group exists

for _command in _UNDO_COMMANDS:  # `changes`, `apply`, `discard`, `rollback`
    cli.add_command(_command)
