"""The spec's dtype table and the conversions between torch, numpy and the on-disk names.

Names are the Zarr v3 ``data_type`` strings (TensorStore writes exactly these). Every dtype is
stored as its little-endian bytes; see spec/format.md "Data types" ([SP-DTYPE-1]).
Conversions are views, never value casts, so NaN payloads and -0.0 survive bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from .errors import UnsupportedValueError


@dataclass(frozen=True)
class DType:
    name: str            # spec / zarr v3 name
    itemsize: int
    torch: torch.dtype
    numpy: np.dtype
    view_as: torch.dtype  # same-size torch dtype numpy understands, used to cross the boundary


def _d(name, size, t, n, v=None):
    return DType(name, size, t, np.dtype(n), v if v is not None else t)


DTYPES: dict[str, DType] = {d.name: d for d in [
    _d("bool", 1, torch.bool, np.bool_),
    _d("int8", 1, torch.int8, np.int8),
    _d("int16", 2, torch.int16, np.int16),
    _d("int32", 4, torch.int32, np.int32),
    _d("int64", 8, torch.int64, np.int64),
    _d("uint8", 1, torch.uint8, np.uint8),
    _d("uint16", 2, torch.uint16, np.uint16),
    _d("uint32", 4, torch.uint32, np.uint32),
    _d("uint64", 8, torch.uint64, np.uint64),
    _d("float16", 2, torch.float16, np.float16),
    _d("bfloat16", 2, torch.bfloat16, ml_dtypes.bfloat16, torch.int16),
    _d("float32", 4, torch.float32, np.float32),
    _d("float64", 8, torch.float64, np.float64),
    _d("complex64", 8, torch.complex64, np.complex64),
    _d("complex128", 16, torch.complex128, np.complex128),
    _d("float8_e4m3fn", 1, torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, torch.uint8),
    _d("float8_e5m2", 1, torch.float8_e5m2, ml_dtypes.float8_e5m2, torch.uint8),
]}
_VIEW_NUMPY = {torch.int16: np.int16, torch.uint8: np.uint8}
_BY_TORCH = {d.torch: d for d in DTYPES.values()}
_BY_NUMPY = {d.numpy: d for d in DTYPES.values()}


def from_name(name: str) -> DType:
    """Look up a spec dtype name; raises ``KeyError`` for names outside the table."""
    return DTYPES[name]


def from_torch(dt: torch.dtype, what: str = "tensor") -> DType:
    try:
        return _BY_TORCH[dt]
    except KeyError:
        raise UnsupportedValueError(
            f"{what} has dtype {dt}, which the format does not define; supported: "
            f"{', '.join(DTYPES)}", spec_id="SP-DTYPE-1") from None


def from_numpy(dt: np.dtype, what: str = "array") -> DType:
    try:
        return _BY_NUMPY[np.dtype(dt).newbyteorder("=") if np.dtype(dt).byteorder == ">" else np.dtype(dt)]
    except (KeyError, TypeError):
        raise UnsupportedValueError(
            f"{what} has dtype {dt}, which the format does not define; supported: "
            f"{', '.join(DTYPES)}", spec_id="SP-DTYPE-1") from None


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor with the matching (ml_dtypes) dtype, sharing memory."""
    d = from_torch(t.dtype)
    if d.view_as is d.torch:
        return t.numpy()
    return t.view(d.view_as).numpy().view(d.numpy)


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array (any table dtype), sharing memory."""
    d = from_numpy(a.dtype)
    if d.view_as is d.torch:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(_VIEW_NUMPY[d.view_as])).view(d.torch)
