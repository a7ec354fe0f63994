"""A state tree taken apart for a save: its msgpack-ready structure and its leaves.

Containers (dict, list, tuple, namedtuple) are walked here; every leaf goes to its handler
(:mod:`.leaves`). Pure: no I/O, no process group.
"""
from __future__ import annotations

from typing import Any

from shardpoint.tree.leaves import handler_for
from shardpoint.tree.model import Flattened, check_root
from shardpoint_core.keys import encode_component, encode_key, format_path


def flatten_state(state: Any, *, replica: tuple = (0,)) -> Flattened:
    """Take a state tree apart into its msgpack-ready structure and its leaves.

    ``replica`` is the replica id given to plain tensors (they are replicas across the ranks
    of a group, and each rank passes its own rank). Raises :class:`UnsupportedValueError`
    naming the path of the first leaf that cannot be stored.
    """
    check_root(state, "save(state, path)")
    f = _Flattener(replica)
    tree = f.walk(state, ())
    return Flattened(tree, f.tensors, f.objects)


class _Flattener:
    """The walk of :func:`flatten_state`, and the ``out`` its leaf handlers append to (an
    object, not a recursive closure: a closure that calls itself is a reference cycle, and it
    kept every tensor it saw until the cyclic collector ran)."""

    def __init__(self, replica: tuple) -> None:
        self.replica = replica
        self.tensors: list = []
        self.objects: list = []

    def walk(self, x: Any, path: tuple) -> Any:
        if isinstance(x, dict):
            for k in x:
                encode_component(k)
            return {"dict": [[k, self.walk(v, path + (k,))] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return {kind: [self.walk(v, path + (i,)) for i, v in enumerate(x)]}
        return handler_for(x).flatten(x, encode_key(path), f"state{format_path(path)}", self)
