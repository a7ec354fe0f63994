"""The handle of an asynchronous save and the per-group bookkeeping behind it.

A save with ``async_save=True`` blocks only while it plans and stages the state into host
buffers; the rest (exchange, writes, durable commit) runs in a background thread here. At most
one background save runs per process group: a new save first waits for the previous one, and
re-raises its error on every rank if any rank has not seen it yet.
"""
from __future__ import annotations

import atexit
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from .staging import StagingPool


class AsyncSave:
    """A save running in the background. ``wait``/``result`` return its ``SaveResult`` or
    raise its error (on every rank the same); ``staging_bytes`` is the host pool it holds."""

    def __init__(self, future: Future, staging_bytes: int) -> None:
        self._future = future
        self._seen = False
        self.staging_bytes = staging_bytes

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
            self._seen = True
            raise
        self._seen = True
        return out

    def result(self) -> Any:
        """Same as :meth:`wait` with no timeout."""
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"AsyncSave({state}, staging_bytes={self.staging_bytes})"


class GroupSaves:
    """What one process group keeps between async saves: the pending save and its pool."""

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
                prev._seen = True
                unseen = e
        agree(unseen)

    def start(self, fn: Callable[[], Any], staging_bytes: int) -> AsyncSave:
        """Run ``fn`` in a background thread; its result or error goes to the handle."""
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                fut.set_exception(e)

        fut.set_running_or_notify_cancel()
        threading.Thread(target=run, name="shardpoint-async-save", daemon=True).start()
        self.pending = AsyncSave(fut, staging_bytes)
        return self.pending


_GROUPS: dict = {}


@atexit.register
def _finish_pending() -> None:
    """A script that ends right after an async save still commits it (errors were logged)."""
    for g in list(_GROUPS.values()):
        if g.pending is not None:
            try:
                g.pending._future.result()
            except BaseException:  # noqa: BLE001 - nobody left to raise to
                pass


def group_saves(key: tuple) -> GroupSaves:
    """The bookkeeping of the group with ``key`` (created on first use)."""
    if key not in _GROUPS:
        _GROUPS[key] = GroupSaves()
    return _GROUPS[key]
