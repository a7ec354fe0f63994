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
from collections import defaultdict
from typing import Any, Sequence

from . import dtypes
from .coverage import check_exact_cover
from .errors import InvalidShardingError
from .grid import pieces_by_chunk, plan_chunk_grid
from .load_planner import check_request, plan_load
from .model import ObjectValues, grid_flat_index, holding_pieces
from .plans import (ChunkWrite, LocalPlan, PlanOptions, RankLoadWork, RankSaveWork, ReadOp,
                    SavePlan, TensorLayout, Transfer)

__all__ = ["ChunkWrite", "LocalPlan", "PlanOptions", "RankLoadWork", "RankSaveWork", "ReadOp",
           "SavePlan", "TensorLayout", "Transfer", "check_request", "merge_trees",
           "plan_chunk_grid", "plan_load", "plan_objects", "plan_save"]


# ------------------------------------------------------------------------------- tree merge
def merge_trees(a: Any, b: Any, where: str = "state") -> Any:
    """Union of two ranks' tree structures; containers must agree in kind ([SP-TREE-1])."""
    ka, kb = next(iter(a)), next(iter(b))
    if ka != kb:
        raise InvalidShardingError(f"{where} is a {ka} on one rank and a {kb} on another",
                                   spec_id="SP-TREE-1")
    if ka == "dict":
        out = {k: v for k, v in a["dict"]}
        order = [k for k, _ in a["dict"]]
        for k, v in b["dict"]:
            if k in out:
                out[k] = merge_trees(out[k], v, f"{where}[{k!r}]")
            else:
                out[k] = v
                order.append(k)
        return {"dict": [[k, out[k]] for k in order]}
    if ka in ("list", "tuple"):
        la, lb = a[ka], b[ka]
        merged = [merge_trees(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(la, lb))]
        return {ka: merged + la[len(lb):] + lb[len(la):]}
    return a  # leaves: same path, same kind; the lower rank's plain value wins


# ------------------------------------------------------------------------------- save plan
def _describe(holders: list) -> str:
    return "rank " + "/".join(f"{r} (replica_id {rep})" for r, _, rep in holders[:4]) + \
        (f" and {len(holders) - 4} more" if len(holders) > 4 else "")


def plan_save(local_plans: Sequence[LocalPlan], opts: PlanOptions = PlanOptions()) -> SavePlan:
    """The global save plan, or :class:`InvalidShardingError` naming key, ranks and regions."""
    world = len(local_plans)
    tree = local_plans[0].tree
    for lp in local_plans[1:]:
        tree = merge_trees(tree, lp.tree)

    by_key: dict = defaultdict(list)   # key -> [(rank, hidx, Holding)]
    for lp in local_plans:
        for i, h in enumerate(lp.holdings):
            by_key[h.key].append((lp.rank, i, h))

    ranks = [RankSaveWork() for _ in range(world)]
    assigned = [0] * world    # bytes each rank writes
    sent = [0] * world
    tensors: dict = {}
    transfers: list = []
    moved_bytes = 0
    unique_bytes = 0

    for key in sorted(by_key):
        entries = by_key[key]
        r0, _, h0 = entries[0]
        for r, _, h in entries:
            if h.global_shape != h0.global_shape or h.dtype != h0.dtype:
                raise InvalidShardingError(
                    f"tensor {key!r}: ranks disagree on global shape/dtype: rank {r0} has "
                    f"{h0.global_shape} {h0.dtype}, rank {r} has {h.global_shape} {h.dtype}",
                    spec_id="SP-COVER-4")
        shape, itemsize = h0.global_shape, dtypes.from_name(h0.dtype).itemsize
        groups: dict = {}                  # region -> (a Holding of it, [(rank, hidx, replica)])
        for r, i, h in entries:
            if (h[5][1] == h[5][0]) if h[5] else not math.prod(h[4]):
                continue  # an empty piece covers nothing, wherever it sits
            reg = (h[3], h[4], h[5])
            g = groups.get(reg)
            if g is None:
                groups[reg] = g = (h, [])
            g[1].append((r, i, h[6]))
        region_list = []                   # (pieces, holders), holders in rank order
        boxes, owners = [], []
        blocks = []
        for region, (h, holders) in groups.items():
            if len(holders) > 1 and len({rep for _, _, rep in holders}) != len(holders):
                reps: dict = {}
                for r, i, rep in holders:
                    if rep in reps:
                        raise InvalidShardingError(
                            f"tensor {key!r}: ranks {reps[rep]} and {r} both hold region offset "
                            f"{region[0]} shape {region[1]}" +
                            (f" range {region[2]}" if region[2] else "") +
                            f" with the same replica_id {rep}; replicas need distinct replica "
                            "ids", spec_id="SP-REPL-2")
                    reps[rep] = r
            pieces = holding_pieces(h)
            region_list.append((pieces, holders))
            if math.prod(region[1]):
                blocks.append((region[0], region[1]))
            for p in pieces:
                boxes.append((p.offset, p.shape))
                owners.append(holders)
        check_exact_cover(shape, boxes, lambda i: _describe(owners[i]), key)
        grid_regions = [([(p.offset, p.shape) for p in ps], [r for r, _, _ in hs])
                        for ps, hs in region_list]
        chunk = plan_chunk_grid(shape, itemsize, grid_regions, blocks, opts)
        tensors[key] = TensorLayout(key, shape, h0.dtype, chunk)
        unique_bytes += math.prod(shape) * itemsize
        if math.prod(shape) == 0:
            ranks[r0].create.append(key)
            continue
        per_chunk = pieces_by_chunk(shape, chunk, [ps for ps, _ in region_list])
        for cidx in sorted(per_chunk):
            parts = per_chunk[cidx]
            coff = tuple(i * c for i, c in zip(cidx, chunk))
            cshp = tuple(min(c, n - o) for c, n, o in zip(chunk, shape, coff))
            cbytes = math.prod(cshp) * itemsize
            if len(parts) == 1:
                # One region covers the chunk: its holders tie; the least loaded one writes
                # (holders are in rank order, so ties go to the lowest rank).
                holders = region_list[parts[0][0]][1]
                writer = holders[0][0] if len(holders) == 1 else \
                    min((r for r, _, _ in holders), key=assigned.__getitem__)
            else:
                held: dict = defaultdict(int)
                for ri, pi, (bo, bs) in parts:
                    for r, _, _ in region_list[ri][1]:
                        held[r] += math.prod(bs)
                writer = min(held, key=lambda r: (-held[r], assigned[r], r))
            assigned[writer] += cbytes
            work = ranks[writer]
            cw = ChunkWrite(key, coff, cshp)
            widx = len(work.writes)
            for ri, pi, (bo, bs) in parts:
                holders = region_list[ri][1]
                mine = [(r, i) for r, i, _ in holders if r == writer]
                if mine:
                    _, hidx = mine[0]
                    if bs == cshp and len(parts) == 1:
                        cw.direct = (hidx, pi)
                    else:
                        cw.local.append((hidx, pi, bo, bs))
                    continue
                src, hidx, _ = min(holders, key=lambda x: (sent[x[0]], x[0]))
                nb = math.prod(bs) * itemsize
                sent[src] += nb
                moved_bytes += nb
                transfers.append(Transfer(src, writer, key, bo, bs, (hidx, pi), (widx,)))
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
