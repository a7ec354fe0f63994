"""Reads of a packed checkpoint planned together (format 1.4, [SP-PACK-6]: adjacent
ranges MAY be merged): :func:`plan_runs` turns the boxes a load reads, of any number of
tensors, into a few large ranged reads of the data objects (:class:`_Run`, one ``preadv``
on files or ranged GET on object stores each) and tells each box where its chunks lie in
them (:class:`_Piece`). :class:`~.packed_read.ReadBatch` gathers the boxes; the views of
:mod:`.packed_read` read the chunks out of the runs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from shardpoint_core.arrays.array import _chunks_of
from shardpoint_core.arrays.identity import chunk_number
from shardpoint_core.stores.base import ByteStore

MAX_RUN = 64 << 20  # one ranged read merges chunks up to this size
MERGE_BELOW = 16 << 20  # chunks this big or bigger are read by the layer's own reads
# on files only boxes of chunks below this are merged: bigger ones are read straight into
# the destination (:mod:`.packed_direct`, no copy), where a read per chunk costs nothing
MERGE_BELOW_FILES = 1 << 20
GAP_FILES = 64 << 10  # bytes no read needs that a run may span: on files
GAP_OBJECTS = 1 << 20  # on object stores, where a request costs more than a MiB


class _Run:
    """One ranged read serving chunks of one or several tensors: fetched by the first read
    that needs it (the others wait for that one); its buffer lives as long as a
    :class:`_Piece` of it does (a view drops a plain chunk's piece once it took its bytes,
    a shard's when its read is done), so a load holds a few runs at a time, not its data
    twice."""

    def __init__(self, store: ByteStore, key: str, lo: int, hi: int) -> None:
        self.store, self.key, self.lo, self.hi = store, key, lo, hi
        self._lock = threading.Lock()
        self._got: Optional[Future[np.ndarray]] = None

    def take(self, at: int, n: int) -> memoryview:
        """Bytes ``at``..``at + n`` of the object (inside the run); EOFError where it is
        shorter."""
        with self._lock:
            f = self._got
            mine = f is None
            if f is None:
                f = self._got = Future()
        if mine:
            try:
                buf = np.empty(self.hi - self.lo, np.uint8)
                self.store.read_into(self.key, self.lo, memoryview(buf))
                f.set_result(buf)
            except BaseException as e:
                f.set_exception(e)  # every chunk of the run falls back to its own read
        return memoryview(f.result())[at - self.lo : at - self.lo + n]


class _Piece:
    """A chunk's bytes inside a :class:`_Run` (``take``: they, fetched if need be)."""

    def __init__(self, run: _Run, at: int, n: int) -> None:
        self.run, self.at, self.n = run, at, n

    def take(self) -> memoryview:
        return self.run.take(self.at, self.n)


def plan_runs(
    boxes: Sequence[Tuple[Any, Sequence[int], Sequence[int]]],
) -> List[Dict[int, _Piece]]:
    """Per box ``(view, offset, shape)``, chunk number -> :class:`_Piece` for its chunks
    below :data:`MERGE_BELOW` (on files: of boxes whose chunks are all below
    :data:`MERGE_BELOW_FILES`), in runs shared by every box: sorted by object and offset,
    a gap of at most :data:`GAP_FILES` / :data:`GAP_OBJECTS` between two chunks of a run,
    at most :data:`MAX_RUN` bytes a run (:class:`~.packed_read.ReadBatch`)."""
    segs: List[Tuple[Any, ...]] = []  # (store url, object key, offset, length, box, chunk, store)
    for i, (view, offset, shape) in enumerate(boxes):
        lay = view.layout
        cs = sorted(
            {
                chunk_number(cidx, lay.shape, lay.chunk)
                for cidx, *_ in _chunks_of(lay, offset, shape)
            }
        )
        if not cs:
            continue
        rec = view.part.records[cs]
        local = bool(view.store.capabilities.local_path)
        small = rec["length"] < (MERGE_BELOW_FILES if local else MERGE_BELOW)
        if local and not small.all():
            continue  # on files: the layer's reads, or straight into the destination
        for c, r in zip(np.asarray(cs)[small], rec[small]):
            key = view.object_key(view.part.objects[int(r["object"])][0])
            segs.append(
                (view.store.url, key, int(r["offset"]), int(r["length"]), i, int(c), view.store)
            )
    out: List[Dict[int, _Piece]] = [{} for _ in boxes]
    segs.sort(key=lambda s: (s[0], s[1], s[2]))
    run: Optional[_Run] = None
    for url, key, off, n, i, c, store in segs:
        gap = GAP_FILES if store.capabilities.local_path else GAP_OBJECTS
        if (
            run is None
            or (run.store.url, run.key) != (url, key)
            or off - run.hi > gap
            or off < run.lo  # overlapping records are refused by the index; be safe
            or max(run.hi, off + n) - run.lo > MAX_RUN
        ):
            run = _Run(store, key, off, off + n)
        run.hi = max(run.hi, off + n)
        out[i][c] = _Piece(run, off, n)
    return out
