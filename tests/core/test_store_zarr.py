"""The Zarr array layer over byte stores (shardpoint_core.arrays.array): files byte for byte
what TensorStore writes in every dtype (plain and sharded chunks, edge chunks, 0-d, empty),
TensorStore reads ours (4 KiB-aligned inner chunks too), region reads and writes cutting
through chunks against a numpy model, and every reader rule on damaged stores."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings, strategies as st

from shardpoint_core.format.dtypes import DTYPES
from shardpoint_testing.tensors import random_array, same_bits
from shardpoint_core.format.errors import CorruptCheckpointError, UnsupportedFormatError
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.stores import FileStore, MemoryStore
from shardpoint_core.arrays.array import (
    ArrayLayout,
    chunk_key,
    read_array_meta,
    read_region,
    write_array_meta,
    write_chunk,
    write_region,
)

KW = dict(shard_above_bytes=4096, inner_chunk_bytes=1024)
CASES = {
    "edge": ((37, 29), (10, 8)),
    "shard": ((130, 48), (128, 48)),
    "cube": ((5, 7, 9), (2, 7, 4)),
    "scalar": ((), ()),
    "empty": ((0, 4), (1, 4)),
}


def _files(root: str) -> dict:
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _ts_spec(path: str) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"}}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_bytes_equal_tensorstores_and_tensorstore_reads_ours(tmp_path, dtype):
    ours, theirs = FileStore(str(tmp_path / "ours"), create=True), str(tmp_path / "ts")
    for name, (shape, chunk) in CASES.items():
        a = random_array(f"{dtype}-{name}", shape, DTYPES[dtype].numpy)
        lay = ArrayLayout.create(shape, dtype, chunk, **KW)
        write_array_meta(ours, name, lay)
        write_region(ours, name, lay, (0,) * len(shape), a)
        meta = json.loads(lay.zarr_json())
        meta.pop("zarr_format"), meta.pop("node_type")
        t = ts.open(
            {
                **_ts_spec(f"{theirs}/{name}"),
                "metadata": meta,
                "create": True,
                "store_data_equal_to_fill_value": True,
            }
        ).result()
        t.write(a).result()
        back = (
            ts.open(
                {**_ts_spec(f"{ours.root}/{name}"), "open": True, "fill_missing_data_reads": False}
            )
            .result()
            .read()
            .result()
        )
        assert same_bits(back, a), name
        got = np.empty(shape, a.dtype)
        read_region(
            ours,
            name,
            read_array_meta(ours, name, ArraySpec(shape, dtype, chunk), name),
            (0,) * len(shape),
            got,
            name,
        )
        assert same_bits(got, a), name
    assert ArrayLayout.create((130, 48), dtype, (128, 48), **KW).inner is not None
    assert _files(ours.root) == _files(theirs)


def test_aligned_inner_chunks_read_by_tensorstore(tmp_path):
    """Inner chunks of 256 KiB and more start on 4 KiB boundaries; TensorStore reads them."""
    s = FileStore(str(tmp_path), create=True)
    a = np.random.default_rng(0).standard_normal((512, 300)).astype(np.float32)
    lay = ArrayLayout.create(
        a.shape, "float32", (512, 300), shard_above_bytes=1 << 19, inner_chunk_bytes=300 << 10
    )
    assert lay.inner == (256, 300)
    write_array_meta(s, "w", lay)
    write_region(s, "w", lay, (0, 0), a)
    assert s.head("w/c/0/0").size == 2 * 311296 + 2 * 16 + 4  # 4 KiB-aligned strides
    back = ts.open({**_ts_spec(f"{tmp_path}/w"), "open": True}).result().read().result()
    assert np.array_equal(back, a)


def test_reads_what_tensorstore_wrote(tmp_path):
    a = np.arange(130 * 48, dtype=np.int32).reshape(130, 48)
    lay = ArrayLayout.create(a.shape, "int32", (64, 48), **KW)
    meta = json.loads(lay.zarr_json())
    meta.pop("zarr_format"), meta.pop("node_type")
    ts.open(
        {
            **_ts_spec(f"{tmp_path}/w"),
            "metadata": meta,
            "create": True,
            "store_data_equal_to_fill_value": True,
        }
    ).result().write(a).result()
    s = FileStore(str(tmp_path))
    lay2 = read_array_meta(s, "w", ArraySpec(a.shape, "int32", (64, 48)), "w")
    out = np.empty((70, 20), np.int32)
    read_region(s, "w", lay2, (50, 13), out, "w")
    assert np.array_equal(out, a[50:120, 13:33])


@st.composite
def _cases(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(nd))
    chunk = tuple(draw(st.integers(1, n + 2)) for n in shape)
    sharded = draw(st.booleans())
    lo = tuple(draw(st.integers(0, n - 1)) for n in shape)
    hi = tuple(draw(st.integers(l_ + 1, n)) for l_, n in zip(lo, shape))
    cuts = [tuple(draw(st.integers(0, n)) for n in shape) for _ in range(draw(st.integers(0, 2)))]
    return shape, chunk, sharded, lo, hi, cuts


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_region_writes_and_reads_cut_through_chunks(case):
    """Pieces written at random cuts (partial chunks: read, changed, rewritten) and a random
    region read back, against numpy."""
    shape, chunk, sharded, lo, hi, cuts = case
    s = MemoryStore()
    kw = dict(shard_above_bytes=0, inner_chunk_bytes=8) if sharded else {}
    lay = ArrayLayout.create(shape, "int16", chunk, **kw)
    write_array_meta(s, "a", lay)
    model = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape)
    bounds = sorted(set([0, *[c[0] for c in cuts], shape[0]]))
    for a, b in zip(bounds, bounds[1:]):  # row bands, each cutting through chunks
        write_region(s, "a", lay, (a,) + (0,) * (len(shape) - 1), model[a:b])
    out = np.empty(tuple(h - l_ for l_, h in zip(lo, hi)), np.int16)
    read_region(s, "a", lay, lo, out, "a")
    assert np.array_equal(out, model[tuple(slice(l_, h) for l_, h in zip(lo, hi))])


def _damaged(sharded: bool):
    s = MemoryStore()
    kw = KW if sharded else {}
    shape, chunk = ((130, 48), (64, 48)) if sharded else ((20, 8), (10, 8))
    lay = ArrayLayout.create(shape, "float32", chunk, **kw)
    assert (lay.inner is not None) == sharded
    write_array_meta(s, "w", lay)
    write_region(s, "w", lay, (0, 0), np.ones(shape, np.float32))
    return s, lay, np.empty(shape, np.float32)


def _fails(s, lay, out, sid):
    with pytest.raises(CorruptCheckpointError) as e:
        read_region(s, "w", lay, (0,) * len(out.shape), out, "model/w")
    assert e.value.spec_id == sid and "model/w" in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("sharded", [False, True])
def test_missing_truncated_and_flipped_chunks(sharded):
    s, lay, out = _damaged(sharded)
    k = chunk_key("w", (1, 0))
    blob = s.get(k)
    s.delete([k])
    assert "w/c/1/0" in _fails(s, lay, out, "SP-READ-2")
    s.put(k, blob[:-1])
    _fails(s, lay, out, "SP-READ-3")
    s.put(k, blob[:10] + bytes([blob[10] ^ 1]) + blob[11:])
    _fails(s, lay, out, "SP-READ-3")
    s.put(k, blob + b"x")  # a longer file: a plain chunk's size, a shard's index
    _fails(s, lay, out, "SP-READ-3")


def test_shard_index_rules():
    s, lay, out = _damaged(True)
    k = chunk_key("w", (1, 0))
    blob = bytearray(s.get(k))
    n = len(lay.chunk) and (64 // lay.inner[0]) * (48 // lay.inner[1])
    idx = np.frombuffer(bytes(blob[-(16 * n + 4) : -4]), "<u8").reshape(n, 2).copy()
    present = int(np.flatnonzero(idx[:, 0] != 2**64 - 1)[0])
    for bad, sid in (
        ((2**64 - 1, 2**64 - 1), "SP-READ-2"),
        ((len(blob), idx[present, 1]), "SP-READ-3"),
        ((0, idx[present, 1] + 4), "SP-READ-3"),
        ((2**64 - 1, idx[present, 1]), "SP-READ-3"),
    ):
        j = idx.copy()
        j[present] = bad
        ib = j.reshape(-1).view(np.uint8).tobytes()
        import crc32c

        s.put(k, bytes(blob[: -(16 * n + 4)]) + ib + crc32c.crc32c(ib).to_bytes(4, "little"))
        _fails(s, lay, out, sid)


class _Counted:
    """A store's protocol only (no ``get_suffix``), counting the calls that reach it."""

    def __init__(self, store):
        self.s, self.calls = store, []
        self.url, self.capabilities = store.url, store.capabilities

    def __getattr__(self, name):
        if name not in ("get", "get_range", "read_into", "put", "head", "list", "delete"):
            raise AttributeError(name)

        def call(*a, **kw):
            self.calls.append((name, a[0]))
            return getattr(self.s, name)(*a, **kw)

        return call


def test_shard_reads_coalesce_inner_chunks_with_or_without_get_suffix():
    """A region of a shard is read by its index and one read per run of back-to-back inner
    chunks it meets; a store with ``get_suffix`` (memory, files, S3) answers the index in one
    call, one without it by a ``head`` and a ranged read."""
    lay = ArrayLayout.create(
        (64, 16), "float32", (64, 16), shard_above_bytes=1024, inner_chunk_bytes=256
    )  # 16 inner chunks of 4 rows
    x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    mem = MemoryStore()
    write_region(mem, "w", lay, (0, 0), x)
    for store, index_calls in (
        (_Counted(mem), [("head", "w/c/0/0"), ("get_range", "w/c/0/0")]),
        (mem, None),
    ):
        out = np.empty((10, 16), np.float32)
        read_region(store, "w", lay, (6, 0), out, "w")  # rows 6-15: inner chunks 1-3
        assert np.array_equal(out, x[6:16])
        if index_calls is not None:
            assert store.calls == index_calls + [("read_into", "w/c/0/0")]


def test_bool_bytes_other_than_0_1_refused_as_read_3():
    s = MemoryStore()
    lay = ArrayLayout.create((4,), "bool", (4,))
    write_array_meta(s, "w", lay)
    import crc32c

    data = bytes([0, 1, 2, 0])
    s.put(chunk_key("w", (0,)), data + crc32c.crc32c(data).to_bytes(4, "little"))
    assert "[SP-READ-5]" in _fails(s, lay, np.empty(4, bool), "SP-READ-3")


def test_zarr_json_rules():
    s = MemoryStore()
    spec = ArraySpec((4, 4), "float32", (2, 4))
    with pytest.raises(CorruptCheckpointError) as e:
        read_array_meta(s, "w", spec, "w")
    assert e.value.spec_id == "SP-ARRAY-1"
    write_array_meta(s, "w", ArrayLayout.create((4, 4), "float32", (2, 4)))
    assert read_array_meta(s, "w", spec, "w").chunk == (2, 4)
    with pytest.raises(CorruptCheckpointError) as e:
        read_array_meta(s, "w", ArraySpec((4, 5), "float32", (2, 4)), "w")
    assert e.value.spec_id == "SP-ARRAY-2"
    meta = json.loads(s.get("w/zarr.json"))
    s.put("w/zarr.json", json.dumps(dict(meta, extra={"x": 1})).encode())
    with pytest.raises(UnsupportedFormatError):
        read_array_meta(s, "w", spec, "w")
    s.put("w/zarr.json", b" " * (2 << 20))
    with pytest.raises(CorruptCheckpointError) as e:
        read_array_meta(s, "w", spec, "w")
    assert e.value.spec_id == "SP-SEC-2"
    s.put("w/zarr.json", b"{not json")
    with pytest.raises(CorruptCheckpointError, match="not JSON"):
        read_array_meta(s, "w", spec, "w")


def test_write_chunk_is_one_vectored_put():
    s = MemoryStore()
    lay = ArrayLayout.create((4, 4), "float32", (2, 4))
    write_chunk(s, "w", lay, (1, 0), np.full((2, 4), 2.0, np.float32))
    assert [i.key for i in s.list()] == ["w/c/1/0"] and s.head("w/c/1/0").size == 36


_NO_TS = r"""
import sys
sys.modules["tensorstore"] = None          # any import of it now fails
import numpy as np, shardpoint as sp
from shardpoint_core.format.dtypes import DTYPES
from shardpoint_core.verify import verify_checkpoint
from shardpoint_core.transactions.backend import ZarrBackend
be = ZarrBackend(shard_above_bytes=4096, inner_chunk_bytes=1024)
rng = np.random.default_rng(1)
state = {n: (rng.integers(0, 2, (70, 33)).astype(bool) if n == "bool" else
             rng.integers(0, 256, 70 * 33 * np.dtype(d.numpy).itemsize, dtype=np.uint8)
             .view(d.numpy).reshape(70, 33)) for n, d in DTYPES.items()}
sp.save(state, "ck", backend=be)
back = sp.load("ck", backend=be)
assert all(back[k].tobytes() == v.tobytes() for k, v in state.items())
assert sp.open("ck", backend=be)["float32"][5:60, 3:31].to_numpy().tobytes() == \
    state["float32"][5:60, 3:31].tobytes()
assert verify_checkpoint("ck").ok
try:
    ZarrBackend(direct_reads=False).read_manifest  # constructing needs no TensorStore
    sp.load("ck", backend=ZarrBackend(direct_reads=False))
    raise SystemExit("loaded through TensorStore without it")
except sp.InvalidOptionError as e:
    assert "shardpoint[tensorstore]" in str(e)
print("ok")
"""


def test_save_load_open_verify_without_tensorstore(tmp_path):
    """TensorStore is optional: with its import failing, every dtype saves, loads (whole and
    through chunks), opens lazily and verifies; the cross-check paths say how to get it."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _NO_TS], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
