"""The C helper's copies of Python facts, and the one grammar of a step's numbers.

``sandlock/exec/helper/sandlock_exec.c`` cannot import Python, so it keeps copies:
the forwarded signals (:mod:`sandlock.linux.process`), the step names in their order
and the steps no list may lack (:mod:`sandlock.exec.spec`), the exit codes
(:mod:`sandlock.errors`), the size a request may have inline
(:mod:`sandlock.exec.native`), the per-run cgroups' name prefix
(:mod:`sandlock.linux.cgroups`), the stage a failed step reports
(:data:`sandlock.exec.engine.STAGES`). Each is read here from the C source as text and
compared with the table it copies (as ``tests/test_tables.py`` does for the syscall
numbers); :func:`test_the_comparison_is_not_vacuous` changes one side of each and
requires the drift to be found.

A step's numbers (``rlimit=RESOURCE:VALUE``) have one grammar on both sides: ASCII
decimal digits only (no sign, no space, no ``_``), in range. ``MALFORMED`` is refused by
the C helper, with its malformed-request report, and by :func:`sandlock.exec.spec.decode`.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import proc_state, require_abi, require_native

import sandlock
from sandlock.errors import ExitCode
from sandlock.exec import engine, spec
from sandlock.exec import native as nativeexec
from sandlock.linux import cgroups, kernel, process

HELPER = Path(spec.__file__).resolve().parent / "helper" / "sandlock_exec.c"
#: The part sandlock_exec.c shares with the front end (the steps, the tree's end).
SHARED = HELPER.with_name("confine.h")


def helper_text() -> str:
    """The helper's source as one text: its file and the header it includes."""
    return HELPER.read_text() + SHARED.read_text()


def define(text: str, name: str) -> str:
    """The body of ``#define NAME body`` (up to a comment or the line's end)."""
    found = re.findall(rf"^#define\s+{name}\s+(.*?)\s*(?:/\*.*)?$", text, re.MULTILINE)
    assert len(found) == 1, f"#define {name} found {len(found)} times in {HELPER} and {SHARED}"
    return str(found[0])


def c_array(text: str, name: str) -> list[str]:
    """The items of ``static const ... name[...] = {a, b, ...};``, unquoted."""
    found = re.findall(rf"\b{name}\[[^\]]*\]\s*=\s*\{{(.*?)\}};", text, re.DOTALL)
    assert len(found) == 1, f"the array {name} found {len(found)} times in {HELPER} and {SHARED}"
    return [item.strip().strip('"') for item in found[0].split(",") if item.strip()]


def drift(text: str) -> list[str]:
    """Every fact of the C source ``text`` that differs from the Python table it copies."""
    out = []
    forwarded = tuple(int(signal.Signals[name.strip()])
                      for name in define(text, "FORWARDED_SIGNALS").split(","))
    if forwarded != process.FORWARDED_SIGNALS:
        out.append(f"FORWARDED_SIGNALS {forwarded} != {process.FORWARDED_SIGNALS}")
    stops = tuple(int(signal.Signals[name.strip()]) for name in define(text, "JOB_STOPS").split(","))
    if stops != process.JOB_STOPS:
        out.append(f"JOB_STOPS {stops} != {process.JOB_STOPS}")
    names = c_array(text, "step_names")
    if names != list(spec.ORDER):
        out.append(f"step_names {names} != spec.ORDER")
    for name in ("SECCOMP_FILTER_FLAG_NEW_LISTENER", "SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV"):
        shift = re.fullmatch(r"\(1U << (\d+)\)", define(text, name + "_"))
        if shift is None or 1 << int(shift[1]) != getattr(kernel, name):
            out.append(f"{name}_ != kernel.{name}")
    required = [name[2:].lower() for name in c_array(text, "required_steps")]
    if required != list(spec.REQUIRED):
        out.append(f"required_steps {required} != spec.REQUIRED {spec.REQUIRED}")
    for name, code in (("LAUNCHER_FAILED", ExitCode.LAUNCHER), ("TIMED_OUT", ExitCode.TIMEOUT)):
        if int(define(text, name)) != code:
            out.append(f"{name} != {code!r}")
    defaulted: list[int] = []  # FORWARDED_SIGNALS in it: compared above, on its own
    for name in define(text, "DEFAULTED_SIGNALS").split(","):
        name = name.strip()
        defaulted += (list(process.FORWARDED_SIGNALS) if name == "FORWARDED_SIGNALS"
                      else [int(signal.Signals[name])])
    if tuple(defaulted) != process.DEFAULTED_SIGNALS:
        out.append(f"DEFAULTED_SIGNALS {defaulted} != {process.DEFAULTED_SIGNALS}")
    if int(define(text, "WIRE_VERSION")) != spec.VERSION:
        out.append("WIRE_VERSION != spec.VERSION")
    request_max = define(text, "REQUEST_MAX")
    assert re.fullmatch(r"\(\d+ \* 1024\)", request_max), request_max
    if not nativeexec.INLINE_LIMIT < int(request_max[1:].split()[0]) * 1024:
        out.append(f"REQUEST_MAX {request_max} <= native.INLINE_LIMIT")
    if define(text, "GROUP_PREFIX") != f'"{cgroups.PREFIX}"':
        out.append(f"GROUP_PREFIX != {cgroups.PREFIX!r}")
    # The stage a failed step reports (engine.STAGES; the other steps report "setup").
    stages = {step.lower(): stage for step, stage in
              re.findall(r'case S_(\w+):[^\n]*\n\s*stage = "(\w+)";', text)}
    if stages != dict(engine.STAGES):
        out.append(f"the child's stages {stages} != engine.STAGES")
    return out


def test_the_c_helpers_copies_are_the_python_tables() -> None:
    assert drift(helper_text()) == []


@pytest.mark.parametrize("old, new", [
    ("#define FORWARDED_SIGNALS SIGINT, SIGTERM, SIGHUP, SIGQUIT",
     "#define FORWARDED_SIGNALS SIGINT, SIGTERM, SIGHUP, SIGUSR1"),
    ("#define JOB_STOPS SIGTSTP, SIGTTIN, SIGTTOU", "#define JOB_STOPS SIGTSTP, SIGTTIN"),
    ('"cgroup", "session",', '"session", "cgroup",'),
    ("S_NNP, S_SECCOMP}", "S_NNP}"),
    ("#define DEFAULTED_SIGNALS SIGPIPE, SIGXFSZ, FORWARDED_SIGNALS",
     "#define DEFAULTED_SIGNALS SIGPIPE, FORWARDED_SIGNALS"),
    ("#define LAUNCHER_FAILED 125", "#define LAUNCHER_FAILED 1"),
    ("#define TIMED_OUT 124", "#define TIMED_OUT 142"),
    ("#define REQUEST_MAX (64 * 1024)", "#define REQUEST_MAX (32 * 1024)"),
    ('#define GROUP_PREFIX "sandlock-"', '#define GROUP_PREFIX "sandlock_"'),
    ('stage = "landlock";', 'stage = "ruleset";'),
])
def test_the_comparison_is_not_vacuous(old: str, new: str) -> None:
    """One side changed: the drift is found (the positive control of the test above)."""
    text = helper_text()
    assert text.count(old) == 1, f"{old!r} is no longer in {HELPER}: update this test"
    assert len(drift(text.replace(old, new))) == 1


def test_the_children_buffer_holds_its_pids() -> None:
    """The arithmetic the children reader relies on is a static assertion of the C
    source (a build fails if it stops holding), and holds for the kernel's pids."""
    text = helper_text()
    assert "_Static_assert(CHILDREN_MAX * (PID_DIGITS + 1) <= CHILDREN_BUFFER," in text
    pid_max_limit = 4 * 1024 * 1024  # PID_MAX_LIMIT on 64-bit (include/linux/threads.h)
    assert int(define(text, "PID_DIGITS")) == len(str(pid_max_limit - 1))
    assert int(define(text, "CHILDREN_MAX")) * (int(define(text, "PID_DIGITS")) + 1) <= int(
        define(text, "CHILDREN_BUFFER"))


# ----------------------------------------------------------------------------
# One grammar for a step's numbers, both executors

MAX_U64 = 2**64 - 1
#: rlimit steps neither executor may accept: each was once accepted by one of them.
MALFORMED = [
    "rlimit=0: -1", "rlimit=0:+5", "rlimit= 0:5", "rlimit=0:5 ", "rlimit=0 :5", "rlimit=+0:5",
    "rlimit=-0:5", "rlimit=0:-0", "rlimit=0_0:5", "rlimit=0:1_0", "rlimit=0:\u0665",
    "rlimit=\u0661:5", "rlimit=0:", "rlimit=:5", "rlimit=0", "rlimit=0:5:6", "rlimit=99:5",
    f"rlimit=0:{MAX_U64 + 1}", "rlimit=99999999999999999999:5", "rlimit=0:0x10", "rlimit=0:\t5",
]
#: ...and their well-formed neighbours, which both accept.
WELL_FORMED = ["rlimit=0:5", "rlimit=15:0", f"rlimit=7:{MAX_U64}", "rlimit=007:0064"]


@pytest.mark.parametrize("text", MALFORMED)
def test_python_refuses_a_malformed_number(text: str) -> None:
    with pytest.raises(ValueError, match="bad rlimit step"):
        spec.decode([text])


@pytest.mark.parametrize("text", WELL_FORMED)
def test_python_takes_a_well_formed_number(text: str) -> None:
    _, numbers = text.split("=")
    res, value = numbers.split(":")
    assert spec.decode([text]) == (("rlimit", int(res), int(value)),)


@pytest.fixture
def box(monkeypatch: pytest.MonkeyPatch) -> Iterator[sandlock.Sandbox]:
    require_abi(1, "the Python API")
    require_native()
    monkeypatch.setenv("SANDLOCK_NATIVE", "1")
    with sandlock.Sandbox({"extends": ["base"], "filesystem": {"exec": ["/usr/bin/true"]}}) as sandbox:
        sandbox.run(["/usr/bin/true"])
        yield sandbox


def refusal(box: sandlock.Sandbox, data: bytes) -> bytes:
    """The helper's answer to a raw request; the server lives on."""
    from test_native import request

    server = nativeexec.get().pid
    answer = request(data)
    assert nativeexec.get().pid == server and proc_state(server) not in ("Z", "gone")
    assert box.run(["/usr/bin/true"]).returncode == 0
    return answer


def with_step(step: str) -> Callable[[list[str]], bytes]:
    from test_native import STEPS, counts

    return lambda args: counts(args, steps=[*STEPS[:4], step, *STEPS[4:]])


REFUSED = b"F 125 SetupError\nsandlock-exec: "
TRUE = ["--", "/usr/bin/true", "true"]


@pytest.mark.parametrize("text", MALFORMED)
def test_the_c_helper_refuses_a_malformed_number(box: sandlock.Sandbox, text: str) -> None:
    answer = refusal(box, with_step(text)(TRUE))
    assert answer.startswith(REFUSED + b"bad rlimit step"), answer


@pytest.mark.parametrize("text", WELL_FORMED)
def test_the_c_helper_takes_a_well_formed_number(box: sandlock.Sandbox, text: str) -> None:
    """The positive control: the same request with a well-formed step runs (an exec
    step's report "E 0 ..." follows "T"; a refusal would come first)."""
    from test_native import request

    answer = request(with_step(text)(TRUE))
    assert answer == b"T", answer


@pytest.mark.parametrize("args, why", [
    (["-p", " 5", "-g", "2:/x", "-G", "/x"], b"bad -p"),
    (["-p", "+5", "-g", "2:/x", "-G", "/x"], b"bad -p"),
    (["-p", "5 ", "-g", "2:/x", "-G", "/x"], b"bad -p"),
    (["-t", " 1"], b"bad -t"),
    (["-t", "+1"], b"bad -t"),
    (["-t", "inf"], b"bad -t"),
    (["-t", "0x10"], b"bad -t"),
    (["-t", "1e999"], b"bad -t"),
])
def test_the_c_helper_refuses_a_malformed_option(box: sandlock.Sandbox, args: list[str],
                                                 why: bytes) -> None:
    from test_native import counts

    steps = ["cgroup"] if args[0] == "-p" else []
    from test_native import STEPS

    answer = refusal(box, counts([*args, *TRUE], steps=[*steps, *STEPS]))
    assert answer.startswith(REFUSED + why), answer


def test_a_cgroup_path_too_long_is_refused_not_cut(box: sandlock.Sandbox, tmp_path: Path) -> None:
    """A base whose group path would not fit the buffer: refused by name, never a
    directory made at a truncated path (snprintf's result is checked)."""
    from test_native import STEPS, counts

    base = str(tmp_path) + "/." * ((4090 - len(str(tmp_path))) // 2)
    args = ["-p", "5", "-g", f"2:{base}", "-G", "/x", *TRUE]
    answer = refusal(box, counts(args, steps=["cgroup", *STEPS]))
    assert answer.startswith(REFUSED + b"the pids cgroup's path is too long"), answer
    assert list(tmp_path.iterdir()) == []


def test_the_options_well_formed_are_taken(box: sandlock.Sandbox) -> None:
    """The positive control of the option tests: -t as Python writes it runs."""
    from test_native import STEPS, counts, request

    assert request(counts(["-t", repr(30.00001), *TRUE], steps=STEPS)) == b"T"
    assert request(counts(["-t", "1e-05", *TRUE], steps=STEPS)) == b"T"


def test_the_resource_count_is_the_kernels() -> None:
    """spec.RLIM_NLIMITS, the bound of a step's RESOURCE, is the kernel's (the C helper
    takes it from its libc's headers)."""
    import resource

    assert spec.RLIM_NLIMITS - 1 == resource.RLIMIT_RTTIME  # the last one
    header = Path("/usr/include/asm-generic/resource.h")
    if not header.exists():
        pytest.skip(f"no {header} here")
    assert int(define(header.read_text(), "RLIM_NLIMITS")) == spec.RLIM_NLIMITS


@pytest.mark.parametrize("message", [b"s +10", b"s  10", b"s 10 ", b"s 010x", b"s 65", b"s 0"])
def test_the_c_helper_ignores_a_malformed_signal_message(box: sandlock.Sandbox, message: bytes) -> None:
    """A call's "s N" message is read with the same grammar: a malformed one is not sent
    on (strtol took "+10" and " 10" for SIGUSR1). Then "s 10" is: the positive control."""
    import time

    script = "trap 'exit 7' USR1; echo ready; while :; do sleep 0.05; done"
    box_sh = sandlock.Sandbox({"extends": ["base"], "filesystem": {"exec": ["/bin/sh", "/usr/bin/sleep"]}})
    with box_sh, box_sh.popen(["/bin/sh", "-c", script], stdout=sandlock.PIPE) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        proc._call.send(message)
        time.sleep(0.3)  # let a wrongly sent signal arrive (a shell that exits shows it)
        assert proc.poll() is None, f"{message!r} was taken for a signal"
        proc._call.send(b"s %d" % signal.SIGUSR1)
        assert proc.wait(timeout=10) == 7
