"""(format 1.5) Compressed chunks, ``sp.save(..., compression="zstd")``: Zarr v3's ``zstd``
codec between ``bytes`` and ``crc32c`` ([SP-ARRAY-7]), read back bit for bit by shardpoint,
zarr-python and TensorStore; and hostile compressed chunks (decompression bombs, frames of
the wrong size, trailing bytes) refused with [SP-READ-9] without allocating more than the
chunk's decoded size."""

import json
import os
import resource
import struct

import crc32c
import numpy as np
import pytest

import shardpoint as sp
from shardpoint_core.format.dtypes import DTYPES
from shardpoint_core.format.errors import (
    CorruptCheckpointError,
    InvalidOptionError,
    UnsupportedFormatError,
)
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.verify import verify_checkpoint

pytest.importorskip("zstandard")


def _bits(name: str, shape: tuple, seed: int) -> np.ndarray:
    dt = DTYPES[name].numpy
    raw = np.random.default_rng(seed).integers(
        0, 256, (int(np.prod(shape)) * dt.itemsize,), dtype=np.uint8
    )
    if name == "bool":
        raw &= 1
    return raw.view(dt).reshape(shape)


def _state() -> dict:
    out = {name: _bits(name, (9, 7), i) for i, name in enumerate(sorted(DTYPES))}
    out["zeros"] = np.zeros((300, 100), np.float32)  # compresses well: one tiny frame
    out["scalar"] = np.float64(2.5)
    out["empty"] = np.zeros((0, 3), np.int32)
    return out


def _same(got: dict, want: dict) -> None:
    for k, w in want.items():
        g = np.asarray(got[k])
        w = np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), k


@pytest.mark.parametrize("where", ["file", "memory"])
def test_zstd_round_trips_every_dtype_bit_for_bit(tmp_ckpt, where):
    path = tmp_ckpt if where == "file" else f"memory://zstd{os.getpid()}/ck"
    state = _state()
    sp.save(state, path, compression="zstd")
    assert tuple(read_metadata(path).format_version) == (1, 5)
    _same(sp.load(path), state)
    if where == "file":
        meta = json.load(open(os.path.join(tmp_ckpt, "tensors", "zeros", "zarr.json")))
        assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]
        assert meta["codecs"][1]["configuration"] == {"level": 3, "checksum": False}
        # 120,000 bytes of zeros are stored as one small frame
        assert os.path.getsize(os.path.join(tmp_ckpt, "tensors", "zeros", "c", "0", "0")) < 1000
        assert verify_checkpoint(tmp_ckpt, strict=True).ok


def test_generic_zarr_readers_read_a_compressed_checkpoint(tmp_ckpt):
    zarr = pytest.importorskip("zarr")
    ts = pytest.importorskip("tensorstore")
    from shardpoint_core.transactions.zarr_compat import register_zarr_dtypes, zarr_path

    state = _state()
    sp.save(state, tmp_ckpt, options=sp.SaveOptions(compression="zstd", compression_level=9))
    register_zarr_dtypes()
    for key in ("float32", "bfloat16", "int64", "bool", "zeros"):
        where = zarr_path(tmp_ckpt, key)
        assert (
            json.load(open(os.path.join(where, "zarr.json")))["codecs"][1]["configuration"]["level"]
            == 9
        )
        got_z = zarr.open_array(where, mode="r")[...]
        got_t = (
            ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": where}}, open=True)
            .result()
            .read()
            .result()
        )
        for got in (got_z, got_t):
            assert got.tobytes() == state[key].tobytes(), key


def test_compression_options_are_checked_before_anything_is_written(tmp_path):
    with pytest.raises(InvalidOptionError, match="compression 'lz4'"):
        sp.SaveOptions(compression="lz4")
    with pytest.raises(InvalidOptionError, match="level"):
        sp.SaveOptions(compression="zstd", compression_level=99)
    with pytest.raises(InvalidOptionError, match="without compression"):
        sp.SaveOptions(compression_level=3)
    # the packed layout has no compressed chunks: refused, not written uncompressed
    with pytest.raises(InvalidOptionError, match="PackedBackend"):
        sp.save(
            {"w": np.ones(4, np.float32)},
            str(tmp_path / "p"),
            backend=PackedBackend(ZarrBackend()),
            compression="zstd",
        )
    assert not os.path.exists(tmp_path / "p")


# ---------------------------------------------------------------------- hostile chunks
def _rle_frame(total: int, byte: int = 0, content_size: bool = True) -> bytes:
    """A zstd frame (RFC 8878) of RLE blocks of 128 KiB regenerating ``total`` bytes, 4 bytes
    per block: what a decompression bomb is made of. ``content_size``: the frame header
    declares ``total`` (8 bytes, single segment), else only a 128 KiB window."""
    if content_size:
        head = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", total)
    else:
        head = b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x38])  # window 2^17, no content size
    blocks = []
    left = total
    while left > 0:
        n = min(left, 1 << 17)
        left -= n
        hdr = (n << 3) | (1 << 1) | (1 if left == 0 else 0)  # RLE block, last bit
        blocks.append(hdr.to_bytes(3, "little") + bytes([byte]))
    return head + b"".join(blocks)


def _plant(tmp_ckpt: str, frame: bytes, key: str = "w") -> None:
    path = os.path.join(tmp_ckpt, "tensors", key, "c", "0")
    with open(path, "wb") as f:
        f.write(frame + crc32c.crc32c(frame).to_bytes(4, "little"))


def _saved(tmp_ckpt: str, n: int) -> None:
    # no chunk table, so that a planted chunk is judged by its bytes alone ([SP-READ-8]
    # would refuse any other stored crc32c first)
    sp.save({"w": np.ones(n, np.float32)}, tmp_ckpt, compression="zstd")
    from shardpoint_conformance.vector_damage import rewrite_body

    rewrite_body(tmp_ckpt, lambda b: b["tensors"]["w"].pop("chunk_crc32c", None))


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_bomb_without_a_declared_size_is_refused_within_the_chunk_size(tmp_ckpt):
    n = 40_000  # a chunk of 160,000 bytes; the frame below decodes to 2 GiB in 64 KiB
    _saved(tmp_ckpt, n)
    frame = _rle_frame(2 << 30, content_size=False)
    assert len(frame) < n * 4  # inside the stored-size bounds: only the decoder stops it
    _plant(tmp_ckpt, frame)
    before = _maxrss_mib()
    with pytest.raises(CorruptCheckpointError, match="does not decode") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-9" and "'w'" in str(e.value)
    assert _maxrss_mib() - before < 512  # never the 2 GiB the frame stands for


def test_a_frame_declaring_another_size_is_refused_before_decoding(tmp_ckpt):
    _saved(tmp_ckpt, 16)
    _plant(tmp_ckpt, _rle_frame(1 << 17)[:5] + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00")
    with pytest.raises(CorruptCheckpointError, match="declares 1099511627776 decoded bytes"):
        sp.load(tmp_ckpt)


@pytest.mark.parametrize(
    "damage,match,sid",
    [
        (lambda f: f + b"\x00" * 8, "unused data|does not decode", "SP-READ-9"),  # trailing
        (lambda f: b"\x00" * len(f), "not a zstd frame", "SP-READ-9"),
        (lambda f: _rle_frame(60), "declares 60", "SP-READ-9"),  # 60 of 64 bytes
        (
            lambda f: _rle_frame(60, content_size=False),
            "decodes to 60|does not decode",
            "SP-READ-9",
        ),
        (lambda f: b"\x28\xb5\x2f\xfd", "not >= 14|bytes stored", "SP-READ-3"),  # below any frame
    ],
    ids=["trailing", "no_magic", "short_declared", "short_undeclared", "too_small"],
)
def test_malformed_frames_are_corrupt(tmp_ckpt, damage, match, sid):
    _saved(tmp_ckpt, 16)
    path = os.path.join(tmp_ckpt, "tensors", "w", "c", "0")
    good = open(path, "rb").read()[:-4]
    _plant(tmp_ckpt, damage(good))
    with pytest.raises(CorruptCheckpointError, match=match) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == sid


def test_stored_crc32c_is_checked_before_decoding(tmp_ckpt):
    _saved(tmp_ckpt, 16)
    path = os.path.join(tmp_ckpt, "tensors", "w", "c", "0")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="crc32c mismatch") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-3"


def test_a_tensor_declaring_more_than_any_frame_decodes_to_is_refused_at_open(tmp_ckpt):
    """[SP-READ-6] for compressed arrays: no zstd frame decodes to more than 32768 times its
    size, so a manifest declaring more than that of the files is refused before allocating."""
    from shardpoint_conformance.vector_damage import rewrite_body

    _saved(tmp_ckpt, 16)  # one chunk file of ~20 bytes
    rewrite_body(
        tmp_ckpt,
        lambda b: b["tensors"]["w"].update(shape=[1 << 24], chunk_shape=[1 << 24]),
    )
    zj = os.path.join(tmp_ckpt, "tensors", "w", "zarr.json")
    meta = json.load(open(zj))
    meta["shape"] = [1 << 24]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 24]
    open(zj, "w").write(json.dumps(meta))
    _plant(tmp_ckpt, _rle_frame(4 << 24)[: 4 + 1 + 8 + 4])  # 1 block: far too small
    with pytest.raises(CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id in ("SP-READ-6", "SP-READ-3")


def test_a_zstd_codec_of_another_form_is_unsupported(tmp_ckpt):
    _saved(tmp_ckpt, 16)
    zj = os.path.join(tmp_ckpt, "tensors", "w", "zarr.json")
    meta = json.load(open(zj))
    meta["codecs"][1]["configuration"]["dictionary"] = "d1"  # a later option
    open(zj, "w").write(json.dumps(meta))
    with pytest.raises(UnsupportedFormatError, match="zstd codec") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-ARRAY-1"


def _two_ranks(rank, world, root):
    import torch

    full = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    a, b = (0, 25) if rank == 0 else (25, 40)  # uneven rows: the plan's grid moves data
    state = {"w": sp.ShardedTensor(full[a:b].clone(), (40, 6), (a, 0)), "step": 7}
    sp.save(state, f"{root}/sync", compression="zstd", async_save=True).wait()
    got = [sp.load(f"{root}/sync")["w"].tolist() == full.tolist()]
    try:  # one rank compressing, the other not: refused before anything is written
        sp.save(state, f"{root}/mixed", compression="zstd" if rank == 0 else None)
        mixed = "saved"
    except sp.ShardpointError as e:
        mixed = type(e).__name__ + ("compression" in str(e)) * " names compression"
    return got, mixed, os.path.exists(f"{root}/mixed")


def test_two_ranks_save_compressed_async_and_must_agree_on_it(tmp_path):
    from shardpoint_testing.launch import run_world

    res = run_world(2, _two_ranks, str(tmp_path), timeout=180, pg_timeout=30)
    for got, mixed, exists in res:
        assert got == [True]
        assert mixed.endswith("names compression") and not exists, mixed
    meta = json.load(open(tmp_path / "sync" / "tensors" / "w" / "zarr.json"))
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]
