"""What `sandlock run` does once its options are parsed: load the policy (or read it back
from the cache of compiled policies), compile, launch and wait, and turn every failure
into one ``sandlock:`` line and an exit code.

Shared by the click-free parser (:mod:`sandlock.cli.run`), the click CLI
(:mod:`sandlock.cli.main`) and `trace`/`learn` (:mod:`sandlock.cli.trace`), below all
three, so that none of them imports another for it. Imports nothing heavy at module
level: this is the per-call path.
"""

from __future__ import annotations

import sys

from ..errors import ExitCode, SandlockError

TYPE_CHECKING = False  # importing typing alone costs several ms per call
if TYPE_CHECKING:
    from typing import Mapping, Optional, Sequence

    from ..compile.compiler import Compiled
    from ..net.routes import Routes
    from ..policy.model import Policy
    from ..undo.keep import Kept
    from ..undo.session import Review


def say(message: str) -> None:
    """One line on stderr, prefixed so it cannot be mistaken for the tool's output. A
    terminal in raw mode (an interactive run's, exec/terminal.py) gets its carriage
    return too; a terminal that takes nothing for a few seconds (nobody drains it) does
    not get the line, rather than hold sandlock for ever."""
    try:
        end = _end_of_line()
        if end is not None:
            sys.stderr.write(f"sandlock: {message}{end}")
            sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr full, closed, or None in-process
        pass


def _end_of_line() -> "str | None":
    """How a line on stderr ends; None when it is a terminal that cannot take one."""
    import os

    try:
        fd = sys.stderr.fileno()
        if not os.isatty(fd):
            return "\n"
    except (OSError, ValueError, AttributeError):  # not a file (in-process), or gone
        return "\n"
    import select
    import termios

    from ..exec.terminal import GRACE

    sys.stderr.flush()
    if not select.select([], [fd], [], GRACE)[1]:
        return None
    try:
        return "\n" if termios.tcgetattr(fd)[1] & termios.OPOST else "\r\n"
    except termios.error:
        return "\n"


def silence_stdout() -> None:
    """Point descriptor 1 at /dev/null, so that the interpreter's last flush of output
    that could not be written does not fail a second time on the way out."""
    import os

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    except OSError:
        pass


def parse_vars(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SandlockError(f"--var expects NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def load(policy: Optional[str], tool: Optional[str], policies: Optional[str],
         variables: Mapping[str, str], data: Optional[bytes] = None) -> Policy:
    """The policy named on the command line: a file (``data``: its bytes, when the
    caller already read them), or a tool of a registry."""
    if tool is not None:
        from ..api.registry import Registry

        if policies is None:
            raise SandlockError("--tool needs --policies DIR (or a policies file)")
        return Registry(policies).policy(tool, variables)
    if policy is None:
        raise SandlockError("missing --policy FILE")
    from ..policy.model import load_policy
    from ..policy.profiles import policy_file

    policy = policy_file(policy)  # a bare name: the shipped policy of that name

    return load_policy(policy, variables, data=data)


def load_full(policy: Optional[str], tool: Optional[str], policies: Optional[str],
               variables: Mapping[str, str], timeout: Optional[str], best_effort: bool,
               data: Optional[bytes], accept: Sequence[str] = ()) -> Policy:
    """Parse the policy and apply the command-line overrides (the uncached path)."""
    from ..policy.model import Compat, parse_duration

    loaded = load(policy, tool, policies, variables, data)
    if best_effort:
        loaded = loaded.with_compat(Compat.BEST_EFFORT)
    if accept:
        loaded = loaded.with_accept(accept)
    if timeout is not None:
        try:
            loaded = loaded.with_timeout(parse_duration(timeout))
        except Exception as exc:  # _Bad from the duration parser
            raise SandlockError(f"--timeout: {exc}") from None
    return loaded


def _read_once(policy: str) -> bytes:
    """The policy file's bytes, read once: the cache key and the compiled policy both
    come from them, so a file replaced while the run starts cannot mix two versions."""
    from ..errors import PolicyError
    from ..policy.readfile import read_policy_bytes

    try:
        return read_policy_bytes(policy)
    except FileNotFoundError:
        from ..policy.profiles import is_name

        hint = " nor a built-in policy (`sandlock policies` lists them)" if is_name(policy) else ""
        raise PolicyError(f"policy file does not exist{hint}", source=policy) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise PolicyError(f"cannot read policy file: {getattr(exc, 'strerror', None) or exc}",
                          source=policy) from None


def prepared(loaded: Policy) -> Optional[Routes]:
    """The route server of a policy with ``[credentials]``, listening, so that compiling
    grants its port (:func:`sandlock.net.routes.prepare`); None without credentials."""
    if not loaded.credentials:
        return None
    from ..net.routes import prepare

    return prepare(loaded, say)


def compile_run(policy: Optional[str], tool: Optional[str], policies: Optional[str],
                variables: Mapping[str, str], timeout: Optional[str], best_effort: bool,
                accept: Sequence[str] = (), review: Optional[Review] = None) -> Compiled:
    """The plan of a run named on the command line, consulting the cache of compiled
    policies (:mod:`sandlock.compile.cache`) first: a policy file compiled before, unchanged,
    is read back instead of parsed (no policy model, tomllib or seccomp compiler is
    imported). Any doubt means a miss: then the policy is loaded once, compiled (with its
    credential routes listening, carried by the plan) and stored. A run that accepts a gap
    (``accept``, `--accept`) is compiled afresh: the cache's key does not hold it, nor does
    it hold a run under ``review`` (`--dry-run`, `--checkpoint`), whose grants it moves."""
    from ..compile import cache as fastpath
    from ..compile import compiler

    cached = None
    data = None
    if policy is not None and tool is None:
        from ..policy.profiles import policy_file

        policy = policy_file(policy)  # a bare name: the shipped policy of that name
        data = _read_once(policy)
        cached = None if accept or review else fastpath.lookup(policy, data, variables, timeout,
                                                     best_effort)

    def load() -> Policy:
        loaded = load_full(policy, tool, policies, variables, timeout, best_effort, data, accept)
        if review is not None:
            loaded = review.prepare(loaded)
        from ..policy.model import cautions

        for line in cautions(loaded):  # once: a cache hit does not come here
            say(f"warning: {line}")
        return loaded

    def compile_with_routes(loaded: Policy) -> Compiled:
        routes = prepared(loaded)
        try:
            return compiler.compile_policy(loaded, routes)
        except BaseException:
            if routes is not None:
                routes.stop()
            raise

    def steps(compiled: Compiled) -> list[str]:
        from ..exec import spec  # the child's steps, for the native entry

        return spec.encode(spec.child_steps(compiled, spec.Command("", (), ()), in_group=False))

    return fastpath.through(cached, data, load, compile_with_routes, steps)[0]


def execute(policy: Optional[str], variables: Mapping[str, str], timeout: Optional[str],
            best_effort: bool, argv: Sequence[str], *, tool: Optional[str] = None,
            policies: Optional[str] = None, accept: Sequence[str] = (),
            review: Optional[Review] = None, keep: Sequence[str] = ()) -> int:
    """Compile (:func:`compile_run`, the cache inside), then run the plan and wait; every
    failure becomes a message and an exit code. ``keep``: paths put back if the tool
    changed them (:mod:`sandlock.undo.keep`; the run then fails)."""
    kept: list[Kept] = []
    try:
        compiled = compile_run(policy, tool, policies, variables, timeout, best_effort, accept,
                               review)
        from ..exec import launcher

        try:
            if review is None:
                command = launcher.prepare_command(compiled, argv)
            else:
                import os

                command = launcher.prepare_command(
                    compiled, argv, caller_env=review.environment(os.environ), cwd=review.cwd)
                review.launched = True
            warn_gaps(compiled)
            log_ready()
            if keep:
                from ..undo.keep import keep as keep_path

                kept += [keep_path(path) for path in keep]
            events: list[str] = []

            def report(line: str) -> None:  # kept for the run log (network refusals)
                events.append(line)
                say(line)

            child = launcher.run(compiled, command, report=report, keep=kept)
        finally:
            compiled.close()  # the ruleset descriptor: the child is done with it
            if compiled.routes is not None:
                compiled.routes.stop()
        if child.output_dropped:
            say(f"{child.output_dropped} bytes of {argv[0]}'s output were not shown: the "
                "terminal took none of them for seconds")
        if child.timed_out:
            say(f"timeout: {argv[0]} ran longer than {compiled.timeout:g}s; killed its "
                "process tree")
        elif child.signal is not None and child.signal not in QUIET_SIGNALS:
            say(killed_by(argv[0], child.signal, compiled.rlimits))
        if child.returncode and not child.timed_out and needs_no_sandbox(argv):
            say(CHROMIUM_HINT)
        log_run(compiled, argv, int(child.returncode or 0), events)
        if kept and put_back_kept(kept, child.kept):
            return ExitCode.LAUNCHER
        return int(child.returncode or 0)
    except SandlockError as exc:
        say(str(exc))
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return ExitCode.SIGNAL_BASE + 2
    finally:
        for each in kept:
            each.close()


def put_back_kept(kept: Sequence[Kept], watchdog_said: Sequence[str]) -> bool:
    """After the run: say what the watchdog put back of the kept paths, and put back
    what it could not (a watchdog killed before it did); True if anything had changed."""
    from ..exec.launcher import KEPT_ALL_SEEN
    from ..undo.keep import KeepError, in_order, put_back

    said = [line[1:] for line in watchdog_said if line != KEPT_ALL_SEEN]
    # Looked at again only if the watchdog did not end its work: a directory it made again
    # is a new one, which a second look would take for a change.
    for each in () if KEPT_ALL_SEEN in watchdog_said else in_order(kept):
        try:
            again = put_back(each)
        except KeepError as exc:
            again = str(exc)
        if again is not None:
            said.append(again)
    for line in said:
        say(line)
    return bool(said)


def log_ready() -> None:
    """Before a run: its record can be appended when the run log is on (off: one
    environment lookup), else SandlockError (exit 125) and nothing runs."""
    import os

    if not os.environ.get("SANDLOCK_LOG"):
        return
    from ..compile.runlog import LogError, ready

    try:
        ready()
    except LogError as exc:
        raise SandlockError(f"run log: {exc} (nothing was run)") from None


def log_run(compiled: Compiled, argv: Sequence[str], code: int, events: Sequence[str],
            refused: Sequence[str] = ()) -> None:
    """The run's record, when the run log is on (off: one environment lookup); ``refused``:
    what `sandlock trace` saw the policy refuse."""
    import os

    if not os.environ.get("SANDLOCK_LOG"):
        return
    from ..compile.runlog import LogError
    from ..compile.runlog import log_run as append

    try:
        append(compiled, argv, code, events, refused)
    except LogError as exc:
        raise SandlockError(f"run log: {exc} (the command exited {code}; this run is not "
                            "logged)") from None


def warn_gaps(compiled: Compiled) -> None:
    """The protections not enforced for this run, one ``warning:`` line each. A process
    limit enforced per user (RLIMIT_NPROC, no pids cgroup: the one gap strict mode
    accepts) is named only when it can bite: when this user already runs at least half
    as many tasks as the limit, so the tool may be refused fork(2) (`sandlock check`
    and `explain` always say it)."""
    if not compiled.warnings:
        return
    from ..linux.process import PER_USER_LIMIT

    lines = [line for line in compiled.warnings if not line.startswith(PER_USER_LIMIT)]
    if lines:
        say(f"warning: NOT enforced for this caller on this kernel (Landlock ABI {compiled.abi}):")
        for line in lines:
            say(f"warning:   - {line}")
    if len(lines) == len(compiled.warnings):
        return
    import os

    from ..compile.compiler import process_limit
    from ..linux.process import user_tasks

    limit = process_limit(compiled.rlimits)
    running = user_tasks(os.getuid())
    if limit is not None and running * 2 >= limit:
        say(f"warning: {PER_USER_LIMIT} (processes = {limit}) not enforced: RLIMIT_NPROC "
            f"instead, per user (no pids cgroup), and this user already runs {running} tasks: "
            "the tool may be refused new processes (`sandlock check` says why)")


#: Programs that start Chromium's own sandbox (and fail to, under sandlock).
CHROMIUM_NAMES = ("chromium", "chromium-browser", "chrome", "google-chrome",
                  "google-chrome-stable", "chrome-headless-shell", "headless_shell")
CHROMIUM_HINT = (
    "hint: Chromium's own sandbox cannot start under sandlock (it needs user namespaces and "
    "writes /proc/self/setgroups, which no policy allows): pass --no-sandbox. sandlock confines "
    "every Chromium process with this policy; without Chromium's sandbox its renderers get the "
    "policy's rights rather than narrower ones")


def needs_no_sandbox(argv: Sequence[str]) -> bool:
    """A Chromium started without ``--no-sandbox`` (it dies setting up its sandbox)."""
    import os

    return os.path.basename(argv[0]) in CHROMIUM_NAMES and "--no-sandbox" not in argv


#: Signals a tool dies of without a word from sandlock, as from a shell: the user's own
#: Ctrl-C (SIGINT, forwarded), and SIGPIPE (its reader went away: ``| head``).
QUIET_SIGNALS = (2, 13)


def killed_by(command: str, signum: int, rlimits: Sequence[tuple[int, int]]) -> str:
    """One line: the signal that killed the tool, and the limit of the policy behind it
    when it is one of sandlock's (RLIMIT_CPU: SIGXCPU, then SIGKILL at the hard limit;
    RLIMIT_FSIZE: SIGXFSZ; setrlimit(2))."""
    import resource
    import signal

    from ..trace.emit import printable

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    line = f"{printable(command)} was killed by {name} (exit {ExitCode.SIGNAL_BASE + signum})"
    limited = {res for res, _ in rlimits}
    if signum in (signal.SIGXCPU, signal.SIGKILL) and resource.RLIMIT_CPU in limited:
        cause = "[limits] cpu: it used all the CPU time the policy gives it"
        line += f"; {cause}" if signum == signal.SIGXCPU else f"; perhaps {cause}"
    elif signum == signal.SIGXFSZ and resource.RLIMIT_FSIZE in limited:
        line += "; [limits] file_size: it wrote a file larger than the policy allows"
    return line


#: `sandlock run`'s options, the one table: the parser below reads it and the help is
#: made from it. (name, metavar, or None for a flag; help). ``--var`` repeats.
OPTIONS: tuple[tuple[str, Optional[str], str], ...] = (
    ("--policy", "FILE", "Policy file (TOML), or the name of a shipped profile."),
    ("--tool", "NAME", "Tool name in the --policies registry."),
    ("--policies", "PATH", "Directory of policies, or one file with [tools.NAME] tables."),
    ("--var", "NAME=VALUE", "Define ${NAME} for the policy (repeatable)."),
    ("--timeout", "DURATION", "Wall-clock limit, e.g. 30s (overrides [limits] timeout)."),
    ("--best-effort", None, "Run even if the kernel cannot enforce everything; warn."),
    ("--accept", "NAME", "Run although the kernel lacks this one protection (repeatable; "
     "`sandlock check` lists the names); every other gap is still refused; warn."),
    ("--dry-run", None, "Write-granted directories are copied and the copy granted instead; "
     "show the changes, then `sandlock apply RUN` or `sandlock discard RUN`."),
    ("--checkpoint", None, "Snapshot the write-granted directories first, so that "
     "`sandlock rollback RUN` can restore them."),
    ("--keep", "PATH", "Put PATH back as it was if the tool changed it, and fail (repeatable; "
     "the Claude Code hook keeps the project's .claude and .mcp.json)."),
)
SUMMARY = "Run COMMAND confined by a policy."
USAGE = ("sandlock run (--policy FILE | --tool NAME --policies DIR) [--var K=V]... [--timeout D] "
         "[--best-effort | --accept NAME...] [--dry-run | --checkpoint] [--keep PATH]... "
         "-- CMD [ARGS]...")
EXIT_CODES = ("Exit codes: the command's own; 128+N killed by signal N; 124 timeout;\n"
              "125 sandlock failed; 126 not executable (or exec denied); 127 not found.")


def help_text() -> str:
    """`sandlock run --help`, from :data:`OPTIONS`."""
    rows = [(name + (f" {metavar}" if metavar else ""), text) for name, metavar, text in OPTIONS]
    rows.append(("-h, --help", "Show this message and exit."))
    width = max(len(left) for left, _ in rows) + 2
    lines = ["Usage: sandlock run [OPTIONS] COMMAND...", "", f"  {SUMMARY}", "", f"  {USAGE}",
             "", "Options:"]
    lines += [f"  {left:<{width}}{text}" for left, text in rows]
    lines += ["", *(f"  {line}" for line in EXIT_CODES.splitlines())]
    return "\n".join(lines) + "\n"


def main_run(args: Sequence[str]) -> int:
    """Parse `run`'s options (:data:`OPTIONS`) and run; the exit code.

    Any other unknown option is an error (exit 125): passed on, a misspelt option
    would be taken for the command itself.
    """
    given: dict[str, str] = {}
    pairs: list[str] = []
    accept: list[str] = []
    keep: list[str] = []
    best_effort = False
    review = ""
    index = 0
    valued = {name for name, metavar, _ in OPTIONS if metavar is not None}
    flags = {name for name, metavar, _ in OPTIONS if metavar is None}
    while index < len(args):
        arg = args[index]
        if arg == "--":
            index += 1
            break
        if not arg.startswith("-"):
            break
        name, eq, value = arg.partition("=")
        if name in ("-h", "--help"):
            sys.stdout.write(help_text())
            return 0
        if name in flags and not eq:
            if name == "--best-effort":
                best_effort = True
            elif review and review != name:
                say(f"error: --dry-run and --checkpoint exclude each other\nusage: {USAGE}")
                return ExitCode.LAUNCHER
            else:
                review = name
            index += 1
            continue
        if name not in valued:
            say(f"error: unknown option {arg!r} (put the command after --)\nusage: {USAGE}")
            return ExitCode.LAUNCHER
        if not eq:
            if index + 1 >= len(args):
                say(f"error: {name} needs a value\nusage: {USAGE}")
                return ExitCode.LAUNCHER
            value = args[index + 1]
            index += 1
        index += 1
        if name == "--var":
            pairs.append(value)
        elif name == "--keep":
            keep.append(value)
        elif name == "--accept":
            accept.append(value)
        else:
            given[name] = value
    argv = list(args[index:])
    if not argv:
        say(f"error: no command given\nusage: {USAGE}")
        return ExitCode.LAUNCHER
    try:
        variables = parse_vars(pairs)
    except SandlockError as exc:
        say(str(exc))
        return ExitCode.LAUNCHER
    if review:
        from .review import run_reviewed

        return run_reviewed(review[2:], lambda under: execute(
            given.get("--policy"), variables, given.get("--timeout"), best_effort, argv,
            tool=given.get("--tool"), policies=given.get("--policies"), accept=accept,
            review=under, keep=keep), say)
    return execute(given.get("--policy"), variables, given.get("--timeout"), best_effort, argv,
                   tool=given.get("--tool"), policies=given.get("--policies"), accept=accept,
                   keep=keep)
