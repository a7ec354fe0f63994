"""Orbax's standard checkpointing on the shardpoint format, switched by one argument.

``StandardCheckpointer`` and ``StandardCheckpointHandler`` here take the calls and arguments of
Orbax's classes of the same names (``save(path, state, save_args=..., custom_metadata=...)``,
``restore(path, target, strict=...)``, ``args=ocp.args.StandardSave(...)`` /
``ocp.args.StandardRestore(...)``) and write a shardpoint checkpoint instead of OCDBT::

    import orbax.checkpoint as ocp
    from shardpoint_jax import orbax as spo
    ckptr = spo.StandardCheckpointer()          # was: ocp.StandardCheckpointer()
    ckptr.save(path, state); ckptr.wait_until_finished()
    state = ckptr.restore(path, abstract_state)
    # a CheckpointManager: the args class picks the handler (Orbax routes by args class)
    mngr.save(step, args=spo.StandardSave(state))      # was: ocp.args.StandardSave(state)
    mngr.restore(step, args=spo.StandardRestore(abstract_state))
    # an ocp.Checkpointer: ocp.Checkpointer(spo.StandardCheckpointHandler()) takes Orbax's
    # own ocp.args.StandardSave / StandardRestore as well

Orbax's semantics, on top of :class:`~shardpoint_jax.orbax_handler.ShardpointHandler`:
``SaveArgs(dtype=...)`` casts a leaf before it is written; ``custom_metadata`` comes back from
``metadata(dir).custom_metadata``; a restore without a target puts each array back on the
sharding it was saved with (where those devices are gone: the restore's ``fallback_sharding``, else
``Topology mismatch detected``); a
``strict=False`` restore truncates or zero-pads arrays whose saved shape differs from the
target's; ``None`` and ``optax.MaskedNode`` leaves are saved as ``None`` and a ``None`` target
leaf is not read; typed PRNG keys (``jax.random.key``) are stored as their ``uint32`` key data
and come back as keys of the same implementation; a target dtype other than the saved one is
a cast after the read (an ``int64`` checkpoint into 32-bit JAX, as Orbax does, but refused if a
value does not fit: never silently wrapped); a ``None`` tree, a bare array and leaf types
Orbax's standard handler refuses (``str``...) raise ``ValueError`` as there.

What Orbax keeps beside its checkpoint (shardings, PRNG key implementations, custom metadata)
is kept in the checkpoint's manifest, as the ignorable extension ``"orbax"`` (versioning.md); the
checkpoint itself is plain shardpoint, which every front end reads (key data as ``uint32``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future

from shardpoint_core.errors import (InvalidOptionError, LayoutMismatchError,
                                    UnsupportedValueError)
from shardpoint_core.manifest import read_metadata
from shardpoint_core.statetree import TensorLeaf, iter_leaves, materialize
from shardpoint_jax.loading import exact_in_jax, load, load_array
from shardpoint_jax.orbax_handler import (SUBDIR, ShardpointHandler, _snapshot,
                                          checkpoint_path)
from shardpoint_jax.saving import save
from shardpoint_jax.tree import walk

EXTENSION = "orbax"   # the manifest extension holding what Orbax keeps beside a checkpoint
_SCALARS = (int, float, np.number, np.ndarray, jax.Array)


class UnsupportedTypeError(UnsupportedValueError, ValueError):
    """A leaf type Orbax's standard handler refuses (the core's ``UnsupportedValueError``,
    also the ``ValueError`` Orbax raises, so its callers' handlers catch it)."""


def _masked(x: Any) -> bool:
    return type(x).__name__ == "MaskedNode"          # optax.MaskedNode, without optax


def _unmask(tree: Any) -> Any:
    """``tree`` with its ``MaskedNode`` leaves as ``None`` (Orbax saves and restores them so)."""
    return jax.tree_util.tree_map(lambda x: None if _masked(x) else x, tree, is_leaf=_masked)


def _is_key(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def _sharding_record(x: Any) -> Optional[dict]:
    s = getattr(x, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in s.spec]
        return {"axis_names": list(s.mesh.axis_names), "mesh_shape": list(s.mesh.devices.shape),
                "device_ids": [int(d.id) for d in s.mesh.devices.flat], "spec": spec}
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return {"device_ids": [int(next(iter(s.device_set)).id)]}
    return None


def _sharding_of(rec: dict, key: str) -> jax.sharding.Sharding:
    """The saved sharding on this process's devices, or Orbax's topology-mismatch error."""
    devices = {d.id: d for d in jax.devices()}
    missing = [i for i in rec["device_ids"] if i not in devices]
    if missing:
        raise LayoutMismatchError(
            f"Topology mismatch detected. The checkpoint was saved with a different topology "
            f"than the current one ({key!r} was on devices {rec['device_ids']}, "
            f"{len(missing)} of them are not here). Please provide a target tree with the "
            "desired topology to restore.", spec_id="SP-LOAD-1")
    if "axis_names" not in rec:
        return jax.sharding.SingleDeviceSharding(devices[rec["device_ids"][0]])
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in rec["device_ids"]],
                                      dtype=object).reshape(rec["mesh_shape"]),
                             tuple(rec["axis_names"]))
    spec = [tuple(p) if isinstance(p, list) else p for p in rec["spec"]]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _saved(rec: dict, key: str, side: dict) -> jax.sharding.Sharding:
    """The saved sharding, or the restore's ``fallback_sharding`` where those devices are
    gone (Orbax's rule); without one, the topology-mismatch error."""
    try:
        return _sharding_of(rec, key)
    except LayoutMismatchError:
        if side.get("fallback") is None:
            raise
        return side["fallback"]


def prepare_save(item: Any, save_args: Any = None) -> tuple:
    """(the tree shardpoint writes, the extension's records): Orbax's checks, casts per
    ``SaveArgs``, masked leaves as None, PRNG keys as their key data."""
    if item is None:
        raise InvalidOptionError("Must provide item to save.")
    item = _unmask(item)
    if not jax.tree.leaves(item) and not item:
        raise InvalidOptionError("Found empty item.")
    if isinstance(item, (jax.Array, np.ndarray, int, float, np.number)):
        raise InvalidOptionError("StandardCheckpointHandler / StandardSave does not support "
                                 "single arrays or scalars (save a dict, list or tuple)")
    args: Dict[str, Any] = {}
    if save_args is not None:
        walk(save_args, lambda _p, key, a: args.__setitem__(key, a))
    shardings: Dict[str, dict] = {}
    keys: Dict[str, str] = {}

    def leaf(_path: tuple, key: str, x: Any) -> Any:
        if x is None or _masked(x):
            return None
        arg = args.get(key)
        if arg is not None and getattr(arg, "aggregate", False):
            raise InvalidOptionError(f"Unsupported option `aggregate` for key: {key}.")
        if not isinstance(x, (np.ndarray, jax.Array)) and hasattr(x, "__array__"):
            x = np.asarray(x)
        if not isinstance(x, _SCALARS):
            raise UnsupportedTypeError(f"Unsupported type: {type(x)} for key: {key}.",
                                       spec_id="SP-VALUE-1")
        if _is_key(x):
            keys[key] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        dtype = getattr(arg, "dtype", None)
        if dtype is not None and hasattr(x, "astype"):
            x = x.astype(dtype)
        rec = _sharding_record(x) if isinstance(x, jax.Array) else None
        if rec is not None:
            shardings[key] = rec
        return x

    return walk(item, leaf), {"shardings": shardings, "prng_keys": keys}


class _Special:
    """A target leaf the handler reads itself (``how``: skip, key, cast, relax)."""

    def __init__(self, how: str, leaf: Any) -> None:
        self.how, self.leaf = how, leaf


class StandardCheckpointHandler(ShardpointHandler):
    """Orbax's ``StandardCheckpointHandler`` on the shardpoint format: takes
    ``ocp.args.StandardSave`` / ``StandardRestore`` (and the ``ShardpointSave`` /
    ``ShardpointRestore`` of its parent). See the module docstring for the semantics."""

    def __init__(self, **_orbax_options: Any) -> None:
        super().__init__()       # Orbax's tuning options (concurrent GB, OCDBT) do not apply

    # -- save ---------------------------------------------------------------------------
    def _save_now(self, directory: Any, item: Any, sidecar: dict) -> None:
        save(os.path.join(os.fspath(directory), SUBDIR), item,
             extensions={EXTENSION: dict(sidecar, must_understand=False)})

    def _prepared(self, args: Any) -> tuple:
        item, sidecar = prepare_save(args.item, getattr(args, "save_args", None))
        sidecar["custom_metadata"] = getattr(args, "custom_metadata", None)
        return item, sidecar

    def save(self, directory: epath.Path, args: Any = None) -> None:
        self._save_now(directory, *self._prepared(args))

    async def async_save(self, directory: epath.Path, args: Any = None) -> Optional[List[Any]]:
        item, sidecar = self._prepared(args)
        item = _snapshot(item)

        async def write() -> None:
            self._save_now(directory, item, sidecar)

        return [future.CommitFutureAwaitingContractedSignals(write(), name="shardpoint_save")]

    # -- restore ------------------------------------------------------------------------
    @staticmethod
    def _sidecar(m: Any) -> dict:
        """What Orbax keeps beside a checkpoint, from the manifest (empty for a checkpoint
        written another way)."""
        ext = m.extensions.get(EXTENSION)
        ext = dict(ext) if isinstance(ext, dict) else {}
        return {"shardings": ext.get("shardings") or {}, "prng_keys": ext.get("prng_keys") or {},
                "custom_metadata": ext.get("custom_metadata")}

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> Any:
        target = args.item if args is not None else item
        strict = getattr(args, "strict", True) if args is not None else True
        path = checkpoint_path(directory)
        m = read_metadata(path)
        side = self._sidecar(m)
        side["fallback"] = getattr(args, "fallback_sharding", None)
        if target is None:
            if m.objects:
                return load(path)
            target = materialize(m.tree, lambda node: _Special("whole", node.entry.key))
        else:
            target = _unmask(target)

            def check(_p: tuple, key: str, x: Any) -> Any:
                if not (x is None or _masked(x) or isinstance(
                        x, _SCALARS + (jax.ShapeDtypeStruct,))):
                    raise UnsupportedTypeError(f"Unsupported type: {type(x)} for key: {key}.",
                                               spec_id="SP-VALUE-1")
                return x
            walk(target, check)
        tensors, keys = m.tensors, side.get("prng_keys", {})
        stored_none = {leaf.key for _p, leaf in iter_leaves(m.tree)
                       if leaf.kind == "value" and leaf.value is None}

        def classify(_p: tuple, key: str, x: Any) -> Any:
            if isinstance(x, _Special):
                return x
            if x is None or _masked(x) or key in stored_none:    # masked at save: None
                return _Special("skip", x)
            t = tensors.get(key)
            if t is None or not isinstance(x, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
                return x
            if _is_key(x) or key in keys:
                return _Special("key", x)
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
                return _Special("saved", x)     # the saved sharding, else numpy (as Orbax)
            if tuple(x.shape) != tuple(t.shape):
                return x if strict else _Special("relax", x)   # strict: refused, both shapes
            if np.dtype(x.dtype) != _np_dtype(t.dtype) or not (
                    isinstance(x, np.ndarray) or exact_in_jax(x.dtype)):
                return _Special("cast", x)
            return x

        plan = walk(target, classify)
        return load(path, plan, strict=strict,
                    leaf_hook=lambda ck, key, leaf: self._special(ck, key, leaf, side, keys,
                                                                  strict))

    def _special(self, ck: Any, key: str, sp: Any, side: dict, keys: dict,
                 strict: bool = True) -> Any:
        if not isinstance(sp, _Special):
            return NotImplemented
        t = ck.manifest.tensors.get(key)
        if sp.how == "skip":
            return None
        if sp.how == "whole":
            rec = side.get("shardings", {}).get(key)
            if rec is not None:
                out = load_array(ck, key, jax.ShapeDtypeStruct(t.shape, _np_dtype(t.dtype),
                                                               sharding=_saved(rec, key, side)))
            else:
                out = ck._whole_tensor(ck.leaves[key])
            return jax.random.wrap_key_data(out, impl=keys[key]) if key in keys else out
        x = sp.leaf
        sharding = getattr(x, "sharding", None)
        rec = side.get("shardings", {}).get(key)
        if sharding is None and rec is not None and not isinstance(x, np.ndarray):
            sharding = _saved(rec, key, side)
        if sp.how == "saved":
            if strict and tuple(x.shape) != tuple(t.shape):
                return load_array(ck, key, x)     # refused, naming both shapes
            if sharding is None:                  # saved from numpy: numpy, in the asked dtype
                return self._special(ck, key, _Special("relax", np.empty(x.shape, x.dtype)),
                                     side, keys, strict)
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            if tuple(x.shape) != tuple(t.shape):
                return self._special(ck, key, _Special("relax", x), side, keys, strict)
            if np.dtype(x.dtype) == _np_dtype(t.dtype) and exact_in_jax(x.dtype):
                return load_array(ck, key, x)
            sp = _Special("cast", x)
        if sp.how == "key":
            impl = keys.get(key) or str(jax.random.key_impl(x))
            data = load_array(ck, key, jax.ShapeDtypeStruct(t.shape, _np_dtype(t.dtype),
                                                            sharding=sharding))
            return jax.random.wrap_key_data(data, impl=impl)
        stored = np.empty(t.shape, _np_dtype(t.dtype))
        if sp.how == "cast" and (isinstance(x, np.ndarray) or exact_in_jax(stored.dtype)) \
                and sharding is not None:
            data = load_array(ck, key, jax.ShapeDtypeStruct(t.shape, stored.dtype,
                                                            sharding=sharding))
            return data.astype(x.dtype)
        data = load_array(ck, key, stored)           # host memory: a relaxed or narrowed read
        if sp.how == "relax":
            data = _fit(data, tuple(x.shape))
        want = np.dtype(x.dtype) if isinstance(x, np.ndarray) else \
            jax.dtypes.canonicalize_dtype(x.dtype)
        if data.dtype != want and np.issubdtype(want, np.integer) and data.size:
            info = np.iinfo(want)
            if data.min() < info.min or data.max() > info.max:
                raise LayoutMismatchError(f"tensor {key!r} holds values outside {want}, which "
                                          "the target asks for; enable jax_enable_x64 or load "
                                          "into a numpy array", spec_id="SP-DTYPE-2")
        data = data.astype(want)
        if isinstance(x, np.ndarray):
            return data
        return jax.device_put(data, sharding) if sharding is not None else jax.device_put(data)

    def metadata(self, directory: epath.Path) -> Any:
        """Orbax's ``TreeMetadata``: array metadata (shape, dtype, sharding) per leaf and the
        ``custom_metadata`` given at save."""
        from orbax.checkpoint._src.metadata import tree as tree_metadata
        from orbax.checkpoint._src.metadata import value as value_metadata
        path = checkpoint_path(directory)
        m = read_metadata(path)
        side = self._sidecar(m)

        def leaf(node: TensorLeaf) -> Any:
            t = node.entry
            return value_metadata.ArrayMetadata(name=t.key, directory=epath.Path(path),
                                                shape=tuple(t.shape), sharding=None,
                                                dtype=_np_dtype(t.dtype))
        tree = materialize(m.tree, leaf)
        return tree_metadata.build_default_tree_metadata(
            tree, custom_metadata=side.get("custom_metadata"))


def _np_dtype(name: str) -> np.dtype:
    from shardpoint_core.dtypes import from_name
    return from_name(name).numpy


def _fit(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` truncated or zero-padded to ``shape`` (Orbax's ``strict=False``)."""
    if a.ndim != len(shape):
        raise LayoutMismatchError(f"cannot fit an array of shape {a.shape} to {shape}: the "
                                  "ranks differ", spec_id="SP-LOAD-1")
    out = np.zeros(shape, a.dtype)
    cut = tuple(slice(0, min(n, k)) for n, k in zip(a.shape, shape))
    out[cut] = a[cut]
    return out


@ocp.args.register_with_handler(StandardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class StandardSave(ocp.args.StandardSave):
    """``ocp.args.StandardSave`` for :class:`StandardCheckpointHandler` (Orbax routes args to
    handlers by class; Orbax's own class stays routed to Orbax's handler)."""


@ocp.args.register_with_handler(StandardCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class StandardRestore(ocp.args.StandardRestore):
    """``ocp.args.StandardRestore`` for :class:`StandardCheckpointHandler`."""


class StandardCheckpointer(ocp.AsyncCheckpointer):
    """Orbax's ``StandardCheckpointer`` writing shardpoint: the one changed argument is the
    class (``spo.StandardCheckpointer()`` for ``ocp.StandardCheckpointer()``); ``save`` and
    ``restore`` take the same arguments (asynchronous like Orbax's: call
    ``wait_until_finished()`` before reading)."""

    def __init__(self, **kwargs: Any) -> None:
        handler_opts = {k: kwargs.pop(k) for k in list(kwargs)
                        if k not in ("async_options", "multiprocessing_options", "file_options",
                                     "atomicity_options", "checkpoint_metadata_store",
                                     "temporary_path_class")}
        super().__init__(StandardCheckpointHandler(**handler_opts), **kwargs)

    def save(self, directory: Any, state: Any, *, save_args: Any = None, force: bool = False,
             custom_metadata: Optional[dict] = None) -> None:
        super().save(directory, args=StandardSave(state, save_args,
                                                   custom_metadata=custom_metadata),
                     force=force)

    def restore(self, directory: Any, target: Any = None, *, strict: bool = True) -> Any:
        return super().restore(directory, args=StandardRestore(target, strict=strict))


__all__ = ["EXTENSION", "StandardCheckpointHandler", "StandardCheckpointer", "StandardRestore",
           "StandardSave",
           "UnsupportedTypeError", "prepare_save"]
