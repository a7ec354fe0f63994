"""Deterministic tensors and bitwise comparison, shared by the tests, the demo and the
conformance suite (one definition instead of a copy per test file)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def seed_of(name: str) -> int:
    """A stable seed from a name (the same on every rank and every run)."""
    return sum(map(ord, name))


def random_bits(name: str, shape: Sequence[int], dtype: Any = None) -> Any:
    """A torch tensor of ``dtype`` whose bytes are random (NaN payloads, -0.0, subnormals
    and all), the same for the same ``name``: round trips must keep every bit."""
    import torch
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed_of(name))
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(tuple(shape))
    return raw.view(dtype).reshape(tuple(shape))


def seeded_randn(name: str, shape: Sequence[int], dtype: Any = None) -> Any:
    """Normal values (then cast to ``dtype``), the same for the same ``name``."""
    import torch
    g = torch.Generator().manual_seed(seed_of(name))
    return torch.randn(tuple(shape), generator=g).to(dtype or torch.float32)


def as_bytes(x: Any) -> tuple:
    """(dtype name, shape, raw bytes) of a torch tensor, numpy array or JAX array."""
    if hasattr(x, "detach"):   # torch: through the core's dtype table, bfloat16/fp8 included
        from shardpoint.tree.dtypes import torch_to_numpy
        x = torch_to_numpy(x.detach().cpu().contiguous())
    a = np.ascontiguousarray(np.asarray(x))
    return str(a.dtype), tuple(a.shape), a.tobytes()


def same_bits(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bytes (NaN == NaN when the
    payloads match; -0.0 != 0.0): what "bitwise round trip" means in these tests."""
    return as_bytes(a) == as_bytes(b)
