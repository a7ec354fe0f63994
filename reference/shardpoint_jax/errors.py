"""The errors shardpoint_jax raises: the core's classes (:mod:`shardpoint_core.format.errors`), under
the names JAX users import, so ``except shardpoint_jax.CorruptCheckpointError`` catches what
the core's manifest codec, Zarr layer and stores raise. ``spec_id`` carries the requirement
broken and ``category`` the spec's failure category (spec/format.md [SP-ERR-1])."""

from __future__ import annotations

from shardpoint_core.format.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidKeyError,
    InvalidOptionError,
    InvalidShardingError,
    LayoutMismatchError,
    LoadFailedError,
    RankLostError,
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

# The caller-error class of shardpoint_jax's first releases (a region outside an array, a bad
# argument): the core's InvalidOptionError under its old name, so code catching it still does.
InvalidRequestError = InvalidOptionError

__all__ = [
    "ShardpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConversionError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InvalidKeyError",
    "InvalidOptionError",
    "InvalidRequestError",
    "InvalidShardingError",
    "LayoutMismatchError",
    "LoadFailedError",
    "RankLostError",
    "ResourceLimitError",
    "SaveFailedError",
    "StoreAccessDeniedError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "UnsupportedFormatError",
    "UnsupportedStoreError",
    "UnsupportedValueError",
]
