"""`sandlock trace` and `sandlock learn`: the commands that record a run.

Kept apart from :mod:`sandlock.cli.main` (which only registers them) and far from the
`sandlock run` fast path: nothing here is imported by a plain run.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import click

from ..errors import ExitCode, SandlockError
from ..trace.emit import command as shell_command
from ..trace.emit import printable
from .launch import load_full, log_ready, log_run, parse_vars, prepared
from .launch import say as _say_raw
from .paths import PathArg

if TYPE_CHECKING:
    from ..trace.learn import Draft

_CONTEXT = {"ignore_unknown_options": True, "allow_interspersed_args": False}


#: Times learn lists the machine's readable paths and compiles them, when an entry listed
#: is gone by the time its rule is made (a busy /tmp: CI's other lanes ran learn at once).
LEARN_ATTEMPTS = 10


def say(message: str) -> None:
    """One line on stderr, escaped: trace and learn messages name the tool's files."""
    _say_raw(printable(message))


def _failed(exc: SandlockError) -> None:
    """sandlock's own error, which may span lines; anything else in it escaped."""
    _say_raw(printable(str(exc), lines=True))


def _emit(report: Optional[str], text: str, out: Optional[_Output] = None) -> None:
    """The report on stderr, or in a file (``out``, opened before the run; ``-``: stdout)."""
    if report is None:
        sys.stderr.write(text)
        sys.stderr.flush()
    elif report == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            assert out is not None
            out.write(text)
        except OSError as exc:
            say(f"cannot write the report to {report!r}: {exc.strerror or exc}")
            raise click.exceptions.Exit(ExitCode.LAUNCHER) from None


class _Output:
    """A file named on the command line for a report or a draft, which is written after a
    run the recorded command controlled (it may write the working directory). Its directory
    is opened before the run and the file is reached from it: a link the command puts in
    place of a directory is never followed. The file is replaced by a rename, never written
    through: a symbolic link, a FIFO, a device or a file with another name (hard link)
    found at its place is refused, not written to."""

    def __init__(self, path: str) -> None:
        self.path = path
        where, self.name = os.path.split(path)
        if not self.name or self.name in (".", ".."):
            raise OSError(errno.EISDIR, "names a directory, not a file", path)
        self.directory = os.open(where or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def write(self, text: str) -> None:
        import stat

        try:
            try:
                found = os.stat(self.name, dir_fd=self.directory, follow_symlinks=False)
            except FileNotFoundError:
                found = None
            if found is not None and not (stat.S_ISREG(found.st_mode) and found.st_nlink == 1):
                raise OSError(0, "it is not a regular file with one name (the recorded command "
                              "may have put a link there): not written; remove it or name "
                              "another file", self.path)
            temporary = f".sandlock-output-{os.urandom(6).hex()}"
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644, dir_fd=self.directory)
            try:
                data = text.encode("utf-8")
                while data:
                    data = data[os.write(fd, data):]
                os.close(fd)
                fd = -1
                os.rename(temporary, self.name, src_dir_fd=self.directory,
                          dst_dir_fd=self.directory)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                os.unlink(temporary, dir_fd=self.directory)
                raise
        finally:
            self.close()

    def close(self) -> None:
        if self.directory >= 0:
            os.close(self.directory)
            self.directory = -1


def _output(path: Optional[str], what: str) -> Optional[_Output]:
    """``path``'s directory, opened before the run (exit 125 if it cannot be)."""
    if path is None or path == "-":
        return None
    try:
        return _Output(path)
    except OSError as exc:
        say(f"cannot write {what} to {path!r}: {exc.strerror or exc}")
        raise click.exceptions.Exit(ExitCode.LAUNCHER) from None


def _check_support() -> None:
    from ..trace.record import supported

    why = supported()
    if why:
        raise SandlockError(why)


@click.command(context_settings=_CONTEXT,
               epilog="\b\nExit codes: the command's own, as `sandlock run`; 125 sandlock failed.")
@click.option("--policy", type=PathArg(dir_okay=False), help="Policy file (TOML).")
@click.option("--tool", help="Tool name in the --policies registry.")
@click.option("--policies", type=PathArg(), help="Directory of policies, or one registry file.")
@click.option("--var", "variables", multiple=True, metavar="NAME=VALUE",
              help="Define ${NAME} for the policy (repeatable).")
@click.option("--timeout", help="Wall-clock limit, e.g. 30s (overrides [limits] timeout).")
@click.option("--best-effort", is_flag=True, help="Run even if the kernel cannot enforce everything.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@click.option("--report", "report", metavar="FILE",
              help="Write the report to FILE (- for stdout) instead of stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def trace(policy: Optional[str], tool: Optional[str], policies: Optional[str],
          variables: Sequence[str], timeout: Optional[str], best_effort: bool, as_json: bool,
          report: Optional[str], command: Sequence[str]) -> None:
    """Run COMMAND confined exactly as `run` would, and list what the policy refused.

    Each refused file access (read, write, exec, create, remove, move, truncate),
    exec interpreter (ELF loader, #! line) and TCP connect/bind port is printed
    with the smallest policy line that grants it. Recording never decides: Landlock
    and seccomp refuse exactly what they refuse under `run`.
    """
    from ..compile import compiler
    from ..compile.seccomp import socket_rules
    from ..exec import launcher
    from ..trace.record import Judge, Recorder

    code: int = ExitCode.LAUNCHER
    out = _output(report, "the report")  # its directory, held before the command runs
    try:
        _check_support()
        loaded = load_full(policy, tool, policies, parse_vars(variables), timeout, best_effort, None)
        # As `run` compiles it, but socket(2) refusals are the recorder's (same rules, same
        # errno), so that they are seen: the policy filter's errno would outrank them.
        compiled = compiler.compile_policy(loaded, prepared(loaded), sockets_recorded=True)
        cmd = launcher.prepare_command(compiled, list(command))
        for line in compiled.warnings:
            say(f"warning: NOT enforced on this kernel: {line}")
        failure: Optional[SandlockError] = None
        # The network the filter was compiled from ([credentials] adds its route's port).
        sockets = socket_rules((compiled.policy or loaded).network)
        log_ready()
        with compiled, Recorder(network_mediated=bool((compiled.policy or loaded).network.allow),
                                sockets=sockets) as recorder:
            try:
                child = launcher.run(compiled, cmd, report=say, recorder=recorder)
                code = int(child.returncode or 0)
            except SandlockError as exc:  # e.g. exec refused (126): still report what was seen
                failure, code = exc, int(exc.exit_code)
            recorder.stop()
            denials = Judge.for_policy(loaded, compiled.abi).denials(recorder.events)
            recorded, lost = len(recorder.events), recorder.lost
        log_run(compiled, list(command), code, (), [str(d) for d in denials])
        if failure is not None:
            _failed(failure)
    except SandlockError as exc:
        _failed(exc)
        if out is not None:
            out.close()
        raise click.exceptions.Exit(int(exc.exit_code)) from None
    if as_json:
        _emit(report, json.dumps({"exit_code": code, "recorded": recorded, "unreadable": lost,
                                  "denials": [d.as_dict() for d in denials]}, indent=2) + "\n", out)
    else:
        lines = [f"sandlock: trace: {d}\n" for d in denials]
        if not denials:
            lines.append(f"sandlock: trace: nothing refused by the filesystem, TCP or socket rules "
                         f"({recorded} calls recorded)\n")
        if lost:
            lines.append(f"sandlock: trace: {lost} calls could not be read (their process "
                         "ended first)\n")
        lines.append("sandlock: trace: not seen here: syscalls the seccomp filter refuses, hosts "
                     "refused by [network] allow (reported as they happen)\n")
        _emit(report, "".join(lines), out)
    raise click.exceptions.Exit(code)


@click.command(context_settings=_CONTEXT)
@click.option("-o", "--output", metavar="FILE", help="Write the draft policy to FILE (default stdout).")
@click.option("--extends", "extends", multiple=True, metavar="PROFILE",
              help="Built-in profile or policy file the draft extends (repeatable; default: "
                   "whichever built-in profiles cover what was used).")
@click.option("--timeout", help="Wall-clock limit of the recorded run, e.g. 5m.")
@click.option("--allow-net", is_flag=True,
              help="Let the recorded run use the network: TCP connect and bind on any port, "
                   "and UDP (without it: none).")
@click.option("--allow-unix", is_flag=True,
              help="Let the recorded run connect to Unix sockets (without it: none). They "
                   "reach your ssh-agent (it signs with your keys), the Docker daemon and the "
                   "D-Bus session bus (`systemd-run --user` runs anything unconfined).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def learn(output: Optional[str], extends: Sequence[str], timeout: Optional[str], allow_net: bool,
          allow_unix: bool, command: Sequence[str]) -> None:
    """Run COMMAND once with recording, under a permissive sandbox, and write a draft policy.

    The recorded run may read and execute what you can, except secrets (~/.ssh,
    ~/.gnupg, ~/.aws, ~/.config/gcloud, sandlock's caches, /etc/shadow); it may write
    only the working directory and a private TMPDIR; it has no network and no Unix
    sockets unless --allow-net / --allow-unix. The draft grants what was used,
    grouped by directory where that stays tight, with a comment per grant and a
    WARNING for each grant broader than what was used or that exposes more than
    files (also printed on stderr). Review it, then use it with
    `sandlock run --policy FILE -- COMMAND`.
    """
    out = _output(output, "the draft")  # its directory, held before the command runs
    try:
        _check_support()
        draft, code = learn_policy(list(command), extends=tuple(extends), timeout=timeout,
                                   report=say, allow_net=allow_net, allow_unix=allow_unix)
    except SandlockError as exc:
        _failed(exc)
        if out is not None:
            out.close()
        raise click.exceptions.Exit(int(exc.exit_code)) from None
    if out is None:
        sys.stdout.write(draft.text)
    else:
        try:
            out.write(draft.text)
        except OSError as exc:
            say(f"cannot write {output!r}: {exc.strerror or exc}")
            raise click.exceptions.Exit(ExitCode.LAUNCHER) from None
    for warning in draft.warnings:
        say(f"learn: {warning}")
    if output is not None:
        run = shell_command(draft.run_command(output, command))
        say(f"learn: draft policy written to {output}; review it, then `{run}`")
    if code:
        say(f"learn: the command exited with {code} during the recorded run: the draft covers "
            "only what it did before that")
    raise click.exceptions.Exit(code)


def learn_policy(argv: Sequence[str], *, extends: Sequence[str] = (), timeout: Optional[str] = None,
                 report: Optional[Callable[[str], None]] = None, allow_net: bool = False,
                 allow_unix: bool = False) -> tuple[Draft, int]:
    """Run ``argv`` recorded; return (the draft, the command's exit code). (Here, above
    exec/ and trace/: it runs the command through the launcher, then drafts from the record.)"""
    import shutil
    import tempfile

    from ..compile import compiler, ruleset
    from ..errors import LandlockError, PolicyError
    from ..exec import launcher
    from ..policy.model import loads_policy, parse_duration
    from ..trace import emit
    from ..trace import record as T
    from ..trace.learn import check_cwd, draft, recording_policy

    cwd = os.path.realpath(os.getcwd())
    home = os.path.realpath(os.path.expanduser("~"))
    check_cwd(cwd, home)
    tmpdir = os.path.realpath(tempfile.mkdtemp(prefix="sandlock-learn-"))
    try:
        # An entry of a shared directory (/tmp: another program's temporary directory) may
        # vanish between the listing and the rule made of it: listed and compiled again.
        for attempt in range(LEARN_ATTEMPTS):
            text = recording_policy(cwd, tmpdir, home, allow_net=allow_net, allow_unix=allow_unix)
            policy = loads_policy(text, source="<learn>")
            if timeout is not None:
                try:
                    policy = policy.with_timeout(parse_duration(timeout))
                except Exception as exc:  # _Bad from the duration parser
                    raise SandlockError(f"--timeout: {exc}") from None
            try:
                compiled = compiler.compile_policy(policy)
                break
            except LandlockError:
                if attempt == LEARN_ATTEMPTS - 1:
                    raise
            except PolicyError as exc:  # a write grant `run` refuses: the working directory
                raise SandlockError(f"learn: the recorded run may write its working directory "
                                    f"{emit.printable(cwd)}, and sandlock refuses that grant: "
                                    f"{exc.reason}; run learn in the tool's project "
                                    "directory") from None
        cmd = launcher.prepare_command(compiled, list(argv))
        code = 0
        log_ready()
        with compiled, T.Recorder(programs=True) as recorder:
            try:
                child = launcher.run(compiled, cmd, report=report, recorder=recorder)
                code = int(child.returncode or 0)
            except SandlockError as exc:
                if report is not None:
                    report(str(exc))
                code = int(exc.exit_code)
            recorder.stop()
        log_run(compiled, list(argv), code, ())
        abi = ruleset.detect_abi()
        learned = T.Judge.for_policy(policy, abi)
        result = draft(recorder.events, abi, argv=argv, cwd=cwd, tmpdir=tmpdir, home=home,
                       allowed=learned, extends=extends)
        return result, code
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)



def register(group: Any) -> None:
    """Add `trace` and `learn` to the click group of :mod:`sandlock.cli.main`."""
    group.add_command(trace)
    group.add_command(learn)

