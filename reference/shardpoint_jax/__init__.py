"""shardpoint_jax: the JAX front end of shardpoint, on the framework-neutral core
(``shardpoint_core``: errors, keys, dtypes, values, the manifest codec, coverage rules).

``save(path, pytree, *, overwrite=False, async_save=False, backend=None, incremental=None)``
and ``load(path, target=None)``; saves are in the packed layout by default, as the core's
(format 1.4), ``backend=ZarrBackend()`` (shardpoint_core.transactions.backend) saves in the
per-array layout, ``incremental=`` builds on an earlier packed checkpoint;
every process of a multi-process job calls both; a path is local (plain or ``file://``) or the
URL of a registered store (``s3://bucket/run/step_5``, ``memory://name/...``).
``read_metadata(path).tree`` is the saved tree with typed leaves (``TensorLeaf``,
``ObjectLeaf``, ``ValueLeaf``; walk it with ``iter_leaves``). ``CheckpointManager(root, ...)``
keeps numbered steps with retention and resume, in the PyTorch front end's layout;
with ``memory=MemoryTier(job)`` every step to host memory replicated to peer hosts, every
N steps a durable copy written from memory in the background.
Imports neither torch nor the PyTorch front end (``shardpoint``)."""

from shardpoint_jax.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidKeyError,
    InvalidOptionError,
    InvalidRequestError,
    InvalidShardingError,
    LayoutMismatchError,
    ResourceLimitError,
    SaveFailedError,
    ShardpointError,
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreUnavailableError,
    UnsupportedFormatError,
    UnsupportedStoreError,
    UnsupportedValueError,
)
from shardpoint_jax.async_save import AsyncSave
from shardpoint_jax.loading import load
from shardpoint_jax.manager import CheckpointManager
from shardpoint_jax.memory_tier import MemoryTier
from shardpoint_jax.saving import save
from shardpoint_jax.tree import ShardedObject
from shardpoint_jax.storage import read_manifest as read_metadata
from shardpoint_core.format.statetree import ObjectLeaf, TensorLeaf, ValueLeaf, iter_leaves, node_at

__version__ = "0.1.0"
__all__ = [
    "save",
    "load",
    "AsyncSave",
    "CheckpointManager",
    "MemoryTier",
    "ShardedObject",
    "ShardpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InvalidKeyError",
    "InvalidOptionError",
    "InvalidRequestError",
    "InvalidShardingError",
    "LayoutMismatchError",
    "ResourceLimitError",
    "SaveFailedError",
    "StoreAccessDeniedError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "UnsupportedFormatError",
    "UnsupportedStoreError",
    "UnsupportedValueError",
    "read_metadata",
    "TensorLeaf",
    "ObjectLeaf",
    "ValueLeaf",
    "iter_leaves",
    "node_at",
]
