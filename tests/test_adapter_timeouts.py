"""A policy's ``[limits] timeout`` is a ceiling: the framework adapters, the model's
requested ``timeout`` and ``Sandbox.run(timeout=)`` may shorten it, never lift it.

The attack: a command that outlives the policy's limit and then prints
``still-running``, asked to run with no timeout (the adapter's default stood in for the
policy's) or with the longest the model may ask for (deepagents lets it ask for an
hour). Its positive controls: the same command under a longer limit prints it (so a
missing line means the limit ended it, not that it never ran), and a timeout shorter
than the policy's still ends it early (narrowing works).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

import pytest
import timeout_tools
from conftest import require_abi
from test_frameworks import SYSTEM_PATH, TESTS, need

import sandlock

#: Outlives LIMIT, then says so.
SLOW = "sleep 2; echo still-running"
LIMIT = "1s"
#: The longest timeout deepagents lets the model ask for (max_execute_timeout).
MODEL_MAX = 3600


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "the Python API")


def capped(limit: str) -> dict[str, Any]:
    """The shell profile, its ``timeout`` replaced by ``limit``."""
    return {"version": 1, "extends": ["shell"], "limits": {"timeout": limit}}


#: Python and sh, the workspace writable, and no ``timeout`` anywhere in the chain.
UNLIMITED = {"version": 1, "extends": ["python"],
             "filesystem": {"read": [str(TESTS)], "write": ["${workspace}"],
                            "exec": ["/bin/sh", "/usr/bin/sleep", "/usr/bin/echo"]}}


# ----------------------------------------------------------------------------
# deepagents: SandlockBackend.execute


@pytest.mark.parametrize("asked", [None, MODEL_MAX], ids=["no-request", "model-asks-an-hour"])
@pytest.mark.parametrize("backend_timeout", [None, 600], ids=["default", "backend-600s"])
def test_deepagents_cannot_lift_the_policy_timeout(tmp_path: Path, asked: Optional[int],
                                                   backend_timeout: Optional[float]) -> None:
    need("deepagents")
    from sandlock.integrations.deepagents import SandlockBackend

    options: dict[str, Any] = {} if backend_timeout is None else {"timeout": backend_timeout}
    backend = SandlockBackend(str(tmp_path), policy=capped(LIMIT), env=SYSTEM_PATH, **options)
    run = backend.execute(SLOW, timeout=asked)
    assert run.exit_code == 124 and "still-running" not in run.output, run.output
    assert "timed out after 1 s" in run.output


def test_deepagents_timeouts_still_narrow(tmp_path: Path) -> None:
    """Controls: under a longer policy limit the command completes; a request or a
    backend timeout shorter than the policy's ends it early."""
    need("deepagents")
    from sandlock.integrations.deepagents import SandlockBackend

    backend = SandlockBackend(str(tmp_path), policy=capped("30s"), env=SYSTEM_PATH)
    done = backend.execute(SLOW)
    assert (done.exit_code, done.output) == (0, "still-running\n")
    asked = backend.execute(SLOW, timeout=1)
    assert asked.exit_code == 124 and "still-running" not in asked.output
    assert "timed out after 1 s" in asked.output
    shorter = SandlockBackend(str(tmp_path), policy=capped("30s"), env=SYSTEM_PATH, timeout=0.5)
    cut = shorter.execute(SLOW)
    assert cut.exit_code == 124 and "timed out after 0.5 s" in cut.output


@pytest.mark.parametrize("asked", [None, MODEL_MAX], ids=["no-request", "model-asks-an-hour"])
def test_deepagents_default_applies_without_a_policy_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: Optional[int]) -> None:
    """A policy with no timeout: the backend's documented default bounds the command,
    and the model cannot ask past it either."""
    need("deepagents")
    from sandlock.integrations import deepagents

    monkeypatch.setattr(deepagents, "DEFAULT_TIMEOUT", 1)
    backend = deepagents.SandlockBackend(str(tmp_path), policy=UNLIMITED, env=SYSTEM_PATH)
    assert backend.sandbox.policy.limits.timeout is None
    run = backend.execute(SLOW, timeout=asked)
    assert run.exit_code == 124 and "still-running" not in run.output, run.output
    assert "timed out after 1 s" in run.output
    monkeypatch.setattr(deepagents, "DEFAULT_TIMEOUT", 30)  # control: the same, longer
    assert backend.execute(SLOW).output == "still-running\n"


# ----------------------------------------------------------------------------
# The API: Sandbox.run / popen / run_async(timeout=)


def _api(box: sandlock.Sandbox, how: str, timeout: Optional[float]) -> tuple[int, bytes]:
    argv = ["/bin/sh", "-c", SLOW]
    if how == "run":
        result = box.run(argv, capture_output=True, timeout=timeout)
        return result.returncode, result.stdout
    if how == "run_async":
        result = asyncio.run(box.run_async(argv, capture_output=True, timeout=timeout))
        return result.returncode, result.stdout
    with box.popen(argv, stdout=sandlock.PIPE, timeout=timeout) as process:
        out, _ = process.communicate()
        return process.wait(), out


@pytest.mark.parametrize("how", ["run", "popen", "run_async"])
def test_api_timeout_cannot_lift_the_policy_timeout(tmp_path: Path, how: str) -> None:
    with sandlock.Sandbox(capped(LIMIT), vars={"workspace": str(tmp_path)}) as box:
        assert _api(box, how, MODEL_MAX) == (124, b"")


@pytest.mark.parametrize("how", ["run", "popen", "run_async"])
def test_api_timeout_still_narrows(tmp_path: Path, how: str) -> None:
    """Controls: under the longer policy the command completes, with or without a
    longer timeout; a shorter timeout ends it early."""
    with sandlock.Sandbox(capped("30s"), vars={"workspace": str(tmp_path)}) as box:
        assert _api(box, how, None) == (0, b"still-running\n")
        assert _api(box, how, 1) == (124, b"")
    with sandlock.Sandbox(UNLIMITED, vars={"workspace": str(tmp_path)}) as box:
        assert _api(box, how, MODEL_MAX) == (0, b"still-running\n")  # no policy limit: asked


# ----------------------------------------------------------------------------
# Function tools (LangChain, OpenAI Agents SDK) and the SDK's sandbox client: they pass
# no timeout of their own, so the policy's ends a tool that outlives it


def _tool_policy(limit: str) -> dict[str, Any]:
    return {"version": 1, "extends": ["python"], "filesystem": {"read": [str(TESTS)]},
            "limits": {"timeout": limit}}


def test_langchain_tool_ends_at_the_policy_timeout() -> None:
    need("langchain_core")
    from sandlock.integrations.langchain import sandboxed_tool

    slow = sandboxed_tool(timeout_tools.linger, policy=_tool_policy(LIMIT))
    answer = slow.invoke({"seconds": 2})
    assert "still-running" not in answer and "Timeout" in answer, answer
    control = sandboxed_tool(timeout_tools.linger, policy=_tool_policy("30s"))
    assert control.invoke({"seconds": 2}) == "still-running"


def test_openai_agents_tool_ends_at_the_policy_timeout() -> None:
    need("agents")
    from agents.tool_context import ToolContext  # what the SDK hands a tool it invokes

    from sandlock.integrations.openai_agents import sandboxed_function_tool

    async def invoke(limit: str) -> Any:
        tool = sandboxed_function_tool(timeout_tools.linger, policy=_tool_policy(limit),
                                       timeout=MODEL_MAX)
        context = ToolContext(context=None, tool_name=tool.name, tool_call_id="1",
                              tool_arguments='{"seconds": 2}')
        return await tool.on_invoke_tool(context, '{"seconds": 2}')

    answer = asyncio.run(invoke(LIMIT))
    assert "still-running" not in str(answer) and "Timeout" in str(answer), answer
    assert asyncio.run(invoke("30s")) == "still-running"  # control


def test_openai_agents_sandbox_client_ends_at_the_policy_timeout(tmp_path: Path) -> None:
    need("agents")
    from agents.sandbox import Manifest

    from sandlock.integrations.openai_agents import SandlockSandboxClient

    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def run(limit: str) -> Any:
        policy = tmp_path / f"p{limit}.toml"
        policy.write_text(f'version = 1\nextends = ["shell"]\n[limits]\ntimeout = "{limit}"\n')
        session = await SandlockSandboxClient(str(policy)).create(
            manifest=Manifest(root=str(workspace)))
        async with session:
            return await session.exec(SLOW, timeout=MODEL_MAX)

    cut = asyncio.run(run(LIMIT))
    assert cut.exit_code == 124 and b"still-running" not in cut.stdout, cut
    assert asyncio.run(run("30s")).stdout == b"still-running\n"  # control
