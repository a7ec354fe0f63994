"""Direct chunk writes: chunk files written with ``pwritev`` from a thread pool, byte for byte
what TensorStore writes for the same array (pinned by tests/core/test_direct_write.py).

TensorStore's file kvstore writes each chunk to a temporary file and renames it into place,
encodes through buffers of its own and runs on its own executor; on the 2-core machine this
project measures on, that made the write phase as long as the disk's own time. Here each
chunk (or run of adjacent inner chunks of a shard) is one ``pwritev`` of the caller's memory
plus its CRC-32C, and ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts the disk writeback
right after, so the one ``syncfs`` at the end of a save (``ZarrBackend.flush``) finds
little left to write: the save overlaps memory copies with disk writes, which a write-then-
fsync cannot.

Only what the backend itself chooses is handled: a little-endian host, the plain chain or one
``sharding_indexed`` of plain chains (``codecs_for``), the default chunk key encoding, and a
write of exactly one whole chunk (what ``SaveJob.write`` issues). Anything else returns None:
the backend writes part of a chunk through the Zarr array layer (:mod:`.array`), and an array
whose layout this module does not handle through the TensorStore cross-check.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import crc32c
import numpy as np

from shardpoint_core.stores.durable import lower_thread_priority
from shardpoint_core.stores.files import (  # noqa: F401 - start_writeback re-exported
    pwritev_all,
    start_writeback,
)

_ABSENT = 2**64 - 1
RUN_BYTES = 16 << 20  # adjacent inner chunks written by one task, up to this many bytes
# Inner chunks of 256 KiB and more start on 4 KiB boundaries (at most 1.6% of padding): with
# the 4-byte CRC after each one, back to back they sit 4*i bytes off their destination's
# alignment, and reading 32 shards of 16 x 2 MiB so took 0.156 s warm against 0.102 s aligned.
INNER_ALIGN = 4096
_ZEROS = np.zeros(INNER_ALIGN, np.uint8)
_ZEROS.flags.writeable = False


def zarr_json_bytes(meta: dict[str, Any]) -> bytes:
    """``zarr.json`` as TensorStore writes it: compact JSON, keys sorted."""
    return json.dumps(
        {"zarr_format": 3, "node_type": "array", **meta}, sort_keys=True, separators=(",", ":")
    ).encode()


@dataclass(frozen=True)
class WriteLayout:
    """What a direct write needs to know about an array this backend created."""

    path: str  # the array's directory
    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    inner: Optional[tuple[int, ...]]  # inner chunk shape when chunks are shards
    itemsize: int


def stored_codecs(codecs: list[Any], itemsize: int) -> list[Any]:
    """``codecs`` as TensorStore stores them in zarr.json: a one-byte dtype's ``bytes`` codec
    loses its ``endian`` (meaningless for one byte), ``index_location: end`` (the default) is
    dropped; the index's own chain keeps ``endian`` (uint64)."""
    out: list[dict[str, Any]] = []
    for c in codecs:
        if c.get("name") == "bytes" and itemsize == 1:
            out.append({"name": "bytes"})
        elif c.get("name") == "sharding_indexed":
            conf = c["configuration"]
            new: dict[str, Any] = {
                "chunk_shape": list(conf["chunk_shape"]),
                "codecs": stored_codecs(conf["codecs"], itemsize),
                "index_codecs": stored_codecs(conf["index_codecs"], 8),
            }
            if conf.get("index_location", "end") != "end":
                new["index_location"] = conf["index_location"]
            out.append({"name": "sharding_indexed", "configuration": new})
        else:
            out.append(c)
    return out


def write_layout(
    path: str, shape: Sequence[int], chunk: Sequence[int], codecs: list[Any], itemsize: int
) -> Optional[WriteLayout]:
    """The layout for an array with the backend's own codec chain, or None (then TensorStore
    writes it): big-endian hosts, systems without ``pwritev``, and anything but plain/sharded
    plain chains."""
    if sys.byteorder != "little" or not hasattr(os, "pwritev"):
        return None
    if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
        inner = tuple(codecs[0]["configuration"]["chunk_shape"])
        return WriteLayout(path, tuple(shape), tuple(chunk), inner, itemsize)
    if [c.get("name") for c in codecs] == ["bytes", "crc32c"]:
        return WriteLayout(path, tuple(shape), tuple(chunk), None, itemsize)
    return None


_PRIORITY = threading.local()


def thread_priority() -> str:
    """The CPU priority work submitted from this thread runs at (:func:`run_at_priority`):
    ``"normal"`` unless this thread was lowered."""
    p: str = getattr(_PRIORITY, "value", "normal")
    return p


def run_at_priority(priority: str) -> None:
    """Lower this thread to ``priority`` for good (:func:`~shardpoint_core.stores.durable.
    lower_thread_priority`) and make every :class:`WritePool` task it submits from now on run
    on that pool's threads of the same priority. For a thread that does only such work (an
    async save's background thread); threads of the pools themselves are set this way too,
    so the tasks they submit stay at their priority."""
    lower_thread_priority(priority)
    _PRIORITY.value = priority


class WritePool:
    """A lazily started thread pool, restarted in a forked child (which inherits the pool
    object but not its threads). A task runs on threads of the submitting thread's priority
    (:func:`run_at_priority`): one executor per priority, each started on first use, so the
    low-priority work of an async save never runs on, or lowers, the threads sync saves and
    loads use."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads, self.name = threads, name
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pid = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        prio = thread_priority()
        pool = self._pools.get(prio)
        if pool is None or self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._pools, self._pid = {}, os.getpid()
                pool = self._pools.get(prio)
                if pool is None:
                    if prio == "normal":
                        pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
                    else:
                        pool = ThreadPoolExecutor(
                            self.threads,
                            thread_name_prefix=f"{self.name}-{prio}",
                            initializer=run_at_priority,
                            initargs=(prio,),
                        )
                    self._pools[prio] = pool
        try:
            return pool.submit(fn, *args)
        except BaseException:
            # A signal's exception (KeyboardInterrupt, a SIGTERM handler's SystemExit) can
            # land inside submit() while it starts a worker thread, before the executor
            # records it: nothing would wake that thread and the interpreter's exit would
            # wait for it forever. Shutting the executor down wakes every thread of it once
            # the work queued before runs (other saves' tasks are not cancelled); the next
            # submit starts a fresh one.
            with self._lock:
                if self._pools.get(prio) is pool:
                    del self._pools[prio]
            pool.shutdown(wait=False)
            raise


def _contiguous_bytes(a: np.ndarray) -> np.ndarray:
    """``a``'s elements in row-major order as one uint8 array (a view when ``a`` is
    contiguous, else a copy of this one (inner) chunk)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def encode_chunk(sub: np.ndarray, cshape: tuple[int, ...], itemsize: int) -> list[Any]:
    """The buffers of one stored (inner) chunk of shape ``cshape`` whose part inside the
    tensor is ``sub`` (its leading corner): element bytes padded with zeros (the fill value)
    to the full chunk, then the 4 CRC-32C bytes. No copy where ``sub`` is contiguous and
    clipped in its first dimension at most. Shared by the direct writer and the Zarr layer."""
    full = math.prod(cshape) * itemsize
    if sub.shape[1:] == cshape[1:]:
        bufs = [_contiguous_bytes(sub)] if sub.size else []
        pad = full - sub.size * itemsize
        if pad:
            bufs.append(np.zeros(pad, np.uint8))
    else:  # clipped in a later dimension: assemble the padded chunk
        scratch = np.zeros(cshape, sub.dtype)
        scratch[tuple(slice(0, n) for n in sub.shape)] = sub
        bufs = [scratch.reshape(-1).view(np.uint8)]
    c = 0
    for b in bufs:
        c = crc32c.crc32c(b, c)
    return bufs + [np.frombuffer(c.to_bytes(4, "little"), np.uint8)]


class WriteOp:
    """One chunk's write (its tasks' futures); ``result()`` waits for every task and raises
    the first failure, like the TensorStore future it stands in for."""

    def __init__(self, futures: list[Any]) -> None:
        self.futures = futures

    def result(self) -> None:
        first: Optional[BaseException] = None
        for f in self.futures:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - every task is waited for before raising
                first = first or e
        if first is not None:
            raise first


class DirectWriter:
    """Writes whole chunks of one array as tasks on ``submit``; see the module docstring.
    ``sink(cidx)``: the slots to record chunk ``cidx``'s units' crc32c in, for the
    manifest's chunk table ([SP-MAN-7]); None records nothing."""

    def __init__(
        self,
        lay: WriteLayout,
        submit: Callable[..., Any],
        early_writeback: bool = True,
        sink: Optional[Callable[..., Any]] = None,
    ) -> None:
        self.lay, self.submit, self.early, self.sink = lay, submit, early_writeback, sink
        self._dirs: set[Any] = set()  # chunk directories made so far
        self._dirs_lock = threading.Lock()

    def _chunk_path(self, cidx: tuple[int, ...]) -> str:
        lay = self.lay
        if not cidx:
            return os.path.join(lay.path, "c")
        parent = os.path.join(lay.path, "c", *map(str, cidx[:-1]))
        with self._dirs_lock:
            if parent not in self._dirs:
                os.makedirs(parent, exist_ok=True)
                self._dirs.add(parent)
        return os.path.join(parent, str(cidx[-1]))

    def write(self, offset: Sequence[int], data: np.ndarray) -> Optional[WriteOp]:
        """The op writing ``data`` (exactly one chunk, clipped to the tensor) at ``offset``,
        or None when the write is not one whole chunk of the right dtype size."""
        lay = self.lay
        offset = tuple(int(o) for o in offset)
        if (
            data.dtype.itemsize != lay.itemsize
            or len(offset) != len(lay.shape)
            or data.ndim != len(lay.shape)
        ):
            return None
        if any(o % c or o >= n for o, c, n in zip(offset, lay.chunk, lay.shape)):
            return None
        valid = tuple(min(c, n - o) for c, n, o in zip(lay.chunk, lay.shape, offset))
        if tuple(data.shape) != valid:
            return None
        cidx = tuple(o // c for o, c in zip(offset, lay.chunk))
        path = self._chunk_path(cidx)
        crcs = self.sink(cidx) if self.sink is not None else None
        if lay.inner is None:
            rec = None if crcs is None else (crcs, 0)
            return WriteOp(
                [
                    self.submit(
                        _write_units, path, [(0, data, lay.chunk, lay.itemsize, rec)], self.early
                    )
                ]
            )
        return WriteOp(self._shard(path, offset, data, crcs))

    def _shard(
        self, path: str, origin: tuple[int, ...], data: np.ndarray, crcs: Optional[bytearray] = None
    ) -> list[Any]:
        lay = self.lay
        inner = lay.inner
        assert inner is not None, "not a sharded layout"  # write() routes shards here
        per = tuple(c // i for c, i in zip(lay.chunk, inner))
        inner_bytes = math.prod(inner) * lay.itemsize + 4
        # Each inner chunk starts on a 4 KiB boundary (the spec allows gaps): its bytes then
        # keep their destination's alignment, which the page-cache copies need to run fast.
        gap = -inner_bytes % INNER_ALIGN if inner_bytes >= 64 * INNER_ALIGN else 0
        index = np.full((math.prod(per), 2), _ABSENT, dtype="<u8")
        runs: list[Any] = [[]]
        pos = run_bytes = 0
        for n, ii in enumerate(np.ndindex(*per)):
            lo = tuple(i * k for i, k in zip(ii, inner))
            if any(o + x >= s for o, x, s in zip(origin, lo, lay.shape)):
                continue  # wholly outside the tensor: absent, as TensorStore leaves it
            index[n] = (pos, inner_bytes)
            sub = data[tuple(slice(x, x + k) for x, k in zip(lo, inner))]
            if runs[-1] and run_bytes >= RUN_BYTES:
                runs.append([])
                run_bytes = 0
            runs[-1].append(
                (pos, sub, inner, lay.itemsize, None if crcs is None else (crcs, 4 * n))
            )
            if gap:
                runs[-1].append((pos + inner_bytes, [_ZEROS[:gap]], None, 0, None))
            pos += inner_bytes + gap
            run_bytes += inner_bytes + gap
        ib = index.reshape(-1).view(np.uint8)
        idx_buf = [ib, np.frombuffer(crc32c.crc32c(ib).to_bytes(4, "little"), np.uint8)]
        runs[-1].append((pos, idx_buf, None, 0, None))
        return [self.submit(_write_units, path, run, self.early) for run in runs if run]


def _write_units(path: str, units: list[Any], early: bool) -> None:
    """One task: encode ``units`` = [(file position, data, chunk shape, itemsize, record)]
    (or pre-encoded buffers with chunk shape None), write them with one ``pwritev`` per run
    of adjacent units, and (``early``) start their writeback. ``record``: None, or
    ``(slots, at)`` to keep the unit's crc32c in (the chunk table, [SP-MAN-7])."""
    bufs: list[Any] = []
    start = units[0][0]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            for pos, data, cshape, itemsize, rec in units:
                enc = data if cshape is None else encode_chunk(data, cshape, itemsize)
                if rec is not None:
                    rec[0][rec[1] : rec[1] + 4] = enc[-1].tobytes()
                if bufs and pos != start + sum(b.nbytes for b in bufs):
                    _flush_run(fd, bufs, start, early)
                    bufs, start = [], pos
                bufs.extend(enc)
            _flush_run(fd, bufs, start, early)
        finally:
            os.close(fd)
    except OSError as e:  # pwritev names no file: a full disk's error then names none
        if e.filename is not None or e.strerror is None:
            raise
        raise OSError(e.errno, e.strerror, path) from e


def _flush_run(fd: int, bufs: list[Any], start: int, early: bool) -> None:
    want = sum(b.nbytes for b in bufs)
    got = pwritev_all(fd, bufs, start)
    if got != want:
        raise OSError(f"short write: {got} of {want} bytes")
    if early:
        start_writeback(fd, start, want)
