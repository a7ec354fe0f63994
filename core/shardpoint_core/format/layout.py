"""The chunk layout and codec chains this backend writes (spec/format.md section 7): plain
``bytes`` + ``crc32c`` chunks, or, above a size, shards of inner chunks that each carry their
own checksum, so a reader can fetch part of a large chunk without reading all of it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from shardpoint_core.format.spec import ArraySpec

#: The chunking choices of every writer of this project (both front ends, converters, the
#: conformance builder), so one state saved from any of them gets the same files: a chunk
#: bigger than ``SHARD_ABOVE_BYTES`` is stored as a shard of inner chunks of at most
#: ``INNER_CHUNK_BYTES`` each (a reader of part of it fetches only the inner chunks it needs).
SHARD_ABOVE_BYTES = 8 << 20
INNER_CHUNK_BYTES = 2 << 20

BYTES_CRC = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def fill_value(dtype: str) -> Any:
    """The fill value written for ``dtype``: zero ([SP-ARRAY-3])."""
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    if dtype.startswith(("float", "bfloat")):
        return 0.0
    return 0


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if d <= limit and d > best:
                    best = d
        i += 1
    return best


def inner_chunk_shape(chunk: Sequence[int], itemsize: int, target: int) -> tuple[Any, ...]:
    """Inner chunks of a shard: divisors of ``chunk``, split from the first dimension on,
    until one inner chunk is at most ``target`` bytes (or every dimension is split to 1)."""
    inner = list(chunk)
    for d in range(len(inner)):
        rest = math.prod(inner[d + 1 :]) * itemsize
        if rest * inner[d] <= target:
            break
        inner[d] = _largest_divisor_at_most(inner[d], max(1, target // max(rest, 1)))
    return tuple(inner)


def codecs_for(spec: ArraySpec, itemsize: int, shard_above: int, inner_target: int) -> list[Any]:
    """The codec chain the writer uses: bytes+crc32c, or sharding_indexed for large chunks;
    (1.5) bytes+zstd+crc32c whatever the chunk's size when ``spec.compression`` is set
    (compressed arrays are not sharded, [SP-ARRAY-7])."""
    if spec.compression is not None:
        return [BYTES_CRC[0], dict(spec.compression), BYTES_CRC[1]]
    nbytes = math.prod(spec.chunk_shape) * itemsize
    if spec.chunk_shape and nbytes > shard_above:
        inner = inner_chunk_shape(spec.chunk_shape, itemsize, inner_target)
        if inner != tuple(spec.chunk_shape):
            return [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(inner),
                        "codecs": BYTES_CRC,
                        "index_codecs": BYTES_CRC,
                        "index_location": "end",
                    },
                }
            ]
    return BYTES_CRC
