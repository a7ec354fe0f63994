"""What a load fills: the caller's ``like`` tree walked against the manifest.

Produces the list of targets (a holding and the tensor to fill in place) and the tree that
``load`` returns once they are filled. Pure: no I/O, no process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from shardpoint.tree import dtypes
from shardpoint_core import errors
from shardpoint.tree.model import (ShardedPieces, check_root, check_tensor_data, pieces_holdings,
                                   sharded_holding)
from shardpoint_core.keys import encode_key, format_path, similar_keys
from shardpoint_core.manifest import Manifest
from shardpoint.tree.model import (Holding, ObjectValues, ShardedObject, ShardedTensor,
                                   _dtensor_leaf, _is_dtensor, iter_tree_leaves, object_grid)


@dataclass
class Target:
    holding: Holding
    data: torch.Tensor      # tensor filled in place (full tensor, local piece or flat data)


def collect_targets(like: Any, m: Manifest, strict: bool, report: Any, rank: int):
    """Walk ``like`` against the manifest: the tensors to fill and a function building the
    returned tree once they are filled."""
    check_root(like, "load(path, like=tree)")
    c = _Collector(m, strict, report)
    built = c.walk(like, ())
    asked = {t.holding.key for t in c.targets}
    report.unexpected_keys = sorted(k for k in m.tensors if k not in asked)
    return c.targets, built


class _Collector:
    """The walk of :func:`collect_targets` (an object, not recursive closures: those are
    reference cycles that kept the targets alive until the cyclic collector ran)."""

    def __init__(self, m: Manifest, strict: bool, report: Any) -> None:
        self.m, self.strict, self.report = m, strict, report
        self.targets: list = []

    def missing(self, what: str, path: tuple = ()) -> None:
        if self.strict:
            raise errors.LayoutMismatchError(
                f"{what} is not in the checkpoint{_missing_hint(self.m, path)} (pass strict=False "
                "to skip it)", spec_id="SP-LOAD-1")
        self.report.missing_keys.append(what)

    def absent(self, what: str, path: tuple, want: str) -> None:
        """A target leaf the checkpoint has no ``want`` for: a leaf of another kind at its
        path fails in both modes ([SP-LOAD-3]); nothing there (or an inner node) is missing."""
        node = _node_at(self.m.tree, path) or {}
        kind = next((k for k in ("tensor", "object", "value") if k in node), want)
        if kind != want:
            raise errors.LayoutMismatchError(
                f"{what}: the checkpoint holds a {kind} at this key, the target asks for a "
                f"{want}; ask for it as a {kind}", spec_id="SP-LOAD-1")
        self.missing(what, path)

    def tensor_target(self, key: str, h: Holding, data: torch.Tensor) -> None:
        e = self.m.tensors[key]
        if h.global_shape != e.shape or h.dtype != e.dtype:
            fix = ("like gives a tensor's global shape: a rank's piece as "
                   "sp.ShardedTensor(piece, global_shape, global_offset)"
                   if h.global_shape != e.shape else
                   f"load into a {e.dtype} tensor and cast it (load bytes are never "
                   "converted; shardpoint.state.load_model casts model weights)")
            raise errors.LayoutMismatchError(
                f"key {key!r}: checkpoint has shape {e.shape} dtype {e.dtype}, the target "
                f"expects shape {h.global_shape} dtype {h.dtype}; {fix}", spec_id="SP-LOAD-1")
        self.targets.append(Target(h, data))

    def walk(self, x: Any, path: tuple) -> Any:
        if isinstance(x, dict):
            out = {k: self.walk(v, path + (k,)) for k, v in x.items()}
            if type(x) is dict:
                return out
            try:
                return type(x)(out)
            except TypeError:
                return out
        if isinstance(x, (list, tuple)):
            # Walked exactly as save walks them (model.flatten_state): a namedtuple is a tuple.
            seq = [self.walk(v, path + (i,)) for i, v in enumerate(x)]
            if hasattr(x, "_fields"):
                return type(x)(*seq)
            return type(x)(seq) if isinstance(x, tuple) else seq
        key = encode_key(path)
        where = f"state{format_path(path)}"
        is_tensor = isinstance(x, (torch.Tensor, np.ndarray, ShardedTensor, ShardedPieces))
        if is_tensor and key not in self.m.tensors:
            self.absent(f"tensor {key!r}", path, "tensor")
            return x
        if isinstance(x, ShardedTensor):
            check_tensor_data(x.data, where, target=True)
            self.tensor_target(key, sharded_holding(x, key, where, (0,)), x.data.detach())
            return x.data
        if isinstance(x, ShardedPieces):
            for p in x:
                check_tensor_data(p.data, where, target=True)
            for h, p in zip(pieces_holdings(x, key, where, (0,)), x):
                self.tensor_target(key, h, p.data.detach())
            return [p.data for p in x]
        if _is_dtensor(x):
            lt = _dtensor_leaf(x, key, where)
            self.tensor_target(key, lt.holding, lt.data)
            return x
        if isinstance(x, torch.Tensor):
            d = dtypes.from_torch(x.dtype, where)
            check_tensor_data(x, where, target=True)
            shp = tuple(x.shape)
            # detach(): same storage, so an nn.Parameter (requires_grad) fills in place too.
            self.tensor_target(key, Holding(key, d.name, shp, (0,) * len(shp), shp, None, (0,)),
                          x.detach())
            return x
        if isinstance(x, np.ndarray):
            if not x.flags.writeable:
                raise errors.LayoutMismatchError(f"{where}: numpy target is read-only")
            if x.dtype.byteorder == ">":
                raise errors.LayoutMismatchError(
                    f"{where}: numpy target has big-endian dtype {x.dtype.str}; it cannot be "
                    "filled in place (pass a native-endian array, e.g. "
                    "x.astype(x.dtype.newbyteorder('='))", spec_id="SP-LOAD-1")
            d = dtypes.from_numpy(x.dtype, where)
            shp = tuple(x.shape)
            self.tensor_target(key, Holding(key, d.name, shp, (0,) * len(shp), shp, None, (0,)),
                          dtypes.numpy_to_torch(x))
            return x
        if isinstance(x, ShardedObject):
            if key not in self.m.objects:
                self.absent(f"sharded object {key!r}", path, "object")
                return x.value
            vals = self.m.objects[key]
            stored = object_grid(vals)
            if stored != x.grid_shape:
                def show(g: tuple) -> str:
                    return str(g[0]) if len(g) == 1 else str(g)
                raise errors.LayoutMismatchError(
                    f"sharded object {key!r}: checkpoint has count (grid) {show(stored)}, the "
                    f"target asks for index {x.index} of count (grid) {show(x.grid_shape)}; "
                    "load with the grid it was saved with", spec_id="SP-OBJ-2")
            return vals[x.flat_index]
        stored = _value_at(self.m.tree, path)
        if stored is None:
            self.absent(f"value {key!r}", path, "value")
            return x
        return stored[0]


def _missing_hint(m: Manifest, path: tuple) -> str:
    """Why a key ``like`` asks for is absent, for the error: the checkpoint holds a subtree
    there, or keys with similar names (a ``module.`` / ``_orig_mod.`` prefix, a typo)."""
    node = _node_at(m.tree, path) if path else None
    if node is not None and any(k in node for k in ("dict", "list", "tuple")):
        below = [k for k in m.tensors if k.startswith(encode_key(path) + "/")][:3]
        return (f": the checkpoint has a subtree there (e.g. {', '.join(map(repr, below))}); "
                "give like a tree for it") if below else ": the checkpoint has a subtree there"
    near = similar_keys(encode_key(path), (encode_key(p) for p, _ in iter_tree_leaves(m.tree))
                        ) if path else []
    return f"; similar keys in it: {', '.join(map(repr, near))}" if near else ""


def _value_at(tree: Any, path: tuple) -> Optional[tuple]:
    node = _node_at(tree, path)
    return (node["value"],) if node is not None and "value" in node else None


def _node_at(tree: Any, path: tuple) -> Optional[dict]:
    """The manifest tree node at ``path``, or None."""
    node = tree
    for c in path:
        if "dict" in node:
            node = dict((k, v) for k, v in node["dict"]).get(c)
        elif "list" in node or "tuple" in node:
            seq = node.get("list", node.get("tuple"))
            node = seq[c] if isinstance(c, int) and 0 <= c < len(seq) else None
        else:
            node = None
        if node is None:
            return None
    return node


def full_targets(m: Manifest) -> tuple:
    """Targets and tree for a load without ``like``: every tensor in full, on CPU."""
    targets: dict = {}
    for key, e in m.tensors.items():
        try:
            t = torch.empty(e.shape, dtype=dtypes.from_name(e.dtype).torch)
        except (RuntimeError, MemoryError) as err:
            raise errors.ResourceLimitError(
                f"tensor {key!r} of shape {e.shape} ({e.nbytes} bytes) cannot be allocated "
                f"here ({type(err).__name__}); load part of it with like=") from err
        targets[key] = Target(Holding(key, e.dtype, e.shape, (0,) * len(e.shape), e.shape,
                                       None, (0,)), t)

    return list(targets.values()), _build_full(m.tree, m, targets)


def _build_full(node: Any, m: Manifest, targets: dict) -> Any:
    """The tree a load without ``like`` returns (module level: no closure cycle)."""
    if "dict" in node:
        return {k: _build_full(v, m, targets) for k, v in node["dict"]}
    if "list" in node:
        return [_build_full(v, m, targets) for v in node["list"]]
    if "tuple" in node:
        return tuple(_build_full(v, m, targets) for v in node["tuple"])
    if "value" in node:
        return node["value"]
    if "object" in node:
        vals = m.objects[node["object"]]
        return ObjectValues(vals, object_grid(vals)).nested()
    t = targets[node["tensor"]].data
    return dtypes.torch_to_numpy(t) if node.get("origin") == "numpy" else t
