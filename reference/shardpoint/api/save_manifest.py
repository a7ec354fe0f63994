"""The tensor entries of the manifest a save publishes, each with its chunk table merged from
the ranks' commit reports ([SP-MAN-7]).
"""

from __future__ import annotations

import msgpack

from shardpoint_core.format.manifest import TensorEntry, array_path_for
from shardpoint_core.arrays.identity import join_tables


def _entries(tensors: dict, payloads: list) -> dict:
    """The manifest's tensor entries, each with its chunk table ([SP-MAN-7]) where every
    chunk's writer recorded its units' crc32c (``payloads``: the ranks' commit reports)."""
    merged: dict = {}  # array path -> chunk number -> its units' crc32c, every rank's
    for p in payloads:  # one pass over what the ranks sent, not one per tensor and rank
        for path, chunks in msgpack.unpackb(p, raw=False) if p else ():
            merged.setdefault(path, {}).update(chunks)
    out = {}
    for k, v in tensors.items():
        path = array_path_for(k)
        out[k] = TensorEntry(
            k,
            path,
            v.shape,
            v.dtype,
            v.chunk_shape,
            join_tables([merged], path, v.shape, v.chunk_shape),
        )
    return out
