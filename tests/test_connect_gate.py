"""The connect gate's own sockets (issue 22): the gate makes every TCP socket of the tool
(socket(2) notified, the socket installed with SECCOMP_IOCTL_NOTIF_ADDFD) and connects
its own reference, found by inode. What the tool does with its descriptor (dup, fork,
close, non-blocking connects, IPv6) must behave as without the gate, the gate's
references must never keep a connection open that the tool closed, and its table is
bounded. Real kernel, real CLI; ``tests/test_container_profile.py`` runs this file under
container runtimes' seccomp profiles too.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from test_network_allow import PROBE_HEAD, needs_kernel, net_policy, py

from sandlock.errors import KernelSupportError


class Peer:
    """A loopback TCP server that records, per connection, what it read and how long
    the connection stayed open after its first byte (None: no EOF within the window)."""

    def __init__(self, family: int = socket.AF_INET) -> None:
        host = "127.0.0.1" if family == socket.AF_INET else "::1"
        self.sock = socket.create_server((host, 0), family=family)
        self.port = self.sock.getsockname()[1]
        self.seen: list[tuple[bytes, float | None]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(4.0)
        data, start, eof = b"", 0.0, None
        try:
            while True:
                chunk = conn.recv(100)
                if not chunk:
                    eof = time.monotonic() - start
                    break
                if not data:
                    start = time.monotonic()
                data += chunk
        except OSError:
            pass
        conn.close()
        self.seen.append((data, eof))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    server = Peer()
    yield server
    server.close()


def wait_for(peer: Peer, count: int) -> list[tuple[bytes, float | None]]:
    end = time.monotonic() + 10
    while len(peer.seen) < count and time.monotonic() < end:
        time.sleep(0.05)
    return sorted(peer.seen, key=lambda item: item[0])


CLOSE_THEN_LINGER = """
import select
def blocking(data, close=True):
    s = socket.socket()  # no timeout: a blocking connect (a timeout makes it non-blocking)
    s.connect(("127.0.0.1", S))
    s.sendall(data)
    if close:
        s.close()
    return s
def non_blocking(data):
    s = socket.socket()
    s.setblocking(False)
    print("nb", errno.errorcode.get(s.connect_ex(("127.0.0.1", S)), "OK"))
    select.select([], [s], [], 5)
    print("so_error", s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
    s.setblocking(True)
    s.sendall(data)
    s.close()
"""


def test_a_connection_the_tool_closes_ends_at_once(tmp_path: Path, peer: Peer) -> None:
    """The gate holds the tool's socket until it is connected, then lets go: a close by
    the tool reaches the server while the tool still runs (the tool lingers 3 s).
    Positive control: a connection the tool keeps open sees no EOF in that time."""
    needs_kernel()
    policy = net_policy(tmp_path, [f"127.0.0.1:{peer.port}"])
    out = py(policy, PROBE_HEAD, f"S = {peer.port}", CLOSE_THEN_LINGER, """
        kept = blocking(b"c-kept", close=False)
        blocking(b"a-blocking")
        non_blocking(b"b-non-blocking")
        time.sleep(3)
        print("done")
    """.replace("time.sleep", "__import__('time').sleep"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["nb", "EINPROGRESS", "so_error", "0", "done"], out.stderr
    seen = wait_for(peer, 3)
    assert [data for data, _ in seen] == [b"a-blocking", b"b-non-blocking", b"c-kept"]
    for data, eof in seen[:2]:
        assert eof is not None and eof < 2.0, (data, eof)
    assert seen[2][1] is None or seen[2][1] > 2.5, seen[2]  # it ended with the tool only


def test_dup_fork_ipv6_and_a_second_connect(tmp_path: Path) -> None:
    """A socket moved to another number and connected in a forked child, over IPv6; a
    second connect says EISCONN as the kernel would; a refused connect leaves the
    socket usable for an allowed one."""
    needs_kernel()
    peer6 = Peer(socket.AF_INET6)
    try:
        policy = net_policy(tmp_path, [f"[::1]:{peer6.port}"])
        out = py(policy, PROBE_HEAD, f"S = {peer6.port}", """
            s = socket.socket(socket.AF_INET6)
            print("refused", err(lambda: s.connect(("::1", S + 1))))
            os.dup2(s.fileno(), 100)
            s.close()
            pid = os.fork()
            if pid == 0:
                t = socket.socket(fileno=100)
                code = err(lambda: t.connect(("::1", S)))
                t.sendall(b"from-child")
                again = err(lambda: t.connect(("::1", S)))
                t.close()
                os._exit(0 if (code, again) == ("OK", "EISCONN") else 1)
            os.close(100)
            print("child", os.waitpid(pid, 0)[1])
        """)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["refused", "EACCES", "child", "0"], out.stderr
        assert [data for data, _ in wait_for(peer6, 1)] == [b"from-child"]
    finally:
        peer6.close()


def test_a_tcp_socket_the_gate_did_not_make_cannot_connect(tmp_path: Path, peer: Peer) -> None:
    """An accepted socket is TCP but not the gate's: its connect is refused and reported
    (the kernel alone would say EISCONN; here nothing runs)."""
    needs_kernel()
    policy = net_policy(tmp_path, ["127.0.0.1:1024-65535"], extra="bind = [0]")
    out = py(policy, PROBE_HEAD, f"S = {peer.port}", """
        srv = socket.create_server(("127.0.0.1", 0))
        c = socket.create_connection(srv.getsockname(), 5)
        a, _ = srv.accept()
        print(err(lambda: a.connect(("127.0.0.1", S))))
    """)
    assert out.stdout.split() == ["EACCES"], out.stdout + out.stderr
    assert "socket sandlock did not make" in out.stderr


def test_the_held_table_is_bounded_and_forgets_closed_sockets(tmp_path: Path) -> None:
    """Sockets made and never connected are held until the table is full; then those
    the tool closed are dropped; a tool that keeps them all gets EMFILE and a report."""
    needs_kernel()
    from sandlock.net.connect import MAX_HELD

    policy = net_policy(tmp_path, ["api.internal.test:80"], extra="")
    out = py(policy, PROBE_HEAD, f"N = {MAX_HELD}", """
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
        for _ in range(3):  # made and closed: the table forgets them when full
            for _ in range(N):
                socket.socket().close()
        kept = []
        def more():
            kept.append(socket.socket())
        outcome = "OK"
        for _ in range(N + 1):
            outcome = err(more)
        print(len(kept), outcome)
        kept.pop().close()
        print(err(more))
    """, )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(MAX_HELD), "EMFILE", "OK"], out.stdout + out.stderr
    assert f"{MAX_HELD} TCP sockets made through the gate" in out.stderr


def test_a_kernel_without_addfd_send_is_refused_naming_the_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below Linux 5.14 the gate cannot install its sockets: the run is refused up front,
    and `sandlock check` says so."""
    from sandlock.compile import report
    from sandlock.linux import kernel
    from sandlock.net import connect

    def line() -> dict[str, object]:
        return next(f for f in report.kernel_report()["features"]
                    if f["feature"] == "host allowlist ([network] allow)")

    assert kernel.addfd_send_unsupported() is None  # this kernel (6.x) has it
    assert line()["available"] is True
    monkeypatch.setattr(kernel, "addfd_send_unsupported", lambda: "no ADDFD here")
    with pytest.raises(KernelSupportError, match=r"allow needs Linux 5\.14\+: no ADDFD here"):
        connect.check_support()
    assert line() == {"feature": "host allowlist ([network] allow)", "available": False,
                      "detail": "needs Linux 5.14+: no ADDFD here"}
