"""The coordinator's regions found from the gathered units (each distinct run of holding rows
once, with the ranks holding it) against the same regions found from every row: the same
regions, numbered alike, with the same holders in the same order, so the save and load plans
built on them are the very same. Pure: no processes, no storage."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
from hypothesis import event, given, settings
import hypothesis.strategies as st

from shardpoint.planning.columns import Gathered, Regions, as_columns
from shardpoint_core.format.errors import InvalidShardingError
from shardpoint.planning.planner import LocalPlan, plan_save

from .test_planner import SET, jobs, local_plans

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks")
)
import plan_scale as bench  # noqa: E402


def gathered_as_sent(plans) -> Gathered:
    """What plan_save gathers: the parts form, decoded with one cache (each distinct blob
    one object, as the deduplicating gather delivers it)."""
    cache: dict = {}
    decoded = [LocalPlan.from_parts(p.to_parts(), cache) for p in plans]
    return Gathered([lp.rank for lp in decoded], [as_columns(lp.holdings) for lp in decoded])


def same_regions(g: Gathered) -> None:
    main = np.ones(g.n, bool)
    for c in g.rep:
        main &= c == 0
    assert g.main_rows().tolist() == main.tolist()
    a = Regions(g, units=True)
    b = Regions(g, units=False)
    assert a.start.tolist() == b.start.tolist()
    assert a.hold_rank.tolist() == b.hold_rank.tolist()
    assert a.hold_hidx.tolist() == b.hold_hidx.tolist()
    assert a._rows.tolist() == b._rows.tolist()
    assert a.by_key == b.by_key
    assert [a.region(i) for i in range(len(a.start) - 1)] == [
        b.region(i) for i in range(len(b.start) - 1)
    ]


def replicated(plans, copies: int, rng: random.Random, main_copies: bool = False) -> list:
    """The job's ranks, each repeated ``copies`` times as data-parallel replicas (same
    holdings and order, the copies with non-zero replica ids, or all-zero ones with
    ``main_copies``): shared units."""
    out = []
    for c in range(copies):
        for p in plans:
            hs = [
                h._replace(replica=(0 if main_copies else c + 1,)) if c else h for h in p.holdings
            ]
            out.append(LocalPlan(len(out), p.tree, hs, []))
    rng.shuffle(out)  # gathered in any order, planned by rank
    return sorted(out, key=lambda lp: lp.rank)


@settings(max_examples=80, **SET)
@given(jobs(max_world=12), st.integers(1, 4))
def test_units_give_the_regions_every_row_gives(job, copies):
    """Random layouts (replicas, flattened ranges, uneven shards, empty pieces), as sent and
    with data-parallel copies sharing their runs."""
    world, tensors, rng = job
    plans, _ = local_plans(world, tensors, rng)
    for ps in (plans, replicated(plans, copies, rng)):
        g = gathered_as_sent(ps)
        same_regions(g)
        event(f"units: {g.units is not None}")
    # copies holding their regions as the main replica too: both ways reject the same
    # region ([SP-REPL-2]) where a region has a non-empty main holder to copy
    if copies > 1:
        g = gathered_as_sent(replicated(plans, copies, rng, main_copies=True))
        errs = []
        for units in (True, False):
            try:
                Regions(g, units=units)
                errs.append(None)
            except InvalidShardingError as e:
                errs.append(str(e))
        assert errs[0] == errs[1]
        event(f"two mains rejected: {errs[0] is not None}")


def test_units_on_a_megatron_like_job_are_shared_and_plan_alike():
    """TP x PP x DP with a distributed optimizer: the model's runs are shared by the DP ranks
    (far fewer unit rows than rows), and the save plan is the one built from every row."""
    plans = bench.build_job(2, 2, 8, 4, 6, 13, even=True)
    g = gathered_as_sent(plans)
    ucat, urow = g.units
    assert len(ucat[0]) < len(urow) / 2
    same_regions(g)
    pa = plan_save([LocalPlan.from_parts(p.to_parts(), {}) for p in plans])
    pb = plan_save(plans)  # columns built in this process: one unit per rank
    assert pa.tensors == pb.tensors and pa.stats == pb.stats
    assert [(w.writes, w.sends, w.recvs) for w in pa.ranks] == [
        (w.writes, w.sends, w.recvs) for w in pb.ranks
    ]
    assert np.array_equal(Regions(g).hold_rank, Regions(g, units=False).hold_rank)
