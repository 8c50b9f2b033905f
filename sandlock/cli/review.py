"""`sandlock run --dry-run` and `--checkpoint`: a run under review (:mod:`sandlock.undo`),
then its change set on stderr, every name and line of content escaped
(:mod:`sandlock.undo.show`). Without click: called from `run`'s own parser."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import SandlockError

if TYPE_CHECKING:
    from ..undo.session import Review


def run_reviewed(mode: str, execute: Callable[[Review], int], say: Callable[[str], None]) -> int:
    """Run ``execute`` (:func:`sandlock.cli.launch.execute` with a review) under a
    :class:`sandlock.undo.session.Review`; then record the trees and show the change set,
    each line through ``say`` (:func:`sandlock.cli.launch.say`). A run that never started
    leaves nothing behind."""
    from ..undo import session, show

    review = session.Review(mode)
    code = execute(review)
    if not review.name:
        return code
    try:
        if not review.launched:
            review.discard_now()
            return code
        name = review.finish()
        value = session.load(name)
        for line in show.lines(name, value):
            say(line)
    except SandlockError as exc:
        say(str(exc))
        say(f"run {review.name} ({mode}) could not be recorded: `sandlock discard {review.name}` "
            "removes its copies")
        return int(exc.exit_code)
    if mode == session.DRY_RUN:
        say(f"the originals are unchanged: `sandlock apply {name}` writes this into them, "
            f"`sandlock discard {name}` drops it")
    else:
        say(f"`sandlock rollback {name}` restores the state before the run; "
            f"`sandlock discard {name}` forgets the snapshot")
    return code
