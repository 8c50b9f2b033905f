"""The agent-framework adapters (sandlock.integrations: langchain, deepagents,
openai_agents): a wrapped tool runs confined, keeps its interface, and its failures
reach the model as the tool's answer.

Each attack (a tool reading a secret outside its grant) has its positive control: the
same tool unwrapped, or wrapped under a policy that grants the secret, reads it. A
framework that is not installed skips its tests, unless SANDLOCK_EXPECT_INTEGRATIONS=1
(CI), where they fail.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import framework_tools
import pytest

import sandlock

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SECRET = "sk-planted-secret"
#: deepagents' file tools run python3 from PATH: the system's, which the shell profile
#: grants (the test runner's PATH may name a venv's first)
SYSTEM_PATH = {"PATH": "/usr/bin:/bin"}


def need(module: str) -> ModuleType:
    """``module``, or skip (fail where SANDLOCK_EXPECT_INTEGRATIONS=1)."""
    if os.environ.get("SANDLOCK_EXPECT_INTEGRATIONS") == "1":
        return importlib.import_module(module)
    return cast(ModuleType, pytest.importorskip(module, reason=f"{module} is not installed (the "
                                                "'langchain' or 'agents' extra); CI sets "
                                                "SANDLOCK_EXPECT_INTEGRATIONS=1"))


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    """A workspace with a note, and a secret in a directory beside it (no grant)."""
    workspace, vault = tmp_path / "workspace", tmp_path / "vault"
    workspace.mkdir()
    vault.mkdir()
    (workspace / "note.md").write_text("water the plants\n")
    (vault / "key").write_text(SECRET)
    tmp_path.chmod(0o755)
    return {"workspace": str(workspace), "note": str(workspace / "note.md"),
            "vault": str(vault), "secret": str(vault / "key")}


def policy(*read: str) -> dict[str, Any]:
    """The python profile, this directory (the tools' module) and ``read``."""
    return {"extends": ["python"], "filesystem": {"read": [str(TESTS), *read]}}


# ----------------------------------------------------------------------------
# Wrapping: lazy, refused early, and the interface kept


def test_sandlock_imports_no_framework() -> None:
    code = ("import sys, sandlock, sandlock.integrations, sandlock.integrations._tools\n"
            "sandlock.Sandbox, sandlock.Registry\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'langchain', 'langchain_core', 'langgraph', 'deepagents', 'agents', 'openai'}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (0, "[]\n", "")


def test_wrapping_refuses_what_could_not_run_confined() -> None:
    langchain = need("sandlock.integrations.langchain")
    agents = need("sandlock.integrations.openai_agents")

    def local(path: str) -> str:
        """A closure: the confined process cannot import it."""
        return path

    async def reader(path: str) -> str:
        """A coroutine function."""
        return path

    for wrap in (langchain.sandboxed_tool, agents.sandboxed_function_tool):
        with pytest.raises(TypeError, match="define it at module level"):
            wrap(local, policy=policy())
        with pytest.raises(TypeError, match="coroutine function"):
            wrap(reader, policy=policy())
        with pytest.raises(TypeError, match="exactly one of .*never run unconfined"):
            wrap(framework_tools.read_text)
        with pytest.raises(TypeError, match="got policy, sandbox"):
            wrap(framework_tools.read_text, policy=policy(), sandbox=sandlock.Sandbox(policy()))
        with pytest.raises(sandlock.PolicyError, match="unknown tool 'read_text'"):
            wrap(framework_tools.read_text, registry=sandlock.Registry(REPO / "policies"))


def test_langchain_tool_keeps_its_interface() -> None:
    need("langchain_core")
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from sandlock.integrations.langchain import sandboxed_tool

    plain = tool(framework_tools.read_text)
    wrapped = sandboxed_tool(framework_tools.read_text, policy=policy())
    assert (wrapped.name, wrapped.description) == (plain.name, plain.description)
    assert convert_to_openai_tool(wrapped) == convert_to_openai_tool(plain)  # what the model sees


def test_openai_agents_tool_keeps_its_interface() -> None:
    need("agents")
    from agents import function_tool

    from sandlock.integrations.openai_agents import sandboxed_function_tool

    plain = function_tool(framework_tools.read_text)
    wrapped = sandboxed_function_tool(framework_tools.read_text, policy=policy())
    assert (wrapped.name, wrapped.description) == (plain.name, plain.description)
    assert wrapped.params_json_schema == plain.params_json_schema


# ----------------------------------------------------------------------------
# LangChain / LangGraph


def _tool_node_answers(tool: Any, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """What a LangGraph ToolNode answers to these tool calls, in order."""
    need("langgraph")
    from langchain_core.messages import AIMessage
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode([tool]))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    request = AIMessage("", tool_calls=[{"name": name, "args": args, "id": str(i)}
                                        for i, (name, args) in enumerate(calls)])
    return list(graph.compile().invoke({"messages": [request]})["messages"][1:])


def test_langchain_tool_reads_its_grant_not_a_secret(places: dict[str, str]) -> None:
    need("langchain_core")
    from langchain_core.tools import tool

    from sandlock.integrations.langchain import sandboxed_tool

    wrapped = sandboxed_tool(framework_tools.read_text, policy=policy("${workspace}"),
                             vars={"workspace": places["workspace"]})
    note, secret = _tool_node_answers(wrapped, [("read_text", {"path": places["note"]}),
                                                ("read_text", {"path": places["secret"]})])
    assert (note.status, note.content) == ("success", "water the plants\n")
    assert secret.status == "error" and secret.content.startswith("PermissionError:")
    assert SECRET not in secret.content
    # positive controls: the tool unwrapped, and wrapped without the refusal, read it
    assert tool(framework_tools.read_text).invoke({"path": places["secret"]}) == SECRET
    granted = sandboxed_tool(framework_tools.read_text, policy=policy(places["vault"]))
    assert granted.invoke({"path": places["secret"]}) == SECRET


def test_langchain_tool_errors_reach_the_model(places: dict[str, str]) -> None:
    need("langchain_core")
    from sandlock.integrations.langchain import sandboxed_tool

    own = sandboxed_tool(framework_tools.close_ticket, policy=policy())
    [answer] = _tool_node_answers(own, [("close_ticket", {"ticket": 7})])
    assert (answer.status, answer.content) == ("error", "TicketError: no such ticket: 7")
    # sandlock's own refusal (the tools' module is not granted) is an answer too
    ungranted = sandboxed_tool(framework_tools.read_text, policy={"extends": ["python"]})
    [answer] = _tool_node_answers(ungranted, [("read_text", {"path": places["note"]})])
    assert answer.status == "error" and "could not load the function" in answer.content
    # and the async path (an async agent's tool calls)
    wrapped = sandboxed_tool(framework_tools.read_text, policy=policy())
    result = asyncio.run(wrapped.ainvoke({"type": "tool_call", "id": "1", "name": "read_text",
                                          "args": {"path": places["secret"]}}))
    assert result.status == "error" and result.content.startswith("PermissionError:")


def test_langchain_decorated_tool_from_a_registry(places: dict[str, str], tmp_path: Path) -> None:
    need("langchain_core")
    import framework_lc_tools

    from sandlock.integrations.langchain import sandboxed_tool

    registry = tmp_path / "tools"
    registry.mkdir()
    (registry / "read_file.toml").write_text(
        'version = 1\nextends = ["venv"]\n'
        f'[filesystem]\nread = [{str(TESTS)!r}, "${{workspace}}"]\n')
    registry.chmod(0o755)
    wrapped = sandboxed_tool(framework_lc_tools.read_file, registry=sandlock.Registry(registry),
                             vars={"venv": sys.prefix, "workspace": places["workspace"]})
    assert wrapped.name == "read_file"
    assert wrapped.invoke({"path": places["note"]}) == "water the plants\n"


# ----------------------------------------------------------------------------
# deepagents


def test_deepagents_backend_confines_commands_and_files(places: dict[str, str]) -> None:
    need("deepagents")
    from sandlock.integrations.deepagents import SandlockBackend

    backend = SandlockBackend(places["workspace"], env=SYSTEM_PATH)  # the shell profile
    written = Path(places["workspace"], "sub", "out.txt")
    assert backend.write(str(written), "made in the sandbox\n").error is None
    assert written.read_text() == "made in the sandbox\n"
    run = backend.execute("cat note.md sub/out.txt")
    assert (run.exit_code, run.output) == (0, "water the plants\nmade in the sandbox\n")
    read = backend.read(places["note"]).file_data
    assert read is not None and "water the plants" in read["content"]

    run = backend.execute(f"cat {places['secret']}")
    assert run.exit_code == 1 and "Permission denied" in run.output and SECRET not in run.output
    assert backend.read(places["secret"]).error is not None
    [down] = backend.download_files([places["secret"]])
    assert (down.content, down.error) == (None, "permission_denied")
    [up] = backend.upload_files([(os.path.join(places["vault"], "planted"), b"x")])
    assert up.error == "permission_denied" and not Path(places["vault"], "planted").exists()
    # positive control: the same backend under a policy that grants the vault
    open_vault = SandlockBackend(places["workspace"], env=SYSTEM_PATH, policy={
        "extends": ["shell"], "filesystem": {"read": [places["vault"]]}})
    assert open_vault.execute(f"cat {places['secret']}").output == SECRET
    assert open_vault.download_files([places["secret"]])[0].content == SECRET.encode()


def test_deepagents_backend_reports_timeouts_and_refusals(places: dict[str, str]) -> None:
    need("deepagents")
    from sandlock.integrations.deepagents import SandlockBackend

    backend = SandlockBackend(places["workspace"], env=SYSTEM_PATH, timeout=0.5)
    run = backend.execute("sleep 5")
    assert run.exit_code == 124 and "timed out after 0.5 s" in run.output
    assert backend.execute("").exit_code == 1
    refused = backend.execute("echo \0")  # Sandbox.run refuses a NUL: an answer, not a raise
    assert refused.exit_code == 125 and refused.output.startswith("[sandlock: ValueError")
    [missing] = backend.download_files(["nowhere.txt"])
    assert missing.error == "file_not_found"


# ----------------------------------------------------------------------------
# OpenAI Agents SDK


def test_openai_agents_tool_reads_its_grant_not_a_secret(places: dict[str, str]) -> None:
    need("agents")
    from agents import Agent, Runner, function_tool, set_tracing_disabled
    from agents.testing import ScriptedModel, assistant_message, function_call

    from sandlock.integrations.openai_agents import sandboxed_function_tool

    set_tracing_disabled(True)
    box = sandlock.Sandbox(policy("${workspace}"), vars={"workspace": places["workspace"]})
    tools: list[Any] = [sandboxed_function_tool(framework_tools.read_text, sandbox=box),
             sandboxed_function_tool(framework_tools.close_ticket, sandbox=box),
             function_tool(framework_tools.read_text, name_override="unconfined_read")]
    model = ScriptedModel([
        [function_call("read_text", {"path": places["note"]}, call_id="1")],
        [function_call("read_text", {"path": places["secret"]}, call_id="2")],
        [function_call("close_ticket", {"ticket": 7}, call_id="3")],
        [function_call("unconfined_read", {"path": places["secret"]}, call_id="4")],
        [assistant_message("done")],
    ])
    agent = Agent(name="t", instructions="", model=model, tools=tools)
    result = Runner.run_sync(agent, "go")
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert result.final_output == "done"
    assert outputs[0] == "water the plants\n"
    assert outputs[1].startswith("PermissionError:") and SECRET not in outputs[1]
    assert outputs[2] == "TicketError: no such ticket: 7"
    assert outputs[3] == SECRET  # positive control: the same function, unwrapped


def test_openai_agents_sandbox_client_confines_commands(places: dict[str, str]) -> None:
    need("agents")
    from agents.sandbox import Manifest
    from agents.sandbox.sandboxes.unix_local import UnixLocalSandboxClient

    from sandlock.integrations.openai_agents import SandlockSandboxClient

    async def run(client: Any, *commands: str) -> list[Any]:
        session = await client.create(manifest=Manifest(root=places["workspace"]))
        async with session:
            return [await session.exec(command) for command in commands]

    made, leak = asyncio.run(run(SandlockSandboxClient(), "echo made > out; cat out note.md",
                                 f"cat {places['secret']}"))
    assert (made.exit_code, made.stdout) == (0, b"made\nwater the plants\n")
    assert leak.exit_code == 1 and b"Permission denied" in leak.stderr
    assert SECRET.encode() not in leak.stdout + leak.stderr
    with pytest.raises(sandlock.PolicyError, match="no-such-profile"):
        SandlockSandboxClient("no-such-profile")
    # positive control: the SDK's own local client runs the same command unconfined
    [control] = asyncio.run(run(UnixLocalSandboxClient(), f"cat {places['secret']}"))
    assert (control.exit_code, control.stdout) == (0, SECRET.encode())


_PLANTED = "import os\nopen({proof!r}, 'w').write('UNCONFINED %d' % os.getuid())\n"


def test_openai_agents_sandbox_client_launcher_ignores_the_sessions_python_path(
        tmp_path: Path) -> None:
    """The SDK starts each command with the session's environment (the host's and the
    manifest's); a manifest that puts a workspace directory on PYTHONPATH (for the
    agent's Python commands) must not decide what sandlock's own launcher, unconfined,
    imports: the model writes the workspace through the SDK's file operations, which
    are not confined. Control: the launcher as it was started before (``-P -m
    sandlock``, the session's environment) runs the planted package."""
    need("agents")
    import io

    from agents.sandbox import Manifest

    from sandlock.integrations.openai_agents import SandlockSandboxClient

    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    proof = tmp_path / "proof"
    environment = {"PYTHONPATH": f"{workspace}/src"}

    async def run() -> list[Any]:
        client = SandlockSandboxClient("shell")
        manifest = Manifest(root=str(workspace), environment=cast(Any, {"value": environment}))
        session = await client.create(manifest=manifest)
        async with session:
            first = await session.exec("echo first")
            await session.write("src/sandlock/__init__.py", io.BytesIO(b""))
            await session.write("src/sandlock/__main__.py",
                                io.BytesIO(_PLANTED.format(proof=str(proof)).encode()))
            return [first, await session.exec("echo second")]

    first, second = asyncio.run(run())
    assert not proof.exists(), proof.read_text()
    assert (first.exit_code, first.stdout) == (0, b"first\n"), first.stderr
    assert (second.exit_code, second.stdout) == (0, b"second\n"), second.stderr
    control = subprocess.run([sys.executable, "-P", "-m", "sandlock", "run", "--policy", "shell",
                              "--", "true"], cwd="/", capture_output=True, timeout=60,
                             env={**os.environ, **environment})
    assert proof.read_text().startswith("UNCONFINED"), control.stderr


def test_openai_agents_sandbox_client_launcher_keeps_its_own_loader_and_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables that decide what the launcher loads or trusts are this process's,
    whatever the session's environment says; the others stay the session's (the tool's)."""
    need("agents")
    from sandlock.integrations.openai_agents import launcher_environment

    monkeypatch.setenv("SANDLOCK_NATIVE", "1")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    seen = launcher_environment({"LD_PRELOAD": "/ws/evil.so", "SANDLOCK_NATIVE": "0",
                                 "SANDLOCK_ABI": "3", "XDG_CACHE_HOME": "/ws",
                                 "PYTHONPATH": "/ws", "GREETING": "hello", "HOME": "/ws"})
    assert "LD_PRELOAD" not in seen and "SANDLOCK_ABI" not in seen
    assert seen["SANDLOCK_NATIVE"] == "1" and seen["HOME"] == os.path.expanduser("~")
    assert seen.get("XDG_CACHE_HOME") == os.environ.get("XDG_CACHE_HOME")
    assert seen["PYTHONPATH"] == "/ws" and seen["GREETING"] == "hello"  # the tool's


_PRELOAD = """\
#include <stdio.h>
__attribute__((constructor)) static void ran(void) {
    FILE *proof = fopen("%s", "w");
    if (proof) fputs("UNCONFINED", proof), fclose(proof);
}
"""


def test_openai_agents_sandbox_client_launcher_loads_no_preload_of_the_session(
        tmp_path: Path) -> None:
    """A manifest's LD_PRELOAD naming a library the model wrote into the workspace: the
    loader of the command line's first program (unconfined) reads it before that program
    could unset it. Control: a program started with the session's environment as the SDK
    had it runs the library."""
    need("agents")
    import io
    import shutil

    from agents.sandbox import Manifest

    from sandlock.integrations.openai_agents import SandlockSandboxClient

    if not shutil.which("cc"):
        pytest.skip("builds a library: needs a C compiler (build-essential)")
    proof = tmp_path / "proof"
    (tmp_path / "evil.c").write_text(_PRELOAD % proof)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "evil.so"),
                    str(tmp_path / "evil.c")], check=True)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    environment = {"LD_PRELOAD": f"{workspace}/x.so"}

    async def run() -> Any:
        client = SandlockSandboxClient("shell")
        manifest = Manifest(root=str(workspace), environment=cast(Any, {"value": environment}))
        session = await client.create(manifest=manifest)
        async with session:
            await session.write("x.so", io.BytesIO((tmp_path / "evil.so").read_bytes()))
            return await session.exec("echo confined")

    done = asyncio.run(run())
    assert not proof.exists(), proof.read_text()
    assert (done.exit_code, done.stdout) == (0, b"confined\n"), done.stderr
    subprocess.run(["/usr/bin/env", "true"], env={**os.environ, **environment}, check=False)
    assert proof.read_text() == "UNCONFINED"


# ----------------------------------------------------------------------------
# The examples, as a user runs them


@pytest.mark.parametrize("example, framework", [
    ("langchain_agent.py", "langchain"), ("deepagents_backend.py", "deepagents"),
    ("openai_agents_tool.py", "agents")])
def test_example_runs_offline(example: str, framework: str) -> None:
    need(framework)
    run = subprocess.run([sys.executable, str(REPO / "examples" / example)], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PermissionError" in run.stdout or "permission_denied" in run.stdout, run.stdout
    assert "sk-not-for-tools" not in run.stdout
    if example == "openai_agents_tool.py":  # and the SandboxAgent's shell, confined
        assert "made" in run.stdout and "api-key: Permission denied" in run.stdout
