"""`sandlock run`: the per-call path, kept free of click and rich.

Start-up is paid on every tool call, and importing click alone costs ~30 ms, so
`run` parses its few options by hand. Anything it does not understand (``--help``
included) is handed to the full click CLI in :mod:`sandlock.cli.main`, which defines
the same options for documentation and calls :func:`execute`.
"""

from __future__ import annotations

import sys

from ..errors import ExitCode, SandlockError

TYPE_CHECKING = False  # importing typing alone costs several ms per call
if TYPE_CHECKING:
    from typing import Mapping, Optional, Sequence

    from ..policy.model import Policy

USAGE = ("sandlock run (--policy FILE | --tool NAME --policies DIR) [--var K=V]... [--timeout D] "
         "[--best-effort] -- CMD [ARGS]...")


def say(message: str) -> None:
    """One line on stderr, prefixed so it cannot be mistaken for the tool's output."""
    try:
        sys.stderr.write(f"sandlock: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr full, closed, or None in-process
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
        from ..policy.registry import Registry

        if policies is None:
            raise SandlockError("--tool needs --policies DIR (or a policies file)")
        return Registry(policies).policy(tool, variables)
    if policy is None:
        raise SandlockError("missing --policy FILE")
    from ..policy.model import load_policy
    from ..policy.profiles import policy_file

    policy = policy_file(policy)  # a bare name: the shipped policy of that name

    return load_policy(policy, variables, data=data)


def _load_full(policy: Optional[str], tool: Optional[str], policies: Optional[str],
               variables: Mapping[str, str], timeout: Optional[str], best_effort: bool,
               data: Optional[bytes]) -> Policy:
    """Parse the policy and apply the command-line overrides (the uncached path)."""
    from ..policy.model import Compat, parse_duration

    loaded = load(policy, tool, policies, variables, data)
    if best_effort:
        loaded = loaded.with_compat(Compat.BEST_EFFORT)
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


def execute(policy: Optional[str], variables: Mapping[str, str], timeout: Optional[str],
            best_effort: bool, argv: Sequence[str], *, tool: Optional[str] = None,
            policies: Optional[str] = None) -> int:
    """Load, compile, launch and wait; every failure becomes a message and an exit code.

    A policy file compiled before, unchanged, is read back from the cache of compiled
    policies (:mod:`sandlock.compile.cache`) instead of being parsed: that skips importing
    the policy model, tomllib and the seccomp compiler. Any doubt means a miss.
    """
    try:
        from ..exec import launcher

        cached = compiled = None
        data = None
        if policy is not None and tool is None:
            from ..compile import cache as fastpath
            from ..policy.profiles import policy_file

            policy = policy_file(policy)  # a bare name: the shipped policy of that name
            data = _read_once(policy)
            cached = fastpath.lookup(policy, data, variables, timeout, best_effort)
        loaded: Policy  # on a hit, the CachedPolicy view: the parts the launcher reads
        try:
            if cached is not None and cached.entry is not None:
                from ..compile.grants import GrantError

                try:
                    compiled = cached.entry.compile()
                    loaded = cached.entry.policy  # type: ignore[assignment]
                except GrantError:
                    compiled = None  # the full path reports it with the policy's line
            if compiled is None:
                loaded = _load_full(policy, tool, policies, variables, timeout, best_effort, data)
                compiled = launcher.compile_policy(loaded)
                if cached is not None:
                    cached.store(loaded, compiled)
        finally:
            if cached is not None:  # done with the cache: its directory is not the tool's
                import os

                os.close(cached.directory)
        try:
            command = launcher.prepare_command(loaded, argv)
            if compiled.gaps:
                say(f"warning: NOT enforced for this caller on this kernel (Landlock ABI "
                    f"{compiled.abi}):")
                for line in compiled.warnings:
                    say(f"warning:   - {line}")
            child = launcher.run(compiled, command, report=say)
        finally:
            compiled.close()  # the ruleset descriptor: the child is done with it
        if child.timed_out:
            say(f"timeout: {argv[0]} ran longer than {loaded.limits.timeout:g}s; killed its "
                "process tree")
        return int(child.returncode or 0)
    except SandlockError as exc:
        say(str(exc))
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return ExitCode.SIGNAL_BASE + 2


def main_run(args: Sequence[str]) -> Optional[int]:
    """Parse `run`'s options; None means "let click print the help".

    Any other unknown option is an error (exit 125): passed on, a misspelt option
    would be taken for the command itself.
    """
    policy = tool = policies = timeout = None
    pairs: list[str] = []
    best_effort = False
    index = 0
    valued = {"--policy", "--var", "--timeout", "--tool", "--policies"}
    while index < len(args):
        arg = args[index]
        if arg == "--":
            index += 1
            break
        if not arg.startswith("-"):
            break
        name, eq, value = arg.partition("=")
        if name in ("-h", "--help"):
            return None
        if name == "--best-effort" and not eq:
            best_effort = True
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
        if name == "--policy":
            policy = value
        elif name == "--tool":
            tool = value
        elif name == "--policies":
            policies = value
        elif name == "--timeout":
            timeout = value
        else:
            pairs.append(value)
    argv = list(args[index:])
    if not argv:
        say(f"error: no command given\nusage: {USAGE}")
        return ExitCode.LAUNCHER
    try:
        variables = parse_vars(pairs)
    except SandlockError as exc:
        say(str(exc))
        return ExitCode.LAUNCHER
    return execute(policy, variables, timeout, best_effort, argv, tool=tool, policies=policies)


def exit_now(code: int) -> None:
    """Exit with ``code``, skipping interpreter teardown when nothing depends on it.

    Once the tool is reaped and stderr flushed, freeing every module one by one
    only delays the caller (~2 ms). Teardown still runs when something registered
    an atexit handler or a thread is alive (they are owed their normal exit).
    """
    import atexit

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    threading = sys.modules.get("threading")
    pending = getattr(atexit, "_ncallbacks", lambda: 1)()  # CPython's count; unknown: assume some
    if pending == 0 and (threading is None or threading.active_count() == 1):
        import os

        os._exit(code)
    sys.exit(code)


def open_standard_streams() -> None:
    """Open /dev/null on each of descriptors 0-2 the caller left closed (``>&-``).

    Left closed, the first file sandlock opens would take that number and be handed
    to the tool as its standard input or output; and Python would leave ``sys.stdout``
    None, so the first print would raise. A tool started this way writes to /dev/null.
    """
    import os

    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        try:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: ``fd`` itself
        except OSError:
            continue  # no /dev/null: nothing better to put there
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)
    try:  # streams that live as long as the process
        if sys.stdin is None:
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
        if sys.stdout is None:
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        if sys.stderr is None:
            sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
    except OSError:
        pass  # still closed: say() and exit_now() cope with a None stream


def _silence_stdout() -> None:
    """Point descriptor 1 at /dev/null, so that the interpreter's last flush of output
    that could not be written does not fail a second time on the way out."""
    import os

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    except OSError:
        pass


def _click_main(args: list[str]) -> int:
    """The click CLI; an output that cannot be written, or any exception that escaped
    a command, ends as one ``sandlock:`` line and exit 125, never a traceback."""
    import errno

    from .main import cli

    try:
        try:
            cli.main(args=args, prog_name="sandlock")
            code: object = 0
        except SystemExit as exc:
            code = exc.code
        sys.stdout.flush()  # output still buffered fails here, not at interpreter exit
    except OSError as exc:
        _silence_stdout()
        if exc.errno == errno.EPIPE:  # the reader went away: nothing to tell it
            return 1
        what = f"{exc.filename}: " if exc.filename else "cannot write the output: "
        say(what + (exc.strerror or str(exc)))
        return ExitCode.LAUNCHER
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        say(f"internal error: {type(exc).__name__}: {exc} (please report it)")
        return ExitCode.LAUNCHER
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    say(str(code))
    return 1


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point: the fast `run` path, else the click CLI."""
    open_standard_streams()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        try:
            code = main_run(args[1:])
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            say(f"internal error: {type(exc).__name__}: {exc} (please report it)")
            code = ExitCode.LAUNCHER
        if code is not None:
            exit_now(code)
    sys.exit(_click_main(args))
