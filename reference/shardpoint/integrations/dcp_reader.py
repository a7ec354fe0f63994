"""The DCP ``StorageReader`` of :mod:`shardpoint.integrations.dcp`: any shardpoint checkpoint
as DCP :class:`Metadata`, filled by one collective :func:`shardpoint.load`.

The checkpoint's tree is cut into DCP items by DCP's own traversal
(``torch.distributed.checkpoint._traverse.traverse_state_dict``), so the FQNs match what DCP's
planner makes of the caller's state dict: dicts are walked; a list is one item unless it holds
a tensor or a dict (then its elements are); a tuple, a numpy array and any other value are one
item each. So a value DCP's own storage pickles whole (``np.random.get_state()``, a numpy
array, ``(tensor, "y")``) is one bytes item here too, rebuilt from the shardpoint tree: its
tensors and arrays are read from their arrays, never from a pickle.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from shardpoint_core.format import errors
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.format.statetree import ObjectLeaf, TensorLeaf, ValueLeaf
from shardpoint.api.checkpointer import load
from shardpoint.integrations.dcp_common import (
    nest,
    planned_alone,
    solo_group,
    supports_checkpoint_id,
)
from shardpoint.tree.dtypes import from_name, torch_to_numpy
from shardpoint.tree.model import ShardedPieces, ShardedTensor


def _is_tensor(node: Any) -> bool:
    """A stored tensor DCP's traversal treats as a tensor (a numpy array is a value to DCP)."""
    return isinstance(node, TensorLeaf) and node.origin != "numpy"


def _terminal(node: Any) -> bool:
    """DCP's ``_is_terminal`` on the stored tree: a dict never; a list when it holds no
    tensor and no non-terminal dict or list; anything else (a tuple, a leaf) always."""
    if isinstance(node, dict):
        return False
    if not isinstance(node, list):
        return True
    for e in node:
        if isinstance(e, (dict, list)) and not _terminal(e):
            return False
        if _is_tensor(e):
            return False
    return True


def plan_dcp_entries(m: Manifest) -> dict:
    """``{fqn: (path, ("tensor", key) | ("value", node))}`` for a shardpoint manifest, by
    DCP's traversal (see the module docstring); ``node`` is the stored subtree of a value (its
    tensors still :class:`TensorLeaf`). A sharded object (per-rank values, e.g. Megatron's RNG
    states) is one value holding its whole grid as nested lists, as :func:`shardpoint.load`
    gives it without a template. Pure."""
    out: dict = {}
    _dcp_walk(m.tree, (), out)
    return out


def _dcp_walk(node: Any, path: tuple, out: dict) -> None:
    """:func:`plan_dcp_entries`' walk (module level: a nested function calling itself would
    be a reference cycle)."""
    if isinstance(node, dict):
        for k, v in node.items():
            _dcp_walk(v, path + (k,), out)
    elif _terminal(node):
        _dcp_add(out, path, ("tensor", node.key) if _is_tensor(node) else ("value", node))
    else:
        for i, v in enumerate(node):
            _dcp_walk(v, path + (i,), out)


def _dcp_add(out: dict, path: tuple, entry: tuple) -> None:
    fqn = ".".join(str(c) for c in path)
    if fqn in out:
        raise errors.LayoutMismatchError(
            f"shardpoint keys {'/'.join(map(str, out[fqn][0]))!r} and "
            f"{'/'.join(map(str, path))!r} both read as DCP FQN {fqn!r}; load them with "
            "shardpoint.load instead"
        )
    out[fqn] = (path, entry)


def _arrays_in(node: Any, path: tuple) -> Iterator[tuple]:
    """``(path, TensorLeaf)`` of every stored array inside a value's subtree."""
    if isinstance(node, TensorLeaf):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _arrays_in(v, path + (k,))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _arrays_in(v, path + (i,))


def _rebuild(node: Any, path: tuple, arrays: dict) -> Any:
    """The plain value of a stored subtree, its arrays taken from ``arrays`` (by path)."""
    if isinstance(node, ValueLeaf):
        return node.value
    if isinstance(node, ObjectLeaf):
        return node.nested()
    if isinstance(node, TensorLeaf):
        return arrays[path]
    if isinstance(node, dict):
        return {k: _rebuild(v, path + (k,), arrays) for k, v in node.items()}
    kids = [_rebuild(v, path + (i,), arrays) for i, v in enumerate(node)]
    return tuple(kids) if isinstance(node, tuple) else kids


class _Unreadable(Mapping):
    """The ``state_dict_metadata`` of a checkpoint that could not be read: any use raises the
    error that said why (see :meth:`ShardpointReader.read_metadata`)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getitem__(self, key: Any) -> Any:
        raise self.error

    def __iter__(self) -> Iterator:
        raise self.error

    def __len__(self) -> int:
        raise self.error


class ShardpointReader(StorageReader):
    """A DCP ``StorageReader`` for any shardpoint checkpoint at ``path``.

    Call order (DCP's): ``reset``, ``read_metadata`` (DCP's :class:`Metadata` built from the
    manifest: one chunk per tensor spanning it, so DCP asks for exactly the regions each rank's
    state dict holds), ``set_up_storage_reader`` on every rank, the plan hooks (pass-through),
    ``read_data`` on every rank (collective: one :func:`shardpoint.load` filling every
    requested region in place, read once and exchanged where that is cheaper). A target tensor
    of another dtype than the stored one gets the stored values cast into it, as DCP's own
    reader does. A path that holds no shardpoint checkpoint (a DCP ``FileSystemWriter``
    directory, nothing) fails with shardpoint's error naming what is there (inside DCP's
    ``CheckpointException``, as every storage error in ``dcp.load``; :func:`shardpoint.dcp.load`
    raises it as it is).
    ``thread_count`` (how many threads DCP's reader uses) is a hint whose outcome, the state
    filled, is the same whatever its value: shardpoint picks its own read parallelism.
    ``_extension_registry`` is accepted for ``FileSystemReader`` compatibility (a shardpoint
    checkpoint names its own codecs; DCP's stream extensions are not needed to read it).
    """

    def __init__(
        self,
        path: "str | os.PathLike",
        _extension_registry: Any = None,
        *,
        group: Any = None,
        thread_count: int = 1,
    ) -> None:
        super().__init__()
        self.path = str(path)
        self.group = group
        self.use_collectives = True
        self._alone = False
        self._entries: Optional[dict] = None
        self._error: Optional[BaseException] = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: "str | os.PathLike | None" = None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)
        self._entries = None
        self._error = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike") -> bool:
        return supports_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata for the checkpoint; raises shardpoint's error when there is none.
        DCP turns a failure here into ``AssertionError("metadata is None ...")`` and asks again
        for rank-local metadata (``rank=``): that second call (DCP's alone) returns metadata
        that holds the first error, which :meth:`set_up_storage_reader` then raises as it is."""
        try:
            m = read_metadata(self.path)
        except errors.ShardpointError as e:
            if "rank" not in kwargs:
                raise
            self._error = e
            return Metadata(state_dict_metadata=_Unreadable(e))  # type: ignore[arg-type]
        entries = plan_dcp_entries(m)
        md: dict = {}
        for fqn, (path, (kind, ref)) in entries.items():
            if kind == "value":
                md[fqn] = BytesStorageMetadata()
                continue
            t = m.tensors[ref]
            shape = torch.Size(t.shape)
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=from_name(t.dtype).torch),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
            entries[fqn] = (path, (kind, ref, tuple(t.shape), t.dtype))
        self._entries = entries
        return Metadata(
            state_dict_metadata=md,
            planner_data={f: p for f, (p, _e) in entries.items()},
            storage_data={f: e for f, (_p, e) in entries.items()},
            storage_meta=StorageMeta(checkpoint_id=self.path),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if isinstance(metadata.state_dict_metadata, _Unreadable):
            raise metadata.state_dict_metadata.error
        self.use_collectives = kwargs.get("use_collectives", True)
        self._alone = False
        if isinstance(metadata.storage_data, dict):
            self._entries = {
                f: (metadata.planner_data[f], e) for f, e in metadata.storage_data.items()
            }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        self._alone = planned_alone(plans)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if self._entries is None:
            self.read_metadata()
        entries = self._entries
        assert entries is not None, "read_metadata() sets the entries"
        targets: dict = {}  # path -> [ShardedTensor] or a whole array of a value
        fills: list = []  # (item, target, buffer)
        values: list = []  # (item, path, node) of bytes items
        for item in plan.items:
            path, entry = entries[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                for p, leaf in _arrays_in(entry[1], path):
                    targets[p] = [torch.empty(leaf.shape, dtype=from_name(leaf.dtype).torch)]
                values.append((item, path, entry[1]))
                continue
            gshape, stored = entry[2], from_name(entry[3]).torch
            target = planner.resolve_tensor(item).detach()
            base = tuple(item.storage_index.offset or (0,) * len(item.storage_offsets))
            offs = tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets))
            # Read the stored dtype; a target of another dtype gets it cast by copy_, as DCP's
            # FileSystemReader does (sp.load itself never converts).
            buf = (
                target
                if target.is_contiguous() and target.dtype == stored
                else torch.empty(tuple(item.lengths), dtype=stored)
            )
            targets.setdefault(path, []).append(ShardedTensor(buf, gshape, offs))
            fills.append((item, target, buf))
        like = nest(
            {p: v[0] if len(v) == 1 else ShardedPieces(v) for p, v in targets.items()},
            f"DCP load from {self.path}",
        )
        load(
            self.path,
            like=like,
            group=solo_group() if self._alone or not self.use_collectives else self.group,
        )
        for item, target, buf in fills:
            if buf is not target:
                target.copy_(buf)
            planner.commit_tensor(item, target)
        for item, path, node in values:
            arrays = {
                p: (torch_to_numpy(targets[p][0]) if leaf.origin == "numpy" else targets[p][0])
                for p, leaf in _arrays_in(node, path)
            }
            self._load_value(item, planner, _rebuild(node, path, arrays))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _load_value(self, item: Any, planner: LoadPlanner, value: Any) -> None:
        lookup = getattr(planner, "state_dict", None)
        if isinstance(lookup, dict) and isinstance(lookup.get(item.dest_index.fqn), io.BytesIO):
            value = io.BytesIO(value)
        buf = io.BytesIO()
        torch.save(value, buf)  # our own plain value, for DCP's load_bytes (torch.load)
        buf.seek(0)
        planner.load_bytes(item, buf)


__all__ = ["ShardpointReader", "plan_dcp_entries"]
