"""Leaf handlers: what each kind of leaf of a state tree means to a save and to a load.

One :class:`LeafHandler` per kind (tensor, ndarray, ShardedTensor, ShardedPieces, DTensor,
ShardedObject, value), looked up by :func:`handler_for` in the order they were registered.
Flattening for save (:func:`shardpoint.tree.flatten.flatten_state`) and load targets
(:func:`shardpoint.tree.targets.collect_targets`) walk the containers and hand every leaf to
its handler, so a new kind of leaf is one handler here and one :func:`register_leaf` call,
not an ``isinstance`` branch in each walker. Pure: no I/O, no process group.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import torch

from shardpoint.tree import dtypes, values
from shardpoint.tree.model import (
    Holding,
    LocalObject,
    LocalTensor,
    ShardedObject,
    ShardedPieces,
    ShardedTensor,
    _dtensor_leaf,
    _is_dtensor,
    _np_tensor,
    check_tensor_data,
    object_grid,
    pieces_holdings,
    sharded_holding,
)
from shardpoint_core.format import errors


class LeafHandler:
    """How one kind of leaf is saved and loaded. Subclasses set ``kind`` (the manifest node
    it becomes: ``"tensor"``, ``"object"`` or ``"value"``) and implement the three methods.

    Call order: a save calls :meth:`matches` then :meth:`flatten`; a load with ``like``
    calls :meth:`matches` then :meth:`target`. ``key`` is the leaf's encoded key, ``what``
    its path for messages (``state['model']['w']``)."""

    kind = "tensor"
    name = ""

    def matches(self, x: Any) -> bool:
        """Whether ``x`` is a leaf of this kind."""
        raise NotImplementedError

    def flatten(self, x: Any, key: str, what: str, out: Any) -> dict:
        """Save: append this leaf's :class:`LocalTensor` / :class:`LocalObject` entries to
        ``out.tensors`` / ``out.objects`` and return its manifest tree node."""
        raise NotImplementedError

    def target(self, x: Any, key: str, what: str, load: Any) -> Any:
        """Load with ``like``: register the tensors to fill (``load.tensor_target``) and
        return what the loaded tree holds in place of ``x``. Only called when the
        checkpoint holds a leaf of this handler's ``kind`` at ``key``."""
        raise NotImplementedError

    def unfilled(self, x: Any) -> Any:
        """What the loaded tree holds for ``x`` when the checkpoint lacks it (``strict=False``):
        ``x`` itself by default."""
        return x


def _plain_holding(key: str, dtype: str, shape: tuple, replica: tuple) -> Holding:
    return Holding(key, dtype, shape, (0,) * len(shape), shape, None, replica)


class ShardedTensorHandler(LeafHandler):
    name = "ShardedTensor"

    def matches(self, x: Any) -> bool:
        return isinstance(x, ShardedTensor)

    def flatten(self, x: ShardedTensor, key: str, what: str, out: Any) -> dict:
        out.tensors.append(LocalTensor(sharded_holding(x, key, what), x.data))
        return {"tensor": key}

    def target(self, x: ShardedTensor, key: str, what: str, load: Any) -> Any:
        check_tensor_data(x.data, what, target=True)
        load.tensor_target(key, sharded_holding(x, key, what, (0,)), x.data.detach())
        return x.data


class ShardedPiecesHandler(LeafHandler):
    name = "ShardedPieces"

    def matches(self, x: Any) -> bool:
        return isinstance(x, ShardedPieces)

    def flatten(self, x: ShardedPieces, key: str, what: str, out: Any) -> dict:
        for h, p in zip(pieces_holdings(x, key, what), x):
            out.tensors.append(LocalTensor(h, p.data))
        return {"tensor": key}

    def target(self, x: ShardedPieces, key: str, what: str, load: Any) -> Any:
        for p in x:
            check_tensor_data(p.data, what, target=True)
        for h, p in zip(pieces_holdings(x, key, what, (0,)), x):
            load.tensor_target(key, h, p.data.detach())
        return [p.data for p in x]


class DTensorHandler(LeafHandler):
    name = "DTensor"

    def matches(self, x: Any) -> bool:
        return _is_dtensor(x)

    def flatten(self, x: Any, key: str, what: str, out: Any) -> dict:
        out.tensors.append(_dtensor_leaf(x, key, what))
        return {"tensor": key}

    def target(self, x: Any, key: str, what: str, load: Any) -> Any:
        lt = _dtensor_leaf(x, key, what)
        load.tensor_target(key, lt.holding, lt.data)
        return x


class TensorHandler(LeafHandler):
    """A plain torch tensor: the whole tensor, a replica on every rank of the group."""

    name = "torch.Tensor"

    def matches(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def flatten(self, x: torch.Tensor, key: str, what: str, out: Any) -> dict:
        d = dtypes.from_torch(x.dtype, what)
        check_tensor_data(x, what)
        out.tensors.append(LocalTensor(_plain_holding(key, d.name, tuple(x.shape), out.replica), x))
        return {"tensor": key}

    def target(self, x: torch.Tensor, key: str, what: str, load: Any) -> Any:
        d = dtypes.from_torch(x.dtype, what)
        check_tensor_data(x, what, target=True)
        # detach(): same storage, so an nn.Parameter (requires_grad) fills in place too.
        load.tensor_target(key, _plain_holding(key, d.name, tuple(x.shape), (0,)), x.detach())
        return x


class NdarrayHandler(LeafHandler):
    """A numpy array: saved like a plain tensor, marked ``origin: numpy`` so a full load
    hands it back as numpy."""

    name = "numpy.ndarray"

    def matches(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def flatten(self, x: np.ndarray, key: str, what: str, out: Any) -> dict:
        d = dtypes.from_numpy(x.dtype, what)
        out.tensors.append(
            LocalTensor(
                _plain_holding(key, d.name, tuple(x.shape), out.replica), _np_tensor(x), "numpy"
            )
        )
        return {"tensor": key, "origin": "numpy"}

    def target(self, x: np.ndarray, key: str, what: str, load: Any) -> Any:
        if not x.flags.writeable:
            raise errors.LayoutMismatchError(f"{what}: numpy target is read-only")
        if x.dtype.byteorder == ">":
            raise errors.LayoutMismatchError(
                f"{what}: numpy target has big-endian dtype {x.dtype.str}; it cannot be "
                "filled in place (pass a native-endian array, e.g. "
                "x.astype(x.dtype.newbyteorder('='))",
                spec_id="SP-LOAD-1",
            )
        d = dtypes.from_numpy(x.dtype, what)
        load.tensor_target(
            key, _plain_holding(key, d.name, tuple(x.shape), (0,)), dtypes.numpy_to_torch(x)
        )
        return x


class ShardedObjectHandler(LeafHandler):
    kind = "object"
    name = "ShardedObject"

    def matches(self, x: Any) -> bool:
        return isinstance(x, ShardedObject)

    def flatten(self, x: ShardedObject, key: str, what: str, out: Any) -> dict:
        values.check_value(x.value, what)
        out.objects.append(LocalObject(key, x.grid_index, x.grid_shape, x.replica_id, x.value))
        return {"object": key}

    def target(self, x: ShardedObject, key: str, what: str, load: Any) -> Any:
        vals = load.m.objects[key]
        stored = object_grid(vals)
        if stored != x.grid_shape:
            raise errors.LayoutMismatchError(
                f"sharded object {key!r}: checkpoint has count (grid) {_grid_text(stored)}, "
                f"the target asks for index {x.index} of count (grid) "
                f"{_grid_text(x.grid_shape)}; load with the grid it was saved with",
                spec_id="SP-OBJ-2",
            )
        return vals[x.flat_index]

    def unfilled(self, x: ShardedObject) -> Any:
        return x.value


def _grid_text(g: tuple) -> str:
    return str(g[0]) if len(g) == 1 else str(g)


class ValueHandler(LeafHandler):
    """A plain value (None, bool, int, float, str, bytes, numpy scalar), stored in the
    manifest. Matches last: anything else is refused with a conversion hint."""

    kind = "value"
    name = "value"

    def matches(self, x: Any) -> bool:
        return True

    def flatten(self, x: Any, key: str, what: str, out: Any) -> dict:
        values.check_value(x, what)  # raises with a conversion hint for anything else
        return {"value": x}

    def target(self, x: Any, key: str, what: str, load: Any) -> Any:
        return load.stored_value(key)


_HANDLERS: List[LeafHandler] = [
    ShardedTensorHandler(),
    ShardedPiecesHandler(),
    DTensorHandler(),
    TensorHandler(),
    NdarrayHandler(),
    ShardedObjectHandler(),
]
_FALLBACK = ValueHandler()
_BUILTIN = frozenset(h.name for h in _HANDLERS)


def register_leaf(handler: LeafHandler, *, before: Optional[str] = None) -> None:
    """Add a handler for a new kind of leaf (first match wins; ``before`` names a handler it
    must be tried ahead of, e.g. a tensor subclass ahead of ``"torch.Tensor"``)."""
    names = [h.name for h in _HANDLERS]
    if handler.name in names:
        raise ValueError(f"a leaf handler named {handler.name!r} is registered already")
    at = names.index(before) if before in names else len(_HANDLERS)
    _HANDLERS.insert(at, handler)


def unregister_leaf(name: str) -> None:
    """Remove the handler registered under ``name`` (the built-in ones stay registered)."""
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in leaf handler")
    _HANDLERS[:] = [h for h in _HANDLERS if h.name != name]


def handler_for(x: Any) -> LeafHandler:
    """The handler of leaf ``x`` (the value handler when no other matches)."""
    for h in _HANDLERS:
        if h.matches(x):
            return h
    return _FALLBACK


def leaf_kinds() -> List[str]:
    """The registered handlers' names, in match order (the value handler last)."""
    return [h.name for h in _HANDLERS] + [_FALLBACK.name]


def is_container(x: Any) -> bool:
    """Whether the walkers descend into ``x`` (dicts, lists and tuples, namedtuples too)."""
    return isinstance(x, (dict, list, tuple))
