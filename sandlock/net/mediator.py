"""The API's tool-facing network servers, each in a process of its own: the host-allowlist
mediation of one call (:class:`RemoteMediation`), and how such a process is started (:func:`start_process`;
the credential route server of a Sandbox, :class:`sandlock.net.routes.RemoteRouteServer`,
is one too).

What a run with ``[network] allow`` needs, the proxy (HTTP and SOCKS5 parsing) and
the connect gate (which reads the tool's memory through ``/proc/TID/mem``),
is attacker-facing: a tool controls every byte it parses and can open connections
until a descriptor limit is reached. ``sandlock run`` runs it in the launcher,
which holds nothing but the run. The API's caller is an agent holding API keys and
conversations, so for each call this module starts a mediator: a clean exec of
``sys.executable -I -S`` with an empty environment (never a fork of the caller),
which runs :class:`sandlock.net.connect.Mediation` for that one call and exits when
the caller stops it or goes away (EOF on its socket). A tool that opens thousands
of connections exhausts the mediator's descriptors, not the agent's; and there are
at most :data:`sandlock.net.listener.MAX_CLIENTS` of them per run anyway.

The credential route server (:mod:`sandlock.net.routes`) parses every HTTP request the
tool sends it and holds the secrets it attaches; under the API it runs the same way, in
a process started for the Sandbox: the agent sends it the credentials and secrets, asks
it for each call's placeholders, and reads back only short JSON answers, checked.

Mediation wire (one SOCK_SEQPACKET socketpair, fd 3 in the mediator): the caller sends the
rules (pickled ``(ports, allow, deny, hosts)``: the mediator trusts its caller);
the mediator answers ``{"env": proxy environment, "bpf": notify BPF in hex}`` (JSON) with the socket
on which the confined child sends its listener (SCM_RIGHTS); the caller's ``stop``
(or EOF) ends it; it answers ``stop`` with the JSON list of its events. The caller reads
JSON only, with a size bound, and checks its shape: the mediator parses every byte of
the tool's traffic, so what it says back is never unmarshalled in the agent.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from .. import PACKAGE_DIR

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

    from ..exec.spec import Command
    from ..policy.model import Policy

#: Seconds the caller waits for the mediator's answer (start-up is ~30 ms).
START_TIMEOUT = 30.0
_STOP = b"stop"


class _Environment:
    """What api.py reads of a Mediation's proxy."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env

    def environment(self) -> dict[str, str]:
        return dict(self._env)


class _Listener:
    """What the API reads of a Mediation's gate."""

    def __init__(self, child_end: int, notify_bpf: bytes) -> None:
        self.child_end = child_end
        self.notify_bpf = notify_bpf


class RemoteMediation:
    """The caller's handle on one call's mediator process; used as api.py uses a
    :class:`sandlock.net.connect.Mediation` (``proxy.environment()``,
    ``gate.child_end``/``notify_bpf``, ``command``, ``start``, ``stop``, ``events``)."""

    def __init__(self, policy: Policy, signals: bool = False) -> None:
        """``signals``: the connect gate's listener also carries the signal gate
        (Landlock ABI < 6; :mod:`sandlock.linux.signalgate`): the tool gets one listener."""
        import pickle

        from ..errors import SetupError

        network = policy.network
        config = pickle.dumps((tuple((r.low, r.high) for r in network.connect),
                               network.allow, network.deny, network.hosts, signals is True))
        self.events: list[str] = []
        self._stopped = False
        self._proc, self._sock = start_process("serve")
        try:
            self._sock.send(config)
            self._sock.settimeout(START_TIMEOUT)
            data, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 1)
            self._sock.settimeout(None)
            if not data or len(fds) != 1:
                raise OSError("no answer")
            env, bpf = _answer(data)
        except (OSError, ValueError, EOFError, TypeError) as exc:
            end_process(self._proc, self._sock)
            raise SetupError(f"the network mediator for [network] allow did not start ({exc}; "
                             f"exit status {self._proc.returncode})") from None
        self.proxy = _Environment(env)
        self.gate = _Listener(fds[0], bpf)

    def command(self, cmd: Command) -> Command:
        """``cmd`` with the proxy variables set (they override the caller's)."""
        env = dict(cmd.env)
        env.update(self.proxy.environment())
        # type(cmd): a command like the caller's (net/ sits beside exec/, never above it)
        return type(cmd)(cmd.executable, cmd.argv, tuple(env.items()), cmd.cwd)

    def start(self) -> None:
        """The listener socket has gone to the supervisor with the request: drop ours."""
        self._close_child_end()

    def _close_child_end(self) -> None:
        if self.gate.child_end >= 0:
            os.close(self.gate.child_end)
            self.gate.child_end = -1

    def stop(self) -> None:
        """End the mediator (once); keep what it refused."""
        if self._stopped:
            return
        self._stopped = True
        self._close_child_end()
        try:
            self._sock.send(_STOP)
            self._sock.settimeout(START_TIMEOUT)
            events = json.loads(self._sock.recv(1 << 20).decode())
            if isinstance(events, list):
                self.events = [e for e in events if isinstance(e, str)][:1000]
        except (OSError, ValueError, EOFError, TypeError):
            pass  # it died: nothing to report, and nothing of it is left to stop
        finally:
            end_process(self._proc, self._sock, gently=True)


def _answer(data: bytes) -> tuple[dict[str, str], bytes]:
    """The mediator's first answer, checked: a str -> str environment and a BPF program."""
    answer = json.loads(data.decode())
    if not isinstance(answer, dict) or not isinstance(answer.get("bpf"), str):
        raise ValueError("not an answer")
    env, bpf = answer.get("env"), bytes.fromhex(answer["bpf"])
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in env.items())):
        raise ValueError("not an environment")
    if not bpf or len(bpf) % 8:
        raise ValueError("not a BPF program")
    return env, bpf


def end_process(proc: Any, sock: socket.socket, gently: bool = False) -> None:
    """Close the caller's end of a process of :func:`start_process` and reap it: at once
    (killed), or ``gently`` (it exits at EOF; killed only if it has not within
    START_TIMEOUT)."""
    sock.close()
    if gently:
        try:
            proc.wait(START_TIMEOUT)
            return
        except Exception:  # noqa: BLE001 - hung: it is ours to kill
            pass
    proc.kill()
    proc.wait()


def start_process(main: str, module: str = "sandlock.net.mediator") -> tuple[Any, socket.socket]:
    """A fresh ``python -I -S`` running ``<module>.<main>(fd)`` (never a fork of the
    caller), empty environment, stdio on /dev/null; the caller's end of its socket."""
    import subprocess
    from importlib.util import find_spec

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    root = os.path.dirname(PACKAGE_DIR)
    # The HTTP layer's parser (net/http.py imports h11) is found where the caller finds
    # it, after the standard library; found, not imported here. No site: no .pth file runs.
    spec = find_spec("h11")
    found = [os.path.dirname(os.path.dirname(spec.origin))] if spec and spec.origin else []
    boot = ("import sys; sys.path.insert(0, sys.argv[1]); sys.path += sys.argv[3:]; "
            f"from {module} import {main}; {main}(int(sys.argv[2]))")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", boot, root, str(theirs.fileno()),
             *found],
            pass_fds=[theirs.fileno()], env={}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


# ----------------------------------------------------------------------------
# The mediator process


def serve(fd: int) -> None:
    """Main of the mediator process (never returns)."""
    import pickle
    from types import SimpleNamespace

    from .connect import Mediation

    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    raise_nofile()  # room for MAX_CLIENTS clients and their upstreams
    code = 1
    mediation: Optional[Mediation] = None
    try:
        ports, allow, deny, hosts, signals = pickle.loads(sock.recv(1 << 20))
        policy: Any = SimpleNamespace(network=SimpleNamespace(
            connect=tuple(SimpleNamespace(low=low, high=high) for low, high in ports),
            allow=allow, deny=deny, hosts=hosts))
        mediation = Mediation(policy)
        if signals:  # the signal gate rides on the connect gate's listener (before its bpf goes)
            from ..linux.signalgate import Signals

            mediation.gate.gate_signals(Signals())
        sock.sendmsg([json.dumps({"env": mediation.proxy.environment(),
                                  "bpf": mediation.gate.notify_bpf.hex()}).encode()],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                       mediation.gate.child_end.to_bytes(4, sys.byteorder))])
        mediation.start()
        said = sock.recv(16)  # "stop", or b"" when the caller is gone
        mediation.stop()
        if said == _STOP:
            sock.send(json.dumps(list(mediation.events)[:1000]).encode())
        code = 0
    except BaseException:  # noqa: BLE001 - the caller sees EOF and reports it
        if mediation is not None:
            mediation.stop()
    finally:
        os._exit(code)


def raise_nofile() -> None:
    """Room for every client the tool may open, and their upstreams."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
