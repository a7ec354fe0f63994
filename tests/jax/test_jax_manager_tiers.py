"""The JAX manager's tiers: every step to the memory tier (replicated to a peer host), every N
steps a durable copy written from memory in the background, resume from the newest step
across tiers (from memory, after a host loss from the peer's replica, past a damaged memory
step, from storage once memory is gone), and a durable copy to a store that refuses it:
retried, reported, never visible half-written, never stopping training.

Real JAX processes (jax.distributed, gloo) with simulated hosts (``host_id``, a shared-memory
directory each) and the real side channel on the loopback, as the torch tier tests do; the
failing store is the real moto S3 server behind a proxy that refuses the commit's PUTs.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid

import numpy as np
import pytest

pytest.importorskip("jax", reason="shardpoint_jax needs jax (pip install -e '.[jax]')")

import jax.numpy as jnp  # noqa: E402

import shardpoint_jax as spj  # noqa: E402
from shardpoint_jax.launch import run_processes  # noqa: E402
from shardpoint_testing.tensors import same_bits  # noqa: E402

_JOB = """
import json, os
import numpy as np, ml_dtypes, shardpoint_jax as spj
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from shardpoint_jax.memory_tier import all_true
pid = jax.process_index()
mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("dp", "tp"))
def full(step):
    return (np.arange(64, dtype=np.float32).reshape(8, 8) + 1) * step
def bias(step):
    return (np.arange(8, dtype=np.float32) * step).astype(ml_dtypes.bfloat16)
def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(*spec)), lambda i: a[i])
tier = spj.MemoryTier("job", k=1, host_id=f"h{pid}", shm_dir=os.path.join(ROOT, "shm", f"h{pid}"),
                      advertise="127.0.0.1", timeout_s=20)
mgr = spj.CheckpointManager(os.path.join(ROOT, "ckpt"), memory=tier, storage_every=2,
                            memory_keep=2, max_to_keep=2, parallel_copy=MODE == "train")
res = {}
if MODE == "train":
    for s in range(1, 6):
        mgr.save(s, {"w": put(full(s), ("dp", "tp")), "b": put(bias(s), ()), "step": s},
                 metrics={"loss": 1.0 / s})
    mgr.close()  # the last durable copy lands (or is reported)
    res.update(memory=mgr.memory_steps(), storage=mgr.all_steps(),
               warnings=mgr.tier_warnings, latest=mgr.latest_step(),
               copied=mgr._tiers.part_objects)
else:  # resume, into another sharding
    tgt = {"w": jax.ShapeDtypeStruct((8, 8), np.float32,
                                     sharding=NamedSharding(mesh, P("tp", None))),
           "b": jax.ShapeDtypeStruct((8,), ml_dtypes.bfloat16,
                                     sharding=NamedSharding(mesh, P("dp"))),
           "step": 0}
    got = mgr.load(target=tgt)
    info = mgr.last_load
    s = info.step
    ok = all(np.asarray(x.data).tobytes() == full(s)[x.index].tobytes()
             for x in got["w"].addressable_shards)
    ok &= all(np.asarray(x.data).tobytes() == bias(s)[x.index].tobytes()
              for x in got["b"].addressable_shards)
    res.update(step=s, tier=info.tier, skipped=info.skipped, url=info.url,
               same=bool(ok and got["step"] == s))
    mgr.close()
all_true("test-done", True)  # every process listed and loaded before any stops serving
tier.close()
print(json.dumps(res))
"""


def _job(root: str, mode: str) -> list:
    code = _JOB.replace("ROOT", repr(root)).replace("MODE", repr(mode))
    outs = run_processes(code, 2, 2, timeout=180, env={"SHARDPOINT_JAX_TIMEOUT_S": "90"})
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def test_two_processes_memory_every_step_storage_every_two_then_resume_across_tiers(tmp_path):
    """Durable copies written by both processes (``parallel_copy``), one commit each."""
    root = str(tmp_path)
    for r in _job(root, "train"):
        assert r["memory"] == [4, 5]  # memory_keep=2
        assert r["storage"] == [2, 4]  # every 2nd step, copied from memory; max_to_keep=2
        assert r["warnings"] == [] and r["latest"] == 5
        assert r["copied"] > 0  # parallel_copy: each process wrote part of each copy
    # the durable copies are whole checkpoints of their own, bitwise the state saved
    d4 = spj.load(os.path.join(root, "ckpt", "step_00000004"))
    want = (np.arange(64, dtype=np.float32).reshape(8, 8) + 1) * 4
    assert same_bits(np.asarray(d4["w"]), want) and d4["__metrics__"]["loss"] == 0.25
    # host h1 is lost (its shared memory gone): step 5 from h0's replica
    shutil.rmtree(os.path.join(root, "shm", "h1"))
    for r in _job(root, "resume"):
        assert r["same"] and r["step"] == 5 and r["tier"] == "memory" and r["skipped"] == []
    # step 5 damaged on every host (its copy, its replica): the next older step, from memory
    # (the packed layout, the default: its data objects, one per writing process)
    pattern = os.path.join(root, "shm", "h*", "job", "step_5", "**", "packed", "*.bin")
    chunks = glob.glob(pattern, recursive=True)
    assert len(chunks) == 4  # 2 processes' objects x 2 hosts
    for c in chunks:
        with open(c, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))
    for r in _job(root, "resume"):
        assert r["same"] and r["step"] == 4 and r["tier"] == "memory"
        assert len(r["skipped"]) == 1 and r["skipped"][0].startswith("step 5 (memory)")


def _tier(tmp_path, **kw):
    return spj.MemoryTier(
        f"j{uuid.uuid4().hex[:8]}", k=0, shm_dir=str(tmp_path / "shm"), advertise="127.0.0.1", **kw
    )


def _state(s: int) -> dict:
    return {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * s, "step": s}


def test_one_process_memory_gone_resumes_from_storage_and_options_are_checked(tmp_path):
    tier = _tier(tmp_path)
    root = str(tmp_path / "ckpt")
    try:
        for kw, says in (
            ({"memory": tier}, "needs storage_every"),
            ({"memory": tier, "storage_every": 0}, "storage_every must be"),
            ({"memory": tier, "storage_every": 2, "async_save": True}, "async_save"),
            ({"storage_every": 2}, "needs memory="),
            ({"memory": tier, "storage_every": 2, "copy_attempts": 0}, "copy_attempts"),
            ({"memory": object(), "storage_every": 2}, "shardpoint_jax.MemoryTier"),
        ):
            with pytest.raises(spj.InvalidOptionError, match=says):
                spj.CheckpointManager(root, **kw)
        mgr = spj.CheckpointManager(root, memory=tier, storage_every=3, memory_keep=1)
        for s in range(1, 5):
            mgr.save(s, _state(s))
        mgr.close()
        assert (mgr.memory_steps(), mgr.all_steps(), mgr.latest_step()) == ([4], [3], 4)
        got = mgr.load()
        assert mgr.last_load.tier == "memory" and same_bits(got["w"], _state(4)["w"])
        shutil.rmtree(tmp_path / "shm")  # the host's memory is gone (a reboot)
        got = mgr.load()
        assert (mgr.last_load.step, mgr.last_load.tier) == (3, "storage")
        assert same_bits(got["w"], _state(3)["w"]) and got["step"] == 3
        with pytest.raises(spj.CheckpointNotFoundError):
            mgr.load(step=4)
    finally:
        tier.close()


def _own_bytes(path: str) -> int:
    """The bytes of the data objects a packed checkpoint holds itself (not its bases')."""
    from shardpoint_core.transactions.resolve import read_metadata

    p = read_metadata(path).packed
    return sum(s for i, (_p, s) in enumerate(p.objects) if p.base_of(i) is None)


def test_incremental_durable_copies_build_on_the_storage_step_before(tmp_path):
    """incremental=True with memory=: each memory step builds on the one before (the frozen
    array stored once, in step 1, kept by memory retention while step 4 builds on it), and
    each durable copy on the storage step before it: step 4 names step 2 as its base and
    holds none of the frozen array's bytes itself; it loads bit for bit and verifies (every
    referred chunk read and checked). Retention (max_to_keep=1) keeps step 2 while a kept
    step builds on it. A restarted job (a fresh memory tier: its first memory step is a
    full one) builds its first durable copy on the storage step before it all the same."""
    from shardpoint_core.transactions.resolve import read_metadata
    from shardpoint_core.verify import verify_checkpoint

    root = str(tmp_path / "ckpt")
    frozen = jnp.arange(2048, dtype=jnp.float32)  # 8 KiB, one chunk
    tier = _tier(tmp_path)
    try:
        mgr = spj.CheckpointManager(
            root, memory=tier, storage_every=2, memory_keep=1, max_to_keep=1, incremental=True
        )
        for s in range(1, 5):
            mgr.save(s, {**_state(s), "frozen": frozen})
        mgr.wait()
        assert (mgr.memory_steps(), mgr.all_steps()) == ([1, 4], [2, 4])
        assert [n for n, _i in read_metadata(tier.url(4)).packed.bases] == ["step_1"]
        assert [n for n, _i in read_metadata(mgr.path(4)).packed.bases] == ["step_00000002"]
        assert _own_bytes(mgr.path(4)) < frozen.nbytes <= _own_bytes(mgr.path(2))
        report = verify_checkpoint(mgr.path(4), strict=True)
        assert report.ok and report.shared == {"step_00000002": 1}
        for s in (5, 6):
            mgr.save(s, {**_state(s), "frozen": frozen})
        mgr.close()
        assert mgr.all_steps() == [2, 6]  # 6 kept, and 2, which it builds on; not 4
        assert [n for n, _i in read_metadata(mgr.path(6)).packed.bases] == ["step_00000002"]
        got = mgr.load()
        assert (mgr.last_load.step, mgr.last_load.tier) == (6, "memory")
        assert same_bits(got["frozen"], frozen) and same_bits(got["w"], _state(6)["w"])
    finally:
        tier.close()
    tier = _tier(tmp_path)  # the job restarted: memory holds nothing of it
    try:
        mgr = spj.CheckpointManager(
            root, memory=tier, storage_every=2, memory_keep=1, max_to_keep=1, incremental=True
        )
        mgr.save(8, {**_state(8), "frozen": frozen})
        mgr.close()
        assert read_metadata(tier.url(8)).packed.bases == []  # a full memory step
        assert mgr.all_steps() == [2, 8]
        assert [n for n, _i in read_metadata(mgr.path(8)).packed.bases] == ["step_00000002"]
        assert _own_bytes(mgr.path(8)) < frozen.nbytes
        for s in (2, 8):
            got = spj.load(mgr.path(s))
            assert same_bits(got["w"], _state(s)["w"]) and same_bits(got["frozen"], frozen)
            assert got["step"] == s
        assert verify_checkpoint(mgr.path(8), strict=True).ok
    finally:
        tier.close()


def test_a_refused_durable_copy_is_retried_reported_and_never_half_visible(
    tmp_path, s3_env, monkeypatch
):
    """The S3 server refuses every commit (the manifest's PUT, 403) of the durable copies:
    the data objects are written, the commit is not. Step 2's copy fails its 3 tries and is
    reported; training goes on; nothing of step 2 shows in storage. Then the store takes
    writes again during step 4's copy: its second try commits, and that is reported too."""
    from shardpoint_testing.s3 import FaultProxy

    refusing = {"on": True}

    def rule(method: str, path: str, n: int):
        commit = method == "PUT" and path.split("?")[0].endswith("/manifest.msgpack")
        return 403 if refusing["on"] and commit else None

    tries: list = []

    def failed(step: int, attempt: int, err: str) -> None:
        tries.append((step, attempt, err.split(":")[0]))
        if step == 4:
            refusing["on"] = False  # the store is back before the second try

    with FaultProxy(s3_env, rule) as proxy:
        for k, v in proxy.env().items():
            monkeypatch.setenv(k, v)
        root = s3_env.url(s3_env.fresh_prefix("tiers") + "/ckpt")
        tier = _tier(tmp_path)
        try:
            mgr = spj.CheckpointManager(
                root, memory=tier, storage_every=2, copy_attempts=3, copy_backoff_s=0.05
            )
            mgr._tiers.on_failure = failed
            for s in range(1, 5):
                mgr.save(s, _state(s))  # never raises: training goes on
            # step 2's copy settled at step 4's save: three refused tries, then reported
            assert [t[:2] for t in tries[:3]] == [(2, 1), (2, 2), (2, 3)]
            assert len(mgr.tier_warnings) == 1
            w = mgr.tier_warnings[0]
            assert w.startswith("step 2:") and "after 3 tries" in w
            assert "SaveFailedError" in w and "refused" in w
            # never half visible: no step 2 in storage, no manifest under its prefix
            assert 2 not in mgr.all_steps()
            with pytest.raises(spj.CheckpointNotFoundError):
                spj.load(mgr.path(2))
            key = mgr.path(2).split("/", 3)[3]
            assert not [k for k in s3_env.objects(key) if k.endswith("manifest.msgpack")]
            mgr.close()
            assert tries[3][:2] == (4, 1) and len(tries) == 4
            assert len(mgr.tier_warnings) == 2 and "committed on try 2" in mgr.tier_warnings[1]
            assert mgr.all_steps() == [4]
            got = spj.load(mgr.path(4))
            assert same_bits(got["w"], _state(4)["w"]) and got["step"] == 4
        finally:
            tier.close()


def test_a_durable_copy_is_retried_only_where_the_failure_may_pass(tmp_path):
    """Through the core's policy (shared by both managers), copying a real memory step: a
    target taken by something else (CheckpointExistsError) is one try; a target that cannot
    be written (its parent is a file) is every try; neither leaves anything visible."""
    from shardpoint_core.transactions.tiers import Tiers

    tier = _tier(tmp_path)
    try:
        tier.save(_state(1), 1)
        t = Tiers(tier, 1, 1, 1, copy_attempts=3, copy_backoff_s=0)
        taken = tmp_path / "taken"
        (taken / "notes").mkdir(parents=True)
        t.start_copy(1, str(taken), None, False)
        (out,) = t.settle(block=True)
        assert out.error.startswith("CheckpointExistsError") and len(out.failures) == 1
        assert os.listdir(taken) == ["notes"]
        blocker = tmp_path / "file"
        blocker.write_bytes(b"not a directory")
        t.start_copy(1, str(blocker / "step_1"), None, False)
        (out,) = t.settle(block=True)
        assert out.error.startswith("SaveFailedError") and out.attempts == len(out.failures) == 3
        assert "after 3 tries" in (out.report(tier.url(1)) or "")
        assert blocker.read_bytes() == b"not a directory"
        t.start_copy(1, str(tmp_path / "ok"), None, False)
        (out,) = t.settle(block=True)
        assert (out.error, out.attempts, out.report(tier.url(1))) == ("", 1, None)
        assert same_bits(spj.load(str(tmp_path / "ok"))["w"], _state(1)["w"])
    finally:
        tier.close()


def test_backend_sets_the_layout_of_every_step_in_both_tiers(tmp_path):
    """backend= with memory=: the memory steps are saved with it and the durable copies
    committed through it, so a manager asking for the per-array layout gets it in both tiers
    (as the torch manager does); incremental=True still needs the packed layout."""
    from shardpoint_core.transactions.backend import ZarrBackend
    from shardpoint_core.transactions.resolve import read_metadata

    tier = _tier(tmp_path)
    root = str(tmp_path / "ckpt")
    try:
        with pytest.raises(spj.InvalidRequestError, match="packed"):
            spj.CheckpointManager(
                root, memory=tier, storage_every=2, incremental=True, backend=ZarrBackend()
            )
        mgr = spj.CheckpointManager(root, memory=tier, storage_every=2, backend=ZarrBackend())
        for s in (1, 2):
            mgr.save(s, _state(s))
        mgr.close()
        assert (mgr.memory_steps(), mgr.all_steps()) == ([1, 2], [2])
        for url in (tier.url(2), mgr.path(2)):
            assert read_metadata(url).packed is None, url  # per-array, in both tiers
        got = spj.load(mgr.path(2))
        assert same_bits(got["w"], _state(2)["w"]) and got["step"] == 2
        got = mgr.load()
        assert mgr.last_load.tier == "memory" and same_bits(got["w"], _state(2)["w"])
    finally:
        tier.close()


def test_a_rolled_back_run_saves_again_a_step_later_memory_steps_build_on(tmp_path):
    """incremental=True with memory=: memory steps 3 and 4 build on step 1 (the frozen array);
    the run goes back to step 1 (a rollback after a loss spike) and saves it again. The later
    memory steps of the run it left are removed from memory first (replacing their base under
    them is refused, [SP-PACK-11]), and the manager says so; their durable copy (step 4) is
    kept, bit for bit."""
    tier = _tier(tmp_path)
    root = str(tmp_path / "ckpt")
    frozen = jnp.arange(2048, dtype=jnp.float32)
    try:
        mgr = spj.CheckpointManager(
            root, memory=tier, storage_every=2, memory_keep=2, incremental=True
        )
        for s in range(1, 5):
            mgr.save(s, {**_state(s), "frozen": frozen})
        assert mgr.memory_steps() == [1, 3, 4]
        again = {**_state(1), "w": _state(1)["w"] + 0.5, "frozen": frozen}
        mgr.save(1, again)
        mgr.close()
        assert (mgr.memory_steps(), mgr.all_steps()) == ([1], [2, 4])
        assert any("memory steps [4, 3] built on it" in w for w in mgr.tier_warnings)
        got = spj.load(tier.url(1))
        assert same_bits(got["w"], again["w"]) and same_bits(got["frozen"], frozen)
        got = spj.load(mgr.path(4))
        assert same_bits(got["w"], _state(4)["w"]) and same_bits(got["frozen"], frozen)
    finally:
        tier.close()
