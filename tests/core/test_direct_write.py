"""Direct chunk writes (the backend's save fast path): every file is byte for byte what
TensorStore writes for the same save, in every dtype, for plain and sharded chunks, edge
chunks, 0-d and empty tensors and non-contiguous sources; the spec-only reader reads them;
a write that is not one whole chunk goes through the Zarr layer (shardpoint_core.arrays.array)."""

import hashlib
import json
import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint.tree.dtypes import DTYPES
from shardpoint_core.format.spec import ArraySpec
from shardpoint_conformance.independent_reader import read_independently
from shardpoint_testing.tensors import random_bits, same_bits
from shardpoint_core.transactions.backend import ZarrBackend

KW = dict(shard_above_bytes=4096, inner_chunk_bytes=1024)
DIRECT = ZarrBackend(**KW)
VIA_TS = ZarrBackend(direct_writes=False, **KW)
SMALL = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=1500))  # many chunks, ragged edges


def _state(dtype: torch.dtype) -> dict:
    return {
        "edge": random_bits("edge", (37, 29), dtype),  # edge chunks in both dimensions
        "shard": random_bits("shard", (130, 48), dtype),  # sharded, last shard partly absent
        "cube": random_bits("cube", (5, 7, 9), dtype),
        "vec": random_bits("vec", (1001,), dtype),
        "cols": random_bits("cols", (29, 37), dtype).t(),  # a non-contiguous source
        "scalar": random_bits("scalar", (), dtype),
        "empty": random_bits("empty", (0, 4), dtype),
    }


def _files(root: str) -> dict:
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("opts", [None, SMALL], ids=["default", "small-chunks"])
def test_files_equal_tensorstores_bytes(tmp_path, name, opts):
    st = _state(DTYPES[name].torch)
    sp.save(st, str(tmp_path / "direct"), backend=DIRECT, options=opts)
    sp.save(st, str(tmp_path / "ts"), backend=VIA_TS, options=opts)
    mine, theirs = _files(str(tmp_path / "direct")), _files(str(tmp_path / "ts"))
    # The manifest is the coordinator's (it records when it was written), not the writer's.
    assert mine.pop("manifest.msgpack") and theirs.pop("manifest.msgpack")
    assert sorted(mine) == sorted(theirs)
    different = [p for p in mine if mine[p] != theirs[p]]
    assert not different, f"{name}: files differ from TensorStore's: {different[:5]}"
    if opts is None and DTYPES[name].itemsize > 1:
        assert any(
            "sharding_indexed" in str(v) for p, v in mine.items() if p.endswith("zarr.json")
        ), "no sharded array was exercised"
    got = read_independently(str(tmp_path / "direct"))["tensors"]
    for key, t in st.items():
        assert got[key]["sha256"] == _sha(t), key


def test_round_trip_through_the_library(tmp_ckpt):
    st = _state(torch.bfloat16) | {"f8": random_bits("f8", (33, 65), torch.float8_e4m3fn)}
    sp.save(st, tmp_ckpt, backend=DIRECT)
    back = sp.load(tmp_ckpt)
    assert all(same_bits(back[k], st[k]) for k in st)


def test_whole_chunks_never_touch_tensorstore(tmp_path):
    root = str(tmp_path)
    h = DIRECT.open_array_for_write(root, "a", ArraySpec((10, 3), "float32", (4, 3)))
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    for op in [DIRECT.write(h, (o, 0), x[o : o + 4]) for o in (0, 4, 8)]:
        op.result()  # an op like TensorStore's future (the fault injector waits on one)
    assert type(h).__name__ == "_WriteHandle" and h._ts is None
    assert sorted(os.listdir(os.path.join(root, "a", "c"))) == ["0", "1", "2"]


def test_a_write_that_is_not_one_chunk_goes_through_the_zarr_layer(tmp_path):
    root = str(tmp_path / "s")
    os.makedirs(root)
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    h = DIRECT.open_array_for_write(root, "a", ArraySpec((10, 3), "float32", (4, 3)))
    DIRECT.wait(
        [
            DIRECT.write(h, (0, 0), x[0:8]),  # two chunks at once
            DIRECT.write(h, (8, 0), x[8:10, :2]),  # part of a chunk...
            DIRECT.write(h, (8, 2), x[8:10, 2:]),
        ]
    )  # ...and the rest of it, at once
    assert h._ts is None  # TensorStore never opened
    DIRECT.flush(root)
    r = DIRECT.open_array_for_read(root, "a", ArraySpec((10, 3), "float32", (4, 3)), "a")
    out = np.zeros_like(x)
    DIRECT.wait([DIRECT.read_into(r, (0, 0), out)])
    assert np.array_equal(out, x)


def test_a_failed_write_fails_the_save_and_commits_nothing(tmp_path):
    """A directory where a chunk file must go: the writer thread's OSError reaches the caller
    as a SaveFailedError, the staging directory is removed and nothing is committed."""
    target = str(tmp_path / "ck")

    class Blocked(ZarrBackend):
        def open_array_for_write(self, root, array_path, spec):
            h = super().open_array_for_write(root, array_path, spec)
            os.makedirs(os.path.join(root, array_path, "c", "0", "0"))
            return h

    with pytest.raises(sp.errors.SaveFailedError, match="IsADirectoryError"):
        sp.save({"w": torch.ones(4, 4)}, target, backend=Blocked())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "shape,chunk",
    [
        ((13, 3), (8, 3)),  # last shard: absent inner chunks
        ((13, 5), (8, 4)),  # shards clipped in both dims
        ((9, 2, 5), (4, 2, 4)),
    ],
)
def test_edge_shards_equal_tensorstores_bytes(tmp_path, shape, chunk):
    small = dict(shard_above_bytes=16, inner_chunk_bytes=8)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for be, name in (
        (ZarrBackend(**small), "direct"),
        (ZarrBackend(direct_writes=False, **small), "ts"),
    ):
        h = be.open_array_for_write(str(tmp_path), name, ArraySpec(shape, "float32", chunk))
        ops = []
        for idx in np.ndindex(*[-(-n // c) for n, c in zip(shape, chunk)]):
            off = tuple(i * c for i, c in zip(idx, chunk))
            ops.append(be.write(h, off, x[tuple(slice(o, o + c) for o, c in zip(off, chunk))]))
        be.wait(ops)
    mine, theirs = _files(str(tmp_path / "direct")), _files(str(tmp_path / "ts"))
    assert "sharding_indexed" in mine["zarr.json"].decode()
    assert mine == theirs


def _shard(path: str, m, key: str):
    """(the stored bytes of the first chunk of tensor ``key``, a shard; its inner chunk
    shape): the chunk file of the per-array layout, or its record's bytes in a packed data
    object (whose offset is then 4 KiB aligned too, [SP-PACK-5])."""
    e = m.tensors[key]
    if m.packed is None:
        with open(os.path.join(path, e.array, "zarr.json")) as fh:
            meta = json.load(fh)
        assert meta["chunk_grid"]["configuration"]["chunk_shape"] == list(e.chunk_shape)
        with open(os.path.join(path, e.array, "c", "0", "0"), "rb") as fh:
            return fh.read(), meta["codecs"][0]["configuration"]["chunk_shape"]
    obj, off, n, _crc = e.packed.chunk(0)
    assert off % 4096 == 0, (key, off)
    with open(os.path.join(path, obj), "rb") as fh:
        fh.seek(off)
        return fh.read(n), list(e.packed.inner)


@pytest.mark.parametrize(
    "layout", ["packed", pytest.param("per-array", marks=pytest.mark.slow)]
)  # per-array: the layout of section 3, on request; its shard padding is the same writer's
def test_big_inner_chunks_start_on_4k_boundaries_and_every_reader_follows_the_index(
    tmp_path, layout
):
    """Inner chunks of 256 KiB and more are padded to 4 KiB boundaries (the spec allows gaps
    between inner chunks), so a read keeps the destination's alignment; the direct reader,
    TensorStore and the spec-only reader all read the padded shards bit for bit, whole and
    by column stripes."""
    import crc32c

    st = {
        "w": random_bits("w", (2048, 2048)),  # 16 MiB: a shard of 2 MiB chunks
        "h": random_bits("h", (4096, 1500), torch.bfloat16),
    }  # inner chunks not 4 KiB multiples
    path = str(tmp_path / "ck")
    sp.save(st, path, backend=ZarrBackend() if layout == "per-array" else None)
    m = sp.read_metadata(path)
    assert (m.packed is None) == (layout == "per-array")
    for key in st:
        raw, inner = _shard(path, m, key)
        per = [c // i for c, i in zip(m.tensors[key].chunk_shape, inner)]
        count = int(np.prod(per))
        index = np.frombuffer(raw[-4 - 16 * count : -4], "<u8").reshape(count, 2)
        assert crc32c.crc32c(raw[-4 - 16 * count : -4]) == int.from_bytes(raw[-4:], "little")
        present = index[index[:, 0] != 2**64 - 1]
        assert len(present) > 1 and all(int(o) % 4096 == 0 for o, _ in present), key
        ends = sorted(int(o + b) for o, b in present)
        starts = sorted(int(o) for o, _ in present)
        gaps = [raw[e:s] for e, s in zip(ends, starts[1:])]
        assert any(gaps) and all(gp == bytes(len(gp)) for gp in gaps), key  # zero padding
    got = read_independently(path)["tensors"]
    assert all(got[k]["sha256"] == _sha(t) for k, t in st.items())
    for be in (None, ZarrBackend(direct_reads=False)):
        whole = sp.load(path, backend=be)
        assert all(
            torch.equal(whole[k].view(torch.uint8), t.view(torch.uint8)) for k, t in st.items()
        )
        stripe = {"w": sp.ShardedTensor(torch.zeros(2048, 700), (2048, 2048), (0, 1000))}
        sp.load(path, like=stripe, backend=be, strict=False)
        assert torch.equal(
            stripe["w"].data.view(torch.int32), st["w"][:, 1000:1700].contiguous().view(torch.int32)
        )
