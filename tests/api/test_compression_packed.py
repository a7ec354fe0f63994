"""(1.5) Compressed chunks in the packed layout ([SP-PACK-12]) on the read paths that only the
packed layout has: partial reads (``sp.open``) of multi-chunk tensors, the coalesced ranged
reads of many small compressed chunks on an object store, incremental saves (chunk identity
by the compressed stored bytes and their hash), and the refusal of a codec map of another
form for that tensor alone."""

import os

import numpy as np
import pytest

import shardpoint as sp
from shardpoint_core.format.errors import CorruptCheckpointError, UnsupportedFormatError
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.verify import verify_checkpoint

pytest.importorskip("zstandard")

OPTS = sp.SaveOptions(
    compression="zstd", plan=sp.PlanOptions(max_chunk_bytes=4096, chunk_overhead_bytes=0)
)


def _ramp(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (
        (np.arange(np.prod(shape)) % 97 + rng.integers(0, 3, np.prod(shape)))
        .astype(dtype)
        .reshape(shape)
    )


def test_partial_reads_decode_only_the_chunks_they_meet(tmp_ckpt):
    """sp.open reads a box of a compressed packed tensor of many chunks bit for bit; a
    damaged chunk outside the box does not stop it, one inside does ([SP-READ-3])."""
    w = _ramp((300, 40))  # 48,000 bytes: 12 or more chunks of <= 4 KiB
    sp.save({"w": w, "step": 1}, tmp_ckpt, options=OPTS)
    m = read_metadata(tmp_ckpt)
    part = m.packed.array(m.tensors["w"].array)
    assert part.codec is not None and len(part.records) > 10
    assert int(part.records["length"].sum()) < w.nbytes  # stored compressed
    chunk_rows = m.tensors["w"].chunk_shape[0]
    obj, off, n, _crc = part.chunk(len(part.records) - 1)  # the last chunk: rows at the end
    raw = bytearray(open(os.path.join(tmp_ckpt, obj), "rb").read())
    raw[off + n // 2] ^= 0x01
    open(os.path.join(tmp_ckpt, obj), "wb").write(bytes(raw))
    with sp.open(tmp_ckpt) as ck:
        got = ck["w"][3 : chunk_rows + 5, 7:30].to_torch().numpy()
        assert got.tobytes() == w[3 : chunk_rows + 5, 7:30].tobytes()
        with pytest.raises(CorruptCheckpointError, match="crc32c") as e:
            ck["w"][290:300].to_torch()
        assert e.value.spec_id == "SP-READ-3" and "'w'" in str(e.value)


def test_many_small_compressed_tensors_load_through_coalesced_reads_on_s3(s3_env):
    """On an object store the chunks of many small tensors are read in merged ranged GETs
    (packed_runs); compressed records are cut out of them and decoded, bit for bit."""
    url = s3_env.url(s3_env.fresh_prefix("zpk") + "/ck")
    state = {f"t{i}": _ramp((20 + i, 30), np.float32, i) for i in range(24)}
    state["zeros"] = np.zeros((512, 64), np.float32)
    sp.save(state, url, options=OPTS)
    m = read_metadata(url)
    assert tuple(m.format_version) == (1, 5) and len(m.packed.objects) < 5
    got = sp.load(url)
    for k, v in state.items():
        assert np.asarray(got[k]).tobytes() == v.tobytes(), k


def test_incremental_compressed_saves_share_unchanged_compressed_chunks(tmp_path):
    """Chunk identity is the compressed stored bytes and their hash ([SP-PACK-9],
    [SP-PACK-10]): an unchanged chunk compressed again at the same level is the same bytes
    and is shared; a changed one is written; the result loads and verifies bit for bit."""
    frozen, moved = _ramp((400, 40), seed=1), _ramp((40, 40), seed=2)
    s1 = {"frozen": frozen, "moved": moved}
    s2 = {"frozen": frozen, "moved": moved + 1}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save(s1, a, options=OPTS, backend=PackedBackend(hashes=True))
    sp.save(s2, b, options=OPTS, incremental="a")
    m = read_metadata(b)
    assert tuple(m.format_version) == (1, 5) and m.packed.codecs is not None
    share = m.packed.sharing()
    n_frozen = len(m.packed.array(m.tensors["frozen"].array).records)
    n_moved = len(m.packed.array(m.tensors["moved"].array).records)
    assert share["bases"]["a"]["chunks"] == n_frozen and share["own"]["chunks"] == n_moved
    got = sp.load(b)
    assert np.asarray(got["frozen"]).tobytes() == frozen.tobytes()
    assert np.asarray(got["moved"]).tobytes() == (moved + 1).tobytes()
    rep = verify_checkpoint(b, strict=True)
    assert rep.ok and rep.hashes, rep.problems
    # a base of plain chunks holds other bytes: nothing shared, still read right
    c = str(tmp_path / "c")
    sp.save(s1, str(tmp_path / "p"), backend=PackedBackend(hashes=True))
    sp.save(s1, c, options=OPTS, incremental="p")
    assert read_metadata(c).packed.sharing()["bases"] == {}
    assert np.asarray(sp.load(c)["frozen"]).tobytes() == frozen.tobytes()


def test_a_codec_of_another_form_refuses_that_tensor_only(tmp_ckpt):
    """[SP-PACK-12]: a codec map the reader does not know is *unsupported* when its array is
    opened ([SP-ARRAY-1]); the other tensors of the checkpoint still load."""
    from shardpoint_conformance.vector_damage import rewrite_body

    sp.save({"a": _ramp((8, 8)), "b": _ramp((8, 8), seed=3)}, tmp_ckpt, compression="zstd")

    def edit(body):
        entry = next(x for x in body["packed"]["arrays"] if x[0] == body["tensors"]["a"]["array"])
        entry[2] = {"name": "lz5", "configuration": {}}

    rewrite_body(tmp_ckpt, edit)
    with pytest.raises(UnsupportedFormatError, match="'a'") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-ARRAY-1"
    with sp.open(tmp_ckpt) as ck:
        assert ck["b"].to_torch().numpy().tobytes() == _ramp((8, 8), seed=3).tobytes()


def test_big_compressed_chunks_are_decoded_not_read_straight_into_the_tensor(tmp_ckpt):
    """Whole tensors of big chunks on files are read straight into the destination
    (packed_direct) only for the plain chain: a compressed chunk of over 1 MiB stored goes
    through the decoder, bit for bit."""
    big = np.random.default_rng(5).integers(0, 2**31, (600, 1024), dtype=np.int32)  # 2.4 MB
    big[:300] = 7  # half compresses, half does not
    sp.save({"big": big}, tmp_ckpt, compression="zstd")
    m = read_metadata(tmp_ckpt)
    lengths = m.packed.array(m.tensors["big"].array).records["length"]
    assert lengths.max() > 1 << 20 and lengths.sum() < big.nbytes
    assert np.asarray(sp.load(tmp_ckpt)["big"]).tobytes() == big.tobytes()
