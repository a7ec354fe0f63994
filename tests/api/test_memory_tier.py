"""The memory tier with real gloo processes: checkpoints in the hosts' shared memory,
replicated to a peer host, restored after a host loss (its processes gone and its shared
memory deleted) by a job with a replacement host or fewer ranks, bitwise; two hosts lost with
k=1 (the lost tensors come from storage, and the result says so); a host lost during
replication (nothing committed, the previous memory step still restores).

Hosts are simulated: each rank names its host (``host_id``) and each host has its own
shared-memory directory (``shm_dir``); the side channel is real TCP on the loopback.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import shardpoint as sp
from shardpoint.api.memory_tier import MemoryTier
from shardpoint_testing.launch import RankFailure, run_world

ROWS, COLS = 24, 16
# every rank's block its own chunk, however small (the planner would merge these tiny blocks
# into one chunk, and then a lost host would lose nothing of them)
OPTS = sp.SaveOptions(plan=sp.PlanOptions(chunk_overhead_bytes=0))


def _full(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "b": torch.randn(COLS, generator=g).to(torch.bfloat16),
        "e": torch.arange(ROWS * 3, dtype=torch.int64).reshape(ROWS, 3) * step,
    }


def _state(rank: int, world: int, step: int, zeros: bool = False) -> dict:
    """Rank ``rank``'s shards of step ``step``'s state (rows of w and e split over the world,
    b replicated); ``zeros``: the same layout, empty, for ``like``."""
    full = _full(step)
    n = ROWS // world
    sl = slice(rank * n, (rank + 1) * n)

    def piece(t: torch.Tensor) -> sp.ShardedTensor:
        d = t[sl].clone()
        return sp.ShardedTensor(torch.zeros_like(d) if zeros else d, t.shape, (rank * n, 0))

    return {
        "model": {
            "w": piece(full["w"]),
            "b": torch.zeros_like(full["b"]) if zeros else full["b"].clone(),
        },
        "extra": {"e": piece(full["e"])},
        "step": 0 if zeros else step,
    }


def _check(rank: int, world: int, tree: dict, step: int) -> None:
    want = _state(rank, world, step)
    for got, exp in (
        (tree["model"]["w"], want["model"]["w"].data),
        (tree["extra"]["e"], want["extra"]["e"].data),
        (tree["model"]["b"], want["model"]["b"]),
    ):
        assert got.dtype == exp.dtype and torch.equal(
            got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
            exp.view(torch.uint8) if exp.dtype == torch.bfloat16 else exp,
        )
    assert tree["step"] == step


def _tier(rank: int, root: str, hosts: list, **kw) -> MemoryTier:
    h = hosts[rank]
    return MemoryTier(
        "job", host_id=h, shm_dir=os.path.join(root, h), advertise="127.0.0.1", timeout_s=20, **kw
    )


def _save(rank: int, world: int, root: str, hosts: list, steps: list, durable: bool) -> list:
    tier = _tier(rank, root, hosts)
    for s in steps:
        tier.save(_state(rank, world, s), s, keep=2, options=OPTS)
        if durable:
            sp.save(
                _state(rank, world, s), os.path.join(root, "durable", f"step_{s}"), options=OPTS
            )
    tier.close()
    return tier.steps()


def _restore(rank: int, world: int, root: str, hosts: list, step: int, fallback) -> dict:
    tier = _tier(rank, root, hosts)
    like = _state(rank, world, step, zeros=True)
    got = tier.restore(like, fallback=fallback)
    assert got.step == step
    _check(rank, world, got.tree, step)
    tier.close()
    return {
        "sources": got.sources,
        "reason": got.reason,
        "storage_url": got.storage_url,
        "memory_bytes": got.memory_bytes,
        "storage_bytes": got.storage_bytes,
        "missing": len(got.missing_objects),
    }


def _lose(root: str, host: str) -> None:
    """Host ``host`` is gone: its processes ended with the run; its memory goes now."""
    shutil.rmtree(os.path.join(root, host))


def test_host_lost_then_replacement_host_and_fewer_ranks_restore_from_memory(tmp_path):
    root = str(tmp_path)
    hosts = ["h0", "h0", "h1", "h1"]
    steps = run_world(4, _save, root, hosts, [1, 2, 3], False, timeout=120, pg_timeout=30)
    assert steps[0] == [2, 3]  # keep=2: the owner's retention evicted step 1
    _lose(root, "h1")
    # the same world size, h1 replaced by an empty h2
    got = run_world(
        4, _restore, root, ["h0", "h0", "h2", "h2"], 3, None, timeout=120, pg_timeout=30
    )
    assert set(got[0]["sources"].values()) == {"memory"} and got[0]["storage_bytes"] == 0
    assert got[0]["reason"] == "" and got[0]["missing"] == 0
    # fewer ranks: the survivors alone, resharded from 4 to 2
    got = run_world(2, _restore, root, ["h0", "h0"], 3, None, timeout=120, pg_timeout=30)
    assert set(got[0]["sources"].values()) == {"memory"}


def test_two_hosts_lost_with_k1_falls_back_to_storage_and_says_so(tmp_path):
    root = str(tmp_path)
    hosts = ["h0", "h1", "h2", "h3"]
    run_world(4, _save, root, hosts, [5], True, timeout=120, pg_timeout=30)
    _lose(root, "h1")
    _lose(root, "h2")  # h1's objects lived on h1 and h2: both gone
    survivors = ["h0", "h3"]
    fallback = os.path.join(root, "durable", "step_{step}")
    got = run_world(2, _restore, root, survivors, 5, fallback, timeout=120, pg_timeout=30)
    r = got[0]
    assert r["sources"]["model/w"] == "storage" and r["sources"]["extra/e"] == "storage"
    assert r["sources"]["step"] == "memory"  # values: the manifest, on h0 and h1
    assert "on no surviving host" in r["reason"] and r["missing"] > 0
    assert r["storage_url"].endswith("step_5") and r["storage_bytes"] > 0
    # without a fallback: a clear error naming what is missing, not a partial state
    with pytest.raises(RankFailure, match="IncompleteCheckpointError.*on no surviving host"):
        run_world(2, _restore, root, survivors, 5, None, timeout=120, pg_timeout=30)


def _save_then_host_dies_mid_replication(rank: int, world: int, root: str) -> str:
    hosts = ["h0", "h0", "h1", "h1"]
    tier = _tier(rank, root, hosts)
    tier.save(_state(rank, world, 1), 1, options=OPTS)
    if hosts[rank] == "h1":  # h1 dies as soon as a replica reaches it
        real = tier.store.handle

        def dying(req, payload):
            if req.get("op") == "put":
                os._exit(17)
            return real(req, payload)

        tier.server._srv.handler = dying
    err = ""
    try:
        tier.save(_state(rank, world, 2), 2, options=OPTS)
    except sp.ShardpointError as e:
        err = type(e).__name__
    committed = tier.store.local_info("step_2/manifest.msgpack") is not None
    with open(os.path.join(root, f"out{rank}"), "w") as f:
        f.write(f"{err} {committed} {tier.steps()}")
    tier.close()
    return err


def test_host_lost_during_replication_commits_nothing_previous_step_restores(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankFailure) as info:
        run_world(4, _save_then_host_dies_mid_replication, root, timeout=50, pg_timeout=15)
    assert "rank 2" in str(info.value) or "rank 3" in str(info.value)
    for r in (0, 1):  # the survivors: the save failed, no marker
        err, committed, steps = open(os.path.join(root, f"out{r}")).read().split(" ", 2)
        assert err and committed == "False" and steps == "[1]"
    _lose(root, "h1")
    got = run_world(2, _restore, root, ["h0", "h0"], 1, None, timeout=120, pg_timeout=30)
    assert set(got[0]["sources"].values()) == {"memory"}


def _over_budget(rank: int, world: int, root: str) -> list:
    tier = _tier(rank, root, ["h0", "h1"], budget_bytes=2000)
    try:
        tier.save(_state(rank, world, 1), 1, options=OPTS)
        err = ""
    except sp.errors.MemoryBudgetError as e:
        err = str(e)
    written = [f for _d, _s, fs in os.walk(os.path.join(root, f"h{rank}")) for f in fs]
    tier.store.configure(budget_bytes=1 << 20)
    tier.save(_state(rank, world, 1), 1, options=OPTS)  # fits: committed
    steps = tier.steps()
    tier.close()
    return [err, written, steps]


def test_a_save_over_the_memory_budget_fails_on_every_rank_before_writing(tmp_path):
    got = run_world(2, _over_budget, str(tmp_path), timeout=120, pg_timeout=30)
    for err, written, steps in got:
        assert "over its budget of 2000 bytes" in err and "nothing was written" in err
        assert written == [] and steps == [1]


def _restore_while_a_host_dies(rank: int, world: int, root: str, hosts: list) -> str:
    tier = _tier(rank, root, hosts)
    if hosts[rank] == "h2":  # h2 dies as soon as it serves a piece
        real = tier.store.handle

        def dying(req, payload):
            if req.get("op") == "get":
                os._exit(17)
            return real(req, payload)

        tier.server._srv.handler = dying
    err = ""
    try:
        tier.restore(_state(rank, world, 5, zeros=True))
    except sp.ShardpointError as e:
        err = type(e).__name__
    with open(os.path.join(root, f"restore{rank}"), "w") as f:
        f.write(err)
    tier.close()
    return err


def test_host_lost_during_recovery_fails_cleanly_then_storage_fills_in(tmp_path):
    """h1 is lost; during the restore, h2 (which holds h1's replicas) dies too: the survivors
    raise, none returns a state; the next restore, on the three hosts left, reads what both
    held from storage, and says so."""
    root = str(tmp_path)
    run_world(4, _save, root, ["h0", "h1", "h2", "h3"], [5], True, timeout=120, pg_timeout=30)
    _lose(root, "h1")
    with pytest.raises(RankFailure) as info:
        run_world(
            4,
            _restore_while_a_host_dies,
            root,
            ["h0", "spare", "h2", "h3"],
            timeout=90,
            pg_timeout=5,
        )
    assert "rank 2: process exited with code 17" in str(info.value)
    for r in (0, 1, 3):
        assert open(os.path.join(root, f"restore{r}")).read() != ""  # raised, no state
    _lose(root, "h2")
    fallback = os.path.join(root, "durable", "step_{step}")
    got = run_world(
        3, _restore, root, ["h0", "spare", "h3"], 5, fallback, timeout=120, pg_timeout=30
    )
    assert got[0]["sources"]["model/w"] == "storage" and "on no surviving host" in got[0]["reason"]


def _save_with_a_deaf_host(rank: int, world: int, root: str) -> list:
    hosts = ["h0", "h0", "h1", "h1"]
    tier = _tier(rank, root, hosts)
    tier.save(_state(rank, world, 1), 1, options=OPTS)
    tier.comm.all_true(True)
    if hosts[rank] == "h1":
        tier.server.close()  # h1 stays up but takes no replica any more
    tier.comm.all_true(True)
    err = ""
    try:
        tier.save(_state(rank, world, 2), 2, options=OPTS)
    except sp.ShardpointError as e:
        err = f"{type(e).__name__}: {e}"
    steps = sorted(
        {
            int(k.split("/")[0][5:])
            for k in os.listdir(tier.store.root)
            if os.path.exists(os.path.join(tier.store.root, k, "manifest.msgpack"))
        }
    )
    tier.close()
    return [err, steps]


def test_a_step_whose_replicas_cannot_be_placed_is_not_committed(tmp_path):
    """Every rank alive, but no replica reaches h1: the save fails on every rank and no host
    holds a marker of step 2 (the marker is written only after every replica is in place)."""
    got = run_world(4, _save_with_a_deaf_host, str(tmp_path), timeout=120, pg_timeout=30)
    for err, steps in got:
        assert "took the replica" in err and "not committed" in err, err
        assert steps == [1]


def _restore_says(rank: int, world: int, root: str, hosts: list, step: int, fallback) -> dict:
    tier = _tier(rank, root, hosts)
    got = tier.restore(_state(rank, world, step, zeros=True), fallback=fallback)
    _check(rank, world, got.tree, step)
    tier.close()
    return {"sources": sorted(set(got.sources.values())), "reason": got.reason}


def test_a_memory_load_failing_on_one_host_sends_every_rank_to_storage(tmp_path):
    """h1's copy of a data object is wrong with a right sidecar (its bytes changed before
    they were checksummed in memory): the shared-memory check passes, the load's own chunk
    check fails on h1 alone. Every rank then reads storage and says why, instead of h1's
    rank going to storage alone while h0's waits for it."""
    import crc32c

    from shardpoint_core.format.manifest import decode_manifest
    from shardpoint_core.stores.shm_host import SIDECAR, HostMemory

    root = str(tmp_path)
    hosts = ["h0", "h1"]
    run_world(2, _save, root, hosts, [1], True, timeout=120, pg_timeout=30)
    mem = HostMemory(os.path.join(root, "h1", "job"))
    with open(mem.path("step_1/manifest.msgpack"), "rb") as f:
        p = decode_manifest(f.read()).tensors["model/b"].packed  # every rank reads b whole
    r = p.records[0]
    key = f"step_1/{p.objects[int(r['object'])][0]}"
    data = bytearray(open(mem.path(key), "rb").read())
    data[int(r["offset"])] ^= 0xFF  # inside a chunk: its crc32c no longer holds
    with open(mem.path(key), "wb") as f:
        f.write(data)
    with open(mem.crc_path(key), "wb") as f:
        f.write(SIDECAR.pack(crc32c.crc32c(bytes(data)), len(data)))
    fb = os.path.join(root, "durable", "step_{step}")
    got = run_world(2, _restore_says, root, hosts, 1, fb, timeout=120, pg_timeout=30)
    for g in got:
        assert g["sources"] == ["storage"] and "failed to load" in g["reason"]
