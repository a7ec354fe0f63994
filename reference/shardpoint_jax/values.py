"""Values of the JAX front end: the core's msgpack value codec (:mod:`shardpoint_core.format.values`)
with ``jax.Array`` registered as an ext 1 array. Inside sharded-object values a JAX writer
writes origin "numpy" ([SP-MAN-6]: every reader can hand back a numpy array), so such arrays
come back as numpy arrays."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardpoint_core.format.values import *  # noqa: F401,F403 - the codec, as this front end uses it
from shardpoint_core.format.values import SCALARS, register_array_type
from shardpoint_jax.dtypes import name_of


def _to_numpy(v: jax.Array) -> np.ndarray:
    return np.array(v, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)


register_array_type(
    jax.Array, "numpy", to_numpy=_to_numpy, check=lambda v, what: name_of(v.dtype, what)
)


def is_scalar_value(v: Any) -> bool:
    """True for what a ``{"value": v}`` leaf may hold: msgpack scalars and numpy scalars."""
    return type(v) in SCALARS or isinstance(v, np.generic)
