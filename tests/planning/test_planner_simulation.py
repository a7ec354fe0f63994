"""Save and load plans executed on numpy in one process, for thousands of random layouts.

The wide, fast net under the real-process tests: every element is written by exactly one
chunk writer, every stored region is read once, and every rank gets back exactly its bits.
"""

import math
import random
import pytest

import numpy as np
from shardpoint.tree.model import Holding, holding_pieces
from shardpoint.planning.planner import LocalPlan, plan_save, plan_load, TensorLayout, PlanOptions


def box_slices(base_off, off, shp):
    return tuple(slice(o - b, o - b + s) for b, o, s in zip(base_off, off, shp))


def rand_splits(n, k, rng):
    cuts = sorted(rng.randint(0, n) for _ in range(k - 1))
    b = [0] + cuts + [n]
    return list(zip(b[:-1], b[1:]))


def rand_layout(shape, world, rng):
    """list per rank of holdings (offset, shape, flat)"""
    kind = rng.choice(["grid", "flat", "rep"])
    if kind == "rep" or not shape:
        return [[((0,) * len(shape), shape, None, (r,))] for r in range(world)]
    if kind == "grid":
        d = rng.randrange(len(shape))
        parts = rand_splits(shape[d], world, rng)
        out = []
        for a, b in parts:
            off = tuple(a if i == d else 0 for i in range(len(shape)))
            shp = tuple(b - a if i == d else s for i, s in enumerate(shape))
            out.append([(off, shp, None, (0,))])
        return out
    n = math.prod(shape)
    parts = rand_splits(n, world, rng)
    return [[((0,) * len(shape), shape, (a, b), (0,))] for a, b in parts]


def run(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 6)
    nd = rng.randint(0, 3)
    shape = tuple(rng.randint(1, 9) for _ in range(nd))
    full = (
        np.arange(max(1, math.prod(shape)), dtype=np.int64)[: math.prod(shape)].reshape(shape) + 1
    )
    lay = rand_layout(shape, world, rng)
    plans, datas = [], []
    for r in range(world):
        hs, ds = [], []
        for off, shp, flat, rep in lay[r]:
            h = Holding("t", "int64", shape, off, shp, flat, rep)
            hs.append(h)
            blk = full[box_slices((0,) * nd, off, shp)]
            ds.append(blk.reshape(-1)[flat[0] : flat[1]].copy() if flat else blk.copy())
        plans.append(LocalPlan(r, {"dict": [["t", {"tensor": "t"}]]}, hs, []))
        datas.append(ds)
    opts = PlanOptions(chunk_overhead_bytes=rng.choice([0, 64, 256 << 10]))
    plan = plan_save(plans, opts)
    lay_t = plan.tensors["t"]
    store = np.zeros(shape, np.int64)
    count = np.zeros(shape, np.int64)

    def view(r, hidx, pidx):
        h = plans[r].holdings[hidx]
        p = holding_pieces(h)[pidx]
        d = datas[r][hidx]
        v = d if p.start is None else d[p.start : p.start + math.prod(p.shape)].reshape(p.shape)
        return v, p.offset

    # sanity: chunks on grid
    for r, w in enumerate(plan.ranks):
        for widx, cw in enumerate(w.writes):
            buf = np.full(cw.shape, -1, np.int64)
            if cw.direct:
                v, off = view(r, *cw.direct)
                buf = v[box_slices(off, cw.offset, cw.shape)].copy()
            for hidx, pidx, bo, bs in cw.local:
                v, off = view(r, hidx, pidx)
                buf[box_slices(cw.offset, bo, bs)] = v[box_slices(off, bo, bs)]
            for t in w.recvs:
                if t.dst_ref[0] != widx:
                    continue
                v, off = view(t.src, *t.src_ref)
                buf[box_slices(cw.offset, t.box_offset, t.box_shape)] = v[
                    box_slices(off, t.box_offset, t.box_shape)
                ]
            sl = box_slices((0,) * nd, cw.offset, cw.shape)
            store[sl] = buf
            count[sl] += 1
            assert all(o % c == 0 for o, c in zip(cw.offset, lay_t.chunk_shape)), (cw, lay_t)
    assert (count == 1).all(), ("chunks written not exactly once", seed, count)
    assert np.array_equal(store, full), ("save mismatch", seed)
    # load into a random layout
    lw = rng.randint(1, 5)
    ll = rand_layout(shape, lw, rng)
    reqs = [
        [Holding("t", "int64", shape, off, shp, flat, (0,)) for off, shp, flat, rep in ll[r]]
        for r in range(lw)
    ]
    works = plan_load(reqs, {"t": TensorLayout("t", shape, "int64", lay_t.chunk_shape)})
    outs = [
        [np.full(h.shape if not h.flat else (h.flat[1] - h.flat[0],), -1, np.int64) for h in rq]
        for rq in reqs
    ]

    def dview(r, q, pi):
        h = reqs[r][q]
        p = holding_pieces(h)[pi]
        d = outs[r][q]
        v = d if p.start is None else d[p.start : p.start + math.prod(p.shape)].reshape(p.shape)
        return v, p.offset

    readcount = np.zeros(shape, np.int64)
    bufs = {}
    for r, w in enumerate(works):
        for ridx, op in enumerate(w.reads):
            sl = box_slices((0,) * nd, op.offset, op.shape)
            readcount[sl] += 1
            data = store[sl].copy()
            bufs[(r, ridx)] = data
            if op.direct:
                v, off = dview(r, *op.direct)
                v[box_slices(off, op.offset, op.shape)] = data
            for q, pi, bo, bs in op.local:
                v, off = dview(r, q, pi)
                v[box_slices(off, bo, bs)] = data[box_slices(op.offset, bo, bs)]
    for r, w in enumerate(works):
        for t in w.recvs:
            data = bufs[(t.src, t.src_ref[0])]
            op = works[t.src].reads[t.src_ref[0]]
            v, off = dview(r, *t.dst_ref)
            v[box_slices(off, t.box_offset, t.box_shape)] = data[
                box_slices(op.offset, t.box_offset, t.box_shape)
            ]
    assert readcount.max() <= 1, ("read twice", seed)
    for r in range(lw):
        for h, o in zip(reqs[r], outs[r]):
            blk = full[box_slices((0,) * nd, h.offset, h.shape)]
            exp = blk.reshape(-1)[h.flat[0] : h.flat[1]] if h.flat else blk
            assert np.array_equal(o, exp), ("load mismatch", seed, h, o, exp)


@pytest.mark.parametrize("block", range(4))
def test_random_layouts_round_trip_through_plans(block):
    for seed in range(block * 150, (block + 1) * 150):
        run(seed)


@pytest.mark.slow
def test_random_layouts_round_trip_through_plans_long():
    for seed in range(600, 20000):
        run(seed)
