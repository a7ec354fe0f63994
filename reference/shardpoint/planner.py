"""Save and load planning: pure functions from every rank's local plan to every rank's work.

Nothing here touches storage or a process group, so a job of thousands of ranks can be planned
(and property-tested) in one process. The flow of a save:
``LocalPlan`` per rank -> :func:`plan_save` (validate replica and coverage rules, choose each
tensor's chunk grid, elect one writer per chunk, schedule the exchange of misaligned pieces)
-> ``SavePlan`` holding one ``RankSaveWork`` per rank. Loads mirror it with
``LoadRequest`` -> :func:`plan_load` -> ``RankLoadWork``.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import msgpack

from . import dtypes, values
from .coverage import box_intersection, check_exact_cover, regular_grid_of
from .errors import InvalidShardingError, LayoutMismatchError
from .model import Holding, holding_pieces


@dataclass(frozen=True)
class PlanOptions:
    """Writer-side knobs. None of them changes what a reader must understand."""

    max_chunk_bytes: int = 256 << 20     # a chunk (one writer's unit) is at most this big
    chunk_overhead_bytes: int = 256 << 10  # cost of one more chunk, in bytes moved instead


# -------------------------------------------------------------------------------- wire forms
@dataclass
class LocalPlan:
    """What one rank tells the coordinator before a save: metadata only, never tensor data."""

    rank: int
    tree: Any
    holdings: list          # [Holding], index = holding index on that rank
    objects: list           # [(key, index, count, replica tuple, value)]

    def to_bytes(self) -> bytes:
        hs = msgpack.packb([h.to_wire() for h in self.holdings])
        return values.pack([self.rank, self.tree, hs, [list(o) for o in self.objects]])

    @staticmethod
    def from_bytes(b: bytes) -> "LocalPlan":
        rank, tree, hs, objs = values.unpack(b)
        # Holdings decode straight into tuples (use_list=False): no per-field conversion.
        make = Holding._make
        holdings = [make(w) for w in msgpack.unpackb(hs, use_list=False)]
        return LocalPlan(rank, tree, holdings, [(k, i, c, tuple(r), v) for k, i, c, r, v in objs])


@dataclass(frozen=True)
class TensorLayout:
    key: str
    shape: tuple
    dtype: str
    chunk_shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.from_name(self.dtype).itemsize


@dataclass
class ChunkWrite:
    """One chunk a rank writes. ``direct``: (holding, piece) whose view covers the chunk, so it
    is written straight from the caller's tensor; else the chunk is assembled in a buffer from
    ``local`` copies ``(holding, piece, box_offset, box_shape)`` and received transfers."""

    key: str
    offset: tuple
    shape: tuple
    direct: Optional[tuple] = None
    local: list = field(default_factory=list)


@dataclass
class Transfer:
    """``box`` of ``key`` moves from rank ``src`` to rank ``dst``; ``src_ref`` and ``dst_ref``
    name the source view and the destination buffer on each side."""

    src: int
    dst: int
    key: str
    box_offset: tuple
    box_shape: tuple
    src_ref: tuple   # save: (holding, piece); load: (read index,)
    dst_ref: tuple   # save: (write index,);   load: (request index, piece)


@dataclass
class RankSaveWork:
    writes: list = field(default_factory=list)     # [ChunkWrite]
    sends: list = field(default_factory=list)      # [Transfer], in exchange order
    recvs: list = field(default_factory=list)      # [Transfer], in exchange order
    create: list = field(default_factory=list)     # keys whose array this rank creates only

    def to_bytes(self) -> bytes:
        return msgpack.packb([
            [[w.key, w.offset, w.shape, w.direct, w.local] for w in self.writes],
            [_t_wire(t) for t in self.sends], [_t_wire(t) for t in self.recvs], self.create])

    @staticmethod
    def from_bytes(b: bytes) -> "RankSaveWork":
        ws, ss, rs, cr = msgpack.unpackb(b, strict_map_key=False)
        tup = _tuplify
        return RankSaveWork(
            [ChunkWrite(k, tup(o), tup(s), tup(d) if d else None,
                        [(h, p, tup(bo), tup(bs)) for h, p, bo, bs in loc])
             for k, o, s, d, loc in ws],
            [_t_unwire(t) for t in ss], [_t_unwire(t) for t in rs], list(cr))


def _tuplify(x):
    return tuple(x)


def _t_wire(t: Transfer) -> list:
    return [t.src, t.dst, t.key, t.box_offset, t.box_shape, t.src_ref, t.dst_ref]


def _t_unwire(w: list) -> Transfer:
    s, d, k, bo, bs, sr, dr = w
    return Transfer(s, d, k, tuple(bo), tuple(bs), tuple(sr), tuple(dr))


@dataclass
class SavePlan:
    tree: Any
    tensors: dict            # key -> TensorLayout
    objects: dict            # key -> list of values (index order)
    ranks: list              # [RankSaveWork], one per rank
    stats: dict = field(default_factory=dict)


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


# ------------------------------------------------------------------------------- grid choice
def _grid_chunks(shape: tuple, chunk: tuple) -> int:
    return math.prod(-(-n // c) for n, c in zip(shape, chunk))


def _split_large(shape: tuple, chunk: tuple, itemsize: int, max_bytes: int) -> tuple:
    """Refine ``chunk`` so one chunk is at most ``max_bytes``, keeping every old chunk a union
    of new ones (split by divisors, or freely along dims the old grid does not cut)."""
    c = list(chunk)
    for d in range(len(c)):
        nbytes = math.prod(c) * itemsize
        if nbytes <= max_bytes:
            break
        want = max(1, (max_bytes // max(1, math.prod(c[d + 1:]) * itemsize)))
        if c[d] >= shape[d]:
            c[d] = max(1, min(c[d], want))
        else:
            best = 1
            for q in range(1, int(math.isqrt(c[d])) + 1):
                if c[d] % q == 0:
                    for v in (q, c[d] // q):
                        if best < v <= want:
                            best = v
            c[d] = best
    return tuple(c)


def _gcd_grid(shape: tuple, boxes: list) -> tuple:
    out = []
    for d, n in enumerate(shape):
        g = 0
        for o, s in boxes:
            g = math.gcd(g, o[d])
            if o[d] + s[d] < n:
                g = math.gcd(g, o[d] + s[d])
        out.append(g or n)
    return tuple(out)


def _max_extent_grid(shape: tuple, boxes: list) -> tuple:
    """Chunk extent = the largest box extent per dimension: the ceil-div grid of uneven
    splits (pieces of 4001 and 4000 rows give chunks of 4001 rows; little moves)."""
    return tuple(max([s[d] for _, s in boxes] or [n]) or 1 for d, n in enumerate(shape))


def _held_bytes(shape, chunk, regions) -> tuple:
    """(bytes to move, chunks) if each chunk is written by the rank holding most of it."""
    # Approximation: a rank holds one region of a tensor, so "held by a rank" = "held by a
    # region" (exact for the layouts planned in practice, and only used to rank candidates).
    per_chunk: dict = defaultdict(lambda: defaultdict(int))
    for ri, (boxes, _holders) in enumerate(regions):
        for off, shp in boxes:
            for cidx, n in _chunks_overlapping(shape, chunk, off, shp):
                per_chunk[cidx][ri] += n
    total = sum(sum(n for n in d.values()) for d in per_chunk.values())
    moved = 0
    for cidx, d in per_chunk.items():
        cbytes = math.prod(min(c, n - i * c) for i, c, n in zip(cidx, chunk, shape))
        moved += cbytes - max(d.values())
    return moved, total


def _chunks_overlapping(shape, chunk, off, shp):
    """Yield (chunk index, overlap elements) for every chunk a box touches."""
    lo = [o // c for o, c in zip(off, chunk)]
    hi = [(o + s - 1) // c for o, s, c in zip(off, shp, chunk)]
    if lo == hi:
        yield tuple(lo), math.prod(shp)
        return
    for cidx in itertools.product(*[range(a, b + 1) for a, b in zip(lo, hi)]):
        n = 1
        for i, c, o, s in zip(cidx, chunk, off, shp):
            n *= min(o + s, (i + 1) * c) - max(o, i * c)
        yield cidx, n


def _pieces_by_chunk(shape: tuple, chunk: tuple, piece_lists: list) -> dict:
    """chunk index -> [(list index, piece index, overlap box)] for every piece of every list."""
    per_chunk: dict = defaultdict(list)
    for li, pieces in enumerate(piece_lists):
        for pi, p in enumerate(pieces):
            if not shape:
                per_chunk[()].append((li, pi, ((), ())))
                continue
            for cidx, _n in _chunks_overlapping(shape, chunk, p.offset, p.shape):
                coff = tuple(i * c for i, c in zip(cidx, chunk))
                cshp = tuple(min(c, n - o) for c, n, o in zip(chunk, shape, coff))
                per_chunk[cidx].append((li, pi, box_intersection(coff, cshp, p.offset, p.shape)))
    return per_chunk


def plan_chunk_grid(shape: tuple, itemsize: int, regions: list, blocks: list,
                    opts: PlanOptions) -> tuple:
    """Choose a regular chunk grid for a tensor ([SP-GRID-1]): the saving layout itself when
    it is one (no data moves), else the candidate that moves the fewest bytes, counting
    ``chunk_overhead_bytes`` per chunk. ``regions``: [(boxes, holder ranks)] per unique
    region; ``blocks``: the rectangular blocks the holdings come from."""
    if not shape:
        return ()
    if math.prod(shape) == 0:
        return tuple(max(1, n) for n in shape)
    boxes = [b for bs, _ in regions for b in bs]
    aligned = regular_grid_of(shape, boxes)
    total_bytes = math.prod(shape) * itemsize
    if aligned is not None:
        aligned = _split_large(shape, aligned, itemsize, opts.max_chunk_bytes)
        n = _grid_chunks(shape, aligned)
        if n == 1 or total_bytes >= n * opts.chunk_overhead_bytes:
            return aligned
    cands = set()
    if aligned is not None:
        cands.add(aligned)
    cands.add(_split_large(shape, _gcd_grid(shape, boxes), itemsize, opts.max_chunk_bytes))
    cands.add(_split_large(shape, tuple(shape), itemsize, opts.max_chunk_bytes))
    for base in (_gcd_grid(shape, blocks), _max_extent_grid(shape, blocks)):
        cands.add(_split_large(shape, base, itemsize, opts.max_chunk_bytes))
        per_block = max(1, round(len(boxes) / max(1, _grid_chunks(shape, base))))
        for k in {max(1, per_block // 2)} | {per_block * f for f in (1, 2, 4, 8, 16)}:
            slab = list(base)
            for d in range(len(slab)):
                if slab[d] > 1:
                    slab[d] = -(-slab[d] // k)
                    break
            cands.add(_split_large(shape, tuple(slab), itemsize, opts.max_chunk_bytes))
    best, best_cost = None, None
    for c in sorted(cands):
        n = _grid_chunks(shape, c)
        if n > 4 * len(boxes) + 64 and c != aligned:
            continue  # finer than the layout itself: many tiny chunks
        moved, _ = _held_bytes(shape, c, regions)
        cost = moved * itemsize + n * opts.chunk_overhead_bytes
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


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
        per_chunk = _pieces_by_chunk(shape, chunk, [ps for ps, _ in region_list])
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
    by_key: dict = defaultdict(list)
    for lp in local_plans:
        for key, index, count, rep, value in lp.objects:
            by_key[key].append((lp.rank, index, count, rep, value))
    out = {}
    for key in sorted(by_key):
        entries = by_key[key]
        counts = {c for _, _, c, _, _ in entries}
        if len(counts) != 1:
            raise InvalidShardingError(f"sharded object {key!r}: ranks disagree on count "
                                       f"({sorted(counts)})", spec_id="SP-OBJ-2")
        count = counts.pop()
        chosen: dict = {}
        seen: dict = {}
        for r, i, _, rep, v in sorted(entries, key=lambda e: (e[1], e[3], e[0])):
            if (i, rep) in seen:
                raise InvalidShardingError(f"sharded object {key!r}: ranks {seen[(i, rep)]} "
                                           f"and {r} both hold index {i} with replica_id "
                                           f"{rep}", spec_id="SP-REPL-2")
            seen[(i, rep)] = r
            chosen.setdefault(i, v)
        missing = [i for i in range(count) if i not in chosen]
        if missing:
            raise InvalidShardingError(f"sharded object {key!r}: no rank holds index(es) "
                                       f"{missing[:8]} of count {count}", spec_id="SP-OBJ-3")
        out[key] = [chosen[i] for i in range(count)]
    return out


# ------------------------------------------------------------------------------- load plan
@dataclass
class ReadOp:
    """A region one rank reads from storage: straight into a request's view (``direct`` =
    (request, piece)) or into a buffer that ``local`` copies and sends then draw from."""

    key: str
    offset: tuple
    shape: tuple
    direct: Optional[tuple] = None
    local: list = field(default_factory=list)   # [(request, piece, box_offset, box_shape)]


@dataclass
class RankLoadWork:
    reads: list = field(default_factory=list)
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return msgpack.packb([
            [[r.key, r.offset, r.shape, r.direct, r.local] for r in self.reads],
            [_t_wire(t) for t in self.sends], [_t_wire(t) for t in self.recvs]])

    @staticmethod
    def from_bytes(b: bytes) -> "RankLoadWork":
        rs, ss, vs = msgpack.unpackb(b, strict_map_key=False)
        tup = _tuplify
        return RankLoadWork(
            [ReadOp(k, tup(o), tup(s), tup(d) if d else None,
                    [(q, p, tup(bo), tup(bs)) for q, p, bo, bs in loc]) for k, o, s, d, loc in rs],
            [_t_unwire(t) for t in ss], [_t_unwire(t) for t in vs])


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
        per_chunk = _pieces_by_chunk(shape, chunk, [holding_pieces(h) for h, _ in groups])
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
