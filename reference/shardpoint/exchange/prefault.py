"""Fault in a tensor's pages with one system call before filling it from user space.

A fresh allocation's pages are faulted one by one as a copy first touches them; on a virtual
machine each fault costs microseconds, and copying 24 MiB into a fresh tensor measured 0.13 s
here against 0.03 s after ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), which faults the
whole range in at once. Elsewhere, or when the call fails, nothing happens: it is only a hint.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable, Optional

import torch

_MADV_POPULATE_WRITE = 23
_PAGE = 4096
_madvise: Optional[Callable[[int, int, int], int]] = None  # madvise(addr, length, advice)
_unavailable = not sys.platform.startswith("linux")


def populate_write(t: torch.Tensor) -> bool:
    """Fault in the pages spanned by CPU tensor ``t`` (contents unchanged); whether it ran."""
    global _madvise, _unavailable
    if _unavailable or t.device.type != "cpu" or t.numel() == 0:
        return False
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            _unavailable = True
            return False
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    item = t.element_size()
    lo = hi = t.data_ptr()
    for n, s in zip(t.shape, t.stride()):
        (lo, hi) = (lo + (n - 1) * s * item, hi) if s < 0 else (lo, hi + (n - 1) * s * item)
    hi += item
    start = lo & ~(_PAGE - 1)
    if _madvise(start, hi - start, _MADV_POPULATE_WRITE) != 0:
        # EINVAL: a kernel before 5.14; anything else (a read-only mapping): leave it be.
        if ctypes.get_errno() == 22:
            _unavailable = True
        return False
    return True
