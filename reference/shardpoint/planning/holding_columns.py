"""One rank's holdings as columns (:class:`HoldingColumns`) and their wire forms: what each
rank sends up to plan a save or a load, cut so the coordinator decodes each distinct key
table segment once. Pure: no I/O.
"""

from __future__ import annotations

import zlib
from typing import Iterator, Optional, Sequence

import msgpack
import numpy as np

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
