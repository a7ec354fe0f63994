"""Chunk-grid choice ([SP-GRID-1]): pure geometry on a tensor's regions and chunks.

The saving layout itself when it is a regular grid (no data moves), else the candidate grid
that moves the fewest bytes. Also the chunk/piece overlap helpers both planners use; those
work on arrays (:class:`PieceArrays`), for every distinct tensor geometry of a plan at once.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np

from shardpoint_core.format.coverage import box_intersection
from shardpoint.tree.model import Holding, holding_pieces
from shardpoint.planning.plans import PlanOptions


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
        want = max(1, (max_bytes // max(1, math.prod(c[d + 1 :]) * itemsize)))
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


def _gcd_grid_of(shape: tuple, pa: "PieceArrays") -> tuple:
    """:func:`_gcd_grid` of many boxes, on arrays."""
    ends = pa.offs + pa.shps
    out = []
    for d, n in enumerate(shape):
        e = ends[:, d]
        g = math.gcd(int(np.gcd.reduce(pa.offs[:, d])), int(np.gcd.reduce(e[e < n])))
        out.append(g or n)
    return tuple(out)


def _regular_grid(shape: tuple, pa: "PieceArrays"):
    """:func:`~.coverage.regular_grid_of` of non-empty boxes, on arrays."""
    origin = np.flatnonzero(~pa.offs.any(axis=1))
    if len(origin) != 1:
        return None
    chunk = pa.shps[origin[0]]
    if (
        not chunk.all()
        or (pa.offs % chunk).any()
        or (pa.shps != np.minimum(chunk, np.array(shape, np.int64) - pa.offs)).any()
    ):
        return None
    return tuple(chunk.tolist())


def _max_extent_grid(shape: tuple, boxes: list) -> tuple:
    """Chunk extent = the largest box extent per dimension: the ceil-div grid of uneven
    splits (pieces of 4001 and 4000 rows give chunks of 4001 rows; little moves)."""
    return tuple(max([s[d] for _, s in boxes] or [n]) or 1 for d, n in enumerate(shape))


def _moved_many(shape: tuple, cands: list, regions: "list | PieceArrays") -> list:
    """Elements each candidate grid would move if each chunk were written by the region
    holding most of it, for all candidates at once: every (candidate, box, chunk) overlap
    expanded one dimension at a time, then per chunk the largest per-region sum.

    Approximation: a rank holds one region of a tensor, so "held by a rank" = "held by a
    region" (exact for the layouts planned in practice, and only used to rank candidates).
    """
    nd = len(shape)
    pa = regions if isinstance(regions, PieceArrays) else PieceArrays.of_boxes(nd, regions)
    offs, ends, reg = pa.offs, pa.offs + pa.shps, pa.li
    C, B, R = len(cands), len(offs), int(reg.max()) + 1 if len(reg) else 1
    ch = np.array(cands, np.int64).reshape(C, nd)
    nc = -(-np.array(shape, np.int64) // ch)
    maxn = int(np.prod(nc, axis=1).max())
    cand = np.repeat(np.arange(C), B)
    box = np.tile(np.arange(B), C)
    lin = np.zeros(C * B, np.int64)
    cnt = np.ones(C * B, np.int64)
    for d in range(nd):
        c, o, e = ch[cand, d], offs[box, d], ends[box, d]
        lo = o // c
        k = (e - 1) // c - lo + 1
        rep = np.repeat(np.arange(len(k)), k)
        pos = np.arange(len(rep)) - np.repeat(np.cumsum(k) - k, k)
        cand, box, c = cand[rep], box[rep], c[rep]
        ci = lo[rep] + pos
        cnt = cnt[rep] * (np.minimum(e[rep], (ci + 1) * c) - np.maximum(o[rep], ci * c))
        lin = lin[rep] * nc[cand, d] + ci
    u, inv = np.unique((cand * maxn + lin) * R + reg[box], return_inverse=True)
    sums = np.bincount(inv.reshape(-1), weights=cnt)
    cells = u // R
    starts = np.flatnonzero(np.concatenate([[True], cells[1:] != cells[:-1]]))
    best = np.maximum.reduceat(sums, starts)
    cells = cells[starts]
    which, rest = cells // maxn, cells % maxn
    ext = np.ones(len(cells), np.int64)
    for d in range(nd - 1, -1, -1):
        i = rest % nc[which, d]
        rest = rest // nc[which, d]
        ext *= np.minimum(ch[which, d], shape[d] - i * ch[which, d])
    return [int(round(x)) for x in np.bincount(which, weights=ext - best, minlength=C)]


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


def pieces_by_chunk(shape: tuple, chunk: tuple, piece_lists: list) -> dict:
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


class PieceArrays(NamedTuple):
    """Pieces of several lists (regions) as arrays, one row per piece: ``li`` (list index),
    ``pi`` (piece index in its list), ``offs``/``shps`` (``n x nd`` global boxes)."""

    li: np.ndarray
    pi: np.ndarray
    offs: np.ndarray
    shps: np.ndarray

    @staticmethod
    def of_lists(nd: int, piece_lists: list) -> "PieceArrays":
        flat = [(li, pi, p) for li, ps in enumerate(piece_lists) for pi, p in enumerate(ps)]
        return PieceArrays(
            np.array([f[0] for f in flat], np.int64),
            np.array([f[1] for f in flat], np.int64),
            np.array([p.offset for _, _, p in flat], np.int64).reshape(-1, nd),
            np.array([p.shape for _, _, p in flat], np.int64).reshape(-1, nd),
        )

    @staticmethod
    def of_boxes(nd: int, regions: list) -> "PieceArrays":
        """From ``[(boxes, anything)]``, ``boxes`` a region's ``[(offset, shape)]``."""
        n = [len(bs) for bs, _ in regions]
        return PieceArrays(
            np.repeat(np.arange(len(regions), dtype=np.int64), n),
            np.concatenate([np.arange(k, dtype=np.int64) for k in n])
            if n
            else np.zeros(0, np.int64),
            np.array([o for bs, _ in regions for o, _ in bs], np.int64).reshape(-1, nd),
            np.array([s for bs, _ in regions for _, s in bs], np.int64).reshape(-1, nd),
        )


def region_pieces(nd: int, regions: Sequence) -> PieceArrays:
    """The pieces :func:`~.model.holding_pieces` gives for each of ``regions`` (``(offset,
    shape, flat or None)`` of ``nd``-dimensional holdings), for all of them at once.

    A flattened range is cut one dimension at a time, all ranges together: at dimension
    ``d`` a range either stays within one row of the sub-block (it descends with that row
    fixed) or splits into a partial head row (descends), whole rows (a box) and a partial
    tail row (descends). Boxes are then put in data order per region."""
    R = len(regions)
    fl = [r[2] for r in regions]
    if nd == 0 or not R:
        keep = [i for i, f in enumerate(fl) if f is None or f[0] < f[1]]
        z = np.zeros((len(keep), nd), np.int64)
        return PieceArrays(np.array(keep, np.int64), np.zeros(len(keep), np.int64), z, z + 1)
    off = np.array([r[0] for r in regions], np.int64).reshape(R, nd)
    shp = np.array([r[1] for r in regions], np.int64).reshape(R, nd)
    isflat = np.array([f is not None for f in fl])
    fa = np.array([f[0] if f else 0 for f in fl], np.int64)
    fb = np.array([f[1] if f else 0 for f in fl], np.int64)
    rect = np.flatnonzero(~isflat & (np.prod(shp, axis=1) > 0))
    out_reg, out_off, out_ext = [rect], [np.zeros((len(rect), nd), np.int64)], [shp[rect]]
    reg = np.flatnonzero(isflat & (fa < fb))
    a, b = fa[reg], fb[reg]
    pre = np.zeros((len(reg), nd), np.int64)
    # strides[r, d]: elements of one index step of dimension d in region r's block
    strides = np.ones((R, nd), np.int64)
    for d in range(nd - 2, -1, -1):
        strides[:, d] = strides[:, d + 1] * shp[:, d + 1]
    if len(reg) and (strides[reg] == 0).any():
        # a range over a block with an empty dimension: the plain loop, which refuses it
        return PieceArrays.of_lists(nd, [holding_pieces_of(nd, r) for r in regions])
    for d in range(nd):
        row = strides[reg, d]
        r0, c0 = np.divmod(a, row)
        r1, c1 = np.divmod(b, row)
        same = r0 == r1
        m0 = r0 + (c0 > 0)
        mid = ~same & (m0 < r1)
        if mid.any():  # whole rows: one box, the later dimensions whole
            o = pre[mid].copy()
            o[:, d] = m0[mid]
            e = shp[reg[mid]].copy()
            e[:, :d] = 1
            e[:, d] = (r1 - m0)[mid]
            out_reg.append(reg[mid])
            out_off.append(o)
            out_ext.append(e)
        head = ~same & (c0 > 0)
        tail = ~same & (c1 > 0)
        parts = [(same, r0, c0, c1), (head, r0, c0, row), (tail, r1, np.zeros_like(c1), c1)]
        reg = np.concatenate([reg[m] for m, *_ in parts])
        a = np.concatenate([lo[m] for m, _, lo, _ in parts])
        b = np.concatenate([hi[m] for m, _, _, hi in parts])
        nxt = []
        for m, r, *_ in parts:
            p = pre[m].copy()
            p[:, d] = r[m]
            nxt.append(p)
        pre = np.concatenate(nxt)
    regs = np.concatenate(out_reg)
    boff = np.concatenate(out_off)
    bext = np.concatenate(out_ext)
    first = (boff * strides[regs]).sum(axis=1)
    order = np.lexsort((first, regs))
    regs, boff, bext = regs[order], boff[order], bext[order]
    cnt = np.bincount(regs, minlength=R)
    pi = np.arange(len(regs)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    return PieceArrays(regs, pi, boff + off[regs], bext)


def holding_pieces_of(nd: int, region: tuple) -> list:
    """:func:`~.model.holding_pieces` of a region ``(offset, shape, flat or None)``."""
    o, s, f = region
    return holding_pieces(Holding("", "float32", (0,) * nd, tuple(o), tuple(s), f, (0,)))


def chunk_part_arrays(shape: tuple, chunk: tuple, piece_lists) -> tuple:
    """The overlaps of pieces with chunks as arrays, in chunk order then piece order:
    ``(part chunk, list index, piece index, box offset, box shape, elements, chunk offset,
    chunk shape)``; ``part chunk`` numbers the touched chunks 0.. in chunk order and the
    last two arrays have one row per touched chunk. A 0-d tensor is one chunk.
    ``piece_lists``: a list of piece lists, or their :class:`PieceArrays`."""
    nd = len(shape)
    pa = (
        piece_lists
        if isinstance(piece_lists, PieceArrays)
        else PieceArrays.of_lists(nd, piece_lists)
    )
    li_a, pi_a = pa.li, pa.pi
    if not shape or not len(li_a):
        n = len(li_a)
        nc = 1 if n and not shape else 0
        z = np.zeros((n, nd), np.int64)
        return (
            np.zeros(n, np.int64),
            li_a,
            pi_a,
            z,
            z,
            np.ones(n, np.int64),
            np.zeros((nc, nd), np.int64),
            np.zeros((nc, nd), np.int64),
        )
    offs = pa.offs
    ends = offs + pa.shps
    idx = np.arange(len(li_a))
    lin = np.zeros(len(li_a), np.int64)
    los: list[np.ndarray] = []  # per dimension so far, each overlap's low and high end
    his: list[np.ndarray] = []
    for d, (n, c) in enumerate(zip(shape, chunk)):
        o, e = offs[:, d], ends[:, d]
        k = ((e - 1) // c - o // c + 1)[idx]
        rep = np.repeat(np.arange(len(idx)), k)
        pos = np.arange(len(rep)) - np.repeat(np.cumsum(k) - k, k)
        idx = idx[rep]
        ci = o[idx] // c + pos
        los = [x[rep] for x in los] + [np.maximum(o[idx], ci * c)]
        his = [x[rep] for x in his] + [np.minimum(e[idx], (ci + 1) * c)]
        lin = lin[rep] * (-(-n // c)) + ci
    order = np.argsort(lin, kind="stable")
    lin_s = lin[order]
    src = idx[order]
    lo = np.stack([x[order] for x in los], 1)
    ext = np.stack([h[order] for h in his], 1) - lo
    new = np.concatenate([[True], lin_s[1:] != lin_s[:-1]])
    part_chunk = np.cumsum(new) - 1
    ch = np.array(chunk, np.int64)
    coff = lo[new] // ch * ch
    cshp = np.minimum(ch, np.array(shape, np.int64) - coff)
    return part_chunk, li_a[src], pi_a[src], lo, ext, np.prod(ext, axis=1), coff, cshp


def region_pieces_many(specs: Sequence[tuple]) -> list:
    """:func:`region_pieces` of many tensors, ``specs`` ``[(nd, regions)]``, in one numpy
    pass per number of dimensions (a plan has ~10^2 distinct tensor geometries; one pass
    each cost more in numpy calls than in work)."""
    out: list = [None] * len(specs)
    by_nd: dict = {}
    for i, (nd, _regs) in enumerate(specs):
        by_nd.setdefault(nd, []).append(i)
    for nd, ids in by_nd.items():
        allregs = [r for i in ids for r in specs[i][1]]
        pa = region_pieces(nd, allregs)
        base = np.cumsum([0] + [len(specs[i][1]) for i in ids])
        cut = np.searchsorted(pa.li, base).tolist()
        for j, i in enumerate(ids):
            a, b = cut[j], cut[j + 1]
            out[i] = PieceArrays(pa.li[a:b] - base[j], pa.pi[a:b], pa.offs[a:b], pa.shps[a:b])
    return out


def chunk_part_arrays_many(items: Sequence[tuple]) -> list:
    """:func:`chunk_part_arrays` of many tensors, ``items`` ``[(shape, chunk, pieces)]``
    (pieces as :class:`PieceArrays`), in one numpy pass per number of dimensions."""
    out: list = [None] * len(items)
    by_nd: dict = {}
    for i, (shape, _, pa) in enumerate(items):
        if shape and len(pa.li):
            by_nd.setdefault(len(shape), []).append(i)
        else:
            out[i] = chunk_part_arrays(shape, items[i][1], pa)
    for nd, ids in by_nd.items():
        sizes = [len(items[i][2].li) for i in ids]
        P = len(ids)
        pat0 = np.repeat(np.arange(P), sizes)
        offs = np.concatenate([items[i][2].offs for i in ids])
        ends = offs + np.concatenate([items[i][2].shps for i in ids])
        li_a = np.concatenate([items[i][2].li for i in ids])
        pi_a = np.concatenate([items[i][2].pi for i in ids])
        ch = np.array([items[i][1] for i in ids], np.int64).reshape(P, nd)
        nn = np.array([items[i][0] for i in ids], np.int64).reshape(P, nd)
        ncd = -(-nn // ch)
        idx = np.arange(len(pat0))
        lin = np.zeros(len(pat0), np.int64)
        los: list = []
        his: list = []
        for d in range(nd):
            o, e, cd = offs[:, d], ends[:, d], ch[pat0, d]
            k = ((e - 1) // cd - o // cd + 1)[idx]
            rep = np.repeat(np.arange(len(idx)), k)
            pos = np.arange(len(rep)) - np.repeat(np.cumsum(k) - k, k)
            idx = idx[rep]
            cc = cd[idx]
            ci = o[idx] // cc + pos
            los = [x[rep] for x in los] + [np.maximum(o[idx], ci * cc)]
            his = [x[rep] for x in his] + [np.minimum(e[idx], (ci + 1) * cc)]
            lin = lin[rep] * ncd[pat0[idx], d] + ci
        pat = pat0[idx]
        order = np.lexsort((lin, pat))
        lin_s, pat_s, src = lin[order], pat[order], idx[order]
        lo = np.stack([x[order] for x in los], 1)
        ext = np.stack([h[order] for h in his], 1) - lo
        new = np.concatenate([[True], (lin_s[1:] != lin_s[:-1]) | (pat_s[1:] != pat_s[:-1])])
        part_chunk = np.cumsum(new) - 1
        cpat = pat_s[new]
        coff = lo[new] // ch[cpat] * ch[cpat]
        cshp = np.minimum(ch[cpat], nn[cpat] - coff)
        cnt = np.prod(ext, axis=1)
        li_s, pi_s = li_a[src], pi_a[src]
        rcut = np.searchsorted(pat_s, np.arange(P + 1)).tolist()
        ccut = np.searchsorted(cpat, np.arange(P + 1)).tolist()
        for j, i in enumerate(ids):
            a, b, ca, cb = rcut[j], rcut[j + 1], ccut[j], ccut[j + 1]
            out[i] = (
                part_chunk[a:b] - ca,
                li_s[a:b],
                pi_s[a:b],
                lo[a:b],
                ext[a:b],
                cnt[a:b],
                coff[ca:cb],
                cshp[ca:cb],
            )
    return out


def chunk_parts(shape: tuple, chunk: tuple, piece_lists: list) -> list:
    """Every chunk some piece touches, in chunk order, as ``(chunk offset, chunk shape,
    [(list index, piece index, box offset, box shape, elements)])``: the pieces' overlaps with
    the chunk, in piece order. :func:`pieces_by_chunk` with numpy, for tensors of many
    pieces and chunks."""
    if not shape:
        return [
            (
                (),
                (),
                [
                    (li, pi, (), (), 1)
                    for li, ps in enumerate(piece_lists)
                    for pi, _ in enumerate(ps)
                ],
            )
        ]
    pc, li, pi, lo, ext, cnt, coff, cshp = chunk_part_arrays(shape, chunk, piece_lists)
    out: list[tuple[tuple, tuple, list]] = [
        (tuple(o), tuple(s), []) for o, s in zip(coff.tolist(), cshp.tolist())
    ]
    for c, a, b, o, s, n in zip(
        pc.tolist(), li.tolist(), pi.tolist(), lo.tolist(), ext.tolist(), cnt.tolist()
    ):
        out[c][2].append((a, b, tuple(o), tuple(s), n))
    return out


def plan_chunk_grid(
    shape: tuple, itemsize: int, regions: "list | PieceArrays", blocks: list, opts: PlanOptions
) -> tuple:
    """Choose a regular chunk grid for a tensor ([SP-GRID-1]): the saving layout itself when
    it is one (no data moves), else the candidate that moves the fewest bytes, counting
    ``chunk_overhead_bytes`` per chunk. ``regions``: [(boxes, holder ranks)] per unique
    region, or the regions' :class:`PieceArrays`; ``blocks``: the rectangular blocks the
    holdings come from."""
    if not shape:
        return ()
    if math.prod(shape) == 0:
        return tuple(max(1, n) for n in shape)
    pa = regions if isinstance(regions, PieceArrays) else PieceArrays.of_boxes(len(shape), regions)
    nboxes = len(pa.li)
    aligned = _regular_grid(shape, pa)
    total_bytes = math.prod(shape) * itemsize
    if aligned is not None:
        aligned = _split_large(shape, aligned, itemsize, opts.max_chunk_bytes)
        n = _grid_chunks(shape, aligned)
        if n == 1 or total_bytes >= n * opts.chunk_overhead_bytes:
            return aligned
    cands = set()
    if aligned is not None:
        cands.add(aligned)
    cands.add(_split_large(shape, _gcd_grid_of(shape, pa), itemsize, opts.max_chunk_bytes))
    cands.add(_split_large(shape, tuple(shape), itemsize, opts.max_chunk_bytes))
    for base in (_gcd_grid(shape, blocks), _max_extent_grid(shape, blocks)):
        cands.add(_split_large(shape, base, itemsize, opts.max_chunk_bytes))
        per_block = max(1, round(nboxes / max(1, _grid_chunks(shape, base))))
        for k in {max(1, per_block // 2)} | {per_block * f for f in (1, 2, 4, 8, 16)}:
            slab = list(base)
            for d in range(len(slab)):
                if slab[d] > 1:
                    slab[d] = -(-slab[d] // k)
                    break
            cands.add(_split_large(shape, tuple(slab), itemsize, opts.max_chunk_bytes))
    # The cheapest candidate wins, the first in sorted order among equals; all candidates'
    # moved bytes are counted in one vectorised pass.
    ranked = [c for c in sorted(cands) if _grid_chunks(shape, c) <= 4 * nboxes + 64 or c == aligned]
    moved = _moved_many(shape, ranked, pa)
    costs = [
        m * itemsize + _grid_chunks(shape, c) * opts.chunk_overhead_bytes
        for m, c in zip(moved, ranked)
    ]
    best = ranked[costs.index(min(costs))]
    return best
