"""A tool function that tests/test_adapter_timeouts.py wraps for LangChain and the OpenAI
Agents SDK and runs confined under a policy with a short ``[limits] timeout``.

Standard library only: the confined process imports this module afresh on every call,
and the test policy grants read on this directory and the standard library only.
"""

from __future__ import annotations

import time


def linger(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: how long to wait.
    """
    time.sleep(seconds)
    return "still-running"
