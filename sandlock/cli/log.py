"""`sandlock log --verify [FILE]`: check the run log's chain (:mod:`sandlock.compile.runlog`)."""

from __future__ import annotations

from typing import Optional

import click

from ..errors import ExitCode, SandlockError
from ..trace.emit import printable
from .launch import say


@click.command("log")
@click.option("--verify", "check", is_flag=True, required=True,
              help="Check that no record was removed, edited, reordered or cut off the end.")
@click.argument("file", required=False)
def log(check: bool, file: Optional[str]) -> None:
    """Check the run log (SANDLOCK_LOG): exit 0 if intact, 1 if tampered with, 125 if it
    cannot be checked. FILE: the log file (default: the one SANDLOCK_LOG names)."""
    from ..compile.runlog import verify

    try:
        count, problems = verify(file)
    except SandlockError as exc:
        say(printable(str(exc)))
        raise click.exceptions.Exit(ExitCode.LAUNCHER) from None
    for problem in problems:
        say(printable(problem))
    if problems:
        raise click.exceptions.Exit(1)
    click.echo(f"{count} records: intact")
