"""Pausing the garbage collector (and numpy's huge-page advice) around planning: a large
job's plan allocates many short-lived acyclic objects and arrays, for which both cost more
than the planning itself. Used by the planners and the exchange's gathers.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: planning a large job allocates ~10^5 acyclic
    objects, and the collections they trigger cost more than the planning itself (measured:
    0.7 s of 1.9 s for the 4,096-rank job). Restores the previous state.

    On the way out the objects made meanwhile are moved to the oldest generation at once
    (``gc.freeze()`` + ``gc.unfreeze()``, when nothing else is frozen): the plan outlives the
    call, and the young collection that re-enabling would trigger walked every one of them
    (0.15 s for that job) only to promote them there.

    Meanwhile numpy does not ask the kernel for huge pages for its large arrays (its
    default on Linux, ``madvise(MADV_HUGEPAGE)``): a plan's arrays live for a fraction of a
    second, and faulting in (and compacting memory for) fresh 2 MiB pages cost more than the
    planning that used them (benchmarks/RESULTS.md, 16,384 ranks). Restored on the way
    out."""
    was = gc.isenabled()
    gc.disable()
    hp = _set_huge_pages(False)
    try:
        yield
    finally:
        _set_huge_pages(hp)
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _set_huge_pages(on: Optional[bool]) -> Optional[bool]:
    """Set numpy's huge-page advice for new arrays; returns the previous setting (None where
    this numpy has no such switch, or when ``on`` is None)."""
    if on is None:
        return None
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    fn = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    return None if fn is None else bool(fn(on))
