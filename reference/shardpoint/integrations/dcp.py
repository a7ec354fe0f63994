"""shardpoint as storage for ``torch.distributed.checkpoint`` (DCP): one changed argument.

    import torch.distributed.checkpoint as dcp
    from shardpoint.dcp import ShardpointReader, ShardpointWriter
    dcp.save(state_dict, storage_writer=ShardpointWriter("/ckpt/step_100"))
    dcp.load(state_dict, storage_reader=ShardpointReader("/ckpt/step_100"))

DCP's planners decide *what* each rank writes and reads (flattening, dedup of replicas, DTensor
and ShardedTensor chunks, resharding); these classes decide *where*: the checkpoint is a
shardpoint checkpoint, written by :func:`shardpoint.save` and read by :func:`shardpoint.load`,
so it passes ``shardpoint verify --strict``, loads with ``sp.load`` at any world size and with
``shardpoint_jax``. DCP's pickled ``.metadata`` file is never written or read: the reader builds
DCP's :class:`Metadata` from the shardpoint manifest, so it reads any shardpoint checkpoint,
whoever wrote it.

How DCP's items map:

- A tensor item (``TENSOR``: a replicated tensor kept on one rank by DCP's dedup; ``SHARD``: a
  DTensor or ShardedTensor chunk) becomes a :class:`~shardpoint.ShardedTensor` at the chunk's
  offsets in the global tensor; several chunks of one FQN on one rank become one
  :class:`~shardpoint.ShardedPieces` leaf.
- A ``BYTE_IO`` item (anything that is not a tensor) is stored as a shardpoint *value*, taken
  from the planner's state dict before DCP pickles it: ints, floats, str, bytes, None, lists of
  them; an ``io.BytesIO`` is stored as its bytes. Any other object is refused with
  :class:`~shardpoint.UnsupportedValueError` (shardpoint never stores pickles). On load the
  value is handed back through the planner's ``load_bytes``, so it lands where DCP puts it.
- Keys: the tree path of each FQN (DCP's flatten mappings: ``{"model": {"layer.0.w": t}}`` is
  ``model/layer.0.w``); reading, a shardpoint key path joined by ``.`` is the FQN, following
  DCP's own traversal (a list holding no tensor is one value).

``save`` and ``load`` are collective inside ``write_data`` and ``read_data``, which DCP calls on
every rank; the checkpoint is committed (complete, durable, then visible) before
``write_data`` returns, so DCP's ``finish`` has nothing left to do. ``no_dist=True`` saves and
loads in one process. Pass ``group=`` when DCP is given a ``process_group`` other than the
default one.
"""
from __future__ import annotations

import io
import os
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan,
                                                  SavePlanner, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from shardpoint_core import errors
from shardpoint_core.manifest import Manifest, read_metadata
from shardpoint_core.statetree import ObjectLeaf, TensorLeaf, ValueLeaf
from shardpoint_core.store.registry import check_path
from shardpoint.api.checkpointer import load, save
from shardpoint.api.saving import SaveOptions, SaveResult
from shardpoint.exchange.comm import Comm
from shardpoint.tree.dtypes import from_name
from shardpoint.tree.model import ShardedPieces, ShardedTensor

_SOLO: dict = {}


def _warn_extensions(extensions: Optional[Sequence[Any]], who: str) -> None:
    """DCP's ``_extensions`` are stream transforms of DCP's own ``.distcp`` bytes (compression,
    or any user transform); a shardpoint checkpoint has no such stream, so they are accepted for
    drop-in use and not applied, which the user is told once per writer."""
    if extensions:
        warnings.warn(f"{who}: DCP stream extensions {[type(e).__name__ for e in extensions]} "
                      "are not applied: shardpoint writes its own chunk format (crc32c per "
                      "chunk), not DCP's .distcp streams", UserWarning, stacklevel=3)


def supports_checkpoint_id(checkpoint_id: Any) -> bool:
    """Whether shardpoint can write or read at ``checkpoint_id`` (DCP asks this to pick a
    storage class for a bare ``checkpoint_id``): a local path or ``file://`` URL, or the URL of
    a store scheme registered with shardpoint (``s3://``, ``memory://``); not an unknown scheme."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    try:
        check_path(checkpoint_id, "save")
    except errors.UnsupportedStoreError:
        return False
    return True


def _planned_alone(plans: list) -> bool:
    """True when DCP planned this save or load for this rank alone (``no_dist=True``: every
    rank is its own coordinator and plans only itself), while a process group may be running.
    DCP tells storage nothing else that tells ``no_dist`` apart on rank 0; the coordinator of a
    collective call sees every rank's plan, and the other ranks never get here."""
    return len(plans) == 1


def _solo_group() -> Any:
    """A process group of this rank alone (for ``no_dist`` use inside a running world)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    rank = dist.get_rank()
    if rank not in _SOLO:
        _SOLO[rank] = dist.new_group([rank], use_local_synchronization=True)
    return _SOLO[rank]


def _nest(leaves: dict, where: str) -> dict:
    """``{path tuple: leaf}`` as nested dicts (list indexes become int keys, which shardpoint
    keys exactly as list positions)."""
    root: dict = {}
    for path, leaf in leaves.items():
        node = root
        for c in path[:-1]:
            nxt = node.setdefault(c, {})
            if not isinstance(nxt, dict):
                raise errors.InvalidKeyError(f"{where}: {path!r} lies under a leaf at {c!r}")
            node = nxt
        if path[-1] in node:
            raise errors.InvalidKeyError(f"{where}: two items map to the tree path {path!r}")
        node[path[-1]] = leaf
    return root


class ShardpointWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes a shardpoint checkpoint at ``path``.

    Call order (DCP's): ``reset`` and ``set_up_storage_writer`` on every rank, the plan hooks
    (pass-through), ``write_data`` on every rank (collective: one :func:`shardpoint.save`),
    ``finish`` on the coordinator (nothing: the save already committed). The arguments of
    DCP's ``FileSystemWriter`` are accepted, in its order, so that it can be swapped in;
    ``thread_count``, ``single_file_per_rank``, ``sync_files``, ``per_thread_copy_ahead``,
    ``cache_staged_state_dict``, ``serialization_format`` and ``_extensions`` (DCP's stream
    transforms, with a warning) do not change what is written (shardpoint picks its own I/O
    parallelism and always makes the checkpoint durable before it is visible).
    ``overwrite=True`` (DCP's default) replaces an existing checkpoint at ``path`` atomically.
    """

    def __init__(self, path: "str | os.PathLike", single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 overwrite: bool = True, _extensions: Optional[Sequence[Any]] = None,
                 serialization_format: Any = None, *, group: Any = None,
                 options: Optional[SaveOptions] = None) -> None:
        super().__init__()
        _warn_extensions(_extensions, "ShardpointWriter")
        self.path = str(path)
        self.group = group
        self.overwrite = overwrite
        self.options = options
        self.thread_count = thread_count
        self.use_collectives = True
        self._alone = False
        self.is_coordinator = False
        self.last_result: Optional[SaveResult] = None

    def reset(self, checkpoint_id: "str | os.PathLike | None" = None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.use_collectives = kwargs.get("use_collectives", True)
        self._alone = False

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        self._alone = _planned_alone(plans)
        return plans

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike") -> bool:
        return supports_checkpoint_id(checkpoint_id)

    def _group(self) -> Any:
        return _solo_group() if self._alone or not self.use_collectives else self.group

    def _value(self, planner: SavePlanner, item: Any) -> Any:
        lookup = getattr(planner, "lookup_object", None)
        if lookup is None:
            raise errors.UnsupportedValueError(
                f"DCP item {item.index.fqn!r}: the planner {type(planner).__name__} only hands "
                "out pickled bytes for non-tensor objects and shardpoint stores no pickles; use "
                "DefaultSavePlanner (or a subclass) or make the object a tensor or plain value")
        obj = lookup(item.index)
        return obj.getvalue() if isinstance(obj, io.BytesIO) else obj

    def plan_tree(self, plan: SavePlan, planner: SavePlanner) -> dict:
        """This rank's shardpoint state tree for DCP's final ``plan`` (pure, no I/O)."""
        mappings = getattr(planner, "mappings", None) or {}
        leaves: dict = {}
        for item in plan.items:
            fqn = item.index.fqn
            path = tuple(mappings.get(fqn, (fqn,)))
            if item.type == WriteItemType.BYTE_IO:
                leaves[path] = self._value(planner, item)
                continue
            data = planner.resolve_data(item)
            td = item.tensor_data
            if item.type == WriteItemType.TENSOR and len(td.size) == data.dim() and \
                    tuple(td.size) == tuple(data.shape):
                piece: Any = data.detach()
            else:
                piece = ShardedTensor(data.detach(), tuple(td.size), tuple(td.chunk.offsets))
            leaves.setdefault(path, []).append(piece)
        for path, v in leaves.items():
            if isinstance(v, list) and v and all(isinstance(p, (torch.Tensor, ShardedTensor))
                                                 for p in v):
                if len(v) == 1:
                    leaves[path] = v[0]
                else:
                    leaves[path] = ShardedPieces([p if isinstance(p, ShardedTensor) else
                                                  ShardedTensor(p, tuple(p.shape),
                                                                (0,) * p.dim()) for p in v])
        return _nest(leaves, f"DCP save to {self.path}")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        group = self._group()
        err: Optional[BaseException] = None
        try:
            tree = self.plan_tree(plan, planner)
        except Exception as e:  # noqa: BLE001 - agreed with the other ranks first
            err = e
        # Every rank learns of a rank that could not map its plan, instead of waiting for it
        # inside the collective save.
        if not Comm(group).all_true(err is None):
            raise err if err is not None else errors.SaveFailedError(
                f"DCP save to {self.path}: another rank could not map its DCP plan to a "
                "shardpoint tree (its error names the item); nothing was written")
        res = save(tree, self.path, group=group, overwrite=self.overwrite,
                   options=self.options)
        self.last_result = res
        out = [WriteResult(index=item.index, size_in_bytes=_nbytes(item), storage_data=None)
               for item in plan.items]
        fut: Future = Future()
        fut.set_result(out)
        return fut

    def finish(self, metadata: Metadata, results: list) -> None:
        """Nothing: ``write_data`` committed the checkpoint; DCP's metadata is not written."""


def _nbytes(item: Any) -> int:
    td = item.tensor_data
    if td is None:
        return 0
    n = 1
    for s in td.chunk.sizes:
        n *= int(s)
    return n * torch.tensor([], dtype=td.properties.dtype).element_size()


# ------------------------------------------------------------------------------- reading
def _value_of(node: Any) -> Any:
    if isinstance(node, ValueLeaf):
        return node.value
    if isinstance(node, list):
        return [_value_of(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_value_of(v) for v in node)
    raise KeyError(node)


def _holds_no_array(node: Any) -> bool:
    if isinstance(node, ValueLeaf):
        return True
    if isinstance(node, (list, tuple)):
        return all(_holds_no_array(v) for v in node)
    return False


def plan_dcp_entries(m: Manifest) -> dict:
    """``{fqn: (path, ("tensor", key) | ("value", value))}`` for a shardpoint manifest, by
    DCP's traversal: dicts are walked, a list or tuple holding no tensor is one value, a
    sharded object (per-rank values, e.g. Megatron's RNG states) is one value holding its whole
    grid as nested lists, as :func:`shardpoint.load` gives it without a template. Pure."""
    out: dict = {}
    _dcp_walk(m.tree, (), out)
    return out


def _dcp_walk(node: Any, path: tuple, out: dict) -> None:
    """:func:`plan_dcp_entries`' walk of the typed tree (module level: a nested function
    calling itself would be a reference cycle)."""
    if isinstance(node, dict):
        for k, v in node.items():
            _dcp_walk(v, path + (k,), out)
    elif isinstance(node, (list, tuple)):
        if path and _holds_no_array(node):
            _dcp_add(out, path, ("value", _value_of(node)))
        else:
            for i, v in enumerate(node):
                _dcp_walk(v, path + (i,), out)
    elif isinstance(node, TensorLeaf):
        _dcp_add(out, path, ("tensor", node.key))
    elif isinstance(node, ValueLeaf):
        _dcp_add(out, path, ("value", node.value))
    elif isinstance(node, ObjectLeaf):
        _dcp_add(out, path, ("value", node.nested()))


def _dcp_add(out: dict, path: tuple, entry: tuple) -> None:
    fqn = ".".join(str(c) for c in path)
    if fqn in out:
        raise errors.LayoutMismatchError(
            f"shardpoint keys {'/'.join(map(str, out[fqn][0]))!r} and "
            f"{'/'.join(map(str, path))!r} both read as DCP FQN {fqn!r}; load them with "
            "shardpoint.load instead")
    out[fqn] = (tuple(str(c) if isinstance(c, str) else c for c in path), entry)


class ShardpointReader(StorageReader):
    """A DCP ``StorageReader`` for any shardpoint checkpoint at ``path``.

    Call order (DCP's): ``reset``, ``read_metadata`` (DCP's :class:`Metadata` built from the
    manifest: one chunk per tensor spanning it, so DCP asks for exactly the regions each rank's
    state dict holds), ``set_up_storage_reader`` on every rank, the plan hooks (pass-through),
    ``read_data`` on every rank (collective: one :func:`shardpoint.load` filling every
    requested region in place, read once and exchanged where that is cheaper). A target tensor
    of another dtype than the stored one gets the stored values cast into it, as DCP's own
    reader does.
    ``thread_count`` and ``_extension_registry`` are accepted for ``FileSystemReader``
    compatibility (a shardpoint checkpoint names its own codecs; DCP's are not needed).
    """

    def __init__(self, path: "str | os.PathLike", _extension_registry: Any = None, *,
                 group: Any = None, thread_count: int = 1) -> None:
        super().__init__()
        self.path = str(path)
        self.group = group
        self.use_collectives = True
        self._alone = False
        self._entries: Optional[dict] = None

    def reset(self, checkpoint_id: "str | os.PathLike | None" = None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)
        self._entries = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike") -> bool:
        return supports_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        m = read_metadata(self.path)
        entries = plan_dcp_entries(m)
        md: dict = {}
        for fqn, (_path, (kind, ref)) in entries.items():
            if kind == "value":
                md[fqn] = BytesStorageMetadata()
                continue
            t = m.tensors[ref]
            shape = torch.Size(t.shape)
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=from_name(t.dtype).torch), size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)),
                                             sizes=shape)])
        entries = {f: (p, e if e[0] == "value" else (e[0], e[1], tuple(m.tensors[e[1]].shape),
                                                   m.tensors[e[1]].dtype))
                   for f, (p, e) in entries.items()}
        self._entries = entries
        return Metadata(state_dict_metadata=md,
                        planner_data={f: p for f, (p, _e) in entries.items()},
                        storage_data={f: e for f, (_p, e) in entries.items()},
                        storage_meta=StorageMeta(checkpoint_id=self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.use_collectives = kwargs.get("use_collectives", True)
        self._alone = False
        if isinstance(metadata.storage_data, dict):
            self._entries = {f: (metadata.planner_data[f], e)
                             for f, e in metadata.storage_data.items()}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        self._alone = _planned_alone(plans)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if self._entries is None:
            self.read_metadata()
        entries = self._entries
        targets: dict = {}     # path -> [ShardedTensor]
        fills: list = []       # (item, target, buffer)
        for item in plan.items:
            path, entry = entries[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                self._load_value(item, planner, entry[1])
                continue
            gshape, stored = entry[2], from_name(entry[3]).torch
            target = planner.resolve_tensor(item).detach()
            base = tuple(item.storage_index.offset or (0,) * len(item.storage_offsets))
            offs = tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets))
            # Read the stored dtype; a target of another dtype gets it cast by copy_, as DCP's
            # FileSystemReader does (sp.load itself never converts).
            buf = target if target.is_contiguous() and target.dtype == stored else torch.empty(
                tuple(item.lengths), dtype=stored)
            targets.setdefault(path, []).append(ShardedTensor(buf, gshape, offs))
            fills.append((item, target, buf))
        like = _nest({p: v[0] if len(v) == 1 else ShardedPieces(v) for p, v in targets.items()},
                     f"DCP load from {self.path}")
        load(self.path, like=like, group=_solo_group() if self._alone or
             not self.use_collectives else self.group)
        for item, target, buf in fills:
            if buf is not target:
                target.copy_(buf)
            planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _load_value(self, item: Any, planner: LoadPlanner, value: Any) -> None:
        lookup = getattr(planner, "state_dict", None)
        if isinstance(lookup, dict) and isinstance(lookup.get(item.dest_index.fqn), io.BytesIO):
            value = io.BytesIO(value)
        buf = io.BytesIO()
        torch.save(value, buf)      # our own plain value, for DCP's load_bytes (torch.load)
        buf.seek(0)
        planner.load_bytes(item, buf)


__all__ = ["ShardpointReader", "ShardpointWriter", "plan_dcp_entries",
           "supports_checkpoint_id"]
