"""A LangChain ``@tool`` (the module's name is the tool, its function is ``.func``),
which tests/test_frameworks.py confines: the confined process imports langchain_core."""

from __future__ import annotations

from langchain_core.tools import tool


@tool
def read_file(path: str) -> str:
    """Read a text file and return its content."""
    with open(path, encoding="utf-8") as file:
        return file.read()
