"""The tensors of a failed collective, until the backend's threads let go of them.

A collective that fails (a lost or hung rank) is raised on the calling thread while the
process group's worker thread may still hold the failed work, and with it the work's tensors.
Whichever side drops a tensor last frees it; when that is a worker after Python dropped its
own reference, the worker must take the GIL to release the tensor's Python object. If the
interpreter is exiting then, Python stops that thread inside torch's C++ destructor, which
cannot unwind: the process aborts ("terminate called without an active exception"), after the
error was printed. So the caller keeps the tensors until the workers are done with them: a
short wait before the error is raised, and whatever is still held then is kept until exit,
where a hook waits again before the interpreter is torn down.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import time
from typing import Any, Iterable

import torch

# Tensors a worker still held when their collective's error was raised.
_STRANDED: list = []
WAIT_S = 2.0  # at the failure: the worker is usually done within milliseconds
EXIT_WAIT_S = 10.0  # at exit, for what was still held


def tensors_in(values: Any) -> list:
    """The tensors in ``values``: nested lists, tuples and dicts, and objects with a
    ``tensor`` attribute (``dist.P2POp``)."""
    out: list = []
    todo = [values]
    while todo:
        v = todo.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(getattr(v, "tensor", None), torch.Tensor):
            out.append(v.tensor)
    return out


def _held_elsewhere(t: torch.Tensor) -> bool:
    """True while something besides its Python object holds ``t`` (a backend's work)."""
    try:
        # private, absent from torch's stubs; a torch without it lands in the except below
        return t._use_count() > 1  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a torch without it: nothing to wait for
        return False


def _settle(tensors: Iterable, limit: float) -> list:
    pending = [t for t in tensors if _held_elsewhere(t)]
    deadline = time.monotonic() + limit
    while pending and time.monotonic() < deadline:
        time.sleep(0.002)
        pending = [t for t in pending if _held_elsewhere(t)]
    return pending


def release_after_failure(tensors: list) -> None:
    """Wait (briefly) until no backend thread holds ``tensors`` (a failed collective's); keep
    those still held until exit. Earlier ones that were let go since are dropped here."""
    _STRANDED[:] = _settle(_STRANDED, 0.0)
    _STRANDED.extend(_settle(tensors, WAIT_S))


def settle_at_exit() -> None:
    """Before the interpreter is torn down (threads still running): wait for the workers to
    let go of what is still held; what they still hold then is never freed, so that no
    worker needs the GIL once the interpreter is gone."""
    if not _STRANDED:
        return
    left = _settle(_STRANDED, EXIT_WAIT_S)
    _STRANDED[:] = left
    if left:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_STRANDED))  # kept past finalization


try:  # Python >= 3.9: runs before interpreter teardown, while threads still run
    # private and absent from typeshed; a Python without it raises AttributeError
    threading._register_atexit(settle_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - another Python
    atexit.register(settle_at_exit)
