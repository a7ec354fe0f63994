"""shardpoint_jax across real JAX processes (jax.distributed, gloo CPU collectives, several
host devices each): replica-0 shards written once, sharded objects on 1-D and 2-D grids,
loads into other meshes and partitionings reading only their own regions, and a failing
process failing the save everywhere while the previous checkpoint stays."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")

from shardpoint_jax.launch import run_processes  # noqa: E402

COMMON = """
import json, sys
import numpy as np, jax, ml_dtypes
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import shardpoint_jax as sj
from shardpoint_testing.tensors import random_array, same_bits
pid, n = jax.process_index(), jax.process_count()
W = random_array(1, (8, 24), ml_dtypes.bfloat16)
M = random_array(2, (8, 24), np.float32)
V = random_array(3, (24,), np.int64)
def put(a, mesh, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(*spec)),
                                        lambda i: a[i])
def check(arr, a):
    for s in arr.addressable_shards:
        assert same_bits(s.data, a[s.index]), s.index
    return len(arr.addressable_shards)
"""

SAVE_LOAD = (
    COMMON
    + """
path = sys.argv[-1] if False else PATH
devs = np.array(jax.devices())
m22 = Mesh(devs.reshape(2, -1), ("dp", "tp"))
tree = {"model": {"w": put(W, m22, ("dp", "tp")), "v": put(V, m22, ("tp",))},
        "opt": {"m": put(M, m22, (None, "tp")), "count": jax.device_put(np.int32(5))},
        "np": np.arange(6, dtype=np.float16), "step": 11,
        "rng": sj.ShardedObject({"pid": pid}, pid, n),
        "grid": sj.ShardedObject(f"cell{pid}", (0, pid), (1, n))}
sj.save(PATH, tree, backend=BACKEND)
other = Mesh(devs[::-1].reshape(-1), ("x",))
tgt = {"model": {"w": jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=NamedSharding(other, P(None, "x"))),
                 "v": jax.ShapeDtypeStruct(V.shape, V.dtype, sharding=NamedSharding(other, P()))},
       "opt": {"m": jax.ShapeDtypeStruct(M.shape, M.dtype, sharding=NamedSharding(other, P("x")))},
       "np": np.zeros(6, np.float16), "step": 0,
       "rng": sj.ShardedObject(None, n - 1 - pid, n),
       "grid": sj.ShardedObject(None, (0, pid), (1, n))}
got = sj.load(PATH, tgt)
shards = check(got["model"]["w"], W) + check(got["model"]["v"], V) + check(got["opt"]["m"], M)
assert same_bits(got["np"], np.arange(6, dtype=np.float16)) and got["step"] == 11
print(json.dumps({"pid": pid, "shards": shards, "rng": got["rng"].value["pid"],
                  "grid": got["grid"].value}))
"""
)


def _run(code, n, devices, path, backend="None", **kw):
    """``backend``: the save's, as code (None: the default, packed)."""
    code = code.replace("BACKEND", backend).replace("PATH", repr(str(path)))
    if backend != "None":
        code = "from shardpoint_core.transactions.backend import ZarrBackend\n" + code
    outs = run_processes(code, n, devices, timeout=300, **kw)
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


@pytest.mark.parametrize(
    "devices,layout",
    [pytest.param(2, "per-array", marks=pytest.mark.slow), (4, "packed")],
)
def test_two_processes_save_and_reload_into_another_mesh(tmp_path, devices, layout):
    per_array = layout == "per-array"
    res = _run(SAVE_LOAD, 2, devices, tmp_path / "ck", "ZarrBackend()" if per_array else "None")
    assert [r["rng"] for r in res] == [1, 0]  # cell n-1-pid, held by the other one
    assert [r["grid"] for r in res] == ["cell0", "cell1"]
    assert all(r["shards"] == 3 * devices for r in res)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    from shardpoint_core.transactions.resolve import read_metadata

    m = read_metadata(str(tmp_path / "ck"))
    # The saving layout is the chunk grid: w split 2 x devices, each block written once.
    assert m.tensors["model/w"].chunk_shape == (4, 24 // devices)
    if per_array:  # one file per block
        ck = tmp_path / "ck" / "tensors"
        zw = json.loads((ck / "model" / "w" / "zarr.json").read_text())
        assert zw["chunk_grid"]["configuration"]["chunk_shape"] == [4, 24 // devices]
        assert len(list((ck / "model" / "w" / "c").rglob("*"))) == 2 + 2 * devices
        return
    # packed: one data object per process, no per-tensor file; each process's blocks (a row
    # of the dp x tp mesh: its own devices) in its own object, one record each
    assert sorted(os.listdir(tmp_path / "ck")) == ["manifest.msgpack", "packed"]
    assert len(os.listdir(tmp_path / "ck" / "packed")) == len(m.packed.objects) == 2
    w = m.packed.array(m.tensors["model/w"].array)
    assert len(w.records) == 2 * devices and w.inner is None
    objects = [w.chunk(c)[0] for c in range(2 * devices)]
    assert objects == [objects[0]] * devices + [objects[-1]] * devices
    assert objects[0] != objects[-1]


FAIL = (
    COMMON
    + """
import os
devs = np.array(jax.devices())
mesh = Mesh(devs, ("x",))
sj.save(PATH, {"w": put(M, mesh, ("x",))})
bad = {"w": put(W, mesh, ("x",)), "extra": object() if pid == 1 else 1}
try:
    sj.save(PATH, bad, overwrite=True)
    out = "saved"
except sj.ShardpointError as e:
    out = f"{type(e).__name__}: {e}"
try:        # a plain value that differs between processes: one would be kept silently
    sj.save(PATH, {"w": put(M, mesh, ("x",)), "step": 10 + pid}, overwrite=True)
    out2 = "saved"
except sj.ShardpointError as e:
    out2 = f"{type(e).__name__}: {e}"
got = sj.load(PATH, {"w": jax.ShapeDtypeStruct(M.shape, M.dtype, sharding=NamedSharding(mesh, P("x")))})
check(got["w"], M)
print(json.dumps({"pid": pid, "out": out, "out2": out2, "left": sorted(os.listdir(os.path.dirname(PATH)))}))
"""
)


def test_a_failing_process_fails_the_save_everywhere_and_keeps_the_previous(tmp_path):
    res = _run(FAIL, 2, 2, tmp_path / "ck")
    for r in res:
        assert r["out"].startswith("UnsupportedValueError") and "extra" in r["out"], r
        assert "SP-VALUE-1" in r["out"]
        assert r["out2"].startswith("InvalidShardingError") and "step" in r["out2"], r
        assert "SP-REPL-1" in r["out2"]
        assert r["left"] == ["ck"]


ASYNC = (
    COMMON
    + """
devs = np.array(jax.devices())
mesh = Mesh(devs.reshape(2, -1), ("dp", "tp"))
tree = {"w": put(W, mesh, ("dp", "tp")), "m": put(M, mesh, (None, "tp"))}
h = sj.save(PATH, tree, async_save=True)
for a in tree.values():
    a.delete()                                 # the caller's buffers are gone at once
path = h.result(timeout=120)                   # written and committed in the background
other = Mesh(devs[::-1].reshape(-1), ("x",))
got = sj.load(path, {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(other, P("x")))
                     for k, a in (("w", W), ("m", M))})
print(json.dumps({"pid": pid, "shards": check(got["w"], W) + check(got["m"], M)}))
"""
)


def test_an_asynchronous_save_commits_across_processes_after_the_arrays_are_gone(tmp_path):
    res = _run(ASYNC, 2, 2, tmp_path / "ck")
    assert sorted(r["pid"] for r in res) == [0, 1] and all(r["shards"] == 4 for r in res)
