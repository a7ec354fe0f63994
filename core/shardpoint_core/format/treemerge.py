"""The checkpoint's tree as the union of every rank's (or process's) wire tree, for both front
ends' save planning: containers must agree in kind ([SP-TREE-1]) and a plain value held by
several ranks must be equal on all of them ([SP-REPL-1]). Pure."""

from __future__ import annotations

from typing import Any, Sequence

from shardpoint_core.format.errors import InvalidShardingError
from shardpoint_core.format.values import pack

__all__ = ["check_values_agree", "merge_many", "merge_trees"]


def merge_trees(a: Any, b: Any, where: str = "state") -> Any:
    """Union of two ranks' tree structures; containers must agree in kind ([SP-TREE-1])."""
    return merge_many([a, b], where)


def merge_many(trees: Sequence[Any], where: str = "state") -> Any:
    """Union of many ranks' trees (in rank order) in one pass over their nodes; containers
    must agree in kind ([SP-TREE-1]); plain values must agree ([SP-REPL-1]).

    Runs of equal subtrees (data-parallel replicas: the model's branch of every rank of a
    stage) are merged once: the equality test runs in C, the merge in Python."""
    uniq = [trees[0]]
    for t in trees[1:]:
        last = uniq[-1]
        if t is not last and t != last:
            uniq.append(t)
    if len(uniq) == 1:
        return uniq[0]
    trees = uniq
    kinds = [next(iter(t)) for t in trees]
    for k in kinds[1:]:
        if k != kinds[0]:
            raise InvalidShardingError(
                f"{where} is a {kinds[0]} on one rank and a {k} on another", spec_id="SP-TREE-1"
            )
    kind = kinds[0]
    if kind == "dict":
        # key -> its subtrees, in rank order (dicts keep first order)
        children: dict[str, Any] = {}
        for t in trees:
            for k, v in t["dict"]:
                lst = children.get(k)
                if lst is None:
                    children[k] = [v]
                else:
                    lst.append(v)
        return {
            "dict": [
                [k, vs[0] if len(vs) == 1 else merge_many(vs, f"{where}[{k!r}]")]
                for k, vs in children.items()
            ]
        }
    if kind in ("list", "tuple"):
        n = max(len(t[kind]) for t in trees)
        cols = [[t[kind][i] for t in trees if i < len(t[kind])] for i in range(n)]
        return {
            kind: [
                vs[0] if len(vs) == 1 else merge_many(vs, f"{where}[{i}]")
                for i, vs in enumerate(cols)
            ]
        }
    if kind == "value":
        check_values_agree([t["value"] for t in trees], where)
    return trees[0]  # leaves: same path, same kind (equal values, checked above)


_EXACT = (int, str, bytes, bool, type(None))  # types whose == is bitwise equality


def check_values_agree(vals: Sequence[Any], where: str) -> None:
    """A plain value is held by every rank that has it, like a replica: the ranks MUST agree
    ([SP-REPL-1]); one rank's value kept silently hid, e.g., per-rank data-loader positions
    saved as a plain int. Compared by their msgpack bytes (so NaN equals NaN, 1 differs
    from 1.0 and True)."""
    first = vals[0]
    if type(first) in _EXACT and all(type(v) is type(first) and v == first for v in vals):
        return  # the common case, without encoding anything
    forms = [pack(v) for v in vals]
    if len(set(forms)) > 1:
        shown = ", ".join(repr(v)[:40] for v in vals[:3])
        raise InvalidShardingError(
            f"{where} is a plain value that differs between ranks ({shown}); the checkpoint "
            "would keep one rank's silently. Save a per-rank value as a ShardedObject "
            "(value, rank, world size), or make it equal on every rank",
            spec_id="SP-REPL-1",
        )
