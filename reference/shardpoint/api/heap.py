"""Giving the C heap's free pages back to the system after a save or a load.

A save and a load allocate and free buffers of chunk size on several threads. Once glibc has
freed one large block it raises its mmap threshold (up to 32 MiB), so later blocks of that
size come from its heaps, where blocks that live on (a ``memory://`` store's objects, the
caller's tensors) keep the pages freed around them from returning to the system: the
process's resident memory grew with every save and load cycle although nothing was kept.
``malloc_trim(0)`` returns every free page of every heap; elsewhere than glibc it is absent
and nothing is done.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

_TRIM: Optional[Any] = None
_LOOKED = False


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``): what a save or
    a load freed stops counting as resident memory. A no-op where there is no glibc."""
    global _TRIM, _LOOKED
    if not _LOOKED:
        _LOOKED = True
        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _TRIM = fn
        except (AttributeError, OSError):  # not glibc
            _TRIM = None
    if _TRIM is not None:
        _TRIM(0)
