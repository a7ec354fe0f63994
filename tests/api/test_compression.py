"""(format 1.5) Compressed chunks, ``sp.save(..., compression="zstd")``: Zarr v3's ``zstd``
codec between ``bytes`` and ``crc32c`` ([SP-ARRAY-7]), read back bit for bit by shardpoint,
zarr-python and TensorStore; and hostile compressed chunks (decompression bombs, frames of
the wrong size, trailing bytes) refused with [SP-READ-9] without allocating more than the
chunk's decoded size."""

import json
import os
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
from shardpoint_core.format.compression import zstd_codec
from shardpoint_core.format.packed import RECORD
from shardpoint_core.transactions.backend import ZarrBackend
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


def _backend(layout: str) -> dict:
    """The save's backend argument: the default (packed) or the per-array layout."""
    return {} if layout == "packed" else {"backend": ZarrBackend()}


def _codec_json(codec: dict) -> str:
    return json.dumps(codec, sort_keys=True)


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


@pytest.mark.parametrize("layout", ["packed", "per-array"])
@pytest.mark.parametrize("where", ["file", "memory"])
def test_zstd_round_trips_every_dtype_bit_for_bit(tmp_ckpt, where, layout):
    path = tmp_ckpt if where == "file" else f"memory://zstd{os.getpid()}{layout}/ck"
    state = _state()
    sp.save(state, path, compression="zstd", **_backend(layout))
    m = read_metadata(path)
    assert tuple(m.format_version) == (1, 5)
    _same(sp.load(path), state)
    if layout == "packed":  # the default: the index names the chain ([SP-PACK-12])
        assert m.packed is not None and m.packed.codecs is not None
        assert set(map(_codec_json, m.packed.codecs)) == {_codec_json(zstd_codec(3))}
        zeros = m.packed.array(m.tensors["zeros"].array)
        assert zeros.chunk(0)[2] < 1000  # 120,000 bytes of zeros stored as one small frame
    if where == "file" and layout == "per-array":
        meta = json.load(open(os.path.join(tmp_ckpt, "tensors", "zeros", "zarr.json")))
        assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]
        assert meta["codecs"][1]["configuration"] == {"level": 3, "checksum": False}
        # 120,000 bytes of zeros are stored as one small frame
        assert os.path.getsize(os.path.join(tmp_ckpt, "tensors", "zeros", "c", "0", "0")) < 1000
    if where == "file":
        assert verify_checkpoint(tmp_ckpt, strict=True).ok


@pytest.mark.parametrize("layout", ["packed", "per-array"])
def test_generic_zarr_readers_read_a_compressed_checkpoint(tmp_ckpt, tmp_path, layout):
    """zarr-python and TensorStore read compressed tensors bit for bit: per-array where they
    lie, packed through ``zarr_store`` and the OCDBT export, whose zarr.json name the zstd
    codec the index holds ([SP-PACK-12])."""
    zarr = pytest.importorskip("zarr")
    ts = pytest.importorskip("tensorstore")
    from shardpoint_core.transactions.packed_zarr import zarr_store
    from shardpoint_core.transactions.ts_export import export_tensorstore
    from shardpoint_core.transactions.zarr_compat import register_zarr_dtypes, zarr_path

    state = _state()
    opts = sp.SaveOptions(compression="zstd", compression_level=9)
    sp.save(state, tmp_ckpt, options=opts, **_backend(layout))
    register_zarr_dtypes()
    if layout == "packed":
        store = zarr_store(tmp_ckpt)
        kv = export_tensorstore(tmp_ckpt, str(tmp_path / "ck.ts"))
        names = {k: e.array for k, e in read_metadata(tmp_ckpt).tensors.items()}
    for key in ("float32", "bfloat16", "int64", "bool", "zeros", "empty"):
        if layout == "packed":
            got_z = zarr.open_array(store, path=names[key], mode="r")
            spec = {"driver": "zarr3", "kvstore": {**kv, "path": names[key] + "/"}}
            got_t = ts.open(spec, open=True).result()
        else:
            where = zarr_path(tmp_ckpt, key)
            got_z = zarr.open_array(where, mode="r")
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": where}}
            got_t = ts.open(spec, open=True).result()
        codec = got_z.metadata.to_dict()["codecs"][1]
        assert codec["name"] == "zstd" and codec["configuration"]["level"] == 9, key
        for got in (got_z[...], got_t.read().result()):
            assert got.shape == state[key].shape, key
            assert got.tobytes() == state[key].tobytes(), key


def test_compression_options_are_checked_before_anything_is_written(tmp_path):
    with pytest.raises(InvalidOptionError, match="compression 'lz4'"):
        sp.SaveOptions(compression="lz4")
    with pytest.raises(InvalidOptionError, match="level"):
        sp.SaveOptions(compression="zstd", compression_level=99)
    with pytest.raises(InvalidOptionError, match="without compression"):
        sp.SaveOptions(compression_level=3)
    # a backend that does not write compressed arrays: refused, not written uncompressed
    with pytest.raises(InvalidOptionError, match="_NoCompression"):
        sp.save(
            {"w": np.ones(4, np.float32)},
            str(tmp_path / "p"),
            backend=_NoCompression(),
            compression="zstd",
        )
    assert not os.path.exists(tmp_path / "p")


class _NoCompression(ZarrBackend):
    """A backend whose layout has no compressed chunks (as a third party's may)."""

    supports_compression = False


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


def _plant(tmp_ckpt: str, frame: bytes, layout: str) -> None:
    """``frame`` and its crc32c become the one chunk of tensor ``w``: per-array its chunk
    file; packed its data object and record (length, crc32c; the object's size), so that
    only what a reader checks of the bytes themselves can refuse them."""
    stored = frame + crc32c.crc32c(frame).to_bytes(4, "little")
    if layout == "per-array":
        with open(os.path.join(tmp_ckpt, "tensors", "w", "c", "0"), "wb") as f:
            f.write(stored)
        return
    from shardpoint_conformance.vector_damage import rewrite_body

    def edit(b: dict) -> None:
        packed = b["packed"]
        ((obj, _size),) = packed["objects"]  # one writer, one tensor, one chunk
        with open(os.path.join(tmp_ckpt, obj), "wb") as f:
            f.write(stored)
        packed["objects"][0][1] = len(stored)
        rec = np.frombuffer(packed["index"], RECORD).copy()
        rec[0]["offset"], rec[0]["length"] = 0, len(stored)
        rec[0]["crc32c"] = int.from_bytes(stored[-4:], "little")
        packed["index"] = rec.tobytes()

    rewrite_body(tmp_ckpt, edit)


def _stored(tmp_ckpt: str, layout: str) -> bytes:
    """The stored bytes (frame + crc32c) of tensor ``w``'s one chunk."""
    if layout == "per-array":
        return open(os.path.join(tmp_ckpt, "tensors", "w", "c", "0"), "rb").read()
    obj, off, n, _crc = read_metadata(tmp_ckpt).packed.array("tensors/w").chunk(0)
    with open(os.path.join(tmp_ckpt, obj), "rb") as f:
        f.seek(off)
        return f.read(n)


def _saved(tmp_ckpt: str, n: int, layout: str) -> None:
    # no chunk table, so that a planted chunk is judged by its bytes alone ([SP-READ-8]
    # would refuse any other stored crc32c first)
    sp.save({"w": np.ones(n, np.float32)}, tmp_ckpt, compression="zstd", **_backend(layout))
    from shardpoint_conformance.vector_damage import rewrite_body

    rewrite_body(tmp_ckpt, lambda b: b["tensors"]["w"].pop("chunk_crc32c", None))


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith(field)) / 1024


def _reset_peak_mib() -> float:
    """RSS now, with the peak (VmHWM) reset to it: ru_maxrss would keep the worker's highest
    peak of any earlier test, against which a load's growth could not show."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _peak_mib() -> float:
    return _status_mib("VmHWM")


LAYOUTS = pytest.mark.parametrize("layout", ["packed", "per-array"])


@LAYOUTS
def test_a_bomb_without_a_declared_size_is_refused_within_the_chunk_size(tmp_ckpt, layout):
    n = 40_000  # a chunk of 160,000 bytes; the frame below decodes to 2 GiB in 64 KiB
    _saved(tmp_ckpt, n, layout)
    frame = _rle_frame(2 << 30, content_size=False)
    assert len(frame) < n * 4  # inside the stored-size bounds: only the decoder stops it
    _plant(tmp_ckpt, frame, layout)
    before = _reset_peak_mib()
    with pytest.raises(CorruptCheckpointError, match="does not decode") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-9" and "'w'" in str(e.value)
    assert _peak_mib() - before < 512  # never the 2 GiB the frame stands for


@LAYOUTS
def test_a_frame_declaring_another_size_is_refused_before_decoding(tmp_ckpt, layout):
    _saved(tmp_ckpt, 16, layout)
    _plant(
        tmp_ckpt,
        _rle_frame(1 << 17)[:5] + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00",
        layout,
    )
    with pytest.raises(CorruptCheckpointError, match="declares 1099511627776 decoded bytes"):
        sp.load(tmp_ckpt)


@LAYOUTS
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
        # below any frame: a chunk file of the wrong size; packed, a record of the wrong
        # length, refused when the manifest is decoded
        (lambda f: b"\x28\xb5\x2f\xfd", "not >= 14|bytes stored|14 to", "SP-READ-3"),
    ],
    ids=["trailing", "no_magic", "short_declared", "short_undeclared", "too_small"],
)
def test_malformed_frames_are_corrupt(tmp_ckpt, damage, match, sid, layout):
    _saved(tmp_ckpt, 16, layout)
    good = _stored(tmp_ckpt, layout)[:-4]
    _plant(tmp_ckpt, damage(good), layout)
    with pytest.raises(CorruptCheckpointError, match=match) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == ("SP-PACK-4" if sid == "SP-READ-3" and layout == "packed" else sid)


@LAYOUTS
def test_stored_crc32c_is_checked_before_decoding(tmp_ckpt, layout):
    _saved(tmp_ckpt, 16, layout)
    if layout == "per-array":
        path, at = os.path.join(tmp_ckpt, "tensors", "w", "c", "0"), 0
    else:
        obj, at, _n, _crc = read_metadata(tmp_ckpt).packed.array("tensors/w").chunk(0)
        path = os.path.join(tmp_ckpt, obj)
    raw = bytearray(open(path, "rb").read())
    raw[at + len(_stored(tmp_ckpt, layout)) // 2] ^= 0x10  # inside the frame
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="crc32c mismatch") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-3"


@LAYOUTS
def test_a_tensor_declaring_more_than_any_frame_decodes_to_is_refused_at_open(tmp_ckpt, layout):
    """[SP-READ-6] for compressed arrays: no zstd frame decodes to more than 32768 times its
    size, so a manifest declaring more than that of the files is refused before allocating;
    packed, each record's length is held to [SP-READ-9]'s bounds when the manifest is
    decoded ([SP-PACK-12]), which bounds the same."""
    from shardpoint_conformance.vector_damage import rewrite_body

    _saved(tmp_ckpt, 16, layout)  # one chunk of ~20 bytes
    rewrite_body(
        tmp_ckpt,
        lambda b: b["tensors"]["w"].update(shape=[1 << 24], chunk_shape=[1 << 24]),
    )
    if layout == "per-array":
        zj = os.path.join(tmp_ckpt, "tensors", "w", "zarr.json")
        meta = json.load(open(zj))
        meta["shape"] = [1 << 24]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 24]
        open(zj, "w").write(json.dumps(meta))
    _plant(tmp_ckpt, _rle_frame(4 << 24)[: 4 + 1 + 8 + 4], layout)  # 1 block: far too small
    before = _reset_peak_mib()
    with pytest.raises(CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    want = ("SP-PACK-4",) if layout == "packed" else ("SP-READ-6", "SP-READ-3")
    assert e.value.spec_id in want, e.value
    assert _peak_mib() - before < 48  # not the 64 MiB the tensor declares


@LAYOUTS
def test_a_zstd_codec_of_another_form_is_unsupported(tmp_ckpt, layout):
    _saved(tmp_ckpt, 16, layout)
    if layout == "per-array":
        zj = os.path.join(tmp_ckpt, "tensors", "w", "zarr.json")
        meta = json.load(open(zj))
        meta["codecs"][1]["configuration"]["dictionary"] = "d1"  # a later option
        open(zj, "w").write(json.dumps(meta))
    else:
        from shardpoint_conformance.vector_damage import rewrite_body

        rewrite_body(
            tmp_ckpt,
            lambda b: b["packed"]["arrays"][0][2]["configuration"].update(dictionary="d1"),
        )
    with pytest.raises(UnsupportedFormatError, match="zstd codec") as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-ARRAY-1"


def _two_ranks(rank, world, root):
    import torch

    full = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    a, b = (0, 25) if rank == 0 else (25, 40)  # uneven rows: the plan's grid moves data
    state = {"w": sp.ShardedTensor(full[a:b].clone(), (40, 6), (a, 0)), "step": 7}
    sp.save(state, f"{root}/sync", compression="zstd", async_save=True).wait()  # packed
    sp.save(state, f"{root}/files", compression="zstd", backend=sp.ZarrBackend())
    got = [sp.load(f"{root}/{d}")["w"].tolist() == full.tolist() for d in ("sync", "files")]
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
        assert got == [True, True]
        assert mixed.endswith("names compression") and not exists, mixed
    m = read_metadata(str(tmp_path / "sync"))  # both ranks' chunks, one chain
    assert m.packed.codecs == [zstd_codec(3)] and tuple(m.format_version) == (1, 5)
    meta = json.load(open(tmp_path / "files" / "tensors" / "w" / "zarr.json"))
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]
