"""A LangChain agent whose tool runs confined by sandlock, offline (a scripted model).

    python examples/langchain_agent.py

The model asks the tool for a note in the workspace, then for a file outside it: the
first call returns the note, the second comes back to the model as the tool's error
(PermissionError), and the agent carries on. The tool's function is at module level
and this module imports no framework at the top: the confined process imports the
function's module afresh on every call, and LangChain would cost it about a second.
"""

from __future__ import annotations

import os
import sys
import tempfile


def read_note(path: str) -> str:
    """Read a text file and return its content."""
    with open(path, encoding="utf-8") as file:
        return file.read()


def main() -> int:
    from langchain.agents import create_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage

    import sandlock
    from sandlock.integrations.langchain import sandboxed_tool

    class ScriptedModel(GenericFakeChatModel):
        """Plays its messages in order; tools are bound by the agent, and ignored."""

        def bind_tools(self, tools: object, **kwargs: object) -> "ScriptedModel":
            return self

    workspace = tempfile.mkdtemp()
    note = os.path.join(workspace, "todo.md")
    with open(note, "w", encoding="utf-8") as file:
        file.write("water the plants\n")
    secret = os.path.join(tempfile.mkdtemp(), "api-key")  # outside the grant
    with open(secret, "w", encoding="utf-8") as file:
        file.write("sk-not-for-tools\n")

    here = os.path.dirname(os.path.abspath(__file__))
    policy = {"extends": ["python"], "filesystem": {"read": ["${workspace}", here]}}
    tool = sandboxed_tool(read_note, policy=policy, vars={"workspace": workspace})

    model = ScriptedModel(messages=iter([
        AIMessage("", tool_calls=[{"name": "read_note", "args": {"path": note}, "id": "1"}]),
        AIMessage("", tool_calls=[{"name": "read_note", "args": {"path": secret}, "id": "2"}]),
        AIMessage("The note says to water the plants; the key file is off limits."),
    ]))
    agent = create_agent(model, tools=[tool])
    state = agent.invoke({"messages": [HumanMessage("What is in my notes?")]})
    for message in state["messages"]:
        if message.type == "tool":
            print(f"tool {message.name} [{message.status}]: {message.content!r}")
    print("agent:", state["messages"][-1].content)
    sandlock.shutdown()
    leaked = any("sk-not-for-tools" in str(m.content) for m in state["messages"])
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
