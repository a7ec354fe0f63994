"""What the format says of one stored array and where the manifest lives: the vocabulary the
array layer, the committers and the transactions share (format.md sections 5 and 7)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

MANIFEST_NAME = "manifest.msgpack"


@dataclass(frozen=True)
class ArraySpec:
    """Shape, dtype (spec name) and chunk grid of one stored tensor, as the manifest says;
    ``chunk_crc32c``: the manifest's table of every stored unit's crc32c ([SP-MAN-7]), which
    a reader checks each unit it reads against ([SP-READ-8]), or None."""

    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    chunk_crc32c: Optional[bytes] = field(default=None, compare=False, repr=False)
    #: (1.4) where the chunks lie in a packed checkpoint (a
    #: :class:`~shardpoint_core.format.packed.PackedArray`), None in the per-array layout
    packed: Optional[Any] = field(default=None, compare=False, repr=False)
    #: (1.5) for a writer: the ``zstd`` codec object its chunks are compressed with
    #: (:func:`~shardpoint_core.format.compression.zstd_codec`), None for the plain chain. A
    #: reader learns an array's chain from its zarr.json, never from here.
    compression: Optional[dict[str, Any]] = field(default=None, compare=False, repr=False)
