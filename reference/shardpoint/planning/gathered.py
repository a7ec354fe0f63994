"""The coordinator's view of every rank's holdings (:class:`Gathered`): one set of int64
columns keyed by global tensor ids, decoded and checked ([SP-COVER-4]) once per distinct key
table segment, so replicated structure costs once. Pure: no I/O.
"""

from __future__ import annotations

from itertools import compress, count, repeat
from operator import is_, itemgetter
from bisect import bisect_right
from typing import Callable, Optional, Sequence, cast

import numpy as np

from shardpoint_core.format.errors import InvalidShardingError
from shardpoint.planning.holding_columns import HoldingColumns, decode_segment


def _disagree(e0: tuple, e: tuple, r0: int, r: int) -> None:
    raise InvalidShardingError(
        f"tensor {e[0]!r}: ranks disagree on global shape/dtype: rank {r0} has {e0[2]} "
        f"{e0[1]}, rank {r} has {e[2]} {e[1]}",
        spec_id="SP-COVER-4",
    )


class Gathered:
    """Every rank's holdings as one set of int64 columns, keyed by global tensor ids.

    ``keys[k] = (key, dtype, global_shape)`` for ``k`` in ``gk``; per row ``rank`` and ``hidx``
    (the holding's index on its rank), ``fs``/``fe``, ``off[d]``, ``shp[d]``, ``rep[j]``.
    Raises [SP-COVER-4] when ranks disagree on a tensor's global shape or dtype (checked once
    per distinct key table segment, so replicated structure is checked once); a caller may
    pass its own ``disagree(first entry, entry, first rank, rank)`` to raise another error.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        cols: Sequence[HoldingColumns],
        disagree: Optional[Callable] = None,
    ):
        disagree = disagree or _disagree
        keys: list = []  # [(key, dtype, global shape)] by global id
        raw: list = []  # the same entries in wire form, for cheap comparison
        kid: dict[str, int] = {}  # key -> global id
        first_rank: list = []
        seg_cache: dict = {}  # table segment bytes -> global ids of its rows
        table_cache: dict = {}  # a rank's segments -> global ids of its table's rows
        seg_of_table: dict = {}  # id of a table's map -> its segments (see below)
        maps = []

        def ids_of(entries: list, r: int) -> np.ndarray:
            """Global ids of a table's (or segment's) entries, new keys numbered in order."""
            found: list[Optional[int]] = list(map(kid.get, map(itemgetter(0), entries)))
            # keys seen for the first time (or twice in this table), found at C speed
            for i in compress(count(), map(is_, found, repeat(None))):
                e = entries[i]
                k = kid.get(e[0])
                if k is None:
                    kid[e[0]] = k = len(keys)
                    keys.append((e[0], e[1], tuple(e[2])))
                    raw.append(e)
                    first_rank.append(r)
                found[i] = k
            ids = cast("list[int]", found)  # every None was filled just above
            if list(map(raw.__getitem__, ids)) != entries:
                i = next(i for i, k in enumerate(ids) if raw[k] != entries[i])
                k0, e = keys[ids[i]], entries[i]
                disagree(k0, (e[0], e[1], tuple(e[2])), first_rank[ids[i]], r)
            return np.array(ids, np.int64)

        for r, c in zip(ranks, cols):
            tb = c.table_bytes
            if tb is None:  # columns built in this process
                maps.append(ids_of(c.raw_table(), r))
                continue
            tk = tuple(tb)
            m = table_cache.get(tk)
            if m is None:
                parts = []
                for sb in tb:
                    sm = seg_cache.get(sb)
                    if sm is None:
                        sm = seg_cache[sb] = ids_of(decode_segment(sb), r)
                    parts.append(sm)
                m = table_cache[tk] = np.concatenate(parts) if parts else np.zeros(0, np.int64)
                ends = np.cumsum([len(p) for p in parts]).tolist()
                # where each segment starts in the table, and the segment's own map (a run
                # of rows lies in one segment: its rows' global ids are that map's)
                seg_of_table[id(m)] = (ends, [(id(p), e - len(p)) for p, e in zip(parts, ends)])
            maps.append(m)
        self.keys, self.key_ids, self.first_rank = keys, kid, first_rank
        D = max((c.D for c in cols), default=0)
        R = max((c.R for c in cols), default=1)
        lens = np.array([c.n_rows() for c in cols], np.int64)
        n = int(lens.sum())
        self.n = n
        self._ranks = ranks_a = np.asarray(list(ranks), np.int64)
        self._row0 = row0 = np.cumsum(lens) - lens  # each rank's first row
        self._lens = lens

        where: dict = {}  # id of a distinct map -> its base in ``allmaps``
        distinct = []
        total = 0
        for m in maps:
            if id(m) not in where:
                where[id(m)] = total
                total += len(m)
                distinct.append(m)
        base = np.array([where[id(m)] for m in maps], np.int64)
        allmaps = np.concatenate(distinct) if distinct else np.zeros(0, np.int64)
        same = all(c.D == D and c.R == R for c in cols)
        # every rank's runs of rows (a run: one array per column), listed once: a column is
        # then one C-speed pass over them rather than a Python call per rank and column
        runs = (
            [r for c in cols for r in (c._runs if c._cols is None else (c._cols,))] if same else []
        )

        def column(j: int, j_of, fill):
            if same:  # every rank sent the same columns: one concatenation, no Python per rank
                parts = list(map(itemgetter(j), runs))
            else:
                parts = [
                    c.cols[j_of(c)] if j_of(c) is not None else np.full(len(c), fill) for c in cols
                ]
            return (
                np.concatenate(parts, dtype=np.int64, casting="safe")
                if parts
                else np.zeros(0, np.int64)
            )

        # the columns are joined on first use: the save's regions are found from the units
        # below (each distinct run once), and only the replica ids are read per row
        self._lazy = {
            # (the closures hold no reference to self: no cycle keeps the gather alive)
            "rank": lambda: np.repeat(ranks_a, lens),
            "hidx": lambda: np.arange(n, dtype=np.int64) - np.repeat(row0, lens),
            # each row's rank position, narrow: rank and holding index of rows in any order
            # read from it and two small tables (a cache-friendly gather)
            "_pos": lambda: np.repeat(
                np.arange(len(lens), dtype=np.int16 if len(lens) < 2**15 else np.int32), lens
            ),
            "gk": lambda: allmaps[column(0, lambda c: 0, 0) + np.repeat(base, lens)],
            "fs": lambda: column(2, lambda c: 2, -1),
            "fe": lambda: column(3, lambda c: 3, -1),
            "off": lambda: [
                column(4 + d, lambda c, d=d: 4 + d if d < c.D else None, 0) for d in range(D)
            ],
            "shp": lambda: [
                column(4 + D + d, lambda c, d=d: 4 + c.D + d if d < c.D else None, 1)
                for d in range(D)
            ],
            "rep": lambda: [
                column(4 + 2 * D + j, lambda c, j=j: 4 + 2 * c.D + j if j < c.R else None, 0)
                for j in range(R)
            ],
        }
        self.D = D
        # (columns before the replica ids of every distinct run, each row's row in them)
        self.units: Optional[tuple[list[np.ndarray], np.ndarray]] = None
        if same and runs:
            # units: a distinct run of rows (its columns before the replica ids, which a
            # deduplicating gather delivers as one object per distinct blob) read through one
            # key map; the data-parallel replicas of a job share them
            w = 4 + 2 * D
            rbase: list = []
            rseg: list = []
            for c, m in zip(cols, maps):
                rs = c._runs if c._cols is None else (c._cols,)
                rbase += [where[id(m)]] * len(rs)
                segs = seg_of_table.get(id(m))
                if segs is None:
                    rseg += [(id(m), 0)] * len(rs)  # the rank's whole table
                elif len(segs[1]) == 1:
                    rseg += segs[1] * len(rs)
                else:
                    ends, sids = segs
                    rseg += [
                        sids[bisect_right(ends, int(r[0][0]))] if len(r[0]) else (id(m), 0)
                        for r in rs
                    ]
            # a run's columns before the replica ids are one decoded blob (or one rank's
            # own arrays): its first and last column name it
            uid: dict = {}
            run_unit = [
                uid.setdefault((id(r[0]), id(r[w - 1]), *sg), len(uid)) for r, sg in zip(runs, rseg)
            ]
            first: dict[int, int] = {}
            for i, u in enumerate(run_unit):
                first.setdefault(u, i)
            ulist = [runs[i] for i in first.values()]
            ubases = [rbase[i] for i in first.values()]
            ulen = np.array([len(r[0]) for r in ulist], np.int64)
            ucat = [
                np.concatenate([r[j] for r in ulist], dtype=np.int64, casting="safe")
                for j in range(w)
            ]
            ucat[0] = allmaps[ucat[0] + np.repeat(np.array(ubases, np.int64), ulen)]
            run_len = np.array([len(r[0]) for r in runs], np.int64)
            ustart = np.cumsum(ulen) - ulen
            rstart = np.cumsum(run_len) - run_len
            # full row -> its unit row
            urow = np.arange(n, dtype=np.int64) + np.repeat(
                ustart[np.array(run_unit, np.int64)] - rstart, run_len
            )
            self.units = (ucat, urow)
            self._main_runs = (
                runs,
                run_len,
                rstart,
                w,
                [
                    f
                    for c in cols
                    for f in (
                        c._run_main
                        if c._cols is None and c._run_main is not None
                        else [None] * (len(c._runs) if c._cols is None else 1)
                    )
                ],
            )

    def rank_hidx(self, rows: np.ndarray) -> tuple:
        """(rank, holding index on that rank) of the rows ``rows``."""
        p = self._pos[rows]
        return self._ranks[p], rows - self._row0[p]

    def main_rows(self) -> np.ndarray:
        """Per row, whether the holding is the main replica (all-zero replica id); from each
        run's flag where its ranks sent the replica ids as constants, without joining the
        replica columns."""
        mr = self.__dict__.get("_main_runs")
        if mr is None:
            main = np.ones(self.n, bool)
            for c in self.rep:
                main &= c == 0
            return main
        runs, run_len, rstart, w, flags = mr
        f = np.array([-1 if x is None else int(x) for x in flags], np.int8)
        main = np.repeat(f == 1, run_len)
        arr = np.flatnonzero(f < 0)
        if len(arr):  # runs that sent their replica ids as columns: those rows only
            al = run_len[arr]
            m = np.ones(int(al.sum()), bool)
            for j in range(len(runs[0]) - w):
                m &= np.concatenate([runs[i][w + j] for i in arr.tolist()]) == 0
            main[
                np.repeat(rstart[arr] - (np.cumsum(al) - al), al)
                + np.arange(len(m), dtype=np.int64)
            ] = m
        return main

    def __getattr__(self, name: str):
        lazy = self.__dict__.get("_lazy")
        if lazy is None or name not in lazy:
            raise AttributeError(name)
        v = lazy.pop(name)()
        setattr(self, name, v)
        return v
