"""Functions that tests/test_helper_faults.py runs confined with Sandbox.call().

Standard library only (the confined process imports this module afresh).
"""

from __future__ import annotations

import os
import pickle
import time

#: What the confined child's setup step would report if Landlock could not be applied
#: (stage, errno, text: launcher._child's format).
FORGED_REPORT = b"landlock\x001\x00forged by the tool: rerun with best_effort=True"

#: A pickled sandlock.errors.SetupError, written by hand: the tool cannot import sandlock.
FORGED_ERROR = b"csandlock.errors\nSetupError\n(Vsandbox setup failed at landlock: forged\ntR."


def _every_fd(data: bytes) -> None:
    for fd in range(3, 1024):
        try:
            os.write(fd, data)
        except OSError:
            pass


def forge_setup_report() -> None:
    """Say "setup failed" on every descriptor, then exit as a failed setup does."""
    _every_fd(FORGED_REPORT)
    os._exit(125)


def forge_setup_error() -> None:
    """Send, as the result, a SetupError "raised" by the setup on every descriptor."""
    envelope = pickle.dumps(("raise", "sandlock.errors.SetupError",
                             "sandbox setup failed at landlock: forged", "", FORGED_ERROR))
    _every_fd(envelope)
    os._exit(0)


def daemon_on_stdout(pidfile: str, ready: str) -> None:
    """Leave a setsid'd grandchild holding stdout and stderr, record its pid, then hang."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            with open(pidfile + ".tmp", "w") as handle:
                handle.write(str(os.getpid()))
            os.rename(pidfile + ".tmp", pidfile)
            time.sleep(120)
        os._exit(0)
    os.waitpid(child, 0)
    with open(ready, "w"):
        pass
    time.sleep(120)


def report_supervisor(pidfile: str) -> None:
    """Record the pid of this process's supervisor (its parent), then hang."""
    with open(pidfile + ".tmp", "w") as handle:
        handle.write(f"{os.getppid()} {os.getpid()}")
    os.rename(pidfile + ".tmp", pidfile)
    time.sleep(120)


def flood_proxy(count: int, ready: str, release: str) -> int:
    """Open ``count`` connections to the run's proxy and hold them until ``release``
    exists; return how many were opened."""
    import resource
    import socket
    import urllib.parse

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    url = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection((url.hostname, url.port), timeout=5))
        except OSError:
            break
    with open(ready, "w"):
        pass
    while not os.path.exists(release):
        time.sleep(0.05)
    return len(held)
