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
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from . import dtypes, values
from .errors import InvalidShardingError, UnsupportedValueError
from .keys import encode_component, encode_key, format_path

Shape = tuple  # tuple[int, ...]
ReplicaId = Union[int, Sequence[int]]


def _norm_replica(r: ReplicaId) -> tuple:
    t = (r,) if isinstance(r, int) else tuple(r)
    if not t or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in t):
        raise InvalidShardingError(f"replica_id {r!r} must be a non-negative int or a non-empty "
                                   "tuple of them", spec_id="SP-REPL-1")
    return t


class ShardedTensor:
    """A rank's piece of a global tensor.

    ``data`` holds the block of shape ``local_shape`` (default ``data.shape``) whose first
    element sits at ``global_offset`` in the global tensor of shape ``global_shape``. With
    ``flattened_range=(start, stop)`` (or a ``slice``), ``data`` is 1-D and holds only elements
    ``start:stop`` of the block's row-major flattening. Pieces of one key on different ranks with
    equal regions are replicas; at most one of them may be the main replica (``replica_id`` all
    zeros), the others may share any non-zero id (Megatron gives them all 1).
    """

    __slots__ = ("data", "global_shape", "global_offset", "local_shape", "flattened_range",
                 "replica_id")

    def __init__(self, data: torch.Tensor, global_shape: Sequence[int],
                 global_offset: Sequence[int], *, local_shape: Optional[Sequence[int]] = None,
                 flattened_range: Optional[Union[slice, tuple]] = None,
                 replica_id: ReplicaId = 0) -> None:
        self.data = data
        self.global_shape = tuple(int(x) for x in global_shape)
        self.global_offset = tuple(int(x) for x in global_offset)
        if flattened_range is not None and local_shape is None:
            raise InvalidShardingError("a ShardedTensor with flattened_range needs local_shape "
                                       "(the shape of the block the range is taken from)",
                                       spec_id="SP-HOLD-3")
        self.local_shape = tuple(int(x) for x in (local_shape if local_shape is not None
                                                   else data.shape))
        if isinstance(flattened_range, slice):
            if flattened_range.step not in (None, 1):
                raise InvalidShardingError("flattened_range must have step 1", spec_id="SP-HOLD-3")
            flattened_range = (flattened_range.start or 0, flattened_range.stop)
        self.flattened_range = (None if flattened_range is None
                                else (int(flattened_range[0]), int(flattened_range[1])))
        self.replica_id = _norm_replica(replica_id)

    def __repr__(self) -> str:
        fr = f", flattened_range={self.flattened_range}" if self.flattened_range else ""
        return (f"ShardedTensor(global_shape={self.global_shape}, global_offset="
                f"{self.global_offset}, local_shape={self.local_shape}{fr}, "
                f"replica_id={self.replica_id}, dtype={self.data.dtype})")


class ShardedObject:
    """A per-rank value (RNG state, data-loader position): entry ``index`` of ``count``.

    Every index in ``range(count)`` must be saved by some rank; equal indices on several ranks
    are replicas and need different ``replica_id``. Values follow the rules of object leaves.
    """

    __slots__ = ("value", "index", "count", "replica_id")

    def __init__(self, value: Any, index: int, count: int, *, replica_id: ReplicaId = 0) -> None:
        self.value, self.index, self.count = value, int(index), int(count)
        self.replica_id = _norm_replica(replica_id)
        if not 0 <= self.index < self.count:
            raise InvalidShardingError(f"ShardedObject index {index} is outside range(count="
                                       f"{count})", spec_id="SP-OBJ-1")

    def __repr__(self) -> str:
        return f"ShardedObject(index={self.index}, count={self.count}, value={self.value!r})"


class Holding(NamedTuple):
    """Metadata of one rank's piece of tensor ``key`` (what the planner sees). A named tuple:
    planning handles millions of them, and they travel as plain msgpack arrays."""

    key: str
    dtype: str
    global_shape: Shape
    offset: Shape            # global offset of the block
    shape: Shape             # shape of the block
    flat: Optional[tuple]    # (start, stop) within the block's flattening, or None
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
        return [self.key, self.dtype, list(self.global_shape), list(self.offset),
                list(self.shape), list(self.flat) if self.flat else None, list(self.replica)]

    @staticmethod
    def from_wire(w: Sequence) -> "Holding":
        k, d, g, o, s, f, r = w
        return Holding(k, d, tuple(g), tuple(o), tuple(s), tuple(f) if f else None, tuple(r))


@dataclass(frozen=True)
class Piece:
    """A rectangular box of a holding; ``start`` is its first element's index in ``data``."""

    offset: Shape
    shape: Shape
    start: Optional[int]     # None: rectangular holding, the box is the whole of ``data``


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
    strides = [math.prod(h.shape[i + 1:]) for i in range(len(h.shape))]
    out = []
    for o, s in _range_boxes(h.shape, h.flat[0], h.flat[1]):
        first = sum(a * b for a, b in zip(o, strides))
        out.append(Piece(tuple(a + b for a, b in zip(h.offset, o)), s, first - start))
    return out


def piece_view(data: torch.Tensor, p: Piece) -> torch.Tensor:
    """The tensor view of ``data`` that piece ``p`` of its holding stands for."""
    if p.start is None:
        return data
    return data[p.start:p.start + math.prod(p.shape)].view(p.shape)


@dataclass
class LocalTensor:
    """A holding together with the rank-local tensor that backs it."""

    holding: Holding
    data: torch.Tensor
    origin: str = "torch"    # "torch" or "numpy": what a full load hands back


@dataclass
class LocalObject:
    key: str
    index: int
    count: int
    replica: tuple
    value: Any


@dataclass
class Flattened:
    """A state tree taken apart: its structure (msgpack-ready) and its leaves."""

    tree: Any
    tensors: list   # [LocalTensor]
    objects: list   # [LocalObject]


def _check_holding(h: Holding, data: torch.Tensor, what: str) -> None:
    g, o, s = h.global_shape, h.offset, h.shape
    if not (len(g) == len(o) == len(s)):
        raise InvalidShardingError(f"{what}: global_shape {g}, global_offset {o} and local "
                                   f"shape {s} must have the same number of dimensions",
                                   spec_id="SP-HOLD-1")
    for d, (gd, od, sd) in enumerate(zip(g, o, s)):
        if gd < 0 or od < 0 or sd < 0 or od + sd > gd:
            raise InvalidShardingError(f"{what}: block offset {o} + shape {s} exceeds global "
                                       f"shape {g} in dimension {d}", spec_id="SP-HOLD-1")
    if h.flat is None:
        if tuple(data.shape) != s:
            raise InvalidShardingError(f"{what}: data has shape {tuple(data.shape)} but "
                                       f"local_shape is {s}", spec_id="SP-HOLD-2")
    else:
        a, b = h.flat
        if not 0 <= a <= b <= math.prod(s):
            raise InvalidShardingError(f"{what}: flattened_range {h.flat} is outside the "
                                       f"block of {math.prod(s)} elements", spec_id="SP-HOLD-3")
        if data.dim() != 1 or data.numel() != b - a:
            raise InvalidShardingError(f"{what}: with flattened_range {h.flat} data must be "
                                       f"1-D with {b - a} elements, got shape "
                                       f"{tuple(data.shape)}", spec_id="SP-HOLD-3")


def _dtensor_leaf(t: Any, key: str, what: str) -> LocalTensor:
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if any(isinstance(p, Partial) for p in t.placements):
        raise UnsupportedValueError(f"{what} is a DTensor with a Partial placement; reduce it "
                                    "first (dtensor.redistribute(placements=[Replicate()...]))",
                                    spec_id="SP-HOLD-4")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coord = t.device_mesh.get_coordinate() or []
    rep = tuple(c for c, p in zip(coord, t.placements) if isinstance(p, Replicate)) or (0,)
    local = t.to_local().detach()   # same storage; a DTensor Parameter fills in place too
    d = dtypes.from_torch(local.dtype, what)
    h = Holding(key, d.name, tuple(t.shape), tuple(offset), tuple(shape), None, rep)
    _check_holding(h, local, what)
    return LocalTensor(h, local)


def _is_dtensor(x: Any) -> bool:
    # No import here: importing torch.distributed.tensor costs ~1 s, and a DTensor can only
    # exist once that module has been imported by whoever made it.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def flatten_state(state: Any, *, replica: tuple = (0,)) -> Flattened:
    """Take a state tree apart into its msgpack-ready structure and its leaves.

    ``replica`` is the replica id given to plain tensors (they are replicas across the ranks
    of a group, and each rank passes its own rank). Raises :class:`UnsupportedValueError`
    naming the path of the first leaf that cannot be stored.
    """
    tensors: list = []
    objects: list = []

    def walk(x: Any, path: tuple) -> Any:
        what = f"state{format_path(path)}"
        if isinstance(x, dict):
            for k in x:
                encode_component(k)
            return {"dict": [[k, walk(v, path + (k,))] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return {kind: [walk(v, path + (i,)) for i, v in enumerate(x)]}
        key = encode_key(path)
        if isinstance(x, ShardedTensor):
            d = dtypes.from_torch(x.data.dtype, what)
            h = Holding(key, d.name, x.global_shape, x.global_offset, x.local_shape,
                        x.flattened_range, x.replica_id)
            _check_holding(h, x.data, what)
            tensors.append(LocalTensor(h, x.data))
            return {"tensor": key}
        if _is_dtensor(x):
            tensors.append(_dtensor_leaf(x, key, what))
            return {"tensor": key}
        if isinstance(x, torch.Tensor):
            d = dtypes.from_torch(x.dtype, what)
            shape = tuple(x.shape)
            tensors.append(LocalTensor(Holding(key, d.name, shape, (0,) * len(shape), shape,
                                               None, replica), x))
            return {"tensor": key}
        if isinstance(x, np.ndarray):
            d = dtypes.from_numpy(x.dtype, what)
            shape = tuple(x.shape)
            tensors.append(LocalTensor(Holding(key, d.name, shape, (0,) * len(shape), shape,
                                               None, replica), _np_tensor(x), "numpy"))
            return {"tensor": key, "origin": "numpy"}
        if isinstance(x, ShardedObject):
            values.check_value(x.value, what)
            objects.append(LocalObject(key, x.index, x.count, x.replica_id, x.value))
            return {"object": key}
        if isinstance(x, values.SCALARS) or isinstance(x, np.generic):
            values.check_value(x, what)
            return {"value": x}
        values.check_value(x, what)  # raises with a conversion hint
        raise AssertionError("unreachable")

    tree = walk(state, ())
    return Flattened(tree, tensors, objects)


def _np_tensor(a: np.ndarray) -> torch.Tensor:
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.writeable:
        a = a.copy()
    return dtypes.numpy_to_torch(a)


def iter_tree_leaves(tree: Any, path: tuple = ()) -> Iterator[tuple]:
    """Yield ``(path, node)`` for every leaf node of a structure built by :func:`flatten_state`."""
    if "dict" in tree:
        for k, v in tree["dict"]:
            yield from iter_tree_leaves(v, path + (k,))
    elif "list" in tree or "tuple" in tree:
        for i, v in enumerate(tree.get("list", tree.get("tuple"))):
            yield from iter_tree_leaves(v, path + (i,))
    else:
        yield path, tree
