"""shardpoint_jax writes the packed layout (issue 30; spec/format.md section 13, format 1.4)
through the core's save transaction with ``backend=PackedBackend()``: sync and async, one
and two real JAX processes, on files, memory:// and the S3 server; incremental saves
(``incremental=``, ``CheckpointManager(incremental=True)``, [SP-PACK-9] to [SP-PACK-11])
that write only the changed chunks. Every checkpoint loads bit for bit into JAX and into
the PyTorch front end, and JAX and torch write the same index for the same state."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardpoint_jax as sj  # noqa: E402
from shardpoint_core.format import dtypes as core_dtypes  # noqa: E402
from shardpoint_core.stores.location import locate  # noqa: E402
from shardpoint_core.transactions.backend import ZarrBackend  # noqa: E402
from shardpoint_core.transactions.packed import PackedBackend  # noqa: E402
from shardpoint_core.transactions.resolve import read_metadata  # noqa: E402
from shardpoint_core.verify import verify_checkpoint  # noqa: E402
from shardpoint_jax.launch import run_processes  # noqa: E402
from shardpoint_testing.tensors import random_array, same_bits  # noqa: E402


def _tree(gen: int = 0) -> dict:
    """One array of every dtype of the table (random bytes: NaN payloads, -0.0), a JAX
    bfloat16 array, one big enough to be a shard of inner chunks (``_backend``), an empty
    one and plain values; ``gen`` changes only ``train``."""
    return {
        "dt": {n: random_array(n, (5, 3), d.numpy) for n, d in core_dtypes.DTYPES.items()},
        "jax": jnp.asarray(random_array("jax", (40, 24), "bfloat16")),
        "big": random_array("big", (300, 1000), np.float32),
        "train": random_array(100 + gen, (16, 8), np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "step": gen,
        "name": "run",
    }


def _backend(**kw) -> PackedBackend:
    """Packed, arrays above 1 MiB stored as shards of 256 KiB inner chunks (``big``)."""
    return PackedBackend(ZarrBackend(shard_above_bytes=1 << 20, inner_chunk_bytes=256 << 10), **kw)


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def _same(got: dict, want: dict) -> None:
    """Every leaf bit for bit (torch tensors, JAX and numpy arrays alike; dtype included)."""
    g, w = _leaves(got), _leaves(want)
    assert set(g) == set(w)
    for k, v in w.items():
        if isinstance(v, (np.ndarray, jax.Array)):
            assert same_bits(g[k], v), k
        else:
            assert g[k] == v, k


def _own_bytes(url: str) -> int:
    """Bytes of the data objects stored in the checkpoint itself."""
    if "://" not in url:
        d = os.path.join(url, "packed")
        return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    store, key = locate(url).pair()
    return sum(i.size for i in store.list(key + "/") if "/packed/" in i.key)


def test_jax_writes_packed_that_jax_and_torch_load_bitwise_sync_and_async(tmp_path):
    import shardpoint as sp

    tree = _tree()
    for name, asynchronous in (("sync", False), ("async", True)):
        path = str(tmp_path / name)
        got = sj.save(path, tree, backend=_backend(), async_save=asynchronous)
        if asynchronous:
            got.wait()
        # a manifest and one data object: no per-tensor directory, no zarr.json
        assert sorted(os.listdir(path)) == ["manifest.msgpack", "packed"]
        assert len(os.listdir(os.path.join(path, "packed"))) == 1
        m = read_metadata(path)
        assert m.format_version == (1, 4) and m.writer.startswith("shardpoint-jax")
        assert dict(m.packed.arrays)[m.tensors["big"].array]  # inner chunks
        _same(sj.load(path), tree)
        _same(sp.load(path), tree)
        assert verify_checkpoint(path).ok
    target = {**tree, "big": jax.ShapeDtypeStruct((300, 1000), np.float32)}
    _same(sj.load(str(tmp_path / "sync"), target), tree)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["files", "memory"])
def test_the_default_layout_is_packed_on_files_and_object_stores_sync_and_async(
    tmp_path, where, asynchronous
):
    """With no backend named, shardpoint_jax.save follows the core's default (issue 30):
    packed, format 1.4, on files and object stores alike, sync and async; nothing per
    tensor is stored (no tensors/ directory, no zarr.json), one data object per process."""
    tree = {
        "w": jnp.asarray(random_array("w", (40, 24), "bfloat16")),
        "n": random_array("n", (7, 5), np.int32),
        "step": 3,
    }
    if where == "files":
        url = str(tmp_path / "ck")
    else:
        url = f"memory://jax-default/{tmp_path.name}-{int(asynchronous)}/ck"
    got = sj.save(url, tree, async_save=asynchronous)
    if asynchronous:
        got.wait()
    m = read_metadata(url)
    assert m.format_version == (1, 4) and m.writer.startswith("shardpoint-jax")
    assert m.packed is not None and len(m.packed.objects) == 1
    assert all(e.packed is not None for e in m.tensors.values())
    if where == "files":
        assert sorted(os.listdir(url)) == ["manifest.msgpack", "packed"]
    else:
        store, key = locate(url).pair()
        keys = [i.key[len(key) + 1 :] for i in store.list(key + "/")]
        assert not [k for k in keys if "/tensors/" in k or k.endswith("zarr.json")], keys
    _same(sj.load(url), tree)


def test_jax_and_torch_write_the_same_packed_index_and_bytes(tmp_path):
    """One process, the data object's name fixed and chunks written in order: the JAX and
    the torch front end plan the same chunks and write the same bytes and index."""
    import shardpoint as sp

    tree = {k: v for k, v in _tree().items() if k not in ("jax", "empty")}
    tree["jax"] = np.asarray(_tree()["jax"])

    def backend() -> PackedBackend:
        return _backend(writer_id="w0", write_threads=1, hashes=True)

    sj.save(str(tmp_path / "j"), tree, backend=backend())
    sp.save(tree, str(tmp_path / "t"), backend=backend())
    mj, mt = read_metadata(str(tmp_path / "j")), read_metadata(str(tmp_path / "t"))
    assert mj.writer != mt.writer
    assert mj.packed.objects == mt.packed.objects and mj.packed.arrays == mt.packed.arrays
    assert mj.packed.records.tobytes() == mt.packed.records.tobytes()
    assert mj.packed.hashes == mt.packed.hashes is not None
    for k, e in mj.tensors.items():
        t = mt.tensors[k]
        assert (e.array, e.shape, e.dtype, e.chunk_shape) == (
            t.array,
            t.shape,
            t.dtype,
            t.chunk_shape,
        )
        assert e.chunk_crc32c == t.chunk_crc32c, k
    obj = os.path.join("packed", "w0-0.bin")
    with open(tmp_path / "j" / obj, "rb") as a, open(tmp_path / "t" / obj, "rb") as b:
        assert a.read() == b.read()


def test_incremental_jax_save_writes_only_the_changed_chunks(tmp_path):
    import shardpoint as sp

    root = tmp_path / "run"
    t1, t2, t3 = _tree(1), _tree(2), _tree(3)
    sj.save(str(root / "a"), t1, backend=_backend(hashes=True))
    sj.save(str(root / "b"), t2, backend=_backend(), incremental="a")
    a, b = str(root / "a"), str(root / "b")
    assert _own_bytes(b) * 50 < _own_bytes(a)
    m = read_metadata(b)
    assert m.format_version == (1, 4) and [n for n, _i in m.packed.bases] == ["a"]
    sharing = m.packed.sharing()
    assert sharing["own"]["chunks"] == m.tensors["train"].packed.records.size  # train alone
    assert sharing["bases"]["a"]["chunks"] > 0
    _same(sj.load(b), t2)
    _same(sp.load(b), t2)
    rep = verify_checkpoint(b)
    assert rep.ok and rep.hashes, rep.problems
    # True: the newest committed checkpoint beside it; async too; no backend: the shared one
    sj.save(str(root / "c"), t3, incremental=True, async_save=True).wait()
    assert [n for n, _i in read_metadata(str(root / "c")).packed.bases] == ["a"]
    _same(sj.load(str(root / "c")), t3)


def test_incremental_refusals_leave_nothing(tmp_path):
    sj.save(str(tmp_path / "plain"), _tree(1), backend=ZarrBackend())  # the per-array layout
    with pytest.raises(sj.InvalidOptionError, match="packed layout"):
        sj.save(str(tmp_path / "x"), _tree(2), incremental="plain")
    with pytest.raises(sj.InvalidOptionError, match="packed layout"):
        sj.save(str(tmp_path / "x"), _tree(2), backend=ZarrBackend(), incremental="plain")
    with pytest.raises(sj.InvalidOptionError, match="packed layout"):
        sj.CheckpointManager(str(tmp_path / "m"), incremental=True, backend=ZarrBackend())
    assert sorted(os.listdir(tmp_path)) == ["plain"]


def test_manager_incremental_keeps_the_bases_and_backend_writes_packed(tmp_path):
    import shardpoint as sp

    mgr = sj.CheckpointManager(str(tmp_path / "run"), max_to_keep=1, incremental=True)
    for step in range(1, 4):
        last = _tree(step)
        mgr.save(step, last)
    mgr.wait()
    assert mgr.all_steps() == [1, 3] and not mgr.retention_warnings  # 1: 3's base
    m = read_metadata(mgr.path(3))
    assert [n for n, _i in m.packed.bases] == [os.path.basename(mgr.path(1))]
    assert _own_bytes(mgr.path(3)) * 50 < _own_bytes(mgr.path(1))
    _same(mgr.load(), last)
    # the torch manager resumes the root and builds on the JAX step
    tm = sp.CheckpointManager(str(tmp_path / "run"), max_to_keep=1, incremental=True)
    t4 = {**_tree(4), "jax": np.asarray(_tree(4)["jax"])}  # torch saves no jax.Array
    tm.save(4, t4)
    assert [n for n, _i in read_metadata(tm.path(4)).packed.bases] == [
        os.path.basename(mgr.path(1))
    ]
    _same(sj.load(tm.path(4)), t4)

    with sj.CheckpointManager(str(tmp_path / "plain"), backend=_backend(), async_save=True) as pm:
        pm.save(1, _tree(1))
    assert read_metadata(pm.path(1)).format_version == (1, 4)
    assert read_metadata(pm.path(1)).packed.hashes is None  # not incremental: no hashes


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_packed_and_incremental_on_object_stores(where, request):
    import shardpoint as sp

    if where == "s3":
        s3 = request.getfixturevalue("s3_env")
        root = s3.url(s3.fresh_prefix("jax-packed-save") + "/run")
    else:
        root = "memory://jax-packed-save/run"
    t1, t2 = _tree(1), _tree(2)
    sj.save(f"{root}/a", t1, backend=_backend(hashes=True))
    store, key = locate(f"{root}/a").pair()
    keys = [i.key[len(key) + 1 :] for i in store.list(key + "/")]
    assert not [k for k in keys if k.endswith("zarr.json")]
    assert len([k for k in keys if "/packed/" in k]) == 1 and "manifest.msgpack" in keys
    with pytest.raises(sj.InvalidOptionError, match="name the base"):
        sj.save(f"{root}/b", t2, incremental=True)
    sj.save(f"{root}/b", t2, backend=_backend(), incremental="a", async_save=True).wait()
    assert _own_bytes(f"{root}/b") * 50 < _own_bytes(f"{root}/a")
    _same(sj.load(f"{root}/a"), t1)
    _same(sj.load(f"{root}/b"), t2)
    _same(sp.load(f"{root}/b"), t2)
    with pytest.raises(sj.ShardpointError, match="SP-PACK-11"):
        sj.save(f"{root}/a", t2, overwrite=True, backend=_backend())  # b builds on it
    _same(sj.load(f"{root}/b"), t2)


TWO = """
import json, os
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import shardpoint_jax as sj
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_testing.tensors import random_array, same_bits
pid = jax.process_index()
W = random_array("W", (8, 24), "bfloat16")
M = random_array("M", (8, 24), np.float32)
def put(a, mesh, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(*spec)), lambda i: a[i])
devs = np.array(jax.devices())
m22 = Mesh(devs.reshape(2, -1), ("dp", "tp"))
tree = {"w": put(W, m22, ("dp", "tp")), "m": put(M, m22, (None, "tp")), "step": 1}
sj.save(ROOT + "/a", tree, backend=PackedBackend(hashes=True))
tree["m"] = put(M + 1, m22, (None, "tp"))
tree["step"] = 2
sj.save(ROOT + "/b", tree, backend=PackedBackend(), incremental="a", async_save=True).wait()
other = Mesh(devs[::-1].reshape(-1), ("x",))
tgt = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(other, P(None, "x")))
       for k, a in (("w", W), ("m", M))}
got = sj.load(ROOT + "/b", {**tgt, "step": 0})
ok = all(same_bits(s.data, W[s.index]) for s in got["w"].addressable_shards)
ok = ok and all(same_bits(s.data, (M + 1)[s.index]) for s in got["m"].addressable_shards)
try:  # process 1 names a base that is not there: its join fails, every process raises
    sj.save(ROOT + "/c", tree, incremental="a" if pid == 0 else "nosuch")
    err = None
except sj.ShardpointError as e:
    err = f"{type(e).__name__}: {e}"
print(json.dumps({"pid": pid, "ok": bool(ok), "step": got["step"], "err": err,
                  "left": sorted(os.listdir(ROOT))}))
"""


def test_two_jax_processes_save_packed_and_incremental_and_reload_into_another_mesh(tmp_path):
    """Two processes of two devices each: each writes its own data object (its replica-0
    shards), process 0 gathers both index parts; the async incremental save refers to
    ``a``'s chunks of the unchanged ``w`` and writes ``m`` again; loads into another mesh
    (and the torch front end) are bitwise. A process that cannot join a save (its base is
    not there) fails it on every process, nothing left, instead of leaving the others
    waiting."""
    import shardpoint as sp

    root = str(tmp_path / "run")
    outs = run_processes(TWO.replace("ROOT", repr(root)), 2, 2, timeout=300)
    res = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert sorted(r["pid"] for r in res) == [0, 1]
    assert all(r["ok"] and r["step"] == 2 for r in res), res
    assert all("CheckpointNotFoundError" in r["err"] and "nosuch" in r["err"] for r in res), res
    assert all(r["left"] == ["a", "b"] for r in res), res
    a, b = read_metadata(f"{root}/a"), read_metadata(f"{root}/b")
    assert len(a.packed.objects) == 2 and len(os.listdir(f"{root}/a/packed")) == 2
    assert a.save_world_size == 2
    sharing = b.packed.sharing()
    assert sharing["own"]["chunks"] == b.tensors["m"].packed.records.size
    assert sharing["bases"]["a"]["chunks"] == b.tensors["w"].packed.records.size
    w = random_array("W", (8, 24), "bfloat16")
    m = random_array("M", (8, 24), np.float32)
    _same(sp.load(f"{root}/b"), {"w": w, "m": m + 1, "step": 2})
    assert verify_checkpoint(f"{root}/b").ok
