"""The invalid golden vectors of the 1.2 clarifications (spec/CHANGELOG.md): hostile inputs
that no conforming writer writes and every 1.2 reader refuses by rule, before it recurses
without bound or allocates more than storage holds. Merged into
:data:`shardpoint_conformance.vector_damage.INVALID`; the 1.0 and 1.1 vectors are unchanged.
"""

from __future__ import annotations

import os
import shutil

import msgpack

from shardpoint_conformance import hostile
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


def _set_entry(j: int, off: int, nb: int):
    """Index edit: entry ``j`` of a 9-entry grid shard becomes ``(off, nb)``."""

    def edit(idx: bytearray) -> None:
        idx[16 * j : 16 * j + 16] = off.to_bytes(8, "little") + nb.to_bytes(8, "little")

    return edit


def _alias_entry_1(idx: bytearray) -> None:
    idx[16:32] = idx[0:16]


def _zarr_text(path: str, tensor: str, edit) -> None:
    p = os.path.join(path, "tensors", tensor, "zarr.json")
    text = open(p).read()
    open(p, "w").write(edit(text))


def _small_bomb(path: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)
    hostile.memory_bomb(path, entries=512, inner_elems=64)


def _int_key(b: dict) -> None:
    b["tensors"][5] = b["tensors"].pop("np")
    for item in b["tree"]["dict"]:
        if item[1].get("tensor") == "np":
            item[1]["tensor"] = 5


def _body_raw(raw: bytes):
    return lambda p: _seal(p, raw)


INVALID_1_2 = {
    "tuples_300_deep": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-5",
        '(1.2) body gets an ignorable field {"must_understand": false, "payload": a nil '
        "inside 300 nested ext 2 tuples of one element}; envelope re-sealed (a reader "
        "decoding tuples from inside the decoder's callback overflowed its stack here)",
        lambda p: rewrite_body(
            p,
            lambda b: b.update(
                later={"must_understand": False, "payload": hostile.nested_tuples(300)}
            ),
        ),
    ),
    "zarr_json_too_deep": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-6",
        '(1.2) tensors/small/zarr.json gets "attributes": {"x": 40 nested arrays} (41 '
        "levels below the top object, 42 in all; the limit is 32)",
        lambda p: _zarr_text(
            p, "small", lambda t: t[:-1] + ',"attributes":{"x":' + "[" * 40 + "]" * 40 + "}}"
        ),
    ),
    "zarr_json_repeated_name": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-6",
        '(1.2) tensors/small/zarr.json gets a second "zarr_format": 3 appended (same value)',
        lambda p: _zarr_text(p, "small", lambda t: t[:-1] + ',"zarr_format":3}'),
    ),
    "declares_more_than_stored": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-READ-6",
        "(1.2) the checkpoint is replaced by one float32 tensor w of shape [32768] (128 KiB) "
        "in one shard of 512 inner chunks of 64, whose index points all 512 entries at the "
        "one inner chunk stored (8.5 KB of files; every crc32c right)",
        _small_bomb,
    ),
    "aliased_shard_index": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-7",
        "(1.2) tensors/grid/c/0/0: index entry 1 set equal to entry 0 (both name inner chunk "
        "0's bytes), index crc32c recomputed",
        lambda p: _edit_file(_p(p, GRID0), lambda d: _reseal_index(d, 9, _alias_entry_1)),
    ),
    "index_offset_2_63": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-READ-3",
        "(1.2) tensors/grid/c/0/0: index entry 3's offset set to 2^63 (nbytes kept), index "
        "crc32c recomputed: past the index, never an integer overflow",
        lambda p: _edit_file(
            _p(p, GRID0),
            lambda d: _reseal_index(
                d, 9, lambda idx: idx.__setitem__(slice(48, 56), (1 << 63).to_bytes(8, "little"))
            ),
        ),
    ),
    "fill_value_minus_zero": Damage(
        "multi_chunk",
        "CorruptCheckpointError",
        "SP-ARRAY-3",
        "(1.2) tensors/grid/zarr.json (float32): fill_value spelled -0 (a JSON number with a "
        "minus sign) instead of 0.0",
        lambda p: _zarr_text(p, "grid", lambda t: t.replace('"fill_value":0.0', '"fill_value":-0')),
    ),
    "int_tensor_key": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-KEY-3",
        '(1.2) tensor "np" keyed by the int 5 in the tensors table and in its tree leaf',
        lambda p: rewrite_body(p, _int_key),
    ),
    "missing_tree": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-2",
        '(1.2) body loses its "tree" field; envelope re-sealed',
        lambda p: rewrite_body(p, lambda b: b.pop("tree")),
    ),
    "body_not_a_map": Damage(
        "nested_tree",
        "CorruptCheckpointError",
        "SP-MAN-2",
        "(1.2) body replaced by the msgpack float 1.5; envelope re-sealed",
        _body_raw(msgpack.packb(1.5)),
    ),
}

__all__ = ["INVALID_1_2", "read_body"]
