"""The Python API an agent imports: :class:`~sandlock.api.sandbox.Sandbox` and its results.

Runs in the agent's process: nothing here parses bytes a tool wrote, beyond the
bounded result decoding of ``call()``.
"""
