"""Megatron-core ``sharded_state_dict`` to shardpoint and back, one call each way.

    from shardpoint.integrations.megatron import load_megatron, save_megatron
    save_megatron(sharded_state_dict, "/ckpt/iter_100")            # collective, every rank
    state = load_megatron(sharded_state_dict, "/ckpt/iter_100")    # any other TP/PP/DP/EP
    model.load_state_dict(state["model"])                         # as dist_checkpointing.load

How the pieces map (megatron-core's ``dist_checkpointing.mapping``):

- ``ShardedTensor`` -> a shardpoint tensor under its Megatron ``key`` (not its tree position):
  ``global_shape``, ``global_offset`` and ``replica_id`` carry over as they are (Megatron's
  tuple ids: all zeros is the main replica; non-main holders may share an id);
  ``prepend_axis_num`` leading axes become size-1 block dimensions (the data is viewed with
  them, so loads still fill it in place); ``flattened_range`` becomes a flattened range of the
  block. ``axis_fragmentations`` is not needed: the planner finds the grid from the offsets.
  Several ShardedTensors of one key on one rank (layers of a pipeline stage, MoE experts)
  become one :class:`~shardpoint.ShardedPieces` leaf.
- ``ShardedObject`` -> :class:`~shardpoint.ShardedObject` at cell ``global_offset`` of the grid
  ``global_shape`` (a 1-element shape is a plain index/count).
- ``ShardedTensorFactory`` -> the ShardedTensors its ``build()`` makes; on load its
  ``merge_fn`` turns the loaded pieces back into one tensor, as Megatron does.
- ``LocalNonpersistentObject`` -> not saved (listed in ``left_out``); on load it is unwrapped
  in place, as Megatron does.
- Everything else is Megatron's "common" state: plain values and tensors stored as shardpoint
  values and (replicated) tensors, under the same path. Values must follow shardpoint's
  rules (no pickle): an ``argparse.Namespace`` such as ``args`` must be converted first.

The checkpoint's tree is ``{"sharded": {megatron_key: leaf}, "common": {...}}``, so any
shardpoint reader finds a Megatron tensor at key ``sharded/<megatron key>``. Megatron classes
are recognised only when megatron-core is already imported (it must be, to have made them);
this module never imports it.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from shardpoint_core import errors
from shardpoint.api.checkpointer import load, save
from shardpoint.api.loading import LoadReport
from shardpoint.tree.model import ShardedObject, ShardedPieces, ShardedTensor
from shardpoint.api.saving import SaveResult

log = logging.getLogger("shardpoint")

SHARDED, COMMON = "sharded", "common"
_DROP = object()


def _megatron_classes() -> Optional[tuple]:
    """(ShardedTensor, ShardedObject, LocalNonpersistentObject, ShardedTensorFactory) of
    megatron-core, or None when it is not imported (then no Megatron object can exist)."""
    m = sys.modules.get("megatron.core.dist_checkpointing.mapping")
    if m is None:
        return None
    return (m.ShardedTensor, m.ShardedObject, m.LocalNonpersistentObject,
            m.ShardedTensorFactory)


def _where(path: tuple) -> str:
    return "sharded_state_dict" + "".join(f"[{c!r}]" for c in path)


def _block(st: Any) -> tuple:
    return (1,) * st.prepend_axis_num + tuple(int(x) for x in st.local_shape)


def _flat_range(st: Any) -> Optional[tuple]:
    fr = st.flattened_range
    if fr is None:
        return None
    if fr.step not in (None, 1):
        raise errors.InvalidShardingError(
            f"Megatron ShardedTensor {st.key!r}: flattened_range {fr} has a step; only "
            "contiguous ranges exist in the format", spec_id="SP-HOLD-3")
    return (int(fr.start or 0), int(fr.stop))


def _piece(st: Any, data: torch.Tensor) -> ShardedTensor:
    """shardpoint's view of one Megatron ShardedTensor (``data`` shares its storage)."""
    fr = _flat_range(st)
    if fr is None and st.prepend_axis_num:
        data = data[(None,) * st.prepend_axis_num]       # a view: loads fill Megatron's data
    return ShardedTensor(data, st.global_shape, st.global_offset, local_shape=_block(st),
                         flattened_range=fr, replica_id=st.replica_id)


def _object(so: Any, value: Any) -> ShardedObject:
    shape = tuple(int(x) for x in so.global_shape)
    offset = tuple(int(x) for x in so.global_offset)
    if len(shape) <= 1:       # Megatron's 1-element grid (or a 0-d one: a single cell)
        return ShardedObject(value, offset[0] if offset else 0, shape[0] if shape else 1,
                             replica_id=so.replica_id)
    return ShardedObject(value, offset, shape, replica_id=so.replica_id)


@dataclass
class MegatronTree:
    """A ``sharded_state_dict`` as a shardpoint state tree (``tree``), the paths of the
    ``LocalNonpersistentObject`` leaves left out of it, and :meth:`assemble` to turn a
    loaded tree back into a Megatron-style state dict."""

    source: Any
    tree: dict
    left_out: list = field(default_factory=list)
    filled: dict = field(default_factory=dict)         # id(Megatron ShardedTensor) -> tensor
    factories: dict = field(default_factory=dict)      # id(factory) -> its built sub-dict

    def assemble(self, loaded: dict) -> Any:
        """The state dict ``dist_checkpointing.load`` would return: ShardedTensors replaced by
        their (filled) tensors, ShardedObjects by their values, factories merged,
        nonpersistent objects unwrapped, common values as loaded."""
        return self._build(self.source, loaded.get(COMMON), loaded.get(SHARDED, {}),
                           _megatron_classes())

    def _build(self, x: Any, c: Any, objects: dict, classes: Optional[tuple]) -> Any:
        # A method, not a closure calling itself: a recursive closure is a reference cycle
        # that would keep the loaded tensors alive until the next collection.
        if isinstance(x, dict):
            return {k: self._build(v, c.get(k) if isinstance(c, dict) else None, objects,
                                   classes) for k, v in x.items()}
        if isinstance(x, list):
            return [self._build(v, c[i] if isinstance(c, list) and i < len(c) else None,
                                objects, classes) for i, v in enumerate(x)]
        if classes is not None:
            mst, mso, local, factory = classes
            if isinstance(x, mst):
                return self.filled[id(x)]
            if isinstance(x, mso):
                return objects[x.key]
            if isinstance(x, local):
                return x.unwrap()
            if isinstance(x, factory):
                return x.merge_fn(self._build(self.factories[id(x)], None, objects, classes))
        return c


class _Mapper:
    """The walk of :func:`megatron_tree`: a class rather than nested closures, because a
    closure that calls itself is a reference cycle holding every tensor it saw."""

    def __init__(self, out: MegatronTree, for_load: bool, classes: Optional[tuple]) -> None:
        self.out, self.for_load, self.classes = out, for_load, classes
        self.tensors: dict = {}     # key -> [shardpoint pieces]
        self.objects: dict = {}     # key -> shardpoint ShardedObject

    def add_tensor(self, st: Any, path: tuple) -> None:
        data = st.data
        if data is None:
            if not self.for_load:
                raise errors.UnsupportedValueError(
                    f"{_where(path)}: Megatron ShardedTensor {st.key!r} has no data to save")
            fr = _flat_range(st)
            n = (fr[1] - fr[0],) if fr else tuple(st.local_shape)
            data = torch.empty(n, dtype=st.dtype)
        self.out.filled[id(st)] = data
        self.tensors.setdefault(st.key, []).append(
            _piece(st, data.detach() if self.for_load else data))

    def add_object(self, so: Any, path: tuple) -> None:
        if so.key in self.objects:
            raise errors.InvalidShardingError(
                f"{_where(path)}: this rank holds Megatron ShardedObject {so.key!r} twice; "
                "a rank holds one cell of an object's grid")
        self.objects[so.key] = _object(so, None if self.for_load else so.data)

    def walk(self, x: Any, path: tuple) -> Any:
        if isinstance(x, dict):
            kept = {k: self.walk(v, path + (k,)) for k, v in x.items()}
            return {k: v for k, v in kept.items() if v is not _DROP}
        if isinstance(x, list):
            return [None if v is _DROP else v
                    for v in (self.walk(v, path + (i,)) for i, v in enumerate(x))]
        if self.classes is None:
            return x
        mst, mso, local, factory = self.classes
        if isinstance(x, mst):
            self.add_tensor(x, path)
        elif isinstance(x, mso):
            self.add_object(x, path)
        elif isinstance(x, local):
            self.out.left_out.append(_where(path))
        elif isinstance(x, factory):
            built = x.build()
            self.out.factories[id(x)] = built
            self.walk(built, path)
        else:
            return x
        return _DROP


def megatron_tree(sharded_state_dict: Any, *, for_load: bool = False) -> MegatronTree:
    """Map a megatron-core ``sharded_state_dict`` to a shardpoint state tree (see the module
    docstring). ``for_load=True`` makes load targets: ShardedTensors without data get a new
    tensor to fill. Raises :class:`~shardpoint.InvalidShardingError` naming the Megatron key
    when a key names both a tensor and an object or a rank holds one object key twice;
    pieces of one key that disagree or overlap are refused, by key, when the tree is saved or
    loaded."""
    m = _Mapper(MegatronTree(sharded_state_dict, {}), for_load, _megatron_classes())
    out, tensors, objects = m.out, m.tensors, m.objects
    common = m.walk(sharded_state_dict, ())
    both = sorted(set(tensors) & set(objects))
    if both:
        raise errors.InvalidShardingError(f"Megatron key {both[0]!r} names both a "
                                          "ShardedTensor and a ShardedObject; rename one")
    sharded: dict = {k: v[0] if len(v) == 1 else ShardedPieces(v) for k, v in tensors.items()}
    sharded.update(objects)
    out.tree = {SHARDED: sharded, COMMON: common if common is not _DROP else None}
    return out


@dataclass
class MegatronSaveResult:
    """What :func:`save_megatron` did: shardpoint's :class:`~shardpoint.SaveResult` and the
    paths of the ``LocalNonpersistentObject`` leaves it left out (Megatron does not save
    them either)."""

    result: SaveResult
    left_out: list


def save_megatron(sharded_state_dict: Any, path: str, **save_kwargs: Any) -> MegatronSaveResult:
    """Save a megatron-core ``sharded_state_dict`` as a shardpoint checkpoint. Collective:
    every rank passes its own. ``save_kwargs`` go to :func:`shardpoint.save` (``group``,
    ``overwrite``, ``backend``, ``options``)."""
    t = megatron_tree(sharded_state_dict)
    if t.left_out:
        log.info("shardpoint save_megatron: %d LocalNonpersistentObject leaf(s) not saved: %s",
                 len(t.left_out), t.left_out[:10])
    return MegatronSaveResult(save(t.tree, path, **save_kwargs), t.left_out)


def load_megatron(sharded_state_dict: Any, path: str, *, strict: bool = True,
                  report: Optional[LoadReport] = None, **load_kwargs: Any) -> Any:
    """Load a checkpoint into a megatron-core ``sharded_state_dict`` of any parallel layout.
    Collective. Every ShardedTensor's data is filled in place; returns the state dict
    ``dist_checkpointing.load`` would (tensors, object values, merged factories, unwrapped
    nonpersistent objects, common values from the checkpoint). ``load_kwargs`` go to
    :func:`shardpoint.load` (``group``, ``backend``, ``exchange_budget_bytes``)."""
    t = megatron_tree(sharded_state_dict, for_load=True)
    loaded = load(path, like=t.tree, strict=strict, report=report, **load_kwargs)
    return t.assemble(loaded)


__all__: list = ["MegatronSaveResult", "MegatronTree", "load_megatron", "megatron_tree",
                 "save_megatron"]
