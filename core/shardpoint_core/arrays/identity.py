"""Chunk identity (format 1.3, [SP-MAN-7], [SP-READ-8]): the manifest's table of every stored
unit's crc32c, which binds each chunk file to its tensor and grid position.

A *unit* is what carries a crc32c of its own: a plain chunk, or an inner chunk of a shard.
Units are numbered chunk by chunk in row-major grid order and, inside a shard, inner chunk by
inner chunk in row-major order; the table holds the 4 stored crc32c bytes of unit ``u`` at
``4*u`` (zeros for an inner chunk wholly outside the tensor, which is never read). The chunk
bytes do not change, so every Zarr reader still reads them; a reader that knows the table
compares each unit's stored crc32c with its entry, so a chunk swapped with another of the
same size (between positions or tensors) is refused instead of read.

Writers collect the crc32c their encoder computes anyway (:class:`CrcSink`), ranks send them
with their success report, and the coordinator joins them (:func:`join_tables`): no extra
pass over the data.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from shardpoint_core.format.errors import CorruptCheckpointError


def units_per_chunk(chunk: Sequence[int], inner: Optional[Sequence[int]]) -> int:
    """Units one chunk file holds: 1 for a plain chunk, the inner chunks of a shard."""
    return 1 if inner is None else math.prod(c // i for c, i in zip(chunk, inner))


def chunk_count(shape: Sequence[int], chunk: Sequence[int]) -> int:
    """Chunks of the grid (none for a tensor with a zero dimension; one for a 0-d one)."""
    return math.prod(-(-n // c) for n, c in zip(shape, chunk))


def table_of(
    raw: Optional[bytes],
    shape: Sequence[int],
    chunk: Sequence[int],
    inner: Optional[Sequence[int]],
    key: str,
    where: str,
) -> Optional[np.ndarray]:
    """The manifest's table for an array laid out so, as uint32 (None without a table); one
    of another length is [SP-READ-8]: it cannot describe this array's units."""
    if raw is None:
        return None
    want = chunk_count(shape, chunk) * units_per_chunk(chunk, inner)
    if len(raw) != 4 * want:
        raise CorruptCheckpointError(
            f"tensor {key!r}: {where}: the manifest's chunk table has {len(raw) // 4} "
            f"entries; the array as its zarr.json lays it out has {want} stored units "
            "([SP-MAN-7])",
            spec_id="SP-READ-8",
        )
    return np.frombuffer(raw, "<u4")


def unit_of(
    origin: Sequence[int],
    shape: Sequence[int],
    chunk: Sequence[int],
    inner: Optional[Sequence[int]],
) -> int:
    """The unit number of the (inner) chunk whose first element sits at global ``origin``."""
    u = 0
    for o, n, c in zip(origin, shape, chunk):
        u = u * -(-n // c) + o // c
    if inner is None:
        return u
    i = 0
    for o, c, k in zip(origin, chunk, inner):
        i = i * (c // k) + (o % c) // k
    return u * units_per_chunk(chunk, inner) + i


def unit_matches(table: Optional[np.ndarray], unit: int, stored: int) -> bool:
    """True when there is no table or its entry for ``unit`` is the stored crc32c."""
    return table is None or int(table[unit]) == stored


def check_unit(table: Optional[np.ndarray], unit: int, stored: int, key: str, where: str) -> None:
    """[SP-READ-8]: the unit's stored crc32c is the one the manifest recorded for its place."""
    if table is not None and not unit_matches(table, unit, stored):
        raise CorruptCheckpointError(
            f"tensor {key!r}: {where}: its crc32c {stored:08x} is not the {int(table[unit]):08x} "
            "the manifest's chunk table records for this position: it holds another chunk's "
            "bytes (swapped or stale)",
            spec_id="SP-READ-8",
        )


class CrcSink:
    """What one process's writes recorded: array path -> chunk number -> the chunk's units'
    crc32c bytes. Encoders fill a chunk's slots as they encode it (distinct slots per task)."""

    def __init__(self) -> None:
        self._arrays: Dict[str, Dict[int, bytearray]] = {}
        self._lock = threading.Lock()

    def chunk(self, array_path: str, flat: int, units: int) -> bytearray:
        """The slots of chunk ``flat`` (a fresh zeroed buffer: a rewrite starts over)."""
        buf = bytearray(4 * units)
        with self._lock:
            self._arrays.setdefault(array_path, {})[flat] = buf
        return buf

    def take(self) -> Dict[str, Dict[int, bytes]]:
        with self._lock:
            out, self._arrays = self._arrays, {}
        return {p: {f: bytes(b) for f, b in d.items()} for p, d in out.items()}


def chunk_number(cidx: Sequence[int], shape: Sequence[int], chunk: Sequence[int]) -> int:
    """Row-major number of chunk ``cidx`` in the grid."""
    u = 0
    for i, n, c in zip(cidx, shape, chunk):
        u = u * -(-n // c) + i
    return u


def join_tables(
    reports: Iterable[Dict[str, Dict[int, bytes]]],
    array_path: str,
    shape: Sequence[int],
    chunk: Sequence[int],
) -> Optional[bytes]:
    """The coordinator's table for one array from every rank's report, or None when some
    chunk was written by a path that records nothing (the table is then left out: a writer
    MAY omit it, [SP-MAN-7]) or the reports disagree on a chunk's unit count."""
    n = chunk_count(shape, chunk)
    if n == 0:
        return None
    parts: Dict[int, bytes] = {}
    for rep in reports:
        parts.update(rep.get(array_path, {}))
    if len(parts) != n or any(not 0 <= f < n for f in parts):
        return None
    sizes = {len(b) for b in parts.values()}
    if len(sizes) != 1:
        return None
    return b"".join(parts[f] for f in range(n))
