"""Load planning: which rank reads which region, and who sends what to whom ([SP-LOAD-2]).

Pure: requests (holdings per rank) and the stored layouts in, one ``RankLoadWork`` per rank
out. Each needed region is read from storage by exactly one rank and exchanged to the others.
Requests are grouped into distinct regions with vectorised passes (:mod:`.columns`), and
tensors with the same shape, chunk grid and requested regions share their chunk geometry, so
the cost grows with distinct structure; what remains per chunk and per transfer is building
the plan itself.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from functools import partial
from itertools import repeat
from typing import Sequence

import numpy as np

from . import dtypes
from .columns import Gathered, Regions, as_columns, gc_paused
from .errors import LayoutMismatchError
from .grid import chunk_parts
from .model import Holding, holding_pieces
from .plans import RankLoadWork, ReadOp, TensorLayout, Transfer

_transfer = partial(tuple.__new__, Transfer)   # Transfer from a 7-tuple, at C speed


def check_request(h: Holding, layout: TensorLayout) -> None:
    """A request must match the stored tensor's global shape and dtype ([SP-LOAD-1])."""
    if h.global_shape != layout.shape or h.dtype != layout.dtype:
        raise LayoutMismatchError(
            f"key {h.key!r}: checkpoint has shape {layout.shape} dtype {layout.dtype}, the "
            f"target expects shape {h.global_shape} dtype {h.dtype}", spec_id="SP-LOAD-1")


def plan_load(requests: Sequence[Sequence[Holding]], layouts: dict) -> list:
    """Per-rank load work: each needed region is read from storage by exactly one rank
    (read dedup, balanced), then sent to every other rank that needs it ([SP-LOAD-2]).
    ``requests[r]``: rank ``r``'s holdings (a list, or :class:`~.columns.HoldingColumns`)."""
    with gc_paused():
        return _plan_load(requests, layouts)


def _plan_load(requests: Sequence[Sequence[Holding]], layouts: dict) -> list:
    world = len(requests)
    out = [RankLoadWork() for _ in range(world)]
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
    recvs: list = []        # every transfer, in plan order
    recv_dst: list = []     # its destination
    for k in sorted(range(len(entries)), key=lambda i: entries[i][0]):
        key, dtype, shape = entries[k]
        lay = layouts[key]
        chunk, itemsize = lay.chunk_shape, dtypes.from_name(lay.dtype).itemsize
        gis, sig = regions.by_key.get(k, ([], b""))
        pkey = (shape, chunk, sig)
        chunks = patterns.get(pkey)
        if chunks is None:
            regs = [regions.region(gi)[1:] for gi in gis]
            pieces = [holding_pieces(Holding(key, dtype, shape, o, s, f, (0,)))
                      for o, s, f in regs]
            chunks = patterns[pkey] = chunk_parts(shape, chunk, pieces)
        need = [regions.holder_lists(gi) for gi in gis]    # (ranks ascending, requests)
        refs: dict = {}
        for coff, cshp, parts in chunks:
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
                reader = cand[0] if len(cand) == 1 else \
                    min(cand, key=lambda r: (read_bytes[r], r))
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
                ts = list(map(_transfer, zip(repeat(reader), rl, repeat(key), repeat(bo),
                                             repeat(bs), repeat(src_ref), drefs)))
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
        w.recvs = ordered[pos:pos + c]
        pos += c
    return out
