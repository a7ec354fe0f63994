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
  ``global_shape`` (a 1-element shape is a plain index/count). Its value follows shardpoint's
  value rules, plus two Python types Megatron's pickles carry and a load gives back as they
  were: a ``set``/``frozenset`` is stored as the tagged dict ``{"__megatron__": "set",
  "items": [...]}`` (items in a fixed order), an ``io.BytesIO`` as ``{"__megatron__":
  "BytesIO", "bytes": ...}``; neither is a pickle.
- ``allow_shape_mismatch=True`` (embeddings, output layers padded to another vocabulary size):
  the target is zeroed and the stored tensor's overlap with it is read, as Megatron does: a
  larger stored tensor is trimmed, a smaller one padded with zeros. A target of another dtype
  than the stored one gets the stored values cast into it, as Megatron's (DCP's) load does.
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

import io
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from shardpoint_core.format import errors
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.format.statetree import ObjectLeaf, TensorLeaf, node_at
from shardpoint.api.checkpointer import load, save
from shardpoint.api.loading import LoadReport
from shardpoint.tree.model import ShardedObject, ShardedPieces, ShardedTensor
from shardpoint.api.saving import SaveResult
from shardpoint.tree.dtypes import from_name

log = logging.getLogger("shardpoint")

SHARDED, COMMON = "sharded", "common"
_DROP = object()


def _megatron_classes() -> Optional[tuple]:
    """(ShardedTensor, ShardedObject, LocalNonpersistentObject, ShardedTensorFactory) of
    megatron-core, or None when it is not imported (then no Megatron object can exist)."""
    m = sys.modules.get("megatron.core.dist_checkpointing.mapping")
    if m is None:
        return None
    return (m.ShardedTensor, m.ShardedObject, m.LocalNonpersistentObject, m.ShardedTensorFactory)


TAG = "__megatron__"


def encode_value(v: Any) -> Any:
    """``v`` with its sets and ``io.BytesIO`` objects as tagged dicts (see the module
    docstring), at any depth of dicts, lists and tuples."""
    if isinstance(v, (set, frozenset)):
        items = sorted((encode_value(x) for x in v), key=lambda x: (type(x).__name__, repr(x)))
        return {TAG: "frozenset" if isinstance(v, frozenset) else "set", "items": items}
    if isinstance(v, io.BytesIO):
        return {TAG: "BytesIO", "bytes": v.getvalue()}
    if isinstance(v, dict):
        return {k: encode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, tuple) and type(v) is tuple:
        return tuple(encode_value(x) for x in v)
    return v


def decode_value(v: Any) -> Any:
    """The inverse of :func:`encode_value`."""
    if isinstance(v, dict):
        if set(v) in ({TAG, "items"}, {TAG, "bytes"}) and v[TAG] in ("set", "frozenset", "BytesIO"):
            if v[TAG] == "BytesIO":
                return io.BytesIO(v["bytes"])
            items = [decode_value(x) for x in v["items"]]
            return set(items) if v[TAG] == "set" else frozenset(items)
        return {k: decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, tuple) and type(v) is tuple:
        return tuple(decode_value(x) for x in v)
    return v


_BOTH: dict = {}


def _both(cls: type, exc: type) -> type:
    both = _BOTH.get(cls)
    if both is None:
        name = f"Megatron{cls.__name__}"
        both = type(
            name,
            (cls, exc),
            {
                "__module__": __name__,
                "__doc__": f"{cls.__name__} that is also Megatron's CheckpointingException.",
            },
        )
        both.__qualname__ = name
        globals()[name] = _BOTH[cls] = both
    return both


def __getattr__(name: str) -> Any:
    """``Megatron<Error>`` classes made on first use, so that one pickled in a process that
    made it unpickles in one that did not (megatron-core is imported for it then)."""
    base = getattr(errors, name[len("Megatron") :], None) if name.startswith("Megatron") else None
    if not (isinstance(base, type) and issubclass(base, errors.ShardpointError)):
        raise AttributeError(name)
    import importlib

    mapping = importlib.import_module("megatron.core.dist_checkpointing.mapping")
    return _both(base, mapping.CheckpointingException)


def as_megatron_error(e: BaseException) -> BaseException:
    """``e`` (a shardpoint error) made also an instance of Megatron's
    ``CheckpointingException``, which Megatron's callers catch: its class becomes a subclass
    of both (same message, traceback and attributes). Other errors are returned as they are."""
    mod = sys.modules.get("megatron.core.dist_checkpointing.mapping")
    exc = getattr(mod, "CheckpointingException", None)
    if exc is None or not isinstance(e, errors.ShardpointError) or isinstance(e, exc):
        return e
    e.__class__ = _both(type(e), exc)
    return e


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
            "contiguous ranges exist in the format",
            spec_id="SP-HOLD-3",
        )
    return (int(fr.start or 0), int(fr.stop))


def _piece(st: Any, data: torch.Tensor) -> ShardedTensor:
    """shardpoint's view of one Megatron ShardedTensor (``data`` shares its storage)."""
    fr = _flat_range(st)
    if fr is None and st.prepend_axis_num:
        data = data[(None,) * st.prepend_axis_num]  # a view: loads fill Megatron's data
    return ShardedTensor(
        data,
        st.global_shape,
        st.global_offset,
        local_shape=_block(st),
        flattened_range=fr,
        replica_id=st.replica_id,
    )


def _object(so: Any, value: Any) -> ShardedObject:
    value = encode_value(value)
    shape = tuple(int(x) for x in so.global_shape)
    offset = tuple(int(x) for x in so.global_offset)
    if len(shape) <= 1:  # Megatron's 1-element grid (or a 0-d one: a single cell)
        return ShardedObject(
            value, offset[0] if offset else 0, shape[0] if shape else 1, replica_id=so.replica_id
        )
    return ShardedObject(value, offset, shape, replica_id=so.replica_id)


@dataclass
class MegatronTree:
    """A ``sharded_state_dict`` as a shardpoint state tree (``tree``), the paths of the
    ``LocalNonpersistentObject`` leaves left out of it, and :meth:`assemble` to turn a
    loaded tree back into a Megatron-style state dict."""

    source: Any
    tree: dict
    left_out: list = field(default_factory=list)
    filled: dict = field(default_factory=dict)  # id(Megatron ShardedTensor) -> tensor
    factories: dict = field(default_factory=dict)  # id(factory) -> its built sub-dict
    overlaps: list = field(default_factory=list)  # (target view, region, buffer)
    cells: dict = field(default_factory=dict)  # id(ShardedObject) -> (key, offset)
    stored: Any = None  # StoredTensors, for those cells

    def finish_overlaps(self) -> None:
        """After a load: targets read through a buffer get it copied in, cast to their dtype
        (Megatron's load casts, as DCP's does); ``allow_shape_mismatch`` targets are zeroed
        first and get the read overlap only (Megatron's trim and pad)."""
        for view, region, buf in self.overlaps:
            if region is None and buf is not None:
                view.copy_(buf)
                continue
            view.zero_()
            if buf is not None:
                view[region].copy_(buf)
        self.overlaps.clear()

    def assemble(self, loaded: dict) -> Any:
        """The state dict ``dist_checkpointing.load`` would return: ShardedTensors replaced by
        their (filled) tensors, ShardedObjects by their values, factories merged,
        nonpersistent objects unwrapped, common values as loaded."""
        return self._build(
            self.source, loaded.get(COMMON), loaded.get(SHARDED, {}), _megatron_classes()
        )

    def _build(self, x: Any, c: Any, objects: dict, classes: Optional[tuple]) -> Any:
        # A method, not a closure calling itself: a recursive closure is a reference cycle
        # that would keep the loaded tensors alive until the next collection.
        if isinstance(x, dict):
            return {
                k: self._build(v, c.get(k) if isinstance(c, dict) else None, objects, classes)
                for k, v in x.items()
            }
        if isinstance(x, list):
            return [
                self._build(
                    v, c[i] if isinstance(c, list) and i < len(c) else None, objects, classes
                )
                for i, v in enumerate(x)
            ]
        if classes is not None:
            mst, mso, local, factory = classes
            if isinstance(x, mst):
                return self.filled[id(x)]
            if isinstance(x, mso):
                if id(x) in self.cells:
                    return decode_value(self.stored.cell(*self.cells[id(x)]))
                return decode_value(objects[x.key])
            if isinstance(x, local):
                return x.unwrap()
            if isinstance(x, factory):
                return x.merge_fn(self._build(self.factories[id(x)], None, objects, classes))
        return decode_value(c)


class _Mapper:
    """The walk of :func:`megatron_tree`: a class rather than nested closures, because a
    closure that calls itself is a reference cycle holding every tensor it saw."""

    def __init__(
        self, out: MegatronTree, for_load: bool, classes: Optional[tuple], stored: Any = None
    ) -> None:
        self.out, self.for_load, self.classes = out, for_load, classes
        self.stored = stored  # key -> stored global shape (or None), for mismatches
        self.tensors: dict = {}  # key -> [shardpoint pieces]
        self.objects: dict = {}  # key -> shardpoint ShardedObject

    def add_tensor(self, st: Any, path: tuple) -> None:
        data = st.data
        if data is None:
            if not self.for_load:
                raise errors.UnsupportedValueError(
                    f"{_where(path)}: Megatron ShardedTensor {st.key!r} has no data to save"
                )
            fr = _flat_range(st)
            n = (fr[1] - fr[0],) if fr else tuple(st.local_shape)
            data = torch.empty(n, dtype=st.dtype)
        self.out.filled[id(st)] = data
        found = self.stored(st.key) if self.for_load and self.stored is not None else None
        if found is not None:
            shape, dtype = found
            if getattr(st, "allow_shape_mismatch", False) and shape != tuple(st.global_shape):
                return self.add_overlap(st, data.detach(), shape, dtype)
            if dtype != data.dtype:  # read the stored dtype, cast on the copy
                buf = torch.empty(data.shape, dtype=dtype)
                self.out.overlaps.append((data.detach(), None, buf))
                data = buf
        self.tensors.setdefault(st.key, []).append(
            _piece(st, data.detach() if self.for_load else data)
        )

    def add_overlap(self, st: Any, data: torch.Tensor, shape: tuple, dtype: Any) -> None:
        """A load target whose stored global shape differs (``allow_shape_mismatch``): read
        the overlap of its block with the stored tensor into a buffer (none: all zeros)."""
        if _flat_range(st) is not None:
            raise errors.LayoutMismatchError(
                f"Megatron ShardedTensor {st.key!r}: allow_shape_mismatch with a "
                "flattened_range cannot be trimmed or padded (Megatron refuses it too); the "
                f"checkpoint holds global shape {shape}, this rank asks {st.global_shape}"
            )
        if len(shape) != len(st.global_shape):
            raise errors.LayoutMismatchError(
                f"Megatron ShardedTensor {st.key!r}: stored with {len(shape)} dimensions "
                f"{shape}, asked with {len(st.global_shape)} {tuple(st.global_shape)}"
            )
        view = data[(None,) * st.prepend_axis_num] if st.prepend_axis_num else data
        lo = tuple(int(o) for o in st.global_offset)
        hi = tuple(min(o + b, s) for o, b, s in zip(lo, view.shape, shape))
        if any(h <= o for o, h in zip(lo, hi)):
            self.out.overlaps.append((view, (), None))
            return
        region = tuple(slice(0, h - o) for o, h in zip(lo, hi))
        buf = torch.empty(tuple(h - o for o, h in zip(lo, hi)), dtype=dtype)
        self.out.overlaps.append((view, region, buf))
        self.tensors.setdefault(st.key, []).append(ShardedTensor(buf, shape, lo))

    def add_object(self, so: Any, path: tuple) -> None:
        if so.key in self.objects and self.for_load and self.stored is not None:
            # more cells of one object on this rank (what load_sharded_metadata hands out):
            # the first is loaded, the others read from the manifest's values
            self.out.cells[id(so)] = (so.key, tuple(int(x) for x in so.global_offset))
            return
        if so.key in self.objects:
            raise errors.InvalidShardingError(
                f"{_where(path)}: this rank holds Megatron ShardedObject {so.key!r} twice; "
                "a rank holds one cell of an object's grid"
            )
        self.objects[so.key] = _object(so, None if self.for_load else so.data)

    def walk(self, x: Any, path: tuple) -> Any:
        if isinstance(x, dict):
            kept = {k: self.walk(v, path + (k,)) for k, v in x.items()}
            return {k: v for k, v in kept.items() if v is not _DROP}
        if isinstance(x, list):
            return [
                None if v is _DROP else v
                for v in (self.walk(v, path + (i,)) for i, v in enumerate(x))
            ]
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


class StoredTensors:
    """What a checkpoint stores under ``root`` by Megatron key, from its manifest (read once,
    on first use): ``self(key)`` is a tensor's ``(global shape, torch dtype)`` (None when
    the key holds none), :meth:`cell` one cell of a sharded object's grid."""

    def __init__(self, path: str, root: tuple = (SHARDED,)) -> None:
        self.path, self.root, self._tree = path, root, None

    def _node(self, key: str) -> Any:
        if self._tree is None:
            self._tree = read_metadata(self.path).tree
        return node_at(self._tree, (*self.root, key))

    def __call__(self, key: str) -> Optional[tuple]:
        node = self._node(key)
        if not isinstance(node, TensorLeaf):
            return None
        return tuple(node.shape), from_name(node.dtype).torch

    def cell(self, key: str, offset: tuple) -> Any:
        node = self._node(key)
        if not isinstance(node, ObjectLeaf):
            raise errors.LayoutMismatchError(
                f"Megatron ShardedObject {key!r} is not a sharded object of the checkpoint at "
                f"{self.path!r}"
            )
        v = node.nested()
        for i in offset if len(node.grid) > 1 else offset[:1] or (0,):
            v = v[i]
        return v


stored_tensors = StoredTensors


def megatron_tree(
    sharded_state_dict: Any, *, for_load: bool = False, stored: Any = None
) -> MegatronTree:
    """Map a megatron-core ``sharded_state_dict`` to a shardpoint state tree (see the module
    docstring). ``for_load=True`` makes load targets: ShardedTensors without data get a new
    tensor to fill; ``stored`` (:func:`stored_tensors`) gives the stored global shapes and
    dtypes: ``allow_shape_mismatch`` targets are trimmed or padded to them, and a target of
    another dtype is read through a buffer and cast, as Megatron's own load does; a rank may
    load several cells of one object. Raises :class:`~shardpoint.InvalidShardingError` naming
    the Megatron key when a key names both a tensor and an object or a rank saves one object
    key twice; pieces of one key that disagree or overlap are refused, by key, when saved or
    loaded."""
    m = _Mapper(
        MegatronTree(sharded_state_dict, {}, stored=stored), for_load, _megatron_classes(), stored
    )
    out, tensors, objects = m.out, m.tensors, m.objects
    common = m.walk(sharded_state_dict, ())
    both = sorted(set(tensors) & set(objects))
    if both:
        raise errors.InvalidShardingError(
            f"Megatron key {both[0]!r} names both a ShardedTensor and a ShardedObject; rename one"
        )
    sharded: dict = {k: v[0] if len(v) == 1 else ShardedPieces(v) for k, v in tensors.items()}
    sharded.update(objects)
    common = None if common is _DROP else common if for_load else encode_value(common)
    out.tree = {SHARDED: sharded, COMMON: common}
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
    try:
        t = megatron_tree(sharded_state_dict)
        if t.left_out:
            log.info(
                "shardpoint save_megatron: %d LocalNonpersistentObject leaf(s) not saved: %s",
                len(t.left_out),
                t.left_out[:10],
            )
        return MegatronSaveResult(save(t.tree, path, **save_kwargs), t.left_out)
    except errors.ShardpointError as e:
        raise as_megatron_error(e)


def load_megatron(
    sharded_state_dict: Any,
    path: str,
    *,
    strict: bool = True,
    report: Optional[LoadReport] = None,
    **load_kwargs: Any,
) -> Any:
    """Load a checkpoint into a megatron-core ``sharded_state_dict`` of any parallel layout.
    Collective. Every ShardedTensor's data is filled in place; returns the state dict
    ``dist_checkpointing.load`` would (tensors, object values, merged factories, unwrapped
    nonpersistent objects, common values from the checkpoint). ``load_kwargs`` go to
    :func:`shardpoint.load` (``group``, ``backend``, ``exchange_budget_bytes``). Errors are
    shardpoint's documented classes and Megatron's ``CheckpointingException`` at once.

    ``path`` is a checkpoint written by :func:`save_megatron`, or a Megatron checkpoint
    directory written by ``dist_checkpointing.save`` with the ``shardpoint`` backend (found by
    its ``metadata.json``: tensors from ``<dir>/shardpoint``, common state from
    ``<dir>/common``), read without registering anything with megatron-core."""
    try:
        mdir = _megatron_dir(str(path))
        if mdir is None and SHARDED not in read_metadata(str(path)).tree:
            loaded, t = _load_flat(sharded_state_dict, str(path), strict, report, load_kwargs)
        elif mdir is None:
            t = megatron_tree(sharded_state_dict, for_load=True, stored=stored_tensors(path))
            loaded = load(path, like=t.tree, strict=strict, report=report, **load_kwargs)
        else:
            t = megatron_tree(sharded_state_dict, for_load=True, stored=stored_tensors(mdir[0]))
            loaded = load(
                mdir[0],
                like={SHARDED: t.tree[SHARDED]},
                strict=strict,
                report=report,
                **load_kwargs,
            )
            loaded[COMMON] = _megatron_common(mdir, t.tree[COMMON], load_kwargs)
        t.finish_overlaps()
        return t.assemble(loaded)
    except errors.ShardpointError as e:
        raise as_megatron_error(e)


def _load_flat(
    sharded_state_dict: Any, path: str, strict: bool, report: Any, load_kwargs: dict
) -> tuple:
    """A shardpoint checkpoint written another way (the DCP plug-in, ``sp.save`` of a flat
    dict): tensors and objects by Megatron key at the top of its tree, as the load strategy
    reads them; the state dict's common values from the same top-level names where the
    checkpoint has them (it has no separate common state)."""
    t = megatron_tree(sharded_state_dict, for_load=True, stored=stored_tensors(path, ()))
    top = read_metadata(path).tree
    common = t.tree[COMMON] if isinstance(t.tree[COMMON], dict) else {}
    like = dict(t.tree[SHARDED])
    names = [k for k in common if k in top and k not in like]
    like.update((k, common[k]) for k in names)
    got = load(path, like=like, strict=strict, report=report, **load_kwargs)
    return {SHARDED: {k: got[k] for k in t.tree[SHARDED]}, COMMON: {k: got[k] for k in names}}, t


def _megatron_dir(d: str) -> Optional[tuple]:
    """``(<d>/shardpoint, <d>/common or None)`` when ``d`` is a ``dist_checkpointing``
    directory of the ``shardpoint`` backend (its ``metadata.json`` says so), else None."""
    meta = os.path.join(d, "metadata.json")
    if not os.path.isfile(meta):
        return None
    try:
        with open(meta) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None
    if backend != "shardpoint":
        raise errors.UnsupportedFormatError(
            f"{d!r} is a Megatron checkpoint of backend {backend!r}, not shardpoint's: load "
            "it with megatron's dist_checkpointing.load, or convert it with `shardpoint "
            "convert`"
        )
    common = os.path.join(d, "common")
    return (
        os.path.join(d, "shardpoint"),
        common if os.path.isfile(os.path.join(common, "manifest.msgpack")) else None,
    )


def _megatron_common(mdir: tuple, wanted: Any, load_kwargs: dict) -> Any:
    """The common state of a Megatron directory (``<dir>/common``); an error naming the
    pickled ``common.pt`` when that is all there is and the state dict asks for values."""
    if mdir[1] is not None:
        return decode_value(
            load(mdir[1], **{k: v for k, v in load_kwargs.items() if k in ("group", "backend")})
        )
    if _has_leaves(wanted):
        raise errors.UnsupportedFormatError(
            f"the common state of {os.path.dirname(mdir[0])!r} is Megatron's pickled "
            "common.pt, which shardpoint does not unpickle: load it with megatron's "
            "dist_checkpointing.load (after `import shardpoint.integrations."
            "megatron_strategy`)"
        )
    return None


def _has_leaves(x: Any) -> bool:
    if isinstance(x, dict):
        return any(_has_leaves(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_leaves(v) for v in x)
    return x is not None


__all__: list = [
    "MegatronSaveResult",
    "MegatronTree",
    "as_megatron_error",
    "decode_value",
    "encode_value",
    "load_megatron",
    "megatron_tree",
    "save_megatron",
    "StoredTensors",
    "stored_tensors",
]
