"""Where the run log is (:mod:`sandlock.compile.runlog`), while it is on: the one fact
the grant checks (:mod:`sandlock.compile.grants`) need of it, kept apart from the log's
writer so that they import nothing else of it."""

from __future__ import annotations

import os

from ..errors import SandlockError

TYPE_CHECKING = False  # typing costs milliseconds on every `sandlock run`
if TYPE_CHECKING:
    from typing import Optional

ENV = "SANDLOCK_LOG"


class LogError(SandlockError):
    """The run log cannot be placed, written or read as it must be (exit code 125)."""


def directory() -> Optional[str]:
    """The log's directory while the log is on, else None; LogError for a value that
    names no place (the log was asked for: never silently off)."""
    value = os.environ.get(ENV, "")
    if not value or value == "0":
        return None
    if value == "1":
        from .cachekey import key_directory

        state = key_directory()
        if state is None:
            raise LogError(f"{ENV}=1: uid {os.geteuid()} has no existing home directory in "
                           "the password database to keep the run log in; name a directory")
        return os.path.join(state, "log")
    if not os.path.isabs(value):
        raise LogError(f"{ENV} must be 1, 0 or an absolute directory, not {value!r}")
    return os.path.normpath(value)


def exposed() -> list[tuple[str, str]]:
    """(path, what it is) of the log no grant may reach, while it is on."""
    where = directory()
    if where is None:
        return []
    return [(where, "sandlock's run log (SANDLOCK_LOG): a tool that reads it learns every "
                    "logged command; no grant may reach it while the log is on")]
