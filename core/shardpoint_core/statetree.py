"""The checkpoint's tree as users see it: nested dicts, lists and tuples with typed leaves.

``read_metadata(path).tree`` (``Manifest.tree``) is this tree: the state that was saved, its
containers as they were (dict keys str or int, lists, tuples, empty ones included) and each
leaf a :class:`TensorLeaf`, :class:`ObjectLeaf` or :class:`ValueLeaf` (``leaf.kind`` says
which). :func:`iter_leaves` walks it, :func:`node_at` looks a path up.

The manifest stores the tree in its wire encoding (``{"dict": [[k, node]]}``, ``{"list":
[...]}``, leaves ``{"tensor": key}`` / ``{"object": key}`` / ``{"value": v}``, [SP-MAN-4];
``Manifest.wire_tree``): :func:`typed_tree` turns it into the typed tree and
:func:`wire_tree` back. Only writers, the codec and the planner (which merges the ranks'
trees) handle the encoding. Pure: no I/O; neither torch nor JAX.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Sequence, Union

from shardpoint_core.keys import encode_key


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor of the checkpoint: its manifest entry (shape, dtype, chunk grid, array
    path) and what it was saved from, as the manifest says ([SP-MAN-6]): ``origin`` None for
    the saving framework's own tensor type (a torch.Tensor from ``shardpoint``, a jax.Array
    from ``shardpoint_jax``), ``"numpy"`` for a numpy array (a load without ``like`` hands it
    back as numpy), ``"torch"`` for a torch tensor saved by another framework."""

    entry: Any            # the manifest's TensorEntry
    origin: Optional[str] = None
    kind: ClassVar[str] = "tensor"

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def shape(self) -> tuple:
        return self.entry.shape

    @property
    def dtype(self) -> str:
        return self.entry.dtype

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


@dataclass(frozen=True)
class ObjectLeaf:
    """A sharded object: one value per cell of its grid (``values`` in row-major order)."""

    key: str
    values: Sequence      # the manifest's ObjectValues
    kind: ClassVar[str] = "object"

    @property
    def grid(self) -> tuple:
        return getattr(self.values, "shape", (len(self.values),))

    def nested(self) -> list:
        """The values as nested lists along the grid (a flat list for a 1-D grid)."""
        return self.values.nested() if hasattr(self.values, "nested") else list(self.values)


@dataclass(frozen=True)
class ValueLeaf:
    """A plain value stored in the manifest (None, bool, int, float, str, bytes)."""

    key: str
    value: Any
    kind: ClassVar[str] = "value"


Leaf = Union[TensorLeaf, ObjectLeaf, ValueLeaf]
LEAF_TYPES = (TensorLeaf, ObjectLeaf, ValueLeaf)


def typed_tree(wire: dict, tensors: dict, objects: dict, path: tuple = ()) -> Any:
    """The wire tree ``wire`` with typed leaves, ``tensors``/``objects`` being the manifest's
    tables (a decoded manifest was checked: every leaf names its own key, [SP-MAN-4])."""
    if "dict" in wire:
        return {k: typed_tree(v, tensors, objects, path + (k,)) for k, v in wire["dict"]}
    if "list" in wire:
        return [typed_tree(v, tensors, objects, path + (i,)) for i, v in enumerate(wire["list"])]
    if "tuple" in wire:
        return tuple(typed_tree(v, tensors, objects, path + (i,))
                     for i, v in enumerate(wire["tuple"]))
    if "tensor" in wire:
        return TensorLeaf(tensors[wire["tensor"]], wire.get("origin"))
    if "object" in wire:
        return ObjectLeaf(wire["object"], objects[wire["object"]])
    return ValueLeaf(encode_key(path), wire["value"])


def wire_tree(tree: Any) -> dict:
    """The wire encoding of a typed tree (the inverse of :func:`typed_tree`)."""
    if isinstance(tree, dict):
        return {"dict": [[k, wire_tree(v)] for k, v in tree.items()]}
    if isinstance(tree, list):
        return {"list": [wire_tree(v) for v in tree]}
    if isinstance(tree, tuple):
        return {"tuple": [wire_tree(v) for v in tree]}
    if isinstance(tree, TensorLeaf):
        return ({"tensor": tree.key, "origin": tree.origin} if tree.origin is not None
                else {"tensor": tree.key})
    if isinstance(tree, ObjectLeaf):
        return {"object": tree.key}
    return {"value": tree.value}


def iter_leaves(tree: Any, path: tuple = ()) -> Iterator[tuple]:
    """``(path, leaf)`` for every leaf of a typed tree, in tree order."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, path + (i,))
    else:
        yield path, tree


def node_at(tree: Any, path: Sequence) -> Optional[Any]:
    """The node of a typed tree at ``path`` (dict keys and list/tuple indices): a container
    or a leaf, or None when the tree has nothing there."""
    node = tree
    for c in path:
        if isinstance(node, dict):
            node = node.get(c)
        elif (isinstance(node, (list, tuple)) and isinstance(c, int)
              and not isinstance(c, bool) and 0 <= c < len(node)):
            node = node[c]
        else:
            return None
        if node is None:
            return None
    return node
