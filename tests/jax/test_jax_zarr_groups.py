"""zarr-python browses the JAX front end's checkpoints like the torch front end's, locally and
on an object store (where the groups lie below the save's prefix): the per-array layout
(written on request, ``backend=ZarrBackend()``) by the Zarr group metadata of [SP-LAYOUT-5]
on disk; the packed layout (the default, format 1.4: no zarr.json stored) through the
read-only store of ``zarr_store`` (issue 30 item 2), which implies the same groups."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("jax")
zarr = pytest.importorskip("zarr")

import shardpoint_jax as spj  # noqa: E402
from shardpoint_core.arrays.groups import GROUP_JSON  # noqa: E402
from shardpoint_core.transactions.backend import ZarrBackend  # noqa: E402
from shardpoint_core.transactions.packed_zarr import zarr_store  # noqa: E402
from shardpoint_core.transactions.zarr_compat import register_zarr_dtypes, zarr_path  # noqa: E402

LAYOUTS = ["per-array", "packed"]


def _backend(layout: str):
    return ZarrBackend() if layout == "per-array" else None  # None: the default, packed


def _group_json(root, path: str) -> bytes:
    """The zarr.json of group ``path`` as zarr-python's store gives it."""
    import asyncio

    from zarr.core.buffer import default_buffer_prototype

    got = asyncio.run(root.store.get(f"{path}zarr.json", default_buffer_prototype()))
    assert got is not None, path
    return got.to_bytes()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_jax_checkpoint_browses_as_a_zarr_group(tmp_path, layout):
    import ml_dtypes

    ck = str(tmp_path / "ck")
    w = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    spj.save(ck, {"params": {"dense": {"w": w}}, "step": 1}, backend=_backend(layout))
    register_zarr_dtypes()
    groups = ("", "tensors/", "tensors/params/", "tensors/params/dense/")
    if layout == "per-array":
        for d in groups:
            with open(os.path.join(ck, d, "zarr.json"), "rb") as f:
                assert f.read() == GROUP_JSON, d
        g = zarr.open_group(ck, mode="r")
    else:
        assert sorted(os.listdir(ck)) == ["manifest.msgpack", "packed"]  # no zarr.json
        g = zarr.open_group(zarr_store(ck), mode="r")
        for d in groups:
            assert json.loads(_group_json(g, d)) == json.loads(GROUP_JSON), d
    assert sorted(g["tensors/params"].group_keys()) == ["dense"]
    got = g["tensors/params/dense/w"][...]
    assert got.dtype == w.dtype and got.tobytes() == w.tobytes()
    assert zarr_path(ck, "params/dense/w") == os.path.join(ck, "tensors", "params", "dense", "w")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_an_object_store_the_groups_lie_below_the_save_prefix(s3_env, layout):
    url = f"s3://{s3_env.bucket}/{s3_env.fresh_prefix()}/ck"
    b = np.arange(3, dtype=np.float32)
    spj.save(url, {"a": {"b": b}}, backend=_backend(layout))
    where = zarr_path(url, "a/b")
    save_dir = where[len(url) + 1 :].split("/")[0]
    assert save_dir.startswith("save-") and where == f"{url}/{save_dir}/tensors/a/b"
    from shardpoint_core.stores.registry import bucket_store

    store, key = bucket_store(url, "test")
    groups = ("", "tensors/", "tensors/a/")
    if layout == "per-array":
        for g in groups:
            assert store.get_range(f"{key}/{save_dir}/{g}zarr.json", 0, 1 << 10) == GROUP_JSON
        return
    assert not [i.key for i in store.list(key + "/") if i.key.endswith("zarr.json")]
    register_zarr_dtypes()
    root = zarr.open_group(zarr_store(url), mode="r")
    for g in groups:
        assert json.loads(_group_json(root, f"{save_dir}/{g}")) == json.loads(GROUP_JSON), g
    got = root[f"{save_dir}/tensors/a/b"][...]
    assert got.dtype == b.dtype and got.tobytes() == b.tobytes()
