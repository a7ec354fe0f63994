"""Save planning: pure functions from every rank's local plan to every rank's work.

Nothing here touches storage or a process group, so a job of thousands of ranks can be planned
(and property-tested) in one process. The flow of a save:
``LocalPlan`` per rank -> :func:`plan_save` (validate replica and coverage rules, choose each
tensor's chunk grid via :mod:`.grid`, elect one writer per chunk, schedule the exchange of
misaligned pieces) -> ``SavePlan`` holding every rank's work as columns, which ``save()``
broadcasts once and each rank cuts its own ``RankSaveWork`` from (:mod:`.save_global`). Loads
are planned in :mod:`.load_planner`; the plan types live in :mod:`.plans`. This module
re-exports both so ``shardpoint.planning.planner`` stays the one import path for planning.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from shardpoint.tree import dtypes
from shardpoint.planning.chunk_table import build_parts, elect, expand
from shardpoint.planning.columns import Gathered, Regions, as_columns, gc_paused
from shardpoint_core.format.coverage import check_exact_cover, regions_tile
from shardpoint_core.format.errors import InvalidShardingError
from shardpoint_core.format.manifest import array_path_for
from shardpoint_core.format.treemerge import merge_many, merge_trees
from shardpoint_core.arrays.groups import group_paths
from shardpoint.planning.grid import chunk_part_arrays_many, plan_chunk_grid, region_pieces_many
from shardpoint.planning.load_planner import check_request, plan_load
from shardpoint.planning.save_global import SaveColumns, SavePlan
from shardpoint.tree.model import ObjectValues, grid_flat_index
from shardpoint.planning.plans import (
    ChunkWrite,
    LocalPlan,
    PlanOptions,
    RankLoadWork,
    RankSaveWork,
    ReadOp,
    TensorLayout,
    Transfer,
    tree_wire_parts,
    unpack_branch,
)

__all__ = [
    "ChunkWrite",
    "LocalPlan",
    "PlanOptions",
    "RankLoadWork",
    "RankSaveWork",
    "ReadOp",
    "SavePlan",
    "TensorLayout",
    "Transfer",
    "check_request",
    "merge_trees",
    "plan_chunk_grid",
    "plan_load",
    "plan_objects",
    "plan_save",
]


def _merged_tree(local_plans: Sequence[LocalPlan]) -> Any:
    """The checkpoint's tree: each distinct tree, or each distinct top-level branch when the
    ranks sent their trees split (:func:`~.plans.pack_tree`), decoded and merged once (DP
    replicas send identical ones; encoded ones are told apart by their bytes before any
    decoding)."""
    wires: dict = {}  # distinct wire forms, in rank order
    for lp in local_plans:
        if lp.tree is not None or lp.tree_bytes is None:
            break
        w = lp.tree_bytes
        parts = tree_wire_parts(w)
        if parts is None:
            break
        wires.setdefault(tuple(map(tuple, parts)), parts)
    else:
        if wires:  # every rank sent its branches one by one: merge branch by branch
            branches: dict = {}  # key -> {branch bytes: None}, both in rank order
            for parts in wires.values():
                for k, b in parts:
                    branches.setdefault(k, {}).setdefault(b, None)
            return {
                "dict": [
                    [k, merge_many([unpack_branch(b) for b in bs], f"state[{k!r}]")]
                    for k, bs in branches.items()
                ]
            }
    distinct: list = []
    seen: set = set()
    for lp in local_plans:
        if lp.tree is None and lp.tree_bytes is not None:
            parts = tree_wire_parts(lp.tree_bytes)
            key = lp.tree_bytes if parts is None else tuple(map(tuple, parts))
            if key in seen:
                continue
            seen.add(key)
            distinct.append(lp.decoded_tree())
        elif not distinct or not (lp.tree is distinct[-1] or lp.tree == distinct[-1]):
            distinct.append(lp.tree)
    return merge_many(distinct)


# ------------------------------------------------------------------------------- save plan
def _describe(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return (
        "rank "
        + "/".join(str(r) for r in ranks[:4])
        + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
    )


class _Pattern(NamedTuple):
    """What a tensor's plan needs that depends on its shape and regions only, so tensors of
    identical structure (the layers of a model) share it: the chunk grid and the chunks'
    parts (:func:`~.grid.chunk_part_arrays`)."""

    chunk: tuple
    parts: Optional[tuple]  # None for a tensor of no elements (it has no parts)


def _plan_patterns(
    first: dict, keys: list, items: list, regions: Regions, opts: PlanOptions
) -> dict:
    """Coverage check ([SP-COVER-1..3]), chunk grid ([SP-GRID-1]) and chunk parts of each
    distinct tensor geometry (``first``: pattern key -> (key id, region ids) of its first
    tensor, in plan order). Pieces and parts are cut for all geometries at once
    (:func:`~.grid.region_pieces_many`, :func:`~.grid.chunk_part_arrays_many`); the full
    coverage check runs only where the quick one (:func:`~.coverage.regions_tile`) does not
    pass; the grid is chosen per geometry."""
    specs = [(len(keys[k][2]), [regions.region(gi)[1:] for gi in gis]) for k, gis in first.values()]
    pieces = region_pieces_many(specs)
    chunks = []
    for (k, gis), (_, regs), pa in zip(first.values(), specs, pieces):
        key, _, shape = keys[k]
        if not regions_tile(shape, regs):
            boxes = list(zip(map(tuple, pa.offs.tolist()), map(tuple, pa.shps.tolist())))
            owner = pa.li.tolist()

            def describe(i: int, gis: list = gis, owner: list = owner) -> str:
                return _describe(regions.holders(gis[owner[i]])[0].tolist())

            check_exact_cover(shape, boxes, describe, key)
        blocks = [(o, s) for o, s, _ in regs if math.prod(s)]
        chunks.append(plan_chunk_grid(shape, items[k], pa, blocks, opts))
    shapes = [keys[k][2] for k, _ in first.values()]
    live = [i for i, shape in enumerate(shapes) if math.prod(shape)]
    parts = dict(
        zip(live, chunk_part_arrays_many([(shapes[i], chunks[i], pieces[i]) for i in live]))
    )
    return {pk: _Pattern(chunks[i], parts.get(i)) for i, pk in enumerate(first)}


def plan_save(local_plans: Sequence[LocalPlan], opts: PlanOptions = PlanOptions()) -> SavePlan:
    """The global save plan, or :class:`InvalidShardingError` naming key, ranks and regions.

    Holdings are grouped into distinct regions with vectorised passes (:mod:`.columns`), and
    tensors of identical shape and regions share one coverage check and grid choice; each
    chunk's writer is elected on arrays (:func:`~.chunk_table.elect`: the holders of a chunk
    take turns, biggest chunks first), so the plan is deterministic, bytes are balanced across
    replicas ([SP-REPL-2], [SP-GRID-1]) and its cost grows with distinct structure.
    """
    with gc_paused():
        return _plan_save(local_plans, opts)


def _plan_save(local_plans: Sequence[LocalPlan], opts: PlanOptions) -> SavePlan:
    local_plans = sorted(local_plans, key=lambda lp: lp.rank)
    world = len(local_plans)
    tree = _merged_tree(local_plans)
    gathered = Gathered(
        [lp.rank for lp in local_plans], [as_columns(lp.holdings) for lp in local_plans]
    )
    regions = Regions(gathered)
    keys = gathered.keys
    D = max((len(e[2]) for e in keys), default=0)
    items = [dtypes.from_name(d).itemsize for _, d, _ in keys]
    tensors: dict = {}
    pkeys: dict = {}
    first: dict = {}  # pattern key -> (key id, region ids) of its first tensor
    order = []
    unique_bytes = 0
    plan_order = sorted(range(len(keys)), key=lambda i: keys[i][0])
    for k in plan_order:
        gis, sig = regions.by_key.get(k, ([], b""))
        pkeys[k] = pk = (keys[k][2], items[k], sig)
        if pk not in first:
            first[pk] = (k, gis)
    patterns = _plan_patterns(first, keys, items, regions, opts)
    for k in plan_order:
        key, dtype, shape = keys[k]
        gis = regions.by_key.get(k, ([], b""))[0]
        tensors[key] = TensorLayout(key, shape, dtype, patterns[pkeys[k]].chunk)
        unique_bytes += math.prod(shape) * items[k]
        if math.prod(shape):
            order.append((k, gis))
    t = build_parts(order, D, lambda k, _g: (pkeys[k], lambda: patterns[pkeys[k]].parts))
    # key ids as positions in sorted(tensors), the order the ranks know them in
    kpos = np.zeros(max(len(keys), 1), np.int64)
    kpos[plan_order] = np.arange(len(plan_order))
    cr = [(gathered.first_rank[k], int(kpos[k])) for k in plan_order if not math.prod(keys[k][2])]
    assigned, moved_bytes, cols = _plan_writes(t, regions, items, world, kpos, cr)
    objects = plan_objects(local_plans)
    stats = {
        "world_size": world,
        "tensors": len(tensors),
        "unique_bytes": unique_bytes,
        "exchange_bytes": moved_bytes,
        "bytes_per_rank_max": max(assigned, default=0),
        "chunks": len(t.c_key),
        "groups": len(group_paths(array_path_for(k) for k in tensors)),
    }  # [SP-LAYOUT-5]
    return SavePlan(tree, tensors, objects, None, stats, cols)


def _plan_writes(t, regions: Regions, items: list, world: int, kpos: np.ndarray, cr: list) -> tuple:
    """Elect each chunk's writer and lay out the writes and transfers, in plan order;
    returns (bytes each rank writes, bytes moved, the plan as :class:`SaveColumns`).
    ``kpos``: each key id's position in the sorted keys; ``cr``: (rank, key position) of
    the empty arrays each rank creates."""
    NC = len(t.c_key)
    pat_off = [p[6] for p in t.patterns]
    base = np.cumsum([0] + [len(o) for o in pat_off[:-1]]).astype(np.int64)
    c_shp = (
        np.concatenate([p[7] for p in t.patterns])[base[t.c_pat] + t.c_idx]
        if NC
        else np.zeros((0, t.D), np.int64)
    )
    item = np.array(items or [1], np.int64)
    c_bytes = np.prod(c_shp, axis=1) * item[t.c_key]
    writer, entry = elect(t, regions, world, c_bytes)
    assigned = np.bincount(writer, weights=c_bytes, minlength=world).astype(np.int64)
    start = np.asarray(regions.start, np.int64)
    hold_rank, hold_hidx = regions.hold_rank, regions.hold_hidx
    nh = np.diff(start)
    one = t.nparts == 1
    fp = t.first[one]
    direct = np.zeros(NC, bool)
    direct[one] = (t.p_bs[fp] == c_shp[one]).all(axis=1)
    # parts written from the writer's own holding (local), and parts others send
    many = np.flatnonzero(~one[t.p_chunk])
    e_part, e_entry = expand(many, start[t.p_gi[many]], nh[t.p_gi[many]])
    mine = hold_rank[e_entry] == writer[t.p_chunk[e_part]]
    lp, first_i = np.unique(e_part[mine], return_index=True)
    l_entry = e_entry[mine][first_i]
    loc_part = np.concatenate([t.first[one & ~direct], lp])
    loc_entry = np.concatenate([entry[one & ~direct], l_entry])
    srt = np.argsort(loc_part, kind="stable")
    loc_part, loc_entry = loc_part[srt], loc_entry[srt]
    sent = np.setdiff1d(many, lp, assume_unique=True)
    g = t.p_gi[sent]
    s_entry = start[g] + (t.p_chunk[sent] + sent) % nh[g]
    s_bytes = np.prod(t.p_bs[sent], axis=1) * item[t.c_key[t.p_chunk[sent]]]
    lc = t.p_chunk[loc_part]
    dq = hold_hidx[np.maximum(entry, 0)]
    sc = t.p_chunk[sent]
    src_r = hold_rank[s_entry]
    # the work stays in columns: save() broadcasts them and each rank builds its own
    # objects (SavePlan.ranks builds every rank's, for callers that want them)
    pbo_a = (
        np.concatenate([p[3] for p in t.patterns]) if t.patterns else np.zeros((0, t.D), np.int64)
    )
    pbs_a = np.concatenate([p[4] for p in t.patterns]) if t.patterns else pbo_a
    c_full = base[t.c_pat] + t.c_idx
    c_off = np.concatenate([p[6] for p in t.patterns])[c_full] if NC else c_shp
    fpi = t.p_pi[t.first] if NC else np.zeros(0, np.int64)
    cr_a = np.array(cr, np.int64).reshape(-1, 2)
    cols = SaveColumns(
        t.D,
        kpos[t.c_key],
        writer.astype(np.int64),
        np.where(direct, dq, -1),
        np.where(direct, fpi, -1),
        c_off,
        c_shp,
        lc.astype(np.int64),
        hold_hidx[loc_entry].astype(np.int64),
        t.p_pi[loc_part].astype(np.int64),
        pbo_a[t.p_src[loc_part]],
        pbs_a[t.p_src[loc_part]],
        sc.astype(np.int64),
        src_r.astype(np.int64),
        hold_hidx[s_entry].astype(np.int64),
        t.p_pi[sent].astype(np.int64),
        pbo_a[t.p_src[sent]],
        pbs_a[t.p_src[sent]],
        cr_a[:, 0].copy(),
        cr_a[:, 1].copy(),
    )
    return assigned.tolist(), int(s_bytes.sum()), cols


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
            raise InvalidShardingError(
                f"sharded object {key!r}: ranks disagree on the grid "
                f"(count): "
                + "; ".join(
                    f"{list(c) if len(c) > 1 else c[0]} on ranks {r[:8]}"
                    for c, r in sorted(who.items())
                ),
                spec_id="SP-OBJ-2",
            )
        grid = grids.pop()
        chosen: dict = {}
        mains: dict = {}
        for r, i, _, rep, v in sorted(entries, key=lambda e: (e[1], e[3], e[0])):
            if len(i) != len(grid) or not all(0 <= a < n for a, n in zip(i, grid)):
                raise InvalidShardingError(
                    f"sharded object {key!r}: rank {r} holds index {i} outside the grid {grid}",
                    spec_id="SP-OBJ-1",
                )
            if not any(rep):
                if i in mains:
                    raise InvalidShardingError(
                        f"sharded object {key!r}: ranks {mains[i]} and {r} both hold index "
                        f"{i if len(i) > 1 else i[0]} as the main replica (replica_id {rep}); "
                        "give every other holder a non-zero replica_id",
                        spec_id="SP-REPL-2",
                    )
                mains[i] = r
            chosen.setdefault(grid_flat_index(i, grid), v)  # main replica first, if any
        total = math.prod(grid)
        missing = [i for i in range(total) if i not in chosen]
        if missing:
            cells = [_unflatten(i, grid) for i in missing[:8]]
            raise InvalidShardingError(
                f"sharded object {key!r}: no rank holds index(es) "
                f"{cells} of count {grid if len(grid) > 1 else total}",
                spec_id="SP-OBJ-3",
            )
        out[key] = ObjectValues([chosen[i] for i in range(total)], grid)
    return out


def _unflatten(flat: int, shape: tuple):
    idx = []
    for n in reversed(shape):
        flat, r = divmod(flat, n)
        idx.append(r)
    return tuple(reversed(idx)) if len(shape) > 1 else idx[0]
