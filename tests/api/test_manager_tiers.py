"""The manager's tier policy with real gloo processes: every step to the memory tier, every N
steps to storage (copied from memory in the background), resume from the newest step across
tiers (from memory, after a host loss from the peers' replicas, with memory gone from storage,
past a damaged memory step to the next older one), a failed durable copy reported while
training goes on; every resumed state bitwise equal to the one saved.

Hosts are simulated (``host_id``, one shared-memory directory each), as in
``test_memory_tier.py``; the side channel is real TCP on the loopback.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

import shardpoint as sp
from shardpoint.api.memory_tier import MemoryTier
from shardpoint_testing.launch import run_world

ROWS, COLS = 16, 8
OPTS = sp.SaveOptions(plan=sp.PlanOptions(chunk_overhead_bytes=0))  # a chunk per rank
HOSTS = ["h0", "h1"]


def _state(rank: int, world: int, step: int, zeros: bool = False) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(ROWS, COLS, generator=g)
    b = torch.randn(COLS, generator=g).to(torch.bfloat16)
    n = ROWS // world
    mine = w[rank * n : (rank + 1) * n].clone()
    return {
        "w": sp.ShardedTensor(
            torch.zeros_like(mine) if zeros else mine, (ROWS, COLS), (rank * n, 0)
        ),
        "b": torch.zeros_like(b) if zeros else b,
        "step": 0 if zeros else step,
    }


def _same(rank: int, world: int, tree: dict, step: int) -> bool:
    want = _state(rank, world, step)
    return (
        torch.equal(tree["w"], want["w"].data)
        and tree["step"] == step
        and torch.equal(tree["b"].view(torch.int16), want["b"].view(torch.int16))
    )


def _manager(rank: int, root: str, **kw):
    h = HOSTS[rank]
    tier = MemoryTier(
        "job", host_id=h, shm_dir=os.path.join(root, "shm", h), advertise="127.0.0.1", timeout_s=20
    )
    mgr = sp.CheckpointManager(os.path.join(root, "ckpt"), memory=tier, save_options=OPTS, **kw)
    return tier, mgr


def _train(
    rank: int, world: int, root: str, steps: list, every: int, parallel: bool = False
) -> dict:
    tier, mgr = _manager(
        rank, root, storage_every=every, memory_keep=2, max_to_keep=2, parallel_copy=parallel
    )
    for s in steps:
        mgr.save(s, _state(rank, world, s), metrics={"loss": 1.0 / s})
    mgr.close()  # the last durable copy lands (or is reported)
    out = {
        "memory": mgr.memory_steps(),
        "storage": mgr.all_steps(),
        "warnings": list(mgr.tier_warnings),
        "latest": mgr.latest_step(),
        "copied": mgr._tiers.part_objects,
    }
    torch.distributed.barrier()  # every rank listed before any stops serving
    tier.close()
    return out


def _resume(rank: int, world: int, root: str) -> dict:
    tier, mgr = _manager(rank, root, storage_every=2, max_to_keep=2)
    like = _state(rank, world, 0, zeros=True)
    tree = mgr.load(like=like)
    info = mgr.last_load
    out = {
        "step": info.step,
        "tier": info.tier,
        "skipped": info.skipped,
        "same": _same(rank, world, tree, info.step),
        "url": info.url,
    }
    # a restarted job goes on training from there
    mgr.save(info.step + 1, _state(rank, world, info.step + 1))
    mgr.close()
    out["storage"] = mgr.all_steps()
    torch.distributed.barrier()
    tier.close()
    return out


def _lose_host_memory(root: str, host: str) -> None:
    shutil.rmtree(os.path.join(root, "shm", host))


def test_memory_every_step_storage_every_n_then_resume_across_tiers(tmp_path):
    root = str(tmp_path)
    got = run_world(2, _train, root, [1, 2, 3, 4, 5], 2, timeout=120, pg_timeout=30)
    for r in got:
        assert r["memory"] == [4, 5]  # memory_keep=2
        assert r["storage"] == [2, 4]  # every 2nd step, copied from memory
        assert r["warnings"] == [] and r["latest"] == 5
    # the durable copies are whole checkpoints of their own, bitwise the state saved
    d4 = sp.load(os.path.join(root, "ckpt", "step_00000004"))
    assert torch.equal(d4["w"], _state(0, 1, 4)["w"].data) and d4["__metrics__"]["loss"] == 0.25
    # resume: the newest step across tiers is memory step 5
    got = run_world(2, _resume, root, timeout=120, pg_timeout=30)
    assert all(r["same"] and r["step"] == 5 and r["tier"] == "memory" for r in got)
    assert got[0]["storage"] == [4, 6]  # step 6 copied, then storage retention (2 kept)
    # h1 is lost (its shared memory gone): step 6 (saved by the resumed job) from the peers
    _lose_host_memory(root, "h1")
    got = run_world(2, _resume, root, timeout=120, pg_timeout=30)
    assert all(r["same"] and r["step"] == 6 and r["tier"] == "memory" for r in got)
    # memory gone entirely: the newest durable step (6 was a storage step too)
    _lose_host_memory(root, "h0")
    _lose_host_memory(root, "h1")
    got = run_world(2, _resume, root, timeout=120, pg_timeout=30)
    assert all(r["same"] and r["step"] == 6 and r["tier"] == "storage" for r in got)
    assert got[0]["url"].endswith("step_00000006")


def test_every_rank_copies_the_objects_its_host_holds_and_one_commit_publishes(tmp_path):
    """parallel_copy: the durable copy of a memory step is written by both ranks (each the
    objects its host holds, shared out by bytes), committed once by the coordinator."""
    root = str(tmp_path)
    got = run_world(2, _train, root, [1, 2, 3, 4], 2, True, timeout=120, pg_timeout=30)
    for r in got:
        assert r["storage"] == [2, 4] and r["memory"] == [3, 4] and r["warnings"] == []
        assert r["copied"] > 0  # both ranks wrote part of each copy
    # the objects of a step (the packed layout, the default): one data object per writer
    # (each rank writes its half of w, and b is written once): 2 a copy
    assert sum(r["copied"] for r in got) == 2 * 2
    for s in (2, 4):
        d = sp.load(os.path.join(root, "ckpt", f"step_{s:08d}"))
        want = _state(0, 1, s)
        assert torch.equal(d["w"], want["w"].data) and d["step"] == s
        assert torch.equal(d["b"].view(torch.int16), want["b"].view(torch.int16))
        # laid out as a save made there: no memory step's save prefix inside it
        top = sorted(os.listdir(os.path.join(root, "ckpt", f"step_{s:08d}")))
        assert top == ["manifest.msgpack", "packed"], top
        assert len(os.listdir(os.path.join(root, "ckpt", f"step_{s:08d}", "packed"))) == 2
    assert not [p for p in os.listdir(os.path.join(root, "ckpt")) if p.startswith(".")]


def _train_s3(rank: int, world: int, root: str, url: str) -> dict:
    h = HOSTS[rank]
    tier = MemoryTier(
        "job", host_id=h, shm_dir=os.path.join(root, "shm", h), advertise="127.0.0.1", timeout_s=20
    )
    mgr = sp.CheckpointManager(
        url,
        memory=tier,
        save_options=OPTS,
        storage_every=2,
        parallel_copy=True,
        copy_attempts=2,
        copy_backoff_s=0.05,
    )
    for s in (1, 2, 3, 4):
        mgr.save(s, _state(rank, world, s))  # never raises: training goes on
    mgr.close()
    out = {"storage": mgr.all_steps(), "warnings": list(mgr.tier_warnings)}
    torch.distributed.barrier()
    tier.close()
    return out


def test_a_parallel_copy_whose_parts_are_refused_is_aborted_whole(tmp_path, s3_env, monkeypatch):
    """The real S3 server (behind a proxy) refuses every data PUT of step 2's durable copy:
    both ranks' parts fail their tries, the coordinator aborts the copy, nothing of step 2 is
    left in storage, and step 4's copy commits as usual."""
    from shardpoint_testing.s3 import FaultProxy

    def rule(method: str, path: str, n: int):
        # the packed layout's data objects (packed/<writer>-<n>.bin)
        chunk = method == "PUT" and "/step_00000002/" in path and "/packed/" in path
        return 403 if chunk else None

    prefix = s3_env.fresh_prefix("ptiers")
    with FaultProxy(s3_env, rule) as proxy:
        for k, v in proxy.env().items():
            monkeypatch.setenv(k, v)
        url = s3_env.url(prefix + "/ckpt")
        got = run_world(2, _train_s3, str(tmp_path), url, timeout=120, pg_timeout=30)
        assert proxy.injected >= 2
        d = sp.load(url + "/step_00000004")
        assert torch.equal(d["w"], _state(0, 1, 4)["w"].data)
    for r in got:
        assert r["storage"] == [4]
        assert len(r["warnings"]) == 1
        w = r["warnings"][0]
        assert w.startswith("step 2:") and "failed (rank " in w and "was refused" in w
    assert s3_env.objects(prefix + "/ckpt/step_00000002/") == {}  # aborted whole


@pytest.mark.parametrize("parallel", [False, True])
def test_a_failed_durable_copy_is_reported_and_training_goes_on(tmp_path, parallel):
    root = str(tmp_path)
    users = os.path.join(root, "ckpt", "step_00000002")  # not the manager's: in the way
    os.makedirs(users)
    with open(os.path.join(users, "notes.txt"), "w") as f:
        f.write("mine")
    got = run_world(2, _train, root, [1, 2, 3, 4], 2, parallel, timeout=120, pg_timeout=30)
    for r in got:  # every rank was told, none was stopped
        assert len(r["warnings"]) == 1 and "step 2" in r["warnings"][0]
        assert "CheckpointExistsError" in r["warnings"][0]
        assert r["storage"] == [4] and r["memory"] == [3, 4]
    assert open(os.path.join(users, "notes.txt")).read() == "mine"  # never touched


def test_a_damaged_memory_step_gives_way_to_the_next_older_step(tmp_path):
    root = str(tmp_path)
    run_world(2, _train, root, [1, 2, 3], 2, timeout=120, pg_timeout=30)
    # step 3 is in memory only; damage its data objects on both hosts (the copy and the
    # replica; the packed layout, the default: one object per writer)
    chunks = glob.glob(
        os.path.join(root, "shm", "h*", "job", "step_3", "**", "packed", "*.bin"), recursive=True
    )
    assert len(chunks) == 4  # 2 writers x 2 hosts
    for c in chunks:
        with open(c, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))
    got = run_world(2, _resume, root, timeout=120, pg_timeout=30)
    for r in got:
        assert r["same"] and r["step"] == 2 and r["tier"] == "memory"
        assert len(r["skipped"]) == 1 and r["skipped"][0].startswith("step 3 (memory)")


def _bad_options(rank: int, world: int, root: str) -> list:
    tier = MemoryTier(
        "job",
        host_id=HOSTS[rank],
        shm_dir=os.path.join(root, "shm", str(rank)),
        advertise="127.0.0.1",
        timeout_s=20,
    )
    out = []
    for kw in (
        {"memory": tier},
        {"memory": tier, "storage_every": 0},
        {"memory": tier, "storage_every": 2, "async_save": True},
        {"storage_every": 2},
    ):
        with pytest.raises(sp.errors.InvalidOptionError) as e:
            sp.CheckpointManager(os.path.join(root, "ckpt"), **kw)
        out.append(str(e.value))
    tier.close()
    return out


def test_tier_options_are_checked(tmp_path):
    got = run_world(2, _bad_options, str(tmp_path), timeout=60, pg_timeout=30)
    assert "needs storage_every" in got[0][0] and "storage_every must be" in got[0][1]
    assert "async_save" in got[0][2] and "needs memory=" in got[0][3]


def test_which_tier_each_step_goes_to():
    from shardpoint.api.manager_tiers import Tiers

    class FakeTier:  # only the attributes the policy checks for
        save = restore = steps = url = remove = None

    t = Tiers(FakeTier(), memory_every=2, memory_keep=1, storage_every=3)
    assert [t.due(s) for s in (1, 2, 3, 4, 6)] == [
        (False, False),
        (True, False),
        (True, True),
        (True, False),
        (True, True),
    ]


FROZEN = torch.arange(4096, dtype=torch.float32)  # unchanged from step to step


def _train_incremental(rank: int, world: int, root: str) -> dict:
    tier, mgr = _manager(
        rank,
        root,
        storage_every=2,
        memory_keep=2,
        max_to_keep=2,
        parallel_copy=True,
        incremental=True,
    )
    for s in (1, 2, 3, 4):
        mgr.save(s, {**_state(rank, world, s), "frozen": FROZEN})
    mgr.close()
    out = {"memory": mgr.memory_steps(), "storage": mgr.all_steps(), "warnings": mgr.tier_warnings}
    torch.distributed.barrier()
    tier.close()
    return out


def _resume_incremental(rank: int, world: int, root: str) -> dict:
    tier, mgr = _manager(rank, root, storage_every=2, max_to_keep=2, incremental=True)
    tree = mgr.load(like={**_state(rank, world, 0, zeros=True), "frozen": torch.zeros(4096)})
    out = {
        "step": mgr.last_load.step,
        "tier": mgr.last_load.tier,
        "same": _same(rank, world, tree, 4) and torch.equal(tree["frozen"], FROZEN),
    }
    mgr.close()
    torch.distributed.barrier()
    tier.close()
    return out


def test_incremental_memory_steps_and_durable_copies_building_on_storage(tmp_path):
    """incremental=True with memory=: each memory step builds on the one before (the frozen
    tensor is stored once, in step 1, which memory retention keeps while later steps build
    on it); each durable copy (written by both ranks) builds on the storage step before it:
    step 4 names step 2 as its base and holds none of the frozen tensor's bytes itself,
    loads bit for bit and verifies (every referred chunk checked); after a host loss the
    newest memory step comes back from the peers' replicas, its base's chunks included."""
    from shardpoint_core.format.manifest import decode_manifest
    from shardpoint_core.verify import verify_checkpoint

    root = str(tmp_path)
    got = run_world(2, _train_incremental, root, timeout=120, pg_timeout=30)
    for r in got:
        assert r["warnings"] == [] and r["storage"] == [2, 4]
        assert r["memory"] == [1, 3, 4]  # 3 and 4 kept; 1 holds what they build on
    with open(os.path.join(root, "shm", "h0", "job", "step_4", "manifest.msgpack"), "rb") as f:
        m4 = decode_manifest(f.read())
    assert [n for n, _i in m4.packed.bases] == ["step_1"]  # the frozen chunks, not rewritten
    own = {}
    for s in (2, 4):
        path = os.path.join(root, "ckpt", f"step_{s:08d}")
        p = sp.read_metadata(path).packed
        own[s] = sum(n for i, (_p, n) in enumerate(p.objects) if p.base_of(i) is None)
        d = sp.load(path)
        assert torch.equal(d["w"], _state(0, 1, s)["w"].data) and torch.equal(d["frozen"], FROZEN)
        assert verify_checkpoint(path, strict=True).ok
    assert sp.read_metadata(os.path.join(root, "ckpt", "step_00000002")).packed.bases == []
    m = sp.read_metadata(os.path.join(root, "ckpt", "step_00000004"))
    assert [n for n, _i in m.packed.bases] == ["step_00000002"]
    assert own[4] < FROZEN.numel() * 4 <= own[2]  # step 4 holds no frozen byte itself
    _lose_host_memory(root, "h1")
    for r in run_world(2, _resume_incremental, root, timeout=120, pg_timeout=30):
        assert r["same"] and r["step"] == 4 and r["tier"] == "memory"


def _restart_incremental(rank: int, world: int, root: str) -> dict:
    """Steps 1 and 2, then a restarted job (a fresh memory tier: its first memory step is a
    full one) saves step 4; both durable copies written by both ranks."""
    out: dict = {"copied": 0}
    for job, steps in (("job", (1, 2)), ("again", (4,))):
        h = HOSTS[rank]
        tier = MemoryTier(
            job, host_id=h, shm_dir=os.path.join(root, "shm", h), advertise="127.0.0.1"
        )
        mgr = sp.CheckpointManager(
            os.path.join(root, "ckpt"),
            memory=tier,
            save_options=OPTS,
            storage_every=2,
            parallel_copy=True,
            incremental=True,
        )
        for s in steps:
            mgr.save(s, {**_state(rank, world, s), "frozen": FROZEN})
        mgr.close()
        out.update(storage=mgr.all_steps(), warnings=mgr.tier_warnings)
        out["copied"] += mgr._tiers.part_objects
        torch.distributed.barrier()
        tier.close()
    return out


def test_a_restarted_jobs_full_memory_step_is_copied_onto_storage_by_every_rank(tmp_path):
    """parallel_copy with incremental=True: the first memory step of a restarted job is a
    full one, yet its durable copy builds on the storage step before it: the data objects
    holding chunks step 2 has are compacted by the ranks holding them, so step 4 holds no
    frozen byte itself, names step 2, loads bit for bit and verifies."""
    from shardpoint_core.verify import verify_checkpoint

    root = str(tmp_path)
    for r in run_world(2, _restart_incremental, root, timeout=120, pg_timeout=30):
        assert r["warnings"] == [] and r["storage"] == [2, 4] and r["copied"] > 0
    path = os.path.join(root, "ckpt", "step_00000004")
    p = sp.read_metadata(path).packed
    assert [n for n, _i in p.bases] == ["step_00000002"]
    assert sum(n for i, (_p, n) in enumerate(p.objects) if p.base_of(i) is None) < 4096 * 4
    assert any(o.startswith("packed/onto-") for o, _n in p.objects)  # compacted
    d = sp.load(path)
    assert torch.equal(d["w"], _state(0, 1, 4)["w"].data) and torch.equal(d["frozen"], FROZEN)
    assert d["step"] == 4 and verify_checkpoint(path, strict=True).ok


def _train_per_array(rank: int, world: int, root: str, parallel: bool) -> dict:
    tier, mgr = _manager(
        rank, root, storage_every=2, memory_keep=2, parallel_copy=parallel, backend=sp.ZarrBackend()
    )
    for s in (1, 2):
        mgr.save(s, _state(rank, world, s))
    mgr.close()
    memory = sp.read_metadata(tier.url(2)).packed
    tree = mgr.load(like=_state(rank, world, 0, zeros=True))
    out = {
        "memory_packed": memory is not None,
        "storage": mgr.all_steps(),
        "warnings": mgr.tier_warnings,
        "same": _same(rank, world, tree, 2) and mgr.last_load.tier == "memory",
    }
    torch.distributed.barrier()
    tier.close()
    return out


@pytest.mark.parametrize("parallel", [False, True], ids=["coordinator", "parallel"])
def test_backend_sets_the_layout_of_every_step_in_both_tiers(tmp_path, parallel):
    """backend= with memory=: the memory steps are saved with it and the durable copies
    committed through it (by the coordinator, or by every rank with ``parallel_copy``), so a
    manager asking for the per-array layout gets it in both tiers (the memory saves used to
    take the default, packed, whatever the manager's backend)."""
    root = str(tmp_path)
    for r in run_world(2, _train_per_array, root, parallel, timeout=120, pg_timeout=30):
        assert r["warnings"] == [] and r["storage"] == [2] and r["same"]
        assert not r["memory_packed"]
    path = os.path.join(root, "ckpt", "step_00000002")
    assert sp.read_metadata(path).packed is None  # per-array in storage too
    d = sp.load(path)
    assert torch.equal(d["w"], _state(0, 1, 2)["w"].data) and d["step"] == 2


def _roll_back(rank: int, world: int, root: str) -> dict:
    tier, mgr = _manager(
        rank, root, storage_every=2, memory_keep=2, parallel_copy=True, incremental=True
    )
    for s in (1, 2, 3, 4):
        mgr.save(s, {**_state(rank, world, s), "frozen": FROZEN})
    before = mgr.memory_steps()
    mgr.save(1, {**_state(rank, world, 5), "frozen": FROZEN})  # back to step 1, new weights
    mgr.close()
    out = {
        "before": before,
        "memory": mgr.memory_steps(),
        "storage": mgr.all_steps(),
        "warnings": mgr.tier_warnings,
    }
    torch.distributed.barrier()
    tier.close()
    return out


def test_a_rolled_back_run_saves_again_a_step_later_memory_steps_build_on(tmp_path):
    """incremental=True with memory=: memory steps 3 and 4 build on step 1 (the frozen
    tensor); the run goes back to step 1 and saves it again. The later memory steps of the
    run it left are removed from memory first (replacing their base under them is refused,
    [SP-PACK-11]), every rank says so, and their durable copy (step 4) stays, bit for bit."""
    root = str(tmp_path)
    for r in run_world(2, _roll_back, root, timeout=120, pg_timeout=30):
        assert r["before"] == [1, 3, 4] and r["memory"] == [1] and r["storage"] == [2, 4]
        assert len(r["warnings"]) == 1 and "memory steps [4, 3] built on it" in r["warnings"][0]
    step1 = sp.load(os.path.join(root, "shm", "h0", "job", "step_1"))
    assert torch.equal(step1["w"], _state(0, 1, 5)["w"].data) and step1["step"] == 5
    d = sp.load(os.path.join(root, "ckpt", "step_00000004"))
    assert torch.equal(d["w"], _state(0, 1, 4)["w"].data) and torch.equal(d["frozen"], FROZEN)
