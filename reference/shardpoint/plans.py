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

from . import dtypes, values
from .columns import HoldingColumns, as_columns
from .model import Holding


@dataclass(frozen=True)
class PlanOptions:
    """Writer-side knobs. None of them changes what a reader must understand."""

    max_chunk_bytes: int = 256 << 20     # a chunk (one writer's unit) is at most this big
    chunk_overhead_bytes: int = 256 << 10  # cost of one more chunk, in bytes moved instead


# -------------------------------------------------------------------------------- wire forms
@dataclass
class LocalPlan:
    """What one rank tells the coordinator before a save: metadata only, never tensor data.

    Decoded from bytes, ``tree`` is None and the tree stays in ``tree_bytes`` until
    :meth:`decoded_tree`: ranks of one data-parallel group send identical trees, and the
    coordinator decodes each distinct one once."""

    rank: int
    tree: Any
    holdings: Sequence[Holding]   # index = holding index on that rank (a list, or columns)
    objects: list           # [(key, index, count, replica tuple, value)]
    tree_bytes: Optional[bytes] = field(default=None, repr=False, compare=False)

    def to_bytes(self) -> bytes:
        """The tree (compressed msgpack) and the holdings as compressed columns
        (:class:`HoldingColumns`): a 4,096-rank job gathers ~1M holdings, which the
        coordinator decodes without a Python object each."""
        tb = self.tree_bytes if self.tree is None else zlib.compress(values.pack(self.tree), 1)
        hs = as_columns(self.holdings).to_wire()
        return values.pack([self.rank, tb, hs, [list(o) for o in self.objects]])

    @staticmethod
    def from_bytes(b: bytes) -> "LocalPlan":
        rank, tb, hs, objs = values.unpack(b)
        return LocalPlan(rank, None, HoldingColumns.from_wire(hs),
                         [(k, i, c, tuple(r), v) for k, i, c, r, v in objs], tree_bytes=tb)

    def decoded_tree(self) -> Any:
        if self.tree is None and self.tree_bytes is not None:
            return values.unpack(zlib.decompress(self.tree_bytes))
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


@dataclass(slots=True)
class ChunkWrite:
    """One chunk a rank writes. ``direct``: (holding, piece) whose view covers the chunk, so it
    is written straight from the caller's tensor; else the chunk is assembled in a buffer from
    ``local`` copies ``(holding, piece, box_offset, box_shape)`` and received transfers."""

    key: str
    offset: tuple
    shape: tuple
    direct: Optional[tuple] = None
    local: list = field(default_factory=list)


class Transfer(NamedTuple):
    """``box`` of ``key`` moves from rank ``src`` to rank ``dst``; ``src_ref`` and ``dst_ref``
    name the source view and the destination buffer on each side. A named tuple: a load
    of a large job plans about a million of them."""

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


@dataclass(slots=True)
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
