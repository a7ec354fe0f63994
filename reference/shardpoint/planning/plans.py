"""Plans are data: the frozen shapes that travel between the coordinator and the ranks.

``LocalPlan`` goes up (metadata only), ``RankSaveWork`` / ``RankLoadWork`` come down; all of
them encode to msgpack, never pickle. No logic beyond the wire forms lives here.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import msgpack
import numpy as np

from shardpoint.tree import dtypes
from shardpoint.tree import values
from shardpoint.planning.columns import (
    COMPRESS_FROM_WORLD,
    PLAN_ZLIB_LEVEL,
    HoldingColumns,
    as_columns,
)
from shardpoint.tree.model import Holding


@dataclass(frozen=True)
class PlanOptions:
    """Writer-side knobs. None of them changes what a reader must understand."""

    max_chunk_bytes: int = 256 << 20  # a chunk (one writer's unit) is at most this big
    chunk_overhead_bytes: int = 256 << 10  # cost of one more chunk, in bytes moved instead


# -------------------------------------------------------------------------------- wire forms
TREE_SPLIT = "split1"
PLAN_PARTS_TAG = "plan4"


def pack_tree(tree: Any) -> Any:
    """A rank's tree on the wire: ``zlib(msgpack(tree))``, or, for a dict of several
    branches, ``[TREE_SPLIT, [[key, zlib(msgpack(branch))], ...]]``: each top-level branch
    compressed alone, so the coordinator decodes each distinct branch once (every rank of a
    pipeline stage sends the same model branch; only the optimizer's differs)."""
    if isinstance(tree, dict) and len(tree) == 1 and len(tree.get("dict") or ()) > 1:
        return [
            TREE_SPLIT,
            [[k, zlib.compress(values.pack(v), PLAN_ZLIB_LEVEL)] for k, v in tree["dict"]],
        ]
    return zlib.compress(values.pack(tree), PLAN_ZLIB_LEVEL)


def unpack_branch(b: bytes) -> Any:
    """A tree (or a branch of one) that :func:`pack_tree` compressed."""
    return values.unpack_gathered(zlib.decompress(b))


def tree_wire_parts(w: Any) -> Optional[list]:
    """``[[key, branch bytes], ...]`` of a split tree wire form, None for a whole tree."""
    if isinstance(w, (bytes, bytearray)):
        return None
    if not (isinstance(w, (list, tuple)) and len(w) == 2 and w[0] == TREE_SPLIT):
        raise ValueError(f"not a tree wire form (tag {w[0] if w else w!r})")
    return w[1]


def unpack_tree(w: Any) -> Any:
    """The tree of a :func:`pack_tree` wire form."""
    parts = tree_wire_parts(w)
    if parts is None:
        return unpack_branch(w)
    return {"dict": [[k, unpack_branch(b)] for k, b in parts]}


@dataclass
class LocalPlan:
    """What one rank tells the coordinator before a save: metadata only, never tensor data.

    Wire form (msgpack, :meth:`to_bytes`): ``[rank, tree, holdings, objects]``, ``tree`` as
    :func:`pack_tree` gives, ``holdings`` as :meth:`HoldingColumns.to_wire` gives, ``objects``
    ``[[key, index, count, replica id, value]]``. Decoded from bytes, ``tree`` is None and
    the wire form stays in ``tree_bytes`` until :meth:`decoded_tree`: ranks of one
    data-parallel group send identical trees (or branches), and the coordinator decodes each
    distinct one once."""

    rank: int
    tree: Any
    holdings: Sequence[Holding]  # index = holding index on that rank (a list, or columns)
    objects: list  # [(key, index, count, replica tuple, value)]
    tree_bytes: Any = field(default=None, repr=False, compare=False)  # wire form of tree

    def to_bytes(self, world: int = 1) -> bytes:
        """The tree (compressed msgpack) and the holdings as columns
        (:class:`HoldingColumns`): a 4,096-rank job gathers ~1M holdings, which the
        coordinator decodes without a Python object each. ``world``: the job's size; from
        :data:`~.columns.COMPRESS_FROM_WORLD` ranks on the columns go compressed too."""
        tb = self.tree_bytes if self.tree is None else pack_tree(self.tree)
        hs = as_columns(self.holdings).to_wire(compress=world >= COMPRESS_FROM_WORLD)
        return values.pack([self.rank, tb, hs, [list(o) for o in self.objects]])

    @staticmethod
    def from_bytes(b: bytes) -> "LocalPlan":
        rank, tb, hs, objs = values.unpack(b)
        return LocalPlan(
            rank,
            None,
            HoldingColumns.from_wire(hs),
            [(k, i, c, tuple(r), v) for k, i, c, r, v in objs],
            tree_bytes=tb,
        )

    def to_parts(self) -> list:
        """The plan as ``[head, blob, ...]`` for a gather that sends each distinct blob once
        (:meth:`~shardpoint.exchange.comm.Comm.gather_parts`): the tree's branches and the
        holdings' key table segments and column runs (:meth:`HoldingColumns.to_parts`) are
        blobs, identical across data-parallel ranks wherever their structure is; ``head``:
        ``msgpack(["plan4", rank, tree branch keys or None (a whole tree: one blob),
        msgpack(holdings meta), objects])``, small and per rank."""
        tw = self.tree_bytes if self.tree is None else pack_tree(self.tree)
        parts = tree_wire_parts(tw)
        tkeys, tblobs = (
            (None, [tw]) if parts is None else ([k for k, _ in parts], [b for _, b in parts])
        )
        meta, hblobs = as_columns(self.holdings).to_parts()
        # the holdings meta as plain msgpack inside the head: values' decoder walks what it
        # is given for its extension types, and the meta (numbers, lists) has none
        head = values.pack(
            [PLAN_PARTS_TAG, self.rank, tkeys, msgpack.packb(meta), [list(o) for o in self.objects]]
        )
        return [head, *tblobs, *hblobs]

    @staticmethod
    def from_parts(parts: Sequence[bytes], cache: Optional[dict] = None) -> "LocalPlan":
        """Decode :meth:`to_parts`; ``cache`` (one dict for every rank of a gather) decodes
        each distinct holdings run once."""
        tag, rank, tkeys, meta, objs = values.unpack(parts[0])
        if tag != PLAN_PARTS_TAG:
            raise ValueError(f"not a local plan parts message (tag {tag!r})")
        nt = 1 if tkeys is None else len(tkeys)
        tb = (
            parts[1]
            if tkeys is None
            else [TREE_SPLIT, [[k, b] for k, b in zip(tkeys, parts[1 : 1 + nt])]]
        )
        return LocalPlan(
            rank,
            None,
            HoldingColumns.from_parts(msgpack.unpackb(meta), parts[1 + nt :], cache),
            [(k, i, c, tuple(r), v) for k, i, c, r, v in objs],
            tree_bytes=tb,
        )

    def decoded_tree(self) -> Any:
        if self.tree is None and self.tree_bytes is not None:
            return unpack_tree(self.tree_bytes)
        return self.tree


@dataclass(frozen=True)
class TensorLayout:
    key: str
    shape: tuple
    dtype: str
    chunk_shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.from_name(self.dtype).itemsize


class ChunkWrite(NamedTuple):
    """One chunk a rank writes. ``direct``: (holding, piece) whose view covers the chunk, so it
    is written straight from the caller's tensor; else the chunk is assembled in a buffer from
    ``local`` copies ``(holding, piece, box_offset, box_shape)`` and received transfers. A
    named tuple: a large job plans ~10^5 of them."""

    key: str
    offset: tuple
    shape: tuple
    direct: Optional[tuple] = None
    local: Sequence = ()


class Transfer(NamedTuple):
    """``box`` of ``key`` moves from rank ``src`` to rank ``dst``; ``src_ref`` and ``dst_ref``
    name the source view and the destination buffer on each side. A named tuple: a load
    of a large job plans about a million of them."""

    src: int
    dst: int
    key: str
    box_offset: tuple
    box_shape: tuple
    src_ref: tuple  # save: (holding, piece); load: (read index,)
    dst_ref: tuple  # save: (write index,);   load: (request index, piece)


@dataclass
class RankSaveWork:
    writes: list = field(default_factory=list)  # [ChunkWrite]
    sends: list = field(default_factory=list)  # [Transfer], in exchange order
    recvs: list = field(default_factory=list)  # [Transfer], in exchange order
    create: list = field(default_factory=list)  # keys whose array this rank creates only

    def to_bytes(self) -> bytes:
        # ChunkWrite and Transfer are named tuples whose fields are their wire rows, in
        # order: msgpack packs them as those arrays (the same bytes as listing each field)
        return msgpack.packb([self.writes, self.sends, self.recvs, self.create])

    @staticmethod
    def from_bytes(b: bytes) -> "RankSaveWork":
        ws, ss, rs, cr = msgpack.unpackb(b, strict_map_key=False)
        tup = _tuplify
        return RankSaveWork(
            [
                ChunkWrite(
                    k,
                    tup(o),
                    tup(s),
                    tup(d) if d else None,
                    [(h, p, tup(bo), tup(bs)) for h, p, bo, bs in loc],
                )
                for k, o, s, d, loc in ws
            ],
            [_t_unwire(t) for t in ss],
            [_t_unwire(t) for t in rs],
            list(cr),
        )


def _tuplify(x):
    return tuple(x)


def _t_unwire(w: list) -> Transfer:
    s, d, k, bo, bs, sr, dr = w
    return Transfer(s, d, k, tuple(bo), tuple(bs), tuple(sr), tuple(dr))


@dataclass(slots=True)
class ReadOp:
    """A region one rank reads from storage: straight into a request's view (``direct`` =
    (request, piece)) or into a buffer that ``local`` copies and sends then draw from."""

    key: str
    offset: tuple
    shape: tuple
    direct: Optional[tuple] = None
    local: list = field(default_factory=list)  # [(request, piece, box_offset, box_shape)]


class RankLoadWork:
    """One rank's load work as integer tables (one row per read, local copy or transfer), so
    the coordinator plans a million transfers with numpy instead of a million objects; the
    rank turns its own few rows into :class:`ReadOp` / :class:`Transfer` on first use
    (:attr:`reads`, :attr:`sends`, :attr:`recvs`).

    ``keys``/``ndims``: the key table the rows index. ``D``: padded dimensions (offsets pad
    with 0, shapes with 1). Rows: ``read_rows`` ``[key, direct request, direct piece,
    offset*D, shape*D]`` (direct -1: read into a buffer); ``local_rows`` ``[read, request,
    piece, box offset*D, box shape*D]``; ``send_rows``/``recv_rows`` ``[src, dst, key, read on
    src, request on dst, piece, box offset*D, box shape*D]``, in exchange order.
    """

    __slots__ = (
        "rank",
        "keys",
        "ndims",
        "D",
        "read_rows",
        "local_rows",
        "send_rows",
        "recv_rows",
        "_ops",
    )

    def __init__(
        self,
        rank: int = 0,
        keys: Sequence[str] = (),
        ndims: Sequence[int] = (),
        D: int = 0,
        read_rows=None,
        local_rows=None,
        send_rows=None,
        recv_rows=None,
    ):
        self.rank, self.keys, self.ndims, self.D = rank, keys, ndims, D
        self.read_rows = _rows(read_rows, 3 + 2 * D)
        self.local_rows = _rows(local_rows, 3 + 2 * D)
        self.send_rows = _rows(send_rows, 6 + 2 * D)
        self.recv_rows = _rows(recv_rows, 6 + 2 * D)
        # (reads, sends, recvs) as objects, made on first use
        self._ops: Optional[tuple[list[ReadOp], list[Transfer], list[Transfer]]] = None

    @staticmethod
    def from_ops(
        rank: int,
        reads: Sequence[ReadOp],
        sends: Sequence[Transfer] = (),
        recvs: Sequence[Transfer] = (),
    ) -> "RankLoadWork":
        """The tables of a rank's reads and transfers given as objects."""
        kid: dict = {}
        nds: list = []
        for k, nd in [(op.key, len(op.offset)) for op in reads] + [
            (t.key, len(t.box_offset)) for t in (*sends, *recvs)
        ]:
            if k not in kid:
                kid[k] = len(nds)
                nds.append(nd)
        D = max(nds, default=0)

        def box(o, s):
            return [*o, *(0,) * (D - len(o)), *s, *(1,) * (D - len(s))]

        rr = [[kid[op.key], *(op.direct or (-1, -1)), *box(op.offset, op.shape)] for op in reads]
        lr = [[i, q, p, *box(bo, bs)] for i, op in enumerate(reads) for q, p, bo, bs in op.local]

        def trows(ts):
            return [
                [
                    t.src,
                    t.dst,
                    kid[t.key],
                    t.src_ref[0],
                    *t.dst_ref,
                    *box(t.box_offset, t.box_shape),
                ]
                for t in ts
            ]

        return RankLoadWork(rank, list(kid), nds, D, rr, lr, trows(sends), trows(recvs))

    def _materialize(self) -> tuple:
        if self._ops is None:
            keys, nds, D = self.keys, self.ndims, self.D
            reads = []
            for k, dq, dp, *b in self.read_rows.tolist():
                nd = nds[k]
                reads.append(
                    ReadOp(
                        keys[k], tuple(b[:nd]), tuple(b[D : D + nd]), None if dq < 0 else (dq, dp)
                    )
                )
            for i, q, p, *b in self.local_rows.tolist():
                nd = len(reads[i].offset)
                reads[i].local.append((q, p, tuple(b[:nd]), tuple(b[D : D + nd])))

            def transfers(rows):
                out = []
                for s, d, k, ri, q, p, *b in rows.tolist():
                    nd = nds[k]
                    out.append(
                        Transfer(s, d, keys[k], tuple(b[:nd]), tuple(b[D : D + nd]), (ri,), (q, p))
                    )
                return out

            self._ops = (reads, transfers(self.send_rows), transfers(self.recv_rows))
        return self._ops

    @property
    def reads(self) -> list:
        """[:class:`ReadOp`] in read order (built once from the rows)."""
        return self._materialize()[0]

    @property
    def sends(self) -> list:
        """[:class:`Transfer`] this rank sends, in exchange order."""
        return self._materialize()[1]

    @property
    def recvs(self) -> list:
        """[:class:`Transfer`] this rank receives, in exchange order."""
        return self._materialize()[2]

    def to_bytes(self, layouts: dict) -> bytes:
        """The tables, keys as positions in ``sorted(layouts)`` (the manifest's keys, which
        every rank has), each table in its narrowest integer type."""
        pos = {k: i for i, k in enumerate(sorted(layouts))}
        kmap = np.array([pos[k] for k in self.keys] or [0], np.int64)
        tables = []
        for t, j in (
            (self.read_rows, 0),
            (self.local_rows, None),
            (self.send_rows, 2),
            (self.recv_rows, 2),
        ):
            if j is not None and len(t):
                t = t.copy()
                t[:, j] = kmap[t[:, j]]
            tables.append(pack_ints(t))
        return encode_load_work(self.rank, self.D, tables)

    @staticmethod
    def from_bytes(b: bytes, layouts: dict) -> "RankLoadWork":
        """Decode :meth:`to_bytes`; ``layouts``: key -> anything with ``.shape`` (the
        manifest's tensors)."""
        tag, rank, D, tables = msgpack.unpackb(b)
        if tag != LOAD_WORK_TAG:
            raise ValueError(f"not a load work message (tag {tag!r})")
        keys = sorted(layouts)
        return RankLoadWork(
            rank, keys, [len(layouts[k].shape) for k in keys], D, *[unpack_ints(t) for t in tables]
        )


def encode_load_work(rank: int, D: int, tables: list) -> bytes:
    """The wire form of one rank's load work: its four tables as :func:`pack_ints` gives."""
    return msgpack.packb([LOAD_WORK_TAG, rank, D, tables])


LOAD_WORK_TAG = "loadwork1"


def _rows(a, width: int) -> np.ndarray:
    if a is None or len(a) == 0:
        return np.zeros((0, width), np.int64)
    return np.asarray(a, np.int64).reshape(-1, width)


_INT_RANGES = [
    (t, int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in ("<i1", "<i2", "<i4", "<i8")
]


def narrowest_int(lo: int, hi: int) -> str:
    return next(t for t, a, b in _INT_RANGES if a <= lo and hi <= b)


def pack_ints(a: np.ndarray) -> list:
    """A 2-D integer table as ``[dtype, rows, columns, bytes]`` in the narrowest type."""
    t = narrowest_int(*((int(a.min()), int(a.max())) if a.size else (0, 0)))
    return [t, a.shape[0], a.shape[1], np.ascontiguousarray(a, t).tobytes()]


def unpack_ints(w: list) -> np.ndarray:
    t, n, m, b = w
    return np.frombuffer(b, t, n * m).astype(np.int64).reshape(n, m)
