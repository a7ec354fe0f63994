"""Whole-tensor reads of a packed checkpoint on local files straight into the destination
(format 1.4, spec/format.md section 13): what :mod:`.direct_read` does for chunk files.

Where a tensor is read whole into a C-contiguous array and its chunks (and a shard's inner
chunks) span whole rows (every dimension but the first), each (inner) chunk's elements land
in one contiguous run of the destination: one ``preadv`` per (inner) chunk reads them there,
and the padding of an edge chunk and the 4 crc32c bytes into a small scratch buffer. The
checks are the Zarr layer's ([SP-READ-3], [SP-READ-5], [SP-READ-7], shard indexes read by
:func:`~.array.read_shard_index`), the chunk table's ([SP-READ-8]) and the record's
crc32c ([SP-PACK-6]); any other read goes to :func:`~.packed.read_packed`'s general path.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, List, Optional

import crc32c
import numpy as np

from shardpoint_core.arrays.array import ABSENT, chunk_key, inner_stride, read_shard_index
from shardpoint_core.arrays.identity import check_unit
from shardpoint_core.format.errors import CorruptCheckpointError


def _bad(key: str, where: str, msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"tensor {key!r}: {where}: {msg}", spec_id=sid)


def applies(view: Any, offset: Any, out: np.ndarray) -> bool:
    """Whether :func:`read_whole` can read this box (else the general path does)."""
    lay = view.layout
    return (
        bool(view.store.capabilities.local_path)
        and hasattr(view.store, "path")
        and sys.byteorder == "little"
        and lay.dtype != "bool"
        and lay.zstd_level is None  # (1.5) compressed chunks are decoded by the Zarr layer
        and tuple(out.shape) == tuple(lay.shape)
        and not any(offset)
        and out.flags.c_contiguous
        and out.size > 0
        and tuple(lay.chunk[1:]) == tuple(lay.shape[1:])
        and (lay.inner is None or tuple(lay.inner[1:]) == tuple(lay.chunk[1:]))
    )


def read_whole(
    view: Any, out: np.ndarray, submit: Optional[Callable[..., Any]] = None
) -> List[Any]:
    """Read the whole tensor of ``view`` into ``out`` (:func:`applies` said yes): one task
    per chunk, submitted (their futures returned) or run here (``[]`` returned)."""
    lay = view.layout
    flat = out.reshape(-1).view(np.uint8)
    rows = lay.shape[0] if lay.shape else 1
    row = lay.itemsize * math.prod(lay.shape[1:]) if lay.shape else lay.itemsize
    c0 = lay.chunk[0] if lay.chunk else 1
    grid = -(-rows // c0)
    tasks = [
        (_shard if lay.inner is not None else _plain, view, flat, c, c0, rows, row)
        for c in range(grid)
    ]
    if submit is None:
        for fn, *args in tasks:
            fn(*args)
        return []
    return [submit(fn, *args) for fn, *args in tasks]


def _open(view: Any, path: str) -> int:
    full = f"{view.prefix}/{path}" if view.prefix else path
    return os.open(
        view.store.path(full),
        os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
    )


def _read_unit(fd: int, dst: memoryview, pad: int, at: int, key: str, where: str) -> int:
    """Elements into ``dst`` and ``pad`` padding bytes + the crc32c into scratch, from
    ``at``; checked; returns the stored crc32c."""
    tail = bytearray(pad + 4)
    want = len(dst) + len(tail)
    got = 0
    bufs: List[Any] = [dst, memoryview(tail)]
    while got < want:
        n = os.preadv(fd, bufs, at + got)
        if n <= 0:
            raise _bad(
                key,
                where,
                f"the data object ends {want - got} bytes early (truncated)",
                "SP-READ-3",
            )
        got += n
        bufs = _rest([dst, memoryview(tail)], got)
    crc = crc32c.crc32c(tail[:pad], crc32c.crc32c(dst))
    stored = int.from_bytes(tail[pad:], "little")
    if crc != stored:
        raise _bad(key, where, "crc32c mismatch", "SP-READ-3")
    return stored


def _rest(bufs: List[memoryview], skip: int) -> List[Any]:
    out: List[Any] = []
    for b in bufs:
        if skip >= len(b):
            skip -= len(b)
            continue
        out.append(b[skip:])
        skip = 0
    return out


def _plain(view: Any, flat: np.ndarray, c: int, c0: int, rows: int, row: int) -> None:
    lay, key = view.layout, view.key
    path, off, n, crc = view.part.chunk(c)
    where = f"chunk {c}: bytes {off}..{off + n} of data object {path}"
    valid = (min(rows, (c + 1) * c0) - c * c0) * row
    full = n - 4
    fd = _open(view, path)
    try:
        stored = _read_unit(
            fd, memoryview(flat[c * c0 * row : c * c0 * row + valid]), full - valid, off, key, where
        )
    finally:
        os.close(fd)
    if stored != crc:
        raise _bad(
            key,
            where,
            f"its stored crc32c {stored:08x} is not the {crc:08x} its "
            "record names: the record points at another chunk's bytes",
            "SP-READ-8",
        )
    check_unit(lay.crcs, c, stored, key, where)


def _shard(view: Any, flat: np.ndarray, c: int, c0: int, rows: int, row: int) -> None:
    lay, key = view.layout, view.key
    cidx = (c,) + (0,) * (len(lay.shape) - 1)
    index, _size = read_shard_index(view, chunk_key(view.part.name, cidx), lay, key)
    path, off, n, _crc = view.part.chunk(c)
    k0 = lay.shard_inner[0]
    nb, _gap = inner_stride(lay)
    units = c0 // k0
    fd = _open(view, path)
    try:
        for j in range(units):
            start = c * c0 + j * k0
            if start >= rows:
                continue  # wholly outside the tensor: never read
            where = (
                f"chunk {c} inner chunk {j}: data object {path} (chunk at bytes {off}..{off + n})"
            )
            pos, size = int(index[j][0]), int(index[j][1])
            if pos == ABSENT:
                raise _bad(key, where, "stored inner chunk is missing", "SP-READ-2")
            valid = (min(rows, start + k0) - start) * row
            stored = _read_unit(
                fd,
                memoryview(flat[start * row : start * row + valid]),
                size - 4 - valid,
                off + pos,
                key,
                where,
            )
            check_unit(lay.crcs, c * units + j, stored, key, where)
    finally:
        os.close(fd)
