"""Orbax's standard checkpointing on the shardpoint format, switched by one argument.

``StandardCheckpointer`` and ``StandardCheckpointHandler`` here take the calls and arguments of
Orbax's classes of the same names (``save(path, state, save_args=..., custom_metadata=...)``,
``restore(path, target, strict=...)``, ``args=ocp.args.StandardSave(...)`` /
``ocp.args.StandardRestore(...)``) and write a shardpoint checkpoint instead of OCDBT::

    import orbax.checkpoint as ocp
    from shardpoint_jax import orbax as spo
    ckptr = spo.StandardCheckpointer()          # was: ocp.StandardCheckpointer()
    ckptr.save(path, state); ckptr.wait_until_finished()
    state = ckptr.restore(path, abstract_state)
    # a CheckpointManager: the args class picks the handler (Orbax routes by args class)
    mngr.save(step, args=spo.StandardSave(state))      # was: ocp.args.StandardSave(state)
    mngr.restore(step, args=spo.StandardRestore(abstract_state))
    # an ocp.Checkpointer: ocp.Checkpointer(spo.StandardCheckpointHandler()) takes Orbax's
    # own ocp.args.StandardSave / StandardRestore as well

Orbax's semantics (``SaveArgs`` casts, ``custom_metadata``, restores without a target on the
saved sharding, ``strict=False`` truncation and padding, masked and ``None`` leaves, typed PRNG
keys, 64-bit dtypes without ``jax_enable_x64``) are :mod:`.orbax_semantics`', shared with
:class:`~shardpoint_jax.orbax_handler.ShardpointHandler`; this handler adds the refusals of
Orbax's standard handler (a ``None`` or empty tree, a bare array, leaf types other than arrays
and numbers: ``ValueError`` as there) and answers ``metadata`` with Orbax's ``TreeMetadata``.
docs/plugins-fidelity-orbax.md lists each behaviour and the remaining differences.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import orbax.checkpoint as ocp
from etils import epath

from shardpoint_core.transactions.resolve import read_metadata
from shardpoint_core.format.statetree import TensorLeaf, materialize
from shardpoint_jax.orbax_handler import ShardpointHandler, checkpoint_path
from shardpoint_jax.orbax_semantics import (
    EXTENSION,
    UnsupportedTypeError,
    _np_dtype,
    prepare_save,
    read_extension,
)


class StandardCheckpointHandler(ShardpointHandler):
    """Orbax's ``StandardCheckpointHandler`` on the shardpoint format: takes
    ``ocp.args.StandardSave`` / ``StandardRestore`` (and the ``ShardpointSave`` /
    ``ShardpointRestore`` of its parent), refuses what Orbax's refuses, and answers
    ``metadata`` with Orbax's ``TreeMetadata``. See the module docstring."""

    standard = True

    def __init__(self, **_orbax_options: Any) -> None:
        super().__init__()  # Orbax's tuning options (concurrent GB, OCDBT) do not apply

    def metadata(self, directory: epath.Path) -> Any:
        """Orbax's ``TreeMetadata``: array metadata (shape, dtype) per leaf and the
        ``custom_metadata`` given at save."""
        from orbax.checkpoint._src.metadata import tree as tree_metadata
        from orbax.checkpoint._src.metadata import value as value_metadata

        path = checkpoint_path(directory)
        m = read_metadata(path)

        def leaf(node: TensorLeaf) -> Any:
            t = node.entry
            return value_metadata.ArrayMetadata(
                name=t.key,
                directory=epath.Path(path),
                shape=tuple(t.shape),
                sharding=None,
                dtype=_np_dtype(t.dtype),
            )

        return tree_metadata.build_default_tree_metadata(
            materialize(m.tree, leaf), custom_metadata=read_extension(m).get("custom_metadata")
        )


@ocp.args.register_with_handler(StandardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class StandardSave(ocp.args.StandardSave):
    """``ocp.args.StandardSave`` for :class:`StandardCheckpointHandler` (Orbax routes args to
    handlers by class; Orbax's own class stays routed to Orbax's handler)."""


@ocp.args.register_with_handler(StandardCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class StandardRestore(ocp.args.StandardRestore):
    """``ocp.args.StandardRestore`` for :class:`StandardCheckpointHandler`."""


class StandardCheckpointer(ocp.AsyncCheckpointer):
    """Orbax's ``StandardCheckpointer`` writing shardpoint: the one changed argument is the
    class (``spo.StandardCheckpointer()`` for ``ocp.StandardCheckpointer()``); ``save`` and
    ``restore`` take the same arguments (asynchronous like Orbax's: call
    ``wait_until_finished()`` before reading)."""

    def __init__(self, **kwargs: Any) -> None:
        handler_opts = {
            k: kwargs.pop(k)
            for k in list(kwargs)
            if k
            not in (
                "async_options",
                "multiprocessing_options",
                "file_options",
                "atomicity_options",
                "checkpoint_metadata_store",
                "temporary_path_class",
            )
        }
        super().__init__(StandardCheckpointHandler(**handler_opts), **kwargs)

    def save(
        self,
        directory: Any,
        state: Any,
        *,
        save_args: Any = None,
        force: bool = False,
        custom_metadata: Optional[dict] = None,
    ) -> None:
        super().save(
            directory,
            args=StandardSave(state, save_args, custom_metadata=custom_metadata),
            force=force,
        )

    def restore(self, directory: Any, target: Any = None, *, strict: bool = True) -> Any:
        return super().restore(directory, args=StandardRestore(target, strict=strict))


class PyTreeCheckpointHandler(ShardpointHandler):
    """Orbax's ``PyTreeCheckpointHandler`` on the shardpoint format: takes
    ``ocp.args.PyTreeSave`` (``save_args``, ``custom_metadata``) and ``ocp.args.PyTreeRestore``
    (``item``, per-leaf ``restore_args``: sharding, global shape, dtype, ``restore_type``)
    with Orbax's rules, and every leaf type the format stores (strings and scalars too, as
    Orbax's type handlers do). Tree ``transforms`` are refused."""

    def __init__(self, **_orbax_options: Any) -> None:
        super().__init__()  # Orbax's tuning options (OCDBT, compression) do not apply


@ocp.args.register_with_handler(PyTreeCheckpointHandler, for_save=True)
@dataclasses.dataclass
class PyTreeSave(ocp.args.PyTreeSave):
    """``ocp.args.PyTreeSave`` for :class:`PyTreeCheckpointHandler`."""


@ocp.args.register_with_handler(PyTreeCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class PyTreeRestore(ocp.args.PyTreeRestore):
    """``ocp.args.PyTreeRestore`` for :class:`PyTreeCheckpointHandler`."""


class PyTreeCheckpointer(ocp.Checkpointer):
    """Orbax's ``PyTreeCheckpointer`` writing shardpoint (``spo.PyTreeCheckpointer()`` for
    ``ocp.PyTreeCheckpointer()``): ``save(path, item, save_args=...)`` and
    ``restore(path, item=..., restore_args=...)`` or ``args=ocp.args.PyTreeRestore(...)``."""

    def __init__(self, primary_host: Optional[int] = 0, **_orbax_options: Any) -> None:
        super().__init__(
            PyTreeCheckpointHandler(),
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=primary_host),
        )


__all__ = [
    "EXTENSION",
    "PyTreeCheckpointHandler",
    "PyTreeCheckpointer",
    "PyTreeRestore",
    "PyTreeSave",
    "StandardCheckpointHandler",
    "StandardCheckpointer",
    "StandardRestore",
    "StandardSave",
    "UnsupportedTypeError",
    "prepare_save",
]
