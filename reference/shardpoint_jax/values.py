"""Values and sharded-object entries as msgpack (spec/format.md section 6): ext type 1 is an
array ``[dtype, shape, data, origin]``, ext type 2 a tuple. No pickle, ever [SP-VALUE-1]."""
from __future__ import annotations

import math
import threading
from typing import Any

import msgpack
import numpy as np

from shardpoint_jax.dtypes import BY_NAME, name_of
from shardpoint_jax.errors import CorruptCheckpointError, UnsupportedValueError

EXT_ARRAY, EXT_TUPLE = 1, 2
ORIGINS = ("torch", "numpy", "numpy-scalar")
LIMITS = dict(max_str_len=2 ** 28, max_array_len=2 ** 28, max_map_len=2 ** 28,
              max_bin_len=2 ** 31, max_ext_len=2 ** 31)   # [SP-SEC-2]
UINT64_MAX, INT64_MIN = 2 ** 64 - 1, -(2 ** 63)
SCALARS = (type(None), bool, int, float, str, bytes)


def is_scalar_value(v: Any) -> bool:
    """True for what a ``{"value": v}`` leaf may hold: msgpack scalars and numpy scalars."""
    return type(v) in SCALARS or isinstance(v, np.generic)


def check_value(v: Any, where: str, *, nested: bool) -> None:
    """Refuse anything msgpack cannot carry as data, naming the path [SP-VALUE-1]."""
    t = type(v)
    if t is int and not INT64_MIN <= v <= UINT64_MAX:
        raise UnsupportedValueError(f"{where}: integer {v} is outside -2^63 .. 2^64-1; "
                                    "store it as a str", spec_id="SP-VALUE-1")
    if t in SCALARS or isinstance(v, np.generic):
        if isinstance(v, np.generic):
            name_of(v.dtype, where)
        if t is str:
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise UnsupportedValueError(f"{where}: string is not valid UTF-8",
                                            spec_id="SP-VALUE-1") from None
        return
    if nested and t in (list, tuple):
        for i, x in enumerate(v):
            check_value(x, f"{where}[{i}]", nested=True)
        return
    if nested and t is dict:
        for k, x in v.items():
            if type(k) not in (str, int):
                raise UnsupportedValueError(f"{where}: map key {k!r} must be str or int",
                                            spec_id="SP-VALUE-1")
            check_value(x, f"{where}[{k!r}]", nested=True)
        return
    if nested and isinstance(v, np.ndarray):
        name_of(v.dtype, where)
        return
    if nested and hasattr(v, "__array__") and hasattr(v, "dtype") and hasattr(v, "shape"):
        return   # a jax.Array inside an object entry: stored as a numpy array
    raise UnsupportedValueError(
        f"{where}: a {t.__module__}.{t.__qualname__} cannot be stored (no pickle); convert "
        "it to arrays, numbers, str, bytes, lists, tuples or dicts", spec_id="SP-VALUE-1")


def _default(v: Any) -> Any:
    if isinstance(v, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack(list(v)))
    if isinstance(v, np.generic):
        return msgpack.ExtType(EXT_ARRAY, _array_payload(np.asarray(v), "numpy-scalar"))
    if isinstance(v, np.ndarray) or hasattr(v, "__array__"):
        return msgpack.ExtType(EXT_ARRAY, _array_payload(np.asarray(v), "numpy"))
    raise UnsupportedValueError(f"cannot pack a {type(v).__name__}", spec_id="SP-VALUE-1")


def _array_payload(a: np.ndarray, origin: str) -> bytes:
    name = name_of(a.dtype, "array value")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    data = np.ascontiguousarray(a).tobytes()   # little-endian host: numpy's order is the format's
    return msgpack.packb([name, list(a.shape), data, origin], use_bin_type=True)


def pack(v: Any) -> bytes:
    """msgpack bytes of a value (floats as float 64, tuples as ext 2, arrays as ext 1)."""
    return msgpack.packb(v, use_bin_type=True, strict_types=True, default=_default)


def ext_hook(code: int, payload: bytes) -> Any:
    """Decode ext 1/2; anything else, or a malformed array, is corrupt [SP-VALUE-2]."""
    if code == EXT_TUPLE:
        # Decoded later, from a loop (_resolve): decoding it here re-entered the C decoder
        # once per level, and 300 nested tuples overflowed the stack (SIGSEGV) [SP-MAN-5].
        _SEEN.n = getattr(_SEEN, "n", 0) + 1
        return _Tuple(payload)
    if code != EXT_ARRAY:
        raise CorruptCheckpointError(f"unknown msgpack extension type {code}; the format "
                                     "defines 1 (array) and 2 (tuple)", spec_id="SP-VALUE-2")
    try:
        dtype, shape, data, origin = _decode(payload)
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError):
        raise CorruptCheckpointError("array extension payload is not a 4-element array",
                                     spec_id="SP-VALUE-2") from None
    if (dtype not in BY_NAME or not isinstance(shape, list) or origin not in ORIGINS
            or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 64
            or not isinstance(data, bytes) or (origin == "numpy-scalar" and shape != [])):
        raise CorruptCheckpointError(f"malformed array extension (dtype {dtype!r}, shape "
                                     f"{shape!r}, origin {origin!r})", spec_id="SP-VALUE-2")
    dt = BY_NAME[dtype]
    if len(data) != math.prod(shape) * dt.itemsize:
        raise CorruptCheckpointError(f"array extension holds {len(data)} bytes; shape {shape} "
                                     f"of {dtype} needs {math.prod(shape) * dt.itemsize}",
                                     spec_id="SP-VALUE-2")
    a = np.frombuffer(data, dt).copy().reshape(shape)
    if dtype == "bool" and a.view(np.uint8).max(initial=0) > 1:
        raise CorruptCheckpointError("bool array value holds a byte other than 0x00/0x01",
                                     spec_id="SP-VALUE-2")
    if origin == "numpy-scalar" and shape == []:
        return a[()]
    return a


def pairs_hook(pairs: list) -> dict:
    """Maps: str or int keys only, none repeated [SP-MAN-5]."""
    out: dict = {}
    for k, v in pairs:
        if type(k) not in (str, int):
            raise CorruptCheckpointError(f"map key {k!r} of type {type(k).__name__}; map keys are "
                                  "str or int", spec_id="SP-MAN-5")
        if k in out:
            raise CorruptCheckpointError(f"map key {k!r} repeated", spec_id="SP-MAN-5")
        out[k] = v
    return out


class _Tuple:
    """An ext 2 payload not decoded yet (see :func:`_resolve`)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


MAX_DEPTH = 256
_SEEN = threading.local()     # ext 2 payloads the hook saw in this thread's current decode


def _decode(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook,
                               object_pairs_hook=pairs_hook, use_list=True, **LIMITS)
    except msgpack.StackError:
        raise CorruptCheckpointError(f"msgpack nests deeper than the decoder allows (the "
                                     f"format allows {MAX_DEPTH} levels)",
                                     spec_id="SP-MAN-5") from None


def _tuple_items(t: _Tuple) -> list:
    try:
        items = _decode(t.data)
    except CorruptCheckpointError:
        raise
    except Exception:  # noqa: BLE001
        raise CorruptCheckpointError("tuple extension payload is not one msgpack array",
                                     spec_id="SP-VALUE-2") from None
    if not isinstance(items, list):
        raise CorruptCheckpointError("tuple extension payload is not an array",
                                     spec_id="SP-VALUE-2")
    return items


def _resolve(v: Any) -> Any:
    """``v`` with every :class:`_Tuple` decoded, by an explicit stack; a level past
    :data:`MAX_DEPTH` is refused as soon as it appears [SP-MAN-5]."""
    holder = [v]
    stack = [(holder, iter(range(1)), 0, None, None)]
    while stack:
        c, slots, d, parent, slot = stack[-1]
        for k in slots:
            x = c[k]
            if type(x) is _Tuple or type(x) in (list, dict):
                if d + 1 > MAX_DEPTH:
                    raise CorruptCheckpointError(f"values nest deeper than {MAX_DEPTH} levels",
                                                 spec_id="SP-MAN-5")
                if type(x) is _Tuple:
                    items = _tuple_items(x)
                    stack.append((items, iter(range(len(items))), d + 1, c, k))
                else:
                    stack.append((x, iter(list(x) if type(x) is dict else range(len(x))),
                                  d + 1, None, None))
                break
        else:
            stack.pop()
            if parent is not None:
                parent[slot] = tuple(c)
    return holder[0]


def unpack(data: bytes) -> Any:
    """Decode exactly one msgpack object with the format's caps and rules [SP-MAN-5];
    nested tuples are decoded from a loop, never by recursion in the C decoder."""
    _SEEN.n = 0
    v = _decode(data)
    return _resolve(v) if _SEEN.n else v


def depth(v: Any) -> int:
    """Nesting levels of a decoded value: maps, arrays and tuples add one, arrays of ext 1
    are leaves [SP-MAN-5]."""
    best, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            best = max(best, d)
            stack.extend((y, d + 1) for y in x.values())
        elif isinstance(x, (list, tuple)):
            best = max(best, d)
            stack.extend((y, d + 1) for y in x)
    return best
