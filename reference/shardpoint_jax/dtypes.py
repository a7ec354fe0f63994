"""The dtype table (spec/format.md section 5) as numpy dtypes, through ml_dtypes."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from shardpoint_jax.errors import UnsupportedFormatError, UnsupportedValueError

BY_NAME = {
    "bool": np.dtype(np.bool_), "int8": np.dtype(np.int8), "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32), "int64": np.dtype(np.int64), "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64), "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64), "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
FILL = {n: (False if n == "bool" else [0.0, 0.0] if n.startswith("complex")
            else 0 if n.startswith(("int", "uint")) else 0.0) for n in BY_NAME}


def numpy_dtype(dtype, where: str) -> np.dtype:
    """``dtype`` as a numpy dtype; JAX's extended dtypes (typed PRNG keys such as flax nnx's
    ``RngKey``, ``key<fry>``) have none and are refused with the way to save them."""
    try:
        return np.dtype(dtype)
    except TypeError:
        raise UnsupportedValueError(
            f"{where}: dtype {dtype} is not in the format's dtype table ({', '.join(BY_NAME)});"
            " a typed PRNG key array is stored as its raw bits: save jax.random.key_data(k) and"
            " rebuild it with jax.random.wrap_key_data, or leave the RNG state out (flax nnx:"
            " nnx.state(model, nnx.Param))", spec_id="SP-DTYPE-1") from None


def name_of(dtype, where: str) -> str:
    """The spec name of a numpy/jax dtype; writers refuse the others [SP-DTYPE-1]."""
    dt = numpy_dtype(dtype, where)
    for n, d in BY_NAME.items():
        if d == dt:
            return n
    raise UnsupportedValueError(f"{where}: dtype {dt} is not in the format's dtype table "
                                f"({', '.join(BY_NAME)}); cast it first", spec_id="SP-DTYPE-1")


def numpy_of(name, where: str) -> np.dtype:
    """The numpy dtype of a stored dtype name; readers reject others as *unsupported*
    [SP-DTYPE-1] [SP-ERR-1]."""
    if not isinstance(name, str) or name not in BY_NAME:
        raise UnsupportedFormatError(f"{where}: dtype {name!r} is not in the format's dtype "
                                     "table", spec_id="SP-DTYPE-1")
    return BY_NAME[name]
