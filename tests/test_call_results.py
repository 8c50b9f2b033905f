"""What a call()'s confined function sends back cannot hurt the caller.

Each attack is a result a hijacked tool can send (``api_tools.reply`` writes the bytes
as its result): the caller must refuse it with a CallError, without allocating far
more than the bytes it read, without spending long rebuilding it, and without
importing or looking anything up on the tool's behalf.
"""

from __future__ import annotations

import fractions
import os
import pickle
import resource
import struct
import subprocess
import sys
import types
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import api_tools
import pytest
from conftest import REPO, require_abi

import sandlock

TESTS = str(REPO / "tests")


@pytest.fixture(autouse=True)
def _landlock() -> None:
    require_abi(1, "the Python API")


@pytest.fixture(scope="module")
def box() -> Iterator[sandlock.Sandbox]:
    with sandlock.Sandbox({"extends": ["python"], "filesystem": {"read": [TESTS]}}) as sandbox:
        yield sandbox


class _As:
    """Pickles as ``func(*args)``: what a hijacked tool can ask the caller to run."""

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> Any:
        return self.func, self.args


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _refused(box: sandlock.Sandbox, blob: bytes) -> sandlock.CallError:
    try:
        box.call(api_tools.reply, blob)
    except BaseException as exc:  # noqa: BLE001 - whatever comes out is the verdict
        assert isinstance(exc, sandlock.CallError), repr(exc)
        return exc
    raise AssertionError("the hostile result was rebuilt")


def _peak_of_refusal(box: sandlock.Sandbox, blob: bytes, why: str = "") -> int:
    """The most memory the refused load of ``blob`` took (tracemalloc: what this load
    allocates, whatever ran before it, where ru_maxrss keeps the process's peak)."""
    import tracemalloc

    tracemalloc.start()
    try:
        assert why in str(_refused(box, blob))
        return int(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


BIG = 1 << 29  # 512 MiB


@pytest.mark.parametrize("blob", [
    pytest.param(pickle.dumps(_As(bytearray, (BIG,)), 5), id="bytearray(n)"),
    # list[0:0] = range(n): a 30-byte pickle that materialises n ints
    pytest.param(b"\x80\x05]" + _global("builtins", "slice") + b"K\x00K\x00\x86R"
                 + _global("builtins", "range") + b"J" + struct.pack("<i", 1 << 24)
                 + b"\x85Rs.", id="list-slice=range(n)"),
    pytest.param(pickle.dumps(_As(frozenset, (range(1 << 24),)), 5), id="frozenset(range)"),
    # a list holding itself 20,000 times (40 KB): each object walked again at each depth
    # it was reached at, the depth check itself took about 300 MiB (and gigabytes for 1 MB)
    pytest.param(b"\x80\x04]\x94(" + b"h\x00" * 20_000 + b"e.", id="list holding itself"),
])
def test_a_small_result_cannot_make_the_caller_allocate(box: sandlock.Sandbox,
                                                        blob: bytes) -> None:
    before = _peak_mib()
    _refused(box, blob)
    assert _peak_mib() - before < 100


@pytest.mark.parametrize("blob", [
    pytest.param(pickle.dumps(_As(fractions.Fraction, ("1e1000000",)), 5),
                 id="Fraction('1e1000000')"),
    pytest.param(pickle.dumps(_As(fractions.Fraction, (3 ** 400000, 7 ** 300000)), 5),
                 id="Fraction(huge, huge)"),
    pytest.param(pickle.dumps(_As(__import__("decimal").Decimal, ("1e999999999",)), 5),
                 id="Decimal('1e999999999')"),
    pytest.param(b"\x80\x05" + b"]" * 100_000 + b"a" * 99_999 + b".", id="nested 100000 deep"),
    # a codec quadratic in its input (22 s for 8,000 characters), and one the caller
    # would import for the tool
    pytest.param(pickle.dumps(_As(bytearray, ("".join(map(chr, range(256, 8256))), "punycode")),
                              5), id="bytearray(str, 'punycode')"),
    pytest.param(pickle.dumps(_As(bytearray, ("x", "idna")), 5), id="bytearray(str, 'idna')"),
])
def test_results_that_cost_time_or_depth_to_use_are_refused(box: sandlock.Sandbox,
                                                            blob: bytes) -> None:
    _refused(box, blob)


def test_plain_data_still_comes_back(box: sandlock.Sandbox) -> None:
    import collections
    import datetime
    import decimal
    import uuid

    value = {"frac": fractions.Fraction(3, 4), "dec": decimal.Decimal("-1.25e-7"),
             "ba": bytearray(b"xy"), "od": collections.OrderedDict(a=1),
             "dq": collections.deque([1, 2], maxlen=5), "ct": collections.Counter("aab"),
             "fs": frozenset({1, 2}), "s": {3}, "c": 1 + 2j, "sl": slice(1, 2),
             "dt": datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone.utc),
             "u": uuid.UUID(int=5), "p": Path("/a/b"), "deep": [[[[[1]]]]],
             "big": 10 ** 1000}
    assert box.call(api_tools.echo, value) == value
    # bytearray.__reduce_ex__ of protocols 0-2 (not what pickle writes, but its form)
    blob = pickle.dumps(_As(bytearray, ("\xffz", "latin-1")), 5)
    assert box.call(api_tools.reply, blob) == bytearray(b"\xffz")


def test_nothing_is_looked_up_or_imported_for_the_tool(box: sandlock.Sandbox,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []
    lazy = types.ModuleType("sandlock_test_lazy")
    lazy.__getattr__ = lambda name: looked_up.append(name)  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "sandlock_test_lazy", lazy)
    (tmp_path / "sandlock_test_never.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, name in [("sandlock_test_lazy", "Boom"), ("sandlock_test_lazy", "A.B"),
                         ("sandlock_test_never", "Error"), ("os", "system"),
                         ("builtins", "eval"), ("__builtin__", "set")]:
        error = _refused(box, b"\x80\x02" + _global(module, name) + b")R.")
        assert "trusted_types" in str(error)
    assert looked_up == []
    assert "sandlock_test_never" not in sys.modules
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_only_exceptions_are_raised_again(box: sandlock.Sandbox, kind: str) -> None:
    try:
        box.call(api_tools.leave_by, kind)
    except BaseException as exc:  # noqa: BLE001
        assert isinstance(exc, sandlock.CallError), repr(exc)
        assert kind in str(exc)
    else:
        raise AssertionError("no error")



#: An agent process: one call() whose tool sends BLOB (argv[1], hex) as its result, then
#: what the caller's class NAME of MODULE (argv[2], argv[3]) and its paths look like.
_AGENT = """
import sys, pathlib
import sandlock, api_tools
blob, module, name, read = bytes.fromhex(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
cls = getattr(__import__(module), name)
before = dict(vars(cls))
with sandlock.Sandbox({"extends": ["python"], "filesystem": {"read": [read]}},
                      trusted_types=[api_tools.Point]) as box:
    try:
        box.call(api_tools.reply, blob)
        print("rebuilt")
    except sandlock.CallError:
        print("refused")
print("same" if dict(vars(cls)) == before else "changed", str(pathlib.Path("/a/b")))
"""


def _set_on_class(module: str, name: str, attribute: str, value: str) -> bytes:
    """GLOBAL module.name, then BUILD (None, {attribute: value}): setattr on what the
    unpickler handed out for the name; then the result 1."""
    key, text = attribute.encode(), value.encode()
    return (b"\x80\x02" + _global(module, name) + b"N}X" + struct.pack("<I", len(key)) + key
            + b"X" + struct.pack("<I", len(text)) + text + b"s\x86b0K\x01.")


@pytest.mark.parametrize("module, name", [
    ("pathlib", "PosixPath"), ("pathlib", "Path"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PurePath"), ("uuid", "UUID"), ("datetime", "date"),
    ("api_tools", "ToolFailed"),  # an exception class already imported
    ("api_tools", "Point"),  # a trusted type
])
def test_a_result_cannot_change_a_class_of_the_caller(module: str, name: str) -> None:
    """BUILD applied to a class the unpickler handed out is setattr on the caller's own
    class: ``PosixPath._str`` made every path of the agent, its policies and its own
    writes included, one path the tool chose."""
    blob = _set_on_class(module, name, "_str", "/tmp/chosen-by-the-tool")
    out = subprocess.run([sys.executable, "-c", _AGENT, blob.hex(), module, name, TESTS],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), TESTS))})
    assert out.stdout.split() == ["refused", "same", "/a/b"], out.stderr


def test_a_checked_constructor_cannot_be_changed(box: sandlock.Sandbox) -> None:
    """BUILD handed a checked constructor: setting what it calls (its ``cls``) would
    make the next call of that name build something else."""
    error = _refused(box, _set_on_class("pathlib", "PurePath", "cls", "/tmp/chosen-by-the-tool"))
    assert "setting the state of a _Constructor" in str(error)


@pytest.mark.parametrize("cls", [Path, set, slice], ids=["stand-in", "checked", "slice"])
def test_a_class_is_no_result(box: sandlock.Sandbox, cls: type) -> None:
    """A class comes back as nothing at all (the caller would get the stand-in or the
    checked constructor the unpickler made for it, not the class), and says so."""
    error = _refused(box, pickle.dumps([cls], 5))
    assert "a class is not data" in str(error)


# ----------------------------------------------------------------------------
# Results whose cost is not their length: keys of one hash, empty containers

#: Python's hash of an int is the int modulo this prime: these keys all hash to 5.
_P = (1 << 61) - 1


def _colliding(count: int) -> list[int]:
    keys = [5 + k * _P for k in range(count)]
    assert len({hash(key) for key in keys}) == 1  # the attack is real: one hash for all
    return keys


def _long1(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


#: 2,000 keys of one hash: 22 KB, past the C unpickler's size; set or dict (each insert
#: compares the key with every one before it: quadratic; 20,000 took 2.4 s of the caller).
_KEYS = b"".join(_long1(key) for key in _colliding(2000))
_ITEMS = b"".join(_long1(key) + b"N" for key in _colliding(2000))


@pytest.mark.parametrize("blob", [
    pytest.param(b"\x80\x05}(" + _ITEMS + b"u.", id="dict SETITEMS"),
    pytest.param(b"\x80\x05(" + _ITEMS + b"d.", id="dict DICT"),
    pytest.param(b"\x80\x05\x8f(" + _KEYS + b"\x90.", id="set ADDITEMS"),
    pytest.param(b"\x80\x05(" + _KEYS + b"\x91.", id="FROZENSET"),
    pytest.param(pickle.dumps(_As(frozenset, (_colliding(2000),)), 5), id="frozenset(list)"),
    pytest.param(pickle.dumps(_As(__import__("collections").Counter, (_colliding(200),)), 5),
                 id="Counter(list), a short result"),
])
def test_keys_of_one_hash_are_refused(box: sandlock.Sandbox, blob: bytes) -> None:
    """Refused at the 65th key of one hash, for that reason (the comparisons' cost would
    refuse most of them later, once read)."""
    assert "more than 64 keys of one hash" in str(_refused(box, blob))


def test_empty_containers_cannot_make_the_caller_allocate(box: sandlock.Sandbox) -> None:
    """300,000 empty sets: 300 KB of pickle, 65 MB of the caller's memory once built."""
    blob = b"\x80\x05](" + b"\x8f" * 300_000 + b"e."
    before = _peak_mib()
    assert "times its length in memory" in str(_refused(box, blob))
    assert _peak_mib() - before < 40


def test_a_large_result_of_records_comes_back(box: sandlock.Sandbox) -> None:
    """Past the C unpickler's size: records, sets of distinct keys, numbers as keys."""
    records = [{"name": f"file{i}.txt", "size": i, "tags": ["a", "b"], "ok": True}
               for i in range(20_000)]
    value = {"records": records, "ids": set(range(5000)), "by_size": {i: i for i in range(5000)},
             "pairs": frozenset((i, -i) for i in range(3000))}
    assert len(pickle.dumps(value, 5)) > 16 << 10
    assert box.call(api_tools.reply, pickle.dumps(value, 5)) == value


def _repeated_call(module: bytes, name: bytes, arg: bytes, times: int) -> bytes:
    """``[module.name(arg)] * times``, each a new object: the callable and its argument
    named once (memoized), then five bytes a call."""
    head = (b"\x80\x04]" + b"\x8c" + bytes([len(module)]) + module + b"\x94\x8c" + bytes([len(name)])
            + name + b"\x94\x93\x94" + b"0" + b"B" + len(arg).to_bytes(4, "little") + arg
            + b"\x85\x94" + b"0")
    return head + b"h\x02h\x03Ra" * times + b"."


@pytest.mark.parametrize("blob, why", [
    pytest.param(_repeated_call(b"builtins", b"bytearray", b"x" * 16384, 5000),
                 "times its length in memory", id="bytearray, checked"),
    pytest.param(_repeated_call(b"builtins", b"bytearray", b"x" * 8192, 1000),
                 "times its length in memory", id="bytearray, C"),
    # a deque of bytes (each byte an item) is refused before it is made
    pytest.param(_repeated_call(b"collections", b"deque", b"x" * 8192, 1000), "deque('bytes',)",
                 id="deque, C"),
])
def test_an_argument_passed_again_and_again_is_counted_each_time(box: sandlock.Sandbox,
                                                                 blob: bytes, why: str) -> None:
    before = _peak_mib()
    assert why in str(_refused(box, blob))
    assert _peak_mib() - before < 40


def test_a_set_and_its_added_keys_count_together(box: sandlock.Sandbox) -> None:
    """set(list of 64 keys of one hash), then 64 more of that hash added to it."""
    keys = _colliding(128)
    built = pickle.dumps(_As(set, (keys[:64],)), 4)[2:-1]  # without PROTO and STOP
    padding = b"B" + (20000).to_bytes(4, "little") + b"x" * 20000 + b"0"  # past the C one's size
    more = b"(" + b"".join(_long1(key) for key in keys[64:]) + b"\x90."
    assert "keys of one hash" in str(_refused(box, b"\x80\x04" + padding + built + more))


def _nested_slices(levels: int, inner: bytes = b"N") -> bytes:
    """slice(slice(... slice(inner) ...)), ``levels`` deep: the callable named once."""
    return (b"\x80\x04\x8c\x08builtins\x8c\x05slice\x93\x94" + b"h\x00" * levels + inner
            + b"\x85R" * levels + b".")


@pytest.mark.parametrize("blob", [
    # freed by recursion in C: 400,000 deep crashed the caller (its stack)
    pytest.param(_nested_slices(1000), id="slices nested 1000 deep"),
    pytest.param(_nested_slices(1, _global("datetime", "date")), id="a class inside a slice"),
])
def test_a_slice_holds_no_container_and_no_class(box: sandlock.Sandbox, blob: bytes) -> None:
    _refused(box, blob)


def test_a_slice_of_numbers_still_comes_back(box: sandlock.Sandbox) -> None:
    assert box.call(api_tools.reply, pickle.dumps(slice(1, None, 2), 5)) == slice(1, None, 2)


@pytest.mark.parametrize("part, times, padding", [
    ("/".join(["a"] * 2000), 5000, 0),
    ("/".join(["a"] * 2000), 5000, 20_000),
    # within what its length may take, until each part is split into its components
    ("/".join(["ab"] * 1000), 700, 20_000),
], ids=["C", "checked", "split"])
def test_a_path_of_one_part_passed_again_and_again_is_refused(
        box: sandlock.Sandbox, part: str, times: int, padding: int) -> None:
    """PurePosixPath(s, s, s, ...): the part named once, then two bytes a reference; each
    split into its components again (9 KiB took 0.6 s and 64 MiB, 58 KiB 1.7 GiB)."""
    import pathlib

    blob = pickle.dumps([b"x" * padding, _As(pathlib.PurePosixPath, (part,) * times)], 4)
    assert (len(blob) > 16 << 10) == bool(padding)
    assert _peak_of_refusal(box, blob) < 16 << 20


def test_a_path_still_comes_back(box: sandlock.Sandbox) -> None:
    import pathlib

    value = [pathlib.PurePosixPath("/srv/data/notes.md"), pathlib.Path("/tmp")]
    assert box.call(api_tools.reply, pickle.dumps(value, 5)) == value


# ----------------------------------------------------------------------------
# A fourth attack round: what the depth check did not see, and what was not counted

_DEEP = "b'N' + b'\\x85' * 1_000_000"  # (((None,),),...), a million deep
#: Results whose key (a million deep) the caller would hash as it rebuilds them.
_DEEP_KEYS = {
    "dict": "b'\\x80\\x04}' + %s + b'Ns.'" % _DEEP,
    # OrderedDict takes any two-item iterable as a pair: here a deque
    "OrderedDict of a deque": ("b'\\x80\\x04\\x8c\\x0bcollections\\x8c\\x0bOrderedDict\\x93]("
                               "\\x8c\\x0bcollections\\x8c\\x05deque\\x93](' + %s + "
                               "b'Ne\\x85Re\\x85R.'" % _DEEP),
}
# deque((deque((... (),)),)), 250,000 deep, each level padded so the memory bound holds
_DEEP_KEYS_FREED = ("b'\\x80\\x04\\x8c\\x0bcollections\\x94\\x8c\\x05deque\\x94\\x93\\x94' + "
                    "b'h\\x02' * 250_000 + b')' + (b'\\x85\\x85R' + b'N0' * 4) * 250_000 + b'.'")
# the same deques, made and dropped (POP): held by the unpickler's memo only, freed with it
_DEEP_DEQUES_DROPPED = _DEEP_KEYS_FREED.replace("b'.'", "b'0K\\x01.'")
_DEEP_KEY = """
import sys
import sandlock, api_tools
blob = eval(sys.argv[2])
with sandlock.Sandbox({"extends": ["python"], "filesystem": {"read": [sys.argv[1]]}}) as box:
    try:
        box.call(api_tools.reply, blob)
        print("rebuilt")
    except sandlock.CallError:
        print("refused")
"""


def test_deques_nested_deep_are_refused_and_freed_without_recursion() -> None:
    """A deque is freed by recursion in C (no guard): 250,000 nested deques (3.3 MB,
    within the memory bound) were built, refused by the depth check, then crashed the
    caller as they were freed."""
    out = subprocess.run([sys.executable, "-c", _DEEP_KEY, TESTS, _DEEP_KEYS_FREED],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), TESTS))})
    assert (out.returncode, out.stdout.split()) == (0, ["refused"]), out.stderr[-2000:]


def test_deques_nested_deep_and_dropped_are_freed_without_recursion() -> None:
    """The same deques, made and dropped by the pickle, which returns 1: held by the
    unpickler's memo only, they were freed with it after a load that passed."""
    out = subprocess.run([sys.executable, "-c", _DEEP_KEY, TESTS, _DEEP_DEQUES_DROPPED],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), TESTS))})
    assert (out.returncode, out.stdout.split()) == (0, ["rebuilt"]), out.stderr[-2000:]


def _built(made: bytes, attribute: bytes, value: bytes) -> bytes:
    """``made`` (opcodes leaving one object), then BUILD {attribute: value} on it."""
    return (b"\x80\x04" + made + b"}\x8c" + bytes([len(attribute)]) + attribute + value
            + b"sb.")


@pytest.mark.parametrize("blob", [
    # a Counter's keys and values hidden by attributes of those names
    pytest.param(_built(b"ccollections\nCounter\n)R", b"keys", b"cbuiltins\nset\n"),
                 id="Counter.keys"),
    pytest.param(_built(b"ccollections\nOrderedDict\n)R", b"x", b"cbuiltins\nset\n"),
                 id="OrderedDict attribute"),
    # a path whose parts say one file and whose text opens another
    pytest.param(_built(b"cpathlib\nPosixPath\nX\x10\x00\x00\x00/workspace/notes\x85R",
                        b"_str", b"X\x0b\x00\x00\x00/etc/passwd"), id="PosixPath._str"),
    pytest.param(_built(b"cfractions\nFraction\nK\x01K\x02\x86R", b"_numerator",
                        b"K\x07"), id="Fraction._numerator"),
])
def test_the_state_of_a_checked_object_is_never_set(box: sandlock.Sandbox, blob: bytes) -> None:
    """BUILD sets an object's attributes: on what a checked constructor made, it undid
    the check (a path checked to be in the workspace opened /etc/passwd)."""
    assert "setting the state of a" in str(_refused(box, blob))


def test_a_text_held_many_times_counts_its_length_each_time(box: sandlock.Sandbox) -> None:
    """One 1 MiB text, referenced 200,000 times (1.4 MB): the caller's repr or json of
    it would write 195 GiB."""
    text = b"x" * (1 << 20)
    blob = (b"\x80\x04X" + len(text).to_bytes(4, "little") + text + b"\x940](" + b"h\x00" * 200_000
            + b"e.")
    assert "times its length" in str(_refused(box, blob))


def _shared(levels: int) -> bytes:
    """(t, l): t = (t', t') and l = [l', l'], ``levels`` deep: each level holds the one
    below twice, so hash, ==, repr and json.dumps walk 2**levels paths."""
    def put(i: int) -> bytes:
        return b"r" + i.to_bytes(4, "little")

    def get(i: int) -> bytes:
        return b"j" + i.to_bytes(4, "little")

    parts = [b"\x80\x04)", put(0), b"0"]
    parts += [get(k) + get(k) + b"\x86" + put(k + 1) + b"0" for k in range(levels)]
    parts += [b"]", put(levels + 1), b"0"]
    parts += [b"(" + get(k) + get(k) + b"l" + put(k + 1) + b"0"
              for k in range(levels + 1, 2 * levels + 1)]
    return b"".join(parts) + get(levels) + get(2 * levels + 1) + b"\x86."


def test_a_result_whose_shared_parts_multiply_is_refused(box: sandlock.Sandbox) -> None:
    """3.5 KB, 100 levels each holding the next twice: within the depth bound, but the
    caller's hash, ==, repr or json.dumps of it would never end."""
    assert "times its length" in str(_refused(box, _shared(100)))


@pytest.mark.parametrize("kind", sorted(_DEEP_KEYS))
def test_a_key_nested_a_million_deep_is_refused_before_it_is_hashed(kind: str) -> None:
    """A tuple's hash recurses in C without a guard: hashed as it went into its dict, a
    key nested 1,000,000 deep crashed the caller (the depth check runs after the load)."""
    out = subprocess.run([sys.executable, "-c", _DEEP_KEY, TESTS, _DEEP_KEYS[kind]],
                         capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), TESTS))})
    assert (out.returncode, out.stdout.split()) == (0, ["refused"]), out.stderr[-2000:]


def _member(cls: bytes, name: bytes, value: bytes) -> bytes:
    """builtins.cls() with BUILD {name: value}: BaseException.__setstate__ sets it, into
    a member of the exception (StopIteration.value, AttributeError.obj), not __dict__."""
    return (b"\x80\x04cbuiltins\n" + cls + b"\n)R}\x8c" + bytes([len(name)]) + name + value
            + b"sb.")


@pytest.mark.parametrize("blob", [
    pytest.param(_member(b"StopIteration", b"value", b"cbuiltins\nset\n"), id="a constructor"),
    pytest.param(_member(b"AttributeError", b"obj", b"cbuiltins\nValueError\n"), id="a class"),
    pytest.param(_member(b"StopIteration", b"value", b"N" + b"\x85" * 1000), id="nested 1000 deep"),
])
def test_what_an_exception_holds_in_its_members_is_checked(box: sandlock.Sandbox,
                                                           blob: bytes) -> None:
    _refused(box, blob)


def _repeated(callable_: bytes, arg: bytes, times: int, padding: int) -> bytes:
    """``[callable_(arg)] * times``, each made anew (the callable and the argument named
    once), after ``padding`` bytes."""
    return (b"\x80\x04B" + padding.to_bytes(4, "little") + b"\0" * padding + b"0]" + callable_
            + b"q\x000X" + len(arg).to_bytes(4, "little") + arg + b"q\x010("
            + b"h\x00h\x01\x85R" * times + b"e.")


@pytest.mark.parametrize("blob", [
    # one new one-character string (80 bytes) per element, 8 times what was counted
    pytest.param(_repeated(b"ccollections\ndeque\n", "\u0100".encode() * 2000, 2000, 100_000),
                 id="deque of a text"),
    pytest.param(_repeated(b"cbuiltins\nset\n", "".join(map(chr, range(256, 2256))).encode(),
                           2000, 100_000), id="set of a text"),
    # a path of 64 KiB of two-letter parts, 21,000 strings of 51 bytes each time
    pytest.param(_repeated(b"cpathlib\nPurePosixPath\n", b"ab/" * 21_000, 40, 20_000),
                 id="paths of many parts"),
])
def test_what_a_constructor_makes_of_its_argument_is_counted(box: sandlock.Sandbox,
                                                             blob: bytes) -> None:
    assert _peak_of_refusal(box, blob) < 16 << 20


def _odict_pairs(keys: list[int]) -> bytes:
    """OrderedDict([deque([key, None]), ...]): pairs that are no tuples or lists."""
    out = [b"\x80\x04\x8c\x0bcollections\x8c\x0bOrderedDict\x93"
           b"\x8c\x0bcollections\x8c\x05deque\x93q\x000]("]
    out += [b"h\x00](" + _long1(key) + b"Ne\x85R" for key in keys]
    return b"".join(out) + b"e\x85R."


def test_an_ordered_dicts_pairs_are_pairs(box: sandlock.Sandbox) -> None:
    """Keys of one hash in pairs that are deques were never counted (60,000 of them took
    147 s of the caller's CPU)."""
    assert "not (key, value) pairs" in str(_refused(box, _odict_pairs(_colliding(100))))


def test_fractions_of_memoized_integers_are_counted(box: sandlock.Sandbox) -> None:
    """Fraction(a, b) of two memoized 65,536-bit integers, again and again (eight bytes a
    call, two new 8 KiB integers each): 816 KB took 1.7 GiB."""
    a, b = (1 << 65535) + 1, (1 << 65535) - 1

    def long4(x: int) -> bytes:
        data = x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8b" + len(data).to_bytes(4, "little") + data

    blob = (b"\x80\x04\x8c\tfractions\x8c\x08Fraction\x93q\x000" + long4(a) + b"q\x010"
            + long4(b) + b"q\x020](" + b"h\x00h\x01h\x02\x86R" * 2000 + b"e.")
    assert _peak_of_refusal(box, blob, "Fraction('int', 'int')") < 16 << 20


def test_a_result_of_protocol_0_lists_comes_back(box: sandlock.Sandbox) -> None:
    """The LIST opcode (protocols 0 and 1) in a result over 16 KiB."""
    value = [[1, 2], ["x" * 20_000]]
    blob = pickle.dumps(value, 0)
    assert len(blob) > 16 << 10 and b"(lp" in blob
    assert box.call(api_tools.reply, blob) == value



# ----------------------------------------------------------------------------
# An eighth attack round

_UNICODE_ERROR = """
import pickle, sys
import sandlock, api_tools
blob = pickle.dumps(UnicodeDecodeError("utf-8", b"x", -10**12, -10**12 + 1, "bad"))
with sandlock.Sandbox({"extends": ["python"], "filesystem": {"read": [sys.argv[1]]}}) as box:
    try:
        error = box.call(api_tools.reply, blob)
    except sandlock.CallError:
        print("refused")
    else:
        print("rebuilt", len(str(error)))
"""


def test_a_unicode_error_out_of_range_is_refused() -> None:
    """str() of a UnicodeDecodeError whose start and end are out of its object crashes
    CPython before 3.12.6 (gh-123378): the caller, on printing what the tool returned
    or raised."""
    out = subprocess.run([sys.executable, "-c", _UNICODE_ERROR, TESTS], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), TESTS))})
    assert (out.returncode, out.stdout.split()) == (0, ["refused"]), out.stderr[-2000:]


def test_a_unicode_error_in_range_still_comes_back(box: sandlock.Sandbox) -> None:
    error = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    back = box.call(api_tools.reply, pickle.dumps(error))
    assert type(back) is UnicodeDecodeError and str(back) == str(error)


def test_a_short_result_of_tuples_each_held_twice_is_refused(box: sandlock.Sandbox) -> None:
    """About 400 bytes of plain tuples, each holding the one before twice, as a set's
    item: its hash walks 2**depth leaves (the C unpickler took 3.4 s at 28 levels, and
    would never end at 60)."""
    blob = bytearray(b"\x80\x04\x8fK\x01\x85\x94")
    for i in range(60):
        blob += b"0h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"
    blob += b"0(h" + bytes([60]) + b"\x90."
    assert len(blob) < 500
    _refused(box, bytes(blob))


def test_a_memoryview_is_no_result(box: sandlock.Sandbox) -> None:
    _refused(box, b"\x80\x05\x96" + (3).to_bytes(8, "little") + b"abc\x98.")



# ----------------------------------------------------------------------------
# A ninth attack round

def test_an_item_is_set_in_a_dict_only(box: sandlock.Sandbox) -> None:
    """SETITEM on a bytearray with a slice key: ``ba[0:0] = ba``, five bytes, doubled it
    (1 KB made 256 MiB)."""
    blob = (b"\x80\x04cbuiltins\nbytearray\nC\x01x\x85R\x94"
            b"cbuiltins\nslice\nK\x00K\x00\x86R\x940" + b"h\x01h\x00s" * 24 + b".")
    assert "setting an item of a bytearray" in str(_refused(box, blob))


@pytest.mark.parametrize("blob", [
    pytest.param(pickle.dumps(_As(__import__("decimal").Decimal, (10 ** 9900,)), 4),
                 id="Decimal(int)"),
    pytest.param(pickle.dumps(_As(fractions.Fraction, (2 ** 2000 + 1, 3)), 4),
                 id="Fraction(big int, int)"),
])
def test_numbers_are_made_of_small_parts(box: sandlock.Sandbox, blob: bytes) -> None:
    """Made from a memoized big integer again and again (six bytes a call), Decimal cost
    2.5 ms a call (it pickles as text: never from an integer) and Fraction 5 ms of gcd
    (its integers: at most 1,024 bits, checked before its gcd runs)."""
    refusal = str(_refused(box, blob))
    assert "Decimal(" in refusal or "Fraction('int', 'int')" in refusal, refusal


def test_a_syntax_error_whose_offsets_are_out_of_its_text_is_refused(
        box: sandlock.Sandbox) -> None:
    """The caller's traceback draws a caret per column: ``end_offset`` 2**30 was 1 GiB."""
    error = SyntaxError("bad", ("tool.py", 1, 1, "x = 1", 1, 2 ** 30))
    assert "SyntaxError whose end_offset" in str(_refused(box, pickle.dumps(error)))
    fine = SyntaxError("bad", ("tool.py", 1, 1, "x = 1", 1, 3))
    assert str(box.call(api_tools.reply, pickle.dumps(fine))) == str(fine)


# ----------------------------------------------------------------------------
# A tenth attack round

#: OSError(1, "s", previous), a million deep through its filename (a field of its own,
#: freed by recursion in C: OSError has no guard); then the chain, or None (the chain
#: left in the unpickler's memo, freed with it after a load that passed).
_OSERROR_CHAIN = ("b'\\x80\\x04\\x8c\\x08builtins\\x8c\\x07OSError\\x93\\x94N\\x94' + "
                  "b'h\\x00(K\\x01\\x8c\\x01sh\\x01tRq\\x010' * 1_000_000 + %s")


@pytest.mark.parametrize("end, verdict", [("b'h\\x01.'", "refused"), ("b'N.'", "rebuilt")],
                         ids=["refused", "dropped"])
def test_exceptions_nested_deep_are_freed_without_recursion(end: str, verdict: str) -> None:
    """The caller crashed (SIGSEGV) as it freed the million OSErrors of a refused result,
    or of one that passed and had dropped them."""
    out = subprocess.run([sys.executable, "-c", _DEEP_KEY, TESTS, _OSERROR_CHAIN % end],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), TESTS))})
    assert (out.returncode, out.stdout.split()) == (0, [verdict]), out.stderr[-2000:]


@pytest.mark.parametrize("link", ["__context__", "__cause__"])
def test_an_exception_is_never_linked_to_another(box: sandlock.Sandbox, link: str) -> None:
    """BUILD set ``__context__``, a link an exception never pickles: a million of them,
    each the context of the next, crashed the caller as they were freed."""
    blob = _member(b"OSError", link.encode(), b"cbuiltins\nValueError\n)R")
    assert "cause, context or traceback" in str(_refused(box, blob))


def test_a_key_counts_what_its_parts_hold(box: sandlock.Sandbox) -> None:
    """A list of 200,000 Nones in an exception used as 20,000 keys (261 KB) was looked
    through for each key: 75 s of the caller's CPU. What a key's parts hold counts
    against its 256 values."""
    blob = (b"\x80\x04cbuiltins\nValueError\n](" + b"N" * 1000 + b"e\x85R\x94}h\x00Ns.")
    assert "a key of more than 256 values" in str(_refused(box, blob))


def _date(name: bytes, state: bytes) -> bytes:
    return b"\x80\x03cdatetime\n" + name + b"\nC" + bytes([len(state)]) + state + b"\x85R."


@pytest.mark.parametrize("name, state", [
    (b"date", bytes([0, 0, 1, 200])),  # year 0, day 200: ctime() crashed the caller
    (b"datetime", bytes([0x07, 0xE4, 2, 31, 255, 255, 255, 0xFF, 0xFF, 0xFF])),
    (b"time", bytes([23, 255, 255, 0xFF, 0xFF, 0xFF])),
], ids=["date", "datetime", "time"])
def test_a_date_out_of_range_is_refused(box: sandlock.Sandbox, name: bytes, state: bytes) -> None:
    """From their pickled bytes, CPython checks a date's month (a time's hour) only."""
    assert "out of range" in str(_refused(box, _date(name, state)))


def test_dates_in_range_still_come_back(box: sandlock.Sandbox) -> None:
    import datetime

    value = [datetime.date(2020, 2, 29), datetime.time(23, 59, 59, 999999, fold=1),
             datetime.datetime(1, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=-23)))]
    assert box.call(api_tools.reply, pickle.dumps(value)) == value


@pytest.mark.parametrize("number", [b"\x8a\x11" + b"\xff" * 16 + b"\x7f", b"\x8c\x05hello",
                                    b"J\xff\xff\xff\xff"], ids=["136 bits", "text", "negative"])
def test_a_uuid_is_a_128_bit_number(box: sandlock.Sandbox, number: bytes) -> None:
    """UUID sets its ``int`` from its state as it is: a 136-bit one had a 38-character
    str() and no bytes."""
    blob = b"\x80\x04\x8c\x04uuid\x8c\x04UUID\x93)\x81}\x8c\x03int" + number + b"sb."
    assert "UUID whose number" in str(_refused(box, blob))
    good = uuid.uuid4()
    assert box.call(api_tools.reply, pickle.dumps(good)) == good


@pytest.mark.parametrize("kind", ["StopIteration", "StopAsyncIteration", "_Refused",
                                  "SetupError in a group", "StopIteration in a group",
                                  "CancelledError", "SkipTest"])
def test_what_means_something_to_the_caller_is_raised_as_a_call_error(box: sandlock.Sandbox,
                                                                      kind: str) -> None:
    """A StopIteration raised again by call() in a map() ended the caller's loop early, and
    nothing said so; an exception of sandlock's own is sandlock's word, not the tool's (in
    an exception group too: the caller's ``except* SandlockError`` took the tool's)."""
    if "group" in kind and sys.version_info < (3, 11):
        pytest.skip("exception groups are Python 3.11's")
    import concurrent.futures  # noqa: F401 - imported: its CancelledError can be rebuilt
    import unittest  # noqa: F401 - and SkipTest

    done, caught = [], None
    try:  # caught here whatever it is: a SkipTest escaping would make pytest skip the test
        for value in map(lambda each: box.call(api_tools.stop, each), [kind, kind]):
            done.append(value)
    except BaseException as exc:  # noqa: BLE001 - what came out is the verdict
        caught = exc
    assert isinstance(caught, sandlock.CallError) and kind in str(caught), repr(caught)
    assert done == []


def test_a_key_is_walked_once_a_load() -> None:
    """A tuple of 255 numbers (or a date and 200 numbers) used as a key again and again, five
    bytes a time, was walked each time (a 64 MiB result: about 400 s of the caller's CPU);
    each object in a key is walked once a load (nothing in it may change after: BUILD is
    refused on it)."""
    import datetime

    from sandlock.api import unpickle

    numbers = tuple(range(255))
    nested = (tuple(range(10)), frozenset({1, 2}), "text")
    dated = (datetime.date(2020, 1, 1), *range(200))
    error = ValueError("x")
    changing = (error, 1)
    unpickle._LOAD.frozen, unpickle._LOAD.hashed = {}, {}
    try:
        for key in (numbers, nested, dated, changing):
            unpickle._small_key(key)
        walked = set(unpickle._LOAD.frozen)
        assert {id(numbers), id(nested), id(dated), id(changing), id(error)} <= walked
        assert id(error) in unpickle._LOAD.hashed  # so BUILD may not change it now
    finally:
        unpickle._LOAD.frozen = unpickle._LOAD.hashed = None
    # each use still counts what it holds: twice the 255 numbers are too many for one key
    with pytest.raises(unpickle._Refused, match="256 values"):
        unpickle._small_key((numbers, numbers))


def _same_hash_keys(text: int, dicts: int) -> bytes:
    """64 keys ``(its own copy of a text, 5 + k * (2**61 - 1))`` of one hash, memoized, then
    ``dicts`` dicts of all of them (197 bytes each)."""
    out = [b"\x80\x04]"]
    for k in range(64):
        number = 5 + k * ((1 << 61) - 1)
        raw = number.to_bytes((number.bit_length() + 8) // 8, "little", signed=True)
        out.append(b"\x8d" + struct.pack("<Q", text) + b"A" * text + b"\x8a"
                   + bytes([len(raw)]) + raw + b"\x86\x940")
    out.append(b"(")
    out += [b"}(" + b"".join(b"h" + bytes([k]) + b"N" for k in range(64)) + b"u"] * dicts
    return b"".join(out + [b"e."])


def test_comparing_keys_of_one_hash_counts(box: sandlock.Sandbox) -> None:
    """64 keys of one hash (the most a dict may have), each holding its own 256 KB text, in
    a thousand dicts of 197 bytes each: each insert compared the whole texts, 23 s of the
    caller's CPU for 17 MB. What the comparisons read counts against 64 times the length."""
    assert "comparing its keys of one hash" in str(_refused(box, _same_hash_keys(20_000, 40)))
    fine = {(5 + k * ((1 << 61) - 1)): k for k in range(64)}  # the same hash, small keys
    assert box.call(api_tools.reply, pickle.dumps(fine, 4)) == fine


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11's")
def test_the_text_of_an_exceptions_fields_counts(box: sandlock.Sandbox) -> None:
    """An OSError whose filename (a field, not its args) was 200 KB, held 15**3 times in
    groups of groups: a 200 KB result, accepted, and the caller's traceback of it was
    1.35 GB. What an exception's fields hold counts as its ``__dict__`` does."""
    with pytest.raises(sandlock.CallError, match="raised ExceptionGroup"):
        box.call(api_tools.raise_groups, 3, 20_000)
    with pytest.raises(ExceptionGroup):  # noqa: F821 - the same groups, of a short filename
        box.call(api_tools.raise_groups, 2, 10)


def test_a_uuid_has_a_number_and_a_key_keeps_its_hash(box: sandlock.Sandbox) -> None:
    """A UUID made by NEWOBJ without BUILD had no number (its str() and hash raised), and
    BUILD on one already in a frozenset changed its hash after the set held it."""
    uuid_class = b"\x80\x04\x8c\x04uuid\x8c\x04UUID\x93"
    assert "UUID whose number" in str(_refused(box, uuid_class + b")\x81."))

    def state(number: int) -> bytes:
        return b"}\x8c\x03int\x8a\x01" + bytes([number]) + b"sb"

    blob = (uuid_class + b"\x94)\x81" + state(1) + b"\x94h\x00)\x81" + state(2)
            + b"\x94(h\x01h\x02\x91\x94h\x01" + state(5) + b"0h\x03.")
    assert "used as a key" in str(_refused(box, blob))



# ----------------------------------------------------------------------------
# A fourteenth attack round

def test_an_integer_in_a_key_counts_its_size(box: sandlock.Sandbox) -> None:
    """An integer's hash is computed from all its digits on every insert: a 1 MB one 255
    times in a tuple key cost 13 s of the caller's CPU for each dict of 64 such keys."""
    assert "256 values" in str(_refused(box, pickle.dumps({(2 ** 70_000,): 1}, 4)))
    assert "256 values" in str(_refused(box, pickle.dumps({2 ** 70_000: 1}, 4)))
    fine = {(2 ** 1000, 3): 1, 2 ** 5000: 2}
    assert box.call(api_tools.reply, pickle.dumps(fine, 4)) == fine


def test_nothing_inside_a_key_changes_after_it(box: sandlock.Sandbox) -> None:
    """BUILD on a UUID inside a tuple already in a set: ``(u,) in s`` was False for the set's
    own member."""
    uuid_class = b"\x80\x04\x8c\x04uuid\x8c\x04UUID\x93\x94"
    state = b"}\x8c\x03int\x8a\x01%bsb"
    blob = (uuid_class + b")\x81" + state % b"\x01" + b"\x94h\x01\x85\x94(h\x02\x91\x94"
            + b"h\x01" + state % b"\x05" + b"0h\x03.")
    assert "used as a key" in str(_refused(box, blob))


def test_a_syntax_error_without_its_line_comes_back(box: sandlock.Sandbox) -> None:
    """The compiler's "'return' outside function" has no text: no caret is drawn, so its
    offsets need no bound (it was refused)."""
    try:
        compile("def f():\n    pass\nreturn 1\n", "tool.py", "exec")
    except SyntaxError as error:
        made = error
    back = box.call(api_tools.reply, pickle.dumps(made))
    assert (type(back), str(back)) == (SyntaxError, str(made))


def test_the_memo_counts(box: sandlock.Sandbox) -> None:
    """Ten million one-byte MEMOIZE opcodes took 652 MiB for 9.5 MiB: the unpickler's memo
    is counted against the same memory as what it builds."""
    blob = b"\x80\x04N" + b"\x94" * 2_000_000 + b"."
    assert "times its length in memory" in str(_refused(box, blob))



def _decimals_and_an_integer(dicts: int) -> bytes:
    """An integer of 16,319 bits and 63 Decimals of its hash, memoized, then ``dicts`` dicts
    of all 64 (195 bytes each, the integer first)."""
    modulus = (1 << 61) - 1
    number = (1 << 16319) + 12345
    raw = number.to_bytes((number.bit_length() + 8) // 8, "little", signed=True)
    out = [b"\x80\x04]\x8b" + struct.pack("<I", len(raw)) + raw + b"\x940cdecimal\nDecimal\n\x940"]
    for k in range(1, 64):
        text = str(number % modulus + k * modulus).encode()
        out.append(b"h\x01\x8c" + bytes([len(text)]) + text + b"\x85R\x940")
    out.append(b"(")
    out += [b"(h\x00N" + b"".join(b"h" + bytes([1 + k]) + b"N" for k in range(1, 64)) + b"d"] * dicts
    return b"".join(out + [b"e."])


def test_a_comparison_costs_its_heavier_key(box: sandlock.Sandbox) -> None:
    """A Decimal compared with an integer of its hash converts the integer (quadratic in its
    digits): 63 Decimals and one 16,319-bit integer of one hash in dicts of 195 bytes, a
    24 KB result, took 11.5 s of the caller's CPU and came back (a sixteenth attack round)."""
    assert "comparing its keys of one hash" in str(_refused(box, _decimals_and_an_integer(1)))



def test_a_fraction_from_text_is_of_small_integers(box: sandlock.Sandbox) -> None:
    """A Fraction pickles as its text: one of 4,300 digits, compared with a Decimal of its
    hash, is converted each time (0.46 ms): 64 keys of one hash in 132-byte sets took 0.56 s
    of the caller's CPU a set (a seventeenth attack round). Its integers are of at most
    1,024 bits, however it is made."""
    blob = pickle.dumps(_As(fractions.Fraction, ("9" * 4300,)), 4)  # as text, by hand
    assert "Fraction" in str(_refused(box, blob))
    fine = [fractions.Fraction(2 ** 1000, 3), fractions.Fraction("1.25")]
    assert box.call(api_tools.reply, pickle.dumps(fine)) == fine
