"""The planner's scaling machinery: columnar local plans, exact grouping of holdings into
regions, the numpy chunk geometry, and a small version of benchmarks/plan_scale.py's
Megatron-style job (TP x PP x DP, distributed-optimizer ranges) planned and executed on numpy.

Each fast path is checked against the plain one it replaces, on random inputs.
"""

import importlib.util
import math
import pathlib
import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from shardpoint import InvalidShardingError, LayoutMismatchError
from shardpoint.planning import columns
from shardpoint.planning import grid
from shardpoint.planning.columns import HoldingColumns, group_rows
from shardpoint.tree.model import Holding, holding_pieces
from shardpoint.planning.planner import LocalPlan, PlanOptions, TensorLayout, plan_load, plan_save

from .test_planner import check_exchange_symmetry, execute_load, execute_save

ROOT = pathlib.Path(__file__).resolve().parents[2]


def random_holdings(rng, n):
    out = []
    for i in range(n):
        nd = rng.randint(0, 3)
        g = tuple(
            rng.choice([0, 1, 7, 3 * 2**31]) if rng.random() < 0.1 else rng.randint(1, 9)
            for _ in range(nd)
        )
        off = tuple(rng.randint(0, x) for x in g)
        shp = tuple(rng.randint(0, x - o) for x, o in zip(g, off))
        flat = None
        if rng.random() < 0.4 and nd:
            a = rng.randint(0, math.prod(shp))
            flat = (a, rng.randint(a, math.prod(shp)))
        rep = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 3)))
        out.append(
            Holding(
                f"k{rng.randint(0, 5)}/é.{i % 3}",
                rng.choice(["float32", "bfloat16"]),
                g,
                off,
                shp,
                flat,
                rep,
            )
        )
    return out


@pytest.mark.parametrize("seed", range(4))
def test_columns_wire_round_trip(seed):
    rng = random.Random(seed)
    hs = random_holdings(rng, rng.choice([0, 1, 40]))
    cols = HoldingColumns.from_holdings(hs)
    assert list(cols) == hs
    back = HoldingColumns.from_wire(cols.to_wire())
    assert back == hs and len(back) == len(hs) and back[1:3] == hs[1:3]
    tree = {"dict": [["a", {"list": [{"tensor": "a/0"}, {"value": (1, b"2")}]}]]}
    lp = LocalPlan(3, tree, hs, [("rng", 0, 1, (0,), b"x")])
    again = LocalPlan.from_bytes(lp.to_bytes())
    assert again.rank == 3 and list(again.holdings) == hs and again.objects == lp.objects
    assert again.tree is None and again.decoded_tree() == tree
    assert LocalPlan.from_bytes(again.to_bytes()).decoded_tree() == tree


def test_trees_merge_in_one_pass_like_pairwise_and_refuse_kind_conflicts():
    from shardpoint.planning.planner import merge_many, merge_trees

    def t(**kw):
        return {"dict": [[k, v] for k, v in kw.items()]}

    trees = [
        t(a=t(x={"tensor": "a/x"}), l={"list": [{"value": 1}]}),
        t(b={"value": 2}, a=t(y={"tensor": "a/y"})),
        t(l={"list": [{"value": 1}, {"value": 3}]}, a=t(x={"tensor": "a/x"})),
    ]
    pairwise = merge_trees(merge_trees(trees[0], trees[1]), trees[2])
    assert merge_many(trees) == pairwise
    assert [k for k, _ in pairwise["dict"]] == ["a", "l", "b"]
    assert pairwise["dict"][1][1] == {"list": [{"value": 1}, {"value": 3}]}
    with pytest.raises(InvalidShardingError, match=r"state\['a'\] is a dict .* list") as e:
        merge_many([trees[0], t(a={"list": []})])
    assert e.value.spec_id == "SP-TREE-1"
    with pytest.raises(InvalidShardingError, match=r"differs between ranks") as e:  # plain
        merge_many([trees[0], t(l={"list": [{"value": 9}]})])  # values agree or are refused
    assert e.value.spec_id == "SP-REPL-1"
    # distinct encoded trees are decoded once; equal ones skip merging
    plans = [LocalPlan.from_bytes(LocalPlan(r, trees[r % 3], [], []).to_bytes()) for r in range(6)]
    assert plan_save(plans).tree == pairwise
    # trees go up branch by branch; a rank with one branch sends its tree whole (mixed forms)
    one = t(a=t(z={"tensor": "a/z"}))
    for extra in ([], [one]):
        got = plan_save(
            [
                LocalPlan.from_bytes(LocalPlan(r, tr, [], []).to_bytes())
                for r, tr in enumerate(trees + extra)
            ]
        ).tree
        assert got == merge_many(trees + extra)
    with pytest.raises(InvalidShardingError, match=r"state\['l'\] is a list .* dict") as e:
        plan_save(
            [
                LocalPlan.from_bytes(LocalPlan(r, tr, [], []).to_bytes())
                for r, tr in enumerate([trees[0], t(l=t(q={"value": 1}), b={"value": 2})])
            ]
        )
    assert e.value.spec_id == "SP-TREE-1"


def test_group_rows_is_exact_even_when_every_hash_collides(monkeypatch):
    rng = np.random.default_rng(0)
    cols = [rng.integers(0, 3, 500) for _ in range(3)]
    expect = {}
    for i, row in enumerate(zip(*[c.tolist() for c in cols])):
        expect.setdefault(row, []).append(i)

    def groups():
        order, starts = group_rows(cols)
        return sorted(order[a:b].tolist() for a, b in zip(starts[:-1], starts[1:]))

    assert groups() == sorted(expect.values())
    monkeypatch.setattr(columns, "_MIX", np.uint64(0))  # all rows hash alike: exact fallback
    assert groups() == sorted(expect.values())


def flat_regions(rng, shape):
    n = math.prod(shape)
    cuts = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 6)))
    b = [0] + cuts + [n]
    return [
        holding_pieces(Holding("k", "float32", shape, (0,) * len(shape), shape, (a, c), (0,)))
        for a, c in zip(b[:-1], b[1:])
        if c > a
    ]


def test_numpy_chunk_geometry_matches_the_plain_loops():
    rng = random.Random(1)
    for _ in range(400):
        shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))
        pieces = flat_regions(rng, shape)
        chunk = tuple(rng.randint(1, x) for x in shape)
        regions = [([(p.offset, p.shape) for p in ps], ()) for ps in pieces]
        per = {}
        for ri, (boxes, _) in enumerate(regions):
            for off, shp in boxes:
                for cidx, n in grid._chunks_overlapping(shape, chunk, off, shp):
                    per.setdefault(cidx, {}).setdefault(ri, 0)
                    per[cidx][ri] += n
        moved = sum(
            math.prod(min(c, m - i * c) for i, c, m in zip(cidx, chunk, shape)) - max(d.values())
            for cidx, d in per.items()
        )
        held = sum(sum(d.values()) for d in per.values())
        chunk2 = tuple(rng.randint(1, x) for x in shape)
        assert grid._moved_many(shape, [chunk, chunk2], regions)[0] == moved
        assert held == math.prod(shape)
        old = grid.pieces_by_chunk(shape, chunk, pieces)
        new = grid.chunk_parts(shape, chunk, pieces)
        assert [c[0] for c in new] == [
            tuple(i * c for i, c in zip(cidx, chunk)) for cidx in sorted(old)
        ]
        for (_coff, _cshp, parts), cidx in zip(new, sorted(old)):
            assert [(li, pi, bo, bs) for li, pi, bo, bs, _ in parts] == [
                (li, pi, bo, bs) for li, pi, (bo, bs) in old[cidx]
            ]
            assert all(n == math.prod(bs) for *_, bs, n in parts)


def load_benchmark():
    spec = importlib.util.spec_from_file_location("plan_scale", ROOT / "benchmarks/plan_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ids(shape, key):
    base = (sum(map(ord, key)) % 97 + 1) << 40
    return (np.arange(math.prod(shape), dtype=np.int64) + base).reshape(shape)


def data_of(h):
    blk = ids(h.global_shape, h.key)[tuple(slice(o, o + s) for o, s in zip(h.offset, h.shape))]
    return blk.reshape(-1)[h.flat[0] : h.flat[1]].copy() if h.flat else blk.copy()


@pytest.mark.parametrize("megatron_ids", [False, True])
def test_small_megatron_style_job_through_the_wire_is_bitwise_exact(megatron_ids):
    """benchmarks/plan_scale.py's job at TP 2 x PP 2 x DP 3 (uneven embedding split, flattened
    optimizer ranges across layer boundaries, replicated norms), sent through the wire form;
    with ``megatron_ids`` every non-main replica carries id 1, as Megatron writes them."""
    bench = load_benchmark()
    plans = bench.build_job(2, 2, 3, 4, 6, 13)
    if megatron_ids:
        plans = [
            LocalPlan(
                p.rank,
                p.tree,
                [h._replace(replica=(0,) if not any(h.replica) else (1,)) for h in p.holdings],
                p.objects,
            )
            for p in plans
        ]
    decoded = [LocalPlan.from_bytes(p.to_bytes()) for p in plans]
    plan = plan_save(decoded, PlanOptions(chunk_overhead_bytes=64))
    check_exchange_symmetry(plan.ranks)
    datas = [[data_of(h) for h in p.holdings] for p in plans]
    store, count = execute_save(plans, datas, plan)
    for key, lay in plan.tensors.items():
        assert (count[key] == 1).all(), key
        assert np.array_equal(store[key], ids(lay.shape, key)), key
    assert plan.stats["exchange_bytes"] > 0
    # load into the same layout, requests through the wire as loading.py sends them
    reqs = [
        HoldingColumns.from_wire(
            HoldingColumns.from_holdings([h._replace(replica=(0,)) for h in p.holdings]).to_wire()
        )
        for p in plans
    ]
    works = plan_load(reqs, plan.tensors)
    check_exchange_symmetry(works)
    reqs = [list(r) for r in reqs]
    outs, got, readcount = execute_load(store, plan.tensors, reqs, works)
    assert all(c.max(initial=0) <= 1 for c in readcount.values())
    for r, rq in enumerate(reqs):
        for q, h in enumerate(rq):
            assert (got[r][q] == 1).all() and np.array_equal(outs[r][q], data_of(h))


def test_errors_from_the_columnar_path_name_key_and_ranks():
    shape = (8, 4)
    good = Holding("w", "float32", shape, (0, 0), shape, None, (0,))
    with pytest.raises(InvalidShardingError) as e:
        plan_save(
            [
                LocalPlan(0, {"dict": []}, [good], []),
                LocalPlan(1, {"dict": []}, [good._replace(dtype="bfloat16", replica=(1,))], []),
            ]
        )
    assert (
        e.value.spec_id == "SP-COVER-4"
        and "rank 0" in str(e.value)
        and "rank 1" in str(e.value)
        and "'w'" in str(e.value)
    )
    # through the wire: key tables in segments (model/..., optim/...), one shared, one not
    m = Holding("model/w", "float32", shape, (0, 0), shape, None, (0,))
    o = Holding("optim/w", "float32", shape, (0, 0), shape, None, (0,))
    wire = [
        LocalPlan(0, {"dict": []}, [m, o], []),
        LocalPlan(
            1,
            {"dict": []},
            [m._replace(replica=(1,)), o._replace(global_shape=(8, 5), replica=(1,))],
            [],
        ),
    ]
    with pytest.raises(InvalidShardingError) as e:
        plan_save([LocalPlan.from_bytes(lp.to_bytes()) for lp in wire])
    assert (
        e.value.spec_id == "SP-COVER-4"
        and "'optim/w'" in str(e.value)
        and "rank 0" in str(e.value)
        and "rank 1" in str(e.value)
    )
    lay = {"w": TensorLayout("w", shape, "float32", (4, 4))}
    with pytest.raises(LayoutMismatchError, match="'w'"):
        plan_load([[good], [good._replace(global_shape=(9, 4))]], lay)


# ------------------------------------------------- pieces cut on arrays, quick coverage test
_dims = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def _regions(draw):
    nd = draw(st.integers(0, 4))
    out = []
    for _ in range(draw(st.integers(0, 6))):
        shp = tuple(draw(st.integers(0, 5)) for _ in range(nd))
        off = tuple(draw(st.integers(0, 7)) for _ in range(nd))
        n, flat = math.prod(shp), None
        if n and draw(st.booleans()):
            a = draw(st.integers(0, n))
            flat = (a, draw(st.integers(a, n)))
        out.append((off, shp, flat))
    return nd, out


@settings(max_examples=300, deadline=None)
@given(_regions())
def test_region_pieces_on_arrays_are_the_holding_pieces(case):
    nd, regions = case
    pa = grid.region_pieces(nd, regions)
    got = list(
        zip(
            pa.li.tolist(),
            pa.pi.tolist(),
            map(tuple, pa.offs.tolist()),
            map(tuple, pa.shps.tolist()),
        )
    )
    want = [
        (i, j, p.offset, p.shape)
        for i, (o, s, f) in enumerate(regions)
        for j, p in enumerate(holding_pieces(Holding("k", "float32", (9,) * nd, o, s, f, (0,))))
    ]
    assert got == want


@st.composite
def _tilings(draw):
    """Regions of a tensor: grid blocks cut into flat ranges, then maybe spoiled (a range
    dropped, moved or duplicated, a block shifted)."""
    shape = tuple(draw(st.integers(1, 6)) for _ in range(draw(st.integers(0, 3))))
    chunk = tuple(draw(st.integers(1, n)) for n in shape)
    regions = []
    for cidx in np.ndindex(*[-(-n // c) for n, c in zip(shape, chunk)]):
        off = tuple(i * c for i, c in zip(cidx, chunk))
        shp = tuple(min(c, n - o) for c, n, o in zip(chunk, shape, off))
        n = math.prod(shp)
        if draw(st.booleans()):
            regions.append((off, shp, None))
            continue
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3))) - {n})
        b = [0] + cuts + [n]
        regions += [(off, shp, (x, y)) for x, y in zip(b[:-1], b[1:]) if y > x]
    spoil = draw(st.integers(0, 4))
    if spoil == 1 and len(regions) > 1:
        regions.pop(draw(st.integers(0, len(regions) - 1)))
    elif spoil == 2 and regions:
        o, s, f = regions[-1]
        if f and f[1] - f[0] > 1:
            regions[-1] = (o, s, (f[0], f[1] - 1))
    elif spoil == 3 and shape and regions:
        o, s, f = regions[0]
        regions[0] = ((o[0] + 1,) + o[1:], s, f)
    elif spoil == 4 and regions:
        o, s, f = regions[-1]
        regions.append((o, s, (0, 1) if f else (0, math.prod(s))))
    return shape, list(dict.fromkeys(regions)), spoil


@settings(max_examples=300, deadline=None)
@given(_tilings())
def test_quick_cover_test_passes_only_what_the_full_check_passes(case):
    from shardpoint_core.format.coverage import check_exact_cover, regions_tile

    shape, regions, spoil = case
    boxes = [
        (p.offset, p.shape)
        for o, s, f in regions
        for p in holding_pieces(Holding("k", "float32", shape, o, s, f, (0,)))
    ]
    try:
        check_exact_cover(shape, boxes, lambda i: f"box {i}", "k")
        ok = True
    except InvalidShardingError:
        ok = False
    quick = regions_tile(shape, regions)
    assert ok or not quick  # it never passes what the full check refuses
    if spoil == 0:  # and it does pass a grid of blocks cut into ranges
        assert quick and ok


@settings(max_examples=100, deadline=None)
@given(st.lists(_regions(), min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_pieces_and_parts_of_many_geometries_at_once_equal_one_at_a_time(cases, rnd):
    specs, items = [], []
    for nd, regions in cases:
        shape = tuple(
            max([o + s for o, s, _ in ((r[0][d], r[1][d], 0) for r in regions)] + [1])
            for d in range(nd)
        )
        specs.append((nd, regions))
        items.append((shape, tuple(rnd.randint(1, n) for n in shape)))
    many = grid.region_pieces_many(specs)
    for (nd, regions), pa in zip(specs, many):
        assert all(np.array_equal(a, b) for a, b in zip(grid.region_pieces(nd, regions), pa))
    parts = grid.chunk_part_arrays_many([(s, c, pa) for (s, c), pa in zip(items, many)])
    for (shape, chunk), pa, got in zip(items, many, parts):
        want = grid.chunk_part_arrays(shape, chunk, pa)
        assert all(np.array_equal(a, b) and a.shape == b.shape for a, b in zip(want, got))
