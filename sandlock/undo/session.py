"""One reviewed run: its write grants copied before it starts, what it changed recorded
when it ends, and the decision afterwards (apply, discard, roll back).

* **Dry run** (``Review(DRY_RUN)``): each write-granted directory tree is copied into a
  private scratch directory and the policy is rewritten to grant the copy in its place
  (every grant inside the tree, of any right, moves with it; the working directory and
  ``PWD`` too, when inside). The originals are not granted at all. :func:`apply` writes
  the change back through :func:`sandlock.undo.tree.sync`; :func:`discard` drops it.
* **Checkpoint** (``Review(CHECKPOINT)``): each tree is snapshotted into sandlock's state
  directory (where no grant may write), with the digest of every file; the tool runs on
  the originals. :func:`rollback` restores the snapshot, verified by those digests.

Either way the record (:mod:`sandlock.undo.record`) holds the manifest of every tree
before and after the run, authenticated; applying or rolling back refuses when a tree
was changed by anyone since (:class:`sandlock.undo.tree.Conflict`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Optional

from . import record, tree
from .tree import UndoError

if TYPE_CHECKING:
    from ..policy.model import Policy

DRY_RUN = "dry-run"
CHECKPOINT = "checkpoint"
SNAPSHOTS = "snap"


def within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def write_trees(policy: Policy) -> list[str]:
    """The outermost write-granted directories of ``policy``. A write grant on anything
    but a directory or a character device (``/dev/null``: no content to keep) is refused:
    its writes could be neither redirected nor undone."""
    from ..policy.model import Access

    found = []
    for rule in policy.paths:
        if rule.access is not Access.WRITE:
            continue
        try:
            info = os.lstat(rule.path)
        except OSError as exc:
            raise UndoError(f"{rule.origin}: {rule.path!r}: {exc.strerror}") from None
        if stat.S_ISDIR(info.st_mode):
            found.append(rule.path)
        elif not stat.S_ISCHR(info.st_mode):
            raise UndoError(f"{rule.origin}: {rule.path!r} is a write grant on a single file: "
                            "a dry run or checkpoint covers directory trees only (grant its "
                            "directory instead)")
    trees = []
    for path in dict.fromkeys(found):
        if not any(other != path and within(path, other) for other in found):
            trees.append(path)
    for path in trees:
        for own in (record.runs_path(), record.scratch_path()):
            if within(own, path):
                raise UndoError(f"the write grant {path!r} holds {own!r}, where sandlock keeps "
                                "run records and copies: grant a narrower directory")
    return trees


def moved(policy: Policy, copies: Mapping[str, str]) -> Policy:
    """``policy`` with every grant inside a copied tree moved to the copy (pure)."""
    def move(path: str) -> str:
        for top, copy in copies.items():
            if within(path, top):
                return copy + path[len(top.rstrip("/")):]
        return path

    paths = tuple(replace(rule, path=move(rule.path)) for rule in policy.paths)
    env = replace(policy.env, set=tuple((name, move(value) if os.path.isabs(value) else value)
                                        for name, value in policy.env.set))
    return replace(policy, paths=paths, env=env)


def confined_by_landlock(mode: str) -> None:
    """Refuse a review where Landlock confines no file (no Landlock, or ``SANDLOCK_ABI=0``),
    whatever the policy's compat: what a review promises is Landlock's to keep. A dry run's
    originals are kept apart only by not being granted, and a checkpoint's snapshot only by
    the state directory no grant reaches; without filesystem confinement the tool writes
    the originals, or deletes the snapshot a rollback needs, and the review would still
    say "the originals are unchanged" or "rollback restores"."""
    from ..compile import abi, ruleset

    if abi.fs_handled(ruleset.detect_abi()):
        return
    kept = ("the originals a dry run keeps apart" if mode == DRY_RUN
            else "the snapshot a rollback restores")
    raise UndoError(f"a {mode} needs Landlock filesystem confinement, and {ruleset.landlock_missing()}: "
                    f"without it the tool can write {kept}, so --best-effort (compat = "
                    "\"best-effort\") does not lift this; run it on a kernel with Landlock "
                    "(Linux 5.13+, \"landlock\" in the lsm= boot parameter), or without the review")


class Review:
    """A run under review: :meth:`prepare` before compiling, :meth:`finish` once the
    tool (and everything it started) is gone. ``name`` is the run's name afterwards."""

    def __init__(self, mode: str) -> None:
        if mode not in (DRY_RUN, CHECKPOINT):
            raise ValueError(mode)
        self.mode = mode
        self.name = ""
        self.trees: list[str] = []
        self.before: list[tree.Manifest] = []
        self.copies: dict[str, str] = {}
        #: The tool's working directory and PWD (the copy's, in a dry run from inside a tree).
        self.cwd: Optional[str] = None
        #: Set by the executor once the plan is compiled and the tool is about to start.
        self.launched = False
        self.finished = False

    def prepare(self, policy: Policy) -> Policy:
        """Copy or snapshot the trees; the policy to compile (a dry run's grants moved)."""
        confined_by_landlock(self.mode)
        self.trees = write_trees(policy)
        if not self.trees:
            raise UndoError(f"{policy.source}: no write-granted directory: nothing to "
                            f"{'redirect' if self.mode == DRY_RUN else 'checkpoint'}")
        self.name = record.new_name()
        runs = record.open_base(record.runs_path())
        try:
            directory = record.open_run(runs, self.name, create=True)
        finally:
            os.close(runs)
        try:
            tree.settle(self._copy_all(directory))
            record.save(directory, self.name, self._value(None))
        except BaseException:
            self.discard_now()
            raise
        finally:
            os.close(directory)
        if self.mode == CHECKPOINT:
            return policy
        try:
            here = os.getcwd()
        except OSError:
            here = None
        if here is not None and self.place(here) != here:
            self.cwd = self.place(here)
        return moved(policy, self.copies)

    def place(self, path: str) -> str:
        """Where absolute ``path`` is for the tool: in a dry run's copy when inside a tree."""
        for top, copy in self.copies.items():
            if within(path, top):
                return copy + path[len(top.rstrip("/")):]
        return path

    def _copy_all(self, run_dir: int) -> int:
        newest = 0
        if self.mode == DRY_RUN:
            base = record.open_base(record.scratch_path())
            os.mkdir(self.name, 0o700, dir_fd=base)
            holder = record.open_run(base, self.name)
            os.close(base)
            where = os.path.join(record.scratch_path(), self.name)
        else:
            os.mkdir(SNAPSHOTS, 0o700, dir_fd=run_dir)
            holder = os.open(SNAPSHOTS, record._DIR, dir_fd=run_dir)
            where = ""
        try:
            for index, top in enumerate(self.trees):
                os.mkdir(str(index), 0o700, dir_fd=holder)
                dst = os.open(str(index), record._DIR, dir_fd=holder)
                src = tree.open_root(top)
                try:
                    manifest, last = tree.copy_tree(src, dst, hashing=self.mode == CHECKPOINT)
                except OSError as exc:
                    raise UndoError(f"cannot copy {top!r}: {exc}") from None
                finally:
                    os.close(src)
                    os.close(dst)
                self.before.append(manifest)
                newest = max(newest, last)
                if where:
                    self.copies[top] = os.path.join(where, str(index))
        finally:
            os.close(holder)
        return newest

    def _value(self, after: Optional[list[tree.Manifest]]) -> dict[str, Any]:
        return {"mode": self.mode, "trees": self.trees, "before": self.before, "after": after}

    def environment(self, caller: Mapping[str, str]) -> dict[str, str]:
        """The caller's environment as the tool should see it (PWD moved with the cwd)."""
        out = dict(caller)
        if self.cwd is not None and "PWD" in out:
            out["PWD"] = self.cwd
        return out

    def finish(self) -> str:
        """Record each tree as the run left it; the run's name."""
        after = []
        for index, top in enumerate(self.trees):
            field = "c" if self.mode == DRY_RUN else "key"
            # The tool may have closed its workspace itself (chmod 0): opened for the scan.
            root, shut = tree.opened_root(self.copies[top] if self.mode == DRY_RUN else top)
            try:
                # The copy is sandlock's once the tool is gone: what the tool closed to this
                # uid is opened for good, the tool's modes recorded (and applied).
                closed = tree.open_up(root, files=True) if self.mode == DRY_RUN else {}
                if shut is not None:
                    closed[""] = shut
                after.append(tree.scan(root, self.before[index], field))
                for rel, mode in closed.items():
                    after[-1][rel]["m"] = mode
                if shut is not None and self.mode != DRY_RUN:
                    tree.closed_as(after[-1][""], shut)  # as the tool left it (put back below)
                if self.mode == DRY_RUN:
                    _hash_originals(top, self.before[index], after[-1])
            except OSError as exc:
                raise UndoError(f"cannot read {top!r} after the run: {exc}") from None
            finally:
                if shut is not None and self.mode != DRY_RUN:
                    os.fchmod(root, shut)
                os.close(root)
        runs = record.open_base(record.runs_path())
        try:
            directory = record.open_run(runs, self.name)
        finally:
            os.close(runs)
        try:
            record.save(directory, self.name, self._value(after))
        finally:
            os.close(directory)
        self.finished = True
        return self.name

    def discard_now(self) -> None:
        """Forget this run (record and copies), once: a second call (the caller's, after
        :meth:`prepare` discarded what it had begun) has nothing left to forget."""
        name, self.name = self.name, ""
        if name:
            forget(name)


def _hash_originals(top: str, before: tree.Manifest, after: tree.Manifest) -> None:
    """Digest the originals of the files a dry run changed without changing their size,
    so the change set can tell content from times (the copy hashed nothing)."""
    cache: dict[str, int] = {}
    root = tree.open_root(top)
    cache[""] = root
    try:
        for rel, new in after.items():
            old = before.get(rel)
            if (old is None or new["same"] or new["k"] != "f" or old["k"] != "f"
                    or old["s"] != new["s"]):
                continue
            old["h"] = tree.digest_at(root, rel, old["key"], cache)
    finally:
        tree.close_all(cache, root)
        os.close(root)


def load(name: str) -> dict[str, Any]:
    runs = record.open_base(record.runs_path())
    try:
        directory = record.open_run(runs, name)
    finally:
        os.close(runs)
    try:
        value = record.load(directory, name)
    finally:
        os.close(directory)
    if value.get("after") is None:
        raise UndoError(f"run {name} did not finish (sandlock was stopped during it): "
                        "`sandlock discard` removes it")
    return value


def changes(value: Mapping[str, Any]) -> list[tuple[int, str, str, Optional[tree.Entry],
                                                    Optional[tree.Entry]]]:
    """(tree index, path, what, before, after) of every change of a finished run; what is
    ``added``, ``removed``, ``modified`` (content or type), ``mode``, ``attributes`` (the
    extended attributes of :mod:`sandlock.undo.xattrs`) or ``times``."""
    out: list[tuple[int, str, str, Optional[tree.Entry], Optional[tree.Entry]]] = []
    for index, (before, after) in enumerate(zip(value["before"], value["after"])):
        found: list[tuple[int, str, str, Optional[tree.Entry], Optional[tree.Entry]]] = []
        touched: list[str] = []  # directories written back for their times alone
        for rel in sorted(set(before) | set(after)):
            old, new = before.get(rel), after.get(rel)
            if old is not None and old.get("skip"):  # a device or socket: never copied
                if new is None and value["mode"] == CHECKPOINT:  # rollback cannot make it
                    found.append((index, rel, "removed", old, None))
                elif new is not None and replaces_skipped(old, new):
                    found.append((index, rel, "modified", old, new))  # apply refuses it
                continue
            if new is None:
                found.append((index, rel, "removed", old, None))
            elif old is None:
                found.append((index, rel, "added", None, new))
            elif old["k"] != new["k"]:  # a file made a directory too (no mode need differ)
                found.append((index, rel, "modified", old, new))
            elif not new["same"] and new["k"] != "d":
                found.append((index, rel, _how(old, new), old, new))
            elif not new["same"] and new["m"] != old["m"]:
                found.append((index, rel, "mode", old, new))
            elif not new["same"] and new.get("x") != old.get("x"):
                found.append((index, rel, "attributes", old, new))
            elif not new["same"]:
                touched.append(rel)
        # A directory's times are written back with it. Listed when nothing listed lies in
        # it (what changed them is otherwise gone: a file made and removed, a touch).
        holding = {os.path.dirname(rel) for _, rel, *_ in found if rel}
        found += [(index, rel, "times", before[rel], after[rel]) for rel in touched
                  if rel not in holding]
        out += sorted(found, key=lambda change: change[1])
    return out


def replaces_skipped(old: tree.Entry, new: tree.Entry) -> bool:
    """Whether ``new`` is something the tool put where ``old``, a device or socket (never
    copied, ``skip``), was: anything but that same object still there."""
    return bool(old.get("skip")) and not (new.get("skip") and new["same"])


def _how(old: tree.Entry, new: tree.Entry) -> str:
    if old["k"] != new["k"] or old.get("l") != new.get("l") or old["s"] != new["s"]:
        return "modified"
    if old["k"] == "f" and (old.get("h") is None or old.get("h") != new.get("h")):
        return "modified"
    if old["m"] != new["m"]:
        return "mode"
    return "attributes" if old.get("x") != new.get("x") else "times"


def apply(name: str) -> int:
    """Write a dry run's changes into the original trees; the number of changes. Refuses
    (nothing changed) on a conflict or on anything
    :func:`sandlock.undo.tree.check_source` refuses; then forgets the run."""
    value = load(name)
    if value["mode"] != DRY_RUN:
        raise UndoError(f"run {name} was a checkpoint, not a dry run: `sandlock rollback` it")
    for index, top in enumerate(value["trees"]):
        before, after = value["before"][index], value["after"][index]
        writes = [(rel, e) for rel, e in after.items() if not e["same"]]
        deletes = [rel for rel in before if rel not in after and not before[rel].get("skip")]
        _sync(top, before, writes, deletes, _scratch(name, index), "key", True)
    forget(name)
    return len(changes(value))


def rollback(name: str) -> int:
    """Restore a checkpointed run's trees from their verified snapshot; the number of
    changes undone; then forgets the run."""
    value = load(name)
    if value["mode"] != CHECKPOINT:
        raise UndoError(f"run {name} was a dry run: `sandlock apply` or `sandlock discard` it")
    for index, top in enumerate(value["trees"]):
        before, after = value["before"][index], value["after"][index]
        writes = [(rel, e) for rel, e in before.items() if not e.get("skip") and (
            e["k"] == "d" or rel not in after or not after[rel]["same"])]
        deletes = [rel for rel in after  # and what the tool put where a socket or device was
                   if rel not in before or replaces_skipped(before[rel], after[rel])]
        _sync(top, after, writes, deletes, _snapshot(name, index), "c", False)
    forget(name)
    return len(changes(value))


def _sync(top: str, expect: tree.Manifest, writes: list[tuple[str, tree.Entry]],
          deletes: list[str], source: int, field: str, tool_made: bool) -> None:
    try:
        # A rollback's root may be closed to this uid (a tool's chmod 0 of its workspace):
        # opened for the moment; it gets its recorded mode, or the one it had on a failure.
        target, shut = tree.opened_root(top) if not tool_made else (tree.open_root(top), None)
        try:
            tree.sync(target, expect, writes, deletes, source, field, tool_made, root_mode=shut)
            shut = None
        finally:
            if shut is not None:
                os.fchmod(target, shut)
            os.close(target)
    except tree.UndoError as exc:
        raise type(exc)(f"{top}: {exc}") from None
    except OSError as exc:
        raise UndoError(f"{top}: {exc}") from None
    finally:
        os.close(source)


def _run_directory(base_path: str, name: str, below: str) -> int:
    """The directory ``below`` in run ``name``'s directory under ``base_path``, opened."""
    base = record.open_base(base_path)
    try:
        holder = record.open_run(base, name)
    finally:
        os.close(base)
    try:
        return os.open(below, record._DIR, dir_fd=holder)
    finally:
        os.close(holder)


def _scratch(name: str, index: int) -> int:
    return _run_directory(record.scratch_path(), name, str(index))


def _snapshot(name: str, index: int) -> int:
    return _run_directory(record.runs_path(), name, f"{SNAPSHOTS}/{index}")


def forget(name: str) -> None:
    """Remove run ``name``'s scratch copies, snapshots and record (discard)."""
    record.check_name(name)
    found = False
    for path in (record.scratch_path(), record.runs_path()):
        base = record.open_base(path)
        try:
            if os.path.lexists(f"/proc/self/fd/{base}/{name}"):
                found = True
            tree.remove_tree(base, name)
        finally:
            os.close(base)
    if not found:
        raise UndoError(f"no run {name}")
