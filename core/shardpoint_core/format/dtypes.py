"""The spec's dtype table: on-disk names, sizes and the numpy (ml_dtypes) dtype of each.

Names are the Zarr v3 ``data_type`` strings (TensorStore writes exactly these). Every dtype is
stored as its little-endian bytes; see spec/format.md "Data types" ([SP-DTYPE-1]). Front ends
add their own framework's dtypes on top (``shardpoint.tree.dtypes`` for torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from shardpoint_core.format.errors import UnsupportedValueError


@dataclass(frozen=True)
class DType:
    name: str  # spec / zarr v3 name
    itemsize: int
    numpy: np.dtype


DTYPES: dict[str, DType] = {
    d.name: d
    for d in [
        DType(n, s, np.dtype(t))
        for n, s, t in [
            ("bool", 1, np.bool_),
            ("int8", 1, np.int8),
            ("int16", 2, np.int16),
            ("int32", 4, np.int32),
            ("int64", 8, np.int64),
            ("uint8", 1, np.uint8),
            ("uint16", 2, np.uint16),
            ("uint32", 4, np.uint32),
            ("uint64", 8, np.uint64),
            ("float16", 2, np.float16),
            ("bfloat16", 2, ml_dtypes.bfloat16),
            ("float32", 4, np.float32),
            ("float64", 8, np.float64),
            ("complex64", 8, np.complex64),
            ("complex128", 16, np.complex128),
            ("float8_e4m3fn", 1, ml_dtypes.float8_e4m3fn),
            ("float8_e5m2", 1, ml_dtypes.float8_e5m2),
        ]
    ]
}
_BY_NUMPY = {d.numpy: d for d in DTYPES.values()}


def unsupported(dt: object, what: str) -> UnsupportedValueError:
    """The error for a dtype outside the table, naming what holds it."""
    return UnsupportedValueError(
        f"{what} has dtype {dt}, which the format does not define; supported: {', '.join(DTYPES)}",
        spec_id="SP-DTYPE-1",
    )


def from_name(name: str) -> DType:
    """Look up a spec dtype name; raises ``KeyError`` for names outside the table."""
    return DTYPES[name]


def from_numpy(dt: np.dtype, what: str = "array") -> DType:
    """The table entry of a numpy dtype (either byte order)."""
    try:
        return _BY_NUMPY[
            np.dtype(dt).newbyteorder("=") if np.dtype(dt).byteorder == ">" else np.dtype(dt)
        ]
    except (KeyError, TypeError):
        raise unsupported(dt, what) from None
