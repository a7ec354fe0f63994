"""Encoding of non-tensor values (object leaves and sharded-object values) as msgpack.

Allowed: None, bool, int (-2**63 .. 2**64-1), float, str, bytes, lists, dicts with str or int
keys, and two extension types defined by the spec ([SP-VALUE-2]):
ext 1 = small array ``[dtype name, shape, little-endian bytes, origin]`` (origin "torch" or
"numpy" tells a reader which kind of array to hand back); ext 2 = tuple (msgpack array body).
Anything else is refused with a message that names the key and how to convert it. No pickle.
A front end registers its framework's array type (:func:`register_array_type`): its values
are stored with its origin and handed back as its arrays; without one, arrays of any origin
come back as numpy arrays.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import msgpack
import numpy as np

from shardpoint_core.format import dtypes
from shardpoint_core.format.errors import CorruptCheckpointError, UnsupportedValueError

EXT_ARRAY = 1
ORIGINS = ("torch", "numpy", "numpy-scalar")  # the spec's ext 1 origins


class _ArrayType:
    def __init__(self, cls: type, origin: str, to_numpy: Any, from_numpy: Any, check: Any) -> None:
        self.cls, self.origin, self.to_numpy, self.from_numpy, self.check = (
            cls,
            origin,
            to_numpy,
            from_numpy,
            check,
        )


_ARRAY_TYPES: list[Any] = []
_FROM_ORIGIN: dict[str, Any] = {}
# False inside numpy_values(): a front end that wants numpy (JAX) decodes in a process where
# another front end (torch) registered a decoder for its origin.
_NATIVE: ContextVar[Any] = ContextVar("shardpoint_native_values", default=True)


def register_array_type(
    cls: type, origin: str, *, to_numpy: Any, check: Any, from_numpy: Any = None
) -> None:
    """Store values of ``cls`` as ext 1 arrays of ``origin`` (one of :data:`ORIGINS`):
    ``check(v, what)`` refuses an unsupported one, ``to_numpy(v)`` gives its C-contiguous
    host array, ``from_numpy(a)`` (optional) turns a decoded array of that origin back into
    ``cls`` (outside :func:`numpy_values`)."""
    assert origin in ORIGINS
    _ARRAY_TYPES.append(_ArrayType(cls, origin, to_numpy, from_numpy, check))
    if from_numpy is not None:
        _FROM_ORIGIN[origin] = from_numpy


@contextmanager
def numpy_values() -> Iterator[None]:
    """Decode ext 1 arrays as numpy arrays, whatever decoders front ends registered."""
    token = _NATIVE.set(False)
    try:
        yield
    finally:
        _NATIVE.reset(token)


def _array_type(v: Any) -> Any:
    for t in _ARRAY_TYPES:
        if isinstance(v, t.cls):
            return t
    return None


EXT_TUPLE = 2
SCALARS = (type(None), bool, int, float, str, bytes)

# Caps applied when unpacking untrusted bytes ([SP-SEC-2]).
UNPACK_LIMITS = dict(
    max_bin_len=1 << 31,
    max_str_len=1 << 28,
    max_array_len=1 << 28,
    max_map_len=1 << 28,
    max_ext_len=1 << 31,
)
# Deepest nesting of maps, arrays and tuples in a manifest body, the body itself being level 1
# ([SP-MAN-5]); every msgpack library can pack and unpack this, and a tree 80 dicts deep fits.
MAX_DEPTH = 256


def strict_pairs(pairs: list[Any]) -> dict[str, Any]:
    """Map hook of the decoder: keys are str or int, each at most once ([SP-MAN-5])."""
    try:
        d = dict(pairs)
    except TypeError:
        d = None
    if d is None or any(type(k) is not str and type(k) is not int for k in d):
        bad = next(k for k, _ in pairs if type(k) is not str and type(k) is not int)
        raise CorruptCheckpointError(
            f"msgpack map key {bad!r} ({type(bad).__name__}) is neither str nor int",
            spec_id="SP-MAN-5",
        )
    if len(d) != len(pairs):
        seen: set[Any] = set()
        dup = None
        for k, _ in pairs:
            if k in seen:
                dup = k
                break
            seen.add(k)
        raise CorruptCheckpointError(f"msgpack map repeats key {dup!r}", spec_id="SP-MAN-5")
    for v in d.values():
        if type(v) is msgpack.Timestamp:
            _timestamp()
    return d


def _timestamp() -> None:
    """msgpack's ext type -1 (a timestamp), which the decoder builds itself instead of calling
    the ext hook: an extension type the format does not define ([SP-VALUE-2], 1.3)."""
    raise CorruptCheckpointError(
        "unknown msgpack extension type -1 (a msgpack timestamp)", spec_id="SP-VALUE-2"
    )


def strict_list(items: list[Any]) -> list[Any]:
    """List hook of the decoder: no msgpack timestamp among the items (see :func:`_timestamp`)."""
    for v in items:
        if type(v) is msgpack.Timestamp:
            _timestamp()
    return items


def _max_depth(v: Any, stop: int) -> int:
    """Levels of maps/lists/tuples in ``v`` (``v`` itself is level 1), counting up to ``stop``."""
    if type(v) not in (dict, list, tuple):
        return 1  # a scalar (a manifest body that is not a map)
    stack = [(v, 1)]
    pop, push = stack.pop, stack.append
    deepest = 0
    while stack:
        x, depth = pop()
        if depth > deepest:
            deepest = depth
            if depth >= stop:
                break
        for c in x.values() if type(x) is dict else x:
            t = type(c)
            if t is dict or t is list or t is tuple:
                push((c, depth + 1))
    return deepest


def nesting_depth_error(v: Any, limit: int = MAX_DEPTH) -> str:
    """Path of a map/list/tuple nested deeper than ``limit`` levels in ``v``, or ''.

    One pass over containers only (scalars are never pushed); the path for the message is
    rebuilt only on failure."""
    if _max_depth(v, limit + 1) <= limit:
        return ""
    path: list[Any] = []
    x, need = v, limit + 1
    while need > 1:  # follow a branch that still goes deep enough
        kids = x.items() if isinstance(x, dict) else enumerate(x)
        k, x = next(
            (k, c)
            for k, c in kids
            if isinstance(c, (dict, list, tuple)) and _max_depth(c, need - 1) >= need - 1
        )
        path.append(k)
        need -= 1
    return "".join(f"[{c!r}]" for c in path[:12]) + ("..." if len(path) > 12 else "")


def _hint(what: str, v: Any) -> str:
    t = type(v).__name__
    head = f"{what} holds a {t}, which the format cannot store without pickle; "
    if callable(getattr(v, "state_dict", None)):  # a module, optimizer, scheduler, Stateful
        return head + (
            "save its .state_dict() and pass what load returns to "
            "load_state_dict() (objects are not called for you, as DCP's Stateful "
            "are; for a model and optimizer see shardpoint.state)"
        )
    if callable(getattr(v, "get_state", None)) and callable(getattr(v, "set_state", None)):
        return head + "save its .get_state() (a tensor) and set_state() it back after the load"
    if type(v).__module__ == "torch" and t in ("device", "dtype", "layout"):
        return head + f"store str() of it (e.g. {str(v)!r})"
    return head + (
        "convert it to plain data first (e.g. vars(ns) for an argparse.Namespace, "
        "dataclasses.asdict(x) for a dataclass, a tensor for array-like data)"
    )


def check_value(v: Any, what: str) -> None:
    """Raise :class:`UnsupportedValueError` unless ``v`` can be encoded by :func:`pack`."""
    # Exact types: subclasses (IntEnum, StrEnum, numpy's str_/float64, ...) are not what
    # msgpack stores; numpy scalars take the array route below, other subclasses are refused.
    if type(v) in (bool, type(None), float, str, bytes):
        return
    if type(v) is int:
        if not -(1 << 63) <= v < (1 << 64):
            raise UnsupportedValueError(
                f"{what} is the integer {v}, outside the 64-bit range "
                "msgpack can store; store it as a str",
                spec_id="SP-VALUE-1",
            )
        return
    if isinstance(v, (np.ndarray, np.generic)):
        dtypes.from_numpy(v.dtype, what)
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            check_value(x, f"{what}[{i}]")
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if type(k) not in (str, int) or (type(k) is int and not -(1 << 63) <= k < (1 << 64)):
                raise UnsupportedValueError(
                    f"{what} has dict key {k!r}; only str keys and 64-bit int keys are supported",
                    spec_id="SP-VALUE-1",
                )
            check_value(x, f"{what}[{k!r}]")
        return
    t = _array_type(v)
    if t is not None:
        t.check(v, what)
        return
    raise UnsupportedValueError(_hint(what, v), spec_id="SP-VALUE-1")


def _default(v: Any) -> Any:
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    if isinstance(v, np.generic):
        return msgpack.ExtType(
            EXT_ARRAY,
            msgpack.packb(
                [
                    dtypes.from_numpy(v.dtype).name,
                    [],
                    np.asarray(v).astype(v.dtype.newbyteorder("<")).tobytes(),
                    "numpy-scalar",
                ]
            ),
        )
    if isinstance(v, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack(list(v)))
    t = _array_type(v)
    if t is not None:
        a = t.to_numpy(v)
        d = dtypes.from_numpy(a.dtype)
        return msgpack.ExtType(
            EXT_ARRAY,
            msgpack.packb(
                [
                    d.name,
                    list(a.shape),
                    a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(),
                    t.origin,
                ]
            ),
        )
    if isinstance(v, np.ndarray):
        d = dtypes.from_numpy(v.dtype)
        a = np.ascontiguousarray(v).astype(d.numpy.newbyteorder("<"), copy=False)
        return msgpack.ExtType(
            EXT_ARRAY, msgpack.packb([d.name, list(v.shape), a.tobytes(), "numpy"])
        )
    raise UnsupportedValueError(_hint("value", v), spec_id="SP-VALUE-1")


def pack(v: Any) -> bytes:
    """msgpack bytes of ``v`` (call :func:`check_value` first for a keyed error message)."""
    data: bytes = msgpack.packb(v, default=_default, strict_types=True, use_bin_type=True)
    return data


class _Tuple:
    """An ext 2 (tuple) payload not decoded yet. Decoding it inside the ext hook would
    re-enter the C decoder once per level and a few hundred nested tuples overflow the C
    stack (SIGSEGV) before any depth check runs; :func:`_resolve` decodes these afterwards
    from a loop, one level at a time, and stops at :data:`MAX_DEPTH` ([SP-MAN-5])."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TUPLE:
        return _Tuple(data)
    if code == EXT_ARRAY:
        try:
            name, shape, raw, origin = msgpack.unpackb(data, raw=False, **UNPACK_LIMITS)
            d = dtypes.from_name(name)
            if not (
                isinstance(raw, bytes)
                and isinstance(shape, list)
                and all(type(n) is int and 0 <= n < 1 << 63 for n in shape)  # [SP-SEC-2]
                and len(shape) <= MAX_RANK
                and len(raw) == _prod(shape) * d.itemsize
            ):
                raise ValueError(f"shape {shape!r} does not match {len(raw)} data bytes")
            if origin not in ORIGINS or (origin == "numpy-scalar" and shape != []):
                raise ValueError(f"origin {origin!r} (numpy-scalar needs shape [])")
            a = np.frombuffer(raw, dtype=d.numpy.newbyteorder("<")).astype(d.numpy).reshape(shape)
            if name == "bool" and a.view(np.uint8).max(initial=0) > 1:
                raise ValueError("bool bytes other than 0x00 and 0x01")
        except Exception as e:
            raise CorruptCheckpointError(f"malformed array value: {e}", spec_id="SP-VALUE-2") from e
        if origin in _FROM_ORIGIN and _NATIVE.get():
            return _FROM_ORIGIN[origin](a)
        return a[()] if origin == "numpy-scalar" else a
    raise CorruptCheckpointError(f"unknown msgpack extension type {code}", spec_id="SP-VALUE-2")


def _prod(shape: list[Any]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


MAX_RANK = 64  # dimensions of a tensor or array value ([SP-SEC-2])


def _decode_one(data: bytes, hooked: bool, seen: Optional[list[Any]] = None) -> Any:
    """One msgpack object, its tuples left as :class:`_Tuple`; msgpack's own errors (its
    nesting limit raises a StackError with no text) become [SP-MAN-5]/[SP-MAN-1] errors."""

    def hook(code: int, payload: bytes) -> Any:
        v = _ext_hook(code, payload)
        if seen is not None and type(v) is _Tuple:
            seen.append(1)
        return v

    kw = dict(raw=False, strict_map_key=False, ext_hook=hook, **UNPACK_LIMITS)
    if hooked:
        kw["object_pairs_hook"] = strict_pairs
        kw["list_hook"] = strict_list
    try:
        return msgpack.unpackb(data, **kw)
    except (msgpack.StackError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"msgpack nests deeper than the decoder's limit (the format allows {MAX_DEPTH} levels)",
            spec_id="SP-MAN-5",
        ) from e


def _resolve(v: Any, hooked: bool) -> Any:
    """``v`` with every :class:`_Tuple` decoded into a tuple, without recursion: an explicit
    stack of (container, slots left, depth); a tuple's items are resolved before the tuple
    is built. Raises [SP-MAN-5] as soon as a level deeper than :data:`MAX_DEPTH` appears."""
    holder = [v]
    # (container, its slots left, depth, the container holding it and its slot there)
    stack: list[tuple[Any, Iterator[int], int, Any, Any]] = [
        (holder, iter(range(1)), 0, None, None)
    ]
    while stack:
        c, slots, depth, parent, slot = stack[-1]
        for k in slots:
            x = c[k]
            t = type(x)
            if t is _Tuple:
                if depth + 1 > MAX_DEPTH:
                    raise CorruptCheckpointError(
                        f"values nest deeper than {MAX_DEPTH} levels (tuples inside tuples)",
                        spec_id="SP-MAN-5",
                    )
                try:
                    items = _decode_one(x.data, hooked)
                except CorruptCheckpointError:
                    raise
                except Exception as e:  # trailing bytes, truncation: the payload's fault
                    raise CorruptCheckpointError(
                        f"ext 2 (tuple) payload is not exactly one msgpack array "
                        f"({type(e).__name__}: {e})",
                        spec_id="SP-VALUE-2",
                    ) from e
                if not isinstance(items, list):
                    raise CorruptCheckpointError(
                        "ext 2 (tuple) payload is not a msgpack array", spec_id="SP-VALUE-2"
                    )
                stack.append((items, iter(range(len(items))), depth + 1, c, k))
                break
            if t is list or t is dict:
                if depth + 1 > MAX_DEPTH:
                    raise CorruptCheckpointError(
                        f"values nest deeper than {MAX_DEPTH} levels", spec_id="SP-MAN-5"
                    )
                stack.append(
                    (x, iter(list(x) if t is dict else range(len(x))), depth + 1, None, None)
                )
                break
        else:
            stack.pop()
            if parent is not None:
                parent[slot] = tuple(c)
    return holder[0]


def _unpack(data: bytes, hooked: bool) -> Any:
    seen: list[Any] = []
    v = _decode_one(data, hooked, seen)
    if seen:
        v = _resolve(v, hooked)
    return v


def unpack(data: bytes) -> Any:
    """Decode bytes written by :func:`pack`, with size caps, the decoding rules of
    [SP-MAN-5] (str/int map keys, no repeated keys) and nothing after the one object;
    never executes code, never recurses once per nested tuple. Nesting depth of maps and
    lists is checked by the caller (:func:`nesting_depth_error`)."""
    return _unpack(data, True)


def unpack_gathered(data: bytes) -> Any:
    """Decode bytes that :func:`pack` wrote in another rank of this job (a local plan's
    tree): the same extension types and size caps, without the per-map hook of
    :func:`unpack`. The sender packed a tree it had checked ([SP-MAN-5] holds by
    construction), and the coordinator decodes ~10^5 small maps per save (3x faster)."""
    return _unpack(data, False)
