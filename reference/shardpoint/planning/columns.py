"""The coordinator's distinct regions (:class:`Regions`): every rank's gathered holdings
grouped into the distinct non-empty regions of each tensor and who holds each, with the
exact vectorised row grouping (:func:`group_rows`) it runs on.

A 4,096-rank job gathers about a million holdings, mostly replicas of a few tens of
thousands of regions. Keeping them as columns (one row per holding) lets the coordinator
decode, check and group them with a handful of vectorised numpy passes, so planning costs
grow with the distinct structure rather than with ranks x tensors. Pure: no I/O. The
columns themselves (:mod:`.holding_columns`), their gather (:mod:`.gathered`) and
:func:`gc_paused` (:mod:`.gc_pause`) are re-exported here, where callers import them.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from shardpoint_core.format.errors import InvalidShardingError
from shardpoint.planning.gc_pause import gc_paused
from shardpoint.planning.holding_columns import (
    COMPRESS_FROM_WORLD,
    PARTS_TAG,
    PLAN_ZLIB_LEVEL,
    WIRE_TAG,
    ZIP_TAG,
    HoldingColumns,
    as_columns,
    decode_segment,
    decode_table,
    pack_columns,
    unpack_columns,
)
from shardpoint.planning.gathered import Gathered

__all__ = [
    "COMPRESS_FROM_WORLD",
    "PARTS_TAG",
    "PLAN_ZLIB_LEVEL",
    "WIRE_TAG",
    "ZIP_TAG",
    "Gathered",
    "HoldingColumns",
    "Regions",
    "as_columns",
    "decode_segment",
    "decode_table",
    "gc_paused",
    "group_rows",
    "pack_columns",
    "unpack_columns",
]


class Regions:
    """The distinct non-empty regions of every tensor and who holds each.

    ``region(g) = (gk, offset, shape, flat)`` (``offset``/``shape`` cut to the tensor's rank);
    ``holders(g)`` gives the ranks (ascending) and holding indices of region ``g``; ``by_key``
    maps a global key id to its regions in a canonical (sorted) order and a signature (bytes)
    equal for keys with equal regions. Raises [SP-REPL-2] when
    two holdings of a region are both the main replica (all-zero replica id), unless
    ``check_replicas`` is off (load requests carry no replica ids that matter).
    """

    def __init__(self, g: Gathered, check_replicas: bool = True, units: bool = True):
        """``units``: group the gathered units' distinct rows (:func:`_group_units`) where
        the gather has them; False groups every row (the same regions, numbered alike)."""
        if units and g.units is not None:
            sel, order, starts, rows = _group_units(g)
        else:
            sel, order, starts, rows = _group_all(g)

        def pick(c):
            return c if sel is None else c[sel]

        self.start = starts
        self._rank_l: Optional[list[int]] = None  # hold_rank and hold_hidx as lists,
        self._hidx_l: Optional[list[int]] = None  # made on first use
        self.start_l = starts.tolist()
        self.hold_rank, self.hold_hidx = g.rank_hidx(order if sel is None else sel[order])
        self._keys, self._D = g.keys, g.D
        self._rows = rows
        # regions of each key in canonical (lexicographic) order, and a signature of them
        # (their rows' bytes): tensors with equal shape and signature share a plan pattern
        canon = np.lexsort(rows.T[::-1]) if len(rows) else np.zeros(0, np.int64)
        ks = rows[canon, 0]
        cut = np.flatnonzero(ks[1:] != ks[:-1]) + 1
        bounds = [0] + cut.tolist() + [len(canon)]
        canon_l = canon.tolist()
        sig = rows[canon, 1:].tobytes()
        w = (rows.shape[1] - 1) * rows.itemsize
        lo, hi = bounds[:-1], bounds[1:]
        self.by_key = dict(
            zip(
                ks[lo].tolist() if len(canon) else [],
                zip(
                    map(canon_l.__getitem__, map(slice, lo, hi)),
                    map(sig.__getitem__, map(slice, [a * w for a in lo], [b * w for b in hi])),
                ),
            )
        )
        if not check_replicas:
            return
        main = pick(g.main_rows())
        main_sorted = main[order]
        nmain = (
            np.add.reduceat(main_sorted.astype(np.int64), starts[:-1])
            if len(rows)
            else np.zeros(0, np.int64)
        )
        dup = np.flatnonzero(nmain > 1)
        if len(dup):
            gi = min(dup.tolist(), key=lambda i: (g.keys[rows[i, 0]][0], rows[i].tolist()))
            rows = order[starts[gi] : starts[gi + 1]]
            rows = rows[main[rows]]
            rep = [pick(c) for c in g.rep]
            mains = [(int(pick(g.rank)[j]), tuple(int(c[j]) for c in rep)) for j in rows]
            k, o, s, f = self.region(gi)
            who = ", ".join(f"rank {r}" for r, _ in mains[:4]) + (
                f" and {len(mains) - 4} more" if len(mains) > 4 else ""
            )
            raise InvalidShardingError(
                f"tensor {g.keys[k][0]!r}: {who} all hold region offset {o} shape {s}"
                + (f" range {f}" if f else "")
                + " as the main replica (all-zero replica_id); "
                "a region has at most one main replica: give the other holders a non-zero "
                "replica_id (they may share one)",
                spec_id="SP-REPL-2",
            )

    def region(self, gi: int) -> tuple:
        """Region ``gi`` as ``(key id, offset, shape, flat or None)``."""
        row, D = self._rows[gi].tolist(), self._D
        nd = len(self._keys[row[0]][2])
        f = None if row[1 + 2 * D] < 0 else (row[1 + 2 * D], row[2 + 2 * D])
        return row[0], tuple(row[1 : 1 + nd]), tuple(row[1 + D : 1 + D + nd]), f

    def holders(self, gi: int) -> tuple:
        a, b = self.start[gi], self.start[gi + 1]
        return self.hold_rank[a:b], self.hold_hidx[a:b]

    def holder_lists(self, gi: int) -> tuple:
        """(ranks, holding indices) of region ``gi`` as lists."""
        rl, hl = self._rank_l, self._hidx_l
        if rl is None or hl is None:
            rl = self._rank_l = self.hold_rank.tolist()
            hl = self._hidx_l = self.hold_hidx.tolist()
        a, b = self.start_l[gi], self.start_l[gi + 1]
        return rl[a:b], hl[a:b]


def _group_all(g: Gathered) -> tuple:
    """``(sel, order, starts, rows)`` of :class:`Regions` from every gathered row: the
    non-empty rows (``sel``, None for all), grouped (:func:`group_rows`), and each group's
    row ``[gk, offset.., shape.., fs, fe]``."""
    fs, fe = g.fs, g.fe
    size = np.ones(g.n, np.int64)
    for s in g.shp:
        size *= s
    nonempty = np.where(fs >= 0, fe > fs, size > 0)
    sel = None if nonempty.all() else np.flatnonzero(nonempty)

    def pick(c):
        return c if sel is None else c[sel]

    cols = [pick(g.gk)] + [pick(c) for c in g.off] + [pick(c) for c in g.shp] + [pick(fs), pick(fe)]
    order, starts = group_rows(cols)
    first = order[starts[:-1]]
    rows = (
        np.column_stack([c[first] for c in cols])
        if len(first)
        else np.zeros((0, len(cols)), np.int64)
    )
    return sel, order, starts, rows


def _group_units(g: Gathered) -> tuple:
    """What :func:`_group_all` returns, found from the units' distinct rows: every gathered
    row is a unit's row (``g.units``), so the regions are the distinct contents of the
    units' rows, each bucketed by the same hash and bits as :func:`group_rows` would over all
    rows (same numbering, same fallback to lexicographic order on a collision); only the
    holders' order is made per row, by one sort of (region, row) integers."""
    assert g.units is not None, "called where the gather has units"
    ucat, urow = g.units
    D = g.D
    ufs, ufe = ucat[2], ucat[3]
    size = np.ones(len(ufs), np.int64)
    for c in ucat[4 + D : 4 + 2 * D]:
        size *= c
    une = np.where(ufs >= 0, ufe > ufs, size > 0)
    ucols = [ucat[0]] + ucat[4 : 4 + 2 * D] + [ufs, ufe]
    if une.all():
        sel, fr = None, urow
    else:
        sel = np.flatnonzero(une[urow])
        fr = urow[sel]
    n = len(fr)
    if not n:
        return (
            sel,
            np.zeros(0, np.int64),
            np.zeros(1, np.int64),
            np.zeros((0, len(ucols)), np.int64),
        )
    live = np.flatnonzero(une)  # every non-empty unit row is some gathered row
    uo, us = group_rows([c[live] for c in ucols])
    G = len(us) - 1
    cg = np.empty(len(live), np.int64)
    cg[uo] = np.repeat(np.arange(G, dtype=np.int64), np.diff(us))
    rep_rows = [c[live[uo[us[:-1]]]] for c in ucols]  # one row per distinct content
    b = max(1, (n - 1).bit_length())
    hb = _row_hash(rep_rows) >> np.uint64(b)
    if len(np.unique(hb)) == G:
        gorder = np.argsort(hb)  # buckets of distinct hashes, ascending, as group_rows
    else:  # a collision: group_rows falls back to lexicographic
        gorder = np.lexsort(rep_rows[::-1])
    rid_of = np.empty(G, np.int64)
    rid_of[gorder] = np.arange(G, dtype=np.int64)
    ureg = np.zeros(len(une), np.int64)
    ureg[live] = rid_of[cg]
    rid = ureg[fr]
    packed = (rid << b) | np.arange(n, dtype=np.int64)
    packed.sort()
    order = packed & ((1 << b) - 1)
    starts = np.concatenate([[0], np.cumsum(np.bincount(rid, minlength=G))])
    rows = np.column_stack([c[gorder] for c in rep_rows])
    return sel, order, starts, rows


_MIX = np.uint64(0xBF58476D1CE4E5B9)


def _row_hash(cols: list) -> np.ndarray:
    """A 64-bit hash of each row of the int64 columns ``cols`` (see :func:`group_rows`)."""
    h = np.full(len(cols[0]), 0x9E3779B97F4A7C15, np.uint64)
    with np.errstate(over="ignore"):
        for col in cols:
            h ^= col.view(np.uint64) if col.dtype == np.int64 else col.astype(np.uint64)
            h *= _MIX
            h ^= h >> np.uint64(29)
    return h


def group_rows(cols: list) -> tuple:
    """Group equal rows of the columns ``cols``: ``(order, starts)`` such that
    ``order[starts[i]:starts[i + 1]]`` are the rows of group ``i`` in their original order.
    Exact: rows are bucketed by a hash (64 bits less those of the row number), then checked
    against their neighbours in the bucket (an exact lexicographic sort takes over on a
    collision)."""
    n = len(cols[0])
    if not n:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    h = _row_hash(cols)
    # sort (hash, row) pairs packed in one uint64, hash in the high bits: a plain sort of
    # distinct integers is 4x faster than a stable argsort and keeps each group's rows in order
    b = max(1, (n - 1).bit_length())
    packed = (h >> np.uint64(b)) << np.uint64(b)
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    order = (packed & np.uint64((1 << b) - 1)).astype(np.int64)
    hs = packed >> np.uint64(b)
    brk = np.flatnonzero(hs[1:] != hs[:-1]) + 1
    starts = np.concatenate([[0], brk, [n]])
    # every row equal to its bucket's first row? (read from the small table of first rows,
    # which stays in cache, rather than gathering each column in sorted order)
    gid = np.empty(n, np.int32 if len(starts) < 2**31 else np.int64)
    gid[order] = np.repeat(np.arange(len(starts) - 1, dtype=gid.dtype), np.diff(starts))
    first = order[starts[:-1]]
    if not any((c != c[first][gid]).any() for c in cols):
        return order, starts
    order = np.lexsort(cols[::-1])
    same = np.ones(n - 1, bool)
    for c in cols:
        cs = c[order]
        same &= cs[1:] == cs[:-1]
    brk = np.flatnonzero(~same) + 1
    return order, np.concatenate([[0], brk, [n]])
