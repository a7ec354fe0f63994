"""The checkpoint's tree as users see it: nested dicts, lists and tuples with typed leaves.

``read_metadata(path).tree`` (``Manifest.tree``) is this tree: the state that was saved, its
containers as they were (dict keys str or int, lists, tuples, empty ones included) and each
leaf a :class:`TensorLeaf`, :class:`ObjectLeaf` or :class:`ValueLeaf` (``leaf.kind`` says
which). :func:`iter_leaves` walks it, :func:`node_at` looks a path up.

The manifest stores the tree in its wire encoding (``{"dict": [[k, node]]}``, ``{"list":
[...]}``, leaves ``{"tensor": key}`` / ``{"object": key}`` / ``{"value": v}``, [SP-MAN-4];
``Manifest.wire_tree``): :func:`typed_tree` turns it into the typed tree and
:func:`wire_tree` back. Only writers, the codec and the planner (which merges the ranks'
trees) handle the encoding. Every front end walks its users' trees with the same container
walk (:func:`encode_tree` for a save, :func:`map_tree` for a load's ``like``), passing its
own ``children`` where it knows more containers. Pure: no I/O; neither torch nor JAX.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence, Tuple, Union

from shardpoint_core.keys import encode_component, encode_key


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
    return encode_tree(tree, _wire_leaf)


def _wire_leaf(path: tuple, leaf: Any) -> dict:
    if isinstance(leaf, TensorLeaf):
        return ({"tensor": leaf.key, "origin": leaf.origin} if leaf.origin is not None
                else {"tensor": leaf.key})
    if isinstance(leaf, ObjectLeaf):
        return {"object": leaf.key}
    return {"value": leaf.value}


# The container walk every front end shares: a ``children`` function says whether a node is
# a container (its kind, its ``(component, child)`` pairs and how to build it back) or a
# leaf (None). :func:`plain_children` knows dicts, lists and tuples; a front end with more
# containers (JAX pytree nodes) passes its own, which falls back to this one.

Children = Callable[[Any], Optional[Tuple[str, list, Callable[[list], Any]]]]


def plain_children(x: Any) -> Optional[Tuple[str, list, Callable[[list], Any]]]:
    """``(kind, [(component, child)], rebuild)`` of a dict (subclasses too), list or tuple
    (namedtuples too), or None for a leaf. ``rebuild(children)`` makes a container like
    ``x``: its own type where that can be built back, else a plain dict/list/tuple."""
    if isinstance(x, dict):
        keys = list(x)
        return "dict", [(k, x[k]) for k in keys], partial(_rebuild_dict, type(x), keys)
    if isinstance(x, list):
        return "list", list(enumerate(x)), list
    if isinstance(x, tuple):
        return "tuple", list(enumerate(x)), partial(_rebuild_tuple, type(x))
    return None


def _rebuild_dict(cls: type, keys: list, kids: list) -> dict:
    out = dict(zip(keys, kids))
    if cls is dict:
        return out
    try:
        return cls(out)
    except TypeError:
        return out


def _rebuild_tuple(cls: type, kids: list) -> tuple:
    if cls is tuple:
        return tuple(kids)
    try:
        return cls(*kids) if hasattr(cls, "_fields") else cls(kids)
    except TypeError:
        return tuple(kids)


def encode_tree(tree: Any, leaf: Callable[[tuple, Any], dict], path: tuple = (),
                children: Children = plain_children) -> dict:
    """The wire encoding ([SP-MAN-4]) of an in-memory tree: containers walked with
    ``children``, dict keys checked as key components ([SP-KEY-1]), each leaf's node from
    ``leaf(path, value)``. What a save writes as the manifest's tree, for every front end."""
    kid = children(tree)
    if kid is None:
        return leaf(path, tree)
    kind, items, _ = kid
    if kind == "dict":
        for k, _v in items:
            encode_component(k)
        return {"dict": [[k, encode_tree(v, leaf, path + (k,), children)] for k, v in items]}
    return {kind: [encode_tree(v, leaf, path + (i,), children) for i, v in items]}


def map_tree(tree: Any, leaf: Callable[[tuple, Any], Any], path: tuple = (),
             children: Children = plain_children) -> Any:
    """``tree`` rebuilt with every leaf replaced by ``leaf(path, value)`` (containers as
    ``children`` builds them back): what a load returns in place of its ``like`` tree."""
    kid = children(tree)
    if kid is None:
        return leaf(path, tree)
    _kind, items, rebuild = kid
    return rebuild([map_tree(v, leaf, path + (c,), children) for c, v in items])


def materialize(tree: Any, tensor: Callable[[TensorLeaf], Any]) -> Any:
    """A typed tree as a load without ``like`` returns it: values as themselves, sharded
    objects as their values (nested lists along the grid, [SP-OBJ-4]), each tensor leaf as
    ``tensor(leaf)`` (the front end's array)."""
    return map_tree(tree, _Materialize(tensor))


class _Materialize:
    def __init__(self, tensor: Callable[[TensorLeaf], Any]) -> None:
        self.tensor = tensor

    def __call__(self, path: tuple, leaf: Any) -> Any:
        if leaf.kind == "value":
            return leaf.value
        if leaf.kind == "object":
            return leaf.nested()
        return self.tensor(leaf)


def iter_leaves(tree: Any, path: tuple = ()) -> Iterator[tuple]:
    """``(path, leaf)`` for every leaf of a typed tree, in tree order."""
    kid = plain_children(tree)
    if kid is None:
        yield path, tree
        return
    for c, v in kid[1]:
        yield from iter_leaves(v, path + (c,))


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
