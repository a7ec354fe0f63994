"""sp.save / sp.load / sp.open / async save on s3:// against a real S3 server (moto, on
loopback): bitwise round trips across world sizes and shardings on real gloo ranks, a rank
killed mid-save (the previous checkpoint intact, nothing committed, the leftover found and
removed), damaged and missing objects (documented errors), and a load that overlaps a
replacement."""

import os

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")

import shardpoint as sp  # noqa: E402
from shardpoint_testing.launch import RankFailure, run_world  # noqa: E402
from shardpoint_testing.tensors import same_bits, seeded_randn  # noqa: E402

SHAPE = (12, 5)


def full(name, dtype=torch.float32):
    return seeded_randn(name, SHAPE, dtype)


def split(n, parts, i):
    return i * n // parts, (i + 1) * n // parts


def saved_state(rank, world, gen=0):
    a, b = split(SHAPE[0], world, rank)
    fa, fb = split(SHAPE[0] * SHAPE[1], world, rank)
    return {
        "rows": sp.ShardedTensor(full(f"rows{gen}")[a:b].clone(), SHAPE, (a, 0)),
        "flat": sp.ShardedTensor(
            full(f"flat{gen}").reshape(-1)[fa:fb].clone(),
            SHAPE,
            (0, 0),
            local_shape=SHAPE,
            flattened_range=(fa, fb),
        ),
        "bf16": full(f"bf{gen}", torch.bfloat16),
        "obj": sp.ShardedObject({"rank": rank, "gen": gen}, rank, world),
        "step": gen,
    }


def _save_reshard_kill(rank, world, url):
    """Save on 2 ranks; load back with columns split (another sharding); then a second save
    over it where rank 1 is SIGKILLed after its first chunk write."""
    from shardpoint_conformance.faults import KillingBackend
    from shardpoint_core.transactions.packed import PackedBackend

    sp.save(saved_state(rank, world), url)
    a, b = split(SHAPE[1], world, rank)
    like = {
        "rows": sp.ShardedTensor(torch.empty(SHAPE[0], b - a), SHAPE, (0, a)),
        "flat": sp.ShardedTensor(torch.empty(SHAPE[0], b - a), SHAPE, (0, a)),
        "bf16": torch.empty(SHAPE, dtype=torch.bfloat16),
    }
    sp.load(url, like=like)
    ok = [
        same_bits(like["rows"].data, full("rows0")[:, a:b]),
        same_bits(like["flat"].data, full("flat0")[:, a:b]),
        same_bits(like["bf16"], full("bf0", torch.bfloat16)),
    ]
    if rank == 1:
        os.environ["SHARDPOINT_CONFORMANCE_KILL"] = "1:write:1"
    be = KillingBackend(PackedBackend())  # the default layout
    try:
        sp.save(saved_state(rank, world, gen=1), url, overwrite=True, backend=be)
        return ok + ["saved"]
    except sp.errors.ShardpointError as e:
        return ok + [type(e).__name__]


def test_two_ranks_save_reshard_load_and_a_rank_killed_mid_save(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("world") + "/step_1")
    with pytest.raises(RankFailure) as e:
        run_world(2, _save_reshard_kill, url, timeout=240, pg_timeout=20)
    assert "rank 1: process exited with code -9" in str(e.value)
    # rank 0 reported its own outcome before the launcher gave up on rank 1; whatever it saw,
    # the checkpoint is the first save, whole, loaded here by one process (world 2 -> 1)
    out = sp.load(url)
    assert same_bits(out["rows"], full("rows0")) and same_bits(out["flat"], full("flat0"))
    assert same_bits(out["bf16"], full("bf0", torch.bfloat16))
    assert out["obj"] == [{"rank": 0, "gen": 0}, {"rank": 1, "gen": 0}] and out["step"] == 0
    # the coordinator outlived rank 1, learnt of the failure and removed the save's prefix
    # (a dead coordinator leaves it to recovery: tests/core/test_s3_commit.py kills one)
    from shardpoint_core.transactions.backend import ZarrBackend

    assert ZarrBackend().list_leftovers(url) == []
    assert all(
        not k.key.startswith("save-") or k.key.split("/")[0] == _named(url)
        for k in _store(url).list()
    )


def _named(url):
    from shardpoint_core.format.manifest import decode_manifest

    return decode_manifest(_store(url).get("manifest.msgpack")).tensors["rows"].array.split("/")[0]


def test_single_process_save_load_open_async(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("api") + "/step_1")
    state = saved_state(0, 1)
    state["u8"] = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    res = sp.save(state, url)
    assert res.path == url
    out = sp.load(url)
    assert same_bits(out["rows"], full("rows0")) and same_bits(out["u8"], state["u8"])
    with sp.open(url) as ck:
        assert same_bits(ck["u8"][2:5].to_torch(), state["u8"][2:5])
    with pytest.raises(sp.CheckpointExistsError):
        sp.save(state, url)
    state2 = saved_state(0, 1, gen=1)
    h = sp.save(state2, url, overwrite=True, async_save=True)
    h.wait()
    assert same_bits(sp.load(url)["rows"], full("rows1"))
    keys = [o.key for o in _store(url).list()]
    assert sum(k.endswith("manifest.msgpack") for k in keys) == 1
    assert len({k.split("/")[0] for k in keys if k.startswith("save-")}) == 1  # old deleted


def _store(url):
    from shardpoint_core.stores.s3 import S3Store

    return S3Store.from_url(url)


def _chunk_object(st, m, key):
    """(object key, offset) of the first chunk of ``key`` below the save: per-array its chunk
    object, packed the data object holding it and the chunk's offset there (the index)."""
    e = m.tensors[key]
    if e.packed is not None:
        obj, off, _n, _crc = e.packed.chunk(0)
        return obj, off
    return next(k.key for k in st.list(f"{e.array}/c/")), 0


@pytest.mark.parametrize("layout", ["packed", "per-array"])
def test_missing_and_damaged_objects_are_documented_errors(s3_env, layout):
    from shardpoint_core.format.manifest import decode_manifest
    from shardpoint_core.transactions.backend import ZarrBackend

    url, be = s3_env.url(s3_env.fresh_prefix("damage") + "/ck"), ZarrBackend()
    sp.save({"w": full("w"), "v": full("v")}, url, backend=None if layout == "packed" else be)
    st = _store(url)
    m = decode_manifest(be.read_manifest(url))
    assert (m.packed is not None) == (layout == "packed")
    w_chunk, off = _chunk_object(st, m, "w")
    data = bytearray(st.get(w_chunk))
    data[off + 3] ^= 0x40
    st.put(w_chunk, bytes(data))
    with pytest.raises(sp.CorruptCheckpointError, match="SP-READ-3"):
        sp.load(url, like={"w": torch.empty(SHAPE)})
    problems = be.verify_array(url, m.tensors["w"].array, m.tensors["w"].spec, "w")
    assert [p[0] for p in problems] == ["SP-READ-3"]
    st.delete([_chunk_object(st, m, "v")[0]])  # packed: the one data object, v's chunk in it
    with pytest.raises(sp.CorruptCheckpointError, match="SP-READ-2"):
        sp.load(url, like={"v": torch.empty(SHAPE)})
    st.delete(["manifest.msgpack"])
    with pytest.raises(sp.IncompleteCheckpointError, match="SP-COMMIT-3"):
        sp.load(url)
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(s3_env.url(s3_env.fresh_prefix("nothing")))


@pytest.mark.parametrize(
    "layout", ["packed", pytest.param("per-array", marks=pytest.mark.slow)]
)  # the retries are the store's, the same for both layouts: the default's in the short run
def test_save_and_load_through_throttling_and_5xx(s3_env, monkeypatch, layout):
    """Every third request answered 503 SlowDown or 500 by a proxy on loopback: the save
    and the load retry with backoff and the round trip is still bitwise."""
    from shardpoint_testing.s3 import FaultProxy
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_core.transactions.packed import PackedBackend

    def rule(method, path, n):
        return (503 if n % 6 == 0 else 500) if n % 3 == 0 else None

    with FaultProxy(s3_env, rule) as proxy:
        for k, v in proxy.env().items():
            monkeypatch.setenv(k, v)
        be = ZarrBackend()  # a fresh client, through the proxy
        be = PackedBackend(be) if layout == "packed" else be
        url = s3_env.url(s3_env.fresh_prefix("faults") + "/ck")
        state = {"w": full("w"), "b": full("b", torch.bfloat16), "step": 3}
        sp.save(state, url, backend=be)
        out = sp.load(url, backend=be)
        assert same_bits(out["w"], state["w"]) and same_bits(out["b"], state["b"])
        assert proxy.injected >= 3
