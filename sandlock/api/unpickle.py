"""The restricted unpickler of ``call()`` results: the caller's only parser of bytes that
the confined tool wrote.

A confined function's outcome comes back as a pickle on the call's result pipe. Whatever
runs in the sandbox may have been hijacked, so every byte read here is untrusted input,
and this module is kept self-contained so that it can be read and reviewed on its own:
it imports nothing of sandlock but its error types and :class:`RemoteTraceback`, opens
nothing and imports only the modules named in ``_SAFE_GLOBALS``.

What is rebuilt is bounded: constructors are named by the bytes, so the only ones
reachable are those below, each called through a check that its output is about the
size of its arguments. Containers are refused past ``_MAX_DEPTH`` levels, exceptions
are rebuilt only from classes already imported, and anything else only if the caller
named its class in ``trusted_types=``.

Two costs are not the bytes' length, and are bounded apart. Memory: an empty set is one
opcode byte and 216 bytes of the caller's memory; the containers a result makes may
take at most ``_MAX_GROWTH`` times its length. Time: numbers, and tuples of them, have
hashes anyone can make equal (``hash(k * (2**61 - 1) + 5)`` is 5 for every k), and a
set or dict of n keys of one hash costs n * n / 2 comparisons to build (20,000 keys,
240 KB, took 2.4 s of the caller's CPU); a set or dict may hold at most
``_MAX_SAME_HASH`` keys of one hash. Both are checked as each container is built, by
the pure-Python unpickler (about ten times slower than the C one, whose opcodes cannot be
checked: a 200-byte result of plain tuples, each holding the one before twice, took the
C one's hashes forever), for every result. It also refuses ``BUILD`` (setting
an object's state) on all but exceptions, ``UUID`` and trusted types: set on a path,
``_str`` made one that its parts said was in the workspace open another file.
"""

from __future__ import annotations

import collections
import enum as _enum
import io
import pickle
import sys
import threading
import types
from typing import Any, Callable, Iterable, Mapping, NoReturn, Optional

from ..errors import CallError, SandlockError
from .results import RemoteTraceback

#: The only globals a result may name, besides exception classes already imported and the
#: caller's ``trusted_types``; only these modules are ever imported here.
_SAFE_GLOBALS = {
    "builtins": {"complex", "set", "frozenset", "bytearray", "slice"},
    "collections": {"OrderedDict", "deque", "Counter"},
    "datetime": {"date", "time", "datetime", "timedelta", "timezone"},
    "decimal": {"Decimal"},
    "fractions": {"Fraction"},
    "uuid": {"UUID"},
    "pathlib": {"PurePath", "PurePosixPath", "Path", "PosixPath"},
}
#: The safe classes a pickle rebuilds with BUILD (their state: UUID's ``int``).
_BUILT = {("uuid", "UUID")}
#: What BUILD never sets on an exception: its links to others (an exception pickles its
#: arguments and ``__dict__`` only).
_LINKS = frozenset({"__context__", "__cause__", "__traceback__", "__suppress_context__"})
#: An int given to a number constructor (Fraction's gcd, Decimal's conversion are
#: quadratic in it): 2^16 bits, ~20,000 decimal digits.
_MAX_INT_BITS = 1 << 16
#: A Decimal's exponent: int() or Fraction() of it would make that many digits.
_MAX_EXPONENT = 10_000
#: Containers inside containers (the caller's repr, ==, json, copy recurse on them).
_MAX_DEPTH = 200
#: Keys of one hash in one set or dict (or Counter, OrderedDict, frozenset).
_MAX_SAME_HASH = 64
#: The memory the containers of a result may take, as a multiple of its length (a list of
#: small records takes about 15 to 30 times the bytes of its pickle), plus 1 MiB.
_MAX_GROWTH = 64
#: Arguments whose length is that of what was read (not range, not an iterator).
_MATERIALISED = (list, tuple, dict, set, frozenset, str, bytes, bytearray)
#: Values with nothing inside to walk.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray})


class _Untrusted(Exception):
    """A result names a global that is neither plain data nor trusted (its message: the name)."""


class _Refused(Exception):
    """A constructor's arguments would cost the caller more than the bytes read."""


def _small_int(value: Any) -> bool:
    return type(value) is not int or value.bit_length() <= _MAX_INT_BITS


def _numbers(cls: type, args: tuple[Any, ...]) -> Any:
    if not all(type(a) in (int, float, str) and _small_int(a) for a in args):
        raise _Refused(f"{cls.__name__}{tuple(type(a).__name__ for a in args)}")
    return cls(*args)


#: The longest text a Fraction or a Decimal is made from (Python's own bound on the digits
#: of an int made from text: its conversion is quadratic).
_MAX_NUMBER_TEXT = 4300


#: The integers a Fraction is made of (as it pickles itself): its gcd is quadratic in
#: them, and a memoized pair is passed again for six bytes a call (65,536-bit ones cost
#: 5 ms each time; 1,024-bit ones about what reading their bytes costs).
_MAX_FRACTION_BITS = 1024


def _fraction(cls: type, args: tuple[Any, ...]) -> Any:
    """Fraction(int, int) of integers of at most _MAX_FRACTION_BITS, or Fraction(str)
    without an exponent (``1e10000000`` is 10**10000000: seconds to minutes of CPU)."""
    import re

    if (1 <= len(args) <= 2 and all(type(a) is int and a.bit_length() <= _MAX_FRACTION_BITS
                                    for a in args)) or (
            len(args) == 1 and type(args[0]) is str and len(args[0]) <= _MAX_NUMBER_TEXT
            and re.fullmatch(r"\s*[-+]?(\d+(/\d+)?|\d*\.\d+|\d+\.)\s*", args[0], re.ASCII)):
        made = cls(*args)
        # from text too: a Decimal compared with one of 4,300 digits converts it (0.46 ms a
        # comparison, 64 keys of one hash in 132-byte sets: 0.56 s of CPU a set)
        if max(made.numerator.bit_length(), made.denominator.bit_length()) <= _MAX_FRACTION_BITS:
            return made
        raise _Refused(f"a Fraction of integers of more than {_MAX_FRACTION_BITS} bits")
    raise _Refused(f"Fraction{tuple(type(a).__name__ for a in args)} (only of integers of "
                   f"at most {_MAX_FRACTION_BITS} bits, or of a string of at most "
                   f"{_MAX_NUMBER_TEXT} characters without an exponent that makes such integers)")


def _decimal(cls: type, args: tuple[Any, ...]) -> Any:
    """Decimal(str), as Decimal pickles itself; never of an integer (a memoized
    33,000-bit one, converted again and again, cost 2.5 ms a call)."""
    if len(args) != 1 or type(args[0]) is not str or len(args[0]) > _MAX_NUMBER_TEXT:
        raise _Refused(f"Decimal{tuple(type(a).__name__ for a in args)} (only of a string "
                       f"of at most {_MAX_NUMBER_TEXT} characters)")
    value = cls(*args)
    if value.is_finite() and max(abs(value.as_tuple().exponent), abs(value.adjusted())) \
            > _MAX_EXPONENT:
        raise _Refused(f"a Decimal with an exponent beyond +-{_MAX_EXPONENT}")
    return value


def _bytearray(cls: type, args: tuple[Any, ...]) -> Any:
    """bytearray(bytes), or bytearray(str, "latin-1") as protocols 0-2 write it; never
    bytearray(n), nor another codec (punycode is quadratic in its input, and a codec
    named here would be imported)."""
    if (len(args) == 1 and isinstance(args[0], (bytes, bytearray))) or (
            len(args) == 2 and type(args[0]) is str and args[1] == "latin-1") or not args:
        return cls(*args)
    raise _Refused(f"bytearray{tuple(type(a).__name__ for a in args)}")


def _slice(cls: type, args: tuple[Any, ...]) -> Any:
    """slice(start, stop, step) of atoms: a slice holding a slice (or a class) would hide
    what it holds from the depth check, and nested ones are freed by recursion in C."""
    if len(args) <= 3 and all(type(a) in _ATOMS and _small_int(a) for a in args):
        return cls(*args)
    raise _Refused(f"slice{tuple(type(a).__name__ for a in args)} (only of numbers, text "
                   "or None)")


def _date(cls: type, args: tuple[Any, ...]) -> Any:
    """A date, time or datetime, as it pickles itself (its bytes, and a tzinfo) or from its
    fields, whose ranges are then checked as the constructor of fields checks them: from
    bytes CPython checks only the month (a time, its hour), and ``date(0, 1, 200).ctime()``
    read a day name before its table (the caller crashed)."""
    made = cls(*args)
    import datetime

    try:
        if cls is datetime.date:
            cls(made.year, made.month, made.day)
        elif cls is datetime.time:
            cls(made.hour, made.minute, made.second, made.microsecond, made.tzinfo,
                fold=made.fold)
        else:
            cls(made.year, made.month, made.day, made.hour, made.minute, made.second,
                made.microsecond, made.tzinfo, fold=made.fold)
    except (ValueError, TypeError, OverflowError) as exc:
        raise _Refused(f"a {cls.__name__} out of range ({exc})") from None
    return made


#: A path's parts, all told (16 times PATH_MAX): a path pickles as its parts, one
#: argument each, and each is split into components again as the path is made.
_MAX_PATH_TEXT = 16 * 4096


def _path(cls: type, args: tuple[Any, ...]) -> Any:
    """A pathlib path of str parts, at most _MAX_PATH_TEXT characters in all (one string
    passed again and again, two bytes a time, was split again each time)."""
    if all(type(a) is str for a in args) and sum(map(len, args)) <= _MAX_PATH_TEXT:
        made = cls(*args)
        _charge(None, made.parts)  # a string for each component: about 25 times the text
        return made
    raise _Refused(f"a path of more than {_MAX_PATH_TEXT} characters, or of parts that are "
                   "not text")


#: What a collection is made of in a pickle: never text, whose characters would each
#: become an object (80 bytes for one not in Latin-1) from two bytes of the pickle.
_ITEMS = (list, tuple, dict, set, frozenset)


def _collection(cls: type, args: tuple[Any, ...]) -> Any:
    """set, frozenset, deque, Counter, OrderedDict of the items read (not of a range, not
    of the characters of a text)."""
    if len(args) > 2 or (args and not isinstance(args[0], _ITEMS)) or (
            len(args) == 2 and not (args[1] is None or type(args[1]) is int)):
        raise _Refused(f"{cls.__name__}{tuple(type(a).__name__ for a in args)}")
    if args and cls is not collections.deque:  # what is hashed: keys, or the items
        given = args[0]
        if cls is collections.OrderedDict and not isinstance(given, dict):
            # OrderedDict takes any two-item iterable as a pair: only those whose key is seen
            if not all(type(pair) in (tuple, list) and len(pair) == 2 for pair in given):
                raise _Refused("OrderedDict of items that are not (key, value) pairs")
            given = [pair[0] for pair in given]
        seen: dict[int, tuple[int, int]] = {}
        _spread(given, seen)
        made = cls(*args)
        _LOAD.hashes[id(made)] = seen  # keys added later count with these
        return made
    return _unguarded(cls(*args))


#: A key's values counted through its tuples and frozensets, each time it is reached: its
#: hash is computed from all of them, again for every key it is part of.
_MAX_KEY_ITEMS = 256


def _hash_cost(atom: Any) -> int:
    """What hashing ``atom`` costs, in values: an int's hash is computed from every digit,
    on every insert (never cached, as a text's is): a 1 MB integer 255 times in a tuple
    key cost 13 s of the caller's CPU per dict of 64 such keys."""
    return 1 + atom.bit_length() // 64 if type(atom) is int else 1


def _weight(atom: Any) -> int:
    """What comparing ``atom`` with a key of its hash costs, in values: a text its length; an
    integer the square of its words (a Decimal compared with it converts it, quadratic)."""
    if type(atom) in (str, bytes, bytearray):
        return 1 + len(atom)
    return 1 + (atom.bit_length() // 64) ** 2 if type(atom) is int else 1


def _small_key(key: Any) -> int:
    """Refuse a key nested more than _MAX_DEPTH deep (the hash of a tuple recurses in C,
    without a guard: a million levels crashed the caller) or holding more than
    _MAX_KEY_ITEMS values (counted each time they are reached: the walk stops past the
    bound, whatever is shared), before it is hashed; its weight, what comparing it with an
    equal key reads (its values and the length of its texts). Each object is walked once a
    load: nothing in a key changes after it is walked (BUILD is refused on it, see
    ``_LOAD.hashed``), and one of 255 numbers (or a date and 200 numbers) used as a key again
    and again, five bytes a time, was walked each time (a 64 MiB result: 400 s)."""
    if type(key) in _ATOMS:
        if _hash_cost(key) > _MAX_KEY_ITEMS:
            raise _Refused(f"a key of more than {_MAX_KEY_ITEMS} values (an integer of "
                           f"{key.bit_length()} bits, hashed again for every insert)")
        return _weight(key)
    walked: Optional[dict[int, tuple[Any, int, int, int]]] = getattr(_LOAD, "frozen", None)
    if walked is None:  # no load under way
        walked = {}
    if id(key) in walked:
        return walked[id(key)][3]
    hashed = getattr(_LOAD, "hashed", None)
    stack: list[list[Any]] = []  # [object, what is left of it, height below, values, weight]

    def enter(item: Any) -> None:
        if len(stack) >= _MAX_DEPTH:
            raise _Refused(f"a key nested more than {_MAX_DEPTH} deep")
        if hashed is not None:  # BUILD would change what the key's hash read
            hashed[id(item)] = item
        if type(item) in (tuple, frozenset):
            inside, looked_at = item, 1
        else:  # what _held looks at counts, atoms too: a list of 200,000 Nones inside an
            # exception used as 20,000 keys was looked through for each (75 s of CPU)
            inside, looked_at = _held(item), _width(item)
        stack.append([item, iter(inside), 0, looked_at, looked_at])
        if looked_at > _MAX_KEY_ITEMS:
            raise _Refused(f"a key of more than {_MAX_KEY_ITEMS} values (each hashed again "
                           "for every key it is part of)")

    enter(key)
    while stack:
        top = stack[-1]
        child = next(top[1], _END)
        if child is _END:
            stack.pop()
            walked[id(top[0])] = (top[0], top[2], top[3], top[4])
            if not stack:
                return int(top[4])
            height, values, weight, top = top[2] + 1, top[3], top[4], stack[-1]
        elif type(child) in _ATOMS:
            height, values, weight = 0, _hash_cost(child), _weight(child)
        elif id(child) in walked:
            _, below, values, weight = walked[id(child)]
            height = below + 1
        else:
            enter(child)
            continue
        top[2], top[3], top[4] = max(top[2], height), top[3] + values, top[4] + weight
        if len(stack) + top[2] > _MAX_DEPTH:
            raise _Refused(f"a key nested more than {_MAX_DEPTH} deep")
        if top[3] > _MAX_KEY_ITEMS:
            raise _Refused(f"a key of more than {_MAX_KEY_ITEMS} values (each hashed again "
                           "for every key it is part of)")
    return 1


def _spread(keys: Iterable[Any], seen: dict[int, tuple[int, int]]) -> None:
    """Count ``keys`` by hash into ``seen`` (one container's); refuse more than
    ``_MAX_SAME_HASH`` of one hash, before they are put in the container. A key is compared
    with each key of its hash already there: what those comparisons read counts against
    the load's memory (64 keys of one hash, each holding its own 256 KB text, shared by a
    thousand dicts of 197 bytes each: 23 s of the caller's CPU for 17 MB). A comparison costs
    what the heavier of its two keys does (a Decimal compared with an integer of one hash
    converts the integer, quadratic in its digits: 24 KB took 11.5 s)."""
    for key in keys:
        weight = _small_key(key)
        try:
            mark = hash(key)
        except TypeError:
            continue  # the container refuses it itself
        count, heaviest = seen.get(mark, (0, 0))
        count, heaviest = count + 1, max(heaviest, weight)
        if count > _MAX_SAME_HASH:
            raise _Refused(f"more than {_MAX_SAME_HASH} keys of one hash in one set or dict "
                           "(each would be compared with all the others: quadratic time)")
        if count > 1 and getattr(_LOAD, "budget", None) is not None:
            _LOAD.budget -= (count - 1) * heaviest
            if _LOAD.budget < 0:
                raise _Refused(f"comparing its keys of one hash reads more than {_MAX_GROWTH} "
                               "times its length")
        seen[mark] = (count, heaviest)


#: The checked constructors; classes not named here are handed out as they are (their
#: constructors take bounded arguments; UUID and the date types are rebuilt with NEWOBJ
#: or from their own small state).
_CHECKS: dict[tuple[str, str], Callable[[type, tuple[Any, ...]], Any]] = {
    ("builtins", "complex"): _numbers, ("builtins", "bytearray"): _bytearray,
    ("builtins", "slice"): _slice,
    **{("pathlib", name): _path for name in ("PurePath", "PurePosixPath", "Path", "PosixPath")},
    ("builtins", "set"): _collection, ("builtins", "frozenset"): _collection,
    ("collections", "OrderedDict"): _collection, ("collections", "deque"): _collection,
    ("collections", "Counter"): _collection,
    ("decimal", "Decimal"): _decimal, ("fractions", "Fraction"): _fraction,
    **{("datetime", name): _date for name in ("date", "time", "datetime")},
}


#: The load under way in this thread: what its objects may still take (see _charge).
_LOAD = threading.local()


def _unguarded(made: Any) -> Any:
    """Note ``made`` if CPython frees it by recursion in C, without the guard (the
    "trashcan") that containers have: a deque, an exception whose type has fields of its
    own (OSError, ImportError, StopIteration...), each holding the next. A million of them
    nested crashed the caller as they were freed; :func:`_defuse` lets go of what each
    holds first (see _load)."""
    if isinstance(made, (collections.deque, BaseException)) and getattr(
            _LOAD, "unguarded", None) is not None:
        _LOAD.unguarded.append(made)
    return made


def _defuse(made: Any) -> None:
    """Make ``made`` (see :func:`_unguarded`) hold nothing, so that it is freed on its own."""
    if isinstance(made, collections.deque):
        made.clear()
        return
    for name in ("__context__", "__cause__", "__traceback__", "args"):
        try:
            BaseException.__dict__[name].__set__(made, () if name == "args" else None)
        except (AttributeError, TypeError):
            pass
    for member in _members(type(made)):
        try:
            member.__set__(made, None)
        except (AttributeError, TypeError):  # read-only, or a number
            pass
    try:
        namespace = BaseException.__dict__["__dict__"].__get__(made)
    except (AttributeError, TypeError):
        return
    if type(namespace) is dict:
        namespace.clear()


def _charge(made: Any, args: tuple[Any, ...] = ()) -> Any:
    """Count ``made`` (and the text and sequences it was made of: a pickle may name one
    argument once and pass it again and again for five bytes a time) against the
    memory the load under way may take; _Refused past it. Called with the arguments
    before the constructor runs (what it may copy of them is counted before it copies
    it), then with what it made."""
    if getattr(_LOAD, "budget", None) is None:  # no load under way (not from a result)
        return made
    cost = sys.getsizeof(made) + sum(sys.getsizeof(arg) for arg in args
                                     if isinstance(arg, _MATERIALISED) or type(arg) is int)
    _LOAD.budget -= cost
    if _LOAD.budget < 0:
        raise _Refused(f"what it builds takes more than {_MAX_GROWTH} times its length in "
                       "memory")
    return made


class _Constructor:
    """What a result gets for a class with a checked constructor: calling it checks the
    arguments, then builds. Not data (the depth check refuses it as a value), and no
    attribute can be set on it (BUILD handed it fails)."""

    __slots__ = ("cls", "check")
    cls: type
    check: Callable[[type, tuple[Any, ...]], Any]

    def __init__(self, cls: type, check: Callable[[type, tuple[Any, ...]], Any]) -> None:
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "check", check)

    def __call__(self, *args: Any) -> Any:  # REDUCE: the class called
        _charge(None, args)
        return _charge(self.check(self.cls, args))

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Refused(f"setting {name!r} on the class {self.cls.__qualname__}")


class _Sealed(type):
    """The type of a class's stand-in: attributes cannot be set on it (BUILD, handed a
    class, is setattr on it), and calling it builds an instance of the real class."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:  # REDUCE: the class called
        _charge(None, args)
        return _unguarded(_charge(type.__getattribute__(cls, "_real")(*args, **kwargs)))

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _Refused(f"setting {name!r} on the class {cls.__qualname__}")

    def __delattr__(cls, name: str) -> None:
        raise _Refused(f"deleting {name!r} of the class {cls.__qualname__}")


#: The stand-in made for each class so far (sealed: one may serve every result).
_STAND_INS: dict[type, type] = {}


def _stand_in(cls: type) -> type:
    """What a result gets for the class ``cls``, never the class itself: the pickle's BUILD
    opcode, applied to a class with no ``__setstate__``, sets its attributes, in the
    caller's process (``PosixPath._str``: every path of the agent one path the tool
    chose). NEWOBJ makes an instance of ``cls`` through it, REDUCE calls ``cls``."""
    made = _STAND_INS.get(cls)
    if made is not None:
        return made

    def __new__(stand_in: type, *args: Any, **kwargs: Any) -> Any:  # NEWOBJ
        _charge(None, args)
        return _unguarded(_charge(cls.__new__(cls, *args, **kwargs)))

    made = _Sealed(cls.__name__, (), {"__new__": __new__, "_real": cls,
                                      "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    return _STAND_INS.setdefault(cls, made)


def _imported_exception(module: str, name: str) -> Optional[type]:
    """The exception class ``module.name`` if that module is already imported; read
    from namespaces only (no getattr: a module's ``__getattr__`` may import)."""
    found: Any = sys.modules.get(module)
    if not isinstance(found, types.ModuleType):
        return None
    namespace: Any = object.__getattribute__(found, "__dict__")
    for part in name.split("."):
        found = namespace.get(part) if isinstance(namespace, Mapping) else None
        if not isinstance(found, type):
            return None
        namespace = type.__dict__["__dict__"].__get__(found)
    return found if issubclass(found, BaseException) else None


def _held(item: Any) -> list[Any]:
    """What ``item`` holds that is not an atom (none for a container of atoms only)."""
    held: Iterable[Any]
    if isinstance(item, dict):  # dict's own methods: an attribute cannot hide what it holds
        keys, values = dict.keys(item), dict.values(item)
        extra = getattr(item, "__dict__", None) if type(item) is not dict else None
        if not extra and _ATOMS.issuperset(map(type, values)) and _ATOMS.issuperset(
                map(type, keys)):
            return []  # the common case, at C speed
        held = (*keys, *values, *(extra.values() if extra else ()))
    elif isinstance(item, (list, tuple, set, frozenset, collections.deque)):
        if _ATOMS.issuperset(map(type, item)):
            return []
        held = item
    elif isinstance(item, BaseException):
        held = (item.args, getattr(item, "__dict__", {}), item.__cause__, item.__context__,
                *_member_values(item))
    elif isinstance(item, _enum.Enum):  # a member the code defined (UUID's is_safe)
        return []
    else:
        held = (*getattr(item, "__dict__", {}).values(), *_member_values(item))
    return [child for child in held if type(child) not in _ATOMS]


#: The member descriptors of each class met: slots, and the fields of exceptions
#: (StopIteration.value, AttributeError.obj, OSError.filename...), which BUILD sets.
_MEMBERS: dict[type, tuple[Any, ...]] = {}


def _members(cls: type) -> tuple[Any, ...]:
    """The member descriptors of ``cls`` and of the classes it derives from."""
    members = _MEMBERS.get(cls)
    if members is None:
        found: dict[str, Any] = {}
        for klass in cls.__mro__:
            for name, attr in vars(klass).items():
                if type(attr) is types.MemberDescriptorType and name not in found:
                    found[name] = attr
        members = _MEMBERS[cls] = tuple(found.values())
    return members


def _member_values(item: Any) -> list[Any]:
    """What ``item`` holds outside its ``__dict__``: the values of its members."""
    cls = type(item)
    values = []
    for member in _members(cls):
        try:
            values.append(member.__get__(item, cls))
        except AttributeError:  # a slot never set
            pass
    return values


def _check_unicode_error(error: UnicodeError) -> None:
    """A Unicode error's fields as its constructor would check them: the caller's str()
    of one whose ``start`` and ``end`` are out of its object crashes (CPython before 3.12.6,
    gh-123378), and the bytes may set them (BUILD) or pass them."""
    text = bytes if isinstance(error, UnicodeDecodeError) else str
    obj, start, end = (getattr(error, name, None) for name in ("object", "start", "end"))
    if not (type(obj) is text and type(start) is int and type(end) is int
            and 0 <= start <= end <= len(obj)
            and all(type(getattr(error, name, "")) is str for name in ("encoding", "reason"))):
        raise _Refused(f"a {type(error).__name__} whose fields are out of range")


def _uuid_class() -> Optional[type]:
    uuid = sys.modules.get("uuid")  # imported once a result names it (find_class)
    return None if uuid is None else uuid.UUID


def _check_uuid(made: Any) -> None:
    """A UUID's number of 128 bits (NEWOBJ makes one with none, BUILD sets any)."""
    number = getattr(made, "int", None)
    if not (type(number) is int and 0 <= number < 1 << 128):
        raise _Refused("a UUID whose number is not of 128 bits (its str(), hash and bytes "
                       "would not be a UUID's)")


def _check_syntax_error(error: SyntaxError) -> None:
    """A SyntaxError's offsets within its text (the caller's traceback draws one caret
    per column between them: ``end_offset`` 2**30 was a 1 GiB string)."""
    text = error.text
    if text is None:  # no line, no caret: the compiler's "'return' outside function"
        return
    if type(text) is not str:
        raise _Refused("a SyntaxError whose text is not text")
    bound = len(text) + 1
    for name in ("offset", "end_offset"):
        value = getattr(error, name, None)
        if value is not None and not (type(value) is int and -bound <= value <= bound):
            raise _Refused(f"a SyntaxError whose {name} is out of its text")


def _width(item: Any) -> int:
    """What ``item`` holds itself, in values (a dict: its keys and its values; an object:
    its ``__dict__`` and its members, an exception's fields among them), a text or bytes
    counting its length: what the caller's repr, json or traceback of it writes (a 200 KB
    filename of an OSError held 15**3 times in exception groups was 1.35 GB of traceback)."""
    if isinstance(item, dict):
        held: Any = (*dict.keys(item), *dict.values(item))
    elif isinstance(item, (list, tuple, set, frozenset, collections.deque)):
        held = item
    else:
        namespace = getattr(item, "__dict__", None)
        held = (*(namespace.values() if isinstance(namespace, dict) else ()),
                *_member_values(item))
    return len(held) + 1 + sum(len(value) for value in held
                               if type(value) in (str, bytes, bytearray))


def _check_depth(value: Any, limit: int) -> "set[int]":
    """The ids of what ``value`` holds, walked. Refuse containers nested deeper than
    _MAX_DEPTH, a container that holds itself
    (nested without end), and a value of more than ``limit`` values when each part it
    holds more than once is counted each time (the caller's ==, hash, repr and json walk
    it so: 100 levels, each holding the next twice, are 3.5 KB and 2**100 values). Each
    object and each reference is walked once: an object met again is judged by what was
    found below it the first time (walking it again at each depth it is reached at made
    a list holding itself 20,000 times, 40 KB, cost about 300 MiB)."""
    uuid_class = _uuid_class()
    found: dict[int, tuple[int, int]] = {}  # id -> (levels below it, values), once walked
    path: list[list[Any]] = []  # [object, what is left of it, height, values]
    on_path: set[int] = set()

    def enter(item: Any) -> None:
        if type(item) is _Sealed:  # a class as a value: the caller would get a stand-in
            raise _Refused(f"the class {item.__qualname__} (a class is not data)")
        if type(item) is _Constructor:
            raise _Refused(f"the class {item.cls.__qualname__} (a class is not data)")
        if isinstance(item, (UnicodeDecodeError, UnicodeEncodeError, UnicodeTranslateError)):
            _check_unicode_error(item)
        if isinstance(item, SyntaxError):
            _check_syntax_error(item)
        if type(item) is uuid_class:
            _check_uuid(item)
        if len(path) > _MAX_DEPTH:
            raise _Refused(f"containers nested more than {_MAX_DEPTH} deep")
        on_path.add(id(item))
        path.append([item, iter(_held(item)), 0, 0])
        add(0, 1 + _width(item))

    def add(height: int, values: int) -> None:
        top = path[-1]
        top[2], top[3] = max(top[2], height), top[3] + values
        if len(path) + top[2] > _MAX_DEPTH + 1:
            raise _Refused(f"containers nested more than {_MAX_DEPTH} deep")
        if top[3] > limit:
            raise _Refused(f"what it holds, a part held twice counted twice, is more than "
                           f"{_MAX_GROWTH} times its length in values (the caller's ==, "
                           "hash, repr or json of it would not end)")

    if type(value) in _ATOMS:
        return set()
    enter(value)
    while path:
        item, rest, height, values = path[-1]
        child = next(rest, _END)
        if child is _END:
            path.pop()
            on_path.discard(id(item))
            found[id(item)] = (height, values)
            if path:
                add(height + 1, values)
        elif id(child) in on_path:
            raise _Refused("a container that holds itself (nested without end)")
        elif id(child) in found:
            below, inside = found[id(child)]
            add(below + 1, inside)
        else:
            enter(child)
    return set(found)


#: The end of what an object holds (no value a result can hold).
_END = object()


class _Restricted:
    """Rebuilds only plain data, exception classes already imported, and trusted types.

    Unpickling runs whatever callable the bytes name, so a compromised tool could
    otherwise run code in the caller (https://docs.python.org/3/library/pickle.html,
    "Restricting Globals"). A name is decided on before anything is imported or looked
    up: only the modules of ``_SAFE_GLOBALS`` are ever imported here.
    """

    trusted: Mapping[tuple[str, str], type]
    #: The classes whose instances BUILD may set the state of (see _Checked.load_build).
    built: set[type]

    def find_class(self, module: str, name: str) -> Any:
        """A stand-in or a checked constructor for the class the bytes name; never the
        class: the bytes may apply BUILD to whatever this returns."""
        if (module, name) in self.trusted:
            return _stand_in(self.trusted[module, name])
        if name in _SAFE_GLOBALS.get(module, ()):
            import importlib

            cls = getattr(importlib.import_module(module), name)
            if (module, name) in _BUILT:
                self.built.add(cls)
            check = _CHECKS.get((module, name))
            return _stand_in(cls) if check is None else _Constructor(cls, check)
        found = _imported_exception(module, name)
        if found is not None:
            return _stand_in(found)
        raise _Untrusted(f"{module}.{name}")


class _Memo(dict):  # type: ignore[type-arg]
    """The unpickler's memo, each new entry counted against the load's memory (ten million
    one-byte MEMOIZE opcodes took 652 MiB for 9.5 MiB)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self and getattr(_LOAD, "budget", None) is not None:
            _LOAD.budget -= _MEMO_ENTRY + sys.getsizeof(key)
            if _LOAD.budget < 0:
                raise _Refused(f"what it builds takes more than {_MAX_GROWTH} times its "
                               "length in memory")
        dict.__setitem__(self, key, value)


#: What a memo entry takes besides its index: the dict's slot and index, about.
_MEMO_ENTRY = 72


#: The pure-Python unpickler (its opcodes are methods, in ``dispatch``).
_Python: Any = pickle._Unpickler


class _Checked(_Restricted, _Python):  # type: ignore[misc]
    """The pure-Python unpickler, each container checked as it is built: keys of one
    hash, and the memory its containers take (see the module's docstring)."""

    def __init__(self, data: bytes, trusted: Mapping[tuple[str, str], type]) -> None:
        super().__init__(io.BytesIO(data))
        self.trusted = trusted
        self.built = set(trusted.values())
        self.memo = _Memo()

    def _made(self, container: Any) -> Any:
        return _charge(container)

    def _keys(self, container: Any, keys: Iterable[Any]) -> None:
        _spread(keys, _LOAD.hashes.setdefault(id(container), {}))

    def load_empty_dictionary(self) -> None:
        self.append(self._made({}))

    def load_empty_list(self) -> None:
        self.append(self._made([]))

    def load_empty_set(self) -> None:
        self.append(self._made(set()))

    def load_list(self) -> None:
        items = self.pop_mark()  # first: it puts back the stack that self.append is of
        self.append(self._made(items))

    def load_dict(self) -> None:
        items = self.pop_mark()
        made = self._made({})
        self._keys(made, items[0::2])
        made.update(zip(items[0::2], items[1::2]))
        self.append(made)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        _spread(items, {})
        self.append(self._made(frozenset(items)))

    @staticmethod
    def _dict(target: Any) -> Any:
        """SETITEM and SETITEMS go into a dict only: ``ba[0:0] = ba``, five bytes, doubled a
        bytearray (a 1 KB result made 256 MiB), and a list the same way."""
        if not isinstance(target, dict):
            raise _Refused(f"setting an item of a {type(target).__name__}")
        return target

    def load_setitem(self) -> None:
        stack = self.stack
        value = stack.pop()
        key = stack.pop()
        self._keys(self._dict(stack[-1]), (key,))
        stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._dict(self.stack[-1])
        self._keys(target, items[0::2])
        for index in range(0, len(items), 2):
            target[items[index]] = items[index + 1]

    def load_build(self) -> None:
        """BUILD (set the state of the object below): exceptions, UUID and trusted types
        only, whose state is what they are made of. Any other object the checked
        constructors made is whole already: a path whose ``_str`` the bytes set opened
        another file than its parts said, a Fraction's ``_numerator`` skipped its check,
        a Counter's ``keys`` hid what it holds."""
        made, state = self.stack[-2], self.stack[-1]
        if not (isinstance(made, BaseException) or type(made) in self.built):
            raise _Refused(f"setting the state of a {type(made).__name__}")
        if id(made) in getattr(_LOAD, "hashed", ()):  # a set or dict holds it by its hash
            raise _Refused(f"setting the state of a {type(made).__name__} used as a key")
        if isinstance(made, BaseException) and isinstance(state, dict) and not _LINKS.isdisjoint(
                dict.keys(state)):
            raise _Refused("setting the cause, context or traceback of an exception (an "
                           "exception pickles none)")
        super().load_build()

    def load_buffer(self) -> None:
        """READONLY_BUFFER and NEXT_BUFFER (protocol 5): a memoryview is no plain data."""
        raise _Refused("a buffer (memoryview) is not plain data")

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._keys(target, items)
        if isinstance(target, set):
            target.update(items)
        else:
            for item in items:
                target.add(item)

    dispatch: dict[int, Any] = dict(_Python.dispatch)
    dispatch.update({pickle.EMPTY_DICT[0]: load_empty_dictionary,
                     pickle.EMPTY_LIST[0]: load_empty_list, pickle.EMPTY_SET[0]: load_empty_set,
                     pickle.LIST[0]: load_list, pickle.DICT[0]: load_dict,
                     pickle.FROZENSET[0]: load_frozenset, pickle.SETITEM[0]: load_setitem,
                     pickle.SETITEMS[0]: load_setitems, pickle.ADDITEMS[0]: load_additems,
                     pickle.BUILD[0]: load_build, pickle.READONLY_BUFFER[0]: load_buffer,
                     pickle.NEXT_BUFFER[0]: load_buffer})


def _load(data: bytes, trusted: Mapping[tuple[str, str], type]) -> Any:
    """The value ``data`` (a pickle the tool wrote) holds, rebuilt under the checks above."""
    loader = _Checked
    outer = (getattr(_LOAD, "budget", None), getattr(_LOAD, "hashes", None),
             getattr(_LOAD, "unguarded", None), getattr(_LOAD, "frozen", None),
             getattr(_LOAD, "hashed", None))
    # what its objects may take; the keys' hashes of each set and dict, by its id; the
    # objects made that are freed without a guard (see below)
    limit = _MAX_GROWTH * len(data) + (1 << 20)
    unguarded: list[Any] = []
    _LOAD.budget, _LOAD.hashes, _LOAD.unguarded, _LOAD.frozen, _LOAD.hashed = (
        limit, {}, unguarded, {}, {})
    try:
        try:
            value = loader(data, trusted).load()
        finally:
            _LOAD.budget, _LOAD.hashes, _LOAD.unguarded, _LOAD.frozen, _LOAD.hashed = outer
        walked = _check_depth(value, limit)
    except BaseException:
        # 250,000 nested deques, or a million OSErrors each the __context__ of the next,
        # crashed the caller as it dropped a refused result. Each let go of what it holds
        # first is freed on its own.
        for made in unguarded:
            _defuse(made)
        raise
    for made in unguarded:  # those the value does not hold (the memo's) are freed with it
        if id(made) not in walked:
            _defuse(made)
    return value


def _trusted_types(types_: Any) -> dict[tuple[str, str], type]:
    """``Sandbox(trusted_types=...)`` as :class:`_Unpickler` looks classes up: by the
    (module, qualified name) a pickle names them with. TypeError for anything but classes."""
    try:
        items = list(types_)
    except TypeError:
        raise TypeError(f"trusted_types must be an iterable of classes, not "
                        f"{type(types_).__name__}") from None
    for item in items:
        if not isinstance(item, type):
            raise TypeError(f"trusted_types must hold classes, not {item!r:.80}")
    return {(t.__module__, t.__qualname__): t for t in items}


def _rebuild(name: str, data: bytes, trusted: Mapping[tuple[str, str], type], code: int) -> Any:
    """The value a confined function returned, from the ``data`` it sent; or raise what it
    raised (re-raised with a :class:`RemoteTraceback` cause when it is a plain exception,
    a CallError otherwise). ``name`` names the function in errors, ``code`` is the exit
    code of its process.

    ``data`` is an envelope of str and bytes only (built in the confined process by
    :mod:`sandlock.exec.forkserver`): ``("ok", pickle)``, ``("unpicklable", type name,
    message)`` or ``("raise", type name, message, traceback text, pickle or None)``.
    """
    try:  # an envelope of str and bytes only; a hijacked tool may send anything
        envelope = _load(data, {})
        kind = envelope[0]
        if kind == "raise":
            _, what, message, text, blob = envelope
    except Exception as exc:  # noqa: BLE001
        raise CallError(f"{name}: the confined process sent a malformed result ({exc})",
                        exit_code=code) from None
    if kind == "unpicklable":
        raise CallError(f"{name} returned a {envelope[1]}, which cannot be pickled back "
                        f"to the caller: {envelope[2]}")
    if kind == "ok":
        try:
            return _load(envelope[1], trusted)
        except _Untrusted as exc:
            raise CallError(f"{name} returned an object of type {exc}, which is not plain "
                            "data: pass it in trusted_types= to rebuild it (results of "
                            "confined code are untrusted input)") from None
        except Exception as exc:  # noqa: BLE001
            raise CallError(f"{name}: its result could not be rebuilt: {exc}") from None
    if kind != "raise":
        raise CallError(f"{name}: the confined process sent a malformed result")
    _reraise(name, what, message, text, blob, trusted)


def _reraise(name: str, what: Any, message: Any, text: Any, blob: Any,
             trusted: Mapping[tuple[str, str], type]) -> NoReturn:
    """Raise the exception a confined function raised, from its ``raise`` envelope."""
    exc_obj: Any = None
    if blob is not None:
        try:
            exc_obj = _load(blob, trusted)
        except Exception:  # noqa: BLE001 - fall back to the text
            exc_obj = None
    if isinstance(exc_obj, Exception) and _raised_again(exc_obj):
        raise exc_obj from RemoteTraceback(text)
    # SystemExit, KeyboardInterrupt, GeneratorExit...: would pass the caller's
    # ``except Exception`` and end it; the tool's exit is the tool's. A sandlock
    # error is the caller's word about the sandbox (SetupError: "could not start"),
    # never the tool's; StopIteration ends the loop of a caller whose iterator calls
    # (a map() over call() stopped early, and said nothing): what the function says it
    # raised is a CallError.
    raise CallError(f"{name} raised {what}: {message}", remote_traceback=text)


#: Exception groups (Python 3.11: a group's exceptions are judged one by one).
_GROUPS: Any = getattr(__import__("builtins"), "BaseExceptionGroup", ())
#: Exceptions of libraries the caller's own code gives a meaning: concurrent.futures'
#: CancelledError (asyncio takes it for the cancellation of the task that awaited the call),
#: unittest's SkipTest (the caller's failing test reported skipped, and CI passed).
_OUTCOMES = frozenset({"CancelledError", "SkipTest"})
#: Exceptions raised again as a CallError: their meaning is the caller's, not the tool's.
_NOT_RAISED = (SandlockError, StopIteration, StopAsyncIteration)


def _raised_again(error: BaseException) -> bool:
    """Whether ``error`` is the tool's to raise in the caller: an ``Exception`` of none of
    :data:`_NOT_RAISED` and of no sandlock module, and so is each one an exception group
    holds (``except* SandlockError`` caught a SetupError the tool made). A result is at
    most _MAX_DEPTH deep: so is the walk."""
    if not isinstance(error, Exception) or isinstance(error, _NOT_RAISED) or (
            type(error).__module__.partition(".")[0] == "sandlock") or (
            type(error).__qualname__ in _OUTCOMES):
        return False
    inside = error.exceptions if isinstance(error, _GROUPS) else ()
    return all(_raised_again(each) for each in inside)
