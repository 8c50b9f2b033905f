"""The variables every policy has, ``${cwd}``, ``${home}`` and ``${tmpdir}``: the caller's.

Kept apart from the policy model (which imports much more), so that a plan read back
from the cache can note them when it is made, and the policy be loaded later, on first
use, with the values the plan was compiled with.
"""

from __future__ import annotations

import errno
import os

from ..errors import PolicyError


def builtin_vars(source: str = "<policy>") -> dict[str, str]:
    """``${cwd}``, ``${home}`` and ``${tmpdir}`` of the caller."""
    try:
        cwd = os.getcwd()
    except OSError as exc:  # ENOENT: the directory was removed while the caller sat in it
        what = ("no longer exists" if exc.errno == errno.ENOENT
                else f"cannot be named ({exc.strerror})")
        raise PolicyError(f"the working directory {what}; change to an existing directory",
                          source=source) from None
    return {
        "cwd": cwd,
        "home": os.path.expanduser("~"),
        "tmpdir": os.environ.get("TMPDIR") or "/tmp",
    }
