"""Pure planner tests: random layouts planned in one process, then executed on numpy.

No processes, no storage: ``plan_save`` and ``plan_load`` are run on hypothesis-generated
layouts (worlds up to 64 ranks, even/uneven/ceil-div splits, 2-D grids, flattened ranges of
blocks, replicas, several pieces per rank) and their copies and transfers are executed on
numpy arrays whose elements are unique ids, so "bitwise equal" means every element landed in
the right place exactly once.
"""

import math
import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from shardpoint import InvalidShardingError, LayoutMismatchError
from shardpoint.tree.dtypes import DTYPES
from shardpoint.tree.model import Holding, holding_pieces
from shardpoint.planning.planner import LocalPlan, PlanOptions, TensorLayout, plan_load, plan_save

SET = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------ layouts
def cuts(n, k, mode, rng):
    """k consecutive [a, b) parts of range(n): even, uneven (random, may be empty anywhere),
    or ceil-div like torch.chunk / DTensor (trailing empty parts sit at offset n)."""
    if mode == "even":
        return [(i * n // k, (i + 1) * n // k) for i in range(k)]
    if mode == "ceil":
        c = -(-n // k) if n else 1
        return [(min(n, i * c), min(n, (i + 1) * c)) for i in range(k)]
    b = sorted(rng.randint(0, n) for _ in range(k - 1))
    b = [0] + b + [n]
    return list(zip(b[:-1], b[1:]))


def make_layout(shape, world, kind, mode, rng):
    """[(rank, offset, shape, flat, replica)] covering ``shape`` exactly once per replica."""
    nd = len(shape)
    out = []
    if kind == "replicated" or nd == 0:
        reps = rng.randint(1, world)
        for j in range(reps):
            out.append((rng.randrange(world) if j else 0, (0,) * nd, shape, None, (j,)))
        # replicas on distinct ranks, or on one rank with distinct ids: both legal
        return out
    if kind in ("split", "grid", "flat_blocks", "multi"):
        dims = [rng.randrange(nd)]
        if kind == "grid" and nd >= 2:
            dims = rng.sample(range(nd), 2)
        parts_per = [rng.randint(1, min(8, world)) for _ in dims]
        axes = [cuts(shape[d], k, mode, rng) for d, k in zip(dims, parts_per)]
        blocks = []
        for combo in np.ndindex(*parts_per):
            off, shp = list((0,) * nd), list(shape)
            for d, ax, i in zip(dims, axes, combo):
                off[d], shp[d] = ax[i][0], ax[i][1] - ax[i][0]
            blocks.append((tuple(off), tuple(shp)))
        reps = rng.randint(1, max(1, world // len(blocks))) if kind != "multi" else 1
        pieces = []
        for off, shp in blocks:
            if kind == "flat_blocks":
                n = math.prod(shp)
                for a, b in cuts(n, rng.randint(1, 4), rng.choice(["even", "uneven", "ceil"]), rng):
                    pieces.append((off, shp, (a, b)))
            else:
                pieces.append((off, shp, None))
        rank = 0
        for j in range(reps):
            for off, shp, flat in pieces:
                r = rng.randrange(world) if kind == "multi" else rank % world
                out.append((r, off, shp, flat, (j,)))
                rank += 1
        return out
    # "flat_whole": ZeRO-style flat ranges of the whole tensor
    n = math.prod(shape)
    return [
        (i % world, (0,) * nd, shape, ab, (0,))
        for i, ab in enumerate(cuts(n, rng.randint(1, world), mode, rng))
    ]


@st.composite
def jobs(draw, max_world=64):
    world = draw(st.integers(1, max_world))
    rng = random.Random(draw(st.integers(0, 2**32)))
    tensors = {}
    for t in range(draw(st.integers(1, 3))):
        nd = draw(st.integers(0, 4))
        shape = tuple(draw(st.integers(0, 9 if nd < 3 else 4)) for _ in range(nd))
        kind = draw(
            st.sampled_from(["replicated", "split", "grid", "flat_blocks", "multi", "flat_whole"])
        )
        mode = draw(st.sampled_from(["even", "uneven", "ceil"]))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        lay = make_layout(shape, world, kind, mode, rng)
        # at most one main replica (id 0) per region ([SP-REPL-2]): number the holders of a
        # region 0, 1, 2..., or Megatron's way (0 for the first, 1 for every other), or give
        # them all one non-zero id (no main at all)
        style = draw(st.sampled_from(["distinct", "megatron", "no_main"]))
        seen = {}
        fixed = []
        for r, off, shp, flat, _rep in lay:
            reg = (off, shp, flat)
            seen[reg] = n = seen.get(reg, -1) + 1
            rid = {"distinct": n, "megatron": min(n, 1), "no_main": 2}[style]
            fixed.append((r, off, shp, flat, (rid,)))
        tensors[f"t{t}"] = (shape, dtype, fixed)
    return world, tensors, rng


def ids(shape, key):
    """Global tensor whose elements are unique across keys (so misplaced data is caught)."""
    base = (int(key[1:]) + 1) << 40
    return (np.arange(math.prod(shape), dtype=np.int64) + base).reshape(shape)


def data_for(full, off, shp, flat):
    blk = full[tuple(slice(o, o + s) for o, s in zip(off, shp))]
    return blk.reshape(-1)[flat[0] : flat[1]].copy() if flat else blk.copy()


def local_plans(world, tensors, rng):
    per_rank = [[] for _ in range(world)]
    for key, (shape, dtype, lay) in tensors.items():
        for r, off, shp, flat, rep in lay:
            per_rank[r].append(
                (
                    Holding(key, dtype, shape, off, shp, flat, rep),
                    data_for(ids(shape, key), off, shp, flat),
                )
            )
    plans, datas = [], []
    for r in range(world):
        items = per_rank[r]
        rng.shuffle(items)  # key order may differ between ranks
        keys = list(dict.fromkeys(h.key for h, _ in items))
        tree = {"dict": [[k, {"tensor": k}] for k in keys]}
        plans.append(LocalPlan(r, tree, [h for h, _ in items], []))
        datas.append([d for _, d in items])
    return plans, datas


def sl(base, off, shp):
    return tuple(slice(o - b, o - b + s) for b, o, s in zip(base, off, shp))


def piece(holding, data, pidx):
    p = holding_pieces(holding)[pidx]
    v = data if p.start is None else data[p.start : p.start + math.prod(p.shape)].reshape(p.shape)
    return v, p.offset


def execute_save(plans, datas, plan):
    """Run the plan's copies and transfers on numpy; return the stored arrays and a count of
    how often each element was written."""
    store = {k: np.full(t.shape, -1, np.int64) for k, t in plan.tensors.items()}
    count = {k: np.zeros(t.shape, np.int64) for k, t in plan.tensors.items()}
    for r, w in enumerate(plan.ranks):
        hold = plans[r].holdings
        for widx, cw in enumerate(w.writes):
            lay = plan.tensors[cw.key]
            assert all(o % c == 0 for o, c in zip(cw.offset, lay.chunk_shape)), (cw, lay)
            assert cw.shape == tuple(
                min(c, n - o) for c, n, o in zip(lay.chunk_shape, lay.shape, cw.offset)
            ), (cw, lay)
            buf = np.full(cw.shape, -1, np.int64)
            fill = np.zeros(cw.shape, np.int64)
            if cw.direct is not None:
                h = hold[cw.direct[0]]
                assert h.key == cw.key
                v, off = piece(h, datas[r][cw.direct[0]], cw.direct[1])
                buf[...] = v[sl(off, cw.offset, cw.shape)]
                fill += 1
            for hidx, pidx, bo, bs in cw.local:
                assert hold[hidx].key == cw.key
                v, off = piece(hold[hidx], datas[r][hidx], pidx)
                buf[sl(cw.offset, bo, bs)] = v[sl(off, bo, bs)]
                fill[sl(cw.offset, bo, bs)] += 1
            for t in w.recvs:
                if t.dst_ref[0] != widx:
                    continue
                assert t.dst == r and t.key == cw.key
                h = plans[t.src].holdings[t.src_ref[0]]
                assert h.key == t.key
                v, off = piece(h, datas[t.src][t.src_ref[0]], t.src_ref[1])
                buf[sl(cw.offset, t.box_offset, t.box_shape)] = v[
                    sl(off, t.box_offset, t.box_shape)
                ]
                fill[sl(cw.offset, t.box_offset, t.box_shape)] += 1
            assert (fill == 1).all(), ("chunk buffer filled unevenly", cw, fill)
            s = sl((0,) * len(cw.offset), cw.offset, cw.shape)
            store[cw.key][s] = buf
            count[cw.key][s] += 1
    return store, count


def check_exchange_symmetry(ranks):
    """Both ends of every transfer list it, in the same order per (src, dst) pair."""
    for s, ws in enumerate(ranks):
        for t in ws.sends:
            assert t.src == s
        for t in ws.recvs:
            assert t.dst == s
    for s in range(len(ranks)):
        for d in range(len(ranks)):
            a = [t for t in ranks[s].sends if t.dst == d]
            b = [t for t in ranks[d].recvs if t.src == s]
            assert a == b


def save_and_check(world, tensors, rng, opts=PlanOptions()):
    plans, datas = local_plans(world, tensors, rng)
    plan = plan_save(plans, opts)
    assert sorted(plan.tensors) == sorted(tensors)
    check_exchange_symmetry(plan.ranks)
    store, count = execute_save(plans, datas, plan)
    moved = 0
    for key, (shape, dtype, _) in tensors.items():
        assert plan.tensors[key].shape == shape and plan.tensors[key].dtype == dtype
        assert (count[key] == 1).all(), ("every element written exactly once", key)
        assert np.array_equal(store[key], ids(shape, key)), key
        if math.prod(shape) == 0:
            assert sum(1 for w in plan.ranks for k in w.create if k == key) == 1
    for w in plan.ranks:
        for t in w.sends:
            moved += math.prod(t.box_shape) * DTYPES[plan.tensors[t.key].dtype].itemsize
    assert plan.stats["exchange_bytes"] == moved
    chunks = [(cw.key, cw.offset) for w in plan.ranks for cw in w.writes]
    assert len(chunks) == len(set(chunks)) == plan.stats["chunks"]  # one writer per chunk
    return plan, store


@settings(max_examples=60, **SET)
@given(jobs())
def test_plan_save_writes_every_element_once_with_one_writer_per_chunk(job):
    world, tensors, rng = job
    opts = PlanOptions(
        chunk_overhead_bytes=rng.choice([0, 16, 256 << 10]),
        max_chunk_bytes=rng.choice([64, 4096, 256 << 20]),
    )
    save_and_check(world, tensors, rng, opts)


@st.composite
def grid_jobs(draw):
    """Layouts that are already a regular grid: even splits of divisible sizes, or ceil-div."""
    world = draw(st.integers(1, 64))
    nd = draw(st.integers(1, 3))
    parts = [draw(st.integers(1, 4)) for _ in range(nd)]
    mode = draw(st.sampled_from(["even", "ceil"]))
    shape = tuple(
        (p * draw(st.integers(1, 3))) if mode == "even" else draw(st.integers(1, 9)) for p in parts
    )
    rng = random.Random(draw(st.integers(0, 2**32)))
    axes = [cuts(n, p, mode, rng) for n, p in zip(shape, parts)]
    reps = draw(st.integers(1, 3))
    lay = []
    i = 0
    for j in range(reps):
        for combo in np.ndindex(*parts):
            off = tuple(axes[d][c][0] for d, c in enumerate(combo))
            shp = tuple(axes[d][c][1] - axes[d][c][0] for d, c in enumerate(combo))
            lay.append((i % world, off, shp, None, (j,)))
            i += 1
    return world, {"t0": (shape, "float32", lay)}, rng


@settings(max_examples=60, **SET)
@given(grid_jobs())
def test_a_regular_grid_moves_no_bytes_and_chunks_are_the_blocks(job):
    world, tensors, rng = job
    plan, _ = save_and_check(world, tensors, rng, PlanOptions(chunk_overhead_bytes=0))
    assert plan.stats["exchange_bytes"] == 0
    assert all(not w.sends and not w.recvs for w in plan.ranks)
    blocks = {(o, s) for _, o, s, _, _ in tensors["t0"][2] if math.prod(s)}
    writes = {(cw.offset, cw.shape) for w in plan.ranks for cw in w.writes}
    assert writes == blocks


@pytest.mark.parametrize("world,split", [(8, "even"), (6, "ceil"), (4, "rows_cols")])
def test_realistic_sizes_with_default_options_move_nothing(world, split):
    shape = (4096, 1024)
    lay = []
    if split == "rows_cols":
        for r in range(world):
            a, b = r // 2 * 2048, r // 2 * 2048 + 2048
            c, d = r % 2 * 512, r % 2 * 512 + 512
            lay.append((r, (a, c), (b - a, d - c), None, (0,)))
    else:
        for r, (a, b) in enumerate(cuts(shape[0], world, split, random.Random(0))):
            lay.append((r, (a, 0), (b - a, shape[1]), None, (0,)))
    plans = [
        LocalPlan(
            r,
            {"dict": [["w", {"tensor": "w"}]]},
            [Holding("w", "float32", shape, o, s, f, rep) for rr, o, s, f, rep in lay if rr == r],
            [],
        )
        for r in range(world)
    ]
    plan = plan_save(plans)
    assert plan.stats["exchange_bytes"] == 0
    assert plan.tensors["w"].chunk_shape == lay[0][2]


def test_uneven_and_flattened_layouts_get_one_grid_independent_of_the_saving_world():
    """The stored grid is regular whatever the saving layout; the exchange moves only what
    does not sit on its writer."""
    shape = (4001 * 2, 64)
    lay = [(0, (0, 0), (4001, 64), None, (0,)), (1, (4001, 0), (4001, 64), None, (0,))]
    plans = [
        LocalPlan(
            r,
            {"dict": [["w", {"tensor": "w"}]]},
            [Holding("w", "bfloat16", shape, o, s, f, rep)],
            [],
        )
        for r, o, s, f, rep in lay
    ]
    plan = plan_save(plans)
    assert plan.stats["exchange_bytes"] == 0 and plan.tensors["w"].chunk_shape == (4001, 64)
    n = math.prod(shape)
    flat = [
        LocalPlan(
            r,
            {"dict": [["w", {"tensor": "w"}]]},
            [Holding("w", "float32", shape, (0, 0), shape, (r * n // 3, (r + 1) * n // 3), (0,))],
            [],
        )
        for r in range(3)
    ]
    plan = plan_save(flat)
    moved = plan.stats["exchange_bytes"]
    assert 0 < moved < n * 4 // 3  # some data moves to reach a regular grid, not most of it


# ------------------------------------------------------------------------------ invalid layouts
def plans_of(*per_rank, objects=None):
    out = []
    for r, hs in enumerate(per_rank):
        keys = list(dict.fromkeys(h.key for h in hs))
        tree = {"dict": [[k, {"tensor": k}] for k in keys]}
        objs = (objects or {}).get(r, [])
        for o in objs:
            tree["dict"].append([o[0], {"object": o[0]}])
        out.append(LocalPlan(r, tree, list(hs), objs))
    return out


def H(off, shp, flat=None, rep=0, key="w", shape=(8, 4), dtype="float32"):
    return Holding(key, dtype, shape, off, shp, flat, (rep,))


@pytest.mark.parametrize(
    "case,sid",
    [
        ("overlap", "SP-COVER-3"),
        ("gap", "SP-COVER-2"),
        ("dup_replica", "SP-REPL-2"),
        ("shape", "SP-COVER-4"),
        ("dtype", "SP-COVER-4"),
        ("flat_overlap", "SP-COVER-3"),
        ("flat_gap", "SP-COVER-2"),
        ("replica_partial_overlap", "SP-COVER-3"),
        ("zero_d_two_regions", None),
    ],
)
def test_invalid_tensor_layouts_raise_naming_the_key(case, sid):
    per_rank = {
        "overlap": ([H((0, 0), (5, 4))], [H((4, 0), (4, 4))]),
        "gap": ([H((0, 0), (3, 4))], [H((4, 0), (4, 4))]),
        "dup_replica": ([H((0, 0), (8, 4))], [H((0, 0), (8, 4))]),
        "shape": ([H((0, 0), (4, 4))], [H((4, 0), (4, 4), shape=(9, 4))]),
        "dtype": ([H((0, 0), (4, 4))], [H((4, 0), (4, 4), dtype="bfloat16")]),
        "flat_overlap": ([H((0, 0), (8, 4), (0, 20))], [H((0, 0), (8, 4), (19, 32))]),
        "flat_gap": ([H((0, 0), (8, 4), (0, 20))], [H((0, 0), (8, 4), (21, 32))]),
        "replica_partial_overlap": (
            [H((0, 0), (8, 4))],
            [H((0, 0), (4, 4), rep=1), H((4, 0), (4, 4), rep=1)],
        ),
        "zero_d_two_regions": ([H((), (), None, 0, shape=())], [H((), (), (0, 1), 0, shape=())]),
    }[case]
    with pytest.raises(InvalidShardingError) as e:
        plan_save(plans_of(*per_rank))
    assert "'w'" in str(e.value)
    if sid:
        assert e.value.spec_id == sid
    if case in ("overlap", "dup_replica"):
        assert "rank" in str(e.value) and "0" in str(e.value) and "1" in str(e.value)


def test_megatron_replica_ids_main_zero_others_share_one():
    """[SP-REPL-2] (1.1): non-main replicas may share an id; the writer election stays
    byte-balanced and deterministic (ties to the lowest rank), whatever the ids."""
    shape = (16, 4)
    per_rank = [[H((0, 0), (16, 4), rep=0 if r == 0 else 1, shape=shape)] for r in range(4)]
    plans = plans_of(*per_rank)
    opts = PlanOptions(chunk_overhead_bytes=0, max_chunk_bytes=64)  # 4 chunks of 4 rows
    plan = plan_save(plans, opts)
    writers = [r for r, w in enumerate(plan.ranks) for _ in w.writes]
    assert sorted(writers) == [0, 1, 2, 3]  # one chunk each: balanced
    assert [len(w.writes) for w in plan_save(plans, opts).ranks] == [1, 1, 1, 1]
    assert [(cw.offset, r) for r, w in enumerate(plan.ranks) for cw in w.writes] == [
        (cw.offset, r) for r, w in enumerate(plan_save(plans, opts).ranks) for cw in w.writes
    ]
    # the same with no main replica at all, and with two ranks sharing a non-zero tuple id
    for ids in ([3, 3, 3, 3], [(0, 0), (0, 1), (0, 1), (2, 5)]):
        per_rank = [
            [
                Holding(
                    "w", "float32", shape, (0, 0), shape, None, i if isinstance(i, tuple) else (i,)
                )
            ]
            for i in ids
        ]
        assert plan_save(plans_of(*per_rank), opts).stats["chunks"] == 4


def test_two_main_replicas_name_key_ranks_region_and_fix():
    per_rank = (
        [H((0, 0), (4, 4))],
        [H((4, 0), (4, 4), rep=1)],
        [H((4, 0), (4, 4), rep=1)],
        [H((4, 0), (4, 4))],
        [H((4, 0), (4, 4), flat=None)],
    )
    with pytest.raises(InvalidShardingError) as e:
        plan_save(plans_of(*per_rank))
    msg = str(e.value)
    assert e.value.spec_id == "SP-REPL-2" and "'w'" in msg
    assert "rank 3" in msg and "rank 4" in msg and "rank 1" not in msg
    assert "(4, 0)" in msg and "main replica" in msg and "non-zero replica_id" in msg


def test_empty_pieces_anywhere_cover_nothing_and_never_shadow():
    # DTensor puts an empty shard at offset = dim, Megatron at the sum of earlier sizes;
    # an empty piece in the middle with the same offset as a real one must not hide it.
    per_rank = (
        [H((0, 0), (4, 4))],
        [H((4, 0), (0, 4))],
        [H((4, 0), (4, 4))],
        [H((8, 0), (0, 4))],
        [H((8, 0), (0, 4), rep=0)],
        [H((0, 0), (8, 4), (7, 7))],
    )
    plan = plan_save(plans_of(*per_rank), PlanOptions(chunk_overhead_bytes=0))
    writes = sorted((cw.offset, cw.shape) for w in plan.ranks for cw in w.writes)
    assert writes == [((0, 0), (4, 4)), ((4, 0), (4, 4))]


@pytest.mark.parametrize(
    "case,sid", [("count", "SP-OBJ-2"), ("missing", "SP-OBJ-3"), ("dup", "SP-REPL-2")]
)
def test_invalid_sharded_objects(case, sid):
    objs = {
        "count": {0: [("rng", 0, 2, (0,), 1)], 1: [("rng", 1, 3, (0,), 2)]},
        "missing": {0: [("rng", 0, 3, (0,), 1)], 1: [("rng", 2, 3, (0,), 2)]},
        "dup": {0: [("rng", 0, 2, (0,), 1), ("rng", 1, 2, (0,), 1)], 1: [("rng", 1, 2, (0,), 2)]},
    }[case]
    with pytest.raises(InvalidShardingError) as e:
        plan_save(plans_of([], [], objects=objs))
    assert "'rng'" in str(e.value) and e.value.spec_id == sid


def test_sharded_object_replicas_and_values():
    objs = {
        0: [("rng", 0, 2, (0,), "a")],
        1: [("rng", 1, 2, (0,), "b")],
        2: [("rng", 0, 2, (1,), "a2")],
        3: [("rng", 1, 2, (1,), "b2")],
    }
    plan = plan_save(plans_of([], [], [], [], objects=objs))
    assert plan.objects == {"rng": ["a", "b"]}
    # Megatron: non-main holders share id 1; the main entry's value is stored
    objs = {
        0: [("rng", 0, 1, (1,), "x")],
        1: [("rng", 0, 1, (1,), "y")],
        2: [("rng", 0, 1, (0,), "main")],
        3: [("rng", 0, 1, (1,), "z")],
    }
    assert plan_save(plans_of([], [], [], [], objects=objs)).objects == {"rng": ["main"]}


def test_wire_forms_round_trip():
    world, tensors, rng = (
        5,
        {
            "t0": (
                (7, 3),
                "bfloat16",
                make_layout((7, 3), 5, "flat_blocks", "uneven", random.Random(1)),
            )
        },
        random.Random(2),
    )
    plans, _ = local_plans(world, tensors, rng)
    for lp in plans:
        back = LocalPlan.from_bytes(lp.to_bytes())
        assert back.holdings == lp.holdings and back.decoded_tree() == lp.tree
    plan = plan_save(plans)
    from shardpoint.planning.planner import RankSaveWork, RankLoadWork

    for w in plan.ranks:
        b = RankSaveWork.from_bytes(w.to_bytes())
        assert [(c.key, c.offset, c.shape, c.direct, c.local) for c in b.writes] == [
            (
                c.key,
                tuple(c.offset),
                tuple(c.shape),
                tuple(c.direct) if c.direct else None,
                [tuple(x) for x in c.local],
            )
            for c in w.writes
        ]
        assert b.sends == w.sends and b.recvs == w.recvs
    reqs = [[Holding("t0", "bfloat16", (7, 3), (0, 0), (7, 3), None, (0,))]] * 2
    lay = {"t0": TensorLayout("t0", (7, 3), "bfloat16", (3, 3))}
    for w in plan_load(reqs, lay):
        b = RankLoadWork.from_bytes(w.to_bytes(lay), lay)
        assert b.sends == w.sends and b.recvs == w.recvs and b.reads == w.reads


# ------------------------------------------------------------------------------ load plans
def requests_for(tensors, world, rng):
    """Random load layouts (unlike the saving ones): per rank a list of Holdings."""
    reqs = [[] for _ in range(world)]
    for key, (shape, dtype, _) in tensors.items():
        if rng.random() < 0.2:
            continue  # a subset load: not every key asked
        kind = rng.choice(["replicated", "split", "grid", "flat_blocks", "multi", "flat_whole"])
        for r, off, shp, flat, _rep in make_layout(
            shape, world, kind, rng.choice(["even", "uneven", "ceil"]), rng
        ):
            if rng.random() < 0.15 and kind != "replicated":
                continue  # loads need not cover the tensor
            reqs[r].append(Holding(key, dtype, shape, off, shp, flat, (0,)))
    for rq in reqs:
        rng.shuffle(rq)
    return reqs


def execute_load(store, layouts, reqs, works):
    outs = [
        [np.full((h.flat[1] - h.flat[0],) if h.flat else h.shape, -1, np.int64) for h in rq]
        for rq in reqs
    ]
    got = [[np.zeros(o.shape, np.int64) for o in rq] for rq in outs]
    readcount = {k: np.zeros(lay.shape, np.int64) for k, lay in layouts.items()}
    bufs = {}

    def dst(r, q, pi):
        return piece(reqs[r][q], outs[r][q], pi), piece(reqs[r][q], got[r][q], pi)[0]

    for r, w in enumerate(works):
        for ridx, op in enumerate(w.reads):
            lay = layouts[op.key]
            s = sl((0,) * len(op.offset), op.offset, op.shape)
            # one read never spans two chunks, and no element is read twice by anyone
            assert all(
                o // c == (o + max(n, 1) - 1) // c
                for o, n, c in zip(op.offset, op.shape, lay.chunk_shape)
            ), (op, lay)
            readcount[op.key][s] += 1
            data = store[op.key][s].copy()
            bufs[(r, ridx)] = data
            if op.direct is not None:
                (v, off), g = dst(r, *op.direct)
                assert reqs[r][op.direct[0]].key == op.key
                v[sl(off, op.offset, op.shape)] = data
                g[sl(off, op.offset, op.shape)] += 1
            for q, pi, bo, bs in op.local:
                (v, off), g = dst(r, q, pi)
                v[sl(off, bo, bs)] = data[sl(op.offset, bo, bs)]
                g[sl(off, bo, bs)] += 1
    for r, w in enumerate(works):
        for t in w.recvs:
            op = works[t.src].reads[t.src_ref[0]]
            assert op.key == t.key
            data = bufs[(t.src, t.src_ref[0])]
            (v, off), g = dst(r, *t.dst_ref)
            v[sl(off, t.box_offset, t.box_shape)] = data[sl(op.offset, t.box_offset, t.box_shape)]
            g[sl(off, t.box_offset, t.box_shape)] += 1
    return outs, got, readcount


@settings(max_examples=50, **SET)
@given(jobs(max_world=16), st.integers(1, 64))
def test_save_then_load_through_the_plans_is_bitwise_exact(job, load_world):
    world, tensors, rng = job
    opts = PlanOptions(
        chunk_overhead_bytes=rng.choice([0, 64, 256 << 10]),
        max_chunk_bytes=rng.choice([32, 256 << 20]),
    )
    plan, store = save_and_check(world, tensors, rng, opts)
    reqs = requests_for(tensors, load_world, rng)
    works = plan_load(reqs, plan.tensors)
    check_exchange_symmetry(works)
    outs, got, readcount = execute_load(store, plan.tensors, reqs, works)
    for k, c in readcount.items():
        assert c.max(initial=0) <= 1, ("an element was read from storage twice", k)
    needed = {k: np.zeros(lay.shape, bool) for k, lay in plan.tensors.items()}
    for r, rq in enumerate(reqs):
        for q, h in enumerate(rq):
            exp = data_for(ids(h.global_shape, h.key), h.offset, h.shape, h.flat)
            assert (got[r][q] == 1).all(), ("each requested element delivered once", r, h)
            assert np.array_equal(outs[r][q], exp), (r, h)
            for p in holding_pieces(h):
                needed[h.key][sl((0,) * len(p.offset), p.offset, p.shape)] = True
    for k in readcount:
        assert ((readcount[k] > 0) | ~needed[k]).all()  # every needed element was read


def test_load_requests_must_match_shape_and_dtype():
    lay = {"w": TensorLayout("w", (8, 4), "float32", (4, 4))}
    for bad in (H((0, 0), (8, 4), shape=(8, 5)), H((0, 0), (8, 4), dtype="float64")):
        with pytest.raises(LayoutMismatchError, match="'w'"):
            plan_load([[bad]], lay)


def test_read_dedup_spreads_reads_across_ranks():
    """Eight ranks all asking for the whole tensor: each chunk is read once, by some rank,
    and the reads are spread (no rank reads more than its share rounded up)."""
    lay = {"w": TensorLayout("w", (16, 4), "float32", (2, 4))}
    works = plan_load([[H((0, 0), (16, 4), shape=(16, 4))]] * 8, lay)
    reads = [len(w.reads) for w in works]
    assert sum(reads) == 8 and max(reads) == 1


@pytest.mark.slow
@settings(max_examples=1000, **SET)
@given(jobs(), st.integers(1, 64))
def test_save_then_load_through_the_plans_long(job, load_world):
    test_save_then_load_through_the_plans_is_bitwise_exact.hypothesis.inner_test(job, load_world)
