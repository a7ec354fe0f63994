"""Requests of a JAX load on a real S3-compatible server (moto's, on loopback), counted on the
client per operation and object, and how many round trips deep they are (deterministic, unlike
time): the JAX front end reads through the core's backend as the torch one does
(tests/api/test_s3_requests.py).

A load: the manifest's GET (no HEAD before it) and one LIST of the checkpoint beside it (the
chunk objects' bytes, [SP-READ-6], before a buffer is allocated); then per array its zarr.json
GET and its first data GET together (a plain chunk, or a shard's index by a suffix range);
then a shard's runs of inner chunks; last the HEAD of the manifest: the identity its GET gave
([SP-COMMIT-14]), checked again once every read is done, as the torch load does. The JAX path
this replaced first sent a HEAD, then the GET, of the manifest, then the zarr.json GETs, a
LIST per array, the data GETs and the shard's runs: 24 requests 6 round trips deep for the
tree below, against 18 in 4 now."""

from collections import Counter

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("boto3")
pytest.importorskip("moto")

import shardpoint_jax as sj  # noqa: E402
from shardpoint_core.stores.location import locate  # noqa: E402
from shardpoint_core.transactions.resolve import backend_for  # noqa: E402
from shardpoint_jax.loading import Checkpoint  # noqa: E402
from shardpoint_testing.s3 import Requests  # noqa: E402

LATENCY = 0.1  # s added to every request: requests in flight together overlap by far
MARKER = "manifest.msgpack"
INNER = 5  # inner chunks of the shard of "big"


def _state() -> dict:
    small = {f"s{i}": np.full((100,), float(i), np.float32) for i in range(6)}
    # 10 MiB: over the core's SHARD_ABOVE_BYTES, a shard of 5 inner chunks of 2 MiB
    return {**small, "big": np.arange(INNER * (1 << 19), dtype=np.float32)}


def _shard_index(url: str) -> np.ndarray:
    """(offset, nbytes) of each inner chunk of the shard ``big/c/0`` as stored (this writer
    may leave gaps between inner chunks: runs are pinned to the index, not to a layout)."""
    store, key = locate(url).pair()
    ckey = next(i.key for i in store.list(key + "/") if i.key.endswith("/tensors/big/c/0"))
    size = store.head(ckey).size
    raw = store.get_range(ckey, size - (16 * INNER + 4), 16 * INNER)
    return np.frombuffer(raw, "<u8").reshape(INNER, 2)


def _run(index: np.ndarray, first: int, last: int) -> str:
    """The Range header of one GET of inner chunks ``first``..``last``."""
    return f"bytes={index[first, 0]}-{index[last, 0] + index[last, 1] - 1}"


def test_a_jax_load_sends_the_manifest_get_then_zarr_json_with_first_data(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("jax-requests") + "/ck")
    state = _state()
    sj.save(url, state)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    with Requests(backend_for(url), url, LATENCY) as log:
        out = sj.load(url, target)
        loaded = log.take()
    assert all(np.array_equal(np.asarray(out[k]), v) for k, v in state.items())

    n = len(state)
    assert len(loaded) == 2 * n + 4, loaded
    assert Requests.waves(loaded) == [
        Counter(
            {
                ("GetObject", MARKER): 1,  # no HEAD before it
                ("ListObjectsV2", ""): 1,
            }
        ),  # [SP-READ-6] for every array at once
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
        _run(_shard_index(url), 0, INNER - 1),
    ], shard  # then all in one run
    assert [r for _m, k, r, *_ in loaded if k == "save-*/tensors/s0/c/0"] == [
        f"bytes=0-{100 * 4 + 4}"
    ]  # a plain chunk: one byte over its size


def test_a_region_of_a_shard_reads_its_inner_chunks_in_one_run(s3_env):
    """Two regions read together: zarr.json and the shard's index beside it, then each
    region's inner chunks in one ranged GET, both in the same round trip."""
    url = s3_env.url(s3_env.fresh_prefix("jax-requests") + "/region")
    state = _state()
    sj.save(url, state)
    el = 1 << 19  # elements of an inner chunk
    q = el // 4
    with Requests(backend_for(url), url, LATENCY) as log:
        ck = Checkpoint(url)
        log.take()  # the manifest's GET and the LIST
        a = ck.array("big").start_read([q], [q])  # inside inner chunk 0
        b = ck.array("big").start_read([2 * el], [2 * el])  # inner chunks 2 and 3
        got = a.result(), b.result()
        reads = log.take()
    assert np.array_equal(got[0], state["big"][q : 2 * q])
    assert np.array_equal(got[1], state["big"][2 * el : 4 * el])
    index = _shard_index(url)
    # Both reads start before zarr.json answers: each sends its own early index read.
    assert Requests.waves(reads) == [
        Counter(
            {
                ("GetObject", "save-*/tensors/big/zarr.json"): 1,
                ("GetObject", "save-*/tensors/big/c/0"): 2,
            }
        ),
        Counter({("GetObject", "save-*/tensors/big/c/0"): 2}),
    ], reads
    runs = sorted(r for _m, k, r, *_ in reads if k == "save-*/tensors/big/c/0")
    idx = f"bytes=-{16 * INNER + 4}"
    assert runs == sorted([idx, idx, _run(index, 0, 0), _run(index, 2, 3)]), runs
