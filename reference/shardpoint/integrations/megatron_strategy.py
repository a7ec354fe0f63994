"""shardpoint as a megatron-core ``dist_checkpointing`` backend: strategies registered under
the backend name ``shardpoint``.

    import shardpoint.integrations.megatron_strategy         # registers the backend
    from megatron.core import dist_checkpointing
    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=("shardpoint", 1))
    state = dist_checkpointing.load(sharded_state_dict, ckpt_dir)   # found by metadata.json

Layout of ``ckpt_dir`` (Megatron's directory, which ``dist_checkpointing.save`` wants empty):
``metadata.json`` (Megatron's own JSON: backend ``shardpoint``, version 1), ``shardpoint/`` (a
shardpoint checkpoint, the tree of :mod:`shardpoint.integrations.megatron`: tensors and sharded
objects at ``sharded/<Megatron key>``) and, with :func:`use_shardpoint_common`, ``common/``
(the common state as a shardpoint checkpoint of its own, instead of the pickled
``common.pt``). Both pass ``shardpoint verify --strict`` and load with ``sp.load``.

- :class:`ShardpointSaveStrategy` is an ``AsyncSaveShardedStrategy``: ``save`` is one
  collective :func:`shardpoint.save`; ``async_save`` stages into shardpoint's host pool and
  returns Megatron's ``AsyncRequest`` whose finalize step waits for shardpoint's background
  write and commit (which run on a gloo group of their own, so nothing runs in Megatron's
  forked worker). It handles ShardedObjects itself, and runs under
  ``FullyParallelSaveStrategyWrapper`` (whose replica election it keeps).
- :class:`ShardpointLoadStrategy` loads into any TP/PP/DP layout with one collective
  :func:`shardpoint.load` (reads are deduplicated and exchanged by shardpoint's cost model),
  also under ``FullyParallelLoadStrategyWrapper``, and answers Megatron's metadata queries
  from the manifest. It also loads a shardpoint checkpoint directory given directly.

CPU-only (gloo) ranks: ``FullyParallelSaveStrategyWrapper`` runs (its replica election is
``all_gather_object``). Two Megatron parts need CUDA in megatron-core 0.16 whatever the
strategy: ``FullyParallelLoadStrategyWrapper.load`` on a group of 2+ ranks calls
``torch.cuda.synchronize()`` unconditionally (``strategies/fully_parallel.py`` lines 272 and
281) and its exchange allocates on ``"cuda"`` (``exchange_utils.py``
``_get_empty_tensor_for_exchange``); ``AsyncCallsQueue.maybe_finalize_async_calls`` all-reduces
a tensor on ``torch.cuda.current_device()`` after the finalize steps (``async_utils.py`` line
604). On CPU the plain load strategy and the request's ``finalize_fns`` called directly do the
same work.
- :class:`ShardpointCommonLoadStrategy` is registered as Megatron's ``torch`` common loader:
  it reads ``common/`` when the checkpoint has one and otherwise defers to Megatron's
  ``common.pt`` loader, so other checkpoints load as before.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import (CheckpointingException, ShardedObject,
                                                      ShardedTensor as MShardedTensor)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (AsyncSaveShardedStrategy,
                                                              LoadCommonStrategy,
                                                              LoadShardedStrategy,
                                                              SaveCommonStrategy,
                                                              StrategyAction,
                                                              register_default_strategy)
from megatron.core.dist_checkpointing.strategies.common import (TorchCommonLoadStrategy,
                                                                TorchCommonSaveStrategy)

from shardpoint_core.manifest import read_metadata
from shardpoint_core.statetree import ObjectLeaf, TensorLeaf, iter_leaves
from shardpoint.api.checkpointer import load, save
from shardpoint.api.saving import SaveOptions
from shardpoint.integrations.megatron import SHARDED, megatron_tree
from shardpoint.tree.dtypes import from_name

BACKEND, VERSION = "shardpoint", 1
SHARDED_DIR, COMMON_DIR, MANIFEST = "shardpoint", "common", "manifest.msgpack"
_SOLO: dict = {}


def _solo() -> Any:
    """A group of this rank alone: the common state is written by rank 0 only."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    r = dist.get_rank()
    if r not in _SOLO:
        _SOLO[r] = dist.new_group([r], use_local_synchronization=True)
    return _SOLO[r]


def sharded_path(checkpoint_dir: Union[str, Path]) -> str:
    """Where the tensors live: ``<dir>/shardpoint``, or ``dir`` itself when it is a shardpoint
    checkpoint (one written by ``sp.save`` or through DCP)."""
    d = str(checkpoint_dir)
    return d if os.path.isfile(os.path.join(d, MANIFEST)) else os.path.join(d, SHARDED_DIR)


class ShardpointSaveStrategy(AsyncSaveShardedStrategy):
    """Megatron's sharded save strategy for backend ``shardpoint`` (see the module docstring).
    ``options`` (:class:`~shardpoint.SaveOptions`) and ``group`` go to :func:`shardpoint.save`."""

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *,
                 options: "SaveOptions | None" = None, group: Any = None) -> None:
        super().__init__(backend, version)
        self.options, self.group = options, group

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> None:
        tree = megatron_tree(sharded_state_dict).tree
        tree.pop("common", None)        # the sharded part only: common state is Megatron's
        save(tree, os.path.join(str(checkpoint_dir), SHARDED_DIR), group=self.group,
             options=self.options)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]
                   ) -> AsyncRequest:
        tree = megatron_tree(sharded_state_dict).tree
        tree.pop("common", None)
        handle = save(tree, os.path.join(str(checkpoint_dir), SHARDED_DIR), group=self.group,
                      options=self.options, async_save=True)
        return AsyncRequest(None, (), [handle.result])


class ShardpointLoadStrategy(LoadShardedStrategy):
    """Megatron's sharded load strategy for backend ``shardpoint``."""

    def __init__(self, *, group: Any = None) -> None:
        self.group = group

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"the shardpoint strategy cannot load backend "
                                         f"{loaded_backend!r} checkpoints")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if int(loaded_version) != VERSION:
            raise CheckpointingException(f"shardpoint backend version {loaded_version} is not "
                                         f"{VERSION}; upgrade shardpoint")

    def load(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> Any:
        t = megatron_tree(sharded_state_dict, for_load=True)
        loaded = load(sharded_path(checkpoint_dir), like={SHARDED: t.tree[SHARDED]},
                      group=self.group)
        return t.assemble({SHARDED: loaded.get(SHARDED, {}), "common": None})

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        """``{key: ShardedTensor}`` without data: each tensor's global shape and dtype."""
        m = read_metadata(sharded_path(checkpoint_dir))
        out = {}
        for path, node in iter_leaves(m.tree):
            if len(path) == 2 and path[0] == SHARDED and isinstance(node, TensorLeaf):
                e = node.entry
                n = len(e.shape)
                out[path[1]] = MShardedTensor(
                    key=path[1], data=None, dtype=from_name(e.dtype).torch,
                    local_shape=tuple(e.shape), global_shape=tuple(e.shape),
                    global_offset=(0,) * n, axis_fragmentations=(1,) * n)
        return out

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        """Tensors as :meth:`load_tensors_metadata`, and each sharded object's grid."""
        out = self.load_tensors_metadata(checkpoint_dir)
        m = read_metadata(sharded_path(checkpoint_dir))
        for path, node in iter_leaves(m.tree):
            if len(path) == 2 and path[0] == SHARDED and isinstance(node, ObjectLeaf):
                shape = tuple(node.grid)
                out[path[1]] = ShardedObject(path[1], None, shape, (0,) * len(shape))
        return out


class ShardpointCommonSaveStrategy(SaveCommonStrategy):
    """Writes Megatron's common state (rank 0) as the shardpoint checkpoint ``<dir>/common``
    instead of the pickled ``common.pt``. Values must be plain (an ``argparse.Namespace``
    such as ``args`` must become a dict first: shardpoint stores no pickles)."""

    def __init__(self, backend: str = "torch", version: int = 1) -> None:
        super().__init__(backend, version)

    def save_common(self, common_state_dict: Any, checkpoint_dir: Union[str, Path]) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            save(common_state_dict, os.path.join(str(checkpoint_dir), COMMON_DIR),
                 group=_solo())

    def save_sharded_objects(self, sharded_objects_state_dict: Any,
                             checkpoint_dir: Union[str, Path]) -> None:
        TorchCommonSaveStrategy("torch", 1).save_sharded_objects(sharded_objects_state_dict,
                                                                 checkpoint_dir)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class ShardpointCommonLoadStrategy(LoadCommonStrategy):
    """Megatron's common loader, extended: ``<dir>/common`` (shardpoint) when present, else
    Megatron's ``common.pt``; a shardpoint checkpoint without common state gives ``{}``."""

    def __init__(self) -> None:
        self._torch = TorchCommonLoadStrategy()

    def load_common(self, checkpoint_dir: Union[str, Path]) -> Any:
        d = str(checkpoint_dir)
        if os.path.isfile(os.path.join(d, COMMON_DIR, MANIFEST)):
            return load(os.path.join(d, COMMON_DIR), group=_solo())
        if not os.path.exists(os.path.join(d, "common.pt")) and \
                os.path.isfile(os.path.join(sharded_path(d), MANIFEST)):
            return {}
        return self._torch.load_common(Path(d))

    def load_sharded_objects(self, sharded_objects_state_dict: Any,
                             checkpoint_dir: Union[str, Path]) -> Any:
        return self._torch.load_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> Any:
        return self._torch.load_sharded_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        # The common state is read from common/ or by Megatron's own loader, whatever the
        # sharded backend: that loader decides.
        self._torch.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self._torch.check_version_compatibility(loaded_version)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


def register() -> None:
    """Register the ``shardpoint`` sharded strategies and the common loader (done on import;
    idempotent)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
                              ShardpointSaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
                              ShardpointLoadStrategy())
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1,
                              ShardpointCommonLoadStrategy())


def use_shardpoint_common(enabled: bool = True) -> None:
    """Make ``dist_checkpointing.save`` write the common state as the shardpoint checkpoint
    ``<dir>/common`` (``enabled=False``: Megatron's ``common.pt`` again). Megatron's ``save``
    takes no common strategy argument, so this replaces its default ``torch`` common saver."""
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1,
                              ShardpointCommonSaveStrategy() if enabled else
                              TorchCommonSaveStrategy("torch", 1))


register()

__all__ = ["ShardpointCommonLoadStrategy", "ShardpointCommonSaveStrategy",
           "ShardpointLoadStrategy", "ShardpointSaveStrategy", "register", "sharded_path",
           "use_shardpoint_common"]
