"""(1.5) The packed index's compressed arrays ([SP-PACK-12]): the entry ``[name, nil, codec]``
round trips, entries of another form are refused ([SP-PACK-2]), and each compressed record's
length is held to [SP-READ-9]'s bounds when the manifest is decoded ([SP-PACK-4]), so that
no record stands for more than 32768 times its bytes."""

from __future__ import annotations


import pytest

from shardpoint_core.format.compression import MAX_RATIO, stored_bounds, zstd_codec
from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.packed import PackedIndex, decode_packed, encode_packed, records_of

from .test_packed_format import Entry  # the manifest entry fields the index reads

N = 64 * 64 * 4  # decoded bytes of one float32 [64, 64] chunk
ARRAYS = {"tensors/w": Entry("w", (64, 128), "float32", (64, 64))}


ZSTD = zstd_codec(3)


def _field(lengths, codec=ZSTD) -> dict:
    size = sum(lengths)
    offs = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = [(0, 0, c, offs[c], n, b"\x01\x02\x03\x04") for c, n in enumerate(lengths)]
    idx = PackedIndex(
        [("packed/w0-0.bin", size)], [("tensors/w", None)], records_of(rows), codecs=[codec]
    )
    return encode_packed(idx, ARRAYS)


def test_a_compressed_entry_round_trips():
    field = _field([20, 300])
    assert field["arrays"] == [["tensors/w", None, zstd_codec(3)]]
    got = decode_packed(field, ARRAYS)
    assert got.codecs == [zstd_codec(3)]
    assert got.array("tensors/w").codec == zstd_codec(3)


@pytest.mark.parametrize("n", [stored_bounds(N)[0] - 1, stored_bounds(N)[1] + 1])
def test_a_compressed_record_outside_the_bounds_is_refused(n):
    least, most = stored_bounds(N)
    assert least * MAX_RATIO >= N  # the least a frame takes bounds what it decodes to
    with pytest.raises(CorruptCheckpointError, match="compressed chunk") as e:
        _field([least, n])
    assert e.value.spec_id == "SP-PACK-4"
    decode_packed(_field([least, most]), ARRAYS)  # the bounds themselves are fine


@pytest.mark.parametrize(
    "entry",
    [
        ["tensors/w", [64, 64], zstd_codec(3)],
        ["tensors/w", None, "zstd"],
        ["tensors/w", None, None],
    ],
    ids=["inner_and_codec", "codec_not_a_map", "nil_codec"],
)
def test_entries_of_another_form_are_corrupt(entry):
    field = _field([20, 20])
    field["arrays"] = [entry]
    with pytest.raises(CorruptCheckpointError) as e:
        decode_packed(field, ARRAYS)
    assert e.value.spec_id == "SP-PACK-2"


def test_an_unknown_codec_map_decodes_and_is_left_to_the_array_s_open():
    """A codec map of another form is unsupported when its array is opened (the reader of
    packed_read.layout_of), not corrupt here: its records' lengths are not bounded by rules
    this reader does not know."""
    field = _field([20, 20])
    field["arrays"][0][2] = {"name": "lz5", "configuration": {}}
    rows = [(0, 0, c, c, 1, b"\x01\x02\x03\x04") for c in range(2)]
    field["index"] = records_of(rows).tobytes()  # lengths no zstd frame can have
    field["objects"][0][1] = 2
    got = decode_packed(field, ARRAYS)
    assert got.array("tensors/w").codec == {"name": "lz5", "configuration": {}}
