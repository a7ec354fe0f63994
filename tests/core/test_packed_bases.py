"""The incremental part of the packed index codec ([SP-PACK-9], [SP-PACK-10]): bases named
by one safe path component with a 32-byte identity, objects of a base, per-record hashes
kept with their records when the index is sorted, and every reader check on hostile
fields."""

from __future__ import annotations


import numpy as np
import pytest

from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.packed import (
    HASH_BYTES,
    PackedIndex,
    chunk_hash,
    decode_packed,
    encode_packed,
    records_of,
)

from .test_packed_format import Entry  # the manifest entry fields the index reads

ARRAYS = {"tensors/w": Entry("w", (4,), "uint8", (2,))}  # two plain chunks of 6 bytes
IDENT = bytes(range(32))


def _field(**change) -> dict:
    """A valid field: chunk 0 in the checkpoint's own object, chunk 1 in base 'step_1'
    (whose object has the same path: another checkpoint's namespace)."""
    index = PackedIndex(
        [("packed/w0-0.bin", 6), ("packed/w0-0.bin", 6)],
        [("tensors/w", None)],
        records_of([(0, 1, 1, 0, 6, b"bbbb"), (0, 0, 0, 0, 6, b"aaaa")]),  # unsorted
        [("step_1", IDENT)],
        [None, 0],
        b"A" * HASH_BYTES + b"B" * HASH_BYTES,  # hashes of the records as given
    )
    field = encode_packed(index, ARRAYS)
    field.update(change)
    return field


def test_bases_objects_and_hashes_round_trip_sorted_together():
    f = _field()
    assert f["objects"] == [["packed/w0-0.bin", 6], ["packed/w0-0.bin", 6, 0]]
    assert f["bases"] == [["step_1", IDENT]]
    idx = decode_packed(f, ARRAYS)
    part = idx.array("tensors/w")
    assert part.hash(0) == b"B" * HASH_BYTES and part.hash(1) == b"A" * HASH_BYTES
    assert part.chunk(0)[0] == "packed/w0-0.bin"
    assert part.chunk(1)[0] == "../step_1/packed/w0-0.bin"  # a reader's view of the base
    assert part.bases == (("step_1", IDENT),)
    sh = idx.sharing()
    assert sh["own"] == {"chunks": 1, "bytes": 6}
    assert sh["bases"]["step_1"]["chunks"] == 1


def test_a_full_field_is_unchanged_by_the_incremental_fields():
    index = PackedIndex(
        [("packed/w0-0.bin", 12)],
        [("tensors/w", None)],
        records_of([(0, 0, 0, 0, 6, b"aaaa"), (0, 0, 1, 6, 6, b"bbbb")]),
    )
    assert set(encode_packed(index, ARRAYS)) == {"objects", "arrays", "index"}


@pytest.mark.parametrize(
    "change, rule, words",
    [
        ({"bases": [["..", IDENT]]}, "SP-PACK-9", "one safe path component"),
        ({"bases": [["a/b", IDENT]]}, "SP-PACK-9", "one safe path component"),
        ({"bases": [["step_1", IDENT[:31]]]}, "SP-PACK-9", "32-byte identity"),
        ({"bases": [["step_1", IDENT], ["step_1", IDENT]]}, "SP-PACK-9", "twice"),
        ({"bases": [["step_1", IDENT], ["step_2", IDENT]]}, "SP-PACK-9", "named by no object"),
        ({"bases": "step_1"}, "SP-PACK-9", "list"),
        (
            {"objects": [["packed/w0-0.bin", 6], ["packed/w0-0.bin", 6, 1]]},
            "SP-PACK-9",
            "out of range",
        ),
        (
            {"objects": [["packed/w0-0.bin", 6], ["../x.bin", 6, 0]]},
            "SP-SEC-1",
            "safe relative path",
        ),
        ({"objects": [["packed/w0-0.bin", 6], ["packed/w0-0.bin", 6, "0"]]}, "SP-PACK-2", ""),
        ({"hashes": b"x" * 31}, "SP-PACK-10", "16 bytes per record"),
        ({"hashes": "x" * 32}, "SP-PACK-10", "16 bytes per record"),
        ({"extra": 1}, "SP-PACK-2", "nothing else"),
    ],
)
def test_hostile_incremental_fields_are_refused_by_rule(change, rule, words):
    with pytest.raises(CorruptCheckpointError, match=rf"\[{rule}\].*{words}"):
        decode_packed(_field(**change), ARRAYS)


def test_two_objects_of_one_base_at_one_path_are_refused():
    f = _field(objects=[["packed/w0-0.bin", 6, 0], ["packed/w0-0.bin", 6, 0]])
    with pytest.raises(CorruptCheckpointError, match=r"SP-PACK-2.*equal"):
        decode_packed(f, ARRAYS)


def test_chunk_hash_is_blake3_of_16_bytes_over_the_buffers_in_order():
    import blake3

    want = blake3.blake3(b"abcdef").digest(16)
    assert want.hex() == blake3.blake3(b"abcdef").hexdigest()[:32]  # a prefix of the XOF
    assert chunk_hash([b"abc", memoryview(b"def")]) == want
    assert chunk_hash([np.frombuffer(b"abcdef", np.uint8)]) == want


def test_two_writers_parts_with_references_gather_into_one_index(tmp_path):
    """The coordinator's gathering (fast variant of the two-rank test): writer a refers to
    a base's chunk whose length, crc32c and hash match and writes the one that differs;
    writer b writes its own; the index names the base once, its object after the save's."""
    from shardpoint_core.arrays.packed import PackedWriter, build_index, gather_parts
    from shardpoint_core.stores.files import FileStore

    store = FileStore(str(tmp_path))
    same = b"\x01" * 6 + b"crc0"
    cand = ("step_1", IDENT, "packed/b0-0.bin", 100, 40, len(same), b"crc0", chunk_hash([same]))
    a = PackedWriter(store, "", writer_id="a", hashes=True)
    a.append("tensors/w", 0, [same], cand)  # referred to
    a.append("tensors/w", 1, [b"\x02" * 6 + b"crc1"], cand[:6] + (b"crc1", b"x" * 16))
    b = PackedWriter(store, "", writer_id="b", hashes=True)
    b.append("tensors/v", 0, [b"\x03" * 6 + b"crc2"])
    a.finish(), b.finish()
    objects, rows, inner, parts, refs = gather_parts(store, "")
    assert len(parts) == 2 and len(rows) == 2 and len(refs) == 1
    arrays = {"tensors/v": None, "tensors/w": None}
    idx = build_index(objects, rows, arrays, refs, hashes=True)
    entries = {
        "tensors/v": Entry("v", (6,), "uint8", (6,)),
        "tensors/w": Entry("w", (12,), "uint8", (6,)),
    }
    back = decode_packed(encode_packed(idx, entries), entries)
    assert back.bases == [("step_1", IDENT)]
    w = back.array("tensors/w")
    assert w.chunk(0) == ("../step_1/packed/b0-0.bin", 40, 10, int.from_bytes(b"crc0", "little"))
    assert w.chunk(1)[0] == "packed/a-0.bin" and w.hash(0) == chunk_hash([same])
    assert back.array("tensors/v").chunk(0)[0] == "packed/b-0.bin"
