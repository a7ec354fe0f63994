"""Encoding of non-tensor values (object leaves and sharded-object values) as msgpack.

Allowed: None, bool, int (-2**63 .. 2**64-1), float, str, bytes, lists, dicts with str or int
keys, and two extension types defined by the spec ([SP-VALUE-2]):
ext 1 = small array ``[dtype name, shape, little-endian bytes, origin]`` (origin "torch" or
"numpy" tells a reader which kind of array to hand back); ext 2 = tuple (msgpack array body).
Anything else is refused with a message that names the key and how to convert it. No pickle.
"""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

from . import dtypes
from .errors import CorruptCheckpointError, UnsupportedValueError

EXT_ARRAY = 1
EXT_TUPLE = 2
SCALARS = (type(None), bool, int, float, str, bytes)

# Caps applied when unpacking untrusted bytes ([SP-SEC-2]).
UNPACK_LIMITS = dict(max_bin_len=1 << 31, max_str_len=1 << 28, max_array_len=1 << 28,
                     max_map_len=1 << 28, max_ext_len=1 << 31)


def _hint(what: str, v: Any) -> str:
    t = type(v).__name__
    return (f"{what} holds a {t}, which the format cannot store without pickle; convert it "
            f"to plain data first (e.g. vars(ns) for an argparse.Namespace, .state_dict() for "
            f"a module, a tensor for array-like data)")


def check_value(v: Any, what: str) -> None:
    """Raise :class:`UnsupportedValueError` unless ``v`` can be encoded by :func:`pack`."""
    # Exact types: subclasses (IntEnum, StrEnum, numpy's str_/float64, ...) are not what
    # msgpack stores; numpy scalars take the array route below, other subclasses are refused.
    if type(v) in (bool, type(None), float, str, bytes):
        return
    if type(v) is int:
        if not -(1 << 63) <= v < (1 << 64):
            raise UnsupportedValueError(f"{what} is the integer {v}, outside the 64-bit range "
                                        "msgpack can store; store it as a str", spec_id="SP-VALUE-1")
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
                raise UnsupportedValueError(f"{what} has dict key {k!r}; only str keys and "
                                            "64-bit int keys are supported", spec_id="SP-VALUE-1")
            check_value(x, f"{what}[{k!r}]")
        return
    if isinstance(v, torch.Tensor):
        dtypes.from_torch(v.dtype, what)
        return
    raise UnsupportedValueError(_hint(what, v), spec_id="SP-VALUE-1")


def _default(v: Any) -> Any:
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    if isinstance(v, np.generic):
        return msgpack.ExtType(EXT_ARRAY, msgpack.packb(
            [dtypes.from_numpy(v.dtype).name, [], np.asarray(v).astype(v.dtype.newbyteorder("<")).tobytes(),
             "numpy-scalar"]))
    if isinstance(v, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack(list(v)))
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().resolve_conj().resolve_neg().contiguous()
        d = dtypes.from_torch(t.dtype)
        a = dtypes.torch_to_numpy(t)
        return msgpack.ExtType(EXT_ARRAY, msgpack.packb(
            [d.name, list(t.shape), a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(), "torch"]))
    if isinstance(v, np.ndarray):
        d = dtypes.from_numpy(v.dtype)
        a = np.ascontiguousarray(v).astype(d.numpy.newbyteorder("<"), copy=False)
        return msgpack.ExtType(EXT_ARRAY, msgpack.packb([d.name, list(v.shape), a.tobytes(), "numpy"]))
    raise UnsupportedValueError(_hint("value", v), spec_id="SP-VALUE-1")


def pack(v: Any) -> bytes:
    """msgpack bytes of ``v`` (call :func:`check_value` first for a keyed error message)."""
    return msgpack.packb(v, default=_default, strict_types=True, use_bin_type=True)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TUPLE:
        return tuple(unpack(data))
    if code == EXT_ARRAY:
        try:
            name, shape, raw, origin = msgpack.unpackb(data, raw=False, **UNPACK_LIMITS)
            d = dtypes.from_name(name)
            a = np.frombuffer(raw, dtype=d.numpy.newbyteorder("<")).astype(d.numpy).reshape(shape)
        except Exception as e:
            raise CorruptCheckpointError(f"malformed array value: {e}", spec_id="SP-VALUE-2") from e
        if origin == "torch":
            return dtypes.numpy_to_torch(a.copy())
        return a[()] if origin == "numpy-scalar" else a
    raise CorruptCheckpointError(f"unknown msgpack extension type {code}", spec_id="SP-VALUE-2")


def unpack(data: bytes) -> Any:
    """Decode bytes written by :func:`pack`, with size caps; never executes code."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_hook,
                           **UNPACK_LIMITS)
