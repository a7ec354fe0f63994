"""Load planning: which rank reads which region, and who sends what to whom ([SP-LOAD-2]).

Pure: requests (holdings per rank) and the stored layouts in, one ``RankLoadWork`` per rank
out. Each needed region is read from storage by exactly one rank and exchanged to the others.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

from . import dtypes
from .errors import LayoutMismatchError
from .grid import pieces_by_chunk
from .model import Holding, holding_pieces
from .plans import RankLoadWork, ReadOp, TensorLayout, Transfer


def check_request(h: Holding, layout: TensorLayout) -> None:
    """A request must match the stored tensor's global shape and dtype ([SP-LOAD-1])."""
    if h.global_shape != layout.shape or h.dtype != layout.dtype:
        raise LayoutMismatchError(
            f"key {h.key!r}: checkpoint has shape {layout.shape} dtype {layout.dtype}, the "
            f"target expects shape {h.global_shape} dtype {h.dtype}", spec_id="SP-LOAD-1")


def plan_load(requests: Sequence[Sequence[Holding]], layouts: dict) -> list:
    """Per-rank load work: each needed region is read from storage by exactly one rank
    (read dedup, balanced), then sent to every other rank that needs it ([SP-LOAD-2])."""
    world = len(requests)
    out = [RankLoadWork() for _ in range(world)]
    read_bytes = [0] * world
    by_key: dict = defaultdict(dict)   # key -> region -> (Holding, [(rank, request)])
    for r, reqs in enumerate(requests):
        for q, h in enumerate(reqs):
            g = by_key[h.key].get(h.region)
            if g is None:
                by_key[h.key][h.region] = g = (h, [])
            g[1].append((r, q))
    transfers: list = []
    for key in sorted(by_key):
        lay = layouts[key]
        shape, chunk = lay.shape, lay.chunk_shape
        itemsize = dtypes.from_name(lay.dtype).itemsize
        groups = list(by_key[key].values())
        for h, _needers in groups:
            check_request(h, lay)
        per_chunk = pieces_by_chunk(shape, chunk, [holding_pieces(h) for h, _ in groups])
        for cidx in sorted(per_chunk):
            parts = per_chunk[cidx]
            if len(parts) == 1:
                needers = groups[parts[0][0]][1]
                reader = needers[0][0] if len(needers) == 1 else \
                    min((r for r, _ in needers), key=read_bytes.__getitem__)
                lo, rshape = parts[0][2]
            else:
                need: dict = defaultdict(int)
                for gi, _pi, (bo, bs) in parts:
                    n = math.prod(bs)
                    for r, _q in groups[gi][1]:
                        need[r] += n
                reader = min(need, key=lambda r: (-need[r], read_bytes[r], r))
                lo = tuple(min(b[0][d] for *_, b in parts) for d in range(len(shape)))
                hi = tuple(max(b[0][d] + b[1][d] for *_, b in parts) for d in range(len(shape)))
                rshape = tuple(h_ - l_ for l_, h_ in zip(lo, hi))
            read_bytes[reader] += math.prod(rshape) * itemsize
            work = out[reader]
            op = ReadOp(key, lo, rshape)
            ridx = len(work.reads)
            if len(parts) == 1 and len(groups[parts[0][0]][1]) == 1:
                op.direct = (groups[parts[0][0]][1][0][1], parts[0][1])
            else:
                for gi, pi, (bo, bs) in parts:
                    for r, q in groups[gi][1]:
                        if r == reader:
                            op.local.append((q, pi, bo, bs))
                        else:
                            transfers.append(Transfer(reader, r, key, bo, bs, (ridx,), (q, pi)))
            work.reads.append(op)
    for t in transfers:
        out[t.src].sends.append(t)
        out[t.dst].recvs.append(t)
    return out
