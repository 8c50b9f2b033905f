"""The run log: one JSON line per run, chained and authenticated (issue 27).

Off by default; ``SANDLOCK_LOG=1`` in the launcher's environment (`sandlock run`, or
the process that makes a :class:`sandlock.Sandbox`) turns it on, in
``<home>/.cache/sandlock/log`` (``<home>`` from the password database, as the cache
key: :func:`sandlock.compile.cachekey.key_directory`); ``SANDLOCK_LOG=/abs/dir`` puts
it in that directory. Each run then appends to ``runs.jsonl`` one record: time, user,
policy file and the SHA-256 of its bytes as the run compiled them (never as the file is
when the run ends: it may have been replaced meanwhile), command, exit status, and the
run's reports — what the policy refused when traced, network refusals, credential-route
refusals (method, path, rule: the route server's own lines, which never hold the
secret). Every string is written JSON-escaped (``ensure_ascii``): a tool's file or
command name cannot add a line or a terminal escape to the log.

Why off: while the log is on, no grant of any right may reach its directory
(:func:`exposed`, checked with the key files by
:class:`sandlock.compile.grants.SecretCheck`, and as a state directory for write
grants): a policy that reads the whole home directory is then refused. Each logged
run also costs a key lookup, a lock, an append and an anchor rewrite.

The chain: record ``n`` carries ``seq = n`` and ``prev``, the ``mac`` of record ``n-1``
(64 zeros for the first), and its own ``mac``, HMAC-SHA256 over its other fields with
a key derived from the records key (:func:`sandlock.compile.cachekey.records_secret`:
a file no grant of any right may reach, which outlives a reboot, unlike the keyring's
cache key: a log keyed with that read as forged after every reboot). So a
record removed, edited or moved breaks the chain, and no one without the key can
write a record that continues it. The tail (records cut off the end, or the whole
file replaced by an older copy of itself) is caught by the anchor: the count and last
``mac``, itself authenticated, kept in sandlock's state directory
(``anchors/<hash of the log's directory>``), which no grant of any run may write,
whatever that run's policy and whether or not it logs. `sandlock log --verify`
checks all of it.

Not covered: a process of this uid that is not confined (it can read the key file
where the key is a file, and rewrite anything), and a run that dies before it logs
(SIGKILL of the launcher). Records are appended without fsync: a crash of the
machine may lose the last ones, which verify then reports.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from .logdir import ENV, LogError, directory, exposed

__all__ = ["ENV", "LogError", "append", "directory", "exposed", "log_run", "verify"]

TYPE_CHECKING = False  # typing costs milliseconds on every `sandlock run`
if TYPE_CHECKING:
    from typing import Any, Iterator, Optional, Sequence

    from .compiler import Compiled

LOG_FILE = "runs.jsonl"
ANCHORS = "anchors"
GENESIS = "0" * 64
#: What the key of the log is derived from the records key with (domain separation: a
#: tag for one can never stand for the other).
DERIVE = b"sandlock:run-log:v1"
#: The largest log verify reads whole, and the largest record.
MAX_LOG = 256 << 20
MAX_FIELD = 4096
MAX_ITEMS = 200
FIELDS = ("seq", "time", "user", "uid", "policy", "policy_sha256", "command", "exit",
          "refused", "reports", "credentials", "api", "not_enforced", "prev")
#: The fields of a record, with its MAC, as this version writes them and as the version
#: before ``not_enforced`` did (its records still verify: the MAC covers what they hold).
RECORD_SHAPES = (sorted((*FIELDS, "mac")),
                 sorted(name for name in (*FIELDS, "mac") if name != "not_enforced"))


def _key() -> bytes:
    import hashlib
    import hmac

    from .cache import open_private_dir
    from .cachekey import records_secret

    key, where = records_secret(open_private_dir)
    if key is None:
        raise LogError(f"the run log needs its key to authenticate its records: {where}")
    return hmac.new(key, DERIVE, hashlib.sha256).digest()


def _mac(key: bytes, record: dict[str, Any]) -> str:
    import hashlib
    import hmac
    import json

    body = {k: v for k, v in record.items() if k != "mac"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def _anchor_mac(key: bytes, log_dir: str, count: int, last: str) -> str:
    import hashlib
    import hmac

    return hmac.new(key, f"anchor\0{log_dir}\0{count}\0{last}".encode(),
                    hashlib.sha256).hexdigest()


def _anchor_name(log_dir: str) -> str:
    import hashlib

    return hashlib.sha256(os.fsencode(log_dir)).hexdigest()[:32]


def _open_dirs(log_dir: str, create: bool) -> tuple[int, int]:
    """Descriptors of the log's directory and of the anchors' (private, reached
    without a link: :func:`sandlock.compile.cache.open_private_dir`)."""
    from .cache import open_private_dir
    from .cachekey import key_directory, not_private

    state = key_directory()
    if state is None:
        raise LogError("the run log needs a home directory in the password database (its "
                       "anchor lives in sandlock's state directory)")
    logs = open_private_dir(log_dir, create=create, private_from=1)
    if logs is None:
        raise LogError(not_private(log_dir))
    if create:
        from .cachekey import remember_root, roots_path

        if not remember_root(open_private_dir, os.path.normpath(log_dir)):
            os.close(logs)
            raise LogError(f"cannot list {log_dir!r} in {roots_path()!r}, the list of "
                           "sandlock's state directories: the runs of another environment "
                           "would not refuse a grant on the log")
    anchors = open_private_dir(os.path.join(state, ANCHORS), create=create, private_from=1)
    if anchors is None:
        os.close(logs)
        raise LogError(not_private(os.path.join(state, ANCHORS)))
    return logs, anchors


def _read_anchor(anchors: int, log_dir: str, key: bytes) -> tuple[int, str]:
    """(count, last mac) of the log in ``log_dir``; (0, GENESIS) with no anchor yet."""
    import json

    from ..policy.readfile import read_policy_bytes

    try:
        data = read_policy_bytes(_anchor_name(log_dir), anchors, os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0, GENESIS
    except OSError as exc:
        raise LogError(f"cannot read the run log's anchor: {exc.strerror}") from None
    try:
        found = json.loads(data)
        count, last, mac = found["count"], found["last"], found["mac"]
        if not isinstance(count, int) or not isinstance(last, str) or not isinstance(mac, str):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise LogError("the run log's anchor is malformed") from None
    import hmac

    if not hmac.compare_digest(mac, _anchor_mac(key, log_dir, count, last)):
        raise LogError("the run log's anchor is not authentic")
    return count, last


def _write_anchor(anchors: int, log_dir: str, key: bytes, count: int, last: str) -> None:
    import json

    name = _anchor_name(log_dir)
    tmp = f".{name}.{os.getpid()}.{os.urandom(6).hex()}"
    text = json.dumps({"log": log_dir, "count": count, "last": last,
                       "mac": _anchor_mac(key, log_dir, count, last)})
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=anchors)
    try:
        os.write(fd, text.encode() + b"\n")
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=anchors, dst_dir_fd=anchors)


def _clip(value: object) -> object:
    if isinstance(value, str):
        return value if len(value) <= MAX_FIELD else value[:MAX_FIELD] + "...[cut]"
    if isinstance(value, (list, tuple)):
        items = [_clip(v) for v in list(value)[:MAX_ITEMS]]
        return items + (["...[cut]"] if len(value) > MAX_ITEMS else [])
    return value


def _policy_hash(data: Optional[bytes]) -> Optional[str]:
    """The SHA-256 of the policy bytes a run compiled, None without them (a dict)."""
    import hashlib

    return None if data is None else hashlib.sha256(data).hexdigest()


@contextmanager
def _opened(log_dir: str) -> Iterator[tuple[bytes, int, int]]:
    """(the key, the log file open for appending and checked, the anchors directory),
    closed on leaving."""
    key = _key()
    logs, anchors = _open_dirs(log_dir, create=True)
    try:
        fd = os.open(LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=logs)
        try:
            _check_file(fd)
            yield key, fd, anchors
        finally:
            os.close(fd)  # releases a lock taken on it
    finally:
        os.close(logs)
        os.close(anchors)


def ready() -> None:
    """Check, before a run starts, that its record can be appended (no-op while the log
    is off): the key, the private directories, the log file and the anchor. LogError
    otherwise, so that a run the log would miss never starts (found after it, the tool
    had run unlogged and its exit code was lost behind the error)."""
    log_dir = directory()
    if log_dir is None:
        return
    with _opened(log_dir) as (key, _, anchors):
        _read_anchor(anchors, log_dir, key)


def append(source: str, command: Sequence[str], exit_code: int, *,
           policy_sha256: Optional[str] = None, refused: Sequence[str] = (),
           reports: Sequence[str] = (), credentials: Sequence[str] = (), api: bool = False,
           not_enforced: Sequence[str] = ()) -> None:
    """Append one record for a finished run (no-op while the log is off).
    ``policy_sha256``: of the policy bytes the run compiled, which only the caller has
    (the file ``source`` names, read again now, may have been replaced during the run).
    ``not_enforced``: the protections the run went without (best effort, or accepted)."""
    log_dir = directory()
    if log_dir is None:
        return
    import fcntl
    import json
    import time

    with _opened(log_dir) as (key, fd, anchors):
        fcntl.flock(fd, fcntl.LOCK_EX)  # one writer at a time: the chain is a sequence
        count, last = _read_anchor(anchors, log_dir, key)
        try:
            import pwd

            user = pwd.getpwuid(os.geteuid()).pw_name
        except (ImportError, KeyError):
            user = ""
        record: dict[str, Any] = {
            "seq": count + 1,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "user": user, "uid": os.geteuid(), "policy": _clip(source),
            "policy_sha256": policy_sha256,
            "command": _clip(list(command)), "exit": exit_code,
            "refused": _clip(list(refused)), "reports": _clip(list(reports)),
            "credentials": _clip(list(credentials)), "api": api,
            "not_enforced": _clip(list(not_enforced)), "prev": last}
        record["mac"] = _mac(key, record)
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        os.write(fd, line.encode() + b"\n")
        _write_anchor(anchors, log_dir, key, count + 1, record["mac"])


def log_run(compiled: Compiled, argv: Sequence[str], code: int, events: Sequence[str] = (),
            refused: Sequence[str] = (), api: bool = False,
            checked: Optional[str] = None) -> None:
    """Append the record of a run of ``compiled`` (`sandlock run`, the API), when the log
    is on. ``events``: the run's report lines (network refusals; the credential route's
    lines are taken from ``compiled.routes``). ``checked``: the log directory the plan's
    grants were checked against (the API compiles once, runs later): a log turned on or
    moved since is an error, since no check kept the plan's grants away from it."""
    where = directory()
    if where is None:
        return
    if checked is not None and checked != where:
        raise LogError(f"{ENV} changed after this policy was compiled: its grants were not "
                       "checked against the log; make a new Sandbox")
    routes = None if api else compiled.routes
    credentials = tuple(getattr(routes, "events", ())) if routes is not None else ()
    try:
        append(compiled.source, argv, code, policy_sha256=_policy_hash(compiled.policy_bytes()),
               refused=refused, api=api,
               reports=[e for e in events if e not in credentials], credentials=credentials,
               not_enforced=compiled.warnings)
    except OSError as exc:
        raise LogError(f"cannot write the run log: {exc.strerror or exc}") from None


def _check_file(fd: int) -> None:
    from stat import S_ISREG

    info = os.fstat(fd)
    if not S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
        raise LogError("the run log is not a regular file of this uid with one link")


def verify(path: Optional[str] = None) -> tuple[int, list[str]]:
    """(records checked, problems): every record authentic and in sequence, the
    last one the anchor names. ``path``: a log file (default: the configured one)."""
    import hmac
    import json

    if path is None:
        log_dir = directory()
        if log_dir is None:
            raise LogError(f"the run log is off: set {ENV}=1 (or a directory), or name a file")
        path = os.path.join(log_dir, LOG_FILE)
    log_dir = os.path.dirname(os.path.abspath(path))
    key = _key()
    logs, anchors = _open_dirs(log_dir, create=False)
    try:
        from ..policy.readfile import read_bounded

        try:
            fd = os.open(os.path.basename(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, dir_fd=logs)
        except OSError as exc:
            raise LogError(f"cannot open {path!r}: {exc.strerror}") from None
        try:
            _check_file(fd)
            data = read_bounded(fd, MAX_LOG)
        finally:
            os.close(fd)
        if data is None:
            raise LogError(f"{path!r} is larger than {MAX_LOG} bytes")
        count, anchored = _read_anchor(anchors, log_dir, key)
    finally:
        os.close(logs)
        os.close(anchors)
    problems: list[str] = []
    last, seq = GENESIS, 0
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        problems.append(f"line {len(lines)}: the last record is cut (no newline)")
    for number, raw in enumerate(lines, 1):
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or sorted(record) not in RECORD_SHAPES:
                raise ValueError
        except ValueError:
            problems.append(f"line {number}: not a record")
            continue
        if not hmac.compare_digest(str(record["mac"]), _mac(key, record)):
            problems.append(f"line {number}: record {record['seq']!r} was altered (its MAC "
                            "does not match)")
        if record["seq"] != seq + 1 or record["prev"] != last:
            problems.append(f"line {number}: record {record['seq']!r} does not follow record "
                            f"{seq} (a record before it was removed, or records reordered)")
        seq = record["seq"] if isinstance(record["seq"], int) else -1
        last = str(record["mac"])
    if (seq, last) != (count, anchored):
        problems.append(f"the anchor names {count} records ending in {anchored[:16]}..., the "
                        f"log ends at record {seq}: records were cut off its end, or the "
                        "log was replaced by an older copy")
    return len(lines), problems
