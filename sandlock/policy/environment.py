"""The tool's environment from a policy's ``[env]``: the caller's variables that ``pass``
matches, then ``set``; nothing else of the caller's.

The one implementation of that rule, used by ``sandlock run`` and the API. Pure: it
reads the mapping it is given. It imports nothing heavy (the per-call CLI path uses it):
the common patterns, a plain name or a name followed by one ``*`` (``LC_*``), are
matched without fnmatch or re; any other glob is compiled once, with fnmatchcase's
meaning (case-sensitive, ``*`` ``?`` ``[...]``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # importing typing alone costs several ms per call
if TYPE_CHECKING:
    from typing import Callable, Iterable, Mapping

_GLOB = "*?["
#: patterns -> matcher, for the few ``pass`` lists a process uses.
_MATCHERS: dict[tuple[str, ...], Callable[[str], bool]] = {}


def matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """A test of a variable name against every pattern of ``pass`` (fnmatchcase)."""
    found = _MATCHERS.get(patterns)
    if found is not None:
        return found
    names, starts, globs = set(), [], []
    for pattern in patterns:
        if not any(c in pattern for c in _GLOB):
            names.add(pattern)
        elif pattern.endswith("*") and not any(c in pattern[:-1] for c in _GLOB):
            starts.append(pattern[:-1])
        else:
            globs.append(pattern)
    exact, prefixes = frozenset(names), tuple(starts)
    if globs:
        import fnmatch
        import re

        full = re.compile("|".join(fnmatch.translate(p) for p in globs)).match

        def test(name: str) -> bool:
            return name in exact or name.startswith(prefixes) or full(name) is not None
    else:
        def test(name: str) -> bool:
            return name in exact or name.startswith(prefixes)
    if len(_MATCHERS) < 64:
        _MATCHERS[patterns] = test
    return test


def build(passed: tuple[str, ...], assigned: Iterable[tuple[str, str]],
          caller: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables whose names ``passed`` matches, then ``assigned`` (``set``)."""
    test = matcher(passed)
    env = {name: value for name, value in caller.items() if test(name)}
    env.update(assigned)
    return env
