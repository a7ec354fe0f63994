"""Local plans on the wire: large jobs compress the holding columns, small ones do not, and the
coordinator reads both forms to the same holdings and the same save plan; the parts form (what
save() and load() gather, identical blobs once) decodes to the same plan."""

import os
import sys

import msgpack
import pytest

from shardpoint.planning.columns import COMPRESS_FROM_WORLD, HoldingColumns
from shardpoint.planning.planner import LocalPlan, plan_save
from shardpoint.tree.model import Holding

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks")
)
import plan_scale as bench  # noqa: E402


def test_large_jobs_compress_the_columns_and_both_forms_decode_alike():
    plans = bench.build_job(2, 2, 3, 4, 6, 13)
    small = [p.to_bytes(len(plans)) for p in plans]
    large = [p.to_bytes(COMPRESS_FROM_WORLD) for p in plans]
    tags = {msgpack.unpackb(msgpack.unpackb(b)[2])[0] for b in small} | {
        msgpack.unpackb(msgpack.unpackb(b)[2])[0] for b in large
    }
    assert tags == {"cols2", "cols3"}
    assert sum(map(len, large)) < sum(map(len, small))
    for a, b, p in zip(small, large, plans):
        ha, hb = LocalPlan.from_bytes(a).holdings, LocalPlan.from_bytes(b).holdings
        assert list(ha) == list(hb) == list(p.holdings)
    pa = plan_save([LocalPlan.from_bytes(b) for b in small])
    pb = plan_save([LocalPlan.from_bytes(b) for b in large])
    assert pa.tensors == pb.tensors and pa.stats == pb.stats and pa.tree == pb.tree
    assert [(w.writes, w.sends, w.recvs) for w in pa.ranks] == [
        (w.writes, w.sends, w.recvs) for w in pb.ranks
    ]


def test_columns_round_trip_compressed_or_not():
    cols = HoldingColumns.from_holdings(bench.build_job(2, 1, 2, 2, 4, 9)[1].holdings)
    for compress in (False, True):
        assert list(HoldingColumns.from_wire(cols.to_wire(compress))) == list(cols)


def test_parts_decode_to_the_same_plan_and_share_identical_blobs():
    """The parts form (what save() gathers): the same holdings, tree and objects, and so the
    same save plan; data-parallel ranks' model runs are one blob, decoded once."""
    from shardpoint.exchange import dedup

    plans = bench.build_job(2, 2, 3, 4, 6, 13)
    parts = [p.to_parts() for p in plans]
    cache: dict = {}
    decoded = [LocalPlan.from_parts(p, cache) for p in parts]
    for d, p in zip(decoded, plans):
        assert list(d.holdings) == list(p.holdings)
        assert d.decoded_tree() == p.tree and d.rank == p.rank
        assert d.objects == [tuple(o) for o in p.objects]
    pa = plan_save(decoded)
    pb = plan_save([LocalPlan.from_bytes(p.to_bytes()) for p in plans])
    assert pa.tensors == pb.tensors and pa.stats == pb.stats and pa.tree == pb.tree
    assert [(w.writes, w.sends, w.recvs) for w in pa.ranks] == [
        (w.writes, w.sends, w.recvs) for w in pb.ranks
    ]
    # DP ranks (TP 2 x PP 2 x DP 3: rank = t + 2 * (d + 3 * s)) differ in replica ids only
    # on the model's rows: their model run is one blob and its replica column a constant
    dp0, dp1 = parts[0], parts[2]
    assert dp0[0] != dp1[0] and set(dp0[1:]) & set(dp1[1:])
    blobs = {dedup.digest(b) for p in parts for b in p[1:]}
    assert len(blobs) < sum(len(p) - 1 for p in parts) / 2
    assert len(cache) <= len(blobs)


def test_parts_of_awkward_holdings_round_trip():
    """Interleaved key groups, varying replica ids inside a run, no holdings at all."""
    hs = [
        Holding("optim/a", "float32", (8,), (0,), (8,), (0, 4), (1,)),
        Holding("model/a", "bfloat16", (4, 6), (0, 0), (2, 6), None, (0,)),
        Holding("model/b", "int8", (5,), (0,), (5,), None, (3,)),
        Holding("optim/a", "float32", (8,), (0,), (8,), (4, 8), (0, 2)),
        Holding("rng/x", "uint64", (), (), (), None, ()),
    ]
    for h in (hs, hs[:1], []):
        cols = HoldingColumns.from_holdings(h)
        meta, blobs = cols.to_parts()
        assert list(HoldingColumns.from_parts(meta, blobs)) == list(h)
    meta, blobs = HoldingColumns.from_holdings(hs).to_parts()
    assert len(meta[5]) == 4  # optim / model / optim / rng: four runs
    with pytest.raises(ValueError):
        HoldingColumns.from_parts(meta, blobs[:-1])
    with pytest.raises(ValueError):
        HoldingColumns.from_parts(["cols3", *meta[1:]], blobs)


def test_save_work_wire_lists_each_write_and_transfer_field_by_field():
    """RankSaveWork.to_bytes packs its named tuples as they are: the wire must stay the
    field-by-field rows ([key, offset, shape, direct, local] and [src, dst, key, box offset,
    box shape, src ref, dst ref]) that every reader of it expects."""
    plan = plan_save(bench.build_job(2, 2, 3, 4, 6, 13))
    moved = 0

    def rows(x):  # as msgpack gives lists back
        return msgpack.unpackb(msgpack.packb(x))

    for w in plan.ranks:
        writes, sends, recvs, create = msgpack.unpackb(w.to_bytes())
        assert writes == rows([[c.key, c.offset, c.shape, c.direct, c.local] for c in w.writes])
        for got, ts in ((sends, w.sends), (recvs, w.recvs)):
            assert got == rows(
                [[t.src, t.dst, t.key, t.box_offset, t.box_shape, t.src_ref, t.dst_ref] for t in ts]
            )
            moved += len(ts)
        assert create == list(w.create)
    assert moved and any(w.writes for w in plan.ranks)
