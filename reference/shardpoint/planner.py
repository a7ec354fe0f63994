"""Save planning: pure functions from every rank's local plan to every rank's work.

Nothing here touches storage or a process group, so a job of thousands of ranks can be planned
(and property-tested) in one process. The flow of a save:
``LocalPlan`` per rank -> :func:`plan_save` (validate replica and coverage rules, choose each
tensor's chunk grid via :mod:`.grid`, elect one writer per chunk, schedule the exchange of
misaligned pieces) -> ``SavePlan`` holding one ``RankSaveWork`` per rank. Loads are planned in
:mod:`.load_planner`; the plan types live in :mod:`.plans`. This module re-exports both so
``shardpoint.planner`` stays the one import path for planning.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from typing import Any, NamedTuple, Sequence

from . import dtypes
from .columns import Gathered, Regions, as_columns, gc_paused
from .coverage import check_exact_cover
from .errors import InvalidShardingError
from .grid import chunk_parts, plan_chunk_grid
from .load_planner import check_request, plan_load
from .model import Holding, ObjectValues, grid_flat_index, holding_pieces
from .plans import (ChunkWrite, LocalPlan, PlanOptions, RankLoadWork, RankSaveWork, ReadOp,
                    SavePlan, TensorLayout, Transfer)

__all__ = ["ChunkWrite", "LocalPlan", "PlanOptions", "RankLoadWork", "RankSaveWork", "ReadOp",
           "SavePlan", "TensorLayout", "Transfer", "check_request", "merge_trees",
           "plan_chunk_grid", "plan_load", "plan_objects", "plan_save"]


# ------------------------------------------------------------------------------- tree merge
def merge_trees(a: Any, b: Any, where: str = "state") -> Any:
    """Union of two ranks' tree structures; containers must agree in kind ([SP-TREE-1])."""
    return merge_many([a, b], where)


def merge_many(trees: Sequence[Any], where: str = "state") -> Any:
    """Union of many ranks' trees (in rank order) in one pass over their nodes; containers
    must agree in kind ([SP-TREE-1]); a leaf takes the lowest rank's value."""
    kinds = [next(iter(t)) for t in trees]
    for k in kinds[1:]:
        if k != kinds[0]:
            raise InvalidShardingError(f"{where} is a {kinds[0]} on one rank and a {k} on "
                                       "another", spec_id="SP-TREE-1")
    kind = kinds[0]
    if kind == "dict":
        children: dict = {}     # key -> its subtrees, in rank order (dicts keep first order)
        for t in trees:
            for k, v in t["dict"]:
                lst = children.get(k)
                if lst is None:
                    children[k] = [v]
                else:
                    lst.append(v)
        return {"dict": [[k, vs[0] if len(vs) == 1 else merge_many(vs, f"{where}[{k!r}]")]
                         for k, vs in children.items()]}
    if kind in ("list", "tuple"):
        n = max(len(t[kind]) for t in trees)
        cols = [[t[kind][i] for t in trees if i < len(t[kind])] for i in range(n)]
        return {kind: [vs[0] if len(vs) == 1 else merge_many(vs, f"{where}[{i}]")
                       for i, vs in enumerate(cols)]}
    return trees[0]  # leaves: same path, same kind; the lowest rank's plain value wins


def _merged_tree(local_plans: Sequence[LocalPlan]) -> Any:
    """The checkpoint's tree: each distinct tree decoded and merged once (DP replicas send
    identical trees; encoded ones are told apart by their bytes before any decoding)."""
    distinct: list = []
    seen: set = set()
    for lp in local_plans:
        if lp.tree is None and lp.tree_bytes is not None:
            if lp.tree_bytes in seen:
                continue
            seen.add(lp.tree_bytes)
            distinct.append(lp.decoded_tree())
        elif not distinct or not (lp.tree is distinct[-1] or lp.tree == distinct[-1]):
            distinct.append(lp.tree)
    return merge_many(distinct)


# ------------------------------------------------------------------------------- save plan
def _describe(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return "rank " + "/".join(str(r) for r in ranks[:4]) + \
        (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")


class _Pattern(NamedTuple):
    """What a tensor's plan needs that depends on its shape and regions only, so tensors of
    identical structure (the layers of a model) share it: the chunk grid and, per chunk,
    ``(offset, shape, bytes, parts)`` with parts ``(region, piece, box_offset, box_shape,
    elements)``."""

    chunk: tuple
    chunks: list


def _plan_pattern(key: str, dtype: str, shape: tuple, itemsize: int, regions: list,
                  holder_ranks, opts: PlanOptions) -> _Pattern:
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
        chunks = [(coff, cshp, math.prod(cshp) * itemsize, parts)
                  for coff, cshp, parts in chunk_parts(shape, chunk, pieces)]
    return _Pattern(chunk, chunks)


def plan_save(local_plans: Sequence[LocalPlan], opts: PlanOptions = PlanOptions()) -> SavePlan:
    """The global save plan, or :class:`InvalidShardingError` naming key, ranks and regions.

    Holdings are grouped into distinct regions with vectorised passes (:mod:`.columns`), and
    tensors of identical shape and regions share one coverage check and grid choice; per
    chunk the least loaded holder writes (ties to the lowest rank), so the plan is
    deterministic and bytes are balanced across replicas ([SP-REPL-2], [SP-GRID-1]).
    """
    with gc_paused():
        return _plan_save(local_plans, opts)


def _plan_save(local_plans: Sequence[LocalPlan], opts: PlanOptions) -> SavePlan:
    local_plans = sorted(local_plans, key=lambda lp: lp.rank)
    world = len(local_plans)
    tree = _merged_tree(local_plans)

    gathered = Gathered([lp.rank for lp in local_plans],
                        [as_columns(lp.holdings) for lp in local_plans])
    regions = Regions(gathered)

    ranks = [RankSaveWork() for _ in range(world)]
    assigned = [0] * world    # bytes each rank writes
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
                key, dtype, shape, itemsize, regs,
                lambda ri: regions.holders(gis[ri])[0].tolist(), opts)
        tensors[key] = TensorLayout(key, shape, dtype, pat.chunk)
        unique_bytes += math.prod(shape) * itemsize
        if not math.prod(shape):
            ranks[gathered.first_rank[k]].create.append(key)
            continue
        hold = [regions.holder_lists(gi) for gi in gis]   # (ranks ascending, hidx)
        for coff, cshp, cbytes, parts in pat.chunks:
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
                    ChunkWrite(key, coff, cshp, (hh[j], pi)) if bs == cshp else
                    ChunkWrite(key, coff, cshp, None, [(hh[j], pi, bo, bs)]))
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
            cw = ChunkWrite(key, coff, cshp)
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
    objects = plan_objects(local_plans)
    stats = {"world_size": world, "tensors": len(tensors), "unique_bytes": unique_bytes,
             "exchange_bytes": moved_bytes, "bytes_per_rank_max": max(assigned, default=0),
             "chunks": sum(len(w.writes) for w in ranks)}
    return SavePlan(tree, tensors, objects, ranks, stats)


def plan_objects(local_plans: Sequence[LocalPlan]) -> dict:
    """Check the ranks' sharded-object entries and pick one value per grid cell.

    Entries are ``(key, grid index, grid shape, replica id, value)``; ints count as 1-D grids.
    Returns key -> :class:`ObjectValues` in row-major grid order. Raises
    :class:`InvalidShardingError` naming the key and ranks when ranks disagree on the grid
    ([SP-OBJ-2]), an index lies outside it ([SP-OBJ-1]), two ranks hold the *main* replica
    (all-zero replica id) of one cell ([SP-REPL-2]; non-main replicas may share an id, as
    Megatron gives every non-main holder id 1), or a cell has no holder ([SP-OBJ-3]).
    """
    by_key: dict = defaultdict(list)
    for lp in local_plans:
        for key, index, count, rep, value in lp.objects:
            index = (index,) if isinstance(index, int) else tuple(index)
            count = (count,) if isinstance(count, int) else tuple(count)
            by_key[key].append((lp.rank, index, count, tuple(rep), value))
    out = {}
    for key in sorted(by_key):
        entries = by_key[key]
        grids = {c for _, _, c, _, _ in entries}
        if len(grids) != 1:
            who = {c: sorted(r for r, _, c2, _, _ in entries if c2 == c) for c in grids}
            raise InvalidShardingError(f"sharded object {key!r}: ranks disagree on the grid "
                                       f"(count): " + "; ".join(
                                           f"{list(c) if len(c) > 1 else c[0]} on ranks "
                                           f"{r[:8]}" for c, r in sorted(who.items())),
                                       spec_id="SP-OBJ-2")
        grid = grids.pop()
        chosen: dict = {}
        mains: dict = {}
        for r, i, _, rep, v in sorted(entries, key=lambda e: (e[1], e[3], e[0])):
            if len(i) != len(grid) or not all(0 <= a < n for a, n in zip(i, grid)):
                raise InvalidShardingError(f"sharded object {key!r}: rank {r} holds index "
                                           f"{i} outside the grid {grid}", spec_id="SP-OBJ-1")
            if not any(rep):
                if i in mains:
                    raise InvalidShardingError(
                        f"sharded object {key!r}: ranks {mains[i]} and {r} both hold index "
                        f"{i if len(i) > 1 else i[0]} as the main replica (replica_id {rep}); "
                        "give every other holder a non-zero replica_id", spec_id="SP-REPL-2")
                mains[i] = r
            chosen.setdefault(grid_flat_index(i, grid), v)   # main replica first, if any
        total = math.prod(grid)
        missing = [i for i in range(total) if i not in chosen]
        if missing:
            cells = [_unflatten(i, grid) for i in missing[:8]]
            raise InvalidShardingError(f"sharded object {key!r}: no rank holds index(es) "
                                       f"{cells} of count {grid if len(grid) > 1 else total}",
                                       spec_id="SP-OBJ-3")
        out[key] = ObjectValues([chosen[i] for i in range(total)], grid)
    return out


def _unflatten(flat: int, shape: tuple):
    idx = []
    for n in reversed(shape):
        flat, r = divmod(flat, n)
        idx.append(r)
    return tuple(reversed(idx)) if len(shape) > 1 else idx[0]
