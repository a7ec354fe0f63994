"""Holdings as columns: one rank's holdings as numpy arrays, their wire form, and the
coordinator's view of every rank's holdings grouped into distinct regions.

A 4,096-rank job gathers about a million holdings, mostly replicas of a few tens of
thousands of regions. Keeping them as columns (one row per holding) lets the coordinator
decode, check and group them with a handful of vectorised numpy passes, so planning costs
grow with the distinct structure rather than with ranks x tensors. Pure: no I/O.
"""

from __future__ import annotations

import gc
from bisect import bisect_right
import zlib
from contextlib import contextmanager
from itertools import compress, count, repeat
from operator import is_, itemgetter
from typing import Callable, Iterator, Optional, Sequence, cast

import msgpack
import numpy as np

from shardpoint_core.format.errors import InvalidShardingError
from shardpoint.tree.model import Holding

WIRE_TAG = "cols2"
ZIP_TAG = "cols3"  # the same with the body compressed (jobs of COMPRESS_FROM_WORLD ranks)
PARTS_TAG = "cols4"  # meta + blobs, for a gather that sends each distinct blob once
# zlib level of what a rank sends up (key tables, tree branches, compressed bodies): 9 makes
# them ~25% smaller than 1 for ~1 ms more a rank, paid in parallel; inflating costs the same,
# and tables and branches are inflated once per distinct content. Measured on the simulated
# 16,384-rank job (one rank in 257): 3.45 KiB a rank at level 1, 2.8 KiB at 9
PLAN_ZLIB_LEVEL = 9
# From this many ranks on, ranks compress their columns' body too: it shrinks ~8x (a rank's
# rows repeat: the optimizer's states share their ranges), which takes the simulated
# 16,384-rank job from 135 to 45 MB gathered, but every body is inflated at the coordinator
# (measured here, interleaved, at 4,096 ranks: 0.85 ms a rank against 0.27 ms for the plain
# body, on a loaded machine), so below this size, where the gather is small anyway (34 MB at
# 4,096 ranks), the body goes plain.
COMPRESS_FROM_WORLD = 8192


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: planning a large job allocates ~10^5 acyclic
    objects, and the collections they trigger cost more than the planning itself (measured:
    0.7 s of 1.9 s for the 4,096-rank job). Restores the previous state.

    On the way out the objects made meanwhile are moved to the oldest generation at once
    (``gc.freeze()`` + ``gc.unfreeze()``, when nothing else is frozen): the plan outlives the
    call, and the young collection that re-enabling would trigger walked every one of them
    (0.15 s for that job) only to promote them there.

    Meanwhile numpy does not ask the kernel for huge pages for its large arrays (its
    default on Linux, ``madvise(MADV_HUGEPAGE)``): a plan's arrays live for a fraction of a
    second, and faulting in (and compacting memory for) fresh 2 MiB pages cost more than the
    planning that used them (benchmarks/RESULTS.md, 16,384 ranks). Restored on the way
    out."""
    was = gc.isenabled()
    gc.disable()
    hp = _set_huge_pages(False)
    try:
        yield
    finally:
        _set_huge_pages(hp)
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _set_huge_pages(on: Optional[bool]) -> Optional[bool]:
    """Set numpy's huge-page advice for new arrays; returns the previous setting (None where
    this numpy has no such switch, or when ``on`` is None)."""
    if on is None:
        return None
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    fn = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    return None if fn is None else bool(fn(on))


class HoldingColumns(Sequence):
    """A rank's holdings as columns; indexing gives :class:`Holding` back.

    ``table``: distinct ``(key, dtype, global_shape)`` of the rank. ``cols``: 1-D integer
    arrays, one row per holding: ``kidx`` (row of ``table``), ``rlen`` (replica id length),
    ``fs``/``fe`` (flattened range, ``-1`` when rectangular), then ``D`` offset columns
    (padded with 0 past a tensor's rank), ``D`` shape columns (padded with 1) and ``R``
    replica-id columns (padded with 0).

    Wire form (msgpack, :meth:`to_wire`): ``["cols2", rows, D, R, table segments, column
    types, body]``. The table is cut into segments where the key's first component changes
    (``model/...``, ``optim/...``), each ``zlib(msgpack([[key, dtype, [global shape]]]))``:
    data-parallel ranks share the model's segment byte for byte, so the coordinator decodes
    each distinct segment once. ``body``: the columns one after another, each in its type
    (the narrowest little-endian integer holding it, ``"<i1"`` .. ``"<i8"``). ``"cols3"``: the
    same with ``zlib(body)``, sent by the ranks of large jobs (:data:`COMPRESS_FROM_WORLD`).
    """

    __slots__ = ("_table", "_cols", "_runs", "_run_main", "D", "R", "table_bytes")

    def __init__(
        self,
        table: Optional[list],
        cols: Optional[list],
        D: int,
        R: int,
        table_bytes: Optional[list] = None,
        runs: Optional[list] = None,
        run_main: Optional[list] = None,
    ):
        """``cols``: the columns; or ``runs``, lists of columns for consecutive rows, joined
        on first use of :attr:`cols` (the coordinator's :class:`Gathered` joins every
        rank's runs in one pass instead). ``run_main``: per run, whether its replica ids are
        all zero (True/False, where the run sent them as constants) or None (read the
        columns)."""
        if cols is None and not runs:
            raise ValueError("holding columns need their columns or at least one run")
        self._table, self._cols, self.D, self.R = table, cols, D, R
        self._runs: list = [] if runs is None else runs  # read while _cols is None
        self._run_main = run_main
        self.table_bytes = table_bytes

    @property
    def cols(self) -> list:
        if self._cols is None:
            runs = self._runs
            self._cols = runs[0] if len(runs) == 1 else [np.concatenate(c) for c in zip(*runs)]
        return self._cols

    @property
    def table(self) -> list:
        """``[(key, dtype, global_shape)]``, decoded on first use: the coordinator decodes
        each distinct table once, however many ranks sent it."""
        if self._table is None:
            assert self.table_bytes is not None, "columns built without their key table"
            self._table = decode_table(self.table_bytes)
        return self._table

    def raw_table(self) -> list:
        """The table as ``[[key, dtype, [global shape]]]`` (wire form, no conversion)."""
        if self.table_bytes is not None:
            return [e for b in self.table_bytes for e in decode_segment(b)]
        return [[k, d, list(g)] for k, d, g in self.table]

    def __len__(self) -> int:
        return self.n_rows()

    def n_rows(self) -> int:
        if self._cols is None:
            return sum(len(r[0]) for r in self._runs)
        return len(self._cols[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = [int(c[i]) for c in self.cols]
        key, dtype, g = self.table[row[0]]
        nd, D = len(g), self.D
        return Holding(
            key,
            dtype,
            g,
            tuple(row[4 : 4 + nd]),
            tuple(row[4 + D : 4 + D + nd]),
            None if row[2] < 0 else (row[2], row[3]),
            tuple(row[4 + 2 * D : 4 + 2 * D + row[1]]),
        )

    def __iter__(self) -> Iterator[Holding]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    @staticmethod
    def from_holdings(hs: Sequence[Holding]) -> "HoldingColumns":
        """Columns of a list of holdings (one Python pass; ranks build their own)."""
        index: dict = {}
        table: list = []
        D = max((len(h.global_shape) for h in hs), default=0)
        R = max((len(h.replica) for h in hs), default=1)
        rows = []
        pad_o, pad_s, pad_r = (0,) * D, (1,) * D, (0,) * R
        for h in hs:
            t = (h.key, h.dtype, tuple(h.global_shape))
            k = index.get(t)
            if k is None:
                index[t] = k = len(table)
                table.append(t)
            nd = len(h.offset)
            f = h.flat or (-1, -1)
            rows.append(
                (k, len(h.replica), f[0], f[1])
                + tuple(h.offset)
                + pad_o[nd:]
                + tuple(h.shape)
                + pad_s[nd:]
                + tuple(h.replica)
                + pad_r[len(h.replica) :]
            )
        m = np.array(rows, np.int64).reshape(len(hs), 4 + 2 * D + R).T
        return HoldingColumns(table, list(m), D, R)

    def to_wire(self, compress: bool = False) -> bytes:
        """The key table (zlib, in segments) once, then each column in the narrowest integer
        type (see the class docstring); ``compress``: the body zlib-compressed (``"cols3"``,
        for jobs of :data:`COMPRESS_FROM_WORLD` ranks or more)."""
        segs, _ = _segments(self.table)
        table = [zlib.compress(msgpack.packb(sg), PLAN_ZLIB_LEVEL) for sg in segs]
        kinds, body = _narrow(self.cols)
        if compress:
            return msgpack.packb(
                [
                    ZIP_TAG,
                    len(self),
                    self.D,
                    self.R,
                    table,
                    kinds,
                    zlib.compress(body, PLAN_ZLIB_LEVEL),
                ]
            )
        return msgpack.packb([WIRE_TAG, len(self), self.D, self.R, table, kinds, body])

    def to_parts(self) -> tuple:
        """The columns as ``(meta, blobs)`` for a gather that sends each distinct blob once
        (:meth:`~shardpoint.exchange.comm.Comm.gather_parts`): data-parallel ranks hold the
        same regions under other replica ids, so their rows differ in the replica columns
        only. ``blobs``: the key table segments (as in :meth:`to_wire`), then per *run* (rows
        cut where the key's first component changes, as the table is) the zlib of
        ``msgpack([column types, body])`` of the columns before the replica ids, and, unless
        every replica column is constant over the run, the same for the replica columns.
        ``meta``: ``["cols4", rows, D, R, table segments, [[run rows, replica constants or
        None], ...]]``."""
        segs, seg_of = _segments(self.table)
        blobs = [zlib.compress(msgpack.packb(sg), PLAN_ZLIB_LEVEL) for sg in segs]
        n, w = len(self), 4 + 2 * self.D
        runs: list = []
        if n:
            rs = seg_of[self.cols[0]]
            cuts = [0, *(np.flatnonzero(rs[1:] != rs[:-1]) + 1).tolist(), n]
            for a, b in zip(cuts, cuts[1:]):
                blobs.append(pack_columns([c[a:b] for c in self.cols[:w]]))
                rep = [c[a:b] for c in self.cols[w:]]
                if all((c == c[0]).all() for c in rep):
                    runs.append([b - a, [int(c[0]) for c in rep]])
                else:
                    runs.append([b - a, None])
                    blobs.append(pack_columns(rep))
        return [PARTS_TAG, n, self.D, self.R, len(segs), runs], blobs

    @staticmethod
    def from_parts(
        meta: list, blobs: Sequence[bytes], cache: Optional[dict] = None
    ) -> "HoldingColumns":
        """Decode :meth:`to_parts`. ``cache`` (a dict shared across ranks): each distinct run
        blob is inflated once (the blobs a deduplicating gather delivers are one object per
        distinct content, so their hashes are computed once)."""
        tag, n, D, R, nt, runs = meta
        if tag != PARTS_TAG:
            raise ValueError(f"not a columnar holdings parts message (tag {tag!r})")
        if (
            len(blobs) != nt + sum(2 if c is None else 1 for _r, c in runs)
            or sum(r for r, _ in runs) != n
        ):
            raise ValueError("holdings parts do not add up to the stated blobs and rows")
        cache = {} if cache is None else cache
        w, pos, pieces, run_main = 4 + 2 * D, nt, [], []

        def cols_of(b: bytes, rows: int, width: int) -> list:
            got = cache.get(b)
            if got is None:
                got = cache[b] = unpack_columns(b)
            if got[0] != rows or len(got[1]) != width:
                raise ValueError("a holdings run's columns do not match its row count")
            return got[1]

        def full(rows: int, v: int) -> np.ndarray:
            a = cache.get((rows, v))  # one read-only array per (rows, value)
            if a is None:
                a = cache[(rows, v)] = np.full(rows, v, np.int64)
                a.flags.writeable = False
            return a

        for rows, consts in runs:
            main = cols_of(blobs[pos], rows, w)
            pos += 1
            if consts is None:
                rep = cols_of(blobs[pos], rows, R)
                pos += 1
            else:
                if len(consts) != R:
                    raise ValueError("a holdings run's replica constants do not match R")
                rep = [full(rows, v) for v in consts]
            pieces.append(main + rep)
            run_main.append(None if consts is None else not any(consts))
        if not pieces:
            return HoldingColumns(
                None,
                [np.zeros(0, np.int64) for _ in range(w + R)],
                D,
                R,
                table_bytes=list(blobs[:nt]),
            )
        return HoldingColumns(
            None, None, D, R, table_bytes=list(blobs[:nt]), runs=pieces, run_main=run_main
        )

    @staticmethod
    def from_wire(b: bytes) -> "HoldingColumns":
        tag, n, D, R, table_b, kinds, body = msgpack.unpackb(b)
        if tag == ZIP_TAG:
            body = zlib.decompress(body)
        elif tag != WIRE_TAG:
            raise ValueError(f"not a columnar holdings message (tag {tag!r})")
        cols, pos = [], 0
        for t in kinds:
            c = np.frombuffer(body, t, n, pos)
            pos += c.nbytes
            cols.append(c)
        return HoldingColumns(None, cols, D, R, table_bytes=table_b)


def _segments(table: Sequence) -> tuple:
    """The key table cut where the key's first component changes, in wire form, and each
    entry's segment number (an array)."""
    segs: list = []
    seg_of: list = []
    top = None
    for k, d, g in table:
        t = k.split("/", 1)[0]
        if not segs or t != top:
            segs.append([])
            top = t
        segs[-1].append([k, d, list(g)])
        seg_of.append(len(segs) - 1)
    return segs, np.array(seg_of or [0], np.int64)


def _narrow(cols: Sequence[np.ndarray]) -> tuple:
    """Each column in the narrowest little-endian integer type holding it: the types and
    the columns' bytes one after another."""
    kinds, body = [], []
    for c in cols:
        lo, hi = (int(c.min()), int(c.max())) if len(c) else (0, 0)
        t = next(
            t
            for t in ("<i1", "<i2", "<i4", "<i8")
            if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max
        )
        kinds.append(t)
        body.append(np.ascontiguousarray(c, t).tobytes())
    return kinds, b"".join(body)


def pack_columns(cols: Sequence[np.ndarray], level: int = PLAN_ZLIB_LEVEL) -> bytes:
    """Columns of equal length as ``zlib(msgpack([types, rows, body]))``, each column in its
    narrowest integer type, one after another."""
    kinds, body = _narrow(cols)
    return zlib.compress(msgpack.packb([kinds, len(cols[0]) if cols else 0, body]), level)


def unpack_columns(b: bytes) -> tuple:
    """``(rows, columns)`` of :func:`pack_columns`."""
    kinds, n, body = msgpack.unpackb(zlib.decompress(b))
    cols, pos = [], 0
    for t in kinds:
        if t not in ("<i1", "<i2", "<i4", "<i8"):
            raise ValueError(f"not a column type: {t!r}")
        c = np.frombuffer(body, t, n, pos)
        pos += c.nbytes
        cols.append(c)
    return n, cols


def decode_segment(b: bytes) -> list:
    """One table segment of the wire form: ``[[key, dtype, [global shape]]]``."""
    return msgpack.unpackb(zlib.decompress(b))


def decode_table(segments: list) -> list:
    return [(k, d, tuple(g)) for b in segments for k, d, g in decode_segment(b)]


def as_columns(hs: Sequence[Holding]) -> HoldingColumns:
    return hs if isinstance(hs, HoldingColumns) else HoldingColumns.from_holdings(hs)


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
