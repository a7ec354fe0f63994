"""The packed layout end to end (format 1.4, spec/format.md section 13): PackedBackend saves
on files and on the real S3 server, any backend loads, every reader check of the stored
side ([SP-PACK-6], [SP-PACK-7]) on damaged files, the commit's promises (leftovers found,
replaced objects deleted), and the refusal of a 1.3 reader."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shardpoint as sp
from shardpoint_core.format import manifest as manifest_mod
from shardpoint_core.format.errors import CorruptCheckpointError, UnsupportedFormatError
from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for, decode_manifest
from shardpoint_core.format.packed import RECORD
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.transactions.writer import CheckpointWriter


def _state():
    rng = np.random.default_rng(7)
    return {
        "model": {
            "w": rng.standard_normal((64, 48)).astype(np.float32),
            "big": rng.standard_normal((2100, 1100)).astype(np.float32),  # sharded
            "b": np.arange(7, dtype=np.int16),
            "flag": np.array([True, False]),
            "empty": np.zeros((0, 3), np.float64),
            "scalar": np.float64(2.5),
        },
        "step": 3,
    }


def _files(root):
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _ds, fs in os.walk(root) for f in fs
    )


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        else:
            x, y = np.asarray(a[k]), np.asarray(b[k])
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k


def test_save_on_files_is_the_manifest_and_one_object_and_loads_with_any_backend(tmp_ckpt):
    state = _state()
    sp.save(state, tmp_ckpt, backend=PackedBackend())
    files = _files(tmp_ckpt)
    assert len(files) == 2 and files[0] == "manifest.msgpack", files
    assert files[1].startswith("packed/") and files[1].endswith("-0.bin")
    m = read_metadata(tmp_ckpt)
    assert m.format_version == (1, 4)
    assert all(e.chunk_crc32c is not None for e in m.tensors.values() if 0 not in e.shape)
    assert dict(m.packed.arrays)["tensors/model/big"] is not None  # a shard
    _same(sp.load(tmp_ckpt), state)  # the default backend
    _same(sp.load(tmp_ckpt, backend=PackedBackend()), state)
    assert sp.verify.verify_checkpoint(tmp_ckpt).ok


def test_partial_reads_and_adjacent_chunks(tmp_ckpt):
    w = np.arange(40 * 30, dtype=np.float32).reshape(40, 30)
    entry = TensorEntry("w", array_path_for("w"), w.shape, "float32", (4, 30))
    with CheckpointWriter.begin(tmp_ckpt, backend=PackedBackend()) as wr:
        h = wr.open_array(entry.array, entry.spec)
        wr.wait([wr.write(h, (i, 0), w[i : i + 8]) for i in range(0, 40, 8)])
        wr.flush()
        wr.commit(Manifest({"dict": [["w", {"tensor": "w"}]]}, {"w": entry}, {}))
    r = CheckpointReader.open(tmp_ckpt)
    a = r.array("w")
    out = np.empty((13, 7), np.float32)
    r.wait([r.read_into(a, (5, 3), out)])
    assert np.array_equal(out, w[5:18, 3:10])


def test_two_writers_each_write_their_own_object(tmp_ckpt):
    """Two ranks (two backends, as two processes would have) write halves of one tensor and
    a tensor each; the coordinator's manifest indexes both objects."""
    x = np.arange(64, dtype=np.int32).reshape(8, 8)
    ex = TensorEntry("x", array_path_for("x"), (8, 8), "int32", (4, 8))
    ey = TensorEntry("y", array_path_for("y"), (3,), "int32", (3,))
    b0, b1 = PackedBackend(), PackedBackend()
    c = CheckpointWriter.begin(tmp_ckpt, backend=b0)
    o = CheckpointWriter.join(tmp_ckpt, c.staging, backend=b1)
    h0, h1 = c.open_array(ex.array, ex.spec), o.open_array(ex.array, ex.spec)
    c.wait([c.write(h0, (0, 0), x[:4])])
    o.wait(
        [
            o.write(h1, (4, 0), x[4:]),
            o.write(o.open_array(ey.array, ey.spec), (0,), np.array([1, 2, 3], np.int32)),
        ]
    )
    c.flush()
    o.flush()
    c.commit(
        Manifest(
            {"dict": [["x", {"tensor": "x"}], ["y", {"tensor": "y"}]]},
            {"x": ex, "y": ey},
            {},
            save_world_size=2,
        )
    )
    assert len([f for f in _files(tmp_ckpt) if f.startswith("packed/")]) == 2
    got = sp.load(tmp_ckpt)
    assert np.array_equal(got["x"], x) and list(got["y"]) == [1, 2, 3]


def _damage(path, fn):
    m = read_metadata(path)
    obj = os.path.join(path, m.packed.objects[0][0])
    fn(obj, m)
    return obj


def _rewrite_index(path, change):
    """Re-seal the manifest after ``change(records)``, as a hostile writer would (the
    codec's encoder checks what it writes, so the field is changed in the body itself)."""
    import hashlib

    import msgpack
    from shardpoint_core.format import values

    mpath = os.path.join(path, "manifest.msgpack")
    with open(mpath, "rb") as f:
        env = msgpack.unpackb(f.read())
    body = values.unpack(env["body"])
    rec = np.frombuffer(body["packed"]["index"], RECORD).copy()
    change(rec)
    body["packed"]["index"] = rec.tobytes()
    raw = values.pack(body)
    with open(mpath, "wb") as f:
        f.write(msgpack.packb({"sha256": hashlib.sha256(raw).digest(), "body": raw}))


@pytest.mark.parametrize(
    "case,rule",
    [
        ("object_missing", "SP-READ-2"),
        ("object_truncated", "SP-READ-3"),
        ("object_symlink", "SP-SEC-5"),
        ("bit_flip", "SP-READ-3"),
        ("records_swapped", "SP-READ-8"),
    ],
)
def test_damaged_packed_checkpoints_are_refused_with_their_rule(tmp_ckpt, tmp_path, case, rule):
    a = np.arange(16, dtype=np.float32)
    sp.save({"a": a, "b": a + 100}, tmp_ckpt, backend=PackedBackend())
    if case == "object_missing":
        _damage(tmp_ckpt, lambda o, m: os.remove(o))
    elif case == "object_truncated":
        _damage(tmp_ckpt, lambda o, m: os.truncate(o, os.path.getsize(o) - 1))
    elif case == "object_symlink":

        def link(o, m):
            os.rename(o, str(tmp_path / "elsewhere"))
            os.symlink(str(tmp_path / "elsewhere"), o)

        _damage(tmp_ckpt, link)
    elif case == "bit_flip":

        def flip(o, m):
            with open(o, "r+b") as f:
                f.seek(5)
                byte = f.read(1)
                f.seek(5)
                f.write(bytes([byte[0] ^ 1]))

        _damage(tmp_ckpt, flip)
    else:  # a and b (same size) point at each other's bytes: only the crc32c tells

        def swap(rec):
            rec["offset"][[0, 1]] = rec["offset"][[1, 0]]

        _rewrite_index(tmp_ckpt, swap)
    with pytest.raises(CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == rule, e.value
    if case != "records_swapped":
        assert "packed/" in str(e.value)


def test_a_reader_of_1_3_refuses_a_packed_checkpoint_as_unsupported(tmp_ckpt, monkeypatch):
    """A reader that does not know the field refuses it under [SP-VER-3], naming it."""
    sp.save({"a": np.ones(3, np.float32)}, tmp_ckpt, backend=PackedBackend())
    data = open(os.path.join(tmp_ckpt, "manifest.msgpack"), "rb").read()
    monkeypatch.setattr(manifest_mod, "_TOP_FIELDS", manifest_mod._TOP_FIELDS - {"packed"})
    with pytest.raises(UnsupportedFormatError) as e:
        decode_manifest(data)
    assert e.value.spec_id == "SP-VER-3" and "'packed'" in str(e.value)


def test_a_failed_save_leaves_nothing_and_a_crashed_one_is_a_leftover(tmp_path):
    target = str(tmp_path / "ck")
    be = PackedBackend()
    spec = ArraySpec((4,), "float32", (4,))
    with pytest.raises(RuntimeError):
        with CheckpointWriter.begin(target, backend=be) as w:
            w.wait([w.write(w.open_array("tensors/a", spec), (0,), np.ones(4, np.float32))])
            raise RuntimeError("a rank failed")
    assert os.listdir(tmp_path) == []
    w = CheckpointWriter.begin(target, backend=be)  # never commits: a crash
    w.wait([w.write(w.open_array("tensors/a", spec), (0,), np.ones(4, np.float32))])
    w.flush()
    leftovers = be.list_leftovers(str(tmp_path))
    assert [lo.path for lo in leftovers] == [w.staging]
    w.abort()


def test_on_s3_one_object_per_writer_and_replacement_deletes_the_old_objects(s3_env):
    from shardpoint_core.stores.location import locate

    url = s3_env.url(s3_env.fresh_prefix("packed") + "/ck")
    state = _state()
    be = PackedBackend(cap=2 << 20)  # the 5 MB shard splits the data into objects
    sp.save(state, url, backend=be)
    store, key = locate(url).pair()
    first = sorted(i.key for i in store.list(key + "/"))
    data = [k for k in first if "/packed/" in k]
    assert len(data) >= 2 and all(k.endswith(".bin") for k in data), first
    assert not any("/tensors/" in k or k.endswith(".idx") for k in first)
    _same(sp.load(url), state)
    sp.save(state, url, backend=be, overwrite=True)
    second = sorted(i.key for i in store.list(key + "/"))
    assert not set(data) & set(second)  # the replaced save's objects are gone
    _same(sp.load(url, backend=ZarrBackend()), state)


def test_cap_splits_objects_on_files(tmp_ckpt):
    state = {f"t{i}": np.full((300, 300), i, np.float32) for i in range(6)}  # 360 KB each
    sp.save(state, tmp_ckpt, backend=PackedBackend(cap=1 << 20))
    data = [f for f in _files(tmp_ckpt) if f.startswith("packed/")]
    assert len(data) == 3, data
    _same(sp.load(tmp_ckpt), state)
    m = read_metadata(tmp_ckpt)
    assert m.packed.records.dtype == RECORD


def _two_rank_save(rank, world, path):
    import torch

    from shardpoint_core.transactions.packed import PackedBackend as Packed

    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    state = {
        "w": sp.ShardedTensor(full[rank * 32 : (rank + 1) * 32].clone(), (64, 8), (rank * 32, 0)),
        "mine": sp.ShardedTensor(torch.full((4,), float(rank)), (8,), (rank * 4,)),
        "step": 5,
    }
    sp.save(state, path, backend=Packed())
    return True


def test_a_two_process_save_writes_one_object_per_rank(tmp_ckpt):
    """Real gloo ranks: each writes its chunks into its own object; the coordinator's
    manifest indexes both, and one process reads the whole tensor back."""
    from shardpoint_testing.launch import run_world

    assert run_world(2, _two_rank_save, tmp_ckpt, timeout=120, pg_timeout=30) == [True, True]
    assert len([f for f in _files(tmp_ckpt) if f.startswith("packed/")]) == 2
    assert not [f for f in _files(tmp_ckpt) if f.endswith(".idx")]
    got = sp.load(tmp_ckpt)
    assert np.array_equal(np.asarray(got["w"]), np.arange(512, dtype=np.float32).reshape(64, 8))
    assert list(np.asarray(got["mine"])) == [0.0] * 4 + [1.0] * 4


def test_every_tensor_opens_with_zarr_python_bit_for_bit(tmp_ckpt):
    """Issue 30 item 2: the documented lines open each tensor of a packed checkpoint with
    zarr-python 3, bit for bit what was saved (a shard, an edge chunk, bfloat16, 0-d)."""
    zarr = pytest.importorskip("zarr")
    import torch

    from shardpoint_core.transactions.packed_zarr import zarr_store
    from shardpoint_core.transactions.zarr_compat import register_zarr_dtypes

    state = {
        "w": np.random.default_rng(1).standard_normal((40, 30)).astype(np.float32),
        "e": np.arange(37 * 11, dtype=np.int16).reshape(37, 11),
        "h": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "s": torch.tensor(-0.0, dtype=torch.float64),
    }
    sp.save(
        state,
        tmp_ckpt,
        backend=PackedBackend(ZarrBackend(shard_above_bytes=256, inner_chunk_bytes=128)),
    )
    register_zarr_dtypes()
    store = zarr_store(tmp_ckpt)
    m = read_metadata(tmp_ckpt)
    for key, want in state.items():
        z = zarr.open_array(store, path=m.tensors[key].array, mode="r")
        got = z[...]
        want = (
            want.view(torch.int16 if want.dtype == torch.bfloat16 else want.dtype).numpy()
            if isinstance(want, torch.Tensor)
            else want
        )
        assert got.shape == want.shape
        assert np.ascontiguousarray(got).tobytes() == want.tobytes(), key
    assert dict(m.packed.arrays)["tensors/w"] is not None  # read through a shard
    assert sorted(zarr.open_group(store, mode="r").group_keys()) == ["tensors"]


def test_a_sparse_object_is_checked_before_allocating_and_sound_ones_are_not_sparse(tmp_ckpt):
    """[SP-SEC-6]: a data object whose chunk lies in a hole (a sparse file, as `truncate`
    makes) is refused by its crc32c before the tensor is allocated; the writer's own
    objects hold every byte, alignment padding included."""
    state = {f"t{i}": np.full((300, 300), i + 1, np.float32) for i in range(3)}  # aligned
    sp.save(state, tmp_ckpt, backend=PackedBackend())
    m = read_metadata(tmp_ckpt)
    obj = os.path.join(tmp_ckpt, m.packed.objects[0][0])
    st = os.stat(obj)
    assert st.st_blocks * 512 >= st.st_size  # no holes: the padding is written
    rec = m.tensors["t1"].packed.records[0]
    off, n = int(rec["offset"]), int(rec["length"])
    with open(obj, "r+b") as f:  # the chunk's bytes become a hole
        data = f.read()
        f.truncate(off)
        f.seek(off + n)
        f.write(data[off + n :])
    if os.stat(obj).st_blocks * 512 + (64 << 10) >= os.stat(obj).st_size:
        pytest.skip("this file system stores no holes")
    with pytest.raises(CorruptCheckpointError) as e:
        sp.load(tmp_ckpt)
    assert e.value.spec_id == "SP-READ-3" and "SP-SEC-6" in str(e.value)
