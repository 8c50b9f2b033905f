"""An OpenAI Agents SDK agent whose function tool runs confined by sandlock, offline
(the SDK's ScriptedModel; no network, no API key).

    python examples/openai_agents_tool.py

The model asks the tool for a note in the workspace, then for a file outside it: the
first call returns the note, the second comes back to the model as the tool's output
("PermissionError: ..."), and the run goes on to its final answer. Then a SandboxAgent
on sandlock's sandbox client runs shell commands: one in its workspace works, ``cat``
of the key file is refused. The tool's function
is at module level and this module imports no framework at the top: the confined
process imports the function's module afresh on every call.
"""

from __future__ import annotations

import os
import sys
import tempfile


def read_note(path: str) -> str:
    """Read a text file and return its content.

    Args:
        path: the file to read.
    """
    with open(path, encoding="utf-8") as file:
        return file.read()


def main() -> int:
    from agents import Agent, RunConfig, Runner, set_tracing_disabled
    from agents.run_config import SandboxRunConfig
    from agents.sandbox import Manifest, SandboxAgent
    from agents.testing import ScriptedModel, assistant_message, function_call

    import sandlock
    from sandlock.integrations.openai_agents import SandlockSandboxClient, sandboxed_function_tool

    set_tracing_disabled(True)  # offline: nothing is exported
    workspace = tempfile.mkdtemp()
    note = os.path.join(workspace, "todo.md")
    with open(note, "w", encoding="utf-8") as file:
        file.write("water the plants\n")
    secret = os.path.join(tempfile.mkdtemp(), "api-key")  # outside the grant
    with open(secret, "w", encoding="utf-8") as file:
        file.write("sk-not-for-tools\n")

    here = os.path.dirname(os.path.abspath(__file__))
    policy = {"extends": ["python"], "filesystem": {"read": ["${workspace}", here]}}
    tool = sandboxed_function_tool(read_note, policy=policy, vars={"workspace": workspace})

    model = ScriptedModel([
        [function_call("read_note", {"path": note}, call_id="1")],
        [function_call("read_note", {"path": secret}, call_id="2")],
        [assistant_message("The note says to water the plants; the key file is off limits.")],
    ])
    agent = Agent(name="notes", instructions="Answer from the notes.", model=model, tools=[tool])
    result = Runner.run_sync(agent, "What is in my notes?")
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    for output in outputs:
        print(f"tool read_note: {output!r}")
    print("agent:", result.final_output)

    # A SandboxAgent's shell, through sandlock's client (the "shell" profile by default)
    model = ScriptedModel([
        [function_call("exec_command", {"cmd": "echo made > out.txt && cat out.txt"}, call_id="1")],
        [function_call("exec_command", {"cmd": f"cat {secret}"}, call_id="2")],
        [assistant_message("The workspace is writable; the key is out of reach.")],
    ])
    shell_agent = SandboxAgent(name="shell", instructions="Work in the workspace.", model=model)
    sandbox = SandboxRunConfig(client=SandlockSandboxClient(), manifest=Manifest(root=workspace))
    result = Runner.run_sync(shell_agent, "Try the shell", run_config=RunConfig(sandbox=sandbox))
    shell = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    for output in shell:
        print(f"tool exec_command: {output.splitlines()[2:]!r}")  # after chunk id and time
    print("agent:", result.final_output)
    sandlock.shutdown()
    return 1 if any("sk-not-for-tools" in str(o) for o in outputs + shell) else 0


if __name__ == "__main__":
    sys.exit(main())
