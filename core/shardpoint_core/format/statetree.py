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
from typing import Any, Callable, ClassVar, Iterator, Optional, Protocol, Sequence, Tuple, Union

from shardpoint_core.format.keys import MAX_KEY_BYTES, encode_component, encode_key


class EntryLike(Protocol):
    """What a leaf reads of its manifest entry (a :class:`~shardpoint_core.format.manifest.
    TensorEntry`; named by this protocol, since the manifest codec imports this module)."""

    @property
    def key(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor of the checkpoint: its manifest entry (shape, dtype, chunk grid, array
    path) and what it was saved from, as the manifest says ([SP-MAN-6]): ``origin`` None for
    the saving framework's own tensor type (a torch.Tensor from ``shardpoint``, a jax.Array
    from ``shardpoint_jax``), ``"numpy"`` for a numpy array (a load without ``like`` hands it
    back as numpy), ``"torch"`` for a torch tensor saved by another framework."""

    entry: EntryLike  # the manifest's TensorEntry
    origin: Optional[str] = None
    kind: ClassVar[str] = "tensor"

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def shape(self) -> tuple[int, ...]:
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
    values: Sequence[Any]  # the manifest's ObjectValues
    kind: ClassVar[str] = "object"

    @property
    def grid(self) -> tuple[Any, ...]:
        return getattr(self.values, "shape", (len(self.values),))

    def nested(self) -> list[Any]:
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


def typed_tree(
    wire: dict[str, Any],
    tensors: dict[str, Any],
    objects: dict[str, Any],
    path: tuple[Any, ...] = (),
) -> Any:
    """The wire tree ``wire`` with typed leaves, ``tensors``/``objects`` being the manifest's
    tables (a decoded manifest was checked: every leaf names its own key, [SP-MAN-4])."""
    if "dict" in wire:
        return {k: typed_tree(v, tensors, objects, path + (k,)) for k, v in wire["dict"]}
    if "list" in wire:
        return [typed_tree(v, tensors, objects, path + (i,)) for i, v in enumerate(wire["list"])]
    if "tuple" in wire:
        return tuple(
            typed_tree(v, tensors, objects, path + (i,)) for i, v in enumerate(wire["tuple"])
        )
    if "tensor" in wire:
        return TensorLeaf(tensors[wire["tensor"]], wire.get("origin"))
    if "object" in wire:
        return ObjectLeaf(wire["object"], objects[wire["object"]])
    return ValueLeaf(encode_key(path), wire["value"])


def wire_tree(tree: Any) -> dict[str, Any]:
    """The wire encoding of a typed tree (the inverse of :func:`typed_tree`)."""
    return encode_tree(tree, _wire_leaf)


def _wire_leaf(path: tuple[Any, ...], key: str, leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, TensorLeaf):
        return (
            {"tensor": leaf.key, "origin": leaf.origin}
            if leaf.origin is not None
            else {"tensor": leaf.key}
        )
    if isinstance(leaf, ObjectLeaf):
        return {"object": leaf.key}
    return {"value": leaf.value}


# The container walk every front end shares: a ``children`` function says whether a node is
# a container (its kind, its ``(component, child)`` pairs and how to build it back) or a
# leaf (None). :func:`plain_children` knows dicts, lists and tuples; a front end with more
# containers (JAX pytree nodes) passes its own, which falls back to this one.

Children = Callable[[Any], Optional[Tuple[str, list[Any], Callable[[list[Any]], Any]]]]


def plain_children(x: Any) -> Optional[Tuple[str, list[Any], Callable[[list[Any]], Any]]]:
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


def _rebuild_dict(cls: type, keys: list[Any], kids: list[Any]) -> dict[str, Any]:
    out = dict(zip(keys, kids))
    if cls is dict:
        return out
    try:
        rebuilt: dict[str, Any] = cls(out)  # a dict subclass (OrderedDict, ...)
        return rebuilt
    except TypeError:
        return out


def _rebuild_tuple(cls: type, kids: list[Any]) -> tuple[Any, ...]:
    if cls is tuple:
        return tuple(kids)
    try:
        rebuilt: tuple[Any, ...] = cls(*kids) if hasattr(cls, "_fields") else cls(kids)
        return rebuilt
    except TypeError:
        return tuple(kids)


def encode_tree(
    tree: Any,
    leaf: Callable[[tuple[Any, ...], str, Any], dict[str, Any]],
    children: Optional[Children] = None,
) -> dict[str, Any]:
    """The wire encoding ([SP-MAN-4]) of an in-memory tree: containers walked with
    ``children`` (:func:`plain_children` when None), dict keys checked as key components
    ([SP-KEY-1]), each leaf's node from ``leaf(path, key, value)``. What a save writes as the
    manifest's tree, for every front end."""
    return _encode(tree, leaf, children, (), "")


def map_tree(
    tree: Any,
    leaf: Callable[[tuple[Any, ...], Optional[str], Any], Any],
    children: Optional[Children] = None,
    *,
    keys: bool = True,
) -> Any:
    """``tree`` rebuilt with every leaf replaced by ``leaf(path, key, value)`` (containers as
    ``children`` builds them back): what a load returns in place of its ``like`` tree.
    ``keys=False``: ``key`` is None, for walks of a typed tree, whose leaves know theirs."""
    return _map(tree, leaf, children, (), "" if keys else None)


# Both walks encode each path component once, on the way down (a leaf's key is its
# parent's plus one component), and walk plain containers without building their
# ``children`` triple: a save walks every node of the user's tree.


def _items(x: Any, children: Optional[Children]) -> Optional[tuple[Any, ...]]:
    if children is not None:
        return children(x)
    if isinstance(x, dict):
        return "dict", x.items(), None
    if isinstance(x, list):
        return "list", enumerate(x), None
    if isinstance(x, tuple):
        return "tuple", enumerate(x), None
    return None


def _join(key: str, c: Any) -> str:
    return f"{key}/{encode_component(c)}" if key else encode_component(c)


def _leaf_key(path: tuple[Any, ...], key: str) -> str:
    # Encoded components are ASCII, so the key's length is its size in bytes; encode_key
    # raises the documented error for the root and for a key over the size limit.
    return encode_key(path) if not path or len(key) > MAX_KEY_BYTES else key


def _encode(
    x: Any, leaf: Callable[..., Any], children: Optional[Children], path: tuple[Any, ...], key: str
) -> dict[str, Any]:
    kid = _items(x, children)
    if kid is None:
        encoded: dict[str, Any] = leaf(path, _leaf_key(path, key), x)
        return encoded
    kind, items = kid[0], kid[1]
    nodes = [[c, _encode(v, leaf, children, path + (c,), _join(key, c))] for c, v in items]
    return {"dict": nodes} if kind == "dict" else {kind: [n for _c, n in nodes]}


def _map(
    x: Any,
    leaf: Callable[..., Any],
    children: Optional[Children],
    path: tuple[Any, ...],
    key: Optional[str],
) -> Any:
    kid = _items(x, children)
    if kid is None:
        return leaf(path, None if key is None else _leaf_key(path, key), x)
    kind, items, rebuild = kid
    if key is None:
        kids = [_map(v, leaf, children, path + (c,), None) for c, v in items]
    else:
        kids = [_map(v, leaf, children, path + (c,), _join(key, c)) for c, v in items]
    if rebuild is not None:
        return rebuild(kids)
    if kind == "dict":
        return _rebuild_dict(type(x), list(x), kids)
    return kids if kind == "list" else _rebuild_tuple(type(x), kids)


def materialize(tree: Any, tensor: Callable[[TensorLeaf], Any]) -> Any:
    """A typed tree as a load without ``like`` returns it: values as themselves, sharded
    objects as their values (nested lists along the grid, [SP-OBJ-4]), each tensor leaf as
    ``tensor(leaf)`` (the front end's array)."""
    return map_tree(tree, _Materialize(tensor), keys=False)


class _Materialize:
    def __init__(self, tensor: Callable[[TensorLeaf], Any]) -> None:
        self.tensor = tensor

    def __call__(self, path: tuple[Any, ...], key: Optional[str], leaf: Any) -> Any:
        if leaf.kind == "value":
            return leaf.value
        if leaf.kind == "object":
            return leaf.nested()
        return self.tensor(leaf)


def iter_leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """``(path, leaf)`` for every leaf of a typed tree, in tree order."""
    kid = plain_children(tree)
    if kid is None:
        yield path, tree
        return
    for c, v in kid[1]:
        yield from iter_leaves(v, path + (c,))


def node_at(tree: Any, path: Sequence[Any]) -> Optional[Any]:
    """The node of a typed tree at ``path`` (dict keys and list/tuple indices): a container
    or a leaf, or None when the tree has nothing there."""
    node = tree
    for c in path:
        if isinstance(node, dict):
            node = node.get(c)
        elif (
            isinstance(node, (list, tuple))
            and isinstance(c, int)
            and not isinstance(c, bool)
            and 0 <= c < len(node)
        ):
            node = node[c]
        else:
            return None
        if node is None:
            return None
    return node
