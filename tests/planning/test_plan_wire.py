"""Local plans on the wire: large jobs compress the holding columns, small ones do not, and the
coordinator reads both forms to the same holdings and the same save plan."""
import os
import sys

import msgpack

from shardpoint.planning.columns import COMPRESS_FROM_WORLD, HoldingColumns
from shardpoint.planning.planner import LocalPlan, plan_save

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))
import plan_scale as bench  # noqa: E402


def test_large_jobs_compress_the_columns_and_both_forms_decode_alike():
    plans = bench.build_job(2, 2, 3, 4, 6, 13)
    small = [p.to_bytes(len(plans)) for p in plans]
    large = [p.to_bytes(COMPRESS_FROM_WORLD) for p in plans]
    tags = {msgpack.unpackb(msgpack.unpackb(b)[2])[0] for b in small} | \
        {msgpack.unpackb(msgpack.unpackb(b)[2])[0] for b in large}
    assert tags == {"cols2", "cols3"}
    assert sum(map(len, large)) < sum(map(len, small))
    for a, b, p in zip(small, large, plans):
        ha, hb = LocalPlan.from_bytes(a).holdings, LocalPlan.from_bytes(b).holdings
        assert list(ha) == list(hb) == list(p.holdings)
    pa = plan_save([LocalPlan.from_bytes(b) for b in small])
    pb = plan_save([LocalPlan.from_bytes(b) for b in large])
    assert pa.tensors == pb.tensors and pa.stats == pb.stats and pa.tree == pb.tree
    assert [(w.writes, w.sends, w.recvs) for w in pa.ranks] == \
        [(w.writes, w.sends, w.recvs) for w in pb.ranks]


def test_columns_round_trip_compressed_or_not():
    cols = HoldingColumns.from_holdings(bench.build_job(2, 1, 2, 2, 4, 9)[1].holdings)
    for compress in (False, True):
        assert list(HoldingColumns.from_wire(cols.to_wire(compress))) == list(cols)
