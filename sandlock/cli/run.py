"""`sandlock run`: the per-call path, kept free of click and of the printing module.

Start-up is paid on every tool call, and importing click alone costs ~30 ms, so
`run` parses its few options by hand (:func:`sandlock.cli.launch.main_run`, from the one
table of them, which also makes its ``--help``). The click CLI's ``run``
(:mod:`sandlock.cli.main`) hands its arguments to the same parser. This
module is the console entry point (:func:`main`), the only one that imports the click
CLI, and only when a command other than ``run`` is asked for.
"""

from __future__ import annotations

import sys

from ..errors import ExitCode
from .launch import main_run, say, silence_stdout

TYPE_CHECKING = False  # importing typing alone costs several ms per call
if TYPE_CHECKING:
    from typing import Optional, Sequence

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


def _given(name: str) -> bool:
    """Whether exec gave this process the variable ``name`` (/proc/self/environ); True when
    that cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            data = handle.read()
    except OSError:
        return True
    return any(item.startswith(name.encode() + b"=") for item in data.split(b"\0"))


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
        silence_stdout()
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
    # The installed command's record name (exec/helper/sandlock_run.c): for the cache to
    # write, never for a tool's environment.
    import os

    from ..compile import cache

    cache.front_end = os.environ.pop(cache.ENV_FRONT_END, None)
    # PEP 538: an interpreter started in the C locale sets LC_CTYPE for its children. The
    # tool's environment is the caller's, as the native front end gives it.
    # (The native entry's key, which holds the locale, is then the front end's too.)
    if "LC_CTYPE" in os.environ and not os.environ.get("LC_ALL") and not _given("LC_CTYPE"):
        del os.environ["LC_CTYPE"]
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        try:
            code = main_run(args[1:])
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            say(f"internal error: {type(exc).__name__}: {exc} (please report it)")
            code = ExitCode.LAUNCHER
        exit_now(code)
    sys.exit(_click_main(args))
