"""OpenAI Agents SDK: a function tool whose every call runs in its own sandbox.

``sandboxed_function_tool(func, policy=...)`` returns the ``agents.FunctionTool`` that
``agents.function_tool(func)`` would (the same name, description and JSON schema, made
by the SDK from ``func``'s signature and docstring), except that a call runs ``func``
through :meth:`sandlock.Sandbox.call_async`: in a new process confined by the policy,
which gets the arguments, not the agent's memory. What ``func`` raises, and what
sandlock refuses, goes back to the model as the tool's output (``TypeName: message``;
the SDK's default would hide it), and the run goes on.

Imports ``agents`` (the ``agents`` extra); ``import sandlock`` does not.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from agents import FunctionTool, RunContextWrapper, function_tool
from agents.function_schema import function_schema

from ._tools import confined_target, failure, sandbox_for

if TYPE_CHECKING:
    from ..api.registry import Registry
    from ..api.sandbox import PolicyLike, Sandbox

__all__ = ["sandboxed_function_tool"]


def _tell_the_model(context: RunContextWrapper[Any], error: Exception) -> str:
    return failure(error)


def sandboxed_function_tool(func: Callable[..., Any], *, policy: Optional[PolicyLike] = None,
                            registry: Optional[Registry] = None,
                            sandbox: Optional[Sandbox] = None,
                            vars: Optional[Mapping[str, str]] = None, name: Optional[str] = None,
                            **tool_options: Any) -> FunctionTool:
    """``func`` (a module-level function taking no run context) as a function tool
    confined by one of: ``policy`` (as :class:`Sandbox` takes it, with ``vars``),
    ``registry`` (its policy ``name``, by default the tool's name, with ``vars``) or
    ``sandbox`` (compiled already, shared by the tools given it). ``tool_options`` go to
    ``agents.function_tool`` (``name_override``, ``description_override``, ``timeout``,
    ``failure_error_function``...).

    The policy must grant read on the directory ``func``'s module is imported from and
    on what it imports. Its result comes back as plain data (``Sandbox.call``).
    """
    tool = str(tool_options.get("name_override") or getattr(func, "__name__", "tool"))
    target = confined_target(func, tool)
    if function_schema(func).takes_context:
        raise TypeError(f"{tool}: a confined function cannot take the run context (it stays "
                        "in the agent's process)")
    box = sandbox_for(name or tool, policy=policy, registry=registry, sandbox=sandbox,
                      vars=vars)

    @functools.wraps(func)  # the SDK reads the signature, hints and docstring of func
    async def confined(*args: Any, **kwargs: Any) -> Any:
        return await box.call_async(target, *args, **kwargs)

    tool_options.setdefault("failure_error_function", _tell_the_model)
    return function_tool(confined, **tool_options)
