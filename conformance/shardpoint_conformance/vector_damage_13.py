"""The invalid golden vectors of format 1.3 (spec/CHANGELOG.md): chunk identity ([SP-MAN-7],
[SP-READ-8]) and the 1.3 clarifications, each pinning the rule a second implementation had
to guess. Merged into :data:`shardpoint_conformance.vector_damage.INVALID`; the 1.0, 1.1 and
1.2 vectors are unchanged.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil

import msgpack

from shardpoint_conformance.vector_damage import (
    GRID0,
    Damage,
    _edit_file,
    _p,
    _reseal_index,
    _seal,
    read_body,
    rewrite_body,
)

A0 = ("tensors", "a", "c", "0", "0")  # chunk_identity: one plain 6x5 int16 chunk
B0 = ("tensors", "b", "c", "0", "0")  # the same size, another tensor
EDGE10 = ("tensors", "sharded", "c", "1", "0")
SMALL0 = (
    "tensors",
    "small",
    "c",
    "0",
    "0",
)  # multi_chunk: one plain 5x3 uint16 chunk  # edge_chunks: rows 8-15 of 10, inner 2x4


def _swap_files(a: tuple, b: tuple):
    def apply(path: str) -> None:
        pa, pb = _p(path, a), _p(path, b)
        tmp = pa + ".swap"
        shutil.move(pa, tmp)
        shutil.move(pb, pa)
        shutil.move(tmp, pb)

    return apply


def _swap_entries_0_1(idx: bytearray) -> None:
    idx[0:16], idx[16:32] = idx[16:32], idx[0:16]


def _table(edit):
    def apply(b: dict) -> None:
        f = b["tensors"]["a"]["chunk_crc32c"]
        f["crc32c"] = edit(f["crc32c"])

    return apply


def _alias_outside(idx: bytearray) -> None:
    idx[16:32] = idx[0:16]  # inner chunk (1, 0), rows 10-11: wholly outside the tensor


def _leaf_root(b: dict) -> None:
    b.update(tree={"value": 1}, tensors={}, objects={})


def _timestamp(b: dict) -> None:
    ts = msgpack.Timestamp.from_datetime(
        datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    )
    b["later"] = {"must_understand": False, "when": ts}


def _envelope_repeated_body(path: str) -> None:
    raw = msgpack.unpackb(open(os.path.join(path, "manifest.msgpack"), "rb").read())["body"]
    import hashlib

    entries = (
        msgpack.packb("sha256")
        + msgpack.packb(hashlib.sha256(raw).digest(), use_bin_type=True)
        + (msgpack.packb("body") + msgpack.packb(raw, use_bin_type=True)) * 2
    )
    open(os.path.join(path, "manifest.msgpack"), "wb").write(bytes([0x83]) + entries)


def _rename_key(new):
    def edit(b: dict) -> None:
        b["tensors"][new] = b["tensors"].pop("7")
        for item in b["tree"]["dict"]:
            if item[0] == "7":
                item[1]["tensor"] = new

    return edit


def _zarr_text(tensor: str, edit):
    def apply(path: str) -> None:
        p = os.path.join(path, "tensors", tensor, "zarr.json")
        text = open(p).read()
        new = edit(text)
        assert new != text
        open(p, "w").write(new)

    return apply


def _dir_for_chunk(path: str) -> None:
    p = _p(path, SMALL0)
    os.remove(p)
    os.makedirs(p)
    open(os.path.join(p, "0"), "wb").write(b"\x00" * 34)  # git keeps no empty directory


def _file_for_dir(path: str) -> None:
    d = os.path.dirname(_p(path, SMALL0))
    data = open(_p(path, SMALL0), "rb").read()
    shutil.rmtree(d)
    open(d, "wb").write(data)


def _no_codecs(path: str) -> None:
    p = os.path.join(path, "tensors", "small", "zarr.json")
    meta = json.load(open(p))
    del meta["codecs"]
    open(p, "w").write(json.dumps(meta, sort_keys=True, separators=(",", ":")))


INVALID_1_3 = {
    "swapped_chunks": Damage(
        "chunk_identity",
        "CorruptCheckpointError",
        "SP-READ-8",
        "(1.3) tensors/a/c/0/0 and tensors/b/c/0/0 (plain int16 chunks of one size, every "
        "crc32c right) swapped: each file holds the other tensor's bytes, which only the "
        "manifest's chunk table tells",
        _swap_files(A0, B0),
    ),
    "swapped_inner_chunks": Damage(
        "chunk_identity",
        "CorruptCheckpointError",
        "SP-READ-8",
        "(1.3) tensors/grid/c/0/0: index entries 0 and 1 swapped (inner chunks 0 and 1 read "
        "each other's bytes), index crc32c recomputed",
        lambda p: _edit_file(_p(p, GRID0), lambda d: _reseal_index(d, 9, _swap_entries_0_1)),
    ),
    "chunk_table_too_short": Damage(
        "chunk_identity",
        "CorruptCheckpointError",
        "SP-READ-8",
        "(1.3) tensor a's chunk_crc32c table loses its one entry (0 entries for 1 stored "
        "unit); envelope re-sealed",
        lambda p: rewrite_body(p, _table(lambda t: t[:-4])),
    ),
    "chunk_table_malformed": Damage(
        "chunk_identity",
        "CorruptCheckpointError",
        "SP-MAN-7",
        "(1.3) tensor a's chunk_crc32c table gets a fifth byte (not 4 per unit); envelope "
        "re-sealed",
        lambda p: rewrite_body(p, _table(lambda t: t + b"\x00")),
    ),
    "leaf_root": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-4",
        '(1.3) the tree becomes the value leaf {"value": 1} and the tables are emptied '
        "(a leaf as the root: [SP-MAN-4], not [SP-KEY-2]); envelope re-sealed",
        lambda p: rewrite_body(p, _leaf_root),
    ),
    "key_in_both_tables": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-4",
        '(1.3) the objects table gets an entry "np" {"count": 1, "values": [0]}, the '
        "key of a tensor the tree holds; envelope re-sealed",
        lambda p: rewrite_body(p, lambda b: b["objects"].update(np={"count": 1, "values": [0]})),
    ),
    "dtype_not_a_string": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-3",
        '(1.3) tensor entry "np" gets dtype 5 (an int, not a name: a malformed field, not an '
        "unknown dtype); envelope re-sealed",
        lambda p: rewrite_body(p, lambda b: b["tensors"]["np"].update(dtype=5)),
    ),
    "envelope_repeated_body": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-1",
        "(1.3) the envelope is a map of 3 entries: sha256, body, and body again (the same bytes)",
        _envelope_repeated_body,
    ),
    "escaped_dot_dot_key": Damage(
        "key_escaping",
        "CorruptCheckpointError",
        "SP-KEY-2",
        '(1.3) tensor key "7" renamed "%2E%2E" in the tensors table and in its tree '
        'leaf: it decodes to ".." ([SP-KEY-2] applies to the decoded component, before '
        "[SP-KEY-3], though the escaped dots are not canonical either)",
        lambda p: rewrite_body(p, _rename_key("%2E%2E")),
    ),
    "timestamp_ext": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-VALUE-2",
        '(1.3) body gets an ignorable field {"must_understand": false, "when": a msgpack '
        "timestamp (ext type -1)}; envelope re-sealed",
        lambda p: rewrite_body(p, _timestamp),
    ),
    "array_value_dim_2_64": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-VALUE-2",
        '(1.3) body gets an ignorable field {"must_understand": false, "v": ext 1 '
        '["uint8", [0, 2^64-1], empty data, "numpy"]} (zero elements, so the data length '
        "is right, but a dimension past the 2^63 limit); envelope re-sealed",
        lambda p: rewrite_body(
            p,
            lambda b: b.update(
                later={
                    "must_understand": False,
                    "v": msgpack.ExtType(
                        1,
                        msgpack.packb(
                            ["uint8", [0, (1 << 64) - 1], b"", "numpy"], use_bin_type=True
                        ),
                    ),
                }
            ),
        ),
    ),
    "outside_entry_aliases": Damage(
        "edge_chunks",
        "CorruptCheckpointError",
        "SP-READ-7",
        "(1.3) tensors/sharded/c/1/0: index entry 1 (inner chunk rows 10-11, wholly outside "
        "the 10-row tensor, absent) set equal to entry 0, index crc32c recomputed",
        lambda p: _edit_file(_p(p, EDGE10), lambda d: _reseal_index(d, 4, _alias_outside)),
    ),
    "storage_transformer": Damage(
        "multi_chunk",
        "UnsupportedFormatError",
        "SP-ARRAY-5",
        '(1.3) tensors/small/zarr.json gets "storage_transformers": [{"name": '
        '"x.later"}] (a Zarr construct 1.x does not define: unsupported, not corrupt)',
        _zarr_text("small", lambda t: t[:-1] + ',"storage_transformers":[{"name":"x.later"}]}'),
    ),
    "index_location_start": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-2",
        '(1.3) tensors/grid/zarr.json: the sharding configuration gets "index_location": '
        '"start" (valid Zarr v3; 1.x allows only "end")',
        _zarr_text(
            "grid", lambda t: t.replace('"index_codecs"', '"index_location":"start","index_codecs"')
        ),
    ),
    "zarr_json_nan": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-1",
        '(1.3) tensors/small/zarr.json gets "attributes": {"x": NaN} (NaN is not a '
        "JSON token, RFC 8259, though some parsers accept it)",
        _zarr_text("small", lambda t: t[:-1] + ',"attributes":{"x":NaN}}'),
    ),
    "directory_as_chunk": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-SEC-5",
        "(1.3) tensors/small/c/0/0 (a plain chunk) replaced by a directory holding a file "
        '"0" of 34 bytes: not a regular file where a chunk file belongs (not a missing '
        "chunk)",
        _dir_for_chunk,
    ),
    "file_as_chunk_directory": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-SEC-5",
        "(1.3) tensors/small/c/0 (the directory of chunk c/0/0) replaced by a regular file "
        "holding that chunk's bytes: a file where the chunk tree holds a directory",
        _file_for_dir,
    ),
    "zarr_json_no_codecs": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-2",
        '(1.3) tensors/small/zarr.json loses its "codecs" field (a required field missing '
        "is damage under the rule that requires it, not an unsupported construct)",
        _no_codecs,
    ),
    "fill_value_underflow": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-3",
        "(1.3) tensors/grid/zarr.json (float32): fill_value 1e-400 (not zero, though a "
        "binary64 parser rounds it to +0)",
        _zarr_text("grid", lambda t: t.replace('"fill_value":0.0', '"fill_value":1e-400')),
    ),
}

__all__ = ["INVALID_1_3", "read_body", "_seal"]
