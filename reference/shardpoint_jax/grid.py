"""Chunk-grid choice (pure; spec/format.md [SP-GRID-1]): the saving layout itself when it is a
regular grid, otherwise the coarsest grid whose cells each lie inside one saved block, so every
chunk has exactly one writer and no data moves between processes."""

from __future__ import annotations

import math
from typing import Sequence

from shardpoint_core.format.coverage import check_exact_cover

LOCAL_CHUNK_BYTES = 64 << 20


def dim_chunk(n: int, spans: Sequence[tuple]) -> int:
    """Chunk length along a dimension of size ``n`` cut into ``spans`` (start, stop)."""
    cuts = sorted({(a, b) for a, b in spans if b > a})
    if not cuts:
        return max(1, n)
    c = cuts[0][1] - cuts[0][0]
    if all(a == i * c and b == min(n, a + c) for i, (a, b) in enumerate(cuts)) and cuts[-1][1] == n:
        return c  # even or ceil-div split: the blocks are the chunks
    g = 0
    for a, b in cuts:
        g = math.gcd(g, math.gcd(a, b))
    return max(1, math.gcd(g, n) if g else n)


def chunk_shape(key: str, shape: Sequence[int], blocks: Sequence[Sequence[tuple]]) -> list:
    """Chunk shape for ``shape`` saved as ``blocks`` (each a list of (start, stop) per dim).
    Raises unless the distinct non-empty blocks tile ``shape`` exactly once: the core's
    coverage rules ([SP-COVER-2] a gap, [SP-COVER-3] an overlap)."""
    if not shape:
        return []
    if math.prod(shape) == 0:
        return [max(1, n) for n in shape]
    distinct = sorted({tuple(b) for b in blocks if all(e > s for s, e in b)})
    boxes = [(tuple(s for s, _ in b), tuple(e - s for s, e in b)) for b in distinct]
    check_exact_cover(shape, boxes, lambda i: f"device block {list(distinct[i])}", key)
    return [dim_chunk(n, [b[d] for b in distinct]) for d, n in enumerate(shape)]


def local_chunk_shape(shape: Sequence[int], itemsize: int) -> list:
    """Chunks of an array one process writes whole: rows up to 64 MiB per chunk."""
    if not shape:
        return []
    if math.prod(shape) == 0:
        return [max(1, n) for n in shape]
    row = math.prod(shape[1:]) * itemsize
    return [max(1, min(shape[0], LOCAL_CHUNK_BYTES // max(1, row)))] + list(shape[1:])
