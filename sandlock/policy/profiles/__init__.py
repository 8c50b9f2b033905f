"""The profiles and tool policies shipped with sandlock, as package data.

A bare name (``read_file``, no ``/`` and no ``.toml``) in ``extends = [...]`` or
``--policy`` means the file of that name here, wherever sandlock is installed: a
checkout, a wheel, or the single-file binary (which bundles this directory).
Only names are looked up, never paths, and nothing outside this directory is
searched, so a file a tool could write cannot stand in for a built-in policy.
This module imports nothing heavy: the per-call CLI path uses it.
"""

from __future__ import annotations

import os

DIR = os.path.dirname(os.path.realpath(__file__))


def is_name(argument: str) -> bool:
    """Whether ``argument`` is a profile name rather than a path."""
    return "/" not in argument and not argument.endswith(".toml") and argument not in ("", ".", "..")


def path(name: str) -> str:
    """The file of the shipped profile ``name`` (which may not exist)."""
    return os.path.join(DIR, f"{name}.toml")


def policy_file(argument: str) -> str:
    """The file a ``--policy`` argument names: a shipped profile for a bare name that
    is one, otherwise the argument itself, a path."""
    if is_name(argument) and os.path.isfile(path(argument)):
        return path(argument)
    return argument
