"""The Python API: one sandbox per tool call, in the spirit of :mod:`subprocess`.

    box = Sandbox("policies/read_file.toml", vars={"workspace": ws})
    result = box.run(["cat", "notes.md"], cwd=ws, capture_output=True, text=True)

A :class:`Sandbox` compiles its policy once (Landlock ruleset fd, seccomp BPF,
rlimits) and is then used by any number of threads and asyncio tasks at once.
Each call is a new process confined by that policy, forked from the fork server
(:mod:`sandlock.exec.forkserver`), never from the caller. Calls share no mutable state:
a call is a request on the fork server's socket plus the pipes of that call.
Commands take a faster path when the native helper is built: a supervisor forked per
call by a ``sandlock-exec`` server (one per caller process, started once with
``posix_spawn``), with the same per-call socket (:mod:`sandlock.exec.native`).

What a call returns is in :mod:`sandlock.api.results`, the I/O pump that drives a call
in :mod:`sandlock.api.pump`, and the restricted unpickler of ``call()`` results (the
only parser of bytes the tool wrote) in :mod:`sandlock.api.unpickle`; the public names
among them are importable from here too.
"""

from __future__ import annotations

import io
import marshal
import os
import socket
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping

from ..compile import compiler
from ..errors import (
    CallError,
    ExecError,
    ExitCode,
    KernelSupportError,
    LandlockError,
    SandlockError,
    SeccompError,
    SetupError,
    TimeoutExpired,
)
from ..exec import forkserver, launcher, spec
from ..exec import native as nativeexec
from ..exec.wire import setup_failure
from ..linux.process import is_terminal, refuse_directories
from .pump import _earliest, _now, _Pump, _wait_readable
from .results import Outcome, RemoteTraceback, Result, _decode, _denials, _result

TYPE_CHECKING = False  # typing and dataclasses cost ~10 ms on the API's first Sandbox()
if TYPE_CHECKING:
    from typing import IO, Any, Callable, Optional, Sequence, Union

    from ..compile.cache import Lookup
    from ..net.connect import Mediation
    from ..policy.model import Policy
    from ..trace.record import Denial

__all__ = ["DEVNULL", "Outcome", "PIPE", "Process", "RemoteTraceback", "Result", "STDOUT", "Sandbox",
           "shutdown", "start"]

#: Same values as :mod:`subprocess`'s, so either module's constants work.
PIPE = -1
STDOUT = -2
DEVNULL = -3

if TYPE_CHECKING:
    File = Union[None, int, IO[Any]]
    PolicyLike = Union["Policy", str, "os.PathLike[str]", Mapping[str, Any]]


def __getattr__(name: str) -> Any:
    """``File`` and ``PolicyLike`` (type aliases), made on first use: typing costs
    milliseconds on the API's first Sandbox()."""
    if name in ("File", "PolicyLike"):
        from typing import IO, Any, Union

        aliases = {"File": Union[None, int, IO[Any]],
                   "PolicyLike": Union["Policy", str, "os.PathLike[str]", Mapping[str, Any]]}
        globals().update(aliases)
        return aliases[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------
# One call, seen from the caller: the supervisor's socket


_FAILURES: dict[str, type[SandlockError]] = {cls.__name__: cls for cls in (
    SetupError, LandlockError, SeccompError, KernelSupportError)}


class _Call:
    """The caller's end of one call's supervisor socket (see :mod:`sandlock.exec.forkserver`)."""

    cmd: Optional[launcher.Command] = None  #: decodes ``X`` reports (the native helper)
    #: The proxy and connect gate of a call under ``[network] allow``, and
    #: what they refused (known once the call is closed).
    mediation: Optional[Mediation] = None
    #: The recorder of a traced call on the native path (its denials, once closed).
    recording: Any = None
    network_events: tuple[str, ...] = ()
    denials: tuple["Denial", ...] = ()  #: from a ``D`` report (``trace=True`` only)
    #: The call's own credential placeholders (``credentials=``), forgotten when it ends.
    session: Any = None
    #: The pty in place of a terminal among the call's stdio, relayed until the call ends.
    relay: Any = None
    #: A supervisor took the call and may have started the command (sandlock-exec's ``T``):
    #: if it vanishes, the command was killed with it, not "not started".
    taken = False

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid: Optional[int] = None
        self.failure: Optional[SandlockError] = None
        self.status: Optional[tuple[int, int, bool]] = None  # returncode, signal, timed out

    @property
    def ended(self) -> bool:
        return self.status is not None or self.failure is not None

    def receive(self) -> None:
        """Read one message (blocks unless the socket is readable)."""
        try:
            message = self.sock.recv(65536)
        except ConnectionResetError:
            # The supervisor exited with our last K or s unread: the kernel reports that
            # once, ahead of its messages still queued here (its E report among them).
            try:
                message = self.sock.recv(65536)
            except OSError:
                message = b""
        except OSError:
            message = b""
        kind, _, rest = message.partition(b" ")
        if kind == b"S":
            self.pid = int(rest)
        elif kind == b"E":
            code, sig, timed_out, pid = (int(x) for x in rest.split())
            self.status = (code, sig, bool(timed_out))
            self.pid = pid
        elif kind == b"F":
            head, _, text = rest.decode(errors="replace").partition("\n")
            exit_code, _, name = head.partition(" ")
            if name == "ExecError":
                self.failure = ExecError(text, int(exit_code))
            else:
                self.failure = _FAILURES.get(name, SandlockError)(text)
                self.failure.exit_code = int(exit_code)
        elif kind == b"D":  # trace=True: what the policy refused, before E or F
            self.denials += _denials(rest)
        elif kind == b"X" and self.cmd is not None:  # the child's own pre-exec report
            self.failure = setup_failure(self.cmd, rest)
        elif self.status is None and self.failure is None and self.taken:
            # The supervisor took the call (its T) and vanished: the command was started
            # and died with it (PR_SET_PDEATHSIG): killed, never "not started".
            self.status = (ExitCode.SIGNAL_BASE + 9, 9, False)
            self.deadline = min(self.deadline or float("inf"), _now() + _LOST_GRACE)
        elif self.status is None and self.failure is None:
            self.failure = SetupError("the sandbox supervisor died before reporting how the "
                                      "call ended (a sandlock helper process was killed)")
            # Nothing will end the call's pipes for sure now (a daemon of the tool may
            # hold them): wait for them only briefly.
            self.deadline = min(self.deadline or float("inf"), _now() + _LOST_GRACE)
        if self.ended:
            self._end_mediation()

    #: The caller's own end of the call (monotonic): its timeout plus _GRACE. The
    #: supervisor enforces the timeout; this holds whatever the helper processes do.
    deadline: Optional[float] = None

    def expire(self) -> None:
        """The caller's deadline passed: the call is over for the caller (the supervisor,
        if it is still there, kills the tree when its socket closes)."""
        if not self.ended:
            self.status = (ExitCode.TIMEOUT, 0, True)
            self._end_mediation()
        self.send(b"K")

    def wait_started(self) -> None:
        while self.pid is None and not self.ended:
            self.receive()

    def send(self, message: bytes) -> None:
        try:
            self.sock.send(message)
        except OSError:
            pass  # already over

    def close(self) -> None:
        """Closing before the end kills the call's whole tree (the supervisor sees EOF)."""
        self.sock.close()
        self._end_mediation()

    def _end_mediation(self) -> None:
        """Once the call's tree is gone (or being killed): stop its proxy and connect
        supervisor, keep what they refused."""
        mediation, self.mediation = self.mediation, None
        if mediation is not None:
            mediation.stop()
            self.network_events = tuple(mediation.events)
        recording, self.recording = self.recording, None
        if recording is not None:  # judged in the recorder process: JSON lists, as D reports
            recording.stop()
            for batch in recording.batches:
                self.denials += _denials(batch)
        session, self.session = self.session, None
        if session is not None:  # the route no longer knows the call's placeholders
            session.close()
        relay, self.relay = self.relay, None
        if relay is not None:  # the tool's last output, copied to the caller's terminal
            relay.close()


#: Native calls still running, for :func:`shutdown` (weak: a dropped call is closed).
_native_calls: "weakref.WeakSet[_NativeCall]" = weakref.WeakSet()
#: Seconds past a call's timeout that the caller waits before ending the call itself,
#: and after its supervisor vanished without a report (issue 17).
_GRACE, _LOST_GRACE = 2.0, 1.0
_native_lock = threading.RLock()  # RLock: a __del__ may run (GC) while it is held


def _forget_native_calls() -> None:
    """A forked copy of the caller must not kill the parent's calls at its shutdown()."""
    global _native_calls, _native_lock
    _native_calls, _native_lock = weakref.WeakSet(), threading.RLock()


os.register_at_fork(after_in_child=_forget_native_calls)


def _ended_socket() -> socket.socket:
    """A call socket whose supervisor end is already gone (a call that never started)."""
    sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peer.close()
    return sock


def _failed(failure: SandlockError) -> _Call:
    """A call refused before any supervisor took it, reported as a supervisor's
    refusal is (its Result carries ``failure``)."""
    call = _Call(_ended_socket())
    call.failure = failure
    return call


class _NativeCall(_Call):
    """A command call supervised by a ``sandlock-exec`` supervisor, forked for it by the
    process's native server (:mod:`sandlock.exec.native`): the same messages on the same
    kind of socket. Kept in ``_native_calls`` while open: stopping the server does not
    end its calls, so :func:`shutdown` sends each a ``K``."""

    def __init__(self, compiled: compiler.Compiled, cmd: launcher.Command,
                 stdio: Sequence[int], timeout: Optional[float], report_start: bool,
                 notify: Optional[tuple[int, bytes]] = None, server: Any = None) -> None:
        self.cmd = cmd
        try:
            sock = nativeexec.spawn(compiled, cmd, stdio, timeout, report_start,
                                    None if timeout is None else timeout + _GRACE, notify,
                                    server)
        except OSError as exc:  # EAGAIN (RLIMIT_NPROC), ENOMEM: as the fork server reports it
            super().__init__(_ended_socket())
            self.failure = SetupError(f"cannot start {nativeexec.HELPER}: {exc} (SANDLOCK_NATIVE=0"
                                      " runs commands through the fork server instead)")
            return
        super().__init__(sock)
        self.taken = True
        with _native_lock:
            _native_calls.add(self)

    def close(self) -> None:
        """Closing before the end kills the tree (the supervisor sees EOF)."""
        with _native_lock:
            _native_calls.discard(self)
        super().close()


# ----------------------------------------------------------------------------
# The sandbox


def _load(policy: PolicyLike, variables: Optional[Mapping[str, str]]) -> Policy:
    from ..policy.model import Policy, load_policy, policy_from_dict

    if isinstance(policy, Policy):
        if variables:
            raise TypeError("vars= applies when loading a policy; this one is already loaded")
        return policy
    if isinstance(policy, Mapping):
        return policy_from_dict(policy, variables)
    if isinstance(policy, (str, os.PathLike)):
        from ..policy.profiles import policy_file

        return load_policy(policy_file(policy) if isinstance(policy, str) else policy, variables)
    raise TypeError(f"policy must be a Policy, a path or a dict, not {type(policy).__name__}")


def _file_plan(policy: Union[str, os.PathLike[str]], variables: Mapping[str, str],
               best_effort: bool) -> tuple[tuple[str, Mapping[str, str], bool], Optional[bytes],
                                           Optional[Lookup]]:
    """A policy file's name, vars and mode; its bytes, read once (None: unreadable, the
    full path reports why); and its slot in the cache of compiled policies (None: the
    cache is off or unusable)."""
    from ..compile import cache
    from ..policy.profiles import policy_file
    from ..policy.readfile import read_policy_bytes

    path = policy_file(policy) if isinstance(policy, str) else os.fspath(policy)
    named = (path, dict(variables), best_effort)
    try:
        data = read_policy_bytes(path)
    except (OSError, ValueError):
        return named, None, None
    return named, data, cache.lookup(path, data, named[1], None, best_effort, handed_over=False)


#: Nesting a dict policy may have to be read back from the cache (a policy is 3 deep).
_DICT_DEPTH = 16


def _dict_text(policy: dict[Any, Any]) -> Optional[bytes]:
    """A dict policy's text, its part of the key in the cache of compiled policies: JSON,
    keys sorted. Only for a dict of exactly dicts with str keys, lists, str, int, float
    (finite), bool and None: each type decides how the policy loads, and JSON tells these
    apart (a tuple, a subclass, a Path would read back as something else). None for any
    other dict: it is compiled in every process."""
    import json

    def plain(value: Any, depth: int) -> bool:
        kind = type(value)
        if kind is dict:
            return depth < _DICT_DEPTH and all(
                type(key) is str and plain(item, depth + 1) for key, item in value.items())
        if kind is list:
            return depth < _DICT_DEPTH and all(plain(item, depth + 1) for item in value)
        return kind in (str, int, float, bool) or value is None

    if not plain(policy, 0):
        return None
    try:
        return json.dumps(policy, sort_keys=True, allow_nan=False).encode("ascii")
    except ValueError:  # NaN or an infinity
        return None


#: The longest timeout (seconds) the API takes, as the policy's ``timeout``.
_MAX_TIMEOUT = 10**9


def _check_timeout(timeout: Any) -> Optional[float]:
    """None (the policy's), or a positive, finite number of seconds. A negative, zero,
    NaN or infinite timeout is an error at once: never "no limit" (a caller passing a
    remaining budget that ran out must not lift the policy's own limit)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
    seconds = float(timeout)
    if not 0 < seconds <= _MAX_TIMEOUT:
        raise ValueError(f"timeout must be a positive, finite number of seconds (at most "
                         f"{_MAX_TIMEOUT}), got {timeout!r}")
    return seconds


def _working_directory() -> str:
    """The caller's working directory; a SetupError (not FileNotFoundError) once it was
    deleted, as `sandlock run` reports it."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise SetupError("the working directory no longer exists (it was deleted); pass cwd= "
                         "or change to an existing directory") from None


class Sandbox:
    """A compiled policy: every :meth:`run`, :meth:`popen` or :meth:`call` is a new,
    separately confined process. Thread-safe; close it (or use ``with``) to release
    the Landlock ruleset fd.

    ``policy`` is a :class:`~sandlock.policy.model.Policy`, a path to a TOML file, or a dict
    with the same schema (``vars`` fill ``${name}``). TOML text: :meth:`from_toml`.
    ``trusted_types`` are the classes (besides plain data and exceptions) that
    :meth:`call` may rebuild from a confined function's result.
    ``review``: ``"dry-run"`` (the write-granted directories are copied and the copies
    granted instead; working directories inside them move to the copy) or
    ``"checkpoint"`` (they are snapshotted first); :meth:`finish_review` (or closing)
    records what the runs changed and names the run for :mod:`sandlock.undo.session`
    (``changes``, ``apply``, ``forget``, ``rollback``). See docs/undo.md.
    """

    def __init__(self, policy: PolicyLike, *, vars: Optional[Mapping[str, str]] = None,
                 best_effort: bool = False, timeout: Optional[float] = None,
                 trusted_types: Iterable[type] = (), max_result_size: int = 64 << 20,
                 credentials: Optional[Mapping[str, str]] = None,
                 accept: Iterable[str] = (), review: Optional[str] = None) -> None:
        # Every argument is checked before anything is compiled or opened.
        names = () if isinstance(accept, str) else tuple(accept)
        if isinstance(accept, str) or not all(isinstance(name, str) for name in names):
            raise TypeError(f"accept must be an iterable of gap names (str), not {accept!r:.80}")
        if vars is not None and not (isinstance(vars, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in vars.items())):
            raise TypeError(f"vars must be a mapping of str to str, not {vars!r:.80}")
        timeout = _check_timeout(timeout)
        trusted = _trusted(trusted_types)
        if type(max_result_size) is not int:
            raise TypeError(f"max_result_size must be an int, not {type(max_result_size).__name__}")
        if max_result_size <= 0:
            raise ValueError(f"max_result_size must be positive, got {max_result_size}")
        self._mediator: Any = None  #: net.mediator.MediatorProcess of ``[network] allow``
        self._recorder: Any = None  #: trace.remote.RecorderProcess of native traced calls
        #: Per slot ("mediation", "recording"): (pid that asked, the next call's part,
        #: asked for while the previous call ran; see _prepared).
        self._ahead: dict[str, tuple[int, Any]] = {}
        self._review: Any = None  #: sandlock.undo.session.Review of review=
        self._routes: Any = None  #: routes.Routes of ``[credentials]``
        # A policy file with none of the options its cache key does not hold: its plan may
        # be read back from the cache of compiled policies, as `sandlock run` reads it.
        self._file: Optional[tuple[str, Mapping[str, str], bool]] = None
        #: A dict's text (its key in the cache), with the vars and mode it was compiled with.
        self._dict: Optional[tuple[bytes, Mapping[str, str], bool]] = None
        data = None
        cached = None
        if not names and timeout is None and review is None and credentials is None:
            if isinstance(policy, (str, os.PathLike)):
                self._file, data, cached = _file_plan(policy, vars or {}, best_effort)
            elif type(policy) is dict:
                text = _dict_text(policy)
                if text is not None:
                    from ..compile import cache

                    self._dict = (text, dict(vars or {}), best_effort)
                    cached = cache.lookup(cache.DICT, text, self._dict[1], None, best_effort,
                                          handed_over=False)

        def load() -> Policy:
            from ..policy.model import Compat

            if data is not None and self._file is not None:
                from ..policy.model import load_policy

                loaded = load_policy(self._file[0], vars, data=data)
            else:
                loaded = _load(policy, vars)
            if best_effort:
                loaded = loaded.with_compat(Compat.BEST_EFFORT)
            if names:
                loaded = loaded.with_accept(names, "accept=")
            if timeout is not None:
                loaded = loaded.with_timeout(timeout)
            if review is not None:
                from ..undo.session import Review

                self._review = Review(review)
                loaded = self._review.prepare(loaded)
            if loaded.network.allow:
                from ..net.connect import check_support

                check_support()  # KernelSupportError: no seccomp user notification
            if loaded.credentials or credentials is not None:  # credential routes (issue 16)
                from ..net.routes import prepare

                # serving for the Sandbox's lifetime, from a process of its own
                self._routes = prepare(loaded, None, credentials, remote=True)
                self._routes.start()
            return loaded

        from ..compile.cache import through
        from ..compile.runlog import directory as run_log

        self._log = run_log()  #: the run log's directory the grants are checked against
        try:
            if self._log is not None:  # its records can be appended: else nothing runs
                from ..compile.runlog import ready

                ready()
            self._compiled, loaded = through(
                cached, data, load, lambda loaded: compiler.compile_policy(loaded, self._routes), None)
        except BaseException:
            if self._routes is not None:
                self._routes.stop()
            if self._review is not None:
                self._review.discard_now()
            raise
        #: The policy as compiled (the route's port among its grants): None when the plan
        #: was read from the cache, until :attr:`policy` is first asked for.
        self._policy = self._compiled.policy
        if self._policy is None:
            from ..policy.builtins import builtin_vars

            # as they are now, for the policy loaded later: its name made absolute, and
            # ${cwd}, ${home}, ${tmpdir} (the plan's; the key held them)
            if self._file is not None:
                path, variables, mode = self._file
                self._file = (os.path.abspath(path), {**builtin_vars(path), **variables}, mode)
            elif self._dict is not None:
                text, variables, mode = self._dict
                self._dict = (text, {**builtin_vars(), **variables}, mode)
        #: Host allowlists: never in a plan the cache holds (it does not store them); a
        #: credential route's is in the policy as compiled (policy.model.with_loopback_port).
        compiled_policy = self._compiled.policy or loaded
        self._allow = compiled_policy is not None and bool(compiled_policy.network.allow)
        self._trusted = trusted
        self._max_result = max_result_size
        from ..policy.environment import matcher

        self._passed = matcher(self._compiled.env_passed)
        self._lock = threading.Lock()
        #: Names this compiled policy to the fork server, which prepares a confined
        #: process for the next call() of this Sandbox (sandlock.exec.server._Spare).
        self._token = os.urandom(16)
        #: Commands run by sandlock-exec when it is built; see sandlock.exec.native.
        self._native = True
        self._users = 0
        self._closed = False

    @classmethod
    def from_toml(cls, text: str, *, vars: Optional[Mapping[str, str]] = None,
                  **options: Any) -> "Sandbox":
        from ..policy.model import loads_policy

        return cls(loads_policy(text, vars), **options)

    # -- inspection

    @property
    def timeout(self) -> Optional[float]:
        """The policy's ``[limits] timeout`` as compiled (seconds), or None."""
        return self._compiled.timeout

    @property
    def policy(self) -> Policy:
        """The policy as compiled (a ``[credentials]`` route's port among its grants). A
        plan read back from the cache of compiled policies was not loaded: the policy is
        loaded here, on first use, from the bytes that plan was compiled from, with the
        ``${cwd}``, ``${home}`` and ``${tmpdir}`` it had (a file it extends is read again:
        one changed since may make this differ from what runs)."""
        loaded = self._policy
        if loaded is None:
            from ..policy.model import Compat, load_policy, policy_from_dict

            if self._file is not None:
                path, variables, best_effort = self._file
                loaded = load_policy(path, variables, data=self._compiled.source_bytes)
            else:  # only a policy file's plan, or a dict's, is read back
                assert self._dict is not None
                import json

                text, variables, best_effort = self._dict
                loaded = policy_from_dict(json.loads(text), variables)
            if best_effort:
                loaded = loaded.with_compat(Compat.BEST_EFFORT)
            self._policy = loaded
        return loaded

    @property
    def abi(self) -> int:
        """The Landlock ABI the ruleset was built for."""
        return self._compiled.abi

    @property
    def warnings(self) -> list[str]:
        """Protections the policy relies on that are not enforced for this caller on this
        kernel: Landlock gaps (best-effort mode, or those ``accept`` names, each line ending
        ``[accepted: NAME]``), a ``processes`` limit that is per-user (RLIMIT_NPROC, no pids
        cgroup) or, for root when accepted, absent."""
        return self._compiled.warnings

    def grants(self) -> dict[str, Any]:
        """What a confined process may do, as plain data (everything else is denied)."""
        p = self.policy
        return {
            **{access: [r.path for r in p.paths if r.access.value == access]
               for access in ("read", "write", "exec")},
            "connect": [str(r) for r in p.network.connect],
            "bind": [str(r) for r in p.network.bind],
            "udp": p.network.udp, "unix": p.network.unix,
            "allow": [rule.text for rule in p.network.allow],
            "scope": {"signals": p.scope.signals, "abstract_unix": p.scope.abstract_unix},
            "env": {"pass": list(p.env.passed), "set": dict(p.env.set)},
            "limits": {k: getattr(p.limits, k) for k in
                       ("timeout", "cpu", "memory", "processes", "open_files", "file_size")},
            "syscalls": {"deny": list(p.syscalls.deny), "allow": list(p.syscalls.allow)},
            "not_enforced": self.warnings,
        }

    # -- lifecycle

    def close(self) -> None:
        """Release the ruleset fd (after the calls being submitted right now)."""
        with self._lock:
            self._closed = True
            if self._users == 0:
                self._compiled.close()
        if getattr(self, "_routes", None) is not None:
            self._routes.stop()
        with self._lock:
            asked, self._ahead = list(getattr(self, "_ahead", {}).values()), {}
        for pid, handle in asked:
            if pid == os.getpid():
                handle.stop()  # never used: ends in its process
        for process in (getattr(self, "_mediator", None), getattr(self, "_recorder", None)):
            if process is not None:
                process.close()  # calls under way keep their proxy, gate or recorder
        if getattr(self, "_review", None) is not None and not self._review.finished:
            self.finish_review()

    def finish_review(self) -> str:
        """Record what this Sandbox's runs changed in its reviewed directories (``review=``;
        once its commands are done); the run's name for :mod:`sandlock.undo.session`."""
        if self._review is None:
            raise SandlockError("this Sandbox was made without review=")
        if not self._review.finished:
            self._review.finish()
        return str(self._review.name)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- calls

    def _start(self, cmd: launcher.Command, stdio: tuple[File, File, File],
               timeout: Optional[float], *, report_start: bool = False, trace: bool = False,
               session: Any = None) -> tuple[_Call, tuple[int, int, int]]:
        """Open the caller's ends of the pipes ``stdio`` asks for and submit ``cmd``;
        on failure nothing stays open. Returns the call and the caller's ends.
        ``session`` (the call's credential placeholders) is closed when the call ends.
        ``timeout`` may shorten the policy's limit, never lift it: the smaller applies."""
        ceiling = self._compiled.timeout  # the policy's promise: its tree dies by then
        if timeout is None or (ceiling is not None and ceiling < timeout):
            timeout = ceiling
        try:
            fields: dict[str, Any] = {"trace": self._trace_rules()} if trace else {}
            mine, theirs = _open_stdio(stdio)
        except BaseException:
            if session is not None:
                session.close()
            raise
        try:
            mediation = self._mediation()
            if mediation is not None:
                if self._routes is not None:  # its connections to the route are this call's
                    mediation.bind((session or self._routes.session).sid)  # type: ignore[attr-defined]
                cmd = mediation.command(cmd)
            call = self._submit("exec", cmd, theirs, timeout, mediation=mediation,
                                report_start=report_start, **fields)
        except BaseException:
            if session is not None:
                session.close()
            for fd in mine:
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            _close_theirs(theirs, stdio)
        if session is not None:
            call.session = session
            if call.ended:
                call._end_mediation()
        return call, mine

    def _trace_rules(self) -> tuple[int, list[tuple[str, int, bool]], dict[int, int]]:
        """What the supervisor of a ``trace=True`` call judges recorded accesses by
        (:class:`sandlock.trace.record.Judge`: the ruleset's rights), computed once."""
        if self._judge is None:
            from ..trace.record import Judge, supported

            why = supported()
            if self._allow:  # has_duplicate_listener() in kernel/seccomp.c
                why = ("not available with [network] allow (a credential route's address is "
                       "one when the policy reaches no other host): the kernel lets a "
                       "process's filters have one notification listener, and the host "
                       "allowlist's connect gate holds it")
            if why:
                raise KernelSupportError(f"trace=True: {why}")
            judge = Judge.for_policy(self.policy, self._compiled.abi)
            self._judge = (judge.abi, judge.rules, judge.ports)
        return self._judge

    _judge: Optional[tuple[int, list[tuple[str, int, bool]], dict[int, int]]] = None

    def _mediation(self) -> Optional[Mediation]:
        """A new proxy and connect gate for one call, if the policy has host
        allowlists (``[network] allow``): in the Sandbox's mediator process
        (:mod:`sandlock.net.mediator`, started on the first such call and kept warm),
        never in this one, until the call ends."""
        if not self._allow:
            return None
        from ..net.mediator import MediatorProcess, RemoteMediation

        with self._lock:
            if self._closed:  # never start a mediator for a Sandbox that is closed
                raise SandlockError("this Sandbox is closed")
            if self._mediator is None:  # its own sandlock-exec server: see WarmProcess
                self._mediator = MediatorProcess(self.policy, self._native and nativeexec.enabled(),
                                                 self._routes)
        # the signal gate (Landlock ABI < 6) rides on its listener (trace=True, whose
        # recorder would carry it, is refused under [network] allow: _trace_rules)
        return self._prepared("mediation", lambda ahead: RemoteMediation(  # type: ignore[no-any-return]
            self.policy, self._compiled.signal_gate, self._mediator, ahead=ahead))

    def _recording(self) -> Any:
        """A recorder for one traced command on the native path, in the Sandbox's
        recorder process (:mod:`sandlock.trace.remote`, started on the first such call
        and kept warm), never in this one; it carries the signal gate if need be."""
        from ..trace.remote import RecorderProcess, RemoteRecording

        rules = self._trace_rules()
        with self._lock:
            if self._closed:
                raise SandlockError("this Sandbox is closed")
            if self._recorder is None:
                self._recorder = RecorderProcess(rules, native=True)
        return self._prepared("recording", lambda ahead: RemoteRecording(
            self._recorder, self._compiled.signal_gate, ahead=ahead))

    def _prepared(self, slot: str, make: Callable[[bool], Any]) -> Any:
        """A call's part in one of the Sandbox's warm processes (``make(ahead)``): the
        one asked for while the previous call ran, if its process still holds it, else
        a new one; then the next call's is asked for (the process makes it meanwhile)."""
        with self._lock:
            ahead = self._ahead.pop(slot, None)
        if ahead is not None and ahead[0] != os.getpid():  # a forked copy: its parent's
            ahead = None
        handle = None
        if ahead is not None:
            try:
                handle = ahead[1].ready()
            except SetupError:  # the process died since: a new one below
                pass
            if handle is not None and not handle.alive():  # it died after answering
                handle.stop()
                handle = None
        if handle is None:
            handle = make(False)
        try:
            following = make(True)
        except SetupError:
            following = None
        with self._lock:
            if following is not None and (self._closed or slot in self._ahead):
                following.stop()  # closed meanwhile, or another thread's call got there first
            elif following is not None:
                self._ahead[slot] = (os.getpid(), following)
        return handle

    def _submit(self, kind: str, cmd: launcher.Command, stdio: Sequence[int],
                timeout: Optional[float], extra_fds: Sequence[int] = (),
                mediation: Optional[Mediation] = None, **fields: Any) -> _Call:
        """Hand one call to a supervisor. ``mediation`` is started here and stopped
        when the call is closed (also if submitting fails). A terminal among ``stdio`` is
        never the tool's: it gets a pty of its own, relayed (:mod:`sandlock.exec.terminal`;
        the caller's terminal is never put in raw mode), until the call ends."""
        from ..compile.grants import refuse_foreign_directory  # a plan's hit imported it

        try:
            refuse_directories(tuple(stdio))
            refuse_foreign_directory(cmd.cwd)
        except SetupError:
            if mediation is not None:
                mediation.stop()
            raise
        if not any(fd >= 0 and is_terminal(fd) for fd in stdio):  # nothing imported
            return self._submit_to(kind, cmd, stdio, timeout, extra_fds, mediation, **fields)
        from ..exec.terminal import Relay

        relay = Relay(stdio, interactive=False)
        try:
            call = self._submit_to(kind, cmd, relay.replace(stdio), timeout, extra_fds,
                                   mediation, **fields)
            relay.start()
        except BaseException:
            relay.close()
            raise
        call.relay = relay
        if call.ended:
            call._end_mediation()
        return call

    def _submit_to(self, kind: str, cmd: launcher.Command, stdio: Sequence[int],
                   timeout: Optional[float], extra_fds: Sequence[int] = (),
                   mediation: Optional[Mediation] = None, **fields: Any) -> _Call:
        with self._lock:
            if self._closed:
                if mediation is not None:
                    mediation.stop()
                raise SandlockError("this Sandbox is closed")
            self._users += 1
        try:
            compiled = self._compiled
            limit = self._compiled.timeout if timeout is None else timeout
            if compiled.signal_gate:  # the signal scope's substitute below Landlock ABI 6
                # run by the fork server's supervisor, or under [network] allow by the
                # mediator's listener (RemoteMediation, below)
                fields["signals"] = True
            # On the native path a command's listener (the host allowlist's connect gate,
            # trace's recorder, the signal gate riding on either) lives in a warm process
            # of the Sandbox that also started the sandlock-exec server the command runs
            # on (an ancestor of the tool: Yama); the child sends it the listener (the
            # notify step). The signal gate alone has no process of its own there: such a
            # command goes through the fork server, whose supervisor carries it.
            native_path = kind == "exec" and self._native and nativeexec.enabled()
            server = None if mediation is None else self._mediator.server
            recording = None
            if native_path and "trace" in fields and mediation is None:
                try:
                    recording = self._recording()
                    server = self._recorder.server
                except SetupError:  # no recorder process: the fork server's supervisor records
                    recording = None
            gate = mediation if mediation is not None else recording
            if native_path and (
                    (gate is None and "trace" not in fields and not compiled.signal_gate)
                    or (gate is not None and server is not None
                        and spec.NOTIFY in server.implements)):
                notify = None if gate is None else (gate.gate.child_end, gate.gate.notify_bpf)
                if notify is not None and compiled.signal_gate:
                    from ..linux.signalgate import carried

                    try:
                        carried(notify[1])  # the one listener must carry the signal gate
                    except SetupError as exc:  # refused as a supervisor refuses it: a Result
                        gate.stop()  # type: ignore[union-attr]
                        return _failed(exc)
                try:
                    native = _NativeCall(compiled, cmd, stdio, limit,
                                         bool(fields.get("report_start")), notify, server)
                except BaseException:
                    if gate is not None:
                        gate.stop()
                    raise
                native.deadline = None if limit is None else _now() + limit + _GRACE
                native.mediation, native.recording = mediation, recording
                if gate is not None:
                    gate.start()
                return native
            if recording is not None:  # its process has no server: the fork server records
                recording.stop()
            if mediation is not None:  # the mediator's gate, not an ancestor of this tool
                from ..linux.notify import memory_unreadable

                why = memory_unreadable(ancestor=False)
                if why:
                    mediation.stop()
                    raise KernelSupportError(
                        f"[network] allow through the fork server: the mediator {why}. The "
                        "native helper runs such calls under the mediator (SANDLOCK_NATIVE=0 "
                        "turns it off; an install without a C compiler lacks it)")
            # The layout the supervisor expects (sandlock.exec.server._serve_one): the call's
            # socket, stdio, the ruleset fd, the mediation socket, then extra_fds.
            fds = [*stdio] + ([compiled.ruleset_fd] if compiled.ruleset_fd >= 0 else [])
            if mediation is not None:
                fds.append(mediation.gate.child_end)
                fields["mediate"] = mediation.gate.notify_bpf
            if kind == "exec":  # a call's spare takes spec.child_steps in its supervisor
                fields["steps"] = spec.encode(spec.child_steps(
                    compiled, cmd, in_group=compiled.run_group_limit() is not None,
                    notify=mediation is not None or bool(fields.get("trace"))
                    or compiled.signal_gate))
            request = {
                "version": spec.VERSION, "kind": kind, "exe": cmd.executable, "argv": list(cmd.argv),
                "env": list(cmd.env), "cwd": cmd.cwd, "bpf": compiled.bpf,
                "rlimits": list(compiled.rlimits), "ruleset": compiled.ruleset_fd >= 0,
                "cgroup": None if compiled.cgroup is None else compiled.cgroup.wire(),
                "timeout": self._compiled.timeout if timeout is None else timeout,
                **fields,
            }
            try:
                call = _Call(forkserver.submit(request, [*fds, *extra_fds]))
            except BaseException:
                if mediation is not None:
                    mediation.stop()
                raise
            if mediation is not None:
                call.mediation = mediation
                mediation.start()
            call.deadline = None if limit is None else _now() + limit + _GRACE
            return call
        finally:
            with self._lock:
                self._users -= 1
                if self._closed and self._users == 0:
                    self._compiled.close()

    def _command(self, argv: Sequence[str], cwd: Optional[str],
                 env: Optional[Mapping[str, str]], session: Any = None) -> launcher.Command:
        args = _argv(argv)
        if cwd is not None and not isinstance(os.fspath(cwd), str):
            raise TypeError(f"cwd must be a str path, not {type(cwd).__name__}")
        if env is not None and not (isinstance(env, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise TypeError(f"env must be a mapping of str to str, not {env!r:.80}")
        if not args:
            raise ExecError("no command given", ExitCode.NOT_FOUND)
        name = args[0]
        if cwd is not None and "/" in name and not os.path.isabs(name):
            # As subprocess: the child changes directory first, so ./tool means cwd's.
            name = os.path.join(os.fspath(cwd), name)
        exe = launcher.resolve_command(name, os.environ.get("PATH"))
        environment = self._environment()
        if session is not None:  # the call's placeholders instead of the Sandbox's
            environment = session.environment(environment)
        environment.update(env or {})
        where = os.path.abspath(cwd or _working_directory())
        if self._review is not None:  # a dry run's copy in place of the original
            where = self._review.place(where)
        return launcher.Command(os.path.abspath(exe), args, tuple(environment.items()), where)

    def _call_session(self, credentials: Optional[Mapping[str, str]]) -> Any:
        """The call's own credential placeholders (:func:`sandlock.net.routes.call_session`),
        or None without ``credentials=``."""
        if credentials is None:
            return None
        if self._routes is None:
            raise ValueError("credentials= needs a policy with [credentials] (the Sandbox "
                             "serves no credential route)")
        from ..net.routes import call_session

        return call_session(self._routes, self.policy, credentials)

    #: os.environ's raw contents and the environment _environment() made of them.
    _env_cache: Optional[tuple[dict[bytes, bytes], dict[str, str]]] = None

    def _environment(self) -> dict[str, str]:
        """policy.environment.build's result (``pass`` globs as fnmatchcase, then ``set``),
        with the matcher made once: matching globs one by one cost ~0.4 ms per call. Reused
        while os.environ is unchanged: comparing CPython's raw dict behind it takes ~1 us,
        going through the mapping to filter it again ~35 us."""
        raw = getattr(os.environ, "_data", None)  # bytes -> bytes, or absent elsewhere
        cached = self._env_cache
        if cached is not None and cached[0] == raw:
            return dict(cached[1])
        env = {k: v for k, v in os.environ.items() if self._passed(k)}
        env.update(self._compiled.env_set)
        if self._routes is not None:  # placeholders and route URLs; no from_env variable
            env = self._routes.session.environment(env)
        if isinstance(raw, dict):
            self._env_cache = (dict(raw), env)
            return dict(env)
        return env

    def popen(self, argv: Sequence[str], *, stdin: File = None, stdout: File = None,
              stderr: File = None, cwd: Optional[str] = None,
              env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
              text: bool = False, encoding: Optional[str] = None,
              errors: Optional[str] = None, trace: bool = False,
              credentials: Optional[Mapping[str, str]] = None) -> "Process":
        """Start ``argv`` confined and return a :class:`Process` (like subprocess.Popen).

        Raises :class:`ExecError` (126/127) or :class:`SetupError` (125) if it could
        not start. ``timeout`` (the policy's without it; never more) is a hard limit
        enforced by the supervisor; ``env`` adds variables to those the policy passes.
        ``trace``: as for :meth:`run` (``Process.result.denials`` once it has ended).
        ``credentials``: as for :meth:`run`.
        """
        timeout = _check_timeout(timeout)
        _check_trace(trace)
        _check_text(encoding, errors)
        session = self._call_session(credentials)
        try:
            cmd = self._command(argv, cwd, env, session)
        except BaseException:
            if session is not None:
                session.close()
            raise
        call, mine = self._start(cmd, (stdin, stdout, stderr), timeout, report_start=True,
                                 trace=trace, session=session)
        process = Process(call, cmd.argv, mine, text or bool(encoding or errors), encoding,
                          errors)
        process._sandbox = self  # its record in the run log when it ends
        return process

    def run(self, argv: Sequence[str], *, input: Optional[Union[bytes, str]] = None,
            timeout: Optional[float] = None, cwd: Optional[str] = None,
            capture_output: bool = False, stdin: File = None, stdout: File = None,
            stderr: File = None, env: Optional[Mapping[str, str]] = None, text: bool = False,
            encoding: Optional[str] = None, errors: Optional[str] = None,
            check: bool = False, trace: bool = False,
            credentials: Optional[Mapping[str, str]] = None) -> Result:
        """Run ``argv`` confined and wait (like subprocess.run).

        Returns a :class:`Result` however it ended, including timeouts (124) and
        refusals before exec (125-127); ``check=True`` raises the typed error instead.
        ``trace=True`` also records what the command did, confined exactly as without
        it (recording never decides, see :mod:`sandlock.trace.record`), and lists what the
        policy refused in ``Result.denials``, as `sandlock trace` does. Without it no
        recording filter is loaded and no recorder runs.
        ``credentials={name: secret}`` overrides the Sandbox's secrets for this call
        only: the call's tool gets placeholders of its own, which the route serves
        with these secrets until the call ends (no other call holds them).
        """
        job = self._start_run(argv, input, timeout, cwd, capture_output, stdin, stdout,
                              stderr, env, text, encoding, errors, trace, credentials)
        if isinstance(job, Result):
            return job.check() if check else job
        try:
            job.pump.run()
        finally:
            job.pump.close()
            job.call.close()
        result = job.result()
        return result.check() if check else result

    async def run_async(self, argv: Sequence[str], *, input: Optional[Union[bytes, str]] = None,
                        timeout: Optional[float] = None, cwd: Optional[str] = None,
                        capture_output: bool = False, stdin: File = None, stdout: File = None,
                        stderr: File = None, env: Optional[Mapping[str, str]] = None,
                        text: bool = False, encoding: Optional[str] = None,
                        errors: Optional[str] = None, check: bool = False,
                        trace: bool = False,
                        credentials: Optional[Mapping[str, str]] = None) -> Result:
        """:meth:`run` for asyncio: awaits without a thread. Cancelling kills the tree."""
        job = self._start_run(argv, input, timeout, cwd, capture_output, stdin, stdout,
                              stderr, env, text, encoding, errors, trace, credentials)
        if isinstance(job, Result):
            return job.check() if check else job
        try:
            await job.pump.run_async()
        finally:
            job.pump.close()
            job.call.close()
        result = job.result()
        return result.check() if check else result

    def _start_run(self, argv: Sequence[str], input: Optional[Union[bytes, str]],
                   timeout: Optional[float], cwd: Optional[str], capture_output: bool,
                   stdin: File, stdout: File, stderr: File, env: Optional[Mapping[str, str]],
                   text: bool, encoding: Optional[str], errors: Optional[str],
                   trace: bool = False, credentials: Optional[Mapping[str, str]] = None
                   ) -> Union[Result, "_RunJob"]:
        # Everything is checked before anything is opened or started.
        timeout = _check_timeout(timeout)
        _check_trace(trace)
        _check_text(encoding, errors)
        if input is not None and not isinstance(input, (bytes, bytearray, memoryview, str)):
            raise TypeError(f"input must be bytes or str, not {type(input).__name__}")
        decode = text or bool(encoding or errors)
        if capture_output:
            if stdout is not None or stderr is not None:
                raise ValueError("capture_output=True cannot be combined with stdout/stderr")
            stdout = stderr = PIPE
        if input is not None:
            if stdin is not None:
                raise ValueError("input= cannot be combined with stdin=")
            stdin = PIPE
            if isinstance(input, str):
                input = input.encode(encoding or "utf-8", errors or "strict")
        args = _argv(argv)
        session = self._call_session(credentials)
        try:
            cmd = self._command(args, cwd, env, session)
        except BaseException as exc:
            if session is not None:
                session.close()
            if isinstance(exc, ExecError):
                return Result(args, int(exc.exit_code), outcome=Outcome.NOT_STARTED, error=exc)
            raise
        call, mine = self._start(cmd, (stdin, stdout, stderr), timeout, trace=trace,
                                 session=session)
        writes = {mine[0]: input or b""} if mine[0] >= 0 else {}
        pump = _Pump(call, writes, [fd for fd in mine[1:] if fd >= 0])
        return _RunJob(call, pump, args, mine, decode, encoding, errors, self)

    def call(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` in a confined process; return or raise its outcome.

        ``func`` must be importable by reference (a module-level function; from the
        main script too) or picklable. The confined process is forked from the fork
        server, not from the caller: it sees the caller's ``sys.path`` and imports
        ``func``'s module afresh, so the policy must grant read on it. It gets the
        arguments (pickled), the policy's environment and the caller's stdout and
        stderr; it does not get the caller's memory, environment or other fds.
        Each call runs in a new process; after a call, the next one of this Sandbox
        is prepared (forked and confined) ahead of time, so it does not wait for that.
        """
        job = self._start_call(func, args, kwargs)
        try:
            job.pump.run()
        finally:
            job.pump.close()
            job.call.close()
        return job.outcome(func)

    async def call_async(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` for asyncio."""
        job = self._start_call(func, args, kwargs)
        try:
            await job.pump.run_async()
        finally:
            job.pump.close()
            job.call.close()
        return job.outcome(func)

    def _start_call(self, func: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> "_CallJob":
        import pickle  # call() only: run() and its Sandbox never load it

        name = getattr(func, "__qualname__", repr(func))
        try:
            payload = pickle.dumps((func, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise CallError(f"cannot send {name} and its arguments to the confined process: "
                            f"{exc} (the function must be importable by reference, e.g. "
                            "defined at module level, or picklable)") from exc
        main = None
        if b"__main__" in payload:
            main = getattr(sys.modules.get("__main__"), "__file__", None)
            if main is None:
                raise CallError(f"{name} is defined in an interactive session; the confined "
                                "process cannot import it (define it in a module)")
            main = os.path.abspath(main)
        # What only the confined child may see travels in a memfd it reads itself: the
        # supervisor, which serves call after call, never has it in memory.
        environment = self._environment()
        mediation = self._mediation()
        if mediation is not None:
            environment.update(mediation.proxy.environment())
        data = marshal.dumps({"env": list(environment.items()), "main": main,
                              "sys_path": [p for p in sys.path if isinstance(p, str)],
                              "payload": payload})
        cmd = launcher.Command(sys.executable, (sys.executable,), (), _working_directory())
        devnull = memfd = result_r = result_w = -1
        try:  # each may fail (EMFILE): whatever was opened is closed
            devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            memfd = os.memfd_create("sandlock-call", os.MFD_CLOEXEC)
            result_r, result_w = os.pipe2(os.O_CLOEXEC)
            view = memoryview(data)
            while view:
                view = view[os.write(memfd, view):]
            call = self._submit("call", cmd, (devnull, 1, 2), None, [memfd, result_w],
                                mediation, policy=self._token)
        except BaseException:
            if result_r >= 0:
                os.close(result_r)
            if mediation is not None:
                mediation.stop()
            raise
        finally:
            for fd in (devnull, memfd, result_w):
                if fd >= 0:
                    os.close(fd)
        return _CallJob(call, _Pump(call, {}, [result_r], limit=self._max_result), result_r,
                        self._trusted, self._max_result, self)


class _RunJob:
    """A command under way: its call, its pump, and how to build its Result."""

    def __init__(self, call: _Call, pump: _Pump, args: tuple[str, ...],
                 mine: tuple[int, int, int], decode: bool, encoding: Optional[str],
                 errors: Optional[str], sandbox: Optional[Sandbox] = None) -> None:
        self.call, self.pump, self.args, self.mine = call, pump, args, mine
        self.decode, self.encoding, self.errors, self.sandbox = decode, encoding, errors, sandbox

    def result(self) -> Result:
        out = [self.pump.output.get(fd) if fd >= 0 else None for fd in self.mine[1:]]
        if self.decode:
            out = [_decode(data, self.encoding, self.errors) for data in out]
        result = _result(self.call, self.args, out[0], out[1])
        _log(self.sandbox, result)
        return result


def _log(sandbox: Optional[Sandbox], result: Result) -> None:
    """Append the record of a run, a process or a call of ``sandbox`` ended with ``result``
    to the run log, when it is on (:func:`sandlock.compile.runlog.log_run`)."""
    if sandbox is not None and sandbox._log is not None:
        from ..compile.runlog import log_run

        log_run(sandbox._compiled, result.args, result.returncode, result.network_events,
                [str(d) for d in result.denials], api=True, checked=sandbox._log)


class _CallJob:
    """A ``call()`` under way: its call, its pump, and the pipe of its pickled result."""

    def __init__(self, call: _Call, pump: _Pump, result_fd: int,
                 trusted: Mapping[tuple[str, str], type], limit: int,
                 sandbox: Optional[Sandbox] = None) -> None:
        self.call, self.pump, self.result_fd = call, pump, result_fd
        self.trusted, self.limit, self.sandbox = trusted, limit, sandbox

    def outcome(self, func: Callable[..., Any]) -> Any:
        name = getattr(func, "__qualname__", repr(func))
        call = self.call
        if call.failure is not None:
            raise call.failure
        assert call.status is not None
        if self.sandbox is not None and self.sandbox._log is not None:  # the run log is on
            _log(self.sandbox, _result(call, ("call()", name), None, None))
        code, sig, timed_out = call.status
        if timed_out:
            raise TimeoutExpired(f"{name}: timed out; its process tree was killed")
        if self.pump.overflow:
            raise CallError(f"{name}: the result is larger than max_result_size "
                            f"({self.limit} bytes); the process was killed")
        data = self.pump.output.get(self.result_fd, b"")
        if not data:
            how = f"was killed by signal {sig}" if sig else f"exited with code {code}"
            raise CallError(f"{name}: the confined process {how} before returning a result",
                            exit_code=code)
        from .unpickle import _rebuild

        return _rebuild(name, data, self.trusted, code)


def _trusted(types_: Any) -> dict[tuple[str, str], type]:
    """:func:`sandlock.api.unpickle._trusted_types`, whose module (and pickle) is loaded
    only when classes are named: a Sandbox that never calls a function needs neither."""
    if isinstance(types_, tuple) and not types_:
        return {}
    from .unpickle import _trusted_types

    return _trusted_types(types_)


def _check_trace(trace: Any) -> None:
    if not isinstance(trace, bool):
        raise TypeError(f"trace must be True or False, not {type(trace).__name__}")


def _check_text(encoding: Any, errors: Any) -> None:
    """A codec or error handler Python does not know is a ValueError before anything
    starts, as a wrong type is a TypeError: not a LookupError once input is encoded or
    output decoded (or never, when there was nothing to decode)."""
    import codecs

    for what, value, lookup in (("encoding", encoding, codecs.lookup),
                                ("errors", errors, codecs.lookup_error)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a str, not {type(value).__name__}")
        try:
            lookup(value)
        except LookupError as exc:
            raise ValueError(f"{what}={value!r}: {exc}") from None


def _argv(argv: Any) -> tuple[str, ...]:
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Iterable):
        raise TypeError("argv must be a sequence of strings (no shell is involved)")
    args = tuple(os.fspath(a) for a in argv)
    if not all(isinstance(a, str) for a in args):
        raise TypeError("argv must be a sequence of strings (no shell is involved)")
    if any("\0" in a for a in args):
        raise ValueError("argv: embedded null byte")
    return args


#: The largest descriptor number (a C int, as dup2 and SCM_RIGHTS take it).
_MAX_FD = 2**31 - 1


def _fileno(given: Any) -> int:
    """The descriptor of a stdio argument that is not PIPE, STDOUT or DEVNULL: a ValueError
    for a number that cannot be one, before anything starts (not an OverflowError, nor
    a call that reports EBADF)."""
    if isinstance(given, int):
        fd = given
    else:
        try:
            fd = int(given.fileno())
        except (AttributeError, io.UnsupportedOperation):
            raise TypeError(f"expected None, PIPE, DEVNULL, an fd or a file, got {given!r}"
                            ) from None
    if not 0 <= fd <= _MAX_FD:
        raise ValueError(f"{fd} is not a file descriptor (nor PIPE, STDOUT or DEVNULL)")
    return fd


def _open_stdio(specs: tuple[File, File, File]) -> tuple[tuple[int, int, int], list[int]]:
    """(the caller's pipe ends or -1, the fds to hand to the child)."""
    mine = [-1, -1, -1]
    theirs: list[int] = []
    try:
        for index, given in enumerate(specs):
            if given is None:
                theirs.append(index)  # inherit the caller's own stdin/stdout/stderr
            elif given == DEVNULL:
                theirs.append(os.open(os.devnull, (os.O_RDONLY if index == 0 else os.O_WRONLY)
                                      | os.O_CLOEXEC))
            elif given == PIPE:
                r, w = os.pipe2(os.O_CLOEXEC)
                mine[index], child = (w, r) if index == 0 else (r, w)
                theirs.append(child)
            elif given == STDOUT and index == 2:
                theirs.append(theirs[1])
            else:
                theirs.append(_fileno(given))
    except BaseException:
        _close_theirs(theirs, specs)
        for fd in mine:
            if fd >= 0:
                os.close(fd)
        raise
    return (mine[0], mine[1], mine[2]), theirs


def _close_theirs(theirs: Sequence[int], specs: Sequence[File]) -> None:
    """Close the child's ends that this module opened (not the caller's own fds)."""
    closed = set()
    for fd, given in zip(theirs, specs):
        if given in (PIPE, DEVNULL) and fd not in closed:
            os.close(fd)
            closed.add(fd)


class Process:
    """A running confined command (like subprocess.Popen); from :meth:`Sandbox.popen`.

    ``kill()`` kills its whole process tree. Dropping the object also does: the
    supervisor kills the tree when the caller's end of its socket closes.
    """

    def __init__(self, call: _Call, args: tuple[str, ...], mine: tuple[int, int, int],
                 text: bool, encoding: Optional[str], errors: Optional[str]) -> None:
        self._call = call
        self.args = args
        self._text = (text, encoding, errors)
        streams: list[Optional[IO[Any]]] = []
        for index, fd in enumerate(mine):
            if fd < 0:
                streams.append(None)
                continue
            raw = open(fd, "wb" if index == 0 else "rb")
            streams.append(io.TextIOWrapper(raw, encoding or "utf-8", errors or "strict")
                           if text else raw)
        self.stdin, self.stdout, self.stderr = streams
        try:
            call.wait_started()
        except BaseException:
            self._close_streams()
            call.close()
            raise
        if call.failure is not None:
            self._close_streams()
            call.close()
            raise call.failure
        self.pid: int = call.pid  # type: ignore[assignment]
        self._sandbox: Optional[Sandbox] = None  #: whose run log records its end

    @property
    def returncode(self) -> Optional[int]:
        return None if self._call.status is None else self._call.status[0]

    @property
    def result(self) -> Optional[Result]:
        """How it ended (outcome, signal), once it has."""
        if self._call.status is None:
            return None
        return _result(self._call, self.args, None, None)

    def poll(self) -> Optional[int]:
        while self._call.status is None and not self._call.ended:
            if not _wait_readable(self._call.sock, 0):
                break
            self._call.receive()
        self._check_lost()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the end; TimeoutExpired (nothing killed) if ``timeout`` passes first."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._call.ended:
            limit = _earliest(deadline, self._call.deadline)  # the call's own end first
            left = None if limit is None else max(0.0, limit - time.monotonic())
            if not _wait_readable(self._call.sock, left):
                if limit != deadline:
                    self._call.expire()
                    break
                raise TimeoutExpired(f"{self.args[0]}: still running after {timeout}s",
                                     timeout=timeout)
            self._call.receive()
        self._check_lost()
        return self.returncode  # type: ignore[return-value]

    def _check_lost(self) -> None:
        if self._call.status is None and self._call.failure is not None:
            raise self._call.failure
        if self._call.status is not None and self._sandbox is not None:  # once, at its end
            sandbox, self._sandbox = self._sandbox, None
            if sandbox._log is not None:  # the run log is on
                _log(sandbox, _result(self._call, self.args, None, None))

    def communicate(self, input: Optional[Union[bytes, str]] = None,
                    timeout: Optional[float] = None) -> tuple[Any, Any]:
        """Send ``input``, read stdout/stderr to EOF, wait. Like Popen.communicate."""
        import time

        if not hasattr(self, "_pump"):
            _, encoding, errors = self._text
            if isinstance(input, str):
                input = input.encode(encoding or "utf-8", errors or "strict")
            writes: dict[int, bytes] = {}
            if self.stdin is not None:
                self.stdin.flush()
                writes[os.dup(self.stdin.fileno())] = input or b""
                self.stdin.close()
            self._fds = [os.dup(s.fileno()) if s is not None else -1
                         for s in (self.stdout, self.stderr)]
            for stream in (self.stdout, self.stderr):
                if stream is not None:
                    stream.close()
            reads = [fd for fd in self._fds if fd >= 0]
            self._pump = _Pump(self._call, writes, reads)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._pump.run(deadline):
            raise TimeoutExpired(f"{self.args[0]}: still running after {timeout}s",
                                 timeout=timeout)
        self._check_lost()
        out = [self._pump.output.get(fd) if fd >= 0 else None for fd in self._fds]
        if self._text[0]:
            out = [_decode(data, self._text[1], self._text[2]) for data in out]
        return out[0], out[1]

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the command's process group."""
        if not self._call.ended:
            self._call.send(b"s %d" % signum)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the whole process tree of this call."""
        if not self._call.ended:
            self._call.send(b"K")

    def _close_streams(self) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def __enter__(self) -> "Process":
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_streams()
        try:
            self.wait()
        finally:
            self._call.close()
            if hasattr(self, "_pump"):
                self._pump.close()

    def __del__(self) -> None:
        try:
            self._call.close()
        except Exception:  # noqa: BLE001
            pass


# ----------------------------------------------------------------------------
# Module-level conveniences


def start() -> int:
    """Start the fork server, and the native command server when it is built, now
    (they start on first use otherwise); return the fork server's pid.

    Not needed for safety (both are exec'd fresh, never copies of the caller), only
    to move their start-up (~20 ms for the fork server) out of the first tool call.
    """
    if nativeexec.enabled():
        nativeexec.get()
    return forkserver.get().pid


def shutdown() -> None:
    """Stop the fork server and the native server, killing any call still running
    (they restart on next use)."""
    with _native_lock:
        running = list(_native_calls)
    for call in running:
        call.send(b"K")
    nativeexec.shutdown()
    forkserver.shutdown()
