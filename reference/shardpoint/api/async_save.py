"""The handle of an asynchronous save and the per-group bookkeeping behind it.

A save with ``async_save=True`` blocks only while it plans and stages the state into host
buffers; the rest (exchange, writes, durable commit) runs in a background thread here. At most
one background save runs per process group: a new save first waits for the previous one, and
re-raises its error on every rank if any rank has not seen it yet.

The background part runs at a lower CPU priority than the trainer (``SaveOptions.
async_priority``): what slows training steps while a save drains is the writer's threads
taking cores from the trainer's (the trainer's steps wait runnable, not for the GIL; see
``benchmarks/bench_async_train.py``). On Linux the background thread lowers itself
(:func:`~shardpoint_core.arrays.direct_write.run_at_priority`), and the backend's thread pools
run what it submits on threads of the same priority, apart from the threads sync saves and
loads use.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from shardpoint.api.staging import StagingPool
from shardpoint.exchange import inflight
from shardpoint_core.arrays.direct_write import run_at_priority
from shardpoint_core.stores.durable import PRIORITIES
from shardpoint_core.format import errors

log = logging.getLogger("shardpoint")


# ``SaveOptions.async_priority``: the CPU priority of an async save's background part, one of
# PRIORITIES. "low": nice 19 (a small share of a core the trainer wants, never none); "idle":
# SCHED_IDLE (only cores nothing else wants: the least slowdown, but a machine kept busy
# delays the save without bound); "normal": the caller's priority.


def check_priority(priority: str) -> None:
    """Raise ``InvalidOptionError`` unless ``priority`` is one of :data:`PRIORITIES`."""
    if priority not in PRIORITIES:
        raise errors.InvalidOptionError(
            f"SaveOptions.async_priority must be one of {', '.join(map(repr, PRIORITIES))}, "
            f"not {priority!r}"
        )


class AsyncSave:
    """A save running in the background. ``wait``/``result`` return its ``SaveResult`` or
    raise its error (on every rank the same); ``staging_bytes`` is the host pool it holds,
    ``path`` the checkpoint it writes."""

    def __init__(self, future: Future, staging_bytes: int, path: str = "") -> None:
        self._future = future
        self._seen = False
        self.staging_bytes = staging_bytes
        self.path = path

    @property
    def reported(self) -> bool:
        """True once ``wait``/``result`` handed the outcome (result or error) to the caller,
        so whoever waits next knows not to raise the same error a second time."""
        return self._seen

    def done(self) -> bool:
        """True once the background part finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The ``SaveResult``, once committed; re-raises the save's error. Raises
        ``TimeoutError`` if ``timeout`` seconds pass first (the save keeps running)."""
        try:
            out = self._future.result(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"the async save is still writing after {timeout} s; it keeps "
                "running: wait() again, or check done()"
            ) from None
        except BaseException:
            self._mark_seen()
            raise
        self._mark_seen()
        return out

    def _mark_seen(self) -> None:
        self._seen = True
        _RUNNING.discard(self)  # its error reached the caller: the exit hook need not wait

    def result(self) -> Any:
        """Same as :meth:`wait` with no timeout."""
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"AsyncSave({state}, staging_bytes={self.staging_bytes})"


class GroupSaves:
    """What a checkpointer keeps per process group between async saves: the pending save
    and its host pool."""

    def __init__(self) -> None:
        self.pending: Optional[AsyncSave] = None
        self.pool = StagingPool()

    def settle(self, agree: Callable[[Optional[BaseException]], None]) -> None:
        """Wait for the previous background save; re-raise its error unless ``wait`` already
        handed it to the caller. ``agree`` is a collective that raises on every rank when any
        rank passes an error: ranks that called ``wait`` and ranks that did not must make the
        same choice, or some would go on into the next save's collectives alone."""
        prev, self.pending = self.pending, None
        if prev is None:
            return
        unseen: Optional[BaseException] = None
        try:
            prev._future.result()
        except BaseException as e:  # noqa: BLE001 - handed to agree
            if not prev._seen:
                prev._mark_seen()
                unseen = e
        agree(unseen)

    def start(
        self, fn: Callable[[], Any], staging_bytes: int, path: str = "", priority: str = "normal"
    ) -> AsyncSave:
        """Run ``fn`` in a background thread at ``priority`` (see :data:`PRIORITIES`; it and
        the threads it starts); its result or error goes to the handle.

        The thread is not a daemon: interpreter exit joins it before finalizing. A daemon
        thread still dropping the save's tensors when the main thread finalizes is killed
        inside torch's tensor deallocator (which releases the GIL and cannot unwind), and
        the process aborts ("terminate called without an active exception"). ``fn`` and
        what it holds are released before the handle completes, so whoever waits on the
        handle finds the job's memory already freed."""
        fut: Future = Future()
        handle = AsyncSave(fut, staging_bytes, path)
        job = [fn]

        def run() -> None:
            try:
                run_at_priority(priority)
                out = job.pop()()
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                fut.set_exception(e)
                return
            fut.set_result(out)
            _RUNNING.discard(handle)

        fut.set_running_or_notify_cancel()
        _RUNNING.add(handle)
        threading.Thread(target=run, name="shardpoint-async-save", daemon=False).start()
        self.pending = handle
        return handle


# Async saves not yet finished (or failed and not yet reported), whichever checkpointer
# started them: the exit hook below waits for them.
_RUNNING: set = set()


def _finish_pending() -> None:
    """A script that ends right after an async save still commits it; a save that fails
    then is logged with its path, since no one is left to raise to.

    Registered with ``threading``'s exit hooks (where ``concurrent.futures`` registers its
    own; they run in reverse order) so it runs before the thread pools the background write
    submits to refuse new work ("cannot schedule new futures after interpreter shutdown"):
    as a plain ``atexit`` hook it ran after that, and a save still writing at exit failed."""
    for h in list(_RUNNING):
        try:
            h._future.result()
        except BaseException as e:  # noqa: BLE001 - nobody left to raise to
            if not h._seen:
                log.error(
                    "shardpoint: the async save to %r still running at exit failed; "
                    "nothing was committed there: %s",
                    h.path,
                    e,
                )
    inflight.settle_at_exit()  # a collective that failed just now: see its module


try:  # Python >= 3.9; the same hook list concurrent.futures uses for its pools
    threading._register_atexit(_finish_pending)  # type: ignore[attr-defined] # private, no stub
except (AttributeError, RuntimeError):  # pragma: no cover - another Python
    atexit.register(_finish_pending)
