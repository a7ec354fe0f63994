"""Files whose apparent size storage does not back ([SP-SEC-6]): a sparse file is cheap to
make (``truncate -s 16G``) and reads as zeros where it has holes, so a 12 MiB checkpoint can
declare, and pass every size rule with, a 16 GiB chunk; a reader that allocates for it
before it finds the checksum wrong is killed for memory first.

Before a reader allocates for a local chunk file it compares the file's size with what
storage holds for it (``st_blocks``, confirmed with ``SEEK_DATA``/``SEEK_HOLE`` since some
file systems report blocks late). A file with holes is not refused for having them (a file
system that stores zero blocks as holes, or ``rsync -S``, makes sound checkpoints sparse):
each checksummed unit that reaches into a hole is checked first, reading only the bytes
storage holds and extending the CRC-32C over the zeros of each hole arithmetically, so the
check costs time and memory in proportion to what is stored, never to the apparent size.

Example::

    check_sparse_chunks(entries, meta, itemsize, "w")   # raises CorruptCheckpointError
"""

from __future__ import annotations

import bisect
import errno
import math
import os
from typing import Any, Iterable, List, Optional, Tuple

import crc32c
import numpy as np

from shardpoint_core.format.errors import CorruptCheckpointError

#: Holes a file may have before the bytes storage holds are counted and checked (tiny files
#: stored inline report no blocks; writers write every byte, padding included).
SPARSE_SLACK = 64 << 10
_PIECE = 16 << 20  # bytes read at a time while checking a sparse unit
_POLY = 0x82F63B78  # CRC-32C, reflected


def _times(mat: List[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: List[int]) -> List[int]:
    return [_times(mat, m) for m in mat]


def _zero_operators() -> List[List[int]]:
    """The CRC register's update over 2^k zero bytes, k = 0..63 (GF(2) matrices as columns)."""
    bit = [_POLY] + [1 << (i - 1) for i in range(1, 32)]  # one zero bit
    op = bit
    for _ in range(3):
        op = _square(op)  # 8 bits: one byte
    ops = [op]
    for _ in range(63):
        ops.append(_square(ops[-1]))
    return ops


_ZERO_OPS: Optional[List[List[int]]] = None


def crc32c_zeros(crc: int, n: int) -> int:
    """``crc32c.crc32c(bytes(n), crc)`` without the ``n`` bytes: O(log n)."""
    global _ZERO_OPS
    if n <= 0:
        return crc
    if _ZERO_OPS is None:
        _ZERO_OPS = _zero_operators()
    r = crc ^ 0xFFFFFFFF
    k = 0
    while n:
        if n & 1:
            r = _times(_ZERO_OPS[k], r)
        n >>= 1
        k += 1
    return r ^ 0xFFFFFFFF


def data_extents(fd: int, size: int) -> List[Tuple[int, int]]:
    """The ``[start, end)`` regions of the file that storage holds (``SEEK_DATA`` /
    ``SEEK_HOLE``); the whole file where the system cannot tell. The number of regions is
    bounded by the blocks stored."""
    seek_data, seek_hole = getattr(os, "SEEK_DATA", None), getattr(os, "SEEK_HOLE", None)
    if seek_data is None or seek_hole is None:
        return [(0, size)]
    out: List[Tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, seek_data)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data after pos
                    break
                raise
            end = min(size, os.lseek(fd, start, seek_hole))
            if start >= size or end <= start:
                break
            out.append((start, end))
            pos = end
    except OSError:
        return [(0, size)]
    return out


def crc_of_range(fd: int, start: int, length: int, extents: List[Tuple[int, int]]) -> int:
    """CRC-32C of ``length`` bytes from ``start``, holes taken as the zeros they read as:
    only the bytes storage holds are read (``_PIECE`` at a time)."""
    end = start + length
    c, pos = 0, start
    i = max(0, bisect.bisect_right(extents, (start, 1 << 64)) - 1)
    for a, b in extents[i:]:
        if a >= end:
            break
        if b <= pos:
            continue
        if a > pos:
            c = crc32c_zeros(c, a - pos)
            pos = a
        stop = min(b, end)
        while pos < stop:
            piece = os.pread(fd, min(_PIECE, stop - pos), pos)
            if not piece:
                raise OSError(errno.EIO, "short read")
            c = crc32c.crc32c(piece, c)
            pos += len(piece)
    return crc32c_zeros(c, end - pos)


def _holes(extents: List[Tuple[int, int]], size: int) -> List[Tuple[int, int]]:
    out, pos = [], 0
    for a, b in extents:
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < size:
        out.append((pos, size))
    return out


def _refuse(key: str, path: str, held: int, size: int, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {key!r}: chunk file {path!r} is sparse (storage holds {held} of its {size} "
        f"bytes; the rest reads as zeros) and {what}: refused before allocating for it "
        "([SP-SEC-6])",
        spec_id="SP-READ-3",
    )


def _stored_crc(fd: int, pos: int) -> int:
    return int.from_bytes(os.pread(fd, 4, pos).ljust(4, b"\0"), "little")


def check_sparse_file(
    path: str, size: int, blocks: int, key: str, n_inner: Optional[int] = None, inner_bytes: int = 0
) -> None:
    """[SP-SEC-6] for one chunk file of ``size`` bytes and ``blocks`` 512-byte blocks: nothing
    when storage holds (nearly) all of it; else every checksummed unit reaching into a hole
    is checked now, from the bytes stored (a plain chunk: the file; a shard of ``n_inner``
    inner chunks of ``inner_bytes`` each: its index, which may not lie in a hole, and each
    inner chunk)."""
    if blocks * 512 + SPARSE_SLACK >= size:
        return
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        return  # the read that needs it reports it, by its rule
    try:
        ext = data_extents(fd, size)
        held = sum(b - a for a, b in ext)
        if held + SPARSE_SLACK >= size:
            return
        if n_inner is None:
            if crc_of_range(fd, 0, size - 4, ext) != _stored_crc(fd, size - 4):
                raise _refuse(key, path, held, size, "its crc32c does not match")
            return
        _check_sparse_shard(fd, path, size, ext, held, key, n_inner, inner_bytes)
    finally:
        os.close(fd)


def _check_sparse_shard(
    fd: int,
    path: str,
    size: int,
    ext: list[Any],
    held: int,
    key: str,
    n_inner: int,
    inner_bytes: int,
) -> None:
    from shardpoint_core.arrays.checks import EMPTY_ENTRY, check_shard_index

    isz = 16 * n_inner
    istart = size - isz - 4
    holes = _holes(ext, size)
    if any(b > istart for _a, b in holes):
        # zeros in an index are entries (0, 0), which no sound index holds ([SP-READ-5])
        raise _refuse(key, path, held, size, "its shard index lies partly in a hole")
    raw = os.pread(fd, isz + 4, istart)
    if len(raw) != isz + 4 or crc32c.crc32c(raw[:isz]) != int.from_bytes(raw[isz:], "little"):
        return  # the shard's own check reports the index ([SP-READ-3])
    index = np.frombuffer(raw[:isz], "<u8").reshape(n_inner, 2)
    check_shard_index(index, istart, key, f"shard {path!r}")  # [SP-READ-7] first
    present = index[index[:, 0] != EMPTY_ENTRY]
    if (present[:, 1] != inner_bytes).any():
        return  # [SP-READ-5], reported by the shard's own check
    off = np.sort(present[:, 0].astype(np.int64))
    ends = off + inner_bytes
    zero_crc = None
    for a, b in holes:
        lo = int(np.searchsorted(ends, a, side="right"))  # first entry ending after a
        hi = int(np.searchsorted(off, b, side="left"))  # entries starting before b
        if hi <= lo:
            continue
        edges = sorted({j for j in (lo, hi - 1) if off[j] < a or ends[j] > b})
        for j in edges:  # reaching into the hole from stored bytes
            o = int(off[j])
            if crc_of_range(fd, o, inner_bytes - 4, ext) != _stored_crc(fd, o + inner_bytes - 4):
                raise _refuse(
                    key, path, held, size, f"the inner chunk at offset {o} fails its crc32c"
                )
        if hi - lo > len(edges):  # wholly in the hole: zeros, crc32c 0 included
            if zero_crc is None:
                zero_crc = crc32c_zeros(0, inner_bytes - 4)
            if zero_crc != 0:
                o = int(off[lo + 1 if lo in edges else lo])
                raise _refuse(
                    key,
                    path,
                    held,
                    size,
                    f"the inner chunk at offset {o} lies in a hole, where its crc32c reads as 0",
                )


def check_sparse_chunks(
    entries: Iterable[os.DirEntry[str]], meta: dict[str, Any], itemsize: int, key: str
) -> None:
    """:func:`check_sparse_file` for each chunk file listed by ``scan_array`` (their
    ``lstat`` is cached in the entries: no system call for a file storage backs)."""
    codec = meta["codecs"][0]
    n_inner, inner_bytes = None, 0
    if codec.get("name") == "sharding_indexed":
        chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
        inner = codec["configuration"]["chunk_shape"]
        n_inner = math.prod(c // i for c, i in zip(chunk, inner))
        inner_bytes = math.prod(inner) * itemsize + 4
    for e in entries:
        st = e.stat(follow_symlinks=False)
        if st.st_blocks * 512 + SPARSE_SLACK < st.st_size:
            check_sparse_file(e.path, st.st_size, st.st_blocks, key, n_inner, inner_bytes)
