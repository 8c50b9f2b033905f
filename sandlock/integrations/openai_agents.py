"""OpenAI Agents SDK: a function tool whose every call runs in its own sandbox.

``sandboxed_function_tool(func, policy=...)`` returns the ``agents.FunctionTool`` that
``agents.function_tool(func)`` would (the same name, description and JSON schema, made
by the SDK from ``func``'s signature and docstring), except that a call runs ``func``
through :meth:`sandlock.Sandbox.call_async`: in a new process confined by the policy,
which gets the arguments, not the agent's memory. What ``func`` raises, and what
sandlock refuses, goes back to the model as the tool's output (``TypeName: message``;
the SDK's default would hide it), and the run goes on.

``SandlockSandboxClient`` is the SDK's sandbox client for ``SandboxAgent``: the SDK's
own local client (``UnixLocalSandboxClient``, which confines nothing on Linux) with every
command it starts (``exec``, PTY sessions) run by ``sandlock run`` under a policy, the
session's workspace as ``${workspace}``.

Imports ``agents`` (the ``agents`` extra); ``import sandlock`` does not.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, cast

from agents import FunctionTool, RunContextWrapper, function_tool
from agents.function_schema import function_schema
from agents.sandbox.sandboxes.unix_local import UnixLocalSandboxClient, UnixLocalSandboxSession

from .. import PACKAGE_DIR
from ._tools import confined_target, failure, sandbox_for

if TYPE_CHECKING:
    from ..api.registry import Registry
    from ..api.sandbox import PolicyLike, Sandbox

__all__ = ["SandlockSandboxClient", "sandboxed_function_tool"]


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


class SandlockSandboxClient(UnixLocalSandboxClient):
    """``UnixLocalSandboxClient`` whose sessions start every command confined:
    ``sandlock run --policy POLICY --var workspace=ROOT [--var K=V]... -- COMMAND``.

    ``policy`` is a policy file or a shipped profile's name (default ``"shell"``: every
    program in /usr/bin, the workspace writable, no network), ``vars`` its other
    variables; it is loaded here (``PolicyError``), and read again by each command.
    The session's file operations (``read``, ``write``, ``ls``...) stay the SDK's own,
    in the agent's process, bounded by its workspace-path checks; what the model runs
    is confined. Other keyword arguments go to ``UnixLocalSandboxClient``.
    """

    def __init__(self, policy: str = "shell", *, vars: Optional[Mapping[str, str]] = None,
                 **options: Any) -> None:
        super().__init__(**options)
        if not isinstance(policy, str) or not policy:
            raise TypeError(f"policy must be a policy file or a profile name, not {policy!r:.80}")
        if "workspace" in (vars or {}):
            raise TypeError("vars: ${workspace} is each session's workspace root")
        from ..policy.model import load_policy
        from ..policy.profiles import policy_file

        # Absolute: the launcher starts in the workspace. Loaded once here, so that a
        # policy error is raised now rather than printed by each command.
        file = os.path.abspath(policy_file(policy))
        load_policy(file, {**(vars or {}), "workspace": "/session/workspace"}, check_paths=False)
        # -E -s: no PYTHON* variable and no user site decide what the launcher imports
        # (the session's environment is the tool's, and the model writes the workspace
        # through the SDK's own file operations); the sandlock this process runs is put
        # first on its path by name instead.
        self._launcher = [sys.executable, "-E", "-s", "-P", "-c", _LAUNCH.format(
            os.path.dirname(PACKAGE_DIR)), "run", "--policy", file]
        for name, value in (vars or {}).items():
            self._launcher += ["--var", f"{name}={value}"]

    async def create(self, **kwargs: Any) -> Any:
        return self._confine(await super().create(**kwargs))

    async def resume(self, state: Any) -> Any:
        return self._confine(await super().resume(state))

    def _confine(self, session: Any) -> Any:
        inner: Any = session._inner
        if type(inner) is not UnixLocalSandboxSession:
            raise TypeError(f"expected a UnixLocalSandboxSession, not {type(inner).__name__}")
        inner.__class__ = _SandlockSession  # adds one method, no state of its own
        cast(Any, inner)._sandlock_launcher = list(self._launcher)
        return session


class _SandlockSession(UnixLocalSandboxSession):
    """The SDK's local session, its one confinement hook answered by ``sandlock run``
    (the launcher runs with the caller's HOME: sandlock's state directory is never in
    the workspace the session makes HOME; the tool gets the policy's HOME)."""

    _sandlock_launcher: list[str]

    async def _resolved_exec_context(self) -> tuple[dict[str, str], str]:
        """The session's environment, which the SDK starts the command line with, with
        this process's values of the variables that decide what sandlock's launcher
        (unconfined, the command line's first program) loads or trusts
        (:func:`launcher_environment`)."""
        env, cwd = await super()._resolved_exec_context()
        return launcher_environment(env), cwd

    def _confined_exec_command(self, *, command_parts: list[str], workspace_root: Path,
                               env: Mapping[str, str]) -> list[str]:
        return [*self._sandlock_launcher, "--var", f"workspace={workspace_root}", "--",
                *command_parts]


#: The launcher's main, its package's directory put first on its import path.
_LAUNCH = "import sys; sys.path.insert(0, {0!r}); from sandlock.cli.run import main; main()"


def _launcher_variable(name: str) -> bool:
    """Variables that decide what sandlock's own launcher loads or trusts: the dynamic
    loader's, sandlock's, where its state and temporary files are, whose home."""
    return (name.startswith(("LD_", "SANDLOCK_", "GCONV_", "MALLOC_", "GLIBC_"))
            or name in ("HOME", "XDG_CACHE_HOME", "TMPDIR", "LOCPATH", "HOSTALIASES"))


def launcher_environment(session: Mapping[str, str]) -> dict[str, str]:
    """The session's environment (the host's and the manifest's) with this process's value
    of each variable that decides what sandlock's launcher loads or trusts
    (:func:`_launcher_variable`) instead of the session's: the launcher, unconfined, is
    started with it, and a manifest's ``LD_PRELOAD`` or ``SANDLOCK_*`` naming the workspace
    (which the model writes through the SDK's file operations) would run or steer it. The
    loader reads ``LD_PRELOAD`` before any program could unset it. ``HOME`` is the
    caller's: sandlock's state directory is never in the session's home (the tool gets the
    policy's). The other variables stay the session's, for the tool as the policy passes
    them (``PYTHON*`` among them: the launcher runs ``-E``)."""
    mine = {**os.environ, "HOME": os.path.expanduser("~")}
    out = {name: value for name, value in session.items() if not _launcher_variable(name)}
    out.update((name, value) for name, value in mine.items() if _launcher_variable(name))
    return out
