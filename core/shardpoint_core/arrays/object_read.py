"""An array on an object store opened for reading (:class:`ObjectArray`): its zarr.json read
by the first read that needs it, with that read's first data request beside it.

An open costs nothing, so as many zarr.json GETs are in flight as reads. A region's first
data request (a plain chunk's read, or a shard index's suffix read) is sent under the layout
the reading backend would have written for the manifest's entry (``guess``) while zarr.json
is read: zarr.json is checked first, and the early answer is used only if zarr.json confirms
that layout, and only for the identical request (:class:`~.array.PrimedStore`), so every
check of the Zarr layer runs on those bytes as on any others; otherwise it is dropped.

Example::

    arr = ObjectArray(store, "save-1a2b/tensors/w", spec, "w", guess)
    futures = arr.read((0, 0), out, meta_pool.submit, io_pool.submit)
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

import numpy as np

from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.arrays.array import ArrayLayout, prime_region, read_array_meta, read_region


def _inline(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` run now, as a finished future."""
    f: Future[Any] = Future()
    try:
        f.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - the future holds it
        f.set_exception(e)
    return f


class ObjectArray:
    """An array on an object store opened for reading: its zarr.json is read and checked by
    the first read (or verify) that needs it, so an open costs nothing and as many zarr.json
    GETs are in flight as reads (the load opens arrays ahead from a few threads only, as it
    does on files). ``guess``: the layout this backend would have written for the manifest's
    entry; the first read sends its first data request under it alongside the zarr.json
    GET, and uses the answer only if zarr.json confirms that layout."""

    def __init__(
        self, store: Any, path: str, spec: ArraySpec, key: str, guess: Optional[ArrayLayout] = None
    ) -> None:
        self.store, self.path, self.spec, self.key = store, path, spec, key
        self.guess = guess
        self._meta: Optional[Future[ArrayLayout]] = None
        self._lock = threading.Lock()

    def meta(self, submit: Callable[..., Any]) -> Future[ArrayLayout]:
        """The read and check of zarr.json (started by ``submit`` unless under way or done;
        one that failed is tried again)."""
        with self._lock:
            f = self._meta
            if f is None or (f.done() and f.exception() is not None):
                f = self._meta = submit(read_array_meta, self.store, self.path, self.spec, self.key)
            return f

    def known(self) -> Optional[ArrayLayout]:
        """The checked layout, if zarr.json was read already."""
        f = self._meta
        return f.result() if f is not None and f.done() and f.exception() is None else None

    @property
    def layout(self) -> ArrayLayout:
        """The checked layout (zarr.json read here, now, if no read did yet)."""
        return self.meta(_inline).result()

    def read(
        self,
        offset: tuple[int, ...],
        out: np.ndarray,
        meta_submit: Callable[..., Any],
        submit: Callable[..., Any],
    ) -> list[Any]:
        """Fill ``out`` with the region at ``offset``. ``meta_submit`` starts the zarr.json
        read (an executor whose tasks never wait: a read task may wait for it), ``submit``
        the region's other chunks and shard runs, all in flight together; their futures are
        returned (:func:`~.array.read_region`)."""
        lay = self.known()
        store = self.store
        if lay is None:
            meta = self.meta(meta_submit)
            primed = None
            if self.guess is not None and not meta.done():
                primed = prime_region(self.store, self.path, self.guess, offset, out.shape)
            lay = meta.result()  # the spec's error for a bad zarr.json, first
            if primed is not None and lay == self.guess:
                store = primed
        return read_region(store, self.path, lay, offset, out, self.key, submit)
