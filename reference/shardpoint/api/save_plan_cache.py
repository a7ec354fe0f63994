"""The save plan cache's key and values: a flat state tree's structure digest (what the plan
depends on) and the plain values merged into a cached plan's tree, so that a save whose
structure did not change sends only its values and reuses the plan.
"""

from __future__ import annotations

from typing import Any

import msgpack

from shardpoint_core.format.treemerge import check_values_agree


def _strip_values(tree: Any) -> Any:
    if "dict" in tree:
        return {"dict": [[k, _strip_values(v)] for k, v in tree["dict"]]}
    for kind in ("list", "tuple"):
        if kind in tree:
            return {kind: [_strip_values(v) for v in tree[kind]]}
    return {"value": None} if "value" in tree else tree


def _structure_digest(flat) -> bytes:
    """What the plan depends on: tree shape, holdings, object ids (not plain values)."""
    import hashlib

    body = msgpack.packb(
        [
            _strip_values(flat.tree),
            [t.holding.to_wire() for t in flat.tensors],
            [[o.key, o.index, o.count, list(o.replica)] for o in flat.objects],
        ]
    )
    return hashlib.sha256(body).digest()


def _value_leaves(tree: Any) -> list:
    from shardpoint.tree.model import iter_tree_leaves

    return [[list(p), n["value"]] for p, n in iter_tree_leaves(tree) if "value" in n]


def _with_values(tree: Any, per_rank: list) -> Any:
    """``tree`` with each plain value replaced by the lowest rank's new value at its path."""
    new: dict = {}
    seen: dict = {}
    for leaves in per_rank:
        for p, v in leaves:
            new.setdefault(tuple(p), v)
            seen.setdefault(tuple(p), []).append(v)
    for p, vs in seen.items():
        if len(vs) > 1:
            check_values_agree(vs, "state" + "".join(f"[{k!r}]" for k in p))

    return _replace_values(tree, (), new)


def _replace_values(node: Any, path: tuple, new: dict) -> Any:
    """``node`` with its value leaves taken from ``new`` by path (module level: a recursive
    closure is a reference cycle)."""
    if "dict" in node:
        return {"dict": [[k, _replace_values(v, path + (k,), new)] for k, v in node["dict"]]}
    for kind in ("list", "tuple"):
        if kind in node:
            return {kind: [_replace_values(v, path + (i,), new) for i, v in enumerate(node[kind])]}
    return {"value": new[path]} if "value" in node else node
