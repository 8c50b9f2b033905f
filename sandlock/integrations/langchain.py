"""LangChain and LangGraph: a tool whose every invocation runs in its own sandbox.

``sandboxed_tool(read_note, policy=...)`` returns a LangChain ``StructuredTool`` with
the wrapped tool's name, description and argument schema; invoking it (directly, from
a LangGraph ``ToolNode`` or a ``create_agent`` agent) runs the tool's function through
:meth:`sandlock.Sandbox.call`: in a new process confined by the policy, which gets
the arguments, not the agent's memory. What the function raises, and what sandlock
refuses, comes back to the model as the tool's error message
(``ToolMessage(status="error")``), not as an exception through the agent.

Imports ``langchain_core`` (the ``langchain`` extra); ``import sandlock`` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

from langchain_core.tools import BaseTool, StructuredTool, ToolException
from langchain_core.tools import tool as make_tool

from ._tools import confined_target, failure, sandbox_for

if TYPE_CHECKING:
    from ..api.registry import Registry
    from ..api.sandbox import PolicyLike, Sandbox

__all__ = ["sandboxed_tool"]


def sandboxed_tool(tool: Union[BaseTool, Callable[..., Any]], *,
                   policy: Optional[PolicyLike] = None, registry: Optional[Registry] = None,
                   sandbox: Optional[Sandbox] = None, vars: Optional[Mapping[str, str]] = None,
                   name: Optional[str] = None) -> StructuredTool:
    """``tool`` (a module-level function, or a ``StructuredTool`` such as ``@tool`` makes)
    as a LangChain tool confined by one of: ``policy`` (a policy as :class:`Sandbox` takes
    it, with ``vars``), ``registry`` (its policy ``name``, by default the tool's name,
    with ``vars``) or ``sandbox`` (compiled already, shared by the tools given it).

    The policy must grant read on the directory the function's module is imported from
    and on what it imports (a ``@tool`` module imports ``langchain_core``: extend the
    ``venv`` profile). Its result comes back as plain data (``Sandbox.call``).
    """
    original = tool if isinstance(tool, BaseTool) else make_tool(tool)
    function = (original.func or original.coroutine) if isinstance(original, StructuredTool) else None
    schema = original.args_schema
    if function is None or schema is None:
        raise TypeError(f"{original.name}: only a function or a StructuredTool with a function "
                        f"(.func) can be confined, not a {type(original).__name__}")
    target = confined_target(function, original.name)  # refuses a coroutine function
    box = sandbox_for(name or original.name, policy=policy, registry=registry,
                      sandbox=sandbox, vars=vars)

    def run(**arguments: Any) -> Any:
        try:
            return box.call(target, **arguments)
        except Exception as exc:  # the tool's own error or sandlock's: the model reads it
            raise ToolException(failure(exc)) from exc

    async def arun(**arguments: Any) -> Any:
        try:
            return await box.call_async(target, **arguments)
        except Exception as exc:
            raise ToolException(failure(exc)) from exc

    return StructuredTool(name=original.name, description=original.description,
                          args_schema=schema, func=run, coroutine=arun,
                          return_direct=original.return_direct,
                          response_format=original.response_format, handle_tool_error=True,
                          metadata={**(original.metadata or {}), "sandlock": True})
