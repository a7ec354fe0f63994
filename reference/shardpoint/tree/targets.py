"""What a load fills: the caller's ``like`` tree walked against the manifest.

Produces the list of targets (a holding and the tensor to fill in place) and the tree that
``load`` returns once they are filled. Pure: no I/O, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from shardpoint.tree import dtypes
from shardpoint.tree.leaves import handler_for
from shardpoint.tree.model import Holding, check_root
from shardpoint_core.format import errors
from shardpoint_core.format.keys import encode_key, format_path, similar_keys
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.statetree import iter_leaves, map_tree, materialize, node_at


@dataclass
class Target:
    holding: Holding
    data: torch.Tensor  # tensor filled in place (full tensor, local piece or flat data)


def collect_targets(like: Any, m: Manifest, strict: bool, report: Any, rank: int):
    """Walk ``like`` against the manifest: the tensors to fill and a function building the
    returned tree once they are filled."""
    check_root(like, "load(path, like=tree)")
    c = _Collector(m, strict, report)
    built = map_tree(like, c.leaf)
    asked = {t.holding.key for t in c.targets}
    report.unexpected_keys = sorted(k for k in m.tensors if k not in asked)
    return c.targets, built


class _Collector:
    """The leaves of :func:`collect_targets`: each to its handler (:mod:`.leaves`), which
    calls back :meth:`tensor_target`. An object, not recursive
    closures: those are reference cycles that kept the targets alive until the cyclic
    collector ran."""

    def __init__(self, m: Manifest, strict: bool, report: Any) -> None:
        self.m, self.strict, self.report = m, strict, report
        self.targets: list = []
        self.values = {v.key: v.value for _p, v in iter_leaves(m.tree) if v.kind == "value"}

    def missing(self, what: str, path: tuple = ()) -> None:
        if self.strict:
            raise errors.LayoutMismatchError(
                f"{what} is not in the checkpoint{_missing_hint(self.m, path)} (pass strict=False "
                "to skip it)",
                spec_id="SP-LOAD-1",
            )
        self.report.missing_keys.append(what)

    def absent(self, what: str, path: tuple, want: str) -> None:
        """A target leaf the checkpoint has no ``want`` for: a leaf of another kind at its
        path fails in both modes ([SP-LOAD-3]); nothing there (or an inner node) is missing."""
        kind = getattr(node_at(self.m.tree, path), "kind", want)  # a leaf's, else want
        if kind != want:
            raise errors.LayoutMismatchError(
                f"{what}: the checkpoint holds a {kind} at this key, the target asks for a "
                f"{want}; ask for it as a {kind}",
                spec_id="SP-LOAD-1",
            )
        self.missing(what, path)

    def tensor_target(self, key: str, h: Holding, data: torch.Tensor) -> None:
        _check_no_self_overlap(data, key)
        e = self.m.tensors[key]
        if h.global_shape != e.shape or h.dtype != e.dtype:
            fix = (
                "like gives a tensor's global shape: a rank's piece as "
                "sp.ShardedTensor(piece, global_shape, global_offset)"
                if h.global_shape != e.shape
                else f"load into a {e.dtype} tensor and cast it (load bytes are never "
                "converted; shardpoint.state.load_model casts model weights)"
            )
            raise errors.LayoutMismatchError(
                f"key {key!r}: checkpoint has shape {e.shape} dtype {e.dtype}, the target "
                f"expects shape {h.global_shape} dtype {h.dtype}; {fix}",
                spec_id="SP-LOAD-1",
            )
        self.targets.append(Target(h, data))

    def leaf(self, path: tuple, key: Optional[str], x: Any) -> Any:
        # Containers are walked by the core's map_tree, exactly as save walks them
        # (encode_tree): a namedtuple is a tuple, a dict subclass is built back when it can be.
        assert key is not None  # map_tree with keys=True names every leaf
        h = handler_for(x)
        if not self.has(h.kind, key):
            self.absent(f"{_NOUN[h.kind]} {key!r}", path, h.kind)
            return h.unfilled(x)
        return h.target(x, key, f"state{format_path(path)}", self)

    def has(self, kind: str, key: str) -> bool:
        """Whether the checkpoint holds a leaf of ``kind`` at ``key``."""
        table = {"tensor": self.m.tensors, "object": self.m.objects}.get(kind, self.values)
        return key in table

    def stored_value(self, key: str) -> Any:
        """The plain value the checkpoint holds at ``key`` (see :meth:`has`)."""
        return self.values[key]


_NOUN = {"tensor": "tensor", "object": "sharded object", "value": "value"}


def has_self_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an ``expand``ed, stride-0 view, or
    strides that interleave). Conservative: dimensions of size > 1 sorted by stride, each
    stride must step past everything the smaller ones reach, which every layout made by
    slicing, transposing or permuting a tensor does."""
    dims = sorted(((abs(st), s) for s, st in zip(t.shape, t.stride()) if s > 1))
    reach = 1
    for stride, size in dims:
        if stride < reach:
            return True
        reach = stride * (size - 1) + reach
    return False


def _check_no_self_overlap(data: torch.Tensor, key: str) -> None:
    """A target whose elements share memory cannot hold distinct values: filling it in place
    would leave the last write in every aliased element, silently wrong."""
    if data.numel() > 1 and has_self_overlap(data):
        raise errors.LayoutMismatchError(
            f"key {key!r}: the target tensor has elements that share memory (shape "
            f"{tuple(data.shape)}, strides {tuple(data.stride())}: an expand()ed or "
            "as_strided view), so it cannot be filled in place; pass a tensor with its own "
            "memory, e.g. t.contiguous() or torch.empty(shape)",
            spec_id="SP-LOAD-1",
        )


def _missing_hint(m: Manifest, path: tuple) -> str:
    """Why a key ``like`` asks for is absent, for the error: the checkpoint holds a subtree
    there, or keys with similar names (a ``module.`` / ``_orig_mod.`` prefix, a typo)."""
    node = node_at(m.tree, path) if path else None
    if isinstance(node, (dict, list, tuple)):
        below = [k for k in m.tensors if k.startswith(encode_key(path) + "/")][:3]
        return (
            (
                f": the checkpoint has a subtree there (e.g. {', '.join(map(repr, below))}); "
                "give like a tree for it"
            )
            if below
            else ": the checkpoint has a subtree there"
        )
    near = (
        similar_keys(encode_key(path), (encode_key(p) for p, _ in iter_leaves(m.tree)))
        if path
        else []
    )
    return f"; similar keys in it: {', '.join(map(repr, near))}" if near else ""


def full_targets(m: Manifest) -> tuple:
    """Targets and tree for a load without ``like``: every tensor in full, on CPU."""
    targets: dict = {}
    for key, e in m.tensors.items():
        try:
            t = torch.empty(e.shape, dtype=dtypes.from_name(e.dtype).torch)
        except (RuntimeError, MemoryError) as err:
            raise errors.ResourceLimitError(
                f"tensor {key!r} of shape {e.shape} ({e.nbytes} bytes) cannot be allocated "
                f"here ({type(err).__name__}); load part of it with like="
            ) from err
        targets[key] = Target(
            Holding(key, e.dtype, e.shape, (0,) * len(e.shape), e.shape, None, (0,)), t
        )

    return list(targets.values()), materialize(m.tree, _FullTensor(targets))


class _FullTensor:
    """The tensor a load without ``like`` returns for a tensor leaf (an object, not a closure
    over ``targets``, like the walkers above)."""

    def __init__(self, targets: dict) -> None:
        self.targets = targets

    def __call__(self, leaf: Any) -> Any:
        t = self.targets[leaf.key].data
        return dtypes.torch_to_numpy(t) if leaf.origin == "numpy" else t
