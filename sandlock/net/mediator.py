"""The API's tool-facing network servers, each in a process of its own: the host-allowlist
mediation of one call (:class:`RemoteMediation`), and how such a process is started (:func:`start_process`;
the credential route server of a Sandbox, :class:`sandlock.net.routes.RemoteRouteServer`,
is one too).

What a run with ``[network] allow`` needs, the proxy (HTTP and SOCKS5 parsing) and
the connect gate (which reads the tool's memory through ``/proc/TID/mem``),
is attacker-facing: a tool controls every byte it parses and can open connections
until a descriptor limit is reached. ``sandlock run`` runs it in the launcher,
which holds nothing but the run. The API's caller is an agent holding API keys and
conversations, so a Sandbox whose policy has ``allow`` starts a mediator on its first such
call: a clean exec of ``sys.executable -I -S`` with an empty environment (never a fork of
the caller), kept warm for the Sandbox's later calls (a Python start-up is ~50 ms, a
call's proxy and gate ~1 ms). Each call gets a :class:`sandlock.net.connect.Mediation`
of its own in it, on a socket of its own: its own proxy and its own connect gate, so a
socket one call's tool made through its gate is unknown to every other call's gate
(refused, EACCES). A tool that opens thousands of connections exhausts the mediator's
descriptors, not the agent's (the Sandbox's other calls under way share that process);
and there are at most :data:`sandlock.net.listener.MAX_CLIENTS` of them per call anyway.

The credential route server (:mod:`sandlock.net.routes`) parses every HTTP request the
tool sends it and holds the secrets it attaches; under the API it runs the same way, in
a process started for the Sandbox: the agent sends it the credentials and secrets, asks
it for each call's placeholders, and reads back only short JSON answers, checked.

Mediation wire. The control socket (fd 3 in the mediator): the caller sends the rules
once (pickled ``(ports, allow, deny, hosts)``: the mediator trusts its caller), then per
call ``call`` (or ``call signals``: the gate's listener also carries the signal gate)
with the call's own SOCK_SEQPACKET socket (SCM_RIGHTS). On a call's socket the mediator
answers ``{"env": proxy environment, "bpf": notify BPF in hex}`` (JSON) with the socket
on which the confined child sends its listener (SCM_RIGHTS); the caller's ``stop`` (or
EOF) ends that call's proxy and gate; it answers ``stop`` with the JSON list of the
call's events. The mediator exits once the control socket and every call's socket have
closed. The caller reads JSON only, with a size bound, and checks its shape: the mediator
parses every byte of the tool's traffic, so what it says back is never unmarshalled in
the agent.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import sys
import time

from .. import PACKAGE_DIR

TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading
    from typing import Any, Callable, Optional

    from ..exec.spec import Command
    from ..policy.model import Policy

#: Seconds the caller waits for the mediator's answer (start-up is ~30 ms).
START_TIMEOUT = 30.0
STOP = b"stop"  #: ends a call (its process answers with what it kept)
#: Names a call's credential-route session (``session SID``): its gate and proxy admit
#: the connections they make to the route for it (:class:`sandlock.net.routes.RouteServer`).
SESSION = b"session "
#: A new call (its socket rides along), and one whose gate also carries the signal gate.
CALL, SIGNALS = b"call", b"call signals"
#: The mediator's own sandlock-exec server, its control socket riding along (or alone:
#: none could start).
_SERVER, _NO_SERVER = b"server", b"no server"


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


class WarmProcess:
    """The caller's handle on a helper process of a Sandbox (:func:`start_process`):
    started on first use (a Python start-up, ~50 ms) with ``config`` as its first
    message, kept warm for the Sandbox's calls, each on a socket of its own
    (:meth:`open`). Ended by :meth:`close`; restarted if it died, or in a forked copy
    of its starter.

    ``native``: the process starts a ``sandlock-exec`` server of its own and hands it
    over (:attr:`server`; its main calls :func:`hand_over_server` after reading the
    config): the Sandbox's commands that this process supervises run there, so it is an
    ancestor of every process of their tools. Its gates read a tool's memory
    (``/proc/TID/mem``), which Yama's ``ptrace_scope`` = 1 (Ubuntu's default) allows
    only to an ancestor."""

    def __init__(self, config: bytes, main: str, module: str = "sandlock.net.mediator",
                 native: bool = False) -> None:
        import threading

        self._config = config
        self._main = (main, module)
        self._native = native
        self._lock = threading.Lock()
        self._proc: Any = None
        self._sock: Optional[socket.socket] = None
        self._owner = -1
        self._closed = False
        #: The process's sandlock-exec server (``native``), else None.
        self.server: Any = None

    def open(self, message: bytes) -> socket.socket:
        """A new call's socket, sent with ``message``: the process answers on it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:
                if self._closed:
                    raise OSError(errno.EBADF, "the Sandbox was closed")
                for attempt in (0, 1):
                    if self._sock is None or self._owner != os.getpid():
                        self._start()
                    assert self._sock is not None
                    try:
                        self._sock.sendmsg([message],
                                           [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             theirs.fileno().to_bytes(4, sys.byteorder))],
                                           socket.MSG_NOSIGNAL)
                        break
                    except OSError:  # it died: the next attempt starts a new one
                        self._end()
                        if attempt:
                            raise
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours

    def _config_fds(self) -> list[socket.socket]:
        """Sockets sent with the config (each start gets new ones; ours are closed)."""
        return []

    def _start(self) -> None:
        self._end()
        self._proc, self._sock = start_process(*self._main)
        self._owner = os.getpid()
        given = self._config_fds()
        try:
            self._sock.sendmsg([self._config], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(
                s.fileno().to_bytes(4, sys.byteorder) for s in given))] if given else [])
        finally:
            for sock in given:
                sock.close()
        if not self._native:
            return
        from ..exec import native as nativeexec

        self._sock.settimeout(START_TIMEOUT)
        try:
            said, fds, _, _ = socket.recv_fds(self._sock, 64, 1)
        finally:
            self._sock.settimeout(None)
        head, _, pid = said.partition(b" ")
        if head != _SERVER or len(fds) != 1 or not pid.isdigit():
            for fd in fds:
                os.close(fd)
            return  # it could not start one: its calls go through the fork server
        os.set_inheritable(fds[0], False)  # a copy in a later child would keep it alive
        self.server = nativeexec.Server(adopted=(socket.socket(fileno=fds[0]), int(pid)))

    def _end(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()  # EOF: it exits; calls already forked go on
        proc, sock, self._proc, self._sock = self._proc, self._sock, None, None
        if sock is None:
            return
        if self._owner != os.getpid():  # a forked copy: the process is its parent's
            sock.close()
            return
        sock.close()  # EOF: the process ends once its calls have (their sockets close)
        if proc.poll() is None and not sys.is_finalizing():  # (no thread starts then)
            import threading

            threading.Thread(target=proc.wait, name="sandlock-helper-reap", daemon=True).start()

    def close(self) -> None:
        """Calls under way go on; the process exits when the last one has ended. No
        call opens after this (the process is never started again)."""
        with self._lock:
            self._closed = True
            self._end()


class MediatorProcess(WarmProcess):
    """A Sandbox's mediator: each call gets a proxy and a connect gate of its own in it
    (:meth:`open_call`), on a socket of its own: what one call's gate holds (the
    sockets its tool made) is never another call's. ``native``: see
    :class:`WarmProcess`."""

    def __init__(self, policy: Policy, native: bool = False, routes: Any = None) -> None:
        """``routes``: the Sandbox's :class:`sandlock.net.routes.Routes` (a remote route
        server), whose connections its calls' gates and proxies admit (``ADMIT``)."""
        import pickle

        network = policy.network
        self._routes = routes
        super().__init__(pickle.dumps((tuple((r.low, r.high) for r in network.connect),
                                       network.allow, network.deny, network.hosts, native,
                                       None if routes is None else routes.port)),
                         "serve", native=native)

    def _config_fds(self) -> list[socket.socket]:
        return [] if self._routes is None else [self._routes.server.admitter()]

    def open_call(self, signals: bool) -> socket.socket:
        """A new call's socket (see :class:`RemoteMediation`); ``signals``: its gate's
        listener also carries the signal gate."""
        return self.open(SIGNALS if signals else CALL)


class RemoteCall:
    """The caller's handle on one call's part in a :class:`WarmProcess`: the process
    answers the call's socket with JSON holding ``bpf`` (its notifying filter, hex) and
    the socket the confined child sends its listener on (both kept as :attr:`gate` by
    :meth:`ready`; the rest of the answer checked by :meth:`_take`), then waits for
    ``stop`` (or EOF) and answers it (read by :meth:`stop`, checked by :meth:`_ended`).
    ``ahead``: only ask (the process prepares the call while the caller goes on);
    :meth:`ready` takes the answer."""

    #: What the process is, in errors.
    what = "helper"

    def __init__(self, process: WarmProcess, message: bytes, ahead: bool = False) -> None:
        from ..errors import SetupError

        self._stopped = False
        self._answered = False
        self._process = process
        self.gate = _Listener(-1, b"")
        try:
            self._sock = process.open(message)
        except OSError as exc:
            raise SetupError(f"the {self.what} did not start ({exc})") from None
        if not ahead:
            self.ready()

    def ready(self) -> "RemoteCall":
        """The process's answer, taken once (waiting for it); SetupError if none came."""
        from ..errors import SetupError

        if self._answered:
            return self
        if self._stopped:
            raise SetupError(f"this call's {self.what} was stopped before it was used")
        try:
            self._sock.settimeout(START_TIMEOUT)
            data, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 1)
            self._sock.settimeout(None)
            for fd in fds:  # received descriptors are inheritable: never into a later child
                os.set_inheritable(fd, False)
            if not data or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise OSError("no answer")
            try:
                answer = json.loads(data.decode())
                bpf = _bpf(answer)
                self._take(answer)
            except BaseException:
                os.close(fds[0])
                raise
            self.gate = _Listener(fds[0], bpf)
        except (OSError, ValueError, EOFError, TypeError) as exc:
            self._stopped = True
            self._sock.close()
            self._ended_early()
            raise SetupError(f"the {self.what} did not start ({exc})") from None
        self._answered = True
        return self

    def _take(self, answer: Any) -> None:
        """Check and keep what else the answer holds (ValueError if it is not one)."""

    def _read_end(self) -> Any:
        """The answer to ``stop``: one JSON message."""
        return json.loads(self._sock.recv(1 << 20).decode())

    def _ended(self, answer: Any) -> None:
        """Check and keep the answer to ``stop``."""
        raise NotImplementedError

    def _ended_early(self) -> None:
        """The call ends without a use (or its process failed): release what it holds."""
        self.start()

    def start(self) -> None:
        """The listener socket has gone to the supervisor with the request: drop ours."""
        if self.gate.child_end >= 0:
            os.close(self.gate.child_end)
            self.gate.child_end = -1

    def alive(self) -> bool:
        """Whether the process still holds this call: its end of the call's socket is
        open (a process that died after answering leaves EOF there)."""
        import select

        poller = select.poll()
        poller.register(self._sock, select.POLLIN | select.POLLHUP)
        return not self._stopped and not poller.poll(0)

    def stop(self) -> None:
        """End the call in the process (once) and take its last answer."""
        if self._stopped:
            return
        self._stopped = True
        if not self._answered:  # asked ahead, never used: the process sees EOF and ends it
            self._sock.close()
            self._ended_early()
            return
        try:
            self._sock.send(STOP)
            self._sock.settimeout(START_TIMEOUT)
            self._ended(self._read_end())
        except (OSError, ValueError, EOFError, TypeError):
            pass  # it died: nothing to report, and nothing of it is left to stop
        finally:
            self._sock.close()
            self._ended_early()


class RemoteMediation(RemoteCall):
    """The caller's handle on one call's proxy and connect gate in a mediator process;
    used as api.py uses a :class:`sandlock.net.connect.Mediation` (``proxy.environment()``,
    ``gate.child_end``/``notify_bpf``, ``command``, ``start``, ``stop``, ``events``)."""

    what = "network mediator for [network] allow"

    def __init__(self, policy: Policy, signals: bool = False,
                 process: Optional[MediatorProcess] = None, ahead: bool = False) -> None:
        """``signals``: the connect gate's listener also carries the signal gate
        (Landlock ABI < 6; :mod:`sandlock.linux.signalgate`): the tool gets one listener.
        ``process``: the Sandbox's warm mediator; without one, a process for this call
        alone (ended with it). ``ahead``: see :class:`RemoteCall`."""
        self.events: list[str] = []
        self.proxy = _Environment({})
        self._own = process is None
        super().__init__(MediatorProcess(policy) if process is None else process,
                         SIGNALS if signals is True else CALL, ahead)

    def _take(self, answer: Any) -> None:
        self.proxy = _Environment(_environment(answer))

    def _ended(self, answer: Any) -> None:
        if isinstance(answer, list):
            self.events = [e for e in answer if isinstance(e, str)][:1000]

    def _ended_early(self) -> None:
        super()._ended_early()
        if self._own:
            self._process.close()

    def bind(self, sid: str) -> None:
        """The call's credential-route session (:attr:`sandlock.net.routes.Session.sid`):
        the connections its gate and proxy make to the route are admitted for it."""
        self.ready()
        self._sock.send(SESSION + sid.encode())

    def command(self, cmd: Command) -> Command:
        """``cmd`` with the proxy variables set (they override the caller's)."""
        env = dict(cmd.env)
        env.update(self.proxy.environment())
        # type(cmd): a command like the caller's (net/ sits beside exec/, never above it)
        return type(cmd)(cmd.executable, cmd.argv, tuple(env.items()), cmd.cwd)


def _bpf(answer: Any) -> bytes:
    """The notifying filter of a warm process's first answer, checked: a BPF program."""
    if not isinstance(answer, dict) or not isinstance(answer.get("bpf"), str):
        raise ValueError("not an answer")
    bpf = bytes.fromhex(answer["bpf"])
    if not bpf or len(bpf) % 8:
        raise ValueError("not a BPF program")
    return bpf


def _environment(answer: dict[str, Any]) -> dict[str, str]:
    """The proxy environment of the mediator's first answer, checked: str -> str."""
    env = answer.get("env")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in env.items())):
        raise ValueError("not an environment")
    return env


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
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
            process_group=0)  # as the fork server: a terminal's job signals never stop it
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


# ----------------------------------------------------------------------------
# The mediator process


def serve(fd: int) -> None:
    """Main of the mediator process (never returns): the rules once, then a thread for each
    call; ends when the caller's socket and every call's have closed."""
    import pickle
    from types import SimpleNamespace

    def setup(config: bytes, fds: list[int]) -> tuple[Any, bool]:
        ports, allow, deny, hosts, native, route_port = pickle.loads(config)
        admissions = None
        if route_port is not None and len(fds) == 1:
            admissions = _Admissions(route_port, socket.socket(fileno=fds[0]))
        else:
            for fd in fds:
                os.close(fd)
        return SimpleNamespace(network=SimpleNamespace(
            connect=tuple(SimpleNamespace(low=low, high=high) for low, high in ports),
            allow=allow, deny=deny, hosts=hosts), admissions=admissions), native

    raise_nofile()  # room for MAX_CLIENTS clients and their upstreams, per call
    serve_warm(fd, setup, _serve_call, "sandlock-mediator-call")


def serve_warm(fd: int, setup: Callable[[bytes, list[int]], tuple[Any, bool]],
               serve_call: Callable[[Any, socket.socket, bool], None], name: str) -> None:
    """Main of a :class:`WarmProcess` (never returns): its config once (``setup`` makes
    (what each call needs, native) of it), its own sandlock-exec server handed over if
    native, then each call in a thread of :class:`_Workers`, ``serve_call(that, the call's
    socket, whether its listener also carries the signal gate)``; ends when the caller's
    socket and every call's have closed."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    calls = _Workers(serve_call, name)
    reaper: "Optional[threading.Thread]" = None
    try:
        config, given, _, _ = socket.recv_fds(sock, 1 << 24, 1)
        state, native = setup(config, given)
        if native:
            from ..linux.kernel import set_child_subreaper

            # What its server leaves when it ends (a supervisor ending a moment after it)
            # comes here, not to a subreaper above this process that never reaps it.
            set_child_subreaper(True)
            reaper = hand_over_server(sock)
        while True:
            said, fds, _, _ = socket.recv_fds(sock, 64, 1)
            if not fds:
                break  # EOF (or a message without its socket: the caller is broken)
            call = socket.socket(fileno=fds[0])
            call.set_inheritable(False)
            for extra in fds[1:]:
                os.close(extra)
            calls.submit(state, call, said == SIGNALS)
    except BaseException:  # noqa: BLE001 - the caller sees EOF on each call and reports it
        pass
    calls.join()
    if reaper is not None:  # its server ends at the caller's EOF too: reaped here, never
        reaper.join(START_TIMEOUT)  # left to whichever subreaper is above this process
        _reap_all(time.monotonic() + START_TIMEOUT)
    os._exit(0)


class _Workers:
    """The threads of a :class:`WarmProcess`'s calls: each serves one call at a time and
    then waits for the next; a call finding none idle starts one more. (A thread started
    per call cost about as much as a traced call's own work.)"""

    def __init__(self, serve: Callable[..., None], name: str) -> None:
        import queue
        import threading

        self._serve, self._name = serve, name
        self._jobs: "queue.SimpleQueue[Optional[tuple[Any, ...]]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []

    def submit(self, *job: Any) -> None:
        import threading

        with self._lock:
            if not self._idle:
                thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                thread.start()
                self._threads.append(thread)
                self._idle += 1
            self._idle -= 1  # this job's: no later job counts on it
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._serve(*job)
            except Exception:  # noqa: BLE001 - the caller sees EOF on the call and reports it
                pass
            with self._lock:
                self._idle += 1

    def join(self) -> None:
        """Once no call comes any more: wait for those under way, then end the threads."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()


def _reap_all(deadline: float) -> None:
    """Reap every child left (each call has ended: what remains is ending); those still
    there at ``deadline`` are killed, then reaped."""
    killed = False
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        if time.monotonic() >= deadline:
            if killed:
                return
            from ..exec.forkserver import children_of

            for child in children_of(os.getpid()):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed, deadline = True, time.monotonic() + 5  # each is reaped as it dies
        time.sleep(0.01)


def hand_over_server(sock: socket.socket) -> Optional[threading.Thread]:
    """In a :class:`WarmProcess` started ``native``: start a sandlock-exec server, a child
    of this process, and give its control socket to the caller (this process keeps no
    copy: the caller's close ends it); the thread that reaps it (None: no server)."""
    import threading

    from ..exec import native as nativeexec

    try:
        control, pid = nativeexec.start_server()
    except OSError:
        sock.send(_NO_SERVER)
        return None
    try:
        sock.sendmsg([_SERVER + b" %d" % pid], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                  control.fileno().to_bytes(4, sys.byteorder))])
    finally:
        control.close()
    reaper = threading.Thread(target=os.waitpid, args=(pid, 0), name="sandlock-server-reap",
                              daemon=True)
    reaper.start()
    return reaper


class _Admissions:
    """The mediator's socket to the Sandbox's route server (:meth:`RemoteRouteServer.admitter`):
    its calls' gates and proxies admit there the connections they make to the route."""

    def __init__(self, port: int, sock: socket.socket) -> None:
        import threading

        sock.set_inheritable(False)
        self.port = port
        self._sock = sock
        self._lock = threading.Lock()

    def admit(self, peer: tuple[str, int], since: int, sid: str, call: str) -> bool:
        """Recorded by the route server (its ``ok``) before the tool's connect is answered."""
        with self._lock:
            try:
                self._sock.send(f"ADMIT {peer[0]} {peer[1]} {since} {sid} {call}".encode())
                self._sock.settimeout(START_TIMEOUT)
                return self._sock.recv(16) == b"ok"
            except OSError:
                return False
            finally:
                self._sock.settimeout(None)


class _CallRoute:
    """One call's route (:class:`sandlock.net.connect.Route`): its session's sid comes from
    the caller (``session SID`` on the call's socket) before the tool may connect; a
    connection made before it arrives waits for it."""

    def __init__(self, admissions: _Admissions) -> None:
        import threading

        self.port = admissions.port
        self._admissions = admissions
        self._call = os.urandom(8).hex()  #: what the route server counts this call's requests by
        self._sid: Optional[str] = None
        self._known = threading.Event()

    def bind(self, sid: str) -> None:
        if self._sid is None:  # once: a call's session never changes
            self._sid = sid
        self._known.set()

    def admit(self, peer: tuple[str, int], since: int) -> bool:
        if not self._known.wait(START_TIMEOUT) or self._sid is None:
            return False
        return self._admissions.admit(peer, since, self._sid, self._call)


#: A session id as the caller sends it (a placeholder: URL-safe base64 and dashes).
_SID = re.compile(r"[A-Za-z0-9_-]{1,200}")


def _serve_call(policy: Any, sock: socket.socket, signals: bool) -> None:
    """One call: its own proxy and connect gate (a new listener, a new table of held
    sockets), until the caller says ``stop`` or closes the call's socket. Under
    ``[credentials]`` the caller names the call's session first (``session SID``)."""
    from .connect import Mediation

    mediation: Optional[Mediation] = None
    route = None if policy.admissions is None else _CallRoute(policy.admissions)
    try:
        mediation = Mediation(policy, route=route)
        if signals:  # the signal gate rides on the connect gate's listener (before its bpf goes)
            from ..linux.signalgate import Signals

            mediation.gate.gate_signals(Signals())
        sock.sendmsg([json.dumps({"env": mediation.proxy.environment(),
                                  "bpf": mediation.gate.notify_bpf.hex()}).encode()],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                       mediation.gate.child_end.to_bytes(4, sys.byteorder))])
        mediation.start()
        said = sock.recv(512)  # "stop", or b"" when the caller is gone
        while said.startswith(SESSION):
            sid = said[len(SESSION):].decode(errors="replace")
            if route is not None and _SID.fullmatch(sid):
                route.bind(sid)
            said = sock.recv(512)
        mediation.stop()
        if said == STOP:
            sock.send(json.dumps(list(mediation.events)[:1000]).encode())
    except BaseException:  # noqa: BLE001 - the caller sees EOF and reports it
        if mediation is not None:
            mediation.stop()
    finally:
        sock.close()


def raise_nofile() -> None:
    """Room for every client the tool may open, and their upstreams."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
