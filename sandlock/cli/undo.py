"""`sandlock changes`, `apply`, `discard` and `rollback` (:mod:`sandlock.undo`); the run
itself is :mod:`sandlock.cli.review`. Every name and line of content a tool chose is
escaped before it is printed (:mod:`sandlock.undo.show`)."""

from __future__ import annotations

import sys
from typing import Callable

import click

from ..errors import SandlockError


def _do(action: Callable[[], str]) -> None:
    try:
        message = action()
    except SandlockError as exc:
        print(f"sandlock: {exc}", file=sys.stderr)
        raise click.exceptions.Exit(int(exc.exit_code)) from None
    print(message)


@click.command()
@click.argument("run")
@click.option("--no-diff", is_flag=True, help="List the changed paths only.")
def changes(run: str, no_diff: bool) -> None:
    """Show what run RUN (a dry run or a checkpoint) changed."""
    from ..undo import session, show

    _do(lambda: "\n".join(show.lines(run, session.load(run), diffs=not no_diff)))


@click.command()
@click.argument("run")
def apply(run: str) -> None:
    """Write dry run RUN's changes into the original directories (refused, with nothing
    changed, if they changed since the run or the tool left links, FIFOs, devices or
    set-user-ID files)."""
    from ..undo import session

    _do(lambda: f"applied {session.apply(run)} change(s) of run {run}")


@click.command()
@click.argument("run")
def discard(run: str) -> None:
    """Drop run RUN: a dry run's copy, or a checkpoint's snapshot."""
    from ..undo import session

    def forget() -> str:
        session.forget(run)
        return f"discarded run {run}"

    _do(forget)


@click.command()
@click.argument("run")
def rollback(run: str) -> None:
    """Restore the directories checkpointed by run RUN as they were before it (refused, with
    nothing changed, if they changed since the run or the snapshot does not verify)."""
    from ..undo import session

    _do(lambda: f"rolled back {session.rollback(run)} path(s) of run {run}")


COMMANDS = (changes, apply, discard, rollback)

