"""The handle of an asynchronous save and the per-group bookkeeping behind it.

A save with ``async_save=True`` blocks only while it plans and stages the state into host
buffers; the rest (exchange, writes, durable commit) runs in a background thread here. At most
one background save runs per process group: a new save first waits for the previous one, and
re-raises its error on every rank if any rank has not seen it yet.

The background part runs at a lower CPU priority than the trainer (``SaveOptions.
async_priority``): what slows training steps while a save drains is the writer's threads
taking cores from the trainer's (the trainer's steps wait runnable, not for the GIL; see
``benchmarks/bench_async_train.py``). On Linux the background thread lowers its own priority
and writes through a twin of the backend whose thread pools it starts (threads inherit their
creator's priority), so the backend's own pools, which sync saves and loads use, keep theirs
(:func:`background_backend`).
"""
from __future__ import annotations

import atexit
import concurrent.futures.thread   # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import sys
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from shardpoint.api.staging import StagingPool
from shardpoint.exchange import inflight
from shardpoint_core.arrays.direct_write import WritePool
from shardpoint_core.format import errors

log = logging.getLogger("shardpoint")


# ``SaveOptions.async_priority``: the CPU priority of an async save's background part.
# "low": nice 19 (a small share of a core the trainer wants, never none); "idle": SCHED_IDLE
# (only cores nothing else wants: the least slowdown, but a machine kept busy delays the
# save without bound); "normal": the caller's priority, the same pools as sync saves.
PRIORITIES = ("low", "idle", "normal")


def check_priority(priority: str) -> None:
    """Raise ``InvalidOptionError`` unless ``priority`` is one of :data:`PRIORITIES`."""
    if priority not in PRIORITIES:
        raise errors.InvalidOptionError(
            f"SaveOptions.async_priority must be one of {', '.join(map(repr, PRIORITIES))}, "
            f"not {priority!r}")


def lower_thread_priority(priority: str) -> bool:
    """Lower the calling thread's CPU priority to ``priority`` (threads it starts from now
    on inherit it); True if it did. Linux only (elsewhere ``setpriority`` of a thread id would
    renice some process); never raises, since a save must not fail for want of a lower
    priority. It is not undone: an unprivileged thread cannot raise its priority again, which
    is why the background part gets thread pools of its own (:func:`background_backend`)."""
    if priority not in ("low", "idle") or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        if priority == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif os.getpriority(os.PRIO_PROCESS, tid) < 19:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        return True
    except (AttributeError, OSError) as e:   # a sandbox refusing it: normal priority
        log.debug("shardpoint: cannot lower the async save's priority: %s", e)
        return False


_POOLS = ("_write_pool", "_reads", "_remote", "_meta_reads")   # ZarrBackend's thread pools
_TWINS_LOCK = threading.Lock()
_TWIN_CLASSES: dict = {}


def _twin_class(cls: type) -> type:
    """A subclass of ``cls`` whose instances own only the thread pools and read and write
    every other attribute on the backend they stand in for (``_sp_origin``), so the twin
    sees that backend's state as it changes, not a copy taken when the twin was made."""
    twin = _TWIN_CLASSES.get(cls)
    if twin is None:
        def __getattr__(self: Any, name: str) -> Any:
            origin = self.__dict__.get("_sp_origin")
            if origin is None:
                raise AttributeError(name)
            return getattr(origin, name)

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if name in _POOLS or name == "_sp_origin":
                self.__dict__[name] = value
            else:
                setattr(self.__dict__["_sp_origin"], name, value)

        twin = type(f"LowPriority{cls.__name__}", (cls,),
                    {"__getattr__": __getattr__, "__setattr__": __setattr__,
                     "__module__": __name__})
        _TWIN_CLASSES[cls] = twin
    return twin


def background_backend(be: Any, priority: str) -> tuple:
    """(the backend, the priority) an async save's background part runs with. At ``"low"``
    or ``"idle"``: a twin of ``be`` (one per backend and priority, kept) whose thread pools
    are its own, started lazily by the low-priority background thread and so at its
    priority, and whose every other attribute is ``be``'s (committer and its locks, records
    of written files and checksums, options). A backend without those pools of its own
    (another ``StorageBackend``, a wrapper) is used as it is at ``"normal"``: the pools it
    reaches could be started by the background thread and would then serve sync saves and
    loads at a low priority for good. The twins hang off ``be`` (a table here would keep
    every backend and its threads alive: a twin refers back to ``be``), so they go with it."""
    if priority not in ("low", "idle"):
        return be, "normal"
    own = getattr(be, "__dict__", {})
    if not all(isinstance(own.get(n), WritePool) for n in _POOLS):
        return be, "normal"
    with _TWINS_LOCK:
        twins = own.setdefault("_sp_async_twins", {})
        twin = twins.get(priority)
        if twin is None:
            twin = object.__new__(_twin_class(type(be)))
            twin.__dict__["_sp_origin"] = be
            for n in _POOLS:
                twin.__dict__[n] = WritePool(own[n].threads, f"sp-{priority}-{own[n].name}")
            twins[priority] = twin
        return twin, priority


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
            raise TimeoutError(f"the async save is still writing after {timeout} s; it keeps "
                               "running: wait() again, or check done()") from None
        except BaseException:
            self._mark_seen()
            raise
        self._mark_seen()
        return out

    def _mark_seen(self) -> None:
        self._seen = True
        _RUNNING.discard(self)   # its error reached the caller: the exit hook need not wait

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

    def start(self, fn: Callable[[], Any], staging_bytes: int, path: str = "",
              priority: str = "normal") -> AsyncSave:
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
                lower_thread_priority(priority)
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
                log.error("shardpoint: the async save to %r still running at exit failed; "
                          "nothing was committed there: %s", h.path, e)
    inflight.settle_at_exit()   # a collective that failed just now: see its module


try:   # Python >= 3.9; the same hook list concurrent.futures uses for its pools
    threading._register_atexit(_finish_pending)
except (AttributeError, RuntimeError):   # pragma: no cover - another Python
    atexit.register(_finish_pending)
