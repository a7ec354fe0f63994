"""The invalid golden vectors: which valid vector each one starts from, the damage done to
it, and the error every reader must report (category and requirement ID).

Each damage is a small byte-level edit that breaks exactly one rule; its description is
written into ``expected.json`` and into spec/vectors/README.md, so an implementer never has
to reverse-engineer the bytes. Uses only msgpack, hashlib, json and the spec's CRC-32C.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable

import msgpack

from shardpoint_conformance.independent_reader import crc32c


@dataclass(frozen=True)
class Damage:
    base: str  # the valid vector it starts from
    error: str  # the reference's class for the failure category
    spec_id: str
    description: str
    apply: Callable


def _manifest(path: str) -> str:
    return os.path.join(path, "manifest.msgpack")


def _seal(path: str, raw_body: bytes, extra: dict | None = None) -> None:
    env = {"sha256": hashlib.sha256(raw_body).digest(), "body": raw_body, **(extra or {})}
    with open(_manifest(path), "wb") as f:
        f.write(msgpack.packb(env, use_bin_type=True))


def read_body(path: str) -> dict:
    env = msgpack.unpackb(open(_manifest(path), "rb").read())
    return msgpack.unpackb(
        env["body"], strict_map_key=False, ext_hook=lambda code, data: msgpack.ExtType(code, data)
    )


def rewrite_body(path: str, edit) -> None:
    """Apply ``edit`` to the decoded body and re-seal the envelope (a valid SHA-256)."""
    body = read_body(path)
    edit(body)
    _seal(path, msgpack.packb(body, use_bin_type=True))


def _edit_file(p: str, edit) -> None:
    data = bytearray(open(p, "rb").read())
    data = edit(data)
    open(p, "wb").write(bytes(data))


def _zarr(path: str, tensor: str, edit) -> None:
    p = os.path.join(path, "tensors", tensor, "zarr.json")
    meta = json.load(open(p))
    edit(meta)
    json.dump(meta, open(p, "w"))


def _index_span(data: bytes | bytearray, n_inner: int) -> tuple[int, int]:
    """(start, stop) of a shard's index (entries + crc32c) at the end of the shard."""
    return len(data) - (16 * n_inner + 4), len(data)


def _reseal_index(data: bytearray, n_inner: int, edit) -> bytearray:
    lo, hi = _index_span(data, n_inner)
    idx = bytearray(data[lo : hi - 4])
    edit(idx)
    data[lo:hi] = bytes(idx) + crc32c(bytes(idx)).to_bytes(4, "little")
    return data


def _flip(at, mask):
    def edit(data):
        data[at(data)] ^= mask
        return data

    return edit


GRID0 = ("tensors", "grid", "c", "0", "0")  # multi_chunk: a 9x11 shard of nine 1x11 inner
SMALL0 = ("tensors", "small", "c", "0", "0")  # multi_chunk: one plain 5x3 uint16 chunk


def _p(path, parts):
    return os.path.join(path, *parts)


def _dup_key_body(path: str) -> None:
    body = read_body(path)
    raw = msgpack.packb(body, use_bin_type=True)
    # A map header one larger, then the whole body's entries plus "objects" once more.
    n = len(body)
    if raw[0] != 0x80 | n:  # a fixmap header: the body has fewer than 15 fields
        raise ValueError("unexpected body header")
    extra = msgpack.packb("objects") + msgpack.packb(body["objects"], use_bin_type=True)
    _seal(path, bytes([0x80 | (n + 1)]) + raw[1:] + extra)


def _deep(n: int):
    v: object = {"must_understand": False}
    for _ in range(n):
        v = [v]
    return {"must_understand": False, "payload": v}


def _bool_byte_2(data: bytearray) -> bytearray:
    data[1] = 0x02  # element 1; the chunk's crc32c is recomputed
    data[-4:] = crc32c(bytes(data[:-4])).to_bytes(4, "little")
    return data


def _bad_array_value(b: dict) -> None:
    st = b["objects"]["rng"]["values"][0]["state"]
    dtype, shape, raw, origin = msgpack.unpackb(st.data, raw=False)
    b["objects"]["rng"]["values"][0]["state"] = msgpack.ExtType(
        1, msgpack.packb([dtype, shape, raw[:-1], origin], use_bin_type=True)
    )


def _unknown_ext(b: dict) -> None:
    b["objects"]["rng"]["values"][0]["later"] = msgpack.ExtType(5, b"\x00")


def _short_array(b: dict) -> None:
    bad = msgpack.ExtType(1, msgpack.packb(["uint8", [4], b"\x00" * 3, "numpy"], use_bin_type=True))
    b["later"] = {"must_understand": False, "value": bad}


def deep_with_tuples(levels: int, tuples: int = 5):
    """An ignorable field whose ``payload`` nests ``levels`` containers (the field's map is
    level 2 of the body, so the innermost container sits at level ``levels + 2``), the outer
    ``tuples`` of them ext 2 tuples, each counting one level ([SP-MAN-5])."""
    v: object = []
    for i in range(levels - 1):
        v = (
            msgpack.ExtType(2, msgpack.packb([v], use_bin_type=True))
            if i >= levels - 1 - tuples
            else [v]
        )
    return {"must_understand": False, "payload": v}


def _rename_tensor(old: str, new: str):
    def edit(b):
        b["tensors"][new] = b["tensors"].pop(old)
        for item in b["tree"]["dict"]:
            if item[1] == {"tensor": old}:
                item[1]["tensor"] = new

    return edit


def _swap_leaves(b: dict) -> None:
    model = dict(b["tree"]["dict"])["model"]["dict"]
    model[0][1]["tensor"], model[1][1]["tensor"] = model[1][1]["tensor"], model[0][1]["tensor"]


INVALID = {
    "bad_checksum": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-3",
        "tensors/grid/c/0/0 (a shard): byte len//3 (inside an inner chunk) xor 0x10",
        lambda p: _edit_file(_p(p, GRID0), _flip(lambda d: len(d) // 3, 0x10)),
    ),
    "bad_shard_index": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-3",
        "tensors/grid/c/0/0: index entry 0's offset byte 3 xor 0x01 (offset + 2^24), index "
        "crc32c left as it was",
        lambda p: _edit_file(_p(p, GRID0), _flip(lambda d: _index_span(d, 9)[0] + 3, 0x01)),
    ),
    "missing_chunk": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-2",
        "tensors/grid/c/0/0 deleted",
        lambda p: os.remove(_p(p, GRID0)),
    ),
    "missing_inner_chunk": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-2",
        "tensors/grid/c/0/0: index entry 2 set to (2^64-1, 2^64-1) (absent) and the index "
        "crc32c recomputed, so only the missing-data rule catches it",
        lambda p: _edit_file(
            _p(p, GRID0),
            lambda d: _reseal_index(d, 9, lambda idx: idx.__setitem__(slice(32, 48), b"\xff" * 16)),
        ),
    ),
    "half_absent_index_entry": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-3",
        "tensors/grid/c/0/0: index entry 1's offset set to 2^64-1, its nbytes kept, index "
        "crc32c recomputed",
        lambda p: _edit_file(
            _p(p, GRID0),
            lambda d: _reseal_index(d, 9, lambda idx: idx.__setitem__(slice(16, 24), b"\xff" * 8)),
        ),
    ),
    "truncated_chunk": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-3",
        "tensors/small/c/0/0 (plain chain): last 6 bytes cut off",
        lambda p: _edit_file(_p(p, SMALL0), lambda d: d[:-6]),
    ),
    "chunk_extra_bytes": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-3",
        "tensors/small/c/0/0 (plain chain): 4 zero bytes appended after the crc32c",
        lambda p: _edit_file(_p(p, SMALL0), lambda d: d + b"\x00" * 4),
    ),
    "bool_byte_2": Damage(
        "all_dtypes",
        "CorruptCheckpointError",
        "SP-READ-3",
        "tensors/bool/c/0/0: element 1 set to 0x02 and the crc32c recomputed",
        lambda p: _edit_file(_p(p, ("tensors", "bool", "c", "0", "0")), _bool_byte_2),
    ),
    "bad_zarr_json": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-1",
        "tensors/small/zarr.json replaced by the 1 byte '{' (not JSON)",
        lambda p: open(_p(p, ("tensors", "small", "zarr.json")), "w").write("{"),
    ),
    "unknown_codec": Damage(
        "multi_chunk",
        "UnsupportedFormatError",
        "SP-ARRAY-1",
        'tensors/small/zarr.json: a {"name": "zstd", "configuration": {"level": 1}} '
        "codec inserted between bytes and crc32c (chunk bytes unchanged)",
        lambda p: _zarr(
            p,
            "small",
            lambda m: m["codecs"].insert(1, {"name": "zstd", "configuration": {"level": 1}}),
        ),
    ),
    "dot_separator": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-3",
        'tensors/small/zarr.json: chunk_key_encoding gets configuration {"separator": "."}',
        lambda p: _zarr(
            p, "small", lambda m: m["chunk_key_encoding"].update(configuration={"separator": "."})
        ),
    ),
    "bad_fill_value": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-3",
        "tensors/small/zarr.json (uint16): fill_value 1 instead of 0",
        lambda p: _zarr(p, "small", lambda m: m.update(fill_value=1)),
    ),
    "missing_manifest": Damage(
        "nested_tree",
        "IncompleteCheckpointError",
        "SP-COMMIT-3",
        "manifest.msgpack deleted",
        lambda p: os.remove(_manifest(p)),
    ),
    "truncated_manifest": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-1",
        "manifest.msgpack cut to its first half",
        lambda p: _edit_file(_manifest(p), lambda d: d[: len(d) // 2]),
    ),
    "bad_envelope": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-1",
        'envelope gets a third entry "note": "x" (SHA-256 still right)',
        lambda p: _seal(p, msgpack.unpackb(open(_manifest(p), "rb").read())["body"], {"note": "x"}),
    ),
    "trailing_bytes": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-1",
        "one byte 0xc0 (msgpack nil) appended after the envelope",
        lambda p: _edit_file(_manifest(p), lambda d: d + b"\xc0"),
    ),
    "duplicate_map_key": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-5",
        'body map gets "objects" a second time (same value) appended; envelope re-sealed',
        _dup_key_body,
    ),
    "float_map_key": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-5",
        'body gets an ignorable field {"must_understand": false, 1.5: "x"} (a float map '
        "key); envelope re-sealed",
        lambda p: rewrite_body(p, lambda b: b.update(later={"must_understand": False, 1.5: "x"})),
    ),
    "too_deep": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-5",
        'body gets an ignorable field whose "payload" is 300 nested arrays (over the 256-level '
        "limit); envelope re-sealed",
        lambda p: rewrite_body(p, lambda b: b.update(later=_deep(300))),
    ),
    "unknown_major_version": Damage(
        "nested_tree",
        "UnsupportedFormatError",
        "SP-VER-2",
        "body format_version set to [2, 0]",
        lambda p: rewrite_body(p, lambda b: b.update(format_version=[2, 0])),
    ),
    "unknown_must_understand_field": Damage(
        "nested_tree",
        "UnsupportedFormatError",
        "SP-VER-3",
        'body gets the field "checksums_v2": {"must_understand": true}',
        lambda p: rewrite_body(p, lambda b: b.update(checksums_v2={"must_understand": True})),
    ),
    "unknown_dtype": Damage(
        "nested_tree",
        "UnsupportedFormatError",
        "SP-DTYPE-1",
        'tensor entry "np" gets dtype "float128"',
        lambda p: rewrite_body(p, lambda b: b["tensors"]["np"].update(dtype="float128")),
    ),
    "path_traversal": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-SEC-1",
        'the first tensor entry (sorted by key) gets array "../../outside"',
        lambda p: rewrite_body(
            p, lambda b: b["tensors"][sorted(b["tensors"])[0]].update(array="../../outside")
        ),
    ),
    "shared_array_path": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-LAYOUT-2",
        'tensor entry "np" gets the array path of model/layers.0.weight',
        lambda p: rewrite_body(
            p,
            lambda b: b["tensors"]["np"].update(
                array=b["tensors"]["model/layers.0.weight"]["array"]
            ),
        ),
    ),
    "non_canonical_key": Damage(
        "key_escaping",
        "CorruptCheckpointError",
        "SP-KEY-3",
        'tensor key "7" renamed "07" in the tensors table and in its tree leaf',
        lambda p: rewrite_body(p, _rename_tensor("7", "07")),
    ),
    "dot_dot_key": Damage(
        "key_escaping",
        "CorruptCheckpointError",
        "SP-KEY-2",
        'tensor key "7" renamed ".." in the tensors table and in its tree leaf',
        lambda p: rewrite_body(p, _rename_tensor("7", "..")),
    ),
    "tree_leaf_wrong_key": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-4",
        "the tree leaves model/layers.0.weight and model/layers.0.bias swap their tensor keys",
        lambda p: rewrite_body(p, _swap_leaves),
    ),
    "malformed_array_value": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-VALUE-2",
        'object rng value 0\'s "state" (ext 1 uint8 [16]) loses the last data byte',
        lambda p: rewrite_body(p, _bad_array_value),
    ),
    "unknown_ext_type": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-VALUE-2",
        'object rng value 0 gets the entry "later": ext type 5 with payload 00 (an '
        "extension type the format does not define); envelope re-sealed",
        lambda p: rewrite_body(p, _unknown_ext),
    ),
    "ext_in_ignorable_field": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-VALUE-2",
        'body gets an ignorable field {"must_understand": false, "value": ext 1 '
        '["uint8", [4], 3 bytes, "numpy"]} (one data byte short); envelope re-sealed',
        lambda p: rewrite_body(p, _short_array),
    ),
    "too_deep_tuples": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-5",
        'body gets an ignorable field whose "payload" nests 255 containers, the outer 5 '
        "of them ext 2 tuples (innermost at level 257, each tuple one level); envelope "
        "re-sealed",
        lambda p: rewrite_body(p, lambda b: b.update(later=deep_with_tuples(255))),
    ),
    "int_fill_value_float": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-3",
        "tensors/small/zarr.json (uint16): fill_value 0.0 (a JSON float) instead of 0",
        lambda p: _zarr(p, "small", lambda m: m.update(fill_value=0.0)),
    ),
    "bad_object_grid": Damage(
        "object_grid",
        "CorruptCheckpointError",
        "SP-OBJ-4",
        'object rng\'s grid "shape" [2, 3] set to [4, 2] (product 8, count 6)',
        lambda p: rewrite_body(p, lambda b: b["objects"]["rng"].update(shape=[4, 2])),
    ),
}
