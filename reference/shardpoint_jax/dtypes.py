"""The core's dtype table (:mod:`shardpoint_core.format.dtypes`) as JAX sees it: JAX's extended
dtypes (typed PRNG keys) are refused with the way to save them, and spec names map to the
numpy (ml_dtypes) dtypes that JAX arrays carry."""

from __future__ import annotations

import numpy as np

from shardpoint_core.format import dtypes as core_dtypes
from shardpoint_core.format.errors import UnsupportedFormatError, UnsupportedValueError
from shardpoint_core.format.layout import fill_value

BY_NAME = {name: d.numpy for name, d in core_dtypes.DTYPES.items()}
FILL = {name: fill_value(name) for name in BY_NAME}


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
            " nnx.state(model, nnx.Param))",
            spec_id="SP-DTYPE-1",
        ) from None


def name_of(dtype, where: str) -> str:
    """The spec name of a numpy/JAX dtype; writers refuse the others [SP-DTYPE-1]."""
    return core_dtypes.from_numpy(numpy_dtype(dtype, where), where).name


def numpy_of(name, where: str) -> np.dtype:
    """The numpy dtype of a stored dtype name; readers reject others as *unsupported*
    [SP-DTYPE-1] [SP-ERR-1]."""
    if not isinstance(name, str) or name not in BY_NAME:
        raise UnsupportedFormatError(
            f"{where}: dtype {name!r} is not in the format's dtype table", spec_id="SP-DTYPE-1"
        )
    return BY_NAME[name]
