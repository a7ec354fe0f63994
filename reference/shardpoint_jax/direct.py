"""Reading and writing whole stored chunks straight from and to their files (spec/format.md
section 7).

A chunk file of this format is the chunk's little-endian bytes (padded to the full chunk
shape at the array's edges) followed by their CRC-32C; a shard is inner chunks of that form
at the offsets its index gives. A region made of whole chunks (or whole inner chunks) needs
nothing else: read each chunk, check its CRC, copy it into place, several chunks at once.
TensorStore does the same work with more copies and bookkeeping: it read the 1.2 GB
benchmark tree from the page cache in 1.3-2.8 s where the files read in 0.25 s. Regions that
cut through chunks (a load into another sharding) still go through TensorStore. The callers
have checked every chunk file's kind and size and every shard index entry
(:meth:`.storage.StoredArray.start_read`) before anything here runs.

A save writes whole chunks only (each chunk has one writer, [SP-GRID-1]): each file is
written with one ``pwritev`` of the chunk's own memory where it is contiguous (a shard's
inner chunks split its leading dimensions, so they are), each unit's CRC after it and a
shard's index at the end; the arrays' ``zarr.json`` were written before.
"""
from __future__ import annotations

import ctypes
import itertools
import math
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np

try:
    import crc32c as _crc32c
except ImportError:    # then every read goes through TensorStore
    _crc32c = None

_POOL: Optional[ThreadPoolExecutor] = None
THREADS = 8
ABSENT = 2**64 - 1      # an index entry's offset for an inner chunk not stored


def available() -> bool:
    return _crc32c is not None


def whole_units(offset: Sequence[int], shape: Sequence[int], array: Sequence[int],
                unit: Sequence[int]) -> bool:
    """Whether the region is made of whole storage units (chunks, or inner chunks of a
    shard): it starts on unit boundaries and ends on one or at the array's end."""
    return all(o % u == 0 and ((o + n) % u == 0 or o + n == d)
               for o, n, d, u in zip(offset, shape, array, unit))


def submit(fn: Callable, *args) -> Future:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="shardpoint-jax-read")
    return _POOL.submit(fn, *args)


def _all(op: Callable, fd: int, bufs: list, pos: int) -> int:
    """``os.preadv`` or ``os.pwritev`` (``op``) of all of ``bufs`` from ``pos``, resumed
    after short transfers; the bytes moved (fewer only at the end of a file being read)."""
    total = 0
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = op(fd, views, pos)
        if n == 0:
            break
        total, pos = total + n, pos + n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def read_region(path_of: Callable[[tuple], str], array: Sequence[int], chunk: Sequence[int],
                inner: Optional[Sequence[int]], dtype: np.dtype, offset: Sequence[int],
                out: np.ndarray, damaged: Callable[[str, str], Exception]) -> None:
    """Fill ``out`` (the region at ``offset``, whole units only) from the chunk files;
    ``damaged(what, spec_id)`` makes the error for a unit that is absent or fails its CRC."""
    stop = [o + n for o, n in zip(offset, out.shape)]
    ranges = [range(o // c, -(-e // c)) for o, e, c in zip(offset, stop, chunk)]
    for idx in itertools.product(*ranges):
        origin = [i * c for i, c in zip(idx, chunk)]
        fd = os.open(path_of(idx), os.O_RDONLY)
        try:
            if inner is None:
                _unit(fd, 0, origin, chunk, array, dtype, offset, out, damaged,
                      f"chunk {list(idx)}")
                continue
            per = [c // i for c, i in zip(chunk, inner)]
            isize = 16 * math.prod(per) + 4
            size = os.fstat(fd).st_size
            index = np.frombuffer(os.pread(fd, isize - 4, size - isize), "<u8").reshape(-1, 2)
            lo = [max(0, o - g) // i for o, g, i in zip(offset, origin, inner)]
            hi = [min(p, -(-(e - g) // i)) for e, g, i, p in zip(stop, origin, inner, per)]
            for cell in itertools.product(*[range(a, b) for a, b in zip(lo, hi)]):
                pos = int(index[np.ravel_multi_index(cell, per)][0]) if per else 0
                if pos == ABSENT:
                    raise damaged(f"chunk {list(idx)}, inner chunk {list(cell)} is missing "
                                  "(absent in its shard's index)", "SP-READ-2")
                iorigin = [g + c * i for g, c, i in zip(origin, cell, inner)]
                _unit(fd, pos, iorigin, inner, array, dtype, offset, out, damaged,
                      f"chunk {list(idx)}, inner chunk {list(cell)}")
        finally:
            os.close(fd)


def _unit(fd: int, pos: int, origin: list, unit: Sequence[int], array: Sequence[int],
          dtype: np.dtype, offset: Sequence[int], out: np.ndarray,
          damaged: Callable[[str, str], Exception], what: str) -> None:
    """One stored unit (``unit``-shaped, at global ``origin``, its bytes then its CRC at
    ``pos``) into its place in ``out``: straight into it when that place is contiguous and
    the unit is not clipped by the array's edge, else through a buffer."""
    nbytes = math.prod(unit) * dtype.itemsize
    valid = [min(u, d - g) for u, d, g in zip(unit, array, origin)]
    dst = out[tuple(slice(g - o, g - o + v) for g, o, v in zip(origin, offset, valid))
              + (Ellipsis,)]   # a view even of a 0-d array
    crc = np.empty(4, np.uint8)
    direct = valid == list(unit) and dst.flags.c_contiguous
    data = dst.reshape(-1).view(np.uint8) if direct else np.empty(nbytes, np.uint8)
    got = _all(os.preadv, fd, [data, crc], pos)
    if got != nbytes + 4 or _crc32c.crc32c(data) != int.from_bytes(crc.tobytes(), "little"):
        raise damaged(f"{what}: its bytes fail their CRC-32C", "SP-READ-3")
    if not direct:
        np.copyto(dst, data.view(dtype).reshape(unit)[tuple(slice(0, v) for v in valid)])


_IOV_MAX = 1024


def write_region(root: str, array: str, shape: Sequence[int], chunk: Sequence[int],
                 inner: Optional[Sequence[int]], offset: Sequence[int],
                 data: np.ndarray) -> list:
    """Write ``data`` (the region at ``offset``: whole chunks) as its chunk files; returns
    their paths. Chunks clipped by the array's edge are stored padded with zeros."""
    stop = [o + n for o, n in zip(offset, data.shape)]
    paths = []
    for idx in itertools.product(*[range(o // c, -(-e // c))
                                   for o, e, c in zip(offset, stop, chunk)]):
        origin = [i * c for i, c in zip(idx, chunk)]
        valid = [min(c, d - g) for c, d, g in zip(chunk, shape, origin)]
        part = data[tuple(slice(g - o, g - o + v) for g, o, v in zip(origin, offset, valid))
                    + (Ellipsis,)]
        if valid != list(chunk):
            full = np.zeros(tuple(chunk), data.dtype)
            full[tuple(slice(0, v) for v in valid) + (Ellipsis,)] = part
            part = full
        path = os.path.join(root, array, "c", *map(str, idx))
        _write_chunk(path, np.ascontiguousarray(part), inner, valid)
        paths.append(path)
    return paths


def _write_chunk(path: str, data: np.ndarray, inner: Optional[Sequence[int]],
                 valid: Sequence[int]) -> None:
    bufs: list = []
    if inner is None:
        raw = data.reshape(-1).view(np.uint8)
        bufs += [raw, _crc_bytes(raw)]
    else:
        per = [c // i for c, i in zip(data.shape, inner)]
        index, pos = [], 0
        for cell in itertools.product(*[range(p) for p in per]):
            if any(c * i >= v for c, i, v in zip(cell, inner, valid)):
                index += [ABSENT, ABSENT]     # wholly outside the array: not stored
                continue
            box = tuple(slice(c * i, (c + 1) * i) for c, i in zip(cell, inner))
            raw = np.ascontiguousarray(data[box]).reshape(-1).view(np.uint8)
            bufs += [raw, _crc_bytes(raw)]
            index += [pos, raw.nbytes + 4]
            pos += raw.nbytes + 4
        idx = np.asarray(index, "<u8").view(np.uint8)
        bufs += [idx, _crc_bytes(idx)]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                 0o644)
    try:
        pos = 0
        for i in range(0, len(bufs), _IOV_MAX):
            group = bufs[i:i + _IOV_MAX]
            want = sum(b.nbytes for b in group)
            if _all(os.pwritev, fd, group, pos) != want:
                raise OSError(f"short write of {path}")
            pos += want
        if EARLY_WRITEBACK:
            _start_writeback(fd, pos)
    finally:
        os.close(fd)


EARLY_WRITEBACK = True
_SFR: Optional[Callable] = None


def _start_writeback(fd: int, nbytes: int) -> None:
    """Ask the kernel to start writing the file back now (Linux ``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE``), so the disk works while the next chunks are still being
    written; the save's one ``syncfs`` at the end then waits for less. A hint: where the
    call is missing or fails, nothing happens."""
    global _SFR
    if _SFR is None:
        _SFR = lambda *_a: 0   # noqa: E731 - until a real one is found
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                _SFR = fn
            except (OSError, AttributeError):
                pass
    _SFR(fd, 0, nbytes, 2)     # SYNC_FILE_RANGE_WRITE


def _crc_bytes(raw: np.ndarray) -> np.ndarray:
    return np.frombuffer(_crc32c.crc32c(raw).to_bytes(4, "little"), np.uint8)
