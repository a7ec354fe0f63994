"""Non-tensor values of the torch front end: the core's msgpack value codec
(:mod:`shardpoint_core.format.values`) with torch tensors registered as ext 1 arrays of origin
"torch", handed back as tensors."""

from __future__ import annotations

import torch

from shardpoint.tree import dtypes as torch_dtypes
from shardpoint_core.format.values import *  # noqa: F401,F403 - the codec, as this front end uses it
from shardpoint_core.format.values import register_array_type


def _to_numpy(v: torch.Tensor):
    return torch_dtypes.torch_to_numpy(v.detach().cpu().resolve_conj().resolve_neg().contiguous())


register_array_type(
    torch.Tensor,
    "torch",
    to_numpy=_to_numpy,
    from_numpy=lambda a: torch_dtypes.numpy_to_torch(a.copy()),
    check=lambda v, what: torch_dtypes.from_torch(v.dtype, what),
)
