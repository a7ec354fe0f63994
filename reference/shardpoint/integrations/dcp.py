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
- A ``BYTE_IO`` item (anything DCP does not treat as a tensor) is stored as a shardpoint
  subtree, taken from the planner's state dict before DCP pickles it: plain values (ints,
  floats, str, bytes, None), lists, tuples and dicts of them, and the tensors and numpy
  arrays inside them as arrays (``np.random.get_state()``, a numpy array, ``(tensor, "y")``
  all round-trip as DCP's own storage does, without a pickle); an ``io.BytesIO`` is stored as
  its bytes. Any other object is refused with :class:`~shardpoint.UnsupportedValueError`
  (shardpoint never stores pickles). On load the value is rebuilt and handed back through the
  planner's ``load_bytes``, so it lands where DCP puts it.
- Keys: the tree path of each FQN (DCP's flatten mappings: ``{"model": {"layer.0.w": t}}`` is
  ``model/layer.0.w``); reading, the stored tree is cut into items by DCP's own traversal
  (:mod:`shardpoint.integrations.dcp_reader`).
- ``overwrite`` follows DCP: ``True`` (DCP's default) replaces a committed checkpoint, through
  shardpoint's committer (atomically: readers see the old or the new one); ``False`` refuses
  it with "Checkpoint already exists" before anything is written. Unlike DCP's
  ``FileSystemWriter``, a directory holding other files (not a checkpoint) is refused, never
  written into or deleted: a checkpoint directory holds its checkpoint only.
- Errors: DCP wraps every storage error in its ``CheckpointException`` (each rank's error in
  ``.failures``); shardpoint's errors are in there as their documented classes.
  :mod:`shardpoint.dcp`'s ``save``/``load``/``async_save`` raise them as they are.

``save`` and ``load`` are collective inside ``write_data`` and ``read_data``, which DCP calls on
every rank; the checkpoint is committed (complete, durable, then visible) before
``write_data`` returns, so DCP's ``finish`` has nothing left to do. ``no_dist=True`` saves and
loads in one process. Pass ``group=`` when DCP is given a ``process_group`` other than the
default one.
"""

from __future__ import annotations

import io
import os
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from shardpoint_core.commit.base import check_overwrite
from shardpoint_core.format import errors
from shardpoint_core.transactions.resolve import get_backend
from shardpoint.api.checkpointer import save
from shardpoint.api.saving import SaveOptions, SaveResult
from shardpoint.exchange.comm import Comm
from shardpoint.integrations.dcp_common import (
    nest,
    planned_alone,
    solo_group,
    supports_checkpoint_id,
)
from shardpoint.integrations.dcp_reader import ShardpointReader, plan_dcp_entries
from shardpoint.tree.model import ShardedPieces, ShardedTensor


def _is_zstd(ext: Any) -> bool:
    """DCP's ``ZStandard`` stream extension (registry name ``stream.zstd``), or a subclass."""
    name = getattr(type(ext), "registry_name", None)
    try:
        return callable(name) and name() == "stream.zstd"
    except Exception:  # noqa: BLE001 - a foreign extension class: not zstd
        return False


def _check_options(extensions: Optional[Sequence[Any]], serialization_format: Any) -> Optional[str]:
    """The compression DCP's ``_extensions`` ask for (``"zstd"`` for ``[ZStandard()]``,
    honoured as zstd-compressed chunks, format 1.5), None without; refuse the
    ``FileSystemWriter`` options that change DCP's own file format in ways a shardpoint
    checkpoint cannot follow: other stream transforms (any user transform of DCP's
    ``.distcp`` streams, which no other reader could undo) and another
    ``serialization_format`` (safetensors files)."""
    exts = list(extensions or [])
    other = [e for e in exts if not _is_zstd(e)]
    if other:
        raise errors.InvalidOptionError(
            f"ShardpointWriter(_extensions={[type(e).__name__ for e in exts]}): DCP stream "
            f"extension(s) {[type(e).__name__ for e in other]} transform DCP's own .distcp "
            "files; a shardpoint checkpoint has none (its chunks are Zarr arrays, whose "
            "codecs every reader knows), so they cannot be applied. ZStandard() is honoured "
            "(zstd-compressed chunks); drop the others, or keep DCP's FileSystemWriter for them"
        )
    fmt = getattr(serialization_format, "value", serialization_format)
    if fmt not in (None, "torch_save"):
        raise errors.InvalidOptionError(
            f"ShardpointWriter(serialization_format={serialization_format!r}): shardpoint "
            "writes its own format (Zarr v3 arrays, a msgpack manifest); for safetensors "
            "files use DCP's writer or `shardpoint convert` to safetensors"
        )
    return "zstd" if exts else None


class ShardpointWriter(StorageWriter, BlockingAsyncStager):
    """A DCP ``StorageWriter`` that writes a shardpoint checkpoint at ``path``.

    Call order (DCP's): ``reset`` and ``set_up_storage_writer`` on every rank, the plan hooks
    (pass-through), ``write_data`` on every rank (collective: one :func:`shardpoint.save`),
    ``finish`` on the coordinator (nothing: the save already committed). The arguments of
    DCP's ``FileSystemWriter`` are taken in its order, so that it can be swapped in:

    - ``overwrite`` as DCP (see the module docstring);
    - ``cache_staged_state_dict`` as DCP: this writer is DCP's ``BlockingAsyncStager``, so
      ``dcp.async_save`` stages through it, into a kept CPU copy when True;
    - ``sync_files``, ``thread_count``, ``per_thread_copy_ahead``, ``single_file_per_rank``
      are hints about how DCP lays out and flushes its own files; what they promise (a
      complete, durable checkpoint) is what every shardpoint save gives, with its own file
      layout and I/O parallelism, whatever their value;
    - ``_extensions=[ZStandard()]`` as DCP: the chunks are compressed with zstd (format 1.5,
      Zarr v3's ``zstd`` codec, which zarr-python and TensorStore read), as
      ``SaveOptions(compression="zstd")``; any other extension and a ``serialization_format``
      other than DCP's default are refused with :class:`~shardpoint.InvalidOptionError`
      (they change DCP's own file format in ways no other reader could undo).
    """

    def __init__(
        self,
        path: "str | os.PathLike",
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Optional[Sequence[Any]] = None,
        serialization_format: Any = None,
        *,
        group: Any = None,
        options: Optional[SaveOptions] = None,
    ) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        compression = _check_options(_extensions, serialization_format)
        self.path = str(path)
        self.group = group
        self.overwrite = check_overwrite(overwrite)  # one overwrite type, refused early
        if compression is not None and (options is None or options.compression is None):
            options = replace(options or SaveOptions(), compression=compression)
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

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        """On the coordinator, before anything is written (where DCP's ``FileSystemWriter``
        checks its target, but once, not on every rank: on an object store that is one
        request per save): an existing checkpoint with ``overwrite=False`` is refused with
        DCP's "Checkpoint already exists"; what a save may never replace (a file, a directory
        of other files) is refused with shardpoint's message."""
        self._alone = planned_alone(plans)
        be = get_backend(None)
        if not self.overwrite and be.checkpoint_state(self.path) == "committed":
            raise errors.CheckpointExistsError(
                f"Checkpoint already exists and self.overwrite=False: {self.path!r} holds a "
                "committed shardpoint checkpoint; pass overwrite=True to replace it "
                "(atomically)",
                spec_id="SP-COMMIT-5",
            )
        be.check_target(self.path, self.overwrite)
        return plans

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike") -> bool:
        return supports_checkpoint_id(checkpoint_id)

    def _group(self) -> Any:
        return solo_group() if self._alone or not self.use_collectives else self.group

    def _value(self, planner: SavePlanner, item: Any) -> Any:
        lookup = getattr(planner, "lookup_object", None)
        if lookup is None:
            raise errors.UnsupportedValueError(
                f"DCP item {item.index.fqn!r}: the planner {type(planner).__name__} only hands "
                "out pickled bytes for non-tensor objects and shardpoint stores no pickles; use "
                "DefaultSavePlanner (or a subclass) or make the object a tensor or plain value"
            )
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
            if td is None or not isinstance(data, torch.Tensor):  # not DCP's own planners
                raise errors.SaveFailedError(
                    f"DCP save to {self.path}: plan item {fqn!r} is a tensor item whose "
                    "planner gave no tensor (or no tensor metadata); nothing was written"
                )
            if (
                item.type == WriteItemType.TENSOR
                and len(td.size) == data.dim()
                and tuple(td.size) == tuple(data.shape)
            ):
                piece: Any = data.detach()
            else:
                piece = ShardedTensor(data.detach(), tuple(td.size), tuple(td.chunk.offsets))
            leaves.setdefault(path, []).append(piece)
        for path, v in leaves.items():
            if (
                isinstance(v, list)
                and v
                and all(isinstance(p, (torch.Tensor, ShardedTensor)) for p in v)
            ):
                if len(v) == 1:
                    leaves[path] = v[0]
                else:
                    leaves[path] = ShardedPieces(
                        [
                            p
                            if isinstance(p, ShardedTensor)
                            else ShardedTensor(p, tuple(p.shape), (0,) * p.dim())
                            for p in v
                        ]
                    )
        return nest(leaves, f"DCP save to {self.path}")

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
            raise (
                err
                if err is not None
                else errors.SaveFailedError(
                    f"DCP save to {self.path}: another rank could not map its DCP plan to a "
                    "shardpoint tree (its error names the item); nothing was written"
                )
            )
        res = save(tree, self.path, group=group, overwrite=self.overwrite, options=self.options)
        self.last_result = res
        out = [
            WriteResult(index=item.index, size_in_bytes=_nbytes(item), storage_data=None)
            for item in plan.items
        ]
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


__all__ = ["ShardpointReader", "ShardpointWriter", "plan_dcp_entries", "supports_checkpoint_id"]
