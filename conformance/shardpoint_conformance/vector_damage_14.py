"""The invalid golden vectors of format 1.4 (spec/CHANGELOG.md): the packed layout's reader
checks ([SP-PACK-2] to [SP-PACK-7]), each starting from the valid vector ``packed_basic``,
and those of incremental checkpoints ([SP-PACK-9], [SP-PACK-10]), from ``packed_incremental``.
Merged into :data:`shardpoint_conformance.vectors.INVALID`; older vectors are unchanged.
"""

from __future__ import annotations

import os
import shutil
import struct

from shardpoint_conformance.vector_damage import Damage, rewrite_body

BASE = "packed_basic"
OBJ0 = ("packed", "w0-0.bin")
_REC = struct.Struct("<IIQQQI")


def _records(edit):
    """A body edit applying ``edit(list of record tuples) -> list`` to the index."""

    def go(b: dict) -> None:
        raw = b["packed"]["index"]
        recs = [list(_REC.unpack_from(raw, i)) for i in range(0, len(raw), 36)]
        b["packed"]["index"] = b"".join(_REC.pack(*r) for r in edit(recs))

    return go


def _set(i: int, field: int, value):
    def edit(recs):
        recs[i][field] = value(recs[i]) if callable(value) else value
        return recs

    return _records(edit)


def _swap_ab_keep_crc(recs):
    """Records of tensors a and b (one plain int16 chunk each, same size; arrays 0 and 1,
    as the index lists arrays in the order the manifest's tensors have) exchange where
    their bytes lie; each keeps its crc32c, the record's claim of what it points at."""
    i, j = [k for k, r in enumerate(recs) if r[0] in (0, 1)][:2]
    for f in (1, 3, 4):
        recs[i][f], recs[j][f] = recs[j][f], recs[i][f]
    return recs


def _truncate(path: str) -> None:
    p = os.path.join(path, *OBJ0)
    os.truncate(p, os.path.getsize(p) - 1)


def _symlink(path: str) -> None:
    p = os.path.join(path, *OBJ0)
    with open(p, "rb") as f:
        data = f.read()
    os.remove(p)
    with open(p + ".real", "wb") as f:
        f.write(data)
    os.symlink(os.path.basename(p) + ".real", p)


INCR = "packed_incremental"


def _base_body(edit):
    """A damage applying ``edit`` to the body of the sibling ``base/`` (re-sealed)."""
    return lambda p: rewrite_body(os.path.join(os.path.dirname(p), "base"), edit)


def _short_hashes(b: dict) -> None:
    b["packed"]["hashes"] = b["packed"]["hashes"][:-1]


INVALID_1_4 = {
    "packed_base_missing": Damage(
        INCR,
        "CorruptCheckpointError",
        "SP-PACK-9",
        "(1.4 incremental) the base beside the checkpoint, base/, deleted",
        lambda p: shutil.rmtree(os.path.join(os.path.dirname(p), "base")),
    ),
    "packed_base_replaced": Damage(
        INCR,
        "CorruptCheckpointError",
        "SP-PACK-9",
        "(1.4 incremental) base/'s manifest body gets created_unix + 1 (another save at the "
        "base's name, every data byte the same): its identity is not the one recorded; "
        "base's envelope re-sealed",
        _base_body(lambda b: b.update(created_unix=b["created_unix"] + 1)),
    ),
    "packed_base_escape": Damage(
        INCR,
        "CorruptCheckpointError",
        "SP-PACK-9",
        '(1.4 incremental) the bases entry names ".." instead of "base" (a path outside the '
        "checkpoint's parent); envelope re-sealed",
        lambda p: rewrite_body(p, lambda b: b["packed"]["bases"][0].__setitem__(0, "..")),
    ),
    "packed_hashes_short": Damage(
        INCR,
        "CorruptCheckpointError",
        "SP-PACK-10",
        "(1.4 incremental) the hashes bin loses its last byte; envelope re-sealed",
        lambda p: rewrite_body(p, _short_hashes),
    ),
    "packed_field_malformed": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-PACK-2",
        '(1.4) the packed field gets a fourth entry "note": 1; envelope re-sealed',
        lambda p: rewrite_body(p, lambda b: b["packed"].update(note=1)),
    ),
    "packed_inner_not_dividing": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-PACK-3",
        "(1.4) the arrays entry of tensors/grid gets inner chunk shape [3, 3] (its chunk "
        "shape does not divide by it); envelope re-sealed",
        lambda p: rewrite_body(
            p,
            lambda b: [
                a.__setitem__(1, [3, 3]) for a in b["packed"]["arrays"] if a[0] == "tensors/grid"
            ],
        ),
    ),
    "packed_chunk_twice": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-PACK-4",
        "(1.4) the index's last record replaced by a copy of the one before it (a chunk "
        "twice, another missing); envelope re-sealed",
        lambda p: rewrite_body(p, _records(lambda r: r[:-1] + [list(r[-2])])),
    ),
    "packed_record_beyond_object": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-PACK-4",
        "(1.4) record 0's offset set past the end of its object; envelope re-sealed",
        lambda p: rewrite_body(
            p, lambda b: _set(0, 3, lambda r: b["packed"]["objects"][r[1]][1])(b)
        ),
    ),
    "packed_records_overlap": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-PACK-5",
        "(1.4) records 0 and 1 (tensors a and b, one plain chunk each in object 0) get the "
        "same offset, so both name the same bytes; envelope re-sealed",
        lambda p: rewrite_body(
            p, _records(lambda r: [r[0], r[1][:3] + [r[0][3]] + r[1][4:], *r[2:]])
        ),
    ),
    "packed_records_swapped": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-READ-8",
        "(1.4) the records of tensors a and b (plain int16 chunks of one size) exchange "
        "object, offset and length but keep their crc32c: each names the other's bytes, "
        "whose own crc32c is right; envelope re-sealed",
        lambda p: rewrite_body(p, _records(_swap_ab_keep_crc)),
    ),
    "packed_object_truncated": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-READ-3",
        "(1.4) packed/w0-0.bin loses its last byte: shorter than the size the manifest declares",
        _truncate,
    ),
    "packed_object_missing": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-READ-2",
        "(1.4) packed/w0-0.bin deleted",
        lambda p: os.remove(os.path.join(p, *OBJ0)),
    ),
    "packed_object_symlink": Damage(
        BASE,
        "CorruptCheckpointError",
        "SP-SEC-5",
        "(1.4) packed/w0-0.bin renamed w0-0.bin.real and replaced by a symlink to it",
        _symlink,
    ),
}
