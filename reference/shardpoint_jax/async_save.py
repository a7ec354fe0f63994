"""Asynchronous saves: the host data a save keeps before returning, and the handle of the
write and commit that run after it in a thread of their own.

A save may run in the background only with data nobody can change under it. A JAX array on
the CPU is immutable, and a host view of it (``np.asarray``, no copy) keeps its buffer alive
and unchanged through ``delete()`` and donation (JAX then copies instead of donating), so it
is held, not copied: the call returns without touching its bytes. Numpy leaves are mutable:
they are copied into one host arena, reused by the next save that fits in it (fresh pages
cost a fault each; reused ones only the copy). Arrays on an accelerator are copied to host.
One asynchronous save runs at a time per process: the next save (sync or not) first waits
for it, and raises its error if nobody saw that error yet.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must come before ours
import sys
import threading
from typing import Callable, Optional

import numpy as np

from shardpoint_jax.errors import SaveFailedError

_ALIGN = 64


class HostPool:
    """One host arena carved into the staged copies of a save, kept for the next one."""

    def __init__(self) -> None:
        self.arena: Optional[np.ndarray] = None

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.nbytes

    def stage(self, regions: list) -> list:
        """``regions`` (``(key, array, chunk, offset, data)``) with each ``data`` replaced by
        host data nobody can change: a view of a CPU JAX array, else a copy (numpy leaves
        into the arena, grown first when they do not fit in it)."""
        held = [_cpu_view(r[-1]) for r in regions]
        copies = [
            (i, np.asarray(r[-1])) for i, (r, h) in enumerate(zip(regions, held)) if h is None
        ]
        sizes = [-(-h.nbytes // _ALIGN) * _ALIGN for _i, h in copies]
        if copies and (self.arena is None or self.arena.nbytes < sum(sizes)):
            self.arena = None  # the old arena goes before the new one comes
            self.arena = np.empty(max(sum(sizes), 1), np.uint8)
        arena = self.arena  # grown above whenever there are copies to place
        pos = 0
        for (i, h), n in zip(copies, sizes):
            if isinstance(regions[i][-1], np.ndarray):
                assert arena is not None
                dst = arena[pos : pos + h.nbytes].view(h.dtype).reshape(h.shape)
                np.copyto(dst, h)
                pos += n
            else:
                dst = h  # from an accelerator: already a new copy
            held[i] = dst
        return [r[:-1] + (h,) for r, h in zip(regions, held)]


def _cpu_view(data: object) -> Optional[np.ndarray]:
    """A no-copy host view of a JAX array whose buffers are on the CPU, else None."""
    import jax

    if not isinstance(data, jax.Array) or any(d.platform != "cpu" for d in data.devices()):
        return None
    return np.asarray(data)


POOL = HostPool()


class AsyncSave:
    """A save writing in the background: ``done()``, ``wait(timeout)``, ``result(timeout)``
    (the checkpoint's path once it is committed); the save's error is raised by ``wait`` and
    ``result``, and by the next save if neither was called."""

    def __init__(self, run: Callable[[], None], path: str) -> None:
        global _PENDING
        self.path = path
        self._error: Optional[BaseException] = None
        self._seen = False
        self._finished = threading.Event()

        def body() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                self._error = e
            finally:
                self._finished.set()

        self._thread = threading.Thread(target=body, name="shardpoint-jax-save", daemon=True)
        _PENDING = self
        self._thread.start()

    def __repr__(self) -> str:
        return f"AsyncSave({self.path!r}, done={self.done()})"

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the save has finished; raise its error, or ``TimeoutError`` if it is
        still writing after ``timeout`` seconds (it goes on writing)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"the save to {self.path!r} is still writing after {timeout}s; "
                "wait again, or check done()"
            )
        self._seen = True
        if self._error is not None:
            raise self._error

    def result(self, timeout: Optional[float] = None) -> str:
        """The checkpoint's path once committed (see :meth:`wait`)."""
        self.wait(timeout)
        return self.path


_PENDING: Optional[AsyncSave] = None


def wait_for_previous() -> None:
    """Wait for this process's previous asynchronous save; raise its error if unseen."""
    global _PENDING
    prev, _PENDING = _PENDING, None
    if prev is None:
        return
    prev._finished.wait()
    if prev._error is not None and not prev._seen:
        prev._seen = True
        raise SaveFailedError(
            f"the previous asynchronous save to {prev.path!r} failed: {prev._error}"
        ) from prev._error


def _finish_at_exit() -> None:
    """A script that ends right after an asynchronous save still commits it.

    A ``threading`` exit hook, as ``concurrent.futures`` registers its own (they run in
    reverse order, so this one first): the background write submits to thread pools, which
    refuse new work once their hook ran, and it must also finish before ``atexit`` hooks
    such as ``jax.distributed``'s shutdown, which the commit's messages need."""
    prev = _PENDING
    if prev is not None and not prev.done():
        print(
            f"shardpoint_jax: waiting for the save to {prev.path!r} to finish before exit",
            file=sys.stderr,
        )
    if prev is not None:
        # join, not the event: a daemon thread still unwinding when the interpreter shuts
        # down is killed inside native code, which aborts the process
        prev._thread.join()
    if prev is not None and prev._error is not None and not prev._seen:
        print(
            f"shardpoint_jax: the asynchronous save to {prev.path!r} failed: {prev._error}",
            file=sys.stderr,
        )


try:
    # CPython's hook that runs before threads are joined at exit (private, hence the
    # AttributeError fallback below)
    threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python: the next best place
    atexit.register(_finish_at_exit)
