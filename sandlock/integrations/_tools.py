"""What the framework adapters share: the sandbox a tool runs in, the reference by
which its confined process finds the tool's function, and the text a model reads
when a confined tool fails.

Nothing here imports a framework; :mod:`.langchain`, :mod:`.deepagents` and
:mod:`.openai_agents` do, each for its own.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

if TYPE_CHECKING:
    from ..api.registry import Registry
    from ..api.sandbox import PolicyLike, Sandbox


def sandbox_for(tool: str, *, policy: Optional[PolicyLike], registry: Optional[Registry],
                sandbox: Optional[Sandbox], vars: Optional[Mapping[str, str]]) -> Sandbox:
    """The one sandbox a wrapped tool's calls run in: compiled once, here, so that a bad
    policy or an unknown registry name is an error when the tool is wrapped, not when
    the model first calls it. Exactly one of ``policy``, ``registry``, ``sandbox``."""
    given = [what for what, value in (("policy", policy), ("registry", registry),
                                      ("sandbox", sandbox)) if value is not None]
    if len(given) != 1:
        raise TypeError(f"{tool}: give exactly one of policy=, registry= or sandbox= "
                        f"(got {', '.join(given) or 'none'}); a tool is never run unconfined")
    if sandbox is not None:
        if vars is not None:
            raise TypeError(f"{tool}: vars= fills a policy's variables; a Sandbox is compiled")
        return sandbox
    if registry is not None:
        return registry.sandbox(tool, vars)
    from ..api.sandbox import Sandbox

    assert policy is not None
    return Sandbox(policy, vars=vars)


class _Ref:
    """Pickles as ``reduce``: a call of a standard-library function by reference, so that
    the confined process rebuilds the reference without importing sandlock code."""

    def __init__(self, reduce: tuple[Any, ...]) -> None:
        self._reduce = reduce

    def __reduce__(self) -> tuple[Any, ...]:
        return self._reduce


def confined_target(func: Callable[..., Any], tool: str) -> Any:
    """What ``Sandbox.call`` sends for ``func``: its module and qualified name, looked up
    afresh in the confined process (``importlib.import_module``, then ``getattr``).

    A framework's decorator usually replaces the module's function with a tool object
    that holds the function as ``.func`` (LangChain's ``@tool``): pickle would refuse
    that function ("not the same object"); the reference follows ``.func`` instead.
    Closures, lambdas and coroutine functions are refused here, when the tool is
    wrapped: the confined process could not find the first two, and the third
    returns a coroutine that cannot cross back.
    """
    if not callable(func):
        raise TypeError(f"{tool}: expected a function, not {type(func).__name__}")
    if inspect.iscoroutinefunction(func):
        raise TypeError(f"{tool}: {func.__qualname__} is a coroutine function; a confined "
                        "tool is a plain function (its caller may still be async)")
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    found: Any = sys.modules.get(module) if isinstance(module, str) else None
    path = qualname.split(".") if isinstance(qualname, str) else ["<unknown>"]
    for part in path:
        found = getattr(found, part, None) if found is not None and "<" not in part else None
    if found is None:
        raise TypeError(f"{tool}: {module}.{qualname} cannot be imported by its name (a "
                        "lambda, a closure or a function defined inside another): the "
                        "confined process imports a tool's function afresh, so define it "
                        "at module level")
    ref = _Ref((importlib.import_module, (module,)))
    for part in path:
        ref = _Ref((getattr, (ref, part)))
    if found is func:
        return ref
    if getattr(found, "func", None) is func:
        return _Ref((getattr, (ref, "func")))
    raise TypeError(f"{tool}: {module}.{qualname} names another object than the function "
                    "given (a decorator that keeps it elsewhere than .func)")


def failure(exc: BaseException) -> str:
    """The text a model reads when a confined tool failed: the exception's type and
    message (the tool's own, or sandlock's ``CallError``), never a traceback."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
