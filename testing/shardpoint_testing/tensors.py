"""Deterministic tensors and bitwise comparison, shared by the tests, the demo and the
conformance suite (one definition instead of a copy per test file)."""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np

Seed = Union[str, int]


def seed_of(name: Seed) -> int:
    """A stable seed from a name (the same on every rank and every run); an int is itself."""
    return name if isinstance(name, int) else sum(map(ord, name))


def random_bits(name: Seed, shape: Sequence[int], dtype: Any = None) -> Any:
    """A torch tensor of ``dtype`` whose bytes are random (NaN payloads, -0.0, subnormals
    and all; bool as 0/1, its only valid bytes), the same for the same ``name`` or seed:
    round trips must keep every bit."""
    import torch

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed_of(name))
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(tuple(shape))
    return raw.view(dtype).reshape(tuple(shape))


def random_array(name: Seed, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """``random_bits`` for torch-free tests: a numpy array of ``dtype`` (any numpy dtype,
    ml_dtypes' bfloat16 and float8 included) with random bytes, bool as 0/1."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed_of(name))
    if dtype == np.bool_:
        return rng.integers(0, 2, tuple(shape)).astype(bool)
    raw = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def seeded_randn(name: Seed, shape: Sequence[int], dtype: Any = None) -> Any:
    """Normal values (then cast to ``dtype``), the same for the same ``name``."""
    import torch

    g = torch.Generator().manual_seed(seed_of(name))
    return torch.randn(tuple(shape), generator=g).to(dtype or torch.float32)


def counting(shape: Sequence[int], i: int = 0, dtype: Any = None) -> Any:
    """``arange * (i + 1) - 7``: distinct, exactly representable values per element, so a
    misplaced element (or tensor ``i`` read for tensor ``j``) shows in any comparison."""
    import torch

    n = int(np.prod(shape, dtype=np.int64))
    return torch.arange(n, dtype=dtype or torch.float32).reshape(tuple(shape)) * (i + 1) - 7


def as_bytes(x: Any) -> tuple:
    """(dtype name, shape, raw bytes) of a torch tensor, numpy array or JAX array."""
    if hasattr(x, "detach"):  # torch: through the core's dtype table, bfloat16/fp8 included
        from shardpoint.tree.dtypes import torch_to_numpy

        x = torch_to_numpy(x.detach().cpu().contiguous())
    a = np.ascontiguousarray(np.asarray(x))
    return str(a.dtype), tuple(a.shape), a.tobytes()


def same_bits(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bytes (NaN == NaN when the
    payloads match; -0.0 != 0.0): what "bitwise round trip" means in these tests."""
    return as_bytes(a) == as_bytes(b)
