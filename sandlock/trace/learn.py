"""`sandlock learn`: one recorded run under a permissive sandbox, then a draft policy.

The recorded run is still confined (Landlock + seccomp, never more than the caller
has): it may read and execute everything the caller can see except well-known
secrets (:data:`SECRETS`), write only the working directory and a private TMPDIR,
and use TCP, UDP and Unix sockets. Everything it touched is recorded by
:class:`sandlock.trace.record.Recorder` (which only records), and :func:`draft` turns the
record into TOML: what the built-in profiles already grant is folded into them,
files are grouped by directory only where the directory is not a place of secrets
or a whole system tree, and every grant says what it is for.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Optional, Sequence

from ..compile import abi as A
from ..errors import LandlockError, SandlockError
from ..policy.model import DEFAULT_ENV_PASS
from . import record as T

#: Relative to the home directory: never granted by learn, never readable in its run.
HOME_SECRETS = (".ssh", ".gnupg", ".aws", ".config/gcloud", ".azure", ".kube", ".docker",
                ".netrc", ".git-credentials", ".password-store", ".local/share/keyrings",
                ".pki", ".config/gh", ".npmrc", ".pypirc", ".cache/sandlock")
SYSTEM_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-",
                  "/etc/sudoers", "/etc/sudoers.d", "/etc/ssl/private")
#: The environment of the recorded run and of the draft.
ENV_PASS = (*DEFAULT_ENV_PASS, "HOME", "USER", "LOGNAME")


def secrets(home: str) -> list[str]:
    """Every path the recorded run may not read, links resolved."""
    from ..compile.grants import _state_dirs

    out = [os.path.join(home, s) for s in HOME_SECRETS] + list(SYSTEM_SECRETS)
    out += _state_dirs()
    try:
        out += [os.path.join("/etc/ssh", n) for n in os.listdir("/etc/ssh") if n.endswith("_key")]
    except OSError:
        pass
    return sorted({os.path.realpath(p) for p in out})


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


def recording_policy(cwd: str, tmpdir: str, home: str) -> str:
    """The TOML of the recorded run's sandbox."""
    readable = cover("/", secrets(home))
    lines = ["version = 1", 'description = "sandlock learn: the recorded run"', "",
             "[filesystem]", "exec = ["]
    lines += [f"    {{ path = {_quote(p)}, optional = true }}," for p in readable]
    lines += ["]", f"write = [{_quote(cwd)}, {_quote(tmpdir)}, \"/dev/null\", "
              "{ path = \"/dev/tty\", optional = true }]", "",
              "[network]", 'connect = ["1-65535"]', 'bind = ["1-65535"]', "udp = true",
              "unix = true", "", "[env]",
              "pass = [" + ", ".join(_quote(n) for n in ENV_PASS) + "]",
              f"set = {{ TMPDIR = {_quote(tmpdir)} }}", ""]
    return "\n".join(lines)


def _quote(text: str) -> str:
    import json

    return json.dumps(text)


def learn_policy(argv: Sequence[str], *, extends: Sequence[str] = (), timeout: Optional[str] = None,
                 report: Optional[Callable[[str], None]] = None) -> tuple[str, int]:
    """Run ``argv`` recorded; return (draft TOML, the command's exit code)."""
    from ..compile import compiler, ruleset
    from ..exec import launcher
    from ..policy.model import loads_policy, parse_duration

    cwd = os.path.realpath(os.getcwd())
    home = os.path.realpath(os.path.expanduser("~"))
    tmpdir = os.path.realpath(tempfile.mkdtemp(prefix="sandlock-learn-"))
    try:
        for attempt in range(3):  # an entry of a shared directory (/tmp) may vanish meanwhile
            policy = loads_policy(recording_policy(cwd, tmpdir, home), source="<learn>")
            if timeout is not None:
                try:
                    policy = policy.with_timeout(parse_duration(timeout))
                except Exception as exc:  # _Bad from the duration parser
                    raise SandlockError(f"--timeout: {exc}") from None
            try:
                compiled = compiler.compile_policy(policy)
                break
            except LandlockError:
                if attempt == 2:
                    raise
        cmd = launcher.prepare_command(policy, list(argv))
        code = 0
        with compiled, T.Recorder(programs=True) as recorder:
            try:
                child = launcher.run(compiled, cmd, report=report, recorder=recorder)
                code = int(child.returncode or 0)
            except SandlockError as exc:
                if report is not None:
                    report(str(exc))
                code = int(exc.exit_code)
            recorder.stop()
        abi = ruleset.detect_abi()
        learned = T.Judge.for_policy(policy, abi)
        text = draft(recorder.events, abi, argv=argv, cwd=cwd, tmpdir=tmpdir, home=home,
                     allowed=learned, extends=extends)
        return text, code
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


# ----------------------------------------------------------------------------
# From the record to a draft


class _Grant:
    def __init__(self, path: str, why: set[str]) -> None:
        self.path = path
        self.why = why
        self.used: set[str] = set()
        self.warning = ""


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


def draft(events: Sequence[T.Event], abi: int, *, argv: Sequence[str], cwd: str, tmpdir: str,
          home: str, allowed: T.Judge, extends: Sequence[str] = ()) -> str:
    """The draft policy for what ``events`` used (``allowed``: the recorded run's own
    rights; an access it refused is reported, never granted)."""
    from ..policy.model import load_profile

    excluded = secrets(home)
    reads: dict[str, set[str]] = {}
    listed: dict[str, set[str]] = {}
    execs: dict[str, set[str]] = {}
    writes: dict[str, set[str]] = {}
    connect: dict[int, set[str]] = {}
    bind: dict[int, set[str]] = {}
    refused: list[str] = []
    udp = unix = False
    for event in events:
        if event.syscall == "socket":
            udp |= event.family in (2, 10) and event.sock_type == 2
            unix |= event.family == 1
        for need in T.needs(event, abi):
            who = _program(need)
            if allowed.refused(need):
                what = need.path or f"TCP port {need.port}"
                line = f"{need.right} {T.shown(what)}" + (f" ({who})" if who else "")
                if line not in refused:
                    refused.append(line)
                continue
            if need.port >= 0:
                (connect if need.right == "connect" else bind).setdefault(need.port, set()).add(who)
                continue
            path = need.path
            if any(_under(path, e) for e in excluded):
                continue
            if need.right == "exec":  # at execve, the caller's image is still the old one
                reason = need.detail or ("the command" if not execs else f"run by {who}")
                execs.setdefault(path, set()).add(reason)
            elif need.right == "read":
                target = listed if os.path.isdir(path) else reads
                target.setdefault(path, set()).add(who)
            else:
                writes.setdefault(path, set()).add(f"{need.right} ({who})" if who else need.right)

    # Built-in profiles that cover what was used
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
            if "/" in name or name.endswith(".toml"):
                from ..policy.model import load_policy

                profile = load_policy(name)
            else:
                profile = load_profile(name)
        except SandlockError:
            continue
        judge = T.Judge.for_policy(profile, abi)
        covered.rules += judge.rules
    read_rights = int(A.Fs.READ_FILE)
    dir_rights = int(A.Fs.READ_DIR)
    exec_rights = int(A.Fs.EXECUTE | A.Fs.READ_FILE)
    write_rights = int(A.Fs.WRITE_FILE)
    execs = {p: w for p, w in execs.items() if covered.refused(T.Need("exec", p, exec_rights))}

    # Writes: the working directory, the temporary directory, else exact paths
    write_grants: list[_Grant] = []
    cwd_written = any(_under(p, cwd) for p in writes)
    tmp_written = any(_under(p, tmpdir) for p in writes)
    for path, why in sorted(writes.items()):
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
    for path, why in reads.items():
        if granted_elsewhere(path) or not covered.refused(T.Need("read", path, read_rights)):
            continue
        if _under(path, cwd):
            cwd_read = True
            continue
        files[path] = why
    dirs_listed = {p: w for p, w in listed.items()
                   if not granted_elsewhere(p) and covered.refused(T.Need("read", p, dir_rights))}
    never = _never_grouped(home, excluded)
    proc = [p for p in list(files) + list(dirs_listed) if T.shown(p).startswith("/proc/self")]
    grants: dict[str, _Grant] = {}
    not_granted: list[str] = []
    for path, why in dirs_listed.items():
        if _under(path, cwd):
            cwd_read = True
        elif path in never:
            not_granted.append(f"listed {path} ({', '.join(sorted(w for w in why if w))}): not "
                               "granted, it would expose everything beneath it")
        elif not T.shown(path).startswith("/proc/self"):
            grants[path] = _Grant(path, set(why))
    by_dir: dict[str, list[str]] = {}
    for path in files:
        if not T.shown(path).startswith("/proc/self"):
            by_dir.setdefault(os.path.dirname(path), []).append(path)
    def tight(folder: str, used: int) -> bool:
        """A directory is granted whole only when it holds little beyond what was used."""
        return folder not in never and _count_files(folder, 64) <= max(8, 4 * used)

    for folder, members in by_dir.items():
        if folder in grants or (len(members) >= 2 and tight(folder, len(members))):
            grant = grants.setdefault(folder, _Grant(folder, set()))
            for member in members:
                grant.why |= files[member]
                grant.used.add(member)
        else:
            for member in members:
                grants[member] = _Grant(member, set(files[member]))
                grants[member].used.add(member)
    # Sibling directories merge into their parent when it is deep and not a place of secrets
    changed = True
    while changed:
        changed = False
        parents: dict[str, list[str]] = {}
        for path in grants:
            if os.path.isdir(path):
                parents.setdefault(os.path.dirname(path), []).append(path)
        for parent, children in parents.items():
            used = sum(len(grants[c].used) or 1 for c in children)
            if len(children) >= 3 and parent.count("/") >= 3 and tight(parent, used):
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
                grant.warning = f"WARNING: broader than used: holds {more} entries, the command {how}"

    # The TOML
    out = [f"# Draft policy written by `sandlock learn -- {' '.join(argv)}`.",
           "# Review every grant (the WARNING lines first), then:",
           f"#   sandlock run --policy THIS_FILE -- {' '.join(argv)}",
           "version = 1",
           f"description = {_quote('learned from: ' + ' '.join(argv))}",
           "extends = [" + ", ".join(_quote(c) for c in chosen) + "]", "", "[filesystem]"]

    def comment(why: set[str]) -> str:
        names = sorted(w for w in why if w)
        return f"  # {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}" if names else ""

    if execs:
        out.append("exec = [")
        for path, why in sorted(execs.items()):
            out.append(f"    {_quote(path)},{comment(why or {'executed'})}")
        out.append("]")
    read_lines = []
    if cwd_read and not cwd_written:
        read_lines.append(f"    \"${{cwd}}\",  # the working directory ({cwd}), read")
    if proc:
        read_lines.append("    \"/proc\",  # WARNING: broader than used: the tool read its own "
                          "/proc/self entries, whose number changes every run")
    for path, grant in sorted(grants.items()):
        note = comment(grant.why)
        if grant.warning:
            note = (note + "; " if note else "  # ") + grant.warning
        read_lines.append(f"    {_quote(path)},{note}")
    if read_lines:
        out += ["read = [", *read_lines, "]"]
    write_lines = []
    if cwd_written:
        write_lines.append(f"    \"${{cwd}}\",  # the working directory ({cwd}): created, "
                           "changed or removed files")
    env_set = ""
    if tmp_written and cwd_written:
        env_set = ("set = { TMPDIR = \"${cwd}\" }  # temporary files go to the working directory "
                   "(granted above); WARNING: point TMPDIR at a private directory if they must not")
    elif tmp_written:
        write_lines.append("    \"${tmpdir}\",  # temporary files; WARNING: broader than used: "
                           "the caller's TMPDIR (often the shared /tmp): point TMPDIR at a "
                           "private directory")
    for grant in write_grants:
        write_lines.append(f"    {_quote(grant.path)},{comment(grant.why)}")
    if write_lines:
        out += ["write = [", *write_lines, "]"]
    if connect or bind or udp or unix:
        out += ["", "[network]"]
        if connect:
            out.append(f"connect = [{', '.join(str(p) for p in sorted(connect))}]  # TCP, used")
        if bind:
            out.append(f"bind = [{', '.join(str(p) for p in sorted(bind))}]  # TCP, used")
        if udp:
            out.append("udp = true  # a UDP socket was made (DNS?)")
        if unix:
            out.append("unix = true  # a Unix socket was made")
    passed = [*ENV_PASS, *(["TMPDIR"] if tmp_written and not env_set else [])]
    out += ["", "[env]", "pass = [" + ", ".join(_quote(n) for n in passed) + "]"]
    if env_set:
        out.append(env_set)
    notes = [f"# refused during the recorded run, not granted: {line}" for line in refused[:50]]
    notes += [f"# {line}" for line in not_granted]
    if notes:
        out += ["", *notes]
    return "\n".join(out) + "\n"
