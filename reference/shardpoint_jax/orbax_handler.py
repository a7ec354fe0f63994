"""shardpoint as an Orbax checkpoint handler: ``ocp.Checkpointer``, ``ocp.AsyncCheckpointer``
and ``ocp.CheckpointManager`` write and read shardpoint with one changed argument.

    import orbax.checkpoint as ocp
    from shardpoint_jax.orbax_handler import ShardpointHandler, ShardpointRestore, ShardpointSave
    ckptr = ocp.Checkpointer(ShardpointHandler())           # or ocp.AsyncCheckpointer(...)
    ckptr.save(path, args=ShardpointSave(state))
    state = ckptr.restore(path, args=ShardpointRestore(abstract_state))   # any other mesh

With a ``CheckpointManager``, the args classes are registered with the handler, so
``mngr.save(step, args=ShardpointSave(state))`` and ``mngr.restore(step,
args=ShardpointRestore(target))`` pick it (under ``ocp.args.Composite`` too).

Orbax keeps what it is good at: its temporary directory, the rename that publishes a step,
steps and retention. The handler writes a shardpoint checkpoint, with :func:`shardpoint_jax.save`,
in the subdirectory ``shardpoint`` of the directory Orbax hands it (Orbax creates that one, and
shardpoint commits its own manifest last inside it), and restores with
:func:`shardpoint_jax.load`: a target of ``jax.ShapeDtypeStruct`` leaves with shardings (or
arrays) restores into that sharding, whatever mesh saved it; no target restores the whole tree
(arrays on the sharding they were saved with). ``ShardpointSave``/``ShardpointRestore`` take
Orbax's ``save_args``, ``custom_metadata``, ``strict`` and ``fallback_sharding``
(:mod:`.orbax_semantics`).
Restore also reads a directory that is itself a shardpoint checkpoint (one written by
``sp.save``, the DCP plugin or Megatron's ``shardpoint`` backend). Asynchronous saves copy numpy
leaves, hold ``jax.Array`` leaves (immutable; do not donate them before the save is done) and
write in Orbax's commit future, once Orbax has created the directory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future

from shardpoint_core.format.errors import InvalidOptionError
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_jax.orbax_semantics import EXTENSION, prepare_save, restore
from shardpoint_jax.saving import save

SUBDIR, MANIFEST = "shardpoint", "manifest.msgpack"


def checkpoint_path(directory: Any) -> str:
    """The shardpoint checkpoint under an Orbax item ``directory`` (``<dir>/shardpoint``), or
    ``directory`` itself when it is one."""
    d = os.fspath(directory)
    return d if os.path.isfile(os.path.join(d, MANIFEST)) else os.path.join(d, SUBDIR)


def _snapshot(tree: Any) -> Any:
    """What an asynchronous save writes later: numpy leaves copied (the caller may change
    them once ``async_save`` returns); ``jax.Array`` leaves are immutable and held as they are
    (so they must not be donated before the save's future is done)."""
    return jax.tree_util.tree_map(
        lambda x: np.array(x, copy=True) if isinstance(x, np.ndarray) else x, tree
    )


class ShardpointHandler(ocp.AsyncCheckpointHandler):
    """An Orbax ``AsyncCheckpointHandler`` writing and reading the shardpoint format, with
    Orbax's save and restore semantics (:mod:`.orbax_semantics`: ``save_args`` casts,
    ``custom_metadata``, the saved sharding kept without a target, ``strict=False`` shape
    relaxing, masked and ``None`` leaves, typed PRNG keys). Collective as Orbax's handlers
    are: every process calls ``save``/``restore``."""

    standard = False  # True: also Orbax's standard handler's refusals (.orbax)

    def _prepared(self, args: Any) -> tuple:
        item, ext = prepare_save(args.item, getattr(args, "save_args", None), self.standard)
        ext.update(custom_metadata=getattr(args, "custom_metadata", None), must_understand=False)
        return item, {EXTENSION: ext}

    def save(self, directory: epath.Path, args: Any = None) -> None:
        item, ext = self._prepared(args)
        save(os.path.join(os.fspath(directory), SUBDIR), item, extensions=ext)

    async def async_save(self, directory: epath.Path, args: Any = None) -> Optional[List[Any]]:
        # Orbax may create the directory after this returns (it signals when it has): the
        # write runs in Orbax's commit future, which waits for that signal.
        item, ext = self._prepared(args)
        item = _snapshot(item)

        async def write() -> None:
            save(os.path.join(os.fspath(directory), SUBDIR), item, extensions=ext)

        return [future.CommitFutureAwaitingContractedSignals(write(), name="shardpoint_save")]

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> Any:
        target = args.item if args is not None else item
        for name in ("transforms", "legacy_transform_fn"):  # PyTreeRestore's: not taken
            if getattr(args, name, None):
                raise InvalidOptionError(
                    f"{name} (Orbax's PyTreeRestore tree transformations) is not supported by "
                    "the shardpoint handler: restore into the stored structure and transform "
                    "the result"
                )
        return restore(
            checkpoint_path(directory),
            target,
            strict=getattr(args, "strict", True),
            fallback=getattr(args, "fallback_sharding", None),
            standard=self.standard,
            restore_args=getattr(args, "restore_args", None),
        )

    def metadata(self, directory: epath.Path) -> Manifest:
        """The checkpoint's manifest: tree, keys, shapes, dtypes, chunk grids."""
        return read_metadata(checkpoint_path(directory))

    def finalize(self, directory: epath.Path) -> None:
        """Nothing: the shardpoint checkpoint is committed before the save's future is done."""

    def close(self) -> None:
        """Nothing to release: the handler keeps no pool or handle between calls."""


@ocp.args.register_with_handler(ShardpointHandler, for_save=True)
@dataclasses.dataclass
class ShardpointSave(ocp.args.CheckpointArgs):
    """Save args: ``item`` is the pytree (sharded ``jax.Array`` leaves, numpy arrays, values);
    ``save_args`` a pytree of ``ocp.SaveArgs`` (``dtype``: the leaf is cast before it is
    written) or None leaves, as Orbax's; ``custom_metadata`` any msgpack-able dict, kept in
    the manifest (``metadata(dir).extensions["orbax"]["custom_metadata"]``)."""

    item: Any
    save_args: Any = None
    custom_metadata: Optional[dict] = None


@ocp.args.register_with_handler(ShardpointHandler, for_restore=True)
@dataclasses.dataclass
class ShardpointRestore(ocp.args.CheckpointArgs):
    """Restore args: ``item`` is the target pytree (``jax.ShapeDtypeStruct`` with
    ``sharding=``, arrays, placeholders for values) or None for the whole tree (arrays on
    their saved sharding; ``fallback_sharding`` where those devices are gone); ``strict=False``
    keeps the target's leaf for keys the checkpoint lacks and truncates or zero-pads arrays
    to the target's shape, as Orbax's."""

    item: Any = None
    strict: bool = True
    fallback_sharding: Any = None


__all__ = ["ShardpointHandler", "ShardpointRestore", "ShardpointSave", "checkpoint_path"]
