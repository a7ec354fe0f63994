"""The packed layout's index (format 1.4, spec/format.md section 13): where every chunk of
every array lies in a checkpoint's data objects, as the manifest's top-level field
``"packed"`` holds it. Pure: values in, values out, no I/O.

The field is ``{"objects": [[path, size], ...], "arrays": [[name, inner], ...],
"index": <bin>}`` with, in an incremental checkpoint, ``"bases": [[name, identity], ...]``
(the sibling checkpoints whose objects it names, [SP-PACK-9]; an object of a base is
``[path, size, base]``) and ``"hashes"`` (16 bytes of BLAKE3 per record, [SP-PACK-10]);
(1.5) a compressed array's entry is ``[name, nil, codec]``, its records' lengths held to
[SP-READ-9]'s bounds ([SP-PACK-12]); the
index is a run of 36-byte little-endian records ``(array u32,
object u32, chunk u64, offset u64, length u64, crc32c 4 bytes)`` in strictly increasing
``(array, chunk)`` order, one per chunk of every array ([SP-PACK-4]). :func:`decode_packed`
applies every reader check of [SP-PACK-2] to [SP-PACK-5] with whole-array operations (the
index is bounded by the manifest's 1 GiB cap, so nothing here allocates more than the
manifest holds); :func:`encode_packed` builds the field from writers' records and checks
it the same way, so a writer cannot commit what a reader refuses.

This module is the codec's entry point: :func:`encode_packed` is here and every other
public name is re-exported from where it lives: the index's data types and constants in
:mod:`~shardpoint_core.format.packed_index`, the reader checks in
:mod:`~shardpoint_core.format.packed_decode`.

Example::

    idx = PackedIndex([("packed/w0-0.bin", 44)], [("tensors/w", None)],
                      records_of([(0, 0, 0, 0, 44, b"\\x01\\x02\\x03\\x04")]))
    field = encode_packed(idx, {"tensors/w": entry})       # entry: shape, dtype, chunk_shape
    again = decode_packed(field, {"tensors/w": entry})
    again.chunk("tensors/w", 0)    # -> (object path, offset, length, crc32c)
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from shardpoint_core.format.packed_decode import decode_packed
from shardpoint_core.format.packed_index import (
    BASE_PREFIX,
    FIELD,
    FORMAT_VERSION_1_4,
    HASH_BYTES,
    HASH_NAME,
    IDENTITY_BYTES,
    MAX_OBJECTS,
    MAX_SIZE,
    RECORD,
    RECORD_BYTES,
    ArrayInfo,
    PackedArray,
    PackedIndex,
    chunk_count,
    chunk_hash,
    is_zstd,
    records_of,
)

__all__ = [
    "ArrayInfo",
    "BASE_PREFIX",
    "FIELD",
    "FORMAT_VERSION_1_4",
    "HASH_BYTES",
    "HASH_NAME",
    "IDENTITY_BYTES",
    "MAX_OBJECTS",
    "MAX_SIZE",
    "PackedArray",
    "PackedIndex",
    "RECORD",
    "RECORD_BYTES",
    "chunk_count",
    "chunk_hash",
    "decode_packed",
    "encode_packed",
    "is_zstd",
    "records_of",
]


def encode_packed(index: PackedIndex, arrays: Mapping[str, ArrayInfo]) -> dict[str, Any]:
    """The manifest field of ``index`` (records sorted here), checked as a reader checks it
    against the tensor entries ``arrays`` (array name -> entry): a writer's bug fails the
    save instead of committing a checkpoint nobody reads."""
    rec = np.asarray(index.records, RECORD)
    order = np.argsort(rec, order=("array", "chunk"), kind="stable")
    rec = rec[order]
    out: dict[str, Any] = {
        "objects": [
            [p, int(s)] if index.base_of(i) is None else [p, int(s), index.base_of(i)]
            for i, (p, s) in enumerate(index.objects)
        ],
        "arrays": [
            [n, None if i is None else list(i)]
            + ([dict(index.codec_of(k) or {})] if index.codec_of(k) is not None else [])
            for k, (n, i) in enumerate(index.arrays)
        ],
        "index": rec.tobytes(),
    }
    if index.bases:  # (incremental) only where used: a full save's field is unchanged
        out["bases"] = [[n, bytes(i)] for n, i in index.bases]
    if index.hashes is not None:
        h = np.frombuffer(index.hashes, np.uint8).reshape(-1, HASH_BYTES)
        out["hashes"] = h[order].tobytes() if len(h) == len(order) else bytes(index.hashes)
    decode_packed(out, arrays)
    return out
