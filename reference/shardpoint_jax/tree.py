"""Pytrees as the format's trees (spec/format.md sections 1, 2, 4): dicts (str/int keys, in
insertion order), lists and tuples are walked directly; other registered JAX pytree nodes
(flax/optax containers) through ``jax.tree_util`` one level at a time, their key entries
becoming dict keys (attribute names) or list indexes. ``None`` is a value, not an empty node.
The walk itself, key encoding included, is the core's (:mod:`shardpoint_core.format.statetree`), the
same one the torch front end uses."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Optional, Tuple, Union

import jax
import numpy as np

from shardpoint_core.format.errors import InvalidShardingError, UnsupportedValueError
from shardpoint_core.format.statetree import encode_tree, map_tree, plain_children

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
        ok = (
            g
            and all(type(n) is int and n >= 1 for n in g)
            and len(c) == len(g)
            and all(type(i) is int and 0 <= i < n for i, n in zip(c, g))
        )
        if not ok:
            raise InvalidShardingError(
                f"sharded object {key!r}: index {self.index!r} is not a cell of grid {g}",
                spec_id="SP-OBJ-1",
            )
        if not rep or not all(type(r) is int and r >= 0 for r in rep):
            raise InvalidShardingError(
                f"sharded object {key!r}: replica id {self.replica_id!r} must be non-negative ints",
                spec_id="SP-REPL-1",
            )


def is_array(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray))


def children(v: Any) -> Optional[Tuple[str, list, Callable[[list], Any]]]:
    """(kind, [(component, child)], rebuild) of a container, or None for a leaf: the core's
    :func:`~shardpoint_core.format.statetree.plain_children` for dicts, lists and tuples, one level
    of ``jax.tree_util`` for other registered pytree nodes."""
    if (
        v is None
        or is_array(v)
        or isinstance(v, (ShardedObject, jax.ShapeDtypeStruct, np.generic, str, bytes, int, float))
    ):
        return None
    kid = plain_children(v)
    if kid is not None or not _is_registered(v):
        return kid
    kids, treedef = jax.tree_util.tree_flatten_with_path(v, is_leaf=lambda x: x is not v)
    comps = [_component(p[0]) for p, _ in kids] if kids else []
    kind = "list" if comps == list(range(len(comps))) else "dict"
    return (
        kind,
        [(c, x) for c, (_, x) in zip(comps, kids)],
        partial(jax.tree_util.tree_unflatten, treedef),
    )


def _is_registered(v: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(v, is_leaf=lambda x: x is not v)
    return not (len(leaves) == 1 and leaves[0] is v)


def _component(k: Any) -> Union[str, int]:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise UnsupportedValueError(f"pytree key entry {k!r} has no key, index or name")


def walk(tree: Any, leaf: Callable[[tuple, str, Any], Any]) -> Any:
    """Rebuild ``tree`` with every leaf replaced by ``leaf(path, key, value)``."""
    # map_tree passes a str key to every leaf with keys=True (its default); its signature
    # says Optional[str] for keys=False
    return map_tree(tree, leaf, children)  # type: ignore[arg-type]


def tree_node(tree: Any, leaf: Callable[[tuple, str, Any], dict]) -> dict:
    """The manifest tree node of ``tree`` (spec/format.md [SP-MAN-4]), by the core's walk."""
    if children(tree) is None:
        raise UnsupportedValueError(
            "the root of the tree must be a dict, list or tuple", spec_id="SP-KEY-2"
        )
    return encode_tree(tree, leaf, children)
