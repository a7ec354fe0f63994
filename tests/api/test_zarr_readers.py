"""Generic Zarr readers on shardpoint checkpoints (issue 33, item 4): zarr-python and TensorStore
read every dtype of the spec's table bit for bit, at the location ``zarr_path`` resolves through
the manifest, and a checkpoint browses as a Zarr group ([SP-LAYOUT-5]). The per-array layout
(``backend=ZarrBackend()``) is read in place; the packed one (the default since 1.4) through
``zarr_store`` and the TensorStore export (the second half)."""

import json
import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from shardpoint_core.format.dtypes import DTYPES
from shardpoint_core.verify import verify_checkpoint
from shardpoint_core.transactions.backend import ZarrBackend
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.arrays.groups import GROUP_JSON
from shardpoint_core.transactions.zarr_compat import (
    register_zarr_dtypes,
    zarr_group_path,
    zarr_path,
)

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")


def _bits(name: str, shape: tuple, seed: int) -> np.ndarray:
    """Random bytes as an array of dtype ``name`` (NaN payloads, subnormals and all); bools
    0/1 only."""
    dt = DTYPES[name].numpy
    raw = np.random.default_rng(seed).integers(
        0, 256, (int(np.prod(shape)) * dt.itemsize,), dtype=np.uint8
    )
    if name == "bool":
        raw &= 1
    return raw.view(dt).reshape(shape)


def _state() -> dict:
    """One tensor of each dtype (numpy, so no framework narrows one), and a nested one."""
    out = {name: _bits(name, (5, 7), i) for i, name in enumerate(sorted(DTYPES))}
    return {"dt": out, "model": {"layers": [{"w": _bits("bfloat16", (3, 4), 99)}]}}


def _leaves(state: dict) -> dict:
    out = {f"dt/{k}": v for k, v in state["dt"].items()}
    out["model/layers/0/w"] = state["model"]["layers"][0]["w"]
    return out


def _ts_read(path: str) -> np.ndarray:
    return (
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True)
        .result()
        .read()
        .result()
    )


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_every_dtype_reads_bit_for_bit_through_zarr_python_and_tensorstore(tmp_ckpt, sharded):
    state = _state()
    be = ZarrBackend(shard_above_bytes=16, inner_chunk_bytes=8) if sharded else ZarrBackend()
    sp.save(state, tmp_ckpt, backend=be)
    register_zarr_dtypes()
    register_zarr_dtypes()  # idempotent
    leaves = _leaves(state)
    assert {k.split("/")[1] for k in leaves if k.startswith("dt/")} == set(DTYPES)
    for key, want in leaves.items():
        where = zarr_path(tmp_ckpt, key)
        meta = json.load(open(os.path.join(where, "zarr.json")))
        assert meta["node_type"] == "array"
        assert (meta["codecs"][0]["name"] == "sharding_indexed") == sharded
        got_z = zarr.open_array(where, mode="r")[...]
        got_t = _ts_read(where)
        for got in (got_z, got_t):
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert got.tobytes() == want.tobytes(), key


def test_zarr_path_names_a_missing_key(tmp_ckpt):
    sp.save({"w": torch.ones(2)}, tmp_ckpt)
    assert zarr_path(tmp_ckpt, "w") == os.path.join(tmp_ckpt, "tensors", "w")
    with pytest.raises(KeyError, match="nope"):
        zarr_path(tmp_ckpt, "nope")


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_a_checkpoint_browses_as_a_zarr_group(tmp_ckpt, layout):
    state = {"model": {"Enc": [torch.arange(6).reshape(2, 3)], "b": torch.ones(2)}, "step": 3}
    if layout == "packed":  # no files of its own: the groups are zarr_store's ([SP-PACK-3])
        sp.save(state, tmp_ckpt)
        g = zarr.open_group(sp.zarr_store(tmp_ckpt), mode="r")
        assert sorted(g["tensors/model"].group_keys()) == ["Enc~1"]
        assert sorted(g["tensors/model"].array_keys()) == ["b"]
        assert g["tensors/model/Enc~1/0"][...].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert not os.path.exists(os.path.join(tmp_ckpt, "zarr.json"))
        assert verify_checkpoint(tmp_ckpt, strict=True).ok
        return
    sp.save(state, tmp_ckpt, backend=ZarrBackend())
    for d in ("", "tensors", "tensors/model", "tensors/model/Enc~1"):
        with open(os.path.join(tmp_ckpt, d, "zarr.json"), "rb") as f:
            assert f.read() == GROUP_JSON, d
    assert zarr_group_path(tmp_ckpt) == tmp_ckpt
    g = zarr.open_group(tmp_ckpt, mode="r")
    assert sorted(g["tensors/model"].group_keys()) == ["Enc~1"]
    assert sorted(g["tensors/model"].array_keys()) == ["b"]
    assert g["tensors/model/Enc~1/0"][...].tolist() == [[0, 1, 2], [3, 4, 5]]
    # the strict validator accepts the group files ([SP-LAYOUT-5]) and still reports strays
    assert verify_checkpoint(tmp_ckpt, strict=True).ok
    os.makedirs(os.path.join(tmp_ckpt, "tensors", "stray"))
    with open(os.path.join(tmp_ckpt, "tensors", "stray", "zarr.json"), "wb") as f:
        f.write(GROUP_JSON)
    assert "SP-LAYOUT-3" in verify_checkpoint(tmp_ckpt, strict=True).spec_ids


def test_object_store_arrays_and_groups_lie_below_the_save_prefix(s3_env):
    url = f"s3://{s3_env.bucket}/{s3_env.fresh_prefix()}/ck"
    state = _state()
    sp.save(state, url, backend=ZarrBackend())  # packed: test_packed_on_s3_... below
    from shardpoint_core.stores.registry import bucket_store

    store, key = bucket_store(url, "test")
    for k, want in _leaves(state).items():
        where = zarr_path(url, k)
        save_dir = where[len(url) + 1 :].split("/")[0]
        assert save_dir.startswith("save-") and where.endswith(f"/tensors/{k}")
        got = (
            ts.open(
                {
                    "driver": "zarr3",
                    "kvstore": {
                        "driver": "s3",
                        "bucket": s3_env.bucket,
                        "path": where.split("/", 3)[3] + "/",
                        "endpoint": os.environ["AWS_ENDPOINT_URL"],
                        "aws_region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                    },
                },
                open=True,
            )
            .result()
            .read()
            .result()
        )
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), k
    obstore = pytest.importorskip("obstore")  # zarr-python's S3 route without fsspec
    register_zarr_dtypes()
    s3 = obstore.store.S3Store(
        s3_env.bucket,
        prefix=zarr_group_path(url).split("/", 3)[3],
        endpoint=os.environ["AWS_ENDPOINT_URL"],
        region=os.environ["AWS_REGION"],
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        client_options={"allow_http": True},
    )
    group = zarr.open_group(zarr.storage.ObjectStore(s3, read_only=True), mode="r")
    for k, want in _leaves(state).items():
        got = group[f"tensors/{k}"][...]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), k
    for g in ("", "tensors/", "tensors/dt/", "tensors/model/layers/"):
        assert store.get_range(f"{key}/{save_dir}/{g}zarr.json", 0, 1 << 10) == GROUP_JSON
    assert zarr_group_path(url) == f"{url}/{save_dir}"


def test_a_group_inside_a_checkpoint_is_named_as_such(tmp_ckpt):
    """``tensors/`` (a group now, [SP-LAYOUT-5]) given for a checkpoint: the error says where
    the checkpoint is, not that a save never committed there (the per-array layout's
    directories: a packed checkpoint has none)."""
    sp.save({"model": {"w": torch.ones(2)}}, tmp_ckpt, backend=ZarrBackend())
    with pytest.raises(sp.CheckpointNotFoundError, match="Zarr group inside a checkpoint"):
        sp.load(os.path.join(tmp_ckpt, "tensors", "model"))
    with pytest.raises(sp.CheckpointNotFoundError, match="one tensor's Zarr array"):
        sp.load(os.path.join(tmp_ckpt, "tensors", "model", "w"))


# ------------------------------------------------------------- the packed layout (1.4)
def _packed(sharded: bool):
    from shardpoint_core.transactions.packed import PackedBackend

    zb = ZarrBackend(shard_above_bytes=16, inner_chunk_bytes=8) if sharded else ZarrBackend()
    return PackedBackend(zb)


def _open_ts(kv: dict, name: str) -> np.ndarray:
    spec = {"driver": "zarr3", "kvstore": {**kv, "path": name + "/"}}
    return ts.open(spec, open=True).result().read().result()


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_packed_every_dtype_reads_bit_for_bit_through_zarr_python_and_tensorstore(
    tmp_path, sharded, monkeypatch
):
    """Issue 30 item 2: every tensor of a packed checkpoint (every dtype of the spec's table,
    a shard's inner chunks, edge chunks) opens with zarr-python through ``zarr_store`` and with
    TensorStore through the OCDBT export, bit for bit; the export is split into several
    b-tree leaves under one interior node (a small leaf size) and copies no chunk."""
    from shardpoint_core.arrays import ocdbt
    from shardpoint_core.transactions.packed_zarr import zarr_store
    from shardpoint_core.transactions.ts_export import SPEC_NAME, export_tensorstore

    monkeypatch.setattr(ocdbt, "NODE_BYTES", 512)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "ck.ts")
    state = _state()
    sp.save(state, ck, backend=_packed(sharded))
    m = read_metadata(ck)
    assert m.packed is not None
    assert any(inner is not None for _n, inner in m.packed.arrays) == sharded
    register_zarr_dtypes()
    store = zarr_store(ck)
    kv = export_tensorstore(ck, out)
    assert json.load(open(os.path.join(out, SPEC_NAME))) == kv
    tree = open(os.path.join(out, "d", "shardpoint"), "rb").read()
    assert tree.count(ocdbt.BTREE_MAGIC.to_bytes(4, "big")) > 2  # leaves and their parent
    for path, size in m.packed.objects:  # an index of the chunks, not a copy
        raw = open(os.path.join(ck, path), "rb").read()
        assert len(raw) == size and raw[:64] not in tree and raw[-64:] not in tree
    for key, want in _leaves(state).items():
        name = m.tensors[key].array
        for got in (zarr.open_array(store, path=name, mode="r")[...], _open_ts(kv, name)):
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert np.ascontiguousarray(got).tobytes() == want.tobytes(), key


def test_incremental_packed_reads_through_zarr_python_and_a_tensorstore_export(tmp_path):
    """An incremental checkpoint ([SP-PACK-9]): the chunks it takes from its base open through
    both readers, the export layering the base beside it (it once named no base, and
    TensorStore read past the end of the checkpoint's own data object)."""
    from shardpoint_core.transactions.packed import PackedBackend
    from shardpoint_core.transactions.packed_zarr import zarr_store
    from shardpoint_core.transactions.ts_export import export_tensorstore

    w, b = torch.randn(1000, 300), torch.randn(10)
    run = tmp_path / "run"
    sp.save({"w": w, "b": b}, str(run / "step_1"), backend=PackedBackend(hashes=True))
    sp.save({"w": w, "b": b + 1}, str(run / "step_2"), incremental="step_1")
    assert read_metadata(str(run / "step_2")).packed.sharing()["bases"]["step_1"]["chunks"]
    kv = export_tensorstore(str(run / "step_2"), str(tmp_path / "step_2.ts"))
    register_zarr_dtypes()
    for name, want in (("w", w), ("b", b + 1)):
        z = zarr.open_array(zarr_store(str(run / "step_2")), path=f"tensors/{name}", mode="r")
        for got in (z[...], _open_ts(kv, f"tensors/{name}")):
            assert got.tobytes() == want.numpy().tobytes(), name


def test_packed_tensorstore_export_checks_crc_and_refuses_what_it_cannot_do(tmp_path):
    """TensorStore checks each chunk's crc32c through the export (a flipped byte in a data
    object is an error, not wrong values); an export is replaced only when asked; a
    per-array checkpoint needs none; the CLI writes the same export."""
    from shardpoint.tools.cli import main
    from shardpoint_core.transactions.ts_export import export_tensorstore

    ck, out = str(tmp_path / "ck"), str(tmp_path / "ck.ts")
    w = np.arange(256, dtype=np.float32).reshape(16, 16)
    sp.save({"w": w}, ck, backend=_packed(False))
    assert main(["export-tensorstore", ck, out]) == 0
    kv = json.load(open(os.path.join(out, "kvstore.json")))
    assert _open_ts(kv, "tensors/w").tobytes() == w.tobytes()
    assert main(["export-tensorstore", ck, out]) == 1  # there already
    with pytest.raises(sp.CheckpointExistsError):
        export_tensorstore(ck, out)
    assert export_tensorstore(ck, out, overwrite=True) == kv
    m = read_metadata(ck)
    obj = os.path.join(ck, m.packed.objects[0][0])
    _path, off, _n, _crc = m.packed.array("tensors/w").chunk(0)
    with open(obj, "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError, match="Digest mismatch"):  # the chunk's crc32c
        _open_ts(kv, "tensors/w")
    plain = str(tmp_path / "plain")
    sp.save({"w": w}, plain, backend=ZarrBackend())
    with pytest.raises(sp.errors.InvalidOptionError, match="per-array layout"):
        export_tensorstore(plain, str(tmp_path / "plain.ts"))
    mem = "memory://ts-export-test/ck"
    sp.save({"w": w}, mem, backend=_packed(False))
    with pytest.raises(sp.errors.InvalidOptionError, match="memory"):
        export_tensorstore(mem, str(tmp_path / "mem.ts"))


def test_packed_on_s3_reads_through_zarr_python_and_a_tensorstore_export(s3_env):
    """The same on the S3 server: zarr_store reads the chunks by ranged GETs below the save
    prefix, and the export (written to S3 too) sends TensorStore's s3 driver to them."""
    from shardpoint_core.transactions.packed_zarr import zarr_store
    from shardpoint_core.transactions.ts_export import export_tensorstore

    base = f"s3://{s3_env.bucket}/{s3_env.fresh_prefix()}"
    state = _state()
    sp.save(state, f"{base}/ck", backend=_packed(True))
    m = read_metadata(f"{base}/ck")
    register_zarr_dtypes()
    store = zarr_store(f"{base}/ck")
    kv = export_tensorstore(f"{base}/ck", f"{base}/ck.ts")
    assert kv["base"]["layers"][1]["base"]["driver"] == "s3"
    for key, want in _leaves(state).items():
        name = m.tensors[key].array
        for got in (zarr.open_array(store, path=name, mode="r")[...], _open_ts(kv, name)):
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), key
