"""A finished run's change set as lines for a terminal: every name and every line of
content escaped (:func:`sandlock.trace.emit.printable`: the tool chose them), a unified
diff for text files up to :data:`DIFF_LIMIT` bytes, whose bytes are shown only when
their digest is the one recorded at the end of the run."""

from __future__ import annotations

import difflib
import hashlib
import os
from typing import Any, Mapping, Optional

from ..trace.emit import printable
from . import tree, xattrs
from .session import CHECKPOINT, changes
from .session import _scratch as scratch_of
from .session import _snapshot as snapshot_of

DIFF_LIMIT = 256 << 10
MARK = {"added": "A", "removed": "D", "modified": "M", "mode": "m", "attributes": "a",
        "times": "t"}


def _what(item: Optional[tree.Entry]) -> str:
    if item is None:
        return ""
    if item["k"] == "l":
        return f" -> {printable(item.get('l', ''))} (symbolic link)"
    if item["k"] == "d" and item.get("deep"):
        return (f"/ (and all it holds: nested deeper than {tree.MAX_DEPTH} levels, not "
                "recorded one by one)")
    if item["k"] == "d":
        return "/"
    if item["k"] in ("p", "o"):
        return " (FIFO, device or socket)"
    return ""


def lines(name: str, value: Mapping[str, Any], diffs: bool = True) -> list[str]:
    """The change set of run ``name`` (its verified record ``value``)."""
    found = changes(value)
    out = [f"run {name} ({value['mode']}): {len(found)} change(s)"]
    roots: dict[tuple[str, int], int] = {}
    links = [tree.links_of(after) for after in value["after"]]
    if value["mode"] != CHECKPOINT:
        for index, top in enumerate(value["trees"]):
            out += [f"! {printable(top)}: apply refuses it: {escape}"
                    for escape in tree.escapes(value["before"][index], value["after"][index])]
    try:
        for index, rel, what, old, new in found:
            top = value["trees"][index]
            path = printable(os.path.join(top, rel) if rel else top.rstrip("/") or "/")
            item = new if new is not None else old
            extra = _what(item) + _kind_change(value, old, new) + _permissions(old, new)
            if value["mode"] != CHECKPOINT and new is not None and what != "removed":
                why = tree.refusal(rel, new, links[index])
                if why is not None:
                    extra += f" [apply refuses it: {printable(why)}]"
            out.append(f"{MARK[what]} {path}{extra}")
            if diffs and what in ("added", "modified") and item is not None and item["k"] == "f":
                out += _diff(value, name, index, rel, old, new, roots)
    finally:
        for fd in roots.values():
            os.close(fd)
    return out


KINDS = {"d": "a directory", "f": "a file", "l": "a symbolic link", "p": "a FIFO",
         "o": "a device or socket"}


def _kind_change(value: Mapping[str, Any], old: Optional[tree.Entry],
                 new: Optional[tree.Entry]) -> str:
    """What it was, when it is now another kind; and that apply or rollback refuses a
    change between a directory and anything else (it refuses the whole run), and apply
    anything put where a socket or device was (never copied to a dry run's copy)."""
    checkpoint = value["mode"] == CHECKPOINT
    if old is not None and old.get("skip"):  # never copied: a socket or device
        if new is None:
            return " [not made again by rollback]" if checkpoint else ""
        out = f" (was {KINDS['o']})"
        return out + (" [rollback removes it, and does not make the device or socket again]"
                      if checkpoint else " [apply refuses it: a device or socket in the "
                      "tree, not copied to the dry run]")
    if old is None or new is None or old["k"] == new["k"]:
        return ""
    out = f" (was {KINDS.get(old['k'], old['k'])})"
    if "d" in (old["k"], new["k"]):
        step = "rollback" if checkpoint else "apply"
        out += f" [{step} refuses it: changed between a directory and a file (not supported)]"
    return out


#: Mode bits an added file or directory is shown with: its group or others may write it,
#: it is set-user-ID, set-group-ID or sticky, or (a file) it may be run. Any mode change
#: of an existing one is shown. (Ownership is not recorded: a file made in a set-group-ID
#: directory takes the directory's group.)
NOTABLE_MODE = {"f": 0o7133, "d": 0o7022}


def _permissions(old: Optional[tree.Entry], new: Optional[tree.Entry]) -> str:
    """Every mode and attribute change that apply or rollback writes, whatever else changed
    (a content change beside them hid them): of an added entry, a notable mode and its
    attributes."""
    if new is None or new["k"] == "l":
        return ""
    if old is None:
        mode = f" mode {new['m']:04o}" if new["m"] & NOTABLE_MODE.get(new["k"], 0o7022) else ""
        made = f" extended attributes: {_attributes_changed({}, new)}" if new.get("x") else ""
        return mode + made
    out = f" mode {old['m']:04o} -> {new['m']:04o}" if old["m"] != new["m"] else ""
    if old.get("x") != new.get("x"):
        out += f" extended attributes: {_attributes_changed(old, new)}"
    return out


def _attributes_changed(old: tree.Entry, new: tree.Entry) -> str:
    """The names of the attributes set, changed or removed (the tool chose them), and what
    an ACL set grants."""
    before, after = dict(tree.attributes_of(old)), dict(tree.attributes_of(new))
    names = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
    return ", ".join(f"{printable(name)} removed" if name not in after else
                     f"{printable(name)} set" + (f" ({xattrs.acl_text(after[name])})"
                                                 if name.startswith(xattrs.ACLS) else "")
                     for name in names)


def _root(value: Mapping[str, Any], name: str, index: int, which: str,
          roots: dict[tuple[str, int], int]) -> Optional[int]:
    """The tree holding the ``before`` or ``after`` side of tree ``index``."""
    if (which, index) in roots:
        return roots[(which, index)]
    try:
        if (which == "before") == (value["mode"] == CHECKPOINT):  # a copy sandlock made
            fd = (snapshot_of if value["mode"] == CHECKPOINT else scratch_of)(name, index)
        else:
            fd = tree.open_root(value["trees"][index])
    except (OSError, tree.UndoError):
        return None
    roots[(which, index)] = fd
    return fd


def _content(value: Mapping[str, Any], name: str, index: int, rel: str,
             item: Optional[tree.Entry], which: str,
             roots: dict[tuple[str, int], int]) -> Optional[bytes]:
    if item is None:
        return b""
    if item["k"] != "f" or item["s"] > DIFF_LIMIT:
        return None
    root = _root(value, name, index, which, roots)
    if root is None:
        return None
    cache = {"": root}
    try:
        data = tree.read_at(root, rel, DIFF_LIMIT + 1, cache)
    finally:
        tree.close_all(cache, root)
    if data is None or (item.get("h") is not None and hashlib.sha256(data).hexdigest() != item["h"]):
        return None
    return data


def _text(data: bytes) -> Optional[list[str]]:
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None


def _diff(value: Mapping[str, Any], name: str, index: int, rel: str,
          old: Optional[tree.Entry], new: Optional[tree.Entry],
          roots: dict[tuple[str, int], int]) -> list[str]:
    before = _content(value, name, index, rel, old if old is None or old["k"] == "f" else None,
                      "before", roots)
    after = _content(value, name, index, rel, new, "after", roots)
    if before is None or after is None:
        return ["    (content not shown: binary, larger than 256 KiB, or changed since the run)"]
    a, b = _text(before), _text(after)
    if a is None or b is None:
        return [f"    (binary: {len(before)} -> {len(after)} bytes)"]
    label = printable(rel)
    return ["    " + printable(line) for line in difflib.unified_diff(
        a, b, f"a/{label}", f"b/{label}", lineterm="")]
