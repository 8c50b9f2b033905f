"""`sandlock learn`: one recorded run under a permissive sandbox, then a draft policy.

The recorded run is confined as any run is (Landlock + seccomp, never more than the
caller has), with wider file rights: it may read and execute everything the caller
can see except well-known secrets (:func:`secrets`), and write only the working
directory and a private TMPDIR. It has no network and no Unix socket unless the
caller asks (``allow_net``, ``allow_unix``: :func:`recording_policy`). Everything it
touched is recorded by :class:`sandlock.trace.record.Recorder` (which only records),
and :func:`draft` turns the record into TOML: what was used is collected, the grants
are chosen (what the built-in profiles already grant is folded into them, files are
grouped by directory only where the directory is not a place of secrets or a whole
system tree, every grant says what it is for, and one that exposes more than files
says so in a WARNING), then rendered through :mod:`sandlock.trace.emit`, the only
way a name the tool chose reaches the text."""

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
    strings = emit.toml_string
    lines = ["version = 1", 'description = "sandlock learn: the recorded run"', "",
             "[filesystem]", "exec = [", *readable, "]",
             f"write = [{emit.policy_path(cwd)}, {emit.policy_path(tmpdir)}, \"/dev/null\", "
             "{ path = \"/dev/tty\", optional = true }]", "", "[network]"]
    if allow_net:
        lines += ['connect = ["1-65535"]', 'bind = ["1-65535"]', "udp = true"]
    lines += [f"unix = {'true' if allow_unix else 'false'}", "", "[env]",
              "pass = [" + ", ".join(strings(n) for n in ENV_PASS) + "]",
              f"set = {{ TMPDIR = {strings(tmpdir)} }}", ""]
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
# From the record to a draft


@dataclass
class _Grant:
    path: str
    why: set[str]
    used: set[str] = field(default_factory=set)
    warning: str = ""


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


def _program(need: T.Need) -> str:
    return os.path.basename(need.program) if need.program else ""


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


def _collect(events: Sequence[T.Event], abi: int, allowed: T.Judge,
             excluded: Sequence[str]) -> _Usage:
    used = _Usage()
    for event in events:
        if event.syscall == "socket":
            used.udp |= event.family in (2, 10) and event.sock_type == 2
            used.unix |= event.family == 1
        for need in T.needs(event, abi):
            who = _program(need)
            if allowed.refused(need):
                what = need.path or f"TCP port {need.port}"
                line = f"{need.right} {T.shown(what)}" + (f" ({who})" if who else "")
                if line not in used.refused:
                    used.refused.append(line)
                continue
            if need.port >= 0:
                ports = used.connect if need.right == "connect" else used.bind
                ports.setdefault(need.port, set()).add(who)
                continue
            path = need.path
            if any(_under(path, e) for e in excluded):
                continue
            if need.right == "exec":  # at execve, the caller's image is still the old one
                reason = need.detail or ("the command" if not used.execs else f"run by {who}")
                used.execs.setdefault(path, set()).add(reason)
            elif need.right == "read":
                target = used.listed if os.path.isdir(path) else used.reads
                target.setdefault(path, set()).add(who)
            else:
                right = f"{need.right} ({who})" if who else need.right
                used.writes.setdefault(path, set()).add(right)
    return used


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
# The draft, as data, then as TOML through :mod:`sandlock.trace.emit`


@dataclass
class Entry:
    """One array element or value of the draft: ``value`` is TOML already emitted;
    ``note`` and ``warning`` are plain text (escaped in the comment)."""

    value: str
    note: str = ""
    warning: str = ""


#: The variable a draft names the directory it was learned in by: ``${cwd}`` would
#: grant whatever directory the policy is later run from.
WORKSPACE = "workspace"


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


def _path_entry(path: str, note: str, warning: str, skipped: list[str], home: str = ""
                ) -> Optional[Entry]:
    """The grant of ``path``, or None (said in ``skipped``) when no policy can name it; a
    path in ``home`` as ``~/...``, so that the draft grants the same file to another user."""
    try:
        return Entry(emit.policy_path(path, home), note, warning)
    except emit.Unspellable as exc:
        skipped.append(f"{exc}: not granted, it cannot be named in a policy")
        return None


def _why(why: set[str]) -> str:
    names = sorted(w for w in why if w)
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


def draft(events: Sequence[T.Event], abi: int, *, argv: Sequence[str], cwd: str, tmpdir: str,
          home: str, allowed: T.Judge, extends: Sequence[str] = ()) -> Draft:
    """The draft policy for what ``events`` used (``allowed``: the recorded run's own
    rights; an access it refused is reported, never granted)."""
    excluded = secrets(home)
    used = _collect(events, abi, allowed, excluded)
    chosen, covered = _profiles(used.execs, abi, extends)
    filesystem, network, env, notes = _choose(used, covered, abi, cwd=cwd, tmpdir=tmpdir,
                                              home=home, excluded=excluded)
    variables = {WORKSPACE: cwd} if _names_workspace(filesystem, env) else {}
    command = emit.command(argv)
    run = emit.command(Draft("", [], variables).run_command("THIS_FILE", argv))
    header = [emit.toml_comment(f"Draft policy written by `sandlock learn -- {command}`."),
              "# Review every grant (the WARNING lines first), then:",
              emit.toml_comment(f"  {run}")]
    if variables:
        header.append(emit.toml_comment(
            f"${{{WORKSPACE}}} is the directory this draft was learned in ({cwd}); each run "
            "names it with --var, so that the grant never follows whatever directory a run "
            "starts in (as ${cwd} would)"))
    header += [
              "version = 1",
              f"description = {emit.toml_string('learned from: ' + command)}",
              "extends = [" + ", ".join(emit.toml_string(c) for c in chosen) + "]"]
    out = _render(header, [("filesystem", filesystem), ("network", network), ("env", env)], notes)
    out.variables = variables
    return out


def _names_workspace(*tables: _Table) -> bool:
    marker = f"${{{WORKSPACE}}}"
    return any(marker in entry.value for table in tables for _key, value in table
               for entry in (value if isinstance(value, list) else [value]))


_Table = list[tuple[str, "Entry | list[Entry]"]]


def _choose(used: _Usage, covered: T.Judge, abi: int, *, cwd: str, tmpdir: str, home: str,
            excluded: Sequence[str]) -> tuple[_Table, _Table, _Table, list[str]]:
    """The draft's grants: ([filesystem], [network], [env], notes)."""
    read_rights = int(A.Fs.READ_FILE)
    dir_rights = int(A.Fs.READ_DIR)
    exec_rights = int(A.Fs.EXECUTE | A.Fs.READ_FILE)
    write_rights = int(A.Fs.WRITE_FILE)
    execs = {p: w for p, w in used.execs.items() if covered.refused(T.Need("exec", p, exec_rights))}

    # Writes: the working directory, the temporary directory, else exact paths
    write_grants: list[_Grant] = []
    cwd_written = any(_under(p, cwd) for p in used.writes)
    tmp_written = any(_under(p, tmpdir) for p in used.writes)
    for path, why in sorted(used.writes.items()):
        if _under(path, cwd) or _under(path, tmpdir):
            continue
        if not covered.refused(T.Need("write", path, write_rights)):
            continue
        write_grants.append(_Grant(T.shown(path), why))

    def granted_elsewhere(path: str) -> bool:
        return (cwd_written and _under(path, cwd)) or _under(path, tmpdir) \
            or path in execs or any(_under(path, g.path) for g in write_grants)

    # Reads: the working directory as one grant; else files, grouped where tight
    cwd_read = False
    files: dict[str, set[str]] = {}
    for path, why in used.reads.items():
        if granted_elsewhere(path) or not covered.refused(T.Need("read", path, read_rights)):
            continue
        if _under(path, cwd):
            cwd_read = True
            continue
        files[path] = why
    dirs_listed = {p: w for p, w in used.listed.items()
                   if not granted_elsewhere(p) and covered.refused(T.Need("read", p, dir_rights))}
    never = _never_grouped(home, excluded)
    proc = [p for p in list(files) + list(dirs_listed) if T.shown(p).startswith("/proc/self")]
    grants: dict[str, _Grant] = {}
    notes = [f"refused during the recorded run, not granted: {line}" for line in used.refused[:50]]
    for path, why in dirs_listed.items():
        if _under(path, cwd):
            cwd_read = True
        elif proc and _under(path, "/proc"):
            continue  # /proc is granted whole below
        elif path in never:
            notes.append(f"listed {path} ({_why(why)}): not granted, it would expose "
                         "everything beneath it")
        elif not T.shown(path).startswith("/proc/self"):
            grants[path] = _Grant(path, set(why))
    by_dir: dict[str, list[str]] = {}
    for path in files:
        if not T.shown(path).startswith("/proc/self") and not (proc and _under(path, "/proc")):
            by_dir.setdefault(os.path.dirname(path), []).append(path)

    def tight(folder: str, count: int) -> bool:
        """A directory is granted whole only when it holds little beyond what was used."""
        return folder not in never and _count_files(folder, 64) <= max(8, 4 * count)

    for folder, members in by_dir.items():
        if folder in grants or (len(members) >= 2 and tight(folder, len(members))):
            grant = grants.setdefault(folder, _Grant(folder, set()))
            for member in members:
                grant.why |= files[member]
                grant.used.add(member)
        else:
            for member in members:
                grants[member] = _Grant(member, set(files[member]), {member})
    # Sibling directories merge into their parent when it is deep and not a place of secrets
    changed = True
    while changed:
        changed = False
        parents: dict[str, list[str]] = {}
        for path in grants:
            if os.path.isdir(path):
                parents.setdefault(os.path.dirname(path), []).append(path)
        for parent, children in parents.items():
            count = sum(len(grants[c].used) or 1 for c in children)
            if len(children) >= 3 and parent.count("/") >= 3 and tight(parent, count):
                merged = grants.setdefault(parent, _Grant(parent, set()))
                for child in children:
                    merged.why |= grants[child].why
                    merged.used |= grants[child].used or {child}
                    del grants[child]
                changed = True
    for path in list(grants):  # drop what a granted directory already holds
        if any(other != path and os.path.isdir(other) and _under(path, other) for other in grants):
            del grants[path]
    for grant in grants.values():
        if os.path.isdir(grant.path):
            total = _count_files(grant.path)
            if total > max(len(grant.used), 1):
                more = "5000 or more" if total >= 5000 else str(total)
                how = f"read {len(grant.used)}" if grant.used else "listed it"
                grant.warning = f"broader than used: holds {more} entries, the command {how}"

    def exposes(path: str) -> str:
        """Never expected (home and places of secrets are never grouped): said if it happens."""
        inside = [p for p in (home, *excluded) if _under(p, path)]
        return f"exposes {inside[0]}, which holds secrets" if inside else ""

    filesystem: _Table = []
    exec_entries = [_path_entry(p, _why(w) or "executed", exposes(p), notes, home)
                    for p, w in sorted(execs.items())]
    read_entries: list[Optional[Entry]] = []
    if cwd_read and not cwd_written:
        read_entries.append(Entry(f'"${{{WORKSPACE}}}"', f"the working directory ({cwd}), read"))
    if proc:
        read_entries.append(Entry('"/proc"', "the tool read its own /proc/self entries, whose "
                                  "number changes every run", f"broader than used: {EXPOSES['proc']}"))
    for path, grant in sorted(grants.items()):
        warning = "; ".join(w for w in (grant.warning, exposes(path)) if w)
        read_entries.append(_path_entry(path, _why(grant.why), warning, notes, home))
    write_entries: list[Optional[Entry]] = []
    if cwd_written:
        write_entries.append(Entry(f'"${{{WORKSPACE}}}"', f"the working directory ({cwd}): "
                                   "created, changed or removed files"))
    env_set: Optional[Entry] = None
    if tmp_written and cwd_written:
        env_set = Entry(f'{{ TMPDIR = "${{{WORKSPACE}}}" }}', "temporary files go to the working directory "
                        "(granted above)", "point TMPDIR at a private directory if they must not")
    elif tmp_written:
        write_entries.append(Entry('"${tmpdir}"', "temporary files", "broader than used: the "
                                   "caller's TMPDIR (often the shared /tmp): point TMPDIR at a "
                                   "private directory"))
    for write in write_grants:
        write_entries.append(_path_entry(write.path, _why(write.why), exposes(write.path), notes,
                                         home))
    for key, entries in (("exec", exec_entries), ("read", read_entries), ("write", write_entries)):
        kept = [e for e in entries if e is not None]
        if kept:
            filesystem.append((key, kept))

    network: _Table = []
    if used.connect:
        network.append(("connect", Entry("[" + ", ".join(str(p) for p in sorted(used.connect))
                                         + "]", "TCP, used")))
    if used.bind:
        network.append(("bind", Entry("[" + ", ".join(str(p) for p in sorted(used.bind)) + "]",
                                      "TCP, used")))
    if used.udp:
        network.append(("udp", Entry("true", "a UDP socket was made (DNS?)", EXPOSES["udp"])))
    if used.unix:
        network.append(("unix", Entry("true", "a Unix socket was made", EXPOSES["unix"])))

    passed = [*ENV_PASS, *(["TMPDIR"] if tmp_written and not env_set else [])]
    env: _Table = [("pass", Entry("[" + ", ".join(emit.toml_string(n) for n in passed) + "]"))]
    if env_set is not None:
        env.append(("set", env_set))
    return filesystem, network, env, notes


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
