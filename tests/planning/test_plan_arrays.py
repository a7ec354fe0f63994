"""The array planners (load work as integer tables, writers elected with numpy) against the
planners they replaced (tests/planning/planner_reference.py): on random jobs they must read, write,
deliver and move exactly the same things; only which replica does the work may differ.
Pure: no processes, no storage (the real multi-rank loads through the tables run in
test_distributed.py and test_load_strategy.py)."""

from __future__ import annotations

import math
import random
from collections import Counter

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from shardpoint.planning.load_dedup import _group_max, encode_global, work_from_global
from shardpoint.planning.load_planner import encode_works, plan_load, plan_load_direct
from shardpoint.tree.model import Holding
from shardpoint.planning.planner import PlanOptions, RankLoadWork, TensorLayout, plan_save
from shardpoint.planning.plans import RankSaveWork, Transfer
from shardpoint.planning.save_global import encode_save_global, layouts_of, save_work_from_global

from .planner_reference import reference_direct_host_bytes, reference_plan_load, reference_plan_save
from .test_planner import SET, check_exchange_symmetry, jobs, local_plans, requests_for


def deliveries(works) -> Counter:
    """What each rank gets into which (request, piece): (rank, request, piece, key, box)."""
    out: Counter = Counter()
    for r, w in enumerate(works):
        for op in w.reads:
            if op.direct is not None:
                out[(r, *op.direct, op.key, op.offset, op.shape)] += 1
            for q, p, bo, bs in op.local:
                out[(r, q, p, op.key, bo, bs)] += 1
        for t in w.recvs:
            out[(t.dst, *t.dst_ref, t.key, t.box_offset, t.box_shape)] += 1
    return out


def read_regions(works) -> Counter:
    return Counter((op.key, op.offset, op.shape) for w in works for op in w.reads)


@settings(max_examples=60, **SET)
@given(jobs(max_world=16), st.integers(1, 48))
def test_load_tables_deliver_what_the_object_planner_delivered(job, load_world):
    world, tensors, rng = job
    plans, _ = local_plans(world, tensors, rng)
    plan = plan_save(
        plans,
        PlanOptions(
            chunk_overhead_bytes=rng.choice([0, 64]), max_chunk_bytes=rng.choice([32, 256 << 20])
        ),
    )
    reqs = requests_for(tensors, load_world, rng)
    new = plan_load(reqs, plan.tensors)
    old = reference_plan_load(reqs, plan.tensors)
    assert len(new) == len(old) == load_world
    check_exchange_symmetry(new)
    assert read_regions(new) == read_regions(old)  # the same reads, each once
    assert deliveries(new) == deliveries(old)  # the same bytes to the same places
    assert sum(len(w.reads) for w in new) == sum(len(w.reads) for w in old)

    # the cost model's figures, computed on the tables, match the objects (how much is
    # received depends on who reads: a reader's own repeated requests are local copies)
    def recv_bytes(works):
        recv = [0] * load_world
        for w in works:
            for t in w.recvs:
                recv[t.dst] += math.prod(t.box_shape) * _itemsize(plan.tensors[t.key].dtype)
        return recv

    assert new.recv_bytes == recv_bytes(new)
    assert new.read_bytes == sum(
        math.prod(op.shape) * _itemsize(plan.tensors[op.key].dtype) for w in old for op in w.reads
    )
    # the direct strategy's per-host bytes, from the tables, as the per-holding loop had them
    hosts = [f"h{rng.randrange(3)}" for _ in range(load_world)]
    got = new.direct_host_bytes(hosts)
    want = reference_direct_host_bytes(reqs, plan.tensors, hosts)
    assert {h: b for h, b in got.items() if b} == {h: b for h, b in want.items() if b}
    # hosts of consecutive ranks (reduced from the per-rank grouping without a second sort),
    # and one host per rank (the per-rank figures)
    per = rng.randint(1, 4)
    hosts = [f"h{r // per}" for r in range(load_world)]
    assert new.direct_host_bytes(hosts) == {
        h: b for h, b in reference_direct_host_bytes(reqs, plan.tensors, hosts).items()
    }
    want = reference_direct_host_bytes(reqs, plan.tensors, [str(r) for r in range(load_world)])
    assert new.direct_rank_bytes() == [want.get(str(r), 0) for r in range(load_world)]
    # every rank's message, encoded in one pass, decodes to the rank's own tables
    wires = encode_works(new, plan.tensors)
    for r, (w, b) in enumerate(zip(new, wires)):
        back = RankLoadWork.from_bytes(b, plan.tensors)
        assert back.rank == r
        assert (back.reads, back.sends, back.recvs) == (w.reads, w.sends, w.recvs)
        assert RankLoadWork.from_bytes(w.to_bytes(plan.tensors), plan.tensors).recvs == w.recvs
        again = RankLoadWork.from_ops(r, w.reads, w.sends, w.recvs)
        assert (again.reads, again.sends, again.recvs) == (w.reads, w.sends, w.recvs)


def _tables(w: RankLoadWork) -> list:
    return [w.read_rows.tolist(), w.local_rows.tolist(), w.send_rows.tolist(), w.recv_rows.tolist()]


@settings(max_examples=80, **SET)
@given(jobs(max_world=16), st.integers(1, 40), st.booleans())
def test_each_rank_cuts_from_the_global_plan_exactly_its_per_rank_message(
    job, load_world, resharded
):
    """The dedup plan broadcast whole (encode_global), each rank cutting its own work
    (work_from_global), gives every rank the very tables of the per-rank message the
    coordinator used to send: replicas (same-layout load), flattened ranges, uneven shards,
    and random resharded requests."""
    world, tensors, rng = job
    plans, _ = local_plans(world, tensors, rng)
    plan = plan_save(
        plans,
        PlanOptions(
            chunk_overhead_bytes=rng.choice([0, 64]), max_chunk_bytes=rng.choice([32, 256 << 20])
        ),
    )
    if resharded:
        reqs = requests_for(tensors, load_world, rng)
    else:  # every rank asks for what it saved: data-parallel replicas read once
        reqs = [
            [
                Holding(h.key, h.dtype, h.global_shape, h.offset, h.shape, h.flat, (0,))
                for h in lp.holdings
            ]
            for lp in plans
        ]
    works = plan_load(reqs, plan.tensors)
    g = encode_global(works, plan.tensors)
    for r, b in enumerate(encode_works(works, plan.tensors)):
        want = RankLoadWork.from_bytes(b, plan.tensors)
        got = work_from_global(g, r, plan.tensors)
        assert (got.rank, got.D) == (want.rank, want.D)
        assert _tables(got) == _tables(want)
        assert (got.reads, got.sends, got.recvs) == (want.reads, want.sends, want.recvs)


def _itemsize(name: str) -> int:
    from shardpoint.tree import dtypes

    return dtypes.from_name(name).itemsize


@settings(max_examples=60, **SET)
@given(jobs(max_world=24))
def test_save_writers_elected_on_arrays_write_and_move_what_the_greedy_planner_did(job):
    world, tensors, rng = job
    plans, _ = local_plans(world, tensors, rng)
    opts = PlanOptions(
        chunk_overhead_bytes=rng.choice([0, 16, 256 << 10]),
        max_chunk_bytes=rng.choice([32, 256 << 20]),
    )
    new = plan_save(plans, opts)
    old_tensors, old_ranks, old_stats = reference_plan_save(plans, opts)
    assert new.tensors == old_tensors
    for k in ("chunks", "exchange_bytes", "unique_bytes", "tensors", "world_size"):
        assert new.stats[k] == old_stats[k], k
    chunks = Counter((c.key, c.offset, c.shape) for w in new.ranks for c in w.writes)
    assert chunks == Counter((c.key, c.offset, c.shape) for w in old_ranks for c in w.writes)
    assert sorted(k for w in new.ranks for k in w.create) == sorted(
        k for w in old_ranks for k in w.create
    )
    # a writer always holds the most of its chunk: what it lacks is what moves. The bytes
    # moved match the greedy planner's; how many pieces carry them may differ (another
    # holder of the same chunk can hold its part in fewer flattened pieces).
    moved = sum(
        math.prod(t.box_shape) * _itemsize(new.tensors[t.key].dtype)
        for w in new.ranks
        for t in w.sends
    )
    assert moved == new.stats["exchange_bytes"]
    check_exchange_symmetry(new.ranks)


def test_replicated_chunks_are_dealt_evenly_and_busy_ranks_last():
    """Eight replicas of a tensor of 16 chunks plus one rank that already writes a big
    tensor alone: every replica writes two chunks, except that the busy one writes fewer."""
    H = Holding
    plans = []
    from shardpoint.planning.planner import LocalPlan

    for r in range(8):
        hs = [H("w", "float32", (16, 4), (0, 0), (16, 4), None, (r,))]
        if r == 3:
            hs.append(H("big", "float32", (64, 64), (0, 0), (64, 64), None, (0,)))
        plans.append(LocalPlan(r, {"dict": []}, hs, []))
    plan = plan_save(plans, PlanOptions(max_chunk_bytes=16, chunk_overhead_bytes=0))
    per = [sum(1 for c in w.writes if c.key == "w") for w in plan.ranks]
    assert sum(per) == 16
    assert per[3] == min(per) and max(per) - min(per) <= 2 + 1


def test_direct_load_work_is_tables_too():
    lay = {"w": TensorLayout("w", (8, 4), "float32", (2, 4))}
    works = plan_load_direct([[Holding("w", "float32", (8, 4), (0, 1), (8, 2), None, (0,))]], lay)
    w = RankLoadWork.from_bytes(encode_works(works, lay)[0], lay)
    assert [(op.offset, op.shape, op.direct) for op in w.reads] == [
        ((i, 1), (2, 2), (0, 0)) for i in range(0, 8, 2)
    ]
    assert w.sends == w.recvs == []


def test_transfers_keep_their_named_fields():
    t = Transfer(0, 1, "w", (0,), (2,), (3,), (4, 5))
    w = RankLoadWork.from_ops(0, [], [t], [])
    assert w.sends == [t] and w.sends[0].dst_ref == (4, 5)


def test_thousands_of_data_parallel_replicas_share_the_reads():
    """2,048 ranks asking for the same 64 chunks: each chunk read once, by distinct ranks,
    and every other rank receives it (the shape of a data-parallel load)."""
    lay = {"w": TensorLayout("w", (64, 4), "float32", (1, 4))}
    reqs = [[Holding("w", "float32", (64, 4), (0, 0), (64, 4), None, (0,))]] * 2048
    works = plan_load(reqs, lay)
    reads = [len(w.read_rows) for w in works]
    assert sum(reads) == 64 and max(reads) == 1
    assert sum(len(w.recv_rows) for w in works) == 64 * 2047
    assert works.recv_bytes == [(64 - reads[r]) * 16 for r in range(2048)]
    rng = random.Random(0)
    for r in rng.sample(range(2048), 3):
        assert len(works[r].recvs) + len(works[r].reads) == 64


_SEEN: set = set()


@settings(max_examples=80, **SET)
@given(jobs(max_world=16))
def test_each_rank_cuts_from_the_global_save_plan_exactly_its_per_rank_reply(job):
    """The save plan broadcast whole (encode_save_global), each rank cutting its own work
    (save_work_from_global), gives every rank the very work, layouts, stats and staging
    path its per-rank reply carried: replicas, flattened ranges, uneven shards, empty
    arrays, chunks assembled from local copies and transfers."""
    world, tensors, rng = job
    plans, _ = local_plans(world, tensors, rng)
    # chunks bigger than a piece (a large overhead) give local copies and transfers
    plan = plan_save(
        plans,
        PlanOptions(
            chunk_overhead_bytes=rng.choice([0, 64, 1 << 20]),
            max_chunk_bytes=rng.choice([32, 256 << 20]),
        ),
    )
    _SEEN.update(
        k
        for k, n in (
            ("send", sum(len(w.sends) for w in plan.ranks)),
            ("local", sum(len(c.local) for w in plan.ranks for c in w.writes)),
            ("direct", sum(c.direct is not None for w in plan.ranks for c in w.writes)),
        )
        if n
    )
    lay = layouts_of(plan.tensors)
    g = encode_save_global(plan.columns, lay, plan.stats, "stage/x")
    for r, want in enumerate(plan.ranks):
        want = RankSaveWork.from_bytes(want.to_bytes())  # as the per-rank reply arrived
        staging, layouts, stats, got = save_work_from_global(g, r)
        assert (staging, stats) == ("stage/x", plan.stats)
        assert layouts == lay
        assert got.writes == want.writes
        assert got.sends == want.sends and got.recvs == want.recvs
        assert got.create == want.create
        # and the objects the coordinator built, before their wire round trip
        assert (got.sends, got.recvs, got.create) == (
            plan.ranks[r].sends,
            plan.ranks[r].recvs,
            plan.ranks[r].create,
        )
        assert [(c.key, c.offset, c.shape, c.direct, list(c.local)) for c in got.writes] == [
            (c.key, c.offset, c.shape, c.direct, list(c.local)) for c in plan.ranks[r].writes
        ]


def test_the_save_cut_property_saw_transfers_local_copies_and_direct_writes():
    """The property above ran on plans with each kind of work (run after it)."""
    if not _SEEN:
        test_each_rank_cuts_from_the_global_save_plan_exactly_its_per_rank_reply()
    assert _SEEN == {"send", "local", "direct"}


def _group_max_packed(key, val):
    """The packed-integer sort ``_group_max`` used before it took a stable sort (kept here as
    the reference its replacement is compared with)."""
    n = len(key)
    nb = max(1, (n - 1).bit_length())
    packed = (key << nb) | np.arange(n, dtype=np.int64)
    packed.sort()
    ks, o = packed >> nb, packed & ((1 << nb) - 1)
    cut = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))
    return ks[cut], np.maximum.reduceat(val[o], cut)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 1000)), min_size=1, max_size=60),
    st.booleans(),
)
def test_group_max_by_stable_sort_equals_the_packed_sort_and_a_dict(pairs, presorted):
    """The per-key maxima of the direct-read pairs: distinct keys ascending and each key's
    largest value, with repeated keys and without, sorted input and not."""
    if presorted:
        pairs = sorted(pairs)
    key = np.array([k for k, _ in pairs], np.int64)
    val = np.array([v for _, v in pairs], np.int64)
    ref: dict = {}
    for k, v in pairs:
        ref[k] = max(ref.get(k, v), v)
    ks, best = _group_max(key, val)
    assert ks.tolist() == sorted(ref) and best.tolist() == [ref[k] for k in sorted(ref)]
    old_k, old_b = _group_max_packed(key, val)
    assert ks.tolist() == old_k.tolist() and best.tolist() == old_b.tolist()
    assert ks.dtype == old_k.dtype and best.dtype == old_b.dtype


def test_group_max_of_nothing_is_empty():
    ks, best = _group_max(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(ks) == 0 and len(best) == 0
