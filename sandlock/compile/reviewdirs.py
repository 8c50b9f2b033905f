"""Where review and undo keep their copies of a tool's files, and keeping other runs away.

``sandlock run --checkpoint`` snapshots the write-granted trees into
``<cache>/sandlock/runs/RUN/``; ``--dry-run`` copies them into
``<cache>/sandlock-scratch/RUN/`` and grants the copy in their place. A copy holds what
only that tool's policy granted (a workspace outside the home, say), so while it exists
no other run's grant, of any right, may reach it (:func:`sandlock.compile.grants.each_rule`):
a policy that reads the whole cache or home directory is refused, naming the run to
discard. The one exception is the dry run's own tool, whose grants lie inside its copy.
One definition of the places for :mod:`sandlock.undo` (which makes them) and the checks.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional, Sequence


def state_path(name: str) -> str:
    """``<cache>/sandlock/NAME``, ``<cache>`` being ``$XDG_CACHE_HOME`` (absolute) or
    ``$HOME/.cache`` (an absolute ``HOME``; else the password database's home, as the
    single-file binary's stub does): where sandlock keeps its state (the compiled-policy
    cache's entries, the runs of review and undo). Normalised as text (``link/..`` is the
    directory holding the link; the directories are then opened without following links).
    The one definition (:mod:`sandlock.compile.cache` and the grants' refusals too)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.environ.get("HOME", "")
        if not os.path.isabs(home):
            try:
                import pwd

                home = pwd.getpwuid(os.geteuid()).pw_dir
            except (ImportError, KeyError):
                home = "/"
        base = os.path.join(home, ".cache")
    return os.path.join(os.path.normpath(base), "sandlock", name)


def runs_path() -> str:
    """``<cache>/sandlock/runs``: records and checkpoint snapshots."""
    return state_path("runs")


def scratch_path() -> str:
    """``<cache>/sandlock-scratch``: beside sandlock's state directory, not in it (a
    write grant there would be refused)."""
    return os.path.join(os.path.dirname(os.path.dirname(runs_path())), "sandlock-scratch")


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def copies(own: Sequence[str], seen: Optional[Callable[[str, Optional[list[str]]], None]] = None
           ) -> list[tuple[str, str]]:
    """(directory, what it is) of every run's copy that exists now, but those holding one
    of ``own`` (the paths of the policy being checked: a dry run's grants, moved into its
    copy). Costs a directory listing of each place when they exist, nothing more.
    ``seen`` is told each place and what its listing found (None: no listing)."""
    out = []
    for base, what in ((runs_path(), "the snapshot of checkpointed run"),
                       (scratch_path(), "the copy of dry run")):
        try:
            names = sorted(os.listdir(base))
        except OSError:  # none yet (or unreadable: then sandlock cannot make one either)
            if seen is not None:
                seen(base, None)
            continue
        if seen is not None:
            seen(base, names)
        for name in names:
            where = os.path.join(base, name)
            if not any(_inside(os.path.normpath(path), where) for path in own):
                out.append((where, f"{what} {name}, which only its own tool may read (`sandlock "
                                   f"discard {name}` removes it)"))
    return out
