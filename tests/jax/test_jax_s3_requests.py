"""Requests of a JAX load on a real S3-compatible server (moto's, on loopback), counted on the
client per operation and object, and how many round trips deep they are (deterministic, unlike
time): the JAX front end reads through the core's backend as the torch one does
(tests/api/test_s3_requests.py). The load reads the manifest first and then only what its
layout needs.

A load of a packed checkpoint (the default, format 1.4): the manifest's GET (no HEAD before
it; the index of every chunk is in it: no LIST), one HEAD per data object ([SP-PACK-7]), one
ranged GET per object for all its small chunks, last the HEAD of the manifest: the identity
its GET gave ([SP-COMMIT-14]), checked again once every read is done, as the torch load does.

A load of a per-array checkpoint (written on request, ``backend=ZarrBackend()``): the
manifest's GET, then one LIST of the checkpoint (the chunk objects' bytes, [SP-READ-6], before
a buffer is allocated); then per array its zarr.json GET and its first data GET together (a
plain chunk, or a shard's index by a suffix range); then a shard's runs of inner chunks; last
the HEAD of the manifest. (The LIST went out with the manifest's GET before the layout was
known, one round trip earlier, and was wasted on every packed load.)"""

from collections import Counter

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("boto3")
pytest.importorskip("moto")

import shardpoint_jax as sj  # noqa: E402
from shardpoint_core.stores.location import locate  # noqa: E402
from shardpoint_core.transactions.backend import ZarrBackend  # noqa: E402
from shardpoint_core.transactions.packed import PackedBackend  # noqa: E402
from shardpoint_core.transactions.resolve import backend_for, read_metadata  # noqa: E402
from shardpoint_jax.loading import Checkpoint  # noqa: E402
from shardpoint_testing.s3 import Requests  # noqa: E402

LATENCY = 0.1  # s added to every request: requests in flight together overlap by far
MARKER = "manifest.msgpack"
INNER = 5  # inner chunks of the shard of "big"


def _state(inner_elements: int = 1 << 19) -> dict:
    small = {f"s{i}": np.full((100,), float(i), np.float32) for i in range(6)}
    # 10 MiB: over the core's SHARD_ABOVE_BYTES, a shard of 5 inner chunks of 2 MiB
    return {**small, "big": np.arange(INNER * inner_elements, dtype=np.float32)}


def _per_array_shard(url: str) -> tuple:
    """(key, base offset, object size) of the per-array layout's shard object ``big/c/0``."""
    store, key = locate(url).pair()
    ckey = next(i.key for i in store.list(key + "/") if i.key.endswith("/tensors/big/c/0"))
    return ckey, 0, store.head(ckey).size


def _packed_shard(url: str) -> tuple:
    """(key, offset, length) of the shard of ``big`` inside its packed data object."""
    store, key = locate(url).pair()
    m = read_metadata(url)
    obj, off, n, _crc = m.packed.array(m.tensors["big"].array).chunk(0)
    return f"{key}/{obj}", off, n


def _shard_index(url: str, packed: bool) -> np.ndarray:
    """(offset in the object, nbytes) of each inner chunk of the shard of ``big`` as stored
    (this writer may leave gaps between inner chunks: runs are pinned to the index, not to a
    layout)."""
    store, _key = locate(url).pair()
    ckey, base, size = (_packed_shard if packed else _per_array_shard)(url)
    raw = store.get_range(ckey, base + size - (16 * INNER + 4), 16 * INNER)
    index = np.frombuffer(raw, "<u8").reshape(INNER, 2).copy()
    index[:, 0] += base
    return index


def _run(index: np.ndarray, first: int, last: int) -> str:
    """The Range header of one GET of inner chunks ``first``..``last``."""
    return f"bytes={index[first, 0]}-{index[last, 0] + index[last, 1] - 1}"


def _load(url: str, state: dict) -> list:
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    with Requests(backend_for(url), url, LATENCY) as log:
        out = sj.load(url, target)
        loaded = log.take()
    assert all(np.array_equal(np.asarray(out[k]), v) for k, v in state.items())
    return loaded


def test_a_jax_load_of_a_packed_checkpoint_sends_no_list(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("jax-requests") + "/packed")
    state = _state()
    sj.save(url, state)  # the default layout: packed
    m = read_metadata(url)
    assert m.packed is not None
    objects = {f"save-*/{p.split('/', 1)[1]}": size for p, size in m.packed.objects}
    assert len(objects) == 1  # 10 MiB and a few small chunks: below the object size cap
    ((obj, size),) = objects.items()
    loaded = _load(url, state)
    assert len(loaded) == 4, loaded
    assert Requests.waves(loaded) == [
        Counter({("GetObject", MARKER): 1}),  # no HEAD before it, no LIST beside it
        Counter({("HeadObject", obj): 1}),  # [SP-PACK-7]
        Counter({("GetObject", obj): 1}),  # every chunk of every tensor
        Counter({("HeadObject", MARKER): 1}),  # the identity, checked again
    ], loaded
    assert [r for op, k, r, *_ in loaded if op == "GetObject" and k == obj] == [
        f"bytes=0-{size - 1}"
    ]  # each byte once


def test_a_jax_load_of_a_per_array_checkpoint_sends_the_manifest_get_then_the_list(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("jax-requests") + "/ck")
    state = _state()
    sj.save(url, state, backend=ZarrBackend())  # the per-array layout, on request
    loaded = _load(url, state)

    n = len(state)
    assert len(loaded) == 2 * n + 4, loaded
    assert Requests.waves(loaded) == [
        Counter({("GetObject", MARKER): 1}),  # no HEAD before it
        Counter({("ListObjectsV2", ""): 1}),  # [SP-READ-6] for every array at once
        Counter(
            {
                ("GetObject", f"save-*/tensors/{k}/{w}"): 1
                for k in state
                for w in ("zarr.json", "c/0")
            }
        ),
        Counter({("GetObject", "save-*/tensors/big/c/0"): 1}),  # the inner chunks
        Counter({("HeadObject", MARKER): 1}),
    ], loaded  # the identity, checked again
    shard = [
        r for _m, k, r, *_ in sorted(loaded, key=lambda r: r[3]) if k == "save-*/tensors/big/c/0"
    ]
    assert shard == [
        f"bytes=-{16 * INNER + 4}",  # the index of the inner chunks
        _run(_shard_index(url, False), 0, INNER - 1),
    ], shard  # then all in one run
    assert [r for _m, k, r, *_ in loaded if k == "save-*/tensors/s0/c/0"] == [
        f"bytes=0-{100 * 4 + 4}"
    ]  # a plain chunk: one byte over its size


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_a_region_of_a_shard_reads_its_inner_chunks_in_one_run(s3_env, layout):
    """The checkpoint opened (its manifest's GET; per array the LIST after it), two regions
    read together: the shard's index (per array: beside zarr.json; packed:
    after the data object's HEAD, [SP-PACK-7]), then each region's inner chunks in one
    ranged GET, both in the same round trip. Packed, the shard is over 16 MiB (a smaller
    chunk is read whole, in one GET with its neighbours): 5 inner chunks of 4 MiB."""
    url = s3_env.url(s3_env.fresh_prefix("jax-requests") + "/region")
    packed = layout == "packed"
    el = 1 << 20 if packed else 1 << 19  # elements of an inner chunk
    state = _state(el)
    be = PackedBackend(ZarrBackend(inner_chunk_bytes=4 << 20)) if packed else ZarrBackend()
    sj.save(url, state, backend=be)
    q = el // 4
    with Requests(backend_for(url), url, LATENCY) as log:
        ck = Checkpoint(url)
        a = ck.array("big").start_read([q], [q])  # inside inner chunk 0
        b = ck.array("big").start_read([2 * el], [2 * el])  # inner chunks 2 and 3
        got = a.result(), b.result()
        reads = log.take()
    assert np.array_equal(got[0], state["big"][q : 2 * q])
    assert np.array_equal(got[1], state["big"][2 * el : 4 * el])
    index = _shard_index(url, packed)
    if packed:
        ckey, off, n = _packed_shard(url)
        obj = "save-*/" + ckey.split("/save-", 1)[1].split("/", 1)[1]
        # No LIST; both reads start after the HEAD: each sends its own index read.
        waves = [
            Counter({("GetObject", MARKER): 1}),
            Counter({("HeadObject", obj): 1}),
            Counter({("GetObject", obj): 2}),
            Counter({("GetObject", obj): 2}),
        ]
        idx = f"bytes={off + n - (16 * INNER + 4)}-{off + n - 1}"
    else:
        obj = "save-*/tensors/big/c/0"
        # Both reads start before zarr.json answers: each sends its own early index read.
        waves = [
            Counter({("GetObject", MARKER): 1}),
            Counter({("ListObjectsV2", ""): 1}),
            Counter({("GetObject", "save-*/tensors/big/zarr.json"): 1, ("GetObject", obj): 2}),
            Counter({("GetObject", obj): 2}),
        ]
        idx = f"bytes=-{16 * INNER + 4}"
    assert Requests.waves(reads) == waves, reads
    runs = sorted(r for op, k, r, *_ in reads if op == "GetObject" and k == obj)
    assert runs == sorted([idx, idx, _run(index, 0, 0), _run(index, 2, 3)]), runs


def test_a_jax_load_checks_every_data_object_in_one_round_trip(s3_env):
    """20 tensors in 20 data objects (a 4 KiB object cap): the JAX front end opens its arrays
    one after another, but tells the reader first which it will read, so every object's
    HEAD ([SP-PACK-7]) is in flight at once (before: one round trip per object)."""
    url = s3_env.url(s3_env.fresh_prefix("jax-requests") + "/objects")
    state = {f"t{i:02d}": np.full((1024,), float(i), np.float32) for i in range(20)}
    sj.save(url, state, backend=PackedBackend(cap=4096))
    m = read_metadata(url)
    objects = Counter(f"save-*/{p.split('/', 1)[1]}" for p, _size in m.packed.objects)
    assert len(objects) == 20
    loaded = _load(url, state)
    assert Requests.waves(loaded) == [
        Counter({("GetObject", MARKER): 1}),
        Counter({("HeadObject", o): 1 for o in objects}),
        Counter({("GetObject", o): 1 for o in objects}),
        Counter({("HeadObject", MARKER): 1}),
    ], loaded
