"""A cache of compiled policies, so that `sandlock run` need not parse its policy.

Parsing a policy means importing tomllib, dataclasses, enum-heavy models and the
seccomp compiler: about 60 ms of imports, paid on every tool call. The result of
all that work is small and plain: the Landlock plan (paths and rights, ports,
handled rights, scopes), the seccomp BPF, rlimits, the environment spec, the
timeout and the warnings of a best-effort run. This module stores that result,
keyed by everything it was computed from, and reads it back with ``marshal``.

The key (compared in full on every hit, not only by its hash) holds: the policy
file's path, real path and bytes; every variable, the working directory, HOME,
TMPDIR and the effective uid (the built-in variables come from those); the
kernel's Landlock ABI and ``SANDLOCK_ABI``; the machine; ``--timeout`` and
``--best-effort``; the sandlock version and a fingerprint of its code. An entry
also records every file it extends, with its bytes, and every policy path with
whether it existed: on a hit each extended file is re-read and compared, and
each path re-checked (existence; real path of write grants), so any change falls
back to the full path, which then reports errors exactly as without a cache. On
a hit the paths are still opened and the ruleset fd built, now; a path that
vanished in between is an error (exit 125), as it is without the cache.

Trust: a tool may be able to write the cache directory (its policy may grant write
on the home), so nothing read back is trusted unless it is authenticated. Each
entry carries a keyed BLAKE2b tag over its payload, with a 256-bit key no tool can
read (:mod:`sandlock.compile.cachekey`): kept in the caller's kernel user keyring
(the seccomp filter refuses keyctl, add_key and request_key to every tool, and
Landlock keeps tools from tracing the launcher that holds the key) or, where the
keyring is refused (containers), in a private key file of the user's home that no
grant may reach. An entry whose tag does not verify is ignored (then overwritten);
without a trusted key there is no cache at all, only the full path. Entries are
unmarshalled only after their tag verified, and used only if they
have exactly the shape this version writes (:data:`SHAPE`): any other is a miss, never
a crash. The Landlock ABI of an entry must be the one the kernel reports now. On a hit
the policy paths are still resolved, checked and opened now
(:mod:`sandlock.compile.grants`), exactly as on a miss.
The policy file is read once (:mod:`sandlock.policy.readfile`): the key and, on a miss,
the compiled policy both come from those bytes, and an entry records the exact text
of every file it extends, as compiled. Entries live in
``$XDG_CACHE_HOME/sandlock/policies`` (default ``~/.cache``), which must be a real
directory owned by the effective uid; ``SANDLOCK_NO_CACHE=1`` turns the cache off.
"""

from __future__ import annotations

import marshal
import os
import sys

from .. import PACKAGE_DIR, __version__
from ..linux import kernel
from . import cachekey
from .cachekey import KEY_NAME as KEY_NAME  # the key's one definition is there
from .cachekey import open_private_dir as open_private_dir  # and the private directories'
from .reviewdirs import state_path

TYPE_CHECKING = False  # typing costs milliseconds; this module exists to save them
if TYPE_CHECKING:
    from typing import Any, Callable, Mapping, Optional, Sequence

    from ..policy.model import Policy
    from .compiler import Compiled
    from .grants import Witness

FORMAT = 5
MAGIC = b"sandlock-compiled-policy\x00%d\n" % FORMAT
TAG_BYTES = 32
ENV_NO_CACHE = "SANDLOCK_NO_CACHE"
BUILD_ID_FILE = "sandlock-build-id"  #: bundled by scripts/build_binary.sh
MAX_ENTRIES = 256
#: The subpackages whose files the code id covers (_code_id): every one, in sorted order.
#: Not only the code that builds a plan: a native entry also holds the child's steps
#: (exec/spec.py), and the CLI decides what it refuses (cli/launch.py); a file of any
#: changed makes every entry stale (an attack round: a patched exec/spec.py was not seen).
PACKAGES = ("api", "cli", "compile", "exec", "integrations", "linux", "net", "policy", "probe",
            "trace", "undo")
PROFILE_DIR = os.path.join(PACKAGE_DIR, "policy", "profiles")

#: Fields of the policy model this cache knows how to reproduce. A field added
#: later (by a feature the cached path does not implement) makes the policy
#: uncacheable unless it holds its default value: never silently skip a feature.
KNOWN_FIELDS = {
    "Policy": {"source", "description", "compat", "paths", "network", "scope", "env", "limits",
               "syscalls", "layers", "inputs", "absent"},
    "PathRule": {"path", "access", "optional", "origin"},
    "PortRange": {"low", "high"},
    "Network": {"connect", "bind", "udp", "unix"},
    "Scopes": {"signals", "abstract_unix"},
    "EnvSpec": {"passed", "set"},
    "Limits": {"timeout", "cpu", "memory", "processes", "open_files", "file_size"},
    "Syscalls": {"deny", "allow"},
}
#: Attributes of compiler.Compiled the cached path reproduces.
KNOWN_COMPILED = {"policy", "abi", "gaps", "ruleset_fd", "bpf", "rlimits", "_fprog", "_keep",
                  "cgroup", "signal_gate", "source", "env_passed", "env_set", "timeout",
                  "landlock"}


#: The shape of an entry's value (see _value), checked in full before any of it is used:
#: a type; a list ``[shape]`` for a tuple of any length whose items all have that shape;
#: a tuple of shapes for a tuple of that length; a frozenset of alternatives. An entry
#: of another shape, even authenticated (a layout changed without a FORMAT bump, a bug),
#: is a miss: the policy is compiled again, never a crash.
SHAPE: dict[str, Any] = {
    "source": str,
    "layers": [(str, str, bytes)],
    "checks": [(str, bool)],
    "plan": (int, int, int, int, [(str, int)], [(int, int)], int, int),
    "warnings": [str],
    "bpf": bytes,
    "rlimits": [(int, int)],
    "env": ([str], [(str, str)]),
    "timeout": frozenset({type(None), float, int}),
    "cgroup": object,  # only compared with what the caller finds now
    "signal_gate": bool,
}


def _fits(obj: object, shape: Any) -> bool:
    if isinstance(shape, frozenset):
        return any(_fits(obj, alternative) for alternative in shape)
    if isinstance(shape, list):
        return type(obj) is tuple and all(_fits(item, shape[0]) for item in obj)
    if isinstance(shape, tuple):
        return (type(obj) is tuple and len(obj) == len(shape)
                and all(_fits(item, s) for item, s in zip(obj, shape)))
    return shape is object or type(obj) is shape


def well_formed(value: object) -> bool:
    """Whether ``value`` (an unmarshalled entry) has exactly the shape of SHAPE."""
    return (type(value) is dict and value.keys() == SHAPE.keys()
            and all(_fits(value[name], shape) for name, shape in SHAPE.items()))


class Entry:
    """A compiled policy read back from the cache (authenticated) and re-checked."""

    def __init__(self, value: dict[str, Any], policy_file: str) -> None:
        passed, set_ = value["env"]
        #: The run's facts (:class:`sandlock.compile.compiler.Compiled`), as compiled.
        self.source: str = value["source"]
        self.env: tuple[tuple[str, ...], tuple[tuple[str, str], ...]] = (tuple(passed), tuple(set_))
        self.timeout: Optional[float] = value["timeout"]
        self.plan = value["plan"]
        self.warnings: tuple[str, ...] = tuple(value["warnings"])
        self.bpf: bytes = value["bpf"]
        self.rlimits: tuple[tuple[int, int], ...] = tuple(value["rlimits"])
        #: The run needs the signal gate (Landlock ABI < 6, sandlock.linux.signalgate).
        self.signal_gate = value["signal_gate"]
        if type(self.signal_gate) is not bool:
            raise ValueError("bad signal_gate")
        self.policy_files = (*((policy_file,) if policy_file != DICT else ()),
                             *(where for kind, where, _ in value["layers"] if kind == "file"))
        #: The pids cgroup base found when the entry was compiled (a ``processes`` limit
        #: only): the entry holds only while the caller finds the same one now, since
        #: the warnings and the strict-mode verdict depend on it.
        self.cgroup = None
        if value["cgroup"] is not None:
            from ..linux import cgroups

            found, why = cgroups.find()
            if _cgroup_key(found, why) != value["cgroup"]:
                raise ValueError("the caller's pids cgroup changed")
            self.cgroup = found
        if not isinstance(self.bpf, bytes) or not self.bpf or len(self.bpf) % 8:
            raise ValueError("bad BPF program")
        #: Whether its compile could have written a native entry.
        self.native_possible = native_possible(value)

    def compile(self) -> Compiled:
        """Resolve and open the paths and build the ruleset fd now, as the full path does
        (a refused grant raises GrantError: the caller then takes the full path, which
        reports it with the policy line)."""
        from . import grants
        from .compiler import Compiled

        abi, handled_fs, handled_net, scoped, paths, ports, file_only, write_rights = self.plan
        fd = grants.build_ruleset(abi, handled_fs, handled_net, scoped, paths, ports, file_only,
                                  write_rights, self.policy_files)
        # Gaps are kept as their one-line descriptions: Compiled.warnings prints str(gap).
        compiled = Compiled(None, abi, self.warnings, fd,  # type: ignore[arg-type]
                            self.bpf, self.rlimits, self.cgroup, signal_gate=self.signal_gate)
        compiled.source = self.source
        compiled.env_passed, compiled.env_set = self.env
        compiled.timeout = self.timeout
        return compiled


class Lookup:
    """The cache slot for one `sandlock run` invocation: a hit (``entry``) or a slot to fill."""

    def __init__(self, key: tuple[Any, ...], directory: int, name: str, secret: bytes,
                 entry: Optional[Entry], policy_file: str, native: tuple[Any, ...] = ()) -> None:
        self.key = key
        self.directory = directory  #: a descriptor of the verified cache directory
        self.name = name
        self.entry = entry
        self._secret = secret
        self._policy_file = policy_file
        self._native = native  #: native_key's arguments, for the native entry

    def store(self, policy: Policy, compiled: Compiled, steps: Sequence[str] = (),
              witness: Optional[Witness] = None) -> None:
        """Save ``compiled`` for next time; with ``steps`` (the child's, encoded by
        :mod:`sandlock.exec.spec`, a layer above) and ``witness`` (what its grant checks
        saw), its native entry too. Never raises: a cache that cannot be written only
        costs speed, it must not change what the command does."""
        try:
            value = _value(policy, compiled, self._policy_file)
            if value is not None:
                _write(self.directory, self.name, self._secret, self.key, value)
                if self._native and steps:
                    write_native(self._secret, native_key(*self._native), value, compiled, steps,
                                 witness)
        except Exception:  # noqa: BLE001 - see docstring
            pass


# ----------------------------------------------------------------------------
# The key


#: The name a policy given as a dict (the API) is looked up by, its text being its JSON
#: (sandlock.api.sandbox._dict_text): no file is named "", so no file's entry is a dict's.
DICT = ""
#: What the policy model names such a policy (sandlock.policy.model.policy_from_dict).
DICT_SOURCE = "<dict>"


def _code_id() -> tuple[Any, ...]:
    """Changes whenever sandlock's code does, even without a new version number."""
    if getattr(sys, "frozen", False):
        # The binary: an id written at build time (scripts/build_binary.sh), since the
        # bundle may be unpacked into a different directory on every run.
        try:
            with open(os.path.join(getattr(sys, "_MEIPASS", ""), BUILD_ID_FILE), "rb") as handle:
                return ("build", handle.read())
        except OSError:
            st = os.stat(sys.executable)
            return (sys.executable, st.st_size, st.st_mtime_ns)
    out = []
    for sub in ("", *PACKAGES):
        here = os.path.join(PACKAGE_DIR, sub)
        for name in sorted(os.listdir(here)):
            if name.endswith(".py"):
                st = os.stat(os.path.join(here, name))
                out.append((sub, name, st.st_size, st.st_mtime_ns))
    return tuple(out)


#: The resources a policy may limit (compiler.rlimits_for): a compiled plan caps each at
#: the caller's hard limit (compiler.clamp_to_hard_limits), so the keys hold those.
LIMITED = (4, 0, 9, 6, 7, 1)  # RLIMIT_CORE, _CPU, _AS, _NPROC, _NOFILE, _FSIZE (Linux)


def hard_limits() -> tuple[int, ...]:
    """The caller's hard limits of LIMITED, RLIM_INFINITY as 2**64 - 1 (its rlim_t)."""
    import resource

    return tuple(resource.getrlimit(res)[1] & (2**64 - 1) for res in LIMITED)


def _key(policy_file: str, text: bytes, variables: Mapping[str, str], timeout: Optional[str],
         best_effort: bool) -> tuple[Any, ...]:
    env = os.environ
    return (FORMAT, __version__, _code_id(), os.uname().machine, os.geteuid(), hard_limits(),
            kernel.landlock_abi(), env.get("SANDLOCK_ABI"), os.getcwd(), env.get("HOME"),
            env.get("TMPDIR"), env.get("XDG_CACHE_HOME"), env.get("SANDLOCK_STUB"),
            env.get("SANDLOCK_STATE_DIR"), tuple(sys.path), policy_file,
            os.path.realpath(policy_file), text, tuple(sorted(variables.items())), timeout,
            best_effort)


def _cache_path(name: str) -> str:
    return state_path(name)


def _tag(secret: bytes, magic: bytes, payload: bytes) -> bytes:
    """The keyed BLAKE2b of ``magic`` then ``payload``: one key tags the three kinds of file
    (compiled plans, native entries, front-end records), and the tag says which kind it is
    (a payload tagged as one never verifies as another)."""
    try:  # the builtin module: hashlib would load OpenSSL (milliseconds)
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover
        from hashlib import blake2b
    digest = blake2b(magic, key=secret, digest_size=TAG_BYTES)
    digest.update(payload)
    return bytes(digest.digest())


def _digest(key: tuple[Any, ...]) -> str:
    data = repr(key).encode("utf-8", "surrogateescape")
    try:  # the builtin module: hashlib would load OpenSSL (milliseconds)
        from _sha256 import sha256  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - Python 3.12+ renamed it
        try:
            from _sha2 import sha256  # type: ignore[import-not-found]
        except ImportError:
            from hashlib import sha256
    return str(sha256(data).hexdigest()[:40])


def lookup(policy_file: str, text: bytes, variables: Mapping[str, str], timeout: Optional[str],
           best_effort: bool, *, handed_over: bool = True) -> Optional[Lookup]:
    """The cache slot for the policy file whose bytes are ``text``; None when the cache
    is off or unusable (no keyring, no private directory). ``handed_over=False`` (the
    API): no front end handed this run over, its environment holds no mark to take."""
    # Set by sandlock-run for the run it hands over when its native entry is stale ("1"):
    # compile afresh, and store both entries anew; or missing ("missing": written once
    # the plan is compiled here, if it can have one). Taken out: never the tool's.
    mark = os.environ.pop(ENV_NATIVE_STALE, "") if handed_over else ""
    stale = mark == "1"
    if os.environ.get(ENV_NO_CACHE):
        return None
    try:
        key = _key(policy_file, text, variables, timeout, best_effort)
    except (OSError, ValueError):
        return None  # the full path will report it
    secret = cachekey.secret(open_private_dir)[0]
    if secret is None:
        return None
    directory = open_private_dir(_cache_path("policies"), create=True)
    if directory is None:
        return None
    name = _digest(key)
    entry = None if stale else _read(directory, name, secret, key, policy_file)
    if entry is not None and mark == "missing" and entry.native_possible:
        entry = None  # a miss: its compile writes the native entry too
    # Listed before the compile's checks read the list (the witness). Unlisted, the runs
    # of other environments would let a grant read what is stored here: store nothing.
    if entry is None and not cachekey.remember_root(open_private_dir,
                                                    os.path.dirname(_cache_path("x"))):
        os.close(directory)
        return None
    return Lookup(key, directory, name, secret, entry, policy_file,
                  (policy_file, text, variables, timeout, best_effort, key[2]))


def through(cached: Optional[Lookup], data: Optional[bytes], load: Callable[[], Policy],
            compile: Callable[[Policy], Compiled],
            steps: Optional[Callable[[Compiled], Sequence[str]]]) -> tuple[Compiled, Optional[Policy]]:
    """The plan of a policy file whose bytes are ``data``, and the policy it was compiled
    from: read back from ``cached`` on a hit (no policy is loaded: None in its place),
    else ``load``ed and ``compile``d, then stored in ``cached``'s slot. ``steps`` (the
    child's steps, encoded a layer above) also stores the native entry, from what the
    grant checks of this compile saw: only a process that compiles one policy at a time
    (the CLI) may record them; None stores none. Closes the slot's directory."""
    from .grants import GrantError, witnessing

    try:
        if cached is not None and cached.entry is not None:
            try:
                hit = cached.entry.compile()
                hit.source_bytes = data  # what the entry's key holds: what runs
                return hit, None
            except GrantError:
                pass  # the full path reports it with the policy's line
        loaded = load()
        if steps is None:
            made = compile(loaded)
            if cached is not None:
                cached.store(loaded, made)
            return made, loaded
        # What the grant checks see, for the native entry (when the plan is stored)
        with witnessing(cached is not None) as witness:
            made = compile(loaded)
        if cached is not None:  # never stores a policy with [credentials] (their port)
            cached.store(loaded, made, steps(made), witness)
        return made, loaded
    finally:
        if cached is not None:  # done with the cache: its directory is not the tool's
            os.close(cached.directory)


# ----------------------------------------------------------------------------
# Reading


def _read(directory: int, name: str, secret: bytes, key: tuple[Any, ...],
          policy_file: str) -> Optional[Entry]:
    from ..policy.readfile import read_policy_bytes

    try:
        data = read_policy_bytes(name, directory, os.O_NOFOLLOW)  # regular, bounded, never blocks
    except OSError:
        return None
    head = len(MAGIC) + TAG_BYTES
    if not data.startswith(MAGIC):
        return None
    from _operator import _compare_digest

    if not _compare_digest(data[len(MAGIC):head], _tag(secret, MAGIC, data[head:])):
        return None
    try:
        stored_key, value = marshal.loads(data[head:])
        if (stored_key != key or not well_formed(value) or value["plan"][0] > kernel.landlock_abi()
                or not _fresh(value)):
            return None
        return Entry(value, policy_file)
    except (ValueError, TypeError, KeyError, EOFError, IndexError):
        return None


def _fresh(value: dict[str, Any]) -> bool:
    """Whether what the entry was compiled from is still what is on disk."""
    from ..policy.readfile import read_policy_bytes

    for kind, where, content in value["layers"]:
        path = os.path.join(PROFILE_DIR, where + ".toml") if kind == "builtin" else where
        try:
            if read_policy_bytes(path) != content:
                return False
        except OSError:
            return False
    for path, present in value["checks"]:
        if os.path.exists(path) != present:
            return False
    return bool(seccomp_ok())


def seccomp_ok() -> bool:
    return kernel.seccomp_supported() is None


# ----------------------------------------------------------------------------
# Writing (only after a full compile succeeded)


def _cacheable(obj: object) -> bool:
    """True if ``obj`` (a policy dataclass) uses only fields this cache reproduces."""
    from dataclasses import MISSING, fields, is_dataclass

    known = KNOWN_FIELDS.get(type(obj).__name__, set())
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.name not in known:
            default = f.default if f.default is not MISSING else (
                f.default_factory() if f.default_factory is not MISSING else MISSING)
            if value != default:
                return False
            continue
        for item in value if isinstance(value, tuple) else (value,):
            if is_dataclass(item) and not _cacheable(item):
                return False
    return True


def _layer_files(policy: Policy) -> list[tuple[str, str, bytes]]:
    """Every layer the policy extends, as (kind, where, bytes) exactly as compiled (the
    policy's own file excluded: it is in the key)."""
    texts = dict(policy.inputs)
    out = []
    for source in policy.layers[:-1]:
        data = texts[source].encode("utf-8")
        if source.startswith("<builtin:") and source.endswith(">"):
            out.append(("builtin", source[len("<builtin:"):-1], data))
        else:
            out.append(("file", source, data))
    return out


def _cgroup_key(found: Any, why: str) -> tuple[Any, ...]:
    return (None, why) if found is None else tuple(found.wire())


def _value(policy: Policy, compiled: Compiled, policy_file: str) -> Optional[dict[str, Any]]:
    from ..linux import cgroups
    from .abi import FILE_ONLY, WRITE_RIGHTS
    from .compiler import Compiled as CompiledType

    plan = compiled.landlock
    if (type(compiled) is not CompiledType or not set(vars(compiled)) <= KNOWN_COMPILED
            or not _cacheable(policy) or plan is None
            or policy.source != (DICT_SOURCE if policy_file == DICT else policy_file)):
        return None
    # Every policy path: those granted exist, the optional ones skipped did not (loaded once).
    checks = (*((path, True) for path in dict.fromkeys(rule.path for rule in policy.paths)),
              *((path, False) for path in policy.absent))
    return {
        "source": compiled.source,
        "layers": tuple(_layer_files(policy)),
        "checks": checks,
        "plan": (plan.abi, plan.handled_fs, plan.handled_net, plan.scoped, plan.paths, plan.ports,
                 int(FILE_ONLY), int(WRITE_RIGHTS)),
        "warnings": tuple(compiled.warnings),
        "bpf": bytes(compiled.bpf),
        "signal_gate": compiled.signal_gate,
        "rlimits": tuple((int(r), int(v)) for r, v in compiled.rlimits),
        "env": (tuple(compiled.env_passed), tuple(compiled.env_set)),
        "timeout": compiled.timeout,
        "cgroup": None if policy.limits.processes is None else _cgroup_key(*cgroups.find()),
    }


def _write(directory: int, name: str, secret: bytes, key: tuple[Any, ...],
           value: dict[str, Any]) -> None:
    """Write the entry under a temporary name, check it reads back whole (a short
    write, a full disk or a file-size limit leaves no entry), then rename it into place."""
    payload = marshal.dumps((key, value))
    _put(directory, name, MAGIC + _tag(secret, MAGIC, payload) + payload)


def _put(directory: int, name: str, data: bytes, prune: bool = True) -> None:
    """Write ``data`` as ``name`` whole (read back, then renamed in); then, with ``prune``,
    keep the directory bounded (:func:`_prune`: only for a directory of entries alone)."""
    tmp = f".{name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600,
                 dir_fd=directory)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        from ..policy.readfile import read_policy_bytes

        if read_policy_bytes(tmp, directory, os.O_NOFOLLOW) != data:
            raise OSError("the entry did not read back as written")
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=directory)
        except OSError:
            pass
        raise
    if prune:
        _prune(directory)


def _prune(directory: int) -> None:
    """Keep the cache bounded: past MAX_ENTRIES, drop the least recently written half."""
    listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
    try:
        names = [n for n in os.listdir(listing) if not n.startswith(".")]
    finally:
        os.close(listing)
    if len(names) <= MAX_ENTRIES:
        return
    def age(n: str) -> int:
        try:
            return os.stat(n, dir_fd=directory, follow_symlinks=False).st_mtime_ns
        except OSError:
            return 0
    for name in sorted(names, key=age)[: len(names) // 2]:
        try:
            os.unlink(name, dir_fd=directory)
        except OSError:
            pass


# ----------------------------------------------------------------------------
# The native entry: the same plan in a format for C (docs/design.md "Native front end")
#
# A file of fields, each a u32 (little-endian) length and that many bytes; a number is a
# field of ASCII decimal digits; a list is a count field, then its items. The file is
# NATIVE_MAGIC, the keyed BLAKE2b tag (TAG_BYTES, the same key as the marshal entries)
# of everything after it, then: the key bytes (native_key), the run's facts
# (NATIVE_FIELDS, in that order) and nothing after. It lives in NATIVE_DIR; its name is
# NATIVE_PREFIX and the hex unkeyed BLAKE2b (NATIVE_NAME_BYTES) of the key bytes: the C front end
# (exec/helper/sandlock_run.c) computes both from what it sees and compares the key in full.

NATIVE_FORMAT = 4
#: Set by the front end when it hands a run over because its entry is stale.
ENV_NATIVE_STALE = "SANDLOCK_NATIVE_STALE"
#: The interpreter's variables that change what the grant checks protect (its import
#: path, its site directories, where it reads bytecode): with any of them set the front
#: end falls back (the witness holds the interpreter started without them).
PYTHON_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE",
              "PYTHONPLATLIBDIR", "PYTHONPYCACHEPREFIX", "PYTHONSAFEPATH", "PYTHONSTARTUP",
              "PYTHONEXECUTABLE", "PYTHONUTF8", "PYTHONCOERCECLOCALE")
NATIVE_MAGIC = b"sandlock-native-entry\x00%d\n" % NATIVE_FORMAT
#: Set by the installed `sandlock` command (the front end) for the run it hands over: the
#: name of its record, which says what interpreter and package its Python CLI (this
#: process) runs with; write_native writes it beside the native entry (write_front).
ENV_FRONT_END = "SANDLOCK_FRONT_END"
FRONT_MAGIC = b"sandlock-front-record\x00%d\n" % NATIVE_FORMAT
FRONT_PREFIX = "f-"
FRONT_BYTES = 32
#: ENV_FRONT_END's value, taken out of the environment by the CLI (cli/run.py main).
front_end: Optional[str] = None
NATIVE_PREFIX = "n-"
NATIVE_DIR = "native"  #: beside "policies", the marshal entries' directory
NATIVE_NAME_BYTES = 20
#: The environment variables the key holds, in order (each: present or not, and its value).
NATIVE_ENV = ("SANDLOCK_ABI", "HOME", "TMPDIR", "XDG_CACHE_HOME", "SANDLOCK_STUB",
              "SANDLOCK_STATE_DIR", "LC_ALL", "LC_CTYPE", "LANG")
#: The facts after the key, in order (read_native's names).
NATIVE_FIELDS = ("source", "layers", "checks", "abi", "handled_fs", "handled_net", "scoped",
                 "paths", "ports", "file_only", "write_rights", "warnings", "bpf", "steps",
                 "env_passed", "env_set", "timeout",
                 # what the grant checks saw (compile.grants.Witness)
                 "mountinfo", "home", "state_dir", "key_file", "interpreter", "python_files",
                 "site_dirs",
                 "grants", "protected", "exposures", "listings")


def _field(data: bytes) -> bytes:
    if len(data) >= 2**32:
        raise ValueError("a field too long for a native entry")
    return len(data).to_bytes(4, "little") + data


def _number(value: int) -> bytes:
    if value < 0:
        raise ValueError("a negative number in a native entry")
    return _field(b"%d" % value)


def _optional(value: Optional[str]) -> bytes:
    """An optional text: a count (0 or 1), then the text if there is one."""
    return _number(0) if value is None else _number(1) + _field(os.fsencode(value))


def _ids(ids: Sequence[tuple[int, int]]) -> bytes:
    """(device, inode) pairs: a count, then two numbers each."""
    return _number(len(ids)) + b"".join(_number(dev) + _number(ino) for dev, ino in ids)


def _some(value: Optional[bytes]) -> bytes:
    """Something optional already encoded: a count (0 or 1), then it."""
    return _number(0) if value is None else _number(1) + value


def _listing(names: Optional[Sequence[bytes]]) -> bytes:
    """A directory's listing: none (it could not be listed), or a count and the names."""
    return _some(None if names is None else
                 _number(len(names)) + b"".join(_field(name) for name in names))


def _witness_fields(witness: Witness) -> bytes:
    """The witness's facts, in NATIVE_FIELDS' order (after "timeout")."""
    from hashlib import blake2b

    out = [_some(None if witness.mountinfo is None else
                 _field(blake2b(witness.mountinfo, digest_size=32).digest())),
           _optional(witness.home), _optional(witness.state_dir), _optional(witness.key_file),
           _optional(witness.interpreter),
           _number(len(witness.python_files))]
    out += [_field(os.fsencode(path)) + _some(None if digest is None else _field(digest))
            for path, digest in witness.python_files]
    out.append(_number(len(witness.site_dirs)))
    out += [_field(os.fsencode(base)) + _listing(names) for base, names in witness.site_dirs]
    out.append(_number(len(witness.grants)))
    out += [_field(os.fsencode(path)) + _number(int(is_dir)) + _field(os.fsencode(canonical))
            + _ids(chain) for path, chain, canonical, is_dir in witness.grants]
    out.append(_number(len(witness.protected)))
    for where, (own, ancestors, position) in witness.protected.items():
        out.append(_field(os.fsencode(where))
                   + _some(None if own is None else _number(own[0]) + _number(own[1]))
                   + _ids(ancestors) + _some(None if position is None else
                                             _field(os.fsencode(position[0]))
                                             + _field(os.fsencode(position[1]))))
    out.append(_number(len(witness.exposures)))
    out += [_number(key) + _field(os.fsencode(point)) + _some(None if above is None else _ids(above))
            for key, (point, above) in witness.exposures.items()]
    out.append(_number(len(witness.listings)))
    out += [_field(os.fsencode(base)) + _listing(names) for base, names in witness.listings.items()]
    return b"".join(out)


def _code_fields(code: tuple[Any, ...]) -> bytes:
    """_code_id's answer as fields: ("build", id) in the binary; else a count of
    (subpackage, file name, size, mtime_ns) rows."""
    if code and code[0] == "build":
        return _number(0) + _field(code[1])
    if not all(type(row) is tuple and len(row) == 4 for row in code):
        raise ValueError("no code id the front end can compute")
    out = [_number(len(code))]
    for sub, name, size, mtime in code:
        out += [_field(sub.encode()), _field(os.fsencode(name)), _number(size), _number(mtime)]
    return b"".join(out)


def native_possible(value: dict[str, Any]) -> bool:
    """Whether the front end can run the plan of ``value`` (an entry's, see _value): one
    that needs no supervisor or check it does not make (the signal gate, a pids cgroup).
    A plan with credential routes is never stored."""
    return not value["signal_gate"] and value["cgroup"] is None


def native_key(policy_file: str, text: bytes, variables: Mapping[str, str],
               timeout: Optional[str], best_effort: bool,
               code: Optional[tuple[Any, ...]] = None) -> bytes:
    """The native entry's key: every fact _key holds that the C front end can see without
    Python, as bytes it builds the same way (tests/test_native_run.py compares them).
    ``sys.path`` is replaced by the interpreter, the package directory, the first entry of
    the path and the directory of the script (both the console script's the installed
    command runs, resolved and as run: the checks protect both, so each install's plans
    are its own): the front end runs that with this package on a miss; what else decides
    the import path is in the witness (grants.Witness). In the single-file binary the
    same fields name the unpacked program and its bundle, and the code is the build id:
    the front end linked into its stub reads them there. Empty
    when the front end could not build the same key (the entry is then not written)."""
    frozen = getattr(sys, "frozen", False)
    if frozen:  # the binary: its interpreter ignores the environment and has no site
        from .grants import ENV_STATE, ENV_STUB

        if not (os.environ.get(ENV_STUB) and os.environ.get(ENV_STATE)):
            return b""  # not started by the binary's stub, whose front end reads entries
    flags = sys.flags
    if not frozen and (any(os.environ.get(name) for name in PYTHON_ENV) or flags.no_site
                       or flags.isolated or flags.ignore_environment or flags.no_user_site):
        # This interpreter's import path is not the one the front end's would have (it
        # starts it with no such variable or flag): what is protected differs.
        return b""
    env = os.environ  # as the caller gave it: cli/run.py main undoes the locale coercion
    fields = [_field(NATIVE_MAGIC), _field(__version__.encode()), _field(os.fsencode(sys.executable)),
              _field(os.fsencode(PACKAGE_DIR)), _field(os.fsencode(sys.path[0] if sys.path else "")),
              _field(os.fsencode(_main_directory())),
              _code_fields(_code_id() if code is None else code),
              _field(os.uname().machine.encode()), _number(os.geteuid()), _number(os.getuid()),
              _number(os.getgid()), _number(os.getegid()),
              *(_number(hard) for hard in hard_limits()),
              _number(kernel.landlock_abi())]
    fields += [_optional(env.get(name)) for name in NATIVE_ENV]
    from .grants import named_directory

    fields += [_field(os.fsencode(os.getcwd())), _field(os.fsencode(named_directory())),
               _field(os.fsencode(policy_file)),
               _field(os.fsencode(os.path.realpath(policy_file))), _field(text)]
    pairs = sorted((os.fsencode(name), os.fsencode(value)) for name, value in variables.items())
    fields.append(_number(len(pairs)))
    fields += [_field(name) + _field(value) for name, value in pairs]
    fields += [_optional(timeout), _number(int(best_effort))]
    return b"".join(fields)


def _main_directory() -> str:
    """The directory of the script this interpreter runs (``__main__``'s file, as given: a
    link is not resolved), whose modules' directories the checks protect; empty for
    ``-c``."""
    name = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.dirname(os.path.abspath(name)) if isinstance(name, str) else ""


def native_name(key: bytes) -> str:
    from hashlib import blake2b

    return NATIVE_PREFIX + blake2b(key, digest_size=NATIVE_NAME_BYTES).hexdigest()


def native_payload(key: bytes, value: dict[str, Any], compiled: Compiled,
                   steps: Sequence[str], witness: Optional[Witness]) -> Optional[bytes]:
    """The native entry after its tag, or None for a plan the front end does not run: one
    that needs a supervisor or a check it does not make (the signal gate, a pids cgroup),
    or whose checks' witness is missing or saw a fact change while they ran."""
    if not native_possible(value) or compiled.routes is not None:
        return None
    if witness is None or not witness.sound or len(witness.grants) != len(value["plan"][4]):
        return None
    abi, handled_fs, handled_net, scoped, paths, ports, file_only, write_rights = value["plan"]
    timeout = value["timeout"]
    passed, set_ = value["env"]
    texts = [value["source"], *(where for _, where, _ in value["layers"]),
             *(path for path, _ in value["checks"]), *(path for path, _ in paths), *passed,
             *(part for pair in set_ for part in pair), *value["warnings"]]
    if not all(_portable(text) for text in texts):
        return None
    out = [_field(key), _field(os.fsencode(value["source"])), _number(len(value["layers"]))]
    out += [_field(kind.encode()) + _field(os.fsencode(where)) + _field(content)
            for kind, where, content in value["layers"]]
    out.append(_number(len(value["checks"])))
    out += [_field(os.fsencode(path)) + _number(int(present)) for path, present in value["checks"]]
    out += [_number(abi), _number(handled_fs), _number(handled_net), _number(scoped),
            _number(len(paths))]
    out += [_field(os.fsencode(path)) + _number(rights) for path, rights in paths]
    out.append(_number(len(ports)))
    out += [_number(port) + _number(rights) for port, rights in ports]
    out += [_number(file_only), _number(write_rights), _number(len(value["warnings"]))]
    out += [_field(line.encode("utf-8", "surrogateescape")) for line in value["warnings"]]
    out += [_field(value["bpf"]), _number(len(steps))]
    out += [_field(os.fsencode(step)) for step in steps]
    out.append(_number(len(passed)))
    out += [_field(os.fsencode(name)) for name in passed]
    out.append(_number(len(set_)))
    out += [_field(os.fsencode(name)) + _field(os.fsencode(text)) for name, text in set_]
    out.append(_optional(None if timeout is None else repr(float(timeout))))
    out.append(_witness_fields(witness))
    return b"".join(out)


def _portable(text: str) -> bool:
    """Whether ``text`` is the same bytes in every filesystem encoding: ASCII, and bytes
    that did not decode (surrogate escapes). Another character depends on the locale's
    data, which no key holds (LOCPATH, the locales installed): its plan gets no native
    entry, as a tool's path written \u00e9 names other bytes under ISO-8859-1."""
    return all(c < "\x80" or "\udc80" <= c <= "\udcff" for c in text)


def write_native(secret: bytes, key: bytes, value: dict[str, Any], compiled: Compiled,
                 steps: Sequence[str], witness: Optional[Witness]) -> None:
    """Write the native entry of a plan just stored, in its own private directory
    (NATIVE_DIR); none for a plan the front end does not run (it then always falls back)."""
    payload = None if not key else native_payload(key, value, compiled, steps, witness)
    if payload is None:
        return
    directory = open_private_dir(_cache_path(NATIVE_DIR), create=True)
    if directory is None:
        return
    try:
        _put(directory, native_name(key), NATIVE_MAGIC + _tag(secret, NATIVE_MAGIC, payload) + payload)
        write_front(secret, directory)
        _prune(directory)
    finally:
        os.close(directory)


def write_front(secret: bytes, directory: int) -> None:
    """The record of the front end that handed this run over (front_end, the hex hash of
    its identity), if one did: this interpreter and this package, what native_key holds,
    which the front end cannot learn without starting Python. Tagged as the entries are:
    a record a tool forged would not verify."""
    name = front_end or ""
    if len(name) != 2 * FRONT_BYTES or name.strip("0123456789abcdef"):
        return
    payload = (_field(bytes.fromhex(name)) + _field(os.fsencode(sys.executable))
               + _field(os.fsencode(PACKAGE_DIR)))
    _put(directory, FRONT_PREFIX + name, FRONT_MAGIC + _tag(secret, FRONT_MAGIC, payload) + payload)


class _Fields:
    """A reader of a native entry's fields (the tests' reader; the C front end's twin)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def raw(self) -> bytes:
        if self.at + 4 > len(self.data):
            raise ValueError("a native entry cut short")
        size = int.from_bytes(self.data[self.at:self.at + 4], "little")
        start, self.at = self.at + 4, self.at + 4 + size
        if self.at > len(self.data):
            raise ValueError("a native entry cut short")
        return self.data[start:self.at]

    def number(self) -> int:
        text = self.raw()
        if not (text.isdigit() and text.isascii()):
            raise ValueError("a number that is not decimal digits")
        return int(text)

    def text(self) -> str:
        return os.fsdecode(self.raw())

    def count(self, most: int) -> int:
        count = self.number()
        if count > most:
            raise ValueError("a count above its bound")
        return count

    def optional(self) -> Optional[str]:
        return self.text() if self.count(1) else None

    def ids(self) -> list[tuple[int, int]]:
        return [(self.number(), self.number()) for _ in range(self.number())]


def read_native(data: bytes, secret: bytes) -> Optional[dict[str, Any]]:
    """A native entry's key and facts (NATIVE_FIELDS), or None if it is not one whose tag
    verifies with ``secret`` and whose fields are exactly those written."""
    head = len(NATIVE_MAGIC) + TAG_BYTES
    if not data.startswith(NATIVE_MAGIC):
        return None
    from _operator import _compare_digest

    if not _compare_digest(data[len(NATIVE_MAGIC):head], _tag(secret, NATIVE_MAGIC, data[head:])):
        return None
    r = _Fields(data[head:])
    try:
        out: dict[str, Any] = {"key": r.raw(), "source": r.text()}
        out["layers"] = [(r.text(), r.text(), r.raw()) for _ in range(r.number())]
        out["checks"] = [(r.text(), bool(r.number())) for _ in range(r.number())]
        for name in ("abi", "handled_fs", "handled_net", "scoped"):
            out[name] = r.number()
        out["paths"] = [(r.text(), r.number()) for _ in range(r.number())]
        out["ports"] = [(r.number(), r.number()) for _ in range(r.number())]
        out["file_only"], out["write_rights"] = r.number(), r.number()
        out["warnings"] = [r.raw().decode("utf-8", "surrogateescape") for _ in range(r.number())]
        out["bpf"] = r.raw()
        out["steps"] = [r.text() for _ in range(r.number())]
        out["env_passed"] = [r.text() for _ in range(r.number())]
        out["env_set"] = [(r.text(), r.text()) for _ in range(r.number())]
        timeout = r.optional()
        out["timeout"] = None if timeout is None else float(timeout)
        out["mountinfo"] = r.raw() if r.count(1) else None
        out["home"], out["state_dir"], out["key_file"] = r.optional(), r.optional(), r.optional()
        out["interpreter"] = r.optional()
        out["python_files"] = [(r.text(), r.raw() if r.count(1) else None)
                               for _ in range(r.number())]
        out["site_dirs"] = [(r.text(), [r.raw() for _ in range(r.number())] if r.count(1) else None)
                            for _ in range(r.number())]
        out["grants"] = [(r.text(), bool(r.number()), r.text(), r.ids())
                         for _ in range(r.number())]
        out["protected"] = [(r.text(), (r.number(), r.number()) if r.count(1) else None, r.ids(),
                             (r.text(), r.text()) if r.count(1) else None)
                            for _ in range(r.number())]
        out["exposures"] = [(r.number(), r.text(), r.ids() if r.count(1) else None)
                            for _ in range(r.number())]
        out["listings"] = [(r.text(), [r.raw() for _ in range(r.number())] if r.count(1) else None)
                           for _ in range(r.number())]
    except ValueError:
        return None
    return out if r.at == len(r.data) else None
