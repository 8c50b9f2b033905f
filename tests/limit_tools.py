"""A function tests/test_process_limit.py runs confined with Sandbox.call() (standard
library only: the confined process imports this module afresh)."""

from __future__ import annotations

import os
import time


def spawn_sleepers(count: int) -> int:
    """Fork up to ``count`` children that sleep (bounded: 30 s); return how many forks
    succeeded. The launcher kills the children when the call ends."""
    made = 0
    for _ in range(count):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
    return made
