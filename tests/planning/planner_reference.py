"""The planners as they were before planning moved to arrays (commit d1cbe93): greedy, one
Python object per transfer. Kept as the model the array planners are checked against
(tests/planning/test_plan_arrays.py); not used by the library."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from shardpoint.tree import dtypes
from shardpoint.planning.columns import Gathered, Regions, as_columns
from shardpoint_core.format.coverage import check_exact_cover
from shardpoint.planning.grid import chunk_parts, plan_chunk_grid
from shardpoint.planning.load_planner import check_request
from shardpoint.tree.model import Holding, holding_pieces
from shardpoint.planning.plans import ChunkWrite, PlanOptions, ReadOp, TensorLayout, Transfer


@dataclass
class OldLoadWork:
    reads: list = field(default_factory=list)
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)


@dataclass
class OldSaveWork:
    writes: list = field(default_factory=list)
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)
    create: list = field(default_factory=list)


def _describe(ranks):
    return "rank " + "/".join(str(r) for r in list(ranks)[:4])


def reference_plan_load(requests, layouts):
    world = len(requests)
    out = [OldLoadWork() for _ in range(world)]
    read_bytes = [0] * world

    def check(e0: tuple, e: tuple, _r0: int, _r: int) -> None:
        for key, dtype, shape in (e0, e):
            check_request(Holding(key, dtype, shape, (), (), None, (0,)), layouts[key])

    gathered = Gathered(range(world), [as_columns(rq) for rq in requests], check)
    entries = gathered.keys
    for e in entries:
        check(e, e, 0, 0)
    regions = Regions(gathered, check_replicas=False)
    patterns: dict = {}
    recvs: list = []  # every transfer, in plan order
    recv_dst: list = []  # its destination
    for k in sorted(range(len(entries)), key=lambda i: entries[i][0]):
        key, dtype, shape = entries[k]
        lay = layouts[key]
        chunk, itemsize = lay.chunk_shape, dtypes.from_name(lay.dtype).itemsize
        gis, sig = regions.by_key.get(k, ([], b""))
        pkey = (shape, chunk, sig)
        chunks = patterns.get(pkey)
        if chunks is None:
            regs = [regions.region(gi)[1:] for gi in gis]
            pieces = [holding_pieces(Holding(key, dtype, shape, o, s, f, (0,))) for o, s, f in regs]
            chunks = patterns[pkey] = chunk_parts(shape, chunk, pieces)
        need = [regions.holder_lists(gi) for gi in gis]  # (ranks ascending, requests)
        refs: dict = {}
        for _coff, _cshp, parts in chunks:
            if len(parts) == 1:
                ri, pi, lo, rshape, n = parts[0]
                rl, ql = need[ri]
                reader = rl[0] if len(rl) == 1 else min(rl, key=read_bytes.__getitem__)
            else:
                want: dict = {}
                for ri, _pi, _bo, _bs, n in parts:
                    for r in need[ri][0]:
                        want[r] = want.get(r, 0) + n
                top = max(want.values())
                cand = [r for r, v in want.items() if v == top]
                reader = cand[0] if len(cand) == 1 else min(cand, key=lambda r: (read_bytes[r], r))
                nd = len(shape)
                lo = tuple(min(p[2][d] for p in parts) for d in range(nd))
                rshape = tuple(max(p[2][d] + p[3][d] for p in parts) - lo[d] for d in range(nd))
            read_bytes[reader] += math.prod(rshape) * itemsize
            work = out[reader]
            op = ReadOp(key, lo, rshape)
            src_ref = (len(work.reads),)
            work.reads.append(op)
            if len(parts) == 1 and len(need[parts[0][0]][0]) == 1:
                op.direct = (need[parts[0][0]][1][0], parts[0][1])
                continue
            for ri, pi, bo, bs, _n in parts:
                rl, ql = need[ri]
                j0, j1 = bisect_left(rl, reader), bisect_right(rl, reader)
                if j1 > j0:
                    op.local.extend((q, pi, bo, bs) for q in ql[j0:j1])
                    if len(rl) == j1 - j0:
                        continue
                    rl, ql = rl[:j0] + rl[j1:], ql[:j0] + ql[j1:]
                # (request, piece) refs repeat across ranks of one layout: share them, so a
                # million transfers do not bring a million more objects for the GC to scan.
                drefs = map(refs.setdefault, zip(ql, repeat(pi)), zip(ql, repeat(pi)))
                ts = list(
                    map(
                        Transfer._make,
                        zip(
                            repeat(reader),
                            rl,
                            repeat(key),
                            repeat(bo),
                            repeat(bs),
                            repeat(src_ref),
                            drefs,
                        ),
                    )
                )
                work.sends.extend(ts)
                recvs.extend(ts)
                recv_dst.extend(rl)
    # Each rank receives in plan order: one stable sort by destination instead of an append
    # per transfer.
    order = np.argsort(np.array(recv_dst, np.int64), kind="stable").tolist()
    ordered = list(map(recvs.__getitem__, order))
    counts = np.bincount(np.array(recv_dst, np.int64), minlength=world).tolist()
    pos = 0
    for w, c in zip(out, counts):
        w.recvs = ordered[pos : pos + c]
        pos += c
    return out


def _plan_pattern(key, dtype, shape, itemsize, regions, holder_ranks, opts):
    """Coverage check ([SP-COVER-1..3]) and chunk grid ([SP-GRID-1]) of one tensor."""
    pieces = [holding_pieces(Holding(key, dtype, shape, o, s, f, (0,))) for o, s, f in regions]
    boxes, owner = [], []
    for ri, ps in enumerate(pieces):
        for p in ps:
            boxes.append((p.offset, p.shape))
            owner.append(ri)
    check_exact_cover(shape, boxes, lambda i: _describe(holder_ranks(owner[i])), key)
    blocks = [(o, s) for o, s, _ in regions if math.prod(s)]
    grid_regions = [([(p.offset, p.shape) for p in ps], ()) for ps in pieces]
    chunk = plan_chunk_grid(shape, itemsize, grid_regions, blocks, opts)
    chunks = []
    if math.prod(shape):
        chunks = [
            (coff, cshp, math.prod(cshp) * itemsize, parts)
            for coff, cshp, parts in chunk_parts(shape, chunk, pieces)
        ]
    return chunk, chunks


def reference_plan_save(local_plans, opts=PlanOptions()):
    local_plans = sorted(local_plans, key=lambda lp: lp.rank)
    world = len(local_plans)

    gathered = Gathered(
        [lp.rank for lp in local_plans], [as_columns(lp.holdings) for lp in local_plans]
    )
    regions = Regions(gathered)

    ranks = [OldSaveWork() for _ in range(world)]
    assigned = [0] * world  # bytes each rank writes
    sent = [0] * world
    tensors: dict = {}
    transfers: list = []
    moved_bytes = 0
    unique_bytes = 0
    patterns: dict = {}
    keys = gathered.keys

    for k in sorted(range(len(keys)), key=lambda i: keys[i][0]):
        key, dtype, shape = keys[k]
        itemsize = dtypes.from_name(dtype).itemsize
        gis, sig = regions.by_key.get(k, ([], b""))
        pkey = (shape, itemsize, sig)
        pat = patterns.get(pkey)
        if pat is None:
            regs = [regions.region(gi)[1:] for gi in gis]
            pat = patterns[pkey] = _plan_pattern(
                key,
                dtype,
                shape,
                itemsize,
                regs,
                lambda ri, gis=gis: regions.holders(gis[ri])[0].tolist(),
                opts,
            )
        tensors[key] = TensorLayout(key, shape, dtype, pat[0])
        unique_bytes += math.prod(shape) * itemsize
        if not math.prod(shape):
            ranks[gathered.first_rank[k]].create.append(key)
            continue
        hold = [regions.holder_lists(gi) for gi in gis]  # (ranks ascending, hidx)
        for coff, cshp, cbytes, parts in pat[1]:
            if len(parts) == 1:
                # One region covers the chunk: its holders tie; the least loaded one writes
                # (min keeps the first of equals, and holders are in rank order).
                ri, pi, bo, bs, _n = parts[0]
                hl, hh = hold[ri]
                if len(hl) == 1:
                    writer, j = hl[0], 0
                else:
                    writer = min(hl, key=assigned.__getitem__)
                    j = bisect_left(hl, writer)
                assigned[writer] += cbytes
                ranks[writer].writes.append(
                    ChunkWrite(key, coff, cshp, (hh[j], pi))
                    if bs == cshp
                    else ChunkWrite(key, coff, cshp, None, [(hh[j], pi, bo, bs)])
                )
                continue
            held: dict = {}
            for ri, _pi, _bo, _bs, n in parts:
                for r in hold[ri][0]:
                    held[r] = held.get(r, 0) + n
            top = max(held.values())
            cand = [r for r, v in held.items() if v == top]
            writer = cand[0] if len(cand) == 1 else min(cand, key=lambda r: (assigned[r], r))
            assigned[writer] += cbytes
            work = ranks[writer]
            cw = ChunkWrite(key, coff, cshp, None, [])
            widx = len(work.writes)
            for ri, pi, bo, bs, n in parts:
                hl, hh = hold[ri]
                j = bisect_left(hl, writer)
                if j < len(hl) and hl[j] == writer:
                    cw.local.append((hh[j], pi, bo, bs))
                    continue
                j = 0 if len(hl) == 1 else bisect_left(hl, min(hl, key=sent.__getitem__))
                nb = n * itemsize
                sent[hl[j]] += nb
                moved_bytes += nb
                transfers.append(Transfer(hl[j], writer, key, bo, bs, (hh[j], pi), (widx,)))
            work.writes.append(cw)

    for t in transfers:
        ranks[t.src].sends.append(t)
        ranks[t.dst].recvs.append(t)
    stats = {
        "world_size": world,
        "tensors": len(tensors),
        "unique_bytes": unique_bytes,
        "exchange_bytes": moved_bytes,
        "bytes_per_rank_max": max(assigned, default=0),
        "chunks": sum(len(w.writes) for w in ranks),
    }
    return tensors, ranks, stats


def reference_direct_host_bytes(requests, layouts, hosts):
    """host -> bytes under the direct strategy, one holding at a time (the old cost model)."""
    from collections import defaultdict
    from shardpoint.planning.grid import pieces_by_chunk

    per_host: dict = defaultdict(dict)
    for r, reqs in enumerate(requests):
        hb = per_host[hosts[r]]
        for h in reqs:
            lay = layouts[h.key]
            itemsize = dtypes.from_name(lay.dtype).itemsize
            per = pieces_by_chunk(lay.shape, lay.chunk_shape, [holding_pieces(h)])
            for cidx, parts in per.items():
                if not lay.shape:
                    n = itemsize
                else:
                    rows = sum(bs[0] for _, _, (_bo, bs) in parts)
                    cfull = [min(c, n - i * c) for c, n, i in zip(lay.chunk_shape, lay.shape, cidx)]
                    n = min(rows, cfull[0]) * math.prod(cfull[1:]) * itemsize
                hb[(h.key, cidx)] = max(hb.get((h.key, cidx), 0), n)
    return {k: sum(v.values()) for k, v in per_host.items()}
