"""[SP-SEC-6] for the data objects of a packed checkpoint on local files (format 1.4,
[SP-PACK-7]): an object whose apparent size storage does not back (a sparse file) could make
a reader allocate, and fill, gigabytes for records that read as zeros. Before a tensor is
allocated, every record of it that reaches into a hole of its object is checked from the
bytes stored (the CRC-32C extended over each hole's zeros arithmetically,
:mod:`.sparse`): a plain chunk by its crc32c, a shard by its index (which may not lie in a
hole) and each inner chunk reaching into one. Sound objects are not sparse: the writer
writes its alignment padding.
"""

from __future__ import annotations

import math
import os
from typing import Any

import crc32c
import numpy as np

from shardpoint_core.arrays.sparse import SPARSE_SLACK, _holes, crc_of_range, data_extents
from shardpoint_core.format.errors import CorruptCheckpointError


def _refuse(key: str, path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {key!r}: data object {path}: sparse (storage does not hold all its bytes) "
        f"and {what} ([SP-SEC-6])",
        spec_id="SP-READ-3",
    )


def _stored(fd: int, pos: int) -> int:
    return int.from_bytes(os.pread(fd, 4, pos).ljust(4, b"\0"), "little")


def check_sparse_object(
    path: str, part: Any, obj: int, key: str, chunk: Any, itemsize: int
) -> bool:
    """Check the records of ``part`` (a PackedArray) in object number ``obj`` (the file
    ``path``) that reach into its holes; True when the object is sparse (so each tensor's
    records are checked on their own), False when storage holds it."""
    st = os.lstat(path)
    if st.st_blocks * 512 + SPARSE_SLACK >= st.st_size:
        return False
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        ext = data_extents(fd, st.st_size)
        if sum(b - a for a, b in ext) + SPARSE_SLACK >= st.st_size:
            return False
        holes = _holes(ext, st.st_size)
        recs = part.records[part.records["object"] == obj]
        for r in recs:
            off, n = int(r["offset"]), int(r["length"])
            if not any(a < off + n and b > off for a, b in holes):
                continue
            if part.inner is None:
                if crc_of_range(fd, off, n - 4, ext) != _stored(fd, off + n - 4):
                    raise _refuse(key, path, f"chunk {int(r['chunk'])} fails its crc32c")
                continue
            _check_shard(fd, path, off, n, holes, ext, key, chunk, part.inner, itemsize)
        return True
    finally:
        os.close(fd)


def _check_shard(
    fd: int,
    path: str,
    off: int,
    n: int,
    holes: list[Any],
    ext: list[Any],
    key: str,
    chunk: Any,
    inner: Any,
    itemsize: int,
) -> None:
    units = math.prod(c // i for c, i in zip(chunk, inner))
    isz = 16 * units
    istart = off + n - isz - 4
    if any(a < off + n and b > istart for a, b in holes):
        raise _refuse(key, path, "a shard index lies partly in a hole")
    raw = os.pread(fd, isz + 4, istart)
    if crc32c.crc32c(raw[:isz]) != int.from_bytes(raw[isz:], "little"):
        return  # the shard's own check reports it ([SP-READ-3])
    index = np.frombuffer(raw[:isz], "<u8").reshape(units, 2)
    nb = math.prod(inner) * itemsize + 4
    for pos, size in index:
        if pos == 2**64 - 1 or size != nb or int(pos) + nb > n:
            continue  # absent, or the shard's own checks report it
        a0 = off + int(pos)
        if any(a < a0 + nb and b > a0 for a, b in holes) and crc_of_range(
            fd, a0, nb - 4, ext
        ) != _stored(fd, a0 + nb - 4):
            raise _refuse(key, path, f"an inner chunk at {a0} fails its crc32c")
