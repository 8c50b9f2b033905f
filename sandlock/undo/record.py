"""Where a run's record, snapshots and scratch copies live, and the record's MAC.

* Records and checkpoint snapshots: ``<cache>/sandlock/runs/RUN/`` (``<cache>`` is
  ``$XDG_CACHE_HOME`` or ``~/.cache``, as for the compiled-policy cache): inside
  sandlock's state directory, which no write grant may reach, is on, or lies inside
  (:func:`sandlock.compile.grants.protected`); nor may another run's grant of any right
  while the run exists (:mod:`sandlock.compile.reviewdirs`).
* Dry-run scratch copies: ``<cache>/sandlock-scratch/RUN/N/``, granted to the tool in
  place of its write grants, so never trusted: everything applied from one is checked
  against the record (:func:`sandlock.undo.tree.sync`); no other run's grant may reach
  one while it exists.

A record is JSON behind a keyed BLAKE2b tag. The key is derived from the records key
(:func:`sandlock.compile.cachekey.records_secret`: a file no grant of any right may
reach, which outlives a reboot: a checkpoint can be rolled back after one), so a tool
that can write a record or a snapshot
(a later run with a broader policy, or any same-uid process without the key) cannot
make sandlock apply or restore what it wrote: a record that does not verify, or a
snapshot file whose digest differs from its record's, is refused before anything is
changed.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import time
from typing import Any, Optional

from ..compile import cache, cachekey
from ..compile.reviewdirs import runs_path as runs_path  # one definition of the places
from ..compile.reviewdirs import scratch_path as scratch_path
from .tree import UndoError

RECORD = "record"
VERSION = 1
TAG_BYTES = 32
#: A record (manifests of 20,000 files are ~6 MB) larger than this is refused unread.
MAX_RECORD = 512 << 20
#: What a run's name looks like: given back to the user, read from the command line.
RUN_NAME = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{8}$")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC




def open_base(path: str) -> int:
    fd = cache.open_private_dir(path, create=True, private_from=2)
    if fd is None:
        raise UndoError(cachekey.not_private(path))
    return fd


def _mac_key() -> bytes:
    secret, where = cachekey.records_secret(cache.open_private_dir)
    if secret is None:
        raise UndoError(f"no key to authenticate run records: {where}")
    return _blake2b(b"sandlock:undo-record:v1", secret)


def _blake2b(payload: bytes, secret: bytes) -> bytes:
    from hashlib import blake2b

    return bytes(blake2b(payload, key=secret, digest_size=TAG_BYTES).digest())


def new_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(4).hex()


def check_name(name: str) -> str:
    if not RUN_NAME.match(name):
        raise UndoError(f"{name!r} is not the name of a run (as `sandlock run --dry-run` or "
                        "`--checkpoint` printed it, e.g. 20260101-120000-0123abcd)")
    return name


def open_run(base: int, name: str, create: bool = False) -> int:
    """The run directory ``name`` below ``base``, never through a link."""
    check_name(name)
    if create:
        os.mkdir(name, 0o700, dir_fd=base)
    try:
        return os.open(name, _DIR, dir_fd=base)
    except FileNotFoundError:
        raise UndoError(f"no run {name} (already applied, discarded or rolled back?)") from None
    except OSError as exc:
        raise UndoError(f"run {name}: cannot open its directory: {exc.strerror}") from None


def save(directory: int, name: str, value: dict[str, Any]) -> None:
    """Write the record of run ``name`` (tagged) into its directory: a temporary file,
    then renamed over the name."""
    body = json.dumps({**value, "version": VERSION, "run": name}, separators=(",", ":"),
                      sort_keys=True).encode("ascii")
    data = _blake2b(body, _mac_key()) + body
    temp = f".{RECORD}.{os.urandom(6).hex()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=directory)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temp, RECORD, src_dir_fd=directory, dst_dir_fd=directory)


def authentic(tag: bytes, body: bytes) -> bool:
    """``tag`` is the record key's MAC of ``body``."""
    return hmac.compare_digest(tag, _blake2b(body, _mac_key()))


def load(directory: int, name: str) -> dict[str, Any]:
    """The record of run ``name``, if its tag verifies and it names that run."""
    try:
        fd = os.open(RECORD, _READ, dir_fd=directory)
    except OSError as exc:
        raise UndoError(f"run {name}: no readable record ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        import stat

        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_RECORD:
            raise UndoError(f"run {name}: its record is not a regular file of a sane size")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    tag, body = data[:TAG_BYTES], data[TAG_BYTES:]
    if not authentic(tag, body):
        raise UndoError(f"run {name}: its record does not verify (changed since sandlock wrote "
                        "it, or written without sandlock's key): refusing to use it")
    value: Optional[dict[str, Any]] = json.loads(body)
    if not isinstance(value, dict) or value.get("version") != VERSION or value.get("run") != name:
        raise UndoError(f"run {name}: its record is of another version or run")
    return value
