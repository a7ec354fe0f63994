"""shardpoint: sharded training checkpoints in a framework-neutral, specified format.

Quick use::

    import shardpoint as sp
    sp.save({"model": model.state_dict(), "step": 10}, "/ckpt/step_10")
    state = sp.load("/ckpt/step_10")                  # whole tree on CPU
    sp.load("/ckpt/step_10", like={"model": model.state_dict()})   # in place, any sharding
    with sp.open("/ckpt/step_10") as ckpt:            # lazy, read-only: one slice of one tensor
        block = ckpt["model/w"][10:20, :4].to_torch()

The package's layers, bottom to top: ``tree`` (leaves, dtypes, targets), ``planning`` (pure),
``exchange`` (torch.distributed), ``api`` (save, load, open, managers), ``integrations`` and
``tools`` (CLI, convert, diff, demo); all on :mod:`shardpoint_core`. Names below are imported
on first use, so ``import shardpoint`` alone (the CLI's ``inspect`` and ``verify``) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardpoint_core import __version__ as __version__  # re-exported
from shardpoint_core.format.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReferencedError,
    ConversionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidKeyError,
    InvalidOptionError,
    InvalidShardingError,
    LayoutMismatchError,
    LoadFailedError,
    MemoryBudgetError,
    RankLostError,
    ResourceLimitError,
    SaveFailedError,
    ShardpointError,
    UnsupportedFormatError,
    UnsupportedStoreError,
    UnsupportedValueError,
)
from shardpoint_core.format.hints import register_path_hint
from shardpoint_core.format.manifest import FORMAT_VERSION, Manifest
from shardpoint_core.commit.recovery import RecoveryAction, recover
from shardpoint_core.stores.registry import register_store

_LAZY = {
    "shardpoint.api": [
        "AsyncSave",
        "Checkpointer",
        "LoadOptions",
        "LoadReport",
        "LoadResult",
        "SaveOptions",
        "SaveResult",
        "load",
        "read_metadata",
        "save",
    ],
    "shardpoint.api.lazy": ["Checkpoint", "TensorView", "open"],
    "shardpoint.api.manager": ["CheckpointManager"],
    "shardpoint.api.memory_tier": ["MemoryTier", "Restored"],
    "shardpoint.tree.model": ["ShardedObject", "ShardedPieces", "ShardedTensor"],
    "shardpoint.planning.planner": ["PlanOptions"],
    "shardpoint_core.transactions.packed": ["PackedBackend"],
    "shardpoint_core.transactions.backend": ["ZarrBackend"],
    "shardpoint_core.transactions.packed_zarr": ["zarr_store"],
    "shardpoint_core.format.statetree": [
        "TensorLeaf",
        "ObjectLeaf",
        "ValueLeaf",
        "iter_leaves",
        "node_at",
    ],
}
_WHERE = {name: mod for mod, names in _LAZY.items() for name in names}
# Modules the README names by their short paths (sp.state, sp.convert, sp.verify, sp.errors).
_MODULES = {
    "state": "shardpoint.api.state",
    "convert": "shardpoint.convert",
    "verify": "shardpoint_core.verify",
    "errors": "shardpoint_core.format.errors",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_WHERE) | set(_MODULES))


def _foreign_format_hint(path: str) -> str:
    # On error paths only: telling other formats apart needs the converters' modules.
    from shardpoint.tools.convert import foreign_format_hint

    return foreign_format_hint(path)


register_path_hint(_foreign_format_hint)

__all__ = [
    "save",
    "load",
    "read_metadata",
    "open",
    "Checkpoint",
    "TensorView",
    "CheckpointManager",
    "Checkpointer",
    "LoadResult",
    "ShardedTensor",
    "ShardedPieces",
    "ShardedObject",
    "SaveOptions",
    "SaveResult",
    "AsyncSave",
    "LoadReport",
    "LoadOptions",
    "PlanOptions",
    "PackedBackend",
    "ZarrBackend",
    "zarr_store",
    "Manifest",
    "FORMAT_VERSION",
    "ShardpointError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "CheckpointReferencedError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "UnsupportedFormatError",
    "InvalidKeyError",
    "UnsupportedValueError",
    "InvalidShardingError",
    "LayoutMismatchError",
    "SaveFailedError",
    "LoadFailedError",
    "RankLostError",
    "ResourceLimitError",
    "ConversionError",
    "InvalidOptionError",
    "UnsupportedStoreError",
    "register_store",
    "MemoryTier",
    "Restored",
    "MemoryBudgetError",
    "recover",
    "RecoveryAction",
    "TensorLeaf",
    "ObjectLeaf",
    "ValueLeaf",
    "iter_leaves",
    "node_at",
]
