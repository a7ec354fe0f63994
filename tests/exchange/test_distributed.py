"""Real gloo process groups: save on N ranks, load on M ranks in other layouts, bitwise.

Spawning a world costs seconds, so each spawned world runs a whole batch of scenarios.
"""

import math
import os

import pytest
import torch

from shardpoint_conformance import faults
from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import same_bits, seeded_randn

SHAPE = (10, 7)


def full(name, dtype=torch.float32):
    return seeded_randn(name, SHAPE, dtype)


def split(n, parts, i):
    return i * n // parts, (i + 1) * n // parts


def ceil_split(n, parts, i):
    c = -(-n // parts)
    return min(n, i * c), min(n, (i + 1) * c)  # empty trailing pieces sit at offset n


def save_layouts(rank, world):
    import shardpoint as sp

    st = {}
    a, b = split(SHAPE[0], world, rank)
    st["rows"] = sp.ShardedTensor(full("rows")[a:b].clone(), SHAPE, (a, 0))
    a, b = ceil_split(SHAPE[1], world, rank)
    st["cols_ceil"] = sp.ShardedTensor(full("cols_ceil")[:, a:b].clone(), SHAPE, (0, a))
    a, b = split(70, world, rank)
    st["flat"] = sp.ShardedTensor(
        full("flat").reshape(-1)[a:b].clone(),
        SHAPE,
        (0, 0),
        local_shape=SHAPE,
        flattened_range=(a, b),
    )
    st["rep"] = full("rep", torch.bfloat16)  # plain tensor: replicas
    if world % 2 == 0:  # 2-D grid (world/2 x 2) with each cell on one rank
        r, c = rank // 2, rank % 2
        ra, rb = split(SHAPE[0], world // 2, r)
        ca, cb = split(SHAPE[1], 2, c)
        st["grid"] = sp.ShardedTensor(full("grid")[ra:rb, ca:cb].clone(), SHAPE, (ra, ca))
    else:
        st["grid"] = sp.ShardedTensor(full("grid").clone(), SHAPE, (0, 0), replica_id=rank)
    st["obj"] = sp.ShardedObject({"rank": rank}, rank, world)
    st["step"] = 42
    st.update(pieces_layouts(rank, world, saving=True))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        st["dt"] = DTensor.from_local(
            full("dt")[slice(*ceil_split(SHAPE[0], world, rank))].clone(),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(SHAPE),
            stride=(SHAPE[1], 1),
        )
    else:
        st["dt"] = full("dt")
    return st


STACK, EXPERTS, STRIDED = (6, 5, 4), (8, 3, 4), (12, 6)


def stacked(key, shape):
    return seeded_randn(key, shape, torch.bfloat16)


def pieces_layouts(rank, world, saving):
    """Several pieces of one tensor on one rank (``sp.ShardedPieces``), saved in one
    arrangement and loaded in another: a pipeline stage's layers of a layer-stacked weight
    (contiguous layers saved, round-robin layers loaded), MoE experts (round-robin saved,
    contiguous blocks loaded), FSDP2 x TP strided row bands (loaded as one column piece),
    and several flattened ranges of one block (loaded as row blocks)."""
    import shardpoint as sp

    def st(key, shape, idx, offset, **kw):
        full_t = stacked(key, shape)
        data = (
            full_t[idx].clone()
            if "flattened_range" not in kw
            else full_t.reshape(-1)[slice(*kw["flattened_range"])].clone()
        )
        if not saving:
            data = torch.full_like(data, -3)
        return sp.ShardedTensor(data, shape, offset, **kw)

    def pieces(items):
        return sp.ShardedPieces(items) if items else None

    out = {}
    if saving:
        a, b = split(STACK[0], world, rank)
        layers = range(a, b)
        ex = range(rank, EXPERTS[0], world)
    else:
        layers = range(rank, STACK[0], world)
        ea, eb = split(EXPERTS[0], world, rank)
        ex = [(ea, eb)] if eb > ea else []
    out["stack"] = pieces([st("stack", STACK, slice(g, g + 1), (g, 0, 0)) for g in layers])
    if saving:
        out["experts"] = pieces([st("experts", EXPERTS, slice(e, e + 1), (e, 0, 0)) for e in ex])
    else:
        out["experts"] = pieces(
            [st("experts", EXPERTS, slice(a, b), (a, 0, 0)) for a, b in ex]
            + [st("experts", EXPERTS, slice(0, 0), (EXPERTS[0], 0, 0))]
        )
    if saving:  # bands i and i + world of 2 * world row bands (a TP block split by FSDP)
        bands = [split(STRIDED[0], 2 * world, i) for i in (rank, rank + world)]
        out["strided"] = pieces([st("strided", STRIDED, slice(a, b), (a, 0)) for a, b in bands])
        k = 3 * world
        rs = [split(70, k, i) for i in range(rank, k, world)]
        out["flatpieces"] = pieces(
            [
                st("flatpieces", SHAPE, None, (0, 0), local_shape=SHAPE, flattened_range=r)
                for r in rs
            ]
        )
    else:
        a, b = split(STRIDED[1], world, rank)
        out["strided"] = pieces([st("strided", STRIDED, (slice(None), slice(a, b)), (0, a))])
        rows = [split(SHAPE[0], 2 * world, i) for i in (2 * rank + 1, 2 * rank)]
        out["flatpieces"] = pieces([st("flatpieces", SHAPE, slice(a, b), (a, 0)) for a, b in rows])
    return {k: v for k, v in out.items() if v is not None}


def check_pieces(out, like, world, tag):
    """Each loaded piece holds its part of the global tensor, filled in place."""
    bad = []
    for key, leaf in like.items():
        if not isinstance(leaf, __import__("shardpoint").ShardedPieces):
            continue
        shape = {"stack": STACK, "experts": EXPERTS, "strided": STRIDED}.get(key, SHAPE)
        full_t = stacked(key, shape)
        if len(out[key]) != len(leaf) or any(t is not p.data for t, p in zip(out[key], leaf)):
            bad.append(f"{tag}: {key}: not the caller's tensors")
        for p in leaf:
            want = full_t[tuple(slice(o, o + n) for o, n in zip(p.global_offset, p.local_shape))]
            if not same_bits(p.data, want):
                bad.append(f"{tag}: {key} piece at {p.global_offset}")
    return bad


def save_job(rank, world, base, per_array=False):
    import shardpoint as sp

    be = sp.ZarrBackend() if per_array else None  # None: the default, packed
    r = sp.save(save_layouts(rank, world), f"{base}/w{world}", backend=be)
    return r.exchange_bytes, r.unique_bytes, r.files, r.rank_chunk_files


def stored_chunk_bytes(path):
    """The bytes of every stored chunk of the checkpoint at ``path``: its chunk files
    (per-array), or the lengths its packed index records (padding between them not
    counted)."""
    import shardpoint as sp

    m = sp.read_metadata(path)
    if m.packed is not None:
        return int(m.packed.records["length"].sum())
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(os.path.join(path, "tensors"))
        for f in fs
        if f != "zarr.json"
    )


def load_job(rank, world, base, save_worlds):
    """Load every saved checkpoint in layouts unlike the saving ones; report mismatches."""
    import shardpoint as sp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    bad = []
    for sw in save_worlds:
        path = f"{base}/w{sw}"
        a, b = split(SHAPE[1], world, rank)
        fa, fb = split(70, world, world - 1 - rank)
        like = {
            "rows": sp.ShardedTensor(torch.empty(SHAPE[0], b - a), SHAPE, (0, a)),
            "cols_ceil": torch.empty(SHAPE),
            "flat": sp.ShardedTensor(
                torch.empty(fb - fa), SHAPE, (0, 0), local_shape=SHAPE, flattened_range=(fa, fb)
            ),
            "rep": sp.ShardedTensor(
                torch.empty(1, SHAPE[1], dtype=torch.bfloat16), SHAPE, (rank % SHAPE[0], 0)
            ),
            "grid": torch.empty(SHAPE),
            "obj": sp.ShardedObject(None, rank % sw, sw),
            "step": 0,
        }
        like.update(pieces_layouts(rank, world, saving=False))
        ca, cb = ceil_split(SHAPE[1], world, rank)  # DTensor shards like torch.chunk
        if world == 3:  # a replicated DTensor: every rank gets all of it
            ca, cb = 0, SHAPE[1]
        if mesh is not None:
            like["dt"] = DTensor.from_local(
                torch.empty(SHAPE[0], cb - ca),
                mesh,
                [Replicate() if world == 3 else Shard(1)],
                run_check=False,
                shape=torch.Size(SHAPE),
                stride=(SHAPE[1], 1),
            )
        out = sp.load(path, like=like)
        checks = {
            "rows": (out["rows"], full("rows")[:, a:b]),
            "cols_ceil": (out["cols_ceil"], full("cols_ceil")),
            "flat": (out["flat"], full("flat").reshape(-1)[fa:fb]),
            "rep": (out["rep"], full("rep", torch.bfloat16)[rank % SHAPE[0] :][:1]),
            "grid": (out["grid"], full("grid")),
        }
        if mesh is not None:
            checks["dt"] = (out["dt"].to_local(), full("dt")[:, ca:cb])
        for k, (got, want) in checks.items():
            if not same_bits(got, want):
                bad.append(f"save {sw} -> load {world}: {k}")
        if out["obj"] != {"rank": rank % sw} or out["step"] != 42:
            bad.append(f"save {sw} -> load {world}: objects")
        bad += check_pieces(out, like, world, f"save {sw} -> load {world}")
    return bad


PER_ARRAY_WORLDS = (2, 3)  # saved per-array; 1 and 4 in the default, packed, layout


def test_save_on_n_load_on_m(tmp_path):
    """Saved by 1 to 4 ranks, in both layouts (each load below reads both), loaded by 1 to 4
    ranks in other layouts."""
    import shardpoint as sp

    base = str(tmp_path)
    for n in (1, 2, 3, 4):
        res = run_world(n, save_job, base, n in PER_ARRAY_WORLDS, timeout=240)
        exchanged, unique, files, _ = res[0]
        names = [
            os.path.relpath(os.path.join(d, f), f"{base}/w{n}")
            for d, _, fs in os.walk(f"{base}/w{n}")
            for f in fs
        ]
        if n in PER_ARRAY_WORLDS:
            names = [os.path.basename(f) for f in names]
            chunk_files = len(names) - names.count("zarr.json") - names.count("manifest.msgpack")
            # the save reports the files there; each chunk file has one writing rank
            assert files == len(names) and sum(r[3] for r in res) == chunk_files, (n, files, res)
        else:
            m = sp.read_metadata(f"{base}/w{n}")
            objects = [o for o, _size in m.packed.objects]
            # the manifest and one data object per rank that wrote chunks, nothing else;
            # each chunk has one writing rank
            assert sorted(names) == sorted(["manifest.msgpack"] + objects), (n, names)
            assert len(objects) == sum(1 for r in res if r[3]), (n, objects, res)
            assert sum(r[3] for r in res) == len(m.packed.records), (n, res)
        sizes = stored_chunk_bytes(f"{base}/w{n}")
        # every byte once (replicas written once); chunk/shard indexes add a few percent
        assert unique <= sizes <= unique * 1.10 + 4096, (n, sizes, unique)
    for m in (1, 2, 3, 4):
        bad = run_world(m, load_job, base, [1, 2, 3, 4], timeout=300)
        assert not any(bad), bad


# ---------------------------------------------------------------------------- Megatron-style
def megatron_job(rank, world, base):
    """TP=2 x PP=2 x DP=2: layers per stage, TP-split weights replicated over DP, and the
    distributed optimizer's flattened fp32 shards split over DP. Save, reload in place."""
    import shardpoint as sp

    tp, dp = 2, 2  # and PP = 2: stage p holds layers 2p and 2p+1
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    names = [f"layers.{2 * p + i}.{w}" for i in range(2) for w in ("qkv", "proj")]

    def block(name):
        dim = 0 if name.endswith("qkv") else 1
        n = SHAPE[dim]
        a, b = split(n, tp, t)
        off = (a, 0) if dim == 0 else (0, a)
        shp = (b - a, SHAPE[1]) if dim == 0 else (SHAPE[0], b - a)
        return off, shp

    def state():
        model, optim = {}, {}
        sizes = [math.prod(block(n)[1]) for n in names]
        total = sum(sizes)
        lo, hi = split(total, dp, d)
        pos = 0
        for n, size in zip(names, sizes):
            off, shp = block(n)
            w = full(n)[off[0] : off[0] + shp[0], off[1] : off[1] + shp[1]]
            model[n] = sp.ShardedTensor(w.clone(), SHAPE, off, replica_id=d)
            a, b = max(lo, pos), min(hi, pos + size)
            if a < b:
                optim[n] = sp.ShardedTensor(
                    full("opt" + n)
                    .reshape(-1)[:0]
                    .new_tensor(
                        full("opt" + n)[off[0] : off[0] + shp[0], off[1] : off[1] + shp[1]].reshape(
                            -1
                        )[a - pos : b - pos]
                    ),
                    SHAPE,
                    off,
                    local_shape=shp,
                    flattened_range=(a - pos, b - pos),
                )
            pos += size
        return {"model": model, "optim": optim, "iteration": 7}

    sp.save(state(), f"{base}/megatron")
    # load back into zeroed copies of the same layout
    like = state()
    for group in ("model", "optim"):
        for v in like[group].values():
            v.data.zero_()
    out = sp.load(f"{base}/megatron", like=like)
    ref = state()
    bad = [
        f"{g}/{k}"
        for g in ("model", "optim")
        for k in ref[g]
        if not torch.equal(out[g][k], ref[g][k].data)
    ]
    # and a single-process-style full read of everything on every rank
    allw = sp.load(f"{base}/megatron")
    bad += [k for k in allw["model"] if not torch.equal(allw["model"][k], full(k))]
    bad += [k for k in allw["optim"] if not torch.equal(allw["optim"][k], full("opt" + k))]
    return bad


def test_megatron_tp2_pp2_dp2_distributed_optimizer(tmp_path):
    bad = run_world(8, megatron_job, str(tmp_path), timeout=300)
    assert not any(bad), bad


# ---------------------------------------------------------------------------- failures
def failure_job(rank, world, base):
    import shardpoint as sp
    import torch.distributed as dist

    out = {}
    a, b = split(SHAPE[0], world, rank)
    good = {"w": sp.ShardedTensor(full("w")[a:b].clone(), SHAPE, (a, 0))}
    invalid = {
        "overlap": {
            "w": sp.ShardedTensor(full("w")[:6].clone(), SHAPE, (0, 0))
            if rank == 0
            else sp.ShardedTensor(full("w")[4:].clone(), SHAPE, (4, 0), replica_id=rank)
        },
        "gap": {"w": sp.ShardedTensor(full("w")[:3].clone(), SHAPE, (0, 0))}
        if rank == 0
        else {"w": sp.ShardedTensor(full("w")[5:].clone(), SHAPE, (5, 0), replica_id=rank)},
        "dup_replica": {"w": sp.ShardedTensor(full("w").clone(), SHAPE, (0, 0), replica_id=0)},
        "shape": {"w": torch.zeros(3 + (rank == 1))},
        "dtype": {"w": torch.zeros(3, dtype=torch.float64 if rank == 1 else torch.float32)},
    }
    for name, st in invalid.items():
        try:
            sp.save(st, f"{base}/{name}")
            out[name] = "saved"
        except sp.InvalidShardingError as e:
            out[name] = f"InvalidShardingError {e.spec_id}"
        dist.barrier()
        out[name + "_exists"] = os.path.exists(f"{base}/{name}") or any(
            n.startswith(f".{name}.") for n in os.listdir(base)
        )
    # a write failure on rank 1: every rank raises, the previous checkpoint survives
    sp.save(good, f"{base}/prev")
    try:
        sp.save(
            {"w": sp.ShardedTensor(torch.zeros(b - a, SHAPE[1]), SHAPE, (a, 0))},
            f"{base}/prev",
            overwrite=True,
            backend=faults.FailingWrites(1),
        )
        out["write_fail"] = "saved"
    except sp.ShardpointError as e:
        out["write_fail"] = type(e).__name__ + ": " + str(e)
    dist.barrier()
    out["prev_intact"] = torch.equal(sp.load(f"{base}/prev")["w"], full("w"))
    out["staging_left"] = [n for n in os.listdir(base) if "shardpoint-" in n]
    # sub-groups: two "DP groups" save different keys to different dirs at the same time
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    gi = rank // 2
    gr = rank % 2
    ga, gb = split(SHAPE[0], 2, gr)
    sp.save(
        {f"g{gi}": sp.ShardedTensor(full(f"g{gi}")[ga:gb].clone(), SHAPE, (ga, 0))},
        f"{base}/sub{gi}",
        group=groups[gi],
    )
    dist.barrier()
    back = sp.load(f"{base}/sub{gi}", like={f"g{gi}": torch.empty(SHAPE)}, group=groups[gi])
    out["subgroup"] = torch.equal(back[f"g{gi}"], full(f"g{gi}"))
    return out


def test_invalid_layouts_failures_and_subgroups(tmp_path):
    res = run_world(4, failure_job, str(tmp_path), timeout=300)
    for r, out in enumerate(res):
        for name in ("overlap", "gap", "dup_replica", "shape", "dtype"):
            assert out[name].startswith("InvalidShardingError"), (r, name, out[name])
            assert out[name + "_exists"] is False, (r, name)
        assert out["overlap"].endswith("SP-COVER-3") and out["gap"].endswith("SP-COVER-2")
        assert out["dup_replica"].endswith("SP-REPL-2") and out["shape"].endswith("SP-COVER-4")
        assert "rank 1" in out["write_fail"] and "No space left" in out["write_fail"], out
        assert out["prev_intact"] and out["staging_left"] == [] and out["subgroup"]


def partial_job(rank, world, path):
    import shardpoint as sp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    try:
        sp.save({"p": dt}, path)
    except sp.UnsupportedValueError as e:
        return str(e)
    return "saved"


def test_dtensor_partial_is_refused_on_every_rank(tmp_path):
    res = run_world(2, partial_job, str(tmp_path / "p"), timeout=120)
    assert all("Partial" in r and "redistribute" in r for r in res), res


def cache_job(rank, world, base):
    """Three saves with the same structure and new values, then one with a new structure."""
    import shardpoint as sp

    flags = []
    for step in range(4):
        rows = SHAPE[0] if step < 3 else SHAPE[0] + 2  # structure changes at step 3
        g = torch.arange(rows * SHAPE[1], dtype=torch.float32).reshape(rows, SHAPE[1]) + step
        a, b = split(rows, world, rank)
        st = {
            "w": sp.ShardedTensor(g[a:b].clone(), g.shape, (a, 0)),
            "step": step,
            "rng": sp.ShardedObject([rank, step], rank, world),
        }
        flags.append(sp.save(st, f"{base}/s{step}").timings["plan_cached"])
        back = sp.load(f"{base}/s{step}")
        assert back["step"] == step and torch.equal(back["w"], g)
        assert back["rng"] == [[i, step] for i in range(world)]
    return flags


def test_plan_cache_reuses_plans_and_sees_new_values(tmp_path):
    res = run_world(2, cache_job, str(tmp_path), timeout=180)
    assert res == [[False, True, True, False]] * 2


# ---------------------------------------------------------------------------- 2-D DTensor mesh
def mesh2d_job(rank, world, base):
    """A 2 x 2 DeviceMesh: Shard(0) x Shard(1), Replicate x Shard(0) and Shard(1) x Replicate
    saved, then loaded back into other placements on the same mesh, into DTensor
    Parameters (filled in place), and into a flat 1-D mesh layout."""
    import shardpoint as sp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    shape = (10, 7)
    placements = {
        "ss": [Shard(0), Shard(1)],
        "rs": [Replicate(), Shard(0)],
        "sr": [Shard(1), Replicate()],
    }
    st = {k: distribute_tensor(full(k), mesh, p) for k, p in placements.items()}
    r = sp.save(st, f"{base}/mesh")
    bad = []
    other = {
        "ss": [Shard(1), Shard(0)],
        "rs": [Shard(0), Replicate()],
        "sr": [Replicate(), Replicate()],
    }
    like = {
        k: torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, p))
        for k, p in other.items()
    }
    ptrs = {k: v.to_local().data_ptr() for k, v in like.items()}
    out = sp.load(f"{base}/mesh", like=like)
    for k, v in out.items():
        if v is not like[k] or v.to_local().data_ptr() != ptrs[k]:
            bad.append(f"{k}: not filled in place")
        if not same_bits(v.full_tensor().detach(), full(k)):
            bad.append(f"{k}: wrong values")
    return bad, r.unique_bytes


def test_dtensor_2d_mesh_round_trip(tmp_path):
    res = run_world(4, mesh2d_job, str(tmp_path), timeout=240)
    assert all(not bad for bad, _ in res), res
    import shardpoint as sp

    back = sp.load(str(tmp_path / "mesh"))
    for k in ("ss", "rs", "sr"):
        assert same_bits(back[k], full(k)), k
    sizes = stored_chunk_bytes(str(tmp_path / "mesh"))
    unique = res[0][1]
    assert unique <= sizes <= unique * 1.10 + 4096  # replicated mesh dims written once


# ---------------------------------------------------------------------------- failure, patched
def patched_failure_job(rank, world, base):
    """The real backend with its ``write`` patched in this process only, on rank 1: the save
    raises on every rank, nothing appears, the previous checkpoint stays."""
    import shardpoint as sp
    from shardpoint_core.transactions.resolve import get_backend
    import torch.distributed as dist

    a, b = split(SHAPE[0], world, rank)

    def state(w):
        st = {"w": sp.ShardedTensor(w[a:b].clone(), SHAPE, (a, 0))}
        if rank == 1:  # only rank 1 holds it, so rank 1 certainly writes a chunk
            st["r1"] = sp.ShardedTensor(w.clone(), SHAPE, (0, 0))
        return st

    sp.save(state(full("w")), f"{base}/ck")
    be = get_backend()
    if rank == 1:

        def broken(handle, offset, data):
            raise PermissionError(13, "Permission denied (patched on rank 1)")

        be.write = broken
    try:
        sp.save(state(torch.zeros(SHAPE)), f"{base}/ck", overwrite=True)
        msg = "saved"
    except sp.ShardpointError as e:
        msg = f"{type(e).__name__}: {e}"
    try:
        sp.save({"x": torch.ones(2)}, f"{base}/new")
        msg_new = "saved"
    except sp.ShardpointError as e:
        msg_new = f"{type(e).__name__}: {e}"
    dist.barrier()
    return (
        msg,
        msg_new,
        torch.equal(sp.load(f"{base}/ck")["w"], full("w")),
        sorted(os.listdir(base)),
    )


def test_write_failure_patched_in_one_rank(tmp_path):
    res = run_world(3, patched_failure_job, str(tmp_path), timeout=180)
    for msg, msg_new, intact, listing in res:
        assert msg.startswith("SaveFailedError") and "rank 1" in msg and "Permission" in msg
        assert msg_new.startswith("SaveFailedError") or msg_new == "saved"
        assert intact and listing in (["ck"], ["ck", "new"])
    # every rank reports the same failure
    assert len({m for m, *_ in res}) == 1


@pytest.mark.slow
def test_save_on_n_load_on_m_bigger_worlds(tmp_path):
    base = str(tmp_path)
    for n in (5, 6, 8):
        run_world(n, save_job, base, timeout=300)
    for m in (5, 6, 7, 8):
        bad = run_world(m, load_job, base, [5, 6, 8], timeout=400)
        assert not any(bad), bad
