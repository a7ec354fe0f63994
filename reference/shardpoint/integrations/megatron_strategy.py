"""shardpoint as a megatron-core ``dist_checkpointing`` backend: strategies registered under
the backend name ``shardpoint``.

    import shardpoint.integrations.megatron_strategy         # registers the backend
    from megatron.core import dist_checkpointing
    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=("shardpoint", 1))
    state = dist_checkpointing.load(sharded_state_dict, ckpt_dir)   # found by metadata.json

Layout of ``ckpt_dir`` (Megatron's directory, which ``dist_checkpointing.save`` wants empty):
``metadata.json`` (Megatron's own JSON: backend ``shardpoint``, version 1), ``shardpoint/`` (a
shardpoint checkpoint, the tree of :mod:`shardpoint.integrations.megatron`: tensors and sharded
objects at ``sharded/<Megatron key>``) and ``common/`` (the common state as a shardpoint
checkpoint of its own, never the pickled ``common.pt``). Both pass ``shardpoint verify
--strict`` and load with ``sp.load``.

The common state: Megatron's ``save`` writes it with its default common strategy before the
sharded one runs and takes no other (``common_strategy`` must be None). Registering replaces
that default with one that writes ``common/`` when the save's sharded strategy is shardpoint's
(seen from ``save``'s own arguments) and Megatron's ``common.pt`` for every other backend, so
``sharded_strategy=("shardpoint", 1)`` alone stores no pickle.
:func:`use_shardpoint_common` forces either for every backend.

Registration: megatron-core 0.16 finds strategies only in its own registry, filled by
imports (it has no entry point for other packages), so every process that saves or loads
this backend through ``dist_checkpointing`` imports this module once (``import
shardpoint.integrations.megatron_strategy``); without it Megatron's load says "Cannot find
a default strategy for: ('load_sharded', 'shardpoint', 1)". Megatron-LM's ``--ckpt-format``
takes a fixed list of names; with this module imported, ``get_default_save_sharded_strategy(
"shardpoint")`` is the strategy such a flag would select. :func:`shardpoint.integrations.
megatron.load_megatron` reads a directory this backend wrote (its ``metadata.json`` names
it) with no registration at all.

Errors the strategies raise are shardpoint's documented classes and Megatron's
``CheckpointingException`` at once (:func:`~shardpoint.integrations.megatron.as_megatron_error`).

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

import itertools
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Optional, Union

import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor as MShardedTensor,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import (
    TorchCommonLoadStrategy,
    TorchCommonSaveStrategy,
)

from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.format.statetree import ObjectLeaf, TensorLeaf, iter_leaves
from shardpoint.api.checkpointer import load, save
from shardpoint.api.saving import SaveOptions
from shardpoint_core.format import errors
from shardpoint_core.format.errors import ShardpointError
from shardpoint.integrations.megatron import (
    SHARDED,
    as_megatron_error,
    decode_value,
    encode_value,
    megatron_tree,
    stored_tensors,
)
from shardpoint.tree.dtypes import from_name

BACKEND, VERSION = "shardpoint", 1
SHARDED_DIR, COMMON_DIR, MANIFEST = "shardpoint", "common", "manifest.msgpack"
_SOLO: dict = {}


def _solo() -> Any:
    """A group of this rank alone: the common state is written by rank 0 only."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    r = dist.get_rank()
    if r not in _SOLO or not _live(_SOLO[r]):
        _SOLO[r] = dist.new_group([r], use_local_synchronization=True)
    return _SOLO[r]


def _live(group: Any) -> bool:
    """Whether a group made earlier survived (not after the default group was remade)."""
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


def sharded_path(checkpoint_dir: Union[str, Path]) -> str:
    """Where the tensors live: ``<dir>/shardpoint``, or ``dir`` itself when it is a shardpoint
    checkpoint (one written by ``sp.save`` or through DCP)."""
    d = str(checkpoint_dir)
    return d if os.path.isfile(os.path.join(d, MANIFEST)) else os.path.join(d, SHARDED_DIR)


class ShardpointSaveStrategy(AsyncSaveShardedStrategy):
    """Megatron's sharded save strategy for backend ``shardpoint`` (see the module docstring).
    ``options`` (:class:`~shardpoint.SaveOptions`) and ``group`` go to :func:`shardpoint.save`.

    ``TorchDistSaveShardedStrategy``'s arguments are taken in its order, for a drop-in:
    ``keep_only_main_replica=True`` is what shardpoint does (one holder per replica set
    writes); ``cached_metadata`` is shardpoint's own plan cache (reused while the structure
    does not change, whatever its value). What shardpoint cannot do as asked is refused with
    :class:`~shardpoint.InvalidOptionError`: ``keep_only_main_replica=False``, a
    ``thread_count`` (shardpoint sizes its own write parallelism) and a ``separation_hint``
    (a ``torch_dist`` file-layout feature)."""

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        keep_only_main_replica: bool = True,
        thread_count: Optional[int] = None,
        cached_metadata: bool = False,
        separation_hint: Optional[str] = None,
        *,
        options: "SaveOptions | None" = None,
        group: Any = None,
    ) -> None:
        for bad, why in (
            (
                not keep_only_main_replica,
                "keep_only_main_replica=False: a "
                "shardpoint checkpoint stores each region once (one replica "
                "writes it)",
            ),
            (
                thread_count is not None,
                f"thread_count={thread_count!r}: "
                "shardpoint sizes its own write parallelism; drop the argument",
            ),
            (
                separation_hint is not None,
                f"separation_hint="
                f"{separation_hint!r}: a torch_dist file-layout feature with no "
                "shardpoint counterpart",
            ),
        ):
            if bad:
                raise as_megatron_error(errors.InvalidOptionError(f"ShardpointSaveStrategy({why})"))
        super().__init__(backend, version)
        self.options, self.group = options, group

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> None:
        try:
            tree = megatron_tree(sharded_state_dict).tree
            tree.pop("common", None)  # the sharded part only: common state is Megatron's
            save(
                tree,
                os.path.join(str(checkpoint_dir), SHARDED_DIR),
                group=self.group,
                options=self.options,
            )
        except ShardpointError as e:
            raise as_megatron_error(e)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        try:
            tree = megatron_tree(sharded_state_dict).tree
            tree.pop("common", None)
            handle = save(
                tree,
                os.path.join(str(checkpoint_dir), SHARDED_DIR),
                group=self.group,
                options=self.options,
                async_save=True,
            )
        except ShardpointError as e:
            raise as_megatron_error(e)
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
            raise CheckpointingException(
                f"the shardpoint strategy cannot load backend {loaded_backend!r} checkpoints"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if int(loaded_version) != VERSION:
            raise CheckpointingException(
                f"shardpoint backend version {loaded_version} is not {VERSION}; upgrade shardpoint"
            )

    def load(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> Any:
        """Fill ``sharded_state_dict`` from ``<dir>/shardpoint``, or from ``dir`` itself when
        it is a shardpoint checkpoint (``sp.save``, the DCP plug-in); in one whose tree has no
        ``sharded`` part, Megatron keys are looked up at the top of the tree."""
        path = sharded_path(checkpoint_dir)
        try:
            root = (SHARDED,) if SHARDED in read_metadata(path).tree else ()
            t = megatron_tree(sharded_state_dict, for_load=True, stored=stored_tensors(path, root))
            like = {SHARDED: t.tree[SHARDED]} if root else t.tree[SHARDED]
            loaded = load(path, like=like, group=self.group)
            t.finish_overlaps()
        except ShardpointError as e:
            raise as_megatron_error(e)
        return t.assemble({SHARDED: loaded.get(SHARDED, {}) if root else loaded, "common": None})

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        """``{key: ShardedTensor}`` without data: each tensor's global shape and dtype."""
        m = read_metadata(sharded_path(checkpoint_dir))
        out = {}
        for path, node in iter_leaves(m.tree):
            if len(path) == 2 and path[0] == SHARDED and isinstance(node, TensorLeaf):
                e = node.entry
                n = len(e.shape)
                out[path[1]] = MShardedTensor(
                    key=path[1],
                    data=None,
                    dtype=from_name(e.dtype).torch,
                    local_shape=tuple(e.shape),
                    global_shape=tuple(e.shape),
                    global_offset=(0,) * n,
                    axis_fragmentations=(1,) * n,
                )
        return out

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        """Tensors as :meth:`load_tensors_metadata`, and each cell of each sharded object's
        grid as its own ``ShardedObject`` under its ``unique_key`` (``key/shard_0.3_1.8``),
        as Megatron's ``torch_dist`` strategy answers."""
        out = self.load_tensors_metadata(checkpoint_dir)
        m = read_metadata(sharded_path(checkpoint_dir))
        for path, node in iter_leaves(m.tree):
            if len(path) == 2 and path[0] == SHARDED and isinstance(node, ObjectLeaf):
                shape = tuple(node.grid)
                for cell in itertools.product(*(range(n) for n in shape)):
                    so = ShardedObject(path[1], None, shape, cell, replica_id=0)
                    out[so.unique_key] = so
        return out


class ShardpointCommonSaveStrategy(SaveCommonStrategy):
    """Writes Megatron's common state (rank 0) as the shardpoint checkpoint ``<dir>/common``
    instead of the pickled ``common.pt``. Values must be plain (an ``argparse.Namespace``
    such as ``args`` must become a dict first: shardpoint stores no pickles); sets and
    ``io.BytesIO`` are stored as tagged values (:func:`~shardpoint.integrations.megatron.
    encode_value`)."""

    def __init__(self, backend: str = "torch", version: int = 1) -> None:
        super().__init__(backend, version)

    def save_common(self, common_state_dict: Any, checkpoint_dir: Union[str, Path]) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                save(
                    encode_value(common_state_dict),
                    os.path.join(str(checkpoint_dir), COMMON_DIR),
                    group=_solo(),
                )
            except ShardpointError as e:
                raise as_megatron_error(e)

    def save_sharded_objects(
        self, sharded_objects_state_dict: Any, checkpoint_dir: Union[str, Path]
    ) -> None:
        TorchCommonSaveStrategy("torch", 1).save_sharded_objects(
            sharded_objects_state_dict, checkpoint_dir
        )

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


def _saving_with_shardpoint() -> bool:
    """Whether the ``dist_checkpointing.save`` that is calling the common saver was given
    shardpoint's sharded strategy (directly or inside Megatron's fully-parallel wrapper): its
    ``sharded_strategy`` argument, read from its frame; False when not called from there."""
    f: Optional[FrameType] = sys._getframe(1)
    for _ in range(6):
        f = f.f_back if f is not None else None
        if f is None:
            return False
        if f.f_code.co_name == "save" and f.f_globals.get("__name__", "").startswith(
            "megatron.core.dist_checkpointing"
        ):
            st = f.f_locals.get("sharded_strategy")
            st = getattr(st, "base_strategy", st)
            return isinstance(st, ShardpointSaveStrategy)
    return False


class DefaultCommonSaveStrategy(SaveCommonStrategy):
    """Megatron's default common saver once this module is registered: ``<dir>/common``
    (shardpoint, no pickle) when the save's sharded strategy is shardpoint's, Megatron's own
    ``common.pt`` for every other backend (see the module docstring)."""

    def __init__(self, backend: str = "torch", version: int = 1) -> None:
        super().__init__(backend, version)
        self._torch = TorchCommonSaveStrategy(backend, version)
        self._shardpoint = ShardpointCommonSaveStrategy(backend, version)

    def save_common(self, common_state_dict: Any, checkpoint_dir: Union[str, Path]) -> None:
        (self._shardpoint if _saving_with_shardpoint() else self._torch).save_common(
            common_state_dict, checkpoint_dir
        )

    def save_sharded_objects(
        self, sharded_objects_state_dict: Any, checkpoint_dir: Union[str, Path]
    ) -> None:
        self._torch.save_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

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
            try:
                return decode_value(load(os.path.join(d, COMMON_DIR), group=_solo()))
            except ShardpointError as e:
                raise as_megatron_error(e)
        if not os.path.exists(os.path.join(d, "common.pt")) and os.path.isfile(
            os.path.join(sharded_path(d), MANIFEST)
        ):
            return {}
        return self._torch.load_common(Path(d))

    def load_sharded_objects(
        self, sharded_objects_state_dict: Any, checkpoint_dir: Union[str, Path]
    ) -> Any:
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
    """Register the ``shardpoint`` sharded strategies, the common loader and the default
    common saver (done on import; idempotent)."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, VERSION, ShardpointSaveStrategy()
    )
    register_default_strategy(
        StrategyAction.LOAD_SHARDED, BACKEND, VERSION, ShardpointLoadStrategy()
    )
    register_default_strategy(
        StrategyAction.LOAD_COMMON, "torch", 1, ShardpointCommonLoadStrategy()
    )
    use_shardpoint_common(None)


def use_shardpoint_common(enabled: Optional[bool] = True) -> None:
    """Where ``dist_checkpointing.save`` writes the common state, for every backend: ``True``
    the shardpoint checkpoint ``<dir>/common``, ``False`` Megatron's ``common.pt``, ``None``
    the default (``common/`` for the shardpoint backend's saves, ``common.pt`` for the
    others'). Megatron's ``save`` takes no common strategy argument, so this replaces its
    default ``torch`` common saver."""
    register_default_strategy(
        StrategyAction.SAVE_COMMON,
        "torch",
        1,
        DefaultCommonSaveStrategy()
        if enabled is None
        else ShardpointCommonSaveStrategy()
        if enabled
        else TorchCommonSaveStrategy("torch", 1),
    )


register()

__all__ = [
    "DefaultCommonSaveStrategy",
    "ShardpointCommonLoadStrategy",
    "ShardpointCommonSaveStrategy",
    "ShardpointLoadStrategy",
    "ShardpointSaveStrategy",
    "register",
    "sharded_path",
    "use_shardpoint_common",
]
