"""A state tree taken apart for a save: its msgpack-ready structure and its leaves.

Containers (dict, list, tuple, namedtuple) are walked by the core's
:func:`shardpoint_core.format.statetree.encode_tree`, as every front end walks them; every leaf goes
to its handler (:mod:`.leaves`). Pure: no I/O, no process group.
"""

from __future__ import annotations

from typing import Any

from shardpoint.tree.leaves import handler_for
from shardpoint.tree.model import Flattened, check_root
from shardpoint_core.format.keys import format_path
from shardpoint_core.format.statetree import encode_tree


def flatten_state(state: Any, *, replica: tuple = (0,)) -> Flattened:
    """Take a state tree apart into its msgpack-ready structure and its leaves.

    ``replica`` is the replica id given to plain tensors (they are replicas across the ranks
    of a group, and each rank passes its own rank). Raises :class:`UnsupportedValueError`
    naming the path of the first leaf that cannot be stored.
    """
    check_root(state, "save(state, path)")
    f = _Flattener(replica)
    tree = encode_tree(state, f.leaf)
    return Flattened(tree, f.tensors, f.objects)


class _Flattener:
    """The leaves of :func:`flatten_state`, and the ``out`` its leaf handlers append to (an
    object, not a recursive closure: a closure that calls itself is a reference cycle, and it
    kept every tensor it saw until the cyclic collector ran)."""

    def __init__(self, replica: tuple) -> None:
        self.replica = replica
        self.tensors: list = []
        self.objects: list = []

    def leaf(self, path: tuple, key: str, x: Any) -> dict:
        return handler_for(x).flatten(x, key, f"state{format_path(path)}", self)
