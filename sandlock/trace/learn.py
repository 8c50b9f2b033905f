"""`sandlock learn`: one recorded run under a permissive sandbox, then a draft policy.

The recorded run is confined as any run is (Landlock + seccomp, never more than the
caller has), with wider file rights: it may read and execute everything the caller
can see except well-known secrets (:func:`secrets`), and write only the working
directory and a private TMPDIR. It has no network and no Unix socket unless the
caller asks (``allow_net``, ``allow_unix``: :func:`recording_policy`). Everything it
touched is recorded by :class:`sandlock.trace.record.Recorder` (which only records),
and :func:`draft` turns the record into TOML in four steps, one section each below:
collect what was used (:func:`_collect`); choose the profiles to extend
(:func:`_profiles`: what they grant is folded into them); group the grants beyond them
(:func:`_choose`: files are grouped by directory only where the directory is not a
place of secrets or a whole system tree); render (every grant says what it is for, one
that exposes more than files says so in a WARNING), every value and comment through
:mod:`sandlock.trace.emit`, the only way a name the tool chose reaches the text."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..compile import abi as A
from ..errors import SandlockError
from ..policy.model import DEFAULT_ENV_PASS
from . import emit
from . import record as T
from .record import HOME_SECRETS, SYSTEM_SECRETS, secrets  # noqa: F401 - their home was here

#: The environment of the recorded run and of the draft.
ENV_PASS = (*DEFAULT_ENV_PASS, "HOME", "USER", "LOGNAME")


def _under(path: str, root: str) -> bool:
    return path == root or root == "/" or path.startswith(root.rstrip("/") + "/")


def cover(root: str, excluded: Sequence[str]) -> list[str]:
    """Directories and files that together hold everything under ``root`` except
    ``excluded`` (Landlock only adds rights, so a hole is made by granting the
    siblings along the way to it). Links are skipped (what they point to is covered
    where it lives); what the caller cannot list is left out."""
    inside = [e for e in excluded if _under(e, root)]
    if not inside:
        return [root]
    if root in inside:
        return []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out: list[str] = []
    for name in names:
        child = os.path.join(root, name)
        if not os.path.islink(child):
            out += cover(child, inside)
    return out


#: What each network grant of a draft or of the recorded run exposes (the WARNING).
EXPOSES = {
    "unix": "any Unix socket the tool can name, beyond the files granted: ssh-agent (it "
            "signs with your keys), the Docker daemon (root), the D-Bus session bus "
            "(`systemd-run --user` runs anything unconfined)",
    "udp": "UDP to any address and port (DNS, and any other datagram traffic: a way out "
           "that no port rule limits)",
    "proc": T.PROC_EXPOSES,
}


def recording_policy(cwd: str, tmpdir: str, home: str, *, allow_net: bool = False,
                     allow_unix: bool = False) -> str:
    """The TOML of the recorded run's sandbox: read and exec what the caller can
    (except :func:`secrets`), write ``cwd`` and ``tmpdir``; no network and no Unix
    socket unless asked (``allow_net``: TCP and UDP, any port; ``allow_unix``).
    A path no policy can name (:class:`emit.Unspellable`) is left out: unreadable."""
    readable = []
    for path in cover("/", secrets(home)):
        try:
            readable.append(f"    {{ path = {emit.policy_path(path)}, optional = true }},")
        except emit.Unspellable:
            continue
    lines = ["version = 1", 'description = "sandlock learn: the recorded run"', "",
             "[filesystem]", "exec = [", *readable, "]",
             f"write = [{emit.policy_path(cwd)}, {emit.policy_path(tmpdir)}, \"/dev/null\", "
             "{ path = \"/dev/tty\", optional = true }]", "", "[network]"]
    if allow_net:
        lines += ['connect = ["1-65535"]', 'bind = ["1-65535"]', "udp = true"]
    lines += [f"unix = {'true' if allow_unix else 'false'}", "", "[env]",
              f"pass = {emit.toml_value(list(ENV_PASS))}",
              f"set = {emit.toml_value({'TMPDIR': tmpdir})}", ""]
    return "\n".join(lines)


def check_cwd(cwd: str, home: str) -> None:
    """The recorded run may write (so read) its working directory: never one that holds
    the home directory or a secret."""
    inside = [p for p in (home, *secrets(home)) if _under(p, cwd)]
    if cwd == home:
        raise SandlockError(f"learn: the working directory is your home directory "
                            f"({emit.printable(cwd)}): the recorded run may write its working "
                            "directory, and the draft would grant it whole, secrets and "
                            "sandlock's own cache included; run learn in the tool's project "
                            "directory (`mkdir -p ~/work/tool && cd ~/work/tool`)")
    if inside:
        raise SandlockError(f"learn: the working directory {emit.printable(cwd)} holds "
                            f"{emit.printable(inside[0])}, which the recorded run could then read "
                            "and the draft would grant (\"${cwd}\"); run learn in the tool's "
                            "project directory")


# ----------------------------------------------------------------------------
# 1. Collect: what the recorded run used


@dataclass
class _Usage:
    """What the recorded run used (plain text: tool-controlled, escaped when rendered)."""

    reads: dict[str, set[str]] = field(default_factory=dict)
    listed: dict[str, set[str]] = field(default_factory=dict)
    execs: dict[str, set[str]] = field(default_factory=dict)
    writes: dict[str, set[str]] = field(default_factory=dict)
    connect: dict[int, set[str]] = field(default_factory=dict)
    bind: dict[int, set[str]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    udp: bool = False
    unix: bool = False


def _program(need: T.Need) -> str:
    return os.path.basename(need.program) if need.program else ""


def _collect(events: Sequence[T.Event], abi: int, allowed: T.Judge,
             excluded: Sequence[str]) -> _Usage:
    used = _Usage()
    for event in events:
        if event.syscall == "socket":
            used.udp |= event.family in (2, 10) and event.sock_type == 2
            used.unix |= event.family == 1
        for need in T.needs(event, abi):
            if allowed.refused(need):
                _refused(used, need)
            elif need.port >= 0:
                ports = used.connect if need.right == "connect" else used.bind
                ports.setdefault(need.port, set()).add(_program(need))
            elif not any(_under(need.path, e) for e in excluded):
                _used_path(used, need)
    return used


def _refused(used: _Usage, need: T.Need) -> None:
    who = _program(need)
    what = need.path or f"TCP port {need.port}"
    line = f"{need.right} {T.shown(what)}" + (f" ({who})" if who else "")
    if line not in used.refused:
        used.refused.append(line)


def _used_path(used: _Usage, need: T.Need) -> None:
    who, path = _program(need), need.path
    if need.right == "exec":  # at execve, the caller's image is still the old one
        reason = need.detail or ("the command" if not used.execs else f"run by {who}")
        used.execs.setdefault(path, set()).add(reason)
    elif need.right == "read":
        target = used.listed if os.path.isdir(path) else used.reads
        target.setdefault(path, set()).add(who)
    else:
        right = f"{need.right} ({who})" if who else need.right
        used.writes.setdefault(path, set()).add(right)


# ----------------------------------------------------------------------------
# 2. Choose the profiles the draft extends


def _profiles(execs: dict[str, set[str]], abi: int, extends: Sequence[str]
              ) -> tuple[list[str], T.Judge]:
    """The profiles the draft extends, and what they grant together."""
    from ..policy.model import load_policy, load_profile

    chosen = list(extends)
    if not chosen:
        chosen = ["base"]
        python = T.Judge.for_policy(load_profile("python"), abi)
        base = T.Judge.for_policy(load_profile("base"), abi)
        exec_rights = int(A.Fs.EXECUTE | A.Fs.READ_FILE)
        if any(not python.refused(T.Need("exec", p, exec_rights)) and base.refused(
                T.Need("exec", p, exec_rights)) for p in execs):
            chosen = ["python"]
    covered = T.Judge(abi)
    for name in chosen:
        try:
            profile = load_policy(name) if "/" in name or name.endswith(".toml") \
                else load_profile(name)
        except SandlockError:
            continue
        covered.rules += T.Judge.for_policy(profile, abi).rules
    return chosen, covered


# ----------------------------------------------------------------------------
# 3. Group: the grants beyond the profiles, as data


@dataclass
class _Grant:
    path: str
    why: set[str]
    used: set[str] = field(default_factory=set)
    warning: str = ""


@dataclass
class _Grants:
    """What the draft grants beyond its profiles (paths plain text, tool-controlled);
    ``notes``: what was used and is not granted, and why."""

    execs: dict[str, set[str]]
    reads: dict[str, _Grant]
    writes: list[_Grant]
    notes: list[str]
    cwd_read: bool = False
    cwd_written: bool = False
    tmp_written: bool = False
    proc: bool = False


def _never_grouped(home: str, excluded: Sequence[str]) -> set[str]:
    """Directories a draft never grants whole, however much of them was used."""
    out = {"/", "/home", "/root", "/tmp", "/var/tmp", "/run", "/proc", "/sys", "/dev", "/mnt",
           "/media", "/srv", "/opt", "/usr", "/var", "/etc", "/usr/bin", "/bin", "/sbin",
           "/usr/sbin", "/usr/local", "/usr/local/bin"}
    for path in (home, *excluded):
        while path not in ("", "/"):
            out.add(path)
            path = os.path.dirname(path)
    return out


def _count_files(path: str, cap: int = 5000) -> int:
    count = 0
    for _root, dirs, files in os.walk(path):
        count += len(files) + len(dirs)
        if count >= cap:
            return cap
    return count


def _tight(folder: str, count: int, never: set[str]) -> bool:
    """A directory is granted whole only when it holds little beyond what was used."""
    return folder not in never and _count_files(folder, 64) <= max(8, 4 * count)


def _in_proc_self(path: str) -> bool:
    return T.shown(path).startswith("/proc/self")


def _choose(used: _Usage, covered: T.Judge, *, cwd: str, tmpdir: str, never: set[str]
            ) -> _Grants:
    """The grants: exact writes outside the working and temporary directories; reads
    grouped by directory where that stays tight (:func:`_group`)."""
    exec_rights = int(A.Fs.EXECUTE | A.Fs.READ_FILE)
    write_rights = int(A.Fs.WRITE_FILE)
    out = _Grants({p: w for p, w in used.execs.items()
                   if covered.refused(T.Need("exec", p, exec_rights))}, {}, [],
                  [f"refused during the recorded run, not granted: {line}"
                   for line in used.refused[:50]],
                  cwd_written=any(_under(p, cwd) for p in used.writes),
                  tmp_written=any(_under(p, tmpdir) for p in used.writes))
    for path, why in sorted(used.writes.items()):
        if not (_under(path, cwd) or _under(path, tmpdir)) \
                and covered.refused(T.Need("write", path, write_rights)):
            out.writes.append(_Grant(T.shown(path), why))

    def wanted(path: str, rights: int) -> bool:
        """Not granted by the profiles, nor by a grant above."""
        elsewhere = (out.cwd_written and _under(path, cwd)) or _under(path, tmpdir) \
            or path in out.execs or any(_under(path, g.path) for g in out.writes)
        return not elsewhere and covered.refused(T.Need("read", path, rights))

    files = {p: w for p, w in used.reads.items() if wanted(p, int(A.Fs.READ_FILE))}
    listed = {p: w for p, w in used.listed.items() if wanted(p, int(A.Fs.READ_DIR))}
    out.cwd_read = any(_under(p, cwd) for p in (*files, *listed))
    files = {p: w for p, w in files.items() if not _under(p, cwd)}
    out.proc = any(_in_proc_self(p) for p in (*files, *listed))
    _group(out, files, listed, cwd=cwd, never=never)
    return out


def _group(out: _Grants, files: dict[str, set[str]], listed: dict[str, set[str]], *,
           cwd: str, never: set[str]) -> None:
    """The read grants in ``out.reads``: a directory listed, a directory whose files were
    read where it is tight, else each file; then :func:`_merge`, and a warning on each
    directory that holds more than was used."""
    for path, why in listed.items():
        if _under(path, cwd) or (out.proc and _under(path, "/proc")):
            continue  # the working directory is one grant, /proc a whole one
        if path in never:
            out.notes.append(f"listed {path} ({_why(why)}): not granted, it would expose "
                             "everything beneath it")
        elif not _in_proc_self(path):
            out.reads[path] = _Grant(path, set(why))
    by_dir: dict[str, list[str]] = {}
    for path in files:
        if not _in_proc_self(path) and not (out.proc and _under(path, "/proc")):
            by_dir.setdefault(os.path.dirname(path), []).append(path)
    for folder, members in by_dir.items():
        if folder in out.reads or (len(members) >= 2 and _tight(folder, len(members), never)):
            grant = out.reads.setdefault(folder, _Grant(folder, set()))
            for member in members:
                grant.why |= files[member]
                grant.used.add(member)
        else:
            for member in members:
                out.reads[member] = _Grant(member, set(files[member]), {member})
    _merge(out.reads, never)
    for grant in out.reads.values():
        if os.path.isdir(grant.path):
            total = _count_files(grant.path)
            if total > max(len(grant.used), 1):
                more = "5000 or more" if total >= 5000 else str(total)
                how = f"read {len(grant.used)}" if grant.used else "listed it"
                grant.warning = f"broader than used: holds {more} entries, the command {how}"


def _merge(grants: dict[str, _Grant], never: set[str]) -> None:
    """Sibling directories merge into their parent when it is deep and tight; then what
    a granted directory already holds is dropped."""
    changed = True
    while changed:
        changed = False
        parents: dict[str, list[str]] = {}
        for path in grants:
            if os.path.isdir(path):
                parents.setdefault(os.path.dirname(path), []).append(path)
        for parent, children in parents.items():
            count = sum(len(grants[c].used) or 1 for c in children)
            if len(children) >= 3 and parent.count("/") >= 3 and _tight(parent, count, never):
                merged = grants.setdefault(parent, _Grant(parent, set()))
                for child in children:
                    merged.why |= grants[child].why
                    merged.used |= grants[child].used or {child}
                    del grants[child]
                changed = True
    for path in list(grants):
        if any(other != path and os.path.isdir(other) and _under(path, other) for other in grants):
            del grants[path]


def _why(why: set[str]) -> str:
    names = sorted(w for w in why if w)
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


# ----------------------------------------------------------------------------
# 4. Render: the draft's tables, then TOML, every value through :mod:`sandlock.trace.emit`


@dataclass
class Entry:
    """One array element or value of the draft: ``value`` is TOML written by
    :mod:`sandlock.trace.emit`; ``note`` and ``warning`` are plain text (escaped in
    the comment)."""

    value: str
    note: str = ""
    warning: str = ""


#: The variable a draft names the directory it was learned in by: ``${cwd}`` would
#: grant whatever directory the policy is later run from.
WORKSPACE = "workspace"
_WORKSPACE = emit.toml_string(f"${{{WORKSPACE}}}")


@dataclass
class Draft:
    """The draft policy, and its WARNING lines (also on stderr, :mod:`sandlock.cli.trace`);
    ``variables``: the ``--var`` its runs need (the directory it was learned in)."""

    text: str
    warnings: list[str]
    variables: dict[str, str] = field(default_factory=dict)

    def run_command(self, policy: str, argv: Sequence[str]) -> list[str]:
        """`sandlock run` of ``argv`` under this draft, saved as ``policy``."""
        named = [part for name, value in self.variables.items()
                 for part in ("--var", f"{name}={value}")]
        return ["sandlock", "run", "--policy", policy, *named, "--", *argv]


_Table = list[tuple[str, "Entry | list[Entry]"]]


def draft(events: Sequence[T.Event], abi: int, *, argv: Sequence[str], cwd: str, tmpdir: str,
          home: str, allowed: T.Judge, extends: Sequence[str] = ()) -> Draft:
    """The draft policy for what ``events`` used (``allowed``: the recorded run's own
    rights; an access it refused is reported, never granted)."""
    excluded = secrets(home)
    used = _collect(events, abi, allowed, excluded)
    chosen, covered = _profiles(used.execs, abi, extends)
    grants = _choose(used, covered, cwd=cwd, tmpdir=tmpdir, never=_never_grouped(home, excluded))
    paths = _Paths(home, [home, *excluded], grants.notes)
    env_set = _tmpdir_set(grants)
    tables = [("filesystem", _filesystem(grants, paths, cwd, env_set)),
              ("network", _network(used)), ("env", _env(grants, env_set))]
    variables = {WORKSPACE: cwd} if _names_workspace(*(t for _name, t in tables)) else {}
    out = _render(_header(argv, cwd, chosen, variables), tables, grants.notes)
    out.variables = variables
    return out


@dataclass
class _Paths:
    """Entries for paths: ``~/...`` inside ``home``; a path no policy can name is left
    out and said in ``skipped``; a grant holding one of ``secret`` says so."""

    home: str
    secret: list[str]
    skipped: list[str]

    def entry(self, path: str, note: str, warning: str = "") -> Optional[Entry]:
        inside = [p for p in self.secret if _under(p, path)]
        exposes = f"exposes {inside[0]}, which holds secrets" if inside else ""
        try:  # never expected (home and places of secrets are never grouped): said if it happens
            value = emit.policy_path(path, self.home)
        except emit.Unspellable as exc:
            self.skipped.append(f"{exc}: not granted, it cannot be named in a policy")
            return None
        return Entry(value, note, "; ".join(w for w in (warning, exposes) if w))


def _tmpdir_set(grants: _Grants) -> Optional[Entry]:
    if not (grants.tmp_written and grants.cwd_written):
        return None
    return Entry(emit.toml_value({"TMPDIR": f"${{{WORKSPACE}}}"}), "temporary files go to the "
                 "working directory (granted above)", "point TMPDIR at a private directory if "
                 "they must not")


def _filesystem(grants: _Grants, paths: _Paths, cwd: str, env_set: Optional[Entry]) -> _Table:
    execs = [paths.entry(p, _why(w) or "executed") for p, w in sorted(grants.execs.items())]
    reads: list[Optional[Entry]] = []
    if grants.cwd_read and not grants.cwd_written:
        reads.append(Entry(_WORKSPACE, f"the working directory ({cwd}), read"))
    if grants.proc:
        reads.append(Entry(emit.toml_string("/proc"), "the tool read the /proc entries of "
                           "processes (its own, or others'), whose numbers change every run",
                           f"broader than used: {EXPOSES['proc']}"))
    reads += [paths.entry(p, _why(g.why), g.warning) for p, g in sorted(grants.reads.items())]
    writes: list[Optional[Entry]] = []
    if grants.cwd_written:
        writes.append(Entry(_WORKSPACE, f"the working directory ({cwd}): created, changed or "
                            "removed files"))
    if grants.tmp_written and env_set is None:
        writes.append(Entry(emit.toml_string("${tmpdir}"), "temporary files", "broader than "
                            "used: the caller's TMPDIR (often the shared /tmp): point TMPDIR at "
                            "a private directory"))
    writes += [paths.entry(w.path, _why(w.why)) for w in grants.writes]
    table: _Table = []
    for key, entries in (("exec", execs), ("read", reads), ("write", writes)):
        kept = [e for e in entries if e is not None]
        if kept:
            table.append((key, kept))
    return table


def _network(used: _Usage) -> _Table:
    table: _Table = []
    for key, ports in (("connect", used.connect), ("bind", used.bind)):
        if ports:
            table.append((key, Entry(emit.toml_value(sorted(ports)), "TCP, used")))
    if used.udp:
        table.append(("udp", Entry(emit.toml_value(True), "a UDP socket was made (DNS?)",
                                   EXPOSES["udp"])))
    if used.unix:
        table.append(("unix", Entry(emit.toml_value(True), "a Unix socket was made",
                                    EXPOSES["unix"])))
    return table


def _env(grants: _Grants, env_set: Optional[Entry]) -> _Table:
    passed = [*ENV_PASS, *(["TMPDIR"] if grants.tmp_written and not env_set else [])]
    table: _Table = [("pass", Entry(emit.toml_value(passed)))]
    if env_set is not None:
        table.append(("set", env_set))
    return table


def _names_workspace(*tables: _Table) -> bool:
    marker = f"${{{WORKSPACE}}}"
    return any(marker in entry.value for table in tables for _key, value in table
               for entry in (value if isinstance(value, list) else [value]))


def _header(argv: Sequence[str], cwd: str, chosen: Sequence[str], variables: dict[str, str]
            ) -> list[str]:
    command = emit.command(argv)
    run = emit.command(Draft("", [], variables).run_command("THIS_FILE", argv))
    header = [emit.toml_comment(f"Draft policy written by `sandlock learn -- {command}`."),
              emit.toml_comment("Review every grant (the WARNING lines first), then:"),
              emit.toml_comment(f"  {run}")]
    if variables:
        header.append(emit.toml_comment(
            f"${{{WORKSPACE}}} is the directory this draft was learned in ({cwd}); each run "
            "names it with --var, so that the grant never follows whatever directory a run "
            "starts in (as ${cwd} would)"))
    return [*header, f"version = {emit.toml_value(1)}",
            f"description = {emit.toml_string('learned from: ' + command)}",
            f"extends = {emit.toml_value(list(chosen))}"]


def _comment(entry: Entry) -> str:
    text = "; ".join(t for t in (entry.note, entry.warning and f"WARNING: {entry.warning}") if t)
    return f"  {emit.toml_comment(text)}" if text else ""


def _render(header: list[str], tables: list[tuple[str, _Table]], notes: list[str]) -> Draft:
    """The TOML text: every string through :mod:`sandlock.trace.emit`, so a name the tool
    chose stays one string (or one comment) however it is spelled."""
    out = list(header)
    warnings: list[str] = []
    for table, keys in tables:
        if not keys:
            continue
        out += ["", f"[{table}]"]
        for key, value in keys:
            entries = value if isinstance(value, list) else [value]
            for entry in entries:
                if entry.warning:
                    warnings.append(emit.printable(f"WARNING: [{table}] {key} "
                                                   f"{entry.value}: {entry.warning}"))
            if isinstance(value, list):
                out.append(f"{key} = [")
                out += [f"    {entry.value},{_comment(entry)}" for entry in value]
                out.append("]")
            else:
                out.append(f"{key} = {value.value}{_comment(value)}")
    if notes:
        out += ["", *(emit.toml_comment(note) for note in notes)]
    return Draft("\n".join(out) + "\n", warnings)
