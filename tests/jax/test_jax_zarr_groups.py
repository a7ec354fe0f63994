"""The JAX front end writes the Zarr group metadata of [SP-LAYOUT-5] too (locally and on an
object store, where the groups lie below the save's prefix), so zarr-python browses its
checkpoints like the torch front end's."""

import os

import numpy as np
import pytest

pytest.importorskip("jax")
zarr = pytest.importorskip("zarr")

import shardpoint_jax as spj  # noqa: E402
from shardpoint_core.arrays.groups import GROUP_JSON  # noqa: E402
from shardpoint_core.transactions.zarr_compat import register_zarr_dtypes, zarr_path  # noqa: E402


def test_a_jax_checkpoint_browses_as_a_zarr_group(tmp_path):
    import ml_dtypes

    ck = str(tmp_path / "ck")
    w = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    spj.save(ck, {"params": {"dense": {"w": w}}, "step": 1})
    for d in ("", "tensors", "tensors/params", "tensors/params/dense"):
        with open(os.path.join(ck, d, "zarr.json"), "rb") as f:
            assert f.read() == GROUP_JSON, d
    register_zarr_dtypes()
    g = zarr.open_group(ck, mode="r")
    got = g["tensors/params/dense/w"][...]
    assert got.dtype == w.dtype and got.tobytes() == w.tobytes()
    assert zarr_path(ck, "params/dense/w") == os.path.join(ck, "tensors", "params", "dense", "w")


def test_on_an_object_store_the_groups_lie_below_the_save_prefix(s3_env):
    url = f"s3://{s3_env.bucket}/{s3_env.fresh_prefix()}/ck"
    spj.save(url, {"a": {"b": np.ones(3, np.float32)}})
    where = zarr_path(url, "a/b")
    save_dir = where[len(url) + 1 :].split("/")[0]
    assert save_dir.startswith("save-")
    from shardpoint_core.stores.registry import bucket_store

    store, key = bucket_store(url, "test")
    for g in ("", "tensors/", "tensors/a/"):
        assert store.get_range(f"{key}/{save_dir}/{g}zarr.json", 0, 1 << 10) == GROUP_JSON
