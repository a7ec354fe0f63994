"""Load strategies: the cost model's decision (pure, property-tested), the direct plan run on
numpy (every requested element delivered once, exact), and real gloo ranks loading a
row-saved checkpoint by columns bitwise under every strategy."""

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

import shardpoint as sp
from shardpoint.planning.load_planner import (
    LoadOptions,
    choose_strategy,
    plan_load_auto,
    plan_load_direct,
)
from shardpoint.tree.model import holding_pieces
from shardpoint_testing.launch import run_world
from shardpoint_testing.tensors import counting, same_bits
from .test_planner import SET, data_for, execute_load, ids, jobs, requests_for, save_and_check, sl

costs_in = st.tuples(
    st.lists(st.sampled_from("abcd"), min_size=1, max_size=8),
    st.integers(0, 1 << 34),
    st.floats(0.01, 100),
    st.floats(0.01, 100),
)


@settings(max_examples=100, **SET)
@given(costs_in, st.data())
def test_choice_is_the_cheaper_estimate_and_monotone(args, data):
    hosts, read, sg, xg = args
    recv = data.draw(st.lists(st.integers(0, 1 << 33), min_size=len(hosts), max_size=len(hosts)))
    per_host = {
        h: data.draw(st.integers(read // max(1, len(set(hosts))), 4 * read + 1)) for h in set(hosts)
    }
    c = choose_strategy(hosts, read, recv, per_host, sg, xg)
    assert c.strategy == ("direct" if c.direct_s <= c.dedup_s else "dedup")
    # A faster exchange never turns dedup into direct; faster storage never the reverse.
    if c.strategy == "dedup":
        assert choose_strategy(hosts, read, recv, per_host, sg, xg * 2).strategy == "dedup"
        assert choose_strategy(hosts, read, recv, per_host, sg / 2, xg).strategy == "dedup"
    for forced in ("dedup", "direct"):
        assert choose_strategy(hosts, read, recv, per_host, sg, xg, forced).strategy == forced


def test_ranks_sharing_cores_price_memory_work_accordingly():
    # 4 ranks of one host, 512 MiB by columns: direct makes each rank check all of it
    m, tot = 1 << 20, 512 << 20
    args = (["h"] * 4, tot, [0] * 4, {"h": tot}, 2.0, 1.0)
    kw = dict(shm_bytes=[96 * m] * 4, dedup_rank_bytes=[128 * m] * 4, direct_rank_bytes=[tot] * 4)
    roomy = choose_strategy(*args, **kw, host_cores=16)
    crowded = choose_strategy(*args, **kw, host_cores=2)
    assert (roomy.strategy, crowded.strategy) == ("direct", "dedup")
    assert crowded.direct_s == pytest.approx(2 * roomy.direct_s)
    assert choose_strategy(*args, **kw).strategy == roomy.strategy  # cores unknown


def test_one_host_reads_directly_and_many_hosts_with_a_fast_exchange_dedup():
    one = choose_strategy(["h"] * 4, 100, [75] * 4, {"h": 100}, 2.0, 1.0)
    assert one.strategy == "direct"
    many = choose_strategy(list("abcd"), 400, [300] * 4, dict.fromkeys("abcd", 400), 2.0, 20.0)
    assert many.strategy == "dedup"
    slow = choose_strategy(list("abcd"), 400, [300] * 4, dict.fromkeys("abcd", 400), 2.0, 0.1)
    assert slow.strategy == "direct"
    with pytest.raises(ValueError, match="strategy"):
        choose_strategy(["h"], 1, [0], {"h": 1}, 1.0, 1.0, "fastest")


def _check_exact(reqs, outs, got):
    for r, rq in enumerate(reqs):
        for q, h in enumerate(rq):
            assert (got[r][q] == 1).all(), ("each requested element delivered once", r, h)
            assert np.array_equal(
                outs[r][q], data_for(ids(h.global_shape, h.key), h.offset, h.shape, h.flat)
            ), (r, h)


@settings(max_examples=25, **SET)
@given(
    jobs(max_world=8),
    st.integers(1, 12),
    st.sampled_from(["auto", "direct", "dedup"]),
    st.integers(1, 4),
    st.floats(0.05, 50),
)
def test_every_strategy_delivers_exactly(job, load_world, strategy, n_hosts, xg):
    world, tensors, rng = job
    plan, store = save_and_check(world, tensors, rng)
    reqs = requests_for(tensors, load_world, rng)
    hosts = [f"h{r % n_hosts}" for r in range(load_world)]
    works, costs = plan_load_auto(reqs, plan.tensors, hosts, LoadOptions(strategy), xg)
    assert strategy == "auto" or costs.strategy == strategy
    if costs.strategy == "direct":
        assert not any(w.sends or w.recvs for w in works)
        assert all(op.direct is not None for w in works for op in w.reads)
    outs, got, _ = execute_load(store, plan.tensors, reqs, works)
    _check_exact(reqs, outs, got)
    needed = sum(1 for rq in reqs for h in rq for _ in holding_pieces(h))
    assert needed == 0 or any(w.reads for w in works)


def test_direct_plan_reads_only_what_each_rank_asks():
    from .test_planner import H
    from shardpoint.planning.planner import TensorLayout

    lay = {"w": TensorLayout("w", (8, 4), "float32", (2, 4))}
    works = plan_load_direct([[H((0, 1), (8, 1))], [H((0, 2), (8, 2))]], lay)
    assert [len(w.reads) for w in works] == [4, 4]
    assert {op.shape for op in works[1].reads} == {(2, 2)}
    assert sl((0, 0), (0, 1), (2, 1)) == (slice(0, 2), slice(1, 2))


# ------------------------------------------------------------------------ real gloo ranks
SHAPE = (48, 20)


def _full(i):
    return counting(SHAPE, i)


def _save_rows(rank, world, path):
    n = SHAPE[0] // world
    st_ = {
        f"t{i}": sp.ShardedTensor(_full(i)[rank * n : (rank + 1) * n].clone(), SHAPE, (rank * n, 0))
        for i in range(3)
    }
    st_["b"] = sp.ShardedTensor(
        _full(9)[rank * n : (rank + 1) * n].to(torch.bfloat16).clone(), SHAPE, (rank * n, 0)
    )
    sp.save(st_, path, overwrite=True)


def _rows_then_cols(rank, world, path):
    _save_rows(rank, world, path)
    bad = []
    a, b = rank * SHAPE[1] // world, (rank + 1) * SHAPE[1] // world
    # auto on one host with a core per rank, forced, on three "hosts", and on one host
    # whose ranks outnumber its cores (they share the memory work: one read each wins)
    for strategy, host, cores in (
        ("auto", None, 64),
        ("dedup", None, None),
        ("direct", None, None),
        ("auto", f"host{rank}", None),
        ("auto", None, 1),
    ):
        like = {
            f"t{i}": sp.ShardedTensor(torch.empty(SHAPE[0], b - a), SHAPE, (0, a)) for i in range(3)
        }
        like["b"] = sp.ShardedTensor(
            torch.empty(SHAPE[0], b - a, dtype=torch.bfloat16), SHAPE, (0, a)
        )
        rep = sp.LoadReport()
        out = sp.load(
            path,
            like=like,
            report=rep,
            options=sp.LoadOptions(strategy, host_id=host, exchange_gbps=50.0, host_cores=cores),
        )
        want = {f"t{i}": _full(i)[:, a:b] for i in range(3)}
        want["b"] = _full(9).to(torch.bfloat16)[:, a:b]
        for k, w in want.items():
            if not same_bits(out[k], w):
                bad.append((strategy, host, k))
        bad.append((strategy, host, rep.strategy, rep.exchange_bytes))
    return bad


def test_column_loads_of_a_row_checkpoint_are_exact_under_every_strategy(tmp_path):
    res = run_world(3, _rows_then_cols, str(tmp_path / "rows"), timeout=180)
    for rank_res in res:
        assert [r for r in rank_res if len(r) == 3] == [], rank_res
        assert [r[2] for r in rank_res] == ["direct", "dedup", "direct", "dedup", "dedup"], rank_res
    sent = [[r[3] for r in rank_res] for rank_res in res]
    assert [sum(x) > 0 for x in zip(*sent)] == [False, True, False, True, True], sent
