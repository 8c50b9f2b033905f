"""Tool functions that tests/test_frameworks.py wraps for LangChain, deepagents and the
OpenAI Agents SDK and runs confined.

Standard library only: the confined process imports this module afresh on every call,
and the test policy grants read on this directory and the standard library only.
"""

from __future__ import annotations


class TicketError(Exception):
    """A tool's own error, which the model must read as the tool's answer."""


def read_text(path: str) -> str:
    """Read a text file and return its content.

    Args:
        path: the file to read.
    """
    with open(path, encoding="utf-8") as file:
        return file.read()


def close_ticket(ticket: int) -> str:
    """Close a ticket by its number.

    Args:
        ticket: the ticket's number.
    """
    raise TicketError(f"no such ticket: {ticket}")
