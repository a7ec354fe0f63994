"""The data model: what a rank holds, as plain data, and how a state tree becomes holdings.

A *holding* is one rank's piece of a global tensor: a rectangular block at a global offset,
optionally only a contiguous range of the block's row-major flattening (a *flattened range*,
as ZeRO / distributed optimizers keep them). Holdings of the same region on several ranks are
*replicas*, told apart by ``replica_id``. Planning works on :class:`Holding` metadata only;
the tensors themselves stay with :class:`LocalTensor` on the rank that owns them.
This module does no I/O and never touches a process group.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from shardpoint.tree import dtypes
from shardpoint_core.format.manifest import ObjectValues, iter_tree_leaves, object_grid  # noqa: F401
from shardpoint_core.format.coverage import box_intersection
from shardpoint_core.format.errors import (
    InvalidKeyError,
    InvalidShardingError,
    UnsupportedValueError,
)

Shape = tuple  # tuple[int, ...]
ReplicaId = Union[int, Sequence[int]]


def _norm_replica(r: ReplicaId) -> tuple:
    try:
        t = (r,) if isinstance(r, int) else tuple(r)
    except TypeError:
        t = ()
    if not t or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in t):
        raise InvalidShardingError(
            f"replica_id {r!r} must be a non-negative int or a non-empty tuple of them",
            spec_id="SP-REPL-1",
        )
    return t


class _Replicated:
    """The ``replica_id`` of a saved piece, validated whenever it is set: Megatron-style code
    assigns it after construction."""

    __slots__ = ("_replica_id",)

    @property
    def replica_id(self) -> tuple:
        """Which replica of its region this piece is: a tuple of non-negative ints, all zeros
        for the main replica. Checked on assignment too ([SP-REPL-1])."""
        return self._replica_id

    @replica_id.setter
    def replica_id(self, r: ReplicaId) -> None:
        self._replica_id = _norm_replica(r)


class ShardedTensor(_Replicated):
    """A rank's piece of a global tensor.

    ``data`` holds the block of shape ``local_shape`` (default ``data.shape``) whose first
    element sits at ``global_offset`` in the global tensor of shape ``global_shape``. With
    ``flattened_range=(start, stop)`` (or a ``slice``), ``data`` is 1-D and holds only elements
    ``start:stop`` of the block's row-major flattening. Pieces of one key on different ranks with
    equal regions are replicas; at most one of them may be the main replica (``replica_id`` all
    zeros), the others may share any non-zero id (Megatron gives them all 1).
    """

    __slots__ = ("data", "global_shape", "global_offset", "local_shape", "flattened_range")

    def __init__(
        self,
        data: torch.Tensor,
        global_shape: Sequence[int],
        global_offset: Sequence[int],
        *,
        local_shape: Optional[Sequence[int]] = None,
        flattened_range: Optional[Union[slice, tuple]] = None,
        replica_id: ReplicaId = 0,
    ) -> None:
        self.data = data
        self.global_shape = tuple(int(x) for x in global_shape)
        self.global_offset = tuple(int(x) for x in global_offset)
        if flattened_range is not None and local_shape is None:
            raise InvalidShardingError(
                "a ShardedTensor with flattened_range needs local_shape "
                "(the shape of the block the range is taken from)",
                spec_id="SP-HOLD-3",
            )
        self.local_shape = tuple(
            int(x) for x in (local_shape if local_shape is not None else data.shape)
        )
        if isinstance(flattened_range, slice):
            if flattened_range.step not in (None, 1):
                raise InvalidShardingError("flattened_range must have step 1", spec_id="SP-HOLD-3")
            flattened_range = (flattened_range.start or 0, flattened_range.stop)
        self.flattened_range = (
            None if flattened_range is None else (int(flattened_range[0]), int(flattened_range[1]))
        )
        self.replica_id = replica_id

    def __repr__(self) -> str:
        fr = f", flattened_range={self.flattened_range}" if self.flattened_range else ""
        return (
            f"ShardedTensor(global_shape={self.global_shape}, global_offset="
            f"{self.global_offset}, local_shape={self.local_shape}{fr}, "
            f"replica_id={self.replica_id}, dtype={self.data.dtype})"
        )


GridIndex = Union[int, Sequence[int]]


def _norm_grid(x: GridIndex, what: str) -> tuple:
    t: tuple = (x,) if isinstance(x, int) else tuple(x)  # a bool is refused just below
    if not t or any(isinstance(i, bool) or not isinstance(i, int) for i in t):
        raise InvalidShardingError(
            f"ShardedObject {what} {x!r} must be an int or a non-empty tuple of ints",
            spec_id="SP-OBJ-1",
        )
    return t


class ShardedObject(_Replicated):
    """A per-rank value (RNG state, data-loader position): entry ``index`` of a grid ``count``.

    ``index`` and ``count`` are ints (a 1-D grid of ``count`` entries) or equal-length tuples
    (a grid of shape ``count``, as Megatron's ``global_offset``/``global_shape``, e.g. per
    (pipeline stage, tensor rank)). Every grid cell must be saved by some rank; equal indices
    on several ranks are replicas (only one may be the main replica, ``replica_id`` 0).
    Values follow the rules of object leaves. A checkpoint stores the grid shape, and a load
    asking for another grid fails ([SP-OBJ-2]).
    """

    __slots__ = ("value", "index", "count", "grid_index", "grid_shape")

    def __init__(
        self, value: Any, index: GridIndex, count: GridIndex, *, replica_id: ReplicaId = 0
    ) -> None:
        self.value = value
        self.grid_index = _norm_grid(index, "index")
        self.grid_shape = _norm_grid(count, "count")
        # Keep the caller's form: an int stays an int (the 1-D case of the grid).
        self.index = self.grid_index[0] if isinstance(index, int) else self.grid_index
        self.count = self.grid_shape[0] if isinstance(count, int) else self.grid_shape
        self.replica_id = replica_id
        if len(self.grid_index) != len(self.grid_shape) or not all(
            0 <= i < n for i, n in zip(self.grid_index, self.grid_shape)
        ):
            raise InvalidShardingError(
                f"ShardedObject index {index} is outside the grid "
                f"count={count} (same number of dimensions, 0 <= "
                "index < count in each)",
                spec_id="SP-OBJ-1",
            )

    @property
    def flat_index(self) -> int:
        """Position of this entry in the row-major order of the grid (how values are stored)."""
        return grid_flat_index(self.grid_index, self.grid_shape)

    def __repr__(self) -> str:
        return f"ShardedObject(index={self.index}, count={self.count}, value={self.value!r})"


def grid_flat_index(index: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major position of grid cell ``index`` in a grid of ``shape``."""
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


class Holding(NamedTuple):
    """Metadata of one rank's piece of tensor ``key`` (what the planner sees). A named tuple:
    planning handles millions of them, and they travel as plain msgpack arrays."""

    key: str
    dtype: str
    global_shape: Shape
    offset: Shape  # global offset of the block
    shape: Shape  # shape of the block
    flat: Optional[tuple]  # (start, stop) within the block's flattening, or None
    replica: tuple

    @property
    def region(self) -> tuple:
        """Identity of the stored region; replicas share it ([SP-REPL-1])."""
        return (self.offset, self.shape, self.flat)

    @property
    def nbytes(self) -> int:
        n = (self.flat[1] - self.flat[0]) if self.flat else math.prod(self.shape)
        return n * dtypes.from_name(self.dtype).itemsize

    def to_wire(self) -> list:
        return [
            self.key,
            self.dtype,
            list(self.global_shape),
            list(self.offset),
            list(self.shape),
            list(self.flat) if self.flat else None,
            list(self.replica),
        ]

    @staticmethod
    def from_wire(w: Sequence) -> "Holding":
        k, d, g, o, s, f, r = w
        return Holding(k, d, tuple(g), tuple(o), tuple(s), tuple(f) if f else None, tuple(r))


@dataclass(frozen=True)
class Piece:
    """A rectangular box of a holding; ``start`` is its first element's index in ``data``."""

    offset: Shape
    shape: Shape
    start: Optional[int]  # None: rectangular holding, the box is the whole of ``data``


def _range_boxes(shape: Shape, start: int, stop: int) -> list:
    """Split elements [start, stop) of a row-major block into boxes, each contiguous in it."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(stop, row)
    if r0 == r1:
        return [((r0,) + o, (1,) + s) for o, s in _range_boxes(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0,) + o, (1,) + s) for o, s in _range_boxes(shape[1:], c0, row)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    if c1:
        out += [((r1,) + o, (1,) + s) for o, s in _range_boxes(shape[1:], 0, c1)]
    return out


def holding_pieces(h: Holding) -> list:
    """The non-empty rectangular boxes (global coordinates) a holding covers, in data order."""
    if h.flat is None:
        return [Piece(h.offset, h.shape, None)] if math.prod(h.shape) else []
    start = h.flat[0]
    strides = [math.prod(h.shape[i + 1 :]) for i in range(len(h.shape))]
    out = []
    for o, s in _range_boxes(h.shape, h.flat[0], h.flat[1]):
        first = sum(a * b for a, b in zip(o, strides))
        out.append(Piece(tuple(a + b for a, b in zip(h.offset, o)), s, first - start))
    return out


def piece_view(data: torch.Tensor, p: Piece) -> torch.Tensor:
    """The tensor view of ``data`` that piece ``p`` of its holding stands for."""
    if p.start is None:
        return data
    return data[p.start : p.start + math.prod(p.shape)].view(p.shape)


@dataclass
class LocalTensor:
    """A holding together with the rank-local tensor that backs it."""

    holding: Holding
    data: torch.Tensor
    origin: str = "torch"  # "torch" or "numpy": what a full load hands back


@dataclass
class LocalObject:
    key: str
    index: tuple  # grid index
    count: tuple  # grid shape
    replica: tuple
    value: Any


@dataclass
class Flattened:
    """A state tree taken apart: its structure (msgpack-ready) and its leaves."""

    tree: Any
    tensors: list  # [LocalTensor]
    objects: list  # [LocalObject]


def check_tensor_data(data: torch.Tensor, what: str, *, target: bool = False) -> None:
    """A tensor whose bytes can be saved (or, ``target``, filled in place): strided, with
    storage. A meta tensor has no data and a sparse one no strided storage; both used to fail
    deep inside the copy with a bare NotImplementedError."""
    if data.layout is not torch.strided:
        raise UnsupportedValueError(
            f"{what} is a {str(data.layout).replace('torch.', '')} tensor; the format stores "
            "dense tensors: pass t.to_dense() (or save its indices and values)"
        )
    if data.is_meta:
        fix = (
            "nothing can be filled in place: pass a real tensor (torch.empty_like(t, "
            "device='cpu')), or shardpoint.state.load_model(path, model), which "
            "materializes a meta model"
            if target
            else "it has no data to save: materialize it first (module.to_empty(device=...) and "
            "initialize or load it)"
        )
        raise UnsupportedValueError(f"{what} is on the meta device; {fix}")


def _check_holding(h: Holding, data: torch.Tensor, what: str) -> None:
    check_tensor_data(data, what)
    g, o, s = h.global_shape, h.offset, h.shape
    if not (len(g) == len(o) == len(s)):
        raise InvalidShardingError(
            f"{what}: global_shape {g}, global_offset {o} and local "
            f"shape {s} must have the same number of dimensions",
            spec_id="SP-HOLD-1",
        )
    for d, (gd, od, sd) in enumerate(zip(g, o, s)):
        if gd < 0 or od < 0 or sd < 0 or od + sd > gd:
            raise InvalidShardingError(
                f"{what}: block offset {o} + shape {s} exceeds global shape {g} in dimension {d}",
                spec_id="SP-HOLD-1",
            )
    if h.flat is None:
        if tuple(data.shape) != s:
            raise InvalidShardingError(
                f"{what}: data has shape {tuple(data.shape)} but local_shape is {s}",
                spec_id="SP-HOLD-2",
            )
    else:
        a, b = h.flat
        if not 0 <= a <= b <= math.prod(s):
            raise InvalidShardingError(
                f"{what}: flattened_range {h.flat} is outside the block of {math.prod(s)} elements",
                spec_id="SP-HOLD-3",
            )
        if data.dim() != 1 or data.numel() != b - a:
            raise InvalidShardingError(
                f"{what}: with flattened_range {h.flat} data must be "
                f"1-D with {b - a} elements, got shape "
                f"{tuple(data.shape)}",
                spec_id="SP-HOLD-3",
            )


class ShardedPieces:
    """Several pieces of one global tensor held by this rank: one leaf, one key.

    Megatron keys tensors by name, not by tree position, so one rank often holds many pieces
    of one global tensor: a pipeline stage's layers of a layer-stacked weight, several MoE
    experts, FSDP2 x TP strided rows, a multi-chunk DCP shard plan. Each piece is a
    :class:`ShardedTensor` (with its own offset, flattened range and ``replica_id``); all must
    agree on global shape and dtype, and no two may overlap. For ``load(like=...)`` each
    piece's ``data`` is filled in place and the leaf comes back as the list of those tensors.
    """

    __slots__ = ("pieces",)

    def __init__(self, pieces: Sequence[ShardedTensor]) -> None:
        self.pieces = list(pieces)
        bad = [i for i, p in enumerate(self.pieces) if not isinstance(p, ShardedTensor)]
        if bad:
            raise InvalidShardingError(
                f"ShardedPieces takes ShardedTensor pieces; piece "
                f"{bad[0]} is a {type(self.pieces[bad[0]]).__name__}"
            )
        if not self.pieces:
            raise InvalidShardingError(
                "ShardedPieces needs at least one piece (a rank that "
                "holds none of a tensor leaves its key out)"
            )

    def __iter__(self) -> Iterator[ShardedTensor]:
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def __repr__(self) -> str:
        return f"ShardedPieces({self.pieces!r})"


def sharded_holding(
    x: ShardedTensor, key: str, what: str, replica: Optional[tuple] = None
) -> Holding:
    """The checked :class:`Holding` of a :class:`ShardedTensor` leaf (``replica`` overrides
    its ``replica_id``, as load targets do)."""
    d = dtypes.from_torch(x.data.dtype, what)
    h = Holding(
        key,
        d.name,
        x.global_shape,
        x.global_offset,
        x.local_shape,
        x.flattened_range,
        x.replica_id if replica is None else replica,
    )
    _check_holding(h, x.data, what)
    return h


def pieces_holdings(x: ShardedPieces, key: str, what: str, replica: Optional[tuple] = None) -> list:
    """The checked holdings of a :class:`ShardedPieces` leaf, in piece order. Raises
    :class:`InvalidShardingError` naming the key when the pieces disagree on global shape or
    dtype ([SP-COVER-4]) or two of them overlap ([SP-COVER-3])."""
    hs = [sharded_holding(p, key, f"{what} piece {i}", replica) for i, p in enumerate(x)]
    h0 = hs[0]
    for i, h in enumerate(hs[1:], 1):
        if (h.global_shape, h.dtype) != (h0.global_shape, h0.dtype):
            raise InvalidShardingError(
                f"{what} (key {key!r}): piece 0 has global shape {h0.global_shape} dtype "
                f"{h0.dtype}, piece {i} has {h.global_shape} {h.dtype}; every piece of one "
                "tensor must agree",
                spec_id="SP-COVER-4",
            )
    boxes = [(p.offset, p.shape, i) for i, h in enumerate(hs) for p in holding_pieces(h)]
    boxes.sort(key=lambda b: b[0][:1])
    active: list = []  # sweep along dimension 0: boxes still open at this offset
    for off, shp, i in boxes:
        lo = off[0] if off else 0
        active = [b for b in active if (b[0][0] + b[1][0] if b[0] else 1) > lo]
        for o2, s2, j in active:
            if j != i and box_intersection(off, shp, o2, s2) is not None:
                a, b = sorted((i, j))
                raise InvalidShardingError(
                    f"{what} (key {key!r}): pieces {a} and {b} overlap (offset "
                    f"{hs[a].offset} shape {hs[a].shape}{_flat_text(hs[a])} and offset "
                    f"{hs[b].offset} shape {hs[b].shape}{_flat_text(hs[b])}); pieces of one "
                    "tensor on one rank must be disjoint",
                    spec_id="SP-COVER-3",
                )
        active.append((off, shp, i))
    return hs


def _flat_text(h: Holding) -> str:
    return f" range {h.flat}" if h.flat else ""


def _dtensor_leaf(t: Any, key: str, what: str) -> LocalTensor:
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in t.placements):
        raise UnsupportedValueError(
            f"{what} is a DTensor with a Partial placement; reduce it "
            "first (dtensor.redistribute(placements=[Replicate()...]))",
            spec_id="SP-HOLD-4",
        )
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coord = t.device_mesh.get_coordinate() or []
    rep = tuple(c for c, p in zip(coord, t.placements) if isinstance(p, Replicate)) or (0,)
    local = t.to_local().detach()  # same storage; a DTensor Parameter fills in place too
    d = dtypes.from_torch(local.dtype, what)
    h = Holding(key, d.name, tuple(t.shape), tuple(offset), tuple(shape), None, rep)
    _check_holding(h, local, what)
    return LocalTensor(h, local)


def _is_dtensor(x: Any) -> bool:
    # No import here: importing torch.distributed.tensor costs ~1 s, and a DTensor can only
    # exist once that module has been imported by whoever made it.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def check_root(tree: Any, call: str) -> None:
    """A path where the tree belongs (``save("ckpt/1", state)``; shardpoint_jax takes
    ``save(path, tree)``) gets an error saying the arguments look swapped, not only that the
    root of a tree cannot be a leaf."""
    if isinstance(tree, (str, os.PathLike)):
        raise InvalidKeyError(
            f"the tree passed to {call} is a path ({str(tree)!r}), not a "
            f"tree; arguments swapped? {call} (shardpoint_jax puts the "
            "path first)",
            spec_id="SP-KEY-2",
        )


def _np_tensor(a: np.ndarray) -> torch.Tensor:
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.writeable:
        a = a.copy()
    return dtypes.numpy_to_torch(a)
