"""A deepagents agent on a sandlock backend, offline (a scripted model).

    python examples/deepagents_backend.py

The model writes a file in the workspace, runs a command there, reads a file outside
the workspace with the read tool and with the shell: the first two work, the last two
are refused by the sandbox (the shell profile grants the workspace, not the caller's
files) and come back to the model as the tools' errors.
"""

from __future__ import annotations

import os
import sys
import tempfile


def main() -> int:
    from deepagents import create_deep_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage

    import sandlock
    from sandlock.integrations.deepagents import SandlockBackend

    class ScriptedModel(GenericFakeChatModel):
        """Plays its messages in order; tools are bound by the agent, and ignored."""

        def bind_tools(self, tools: object, **kwargs: object) -> "ScriptedModel":
            return self

    workspace = tempfile.mkdtemp()
    secret = os.path.join(tempfile.mkdtemp(), "api-key")  # outside the workspace
    with open(secret, "w", encoding="utf-8") as file:
        file.write("sk-not-for-tools\n")
    # The built-in "shell" policy with the workspace filled in; deepagents' file tools run
    # python3 from PATH, so name the system's (which the policy grants), not a venv's.
    backend = SandlockBackend(workspace, env={"PATH": "/usr/bin:/bin"})

    def call(tool: str, args: dict[str, object], ident: str) -> AIMessage:
        return AIMessage("", tool_calls=[{"name": tool, "args": args, "id": ident}])

    hello = os.path.join(workspace, "hello.py")
    model = ScriptedModel(messages=iter([
        call("write_file", {"file_path": hello, "content": "print('hello from the sandbox')\n"}, "1"),
        call("execute", {"command": "python3 hello.py && ls"}, "2"),
        call("read_file", {"file_path": secret}, "3"),
        call("execute", {"command": f"cat {secret}"}, "4"),
        AIMessage("Done: the script ran; the key is out of reach."),
    ]))
    agent = create_deep_agent(model=model, backend=backend)
    state = agent.invoke({"messages": [HumanMessage("Write and run hello.py")]})
    for message in state["messages"]:
        if message.type == "tool":
            print(f"tool {message.name} [{message.status}]: {str(message.content).strip()!r}")
    print("agent:", state["messages"][-1].content)
    sandlock.shutdown()
    leaked = any("sk-not-for-tools" in str(m.content) for m in state["messages"])
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
