"""Orbax's save and restore semantics on the shardpoint format, shared by the Orbax handlers
(:mod:`.orbax_handler`'s ``ShardpointHandler`` and :mod:`.orbax`'s ``StandardCheckpointHandler``).

Save: ``SaveArgs(dtype=...)`` casts a leaf before it is written; ``None`` and
``optax.MaskedNode`` leaves are saved as ``None``; typed PRNG keys as their ``uint32`` key data.
What Orbax keeps beside a checkpoint (each array's sharding, each key's implementation, the
user's ``custom_metadata``) goes into the manifest as the ignorable extension ``"orbax"``.
Restore: without a target every array goes back on its saved sharding (the restore's
``fallback_sharding``, else Orbax's ``Topology mismatch detected``, where those devices are
gone); ``strict=False`` truncates or zero-pads an array to the target's shape; a ``None`` target
leaf is not read; a target dtype other than the stored one is a cast after the read (a 64-bit
checkpoint into 32-bit JAX as Orbax does, refused where a value does not fit). With
``standard=True`` Orbax's standard handler's refusals apply too (``ValueError`` there and here).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import jax
import numpy as np

from shardpoint_core.format.errors import (
    InvalidOptionError,
    LayoutMismatchError,
    UnsupportedValueError,
)
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.format.statetree import iter_leaves, materialize
from shardpoint_jax.loading import exact_in_jax, load, load_array
from shardpoint_jax.tree import walk

EXTENSION = "orbax"  # the manifest extension holding what Orbax keeps beside a checkpoint
_SCALARS = (int, float, np.number, np.ndarray, jax.Array)


class UnsupportedTypeError(UnsupportedValueError, ValueError):
    """A leaf type Orbax's standard handler refuses (the core's ``UnsupportedValueError``,
    also the ``ValueError`` Orbax raises, so its callers' handlers catch it)."""


def _masked(x: Any) -> bool:
    return type(x).__name__ == "MaskedNode"  # optax.MaskedNode, without optax


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
        # jax.Device objects; Any: jax's annotations leave their type unresolved here
        devices: Any = s.mesh.devices.flat
        return {
            "axis_names": list(s.mesh.axis_names),
            "mesh_shape": list(s.mesh.devices.shape),
            "device_ids": [int(d.id) for d in devices],
            "spec": spec,
        }
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        device: Any = next(iter(s.device_set))  # as above
        return {"device_ids": [int(device.id)]}
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
            "desired topology to restore.",
            spec_id="SP-LOAD-1",
        )
    if "axis_names" not in rec:
        return jax.sharding.SingleDeviceSharding(devices[rec["device_ids"][0]])
    mesh = jax.sharding.Mesh(
        np.array([devices[i] for i in rec["device_ids"]], dtype=object).reshape(rec["mesh_shape"]),
        tuple(rec["axis_names"]),
    )
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


def prepare_save(item: Any, save_args: Any = None, standard: bool = True) -> tuple:
    """(the tree shardpoint writes, the extension's records): casts per ``SaveArgs``, masked
    leaves as None, PRNG keys as their key data; ``standard``: also Orbax's standard
    handler's refusals (no tree, an empty tree, leaf types other than arrays and numbers)."""
    if item is None and standard:
        raise InvalidOptionError("Must provide item to save.")
    item = _unmask(item)
    if standard and not jax.tree.leaves(item) and not item:
        raise InvalidOptionError("Found empty item.")
    if standard and isinstance(item, (jax.Array, np.ndarray, int, float, np.number)):
        raise InvalidOptionError(
            "StandardCheckpointHandler / StandardSave does not support "
            "single arrays or scalars (save a dict, list or tuple)"
        )
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
        if standard and not isinstance(x, (np.ndarray, jax.Array)) and hasattr(x, "__array__"):
            x = np.asarray(x)
        if standard and not isinstance(x, _SCALARS):
            raise UnsupportedTypeError(
                f"Unsupported type: {type(x)} for key: {key}.", spec_id="SP-VALUE-1"
            )
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


def read_extension(m: Any) -> dict:
    """What Orbax keeps beside a checkpoint, from the manifest (empty for a checkpoint
    written another way)."""
    ext = m.extensions.get(EXTENSION)
    ext = dict(ext) if isinstance(ext, dict) else {}
    return {
        "shardings": ext.get("shardings") or {},
        "prng_keys": ext.get("prng_keys") or {},
        "custom_metadata": ext.get("custom_metadata"),
    }


def _with_restore_args(m: Any, target: Any, restore_args: Any) -> Any:
    """The target that Orbax's per-leaf ``restore_args`` (``PyTreeRestore``) ask for: each
    leaf's ``RestoreArgs``/``ArrayRestoreArgs`` wins over the target's leaf (Orbax's rule):
    ``sharding`` (or ``mesh`` + ``mesh_axes``), ``global_shape`` (truncated or zero-padded
    only where ``strict=False``), ``dtype`` (a cast after the read) and ``restore_type``
    (``np.ndarray``: host memory); a leaf without a sharding goes back on the saved one.
    ``restore_args`` must have the restored tree's structure, as Orbax demands."""
    args: Dict[str, Any] = {}
    walk(restore_args, lambda _p, key, a: args.__setitem__(key, a))
    if target is None:
        target = materialize(m.tree, lambda node: _Special("whole", node.entry.key))
    keys: list = []
    walk(target, lambda _p, key, x: keys.append(key))
    missing, extra = sorted(set(keys) - set(args)), sorted(set(args) - set(keys))
    if missing or extra:
        raise InvalidOptionError(
            "restore_args must have the structure of the restored tree (the item's, else the "
            f"checkpoint's): no restore args for {missing[:5]}, restore args for keys it does "
            f"not have: {extra[:5]}"
        )

    def leaf(_path: tuple, key: str, x: Any) -> Any:
        a, t = args[key], m.tensors.get(key)
        if a is None or t is None or x is None or _masked(x):
            return x
        if type(a).__name__ not in (
            "RestoreArgs",
            "ArrayRestoreArgs",
            "SingleReplicaArrayRestoreArgs",
        ):
            raise InvalidOptionError(
                f"restore_args for {key!r}: {type(a).__name__} is not "
                "one of Orbax's RestoreArgs / ArrayRestoreArgs"
            )
        old = None if isinstance(x, _Special) else x
        dtype = getattr(a, "dtype", None) or getattr(old, "dtype", None) or _np_dtype(t.dtype)
        shape = tuple(getattr(a, "global_shape", None) or getattr(old, "shape", None) or t.shape)
        if getattr(a, "restore_type", None) is np.ndarray:
            want: Any = np.empty(shape, dtype)
        else:
            sharding = getattr(a, "sharding", None)
            if (
                sharding is None
                and getattr(a, "mesh", None) is not None
                and getattr(a, "mesh_axes", None) is not None
            ):
                sharding = jax.sharding.NamedSharding(a.mesh, a.mesh_axes)
            if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
                sharding = sharding.to_jax_sharding()  # Orbax's ShardingMetadata
            if sharding is None and isinstance(old, jax.Array):
                sharding = old.sharding
            want = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        if shape != tuple(t.shape) and not getattr(a, "strict", True):
            return _Special("relax", want)
        return want

    return walk(target, leaf)


def restore(
    path: str,
    target: Any = None,
    *,
    strict: bool = True,
    fallback: Any = None,
    standard: bool = True,
    restore_args: Any = None,
) -> Any:
    """Orbax's restore of the shardpoint checkpoint at ``path`` (see the module docstring);
    ``standard``: also Orbax's standard handler's refusal of other target leaf types;
    ``restore_args``: Orbax's per-leaf ``RestoreArgs`` (``PyTreeRestore``), which win over
    the target's leaves."""
    m = read_metadata(path)
    side = read_extension(m)
    side["fallback"] = fallback
    if restore_args is not None:
        target = _with_restore_args(m, _unmask(target), restore_args)
    if target is None:
        if m.objects:
            return load(path)
        target = materialize(m.tree, lambda node: _Special("whole", node.entry.key))
    elif standard:
        target = _unmask(target)

        def check(_p: tuple, key: str, x: Any) -> Any:
            if not (
                x is None
                or _masked(x)
                or isinstance(x, _SCALARS + (jax.ShapeDtypeStruct, _Special))
            ):
                raise UnsupportedTypeError(
                    f"Unsupported type: {type(x)} for key: {key}.", spec_id="SP-VALUE-1"
                )
            return x

        walk(target, check)
    else:
        target = _unmask(target)
    tensors, keys = m.tensors, side.get("prng_keys", {})
    stored_none = {
        leaf.key for _p, leaf in iter_leaves(m.tree) if leaf.kind == "value" and leaf.value is None
    }

    def classify(_p: tuple, key: str, x: Any) -> Any:
        if isinstance(x, _Special):
            return x
        if x is None or _masked(x) or key in stored_none:  # masked at save: None
            return _Special("skip", x)
        t = tensors.get(key)
        if t is None or not isinstance(x, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
            return x
        if _is_key(x) or key in keys:  # saved as a key: a key again, as Orbax restores it
            return _Special("key", x)
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return _Special("saved", x)  # the saved sharding, else numpy (as Orbax)
        if tuple(x.shape) != tuple(t.shape):
            return x if strict else _Special("relax", x)  # strict: refused, both shapes
        if np.dtype(x.dtype) != _np_dtype(t.dtype) or not (
            isinstance(x, np.ndarray) or exact_in_jax(x.dtype)
        ):
            return _Special("cast", x)
        return x

    plan = walk(target, classify)
    return load(
        path,
        plan,
        strict=strict,
        leaf_hook=lambda ck, key, leaf: _special(ck, key, leaf, side, keys, strict),
    )


def _special(ck: Any, key: str, sp: Any, side: dict, keys: dict, strict: bool = True) -> Any:
    if not isinstance(sp, _Special):
        return NotImplemented
    t = ck.manifest.tensors.get(key)
    if sp.how == "skip":
        return None
    if sp.how == "whole":
        rec = side.get("shardings", {}).get(key)
        if rec is not None:
            out = load_array(
                ck,
                key,
                jax.ShapeDtypeStruct(t.shape, _np_dtype(t.dtype), sharding=_saved(rec, key, side)),
            )
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
            return load_array(ck, key, x)  # refused, naming both shapes
        if sharding is None:  # saved from numpy: numpy, in the asked dtype
            return _special(
                ck, key, _Special("relax", np.empty(x.shape, x.dtype)), side, keys, strict
            )
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if tuple(x.shape) != tuple(t.shape):
            return _special(ck, key, _Special("relax", x), side, keys, strict)
        if np.dtype(x.dtype) == _np_dtype(t.dtype) and exact_in_jax(x.dtype):
            return load_array(ck, key, x)
        sp = _Special("cast", x)
    if sp.how == "key":
        impl = keys.get(key) or str(jax.random.key_impl(x))
        data = load_array(
            ck, key, jax.ShapeDtypeStruct(t.shape, _np_dtype(t.dtype), sharding=sharding)
        )
        return jax.random.wrap_key_data(data, impl=impl)
    stored = np.empty(t.shape, _np_dtype(t.dtype))
    if (
        sp.how == "cast"
        and (isinstance(x, np.ndarray) or exact_in_jax(stored.dtype))
        and sharding is not None
    ):
        data = load_array(ck, key, jax.ShapeDtypeStruct(t.shape, stored.dtype, sharding=sharding))
        return data.astype(x.dtype)
    data = load_array(ck, key, stored)  # host memory: a relaxed or narrowed read
    if sp.how == "relax":
        data = _fit(data, tuple(x.shape))
    want = (
        np.dtype(x.dtype) if isinstance(x, np.ndarray) else jax.dtypes.canonicalize_dtype(x.dtype)
    )
    if data.dtype != want and np.issubdtype(want, np.integer) and data.size:
        info = np.iinfo(want)
        if data.min() < info.min or data.max() > info.max:
            raise LayoutMismatchError(
                f"tensor {key!r} holds values outside {want}, which "
                "the target asks for; enable jax_enable_x64 or load "
                "into a numpy array",
                spec_id="SP-DTYPE-2",
            )
    data = data.astype(want)
    if isinstance(x, np.ndarray):
        return data
    return jax.device_put(data, sharding) if sharding is not None else jax.device_put(data)


def _np_dtype(name: str) -> np.dtype:
    from shardpoint_core.format.dtypes import from_name

    return from_name(name).numpy


def _fit(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` truncated or zero-padded to ``shape`` (Orbax's ``strict=False``)."""
    if a.ndim != len(shape):
        raise LayoutMismatchError(
            f"cannot fit an array of shape {a.shape} to {shape}: the ranks differ",
            spec_id="SP-LOAD-1",
        )
    out = np.zeros(shape, a.dtype)
    cut = tuple(slice(0, min(n, k)) for n, k in zip(a.shape, shape))
    out[cut] = a[cut]
    return out
