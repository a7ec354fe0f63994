"""The packed index codec (format 1.4, spec/format.md section 13): round trips of any valid
index, and every reader check of [SP-PACK-2] to [SP-PACK-5] on hostile fields."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.packed import (
    RECORD,
    PackedIndex,
    chunk_count,
    decode_packed,
    encode_packed,
)


@dataclass
class Entry:
    key: str
    shape: tuple
    dtype: str
    chunk_shape: tuple


ITEM = {"uint8": 1, "int16": 2, "float32": 4}


@st.composite
def indexes(draw):
    """(field, arrays, index) of a valid packed index: arrays laid out back to back in a
    few objects, with random gaps."""
    n = draw(st.integers(0, 4))
    arrays, listed = {}, []
    for i in range(n):
        rank = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0, 5)) for _ in range(rank))
        chunk = tuple(draw(st.integers(1, 4)) for _ in range(rank))
        dtype = draw(st.sampled_from(sorted(ITEM)))
        inner = None
        if rank and draw(st.booleans()):
            inner = tuple(
                draw(st.sampled_from([d for d in range(1, c + 1) if c % d == 0])) for c in chunk
            )
        name = f"tensors/t{i}"
        arrays[name] = Entry(f"t{i}", shape, dtype, chunk)
        listed.append((name, inner))
    nobj = draw(st.integers(1, 3))
    pos = [0] * nobj
    rows = []
    for a, (name, inner) in enumerate(listed):
        e = arrays[name]
        units = 1 if inner is None else math.prod(c // k for c, k in zip(e.chunk_shape, inner))
        for c in range(chunk_count(e.shape, e.chunk_shape)):
            o = draw(st.integers(0, nobj - 1))
            n_ = (
                math.prod(e.chunk_shape) * ITEM[e.dtype] + 4
                if inner is None
                else 16 * units + 4 + draw(st.integers(0, 64))
            )
            pos[o] += draw(st.integers(0, 8))
            rows.append((a, o, c, pos[o], n_, draw(st.integers(0, 2**32 - 1))))
            pos[o] += n_
    rec = np.array(rows, RECORD) if rows else np.zeros(0, RECORD)
    draw(st.randoms()).shuffle(rows)  # the writer's order is any; encode sorts
    objects = [(f"packed/w-{o}.bin", pos[o] + draw(st.integers(0, 8))) for o in range(nobj)]
    return PackedIndex(objects, listed, rec), arrays


@settings(max_examples=60, deadline=None)
@given(indexes())
def test_any_valid_index_round_trips(case):
    idx, arrays = case
    field = encode_packed(idx, arrays)
    got = decode_packed(field, arrays)
    assert got.objects == idx.objects and got.arrays == idx.arrays
    assert got.records.tobytes() == np.sort(idx.records, order=("array", "chunk")).tobytes()
    for a, (name, _inner) in enumerate(idx.arrays):
        part = got.array(name)
        assert len(part.records) == chunk_count(arrays[name].shape, arrays[name].chunk_shape)
        assert all(int(r["array"]) == a for r in part.records)
        assert [int(c) for c in part.records["chunk"]] == list(range(len(part.records)))


def _base():
    """Two float32 arrays of two plain chunks each (4 elements a chunk: 20 bytes) in one
    object of 80 bytes."""
    arrays = {
        "tensors/a": Entry("a", (8,), "float32", (4,)),
        "tensors/b": Entry("b", (8,), "float32", (4,)),
    }
    rows = [(0, 0, 0, 0, 20, 1), (0, 0, 1, 20, 20, 2), (1, 0, 0, 40, 20, 3), (1, 0, 1, 60, 20, 4)]
    field = {
        "objects": [["packed/w-0.bin", 80]],
        "arrays": [["tensors/a", None], ["tensors/b", None]],
        "index": np.array(rows, RECORD).tobytes(),
    }
    decode_packed(field, arrays)  # the base is valid
    return field, arrays


def _records(field):
    return np.frombuffer(field["index"], RECORD).copy()


def _set(field, i, name, value):
    r = _records(field)
    r[i][name] = value
    field["index"] = r.tobytes()


HOSTILE = {
    "not_a_map": (lambda f: f.clear() or f.update(x=1), "SP-PACK-2"),
    "index_not_bin": (lambda f: f.update(index="x"), "SP-PACK-2"),
    "object_size_negative": (lambda f: f.update(objects=[["packed/w-0.bin", -1]]), "SP-PACK-2"),
    "object_size_2_63": (lambda f: f.update(objects=[["packed/w-0.bin", 2**63]]), "SP-PACK-2"),
    "object_path_traversal": (lambda f: f.update(objects=[["../w.bin", 80]]), "SP-SEC-1"),
    "object_is_manifest": (lambda f: f.update(objects=[["manifest.msgpack", 80]]), "SP-PACK-2"),
    "object_inside_array_name": (lambda f: f.update(objects=[["tensors/a/x", 80]]), "SP-PACK-2"),
    "duplicate_object": (lambda f: f.update(objects=[["p/w", 80], ["p/w", 80]]), "SP-PACK-2"),
    "array_listed_twice": (lambda f: f["arrays"].append(["tensors/a", None]), "SP-PACK-2"),
    "array_unlisted": (lambda f: f["arrays"].pop(), "SP-PACK-2"),
    "array_unknown": (lambda f: f["arrays"].__setitem__(1, ["tensors/zz", None]), "SP-PACK-2"),
    "inner_not_dividing": (lambda f: f["arrays"].__setitem__(0, ["tensors/a", [3]]), "SP-PACK-3"),
    "inner_wrong_rank": (lambda f: f["arrays"].__setitem__(0, ["tensors/a", [2, 2]]), "SP-PACK-3"),
    "index_ragged": (lambda f: f.update(index=f["index"] + b"\0"), "SP-PACK-4"),
    "record_missing": (lambda f: f.update(index=f["index"][:-36]), "SP-PACK-4"),
    "record_twice": (lambda f: f.update(index=f["index"][:36] + f["index"][:-36]), "SP-PACK-4"),
    "records_out_of_order": (
        lambda f: f.update(index=f["index"][36:72] + f["index"][:36] + f["index"][72:]),
        "SP-PACK-4",
    ),
    "chunk_outside_grid": (lambda f: _set(f, 1, "chunk", 2), "SP-PACK-4"),
    "chunk_2_64": (lambda f: _set(f, 1, "chunk", 2**64 - 1), "SP-PACK-4"),
    "array_out_of_range": (lambda f: _set(f, 3, "array", 7), "SP-PACK-4"),
    "object_out_of_range": (lambda f: _set(f, 0, "object", 1), "SP-PACK-4"),
    "beyond_object": (lambda f: _set(f, 3, "offset", 61), "SP-PACK-4"),
    "offset_2_64": (lambda f: _set(f, 3, "offset", 2**64 - 1), "SP-PACK-4"),
    "length_2_64": (lambda f: _set(f, 3, "length", 2**64 - 1), "SP-PACK-4"),
    "plain_length_wrong": (lambda f: _set(f, 3, "length", 19), "SP-PACK-4"),
    "overlap": (lambda f: _set(f, 2, "offset", 30), "SP-PACK-5"),
    "alias": (lambda f: _set(f, 2, "offset", 0), "SP-PACK-5"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_index_is_refused_with_its_rule(case):
    field, arrays = _base()
    damage, rule = HOSTILE[case]
    damage(field)
    with pytest.raises(CorruptCheckpointError) as e:
        decode_packed(field, arrays)
    assert e.value.spec_id == rule
    assert "manifest.msgpack" in str(e.value) and "packed" in str(e.value)


def test_a_huge_declared_grid_costs_nothing():
    """A tiny field declaring 2^60 chunks is refused by the count alone, before any work
    per declared chunk ([SP-SEC-2])."""
    field, arrays = _base()
    arrays["tensors/a"] = Entry("a", (2**60,), "uint8", (1,))
    with pytest.raises(CorruptCheckpointError) as e:
        decode_packed(field, arrays)
    assert e.value.spec_id == "SP-PACK-4"


def test_shard_records_need_at_least_their_index():
    arrays = {"tensors/s": Entry("s", (4,), "uint8", (4,))}
    field = {
        "objects": [["o", 100]],
        "arrays": [["tensors/s", [2]]],
        "index": np.array([(0, 0, 0, 0, 35, 0)], RECORD).tobytes(),
    }
    with pytest.raises(CorruptCheckpointError) as e:  # 2 inner chunks: index 36 bytes
        decode_packed(field, arrays)
    assert e.value.spec_id == "SP-PACK-4"
    field["index"] = np.array([(0, 0, 0, 0, 36, 0)], RECORD).tobytes()
    assert decode_packed(field, arrays).array("tensors/s").inner == (2,)
