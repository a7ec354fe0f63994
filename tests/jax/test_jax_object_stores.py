"""shardpoint_jax on object stores through the core's store registry and the object-store
committer (spec section 9.1): ``memory://`` and ``s3://`` (moto's real server, ``s3_env``)
for save (sync and async) and load, a checkpoint written by JAX on S3 read by the PyTorch
front end and back, the JAX CheckpointManager's retention and clean-up on S3, and the errors
of a path no store serves."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardpoint_jax as sj  # noqa: E402
from shardpoint_core.stores.location import locate  # noqa: E402
from shardpoint_jax.loading import Checkpoint  # noqa: E402
from shardpoint_testing.probes import crashed_save, vector_on_store  # noqa: E402


def _tree(gen: int = 0, rows: int = 700) -> dict:
    rng = np.random.default_rng(gen)
    return {
        "w": jnp.asarray(rng.standard_normal((rows, 1000), np.float32)),  # 700: a shard
        "b": jnp.asarray(rng.standard_normal((33,), np.float32)).astype(jnp.bfloat16),
        "mask": np.array([True, False, True]),
        "i": np.arange(12, dtype=np.int64).reshape(3, 4),
        "s": jnp.asarray(2.5, jnp.float32),
        "step": gen,
        "name": "run",
    }


def _same(a, b) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], (np.ndarray, jax.Array)):
            x, y = np.asarray(a[k]), np.asarray(b[k])
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
        else:
            assert a[k] == b[k], k


def _keys(url: str) -> list:
    store, key = locate(url).pair()
    return [i.key[len(key) + 1 :] for i in store.list(key + "/")]


def test_memory_store_save_load_async_overwrite_and_partial_reads():
    url = "memory://jax-objects/run/step_1"
    sj.save(url, _tree(0))
    _same(sj.load(url), _tree(0))
    with pytest.raises(sj.CheckpointExistsError):
        sj.save(url, _tree(1))
    sj.save(url, _tree(1), overwrite=True, async_save=True).wait()
    _same(sj.load(url), _tree(1))
    keys = _keys(url)
    assert keys.count("manifest.msgpack") == 1
    assert len({k.split("/")[0] for k in keys if k.startswith("save-")}) == 1  # old deleted
    rows = jax.ShapeDtypeStruct((700, 1000), np.float32)
    assert (
        np.asarray(sj.load(url, {"w": rows})["w"]).tobytes() == np.asarray(_tree(1)["w"]).tobytes()
    )


def test_paths_no_store_serves_are_refused_before_any_io(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sj.UnsupportedStoreError, match="nosuch://"):
        sj.save("nosuch://bucket/ck", {"a": np.zeros(3)})
    with pytest.raises(sj.UnsupportedStoreError):
        sj.load("nosuch://bucket/ck")
    with pytest.raises(sj.UnsupportedStoreError):
        sj.CheckpointManager("nosuch://bucket/run")
    assert list(tmp_path.iterdir()) == []  # no local directory named 'nosuch:'
    with pytest.raises(sj.CheckpointNotFoundError):
        sj.load("memory://jax-objects/never/saved")


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_damaged_and_missing_objects_name_the_rule(layout):
    """A flipped byte in a chunk (per array: its object; packed: inside its record of the
    data object) and a missing object (per array: a chunk's; packed: the data object)."""
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_core.transactions.resolve import read_metadata

    url = f"memory://jax-objects/damage-{layout}/ck"
    sj.save(
        url,
        {
            "w": np.arange(300 * 70, dtype=np.float32).reshape(300, 70),
            "v": np.ones((5, 5), np.float32),
        },
        backend=ZarrBackend() if layout == "per-array" else None,  # None: packed
    )
    store, key = locate(url).pair()
    names = _keys(url)
    if layout == "per-array":
        w = next(k for k in names if "/tensors/w/c/" in k)
        v = next(k for k in names if "/tensors/v/c" in k)
        at = 3
    else:
        assert not [k for k in names if "/tensors/" in k]
        m = read_metadata(url)
        w, at, _n, _crc = m.packed.array(m.tensors["w"].array).chunk(0)
        at += 3
        v = m.packed.array(m.tensors["v"].array).chunk(0)[0]
        assert v == w and v in names  # one data object holds both
    data = bytearray(store.get(f"{key}/{w}"))
    data[at] ^= 0x40
    store.put(f"{key}/{w}", bytes(data))
    with pytest.raises(sj.CorruptCheckpointError) as e:
        sj.load(url, {"w": np.zeros((300, 70), np.float32)})
    assert e.value.spec_id == "SP-READ-3" and "'w'" in str(e.value) and w in str(e.value)
    store.delete([f"{key}/{v}"])
    with pytest.raises(sj.CorruptCheckpointError) as e:
        sj.load(url, {"v": np.zeros((5, 5), np.float32)})
    assert e.value.spec_id == "SP-READ-2" and "'v'" in str(e.value)


def test_s3_jax_save_read_by_torch_and_back(s3_env):
    torch = pytest.importorskip("torch")
    import shardpoint as sp
    from shardpoint_testing.tensors import same_bits

    url = s3_env.url(s3_env.fresh_prefix("jax") + "/step_1")
    tree = _tree(3, rows=16)  # shards on an object store: the memory:// tests
    sj.save(url, tree)
    got = sp.load(url)
    assert got["w"].numpy().tobytes() == np.asarray(tree["w"]).tobytes()
    assert (
        got["b"].dtype == torch.bfloat16
        and got["b"].view(torch.int16).numpy().tobytes() == np.asarray(tree["b"]).tobytes()
    )
    assert got["mask"].tolist() == [True, False, True] and got["step"] == 3
    # the PyTorch front end replaces it on S3; JAX reads that, async save on top
    got["w"] = got["w"] * 2
    sp.save(got, url, overwrite=True)
    back = sj.load(url)
    assert np.asarray(back["w"]).tobytes() == (np.asarray(tree["w"]) * 2).tobytes()
    assert np.asarray(back["b"]).tobytes() == np.asarray(tree["b"]).tobytes()
    sj.save(url, back, overwrite=True, async_save=True).wait()
    assert same_bits(sp.load(url)["i"], torch.arange(12, dtype=torch.int64).reshape(3, 4))


def test_s3_compressed_checkpoint_reads_in_jax(s3_env):
    """(1.5) A zstd-compressed checkpoint on S3 (written by the PyTorch front end) loads in
    JAX: its chunk objects hold far fewer bytes than the tensor declares, which the bytes-
    present rule allows up to 32768 to 1 for compressed arrays ([SP-READ-6], [SP-READ-9]).
    Compression is the per-array layout's (the packed one has no compressed chunks)."""
    pytest.importorskip("torch")
    pytest.importorskip("zstandard")
    import shardpoint as sp

    url = s3_env.url(s3_env.fresh_prefix("jax") + "/zstd")
    zeros = np.zeros((256, 256), np.float32)
    ramp = np.arange(600, dtype=np.int64).reshape(20, 30)
    sp.save({"z": zeros, "r": ramp}, url, compression="zstd", backend=sp.ZarrBackend())
    got = sj.load(url, {"z": np.ones((256, 256), np.float32), "r": np.zeros((20, 30), np.int64)})
    assert np.asarray(got["z"]).tobytes() == zeros.tobytes()
    assert np.asarray(got["r"]).tobytes() == ramp.tobytes()


def test_s3_manager_retention_and_leftovers(s3_env):
    root = s3_env.url(s3_env.fresh_prefix("jaxmgr") + "/run")
    with sj.CheckpointManager(root, max_to_keep=2, async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full((4, 4), step, np.float32)}, metrics={"loss": step})
    mgr = sj.CheckpointManager(root, max_to_keep=2)
    assert mgr.all_steps() == [2, 3] and mgr.metrics(3) == {"loss": 3}
    assert not any(k.startswith("step_00000001/") for k in _keys(root))  # objects gone too
    assert np.asarray(mgr.load()["x"]).tolist() == np.full((4, 4), 3).tolist()
    # a save that crashed before its marker: an unreferenced save prefix, left alone while it
    # may still be running, removed by the next save once old enough ([SP-COMMIT-15])
    store, key = locate(root).pair()
    crashed = f"{key}/step_00000004/save-{'ab' * 8}/tensors/x/c/0/0"
    crashed_save(store, f"{key}/step_00000004/save-{'ab' * 8}", {"tensors/x/c/0/0": b"partial"})
    mgr.save(5, {"x": np.zeros((4, 4), np.float32)})
    assert store.head(crashed) is not None and mgr.all_steps() == [3, 5]
    mgr.leftover_min_age_s = 0.0
    with pytest.raises(sj.CheckpointNotFoundError):
        mgr.load(4)
    assert store.head(crashed) is None
    # step 3 is not retained any more, but the newest is never removed
    with pytest.raises(sj.CheckpointExistsError):
        mgr.save(5, {"x": np.zeros((4, 4), np.float32)})


VECTORS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "spec",
    "vectors",
    "invalid",
)


@pytest.mark.parametrize(
    "case",
    [
        "aliased_shard_index",
        "declares_more_than_stored",
        "bad_checksum",
        "missing_inner_chunk",
        "truncated_chunk",
        "zarr_json_repeated_name",
        "bad_zarr_json",
        # the packed layout's (format 1.4)
        "packed_object_missing",
        "packed_object_truncated",
        "packed_record_beyond_object",
        "packed_records_swapped",
        "packed_chunk_twice",
    ],
)
def test_invalid_vectors_on_an_object_store_fail_as_on_files(case):
    """The reader rules hold on a store without files too: the vector's objects uploaded to
    ``memory://`` are refused with the class and rule of spec/vectors/invalid, in both
    layouts."""
    url = f"memory://jax-vectors/{case}"
    exp = vector_on_store(os.path.join(VECTORS, case), url)
    with pytest.raises(sj.ShardpointError) as e:
        sj.load(url)
    assert (type(e.value).__name__, e.value.spec_id) == (exp["error"], exp["spec_id"]), e.value


@pytest.mark.slow  # two JAX processes with 2 devices each: ~20 s on a loaded machine
def test_two_processes_save_and_reload_on_s3(s3_env):
    """Process 0 decides the save prefix and sends it as a URL; both write their blocks below
    it, process 0 puts the marker; both load into another mesh from the store."""
    import json
    from shardpoint_jax.launch import run_processes
    from .test_jax_multiprocess import SAVE_LOAD

    url = s3_env.url(s3_env.fresh_prefix("jaxmp") + "/step_1")
    code = SAVE_LOAD.replace("BACKEND", "None").replace("PATH", repr(url))  # packed
    outs = run_processes(code, 2, 2, timeout=300)
    res = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert [r["rng"] for r in res] == [1, 0] and [r["grid"] for r in res] == ["cell0", "cell1"]
    keys = _keys(url)
    assert keys.count("manifest.msgpack") == 1
    assert len({k.split("/")[0] for k in keys if k.startswith("save-")}) == 1
    # the save's lease ([SP-COMMIT-16]) and one data object per process (their index parts
    # gathered into the manifest and deleted): nothing per tensor
    below = sorted(k.split("/", 1)[1] for k in keys if k != "manifest.msgpack")
    assert below[0] == "lease.msgpack" and len(below) == 3, keys
    assert all(k.startswith("packed/") and k.endswith("-0.bin") for k in below[1:]), keys


def test_a_listing_is_grouped_by_array_once():
    """[SP-READ-6] on object stores looks each array's chunk objects up in one grouping of
    the checkpoint's listing (a scan of the whole listing per array grew as arrays x
    objects): chunk keys of any depth, a 0-d array's one chunk ``c``, an array whose own
    key is ``c``; zarr.json and stray names are no chunks."""
    from shardpoint_core.stores.base import ObjectInfo
    from shardpoint_jax.storage import chunks_by_array

    keys = [
        "r/s/tensors/w/c/0/1",
        "r/s/tensors/w/c/1/0",
        "r/s/tensors/w/zarr.json",
        "r/s/tensors/scalar/c",
        "r/s/tensors/c/x/c/0",
        "r/s/tensors/c/x/zarr.json",
        "r/s/tensors/w/c/notes.txt",
        "r/manifest.msgpack",
    ]
    got = chunks_by_array(ObjectInfo(k, 10, 0.0) for k in keys)
    assert {a: sorted(i.key for i in v) for a, v in got.items()} == {
        "r/s/tensors/w": ["r/s/tensors/w/c/0/1", "r/s/tensors/w/c/1/0"],
        "r/s/tensors/scalar": ["r/s/tensors/scalar/c"],
        "r/s/tensors/c/x": ["r/s/tensors/c/x/c/0"],
    }


def _packed_tree() -> dict:
    rng = np.random.default_rng(5)
    return {
        "w": rng.standard_normal((2500, 1000), np.float32),  # 10 MB: a shard
        "b": (rng.standard_normal(33).astype(np.float32)).astype(jnp.bfloat16),
        "e": rng.integers(0, 255, (5, 7)).astype(np.uint8).view(jnp.float8_e4m3fn),
        "i": np.arange(12, dtype=np.int32).reshape(3, 4),
        "step": 4,
    }


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_packed_checkpoints_load_on_object_stores(where, request):
    """Issue 30: a packed checkpoint (format 1.4, written by the torch front end) loads into
    JAX from memory:// and the S3 server through the core's reader, whole and into a
    target, bit for bit (bfloat16 and float8 too); a box of a tensor reads only its bytes."""
    import shardpoint as sp
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_core.transactions.packed import PackedBackend
    from shardpoint_core.transactions.resolve import read_metadata

    if where == "s3":
        s3 = request.getfixturevalue("s3_env")
        url = s3.url(s3.fresh_prefix("jax-packed") + "/ck")
    else:
        url = "memory://jax-objects/packed/ck"
    tree = _packed_tree()
    sp.save(tree, url, backend=PackedBackend(ZarrBackend(shard_above_bytes=1 << 20)))
    m = read_metadata(url)
    assert m.format_version == (1, 4) and dict(m.packed.arrays)[m.tensors["w"].array]
    assert not [k for k in _keys(url) if k.endswith("zarr.json")]  # nothing per array
    _same(sj.load(url), tree)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items() if k != "step"}
    got = sj.load(url, {**target, "step": 0})
    _same(got, tree)
    ck = Checkpoint(url)
    box = ck.array("w").read([100, 0], [50, 1000])
    assert box.tobytes() == tree["w"][100:150].tobytes()


def test_a_jax_load_of_a_packed_checkpoint_on_s3_reads_each_object_once(s3_env):
    """The requests of that load on the S3 server: the manifest's GET (the index is in it:
    no LIST of the checkpoint), one HEAD per data object ([SP-PACK-7]), one
    ranged GET per object for every tensor's chunks (covering it exactly), the manifest's
    HEAD at the end ([SP-COMMIT-14]); no per-tensor request, no byte read twice."""
    import shardpoint as sp
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_core.transactions.packed import PackedBackend
    from shardpoint_core.transactions.resolve import backend_for, read_metadata
    from shardpoint_testing.s3 import Requests

    url = s3_env.url(s3_env.fresh_prefix("jax-packed") + "/requests")
    tree = _packed_tree()
    sp.save(tree, url, backend=PackedBackend(ZarrBackend(shard_above_bytes=1 << 20)))
    m = read_metadata(url)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items() if k != "step"}
    with Requests(backend_for(url), url) as log:
        got = sj.load(url, {**target, "step": 0})
        reads = log.take()
    _same(got, tree)
    objects = {f"save-*/{p.split('/', 1)[1]}": size for p, size in m.packed.objects}
    got_reads = sorted((op, k, r if k in objects else None) for op, k, r, *_ in reads)
    assert got_reads == sorted(
        [("GetObject", "manifest.msgpack", None)]
        + [("HeadObject", k, None) for k in objects]
        + [("GetObject", k, f"bytes=0-{size - 1}") for k, size in objects.items()]
        + [("HeadObject", "manifest.msgpack", None)]
    ), reads


PACKED_SHARDS = """
import json
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import shardpoint_jax as sj
from shardpoint_core.transactions.resolve import backend_for
from shardpoint_testing.s3 import Requests
url = URL
w = np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256)
mesh = Mesh(np.array(jax.devices()), ("x",))
tgt = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("x")))}
with Requests(backend_for(url), url) as log:
    got = sj.load(url, tgt)
    reads = log.take()
for s in got["w"].addressable_shards:
    assert np.asarray(s.data).tobytes() == w[s.index].tobytes(), s.index
gets = sorted(r for op, k, r, *_ in reads if op == "GetObject" and "/packed/" in k)
print(json.dumps({"pid": jax.process_index(), "gets": gets}))
"""


def test_each_jax_process_reads_only_the_chunks_of_its_shards_in_one_get(s3_env):
    """Two JAX processes of two devices each load a packed tensor of four row chunks, split
    by rows over the four devices: each process reads its two chunks, adjacent in the data
    object, in one ranged GET and nothing of the other process's half."""
    import json

    from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for
    from shardpoint_core.transactions.packed import PackedBackend
    from shardpoint_core.transactions.resolve import read_metadata
    from shardpoint_core.transactions.writer import CheckpointWriter
    from shardpoint_jax.launch import run_processes

    url = s3_env.url(s3_env.fresh_prefix("jax-packed") + "/shards")
    w = np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256)
    entry = TensorEntry("w", array_path_for("w"), w.shape, "float32", (1024, 256))
    with CheckpointWriter.begin(url, backend=PackedBackend(write_threads=1)) as wr:
        h = wr.open_array(entry.array, entry.spec)
        wr.wait([wr.write(h, (0, 0), w)])
        wr.flush()
        wr.commit(Manifest({"dict": [["w", {"tensor": "w"}]]}, {"w": entry}, {}))
    part = read_metadata(url).packed.array(read_metadata(url).tensors["w"].array)
    chunks = [part.chunk(c) for c in range(4)]  # (object, offset, length, crc32c)
    outs = run_processes(PACKED_SHARDS.replace("URL", repr(url)), 2, 2, timeout=300)
    res = sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda r: r["pid"])
    for pid, r in enumerate(res):
        lo, hi = chunks[2 * pid], chunks[2 * pid + 1]
        assert r["gets"] == [f"bytes={lo[1]}-{hi[1] + hi[2] - 1}"], (pid, r, chunks)
