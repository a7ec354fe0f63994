"""Pytrees as the format's trees (spec/format.md sections 1, 2, 4): dicts (str/int keys, in
insertion order), lists and tuples are walked directly; other registered JAX pytree nodes
(flax/optax containers) through ``jax.tree_util`` one level at a time, their key entries
becoming dict keys (attribute names) or list indexes. ``None`` is a value, not an empty node."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple, Union

import jax
import numpy as np

from shardpoint_core.errors import InvalidShardingError, UnsupportedValueError
from shardpoint_core.keys import encode_key

Index = Tuple[int, ...]


@dataclasses.dataclass
class ShardedObject:
    """One cell ``index`` of a per-process value over a grid ``shape`` (an int count is the
    1-D grid); e.g. the RNG state of each (stage, tensor rank). ``replica_id`` 0 is the main
    copy of a cell [SP-REPL-2]. As a load target, ``value`` is ignored and filled."""
    value: Any
    index: Union[int, Index]
    shape: Union[int, Index]
    replica_id: Union[int, Index] = 0

    @property
    def grid(self) -> Index:
        return (self.shape,) if isinstance(self.shape, int) else tuple(self.shape)

    @property
    def cell(self) -> Index:
        return (self.index,) if isinstance(self.index, int) else tuple(self.index)

    def check(self, key: str) -> None:
        """[SP-OBJ-1] [SP-REPL-1] on the object's own numbers."""
        g, c = self.grid, self.cell
        rep = (self.replica_id,) if isinstance(self.replica_id, int) else self.replica_id
        ok = (g and all(type(n) is int and n >= 1 for n in g) and len(c) == len(g)
              and all(type(i) is int and 0 <= i < n for i, n in zip(c, g)))
        if not ok:
            raise InvalidShardingError(f"sharded object {key!r}: index {self.index!r} is not "
                                       f"a cell of grid {g}", spec_id="SP-OBJ-1")
        if not rep or not all(type(r) is int and r >= 0 for r in rep):
            raise InvalidShardingError(f"sharded object {key!r}: replica id "
                                       f"{self.replica_id!r} must be non-negative ints",
                                       spec_id="SP-REPL-1")


def is_array(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray))


def children(v: Any) -> Optional[Tuple[str, list, Callable[[list], Any]]]:
    """(kind, [(component, child)], rebuild) of a container, or None for a leaf."""
    if v is None or is_array(v) or isinstance(v, (ShardedObject, jax.ShapeDtypeStruct,
                                                  np.generic, str, bytes, int, float)):
        return None
    if isinstance(v, dict):
        keys = list(v)
        return "dict", [(k, v[k]) for k in keys], lambda xs: _rebuild_dict(v, keys, xs)
    if isinstance(v, list):
        return "list", list(enumerate(v)), list
    if isinstance(v, tuple):
        if hasattr(v, "_fields"):
            return "tuple", list(enumerate(v)), lambda xs: type(v)(*xs)
        return "tuple", list(enumerate(v)), tuple
    if _is_registered(v):
        kids, treedef = jax.tree_util.tree_flatten_with_path(v, is_leaf=lambda x: x is not v)
        comps = [_component(p[0]) for p, _ in kids] if kids else []
        kind = "list" if comps == list(range(len(comps))) else "dict"
        return (kind, [(c, x) for c, (_, x) in zip(comps, kids)],
                lambda xs: jax.tree_util.tree_unflatten(treedef, xs))
    return None


def _rebuild_dict(v: dict, keys: list, xs: list) -> dict:
    out = dict(zip(keys, xs))
    if type(v) is dict:
        return out
    try:
        return type(v)(out)
    except TypeError:
        return out


def _is_registered(v: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(v, is_leaf=lambda x: x is not v)
    return not (len(leaves) == 1 and leaves[0] is v)


def _component(k: Any) -> Union[str, int]:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise UnsupportedValueError(f"pytree key entry {k!r} has no key, index or name")


def walk(tree: Any, leaf: Callable[[tuple, str, Any], Any], path: tuple = ()) -> Any:
    """Rebuild ``tree`` with every leaf replaced by ``leaf(path, key, value)``."""
    kid = children(tree)
    if kid is None:
        return leaf(path, encode_key(path), tree)
    _kind, items, rebuild = kid
    return rebuild([walk(x, leaf, path + (c,)) for c, x in items])


def tree_node(tree: Any, leaf: Callable[[tuple, str, Any], dict], path: tuple = ()) -> dict:
    """The manifest tree node of ``tree`` (spec/format.md [SP-MAN-4])."""
    kid = children(tree)
    if kid is None:
        if not path:
            raise UnsupportedValueError("the root of the tree must be a dict, list or tuple",
                                        spec_id="SP-KEY-2")
        return leaf(path, encode_key(path), tree)
    kind, items, _ = kid
    if kind == "dict":
        return {"dict": [[c, tree_node(x, leaf, path + (c,))] for c, x in items]}
    return {kind: [tree_node(x, leaf, path + (c,)) for c, x in items]}
