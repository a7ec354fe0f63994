"""The spec's dtype table (:mod:`shardpoint_core.format.dtypes`) with torch's dtypes, and the
conversions between torch, numpy and the on-disk names.

Names are the Zarr v3 ``data_type`` strings (TensorStore writes exactly these). Every dtype is
stored as its little-endian bytes; see spec/format.md "Data types" ([SP-DTYPE-1]).
Conversions are views, never value casts, so NaN payloads and -0.0 survive bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch

from shardpoint_core.format import dtypes as core


TorchDType = torch.dtype  # the field below is named ``torch``


@dataclass(frozen=True)
class DType(core.DType):
    """A table entry with its torch dtype (``view_as``: the same-size torch dtype numpy
    understands, used to cross the boundary)."""

    torch: TorchDType
    view_as: TorchDType


_TORCH = {
    "bool": torch.bool,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_VIEW_AS = {"bfloat16": torch.int16, "float8_e4m3fn": torch.uint8, "float8_e5m2": torch.uint8}
DTYPES: dict[str, DType] = {
    n: DType(d.name, d.itemsize, d.numpy, _TORCH[n], _VIEW_AS.get(n, _TORCH[n]))
    for n, d in core.DTYPES.items()
}
_VIEW_NUMPY: dict[TorchDType, type] = {torch.int16: np.int16, torch.uint8: np.uint8}
_BY_TORCH = {d.torch: d for d in DTYPES.values()}


def from_name(name: str) -> DType:
    """Look up a spec dtype name; raises ``KeyError`` for names outside the table."""
    return DTYPES[name]


def from_torch(dt: torch.dtype, what: str = "tensor") -> DType:
    try:
        return _BY_TORCH[dt]
    except KeyError:
        raise core.unsupported(dt, what) from None


def from_numpy(dt: np.dtype, what: str = "array") -> DType:
    return DTYPES[core.from_numpy(dt, what).name]


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
